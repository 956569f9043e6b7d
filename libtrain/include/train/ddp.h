#pragma once
// Data-parallel gradient synchronisation: what PyTorch's DistributedDataParallel does, in C++.
//
// Parameters are grouped into buckets in reverse registration order (the order autograd produces
// their gradients). A hook on each parameter's gradient accumulator counts it ready; when the last
// gradient of a bucket arrives, the bucket is copied into one flat buffer, divided by the world
// size and all-reduced asynchronously, while backward carries on with earlier layers. finish()
// waits for the buckets still in flight and writes the averaged gradients back.
//
//   GradSync sync(model, group, options);   // after the model is on its device
//   sync.broadcast_parameters();            // rank 0's weights everywhere (done by the Trainer)
//   for each micro-step:
//     sync.prepare(last_micro_step);        // only the last micro-step communicates (no_sync)
//     loss.backward();
//     if (last_micro_step) sync.finish();
#include <train/dist.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>

namespace train::dist {

struct GradSyncOptions {
  int64_t bucket_bytes = int64_t{25} << 20;
  int64_t first_bucket_bytes = int64_t{1} << 20;
  // false: a parameter that received no gradient in a synchronising step is an error that names
  // it. true: it contributes zeros (or the gradient it accumulated in earlier micro-steps).
  bool find_unused_parameters = false;
};

struct GradSyncStats {
  int64_t buckets = 0;
  int64_t parameters = 0;
  int64_t bytes = 0;               // gradient bytes all-reduced per step
  int64_t syncs = 0;               // synchronising steps so far
  double wait_seconds = 0;         // time finish() blocked on communication (the part not hidden)
  double copy_seconds = 0;         // time spent flattening gradients into buckets and back
};

class GradSync {
 public:
  // Keeps a reference to `model` and hooks on its parameters' gradients: the model must outlive
  // this object (the destructor removes the hooks).
  GradSync(torch::nn::Module& model, GroupPtr group, GradSyncOptions options = {});
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Checks that every rank has the same parameter names and shapes (a mismatch would corrupt
  // the allreduce silently), then copies rank 0's parameters and buffers to all ranks.
  void broadcast_parameters();
  // Copies rank 0's buffers (BatchNorm running statistics) to all ranks.
  void broadcast_buffers();
  // Call before each backward: `sync` = this backward completes the gradient (the last
  // micro-step of an accumulation); otherwise hooks do nothing and gradients stay local.
  void prepare(bool sync);
  // Call after the synchronising backward: launches any bucket that is still waiting (unused
  // parameters), waits for every allreduce and writes averaged gradients into param.grad().
  void finish();
  // Call instead of finish() when this rank's forward or backward failed part-way (out of
  // memory): it still takes part in every allreduce of the step, in order, so the other ranks are
  // not left waiting, and leaves param.grad() alone. The step's result is to be discarded on every
  // rank (the trainer agrees on that right after). Works whether or not prepare(true) was called.
  void abandon();
  // A checksum of every parameter's bytes, identical across ranks when the replicas agree.
  // Compares it across ranks and returns the number of ranks whose parameters differ from rank 0.
  int64_t count_diverged_ranks();

  GradSyncStats stats() const;
  std::string describe() const;  // "11 buckets (25 MiB, first 1 MiB) over 62 parameters, 44.7 MB per step"

  struct Impl;  // internal (the autograd hooks reach it)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace train::dist
