#include "train/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

#include "compat.h"
#include "rng_state.h"
#ifdef TRAIN_WITH_CUDA
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include "train/amp.h"
#include "train/checkpoint.h"
#include "train/data/loader.h"
#include "train/data/tokens.h"
#include "train/data/transforms.h"
#include "train/ddp.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"
#include "train/optim.h"
#include "train/probe.h"
#include "train/run.h"
#include "models/own_loss.h"
#include "step_graph.h"
#include "tensor_groups.h"

namespace train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Cross-entropy over the batch, mean or sum; token tasks use -100 for positions without a target.
// `model` names the model in the message when the logits do not fit the data's `num_classes`.
torch::Tensor loss_fn(const std::string& model, int64_t num_classes, const torch::Tensor& logits,
                      const torch::Tensor& target, double label_smoothing, bool sum = false) {
  check_logits(model, logits, target.numel(), num_classes);
  auto options = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100);
  if (label_smoothing > 0) options.label_smoothing(label_smoothing);
  if (sum) options.reduction(torch::kSum);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
                                              target.reshape({-1}), options);
}

// Loss scaling: this many consecutive non-finite losses are divergence, not overflow.
constexpr int64_t kNonfiniteLossStreak = 10;

// Multiplies every gradient by `factor` (token targets: from the fixed divisor of the loss sums
// to the mean over the global batch's targets).
void token_loss_rescale(torch::nn::Module& model, double factor) {
  if (factor == 1.0) return;
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters()) {
    if (p.grad().defined()) p.mutable_grad().mul_(factor);
  }
}

// Moves batches to the GPU one batch ahead, on a side stream: the copy of batch k+1 from pinned
// host memory runs while the compute stream works on batch k. The compute stream waits on an
// event before it touches a batch, and the batch's memory is marked as used by the compute stream
// so that the caching allocator does not hand it out early.
class DeviceFeeder {
 public:
#ifdef TRAIN_WITH_CUDA
  explicit DeviceFeeder(torch::Device device, bool channels_last)
      : device_(device), channels_last_(channels_last), side_(c10::cuda::getStreamFromPool(false, device.index())),
        ready_(c10::DeviceType::CUDA) {}

  void stage(data::Batch host) {
    c10::cuda::CUDAStreamGuard guard(side_);
    staged_ = host.to(device_, /*non_blocking=*/true);
    if (channels_last_ && staged_.input.dim() == 4) {
      staged_.input = staged_.input.contiguous(torch::MemoryFormat::ChannelsLast);
    }
    ready_.record(side_.unwrap());
    host_ = std::move(host);  // the pinned source stays alive until the copy is done
    has_ = true;
  }

  data::Batch take() {
    const c10::Stream compute = c10::cuda::getCurrentCUDAStream(device_.index()).unwrap();
    ready_.block(compute);
    for (auto* t : {&staged_.input, &staged_.target}) {
      if (t->defined()) t->record_stream(compute);
    }
    has_ = false;
    host_ = data::Batch{};
    return std::move(staged_);
  }
#else
  explicit DeviceFeeder(torch::Device, bool) {}
  void stage(data::Batch) {}
  data::Batch take() { return {}; }
#endif
  bool staged() const { return has_; }
  // Drops the batch staged ahead (the loader is about to be rewound).
  void reset() {
#ifdef TRAIN_WITH_CUDA
    if (has_) side_.synchronize();
    staged_ = data::Batch{};
    host_ = data::Batch{};
#endif
    has_ = false;
  }

 private:
#ifdef TRAIN_WITH_CUDA
  torch::Device device_;
  bool channels_last_;
  c10::cuda::CUDAStream side_;
  c10::Event ready_;
  data::Batch staged_, host_;
#endif
  bool has_ = false;
};

// The first line of an exception message (c10's carry a C++ backtrace after it).
std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// The largest divisor of n that is at most n / 2 (0 when n is 1): the next micro-batch after an
// out-of-memory error, so that micro-batch x accumulation still makes the global batch exactly.
int64_t smaller_micro_batch(int64_t n) {
  for (int64_t d = n / 2; d >= 1; --d) {
    if (n % d == 0) return d;
  }
  return 0;
}

// The model's buffers (BatchNorm's running statistics) as they were at the start of a step, so
// that a step redone after running out of memory does not count its first micro-batches' batch
// statistics twice. One concatenated copy per device and dtype: a couple of kernels a step.
class BufferSnapshot {
 public:
  void take(torch::nn::Module& model) {
    torch::NoGradGuard no_grad;
    groups_.clear();
    for (auto& [key, buffers] : group_by_device_and_dtype(model.buffers())) {
      std::vector<torch::Tensor> flat;
      flat.reserve(buffers.size());
      for (const auto& b : buffers) flat.push_back(b.reshape({-1}));
      groups_.push_back({std::move(buffers), torch::cat(flat)});
    }
  }
  void restore() const {
    torch::NoGradGuard no_grad;
    for (const auto& [buffers, copy] : groups_) {
      int64_t offset = 0;
      for (const auto& b : buffers) {
        const int64_t n = b.numel();
        b.copy_(copy.narrow(0, offset, n).view(b.sizes()));
        offset += n;
      }
    }
  }

 private:
  std::vector<std::pair<std::vector<torch::Tensor>, torch::Tensor>> groups_;
};

}  // namespace

// " | mae 0.0312 | hit_rate 0.9140": the model's own measures (Model::eval_metrics).
static std::string describe_metrics(const EvalResult& ev) {
  std::string text;
  for (const auto& [name, value] : ev.metrics) text += " | " + name + " " + log::measure(value);
  return text;
}

// "accuracy 91.23% at step 1872", "loss 0.4312 at step 1872", and a model's own measure
// (Model::eval_metrics) as "mae 0.0312 at step 1872".
static std::string describe_best(const BestCheckpoint& best) {
  const bool percent = best.metric == "accuracy" || best.metric == "top5";
  return log::str(best.metric, " ", percent ? log::fixed(100.0 * best.value, 2) + "%" : log::measure(best.value),
                  " at step ", best.step);
}

struct Trainer::Impl {
  Config config;
  Plan plan;
  models::ModelPtr model;
  data::DatasetPtr train_set, val_set;
  std::string run_dir;
  // The newest checkpoint an earlier fit() of this trainer wrote: a later call that writes none
  // (its run already complete) still reports it in FitResult::last_checkpoint.
  std::string last_written;
  torch::Device device{torch::kCPU};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<GradScaler> scaler;
  std::unique_ptr<data::Loader> loader;
  std::unique_ptr<DeviceFeeder> feeder;  // CUDA with pinned memory: copies one batch ahead
  // plan.checkpoint_async, on rank 0 with a run directory: checkpoints, their pruning and best.pt
  // are written on its thread, in order.
  std::unique_ptr<AsyncCheckpointWriter> writer;
  dist::GroupPtr group;                 // null for a single process
  std::unique_ptr<dist::GradSync> sync;  // data-parallel gradient averaging (group of > 1 rank)
  bool has_buffers = false;
  bool own_loss = false;  // the model's loss() instead of cross-entropy (Model::has_own_loss)
  std::vector<models::Model::EvalMetric> eval_metrics;  // the model's own evaluation measures
  // plan.cuda_graphs: the step captured in a CUDA graph, and the device tensors its fused
  // optimizer reads the learning rate and the skip flag (a non-finite loss) from.
  std::unique_ptr<detail::StepGraph> graph;
  torch::Tensor step_lr, step_skip;
  int64_t graph_replays = 0;  // of graphs already released
  BufferSnapshot step_buffers;  // with tuning.oom_recovery: the buffers at the start of the step
  OomListener on_oom;
  // on_nonfinite rollback: steps whose batches gave a non-finite loss, as (epoch, first sample of
  // the step in this rank's share of the epoch); they are passed over. Saved in checkpoints.
  std::set<std::pair<int64_t, int64_t>> bad_steps;
  int64_t rollbacks = 0;
  int64_t oom_recoveries = 0;
  int64_t scaler_nonfinite_loss = 0;  // loss scaling: steps with a non-finite loss (left out of the loss windows)
  int64_t scaler_skipped = 0;         // loss scaling: steps the scaler skipped for inf/NaN gradients
  int64_t nonfinite_loss_streak = 0;     // loss scaling: consecutive steps whose loss was non-finite
  double retired_wait = 0;     // wait_seconds() of loaders replaced after an out-of-memory error
  // data.on_error skip: the (epoch, index) of samples replaced, from loaders replaced after an
  // out-of-memory error (the new loader delivers their staged batch again) or read from a checkpoint.
  std::set<std::pair<int64_t, int64_t>> retired_skipped;
  // plan.workers_adaptive: the data wait measured since the loader last (re)started.
  struct {
    bool warm = false;  // the first window after a (re)start pays for the workers' start-up
    int64_t steps = 0;
    double seconds = 0;
    double waited = 0;
  } starving;
  MetricsSink metrics;
  std::vector<MetricsListener> metrics_listeners;  // rank 0's
  // A record for metrics.jsonl / TensorBoard (rank 0's run directory) and the listeners.
  void record(const MetricRecord& r) {
    metrics.write(r);
    if (plan.rank != 0) return;
    for (const auto& listener : metrics_listeners) listener(r);
  }
  std::atomic<bool> stop{false};
  // A graceful stop skipped the evaluation due at `step`: the resumed run does it first.
  bool eval_pending = false;
  // checkpoint.best: the best evaluation so far (this run's, or best.json's from an earlier one).
  std::optional<BestCheckpoint> best;
  // trainer.early_stop_patience: evaluations in a row since the last that improved on `best`.
  int64_t evals_without_improvement = 0;

