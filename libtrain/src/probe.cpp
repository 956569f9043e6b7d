#include "train/probe.h"

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "compat.h"
#include "models/own_loss.h"
#include "rng_state.h"
#include "train/amp.h"
#include "train/errors.h"
#include "train/log.h"
#include "train/optim.h"

#ifdef TRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace train {
namespace {

// "2, 3, 224, 224"
std::string join_sizes(c10::IntArrayRef sizes) {
  std::string out;
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out;
}

// ---- Counting CPU allocator -----------------------------------------------------------------

// Counts in front of the allocator that was current when counting started. It hands out that
// allocator's own pointers with the context equal to the pointer, as LibTorch's raw interface
// (raw_allocate / raw_deallocate, which oneDNN's scratch buffers use) requires, and keeps the size
// and the original deleter in a table. So a block may be freed through this allocator or the
// original one, before or after counting stops: the memory always goes back to its allocator.
//
// One per process and never destroyed: blocks must find it when freed (their deleter is `release`)
// and when resized (a StorageImpl keeps a pointer to the allocator that made it), and they can
// outlive any counter. Each start begins a new generation, so freeing blocks counted by an earlier
// counter does not disturb the current counts.
class CountingCpuAllocator final : public compat::HostAllocatorBase {
 public:
  static CountingCpuAllocator& instance() {
    static auto* allocator = new CountingCpuAllocator();  // leaked on purpose, see above
    return *allocator;
  }

  // Counts from now on, forwarding to `wrapped`. False while another counter is counting.
  bool start(c10::Allocator* wrapped, int64_t limit_bytes) {
    bool idle = false;
    if (!counting_.compare_exchange_strong(idle, true)) return false;
    wrapped_.store(wrapped);
    live_.store(0);
    peak_.store(0);
    limit_.store(limit_bytes);
    generation_.fetch_add(1);
    return true;
  }
  void stop() {
    limit_.store(0);
    counting_.store(false);
  }

  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

 protected:
  c10::DataPtr allocate_bytes(size_t bytes) override {
    const int64_t limit = limit_.load();
    if (limit > 0 && counting_.load() && live_.load() + static_cast<int64_t>(bytes) > limit) {
      // What the CUDA caching allocator throws, so that code under test takes its real OOM path.
      throw c10::OutOfMemoryError(
          c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
          "CPU out of memory (train::CpuMemoryCounter limit): tried to allocate " + std::to_string(bytes) +
              " bytes with " + std::to_string(live_.load()) + " of " + std::to_string(limit) + " bytes in use");
    }
    c10::DataPtr original = wrapped_.load()->allocate(bytes);
    void* data = original.get();
    // Blocks whose context is not the pointer itself cannot be handed out as raw blocks; they
    // pass through uncounted (LibTorch's CPU allocators do not make such blocks).
    if (!counting_.load() || data == nullptr || original.get_context() != data) return original;
    const Block block{static_cast<int64_t>(bytes), generation_.load(), original.get_deleter()};
    const c10::Device device = original.device();
    original.release_context();  // the table owns the block now
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Overwrites the entry of a block that was freed behind this allocator's back (raw-freed
      // through the original allocator after counting stopped) at the same address.
      blocks_[data] = block;
    }
    add(block.bytes);
    return {data, data, &release, device};
  }

 private:
  struct Block {
    int64_t bytes;
    uint64_t generation;
    c10::DeleterFnPtr deleter;  // the original allocator's
  };

  static void release(void* data) {
    if (data == nullptr) return;
    CountingCpuAllocator& self = instance();
    std::unique_lock<std::mutex> lock(self.mutex_);
    const auto it = self.blocks_.find(data);
    if (it == self.blocks_.end()) {  // raw-allocated by the original allocator before counting started
      lock.unlock();
      self.wrapped_.load()->raw_deallocate(data);
      return;
    }
    const Block block = it->second;
    self.blocks_.erase(it);
    lock.unlock();
    if (block.generation == self.generation_.load()) self.live_.fetch_sub(block.bytes);
    block.deleter(data);
  }

