#pragma once
// A multi-worker batch loader with deterministic delivery order and a resumable position.
//
// Workers are threads. Each batch is assembled by one worker (get() for each index, then
// collate) into a bounded queue; the caller receives batches strictly in sampler order, so the
// stream of batches is identical for any worker count given the seed. A worker's exception is
// re-raised in the caller by next(), naming the sample index. Workers do not stop at the end of
// an epoch: they go on building the next epoch's first batches (up to LoaderOptions::epochs), and
// start() of that epoch keeps them, so that an epoch boundary, or an evaluation between epochs,
// does not leave the caller waiting for a whole batch.
//
// With on_error = Skip, a sample whose get() throws (a corrupt JPEG, a truncated record) is
// replaced in its batch by the next sample in dataset index order that loads: index + 1, + 2, ...
// (wrapping around), with that sample's own seed. The substitute depends only on the failing
// index, so delivery stays identical for any worker count, and batches keep their size. Each
// replaced sample counts once per epoch in skipped(), when its batch is first delivered (a batch
// delivered again after start() rewinds does not count it again); the first few are logged as
// warnings with the error (which names the file). When neither the sample nor any of the 100
// after it (fewer in a smaller dataset) loads, next() raises the sample's error, saying so.
#include <train/data/dataset.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace train::data {

// What the loader does when a sample cannot be loaded (data.on_error).
enum class OnError { Raise, Skip };

// "raise" | "skip"; std::invalid_argument otherwise.
OnError parse_on_error(const std::string& name);

struct LoaderOptions {
  int64_t batch_size = 1;
  bool shuffle = true;
  bool drop_last = true;
  int64_t workers = 0;        // 0 = load in the calling thread
  int64_t prefetch = 2;       // batches in flight per worker
  // Epochs the caller reads (0: no bound): workers build no batch of a later epoch in advance.
  // start() of a later epoch still works (its own epoch is then the bound).
  int64_t epochs = 0;
  uint64_t seed = 0;
  bool pin_memory = false;    // collate into page-locked memory (CUDA builds only)
  int64_t rank = 0;           // shard of the dataset this process reads
  int64_t world_size = 1;
  // drop_last false: pad = true (training) lengthens every rank's shard to the same size by
  // repeating samples from the start of the order, as DistributedSampler does; pad = false
  // (evaluation) gives rank r samples r, r + W, r + 2W, ... of the order and no more, so that
  // over all ranks every sample is read exactly once, with the seed, the substitute under
  // on_error skip and the index in errors that one rank would use for it.
  bool pad = true;
  OnError on_error = OnError::Raise;
};

struct LoaderPosition {
  int64_t epoch = 0;
  int64_t batch = 0;          // index of the next batch to be delivered in this epoch
};

class Loader {
 public:
  Loader(DatasetPtr dataset, LoaderOptions options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Starts (or restarts) an epoch at a given batch; the shuffle depends only on (seed, epoch).
  void start(LoaderPosition position);
  // Next batch of the current epoch, or nullopt at its end.
  std::optional<Batch> next();
  // Raises the worker count (never lowers it): the new workers join the running ones, and every
  // batch built or being built is kept. Delivery does not change.
  void set_workers(int64_t workers);
  LoaderPosition position() const;

  int64_t batches_per_epoch() const;
  int64_t samples_per_epoch() const;  // samples this rank sees per epoch (after padding/drop)
  // Seconds the caller spent blocked inside next() since construction.
  double wait_seconds() const;
  // Samples replaced under OnError::Skip in the batches delivered since construction, each
  // counted once per epoch: the size of skipped_samples().
  int64_t skipped() const;
  // Their (epoch, dataset index).
  const std::set<std::pair<int64_t, int64_t>>& skipped_samples() const;
  // The errors of the first few of them (each names the sample index and, where the dataset
  // says, the file).
  const std::vector<std::string>& skip_messages() const;
  const Dataset& dataset() const;
  const LoaderOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Mixes (seed, epoch, index) into the per-sample seed passed to Dataset::get.
uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t index);

}  // namespace train::data