  // The value checkpoint.best ranks an evaluation by; nullopt when off or the metric is missing.
  std::optional<double> best_metric(const EvalResult& ev) const {
    const std::string& metric = config.checkpoint.best;
    if (metric == "none" || ev.samples == 0) return std::nullopt;
    if (metric == "loss") return ev.loss;
    if (metric == "top5") return ev.has_top5 ? std::optional<double>(ev.top5) : std::nullopt;
    if (metric == "accuracy") return ev.has_accuracy ? std::optional<double>(ev.accuracy) : std::nullopt;
    for (const auto& [name, value] : ev.metrics) {
      if (name == metric) return value;
    }
    return std::nullopt;
  }
  // Whether `value` of checkpoint.best's metric beats `best` (ties do not).
  bool better(double value, double best_value) const {
    const std::string& metric = config.checkpoint.best;
    for (const auto& m : eval_metrics) {
      if (m.name == metric) return m.higher_is_better ? value > best_value : value < best_value;
    }
    return better_than(metric, value, best_value);
  }
  // Whether `ev` becomes the best checkpoint: the same answer on every rank (the evaluation is
  // reduced over them, and the best so far came from rank 0).
  bool improves_best(const EvalResult& ev) const {
    const std::optional<double> value = best_metric(ev);
    return value && std::isfinite(*value) && (!best || better(*value, best->value));
  }
  // trainer.early_stop_patience: counts an evaluation that did (or did not) improve on the best,
  // by more than trainer.early_stop_min_delta. Called before keep_best replaces `best`.
  void count_evaluation(const EvalResult& ev, bool improved) {
    const std::optional<double> value = best_metric(ev);
    if (config.trainer.early_stop_patience == 0 || !value) return;
    const bool enough = improved && (!best || std::abs(*value - best->value) > config.trainer.early_stop_min_delta);
    evals_without_improvement = enough ? 0 : evals_without_improvement + 1;
  }
  bool early_stop_due() const {
    return config.trainer.early_stop_patience > 0 && evals_without_improvement >= config.trainer.early_stop_patience;
  }
  std::string describe_early_stop() const {
    return log::str("val ", config.checkpoint.best, " has not improved for ", evals_without_improvement,
                    " evaluation(s) (trainer.early_stop_patience ", config.trainer.early_stop_patience, ")",
                    best ? "; best " + describe_best(*best) : std::string());
  }
  // Records `ev` at the current step as the best, and on rank 0 makes `checkpoint` best.pt.
  void keep_best(const EvalResult& ev, const std::string& checkpoint) {
    BestCheckpoint record{config.checkpoint.best, *best_metric(ev), step};
    const std::string dir = checkpoint_dir();
    if (plan.rank == 0 && !dir.empty()) {
      // After the checkpoint's write: on the writer's thread when it writes in the background.
      auto link = [dir, checkpoint, record, previous = best] {
        if (!files::exists(checkpoint)) return;
        keep_best_checkpoint(dir, checkpoint, record);
        log::info(log::str("best checkpoint: val ", describe_best(record),
                           previous ? " (was " + describe_best(*previous) + ")" : std::string(), " -> ",
                           best_checkpoint_path(dir)));
      };
      if (writer) {
        writer->then(link);
      } else {
        link();
      }
    }
    best = record;
  }
  int64_t step = 0;
  int64_t samples_seen = 0;
  // The training loss of the steps after the last logged row, summed over every rank, as the
  // checkpoint restored holds it (loss, weight): the row the resumed run logs next covers them
  // too. Rank 0 carries it; the others start from 0, so the ranks' sums still add up.
  std::pair<double, double> loss_window_before{0.0, 0.0};

  std::string checkpoint_dir() const { return run_dir.empty() ? "" : files::join(run_dir, "checkpoints"); }
  int64_t batches_per_epoch() const { return plan.steps_per_epoch * plan.accum_steps; }
  // Where training stands in the data: the loader's position less the batch staged ahead.
  data::LoaderPosition consumed() const {
    auto pos = loader->position();
    if (feeder && feeder->staged()) --pos.batch;
    return pos;
  }
  // The same in samples, which stays valid when the micro-batch changes.
  std::pair<int64_t, int64_t> sample_position() const {
    const auto pos = consumed();
    return {pos.epoch, pos.batch * plan.micro_batch};
  }
  double loader_wait() const { return retired_wait + loader->wait_seconds(); }
  int64_t loader_skipped() const {
    int64_t count = static_cast<int64_t>(retired_skipped.size());
    for (const auto& sample : loader->skipped_samples()) count += retired_skipped.count(sample) == 0;
    return count;
  }
  // data.on_error skip: the samples replaced so far on every rank, as rows (rank, epoch, index),
  // for the checkpoint, so that a resumed run counts them as the uninterrupted one does. A
  // collective with more than one rank: every rank calls it at the same step.
  torch::Tensor skipped_rows() const {
    std::set<std::pair<int64_t, int64_t>> mine = retired_skipped;
    mine.insert(loader->skipped_samples().begin(), loader->skipped_samples().end());
    const int64_t world = group ? group->size() : 1;
    const int64_t rank = group ? group->rank() : 0;
    std::vector<int64_t> counts(static_cast<size_t>(world), 0);
    counts[static_cast<size_t>(rank)] = static_cast<int64_t>(mine.size());
    if (group) counts = group->reduce_ints(counts, dist::ReduceOp::Sum);
    int64_t total = 0, first = 0;
    for (int64_t r = 0; r < world; ++r) {
      if (r == rank) first = total;
      total += counts[static_cast<size_t>(r)];
    }
    auto rows = torch::zeros({total, 3}, torch::kLong);
    auto* out = rows.data_ptr<int64_t>() + 3 * first;
    for (const auto& [epoch, index] : mine) {
      *out++ = rank;
      *out++ = epoch;
      *out++ = index;
    }
    if (group && total > 0) {  // each rank filled its own rows; the sum puts them all together
      rows = rows.to(device);
      group->allreduce(rows, dist::ReduceOp::Sum);
      rows = rows.cpu();
    }
    return rows;
  }

  void make_loader() {
    if (loader) {
      retired_wait += loader->wait_seconds();
      retired_skipped.insert(loader->skipped_samples().begin(), loader->skipped_samples().end());
      loader.reset();  // joins its workers
    }
    data::LoaderOptions lo;
    lo.batch_size = plan.micro_batch;
    lo.shuffle = config.data.shuffle;
    lo.drop_last = true;
    lo.workers = plan.workers;
    lo.prefetch = plan.prefetch;
    // Workers read ahead into the next epoch, but not past the run's last one.
    lo.epochs = plan.steps_per_epoch > 0 ? (plan.total_steps + plan.steps_per_epoch - 1) / plan.steps_per_epoch : 0;
    lo.seed = static_cast<uint64_t>(config.trainer.seed);
    lo.pin_memory = plan.pin_memory;
    lo.rank = plan.rank;
    lo.world_size = plan.world_size;
    lo.on_error = data::parse_on_error(config.data.on_error);
    loader = std::make_unique<data::Loader>(train_set, lo);
  }
  // plan.workers_adaptive: at the end of each logging window, once at least 8 steps and 0.25 s
  // have been measured since the loader last started, a data wait above 5 % of that time doubles
  // the loader's workers (up to plan.max_workers). Delivery does not depend on the worker count,
  // so training continues on exactly the same batches, and the batches already built are kept.
  void adapt_workers(double seconds, double waited, int64_t steps) {
    if (!plan.workers_adaptive || plan.workers >= plan.max_workers) return;
    if (!starving.warm) {
      starving = {};
      starving.warm = true;
      return;
    }
    starving.steps += steps;
    starving.seconds += seconds;
    starving.waited += waited;
    if (starving.steps < 8 || starving.seconds < 0.25) return;
    const double fraction = starving.waited / starving.seconds;
    const int64_t measured = starving.steps;
    starving = {};
    starving.warm = true;
    if (fraction <= 0.05) return;
    const int64_t before = plan.workers;
    plan.workers = std::min(plan.max_workers, 2 * before);
    loader->set_workers(plan.workers);  // joins the running workers; nothing built is dropped
    starving.warm = false;
    log::info(log::str("data wait ", log::fixed(100.0 * fraction, 1), "% of the last ", measured, " steps with ", before,
                       " loader worker", before == 1 ? "" : "s", " (> 5%): raising data workers to ", plan.workers,
                       " (at most ", plan.max_workers, ")"));
  }
  // Continues the data at a sample position (from a checkpoint, or the start of a step to redo).
  void rewind(int64_t epoch, int64_t sample, const std::string& source) {
    if (sample % plan.micro_batch != 0) {
      throw CheckpointError(log::str(source, ": its data position (sample ", sample, " of epoch ", epoch,
                                     ") is not a multiple of the micro-batch ", plan.micro_batch));
    }
    if (sample / plan.micro_batch > batches_per_epoch()) {
      throw CheckpointError(log::str(
          source, ": it was written ", sample * plan.world_size, " samples into epoch ", epoch,
          ", more than an epoch of the training set now gives (", batches_per_epoch() / plan.accum_steps,
          " steps of ", plan.global_batch, " from ", train_set->describe(),
          "): the data changed since; resume with the data it was written with, or start a new run"));
    }
    if (feeder) feeder->reset();
    loader->start({epoch, sample / plan.micro_batch});
  }
  // The epoch boundary: once this epoch's whole steps are consumed the loader moves on.
  bool maybe_next_epoch() {
    if (consumed().batch < batches_per_epoch()) return false;
    if (feeder) feeder->reset();
    loader->start({consumed().epoch + 1, 0});
    return true;
  }
  // Whether this step runs through the CUDA graph. A graph that went off (a failed capture, no
  // gain, accumulation after an out-of-memory error) is released here, and the optimizer goes
  // back to its host-side learning rate.
  bool graph_step() {
    if (!graph) return false;
    if (graph->active() && plan.accum_steps > 1) {
      graph->stop(log::str("micro-batch ", plan.micro_batch, " x ", plan.accum_steps, " accumulation steps"));
    }
    if (graph->active()) return true;
    detail::set_device_step_controls(*optimizer, torch::Tensor(), torch::Tensor());
    log::info("cuda_graphs: " + graph->summary());
    graph_replays += graph->replays();
    graph.reset();
    step_lr = step_skip = torch::Tensor();
    return false;
  }

  // One whole step for the graph: gradients dropped (inside the capture, the backward pass then
  // allocates them from the graph's pool, where every replay rewrites them), forward, backward and
  // the fused optimizer step, which reads the LR from step_lr and skips its update when the loss
  // (or, with clipping, the gradient norm) is not finite, all on the device.
  torch::Tensor graph_step_compute(const torch::Tensor& input, const torch::Tensor& target) {
    drop_gradients();
    torch::Tensor loss;
    {
      AutocastScope amp(device.type(), autocast_dtype(), autocast());
      loss = own_loss ? checked_own_loss(*model, config.model.name, model->forward(input), target)
                      : loss_fn(config.model.name, train_set->num_classes(), model->forward(input), target,
                                config.loss.label_smoothing);
    }
    loss.backward();
    {
      torch::NoGradGuard no_grad;
      torch::Tensor finite = loss.detach().isfinite();
      // Clipped on the device; a non-finite norm skips the step like a non-finite loss.
      if (config.optim.clip_grad_norm > 0) {
        finite = finite.logical_and(clip_grad_norm_on_device(*model, config.optim.clip_grad_norm).isfinite());
      }
      step_skip.copy_(finite.logical_not());
    }
    try {
      optimizer->step();
    } catch (const c10::Error& e) {
      // Not the step's out-of-memory recovery: the weights may be half updated.
      if (is_out_of_memory(e)) throw Error(optimizer_out_of_memory(first_line(e.what_without_backtrace())));
      throw;
    }
    return loss.detach();
  }

  void drop_gradients() {
    for (auto& p : model->parameters()) {
      if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
    }
  }

