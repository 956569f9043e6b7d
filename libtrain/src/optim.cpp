#include "train/optim.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "compat.h"
#include "optimizer_names.h"
#include "tensor_groups.h"
#include "train/errors.h"
#include "train/log.h"

namespace train {

namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;
using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamGroup;
using torch::optim::SGDOptions;
using torch::optim::SGDParamState;
using TensorVector = std::vector<torch::Tensor>;

// Base of the foreach and fused optimizers: torch::optim's parameter groups, options and
// per-parameter state, with a step that updates all parameters of a group in one go.
class MultiTensorOptimizer : public torch::optim::Optimizer {
 public:
  torch::Tensor step(LossClosure closure = nullptr) final {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {
      torch::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups_) {
      TensorVector params, grads;
      for (const auto& param : group.params()) {
        if (!param.grad().defined()) continue;  // no gradient this step: no update, no state
        params.push_back(param);
        grads.push_back(param.grad());
      }
      if (!params.empty()) step_group(group.options(), params, grads);
    }
    return loss;
  }

  bool fused() const { return fused_; }

  // See detail::set_device_step_controls. Whether this optimizer can take them: its fused step.
  virtual bool takes_device_controls() const { return fused_; }
  void set_device_controls(torch::Tensor lr, torch::Tensor skip) {
    if (device_lr_.defined() && !lr.defined()) leave_device_controls();
    device_lr_ = std::move(lr);
    device_skip_ = std::move(skip);
  }

 protected:
  MultiTensorOptimizer(const std::vector<OptimizerParamGroup>& groups, std::unique_ptr<OptimizerOptions> defaults,
                       bool fused)
      : Optimizer(groups, std::move(defaults)), fused_(fused) {}

  virtual void step_group(const OptimizerOptions& options, const TensorVector& params, const TensorVector& grads) = 0;
  // The step goes back to host-side values: what the device held that the host needs comes back.
  virtual void leave_device_controls() {}

  // The parameter's state, nullptr before its first step.
  template <typename State>
  State* find_state(const torch::Tensor& param) {
    const auto it = state_.find(compat::optimizer_state_key(param));
    return it == state_.end() ? nullptr : static_cast<State*>(it->second.get());
  }
  // A fresh state for the parameter's first step.
  template <typename State>
  State& add_state(const torch::Tensor& param) {
    auto state = std::make_unique<State>();
    State& added = *state;
    state_[compat::optimizer_state_key(param)] = std::move(state);
    return added;
  }

  torch::Tensor device_lr_;    // defined: the fused kernel reads the LR from it (options.lr() is not used)
  torch::Tensor device_skip_;  // with device_lr_: 1.0 skips the whole update

 private:
  bool fused_;
};

// torch::optim::SGD's update: d = grad + weight_decay * p; with momentum, buf = d at the first
// step, then buf = momentum * buf + (1 - dampening) * d, and d = d + momentum * buf (nesterov)
// or d = buf; p -= lr * d.
class MultiTensorSGD final : public MultiTensorOptimizer {
 public:
  MultiTensorSGD(const std::vector<OptimizerParamGroup>& groups, const SGDOptions& defaults, bool fused)
      : MultiTensorOptimizer(groups, std::make_unique<SGDOptions>(defaults), fused) {}


  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
  }

 private:
  void step_group(const OptimizerOptions& group_options, const TensorVector& params,
                  const TensorVector& grads) override {
    const auto& options = static_cast<const SGDOptions&>(group_options);
    if (fused()) {
      fused_step(options, params, grads);
    } else {
      foreach_step(options, params, grads);
    }
  }

  void foreach_step(const SGDOptions& options, const TensorVector& params, const TensorVector& grads) {
    // d in new tensors when there is weight decay: the gradients stay as backward left them.
    TensorVector updates = grads;
    if (options.weight_decay() != 0) updates = at::_foreach_add(grads, params, options.weight_decay());
    if (options.momentum() != 0) {
      TensorVector buffers, running_buffers, running_updates;
      for (size_t i = 0; i < params.size(); ++i) {
        if (auto* state = find_state<SGDParamState>(params[i])) {
          buffers.push_back(state->momentum_buffer());
          running_buffers.push_back(state->momentum_buffer());
          running_updates.push_back(updates[i]);
        } else {
          auto& state_new = add_state<SGDParamState>(params[i]);
          state_new.momentum_buffer(torch::clone(updates[i]).detach());
          buffers.push_back(state_new.momentum_buffer());
        }
      }
      if (!running_buffers.empty()) {
        at::_foreach_mul_(running_buffers, options.momentum());
        at::_foreach_add_(running_buffers, running_updates, 1 - options.dampening());
      }
      updates = options.nesterov() ? at::_foreach_add(updates, buffers, options.momentum()) : buffers;
    }
    at::_foreach_add_(params, updates, -options.lr());
  }

