#include "train/optim.h"

#include <torch/torch.h>

#include <cmath>

#include "train/errors.h"

namespace train {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimConfig& config, torch::nn::Module& model,
                                                        double lr) {
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : model.parameters()) {
    if (!p.requires_grad()) continue;
    (p.dim() <= 1 && !config.decay_norm_and_bias ? no_decay : decay).push_back(p);
  }
  auto groups = [&](auto options) {
    std::vector<torch::optim::OptimizerParamGroup> out;
    if (!decay.empty()) {
      auto o = std::make_unique<decltype(options)>(options);
      o->weight_decay(config.weight_decay);
      out.emplace_back(decay, std::move(o));
    }
    if (!no_decay.empty()) {
      auto o = std::make_unique<decltype(options)>(options);
      o->weight_decay(0.0);
      out.emplace_back(no_decay, std::move(o));
    }
    return out;
  };
  if (config.name == "sgd") {
    auto options = torch::optim::SGDOptions(lr).momentum(config.momentum).nesterov(config.nesterov);
    return std::make_unique<torch::optim::SGD>(groups(options), options);
  }
  if (config.name == "adamw") {
    auto options = torch::optim::AdamWOptions(lr).betas({config.beta1, config.beta2}).eps(config.eps);
    return std::make_unique<torch::optim::AdamW>(groups(options), options);
  }
  throw ConfigError("key 'optim.name': unknown optimizer '" + config.name + "' (sgd, adamw)");
}

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

double clip_grad_norm(torch::nn::Module& model, double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : model.parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return 0.0;
  std::vector<torch::Tensor> norms;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(g.detach().to(torch::kFloat).norm());
  const double total = torch::stack(norms).norm().item<double>();
  if (max_norm > 0 && total > max_norm) {
    const double scale = max_norm / (total + 1e-6);
    for (auto& g : grads) g.detach().mul_(scale);
  }
  return total;
}

}  // namespace train