  // Model, optimizer, RNG, loss scaler, rolled-back steps and the data position from a checkpoint.
  TrainState restore(const std::string& path) {
    const TrainState st = load_checkpoint(path, *model, optimizer.get());
    step = st.step;
    samples_seen = st.samples_seen;
    check_saved_settings(st, path);
    warn_about_config_changes(st, path);
    int64_t micro = plan.micro_batch, world = plan.world_size;
    std::set<std::pair<int64_t, int64_t>> skipped;
    torch::Tensor skipped_before;  // data.on_error skip: (rank, epoch, index) rows
    try {
      if (auto it = st.tensors.find("rng/cpu"); it != st.tensors.end()) compat::set_cpu_rng_state(it->second);
      if (auto it = st.tensors.find("rng/cuda"); it != st.tensors.end()) detail::set_cuda_rng_state(device, it->second);
      if (plan.loss_scaling && st.tensors.count("scaler/scale")) scaler->load_state(st.tensors);
      if (auto it = st.tensors.find("trainer/bad_steps"); it != st.tensors.end()) {
        const auto rows = it->second.to(torch::kLong).contiguous().view({-1, 2});
        for (int64_t i = 0; i < rows.size(0); ++i) skipped.emplace(rows[i][0].item<int64_t>(), rows[i][1].item<int64_t>());
      }
      // Positions count micro-batches of the micro-batch in force when the checkpoint was written
      // (older checkpoints: the plan's), in the share of the data one of `world` ranks reads.
      if (auto it = st.tensors.find("trainer/micro_batch"); it != st.tensors.end()) micro = it->second.item<int64_t>();
      if (auto it = st.tensors.find("trainer/world_size"); it != st.tensors.end()) world = it->second.item<int64_t>();
      evals_without_improvement = 0;
      if (auto it = st.tensors.find("trainer/evals_without_improvement"); it != st.tensors.end()) {
        evals_without_improvement = it->second.item<int64_t>();
      }
      const auto pending = st.tensors.find("trainer/eval_pending");
      eval_pending = pending != st.tensors.end() && pending->second.item<int64_t>() != 0;
      if (auto it = st.tensors.find("trainer/skipped_samples"); it != st.tensors.end()) {
        skipped_before = it->second.to(torch::kLong).contiguous().view({-1, 3});
      }
      loss_window_before = {0.0, 0.0};
      if (auto it = st.tensors.find("trainer/loss_window"); it != st.tensors.end() && plan.rank == 0) {
        const torch::Tensor sums = it->second.to(torch::kDouble).contiguous().view({-1});
        if (sums.numel() != 2) throw std::invalid_argument("trainer/loss_window holds " + std::to_string(sums.numel()) + " values");
        loss_window_before = {sums[0].item<double>(), sums[1].item<double>()};
      }
    } catch (const std::exception& e) {
      const std::string what = e.what();
      throw CheckpointError(path + ": damaged trainer state: " + what.substr(0, what.find('\n')));
    }
    if (micro <= 0 || world <= 0) {
      throw CheckpointError(log::str(path, ": damaged trainer state: micro-batch ", micro, ", world size ", world));
    }
    // Rank r reads samples r, r + W, r + 2W, ... of the epoch's order, so after n samples per rank
    // the ranks together have read its first n x W: on another number of ranks the same prefix is
    // n x W / W' samples per rank (a whole number: positions are at step boundaries, and a step
    // is the same global batch on any number of ranks).
    auto convert = [&](int64_t per_rank) -> int64_t {
      const int64_t global = per_rank * world;
      if (global % plan.world_size != 0) {
        throw CheckpointError(log::str(path, ": its data position (", global, " samples of the epoch over ", world,
                                       " ranks) does not divide among ", plan.world_size, " ranks"));
      }
      return global / plan.world_size;
    };
    for (const auto& [epoch, sample] : skipped) bad_steps.emplace(epoch, convert(sample));
    // The samples data.on_error skip replaced before the checkpoint count as replaced (a set, so a
    // batch delivered again, or the rows of a rollback's own checkpoint, count once). Each rank
    // takes its own; on another number of ranks rank 0 takes them all, so that the ranks' counts
    // still add up to the run's.
    if (skipped_before.defined()) {
      const int64_t* row = skipped_before.data_ptr<int64_t>();
      for (int64_t i = 0; i < skipped_before.size(0); ++i, row += 3) {
        if (world == plan.world_size ? row[0] == plan.rank : plan.rank == 0) retired_skipped.emplace(row[1], row[2]);
      }
    }
    const int64_t sample = convert(st.batch_in_epoch * micro);
    if (world != plan.world_size) {
      log::warn(log::str(path, " was written by a run on ", world, " rank(s); continuing on ", plan.world_size,
                         " at the same place in the data (sample ", sample * plan.world_size, " of epoch ", st.epoch,
                         "), but the result will not be bit for bit the one of an uninterrupted run"));
    }
    rewind(st.epoch, sample, path);
    return st;
  }

  // Settings that change the trajectory: a resumed run with other values continues, but is no
  // longer the uninterrupted run; say so. Every config key is compared except those that decide
  // only where files are, how fast, or what is logged; the plan's batch, LR, micro-batch, threads
  // and precision (which follow from the machine as well as the config) are compared as saved.
  // The plan's settings a checkpoint records, compared on resume: values no run writes are a
  // damaged file, not a change to report ("the plan's global batch -8 -> 8").
  static void check_saved_settings(const TrainState& st, const std::string& path) {
    auto damaged = [&path](const std::string& what) {
      return CheckpointError(path + ": damaged trainer state: " + what);
    };
    for (const char* name : {"trainer/global_batch", "trainer/lr", "trainer/precision", "trainer/threads"}) {
      const auto it = st.tensors.find(name);
      if (it == st.tensors.end()) continue;
      const torch::Tensor& t = it->second;
      if (t.numel() != 1) throw damaged(log::str(name, " holds ", t.numel(), " values"));
      const double value = t.item<double>();
      const std::string key = name;
      if (!std::isfinite(value) || value < 0 || (key == "trainer/global_batch" && value < 1) ||
          (key == "trainer/precision" && value != 0 && value != 1 && value != 2)) {
        throw damaged(key + " " + log::exact(value));
      }
    }
  }

  void warn_about_config_changes(const TrainState& st, const std::string& path) const {
    std::vector<std::string> trajectory, execution;
    if (!st.config_yaml.empty()) {
      try {
        const Config saved = parse_config(st.config_yaml, path);
        for (const ConfigChange& c : config_changes(saved, config)) {
          const std::string text = c.key + " " + c.before + " -> " + c.after;
          if (c.on_resume == OnResume::Execution) {
            execution.push_back(text);
          } else if (c.on_resume == OnResume::Trajectory) {
            trajectory.push_back(text);
          }
        }
      } catch (const std::exception&) {
        // written by another version of train: no config to compare
      }
    }
    auto saved_int = [&](const char* name) -> std::optional<int64_t> {
      const auto it = st.tensors.find(name);
      if (it == st.tensors.end() || it->second.numel() != 1) return std::nullopt;
      return it->second.item<int64_t>();
    };
    // tuning.* decides these with the machine: a scaled batch, or its LR, can change on another
    // GPU with no key changed.
    // (Said only when no key that the list names already explains it.)
    auto listed = [&](const std::string& key) {
      auto named = [&](const std::string& t) { return t.rfind(key + " ", 0) == 0; };
      return std::any_of(trajectory.begin(), trajectory.end(), named) ||
             std::any_of(execution.begin(), execution.end(), named);
    };
    const auto batch = saved_int("trainer/global_batch");
    if (batch && *batch != plan.global_batch && !listed("trainer.global_batch")) {
      trajectory.push_back(log::str("the plan's global batch ", *batch, " -> ", plan.global_batch));
    }
    if (const auto it = st.tensors.find("trainer/lr"); it != st.tensors.end() && it->second.numel() == 1) {
      const double lr = it->second.item<double>();
      if (lr != plan.lr && !listed("optim.lr") && !listed("trainer.global_batch")) {
        // Exact: 0.1/3 and 0.1/6 must not read as rounded look-alikes.
        trajectory.push_back("the plan's peak lr " + log::exact(lr) + " -> " + log::exact(plan.lr));
      }
    }
    const auto samples = saved_int("trainer/train_samples");
    if (samples && *samples != train_set->size()) {
      // (The run's length follows from it when the config counts epochs.)
      const auto total = saved_int("trainer/total_steps");
      trajectory.push_back(log::str("the training set's size ", *samples, " -> ", train_set->size(), " samples",
                                    total && *total != plan.total_steps
                                        ? log::str(", the run's steps ", *total, " -> ", plan.total_steps)
                                        : std::string()));
    } else if (const auto print = saved_int("trainer/train_fingerprint");
               print && train_set->fingerprint() != 0 && static_cast<uint64_t>(*print) != train_set->fingerprint() &&
               !listed("data.root") && !listed("data.train_dir") && !listed("data.train_images") &&
               !listed("data.train_tsv") && !listed("data.train_tokens")) {
      // Same size, other content: files replaced, relabelled, re-tokenised (Dataset::fingerprint).
      trajectory.push_back(log::str("the training data: the same ", train_set->size(),
                                    " samples in number, but not the same samples"));
    }
    // (Another global batch is split anew: its micro-batch says nothing more.)
    const bool same_batch = batch ? *batch == plan.global_batch : !listed("trainer.global_batch");
    if (const auto micro = saved_int("trainer/micro_batch"); micro && *micro != plan.micro_batch && same_batch) {
      execution.push_back(log::str("micro-batch ", *micro, " -> ", plan.micro_batch));
    }
    if (const auto threads = saved_int("trainer/threads"); threads && *threads != plan.threads && !listed("trainer.threads")) {
      execution.push_back(log::str("CPU threads ", *threads, " -> ", plan.threads));
    }
    if (const auto precision = saved_int("trainer/precision");
        precision && *precision != precision_code(plan.precision) && !listed("precision.mode")) {
      execution.push_back(log::str("precision ", precision_name(*precision), " -> ", plan.precision));
    }
    auto join = [](const std::vector<std::string>& items) {
      std::string list;
      for (const auto& item : items) list += (list.empty() ? "" : ", ") + item;
      return list;
    };
    if (!trajectory.empty()) {
      log::warn(path + " was written with other settings (" + join(trajectory) +
                "): the resumed run continues with the new ones and will differ from an uninterrupted run");
    }
    if (!execution.empty()) {
      log::warn(path + " was written by a run that computed differently (" + join(execution) +
                "): the same training, but not bit for bit the uninterrupted run's result");
    }
  }

  static int64_t precision_code(const std::string& precision) {
    return precision == "bf16" ? 1 : precision == "fp16" ? 2 : 0;
  }
  static const char* precision_name(int64_t code) { return code == 1 ? "bf16" : code == 2 ? "fp16" : "fp32"; }

