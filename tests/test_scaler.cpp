#include "testing.h"

#include <torch/version.h>
#include <train/amp.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <stdexcept>

using namespace train;

namespace {

// LibTorch 2.3 added CPU kernels for _amp_foreach_non_finite_check_and_unscale_ and
// _amp_update_scale_; before, the scaler runs its own CPU code.
constexpr bool kCpuAmpKernels = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3);

GradScaler::Options scaler_options(double init_scale, int64_t growth_interval) {
  GradScaler::Options options;
  options.init_scale = init_scale;
  options.growth_interval = growth_interval;
  return options;
}

// One fp32 and one bf16 parameter under a GradScaler on `device`: both are unscaled exactly, and
// an inf in the gradients skips the step for both and halves the scale.
void check_bf16_beside_fp32(const torch::Device& device) {
  auto w32 = torch::zeros({3}, torch::TensorOptions(torch::kFloat).device(device).requires_grad(true));
  auto w16 = torch::zeros({3}, torch::TensorOptions(torch::kBFloat16).device(device).requires_grad(true));
  torch::optim::SGD sgd({w32, w16}, torch::optim::SGDOptions(1.0));
  GradScaler scaler(scaler_options(8.0, 100));
  auto step = [&](float bad) {
    sgd.zero_grad();
    const auto c = torch::tensor({0.5f, bad, 0.25f}).to(device);
    const auto loss = (w32 * c).sum() + (w16.to(torch::kFloat) * c).sum();
    scaler.scale(loss).backward();
    CHECK(w16.grad().scalar_type() == torch::kBFloat16);
    const bool stepped = scaler.step(sgd);
    scaler.update();
    return stepped;
  };
  const auto after_one = torch::tensor({-0.5f, -1.0f, -0.25f});
  CHECK(step(1.0f));
  CHECK(torch::equal(w32.detach().cpu(), after_one));
  CHECK(torch::equal(w16.detach().cpu().to(torch::kFloat), after_one));
  CHECK_FALSE(step(std::numeric_limits<float>::infinity()));
  CHECK(scaler.get_scale() == 4.0);
  CHECK(torch::equal(w32.detach().cpu(), after_one));
  CHECK(torch::equal(w16.detach().cpu().to(torch::kFloat), after_one));
}

int64_t growth_tracker(const GradScaler& scaler) { return scaler.state().at("scaler/growth_tracker").item<int64_t>(); }

// One parameter and plain SGD (lr 1): loss = sum(w * c) has the gradient c, so a step that is
// taken subtracts c from w.
struct Problem {
  torch::Tensor w = torch::zeros({3}, torch::requires_grad());
  torch::optim::SGD sgd{std::vector<torch::Tensor>{w}, torch::optim::SGDOptions(1.0)};

  void backward(GradScaler& scaler, const torch::Tensor& c) { scaler.scale((w * c).sum()).backward(); }

  // One optimizer step through the scaler; returns whether the optimizer stepped.
  bool train_step(GradScaler& scaler, const torch::Tensor& c) {
    sgd.zero_grad();
    backward(scaler, c);
    const bool stepped = scaler.step(sgd);
    scaler.update();
    return stepped;
  }
};

// The gradient of the examples: exactly representable, so scaled and unscaled values are exact.
torch::Tensor grad_c() { return torch::tensor({1.0f, -2.0f, 0.375f}); }

// Exactly equal, with inf == inf and NaN == NaN.
bool same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && torch::allclose(a.to(torch::kDouble), b.to(torch::kDouble), 0.0, 0.0,
                                                               /*equal_nan=*/true);
}

}  // namespace

