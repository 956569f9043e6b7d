// The training step captured in a CUDA graph (tuning.cuda_graphs): replaying it trains like the
// eager step, a non-finite loss inside a replay leaves the weights alone, a rollback captures
// again, and a model whose forward waits for the GPU falls back to eager steps. GPU only; the
// plan's rules and the optimizer's device-side LR and skip flag have CPU tests (test_plan.cpp,
// test_optim.cpp).
#include "testing.h"

#include <train/config.h>
#include <train/data/dataset.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/log.h>
#include <train/models/model.h>
#include <train/run.h>
#include <train/trainer.h>

#include <torch/version.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

using namespace train;

namespace {

// 3x16x16 images, a fixed pseudo-random one per index, 10 classes. The get() calls numbered
// [nan_from, nan_to) (in the order the loader makes them; workers 0 makes them in order) return
// NaN images: with 16 samples a step and nothing shuffled across calls, the batch of one chosen
// step.
class CountedImages : public data::Dataset {
 public:
  CountedImages(int64_t nan_from, int64_t nan_to) : nan_from_(nan_from), nan_to_(nan_to) {}
  int64_t size() const override { return 512; }
  data::Example get(int64_t index, uint64_t) const override {
    const int64_t call = calls_++;
    torch::Tensor image = torch::sin(torch::arange(768, torch::kFloat).reshape({3, 16, 16}) * (0.01 * (index + 1))) +
                          static_cast<double>(index % 10) / 5.0;
    if (call >= nan_from_ && call < nan_to_) image.fill_(std::numeric_limits<float>::quiet_NaN());
    return {image, torch::scalar_tensor(index % 10, torch::kLong)};
  }
  std::vector<int64_t> input_shape() const override { return {3, 16, 16}; }
  int64_t num_classes() const override { return 10; }
  std::string describe() const override { return "counted images"; }

 private:
  int64_t nan_from_, nan_to_;
  mutable std::atomic<int64_t> calls_{0};
};

// Says it can be captured, but its forward reads a value on the host.
class WaitingCnn : public models::Model {
 public:
  explicit WaitingCnn(const ModelConfig& c) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.in_channels, 8, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(8, c.num_classes));
  }
  bool capturable() const override { return true; }
  torch::Tensor forward(const torch::Tensor& x) override {
    torch::Tensor h = torch::relu(conv->forward(x)).mean({2, 3});
    if (h.abs().max().item<float>() > 1e30f) h = h * 0;  // never true: only the wait matters
    return fc->forward(h);
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};

void register_waiting_cnn() {
  static const bool once = [] {
    models::register_model("waiting_cnn", [](const ModelConfig& c) { return std::make_shared<WaitingCnn>(c); },
                           "a model that waits for the GPU in its forward (tests)");
    return true;
  }();
  (void)once;
}

// A capturable model with its own loss: the class index read as a number to regress.
class GraphRegressor : public models::Model {
 public:
  explicit GraphRegressor(const ModelConfig& c) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.in_channels, 8, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(8, 1));
  }
  bool capturable() const override { return true; }
  torch::Tensor forward(const torch::Tensor& x) override {
    return fc->forward(torch::relu(conv->forward(x)).mean({2, 3}));
  }
  bool has_own_loss() const override { return true; }
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override {
    return torch::mse_loss(output.squeeze(1).to(torch::kFloat), target.to(torch::kFloat));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};

void register_graph_regressor() {
  static const bool once = [] {
    models::register_model("graph_regressor", [](const ModelConfig& c) { return std::make_shared<GraphRegressor>(c); },
                           "a capturable model with its own loss (tests)");
    return true;
  }();
  (void)once;
}

// schedule: cosine gives a new LR every step, which a replay must read from the GPU; constant
// (after the same warmup) does not depend on the run's length, for runs of different lengths
// that must agree step for step.
Config graph_config(const std::string& model, const std::string& mode, int64_t max_steps,
                    const std::string& schedule = "cosine") {
  return parse_config(
      "model: {name: " + model + ", in_channels: 3, num_classes: 10, width: 0.25, small_input: true}\n"
      "data: {kind: custom, workers: 0}\n"
      // Momentum and weight decay: state the captured step reads and writes.
      "optim: {name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0005}\n"
      "schedule: {name: " + schedule + ", warmup_steps: 5}\n"
      "trainer: {global_batch: 16, max_steps: " + std::to_string(max_steps) + ", device: cuda, seed: 3}\n"
      "tuning: {micro_batch: 16, cuda_graphs: " + mode + "}\n"
      "precision: {mode: fp32, channels_last: on}\n"
      "logging: {every_steps: 5, tensorboard: false}\n",
      "graphs.yaml");
}

