// Fault tolerance inside a run: out-of-memory recovery (with the CPU allocator limit standing in
// for a full GPU) and the non-finite loss policy (stop or roll back).
#include "testing.h"

#include "bad_samples.h"

#include <fstream>

#include <train/checkpoint.h>
#include <train/config.h>
#include <train/data/dataset.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/models/model.h>
#include <train/optim.h>
#include <train/probe.h>
#include <train/run.h>
#include <train/trainer.h>

#include <torch/torch.h>

#include <atomic>
#include <exception>
#include <stdexcept>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

using namespace train;

namespace {

// Above this micro-batch WideMlp's training forward fails: an impossible allocation, or with
// g_fail_with_shape_error a shape mismatch.
std::atomic<int64_t> g_fail_above{std::numeric_limits<int64_t>::max()};
std::atomic<bool> g_fail_with_shape_error{false};

struct FailAbove {
  FailAbove(int64_t batch, bool shape_error) {
    g_fail_above = batch;
    g_fail_with_shape_error = shape_error;
  }
  ~FailAbove() { g_fail_above = std::numeric_limits<int64_t>::max(); }
};

// Wide hidden layer with a chain of SiLUs: activations (per sample) dominate the memory of a step, so halving the
// micro-batch visibly lowers the peak. No batch statistics: micro-batching does not change the
// update.
class WideMlp : public models::Model {
 public:
  explicit WideMlp(const ModelConfig& c) {
    fc1 = register_module("fc1", torch::nn::Linear(c.in_channels * 8 * 8, 2048));
    fc2 = register_module("fc2", torch::nn::Linear(2048, c.num_classes));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    if (is_training() && x.size(0) > g_fail_above.load()) {
      if (g_fail_with_shape_error) {
        (void)torch::matmul(torch::ones({2, 3}), torch::ones({2, 3}));  // a real error that is not memory
      } else {
        // More than the address space: fails for real in the CPU allocator (posix_memalign), which
        // LibTorch reports as a plain c10::Error, not as an OutOfMemoryError.
        (void)torch::empty({int64_t{1} << 50}, torch::kByte);
      }
    }
    auto h = fc1->forward(x.flatten(1));
    if (bn) h = bn->forward(h);
    for (int i = 0; i < 4; ++i) h = h * torch::sigmoid(h);  // each keeps two [B, 2048] tensors for backward
    return fc2->forward(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};  // wide_bn_mlp only
};

// Produces a NaN in the forward passes whose (1-based) count is in [nan_from, nan_to].
std::atomic<int> g_forward_calls{0};
std::atomic<int> g_nan_from{std::numeric_limits<int>::max()};
std::atomic<int> g_nan_to{std::numeric_limits<int>::max()};

class PoisonedMlp : public models::Model {
 public:
  explicit PoisonedMlp(const ModelConfig& c) {
    fc1 = register_module("fc1", torch::nn::Linear(c.in_channels * 8 * 8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, c.num_classes));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = torch::relu(fc1->forward(x.flatten(1)));
    const int call = ++g_forward_calls;
    if (call >= g_nan_from && call <= g_nan_to) h = h * std::numeric_limits<float>::quiet_NaN();
    return fc2->forward(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// One large parameter that the loss barely touches: its gradient and the optimizer's state are
// the memory of a step, the activations next to nothing.
class HeavyParams : public models::Model {
 public:
  explicit HeavyParams(const ModelConfig& c) {
    fc = register_module("fc", torch::nn::Linear(c.in_channels * 8 * 8, c.num_classes));
    big = register_parameter("big", torch::zeros({8 << 20}));  // 32 MiB
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fc->forward(x.flatten(1)) + big.sum() * 1e-3; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor big;
};

void register_models() {
  static const bool once = [] {
    models::register_model("wide_bn_mlp",
                           [](const ModelConfig& c) {
                             auto m = std::make_shared<WideMlp>(c);
                             m->bn = m->register_module("bn", torch::nn::BatchNorm1d(2048));
                             return m;
                           },
                           "wide_mlp with BatchNorm after the first layer");
    models::register_model("heavy_params", [](const ModelConfig& c) { return std::make_shared<HeavyParams>(c); },
                           "a linear layer next to one 32 MiB parameter");
    models::register_model("wide_mlp", [](const ModelConfig& c) { return std::make_shared<WideMlp>(c); },
                           "wide two-layer MLP for the out-of-memory tests");
    models::register_model("poisoned_mlp", [](const ModelConfig& c) { return std::make_shared<PoisonedMlp>(c); },
                           "MLP that turns chosen forward passes into NaN");
    return true;
  }();
  (void)once;
}

void poison(int from, int to) {
  g_forward_calls = 0;
  g_nan_from = from;
  g_nan_to = to;
}

Config config_for(const std::string& model, std::vector<std::string> sets) {
  register_models();
  return parse_config("model: {name: " + model + ", in_channels: 1, num_classes: 10}\n"
                      "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 256,"
                      " synthetic_val_samples: 64, workers: 0}\n"
                      "optim: {name: sgd, lr: 0.05, momentum: 0.9}\n"
                      "schedule: {name: constant}\n"
                      "trainer: {global_batch: 32, max_steps: 4, device: cpu, threads: 1}\n"
                      "logging: {every_steps: 1000}\n",
                      "fault_test.yaml", sets);
}

std::vector<torch::Tensor> snapshot(Trainer& trainer) {
  std::vector<torch::Tensor> out;
  for (const auto& p : trainer.model().parameters()) out.push_back(p.detach().clone());
  return out;
}

bool identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

struct OomRun {
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> buffers;
  int64_t peak = 0;
  FitResult result;
  Plan plan;
  std::vector<std::pair<int64_t, int64_t>> events;
};

// Trains under a CPU memory limit (0 = none) and reports the peak the counter saw.
OomRun run_limited(const Config& config, int64_t limit) {
  torch::manual_seed(0);
  RunParts run = prepare_run(config);
  OomRun out;
  {
    CpuMemoryCounter counter(limit);
    Trainer trainer(config, run.plan, run.model, run.train, nullptr, "");
    trainer.on_out_of_memory([&](int64_t failed, int64_t next) { out.events.emplace_back(failed, next); });
    out.result = trainer.fit();
    out.peak = counter.peak_bytes();
    out.params = snapshot(trainer);
    for (const auto& b : trainer.model().buffers()) out.buffers.push_back(b.detach().clone());
    out.plan = trainer.plan();
  }
  return out;
}

std::string temp_dir(const std::string& name) { return files::make_temp_directory("train_fault_" + name + "_"); }

}  // namespace

TEST_CASE("out of memory: the micro-batch halves, the global batch stays, the step is redone with the same samples",
          "[fault][oom]") {
  // Without momentum every step has the same peak, so the first one runs out.
  const Config whole = config_for("wide_mlp", {"tuning.micro_batch=32", "optim.momentum=0"});
  const Config halves = config_for("wide_mlp", {"tuning.micro_batch=16", "optim.momentum=0"});
  const OomRun big = run_limited(whole, 0);
  const OomRun small = run_limited(halves, 0);
  REQUIRE(big.plan.micro_batch == 32);
  REQUIRE(small.plan.accum_steps == 2);
  // The limit lies between the two peaks: micro-batch 32 cannot run, 16 can.
  INFO("peak at 32: " << big.peak << " bytes, at 16: " << small.peak);
  REQUIRE(big.peak > small.peak + small.peak / 20);
  const int64_t limit = (big.peak + small.peak) / 2;

  const OomRun recovered = run_limited(whole, limit);
  CHECK(recovered.result.oom_recoveries == 1);
  CHECK(recovered.result.steps == 4);
  CHECK(recovered.plan.micro_batch == 16);
  CHECK(recovered.plan.accum_steps == 2);
  CHECK(recovered.plan.global_batch == 32);
  REQUIRE(recovered.events.size() == 1);
  CHECK(recovered.events[0] == std::make_pair<int64_t, int64_t>(32, 16));
  // Nothing lost, nothing repeated: bit for bit the run that used micro-batch 16 from the start.
  CHECK(identical(recovered.params, small.params));
  CHECK(!identical(recovered.params, big.params));  // (the two runs differ in summation order)

  SECTION("with tuning.oom_recovery off it is an error naming the micro-batch") {
    const Config off = config_for("wide_mlp", {"tuning.micro_batch=32", "optim.momentum=0", "tuning.oom_recovery=false"});
    try {
      run_limited(off, limit);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("out of memory in step 1 at micro-batch 32"));
      CHECK_THAT(e.what(), Catch::Contains("tuning.oom_recovery is off"));
    }
  }
  SECTION("when even micro-batch 1 does not fit, the error says so") {
    try {
      run_limited(whole, small.peak / 4);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("at micro-batch 1"));
    }
  }
}

TEST_CASE("out of memory with BatchNorm: the redone step counts its batch statistics once", "[fault][oom]") {
  // The micro-batch of 32 gets through BatchNorm (which updates the running statistics) before it
  // runs out; the redone step must start from the statistics as they were.
  const Config whole = config_for("wide_bn_mlp", {"tuning.micro_batch=32", "optim.momentum=0"});
  const OomRun big = run_limited(whole, 0);
  const OomRun small = run_limited(config_for("wide_bn_mlp", {"tuning.micro_batch=16", "optim.momentum=0"}), 0);
  REQUIRE(big.peak > small.peak + small.peak / 20);
  const OomRun recovered = run_limited(whole, (big.peak + small.peak) / 2);
  REQUIRE(recovered.result.oom_recoveries == 1);
  REQUIRE(recovered.buffers.size() == 3);  // running mean, running variance, batches tracked
  CHECK(identical(recovered.params, small.params));
  CHECK(identical(recovered.buffers, small.buffers));
  CHECK(!identical(recovered.buffers, big.buffers));
}

TEST_CASE("is_out_of_memory: the allocators' failures, not other LibTorch errors", "[fault][oom]") {
  const auto caught = [](auto&& f) -> std::exception_ptr {
    try {
      f();
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  };
  const auto classify = [](const std::exception_ptr& p) {
    REQUIRE(p);
    try {
      std::rethrow_exception(p);
    } catch (const std::exception& e) {
      return is_out_of_memory(e);
    }
  };
  const auto error = [](const std::string& message) {
    return std::make_exception_ptr(c10::Error(c10::SourceLocation{"f", "file.cpp", 1}, message));
  };
  // The CPU allocator, for real: more bytes than the address space.
  const auto cpu = caught([] { (void)torch::empty({int64_t{1} << 50}, torch::kByte); });
  REQUIRE(cpu);
  CHECK(classify(cpu));
  CHECK(classify(std::make_exception_ptr(c10::OutOfMemoryError(c10::SourceLocation{"f", "file.cpp", 1},
                                                                "CUDA out of memory. Tried to allocate 2.00 GiB"))));
  // Messages LibTorch gives when a CUDA allocation outside its caching allocator fails.
  CHECK(classify(error("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")));
  CHECK(classify(error("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")));
  CHECK(classify(error("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")));
  // Not memory: a shape error, an NCCL failure (its communicator is not trusted again), and an
  // exception that is not LibTorch's.
  CHECK_FALSE(classify(caught([] { (void)torch::matmul(torch::ones({2, 3}), torch::ones({2, 3})); })));
  CHECK_FALSE(classify(error("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error, NCCL version 2.28.9 "
                             "Last error: Cuda failure 'out of memory'")));
  CHECK_FALSE(classify(std::make_exception_ptr(std::runtime_error("out of memory"))));
}

TEST_CASE("a CPU allocation that fails as a plain LibTorch error is recovered like the GPU's out-of-memory error",
          "[fault][oom]") {
  const Config whole = config_for("wide_mlp", {"tuning.micro_batch=32", "optim.momentum=0"});
  const OomRun small = run_limited(config_for("wide_mlp", {"tuning.micro_batch=16", "optim.momentum=0"}), 0);
  SECTION("an allocation failure halves the micro-batch and redoes the step") {
    FailAbove fail(16, false);
    const OomRun recovered = run_limited(whole, 0);
    CHECK(recovered.result.oom_recoveries == 1);
    CHECK(recovered.plan.micro_batch == 16);
    CHECK(recovered.plan.global_batch == 32);
    CHECK(identical(recovered.params, small.params));
  }
  SECTION("any other LibTorch error ends the run as before") {
    FailAbove fail(16, true);
    CHECK_THROWS_AS(run_limited(whole, 0), c10::Error);
  }
}

TEST_CASE("out of memory in the optimizer step ends the run with what a smaller micro-batch cannot change",
          "[fault][oom]") {
  // AdamW's first step allocates two 32 MiB state tensors next to the 32 MiB gradient: a limit of
  // 80 MiB above the start lets the forward and backward passes run and not the step.
  const Config c = config_for("heavy_params", {"optim.name=adamw", "optim.lr=0.001", "tuning.micro_batch=32"});
  try {
    run_limited(c, int64_t{80} << 20);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("out of memory in the optimizer step of step 1"));
    CHECK_THAT(e.what(), Catch::Contains("A smaller micro-batch does not shrink this part"));
    CHECK_THAT(e.what(), Catch::Contains("0.031 GiB of parameters"));
    CHECK_THAT(e.what(), Catch::Contains("(adamw)"));
    CHECK(e.exit_code() == kExitRuntime);
  }
  // With room for the state the same run trains.
  CHECK(run_limited(c, 0).result.steps == 4);
}

TEST_CASE("out of memory mid-run: checkpoints written after the change resume at the new micro-batch",
          "[fault][oom][resume]") {
  const Config whole = config_for("wide_mlp", {"tuning.micro_batch=32", "trainer.max_steps=6",
                                               "checkpoint.every_steps=2"});
  const Config halves = config_for("wide_mlp", {"tuning.micro_batch=16", "trainer.max_steps=6"});
  const OomRun big = run_limited(config_for("wide_mlp", {"tuning.micro_batch=32"}), 0);
  const OomRun small = run_limited(halves, 0);
  const int64_t limit = (big.peak + small.peak) / 2;

  const std::string dir = temp_dir("oom_resume");
  torch::manual_seed(0);
  RunParts run = prepare_run(whole);
  {
    CpuMemoryCounter counter(limit);
    Trainer trainer(whole, run.plan, run.model, run.train, nullptr, dir);
    const FitResult r = trainer.fit();
    CHECK(r.oom_recoveries == 1);
  }
  // A fresh process plans micro-batch 32 again (no cache here); the checkpoint's position is in
  // micro-batches of 16 and must be converted, not misread.
  torch::manual_seed(0);
  RunParts again = prepare_run(whole);
  Trainer resumed(whole, again.plan, again.model, again.train, nullptr, dir);
  const std::string ckpt = checkpoint_path(files::join(dir, "checkpoints"), 4);
  REQUIRE(files::exists(ckpt));
  resumed.fit(ckpt);  // no limit now: steps 5 and 6 at micro-batch 32
  const OomRun reference = run_limited(halves, 0);
  // Same samples in steps 5-6; only the micro-batch split (summation order) differs.
  const auto got = snapshot(resumed);
  REQUIRE(got.size() == reference.params.size());
  for (size_t i = 0; i < got.size(); ++i) CHECK(torch::allclose(got[i], reference.params[i], 1e-5, 1e-6));
  files::remove_all(dir);
}

TEST_CASE("non-finite loss, on_nonfinite stop: exit 1 naming the step and the first bad gradient, weights untouched",
          "[fault][nonfinite]") {
  const Config config = config_for("poisoned_mlp", {});
  poison(1000, 1000);
  const OomRun two = run_limited(config_for("poisoned_mlp", {"trainer.max_steps=2"}), 0);

  torch::manual_seed(0);
  RunParts run = prepare_run(config);
  poison(3, 3);  // the third step's forward
  Trainer trainer(config, run.plan, run.model, run.train, nullptr, "");
  try {
    trainer.fit();
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitRuntime);
    CHECK_THAT(e.what(), Catch::Contains("the loss is nan at step 3"));
    CHECK_THAT(e.what(), Catch::Contains("fc1.weight"));  // registration order: fc1 comes first
    CHECK_THAT(e.what(), Catch::Contains("weights are still those after step 2"));
    CHECK_THAT(e.what(), Catch::Contains("trainer.on_nonfinite: rollback"));
  }
  CHECK(identical(snapshot(trainer), two.params));
}

TEST_CASE("non-finite loss, on_nonfinite rollback: back to the newest checkpoint, the batch skipped, training goes on",
          "[fault][nonfinite]") {
  const std::string dir = temp_dir("rollback");
  const Config config = config_for("poisoned_mlp", {"trainer.max_steps=6", "checkpoint.every_steps=2",
                                                    "trainer.on_nonfinite=rollback", "logging.every_steps=1"});
  torch::manual_seed(0);
  RunParts run = prepare_run(config);
  poison(4, 4);  // step 4; the newest checkpoint is step 2
  {
    Trainer trainer(config, run.plan, run.model, run.train, nullptr, dir);
    const FitResult r = trainer.fit();
    CHECK(r.rollbacks == 1);
    CHECK(r.steps == 6);
    for (const auto& p : snapshot(trainer)) CHECK(p.isfinite().all().item<bool>());
    // Steps 3 and 4 after the rollback were called as forward passes 5 and 6 (4 was poisoned); the
    // skipped batch is the one at samples 96..127 of epoch 0 (step 4 = the 4th of 32 samples each).
    CHECK(g_forward_calls == 4 + 4);  // 4 before the rollback, then steps 3..6 again
  }
  // metrics.jsonl holds each step once, in order: step 3 as logged before the rollback went with it.
  {
    std::ifstream in(files::join(dir, "metrics.jsonl"));
    std::vector<int64_t> steps;
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"split\":\"train\"") != std::string::npos) steps.push_back(std::stoll(line.substr(8)));
    }
    CHECK(steps == std::vector<int64_t>{1, 2, 3, 4, 5, 6});
  }
  // The skip list is in the checkpoints, so a resumed run skips the same batch.
  TrainState st;
  {
    torch::manual_seed(0);
    RunParts probe = prepare_run(config);
    st = load_checkpoint(checkpoint_path(files::join(dir, "checkpoints"), 6), *probe.model, nullptr);
  }
  REQUIRE(st.tensors.count("trainer/bad_steps") == 1);
  const auto bad = st.tensors.at("trainer/bad_steps");
  CHECK(bad.size(0) == 1);
  CHECK(bad[0][0].item<int64_t>() == 0);
  CHECK(bad[0][1].item<int64_t>() == 96);

  SECTION("a loss that stays non-finite stops after trainer.max_rollbacks") {
    const std::string dir2 = temp_dir("rollback_max");
    const Config stubborn = config_for("poisoned_mlp", {"trainer.max_steps=6", "checkpoint.every_steps=1",
                                                        "trainer.on_nonfinite=rollback", "trainer.max_rollbacks=2"});
    torch::manual_seed(0);
    RunParts r2 = prepare_run(stubborn);
    poison(3, 1000);  // after prepare_run: its memory probe runs forward passes too
    Trainer t2(stubborn, r2.plan, r2.model, r2.train, nullptr, dir2);
    CHECK_THROWS_WITH(t2.fit(), Catch::Contains("trainer.max_rollbacks (2) reached"));
    files::remove_all(dir2);
  }
  SECTION("without a checkpoint there is nothing to roll back to") {
    const Config nodir = config_for("poisoned_mlp", {"trainer.on_nonfinite=rollback"});
    torch::manual_seed(0);
    RunParts r3 = prepare_run(nodir);
    poison(2, 2);  // after prepare_run: its memory probe runs forward passes too
    Trainer t3(nodir, r3.plan, r3.model, r3.train, nullptr, "");
    CHECK_THROWS_WITH(t3.fit(), Catch::Contains("no checkpoint to roll back to"));
  }
  poison(1000, 1000);
  files::remove_all(dir);
}

