#pragma once
// Optimizer and learning-rate schedule factories.
#include <train/config.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>

namespace train {

// SGD (momentum, nesterov) or AdamW from `optim`. Two parameter groups: weights with weight
// decay, and normalisation weights + biases (parameters with <= 1 dimension) without it,
// unless optim.decay_norm_and_bias is set.
//
// optim.impl picks how a step runs, for the device the parameters are on now: "fused" (one
// LibTorch kernel per group), "foreach" (multi-tensor _foreach_ ops), "loop" (torch::optim::SGD /
// AdamW, one parameter at a time) or "auto" (fused where LibTorch has the kernel, else foreach).
// All follow torch::optim's math and keep its state layout (SGDParamState, AdamWParamState), so
// save() / load() checkpoints move between them. ConfigError for "fused" without a kernel.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimConfig& config, torch::nn::Module& model,
                                                        double lr);

// How `optimizer` steps, for the plan and the log: "sgd fused", "adamw foreach", "sgd loop", ...;
// "other" for an optimizer make_optimizer did not make.
std::string optimizer_impl(const torch::optim::Optimizer& optimizer);

// Gives every state tensor of an SGD or AdamW optimizer (momentum, Adam moments) the device,
// dtype-preserving layout and strides of its parameter. A loaded checkpoint's state arrives on the
// CPU in contiguous layout; a CUDA or channels_last model needs it like its parameters before the
// first step (the foreach and fused kernels take one device and one layout per list). Throws
// std::invalid_argument naming the parameter index when a state is not its parameter's shape or dtype, or
// is not finite (a damaged checkpoint).
void place_state_like_params(torch::optim::Optimizer& optimizer);

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

namespace detail {

// For a step captured in a CUDA graph (the trainer's tuning.cuda_graphs): makes a fused SGD or
// AdamW from make_optimizer read its learning rate from `lr` and skip its whole update
// (parameters, momentum or moments, AdamW's step count) where `skip` holds 1, both 0-dim float32
// tensors on the parameters' device that the caller fills before each step; set_learning_rate
// then no longer changes what the step uses. AdamW then counts its steps on the device (the
// saved state catches up in save()). Undefined tensors go back to the host. Returns false,
// changing nothing, for any other optimizer (AdamW before LibTorch 2.4); std::invalid_argument
// for tensors of another shape or dtype.
bool set_device_step_controls(torch::optim::Optimizer& optimizer, const torch::Tensor& lr, const torch::Tensor& skip);

}  // namespace detail

// Linear warmup over W steps (step k < W gets peak x (k + 1) / W: the first step already moves,
// the last warmup step reaches the peak), then constant, cosine (to min_lr_ratio x peak) or step
// decay (x gamma at each milestone, given as fractions of the total steps). Pure function of
// the step, so a resumed run gets the same LR without saving schedule state.
class LrSchedule {
 public:
  LrSchedule(const ScheduleConfig& config, double peak_lr, int64_t total_steps, int64_t warmup_steps);
  // LR for optimizer step `step` (0-based: the LR used by the step that produces step+1).
  double at(int64_t step) const;

 private:
  ScheduleConfig config_;
  double peak_;
  int64_t total_;
  int64_t warmup_;
};

// Global L2 norm of all gradients, scaling them so that the norm is at most max_norm.
// Returns the norm before clipping.
double clip_grad_norm(torch::nn::Module& model, double max_norm);

// The same without reading the norm on the host (what a step captured in a CUDA graph needs):
// the gradients are multiplied by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils'
// clip_grad_norm_ does, and the norm before clipping comes back as a 0-dim float tensor on the
// first gradient's device (inf or NaN when a gradient is; the gradients are then 0 or NaN).
torch::Tensor clip_grad_norm_on_device(torch::nn::Module& model, double max_norm);

}  // namespace train