  // on_nonfinite rollback: the batches of a step that gave a non-finite loss are passed over.
  void skip_bad_steps() {
    while (!bad_steps.empty() && bad_steps.count(sample_position()) != 0) {
      const auto pos = sample_position();
      for (int64_t i = 0; i < plan.accum_steps; ++i) (void)next_batch();
      log::warn(log::str("trainer.on_nonfinite rollback: skipping the ", plan.accum_steps * plan.micro_batch,
                         " samples from sample ", pos.second, " of epoch ", pos.first,
                         " (they gave a non-finite loss)"));
      maybe_next_epoch();
    }
  }

  // Out of memory in a step on some rank: every rank frees the step, halves the micro-batch (the
  // largest divisor at most half, so the global batch stays exact), doubles the accumulation and
  // redoes the step from its first sample. `what` is "" on ranks that did not run out themselves.
  void recover_from_oom(const std::string& what, std::pair<int64_t, int64_t> step_start) {
    const int64_t failed = plan.micro_batch;
    const int64_t next = smaller_micro_batch(failed);
    const std::string cause = what.empty() ? std::string(" on another rank") : ": " + what;
    if (next == 0) {
      throw Error(log::str("out of memory in step ", step + 1, " at micro-batch 1", cause,
                           "; there is no smaller micro-batch. The model does not fit on ", device.str(),
                           " at this precision: try precision.mode bf16/fp16 or a smaller model"));
    }
    drop_gradients();
    step_buffers.restore();  // the forward passes that ran updated BatchNorm's statistics
#ifdef TRAIN_WITH_CUDA
    if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    plan.accum_steps *= failed / next;
    plan.micro_batch = next;
    make_loader();  // batches of the new size, from the same sample order
    rewind(step_start.first, step_start.second, "out-of-memory recovery");
    ++oom_recoveries;
    log::warn(log::str("out of memory in step ", step + 1, " at micro-batch ", failed, cause,
                       "; redoing the step with micro-batch ", next, " x ", plan.accum_steps,
                       " accumulation steps (global batch ", plan.global_batch, " unchanged)"));
    if (on_oom) on_oom(failed, next);
  }

  // Out of memory after the backward pass (unscaling, clipping, the optimizer step: on the first
  // step the optimizer allocates its state). A smaller micro-batch does not shrink this part, and
  // the weights may be half updated, so the run ends; its checkpoints are as they were.
  std::string optimizer_out_of_memory(const std::string& what) const {
    int64_t param_bytes = 0;
    for (const auto& p : model->parameters()) param_bytes += p.numel() * static_cast<int64_t>(p.element_size());
    const double gib = static_cast<double>(param_bytes) / static_cast<double>(int64_t{1} << 30);
    return log::str("out of memory in the optimizer step of step ", step + 1, " (after the backward pass at micro-batch ",
                    plan.micro_batch, "): ", what, ". A smaller micro-batch does not shrink this part: it holds the ",
                    log::fixed(gib, 3), " GiB of parameters, as much again of gradients and the optimizer's state (",
                    config.optim.name, "). Free ", device.str(), " (another process may hold it) or train a smaller "
                    "model; the checkpoints written so far are intact (resume with --resume auto, or fit(\"auto\"))");
  }

  // A non-finite loss (or gradient norm) without loss scaling: trainer.on_nonfinite decides.
  // Called before the optimizer step, on every rank alike.
  void handle_nonfinite(double loss, std::pair<int64_t, int64_t> step_start) {
    const std::string what = std::isfinite(loss) ? std::string("the gradient norm is not finite")
                                                 : log::str("the loss is ", loss);
    const std::string where = log::str("step ", step + 1, " (epoch ", step_start.first, ", from sample ",
                                       step_start.second, " of the epoch)");
    std::string why_not;
    if (config.trainer.on_nonfinite == "rollback") {
      // The newest checkpoint may still be on its way to the disk (checkpoint_async, rank 0): it
      // is there before any rank looks.
      if (writer) writer->wait();
      if (group && plan.checkpoint_async) (void)group->reduce_int(0, dist::ReduceOp::Min);
      const std::string ckpt = checkpoint_dir().empty() ? "" : latest_checkpoint(checkpoint_dir());
      int64_t have = ckpt.empty() ? 0 : 1;
      if (group) have = group->reduce_int(have, dist::ReduceOp::Min);
      if (have == 0) {
        why_not = "; there is no checkpoint to roll back to";
      } else if (rollbacks >= config.trainer.max_rollbacks) {
        why_not = log::str("; trainer.max_rollbacks (", config.trainer.max_rollbacks, ") reached");
      } else {
        ++rollbacks;
        bad_steps.insert(step_start);
        drop_gradients();
        restore(ckpt);
        // An evaluation that checkpoint had put off was done when this run resumed from it (the
        // newest checkpoint is that one or one this run wrote, which has none pending).
        eval_pending = false;
        if (group) {
          const auto [lo, hi] = group->range(step);
          if (lo != hi) {
            throw Error(log::str("on_nonfinite rollback: the ranks found different newest checkpoints (steps ", lo,
                                 " to ", hi, "); the run directory must be shared"));
          }
        }
        log::warn(log::str(what, " at ", where, "; rolled back to ", ckpt, " (step ", step,
                           ") and will skip that step's samples (rollback ", rollbacks, " of at most ",
                           config.trainer.max_rollbacks, ")"));
        return;
      }
    }
    throw Error(log::str(what, " at ", where, "; ", nonfinite_culprit(), ". The weights are still those after step ",
                         step, why_not, ". Lower optim.lr, set optim.clip_grad_norm",
                         config.trainer.on_nonfinite == "stop" ? ", or set trainer.on_nonfinite: rollback to skip the batch"
                                                               : ""));
  }

  // Names where a non-finite loss came from: the first parameter (registration order) whose
  // gradient is not finite, or else whose value is not.
  std::string nonfinite_culprit() const {
    torch::NoGradGuard no_grad;
    for (const auto& p : model->named_parameters()) {
      const auto& g = p.value().grad();
      if (g.defined() && !g.isfinite().all().item<bool>()) return "the first non-finite gradient is " + p.key() + "'s";
    }
    for (const auto& p : model->named_parameters()) {
      if (!p.value().isfinite().all().item<bool>()) return "the gradients are finite but parameter " + p.key() + " is not";
    }
    return "every gradient and parameter is finite (the loss itself overflowed; check the inputs and labels)";
  }
  double epoch_progress() const {
    const auto pos = consumed();
    return static_cast<double>(pos.epoch) +
           static_cast<double>(pos.batch) / static_cast<double>(std::max<int64_t>(1, batches_per_epoch()));
  }

  // The next micro-batch; rolls over to the next epoch once this epoch's whole steps are used.
  // last_of_run: the run's final micro-batch, after which nothing is staged (a batch staged past
  // the end would count its skipped samples, data.on_error skip, without training on them).
  data::Batch next_batch(bool last_of_run = false) {
    if (!feeder) {
      auto batch = loader->next();
      if (!batch) throw Error("loader ran out of batches mid-step (dataset shrank?)");
      return to_device(checked(std::move(*batch), *train_set, "training"));
    }
    if (!feeder->staged()) {
      auto batch = loader->next();
      if (!batch) throw Error("loader ran out of batches mid-step (dataset shrank?)");
      feeder->stage(checked(std::move(*batch), *train_set, "training"));
    }
    data::Batch current = normalized(feeder->take());
    // Stage the next one while this one computes, within the epoch's whole steps only (the
    // epoch boundary restarts the loader).
    if (!last_of_run && loader->position().batch < batches_per_epoch()) {
      if (auto ahead = loader->next()) feeder->stage(checked(std::move(*ahead), *train_set, "training"));
    }
    return current;
  }

  // A batch from `data`, checked on the host before it moves, against what the dataset says of
  // itself and what the loss takes. A custom Dataset's commonest mistakes otherwise surface deep in
  // the model or the loss as c10 errors naming neither the data nor the rule ("mat1 and mat2
  // shapes cannot be multiplied", "Target 7 is out of bounds"), and on a GPU an out-of-range class
  // index is a device-side assert that ends the process. Sizes, and for class targets a min and a
  // max over the batch's targets: microseconds.
  data::Batch checked(data::Batch batch, const data::Dataset& data, const char* split) const {
    const auto where = [&] { return log::str("the ", split, " data (", data.describe(), ")"); };
    if (!batch.input.defined() || !batch.target.defined()) {
      throw DataError(where() + " gave a batch without " + (batch.input.defined() ? "targets" : "inputs"));
    }
    if (data.static_shapes()) {
      const std::vector<int64_t> shape = data.input_shape();
      const auto sizes = batch.input.sizes();
      if (!shape.empty() && (sizes.size() != shape.size() + 1 ||
                             !std::equal(shape.begin(), shape.end(), sizes.begin() + 1))) {
        throw DataError(log::str(where(), " gave a batch of inputs of shape ", sizes, ", but its input_shape() is ",
                                 c10::IntArrayRef(shape), ": every sample's input must have that shape"));
      }
    }
    if (own_loss) return batch;  // the model's loss takes whatever targets it takes
    const torch::Tensor& target = batch.target;
    if (target.scalar_type() != torch::kLong) {
      throw DataError(log::str(where(), " gave ", target.scalar_type(), " targets, but model '", config.model.name,
                               "' is trained with cross-entropy on int64 class indices (a model that takes other "
                               "targets has its own loss: Model::has_own_loss)"));
    }
    const int64_t classes = data.num_classes();
    if (target.numel() == 0) return batch;
    if (target.min().item<int64_t>() >= 0 && target.max().item<int64_t>() < classes) return batch;
    const torch::Tensor bad = target.ne(data::kIgnoreIndex).logical_and(target.lt(0).logical_or(target.ge(classes)));
    if (!bad.any().item<bool>()) return batch;
    throw DataError(log::str(where(), " gave the target ", target.masked_select(bad)[0].item<int64_t>(),
                             ", outside its classes [0, ", classes, "): Dataset::get must return class indices below "
                             "num_classes() (or ", data::kIgnoreIndex, " for a position without a target)"));
  }

  data::Batch to_device(const data::Batch& batch) const {
    data::Batch b = batch.to(device, /*non_blocking=*/plan.pin_memory);
    if (plan.channels_last && b.input.dim() == 4) b.input = b.input.contiguous(torch::MemoryFormat::ChannelsLast);
    return normalized(std::move(b));
  }
  // data.uint8: images travel as bytes (4x less to copy) and are normalised where they compute.
  data::Batch normalized(data::Batch b) const {
    if (!plan.uint8_batches || b.input.scalar_type() != torch::kByte) return b;
    return data::normalize_on_device(b, config.data.mean, config.data.std);
  }

  bool autocast() const { return plan.precision != "fp32"; }
  torch::ScalarType autocast_dtype() const { return plan.precision == "fp16" ? torch::kHalf : torch::kBFloat16; }