  void add(int64_t bytes) {
    const int64_t now = live_.fetch_add(bytes) + bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  std::atomic<c10::Allocator*> wrapped_{nullptr};
  std::atomic<bool> counting_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> limit_{0};  // > 0: allocations beyond it throw c10::OutOfMemoryError
  std::mutex mutex_;  // guards blocks_; the counts are atomics
  std::unordered_map<void*, Block> blocks_;
};

// ---- Probe state ----------------------------------------------------------------------------

torch::Device probe_device(const ProbeOptions& options) {
  torch::Device device(options.device);
  if (device.is_cuda()) {
    if (!torch::cuda::is_available()) {
      throw std::invalid_argument("probe: " + options.device + " but CUDA is not available");
    }
#ifdef TRAIN_WITH_CUDA
    if (!device.has_index()) device.set_index(c10::cuda::current_device());
#endif
    // Initialises CUDA and its caching allocator, whose statistics the memory probe reads before
    // its first allocation.
    torch::empty({0}, torch::TensorOptions().device(device));
  } else if (!device.is_cpu()) {
    throw std::invalid_argument("probe: device '" + options.device + "' is neither cpu nor cuda");
  }
  return device;
}

void validate(const models::Model& model, const ProbeOptions& options, const std::vector<int64_t>& batches) {
  if (options.input_shape.empty()) throw std::invalid_argument("probe: input_shape is empty");
  if (!model.has_own_loss() && options.num_classes < 1) throw std::invalid_argument("probe: num_classes must be positive");
  if (options.warmup_steps < 0) throw std::invalid_argument("probe: warmup_steps must not be negative");
  if (options.timed_steps < 1) throw std::invalid_argument("probe: timed_steps must be positive");
  for (const int64_t batch : batches) {
    if (batch < 1) throw std::invalid_argument("probe: batch sizes must be positive, got " + std::to_string(batch));
  }
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Restores the generators the probe draws from (inputs and targets, dropout) on destruction, so
// that a run trains the same with or without probing.
class RngStateGuard {
 public:
  explicit RngStateGuard(const torch::Device& device)
      : device_(device), cpu_state_(compat::cpu_rng_state()), cuda_state_(detail::cuda_rng_state(device)) {}
  ~RngStateGuard() {
    compat::set_cpu_rng_state(cpu_state_);
    if (cuda_state_.defined()) detail::set_cuda_rng_state(device_, cuda_state_);
  }
  RngStateGuard(const RngStateGuard&) = delete;
  RngStateGuard& operator=(const RngStateGuard&) = delete;

 private:
  torch::Device device_;
  torch::Tensor cpu_state_;
  torch::Tensor cuda_state_;
};

// Swaps the model's parameters and buffers for copies on `device` while alive, and swaps the
// originals back on destruction. The swaps use set_data, so the model's tensor objects (which an
// optimizer may hold) stay the same and get their original storage back, bit for bit.
class ModelStateSwap {
 public:
  ModelStateSwap(models::Model& model, const torch::Device& device, bool channels_last)
      : model_(model), was_training_(model.is_training()) {
    // A copy or the layout change can run out of memory on the probed device part way: no
    // destructor runs for a constructor that throws, and the model would keep the copies made so
    // far, without their gradients.
    try {
      torch::NoGradGuard no_grad;
      for (auto& tensor : model.parameters()) swap_in(tensor, device);
      for (auto& tensor : model.buffers()) swap_in(tensor, device);
      if (channels_last) to_channels_last(model);
      model.train();
    } catch (...) {
      restore();
      throw;
    }
  }
  ~ModelStateSwap() { restore(); }
  ModelStateSwap(const ModelStateSwap&) = delete;
  ModelStateSwap& operator=(const ModelStateSwap&) = delete;

 private:
  struct Saved {
    torch::Tensor tensor;  // the model's own tensor object
    torch::Tensor data;    // its storage before the probe
    torch::Tensor grad;
  };

  void restore() {
    torch::NoGradGuard no_grad;
    // Reverse order, so that a tensor listed twice ends with its first saved state.
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      it->tensor.set_data(it->data);
      it->tensor.mutable_grad() = it->grad;
    }
    model_.train(was_training_);
  }

  void swap_in(torch::Tensor& tensor, const torch::Device& device) {
    saved_.push_back({tensor, tensor.data(), tensor.grad()});
    tensor.set_data(tensor.data().to(device, tensor.scalar_type(), /*non_blocking=*/false, /*copy=*/true));
    tensor.mutable_grad() = torch::Tensor();
  }

  models::Model& model_;
  bool was_training_;
  std::vector<Saved> saved_;
};

// Training at one batch size: the model's state swapped for copies, a fresh optimizer on them,
// and one random input batch on the device.
class ProbeSession {
 public:
  ProbeSession(models::Model& model, const ProbeOptions& options, const torch::Device& device, int64_t batch)
      : model_(model), options_(options), device_(device), swap_(model, device, options.channels_last),
        optimizer_(make_optimizer(options.optim, model, options.optim.lr)) {
    std::vector<int64_t> shape{batch};
    shape.insert(shape.end(), options.input_shape.begin(), options.input_shape.end());
    input_ = model.random_input(shape, torch::TensorOptions().device(device));
    if (options.channels_last && input_.dim() == 4) input_ = input_.contiguous(torch::MemoryFormat::ChannelsLast);
  }