  // The kernel takes one is_first_step flag per call, so parameters that get their momentum
  // buffer now (the first step, or a gradient for the first time) go in a call of their own.
  void fused_step(const SGDOptions& options, const TensorVector& params, const TensorVector& grads) {
    const auto run = [&](const TensorVector& p, const TensorVector& g, const TensorVector& buffers, bool first) {
      if (p.empty()) return;
      if (device_lr_.defined()) {
        compat::fused_sgd(p, g, buffers, options.weight_decay(), options.momentum(), device_lr_, options.dampening(),
                          options.nesterov(), first, device_skip_);
      } else {
        compat::fused_sgd(p, g, buffers, options.weight_decay(), options.momentum(), options.lr(),
                          options.dampening(), options.nesterov(), first);
      }
    };
    if (options.momentum() == 0) {
      run(params, grads, {}, false);
      return;
    }
    TensorVector running_params, running_grads, running_buffers, new_params, new_grads, new_buffers;
    for (size_t i = 0; i < params.size(); ++i) {
      if (auto* state = find_state<SGDParamState>(params[i])) {
        running_params.push_back(params[i]);
        running_grads.push_back(grads[i]);
        running_buffers.push_back(state->momentum_buffer());
      } else {
        auto& state_new = add_state<SGDParamState>(params[i]);
        state_new.momentum_buffer(torch::empty_like(params[i]));  // the kernel writes d into it
        new_params.push_back(params[i]);
        new_grads.push_back(grads[i]);
        new_buffers.push_back(state_new.momentum_buffer());
      }
    }
    run(running_params, running_grads, running_buffers, false);
    run(new_params, new_grads, new_buffers, true);
  }
};

// torch::optim::AdamW's update: p *= 1 - lr * weight_decay; m = beta1 * m + (1 - beta1) * g;
// v = beta2 * v + (1 - beta2) * g^2; p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
class MultiTensorAdamW final : public MultiTensorOptimizer {
 public:
  MultiTensorAdamW(const std::vector<OptimizerParamGroup>& groups, const AdamWOptions& defaults, bool fused)
      : MultiTensorOptimizer(groups, std::make_unique<AdamWOptions>(defaults), fused) {}

  void save(torch::serialize::OutputArchive& archive) const override {
    // The counts a step on the device advanced are what the checkpoint holds. (The optimizer is
    // not const: it was made by make_optimizer.)
    const_cast<MultiTensorAdamW*>(this)->copy_steps_to_host();
    torch::optim::serialize<AdamWParamState, AdamWOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<AdamWParamState, AdamWOptions>(archive, *this);
    device_steps_.clear();  // the loaded counts start them again
  }
  bool takes_device_controls() const override { return fused() && compat::kAdamwStepOnDevice; }

 private:
  void leave_device_controls() override {
    copy_steps_to_host();
    device_steps_.clear();
  }
  void copy_steps_to_host() {
    for (auto& [impl, entry] : device_steps_) {
      if (auto* state = find_state<AdamWParamState>(entry.first)) {
        state->step(static_cast<int64_t>(std::llround(entry.second.item<double>())));
      }
    }
  }