TEST_CASE("GradScaler: grows after growth_interval clean steps, backs off and skips on inf", "[amp][scaler]") {
  GradScaler scaler(scaler_options(8.0, 3));
  Problem problem;
  CHECK(scaler.get_scale() == 8.0);

  CHECK(problem.train_step(scaler, grad_c()));
  CHECK(torch::equal(problem.w.grad(), grad_c()));  // the optimizer saw the unscaled gradient
  CHECK(scaler.get_scale() == 8.0);
  CHECK(growth_tracker(scaler) == 1);

  CHECK(problem.train_step(scaler, grad_c()));
  CHECK(scaler.get_scale() == 8.0);
  CHECK(growth_tracker(scaler) == 2);

  CHECK(problem.train_step(scaler, grad_c()));  // the third clean step in a row: x2
  CHECK(scaler.get_scale() == 16.0);
  CHECK(growth_tracker(scaler) == 0);
  CHECK(torch::equal(problem.w.detach(), -3 * grad_c()));

  const auto inf_grad = torch::tensor({1.0f, std::numeric_limits<float>::infinity(), 0.375f});
  CHECK_FALSE(problem.train_step(scaler, inf_grad));  // skipped: x0.5, parameters unchanged
  CHECK(scaler.get_scale() == 8.0);
  CHECK(growth_tracker(scaler) == 0);
  CHECK(torch::equal(problem.w.detach(), -3 * grad_c()));

  CHECK(problem.train_step(scaler, grad_c()));  // counting starts again
  CHECK(scaler.get_scale() == 8.0);
  CHECK(growth_tracker(scaler) == 1);
  CHECK(torch::equal(problem.w.detach(), -4 * grad_c()));
}

TEST_CASE("GradScaler: NaN and inf gradients are both detected", "[amp][scaler]") {
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
    INFO("bad gradient value " << bad);
    GradScaler scaler(scaler_options(1024.0, 2000));
    Problem problem;
    CHECK_FALSE(problem.train_step(scaler, torch::tensor({0.5f, 1.0f, bad})));
    CHECK(torch::equal(problem.w.detach(), torch::zeros({3})));
    CHECK(scaler.get_scale() == 512.0);
  }
}

TEST_CASE("GradScaler: unscale divides the gradients exactly, once per step", "[amp][scaler]") {
  SECTION("power-of-two scale: the original gradient") {
    GradScaler scaler(scaler_options(65536.0, 2000));
    Problem problem;
    problem.backward(scaler, grad_c());
    CHECK(torch::equal(problem.w.grad(), grad_c() * 65536.0f));
    scaler.unscale(problem.sgd);
    CHECK(torch::equal(problem.w.grad(), grad_c()));
    CHECK_THROWS_AS(scaler.unscale(problem.sgd), std::logic_error);
    CHECK(scaler.step(problem.sgd));  // does not unscale a second time
    CHECK(torch::equal(problem.w.detach(), -grad_c()));
    CHECK_THROWS_AS(scaler.step(problem.sgd), std::logic_error);
    scaler.update();
  }
  SECTION("any scale: multiplied by the fp32 reciprocal") {
    GradScaler scaler(scaler_options(3.0, 2000));
    Problem problem;
    problem.backward(scaler, grad_c());
    const auto scaled = problem.w.grad().clone();
    scaler.unscale(problem.sgd);
    CHECK(torch::equal(problem.w.grad(), scaled * static_cast<float>(1.0 / 3.0)));
  }
  SECTION("gradient accumulation: scaled micro-batches, one unscale") {
    GradScaler scaler(scaler_options(256.0, 2000));
    Problem problem;
    problem.backward(scaler, grad_c());
    problem.backward(scaler, 2 * grad_c());
    CHECK(scaler.step(problem.sgd));
    scaler.update();
    CHECK(torch::equal(problem.w.grad(), 3 * grad_c()));
  }
  SECTION("parameters without a gradient are skipped") {
    GradScaler scaler(scaler_options(4.0, 2000));
    Problem problem;
    auto unused = torch::ones({2}, torch::requires_grad());
    problem.sgd.add_param_group(torch::optim::OptimizerParamGroup({unused}));
    problem.backward(scaler, grad_c());
    CHECK(scaler.step(problem.sgd));
    scaler.update();
    CHECK_FALSE(unused.grad().defined());
    CHECK(torch::equal(unused.detach(), torch::ones({2})));
  }
  SECTION("update without unscale or step is an error") {
    GradScaler scaler(scaler_options(4.0, 2000));
    Problem problem;
    problem.backward(scaler, grad_c());
    CHECK_THROWS_AS(scaler.update(), std::logic_error);
  }
}

