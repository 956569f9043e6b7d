// Fuzz target: the IDX reader (MNIST / Fashion-MNIST images and labels, plain or gzip).
// Input: one file, read both as idx3-ubyte images and as idx1-ubyte labels.
// Property: what is read has the shape the header declares and labels in range.
#include <train/data/idx.h>
#include <train/errors.h>

#include <cstdint>
#include <string>

#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = train::fuzz::write_scratch("data-idx-ubyte", data, size);
  try {
    const torch::Tensor images = train::data::read_idx_images(path);
    if (images.dim() != 4 || images.size(1) != 1 || images.scalar_type() != torch::kByte) {
      train::fuzz::violated("read_idx_images did not return uint8 [N, 1, H, W]");
    }
  } catch (const train::Error&) {
  }
  try {
    const torch::Tensor labels = train::data::read_idx_labels(path);
    if (labels.dim() != 1 || labels.scalar_type() != torch::kLong) {
      train::fuzz::violated("read_idx_labels did not return int64 [N]");
    }
    if (labels.numel() > 0 &&
        (labels.min().item<int64_t>() < 0 || labels.max().item<int64_t>() >= train::data::kIdxNumClasses)) {
      train::fuzz::violated("read_idx_labels returned a label out of range");
    }
  } catch (const train::Error&) {
  }
  return 0;
}
