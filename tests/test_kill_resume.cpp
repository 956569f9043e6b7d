// A run killed with SIGKILL mid-training and resumed with --resume auto ends with exactly the
// weights of an uninterrupted run: the `train` binary in real processes, no in-process shortcuts.
#include "testing.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <train/checkpoint.h>
#include <train/config.h>
#include <train/files.h>
#include <train/run.h>

#include <chrono>
#include <fstream>
#include <thread>

extern char** environ;

using namespace train;

namespace {

const std::string kTrain = std::string(TRAIN_BINARY_DIR) + "/bin/train";

pid_t spawn(std::vector<std::string> args) {
  args.insert(args.begin(), kTrain);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, kTrain.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  REQUIRE(rc == 0);
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::vector<torch::Tensor> weights(const std::string& checkpoint, const Config& config) {
  RunParts run = prepare_run(config);
  load_checkpoint(checkpoint, *run.model, nullptr);
  std::vector<torch::Tensor> out;
  for (const auto& p : run.model->parameters()) out.push_back(p.detach().clone());
  for (const auto& b : run.model->buffers()) out.push_back(b.detach().clone());
  return out;
}

}  // namespace

TEST_CASE("kill -9 mid-run, then --resume auto, equals the uninterrupted run", "[resume][process]") {
  const std::string dir = files::make_temp_directory("train_kill_");
  const std::string config_path = files::join(dir, "run.yaml");
  std::ofstream(config_path) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.25, small_input: true}\n"
                                "data: {kind: synthetic, channels: 1, image_size: 24, synthetic_train_samples: 2048,"
                                " synthetic_val_samples: 64, workers: 2, random_flip: true}\n"
                                "optim: {name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0005}\n"
                                "schedule: {name: cosine, warmup_steps: 5}\n"
                                "trainer: {global_batch: 32, max_steps: 120, device: cpu, threads: 1,"
                                " eval_every_steps: 50}\n"
                                "tuning: {micro_batch: 16}\n"  // accumulation across the kill too
                                "checkpoint: {every_steps: 10, keep_last: 3}\n"
                                "logging: {every_steps: 10}\n";
  const Config config = load_config(config_path);
  const std::string whole = files::join(dir, "whole"), killed = files::join(dir, "killed");

  REQUIRE(wait_exit(spawn({"fit", config_path, "--run-dir", whole})) == 0);

  // Kill as soon as a mid-run checkpoint exists (the process is then mid-step, past it).
  const pid_t pid = spawn({"fit", config_path, "--run-dir", killed});
  const std::string mid = checkpoint_path(files::join(killed, "checkpoints"), 30);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!files::exists(mid) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  REQUIRE(files::exists(mid));
  ::kill(pid, SIGKILL);
  CHECK(wait_exit(pid) == 128 + SIGKILL);
  const std::string final_name = checkpoint_path(files::join(killed, "checkpoints"), 120);
  REQUIRE_FALSE(files::exists(final_name));  // it really died before the end

  REQUIRE(wait_exit(spawn({"fit", config_path, "--run-dir", killed, "--resume", "auto"})) == 0);
  REQUIRE(files::exists(final_name));
  const auto a = weights(checkpoint_path(files::join(whole, "checkpoints"), 120), config);
  const auto b = weights(final_name, config);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(torch::allclose(a[i], b[i], 1e-6, 1e-7));
  files::remove_all(dir);
}