  // skipped: skipped_rows(), for data.on_error skip (undefined otherwise).
  // loss_window: the training loss since the last logged row, over every rank (loss, weight).
  void write_checkpoint(const std::string& path, const torch::Tensor& skipped, std::pair<double, double> loss_window) {
    TrainState state;
    state.step = step;
    state.epoch = consumed().epoch;
    state.batch_in_epoch = consumed().batch;
    state.samples_seen = samples_seen;
    state.config_yaml = to_yaml(config);
    state.tensors["rng/cpu"] = compat::cpu_rng_state();
    if (auto rng = detail::cuda_rng_state(device); rng.defined()) state.tensors["rng/cuda"] = rng;
    state.tensors["trainer/micro_batch"] = torch::tensor(plan.micro_batch, torch::kLong);
    // The plan as it was, for warn_about_config_changes on resume.
    state.tensors["trainer/global_batch"] = torch::tensor(plan.global_batch, torch::kLong);
    state.tensors["trainer/lr"] = torch::tensor(plan.lr, torch::kDouble);
    state.tensors["trainer/threads"] = torch::tensor(plan.threads, torch::kLong);
    state.tensors["trainer/precision"] = torch::tensor(precision_code(plan.precision), torch::kLong);
    state.tensors["trainer/world_size"] = torch::tensor(plan.world_size, torch::kLong);
    // The data and the run's length it gave, so that a resume on changed data says so.
    state.tensors["trainer/train_samples"] = torch::tensor(train_set->size(), torch::kLong);
    if (const uint64_t print = train_set->fingerprint(); print != 0) {
      state.tensors["trainer/train_fingerprint"] = torch::tensor(static_cast<int64_t>(print), torch::kLong);
    }
    state.tensors["trainer/total_steps"] = torch::tensor(plan.total_steps, torch::kLong);
    if (!bad_steps.empty()) {
      std::vector<int64_t> flat;
      for (const auto& [epoch, sample] : bad_steps) flat.insert(flat.end(), {epoch, sample});
      state.tensors["trainer/bad_steps"] = torch::tensor(flat, torch::kLong).view({-1, 2});
    }
    if (eval_pending) state.tensors["trainer/eval_pending"] = torch::tensor(int64_t{1}, torch::kLong);
    if (evals_without_improvement > 0) {
      state.tensors["trainer/evals_without_improvement"] = torch::tensor(evals_without_improvement, torch::kLong);
    }
    if (loss_window.second > 0) {
      state.tensors["trainer/loss_window"] = torch::tensor({loss_window.first, loss_window.second}, torch::kDouble);
    }
    if (skipped.defined() && skipped.size(0) > 0) state.tensors["trainer/skipped_samples"] = skipped;
    for (auto& [name, tensor] : scaler->state()) state.tensors[name] = tensor;
    if (writer) {
      writer->save(path, *model, optimizer.get(), state);  // logs the checkpoint once it is written
      writer->then([dir = checkpoint_dir(), keep = config.checkpoint.keep_last, path] {
        prune_checkpoints(dir, keep, path);
      });
      return;
    }
    save_checkpoint(path, *model, optimizer.get(), state);
    prune_checkpoints(checkpoint_dir(), config.checkpoint.keep_last, path);
    log::info("checkpoint " + path);
  }
};

Trainer::Trainer(Config config, Plan plan, models::ModelPtr model, data::DatasetPtr train, data::DatasetPtr val,
                 std::string run_dir, dist::GroupPtr group)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  if (!model) throw UsageError("Trainer: no model (a null ModelPtr)");
  if (!train) throw UsageError("Trainer: no training set (a null DatasetPtr)");
  if (!plan.scaled_batch && plan.global_batch != config.trainer.global_batch) {
    // A plan made from another config: the batch arithmetic and the LR would not be this config's.
    throw ConfigError(log::str("key 'trainer.global_batch': ", config.trainer.global_batch, " but the plan was made ",
                               "for a global batch of ", plan.global_batch, "; make the plan from this config ",
                               "(prepare_run or make_plan)"));
  }
  s.config = std::move(config);
  s.plan = std::move(plan);
  s.model = std::move(model);
  s.train_set = std::move(train);
  s.val_set = std::move(val);
  s.run_dir = std::move(run_dir);
  s.own_loss = s.model->has_own_loss();
  s.eval_metrics = s.model->eval_metrics();
  {
    std::set<std::string> names{"loss", "accuracy", "top5", "samples", "step", "epoch", "split"};
    for (const auto& m : s.eval_metrics) {
      const bool word = !m.name.empty() && std::all_of(m.name.begin(), m.name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
      });
      if (!word || !names.insert(m.name).second) {
        throw Error("model '" + s.config.model.name + "': eval_metrics() names '" + m.name +
                    "'; a metric's name is letters, digits and '_', used once, and not loss, accuracy, top5, "
                    "samples, step, epoch or split");
      }
    }
  }
  check_model_settings(s.config, *s.model, /*data_read=*/true, s.val_set.get());
  if (s.val_set && s.val_set->size() == 0) {
    log::warn("the validation set is empty (" + s.val_set->describe() + "): this run has no evaluations");
    s.val_set.reset();
  }
  if (group && group->size() > 1) {
    if (group->size() != s.plan.world_size || group->rank() != s.plan.rank) {
      throw Error(log::str("the plan was made for rank ", s.plan.rank, " of ", s.plan.world_size,
                           " but the process group is rank ", group->rank(), " of ", group->size()));
    }
    s.group = std::move(group);
  }
  if (!s.plan.schedule_known) finalize_schedule(s.plan, s.config, s.train_set->size());
  s.device = torch::Device(s.plan.device.device_string());
  s.model->to(s.device);
  if (s.plan.channels_last) to_channels_last(*s.model);
  if (s.group) {
    dist::GradSyncOptions so;
    so.bucket_bytes = static_cast<int64_t>(s.config.distributed.bucket_mb * (1 << 20));
    so.first_bucket_bytes = static_cast<int64_t>(s.config.distributed.first_bucket_mb * (1 << 20));
    so.find_unused_parameters = s.config.distributed.find_unused_parameters;
    s.sync = std::make_unique<dist::GradSync>(*s.model, s.group, so);
  }
  s.has_buffers = !s.model->buffers().empty();
  if (s.plan.checkpoint_async && s.plan.rank == 0 && !s.run_dir.empty()) s.writer = std::make_unique<AsyncCheckpointWriter>();
  s.optimizer = make_optimizer(s.config.optim, *s.model, s.plan.lr);
  if (s.plan.cuda_graphs && s.device.is_cuda() && !s.sync) {
    const auto f32 = torch::TensorOptions().device(s.device).dtype(torch::kFloat);
    s.step_lr = torch::full({}, s.plan.lr, f32);
    s.step_skip = torch::zeros({}, f32);
    if (detail::set_device_step_controls(*s.optimizer, s.step_lr, s.step_skip)) {
      s.graph = std::make_unique<detail::StepGraph>(s.device, s.config.tuning.cuda_graphs != "on");
    } else {
      log::warn("cuda_graphs: the optimizer (" + optimizer_impl(*s.optimizer) +
                ") cannot take its learning rate from the GPU; no graph");
      s.step_lr = s.step_skip = torch::Tensor();
    }
  }
  GradScalerOptions scaling;
  scaling.enabled = s.plan.loss_scaling;  // disabled: scale/step/update are pass-throughs
  s.scaler = std::make_unique<GradScaler>(scaling);
  s.make_loader();
  if (s.device.is_cuda() && s.plan.pin_memory) s.feeder = std::make_unique<DeviceFeeder>(s.device, s.plan.channels_last);
  if (!s.run_dir.empty() && s.plan.rank == 0) s.metrics = MetricsSink(s.run_dir, s.config.logging);
}

Trainer::~Trainer() = default;

const Plan& Trainer::plan() const { return impl_->plan; }
models::Model& Trainer::model() { return *impl_->model; }
void Trainer::request_stop() { impl_->stop.store(true); }
void Trainer::on_out_of_memory(OomListener listener) { impl_->on_oom = std::move(listener); }
void Trainer::on_metrics(MetricsListener listener) {
  if (listener) impl_->metrics_listeners.push_back(std::move(listener));
}