struct Outcome {
  FitResult result;
  std::vector<torch::Tensor> params, buffers;
  std::string log;
  std::string error;  // what fit() threw, if it did
};

Outcome train_with(const Config& c, const std::shared_ptr<CountedImages>& data, const std::string& run_dir = "") {
  RunOptions options;
  options.train_data = data;
  RunParts run = prepare_run(c, options);
  run.plan.cudnn_benchmark = false;  // the same convolution algorithms in every run
  apply_plan_globals(run.plan);
  at::globalContext().setDeterministicCuDNN(true);
  const std::string dir = files::make_temp_directory("train_graph_log_");
  const std::string path = files::join(dir, "captured.log");
  Outcome out;
  log::set_file(path);
  {
    Trainer trainer(c, run.plan, run.model, run.train, nullptr, run_dir);
    try {
      out.result = trainer.fit();
    } catch (const Error& e) {
      out.error = e.what();
    }
    for (const auto& p : trainer.model().parameters()) out.params.push_back(p.detach().cpu());
    for (const auto& b : trainer.model().buffers()) out.buffers.push_back(b.detach().cpu());
  }
  log::set_file("");
  std::ifstream in(path);
  out.log.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  files::remove_all(dir);
  return out;
}

void check_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double tolerance) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("tensor " << i << ", largest difference " << (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
    CHECK(torch::allclose(a[i].to(torch::kDouble), b[i].to(torch::kDouble), tolerance, tolerance));
  }
}

constexpr int64_t kNever = -1;

}  // namespace

TEST_CASE("cuda: a training step replayed from a CUDA graph trains like the eager step", "[cuda][graphs]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: CUDA graphs are checked by scripts/gpu-check on a GPU machine");
  const Config eager_config = graph_config("resnet18", "off", 30);
  const Config graph_on = graph_config("resnet18", "on", 30);
  const Outcome eager = train_with(eager_config, std::make_shared<CountedImages>(kNever, kNever));
  const Outcome graphed = train_with(graph_on, std::make_shared<CountedImages>(kNever, kNever));
  CHECK(eager.result.graph_replays == 0);
  // Two eager steps, one on the capture stream, the capture (replayed at once), then replays.
  CHECK(graphed.result.graph_replays == 27);
  CHECK_THAT(graphed.log, Catch::Contains("cuda_graphs: captured the training step"));
  CHECK(graphed.result.steps == 30);
  check_close(eager.params, graphed.params, 1e-5);
  check_close(eager.buffers, graphed.buffers, 1e-5);  // BatchNorm's running statistics
  CHECK(graphed.result.train_loss == Approx(eager.result.train_loss).epsilon(1e-4));

  // Fused AdamW: its step count advanced on the GPU inside the graph (bias corrections), and the
  // gradients clipped there.
  if (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)) {
    Config adamw_eager = eager_config, adamw_graph = graph_on;
    for (Config* k : {&adamw_eager, &adamw_graph}) {
      k->optim.name = "adamw";
      k->optim.lr = 0.003;
      k->optim.weight_decay = 0.05;
      k->optim.clip_grad_norm = 0.5;  // in the graph: clipped on the device; eager: on the host
    }
    const Outcome a_eager = train_with(adamw_eager, std::make_shared<CountedImages>(kNever, kNever));
    const Outcome a_graph = train_with(adamw_graph, std::make_shared<CountedImages>(kNever, kNever));
    CHECK(a_graph.result.graph_replays == 27);
    check_close(a_eager.params, a_graph.params, 1e-5);
  }

  // auto: timed against the eager step and kept or dropped, and the weights the same either way.
  const Outcome measured = train_with(graph_config("resnet18", "auto", 30), std::make_shared<CountedImages>(kNever, kNever));
  const bool kept = measured.log.find("cuda_graphs: kept (median step") != std::string::npos;
  const bool dropped = measured.log.find("cuda_graphs: dropped, replaying gains less than") != std::string::npos;
  INFO(measured.log);
  CHECK(kept != dropped);
  // 2 + 5 eager steps, 1 on the capture stream, the capture, 5 timed replays, and on if kept.
  CHECK(measured.result.graph_replays == (kept ? 22 : 6));
  check_close(eager.params, measured.params, 1e-5);
}