TEST_CASE("on_nonfinite rollback to a checkpoint whose evaluation a stop put off does not put it off again",
          "[fault][nonfinite][resume]") {
  const std::string dir = temp_dir("rollback_pending");
  // 64 validation samples in one batch: an evaluation is one forward pass.
  const Config config = config_for("poisoned_mlp", {"trainer.max_steps=3", "checkpoint.every_steps=1",
                                                    "trainer.eval_every_steps=1", "trainer.eval_batch=64",
                                                    "trainer.on_nonfinite=rollback"});
  poison(1000, 1000);
  {
    torch::manual_seed(0);
    RunParts run = prepare_run(config);
    Trainer t(config, run.plan, run.model, run.train, run.val, dir);
    t.request_stop();  // stops after step 1; its evaluation is put off, in the step-1 checkpoint
    REQUIRE(t.fit().steps == 1);
  }
  // Resumed: the put-off evaluation (forward 1), step 2 (forward 2, poisoned) rolls back to the
  // step-1 checkpoint, then steps 2 and 3 with their evaluations.
  {
    torch::manual_seed(0);
    RunParts run = prepare_run(config);
    poison(2, 2);  // after prepare_run: its memory probe runs forward passes too
    Trainer t(config, run.plan, run.model, run.train, run.val, dir);
    const FitResult r = t.fit("auto");
    CHECK(r.rollbacks == 1);
    CHECK(r.steps == 3);
  }
  poison(1000, 1000);
  // The evaluation was done once; nothing is pending in the checkpoints written after the rollback.
  TrainState st;
  {
    torch::manual_seed(0);
    RunParts probe = prepare_run(config);
    st = load_checkpoint(checkpoint_path(files::join(dir, "checkpoints"), 3), *probe.model, nullptr);
  }
  CHECK(st.tensors.count("trainer/eval_pending") == 0);
  files::remove_all(dir);
}