  // One step as the trainer takes it, with random targets shaped like the logits without their
  // last dimension: forward(), backward(), update().
  void step() {
    backward(forward());
    update();
  }

  // Clears the gradients (to none) and runs the forward pass: the loss, holding the activations
  // the backward pass needs.
  torch::Tensor forward() {
    torch::AutoGradMode grad_mode(true);
    optimizer_->zero_grad();
    AutocastScope amp(device_.type(), options_.fp16 ? torch::kHalf : torch::kBFloat16, options_.bf16 || options_.fp16);
    if (model_.has_own_loss()) {
      const torch::Tensor output = model_.forward(input_);
      return checked_own_loss(model_, "", output, own_loss_target(output));
    }
    const torch::Tensor logits =
        options_.target_fraction < 1.0 ? model_.forward_selected(input_, target_positions()) : model_.forward(input_);
    check_logits("", logits, /*targets=*/-1, options_.num_classes);
    const torch::Tensor target =
        torch::randint(options_.num_classes, logits.sizes().slice(0, logits.dim() - 1),
                       torch::TensorOptions().dtype(torch::kLong).device(device_));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
                                                target.reshape({-1}));
  }

  // Backward and gradient clipping; the graph, and with it the activations, go with `loss`.
  void backward(torch::Tensor loss) {
    torch::AutoGradMode grad_mode(true);
    loss.backward();
    loss = torch::Tensor();
    if (options_.optim.clip_grad_norm > 0) clip_grad_norm(model_, options_.optim.clip_grad_norm);
  }

  // The optimizer step: its temporaries (a foreach or fused step's copies of the gradients or the
  // parameters) do not depend on the batch.
  void update() { optimizer_->step(); }

 private:
  // A model with its own loss: options.example_target repeated over the batch, or without one
  // (the data could not be read) zeros shaped like the output.
  torch::Tensor own_loss_target(const torch::Tensor& output) const {
    if (!options_.example_target.defined()) return torch::zeros(output.sizes(), output.options().dtype(torch::kFloat));
    const torch::Tensor one = options_.example_target.to(device_).unsqueeze(0);
    std::vector<int64_t> sizes(one.sizes().begin(), one.sizes().end());
    sizes[0] = input_.size(0);
    return one.expand(sizes).contiguous();
  }