TEST_CASE("GradScaler: a disabled scaler passes everything through", "[amp][scaler]") {
  GradScaler::Options options;
  options.enabled = false;
  GradScaler scaler(options);
  Problem problem;
  const auto loss = (problem.w * grad_c()).sum();
  const auto scaled = scaler.scale(loss);
  CHECK(scaled.is_same(loss));
  scaled.backward();
  scaler.unscale(problem.sgd);
  CHECK(torch::equal(problem.w.grad(), grad_c()));
  CHECK(scaler.step(problem.sgd));
  scaler.update();
  CHECK(torch::equal(problem.w.detach(), -grad_c()));
  CHECK(scaler.get_scale() == 1.0);
  CHECK(scaler.state().empty());
}

TEST_CASE("GradScaler: state() and load_state() round trip", "[amp][scaler]") {
  GradScaler first(scaler_options(8.0, 3));
  Problem problem;
  problem.train_step(first, grad_c());
  problem.train_step(first, grad_c());
  const auto saved = first.state();
  CHECK(saved.at("scaler/scale").item<double>() == 8.0);
  CHECK(growth_tracker(first) == 2);

  SECTION("into a fresh scaler") {
    GradScaler second(scaler_options(1.0, 3));
    second.load_state(saved);
    CHECK(second.get_scale() == 8.0);
    CHECK(growth_tracker(second) == 2);
    Problem resumed;
    CHECK(resumed.train_step(second, grad_c()));  // the third clean step: grows as `first` would
    CHECK(second.get_scale() == 16.0);
  }
  SECTION("into a scaler that has already run") {
    GradScaler second(scaler_options(1.0, 3));
    Problem other;
    other.train_step(second, grad_c());
    second.load_state(saved);
    CHECK(second.get_scale() == 8.0);
    CHECK(growth_tracker(second) == 2);
  }
  SECTION("the saved tensors do not follow later updates") {
    problem.train_step(first, grad_c());
    CHECK(first.get_scale() == 16.0);
    CHECK(saved.at("scaler/scale").item<double>() == 8.0);
  }
  SECTION("a state without the scaler's entries is rejected") {
    GradScaler second(scaler_options(1.0, 3));
    CHECK_THROWS_AS(second.load_state({}), std::invalid_argument);
  }
  SECTION("a scale of 0, below 0 or not finite, or a negative tracker, is rejected: it would skip every step") {
    GradScaler second(scaler_options(1.0, 3));
    const double inf = std::numeric_limits<double>::infinity();
    for (const auto& [scale, tracker] : std::vector<std::pair<double, int64_t>>{{0.0, 0}, {-1.0, 5}, {inf, 0}, {8.0, -1}}) {
      INFO(scale << " " << tracker);
      const std::map<std::string, torch::Tensor> bad = {
          {"scaler/scale", torch::full({}, scale, torch::kFloat)},
          {"scaler/growth_tracker", torch::full({}, tracker, torch::kInt)}};
      CHECK_THROWS_WITH(second.load_state(bad), Catch::Contains("are not a scaler's state"));
    }
  }
}

