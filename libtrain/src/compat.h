#pragma once
// The one place where LibTorch version differences live (1.13 ... 2.11).
// Internal header: not installed.
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

}  // namespace train::compat
