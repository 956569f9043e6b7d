// A run killed with SIGKILL mid-training and resumed with --resume auto ends with exactly the
// weights of an uninterrupted run: the `train` binary in real processes, no in-process shortcuts.
// Stop signals (SIGTERM, SIGINT, SIGUSR1; a duplicate; a second one later; a stop that overruns
// trainer.stop_grace_s) and the temporary files of killed checkpoint writes. The stop tests that
// need a step of a known length run this binary as `train` (TRAIN_TEST_WORKER=cli, see main.cpp)
// with a model whose forward sleeps.
#include "testing.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <train/checkpoint.h>
#include <train/cli.h>
#include <train/config.h>
#include <train/files.h>
#include <train/models/model.h>
#include <train/run.h>

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
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

// Runs `program args...` with `env` added to this process's environment, stdout and stderr to `log`.
pid_t spawn_logged(const std::string& program, std::vector<std::string> args, const std::string& log,
                   const std::map<std::string, std::string>& env = {}) {
  args.insert(args.begin(), program);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (!env.count(kv.substr(0, kv.find('=')))) env_strings.push_back(kv);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  REQUIRE(rc == 0);
  return pid;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Waits (polling every 2 ms) until `path` contains `text`; false after `seconds`.
bool wait_for_text(const std::string& path, const std::string& text, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (slurp(path).find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// Waits until `sig`, sent to the process `pid`, is no longer pending there (a thread took it, and its
// handler ran or runs with the signal blocked), so that the next one is a separate delivery rather
// than merged with it.
void wait_delivered(pid_t pid, int sig) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    std::istringstream status(slurp("/proc/" + std::to_string(pid) + "/status"));
    unsigned long long pending = 0;
    bool exited = false;
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("ShdPnd:", 0) == 0) pending = std::stoull(line.substr(7), nullptr, 16);
      if (line.rfind("State:", 0) == 0) exited = line.find('Z') != std::string::npos;
    }
    if (exited || (pending & (1ULL << (sig - 1))) == 0) return;
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::yield();
  }
  FAIL("signal " << sig << " still pending in process " << pid << " after 5 s");
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  REQUIRE(n > 0);
  return std::string(buf, static_cast<size_t>(n));
}

// A linear model whose training forward sleeps TRAIN_TEST_FORWARD_SLEEP_MS: with micro-batch 1 and
// accumulation A, a step takes A times that, whatever the machine.
class SleepyLinear : public models::Model {
 public:
  SleepyLinear(int64_t in, int64_t classes) : fc_(register_module("fc", torch::nn::Linear(in, classes))) {
    if (const char* ms = std::getenv("TRAIN_TEST_FORWARD_SLEEP_MS")) sleep_ms_ = std::atoi(ms);
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    if (is_training()) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    return fc_(x.flatten(1));
  }

 private:
  torch::nn::Linear fc_;
  int sleep_ms_ = 0;
};

// 8 forwards of 250 ms in each step: 2 s per step.
const char* kSleepyConfig = "model: {name: test_sleepy, in_channels: 1, num_classes: 10}\n"
                            "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 256,"
                            " synthetic_val_samples: 8, workers: 1}\n"
                            "trainer: {global_batch: 8, max_steps: 20, device: cpu, threads: 1,"
                            " eval_every_steps: 1000}\n"
                            "tuning: {micro_batch: 1}\n"
                            "logging: {every_steps: 1}\n";
const std::map<std::string, std::string> kSleepyEnv{{"TRAIN_TEST_WORKER", "cli"},
                                                     {"TRAIN_TEST_FORWARD_SLEEP_MS", "250"}};

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

// TRAIN_TEST_WORKER=cli: this binary is `train`, with the test model above registered.
int cli_test_worker(int argc, char** argv) {
  models::register_model("test_sleepy", [](const ModelConfig& c) {
    return std::make_shared<SleepyLinear>(c.in_channels * 8 * 8, c.num_classes);
  }, "test: a linear model whose forward sleeps");
  return run_cli(argc, argv);
}

