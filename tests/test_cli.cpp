#include "testing.h"

#include <train/cli.h>
#include <train/data/token_file.h>
#include <train/doctor.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/log.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

int cli(std::vector<std::string> args) {
  args.insert(args.begin(), "train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return train::run_cli(static_cast<int>(argv.size()), argv.data());
}

struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name) : path(train::files::make_temp_directory("train_cli_" + name + "_")) {}
  ~TempDir() { train::files::remove_all(path); }
  std::string operator/(const std::string& file) const { return train::files::join(path, file); }
  std::string write(const std::string& file, const std::string& text) const {
    std::ofstream(*this / file) << text;
    return *this / file;
  }
};

// What `fn` writes to file descriptor `fd`.
std::string output_of(int fd, const std::function<void()>& fn) {
  std::cout.flush();
  std::fflush(nullptr);
  const int saved = ::dup(fd);
  std::FILE* capture = std::tmpfile();
  ::dup2(::fileno(capture), fd);
  fn();
  std::cout.flush();
  std::fflush(nullptr);
  ::dup2(saved, fd);
  ::close(saved);
  std::rewind(capture);
  std::string text;
  for (int c; (c = std::fgetc(capture)) != EOF;) text += static_cast<char>(c);
  std::fclose(capture);
  return text;
}

// What `fn` writes to stderr (the log's console sink).
std::string stderr_of(const std::function<void()>& fn) { return output_of(STDERR_FILENO, fn); }

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

const char* kSynthetic =
    "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
    "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 64, synthetic_val_samples: 16}\n"
    "trainer: {global_batch: 16, max_steps: 2, device: cpu}\n";

}  // namespace

TEST_CASE("cli: usage errors exit 2", "[cli]") {
  CHECK(cli({}) == train::kExitInvalid);
  CHECK(cli({"frobnicate"}) == train::kExitInvalid);
  CHECK(cli({"fit"}) == train::kExitInvalid);  // missing CONFIG
  CHECK(cli({"fit", "--help"}) == train::kExitOk);
  CHECK(cli({"config", "--reference"}) == train::kExitOk);
}

TEST_CASE("cli: an invalid config exits 2, missing data 1, and neither writes anything", "[cli]") {
  TempDir tmp("badcfg");
  const std::string bad = tmp.write("bad.yaml", std::string(kSynthetic) + "optim: {lr: -1}\n");
  const std::string run_dir = tmp / "run";
  CHECK(cli({"check", bad}) == train::kExitInvalid);
  CHECK(cli({"fit", bad, "--run-dir", run_dir}) == train::kExitInvalid);
  CHECK_FALSE(train::files::exists(run_dir));
  const std::string good = tmp.write("good.yaml", kSynthetic);
  CHECK(cli({"fit", good, "--run-dir", run_dir, "--set", "optim.lrr=0.1"}) == train::kExitInvalid);
  CHECK(cli({"fit", tmp.write("missing_data.yaml", "model: {name: resnet18}\ndata: {kind: idx, root: /nonexistent}\n"
                                                   "trainer: {global_batch: 8, epochs: 1}\n"),
             "--run-dir", run_dir}) == train::kExitData);
  CHECK(cli({"fit", good, "--run-dir", run_dir, "--resume", tmp / "nope.pt"}) == train::kExitInvalid);
  CHECK(cli({"fit", good, "--run-dir", run_dir, "--resume", tmp.write("corrupt.pt", "garbage")}) == train::kExitInvalid);
  CHECK_FALSE(train::files::exists(run_dir));
}

