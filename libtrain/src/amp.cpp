#include "train/amp.h"

#include <cmath>
#include <stdexcept>

#include "compat.h"

namespace train {

AutocastScope::AutocastScope(torch::DeviceType device, torch::ScalarType dtype, bool enabled)
    : device_(device), enabled_(enabled) {
  if (!enabled_) return;
  prev_enabled_ = compat::autocast_enabled(device_);
  prev_dtype_ = compat::autocast_dtype(device_);
  compat::set_autocast_enabled(device_, true);
  compat::set_autocast_dtype(device_, dtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!enabled_) return;
  // The cast-weight cache lives for the outermost scope only, as in torch.autocast.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_, prev_enabled_);
  compat::set_autocast_dtype(device_, prev_dtype_);
}

bool autocast_enabled(torch::DeviceType device) { return compat::autocast_enabled(device); }

void to_channels_last(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (p.dim() == 4) p.set_data(p.data().contiguous(torch::MemoryFormat::ChannelsLast));
  }
  for (auto& b : module.buffers()) {
    if (b.dim() == 4) b.set_data(b.data().contiguous(torch::MemoryFormat::ChannelsLast));
  }
}

// ---------------------------------------------------------------------------------------------
// GradScaler
// ---------------------------------------------------------------------------------------------
namespace detail {

void non_finite_check_and_unscale(const std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                                  const torch::Tensor& inv_scale) {
  if (grads.empty()) return;
  // Nothing is read on the host: the finiteness flags and the products stay on the device (the
  // kernel's own contract), so a GPU running this (bf16 gradients) is not waited for per gradient.
  std::vector<torch::Tensor> finite;
  finite.reserve(grads.size());
  for (const auto& grad : grads) finite.push_back(grad.isfinite().all());
  found_inf.masked_fill_(torch::stack(finite).logical_not().any(), 1.0);
  for (const auto& grad : grads) {
    // The kernel multiplies by the fp32 inv_scale in the grad's own precision for fp32 and fp64,
    // and in fp32 with one rounding for fp16 and bf16 (by 1.0: the same values, as the kernel's).
    const bool reduced = grad.scalar_type() == torch::kHalf || grad.scalar_type() == torch::kBFloat16;
    if (reduced) {
      grad.copy_(grad.to(torch::kFloat).mul_(inv_scale));
    } else {
      grad.mul_(inv_scale);
    }
  }
}

void update_scale(torch::Tensor& scale, torch::Tensor& growth_tracker, const torch::Tensor& found_inf,
                  double growth_factor, double backoff_factor, int64_t growth_interval) {
  // Same arithmetic as the kernel: a float scale times a double factor, rounded to float.
  const float current = scale.item<float>();
  if (found_inf.item<float>() != 0.f) {
    scale.fill_(static_cast<float>(current * backoff_factor));
    growth_tracker.fill_(0);
    return;
  }
  const int64_t successful = growth_tracker.item<int>() + 1;
  if (successful == growth_interval) {
    const auto grown = static_cast<float>(current * growth_factor);
    if (std::isfinite(grown)) scale.fill_(grown);  // never grow past fp32's range to inf
    growth_tracker.fill_(0);
  } else {
    growth_tracker.fill_(successful);
  }
}

}  // namespace detail

namespace {

// `grads` share one dtype (GradScaler::unscale groups them so).
void non_finite_check_and_unscale(const std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                                  const torch::Tensor& inv_scale) {
  if (grads.empty()) return;
  if (compat::has_amp_unscale_kernel(found_inf.device().type(), grads.front().scalar_type())) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
  } else {
    detail::non_finite_check_and_unscale(grads, found_inf, inv_scale);
  }
}

void update_scale(torch::Tensor& scale, torch::Tensor& growth_tracker, const torch::Tensor& found_inf,
                  const GradScalerOptions& options) {
  if (compat::has_amp_scaler_kernels(scale.device().type())) {
    at::_amp_update_scale_(scale, growth_tracker, found_inf, options.growth_factor, options.backoff_factor,
                           options.growth_interval);
  } else {
    detail::update_scale(scale, growth_tracker, found_inf, options.growth_factor, options.backoff_factor,
                         options.growth_interval);
  }
}

}  // namespace

GradScaler::GradScaler(Options options) : options_(options), init_scale_(options.init_scale) {
  if (!(options_.init_scale > 0) || !(options_.growth_factor > 1) || !(options_.backoff_factor > 0) ||
      !(options_.backoff_factor < 1) || options_.growth_interval < 1) {
    throw std::invalid_argument(
        "GradScaler: needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1");
  }
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) {
  if (!options_.enabled) return loss;
  if (!scale_.defined()) {
    const auto on_device = torch::TensorOptions().device(loss.device());
    scale_ = torch::full({}, init_scale_, on_device.dtype(torch::kFloat));
    growth_tracker_ = torch::full({}, init_growth_tracker_, on_device.dtype(torch::kInt));
  }
  return loss * scale_;
}