TEST_CASE("kill -9 mid-run, then --resume auto, equals the uninterrupted run", "[resume][process]") {
  const std::string dir = files::make_temp_directory("train_kill_");
  const std::string config_path = files::join(dir, "run.yaml");
  std::ofstream(config_path) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.25, small_input: true}\n"
                                "data: {kind: synthetic, channels: 1, image_size: 24, synthetic_train_samples: 2048,"
                                " synthetic_val_samples: 64, workers: 2, random_flip: true}\n"
                                "optim: {name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0005}\n"
                                "schedule: {name: cosine, warmup_steps: 5}\n"
                                "trainer: {global_batch: 32, max_steps: 60, device: cpu, threads: 1,"
                                " eval_every_steps: 50}\n"
                                "tuning: {micro_batch: 16}\n"  // accumulation across the kill too
                                "checkpoint: {every_steps: 10, keep_last: 3}\n"
                                "logging: {every_steps: 10}\n";
  const Config config = load_config(config_path);
  const std::string killed = files::join(dir, "killed");
  // The uninterrupted run, once for both cases below (its checkpoint.async does not change it).
  static const std::vector<torch::Tensor> uninterrupted = [&] {
    const std::string whole = files::join(dir, "whole");
    REQUIRE(wait_exit(spawn({"fit", config_path, "--run-dir", whole})) == 0);
    return weights(checkpoint_path(files::join(whole, "checkpoints"), 60), config);
  }();
  // The killed run writes its checkpoints in the loop, or on a background thread (which the kill
  // may catch mid-write: its temporary file is removed, and the resume starts from the newest
  // whole checkpoint).
  const std::string async = "checkpoint.async=" + GENERATE(as<std::string>{}, "off", "on");
  INFO(async);

  // Kill as soon as a mid-run checkpoint exists (the process is then mid-step, past it).
  const pid_t pid = spawn({"fit", config_path, "--run-dir", killed, "--set", async});
  const std::string mid = checkpoint_path(files::join(killed, "checkpoints"), 30);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!files::exists(mid) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  REQUIRE(files::exists(mid));
  ::kill(pid, SIGKILL);
  CHECK(wait_exit(pid) == 128 + SIGKILL);
  const std::string final_name = checkpoint_path(files::join(killed, "checkpoints"), 60);
  REQUIRE_FALSE(files::exists(final_name));  // it really died before the end

  REQUIRE(wait_exit(spawn({"fit", config_path, "--run-dir", killed, "--resume", "auto", "--set", async})) == 0);
  REQUIRE(files::exists(final_name));
  const auto b = weights(final_name, config);
  REQUIRE(uninterrupted.size() == b.size());
  for (size_t i = 0; i < b.size(); ++i) CHECK(torch::equal(uninterrupted[i], b[i]));  // exactly: the README promises it
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

namespace {

// A run that stops at a signal: "stop requested: stopped after step N" in its log, and that step's
// checkpoint. Returns N (-1 if the log does not say).
int64_t stopped_after_step(const std::string& log) {
  const std::string marker = "stop requested: stopped after step ";
  const size_t at = log.find(marker);
  return at == std::string::npos ? -1 : std::stoll(log.substr(at + marker.size()));
}

const char* kStopConfig = "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                          "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 1024,"
                          " synthetic_val_samples: 16, workers: 1}\n"
                          "optim: {name: sgd, lr: 0.05, momentum: 0.9}\n"
                          "trainer: {global_batch: 16, max_steps: 60, device: cpu, threads: 1, eval_every_steps: 1000}\n"
                          "checkpoint: {every_steps: 1000}\n"
                          "logging: {every_steps: 5}\n";

}  // namespace