TEST_CASE("GradScaler: the CPU fallback matches the ATen kernels bit for bit", "[amp][scaler]") {
  if (!kCpuAmpKernels) {
    WARN("LibTorch " << TORCH_VERSION << " has no CPU kernels to compare with; the fallback is what runs");
    return;
  }
  torch::manual_seed(7);
  SECTION("non-finite check and unscale") {
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16}) {
      for (const double inv : {1.0 / 65536.0, 1.0 / 3.0, 1.0, 1.0 / 1e-30}) {
        for (const float bad : {0.0f, inf, nan}) {
          INFO("dtype " << dtype << ", inv_scale " << inv << ", planted value " << bad);
          std::vector<torch::Tensor> grads = {(torch::randn({37}) * 1000).to(dtype), torch::randn({4, 5}).to(dtype)};
          if (bad != 0.0f) grads[1][2][3] = bad;
          std::vector<torch::Tensor> by_kernel, by_fallback;
          for (const auto& g : grads) {
            by_kernel.push_back(g.clone());
            by_fallback.push_back(g.clone());
          }
          const auto inv_scale = torch::full({}, inv, torch::kFloat);
          auto found_by_kernel = torch::zeros({}, torch::kFloat);
          auto found_by_fallback = torch::zeros({}, torch::kFloat);
          at::_amp_foreach_non_finite_check_and_unscale_(by_kernel, found_by_kernel, inv_scale);
          train::detail::non_finite_check_and_unscale(by_fallback, found_by_fallback, inv_scale);
          CHECK(same(found_by_kernel, found_by_fallback));
          CHECK(found_by_kernel.item<float>() == (bad == 0.0f ? 0.0f : 1.0f));
          for (size_t i = 0; i < grads.size(); ++i) CHECK(same(by_kernel[i], by_fallback[i]));
        }
      }
    }
  }
  SECTION("scale update") {
    // Clean and inf steps, an odd growth factor, and growth that would overflow fp32.
    for (const double start : {65536.0, 3.0, static_cast<double>(FLT_MAX) / 2}) {
      auto scale_by_kernel = torch::full({}, start, torch::kFloat);
      auto scale_by_fallback = scale_by_kernel.clone();
      auto tracker_by_kernel = torch::zeros({}, torch::kInt);
      auto tracker_by_fallback = tracker_by_kernel.clone();
      for (const float found : {0.f, 0.f, 0.f, 1.f, 0.f, 2.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}) {
        INFO("start " << start << ", found_inf " << found);
        const auto found_inf = torch::full({}, found, torch::kFloat);
        at::_amp_update_scale_(scale_by_kernel, tracker_by_kernel, found_inf, 2.7, 0.3, 3);
        train::detail::update_scale(scale_by_fallback, tracker_by_fallback, found_inf, 2.7, 0.3, 3);
        CHECK(same(scale_by_kernel, scale_by_fallback));
        CHECK(same(tracker_by_kernel, tracker_by_fallback));
      }
      CHECK(std::isfinite(scale_by_fallback.item<float>()));
    }
  }
}

TEST_CASE("GradScaler: bf16 gradients beside fp32 ones are unscaled, and an inf in either skips the step",
          "[amp][scaler]") {
  check_bf16_beside_fp32(torch::Device("cpu"));
}

