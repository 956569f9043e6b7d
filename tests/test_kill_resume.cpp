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

TEST_CASE("a corrupt newest checkpoint is detected by its checksum and skipped by --resume auto", "[resume][process]") {
  const std::string dir = files::make_temp_directory("train_corrupt_");
  const std::string config_path = files::join(dir, "run.yaml");
  std::ofstream(config_path) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                                "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 1024,"
                                " synthetic_val_samples: 32, workers: 1}\n"
                                "optim: {name: sgd, lr: 0.05, momentum: 0.9}\n"
                                "trainer: {global_batch: 16, max_steps: 400, device: cpu, threads: 1}\n"
                                "checkpoint: {every_steps: 10, keep_last: 3}\n"
                                "logging: {every_steps: 10}\n";
  const Config config = load_config(config_path);
  const std::string whole = files::join(dir, "whole"), cut = files::join(dir, "cut");
  REQUIRE(wait_exit(spawn({"fit", config_path, "--run-dir", whole})) == 0);

  const pid_t pid = spawn({"fit", config_path, "--run-dir", cut});
  const std::string ckpts = files::join(cut, "checkpoints");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!files::exists(checkpoint_path(ckpts, 30) + ".crc32c") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::kill(pid, SIGKILL);
  wait_exit(pid);
  // Flip one byte in the middle of the newest checkpoint: the zip structure still opens, the
  // tensor data is wrong. Only the checksum can tell.
  const std::string newest = latest_checkpoint(ckpts);
  REQUIRE_FALSE(newest.empty());
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const auto size = static_cast<std::streamoff>(f.tellg());
    f.seekp(size / 2);
    char c = 0;
    f.seekg(size / 2);
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(size / 2);
    f.write(&c, 1);
  }
  RunParts probe = prepare_run(config);
  CHECK_THROWS_WITH(load_checkpoint(newest, *probe.model, nullptr), Catch::Contains("checksum mismatch"));
  CHECK(latest_checkpoint(ckpts) != newest);  // the previous one is the newest valid
  CHECK(wait_exit(spawn({"fit", config_path, "--run-dir", cut, "--resume", newest})) == 2);

  REQUIRE(wait_exit(spawn({"fit", config_path, "--run-dir", cut, "--resume", "auto"})) == 0);
  const auto a = weights(checkpoint_path(files::join(whole, "checkpoints"), 400), config);
  const auto b = weights(checkpoint_path(ckpts, 400), config);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(torch::equal(a[i], b[i]));
  files::remove_all(dir);
}