TEST_CASE("a stop signal delivered twice within milliseconds is one graceful stop, and SIGUSR1 stops like SIGTERM",
          "[resume][process][signals][timing]") {
  const std::string dir = files::make_temp_directory("train_signals_");
  const std::string config_path = files::join(dir, "run.yaml");
  std::ofstream(config_path) << kStopConfig;
  struct Case {
    const char* name;
    std::vector<int> signals;
  };
  for (const Case& c : {Case{"twice", {SIGTERM, SIGTERM}}, Case{"usr1", {SIGUSR1}}}) {
    DYNAMIC_SECTION(c.name) {
      const std::string run_dir = files::join(dir, c.name), log = files::join(dir, std::string(c.name) + ".log");
      const pid_t pid = spawn_logged(kTrain, {"fit", config_path, "--run-dir", run_dir}, log);
      REQUIRE(wait_for_text(files::join(run_dir, "metrics.jsonl"), "\"step\":5,", 120));
      // As a launcher that forwards a signal its rank also got directly: the same signal twice, a
      // moment apart. It used to take the "second signal" path and exit 143, no checkpoint.
      for (const int sig : c.signals) {
        ::kill(pid, sig);
        wait_delivered(pid, sig);
      }
      const int rc = wait_exit(pid);
      const std::string out = slurp(log);
      INFO(out);
      REQUIRE(rc == 3);
      const int64_t step = stopped_after_step(out);
      REQUIRE(step >= 5);
      REQUIRE(step < 60);
      // The steps since the last logging window are logged at the stop (the resumed run starts after
      // them), even between window boundaries.
      CHECK_THAT(slurp(files::join(run_dir, "metrics.jsonl")),
                 Catch::Contains("{\"step\":" + std::to_string(step) + ",\"epoch\""));
      const std::string ckpts = files::join(run_dir, "checkpoints");
      CHECK(latest_checkpoint(ckpts) == checkpoint_path(ckpts, step));
      if (c.signals.size() > 1) CHECK_THAT(out, Catch::Contains("already stopping"));
      const std::string resumed = files::join(dir, std::string(c.name) + ".resumed.log");
      REQUIRE(wait_exit(spawn_logged(kTrain, {"fit", config_path, "--run-dir", run_dir, "--resume", "auto"},
                                     resumed)) == 0);
      CHECK_THAT(slurp(resumed), Catch::Contains("resumed from " + checkpoint_path(ckpts, step)));
      CHECK(files::exists(checkpoint_path(ckpts, 60)));
    }
  }
  files::remove_all(dir);
}

TEST_CASE("a second stop signal a second later, or a stop past trainer.stop_grace_s, exits 128 + signal without a "
          "checkpoint", "[resume][process][signals][timing]") {
  const std::string dir = files::make_temp_directory("train_signals_late_");
  const std::string config_path = files::join(dir, "sleepy.yaml");
  std::ofstream(config_path) << kSleepyConfig;
  const std::string run_dir = files::join(dir, "run"), log = files::join(dir, "run.log");
  const std::string ckpts = files::join(run_dir, "checkpoints");
  SECTION("Ctrl-C, then Ctrl-C again 1.1 s later, while the 2 s step still runs") {
    const pid_t pid = spawn_logged(self_exe(), {"fit", config_path, "--run-dir", run_dir}, log, kSleepyEnv);
    REQUIRE(wait_for_text(files::join(run_dir, "metrics.jsonl"), "\"step\":1,", 120));  // step 2 just began
    ::kill(pid, SIGINT);
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    ::kill(pid, SIGINT);
    const int rc = wait_exit(pid);
    INFO(slurp(log));
    CHECK(rc == 128 + SIGINT);
    CHECK_THAT(slurp(log), Catch::Contains("another stop signal; exiting now without a checkpoint"));
    CHECK(latest_checkpoint(ckpts).empty());
  }
  SECTION("SIGTERM with trainer.stop_grace_s = 0.3 and 2 s steps: the watchdog exits 143, not 3") {
    const pid_t pid = spawn_logged(self_exe(), {"fit", config_path, "--run-dir", run_dir, "--set",
                                                "trainer.stop_grace_s=0.3"},
                                   log, kSleepyEnv);
    REQUIRE(wait_for_text(files::join(run_dir, "metrics.jsonl"), "\"step\":1,", 120));
    ::kill(pid, SIGTERM);
    const int rc = wait_exit(pid);
    INFO(slurp(log));
    CHECK(rc == 128 + SIGTERM);  // 3 would claim a checkpoint
    CHECK_THAT(slurp(log), Catch::Contains("did not finish within trainer.stop_grace_s = 0.3 s; exiting with 143"));
    // train.log has it too: each line is flushed as it is logged, so _Exit loses none.
    CHECK_THAT(slurp(files::join(run_dir, "train.log")), Catch::Contains("did not finish within trainer.stop_grace_s"));
    CHECK(latest_checkpoint(ckpts).empty());
  }
  files::remove_all(dir);
}

