#pragma once
// Optimizer and learning-rate schedule factories.
#include <train/config.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace train {

// SGD (momentum, nesterov), AdamW or a registered optimizer (below) from `optim`. Two parameter
// groups: weights with weight decay, and normalisation weights + biases (parameters with <= 1
// dimension) without it, unless optim.decay_norm_and_bias is set.
//
// optim.impl picks how a step runs, for the device the parameters are on now: "fused" (one
// LibTorch kernel per group), "foreach" (multi-tensor _foreach_ ops), "loop" (torch::optim::SGD /
// AdamW, one parameter at a time) or "auto" (fused where LibTorch has the kernel, else foreach).
// All follow torch::optim's math and keep its state layout (SGDParamState, AdamWParamState), so
// save() / load() checkpoints move between them. ConfigError for "fused" without a kernel.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimConfig& config, torch::nn::Module& model,
                                                        double lr);

// ---- optimizers of your own ----
//
// What a registered optimizer's builder gets: the model's trainable parameters in the two groups
// make_optimizer uses, the optim.* config (momentum, beta1, beta2, eps, weight_decay: read those
// that mean something to it), and the learning rate to start from (the plan's: optim.lr after any
// batch scaling; the schedule then sets each group's lr before every step).
struct OptimizerParams {
  std::vector<torch::Tensor> decay;     // weights: optim.weight_decay applies
  std::vector<torch::Tensor> no_decay;  // normalisation weights and biases (empty with optim.decay_norm_and_bias)
  OptimConfig config;
  double lr = 0;
};

// The two groups as torch::optim wants them, each with its own copy of `options` (any
// torch::optim options type: RMSpropOptions, AdagradOptions, ...): optim.weight_decay on the
// first, 0 on the second. Empty groups are left out.
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> param_groups(const OptimizerParams& params, const Options& options) {
  std::vector<torch::optim::OptimizerParamGroup> out;
  if (!params.decay.empty()) {
    auto o = std::make_unique<Options>(options);
    o->weight_decay(params.config.weight_decay);
    out.emplace_back(params.decay, std::move(o));
  }
  if (!params.no_decay.empty()) {
    auto o = std::make_unique<Options>(options);
    o->weight_decay(0.0);
    out.emplace_back(params.no_decay, std::move(o));
  }
  return out;
}

using OptimizerBuilder = std::function<std::unique_ptr<torch::optim::Optimizer>(const OptimizerParams& params)>;

// Makes `optim.name: <name>` build the optimizer `builder` returns, in YAML configs, the CLI and
// the examples alike. Register before the config is used, e.g. first thing in main():
//
//   train::register_optimizer("rmsprop", [](const train::OptimizerParams& p) {
//     auto options = torch::optim::RMSpropOptions(p.lr).alpha(0.99).eps(p.config.eps);
//     return std::make_unique<torch::optim::RMSprop>(train::param_groups(p, options), options);
//   }, "RMSprop, alpha 0.99", /*state_per_parameter=*/1);
//
// `state_per_parameter`: the parameter-sized tensors its state keeps per parameter (RMSprop 1,
// Adam 2), for the plan's checkpoint size; the micro-batch is sized with the optimizer itself.
// The optimizer must keep the lr of each group in its options (set_lr, as torch::optim's do) and
// save() / load() its state: checkpoints and exact resumes go through them, and on a resume its
// state is moved to the parameters' device. optim.impl must stay auto (it picks among the
// built-in kernels); steps are never captured in CUDA graphs. sgd and adamw are built in and
// cannot be replaced: std::invalid_argument, as for an empty name or builder. A name registered
// again gets the new builder.
void register_optimizer(const std::string& name, OptimizerBuilder builder, const std::string& summary,
                        int state_per_parameter);

// sgd, adamw and every registered name, sorted.
std::vector<std::string> optimizer_names();

// Parameter-sized state tensors per parameter for `config`'s optimizer: adamw 2, sgd 1 with
// momentum (else 0), a registered one what it declared. ConfigError for an unknown name, or for
// optim.impl other than auto with a registered one (what make_optimizer would refuse).
int optimizer_state_per_parameter(const OptimConfig& config);

// How `optimizer` steps, for the plan and the log: "sgd fused", "adamw foreach", "sgd loop", ...;
// "other" for an optimizer make_optimizer did not make.
std::string optimizer_impl(const torch::optim::Optimizer& optimizer);

// Gives every state tensor of an SGD or AdamW optimizer (momentum, Adam moments) the device,
// dtype-preserving layout and strides of its parameter. A loaded checkpoint's state arrives on the
// CPU in contiguous layout; a CUDA or channels_last model needs it like its parameters before the
// first step (the foreach and fused kernels take one device and one layout per list). Throws
// std::invalid_argument naming the parameter index when a state is not its parameter's shape or dtype, or
// is not finite (a damaged checkpoint). The state of any other optimizer (a registered one) goes
// to the first parameter's device through the optimizer's own save() and load(), unchecked.
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