TEST_CASE("data.on_error skip: a sample in a step redone after a rollback counts once", "[fault][nonfinite][data]") {
  const std::string dir = temp_dir("rollback_skip");
  const Config config = config_for("poisoned_mlp", {"trainer.max_steps=6", "checkpoint.every_steps=2",
                                                    "trainer.on_nonfinite=rollback", "data.on_error=skip",
                                                    "data.shuffle=false"});
  torch::manual_seed(0);
  RunParts run = prepare_run(config);
  poison(4, 4);  // step 4; back to the checkpoint of step 2, and step 3 (samples 64..95) is redone
  {
    Trainer trainer(config, run.plan, run.model, std::make_shared<testing::BadSamples>(run.train, std::set<int64_t>{70}),
                    nullptr, dir);
    const FitResult r = trainer.fit();
    CHECK(r.rollbacks == 1);
    CHECK(r.steps == 6);
    CHECK(r.skipped_samples == 1);
  }
  poison(1000, 1000);
  files::remove_all(dir);
}

TEST_CASE("data.on_error skip: a resumed run counts the samples replaced before its checkpoint",
          "[fault][data][resume]") {
  // 8 steps of 32 per epoch, in order: samples 5, 70 (before the step-4 checkpoint) and 200 in epoch
  // 0, then 5 and 70 again in epoch 1's first 4 steps; 5 in all.
  const Config config = config_for("poisoned_mlp", {"trainer.max_steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=5",
                                                    "data.on_error=skip", "data.shuffle=false"});
  poison(1000, 1000);
  const std::set<int64_t> bad = {5, 70, 200};
  const std::string dir_a = temp_dir("skip_resume_a"), dir_b = temp_dir("skip_resume_b");
  torch::manual_seed(0);
  RunParts run = prepare_run(config);
  FitResult uninterrupted;
  {
    Trainer trainer(config, run.plan, run.model, std::make_shared<testing::BadSamples>(run.train, bad), nullptr, dir_a);
    uninterrupted = trainer.fit();
  }
  CHECK(uninterrupted.skipped_samples == 5);

  const std::string step4 = checkpoint_path(files::join(dir_a, "checkpoints"), 4);
  auto resume = [&](const std::string& checkpoint) {
    files::remove_all(dir_b);
    files::make_directories(files::join(dir_b, "checkpoints"));
    const std::string copy = checkpoint_path(files::join(dir_b, "checkpoints"), 4);
    files::copy_file(checkpoint, copy);
    torch::manual_seed(0);
    RunParts again = prepare_run(config);
    Trainer trainer(config, again.plan, again.model, std::make_shared<testing::BadSamples>(again.train, bad), nullptr,
                    dir_b);
    return trainer.fit(copy);
  };
  const FitResult resumed = resume(step4);
  CHECK(resumed.resumed_from_step == 4);
  CHECK(resumed.steps == 12);
  CHECK(resumed.skipped_samples == uninterrupted.skipped_samples);

  // A checkpoint written before the count was saved still loads; it counts from the resume.
  {
    RunParts scratch = prepare_run(config);
    auto optimizer = make_optimizer(config.optim, *scratch.model, run.plan.lr);
    TrainState st = load_checkpoint(step4, *scratch.model, optimizer.get());
    REQUIRE(st.tensors.count("trainer/skipped_samples") == 1);
    CHECK(st.tensors.at("trainer/skipped_samples").size(0) == 2);  // (rank, epoch, index) of 5 and 70
    st.tensors.erase("trainer/skipped_samples");
    const std::string older = files::join(dir_a, "older.pt");
    save_checkpoint(older, *scratch.model, optimizer.get(), st);
    CHECK(resume(older).skipped_samples == 3);
  }
  files::remove_all(dir_a);
  files::remove_all(dir_b);
}