  // Token tasks: exactly round(target_fraction x positions) positions with a target, at random
  // places. The data's count varies from batch to batch around that mean (MLM: about +-5 % at 2,048
  // positions); a probe that drew it the same way would measure each batch size at a different
  // share of targets, and its line through the points, extrapolated to larger batches, would
  // carry that noise several times over. The plan's headroom is for the batches above the mean.
  torch::Tensor target_positions() const {
    const int64_t positions = input_.numel();
    const int64_t count = std::clamp<int64_t>(
        std::llround(options_.target_fraction * static_cast<double>(positions)), 1, positions);
    const auto on_device = torch::TensorOptions().device(device_);
    torch::Tensor mask = torch::zeros({positions}, on_device.dtype(torch::kBool));
    mask.index_fill_(0, torch::randperm(positions, on_device.dtype(torch::kLong)).narrow(0, 0, count), true);
    return mask.view(input_.sizes());
  }

  models::Model& model_;
  const ProbeOptions& options_;
  torch::Device device_;
  ModelStateSwap swap_;  // declared before the optimizer: swapped back after it is gone
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  torch::Tensor input_;
};

// Live and peak bytes on the probed device: the caching allocator's statistics on CUDA, a
// CpuMemoryCounter on the CPU. (Without CUDA support probe_device admits only the CPU.)
class MemoryMeter {
 public:
  explicit MemoryMeter(const torch::Device& device) : device_(device) {
    if (device.is_cpu()) cpu_.emplace();
  }
  int64_t live_bytes() const {
#ifdef TRAIN_WITH_CUDA
    if (!cpu_) return compat::cuda_allocated_bytes(device_.index()).current;
#endif
    return cpu_->live_bytes();
  }
  int64_t peak_bytes() const {
#ifdef TRAIN_WITH_CUDA
    if (!cpu_) return compat::cuda_allocated_bytes(device_.index()).peak;
#endif
    return cpu_->peak_bytes();
  }
  void reset_peak() {
#ifdef TRAIN_WITH_CUDA
    if (!cpu_) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
      return;
    }
#endif
    cpu_->reset_peak();
  }

 private:
  torch::Device device_;
  std::optional<CpuMemoryCounter> cpu_;
};

// Runs `measure`; on running out of device memory returns false after returning the cached blocks
// to the device. By then unwinding has destroyed the session, so the cache holds all of its memory.
// The other errors of the model's or the optimizer's code (a shape that does not fit, a dtype
// the model does not take) come out with what the probe was doing: this is the first time the
// plan runs a program's own model, before any data is read.
template <typename Measure>
bool fits_in_memory(const torch::Device& device, int64_t batch, const ProbeOptions& options, Measure&& measure) {
  const auto doing = [&] {
    std::vector<int64_t> shape{batch};
    shape.insert(shape.end(), options.input_shape.begin(), options.input_shape.end());
    return log::str("measuring the plan's memory (a training step of the model on a random batch of shape [",
                    join_sizes(shape), "] on ", device.str(), ")");
  };
  try {
    measure();
    return true;
  } catch (const Error& e) {
    throw Error(doing() + ": " + e.what(), e.exit_code());
  } catch (const c10::Error& e) {
    if (!is_out_of_memory(e)) throw Error(doing() + " failed: " + e.what_without_backtrace());
#ifdef TRAIN_WITH_CUDA
    if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#else
    (void)device;
#endif
    return false;
  }
}

}  // namespace

// ---- is_out_of_memory ------------------------------------------------------------------------

bool is_out_of_memory(const std::exception& error) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&error) != nullptr) return true;
  if (dynamic_cast<const c10::Error*>(&error) == nullptr) return false;
  // c10::Error's what() carries a backtrace after the message; the first lines are the message.
  const std::string message = error.what();
  if (message.find("NCCL") != std::string::npos) return false;
  for (const char* marker : {"CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                             "CUDNN_STATUS_ALLOC_FAILED", "DefaultCPUAllocator: can't allocate memory",
                             "DefaultCPUAllocator: not enough memory"}) {
    if (message.find(marker) != std::string::npos) return true;
  }
  return false;
}