  void step_group(const OptimizerOptions& group_options, const TensorVector& params,
                  const TensorVector& grads) override {
    const auto& options = static_cast<const AdamWOptions&>(group_options);
    // make_optimizer never sets amsgrad; a loaded checkpoint could.
    TORCH_CHECK(!options.amsgrad(), "the foreach and fused AdamW do not implement amsgrad; use optim.impl: loop");
    const bool on_device = device_lr_.defined();
    TensorVector exp_avgs, exp_avg_sqs, device_steps;
    std::vector<int64_t> steps;
    for (const auto& param : params) {
      auto* state = find_state<AdamWParamState>(param);
      if (!state) {
        state = &add_state<AdamWParamState>(param);
        state->exp_avg(torch::zeros_like(param, torch::MemoryFormat::Preserve));
        state->exp_avg_sq(torch::zeros_like(param, torch::MemoryFormat::Preserve));
      }
      exp_avgs.push_back(state->exp_avg());
      exp_avg_sqs.push_back(state->exp_avg_sq());
      if (on_device) {
        // The count lives on the device from here on (a captured step replays without the host).
        auto& entry = device_steps_[param.unsafeGetTensorImpl()];
        if (!entry.second.defined()) {
          entry = {param, torch::full({}, static_cast<double>(state->step()), param.options().dtype(torch::kFloat))};
        }
        device_steps.push_back(entry.second);
        continue;
      }
      state->step(state->step() + 1);
      steps.push_back(state->step());
    }
    if (on_device) {
      const auto [beta1, beta2] = options.betas();
      compat::advance_steps(device_steps, device_skip_);
      compat::fused_adamw_on_device(params, grads, exp_avgs, exp_avg_sqs, device_steps, device_lr_, beta1, beta2,
                                    options.weight_decay(), options.eps(), device_skip_);
      return;
    }
    if (fused()) {
      fused_step(options, params, grads, exp_avgs, exp_avg_sqs, steps);
    } else {
      foreach_step(options, params, grads, exp_avgs, exp_avg_sqs, steps);
    }
  }

  static void foreach_step(const AdamWOptions& options, const TensorVector& params, const TensorVector& grads,
                           const TensorVector& exp_avgs, const TensorVector& exp_avg_sqs,
                           const std::vector<int64_t>& steps) {
    const auto [beta1, beta2] = options.betas();
    if (options.weight_decay() != 0) at::_foreach_mul_(params, 1 - options.lr() * options.weight_decay());
    at::_foreach_mul_(exp_avgs, beta1);
    at::_foreach_add_(exp_avgs, grads, 1 - beta1);
    at::_foreach_mul_(exp_avg_sqs, beta2);
    at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2);
    // Bias corrections per parameter: a parameter that first got a gradient later has a smaller t.
    std::vector<c10::Scalar> bias_correction2_sqrt, neg_step_size;
    for (const int64_t t : steps) {
      bias_correction2_sqrt.emplace_back(std::sqrt(1 - std::pow(beta2, t)));
      neg_step_size.emplace_back(-options.lr() / (1 - std::pow(beta1, t)));
    }
    TensorVector denoms = at::_foreach_sqrt(exp_avg_sqs);
    at::_foreach_div_(denoms, bias_correction2_sqrt);
    at::_foreach_add_(denoms, options.eps());
    at::_foreach_addcdiv_(params, exp_avgs, denoms, neg_step_size);
  }

  static void fused_step(const AdamWOptions& options, const TensorVector& params, const TensorVector& grads,
                         const TensorVector& exp_avgs, const TensorVector& exp_avg_sqs,
                         const std::vector<int64_t>& steps) {
    // The kernel reads each step count from a float tensor on the parameter's device; the
    // parameters of a group nearly always share one count, so one tensor per distinct count.
    std::map<int64_t, torch::Tensor> step_tensors;
    TensorVector step_list;
    for (size_t i = 0; i < params.size(); ++i) {
      auto& tensor = step_tensors[steps[i]];
      if (!tensor.defined()) {
        tensor = torch::full({}, static_cast<double>(steps[i]), params[i].options().dtype(torch::kFloat));
      }
      step_list.push_back(tensor);
    }
    const auto [beta1, beta2] = options.betas();
    compat::fused_adamw(params, grads, exp_avgs, exp_avg_sqs, step_list, options.lr(), beta1, beta2,
                        options.weight_decay(), options.eps());
  }

  // With device controls: each parameter's step count as a float tensor on its device, advanced
  // there; the host's AdamWParamState::step() catches up in save() and when the controls go.
  std::map<const c10::TensorImpl*, std::pair<torch::Tensor, torch::Tensor>> device_steps_;
};

enum class Impl { kFused, kForeach, kLoop };