EvalResult Trainer::evaluate() {
  auto& s = *impl_;
  EvalResult result;
  if (!s.val_set) return result;
  // Every rank evaluates with rank 0's BatchNorm statistics, as PyTorch's DDP does: each rank's own
  // running estimates have drifted apart since the last training step's broadcast.
  if (s.sync && s.has_buffers && s.config.distributed.broadcast_buffers) s.sync->broadcast_buffers();
  data::LoaderOptions lo;
  lo.batch_size = s.config.trainer.eval_batch > 0 ? s.config.trainer.eval_batch : s.plan.micro_batch;
  lo.shuffle = false;
  lo.drop_last = false;
  lo.epochs = 1;  // one pass: no reading ahead into a second
  lo.workers = s.plan.workers;
  lo.prefetch = s.plan.prefetch;
  lo.pin_memory = s.plan.pin_memory;
  lo.on_error = data::parse_on_error(s.config.data.on_error);
  // Rank r of W evaluates samples r, r + W, ... once each (no padding, so that the sums over the
  // ranks count every sample once), as the dataset's own indices: each sample gets the seed (the
  // MLM masks), the substitute under data.on_error skip and the name in errors that a single
  // process gives it, and the dataset's one-pass batches (get_batch) still apply.
  if (s.group) {
    lo.rank = s.group->rank();
    lo.world_size = s.group->size();
    lo.pad = false;
  }
  data::Loader loader(s.val_set, lo);
  loader.start({0, 0});
  torch::NoGradGuard no_grad;
  s.model->eval();
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(s.device));
  auto correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(s.device));
  auto correct5 = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(s.device));
  // Counted on the device and read once at the end: a read per batch would make the host wait for
  // each batch before it queues the next.
  auto counted = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(s.device));
  // The model's own measures (Model::eval_metrics): their sums, as the loss's.
  std::vector<torch::Tensor> metric_sums;
  for (size_t i = 0; i < s.eval_metrics.size(); ++i) {
    metric_sums.push_back(torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(s.device)));
  }
  const auto add_metric_sums = [&](const torch::Tensor& output, const torch::Tensor& target) {
    if (metric_sums.empty()) return;
    const std::vector<torch::Tensor> sums =
        checked_eval_sums(*s.model, s.config.model.name, metric_sums.size(), output, target);
    for (size_t i = 0; i < sums.size(); ++i) metric_sums[i] += sums[i].detach().reshape({}).to(torch::kDouble);
  };
  constexpr int64_t kTop = 5;
  while (auto batch = loader.next()) {
    auto b = s.to_device(s.checked(std::move(*batch), *s.val_set, "validation"));
    if (s.own_loss) {  // the mean of the model's loss over samples; no accuracy
      torch::Tensor loss;
      {
        AutocastScope amp(s.device.type(), s.autocast_dtype(), s.autocast());
        const torch::Tensor output = s.model->forward(b.input);
        loss = checked_own_loss(*s.model, s.config.model.name, output, b.target);
        add_metric_sums(output, b.target);
      }
      loss_sum += loss.detach().to(torch::kDouble) * static_cast<double>(b.size());
      counted += b.size();
      continue;
    }
    const bool token_targets = b.target.dim() > 1;
    torch::Tensor logits, flat_target;
    {
      AutocastScope amp(s.device.type(), s.autocast_dtype(), s.autocast());
      if (token_targets) {  // logits only where there is a target
        const auto has_target = b.target.ne(data::kIgnoreIndex);
        logits = s.model->forward_selected(b.input, has_target);
        flat_target = b.target.masked_select(has_target);
      } else {
        logits = s.model->forward(b.input);
        flat_target = b.target.reshape({-1});
      }
      check_logits(s.config.model.name, logits, flat_target.numel(), s.train_set->num_classes());
      add_metric_sums(logits, flat_target);
    }
    auto flat_logits = logits.reshape({-1, logits.size(-1)}).to(torch::kFloat);
    auto valid = flat_target.ne(-100);
    loss_sum += torch::nn::functional::cross_entropy(
                    flat_logits, flat_target,
                    torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum))
                    .to(torch::kDouble);
    correct += flat_logits.argmax(-1).eq(flat_target).logical_and(valid).sum();
    // Top-5 means something with more than five classes: a model wider than its data (the default
    // model.num_classes for three classes) would always be right among its five best.
    if (std::min(flat_logits.size(-1), s.train_set->num_classes()) > kTop) {
      result.has_top5 = true;
      const torch::Tensor top = std::get<1>(flat_logits.topk(kTop, -1));
      correct5 += top.eq(flat_target.unsqueeze(1)).any(1).logical_and(valid).sum();
    }
    counted += valid.sum();
  }
  s.model->train();
  result.has_accuracy = !s.own_loss;
  result.samples = counted.item<int64_t>();
  double loss_total = loss_sum.item<double>();
  double correct_total = static_cast<double>(correct.item<int64_t>());
  double correct5_total = static_cast<double>(correct5.item<int64_t>());
  std::vector<double> metric_totals;
  for (const auto& sum : metric_sums) metric_totals.push_back(sum.item<double>());
  if (s.group) {  // every rank evaluated its own share
    std::vector<double> local{loss_total, correct_total, correct5_total, static_cast<double>(result.samples)};
    local.insert(local.end(), metric_totals.begin(), metric_totals.end());
    auto sums = torch::tensor(local, torch::TensorOptions().dtype(torch::kDouble)).to(s.device);
    s.group->allreduce(sums, dist::ReduceOp::Sum);
    sums = sums.cpu();
    loss_total = sums[0].item<double>();
    correct_total = sums[1].item<double>();
    correct5_total = sums[2].item<double>();
    result.samples = static_cast<int64_t>(sums[3].item<double>());
    for (size_t i = 0; i < metric_totals.size(); ++i) metric_totals[i] = sums[static_cast<int64_t>(4 + i)].item<double>();
  }
  if (result.samples > 0) {
    result.loss = loss_total / static_cast<double>(result.samples);
    if (result.has_accuracy) result.accuracy = correct_total / static_cast<double>(result.samples);
    if (result.has_top5) result.top5 = correct5_total / static_cast<double>(result.samples);
    for (size_t i = 0; i < metric_totals.size(); ++i) {
      result.metrics.emplace_back(s.eval_metrics[i].name, metric_totals[i] / static_cast<double>(result.samples));
    }
  }
  return result;
}