// ---- CpuMemoryCounter -----------------------------------------------------------------------

CpuMemoryCounter::CpuMemoryCounter(int64_t limit_bytes) : previous_(c10::GetCPUAllocator()), priority_(0) {
  CountingCpuAllocator& counting = CountingCpuAllocator::instance();
  if (!counting.start(previous_, limit_bytes)) throw std::logic_error("CpuMemoryCounter: another counter is alive");
  // SetCPUAllocator ignores priorities below the current one and cannot report it, so the lowest
  // priority that takes effect is the current one: restoring at it leaves the priority unchanged.
  for (int priority = 0; priority <= std::numeric_limits<uint8_t>::max(); ++priority) {
    c10::SetCPUAllocator(&counting, static_cast<uint8_t>(priority));
    if (c10::GetCPUAllocator() == &counting) {
      priority_ = static_cast<uint8_t>(priority);
      return;
    }
  }
}

CpuMemoryCounter::~CpuMemoryCounter() {
  c10::SetCPUAllocator(previous_, priority_);
  CountingCpuAllocator::instance().stop();
}

int64_t CpuMemoryCounter::live_bytes() const { return CountingCpuAllocator::instance().live(); }
int64_t CpuMemoryCounter::peak_bytes() const { return CountingCpuAllocator::instance().peak(); }
void CpuMemoryCounter::reset_peak() { CountingCpuAllocator::instance().reset_peak(); }

// ---- Probes ---------------------------------------------------------------------------------

// After probing, the caching allocator gives back what the largest step reserved (up to the
// budget): memory the allocator does not manage (NCCL's buffers, the cuDNN and cuBLAS handles of
// new threads, kernels loaded later) would otherwise find only what the budget left over.
static void release_cached_memory(const torch::Device& device) {
#ifdef TRAIN_WITH_CUDA
  if (!device.is_cuda()) return;
  synchronize(device);
  c10::cuda::CUDACachingAllocator::emptyCache();
#else
  (void)device;
#endif
}

MemoryFit probe_memory(models::Model& model, const ProbeOptions& options, const std::vector<int64_t>& batches) {
  validate(model, options, batches);
  const torch::Device device = probe_device(options);
  RngStateGuard rng(device);
  MemoryMeter meter(device);
  // One baseline for all points: buffers that libraries create on first use and keep (cuBLAS
  // workspaces) then count in every point, not only in the first.
  const int64_t baseline = meter.live_bytes();
  std::vector<ProbePoint> points;
  for (const int64_t batch : batches) {
    ProbePoint point;
    point.batch = batch;
    point.oom = !fits_in_memory(device, batch, options, [&] {
      ProbeSession session(model, options, device, batch);
      for (int i = 0; i < options.warmup_steps; ++i) session.step();
      meter.reset_peak();
      // What the forward pass keeps for the backward grows with the batch from the first sample.
      // The peak need not: at small batches a buffer the size of the parameters (the sum of a
      // tied embedding's two gradients, an optimizer step's temporaries) can outweigh the
      // activations, so the peaks of two small batches can be equal.
      torch::Tensor loss = session.forward();
      point.activation_bytes = meter.live_bytes() - baseline;
      session.backward(std::move(loss));
      point.peak_bytes = meter.peak_bytes() - baseline;
      session.update();
      point.peak_bytes = std::max(point.peak_bytes, meter.peak_bytes() - baseline);
    });
    points.push_back(point);
  }
  release_cached_memory(device);
  return fit_memory(std::move(points));
}

