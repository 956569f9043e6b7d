#include "train/trainer.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <iomanip>
#include <optional>
#include <sstream>

#include "compat.h"
#include "train/amp.h"
#include "train/checkpoint.h"
#include "train/data/loader.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"
#include "train/optim.h"

namespace train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Mean cross-entropy over the batch; token tasks use -100 for positions without a target.
torch::Tensor loss_fn(const torch::Tensor& logits, const torch::Tensor& target, double label_smoothing) {
  auto options = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100);
  if (label_smoothing > 0) options.label_smoothing(label_smoothing);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
                                              target.reshape({-1}), options);
}

std::string fixed(double v, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << v;
  return out.str();
}

}  // namespace

struct Trainer::Impl {
  Config config;
  Plan plan;
  models::ModelPtr model;
  data::DatasetPtr train_set, val_set;
  std::string run_dir;
  torch::Device device{torch::kCPU};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<GradScaler> scaler;
  std::unique_ptr<data::Loader> loader;
  JsonlWriter metrics;
  std::atomic<bool> stop{false};
  int64_t step = 0;
  int64_t samples_seen = 0;

  std::string checkpoint_dir() const { return run_dir.empty() ? "" : files::join(run_dir, "checkpoints"); }
  int64_t batches_per_epoch() const { return plan.steps_per_epoch * plan.accum_steps; }
  double epoch_progress() const {
    const auto pos = loader->position();
    return static_cast<double>(pos.epoch) +
           static_cast<double>(pos.batch) / static_cast<double>(std::max<int64_t>(1, batches_per_epoch()));
  }

  // The next micro-batch; rolls over to the next epoch once this epoch's whole steps are used.
  data::Batch next_batch() {
    auto batch = loader->next();
    if (!batch) throw Error("loader ran out of batches mid-step (dataset shrank?)");
    return to_device(*batch);
  }

  data::Batch to_device(const data::Batch& batch) const {
    data::Batch b = batch.to(device, /*non_blocking=*/plan.pin_memory);
    if (plan.channels_last && b.input.dim() == 4) b.input = b.input.contiguous(torch::MemoryFormat::ChannelsLast);
    return b;
  }

  bool autocast() const { return plan.precision != "fp32"; }
  torch::ScalarType autocast_dtype() const { return plan.precision == "fp16" ? torch::kHalf : torch::kBFloat16; }

  void write_checkpoint(const std::string& path) {
    TrainState state;
    state.step = step;
    state.epoch = loader->position().epoch;
    state.batch_in_epoch = loader->position().batch;
    state.samples_seen = samples_seen;
    state.config_yaml = to_yaml(config);
    state.tensors["rng/cpu"] = compat::cpu_rng_state();
    for (auto& [name, tensor] : scaler->state()) state.tensors[name] = tensor;
    save_checkpoint(path, *model, optimizer.get(), state);
    prune_checkpoints(checkpoint_dir(), config.checkpoint.keep_last, path);
  }
};

Trainer::Trainer(Config config, Plan plan, models::ModelPtr model, data::DatasetPtr train, data::DatasetPtr val,
                 std::string run_dir)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.config = std::move(config);
  s.plan = std::move(plan);
  s.model = std::move(model);
  s.train_set = std::move(train);
  s.val_set = std::move(val);
  s.run_dir = std::move(run_dir);
  if (s.plan.total_steps <= 0) finalize_schedule(s.plan, s.config, s.train_set->size());
  s.device = torch::Device(s.plan.device.device_string());
  s.model->to(s.device);
  if (s.plan.channels_last) to_channels_last(*s.model);
  s.optimizer = make_optimizer(s.config.optim, *s.model, s.plan.lr);
  GradScalerOptions scaling;
  scaling.enabled = s.plan.loss_scaling;  // disabled: scale/step/update are pass-throughs
  s.scaler = std::make_unique<GradScaler>(scaling);
  data::LoaderOptions lo;
  lo.batch_size = s.plan.micro_batch;
  lo.shuffle = s.config.data.shuffle;
  lo.drop_last = true;
  lo.workers = s.plan.workers;
  lo.prefetch = s.plan.prefetch;
  lo.seed = static_cast<uint64_t>(s.config.trainer.seed);
  lo.pin_memory = s.plan.pin_memory;
  lo.rank = s.plan.rank;
  lo.world_size = s.plan.world_size;
  s.loader = std::make_unique<data::Loader>(s.train_set, lo);
  if (!s.run_dir.empty() && s.config.logging.jsonl && s.plan.rank == 0) {
    s.metrics = JsonlWriter(files::join(s.run_dir, "metrics.jsonl"));
  }
}

Trainer::~Trainer() = default;

const Plan& Trainer::plan() const { return impl_->plan; }
models::Model& Trainer::model() { return *impl_->model; }
void Trainer::request_stop() { impl_->stop.store(true); }

