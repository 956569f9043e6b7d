#pragma once
// The state of the CUDA generator behind dropout on a device: saved in checkpoints for exact
// resume, restored after the probe, forked by BERT's recomputed layers. Internal header.
#include <torch/torch.h>

#include <mutex>

#ifdef TRAIN_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace train::detail {
namespace {

// The default CUDA generator's state for `device`; an empty tensor for a device that is not CUDA.
inline torch::Tensor cuda_rng_state([[maybe_unused]] const torch::Device& device) {
#ifdef TRAIN_WITH_CUDA
  if (device.is_cuda()) {
    auto generator = at::cuda::detail::getDefaultCUDAGenerator(device.has_index() ? device.index() : -1);
    std::lock_guard<std::mutex> lock(generator.mutex());
    return generator.get_state();
  }
#endif
  return {};
}

// Sets it back; nothing for a device that is not CUDA.
inline void set_cuda_rng_state([[maybe_unused]] const torch::Device& device,
                               [[maybe_unused]] const torch::Tensor& state) {
#ifdef TRAIN_WITH_CUDA
  if (device.is_cuda()) {
    auto generator = at::cuda::detail::getDefaultCUDAGenerator(device.has_index() ? device.index() : -1);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
#endif
}

}  // namespace
}  // namespace train::detail
