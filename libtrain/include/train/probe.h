#pragma once
// Memory and throughput probe: what one training step (forward, loss, backward, optimizer step)
// costs at a few micro-batch sizes, measured on the device, so that the plan can choose the
// micro-batch from measurements:
//
//   peak_memory(b) ~ fixed + per_sample * b      (least squares through the measured points)
//
// The probes train on copies of the model's state and leave the model, the caller's optimizer,
// the random generators and the autocast state as they were. They use the CPU threads and
// cuDNN settings in force, so apply the plan's globals first.
#include <train/config.h>
#include <train/models/model.h>

#include <c10/core/Allocator.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace train {

struct ProbeOptions {
  std::vector<int64_t> input_shape;  // one sample, e.g. {3, 224, 224}; inputs are random floats
  int64_t num_classes = 10;          // random targets are drawn in [0, num_classes)
  std::string device = "cpu";        // "cpu", "cuda" or "cuda:N"
  bool bf16 = false;                 // autocast to bf16
  bool fp16 = false;                 // autocast to fp16 (a CUDA plan for compute capability 7.x)
  bool channels_last = false;        // channels_last parameters and 4-D inputs
  double target_fraction = 1.0;      // token tasks: share of positions with a target (MLM: data.mask_prob);
                                     // below 1 the step takes logits at those only (forward_selected)
  // A model with its own loss (Model::has_own_loss): one sample's target (no batch dimension),
  // repeated over the batch; undefined: zeros shaped like the model's output. num_classes and
  // target_fraction do not apply to such a model.
  torch::Tensor example_target;
  OptimConfig optim;                 // the optimizer (and gradient clipping) of the run
  int warmup_steps = 1;              // steps before measuring at each batch size
  int timed_steps = 3;               // steps timed by probe_throughput
};

struct ProbePoint {
  int64_t batch = 0;
  int64_t peak_bytes = 0;        // probe_memory: peak device memory of one step above the probe's start
  double seconds_per_step = 0;   // probe_throughput
  bool oom = false;              // this batch ran out of device memory; the other fields are 0
  int64_t activation_bytes = 0;  // probe_memory: memory in use after the forward pass, above the start
};

// The line fixed + per_sample x batch under which every measured peak lies. Its slope is the
// steeper of the peaks' between the two largest batches and that of the memory the forward pass
// keeps (the activations): at small batches a buffer the size of the parameters can set the peak,
// the same at every batch, while the activations grow from the first sample.
struct MemoryFit {
  int64_t fixed_bytes = 0;       // parameters, gradients, optimizer state, workspaces
  double per_sample_bytes = 0;   // activations and the batch itself
  std::vector<ProbePoint> points;

  bool measured() const;                 // at least one point ran without running out of memory
  int64_t predict(int64_t batch) const;  // fixed + per_sample * batch, rounded to the nearest byte
  // Largest batch b with predict(b) <= budget_bytes that is also below every batch that ran out of
  // memory; 0 if there is none or nothing was measured. With a non-positive per_sample_bytes the
  // line cannot extrapolate, so the answer is at most the largest measured batch.
  int64_t max_batch(int64_t budget_bytes) const;
  // When the peaks stay flat while the activations grow (the batches measured are too small for
  // the activations to set the peak), a batch up to largest_useful at which the peak should follow
  // them, to measure as well; also, when only the largest batch is on that line, twice it (the
  // fit's slope needs two points on the line). 0 when the two largest batches already show the
  // line or a larger batch would not matter.
  int64_t batch_beyond_flat(int64_t largest_useful) const;
};

// Peak memory of one full training step at each batch (after options.warmup_steps), relative to
// the device memory in use when the probe starts, so it includes the copies of the parameters,
// their gradients and the optimizer state. The model's parameters and buffers are swapped for
// copies on options.device for the duration of each batch and swapped back afterwards (no deep
// clone: LibTorch modules are only clonable through Cloneable, which Model is not), so the model's
// tensors keep their values, storage, device, layout and gradients, and an optimizer the caller
// built on them is untouched. Batches that run out of CUDA memory are marked oom; the cache is
// emptied and the probe continues.
//
// CUDA measures with the caching allocator's statistics (their peak is reset), the CPU with a
// CpuMemoryCounter.
MemoryFit probe_memory(models::Model& model, const ProbeOptions& options, const std::vector<int64_t>& batches);

// Seconds per training step at each batch: options.timed_steps steps after options.warmup_steps,
// with the device synchronised before and after the timed steps. State is handled as in
// probe_memory.
std::vector<ProbePoint> probe_throughput(models::Model& model, const ProbeOptions& options,
                                         const std::vector<int64_t>& batches);

// Walks the measured points in ascending batch order (meant to be successive doublings) and
// returns the batch after which the next one gains less than min_gain in samples per second;
// 0 if no point was measured.
int64_t choose_by_throughput(const std::vector<ProbePoint>& points, double min_gain = 0.05);

// The MemoryFit of the points that did not run out of memory (see MemoryFit). A single batch size
// gives a line through the origin, which overestimates larger batches.
MemoryFit fit_memory(std::vector<ProbePoint> points);

// Whether `error` reports that an allocation failed: c10::OutOfMemoryError (what CUDA's caching
// allocator throws when the device is full), or a plain c10::Error from the allocations that do not
// go through it: "CUDA error: out of memory" (a cudaMalloc outside the cache, e.g. a library's
// handle), cuBLAS/cuDNN workspaces (CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_ALLOC_FAILED) and the
// CPU allocator ("DefaultCPUAllocator: can't allocate memory"). A smaller batch can cure each of
// these; an NCCL failure that mentions memory is not counted (its communicator cannot be trusted
// afterwards). The trainer's recovery and the probe use this one test.
bool is_out_of_memory(const std::exception& error);

// Counts the bytes LibTorch allocates through its CPU allocator while the counter is alive: it
// installs a counting allocator in front of the current one and reinstalls that one, at its
// priority, on destruction. One counter at a time per process. Allocations from every thread are
// counted, including the scratch buffers LibTorch's oneDNN convolutions request through it; memory
// that libraries allocate for themselves (oneDNN's primitive cache, BLAS buffers) is not. Memory
// allocated while the counter was alive may be freed at any time later, from any thread.
//
// With limit_bytes > 0 it is also an injectable memory limit for tests: an allocation that would
// take live_bytes() above it throws c10::OutOfMemoryError, as CUDA's caching allocator does when
// the device is full, so the trainer's out-of-memory recovery can be exercised on a CPU.
class CpuMemoryCounter {
 public:
  explicit CpuMemoryCounter(int64_t limit_bytes = 0);  // throws std::logic_error while another counter is alive
  ~CpuMemoryCounter();
  CpuMemoryCounter(const CpuMemoryCounter&) = delete;
  CpuMemoryCounter& operator=(const CpuMemoryCounter&) = delete;

  int64_t live_bytes() const;  // allocated since construction and not yet freed
  int64_t peak_bytes() const;  // highest live_bytes since construction or the last reset_peak
  void reset_peak();

 private:
  c10::Allocator* previous_;
  uint8_t priority_;
};

}  // namespace train