EvalResult Trainer::evaluate() {
  auto& s = *impl_;
  EvalResult result;
  if (!s.val_set) return result;
  data::LoaderOptions lo;
  lo.batch_size = s.config.trainer.eval_batch > 0 ? s.config.trainer.eval_batch : s.plan.micro_batch;
  lo.shuffle = false;
  lo.drop_last = false;
  lo.workers = s.plan.workers;
  lo.prefetch = s.plan.prefetch;
  lo.pin_memory = s.plan.pin_memory;
  data::Loader loader(s.val_set, lo);
  loader.start({0, 0});
  torch::NoGradGuard no_grad;
  s.model->eval();
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(s.device));
  auto correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(s.device));
  while (auto batch = loader.next()) {
    auto b = s.to_device(*batch);
    torch::Tensor logits;
    {
      AutocastScope amp(s.device.type(), s.autocast_dtype(), s.autocast());
      logits = s.model->forward(b.input);
    }
    auto flat_logits = logits.reshape({-1, logits.size(-1)}).to(torch::kFloat);
    auto flat_target = b.target.reshape({-1});
    auto valid = flat_target.ne(-100);
    loss_sum += torch::nn::functional::cross_entropy(
                    flat_logits, flat_target,
                    torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum))
                    .to(torch::kDouble);
    correct += flat_logits.argmax(-1).eq(flat_target).logical_and(valid).sum();
    result.samples += valid.sum().item<int64_t>();
  }
  s.model->train();
  if (result.samples > 0) {
    result.loss = loss_sum.item<double>() / static_cast<double>(result.samples);
    result.accuracy = static_cast<double>(correct.item<int64_t>()) / static_cast<double>(result.samples);
  }
  return result;
}