std::vector<ProbePoint> probe_throughput(models::Model& model, const ProbeOptions& options,
                                         const std::vector<int64_t>& batches) {
  validate(model, options, batches);
  const torch::Device device = probe_device(options);
  RngStateGuard rng(device);
  std::vector<ProbePoint> points;
  for (const int64_t batch : batches) {
    ProbePoint point;
    point.batch = batch;
    point.oom = !fits_in_memory(device, batch, options, [&] {
      ProbeSession session(model, options, device, batch);
      for (int i = 0; i < options.warmup_steps; ++i) session.step();
      synchronize(device);
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < options.timed_steps; ++i) session.step();
      synchronize(device);
      const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
      point.seconds_per_step = elapsed.count() / options.timed_steps;
    });
    points.push_back(point);
  }
  release_cached_memory(device);
  return points;
}

int64_t choose_by_throughput(const std::vector<ProbePoint>& points, double min_gain) {
  std::vector<ProbePoint> measured;
  std::copy_if(points.begin(), points.end(), std::back_inserter(measured),
               [](const ProbePoint& p) { return !p.oom && p.seconds_per_step > 0; });
  if (measured.empty()) return 0;
  std::sort(measured.begin(), measured.end(),
            [](const ProbePoint& a, const ProbePoint& b) { return a.batch < b.batch; });
  const auto samples_per_second = [](const ProbePoint& p) { return static_cast<double>(p.batch) / p.seconds_per_step; };
  size_t chosen = 0;
  for (size_t next = 1; next < measured.size(); ++next) {
    if (samples_per_second(measured[next]) < samples_per_second(measured[chosen]) * (1.0 + min_gain)) break;
    chosen = next;
  }
  return measured[chosen].batch;
}

// ---- Fit ------------------------------------------------------------------------------------

MemoryFit fit_memory(std::vector<ProbePoint> points) {
  MemoryFit fit;
  fit.points = std::move(points);
  std::vector<const ProbePoint*> measured;
  for (const ProbePoint& p : fit.points) {
    if (!p.oom) measured.push_back(&p);
  }
  if (measured.empty()) return fit;
  std::sort(measured.begin(), measured.end(), [](const ProbePoint* x, const ProbePoint* y) { return x->batch < y->batch; });
  const ProbePoint& largest = *measured.back();
  if (measured.front()->batch == largest.batch) {
    // One batch size: a line through the origin.
    fit.per_sample_bytes = static_cast<double>(largest.peak_bytes) / static_cast<double>(largest.batch);
    return fit;
  }
  // The peak is max(a constant, fixed + slope x batch): flat while a buffer the size of the
  // parameters is the largest thing alive (the sum of a tied embedding's two gradients, an
  // optimizer step's temporaries), a line once the activations are. The slope is the steeper of
  // the peaks' between the two largest batches (where the line is, if anywhere) and that of the
  // activations the forward pass keeps (least squares over every batch: they grow from the first
  // sample, and show a slope even where the peaks are flat); the line is the lowest with that
  // slope that passes over every measured peak.
  const ProbePoint& below = **(measured.end() - 2);
  const double peak_slope = static_cast<double>(largest.peak_bytes - below.peak_bytes) /
                            static_cast<double>(largest.batch - below.batch);
  double mean_batch = 0, mean_activations = 0;
  for (const ProbePoint* p : measured) {
    mean_batch += static_cast<double>(p->batch) / static_cast<double>(measured.size());
    mean_activations += static_cast<double>(p->activation_bytes) / static_cast<double>(measured.size());
  }
  double sxx = 0, sxa = 0;  // centred sums, for accuracy with byte counts in the billions
  for (const ProbePoint* p : measured) {
    const double dx = static_cast<double>(p->batch) - mean_batch;
    sxx += dx * dx;
    sxa += dx * (static_cast<double>(p->activation_bytes) - mean_activations);
  }
  fit.per_sample_bytes = std::max(peak_slope, sxa / sxx);
  fit.fixed_bytes = std::numeric_limits<int64_t>::min();
  for (const ProbePoint* p : measured) {
    const double above = static_cast<double>(p->peak_bytes) - fit.per_sample_bytes * static_cast<double>(p->batch);
    fit.fixed_bytes = std::max(fit.fixed_bytes, static_cast<int64_t>(std::ceil(above)));
  }
  return fit;
}

