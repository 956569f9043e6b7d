#pragma once
// Mixed precision: an autocast scope that works on every supported LibTorch version, and the
// memory-format conversion that tensor-core convolutions want.
#include <torch/nn/module.h>
#include <torch/types.h>

namespace train {

// While alive, ops on `device`'s type run under autocast to `dtype` (bf16 or fp16 on CUDA,
// bf16 on CPU). Nests: the previous state is restored on destruction. `enabled == false`
// makes it a no-op, so call sites need no branch.
class AutocastScope {
 public:
  AutocastScope(torch::DeviceType device, torch::ScalarType dtype, bool enabled = true);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  torch::DeviceType device_;
  bool enabled_;
  bool prev_enabled_ = false;
  torch::ScalarType prev_dtype_ = torch::kFloat;
};

bool autocast_enabled(torch::DeviceType device);

// Converts every 4-D parameter and buffer of `module` to channels_last in place
// (LibTorch's Module::to has no memory_format argument).
void to_channels_last(torch::nn::Module& module);

}  // namespace train
