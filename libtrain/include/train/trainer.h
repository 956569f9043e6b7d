#pragma once
// The training loop: accumulate -> (sync) -> clip -> step -> log -> evaluate -> checkpoint.
#include <train/config.h>
#include <train/data/dataset.h>
#include <train/dist.h>
#include <train/metrics.h>  // MetricRecord, which a metrics listener reads (LibTorch-free)
#include <train/models/model.h>
#include <train/plan.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace train {

struct EvalResult {
  double loss = 0;
  double accuracy = 0;   // top-1, in [0, 1]
  // False for a model with its own loss (Model::has_own_loss): loss only, accuracy 0.
  bool has_accuracy = true;
  // Top-5, in [0, 1]: the target among the five highest logits (as torchvision's reference
  // scripts report it). Only for more than five classes (or tokens); with five or fewer, 0 and
  // has_top5 false.
  double top5 = 0;
  bool has_top5 = false;
  int64_t samples = 0;   // evaluated: samples, or for token targets the positions with a target
  // The model's own measures (Model::eval_metrics), each the mean over `samples`, in its order.
  std::vector<std::pair<std::string, double>> metrics;
};

struct FitResult {
  int64_t steps = 0;             // optimizer steps completed in total (including resumed ones)
  int64_t resumed_from_step = 0;
  double train_loss = 0;         // mean loss of the last logging window (0 when this call ran no step)
  EvalResult val;                // final evaluation (samples == 0 when there is no val set)
  double seconds = 0;            // wall time of this fit() call
  double data_wait_fraction = 0; // time blocked on the loader / wall time of the training loop
  int64_t loader_workers = 0;    // at the end: the plan's, or more if the loader starved the step
  std::string last_checkpoint;   // the newest one written, or else resumed from; "" when no run directory
  // data.on_error skip: training samples this rank replaced because they failed to load, each once
  // per epoch, over the whole run: a resumed run counts those before its checkpoint too.
  int64_t skipped_samples = 0;
  // Distributed runs: ranks whose parameters differ from rank 0's at the end (0 = replicas
  // identical), and the seconds spent blocked on gradient allreduce (the part not hidden behind
  // backward).
  int64_t diverged_ranks = 0;
  double allreduce_wait_seconds = 0;
  int64_t oom_recoveries = 0;    // steps redone with a halved micro-batch after running out of memory
  int64_t scaler_skipped_steps = 0;  // loss scaling: steps of this call skipped for inf/NaN gradients
  int64_t rollbacks = 0;         // trainer.on_nonfinite rollback: reloads of the newest checkpoint
  int64_t graph_replays = 0;     // tuning.cuda_graphs: steps run by replaying the captured CUDA graph
  // trainer.early_stop_patience ended training before plan.total_steps (in this call, or in the
  // attempt whose checkpoint it resumed; `steps` says where).
  bool stopped_early = false;
  // A stop request (request_stop(), or a stop signal through StopSignals) ended this call before
  // plan.total_steps, after the step it came in (the next one, where a metrics listener or another
  // rank asked after the step's agreement), with a checkpoint there when there is a run directory.
  bool stopped = false;
  // checkpoint.best: the best evaluation the run directory has seen (this call's or an earlier
  // attempt's), its metric, value and step; best_checkpoint is its file (rank 0; "" without one).
  std::string best_metric;
  double best_value = 0;
  int64_t best_step = -1;
  std::string best_checkpoint;
};

// Called after the trainer recovered from running out of memory, with the micro-batch that
// failed and the one it continues with (for the plan cache).
using OomListener = std::function<void(int64_t failed_micro_batch, int64_t new_micro_batch)>;

// Called with each metrics record the run produces, as metrics.jsonl gets it (with or without a
// run directory): a training row every logging.every_steps steps ("split": "train", with step,
// epoch, loss, lr, samples_per_s, step_time_ms, data_wait_ms, peak_memory_mib, and loss_scale
// under loss scaling) and one per evaluation ("split": "val", with loss, accuracy, top5 when
// there are more than five classes, samples). The values are the global batch's: in a
// data-parallel run it is called on rank 0 only. It runs on the training thread between steps, so
// it should be quick; what it throws ends fit().
using MetricsListener = std::function<void(const MetricRecord& record)>;

class Trainer {
 public:
  // `run_dir` receives metrics.jsonl, a TensorBoard event file and checkpoints/ ("" keeps
  // everything in memory); it is neither locked nor put back on bad input: fit_in_run_dir (fit.h)
  // does that. Throws ConfigError when `plan` was made for another global batch than `config`'s.
  // `val` may be null. With a process group of more than one rank the trainer is data-parallel:
  // rank 0's weights are broadcast at the start, gradients are averaged across ranks with
  // overlapped bucketed allreduce (config.distributed), each rank evaluates its share of the
  // validation set, and only rank 0 writes metrics and checkpoints.
  Trainer(Config config, Plan plan, models::ModelPtr model, data::DatasetPtr train, data::DatasetPtr val,
          std::string run_dir, dist::GroupPtr group = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains to plan.total_steps.
  //
  // Out of memory inside a step (tuning.oom_recovery): the step is dropped, the micro-batch halved
  // and the accumulation doubled on every rank, and the step redone with the same samples; plan()
  // then shows the new micro-batch. A non-finite loss without loss scaling: trainer.on_nonfinite
  // stops (train::Error naming the step and the first non-finite gradient, weights untouched) or
  // rolls back to the newest checkpoint and skips the step's samples. `resume` is "" (fresh start), a checkpoint path, or "auto"
  // (the newest checkpoint in <run_dir>/checkpoints, or a fresh start when there is none).
  FitResult fit(const std::string& resume = "");
  EvalResult evaluate();

  // Stops after the current optimizer step (and writes a checkpoint there, with a run directory);
  // FitResult::stopped says so. Safe from a signal handler's flag-polling thread, and from a
  // metrics listener: asked on a step's row or evaluation, the run stops after that step (in a
  // data-parallel job, after the next, which is when the ranks agree on it).
  void request_stop();
  void on_out_of_memory(OomListener listener);
  // Another listener for the records (metrics.h); each one added is called, in order.
  void on_metrics(MetricsListener listener);

  const Plan& plan() const;
  models::Model& model();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace train
