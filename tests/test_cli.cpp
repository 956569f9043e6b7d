#include "testing.h"

#include <train/cli.h>
#include <train/doctor.h>
#include <train/errors.h>
#include <train/files.h>

#include <unistd.h>
#include <fstream>
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
  // The resolved config written into the run directory is itself a valid config.
  CHECK(cli({"check", train::files::join(run_dir, "config.yaml")}) == train::kExitOk);
  CHECK(cli({"eval", cfg, "--checkpoint", train::files::join(run_dir, "checkpoints/step_00000003.pt")}) ==
        train::kExitOk);
  CHECK(cli({"plan", cfg, "--json"}) == train::kExitOk);
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