TEST_CASE("cli: fit writes the run directory, and a second fit needs --resume", "[cli]") {
  TempDir tmp("fit");
  const std::string cfg = tmp.write("run.yaml", kSynthetic);
  const std::string run_dir = tmp / "run";
  REQUIRE(cli({"fit", cfg, "--run-dir", run_dir}) == train::kExitOk);
  for (const char* f : {"config.yaml", "plan.json", "metrics.jsonl", "train.log", "checkpoints/step_00000002.pt"}) {
    CHECK(train::files::exists(train::files::join(run_dir, f)));
  }
  CHECK(cli({"fit", cfg, "--run-dir", run_dir}) == train::kExitInvalid);
  CHECK(cli({"fit", cfg, "--run-dir", run_dir, "--resume", "auto", "--set", "trainer.max_steps=3"}) == train::kExitOk);
  CHECK(train::files::exists(train::files::join(run_dir, "checkpoints/step_00000003.pt")));
  // Resuming the finished run evaluates again for its result, without a second row for step 3.
  CHECK(cli({"fit", cfg, "--run-dir", run_dir, "--resume", "auto", "--set", "trainer.max_steps=3"}) == train::kExitOk);
  std::stringstream metrics;
  metrics << std::ifstream(train::files::join(run_dir, "metrics.jsonl")).rdbuf();
  CHECK(count_of(metrics.str(), "{\"step\":3,") == 2);  // the train row and one val row
  // The resolved config written into the run directory is itself a valid config.
  CHECK(cli({"check", train::files::join(run_dir, "config.yaml")}) == train::kExitOk);
  const std::string evaluation = output_of(STDOUT_FILENO, [&] {
    CHECK(cli({"eval", cfg, "--checkpoint", train::files::join(run_dir, "checkpoints/step_00000003.pt")}) ==
          train::kExitOk);
  });
  CHECK_THAT(evaluation, Catch::Contains("\"split\":\"val\"") && Catch::Contains("\"accuracy\":") &&
                             Catch::Contains("\"top5\":") && Catch::Contains("\"samples\":16"));
  CHECK(cli({"plan", cfg, "--json"}) == train::kExitOk);
}

TEST_CASE("cli: the done line of a resumed run counts the steps this process took", "[cli]") {
  TempDir tmp("done");
  const std::string cfg = tmp.write("run.yaml", std::string(kSynthetic) + "checkpoint: {every_steps: 1}\n");
  const std::string run_dir = tmp / "run";
  const auto fit = [&](const std::string& max_steps) {
    std::vector<std::string> args{"fit", cfg, "--run-dir", run_dir, "--set", "trainer.max_steps=" + max_steps};
    if (train::files::exists(run_dir)) args.insert(args.end(), {"--resume", "auto"});
    REQUIRE(cli(args) == train::kExitOk);
  };
  fit("2");
  fit("4");
  fit("5");
  fit("5");  // resumed from the final checkpoint: nothing to train
  std::stringstream log;
  log << std::ifstream(train::files::join(run_dir, "train.log")).rdbuf();
  // The time on each line is this process's, so the count must be too, not the run's 4 or 5.
  CHECK(count_of(log.str(), "done: 2 steps in ") == 1);
  CHECK(count_of(log.str(), "done: steps 3-4 (2 in this run) in ") == 1);
  CHECK(count_of(log.str(), "done: step 5 (1 in this run) in ") == 1);
  CHECK(count_of(log.str(), "done: 0 steps in this run (resumed at step 5) in ") == 1);
}

TEST_CASE("cli: a log file that cannot be written stops with one warning, and the run goes on", "[cli][log]") {
  TempDir tmp("log_full");
  // /dev/full: every write succeeds into the buffer and every flush fails with ENOSPC, as on a full
  // disk. spdlog's file sink threw that from log::write, out of the training loop, and again from
  // the error report (std::terminate, exit 134).
  const std::string log_path = tmp / "train.log";
  REQUIRE(::symlink("/dev/full", log_path.c_str()) == 0);
  std::string err = stderr_of([&] {
    train::log::set_file(log_path);
    CHECK_NOTHROW(train::log::warn("first line"));
    CHECK_NOTHROW(train::log::error("second line"));
    train::log::set_file("");
  });
  CHECK(count_of(err, "cannot write the log file " + log_path + " (" + std::strerror(ENOSPC) + ")") == 1);
  CHECK_THAT(err, Catch::Contains("first line") && Catch::Contains("second line"));  // the console has them

  // A run whose train.log is on a full disk trains to the end and checkpoints.
  const std::string cfg = tmp.write("run.yaml", kSynthetic);
  const std::string run_dir = tmp / "run";
  train::files::make_directories(run_dir);
  REQUIRE(::symlink("/dev/full", train::files::join(run_dir, "train.log").c_str()) == 0);
  int rc = -1;
  err = stderr_of([&] { rc = cli({"fit", cfg, "--run-dir", run_dir}); });
  CHECK(rc == train::kExitOk);
  CHECK(count_of(err, "cannot write the log file " + train::files::join(run_dir, "train.log")) == 1);
  CHECK(train::files::exists(train::files::join(run_dir, "checkpoints/step_00000002.pt")));
}