TEST_CASE("cuda: a non-finite loss in a replayed step changes no weight and a rollback captures again",
          "[cuda][graphs]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: CUDA graphs are checked by scripts/gpu-check on a GPU machine");
  // The 11th batch (get() calls 160 to 175) is NaN: step 11, long after the capture at step 4.
  const Outcome ten =
      train_with(graph_config("resnet18", "on", 10, "constant"), std::make_shared<CountedImages>(kNever, kNever));
  SECTION("on_nonfinite stop: the error says the weights are those after step 10, and they are") {
    const Outcome stopped =
        train_with(graph_config("resnet18", "on", 30, "constant"), std::make_shared<CountedImages>(160, 176));
    CHECK_THAT(stopped.error, Catch::Contains("the loss is nan at step 11"));
    CHECK_THAT(stopped.error, Catch::Contains("The weights are still those after step 10"));
    // Two runs: cuBLAS on the graph's pool streams need not be bitwise reproducible, and any
    // update the NaN step made would be NaN or of lr x gradient's size, far above 1e-6.
    check_close(ten.params, stopped.params, 1e-6);
  }
  SECTION("on_nonfinite rollback: back to step 10's checkpoint, the batch skipped, the step captured again") {
    const std::string dir = files::make_temp_directory("train_graph_rollback_");
    Config c = graph_config("resnet18", "on", 30);
    c.trainer.on_nonfinite = "rollback";
    c.checkpoint.every_steps = 5;
    const Outcome rolled = train_with(c, std::make_shared<CountedImages>(160, 176), dir);
    INFO(rolled.log);
    CHECK(rolled.error.empty());
    CHECK(rolled.result.rollbacks == 1);
    CHECK(rolled.result.steps == 30);
    CHECK_THAT(rolled.log, Catch::Contains("cuda_graphs: rolled back to a checkpoint; the step is captured again"));
    // Steps 4 to 11 replayed (11 with the NaN batch), then from step 10's checkpoint: 2 eager
    // steps, 1 on the capture stream, and steps 14 to 30 replayed.
    CHECK(rolled.result.graph_replays == 8 + 17);
    for (const auto& p : rolled.params) CHECK(p.isfinite().all().item<bool>());
    files::remove_all(dir);
  }
}

TEST_CASE("cuda: a model that waits for the GPU in its forward fails to capture and trains on eagerly",
          "[cuda][graphs]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: CUDA graphs are checked by scripts/gpu-check on a GPU machine");
  register_waiting_cnn();
  const Outcome eager = train_with(graph_config("waiting_cnn", "off", 12), std::make_shared<CountedImages>(kNever, kNever));
  const Outcome tried = train_with(graph_config("waiting_cnn", "on", 12), std::make_shared<CountedImages>(kNever, kNever));
  INFO(tried.log);
  CHECK(tried.error.empty());
  CHECK_THAT(tried.log, Catch::Contains("cuda_graphs: capturing the training step failed"));
  CHECK(tried.result.graph_replays == 0);
  CHECK(tried.result.steps == 12);
  check_close(eager.params, tried.params, 1e-5);

  // The failed capture left nothing behind. The default CUDA generator is out of capture mode:
  // eager dropout draws new masks (a generator left capturing would fail, or repeat the graph's
  // offsets). And the allocator's routing to the graph's pool is gone: the next capture works.
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  torch::Tensor first, second;
  REQUIRE_NOTHROW(first = torch::dropout(torch::ones({4096}, cuda), 0.5, true));
  REQUIRE_NOTHROW(second = torch::dropout(torch::ones({4096}, cuda), 0.5, true));
  CHECK_FALSE(first.equal(second));
  const Outcome next = train_with(graph_config("resnet18", "on", 8), std::make_shared<CountedImages>(kNever, kNever));
  INFO(next.log);
  CHECK(next.error.empty());
  CHECK(next.result.graph_replays == 5);  // 2 eager, 1 on the capture stream, then the capture and replays
}

TEST_CASE("cuda: a model with its own loss is captured and replays like its eager steps", "[cuda][graphs]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: CUDA graphs are checked by scripts/gpu-check on a GPU machine");
  register_graph_regressor();
  const Outcome eager = train_with(graph_config("graph_regressor", "off", 20), std::make_shared<CountedImages>(kNever, kNever));
  const Outcome graphed = train_with(graph_config("graph_regressor", "on", 20), std::make_shared<CountedImages>(kNever, kNever));
  INFO(graphed.log);
  CHECK(eager.error.empty());
  CHECK(graphed.error.empty());
  CHECK(graphed.result.graph_replays == 17);
  check_close(eager.params, graphed.params, 1e-5);
  CHECK(graphed.result.train_loss == Approx(eager.result.train_loss).epsilon(1e-4));
}
