#include "testing.h"

#include <c10/core/CPUAllocator.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "train/amp.h"
#include "train/config.h"
#include "train/errors.h"
#include "train/models/model.h"
#include "train/probe.h"

using namespace train;

namespace {

ProbePoint memory_point(int64_t batch, int64_t peak_bytes) {
  ProbePoint p;
  p.batch = batch;
  p.peak_bytes = peak_bytes;
  return p;
}

ProbePoint oom_point(int64_t batch) {
  ProbePoint p;
  p.batch = batch;
  p.oom = true;
  return p;
}

ProbePoint timed_point(int64_t batch, double seconds_per_step) {
  ProbePoint p;
  p.batch = batch;
  p.seconds_per_step = seconds_per_step;
  return p;
}

// ResNet-18 at 1/8 width (base 8 channels) with the small-input stem: 1x16x16 images.
models::ModelPtr small_resnet() {
  ModelConfig config;
  config.name = "resnet18";
  config.num_classes = 10;
  config.in_channels = 1;
  config.width = 0.125;
  config.small_input = true;
  return models::make_model(config);
}

ProbeOptions small_resnet_options(const std::string& device) {
  ProbeOptions options;
  options.input_shape = {1, 16, 16};
  options.num_classes = 10;
  options.device = device;
  options.optim.name = "sgd";
  options.optim.momentum = 0.9;
  return options;
}

double relative_error(double predicted, double measured) { return std::abs(predicted - measured) / measured; }

// Every parameter and buffer with its storage address and gradient, to show that the probe left
// the model exactly as it found it.
struct ModelSnapshot {
  std::vector<torch::Tensor> values, grads;
  std::vector<const void*> storage;

  explicit ModelSnapshot(torch::nn::Module& model) {
    for (const auto& t : model.parameters()) add(t);
    for (const auto& t : model.buffers()) add(t);
  }
  void add(const torch::Tensor& t) {
    values.push_back(t.detach().clone());
    grads.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
    storage.push_back(t.data_ptr());
  }
  bool operator==(const ModelSnapshot& other) const {
    if (values.size() != other.values.size()) return false;
    for (size_t i = 0; i < values.size(); ++i) {
      if (storage[i] != other.storage[i] || values[i].device() != other.values[i].device() ||
          values[i].strides() != other.values[i].strides() || !torch::equal(values[i], other.values[i]) ||
          grads[i].defined() != other.grads[i].defined() ||
          (grads[i].defined() && !torch::equal(grads[i], other.grads[i]))) {
        return false;
      }
    }
    return true;
  }
};

}  // namespace

TEST_CASE("fit_memory recovers an exact line, and predict and max_batch agree with it", "[probe]") {
  const int64_t fixed = 3'000'000, per_sample = 12'345;
  const MemoryFit fit = fit_memory({memory_point(4, fixed + 4 * per_sample), memory_point(8, fixed + 8 * per_sample),
                                    memory_point(16, fixed + 16 * per_sample)});
  CHECK(fit.measured());
  CHECK(fit.fixed_bytes == fixed);
  CHECK(fit.per_sample_bytes == Approx(per_sample).epsilon(1e-12));
  CHECK(fit.points.size() == 3);
  CHECK(fit.predict(100) == fixed + 100 * per_sample);

  CHECK(fit.max_batch(fixed + 20 * per_sample) == 20);
  CHECK(fit.max_batch(fixed + 20 * per_sample - 1) == 19);
  CHECK(fit.max_batch(fixed + per_sample) == 1);
  CHECK(fit.max_batch(fixed + per_sample - 1) == 0);
  CHECK(fit.max_batch(fixed - 1) == 0);  // the budget does not even hold the fixed part
  CHECK(fit.max_batch(0) == 0);
}