TEST_CASE("cli: a full disk while the run writes its config.yaml leaves no run directory behind", "[cli][log]") {
  TempDir tmp("setup_full");
  const std::string cfg = tmp.write("run.yaml", kSynthetic);
  const std::string run_dir = tmp / "run";
  // Files may not grow past 2 KiB: config.yaml's write fails (EFBIG) as it would on a full disk.
  // It used to leave the directory with .lock and a train.log that could not say why.
  int rc = -1;
  std::string err;
  {
    const train::testing::FileSizeLimit limit(2048);
    err = stderr_of([&] { rc = cli({"fit", cfg, "--run-dir", run_dir}); });
  }
  INFO(err);
  CHECK(rc == train::kExitRuntime);
  CHECK_THAT(err, Catch::Contains(train::files::join(run_dir, "config.yaml")) &&
                      Catch::Contains(std::strerror(EFBIG)) &&
                      Catch::Contains("the run stopped while writing its run directory's files"));
  CHECK_FALSE(train::files::exists(run_dir));
  // With room again, the same command runs.
  CHECK(cli({"fit", cfg, "--run-dir", run_dir}) == train::kExitOk);
}

TEST_CASE("cli: a torchrun restart without --resume auto is refused with the way to continue", "[cli]") {
  TempDir tmp("torchrun_restart");
  const std::string cfg = tmp.write("run.yaml", kSynthetic);
  const std::string run_dir = tmp / "run";
  REQUIRE(cli({"fit", cfg, "--run-dir", run_dir}) == train::kExitOk);  // the first attempt's checkpoints
  // torchrun's second attempt, as one rank of one.
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
  int rc = -1;
  const std::string err = stderr_of([&] { rc = cli({"fit", cfg, "--run-dir", run_dir}); });
  const int resumed = cli({"fit", cfg, "--run-dir", run_dir, "--resume", "auto"});
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  CHECK(rc == train::kExitInvalid);
  CHECK_THAT(err, Catch::Contains("already holds checkpoints") &&
                      Catch::Contains("This is torchrun's restart 1 (TORCHELASTIC_RESTART_COUNT): restarts continue the "
                                      "run only when the command has --resume auto"));
  CHECK(resumed == train::kExitOk);
}

