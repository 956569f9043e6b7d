#pragma once
// Mixed precision: an autocast scope that works on every supported LibTorch version, loss
// scaling for fp16, and the memory-format conversion that tensor-core convolutions want.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace train {

// While alive, ops on `device`'s type run under autocast to `dtype` (bf16 or fp16 on CUDA,
// bf16 on CPU). Nests: the previous state is restored on destruction. `enabled == false`
// makes it a no-op, so call sites need no branch.
class AutocastScope {
 public:
  AutocastScope(torch::DeviceType device, torch::ScalarType dtype, bool enabled = true);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  torch::DeviceType device_;
  bool enabled_;
  bool prev_enabled_ = false;
  torch::ScalarType prev_dtype_ = torch::kFloat;
};

bool autocast_enabled(torch::DeviceType device);

// Converts every 4-D parameter and buffer of `module` to channels_last in place
// (LibTorch's Module::to has no memory_format argument).
void to_channels_last(torch::nn::Module& module);

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;      // > 1
  double backoff_factor = 0.5;     // in (0, 1)
  int64_t growth_interval = 2000;  // clean steps between growths, >= 1
  bool enabled = true;
};

// Dynamic loss scaling for fp16 autocast, equivalent to torch.amp.GradScaler: the loss is
// multiplied by a scale so that small fp16 gradients do not underflow; the gradients are divided
// by it again before the optimizer step, and a step with an inf or NaN gradient is skipped and
// the scale backed off. Parameters (and so gradients) stay fp32.
//
//   scaler.scale(loss).backward();   // once per micro-batch (gradient accumulation works)
//   scaler.unscale(optimizer);       // optional, e.g. before clipping
//   scaler.step(optimizer);          // unscales unless done, steps unless inf/NaN was found
//   scaler.update();                 // once per optimizer step, after every step()
//
// The scale lives in a float tensor on the loss's device, so nothing waits for the device
// except step()'s inf/NaN decision and get_scale(). A disabled scaler passes everything through.
class GradScaler {
 public:
  using Options = GradScalerOptions;

  explicit GradScaler(Options options = Options());
  // Copies would share the scale tensor; one scaler per training loop.
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;
  GradScaler(GradScaler&&) = default;
  GradScaler& operator=(GradScaler&&) = default;

  // loss * scale; the scale tensor is created on the loss's device at the first call.
  torch::Tensor scale(const torch::Tensor& loss);
  // Divides the gradients of `optimizer`'s parameters by the scale and records whether any is
  // inf or NaN. At most once per optimizer between update()s; parameters without a gradient
  // are skipped.
  void unscale(torch::optim::Optimizer& optimizer);
  // Unscales if unscale() was not called, then runs optimizer.step() unless a gradient was inf
  // or NaN. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // Backs the scale off after an inf/NaN step and resets the count of clean steps; grows it
  // after growth_interval clean steps in a row.
  void update();

  double get_scale() const;  // 1.0 when disabled
  bool enabled() const { return options_.enabled; }

  // {"scaler/scale", "scaler/growth_tracker"} as CPU tensors; empty when disabled.
  std::map<std::string, torch::Tensor> state() const;
  void load_state(const std::map<std::string, torch::Tensor>& state);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerRecord {
    Stage stage = Stage::kReady;
    torch::Tensor found_inf;  // float, 1.0 when a gradient was inf or NaN
  };

  void require_scale(const char* caller) const;

  Options options_;
  double init_scale_;
  int64_t init_growth_tracker_ = 0;
  torch::Tensor scale_;           // 0-dim float32
  torch::Tensor growth_tracker_;  // 0-dim int32: clean steps since the last growth or backoff
  std::map<const torch::optim::Optimizer*, OptimizerRecord> records_;  // since the last update()
};

namespace detail {

// Plain-tensor-op versions of at::_amp_foreach_non_finite_check_and_unscale_ and
// at::_amp_update_scale_ with bit-identical results, for devices without those kernels (CPU
// before LibTorch 2.3). Declared here for the tests that compare them with the ATen ops.
void non_finite_check_and_unscale(const std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                                  const torch::Tensor& inv_scale);
void update_scale(torch::Tensor& scale, torch::Tensor& growth_tracker, const torch::Tensor& found_inf,
                  double growth_factor, double backoff_factor, int64_t growth_interval);

}  // namespace detail

}  // namespace train
