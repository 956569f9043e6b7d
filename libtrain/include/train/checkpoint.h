#pragma once
// Full run state in one file, written atomically (temporary file, fsync, rename, fsync of the
// directory), and validated on load with errors that name the file and the offending entry.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "train/safetensors.h"

namespace train {

struct TrainState {
  int64_t step = 0;             // optimizer steps completed
  int64_t epoch = 0;            // loader position: epoch of the next batch
  int64_t batch_in_epoch = 0;   //                  index of the next micro-batch in that epoch
  int64_t samples_seen = 0;
  std::string config_yaml;      // resolved config of the run that wrote the checkpoint
  // Other components' state (loss scaler, RNG, ...), by name.
  std::map<std::string, torch::Tensor> tensors;
};

constexpr int64_t kCheckpointFormat = 1;

void save_checkpoint(const std::string& path, const torch::nn::Module& model,
                     const torch::optim::Optimizer* optimizer, const TrainState& state);

// Writes checkpoints on a thread of its own, so that a training loop pays for a copy in memory and
// not for the disk (a 1.3 GB BERT-base checkpoint with its AdamW state: 0.2 s to serialize, 4 to
// 7 s to write and fsync on the 2-core test machine). save() serializes on the calling thread (the
// state as it is now: the loop may change it as soon as save returns) into a buffer that stays
// allocated for the next checkpoint, and returns; the write (the same bytes save_checkpoint writes,
// as atomically, with the checksum) and the jobs queued after it with then() run on the writer's
// thread, one at a time, in order. save() first waits for what is queued, so that one checkpoint
// at most is in memory. A failure is rethrown, once, by the next save() or wait(); the destructor
// waits and logs one not yet reported. Not thread-safe itself: one thread calls it.
class AsyncCheckpointWriter {
 public:
  AsyncCheckpointWriter();
  ~AsyncCheckpointWriter();
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  void save(const std::string& path, const torch::nn::Module& model, const torch::optim::Optimizer* optimizer,
            const TrainState& state);
  void then(std::function<void()> job);  // runs on the writer's thread after what is queued
  void wait();                           // returns when the queue is empty; rethrows a failure
  bool idle() const;                     // nothing queued or running

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Restores model (and optimizer when given) in place. The optimizer gets its state (momentum,
// Adam moments, step counts) back but keeps the hyperparameters it was built with (weight decay,
// momentum, betas, eps): the config of the resumed run decides them. Throws CheckpointError naming the file
// for a missing/corrupt file, a format mismatch, or a parameter whose name or shape differs.
TrainState load_checkpoint(const std::string& path, torch::nn::Module& model,
                           torch::optim::Optimizer* optimizer);

// Loads only the model weights (model.init_from, train eval): from a checkpoint, or from a
// `.safetensors` file with state-dict names (torchvision's for ResNet). strict: a missing or
// unexpected key or a shape mismatch throws CheckpointError naming the file and the keys; not
// strict: the matching keys are loaded and a warning lists what was skipped or left missing.
// `rules` (the model's weight_rules(), for model.init_from) let a new task head start fresh and
// skip other heads' and redundant tensors, each listed in the log; without them the match is exact.
void load_model_weights(const std::string& path, torch::nn::Module& model, bool strict = true,
                        const WeightRules& rules = {});
// The same checks as load_model_weights (a readable file; with strict, a key-for-key match),
// without loading anything or logging: for validating model.init_from before a run starts.
void check_model_weights(const std::string& path, const torch::nn::Module& model, bool strict = true,
                         const WeightRules& rules = {});

// The model weights stored in a checkpoint, by state-dict name (train export).
std::map<std::string, torch::Tensor> read_checkpoint_weights(const std::string& path);

// "<dir>/step_00000123.pt" naming. latest_checkpoint: the newest checkpoint in dir that passes its
// checksum (the "<file>.crc32c" sidecar written with it) and opens; corrupt or truncated ones are
// skipped with a warning naming them. "" if none.
// A damaged file is reported once per process. list_checkpoints: every "step_*.pt" file in dir,
// readable or not, oldest first.
std::string checkpoint_path(const std::string& dir, int64_t step);
std::string latest_checkpoint(const std::string& dir);
std::vector<std::string> list_checkpoints(const std::string& dir);
// Deletes periodic checkpoints beyond the newest `keep` (never `protect`).
void prune_checkpoints(const std::string& dir, int64_t keep, const std::string& protect);
// Moves the checkpoints of dir newer than `step` (with their checksums) into dir/abandoned/ and
// returns their new paths; best.pt and best.json too when best.json names a step after `step`.
// One whose name an earlier resume's set-aside checkpoint already has
// there takes a numbered name ("step_00000040.1.pt", then .2, ...): none is overwritten. A run resumed from an older checkpoint leaves the newer ones' future
// behind: kept in place, --resume auto and rollbacks would jump back to them, and pruning would
// delete the resumed run's own files first.
std::vector<std::string> set_aside_checkpoints_after(const std::string& dir, int64_t step);
// checkpoint.best: the best evaluation a run directory has seen. dir/best.pt is that step's
// checkpoint (the same bytes: a hard link where the file system has them, else a copy), so
// pruning the step's own file leaves it; dir/best.json names the metric, value and step.
struct BestCheckpoint {
  std::string metric;  // accuracy | top5 | loss
  double value = 0;
  int64_t step = -1;
};
std::string best_checkpoint_path(const std::string& dir);  // dir/best.pt
// dir/best.json; nullopt when there is none, or when it cannot be read (a warning names the file).
std::optional<BestCheckpoint> read_best_checkpoint(const std::string& dir);
// Makes `checkpoint` dir/best.pt (with its checksum) and writes dir/best.json, each replaced
// atomically: a crash in between leaves best.pt without a checksum (still verified member by
// member on load) or best.json one step behind, never a half-written file.
void keep_best_checkpoint(const std::string& dir, const std::string& checkpoint, const BestCheckpoint& best);
// Whether `value` of `metric` beats `best` (higher accuracy or top5, lower loss; ties do not).
bool better_than(const std::string& metric, double value, double best);

// Removes the temporary files ("step_*.pt.tmp.<pid>", "step_*.pt.crc32c.tmp.<pid>", best.pt's and best.json's) that writes
// killed before their rename left in dir, logging each; those of a writer that is still running
// here (another process writing to the same directory) are kept, with a warning. Files of this
// process's own pid count as left over: a container may give every restart the same pid, and this
// is called before the run writes anything. Checksum sidecars ("step_*.pt.crc32c",
// "best.pt.crc32c") whose checkpoint is gone are removed too, logged. Returns the paths removed.
std::vector<std::string> remove_stale_checkpoint_temporaries(const std::string& dir);

}  // namespace train