TEST_CASE("temporary files left by killed writes are removed when a run starts in the directory",
          "[resume][process][signals]") {
  const std::string dir = files::make_temp_directory("train_tmp_files_");
  const std::string config_path = files::join(dir, "run.yaml");
  std::ofstream(config_path) << kStopConfig;
  const std::string run_dir = files::join(dir, "run"), ckpts = files::join(run_dir, "checkpoints");
  files::make_directories(ckpts);
  // A pid that is certainly not running: a child that has exited and been reaped.
  pid_t dead = -1;
  {
    char* argv[] = {const_cast<char*>("/bin/true"), nullptr};
    REQUIRE(posix_spawn(&dead, "/bin/true", nullptr, nullptr, argv, environ) == 0);
    REQUIRE(wait_exit(dead) == 0);
  }
  const std::string d = std::to_string(dead), alive = std::to_string(::getpid());
  const std::vector<std::string> stale{"step_00000010.pt.tmp." + d, "step_00000010.pt.crc32c.tmp." + d};
  // A write still in progress (its pid runs: this test), and files that are not ours.
  const std::vector<std::string> kept{"step_00000020.pt.tmp." + alive, "notes.tmp." + d, "step_00000030.pt.tmp.x1",
                                      "step_00000030.pt.bak"};
  for (const auto& name : stale) std::ofstream(files::join(ckpts, name)) << "half a checkpoint";
  for (const auto& name : kept) std::ofstream(files::join(ckpts, name)) << "something";
  // Checksums whose checkpoints are gone (pruning killed between its two removals).
  const std::vector<std::string> orphans{"step_00000004.pt.crc32c", "best.pt.crc32c"};
  for (const auto& name : orphans) std::ofstream(files::join(ckpts, name)) << "crc32c 00000000 bytes 1\n";
  // The run directory's own files (written the same way), and one that is not the run's. A resume
  // rewrites the event files: TensorBoard would read a leftover of one ("tfevents" in its name).
  const std::vector<std::string> stale_top{"config.yaml.tmp." + d, "plan.json.tmp." + d, "metrics.jsonl.tmp." + d,
                                           "events.out.tfevents.1796323316.host.42.000000.tmp." + d};
  const std::string kept_top = "results.csv.tmp." + d;
  for (const auto& name : stale_top) std::ofstream(files::join(run_dir, name)) << "half a file";
  std::ofstream(files::join(run_dir, kept_top)) << "the user's";
  const std::string log = files::join(dir, "run.log");
  REQUIRE(wait_exit(spawn_logged(kTrain, {"fit", config_path, "--run-dir", run_dir, "--set", "trainer.max_steps=2"},
                                 log)) == 0);
  const std::string out = slurp(log);
  INFO(out);
  for (const auto& name : stale) {
    CHECK_FALSE(files::exists(files::join(ckpts, name)));
    CHECK_THAT(out, Catch::Contains("removed " + files::join(ckpts, name) + ", left by a write that did not finish "
                                    "(pid " + d + ")"));
  }
  for (const auto& name : orphans) {
    CHECK_FALSE(files::exists(files::join(ckpts, name)));
    CHECK_THAT(out, Catch::Contains("removing " + files::join(ckpts, name) +
                                    ": the checksum of a checkpoint that is no longer there"));
  }
  for (const auto& name : stale_top) {
    CHECK_FALSE(files::exists(files::join(run_dir, name)));
    CHECK_THAT(out, Catch::Contains("removed " + files::join(run_dir, name) + ", left by a write that did not finish"));
  }
  CHECK(files::exists(files::join(run_dir, kept_top)));
  for (const auto& name : kept) CHECK(files::exists(files::join(ckpts, name)));
  CHECK_THAT(out, Catch::Contains("kept " + files::join(ckpts, kept[0]) + ": its writer, pid " + alive +
                                  ", is still running"));
  CHECK_THAT(slurp(files::join(run_dir, "train.log")), Catch::Contains("left by a write that did not finish"));
  CHECK(files::exists(checkpoint_path(ckpts, 2)));
  files::remove_all(dir);
}