FitResult Trainer::fit(const std::string& resume) {
  auto& s = *impl_;
  FitResult result;
  const auto fit_start = Clock::now();
  const std::string ckpt_dir = s.checkpoint_dir();
  result.last_checkpoint = s.last_written;

  // Rank 0 alone writes checkpoints: what a killed write of an earlier run left is garbage.
  if (!ckpt_dir.empty() && s.plan.rank == 0) remove_stale_checkpoint_temporaries(ckpt_dir);

  // ---- initial state: resume, init_from, or fresh ----
  std::string resume_path = resume;
  if (resume == "auto") {
    resume_path = ckpt_dir.empty() ? "" : latest_checkpoint(ckpt_dir);
    if (resume_path.empty()) log::info("resume auto: no checkpoint in " + ckpt_dir + "; starting fresh");
  }
  if (!resume_path.empty()) {
    const TrainState st = s.restore(resume_path);
    result.resumed_from_step = s.step;
    // The newest checkpoint until this call writes one (a finished run resumed writes none).
    if (!ckpt_dir.empty()) result.last_checkpoint = resume_path;
    log::info(log::str("resumed from ", resume_path, " at step ", s.step, " (epoch ", st.epoch, ", batch ",
                       st.batch_in_epoch, ")"));
    if (!ckpt_dir.empty() && s.plan.rank == 0) {
      for (const auto& moved : set_aside_checkpoints_after(ckpt_dir, s.step)) {
        log::warn("checkpoint newer than the one resumed from, set aside: " + moved);
      }
    }
  } else if (!s.config.model.init_from.empty()) {
    load_model_weights(s.config.model.init_from, *s.model, s.config.model.init_strict, s.model->weight_rules());
    log::info("model weights initialised from " + s.config.model.init_from);
  }
  if (s.group) {
    // Each rank found its own checkpoint (rank 0 writes them): a run directory that is not shared,
    // or a stale listing of one, would pair one rank's step k with another's step j.
    const auto [lo, hi] = s.group->range(s.step);
    if (lo != hi) {
      throw Error(log::str("the ranks start at different steps (", lo, " to ", hi,
                           "): rank ", s.plan.rank, " ", resume_path.empty() ? "starts fresh" : "resumed from " + resume_path,
                           "; every rank must see rank 0's checkpoints (a shared run directory)"));
    }
  }
  if (s.config.checkpoint.best != "none") {
    // The best an earlier attempt in this run directory kept, as rank 0 reads it: every rank then
    // ranks the evaluations against the same value.
    std::optional<BestCheckpoint> found = ckpt_dir.empty() || s.plan.rank != 0 ? std::nullopt
                                                                               : read_best_checkpoint(ckpt_dir);
    if (found && found->metric != s.config.checkpoint.best) {
      log::warn(log::str(best_checkpoint_path(ckpt_dir), " was kept for val ", found->metric,
                         " and checkpoint.best is now ", s.config.checkpoint.best,
                         ": the next evaluation replaces it"));
      found.reset();
    }
    if (found && found->step > s.step) {
      // Kept by the attempt this run went back from (--resume of an older checkpoint): a future
      // that is not this run's.
      log::warn(log::str(best_checkpoint_path(ckpt_dir), " holds val ", describe_best(*found), ", later than step ",
                         s.step, " this run starts from: the next evaluation replaces it"));
      found.reset();
    }
    if (found && !files::exists(best_checkpoint_path(ckpt_dir))) {
      // Deleted by hand, or lost with a disk: a record without its file would keep every later
      // evaluation that is not better from writing one.
      log::warn(log::str(files::join(ckpt_dir, "best.json"), " names val ", describe_best(*found),
                         " but ", best_checkpoint_path(ckpt_dir), " is missing: the next evaluation replaces both"));
      found.reset();
    }
    if (s.group) {
      const std::vector<double> shared = s.group->reduce_doubles(
          {found ? 1.0 : 0.0, found ? found->value : 0.0, found ? static_cast<double>(found->step) : 0.0},
          dist::ReduceOp::Sum);
      found.reset();
      if (shared[0] > 0) found = BestCheckpoint{s.config.checkpoint.best, shared[1], static_cast<int64_t>(shared[2])};
    }
    s.best = found;
    if (s.best && s.plan.rank == 0) {
      log::info(log::str("best checkpoint so far: val ", describe_best(*s.best), " (",
                         best_checkpoint_path(ckpt_dir), ")"));
    }
  }
  if (s.sync) {
    s.sync->broadcast_parameters();  // identical replicas, whatever each rank initialised or loaded
    log::info("distributed: gradient allreduce in " + s.sync->describe());
  }
  if (resume_path.empty()) s.loader->start({0, 0});
  // What an earlier attempt in this run directory logged after this step is about to be logged
  // again (or, for a fresh start, belongs to a run that never checkpointed).
  // An evaluation that a stop put off is done again, and replaces what an attempt that did it and
  // was then killed logged of it.
  s.metrics.start_after(s.step, s.eval_pending);
  reset_peak_memory(s.device.str());  // the plan's probe is not this run's peak
  s.model->train();

  const LrSchedule schedule(s.config.schedule, s.plan.lr, s.plan.total_steps, s.plan.warmup_steps);
  const int64_t log_every = std::max<int64_t>(1, s.config.logging.every_steps);
  Meter step_time, loss_meter;
  // The window's mean training loss is window_loss / window_loss_weight: summed step means and a
  // count of steps (classification), or summed token losses and a count of tokens (token tasks).
  double window_loss = 0, window_loss_weight = 0;
  int64_t window_steps = 0, window_samples = 0;
  auto window_start = Clock::now();
  double window_wait_start = s.loader_wait();
  const double wait_at_start = s.loader_wait();
  const auto loop_start = Clock::now();
  const int64_t first_step = s.step;

  // record: false for an evaluation that an earlier attempt already recorded at this step.
  auto evaluate_and_log = [&](bool record = true) {
    const EvalResult ev = evaluate();
    if (ev.samples == 0) return ev;
    log::info(log::str("eval step ", s.step, " | loss ", log::measure(ev.loss),
                       ev.has_accuracy ? " | top-1 " + log::fixed(100.0 * ev.accuracy, 2) + "%" : std::string(),
                       ev.has_top5 ? " | top-5 " + log::fixed(100.0 * ev.top5, 2) + "%" : std::string(),
                       describe_metrics(ev), " (",
                       ev.samples, " samples)"));
    if (!record) return ev;
    MetricRecord r;
    r.add("step", s.step).add("epoch", s.epoch_progress()).add("split", "val").add("loss", ev.loss);
    if (ev.has_accuracy) r.add("accuracy", ev.accuracy);
    if (ev.has_top5) r.add("top5", ev.top5);
    for (const auto& [name, value] : ev.metrics) r.add(name, value);
    r.add("samples", ev.samples);
    s.record(r);
    return ev;
  };

  auto new_window = [&] {
    window_loss = 0;
    window_loss_weight = 0;
    window_steps = 0;
    window_samples = 0;
    window_start = Clock::now();
    window_wait_start = s.loader_wait();
  };
  // The steps between the last row and the checkpoint resumed from count in the next row (their
  // losses; the timings cover the steps this run takes).
  auto window_from_checkpoint = [&] {
    new_window();
    window_loss = s.loss_window_before.first;
    window_loss_weight = s.loss_window_before.second;
    s.loss_window_before = {0.0, 0.0};
  };

  // After a rollback (trainer.on_nonfinite) the steps after the checkpoint are done again: what
  // was logged of them goes, and the window starts over.
  auto restart_window = [&] {
    s.metrics.start_after(s.step);
    window_from_checkpoint();
  };

  if (s.eval_pending) {  // put off by the graceful stop that wrote the checkpoint resumed from
    result.val = evaluate_and_log();  // evaluate() puts the model back in training mode
    s.eval_pending = false;
    // No step since the checkpoint resumed from: it is the state this evaluation saw.
    const bool improved = s.improves_best(result.val);
    s.count_evaluation(result.val, improved);
    if (improved) s.keep_best(result.val, resume_path);
  }
  const bool evaluated_pending = result.val.samples > 0;
  // Evaluation time is not training time (see pause_start below): the first window starts now.
  window_from_checkpoint();

  bool evaluated_at_end = false;
  // checkpoint.every_minutes: rank 0's clock, from the start of this attempt or its last checkpoint.
  const double checkpoint_seconds = 60.0 * s.config.checkpoint.every_minutes;
  auto last_checkpoint_time = Clock::now();
  // Resumed from the checkpoint of an early stop (or its put-off evaluation ends the patience).
  const bool stopped_before = s.early_stop_due() && s.step < s.plan.total_steps;
  if (stopped_before) {
    result.stopped_early = true;
    log::info(log::str("early stopping: stopped at step ", s.step, " of ", s.plan.total_steps, ": ",
                       s.describe_early_stop(), "; raise trainer.early_stop_patience to train on"));
  }
  while (!stopped_before && s.step < s.plan.total_steps) {
    s.skip_bad_steps();
    const auto t0 = Clock::now();
    const auto step_start = s.sample_position();
    const bool graphed = s.graph_step();
    if (!graphed) s.optimizer->zero_grad();
    // Like PyTorch's DDP: rank 0's BatchNorm statistics go to every rank before the forward.
    if (s.sync && s.has_buffers && s.config.distributed.broadcast_buffers) s.sync->broadcast_buffers();
    // (A replay allocates nothing, so it cannot run out of memory.)
    if (s.has_buffers && s.config.tuning.oom_recovery && !(graphed && s.graph->replaying())) {
      s.step_buffers.take(*s.model);
    }
    const double lr = schedule.at(s.step);
    // The micro-batch losses stay on the device until the one read after the step (that read is
    // the step's only host sync besides the optimizer's own).
    std::vector<torch::Tensor> micro_losses;  // micro-batch means, or sums for token targets
    std::vector<torch::Tensor> micro_targets;  // token targets: positions with a target per micro-batch
    micro_losses.reserve(static_cast<size_t>(s.plan.accum_steps));
    double divisor = 0;  // token targets: what every micro-batch's loss sum is divided by
    std::string oom;  // what ran out of memory in this step, on this rank
    try {
      if (graphed) {
        const data::Batch batch = s.next_batch(s.step + 1 == s.plan.total_steps);
        s.step_lr.fill_(lr);
        micro_losses.push_back(s.graph->run(batch.input, batch.target, [&s](const torch::Tensor& in, const torch::Tensor& t) {
          return s.graph_step_compute(in, t);
        }));
      }
      for (int64_t micro = 0; !graphed && micro < s.plan.accum_steps; ++micro) {
        // Only the last micro-step of an accumulation communicates (no_sync for the others).
        if (s.sync) s.sync->prepare(micro + 1 == s.plan.accum_steps);
        const data::Batch batch = s.next_batch(s.step + 1 == s.plan.total_steps && micro + 1 == s.plan.accum_steps);
        // Token targets (MLM): micro-batches hold different numbers of targets, so the mean of
        // their means is not the mean over the global batch, and would change with the split into
        // micro-batches and ranks. Their sums are divided by a fixed divisor here, and the
        // gradients rescaled to the mean over every target of the global batch after the step's
        // count is known on all ranks (see token_loss_rescale below).
        const bool token_targets = !s.own_loss && batch.target.dim() > 1;
        torch::Tensor loss, has_target;
        {
          AutocastScope amp(s.device.type(), s.autocast_dtype(), s.autocast());
          if (s.own_loss) {
            loss = checked_own_loss(*s.model, s.config.model.name, s.model->forward(batch.input), batch.target);
          } else if (token_targets) {
            // Logits only where there is a target (MLM: 15 % of the positions).
            has_target = batch.target.ne(data::kIgnoreIndex);
            loss = loss_fn(s.config.model.name, s.train_set->num_classes(),
                           s.model->forward_selected(batch.input, has_target), batch.target.masked_select(has_target),
                           s.config.loss.label_smoothing, /*sum=*/true);
          } else {
            loss = loss_fn(s.config.model.name, s.train_set->num_classes(), s.model->forward(batch.input),
                           batch.target, s.config.loss.label_smoothing);
          }
        }
        if (token_targets) {
          micro_targets.push_back(has_target.sum());
          // Positions per micro-batch x accum_steps: the same on every rank and known without a
          // host sync; a loss of the mean's order of magnitude for the loss scaler.
          if (divisor == 0) divisor = static_cast<double>(batch.target.numel() * s.plan.accum_steps);
          s.scaler->scale(loss / divisor).backward();
        } else {
          // Every micro-batch has the same size, so the mean over the global batch is the mean
          // of the micro-batch means. (No division by 1: an op and an autograd node per step.)
          s.scaler->scale(s.plan.accum_steps == 1 ? loss : loss / static_cast<double>(s.plan.accum_steps)).backward();
        }
        micro_losses.push_back(loss.detach());
      }
      if (s.sync) s.sync->finish();  // averaged gradients, before unscaling, clipping and the step
    } catch (const c10::Error& e) {
      if (!is_out_of_memory(e)) throw;
      // The activations and the autograd graph went with the stack; the gradients go now.
      oom = first_line(e.what_without_backtrace());
      if (!s.config.tuning.oom_recovery) {
        throw Error(log::str("out of memory in step ", s.step + 1, " at micro-batch ", s.plan.micro_batch, ": ", oom,
                             " (tuning.oom_recovery is off; set tuning.micro_batch lower)"));
      }
      if (s.sync) s.sync->abandon();  // the other ranks are not left waiting in their allreduce
      s.drop_gradients();
      micro_losses.clear();
    }
    // A non-finite loss is caught before the weights change. With loss scaling the scaler deals
    // with it (non-finite gradients skip the step and lower the scale).
    // The step's loss on this rank: the mean of the micro-batch means (the mean over the step's
    // batch), or for token targets the sum over the micro-batches over their count of targets.
    double step_loss = 0, step_loss_sum = 0;
    int64_t step_targets = 0;
    const bool token_targets = !micro_targets.empty() && oom.empty();
    if (token_targets) {
      const auto host = torch::stack({torch::stack(micro_losses).to(torch::kDouble).sum(),
                                      torch::stack(micro_targets).to(torch::kDouble).sum()})
                            .cpu();
      step_loss_sum = host[0].item<double>();
      step_targets = static_cast<int64_t>(host[1].item<double>());
      step_loss = step_targets > 0 ? step_loss_sum / static_cast<double>(step_targets) : 0.0;
      if (!std::isfinite(step_loss_sum)) step_loss = step_loss_sum;
    } else if (micro_losses.size() == 1) {
      step_loss = micro_losses[0].item<double>();
    } else if (!micro_losses.empty()) {
      step_loss = torch::stack(micro_losses).to(torch::kDouble).mean().item<double>();
    }
    const bool nonfinite = oom.empty() && !std::isfinite(step_loss);
    // With a graph and clipping, a finite loss with a non-finite gradient norm skipped the step on
    // the device; the host learns it here (the loss was read: no further wait).
    const bool norm_nonfinite = graphed && oom.empty() && !nonfinite && s.config.optim.clip_grad_norm > 0 &&
                                s.step_skip.item<float>() != 0;
    bool stopping = s.stop.load();
    bool any_oom = !oom.empty();
    bool any_nonfinite = nonfinite || norm_nonfinite;
    int64_t global_targets = step_targets;
    bool time_checkpoint = checkpoint_seconds > 0 && s.plan.rank == 0 &&
                           seconds_since(last_checkpoint_time) >= checkpoint_seconds;
    if (s.group) {
      // All ranks take the same decision: a stop request (SIGTERM) may reach one rank only, and
      // out-of-memory errors and non-finite losses happen on one rank first; a checkpoint due by
      // the time is due by rank 0's clock. The same allreduce counts the global batch's token
      // targets.
      const auto agreed = s.group->reduce_ints(
          {stopping ? 1 : 0, any_nonfinite ? 1 : 0, any_oom ? 1 : 0, step_targets, time_checkpoint ? 1 : 0},
          dist::ReduceOp::Sum);
      stopping = agreed[0] != 0;
      any_nonfinite = agreed[1] != 0;
      any_oom = agreed[2] != 0;
      global_targets = agreed[3];
      time_checkpoint = agreed[4] != 0;
    }
    if (s.plan.loss_scaling && !any_oom) {
      // The scaler skips a step whose gradients overflowed and lowers the scale: the cure for an
      // fp16 gradient overflow. A non-finite *loss* comes from the forward pass, which the scale
      // does not touch; an isolated one is skipped like an overflow, but a run of them is a
      // diverged model that skipping would hide (no updates, a shrinking scale, nothing logged).
      s.nonfinite_loss_streak = any_nonfinite ? s.nonfinite_loss_streak + 1 : 0;
      if (any_nonfinite && s.nonfinite_loss_streak < kNonfiniteLossStreak) {
        any_nonfinite = false;
      } else if (any_nonfinite) {
        log::warn(log::str("loss scaling: the loss itself was non-finite in ", s.nonfinite_loss_streak,
                           " consecutive steps; the scaler cannot fix an overflow in the forward pass, so this is "
                           "handled as divergence (trainer.on_nonfinite: ", s.config.trainer.on_nonfinite, ")"));
        s.nonfinite_loss_streak = 0;
      }
    }
    if (any_oom) {
      s.recover_from_oom(oom, step_start);
      continue;
    }
    if (any_nonfinite) {
      // (With a graph the fused optimizer step already skipped its update on the device.)
      s.handle_nonfinite(step_loss, step_start);  // returns only when it rolled back
      if (s.graph) s.graph->invalidate("rolled back to a checkpoint");  // new optimizer state tensors
      restart_window();
      continue;
    }
    if (token_targets && global_targets > 0) {
      // Gradients so far: the loss sums over the divisor, averaged over the ranks. Times
      // divisor x ranks / targets: the gradient of the mean over every target of the global batch.
      const double ranks = s.group ? static_cast<double>(s.group->size()) : 1.0;
      token_loss_rescale(*s.model, divisor * ranks / static_cast<double>(global_targets));
    }
    if (graphed) {
      set_learning_rate(*s.optimizer, lr);  // what checkpoints record: the step ran in the graph's step
    } else {
      try {
        if (s.config.optim.clip_grad_norm > 0) {
          s.scaler->unscale(*s.optimizer);  // clip the true gradients, not the scaled ones
          const double norm = clip_grad_norm(*s.model, s.config.optim.clip_grad_norm);
          // The gradients are the same on every rank, so every rank sees the same norm.
          if (!s.plan.loss_scaling && !std::isfinite(norm)) {
            s.handle_nonfinite(step_loss, step_start);
            restart_window();
            continue;
          }
        }
        set_learning_rate(*s.optimizer, lr);
        // Skips the step when a gradient is inf/NaN (loss scaling only); the schedule and the step
        // count go on, as with torch.amp.GradScaler.
        if (!s.scaler->step(*s.optimizer)) ++s.scaler_skipped;
        s.scaler->update();
      } catch (const c10::Error& e) {
        if (!is_out_of_memory(e)) throw;
        throw Error(s.optimizer_out_of_memory(first_line(e.what_without_backtrace())));
      }
    }
    ++s.step;
    s.samples_seen += s.plan.global_batch;
    if (nonfinite) {
      ++s.scaler_nonfinite_loss;
    } else if (token_targets) {
      window_loss += step_loss_sum;
      window_loss_weight += static_cast<double>(step_targets);
    } else {
      window_loss += step_loss;
      window_loss_weight += 1;
    }
    ++window_steps;
    window_samples += s.plan.micro_batch * s.plan.accum_steps;
    step_time.add(seconds_since(t0));

    // Epoch boundary: the loader has delivered every whole step of this epoch.
    const bool epoch_end = s.maybe_next_epoch();
    const bool last = s.step == s.plan.total_steps;
    // A single process also notices a stop request that came during this step; ranks stop after
    // the step in which they agreed to.
    if (!s.group) stopping = stopping || s.stop.load();

    // A stop logs the steps since the last window too: the resumed run starts after them. Off the
    // logging grid, that row's loss sums also go into the checkpoint, so that the resumed run's
    // next row averages the same steps as the uninterrupted run's row there.
    std::optional<std::pair<double, double>> stop_row_window;
    if (s.step % log_every == 0 || last || stopping) {
      const double elapsed = seconds_since(window_start);
      const double waited = s.loader_wait() - window_wait_start;
      if (s.group) {  // the loss of the global batch: over every rank's steps (or targets)
        const auto sums = s.group->reduce_doubles({window_loss, window_loss_weight}, dist::ReduceOp::Sum);
        window_loss = sums[0];
        window_loss_weight = sums[1];
        window_samples *= s.group->size();
      }
      // No finite loss in the window (loss scaling skipped every step): no number to show.
      const double mean_loss = window_loss_weight > 0 ? window_loss / window_loss_weight
                                                      : std::numeric_limits<double>::quiet_NaN();
      if (window_loss_weight > 0 && !std::isfinite(mean_loss)) {
        throw Error(log::str("loss is ", mean_loss, " at step ", s.step,
                             "; lower optim.lr or enable optim.clip_grad_norm"));
      }
      const double sps = static_cast<double>(window_samples) / std::max(elapsed, 1e-9);
      const double eta = step_time.mean() * static_cast<double>(s.plan.total_steps - s.step);
      result.train_loss = mean_loss;
      log::info(log::str("step ", s.step, "/", s.plan.total_steps, " ep ", log::fixed(s.epoch_progress(), 2), " | loss ",
                         log::measure(mean_loss), " | lr ", lr, " | ", log::fixed(sps, 1), " samples/s | ",
                         log::fixed(1000.0 * elapsed / window_steps, 1), " ms/step | data ",
                         log::fixed(100.0 * waited / std::max(elapsed, 1e-9), 1), "% | ETA ", format_duration(eta)));
      MetricRecord r;
      r.add("step", s.step).add("epoch", s.epoch_progress()).add("split", "train").add("loss", mean_loss)
          .add("lr", lr).add("samples_per_s", sps).add("step_time_ms", 1000.0 * elapsed / window_steps)
          .add("data_wait_ms", 1000.0 * waited / window_steps)
          .add("peak_memory_mib", peak_memory_mib(s.device.str()));
      if (s.plan.loss_scaling) r.add("loss_scale", s.scaler->get_scale());
      s.record(r);
      s.adapt_workers(elapsed, waited, window_steps);
      if (stopping && !last && s.step % log_every != 0) stop_row_window.emplace(window_loss, window_loss_weight);
      new_window();
      step_time.reset();
    }

    // Evaluation and checkpoint time is not training time: the window's samples/s, step time and
    // data-wait share leave it out.
    const auto pause_start = Clock::now();
    bool best_due = false;
    bool early_stop = false;
    const int64_t eval_every = s.config.trainer.eval_every_steps;
    if ((eval_every > 0 && s.step % eval_every == 0) || (eval_every == 0 && epoch_end) || last) {
      if (stopping && !last) {
        // The checkpoint comes first: an evaluation could outlast trainer.stop_grace_s.
        log::warn(log::str("stop requested: the evaluation due at step ", s.step,
                           " is put off until the run resumes"));
        s.eval_pending = true;  // in the checkpoint written next
      } else {
        result.val = evaluate_and_log();
        best_due = s.improves_best(result.val);
        s.count_evaluation(result.val, best_due);
        early_stop = !last && s.early_stop_due();
        evaluated_at_end = last || early_stop;
      }
    }
    // A single process stops after this step for a request made since (a metrics listener's, on
    // this step's row or evaluation).
    if (!s.group && !last && !stopping && s.stop.load()) stopping = true;
    const int64_t every = s.config.checkpoint.every_steps;
    // A new best evaluation gets this step's checkpoint, which then becomes best.pt.
    const bool checkpoint_due =
        (every > 0 && s.step % every == 0) || last || stopping || best_due || time_checkpoint || early_stop;
    // Every rank's replaced samples go into rank 0's checkpoint: gathered on every rank, whether
    // or not it has a run directory, since the condition is the same on all of them.
    torch::Tensor skipped;
    if (checkpoint_due && s.config.data.on_error == "skip" && (s.group || !ckpt_dir.empty())) {
      skipped = s.skipped_rows();
    }
    // The loss of the steps since the last row, over every rank (window_steps is the same on all
    // of them), for the row a resumed run logs next.
    std::pair<double, double> loss_window{window_loss, window_loss_weight};
    if (stop_row_window) {
      loss_window = *stop_row_window;  // summed over the ranks already, for the row
    } else if (checkpoint_due && window_steps > 0 && s.group) {
      const auto sums = s.group->reduce_doubles({window_loss, window_loss_weight}, dist::ReduceOp::Sum);
      loss_window = {sums[0], sums[1]};
    }
    if (!ckpt_dir.empty() && checkpoint_due) {
      result.last_checkpoint = s.last_written = checkpoint_path(ckpt_dir, s.step);
      if (s.plan.rank == 0) {  // the replicas are identical; rank 0 writes for all
        s.write_checkpoint(result.last_checkpoint, skipped, loss_window);
      }
    }
    if (best_due) s.keep_best(result.val, result.last_checkpoint);
    // The run ends after this step: its checkpoint (and best.pt) are on disk before any rank
    // leaves, since a launcher may stop the ranks still running when one exits.
    if (s.writer && (last || stopping || early_stop)) s.writer->wait();
    // The others wait for rank 0's write here, not in their next collective, which would give up
    // after distributed.timeout_s (a large model on a slow disk takes longer).
    if (s.group && checkpoint_due) {
      s.group->wait_for_all(log::str("the checkpoint of step ", s.step), s.config.distributed.checkpoint_timeout_s,
                            "distributed.checkpoint_timeout_s");
    }
    window_start += Clock::now() - pause_start;
    if (checkpoint_due) last_checkpoint_time = Clock::now();
    if (early_stop) {
      result.stopped_early = true;
      log::info(log::str("early stopping after step ", s.step, " of ", s.plan.total_steps, ": ", s.describe_early_stop()));
      break;
    }
    if (stopping && !last) {
      result.stopped = true;
      log::warn(log::str("stop requested: stopped after step ", s.step,
                         ckpt_dir.empty() ? "; no run directory, so nothing was saved to resume from"
                                          : "; resume with --resume auto, or fit(\"auto\")"));
      break;
    }
  }
  // Resumed from the final checkpoint: the result's numbers, without a second row for that step.
  // The same after an early stop.
  if (!evaluated_at_end && !evaluated_pending && (s.step == s.plan.total_steps || stopped_before) &&
      first_step == s.step) {
    result.val = evaluate_and_log(/*record=*/false);
  }
  if (s.sync) {
    result.diverged_ranks = s.sync->count_diverged_ranks();
    result.allreduce_wait_seconds = s.sync->stats().wait_seconds;
    if (result.diverged_ranks == 0) {
      log::info(log::str("distributed: parameters identical on all ", s.group->size(), " ranks; waited ",
                         log::fixed(result.allreduce_wait_seconds, 2), " s on gradient allreduce in ",
                         s.sync->stats().syncs, " steps"));
    } else {
      log::warn(log::str("distributed: parameters of ", result.diverged_ranks, " rank(s) differ from rank 0's"));
    }
  }
  if (s.scaler_skipped > 0 || s.scaler_nonfinite_loss > 0) {
    // A few skips while the scale comes down from 2^16 are how dynamic scaling works; many, or a
    // non-finite loss, are worth a look.
    const std::string text = log::str("loss scaling: the scaler skipped ", s.scaler_skipped, " of ",
                                      s.step - first_step, " step(s) for inf/NaN gradients; ",
                                      s.scaler_nonfinite_loss, " had a non-finite loss, left out of the logged loss");
    if (s.scaler_nonfinite_loss > 0 || s.scaler_skipped * 20 > s.step - first_step) {
      log::warn(text);
    } else {
      log::info(text);
    }
  }
  result.scaler_skipped_steps = s.scaler_skipped;
  result.graph_replays = s.graph_replays + (s.graph ? s.graph->replays() : 0);
  if (s.graph) log::info("cuda_graphs: " + s.graph->summary());
  result.oom_recoveries = s.oom_recoveries;
  result.rollbacks = s.rollbacks;
  if (s.writer) s.writer->wait();  // every checkpoint on disk, or its failure reported
  if (s.best) {
    result.best_metric = s.best->metric;
    result.best_value = s.best->value;
    result.best_step = s.best->step;
    if (!ckpt_dir.empty() && files::exists(best_checkpoint_path(ckpt_dir))) {
      result.best_checkpoint = best_checkpoint_path(ckpt_dir);
    }
  }
  if (s.loader_skipped() > 0) {
    log::warn(log::str("data.on_error skip: ", s.loader_skipped(),
                       " training sample(s) could not be loaded and were replaced (each is named in the log of "
                       "the run that met it first)"));
  }
  result.skipped_samples = s.loader_skipped();
  result.steps = s.step;
  result.seconds = seconds_since(fit_start);
  const double loop_time = seconds_since(loop_start);
  result.loader_workers = s.plan.workers;
  result.data_wait_fraction = loop_time > 0 ? (s.loader_wait() - wait_at_start) / loop_time : 0.0;
  return result;
}

}  // namespace train
