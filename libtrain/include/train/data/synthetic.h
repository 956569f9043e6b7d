#pragma once
// A generated image-classification dataset that needs no files: for tests, benchmarks and smoke
// runs. It is learnable, so a short training run shows a falling loss.
//
// Sample i has label i % num_classes and pixels 0.5 + 0.2 * prototype[label] + 0.3 * noise_i,
// all within [0, 1]. Each class prototype is a fixed +-1 pattern and noise_i is uniform in
// [-1, 1), generated from the sample index (not the epoch seed), so the content of a sample never
// changes; only the transforms draw from the per-sample seed.
#include <train/data/dataset.h>
#include <train/data/transforms.h>

#include <cstdint>
#include <string>
#include <vector>

namespace train::data {

struct SyntheticImageOptions {
  int64_t samples = 1024;
  int64_t channels = 3;
  int64_t image_size = 32;  // H = W
  int64_t num_classes = 10;
  // Selects the noise; datasets with different streams (train / val) share the class prototypes
  // and therefore the task, but not their samples.
  uint64_t stream = 0;
  ImageTransforms transforms;
};

class SyntheticImageDataset : public Dataset {
 public:
  explicit SyntheticImageDataset(SyntheticImageOptions options);

  int64_t size() const override { return options_.samples; }
  Example get(int64_t index, uint64_t seed) const override;
  std::vector<int64_t> input_shape() const override;
  int64_t num_classes() const override { return options_.num_classes; }
  std::string describe() const override;

 private:
  SyntheticImageOptions options_;
  torch::Tensor prototypes_;  // float [num_classes, C, H, W], entries +-1
};

}  // namespace train::data
