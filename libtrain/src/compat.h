#pragma once
// The one place where LibTorch version differences live (1.13 ... 2.11).
// Internal header: not installed.
#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

#define TRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace train::compat {

inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

// State of the default CPU generator (dropout, random init) for exact resume.
inline torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
inline void set_cpu_rng_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// TF32 for cuBLAS matmuls and cuDNN convolutions (only meaningful on compute capability >= 8.0).
inline void set_allow_tf32(bool allow) {
  at::globalContext().setAllowTF32CuBLAS(allow);
  at::globalContext().setAllowTF32CuDNN(allow);
}

inline void set_cudnn_benchmark(bool on) { at::globalContext().setBenchmarkCuDNN(on); }

// Autocast: 2.x takes the device type; 1.13 has separate GPU and CPU functions.
inline bool autocast_enabled(c10::DeviceType device) {
#if TRAIN_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}
inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if TRAIN_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CPU) at::autocast::set_cpu_enabled(enabled); else at::autocast::set_enabled(enabled);
#endif
}
inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
#if TRAIN_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
#endif
}
inline void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
#if TRAIN_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CPU) at::autocast::set_autocast_cpu_dtype(dtype); else at::autocast::set_autocast_gpu_dtype(dtype);
#endif
}

}  // namespace train::compat

// ---------------------------------------------------------------------------------------------
// Allocators (the memory probe's counting CPU allocator, CUDA allocator statistics).
// ---------------------------------------------------------------------------------------------
namespace train::compat {

// Base for allocators of host memory. 2.3 made c10::Allocator::allocate non-const and added the
// pure virtual copy_data; subclasses implement allocate_bytes once for every version.
class HostAllocatorBase : public c10::Allocator {
 public:
#if TRAIN_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t bytes) override { return allocate_bytes(bytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);  // host memory: memcpy
  }
#else
  // 1.13 declares allocate const although allocators keep state; no allocator object is itself
  // const, so casting the qualifier away is well defined.
  c10::DataPtr allocate(size_t bytes) const override {
    return const_cast<HostAllocatorBase*>(this)->allocate_bytes(bytes);
  }
#endif

 protected:
  virtual c10::DataPtr allocate_bytes(size_t bytes) = 0;
};

}  // namespace train::compat

#ifdef TRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

namespace train::compat {

struct CudaAllocatedBytes {
  int64_t current = 0;  // held by live tensors now
  int64_t peak = 0;     // most held at once since the last resetPeakStats
};

// Bytes the CUDA caching allocator has handed out on `device`. The enum that names the aggregate
// statistic (StatType) moved from c10::cuda::CUDACachingAllocator to c10::CachingAllocator during
// 2.x; its index, 0, is the same in every version.
inline CudaAllocatedBytes cuda_allocated_bytes(c10::DeviceIndex device) {
  constexpr size_t kAggregate = 0;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return {stats.allocated_bytes[kAggregate].current, stats.allocated_bytes[kAggregate].peak};
}

}  // namespace train::compat
#endif  // TRAIN_WITH_CUDA

// ---------------------------------------------------------------------------------------------
// Loss scaling and multi-tensor optimizers (amp.cpp, optim.cpp): which native kernels a device
// has, and the optimizer state map's key type.
// ---------------------------------------------------------------------------------------------
#include <sstream>
#include <type_traits>