TEST_CASE("cli: a run directory in use by another run is refused before anything in it changes", "[cli]") {
  TempDir tmp("lock");
  const std::string cfg = tmp.write("run.yaml", kSynthetic);
  const std::string run_dir = tmp / "run";
  train::files::make_directories(run_dir);
  // Another run's rank 0 holds the lock (flock locks conflict between open files, even in one
  // process).
  const int fd = ::open(train::files::join(run_dir, ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
  REQUIRE(::write(fd, "4242\n", 5) == 5);
  std::string err = stderr_of([&] { CHECK(cli({"fit", cfg, "--run-dir", run_dir}) == train::kExitInvalid); });
  CHECK(err.find("run directory " + run_dir + " is in use by another run (pid 4242)") != std::string::npos);
  CHECK(train::files::list_directory(run_dir) == std::vector<std::string>{".lock"});
  ::close(fd);  // that run ended
  CHECK(cli({"fit", cfg, "--run-dir", run_dir}) == train::kExitOk);
}

TEST_CASE("cli: logging.level applies from the start, to the probe and the plan too", "[cli]") {
  TempDir tmp("level");
  const std::string cfg = tmp.write("run.yaml", kSynthetic);
  // A cache of its own: the first plan probes, whatever earlier runs left in a shared cache.
  const std::vector<std::string> plan{"plan", cfg, "--set", "tuning.batch=scale", "--set", "tuning.max_micro_batch=8",
                                      "--set", "tuning.cache_dir=" + tmp / "cache"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = plan;
    args.insert(args.end(), extra.begin(), extra.end());
    return stderr_of([&] { CHECK(cli(args) == train::kExitOk); });
  };
  const std::string probed = with({});
  CHECK_THAT(probed, Catch::Contains(" I] measured in ") && Catch::Contains("probe on cpu at "));
  // Quiet from the start: neither a probe nor the plan cache says anything.
  CHECK(count_of(with({"--set", "logging.level=error", "--set", "tuning.max_micro_batch=4"}), " I] ") == 0);
  CHECK(count_of(with({"--set", "logging.level=error"}), " I] ") == 0);
  train::log::set_level(train::log::Level::info);  // the level is the process's; later tests log at info
}

TEST_CASE("cli: a cached measurement made with less memory free is measured again when its cap limits the plan",
          "[cli][plan]") {
  TempDir tmp("regrow");
  const std::string cfg = tmp.write("run.yaml", kSynthetic);  // global batch 16 on the CPU
  const std::string cache = tmp / "cache";
  const std::vector<std::string> plan{"plan", cfg, "--set", "tuning.cache_dir=" + cache};
  std::string out;
  std::string err = stderr_of([&] { out = output_of(STDOUT_FILENO, [&] { CHECK(cli(plan) == train::kExitOk); }); });
  CHECK_THAT(err, Catch::Contains("probe on cpu at 2, 4"));
  CHECK_THAT(out, Catch::Contains("micro_batch      16 "));
  std::vector<std::string> entries;  // the measurement, not the latest-*.json the cache reports changes from
  for (const auto& name : train::files::list_directory(cache)) {
    if (name.rfind("latest-", 0) != 0) entries.push_back(name);
  }
  REQUIRE(entries.size() == 1);
  const std::string entry = train::files::join(cache, entries.front());
  std::stringstream read;
  read << std::ifstream(entry).rdbuf();
  const std::string measured = read.str();
  // As if measured while another process held nearly all memory: 1 MB, 2 samples.
  auto rewrite = [&](int64_t max_micro_batch) {
    std::string text = std::regex_replace(measured, std::regex("\"budget_bytes\":[0-9]+"), "\"budget_bytes\":1000000");
    text = std::regex_replace(text, std::regex("\"max_micro_batch\":[0-9]+"),
                              "\"max_micro_batch\":" + std::to_string(max_micro_batch));
    std::ofstream(entry, std::ios::trunc) << text;
  };
  rewrite(2);
  err = stderr_of([&] { out = output_of(STDOUT_FILENO, [&] { CHECK(cli(plan) == train::kExitOk); }); });
  CHECK_THAT(err, Catch::Contains("was measured with a 0.0 GiB budget") && Catch::Contains("GiB now: measuring again") &&
                      Catch::Contains("probe on cpu at 2, 4"));
  CHECK_THAT(out, Catch::Contains("micro_batch      16 "));
  // The new measurement replaced the old: a hit.
  err = stderr_of([&] { CHECK(cli(plan) == train::kExitOk); });
  CHECK_THAT(err, Catch::Contains("plan cache hit") && !Catch::Contains("measuring again") &&
                      Catch::Matches("[\\s\\S]*plan ready in [0-9]+ ms \\(device [0-9]+, data [0-9]+, model [0-9]+, the "
                                     "rest -?[0-9]+\\): memory from the plan cache[\\s\\S]*"));
  // Against the process's own start (library loading before main), here in the test process's.
  CHECK_THAT(err, Catch::Matches("[\\s\\S]*memory from the plan cache; the process started [0-9]+ ms ago[\\s\\S]*"));
  // A small budget whose cap does not limit this plan (16 fits) is kept: no probe.
  rewrite(64);
  err = stderr_of([&] { CHECK(cli(plan) == train::kExitOk); });
  CHECK_THAT(err, Catch::Contains("plan cache hit") && !Catch::Contains("measured in"));
}

TEST_CASE("cli: another global batch or tuning.batch mode plans from the cached measurement, without a probe",
          "[cli][plan][cache]") {
  TempDir tmp("batchreuse");
  const std::string cfg = tmp.write("run.yaml", kSynthetic);  // global batch 16 on the CPU
  const std::vector<std::string> plan{"plan", cfg, "--set", "tuning.cache_dir=" + tmp / "cache"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = plan;
    args.insert(args.end(), extra.begin(), extra.end());
    std::string out;
    const std::string err = stderr_of([&] { out = output_of(STDOUT_FILENO, [&] { CHECK(cli(args) == train::kExitOk); }); });
    return err + out;
  };
  CHECK_THAT(with({}), Catch::Contains(" I] measured in "));
  // The memory fit holds for any batch: none of these probes again.
  const std::string bigger = with({"--set", "trainer.global_batch=64"});
  CHECK_THAT(bigger, Catch::Contains("plan cache hit") && !Catch::Contains("measured in"));
  CHECK_THAT(bigger, Catch::Contains("global_batch     64 "));
  const std::string scaled = with({"--set", "tuning.batch=scale", "--set", "tuning.max_global_batch=64"});
  CHECK_THAT(scaled, Catch::Contains("plan cache hit") && !Catch::Contains("measured in") &&
                         Catch::Contains("tuning.batch scale"));
}

TEST_CASE("cli: a cached memory slope known only up to a smaller micro-batch is measured again for a larger one",
          "[cli][plan][cache][tokens]") {
  // BERT-tiny with a 20k vocabulary trained with AdamW: at 2 and 4 sequences a parameter-sized
  // buffer sets the step's peak (test_probe.cpp), so a plan that can use no more than 4 keeps
  // those flat peaks, and its slope says nothing about larger micro-batches.
  TempDir tmp("slope");
  train::data::TokenFileOptions options;
  options.vocab_size = 20000;
  options.special = train::data::SpecialTokens{0, 1, 2, 3, 4};
  std::vector<std::vector<int64_t>> corpus;
  for (int64_t d = 0; d < 300; ++d) {
    std::vector<int64_t> doc;
    for (int64_t i = 0; i < 60; ++i) doc.push_back(5 + (d * 131 + i * 17) % 19990);
    corpus.push_back(doc);
  }
  train::data::write_token_file(tmp / "train.tokens", corpus, options);
  train::data::write_token_file(tmp / "val.tokens", corpus, options);
  const std::string cfg = tmp.write(
      "mlm.yaml",
      "model: {name: bert-mlm, preset: bert-tiny, vocab_size: 20000, num_classes: 20000, max_positions: 64}\n"
      "data: {kind: tokens, root: " + tmp.path + ", seq_len: 64}\n"
      "optim: {name: adamw, lr: 0.001, weight_decay: 0.01, clip_grad_norm: 1.0}\n"
      "trainer: {global_batch: 4, max_steps: 2, device: cpu}\n"
      "tuning: {cache_dir: " + tmp.path + "/cache}\n");
  auto plan = [&](int64_t global_batch) {
    return stderr_of([&] {
      output_of(STDOUT_FILENO, [&] {
        CHECK(cli({"plan", cfg, "--set", "trainer.global_batch=" + std::to_string(global_batch)}) == train::kExitOk);
      });
    });
  };
  std::string err = plan(4);
  CHECK_THAT(err, Catch::Contains(" I] measured in ") && Catch::Contains("probe on cpu at 2, 4"));
  err = plan(64);
  CHECK_THAT(err, Catch::Contains("memory peaks were still flat up to micro-batch 4") &&
                      Catch::Contains("this plan could use 64; measuring again") && Catch::Contains(" I] measured in "));
  // Measured beyond the flat part now: these plans reuse it.
  err = plan(64);
  CHECK_THAT(err, Catch::Contains("plan cache hit") && !Catch::Contains("measured in"));
  err = plan(16);
  CHECK_THAT(err, Catch::Contains("plan cache hit") && !Catch::Contains("measured in"));
}

TEST_CASE("cuda: another global batch or scale mode times only the micro-batch sizes no earlier plan timed",
          "[cli][plan][cache][cuda]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: throughput probes run on a GPU only (scripts/gpu-check)");
  TempDir tmp("timedsizes");
  const std::string cfg = tmp.write(
      "run.yaml",
      // No convolutions: cuDNN's autotuning of every new batch shape would take most of the time.
      "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
      "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 256, synthetic_val_samples: 64}\n"
      "trainer: {global_batch: 32, max_steps: 2, device: cuda}\n"
      "tuning: {cache_dir: " + tmp.path + "/cache, max_global_batch: 256}\n");
  auto plan = [&](std::vector<std::string> sets) {
    std::vector<std::string> args{"plan", cfg};
    for (const auto& s : sets) {
      args.push_back("--set");
      args.push_back(s);
    }
    return stderr_of([&] { output_of(STDOUT_FILENO, [&] { CHECK(cli(args) == train::kExitOk); }); });
  };
  CHECK_THAT(plan({}), Catch::Contains(" I] measured in "));  // memory, then 16 and 32 timed
  std::string err = plan({"trainer.global_batch=128"});          // 64 and 128 are new
  CHECK_THAT(err, Catch::Contains("timed 2 micro-batch sizes no earlier plan needed") && !Catch::Contains("measured in"));
  err = plan({"trainer.global_batch=64"});  // all timed
  CHECK_THAT(err, Catch::Contains("(no probe)") && !Catch::Contains("measured in"));
  err = plan({"trainer.global_batch=64", "tuning.batch=scale"});  // up to tuning.max_global_batch: 256 is new
  CHECK_THAT(err, Catch::Contains("micro-batch size") && Catch::Contains("no earlier plan needed") &&
                      !Catch::Contains("measured in"));
}

TEST_CASE("cli: mistakes found before anything starts: tuning.device in fit, --nproc, check, init_from", "[cli]") {
  TempDir tmp("early");
  const std::string cfg = tmp.write("run.yaml", kSynthetic);
  const std::string run_dir = tmp / "run";
  // A device profile is for train plan; fit and eval run on this machine.
  std::string err = stderr_of(
      [&] { CHECK(cli({"fit", cfg, "--run-dir", run_dir, "--set", "tuning.device=h100"}) == train::kExitInvalid); });
  CHECK(err.find("--set tuning.device=h100: key 'tuning.device': 'h100' plans for a device profile") != std::string::npos);
  CHECK_FALSE(train::files::exists(run_dir));
  // launch: a batch the ranks cannot split, and a rank count out of range, before any rank starts.
  err = stderr_of([&] { CHECK(cli({"launch", "--nproc", "3", cfg, "--run-dir", run_dir}) == train::kExitInvalid); });
  CHECK(err.find("run.yaml:3:") != std::string::npos);
  CHECK(err.find("key 'trainer.global_batch': 16 is not divisible by --nproc 3") != std::string::npos);
  CHECK(cli({"launch", "--nproc", "0", cfg}) == train::kExitInvalid);
  CHECK(cli({"launch", "--nproc", "99999", cfg}) == train::kExitInvalid);
  CHECK_FALSE(train::files::exists(run_dir));
  // check builds the model: an unknown model name, a bad profile name, a missing init_from file.
  err = stderr_of([&] { CHECK(cli({"check", cfg, "--set", "model.name=resnet19"}) == train::kExitInvalid); });
  CHECK(err.find("did you mean 'resnet18'?") != std::string::npos);
  err = stderr_of([&] { CHECK(cli({"check", cfg, "--set", "tuning.device=a100-80g"}) == train::kExitInvalid); });
  CHECK(err.find("--set tuning.device=a100-80g: key 'tuning.device': unknown device") != std::string::npos);
  // plan --device: named as the flag the user gave.
  err = stderr_of([&] { CHECK(cli({"plan", cfg, "--device", "a100-80g"}) == train::kExitInvalid); });
  CHECK(err.find("--device a100-80g: unknown device 'a100-80g'; did you mean 'a100-80gb'?") != std::string::npos);
  CHECK(err.find("tuning.device") == std::string::npos);
  const std::string with_init = tmp.write(
      "with_init.yaml", "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true,\n"
                        "        init_from: " + (tmp / "none.pt") + "}\n"
                        "data: {kind: synthetic, channels: 1, image_size: 8}\n"
                        "trainer: {global_batch: 16, max_steps: 2, device: cpu}\n");
  for (const char* command : {"check", "fit"}) {
    CAPTURE(command);
    std::vector<std::string> args{command, with_init};
    if (std::string(command) == "fit") args.insert(args.end(), {"--run-dir", run_dir});
    err = stderr_of([&] { CHECK(cli(args) == train::kExitInvalid); });
    CHECK(err.find("with_init.yaml:2:20: key 'model.init_from': " + (tmp / "none.pt")) != std::string::npos);
  }
  CHECK_FALSE(train::files::exists(run_dir));
  CHECK(cli({"check", cfg}) == train::kExitOk);
}

TEST_CASE("cli: doctor and plan --device", "[cli]") {
  CHECK(cli({"doctor"}) == train::kExitOk);  // every smoke test passes on this machine
  CHECK(cli({"doctor", "--json"}) == train::kExitOk);
  CHECK_THAT(train::cuda_failure_hint("CUDA error: no kernel image is available for execution on the device"),
             Catch::Contains("compute capability"));
  CHECK_THAT(train::cuda_failure_hint("CUDA driver version is insufficient for CUDA runtime version"),
             Catch::Contains("driver"));
  CHECK(train::cuda_failure_hint("something else").empty());
  // CUDA's minor version compatibility: an older minor version warns; an older major fails.
  CHECK(train::cuda_driver_check(13000, 13000).status == "ok");
  CHECK(train::cuda_driver_check(13020, 13000).status == "ok");
  CHECK(train::cuda_driver_check(12020, 12040).status == "warn");
  CHECK_THAT(train::cuda_driver_check(12020, 12040).hint, Catch::Contains("minor version compatibility"));
  CHECK(train::cuda_driver_check(12080, 13000).status == "fail");
  CHECK_THAT(train::cuda_driver_check(11080, 12040).hint, Catch::Contains("update the NVIDIA driver"));
  TempDir tmp("plan");
  const std::string cfg = tmp.write("run.yaml", std::string(kSynthetic) + "tuning: {cache_dir: " + tmp.path + "}\n");
  CHECK(cli({"plan", cfg, "--device", "a100-80gb", "--json"}) == train::kExitOk);
  CHECK(cli({"plan", cfg, "--device", "a100-80"}) == train::kExitInvalid);  // unknown profile
}

TEST_CASE("cli: plan --world-size N plans N ranks on one host unless --local-world-size says fewer", "[cli]") {
  TempDir tmp("plan_local");
  const std::string cfg = tmp.write("run.yaml", std::string(kSynthetic) + "tuning: {cache_dir: " + tmp.path + "}\n");
  std::string out = output_of(STDOUT_FILENO, [&] { CHECK(cli({"plan", cfg, "--world-size", "8"}) == train::kExitOk); });
  CHECK_THAT(out, Catch::Contains(" / 8 ranks on this host"));
  out = output_of(STDOUT_FILENO, [&] {
    CHECK(cli({"plan", cfg, "--world-size", "16", "--local-world-size", "4"}) == train::kExitOk);
  });
  CHECK_THAT(out, Catch::Contains(" / 4 ranks on this host"));
  out = output_of(STDOUT_FILENO, [&] {
    CHECK(cli({"plan", cfg, "--world-size", "4", "--local-world-size", "1"}) == train::kExitOk);
  });
  CHECK_THAT(out, !Catch::Contains("ranks on this host"));
  std::string err = stderr_of([&] {
    CHECK(cli({"plan", cfg, "--world-size", "8", "--local-world-size", "3"}) == train::kExitInvalid);
  });
  CHECK_THAT(err, Catch::Contains("--local-world-size 3: the ranks per host must divide --world-size 8"));
  stderr_of([&] { CHECK(cli({"plan", cfg, "--world-size", "2", "--local-world-size", "4"}) == train::kExitInvalid); });
  stderr_of([&] { CHECK(cli({"plan", cfg, "--local-world-size", "2"}) == train::kExitInvalid); });  // needs --world-size
}

TEST_CASE("cli: plan without the data leaves the schedule unresolved, not 0", "[cli]") {
  TempDir tmp("plan_nodata");
  const std::string sets[] = {"data.root=" + (tmp / "imagenet"), "tuning.cache_dir=" + tmp.path, "tuning.probe=false"};
  const std::string config = std::string(TRAIN_SOURCE_DIR) + "/configs/resnet50_imagenet.yaml";
  std::string out = output_of(STDOUT_FILENO, [&] {
    CHECK(cli({"plan", config, "--device", "a100-80gb", "--json", "--set",
               sets[0], "--set", sets[1], "--set", sets[2]}) == train::kExitOk);
  });
  CHECK_THAT(out, Catch::Contains("\"warmup_steps\":null"));
  CHECK_THAT(out, Catch::Contains("\"warmup_epochs\":5"));
  CHECK_THAT(out, Catch::Contains("\"total_steps\":null"));
  out = output_of(STDOUT_FILENO, [&] {
    CHECK(cli({"plan", config, "--device", "a100-80gb", "--set", sets[0],
               "--set", sets[1], "--set", sets[2]}) == train::kExitOk);
  });
  CHECK_THAT(out, Catch::Contains("5 epochs"));
  CHECK_THAT(out, Catch::Contains("resolved when the data is read"));
}

TEST_CASE("cli: on the CPU, a global batch beyond memory accumulates instead of one pass", "[cli][plan]") {
  // ResNet-50 at 224 px needs about 80 MiB a sample on the CPU: 4096 samples, some 320 GiB, fit no
  // machine this runs on. Fixed mode keeps the global batch and splits it.
  TempDir tmp("plan_cpu_memory");
  const std::string config = std::string(TRAIN_SOURCE_DIR) + "/configs/resnet50_imagenet.yaml";
  const std::string out = output_of(STDOUT_FILENO, [&] {
    CHECK(cli({"plan", config, "--json", "--set", "data.root=" + (tmp / "imagenet"), "--set",
               "tuning.cache_dir=" + tmp.path, "--set", "trainer.global_batch=4096", "--set",
               "tuning.base_batch=4096", "--set", "trainer.device=cpu"}) == train::kExitOk);
  });
  std::smatch micro, accum;
  REQUIRE(std::regex_search(out, micro, std::regex("\"micro_batch\":([0-9]+)")));
  REQUIRE(std::regex_search(out, accum, std::regex("\"accum_steps\":([0-9]+)")));
  CHECK(std::stoll(micro[1]) < 4096);
  CHECK(std::stoll(micro[1]) * std::stoll(accum[1]) == 4096);
  CHECK_THAT(out, Catch::Contains("\"global_batch\":4096"));
}

TEST_CASE("cli: check --data reads every sample and names the bad ones, and verifies token-file checksums",
          "[cli][tokens]") {
  TempDir tmp("checkdata");
  train::data::TokenFileOptions options;
  options.vocab_size = 30;
  options.special = train::data::SpecialTokens{0, 1, 2, 3, 4};
  std::vector<std::vector<int64_t>> corpus;
  for (int64_t d = 0; d < 40; ++d) corpus.push_back(std::vector<int64_t>(static_cast<size_t>(5 + d % 7), 5 + d % 25));
  train::data::write_token_file(tmp / "train.tokens", corpus, options);
  train::data::write_token_file(tmp / "val.tokens", corpus, options);
  const std::string cfg = tmp.write(
      "mlm.yaml", "model: {name: bert-mlm, preset: bert-tiny, vocab_size: 30, num_classes: 30, max_positions: 16}\n"
                  "data: {kind: tokens, root: " + tmp.path + ", seq_len: 16}\n"
                  "trainer: {global_batch: 8, max_steps: 2, device: cpu}\n");
  std::string out = output_of(STDOUT_FILENO, [&] { CHECK(cli({"check", cfg, "--data"}) == train::kExitOk); });
  CHECK(count_of(out, "samples read") == 2);
  CHECK(count_of(out, "all load") == 2);
  CHECK(out.find("the data was read") != std::string::npos);

  // Token files as bytes: a 128-byte header, then 2-byte tokens; the header's checksum is the
  // 64-bit FNV-1a of everything after the header.
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  auto write = [](const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  };
  auto seal = [](std::string& bytes) {  // recomputes the checksum
    uint64_t hash = 0xCBF29CE484222325ull;
    for (size_t i = 128; i < bytes.size(); ++i) hash = (hash ^ static_cast<uint8_t>(bytes[i])) * 0x100000001B3ull;
    for (int i = 0; i < 8; ++i) bytes[48 + static_cast<size_t>(i)] = static_cast<char>(hash >> (8 * i));
  };
  const std::string good = read(tmp / "val.tokens");

  // A changed token still inside the vocabulary: only the checksum can tell.
  std::string flipped = good;
  flipped[128 + 2 * 7] = static_cast<char>(flipped[128 + 2 * 7] ^ 1);
  write(tmp / "val.tokens", flipped);
  CHECK(cli({"check", cfg}) == train::kExitOk);  // without --data nothing is read
  std::string err = stderr_of([&] { CHECK(cli({"check", cfg, "--data"}) == train::kExitData); });
  CHECK(err.find(tmp / "val.tokens") != std::string::npos);
  CHECK(err.find("checksum mismatch") != std::string::npos);

  // Tokens outside the vocabulary behind a correct checksum: the samples that hold them are
  // named, with the file and position; on_error: skip would replace them, so that passes.
  std::string outside = good;
  outside[128 + 2 * 3] = 31;   // document 0, in sample 0
  outside[128 + 2 * 200] = 40;  // later on
  seal(outside);
  write(tmp / "val.tokens", outside);
  err = stderr_of([&] {
    out = output_of(STDOUT_FILENO, [&] { CHECK(cli({"check", cfg, "--data"}) == train::kExitData); });
  });
  CHECK(out.find("val data") != std::string::npos);
  CHECK(out.find("2 bad") != std::string::npos);
  CHECK(out.find("  sample 0: " + (tmp / "val.tokens") + ": corrupt token file: token 31 at position 3") !=
        std::string::npos);
  CHECK(out.find("token 40 at position 200") != std::string::npos);
  CHECK(err.find("2 sample(s) fail to load") != std::string::npos);
  out = output_of(STDOUT_FILENO,
                  [&] { CHECK(cli({"check", cfg, "--data", "--set", "data.on_error=skip"}) == train::kExitOk); });
  CHECK(out.find("data.on_error: skip will replace its 2 bad sample(s)") != std::string::npos);

  // The model is checked against the data as train fit checks it.
  write(tmp / "val.tokens", good);
  err = stderr_of([&] {
    CHECK(cli({"check", cfg, "--data", "--set", "model.vocab_size=20", "--set", "model.num_classes=20"}) ==
          train::kExitInvalid);
  });
  CHECK(err.find("--set model.num_classes=20: key 'model.num_classes': 20 but the data") != std::string::npos);
  CHECK(cli({"check", cfg, "--data", "--set", "data.kind=custom"}) == train::kExitInvalid);
}
