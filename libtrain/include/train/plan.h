#pragma once
// Plan: the resolved, immutable decisions for one run on one device, each with its reason.
//
// The config says what the user asked for; the plan records what was decided here and why.
// It is computed once, up front; nothing downstream re-derives batch arithmetic.
//
//   global_batch = micro_batch x accum_steps x world_size     (exactly; otherwise an error)
#include <train/config.h>
#include <train/device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace train {

struct PlanDecision {
  std::string name;    // "micro_batch"
  std::string value;   // "64"
  std::string reason;  // "global 256 / world 1 = 256 per rank; capped at tuning.max_micro_batch 64 -> accum 4"
  // What the user should act on ("the per-rank batch 331 has no divisor from 64 to 128, ..."):
  // printed after the reason as "; WARNING: ...", logged as warnings at the start of a run, and
  // a "warnings" array in the plan's JSON.
  std::vector<std::string> warnings;
  // The reason followed by the warnings, as the plan's table shows it.
  std::string text() const;
};

// What was measured (or estimated) about memory and speed, which bounds the micro-batch.
// Produced by the probe in run.cpp, or read back from the plan cache.
struct MemoryEvidence {
  int64_t fixed_bytes = 0;       // weights, gradients, optimizer state, workspaces
  double per_sample_bytes = 0;   // activations per sample
  int64_t budget_bytes = 0;      // memory the plan may fill
  int64_t max_micro_batch = 0;   // largest micro-batch predicted to fit; 0 = unknown
  bool estimate = false;         // converted from a probe on another device, not measured here
  std::string source;            // "probe on cuda:0 at 8, 16, 32", "plan cache", ...
  std::vector<std::pair<int64_t, double>> throughput;  // (micro-batch, samples/s), ascending
  int64_t throughput_choice = 0; // smallest micro-batch after which doubling gains < 5%; 0 = none
  // The largest micro-batch the memory probe could measure at when its peaks were still flat (the
  // slope then undercounts the activations beyond it); 0 when the peaks followed the activations.
  // A plan that could use a larger micro-batch measures again instead of reusing this evidence.
  int64_t slope_known_up_to = 0;
};

struct Plan {
  DeviceProfile device;
  int64_t world_size = 1;
  int64_t rank = 0;
  int64_t global_batch = 0;
  int64_t micro_batch = 0;
  int64_t accum_steps = 1;
  double lr = 0.0;               // peak LR after any scaling
  double lr_scale = 1.0;         // lr / optim.lr
  bool scaled_batch = false;     // tuning.batch: scale grew the global batch
  // Resolved once the epoch length is known (finalize_schedule sets schedule_known). A plan made
  // without the data (train plan for data on another machine) says so in its text and writes null
  // in its JSON for what stays unknown (steps_per_epoch 0, total_steps 0, warmup_steps -1): only
  // trainer.max_steps without trainer.epochs fixes total_steps, and a warmup in steps then too.
  int64_t warmup_steps = 0;
  int64_t steps_per_epoch = 0;
  int64_t total_steps = 0;
  bool schedule_known = false;
  double warmup_epochs = 0.0;    // schedule.warmup_epochs
  std::string precision = "fp32";  // fp32 | bf16 | fp16 (the autocast dtype)
  bool loss_scaling = false;       // dynamic loss scaling (GradScaler)
  bool tf32 = false;
  bool channels_last = false;
  bool cudnn_benchmark = false;
  int64_t threads = 1;           // intra-op CPU threads
  bool host_malloc_kept = false;  // the C heap keeps freed memory for the next step (train/host_memory.h)
  int64_t workers = 0;
  // When workers were not fixed by data.workers: the trainer adds loader workers, up to
  // max_workers, while the time it waits for data exceeds 5 % of a logging window.
  bool workers_adaptive = false;
  int64_t max_workers = 0;
  int64_t prefetch = 2;
  bool pin_memory = false;
  bool uint8_batches = false;    // image_folder batches travel as uint8 and are normalised on the device
  bool checkpoint_async = false; // checkpoints are written on a background thread (AsyncCheckpointWriter)
  // The training step is captured in a CUDA graph after a few eager steps and replayed; with
  // tuning.cuda_graphs auto the trainer keeps the graph only if a replay is measured faster.
  bool cuda_graphs = false;
  int64_t model_params = 0;
  MemoryEvidence memory;
  std::vector<PlanDecision> decisions;

  std::string to_text() const;   // the table printed at start
  std::string to_json() const;
};

struct PlanInputs {
  int64_t world_size = 1;
  int64_t rank = 0;
  int64_t local_world_size = 1;  // ranks sharing this host's cores
  int64_t model_params = 0;
  bool convolutional = false;    // conv nets: channels_last and cudnn.benchmark candidates
  int64_t narrowest_conv = 0;    // the fewest output channels of a 2-D convolution (0: none known)
  bool static_shapes = true;     // every batch has the same input shape (data::Dataset::static_shapes)
  std::string varying_shapes;    // when not: the data whose shapes vary, for the reason
  bool capturable = false;       // models::Model::capturable: a step through it can be captured in a CUDA graph
  // Parameter-sized tensors the optimizer keeps per parameter (optimizer_state_per_parameter,
  // optim.h), for the checkpoint size; -1: from optim.name and optim.momentum (sgd or adamw).
  int optimizer_state_per_parameter = -1;
  MemoryEvidence memory;
};

// A measurement from the plan cache under the memory free now: the fit (fixed + per-sample bytes)
// still holds, the budget it was sized for may not. With less free than at the probe, the largest
// micro-batch drops to what fits now, and the source says so; with as much or more it is kept
// (sizes above it were never confirmed on this device).
MemoryEvidence with_current_budget(MemoryEvidence cached, int64_t budget_bytes);

// tuning.batch scale: the largest global batch the plan may grow to (tuning.max_global_batch, or 32
// x the base batch).
int64_t max_scaled_global_batch(const Config& config);

// data.uint8 resolved: on or off as set; auto = on for image_folder data on a GPU. The run builds
// its datasets with it (before the plan), and make_plan records it with its reason.
bool resolve_uint8_batches(const Config& config, const DeviceProfile& device);

// Resolves the batch arithmetic, precision and loader decisions. Throws ConfigError when the
// global batch cannot be split exactly.
Plan make_plan(const Config& config, const DeviceProfile& device, const PlanInputs& inputs);

// Fills steps_per_epoch, total_steps and warmup_steps once the training set size is known.
void finalize_schedule(Plan& plan, const Config& config, int64_t train_samples);
// Without the training set: adds the total_steps and warmup_steps decisions as far as the config
// tells them ("90 epochs", "5 epochs"), each resolved when the data is read; schedule_known stays
// false.
void defer_schedule(Plan& plan, const Config& config);

}  // namespace train