namespace train::compat {

// _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_ have CUDA kernels in every
// supported version; their CPU kernels came in 2.3 (pytorch#109281).
inline bool has_amp_scaler_kernels(c10::DeviceType device) {
  return device == c10::DeviceType::CUDA || (device == c10::DeviceType::CPU && TRAIN_TORCH_AT_LEAST(2, 3));
}

// The unscale kernel's dtypes: the CUDA one takes fp32, fp64 and fp16 but not bf16 (2.11 raises
// "not implemented for 'BFloat16'", seen on an H200); the CPU one takes all four.
inline bool has_amp_unscale_kernel(c10::DeviceType device, c10::ScalarType dtype) {
  if (!has_amp_scaler_kernels(device)) return false;
  return device != c10::DeviceType::CUDA || dtype != c10::ScalarType::BFloat16;
}

// _fused_adamw_: CUDA since 2.0 (pytorch#88015), CPU since 2.4 (pytorch#123074).
inline bool has_fused_adamw(c10::DeviceType device) {
  return (device == c10::DeviceType::CUDA && TRAIN_TORCH_AT_LEAST(2, 0)) ||
         (device == c10::DeviceType::CPU && TRAIN_TORCH_AT_LEAST(2, 4));
}

// _fused_sgd_: CUDA since 2.3 (pytorch#116585), CPU since 2.4 (pytorch#123629).
inline bool has_fused_sgd(c10::DeviceType device) {
  return (device == c10::DeviceType::CUDA && TRAIN_TORCH_AT_LEAST(2, 3)) ||
         (device == c10::DeviceType::CPU && TRAIN_TORCH_AT_LEAST(2, 4));
}

// One AdamW step (no amsgrad, no maximize) over tensors on one device. Call only where
// has_fused_adamw(device); `steps` are float tensors holding the already incremented counts.
#if TRAIN_TORCH_AT_LEAST(2, 0)
inline void fused_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList steps, double lr, double beta1,
                        double beta2, double weight_decay, double eps) {
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                    weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
}
#else
template <typename... Args>
void fused_adamw(const Args&...) {
  TORCH_CHECK(false, "_fused_adamw_ needs LibTorch 2.0 or later, this is ", torch_version());
}
#endif

// CUDA-graph capture of the training step (step_graph.cpp): CUDAGraph::capture_begin with a pool
// and a thread-local capture mode, and Generator::graphsafe_set_state to take the default CUDA
// generator out of capture mode after a capture that failed half-way, are there from 2.4.
inline constexpr bool kCudaGraphCapture = TRAIN_TORCH_AT_LEAST(2, 4);
#if defined(TRAIN_WITH_CUDA) && TRAIN_TORCH_AT_LEAST(2, 4)
#define TRAIN_CUDA_GRAPHS 1
#else
#define TRAIN_CUDA_GRAPHS 0
#endif
// A capture also routes pinned host allocations to the graph's pool
// (HostAllocator::end_allocate_to_pool / release_pool; in 2.11's headers, checked).
#define TRAIN_HOST_GRAPH_POOLS TRAIN_TORCH_AT_LEAST(2, 11)

// AdamW for a captured step: the LR from `lr`, the update skipped where `skip` holds 1 (both 0-dim
// float tensors on the parameters' device), `steps` already advanced by advance_steps. The
// tensor-LR form of _fused_adamw_ and _foreach_add_ with a tensor are in 2.4 (checked; older
// releases plan without CUDA graphs for AdamW).
#if TRAIN_TORCH_AT_LEAST(2, 4)
inline constexpr bool kAdamwStepOnDevice = true;
inline void fused_adamw_on_device(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                  at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& lr,
                                  double beta1, double beta2, double weight_decay, double eps,
                                  const at::Tensor& skip) {
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                    weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false,
                    /*grad_scale=*/c10::optional<at::Tensor>(), c10::optional<at::Tensor>(skip));
}
// Every step count + 1 - skip, on the device.
inline void advance_steps(at::TensorList steps, const at::Tensor& skip) {
  at::_foreach_add_(steps, skip, -1);
  at::_foreach_add_(steps, 1);
}
#else
inline constexpr bool kAdamwStepOnDevice = false;
template <typename... Args>
void fused_adamw_on_device(const Args&...) {
  TORCH_CHECK(false, "AdamW with its step on the device needs LibTorch 2.4 or later, this is ", torch_version());
}
template <typename... Args>
void advance_steps(const Args&...) {
  TORCH_CHECK(false, "AdamW with its step on the device needs LibTorch 2.4 or later, this is ", torch_version());
}
#endif

// Every tensor of `tensors` (one device) times the 0-dim tensor `factor`, without reading it on
// the host: one multi-tensor kernel from 2.1 (_foreach_mul_.Tensor), one kernel per tensor before.
inline void foreach_mul_by_tensor(at::TensorList tensors, const at::Tensor& factor) {
#if TRAIN_TORCH_AT_LEAST(2, 1)
  at::_foreach_mul_(tensors, factor);
#else
  for (const auto& t : tensors) t.mul_(factor);
#endif
}