// examples/resnet/main.cpp trains through fit_in_run_dir, as train fit does: its run directory is
// locked against a second run, and a stop signal ends it with a checkpoint (exit 3) that the next
// run continues from. Before, a program built on the library got neither: two runs wrote one
// metrics.jsonl, and SIGTERM killed the example without a checkpoint (exit 143).
TEST_CASE("resnet_example: a second run on its run directory is refused, and SIGTERM stops with a checkpoint",
          "[resume][process][signals][library_use]") {
  const std::string example = std::string(TRAIN_BINARY_DIR) + "/bin/resnet_example";
  if (!files::is_regular_file(example)) FAIL(example + " is missing (TRAIN_BUILD_EXAMPLES=OFF?)");
  const std::string dir = files::make_temp_directory("train_example_signals_");
  const std::string config_path = files::join(dir, "run.yaml");
  std::ofstream(config_path) << kStopConfig;
  const std::string run_dir = files::join(dir, "run"), log = files::join(dir, "first.log");
  // Long enough that the second run's start-up cannot outlast it; the resumed run ends sooner.
  const pid_t pid = spawn_logged(example, {config_path, "--run-dir", run_dir, "--set", "trainer.max_steps=5000"}, log);
  REQUIRE(wait_for_text(files::join(run_dir, "metrics.jsonl"), "\"step\":5,", 120));

  const std::string second_log = files::join(dir, "second.log");
  const int second = wait_exit(spawn_logged(example, {config_path, "--run-dir", run_dir}, second_log));
  INFO(slurp(second_log));
  CHECK(second == 2);
  CHECK_THAT(slurp(second_log), Catch::Contains("is in use by another run"));

  ::kill(pid, SIGTERM);
  wait_delivered(pid, SIGTERM);
  const int rc = wait_exit(pid);
  const std::string out = slurp(log);
  INFO(out);
  REQUIRE(rc == 3);
  const int64_t step = stopped_after_step(out);
  REQUIRE(step >= 5);
  REQUIRE(step < 5000);
  const std::string ckpts = files::join(run_dir, "checkpoints");
  CHECK(latest_checkpoint(ckpts) == checkpoint_path(ckpts, step));
  // The refused run changed nothing: one run's rows, each step once.
  const std::string metrics = slurp(files::join(run_dir, "metrics.jsonl"));
  CHECK(metrics.find("{\"step\":5,") == metrics.rfind("{\"step\":5,"));

  const std::string resumed = files::join(dir, "resumed.log");
  const std::string end = "trainer.max_steps=" + std::to_string(step + 3);
  REQUIRE(wait_exit(spawn_logged(example, {config_path, "--run-dir", run_dir, "--set", end}, resumed)) == 0);
  CHECK_THAT(slurp(resumed), Catch::Contains("resumed from " + checkpoint_path(ckpts, step)));
  CHECK(files::exists(checkpoint_path(ckpts, step + 3)));
  files::remove_all(dir);
}