Impl choose_impl(const OptimConfig& config, c10::DeviceType device) {
  const bool has_fused = config.name == "sgd" ? compat::has_fused_sgd(device) : compat::has_fused_adamw(device);
  if (config.impl == "auto") return has_fused ? Impl::kFused : Impl::kForeach;
  if (config.impl == "fused") {
    if (!has_fused) {
      throw ConfigError("key 'optim.impl': LibTorch " + compat::torch_version() + " has no fused " + config.name +
                        " kernel for " + c10::DeviceTypeName(device, /*lower_case=*/true) +
                        " tensors; use auto, foreach or loop");
    }
    return Impl::kFused;
  }
  if (config.impl == "foreach") return Impl::kForeach;
  if (config.impl == "loop") return Impl::kLoop;
  throw ConfigError("key 'optim.impl': unknown implementation '" + config.impl + "' (auto, fused, foreach, loop)");
}

struct Registered {
  OptimizerBuilder builder;
  std::string summary;
  int state_per_parameter = 0;
};

struct OptimizerRegistry {
  std::mutex mutex;
  std::map<std::string, Registered> entries;
};

OptimizerRegistry& optimizer_registry() {
  static OptimizerRegistry* registry = new OptimizerRegistry();  // never destroyed: usable at exit
  return *registry;
}

bool built_in(const std::string& name) { return name == "sgd" || name == "adamw"; }

std::optional<Registered> find_registered(const std::string& name) {
  OptimizerRegistry& r = optimizer_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.entries.find(name);
  if (it == r.entries.end()) return std::nullopt;
  return it->second;
}

// optim.impl picks among the built-in kernels: anything but auto is an error for a registered
// optimizer.
void check_impl(const OptimConfig& config, const Registered& registered) {
  if (config.impl != "auto") {
    throw ConfigError("key 'optim.impl': " + config.impl + " picks among the sgd and adamw kernels; '" + config.name +
                      "' (registered: " + registered.summary + ") steps as its builder made it; use auto");
  }
}

ConfigError unknown_optimizer(const std::string& name) {
  return ConfigError("key 'optim.name': " + detail::optimizer_name_problem(name));
}

}  // namespace

void register_optimizer(const std::string& name, OptimizerBuilder builder, const std::string& summary,
                        int state_per_parameter) {
  if (name.empty()) throw std::invalid_argument("register_optimizer: empty optimizer name");
  if (built_in(name)) {
    throw std::invalid_argument("register_optimizer: '" + name + "' is built in (optim.impl picks how it steps); "
                                "register yours under another name");
  }
  if (!builder) throw std::invalid_argument("register_optimizer: empty builder for '" + name + "'");
  if (state_per_parameter < 0) {
    throw std::invalid_argument("register_optimizer: state_per_parameter of '" + name + "' is negative");
  }
  {
    OptimizerRegistry& r = optimizer_registry();
    const std::lock_guard<std::mutex> lock(r.mutex);
    r.entries[name] = Registered{std::move(builder), summary, state_per_parameter};
  }
  detail::accept_optimizer_name(name);  // the config now takes it for optim.name
}

std::vector<std::string> optimizer_names() {
  std::vector<std::string> names = detail::accepted_optimizer_names();
  std::sort(names.begin(), names.end());
  return names;
}

int optimizer_state_per_parameter(const OptimConfig& config) {
  if (const int built_in_count = detail::built_in_state_per_parameter(config); built_in_count >= 0) {
    return built_in_count;
  }
  if (const auto registered = find_registered(config.name)) {
    check_impl(config, *registered);
    return registered->state_per_parameter;
  }
  throw unknown_optimizer(config.name);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimConfig& config, torch::nn::Module& model,
                                                        double lr) {
  OptimizerParams params;
  params.config = config;
  params.lr = lr;
  for (auto& p : model.parameters()) {
    if (!p.requires_grad()) continue;
    (p.dim() <= 1 && !config.decay_norm_and_bias ? params.no_decay : params.decay).push_back(p);
  }
  if (!built_in(config.name)) {
    const auto registered = find_registered(config.name);
    if (!registered) throw unknown_optimizer(config.name);
    check_impl(config, *registered);
    std::unique_ptr<torch::optim::Optimizer> made = registered->builder(params);
    if (!made) throw Error("the builder of optimizer '" + config.name + "' returned none");
    return made;
  }
  // What "auto" and "fused" can use depends on the device the parameters are on now.
  const auto& trained = params.decay.empty() ? params.no_decay : params.decay;
  const Impl impl = choose_impl(config, trained.empty() ? c10::DeviceType::CPU : trained.front().device().type());
  if (config.name == "sgd") {
    auto options = SGDOptions(lr).momentum(config.momentum).nesterov(config.nesterov);
    if (impl == Impl::kLoop) return std::make_unique<torch::optim::SGD>(param_groups(params, options), options);
    return std::make_unique<MultiTensorSGD>(param_groups(params, options), options, impl == Impl::kFused);
  }
  auto options = AdamWOptions(lr).betas({config.beta1, config.beta2}).eps(config.eps);
  if (impl == Impl::kLoop) return std::make_unique<torch::optim::AdamW>(param_groups(params, options), options);
  return std::make_unique<MultiTensorAdamW>(param_groups(params, options), options, impl == Impl::kFused);
}