TEST_CASE("fit_memory ignores out-of-memory points, and max_batch stays below them", "[probe]") {
  const MemoryFit fit = fit_memory({memory_point(8, 1000 + 8 * 100), oom_point(64), memory_point(16, 1000 + 16 * 100),
                                    oom_point(128)});
  CHECK(fit.fixed_bytes == 1000);
  CHECK(fit.per_sample_bytes == Approx(100));
  CHECK(fit.max_batch(1000 + 40 * 100) == 40);
  CHECK(fit.max_batch(1'000'000'000) == 63);  // the line says more fits, but 64 ran out of memory

  const MemoryFit single = fit_memory({memory_point(10, 5000)});  // one size: a line through the origin
  CHECK(single.fixed_bytes == 0);
  CHECK(single.per_sample_bytes == Approx(500));
  CHECK(single.max_batch(5000) == 10);

  const MemoryFit nothing = fit_memory({oom_point(4)});
  CHECK_FALSE(nothing.measured());
  CHECK(nothing.max_batch(1'000'000'000) == 0);
  CHECK(fit_memory({}).max_batch(1'000'000'000) == 0);
}

TEST_CASE("choose_by_throughput stops when doubling gains less than 5%", "[probe]") {
  // samples/s: 8 -> 80, 16 -> 160 (+100%), 32 -> 164 (+2.6%: stop), 64 -> 320 (never reached)
  const std::vector<ProbePoint> points{timed_point(8, 0.1), timed_point(16, 0.1), timed_point(32, 0.195),
                                       timed_point(64, 0.2)};
  CHECK(choose_by_throughput(points) == 16);
  CHECK(choose_by_throughput(points, 0.01) == 64);  // +2.6% clears a 1% bar, and 64 doubles again

  // Exactly +5% is enough to keep doubling; out-of-memory points and the input order do not matter.
  const std::vector<ProbePoint> mixed{oom_point(64), timed_point(16, 16.0 / 105.0), timed_point(8, 0.1)};
  CHECK(choose_by_throughput(mixed) == 16);
  CHECK(choose_by_throughput({oom_point(8)}) == 0);
  CHECK(choose_by_throughput({}) == 0);
}

TEST_CASE("CpuMemoryCounter counts CPU tensors while alive and restores the allocator", "[probe]") {
  c10::Allocator* const before = c10::GetCPUAllocator();
  torch::Tensor outlives_counter;
  {
    CpuMemoryCounter counter;
    CHECK(c10::GetCPUAllocator() != before);
    CHECK_THROWS_AS(CpuMemoryCounter(), std::logic_error);  // one at a time

    auto mebibyte = torch::ones({256 * 1024});  // float32: 1 MiB
    CHECK(counter.live_bytes() >= 1024 * 1024);
    mebibyte = torch::Tensor();
    CHECK(counter.live_bytes() < 1024 * 1024);
    CHECK(counter.peak_bytes() >= 1024 * 1024);
    counter.reset_peak();
    CHECK(counter.peak_bytes() == counter.live_bytes());

    outlives_counter = torch::ones({1000});
  }
  CHECK(c10::GetCPUAllocator() == before);

  CpuMemoryCounter next;
  const int64_t start = next.live_bytes();
  outlives_counter = torch::Tensor();  // freed through the first counter's deleter, not counted here
  CHECK(next.live_bytes() == start);
  const auto counted = torch::ones({1000});
  CHECK(next.live_bytes() == start + 4000);
}

TEST_CASE("probe_memory on the CPU predicts the peak at a larger batch within 20%", "[probe]") {
  auto model = small_resnet();
  const ProbeOptions options = small_resnet_options("cpu");

  // The plan probes 4 and 8; 16 is measured in the same call so that everything the first step
  // creates and keeps (oneDNN, cuBLAS workspaces) counts in all three points alike.
  const MemoryFit probed = probe_memory(*model, options, {4, 8, 16});
  REQUIRE(probed.points.size() == 3);
  for (const ProbePoint& p : probed.points) {
    CHECK_FALSE(p.oom);
    CHECK(p.peak_bytes > 0);
  }
  const MemoryFit fit = fit_memory({probed.points[0], probed.points[1]});
  CHECK(fit.points[1].peak_bytes > fit.points[0].peak_bytes);
  CHECK(fit.per_sample_bytes > 0);
  // The fixed part is the probe's copy of the parameters, their gradients and SGD's momentum, plus
  // workspaces (measured: 1.01x on LibTorch 2.11, 1.14x on 1.13).
  const double state_bytes = 3.0 * sizeof(float) * static_cast<double>(models::count_parameters(*model));
  CHECK(static_cast<double>(fit.fixed_bytes) > 0.95 * state_bytes);
  CHECK(static_cast<double>(fit.fixed_bytes) < 1.5 * state_bytes);

  const int64_t measured = probed.points[2].peak_bytes;
  const int64_t predicted = fit.predict(16);
  CAPTURE(fit.fixed_bytes, fit.per_sample_bytes, fit.points[0].peak_bytes, fit.points[1].peak_bytes, predicted,
          measured, relative_error(static_cast<double>(predicted), static_cast<double>(measured)));
  CHECK(relative_error(static_cast<double>(predicted), static_cast<double>(measured)) < 0.2);
}

TEST_CASE("probes leave the model, generator, autocast and CPU allocator as they were", "[probe]") {
  auto model = small_resnet();
  {  // gradients from an earlier step must survive too
    auto loss = model->forward(torch::randn({2, 1, 16, 16})).sum();
    loss.backward();
  }
  model->eval();
  const ModelSnapshot before(*model);
  c10::Allocator* const cpu_allocator = c10::GetCPUAllocator();

  ProbeOptions options = small_resnet_options("cpu");
  options.optim.name = "adamw";  // optimizer state on top of momentum
  options.optim.clip_grad_norm = 1.0;
  torch::manual_seed(7);
  probe_memory(*model, options, {2, 4});
  const std::vector<ProbePoint> timed = probe_throughput(*model, options, {2, 4});
  const auto after_probes = torch::rand({4});
  torch::manual_seed(7);
  CHECK(torch::equal(after_probes, torch::rand({4})));  // the generator was restored

  REQUIRE(timed.size() == 2);
  for (const ProbePoint& p : timed) CHECK(p.seconds_per_step > 0);
  CHECK(ModelSnapshot(*model) == before);
  CHECK_FALSE(model->is_training());
  CHECK_FALSE(autocast_enabled(torch::kCPU));
  CHECK(c10::GetCPUAllocator() == cpu_allocator);
  const auto after = torch::arange(1000, torch::kFloat).sum();  // the allocator still works
  CHECK(after.item<double>() == Approx(999.0 * 1000.0 / 2.0));
}

TEST_CASE("probes run bf16 autocast with channels_last on the CPU", "[probe]") {
  auto model = small_resnet();
  const ModelSnapshot before(*model);
  ProbeOptions options = small_resnet_options("cpu");
  options.bf16 = true;
  options.channels_last = true;
  options.timed_steps = 1;
  const MemoryFit fit = probe_memory(*model, options, {2});
  CHECK(fit.points.at(0).peak_bytes > 0);
  CHECK(probe_throughput(*model, options, {2}).at(0).seconds_per_step > 0);
  CHECK(ModelSnapshot(*model) == before);  // strides included: back in the model's own layout
  CHECK_FALSE(autocast_enabled(torch::kCPU));
}

TEST_CASE("a probe that runs out of memory while copying the model leaves the model as it was", "[probe]") {
  auto model = small_resnet();
  {  // gradients from an earlier step must survive too
    auto loss = model->forward(torch::randn({2, 1, 16, 16})).sum();
    loss.backward();
  }
  const ModelSnapshot before(*model);
  int64_t state_bytes = 0;  // what the probe's copies of the parameters and buffers take
  for (const auto& t : model->parameters()) state_bytes += t.nbytes();
  for (const auto& t : model->buffers()) state_bytes += t.nbytes();
  ProbeOptions options = small_resnet_options("cpu");
  options.timed_steps = 1;
  // probe_throughput keeps no counter of its own, so this one's limit applies to it: the CPU runs
  // out of memory as the CUDA allocator would on a small GPU, first half way through the copies,
  // then in the channels_last conversion after them.
  for (const auto& [limit, channels_last] : {std::pair<int64_t, bool>{state_bytes / 2, false},
                                             std::pair<int64_t, bool>{state_bytes + 1, true}}) {
    CAPTURE(limit, channels_last);
    options.channels_last = channels_last;
    std::vector<ProbePoint> points;
    {
      CpuMemoryCounter counter(limit);
      points = probe_throughput(*model, options, {2});
    }
    REQUIRE(points.size() == 1);
    CHECK(points[0].oom);
    CHECK(ModelSnapshot(*model) == before);  // its own storage, values, strides and gradients
  }
}

TEST_CASE("probe_memory on the CPU grows with the batch for a transformer trained with AdamW", "[probe]") {
  // BERT-tiny with a 20k vocabulary (2.8 M parameters, the embedding most of them): at 2 and 4
  // sequences a parameter-sized buffer sets the step's peak, the same at both. A probe that fitted
  // the peaks alone found 512 bytes per sample here (the input ids) and planned micro-batches of
  // millions.
  ModelConfig config;
  config.name = "bert-mlm";
  config.preset = "bert-tiny";
  config.vocab_size = 20000;
  config.max_positions = 64;
  config.dropout = 0.1;
  auto model = models::make_model(config);
  ProbeOptions options;
  options.input_shape = {64};
  options.num_classes = 20000;
  options.device = "cpu";
  options.target_fraction = 0.15;
  options.optim.name = "adamw";
  options.optim.weight_decay = 0.01;
  options.optim.clip_grad_norm = 1.0;

  // The plan probes 2 and 4 on a CPU. Their peaks are flat while the activations grow: the fit
  // asks for a larger batch, at most the largest the plan could use.
  const MemoryFit small = probe_memory(*model, options, {2, 4});
  CAPTURE(small.points[0].peak_bytes, small.points[0].activation_bytes, small.points[1].peak_bytes,
          small.points[1].activation_bytes, small.per_sample_bytes);
  CHECK(small.per_sample_bytes > 64 * 1024);  // the activations' slope, though the peaks are flat
  const int64_t more = small.batch_beyond_flat(64);
  CHECK(more > 4);
  CHECK(more <= 64);
  CHECK(small.batch_beyond_flat(4) == 0);  // nothing larger is of use
  if (more <= 4 || more >= 64) return;

  // With it, only the largest batch is on the line: the secant from 4, still on the flat part,
  // would undercount the slope (by about 10% at twice the batch). So twice it is measured too.
  const MemoryFit three = probe_memory(*model, options, {2, 4, more});
  const int64_t twice = three.batch_beyond_flat(4 * more);
  CHECK(twice == 2 * more);
  CHECK(three.batch_beyond_flat(more) == 0);  // nothing larger is of use

  // Measured in one call with a batch beyond them all, the fit must not undercount it.
  const MemoryFit probed = probe_memory(*model, options, {2, 4, more, 2 * more, 4 * more});
  REQUIRE(probed.points.size() == 5);
  const MemoryFit fit = fit_memory({probed.points[0], probed.points[1], probed.points[2], probed.points[3]});
  CHECK(fit.batch_beyond_flat(4 * more) == 0);
  const int64_t measured = probed.points[4].peak_bytes;
  const int64_t predicted = fit.predict(4 * more);
  CAPTURE(more, fit.fixed_bytes, fit.per_sample_bytes, probed.points[2].peak_bytes, probed.points[3].peak_bytes,
          predicted, measured);
  // A plan must not count on memory the step needs. The peaks of one step vary by a few percent
  // from run to run here (concurrent temporaries in multi-threaded kernels); extrapolated to twice
  // the largest batch that is about ±5%, within the 10% the plan keeps back
  // (tuning.memory_fraction 0.9). Without the second point on the line the prediction was 6-11%
  // short on LibTorch 1.13.
  CHECK(predicted >= measured * 0.9);
  CHECK(relative_error(static_cast<double>(predicted), static_cast<double>(measured)) < 0.25);
}

TEST_CASE("probe options are validated", "[probe]") {
  auto model = small_resnet();
  ProbeOptions options = small_resnet_options("cpu");
  CHECK_THROWS_AS(probe_memory(*model, options, {0}), std::invalid_argument);
  options.input_shape.clear();
  CHECK_THROWS_AS(probe_memory(*model, options, {4}), std::invalid_argument);
  options = small_resnet_options("mps");
  CHECK_THROWS_AS(probe_throughput(*model, options, {4}), std::invalid_argument);
}

// The probe is the first code to run a program's own model: its errors say what the probe was doing.
TEST_CASE("a model that does not fit the data fails the probe with what was being measured", "[probe]") {
  auto model = small_resnet();  // 10 logits, 1-channel input
  const ModelSnapshot before(*model);
  SECTION("fewer logits than classes") {
    ProbeOptions options = small_resnet_options("cpu");
    options.num_classes = 20;
    CHECK_THROWS_WITH(probe_memory(*model, options, {4}),
                      Catch::Contains("measuring the plan's memory (a training step of the model on a random batch "
                                      "of shape [4, 1, 16, 16] on cpu)") &&
                          Catch::Contains("the model's output has shape [4, 10], but the data has 20 classes"));
  }
  SECTION("an input the model does not take") {
    ProbeOptions options = small_resnet_options("cpu");
    options.input_shape = {3, 16, 16};  // the stem takes one channel
    try {
      probe_memory(*model, options, {2});
      FAIL("the probe ran a 1-channel model on 3-channel input");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("measuring the plan's memory (a training step of the model on a random "
                                           "batch of shape [2, 3, 16, 16] on cpu) failed: "));
      CHECK_THAT(e.what(), !Catch::Contains("Exception raised from"));  // no C++ backtrace
    }
  }
  CHECK(ModelSnapshot(*model) == before);  // the failed probe put the model back as it was
}

TEST_CASE("probe_memory on CUDA: prediction, out-of-memory points, state restored", "[probe][cuda]") {
  TRAIN_SKIP_WITHOUT_CUDA("CUDA is not available; skipping the CUDA memory probe");
  auto model = small_resnet();  // stays on the CPU: the probe copies it to the GPU
  const ModelSnapshot before(*model);
  ProbeOptions options = small_resnet_options("cuda:0");

  // Batches large enough that activations dominate the caching allocator's rounding.
  const MemoryFit probed = probe_memory(*model, options, {128, 256, 512});
  REQUIRE(probed.points.size() == 3);
  const MemoryFit fit = fit_memory({probed.points[0], probed.points[1]});
  const int64_t measured = probed.points[2].peak_bytes;
  const int64_t predicted = fit.predict(512);
  CAPTURE(fit.fixed_bytes, fit.per_sample_bytes, fit.points[0].peak_bytes, fit.points[1].peak_bytes, predicted,
          measured, relative_error(static_cast<double>(predicted), static_cast<double>(measured)));
  CHECK(relative_error(static_cast<double>(predicted), static_cast<double>(measured)) < 0.2);

  // 2^30 samples of 1x16x16 floats are a 1 TiB input: no GPU holds it.
  const int64_t too_large = int64_t{1} << 30;
  const MemoryFit with_oom = probe_memory(*model, options, {too_large, 64});
  REQUIRE(with_oom.points.size() == 2);
  CHECK(with_oom.points[0].oom);
  CHECK_FALSE(with_oom.points[1].oom);  // the probe recovered and continued
  CHECK(with_oom.points[1].peak_bytes > 0);
  CHECK(with_oom.max_batch(int64_t{1} << 50) < too_large);

  options.bf16 = true;
  options.channels_last = true;
  const std::vector<ProbePoint> timed = probe_throughput(*model, options, {64, 128, 256});
  for (const ProbePoint& p : timed) {
    CAPTURE(p.batch, p.seconds_per_step);
    CHECK(p.seconds_per_step > 0);
  }
  CHECK(choose_by_throughput(timed) > 0);

  CHECK(ModelSnapshot(*model) == before);
  CHECK(model->parameters()[0].device().is_cpu());
  CHECK_FALSE(autocast_enabled(torch::kCUDA));
}