FitResult Trainer::fit(const std::string& resume) {
  auto& s = *impl_;
  FitResult result;
  const auto fit_start = Clock::now();
  const std::string ckpt_dir = s.checkpoint_dir();

  // ---- initial state: resume, init_from, or fresh ----
  std::string resume_path = resume;
  if (resume == "auto") {
    resume_path = ckpt_dir.empty() ? "" : latest_checkpoint(ckpt_dir);
    if (resume_path.empty()) log::info("resume auto: no checkpoint in " + ckpt_dir + "; starting fresh");
  }
  data::LoaderPosition start_pos{0, 0};
  if (!resume_path.empty()) {
    const TrainState st = load_checkpoint(resume_path, *s.model, s.optimizer.get());
    s.step = st.step;
    s.samples_seen = st.samples_seen;
    start_pos = {st.epoch, st.batch_in_epoch};
    if (auto it = st.tensors.find("rng/cpu"); it != st.tensors.end()) compat::set_cpu_rng_state(it->second);
    if (s.plan.loss_scaling && st.tensors.count("scaler/scale")) s.scaler->load_state(st.tensors);
    result.resumed_from_step = s.step;
    log::info(log::str("resumed from ", resume_path, " at step ", s.step, " (epoch ", st.epoch, ", batch ",
                       st.batch_in_epoch, ")"));
  } else if (!s.config.model.init_from.empty()) {
    load_model_weights(s.config.model.init_from, *s.model, s.config.model.init_strict);
    log::info("model weights initialised from " + s.config.model.init_from);
  }
  s.loader->start(start_pos);
  s.model->train();

  const LrSchedule schedule(s.config.schedule, s.plan.lr, s.plan.total_steps, s.plan.warmup_steps);
  const int64_t log_every = std::max<int64_t>(1, s.config.logging.every_steps);
  Meter step_time, loss_meter;
  auto window_loss = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(s.device));
  int64_t window_steps = 0, window_samples = 0;
  auto window_start = Clock::now();
  double window_wait_start = s.loader->wait_seconds();
  const double wait_at_start = s.loader->wait_seconds();
  const auto loop_start = Clock::now();
  const int64_t first_step = s.step;

  auto evaluate_and_log = [&]() {
    const EvalResult ev = evaluate();
    if (ev.samples == 0) return ev;
    log::info(log::str("eval step ", s.step, " | loss ", fixed(ev.loss, 4), " | top-1 ",
                       fixed(100.0 * ev.accuracy, 2), "% (", ev.samples, " samples)"));
    MetricRecord r;
    r.add("step", s.step).add("epoch", s.epoch_progress()).add("split", "val").add("loss", ev.loss)
        .add("accuracy", ev.accuracy).add("samples", ev.samples);
    s.metrics.write(r);
    return ev;
  };

  bool evaluated_at_end = false;
  while (s.step < s.plan.total_steps) {
    const auto t0 = Clock::now();
    s.optimizer->zero_grad();
    auto step_loss = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(s.device));
    for (int64_t micro = 0; micro < s.plan.accum_steps; ++micro) {
      const data::Batch batch = s.next_batch();
      torch::Tensor loss;
      {
        AutocastScope amp(s.device.type(), s.autocast_dtype(), s.autocast());
        loss = loss_fn(s.model->forward(batch.input), batch.target, s.config.loss.label_smoothing);
      }
      // Every micro-batch has the same size, so the mean over the global batch is the mean
      // of the micro-batch means.
      s.scaler->scale(loss / static_cast<double>(s.plan.accum_steps)).backward();
      step_loss += loss.detach().to(torch::kDouble);
    }
    if (s.config.optim.clip_grad_norm > 0) {
      s.scaler->unscale(*s.optimizer);  // clip the true gradients, not the scaled ones
      clip_grad_norm(*s.model, s.config.optim.clip_grad_norm);
    }
    const double lr = schedule.at(s.step);
    set_learning_rate(*s.optimizer, lr);
    s.scaler->step(*s.optimizer);  // skips the step when a gradient is inf/NaN (loss scaling only)
    s.scaler->update();
    ++s.step;
    s.samples_seen += s.plan.global_batch;
    window_loss += step_loss / static_cast<double>(s.plan.accum_steps);
    ++window_steps;
    window_samples += s.plan.micro_batch * s.plan.accum_steps;
    step_time.add(seconds_since(t0));

    // Epoch boundary: the loader has delivered every whole step of this epoch.
    bool epoch_end = false;
    if (s.loader->position().batch >= s.batches_per_epoch()) {
      s.loader->start({s.loader->position().epoch + 1, 0});
      epoch_end = true;
    }
    const bool last = s.step == s.plan.total_steps;

    if (s.step % log_every == 0 || last) {
      const double elapsed = seconds_since(window_start);
      const double waited = s.loader->wait_seconds() - window_wait_start;
      const double mean_loss = window_loss.item<double>() / static_cast<double>(window_steps);
      if (!std::isfinite(mean_loss)) {
        throw Error(log::str("loss is ", mean_loss, " at step ", s.step,
                             "; lower optim.lr or enable optim.clip_grad_norm"));
      }
      const double sps = static_cast<double>(window_samples) / std::max(elapsed, 1e-9);
      const double eta = step_time.mean() * static_cast<double>(s.plan.total_steps - s.step);
      result.train_loss = mean_loss;
      log::info(log::str("step ", s.step, "/", s.plan.total_steps, " ep ", fixed(s.epoch_progress(), 2), " | loss ",
                         fixed(mean_loss, 4), " | lr ", lr, " | ", fixed(sps, 1), " samples/s | ",
                         fixed(1000.0 * elapsed / window_steps, 1), " ms/step | data ",
                         fixed(100.0 * waited / std::max(elapsed, 1e-9), 1), "% | ETA ", format_duration(eta)));
      MetricRecord r;
      r.add("step", s.step).add("epoch", s.epoch_progress()).add("split", "train").add("loss", mean_loss)
          .add("lr", lr).add("samples_per_s", sps).add("step_time_ms", 1000.0 * elapsed / window_steps)
          .add("data_wait_ms", 1000.0 * waited / window_steps);
      if (s.plan.loss_scaling) r.add("loss_scale", s.scaler->get_scale());
      s.metrics.write(r);
      window_loss.zero_();
      window_steps = 0;
      window_samples = 0;
      window_start = Clock::now();
      window_wait_start = s.loader->wait_seconds();
      step_time.reset();
    }

    const int64_t eval_every = s.config.trainer.eval_every_steps;
    if ((eval_every > 0 && s.step % eval_every == 0) || (eval_every == 0 && epoch_end) || last) {
      result.val = evaluate_and_log();
      evaluated_at_end = last;
    }
    const bool stopping = s.stop.load();
    const int64_t every = s.config.checkpoint.every_steps;
    if (!ckpt_dir.empty() && ((every > 0 && s.step % every == 0) || last || stopping)) {
      result.last_checkpoint = checkpoint_path(ckpt_dir, s.step);
      s.write_checkpoint(result.last_checkpoint);
      log::info("checkpoint " + result.last_checkpoint);
    }
    if (stopping && !last) {
      log::warn(log::str("stop requested: stopped after step ", s.step, "; resume with --resume auto"));
      break;
    }
  }
  if (!evaluated_at_end && s.step == s.plan.total_steps && first_step == s.step) result.val = evaluate_and_log();
  result.steps = s.step;
  result.seconds = seconds_since(fit_start);
  const double loop_time = seconds_since(loop_start);
  result.data_wait_fraction = loop_time > 0 ? (s.loader->wait_seconds() - wait_at_start) / loop_time : 0.0;
  return result;
}

}  // namespace train