// One SGD step over tensors on one device. Call only where has_fused_sgd(device).
// `momentum_buffers` is empty when momentum is 0; with is_first_step the kernel fills them.
#if TRAIN_TORCH_AT_LEAST(2, 3)
inline void fused_sgd(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                      double weight_decay, double momentum, double lr, double dampening, bool nesterov,
                      bool is_first_step) {
  at::_fused_sgd_(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov,
                  /*maximize=*/false, is_first_step);
}
// The same with the learning rate read from `lr` (a 0-dim float tensor on the parameters' device)
// and the whole update skipped where `skip` (0-dim float) holds 1: what a captured CUDA graph
// needs, since it replays the values it captured but reads tensors afresh.
inline void fused_sgd(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                      double weight_decay, double momentum, const at::Tensor& lr, double dampening,
                      bool nesterov, bool is_first_step, const at::Tensor& skip) {
  at::_fused_sgd_(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov,
                  /*maximize=*/false, is_first_step, /*grad_scale=*/c10::optional<at::Tensor>(), c10::optional<at::Tensor>(skip));
}
#else
template <typename... Args>
void fused_sgd(const Args&...) {
  TORCH_CHECK(false, "_fused_sgd_ needs LibTorch 2.3 or later, this is ", torch_version());
}
#endif

// Optimizer::state() is keyed by the parameter's TensorImpl address: as text on 1.13, as the
// pointer itself later. The overload is chosen by the map's key type, so the exact release of
// that change does not matter.
using OptimizerStateKey =
    std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

inline void make_state_key(void* impl, void*& key) { key = impl; }
inline void make_state_key(void* impl, std::string& key) {
  std::ostringstream text;  // what 1.13's c10::guts::to_string does for a pointer
  text << impl;
  key = text.str();
}
inline OptimizerStateKey optimizer_state_key(const torch::Tensor& param) {
  OptimizerStateKey key;
  make_state_key(param.unsafeGetTensorImpl(), key);
  return key;
}

// Whether Optimizer::load here reads back a saved state key (the text "params/N" of a saved param
// group holds). 1.13 saved the address as hex text ("0x55d0c3a1b2c0") and compares keys as text, so
// it reads its own and the later decimal ones. The pointer-keyed versions parse the text with
// std::stoull, which reads hex text as 0: every parameter's state would land on one key.
inline bool reads_saved_optimizer_key(const std::string& saved) {
  return std::is_same_v<OptimizerStateKey, std::string> || saved.rfind("0x", 0) != 0;
}

}  // namespace train::compat

// ---- c10d (only for the translation units that define TRAIN_COMPAT_C10D before including) ----
// 2.x split ProcessGroup into a dispatcher and per-backend `Backend` objects (ProcessGroupGloo
// and ProcessGroupNCCL derive from Backend); in 1.13 they derive from ProcessGroup itself. Both
// expose allreduce/broadcast returning a Work with wait().
#ifdef TRAIN_COMPAT_C10D
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(TRAIN_WITH_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace train::compat {

#if TRAIN_TORCH_AT_LEAST(2, 0)
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

// Ends a backend at the end of its group's life. Destroyed without it, 2.x's ProcessGroupNCCL
// warns at exit that "destroy_process_group() was not called" (and then shuts itself down);
// Backend::shutdown is a no-op for Gloo. 1.13's ProcessGroup has no shutdown.
inline void shutdown_backend(C10dBackend& backend) {
#if TRAIN_TORCH_AT_LEAST(2, 4)
  backend.shutdown();
#else
  (void)backend;
#endif
}

// Whether this LibTorch's TCPStore client speaks the protocol of the 2.x stores that torchrun's
// agent serves (1.13's does not: the agent rejects its messages).
constexpr bool kTcpStoreSpeaksAgentProtocol = TRAIN_TORCH_AT_LEAST(2, 0);

// libuv is the 2.x default for the store server; not every build has it, and the classic
// server is enough for one store per job. The option does not exist in 1.13.
inline void store_without_libuv(c10d::TCPStoreOptions& options) {
#if TRAIN_TORCH_AT_LEAST(2, 2)
  options.useLibUV = false;
#else
  (void)options;
#endif
}

}  // namespace train::compat
#endif  // TRAIN_COMPAT_C10D