std::string optimizer_impl(const torch::optim::Optimizer& optimizer) {
  if (const auto* sgd = dynamic_cast<const MultiTensorSGD*>(&optimizer)) {
    return sgd->fused() ? "sgd fused" : "sgd foreach";
  }
  if (const auto* adamw = dynamic_cast<const MultiTensorAdamW*>(&optimizer)) {
    return adamw->fused() ? "adamw fused" : "adamw foreach";
  }
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return "sgd loop";
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return "adamw loop";
  return "other";
}

void place_state_like_params(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  int64_t index = 0;
  auto place = [&index](const torch::Tensor& state, const torch::Tensor& param) -> torch::Tensor {
    if (!state.defined()) return state;
    if (state.sizes() != param.sizes()) {
      throw std::invalid_argument(log::str("optimizer state of parameter ", index, " has shape ", state.sizes(),
                                           " but the parameter has ", param.sizes()));
    }
    // A damaged checkpoint's state would fail at the first step ("expected scalar type Float") or
    // make every update non-finite.
    if (state.scalar_type() != param.scalar_type()) {
      throw std::invalid_argument(log::str("optimizer state of parameter ", index, " is ", state.scalar_type(),
                                           " but the parameter is ", param.scalar_type()));
    }
    if (!torch::isfinite(state).all().item<bool>()) {
      throw std::invalid_argument(log::str("optimizer state of parameter ", index, " holds NaN or infinite values"));
    }
    if (state.device() == param.device() && state.strides() == param.strides()) return state;
    return torch::empty_like(param, param.options().dtype(state.scalar_type())).copy_(state);
  };
  bool other_state = false;  // of a registered optimizer: its own state class
  torch::Device device = torch::kCPU;
  for (auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      if (index == 0) device = param.device();
      const auto it = optimizer.state().find(compat::optimizer_state_key(param));
      if (it != optimizer.state().end()) {
        if (auto* sgd = dynamic_cast<SGDParamState*>(it->second.get())) {
          sgd->momentum_buffer(place(sgd->momentum_buffer(), param));
        } else if (auto* adamw = dynamic_cast<AdamWParamState*>(it->second.get())) {
          adamw->exp_avg(place(adamw->exp_avg(), param));
          adamw->exp_avg_sq(place(adamw->exp_avg_sq(), param));
          adamw->max_exp_avg_sq(place(adamw->max_exp_avg_sq(), param));
        } else {
          other_state = true;
        }
      }
      ++index;
    }
  }
  if (!other_state) return;
  // A state class this code does not know: its tensors are reached through its own save() and
  // load(), read back onto the parameters' device (as torch.optim's load_state_dict casts them).
  // The options stay as they are: load() puts back what save() wrote.
  torch::serialize::OutputArchive out;
  optimizer.save(out);
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes, device);
  optimizer.state().clear();
  optimizer.load(in);
}

namespace detail {

bool set_device_step_controls(torch::optim::Optimizer& optimizer, const torch::Tensor& lr, const torch::Tensor& skip) {
  auto* multi = dynamic_cast<MultiTensorOptimizer*>(&optimizer);
  if (!multi || !multi->takes_device_controls()) return false;
  if (lr.defined() != skip.defined()) {
    throw std::invalid_argument("set_device_step_controls: give both the LR and the skip tensor, or neither");
  }
  for (const auto* t : {&lr, &skip}) {
    if (t->defined() && (t->dim() != 0 || t->scalar_type() != torch::kFloat)) {
      throw std::invalid_argument("set_device_step_controls: the LR and skip tensors are 0-dim float32");
    }
  }
  multi->set_device_controls(lr, skip);
  return true;
}

}  // namespace detail

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