TEST_CASE("out of memory: the plan cache remembers the micro-batch that fits for the next run", "[fault][oom][plan]") {
  const std::string cache = temp_dir("oom_cache");
  const Config config = config_for("wide_mlp", {"tuning.cache_dir=" + cache});
  RunParts first = prepare_run(config);
  REQUIRE(first.plan.micro_batch == 32);  // the whole batch in one pass on a CPU
  REQUIRE(first.record_oom);
  first.record_oom(32, 16);  // what the trainer reports after recovering

  RunParts second = prepare_run(config);
  CHECK(second.plan.micro_batch == 16);
  CHECK(second.plan.accum_steps == 2);
  CHECK(second.plan.global_batch == 32);
  CHECK_THAT(second.plan.to_text(), Catch::Contains("out of memory at micro-batch 32 during training"));
  // Recorded again from a plan that read the cache: stored as measured, said once to come from it.
  REQUIRE(second.record_oom);
  second.record_oom(16, 8);
  RunParts third = prepare_run(config);
  CHECK(third.plan.micro_batch == 8);
  const std::string& source = third.plan.memory.source;
  CAPTURE(source);
  CHECK(source.rfind("plan cache ", 0) == 0);
  CHECK(source.find("plan cache ", 1) == std::string::npos);
  CHECK_THAT(source, Catch::Contains("out of memory at micro-batch 16 during training"));

  // A micro-batch fixed in the config is the user's choice: nothing is recorded.
  RunParts fixed = prepare_run(config_for("wide_mlp", {"tuning.cache_dir=" + cache, "tuning.micro_batch=8"}));
  CHECK(!fixed.record_oom);
  files::remove_all(cache);
}