void GradScaler::require_scale(const char* caller) const {
  if (!scale_.defined()) {
    throw std::logic_error(std::string("GradScaler::") + caller + "() before any scale(loss)");
  }
}

void GradScaler::unscale(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  require_scale("unscale");
  OptimizerRecord& record = records_[&optimizer];
  if (record.stage == Stage::kUnscaled) {
    throw std::logic_error("GradScaler::unscale() was already called for this optimizer since the last update()");
  }
  if (record.stage == Stage::kStepped) throw std::logic_error("GradScaler::unscale() after step()");

  torch::NoGradGuard no_grad;
  // The reciprocal in double, rounded once to float, as torch.amp.GradScaler computes it.
  const auto inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
  auto found_inf = torch::zeros({}, scale_.options());
  std::map<torch::ScalarType, std::vector<torch::Tensor>> grads_by_dtype;  // one kernel launch per dtype
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      const auto& grad = param.grad();
      if (!grad.defined()) continue;
      if (grad.device() != scale_.device()) {
        throw std::invalid_argument("GradScaler: a gradient is on " + grad.device().str() + ", the loss was on " +
                                    scale_.device().str());
      }
      // As in PyTorch: fp16 parameters lose small updates in the step itself; keep fp32 master
      // weights and let autocast produce the fp16 activations.
      if (grad.scalar_type() == torch::kHalf) {
        throw std::invalid_argument("GradScaler: fp16 gradients cannot be unscaled");
      }
      grads_by_dtype[grad.scalar_type()].push_back(grad);
    }
  }
  for (const auto& entry : grads_by_dtype) non_finite_check_and_unscale(entry.second, found_inf, inv_scale);
  record.found_inf = found_inf;
  record.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  OptimizerRecord& record = records_[&optimizer];  // std::map: stays valid while unscale() runs
  if (record.stage == Stage::kStepped) {
    throw std::logic_error("GradScaler::step() was already called for this optimizer since the last update()");
  }
  if (record.stage == Stage::kReady) unscale(optimizer);
  const bool finite = record.found_inf.item<float>() == 0.f;  // waits for the device
  if (finite) optimizer.step();
  record.stage = Stage::kStepped;
  return finite;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  require_scale("update");
  std::vector<torch::Tensor> found_infs;
  for (const auto& entry : records_) {
    if (entry.second.found_inf.defined()) found_infs.push_back(entry.second.found_inf);
  }
  if (found_infs.empty()) {
    throw std::logic_error("GradScaler::update() without unscale() or step() since the last update()");
  }
  const auto found_inf = torch::stack(found_infs).sum();
  update_scale(scale_, growth_tracker_, found_inf, options_);
  records_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

std::map<std::string, torch::Tensor> GradScaler::state() const {
  if (!options_.enabled) return {};
  if (!scale_.defined()) {
    return {{"scaler/scale", torch::full({}, init_scale_, torch::kFloat)},
            {"scaler/growth_tracker", torch::full({}, init_growth_tracker_, torch::kInt)}};
  }
  return {{"scaler/scale", scale_.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true)},
          {"scaler/growth_tracker", growth_tracker_.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true)}};
}

void GradScaler::load_state(const std::map<std::string, torch::Tensor>& state) {
  if (!options_.enabled) return;
  const auto scale = state.find("scaler/scale");
  const auto tracker = state.find("scaler/growth_tracker");
  if (scale == state.end() || tracker == state.end()) {
    throw std::invalid_argument(
        "GradScaler::load_state: no scaler/scale or scaler/growth_tracker entry (saved with a disabled scaler?)");
  }
  const double value = scale->second.item<double>();
  const int64_t growth = tracker->second.item<int64_t>();
  // A scale of 0 or inf would skip every step from then on, silently.
  if (!std::isfinite(value) || value <= 0 || growth < 0) {
    throw std::invalid_argument("GradScaler::load_state: scale " + std::to_string(value) + " and growth tracker " +
                                std::to_string(growth) + " are not a scaler's state (a finite scale > 0, a tracker >= 0)");
  }
  init_scale_ = value;
  init_growth_tracker_ = growth;
  if (scale_.defined()) {
    scale_.fill_(init_scale_);
    growth_tracker_.fill_(init_growth_tracker_);
  }
}

}  // namespace train