LrSchedule::LrSchedule(const ScheduleConfig& config, double peak_lr, int64_t total_steps, int64_t warmup_steps)
    : config_(config), peak_(peak_lr), total_(std::max<int64_t>(1, total_steps)),
      warmup_(std::max<int64_t>(0, warmup_steps)) {}

double LrSchedule::at(int64_t step) const {
  if (step < warmup_) return peak_ * static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (config_.name == "constant") return peak_;
  if (config_.name == "cosine") {
    const double span = static_cast<double>(std::max<int64_t>(1, total_ - warmup_));
    const double t = std::min(1.0, static_cast<double>(step - warmup_) / span);
    const double floor = peak_ * config_.min_lr_ratio;
    return floor + (peak_ - floor) * 0.5 * (1.0 + std::cos(M_PI * t));
  }
  if (config_.name == "step") {
    double lr = peak_;
    for (double m : config_.milestones) {
      if (step >= static_cast<int64_t>(std::llround(m * static_cast<double>(total_)))) lr *= config_.gamma;
    }
    return lr;
  }
  throw ConfigError("key 'schedule.name': unknown schedule '" + config_.name + "'");
}

namespace {

// The global L2 norm of `groups`' gradients (fp32, 0-dim, on the first group's device), with
// multi-tensor kernels: one list per (device, dtype) goes to one norm, a handful of kernels for
// the whole model where a loop launches two per parameter.
torch::Tensor total_grad_norm(const std::map<TensorGroupKey, std::vector<torch::Tensor>>& groups) {
  std::vector<torch::Tensor> norms;  // fp32 norms, one per gradient
  for (const auto& [key, group] : groups) {
    const auto type = group.front().scalar_type();
    if (type == torch::kFloat || type == torch::kDouble) {
      for (auto& n : at::_foreach_norm(group, 2)) norms.push_back(n.to(torch::kFloat));
    } else {
      // fp16/bf16 gradients: the norm in fp32 (an fp16 norm overflows above 65,504).
      for (const auto& g : group) norms.push_back(g.to(torch::kFloat).norm());
    }
  }
  // Per-device partial norms meet on the first gradient's device.
  const auto& first = norms.front().device();
  for (auto& n : norms) n = n.to(first);
  return torch::stack(norms).norm();
}

// The model's gradients by (device, dtype), each list for one multi-tensor kernel.
std::map<TensorGroupKey, std::vector<torch::Tensor>> gradient_groups(torch::nn::Module& model) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : model.parameters()) grads.push_back(p.grad());
  return group_by_device_and_dtype(grads);
}

}  // namespace

double clip_grad_norm(torch::nn::Module& model, double max_norm) {
  torch::NoGradGuard no_grad;
  const auto groups = gradient_groups(model);
  if (groups.empty()) return 0.0;
  const double total = total_grad_norm(groups).item<double>();  // the one host read
  if (max_norm > 0 && total > max_norm) {
    const double scale = max_norm / (total + 1e-6);
    for (const auto& [key, group] : groups) at::_foreach_mul_(group, scale);
  }
  return total;
}

torch::Tensor clip_grad_norm_on_device(torch::nn::Module& model, double max_norm) {
  torch::NoGradGuard no_grad;
  const auto groups = gradient_groups(model);
  if (groups.empty()) return torch::zeros({}, torch::kFloat);
  const torch::Tensor total = total_grad_norm(groups);
  if (max_norm > 0) {
    // min(1, max_norm / (norm + 1e-6)): 1 below the limit (the gradients stay as they are), 0 for
    // an infinite norm, NaN for a NaN one.
    const torch::Tensor factor = (max_norm / (total + 1e-6)).clamp_max(1.0);
    for (const auto& [key, group] : groups) {
      compat::foreach_mul_by_tensor(group, factor.device() == group.front().device() ? factor
                                                                                        : factor.to(group.front().device()));
    }
  }
  return total;
}

}  // namespace train
