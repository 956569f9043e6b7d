#pragma once
// ResNet-18/34/50 with torchvision's architecture (v1.5: the bottleneck strides on its 3x3 conv)
// and torchvision's state-dict names (`conv1`, `layer1.0.downsample.0`, `fc`, ...), so that
// torchvision weights can be loaded by name.
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <array>
#include <cstdint>

#include "train/config.h"
#include "train/models/model.h"

namespace train::models {

enum class ResNetBlock {
  kBasic,       // two 3x3 convs (ResNet-18/34)
  kBottleneck,  // 1x1 -> 3x3 -> 1x1 with 4x expansion (ResNet-50)
};

struct ResNetOptions {
  ResNetBlock block = ResNetBlock::kBasic;
  std::array<int64_t, 4> blocks = {2, 2, 2, 2};  // residual blocks per stage
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  // Channel multiplier. Stage i has base * 2^i planes, where base = 64 * width rounded to the
  // nearest multiple of 8 and at least 8 (1.0 -> 64, 0.5 -> 32, 0.25 -> 16, 0.1 -> 8). Rounding
  // the base alone keeps every stage exactly twice the previous one, as in torchvision.
  double width = 1.0;
  // Stem = 3x3 stride-1 conv without max-pool, for 28x28 / 32x32 images.
  bool small_input = false;
  // Zero the last BN gamma of every residual block so that each block starts as the identity
  // ("Bag of Tricks"; torchvision's `zero_init_residual`). Off by default, as in torchvision.
  bool zero_init_residual = false;

  // torchvision's layout for depth 18, 34 or 50 (1000 classes, 3 channels, width 1).
  // Throws std::invalid_argument for any other depth.
  static ResNetOptions for_depth(int depth);
};

class ResNet : public Model {
 public:
  // Throws std::invalid_argument for a non-positive width, class count, channel or block count.
  explicit ResNet(const ResNetOptions& options);

  torch::Tensor forward(const torch::Tensor& input) override;
  bool has_batch_stats() const override { return true; }
  bool is_convolutional() const override { return true; }
  bool capturable() const override { return true; }
  // Images [channels, H, W] of any size.
  std::string input_problem(const std::vector<int64_t>& sample_shape, int64_t vocab_size) const override;
  // The head is fc: torchvision's ImageNet weights start a model with another class count.
  WeightRules weight_rules() const override;

  const ResNetOptions& options() const { return options_; }

 private:
  ResNetOptions options_;
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr};
  std::array<torch::nn::Sequential, 4> layers_{nullptr, nullptr, nullptr, nullptr};
  torch::nn::Linear fc_{nullptr};
};

// ResNet-`depth` (18, 34 or 50) with num_classes, in_channels, width and small_input taken from
// `config`. This is what the registry's built-in `resnet18`/`resnet34`/`resnet50` call.
ModelPtr make_resnet(int depth, const ModelConfig& config);

}  // namespace train::models