int64_t MemoryFit::batch_beyond_flat(int64_t largest_useful) const {
  std::vector<const ProbePoint*> sorted;
  for (const ProbePoint& p : points) {
    if (p.oom) return 0;  // memory bounds the batch already
    sorted.push_back(&p);
  }
  std::sort(sorted.begin(), sorted.end(), [](const ProbePoint* x, const ProbePoint* y) { return x->batch < y->batch; });
  if (sorted.size() < 2 || sorted.front()->batch == sorted.back()->batch) return 0;
  // Whether the peak grows from a to b with the activations (half their growth at least), rather
  // than staying at the level some other buffer sets.
  const auto on_the_line = [](const ProbePoint& a, const ProbePoint& b) {
    const int64_t activations = b.activation_bytes - a.activation_bytes;
    return activations <= 0 || b.peak_bytes - a.peak_bytes >= activations / 2;
  };
  const ProbePoint &low = *sorted.front(), &top = *sorted.back();
  if (on_the_line(low, top)) {
    // The fit's slope is the secant of the two largest batches: when the smaller of them is still
    // on the flat part, that secant starts below the line and undercounts it (by 10% at twice
    // the batch, on BERT-tiny): measure at twice the largest too.
    if (sorted.size() < 3 || on_the_line(**(sorted.end() - 3), **(sorted.end() - 2))) return 0;
    const int64_t batch = std::min(2 * top.batch, largest_useful);
    return batch > top.batch ? batch : 0;
  }
  // The activations must outgrow what the peak holds beyond them before the peak follows: measure
  // at twice the batch where they would, a power of two, within what the plan could use.
  const int64_t activations = top.activation_bytes - low.activation_bytes;
  const double per_sample = static_cast<double>(activations) / static_cast<double>(top.batch - low.batch);
  const double needed =
      static_cast<double>(top.batch) + 2.0 * static_cast<double>(top.peak_bytes - top.activation_bytes) / per_sample;
  int64_t batch = 2 * top.batch;
  while (static_cast<double>(batch) < needed && batch < largest_useful) batch *= 2;
  batch = std::min(batch, largest_useful);
  return batch > top.batch ? batch : 0;
}

bool MemoryFit::measured() const {
  return std::any_of(points.begin(), points.end(), [](const ProbePoint& p) { return !p.oom; });
}

int64_t MemoryFit::predict(int64_t batch) const {
  return fixed_bytes + std::llround(per_sample_bytes * static_cast<double>(batch));
}

int64_t MemoryFit::max_batch(int64_t budget_bytes) const {
  if (!measured()) return 0;
  int64_t limit = std::numeric_limits<int64_t>::max();  // below every batch that ran out of memory
  int64_t largest_measured = 0;
  for (const ProbePoint& p : points) {
    if (p.oom) limit = std::min(limit, p.batch - 1);
    else largest_measured = std::max(largest_measured, p.batch);
  }
  if (per_sample_bytes <= 0) {
    const int64_t batch = std::min(largest_measured, limit);
    return batch > 0 && predict(batch) <= budget_bytes ? batch : 0;
  }
  const double solution = std::floor(static_cast<double>(budget_bytes - fixed_bytes) / per_sample_bytes);
  int64_t batch = solution <= 0 ? 0 : solution >= static_cast<double>(limit) ? limit : static_cast<int64_t>(solution);
  // Settle rounding at the boundary so that the answer agrees with predict exactly.
  while (batch > 0 && predict(batch) > budget_bytes) --batch;
  while (batch < limit && predict(batch + 1) <= budget_bytes) ++batch;
  return batch;
}

}  // namespace train
