#pragma once
// Internal: tensors sorted into the lists that the multi-tensor (_foreach_*) kernels and one
// torch::cat take, each on one device and of one dtype.
#include <torch/types.h>

#include <map>
#include <tuple>
#include <vector>

namespace train {
namespace {

using TensorGroupKey = std::tuple<int, int, int>;  // device type, device index, dtype

// The defined tensors of `tensors` by device and dtype, each list in the order given.
inline std::map<TensorGroupKey, std::vector<torch::Tensor>> group_by_device_and_dtype(
    const std::vector<torch::Tensor>& tensors) {
  std::map<TensorGroupKey, std::vector<torch::Tensor>> groups;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    groups[{static_cast<int>(t.device().type()), static_cast<int>(t.device().index()),
            static_cast<int>(t.scalar_type())}]
        .push_back(t);
  }
  return groups;
}

}  // namespace
}  // namespace train