TEST_CASE("cuda: the scaler on the GPU: the ATen CUDA kernels match the CPU fallback, fp16 included, and a step "
          "grows, backs off and skips", "[cuda][amp][scaler]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: the CUDA loss-scaling kernels are checked by scripts/gpu-check on a GPU machine");
  const torch::Device cuda("cuda:0");
  torch::manual_seed(7);
  SECTION("non-finite check and unscale: CUDA kernel against the CPU fallback") {
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (const auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      for (const double inv : {1.0 / 65536.0, 1.0 / 3.0, 1.0}) {
        for (const float bad : {0.0f, inf, nan}) {
          INFO("dtype " << dtype << ", inv_scale " << inv << ", planted value " << bad);
          std::vector<torch::Tensor> grads = {(torch::randn({37}) * 100).to(dtype), torch::randn({4, 5}).to(dtype)};
          if (bad != 0.0f) grads[1][2][3] = bad;
          std::vector<torch::Tensor> on_gpu, on_cpu;
          for (const auto& g : grads) {
            on_gpu.push_back(g.to(cuda));
            on_cpu.push_back(g.clone());
          }
          auto found_gpu = torch::zeros({}, torch::TensorOptions(torch::kFloat).device(cuda));
          auto found_cpu = torch::zeros({}, torch::kFloat);
          const auto inv_gpu = torch::full({}, inv, torch::TensorOptions(torch::kFloat).device(cuda));
          if (dtype == torch::kBFloat16) {
            // ATen's CUDA kernel has no bf16 (2.11: "not implemented for 'BFloat16'"): GradScaler
            // runs the fallback on the GPU for bf16 gradients, checked against it on the CPU.
            train::detail::non_finite_check_and_unscale(on_gpu, found_gpu, inv_gpu);
          } else {
            at::_amp_foreach_non_finite_check_and_unscale_(on_gpu, found_gpu, inv_gpu);
          }
          train::detail::non_finite_check_and_unscale(on_cpu, found_cpu, torch::full({}, inv, torch::kFloat));
          CHECK(same(found_gpu.cpu(), found_cpu));
          CHECK(found_cpu.item<float>() == (bad == 0.0f ? 0.0f : 1.0f));
          // Where no value was planted the gradients are unscaled alike (with one, PyTorch leaves
          // them unspecified: the step is skipped).
          if (bad == 0.0f) {
            for (size_t i = 0; i < grads.size(); ++i) CHECK(same(on_gpu[i].cpu(), on_cpu[i]));
          }
        }
      }
    }
  }
  SECTION("scale update: CUDA kernel against the CPU fallback") {
    auto scale_gpu = torch::full({}, 65536.0, torch::TensorOptions(torch::kFloat).device(cuda));
    auto tracker_gpu = torch::zeros({}, torch::TensorOptions(torch::kInt).device(cuda));
    auto scale_cpu = scale_gpu.cpu();
    auto tracker_cpu = tracker_gpu.cpu();
    for (const float found : {0.f, 0.f, 0.f, 1.f, 0.f, 2.f, 0.f, 0.f, 0.f, 0.f}) {
      INFO("found_inf " << found);
      at::_amp_update_scale_(scale_gpu, tracker_gpu, torch::full({}, found, torch::TensorOptions(torch::kFloat).device(cuda)),
                             2.0, 0.5, 3);
      train::detail::update_scale(scale_cpu, tracker_cpu, torch::full({}, found, torch::kFloat), 2.0, 0.5, 3);
      CHECK(same(scale_gpu.cpu(), scale_cpu));
      CHECK(same(tracker_gpu.cpu(), tracker_cpu));
    }
  }
  SECTION("a GradScaler over an fp16 autocast step on the GPU") {
    // fp32 master weight, loss = w . c computed in fp16 by autocast (a matmul): the gradient c,
    // scaled by 8 in the backward pass, comes back to w in fp32 and is unscaled exactly.
    auto w = torch::zeros({1, 3}, torch::TensorOptions(torch::kFloat).device(cuda).requires_grad(true));
    torch::optim::SGD sgd({w}, torch::optim::SGDOptions(1.0));
    GradScaler scaler(scaler_options(8.0, 2));
    auto step = [&](const torch::Tensor& c) {
      sgd.zero_grad();
      torch::Tensor loss;
      {
        AutocastScope autocast(torch::kCUDA, torch::kHalf, true);
        loss = w.matmul(c.to(cuda).view({3, 1})).squeeze();  // a 0-dim fp16 loss
      }
      CHECK(loss.scalar_type() == torch::kHalf);
      scaler.scale(loss).backward();
      CHECK(w.grad().scalar_type() == torch::kFloat);
      const bool stepped = scaler.step(sgd);
      scaler.update();
      return stepped;
    };
    CHECK(step(grad_c()));
    CHECK(step(grad_c()));  // second clean step in a row: x2
    CHECK(scaler.get_scale() == 16.0);
    CHECK(torch::equal(w.detach().cpu().view({3}), -2 * grad_c()));
    const auto inf_grad = torch::tensor({1.0f, std::numeric_limits<float>::infinity(), 0.375f});
    CHECK_FALSE(step(inf_grad));  // skipped, x0.5
    CHECK(scaler.get_scale() == 8.0);
    CHECK(torch::equal(w.detach().cpu().view({3}), -2 * grad_c()));
    for (const auto& [name, tensor] : scaler.state()) CHECK(tensor.device().is_cpu());  // checkpoints hold CPU tensors
  }
  SECTION("a GradScaler unscales bf16 gradients on the GPU beside fp32 ones, and skips on an inf in either") {
    // ATen's CUDA unscale kernel does not take bf16: GradScaler unscales those by the fallback.
    check_bf16_beside_fp32(cuda);
  }
}
