#include "train/models/resnet.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "train/safetensors.h"

namespace train::models {
namespace {

// Every conv in the network comes from here, so this is also where torchvision's conv init
// (Kaiming normal, fan_out, ReLU gain) is applied. Padding kernel/2 keeps "same" spatial size
// before striding, as torchvision's conv1x1 / conv3x3 / 7x7 stem do.
torch::nn::Conv2d make_conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(in, out, kernel)
                             .stride(stride)
                             .padding(kernel / 2)
                             .bias(false));
  torch::nn::init::kaiming_normal_(conv->weight, /*a=*/0.0, torch::kFanOut, torch::kReLU);
  return conv;
}

// LibTorch already initialises BN weight to 1 and bias to 0, which is torchvision's init.
torch::nn::BatchNorm2d make_bn(int64_t channels) {
  return torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(channels).eps(1e-5).momentum(0.1));
}

// The projection shortcut (1x1 conv + BN), registered as `downsample` so its parameters are
// `downsample.0.weight` and `downsample.1.*` like torchvision's nn.Sequential.
torch::nn::Sequential make_downsample(int64_t in, int64_t out, int64_t stride) {
  return torch::nn::Sequential(make_conv(in, out, 1, stride), make_bn(out));
}

// Adds the shortcut and applies the final ReLU; shared by both block kinds. ReLUs and the add are
// in place, as torchvision's, to save activation memory. `downsample` is a holder (a shared
// pointer), so passing it by value is cheap.
torch::Tensor residual(torch::Tensor out, const torch::Tensor& input,
                       torch::nn::Sequential downsample) {
  out += downsample.is_empty() ? input : downsample->forward(input);
  return out.relu_();
}

class BasicBlock : public torch::nn::Module {
 public:
  static constexpr int64_t kExpansion = 1;

  BasicBlock(int64_t in, int64_t planes, int64_t stride, bool zero_init_residual)
      : conv1_(register_module("conv1", make_conv(in, planes, 3, stride))),
        bn1_(register_module("bn1", make_bn(planes))),
        conv2_(register_module("conv2", make_conv(planes, planes, 3, 1))),
        bn2_(register_module("bn2", make_bn(planes))) {
    if (stride != 1 || in != planes * kExpansion) {
      downsample_ = register_module("downsample", make_downsample(in, planes * kExpansion, stride));
    }
    if (zero_init_residual) torch::nn::init::zeros_(bn2_->weight);
  }

  torch::Tensor forward(const torch::Tensor& input) {
    auto out = bn1_(conv1_(input)).relu_();
    out = bn2_(conv2_(out));
    return residual(out, input, downsample_);
  }

 private:
  torch::nn::Conv2d conv1_;
  torch::nn::BatchNorm2d bn1_;
  torch::nn::Conv2d conv2_;
  torch::nn::BatchNorm2d bn2_;
  torch::nn::Sequential downsample_{nullptr};
};

// ResNet v1.5: the stride sits on the 3x3 conv (conv2), not on the first 1x1.
class Bottleneck : public torch::nn::Module {
 public:
  static constexpr int64_t kExpansion = 4;

  Bottleneck(int64_t in, int64_t planes, int64_t stride, bool zero_init_residual)
      : conv1_(register_module("conv1", make_conv(in, planes, 1, 1))),
        bn1_(register_module("bn1", make_bn(planes))),
        conv2_(register_module("conv2", make_conv(planes, planes, 3, stride))),
        bn2_(register_module("bn2", make_bn(planes))),
        conv3_(register_module("conv3", make_conv(planes, planes * kExpansion, 1, 1))),
        bn3_(register_module("bn3", make_bn(planes * kExpansion))) {
    if (stride != 1 || in != planes * kExpansion) {
      downsample_ = register_module("downsample", make_downsample(in, planes * kExpansion, stride));
    }
    if (zero_init_residual) torch::nn::init::zeros_(bn3_->weight);
  }

  torch::Tensor forward(const torch::Tensor& input) {
    auto out = bn1_(conv1_(input)).relu_();
    out = bn2_(conv2_(out)).relu_();
    out = bn3_(conv3_(out));
    return residual(out, input, downsample_);
  }

 private:
  torch::nn::Conv2d conv1_;
  torch::nn::BatchNorm2d bn1_;
  torch::nn::Conv2d conv2_;
  torch::nn::BatchNorm2d bn2_;
  torch::nn::Conv2d conv3_;
  torch::nn::BatchNorm2d bn3_;
  torch::nn::Sequential downsample_{nullptr};
};

// One stage (`layerN`): the first block changes stride/width, the rest keep them. Blocks are
// named "0", "1", ... by Sequential, matching torchvision. Advances `in` to the stage output.
template <typename Block>
torch::nn::Sequential make_stage(int64_t& in, int64_t planes, int64_t blocks, int64_t stride,
                                 bool zero_init_residual) {
  torch::nn::Sequential stage;
  for (int64_t i = 0; i < blocks; ++i) {
    stage->push_back(std::make_shared<Block>(in, planes, i == 0 ? stride : 1, zero_init_residual));
    in = planes * Block::kExpansion;
  }
  return stage;
}

int64_t base_planes(double width) {
  return std::max<int64_t>(8, 8 * std::llround(64.0 * width / 8.0));
}

void validate(const ResNetOptions& options) {
  if (!(options.width > 0.0) || !std::isfinite(options.width)) {
    throw std::invalid_argument("ResNet: width must be a positive number, got " +
                                std::to_string(options.width));
  }
  if (options.num_classes < 1) {
    throw std::invalid_argument("ResNet: num_classes must be >= 1, got " +
                                std::to_string(options.num_classes));
  }
  if (options.in_channels < 1) {
    throw std::invalid_argument("ResNet: in_channels must be >= 1, got " +
                                std::to_string(options.in_channels));
  }
  for (int64_t blocks : options.blocks) {
    if (blocks < 1) {
      throw std::invalid_argument("ResNet: every stage needs at least one block, got " +
                                  std::to_string(blocks));
    }
  }
}

}  // namespace

ResNetOptions ResNetOptions::for_depth(int depth) {
  ResNetOptions options;
  switch (depth) {
    case 18:
      options.block = ResNetBlock::kBasic;
      options.blocks = {2, 2, 2, 2};
      break;
    case 34:
      options.block = ResNetBlock::kBasic;
      options.blocks = {3, 4, 6, 3};
      break;
    case 50:
      options.block = ResNetBlock::kBottleneck;
      options.blocks = {3, 4, 6, 3};
      break;
    default:
      throw std::invalid_argument("ResNet: unsupported depth " + std::to_string(depth) +
                                  " (supported: 18, 34, 50)");
  }
  return options;
}

ResNet::ResNet(const ResNetOptions& options) : options_(options) {
  validate(options);
  const int64_t base = base_planes(options.width);
  const bool small = options.small_input;
  conv1_ = register_module("conv1",
                           make_conv(options.in_channels, base, small ? 3 : 7, small ? 1 : 2));
  bn1_ = register_module("bn1", make_bn(base));

  int64_t in = base;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const int64_t planes = base << i;
    const int64_t stride = i == 0 ? 1 : 2;
    const int64_t blocks = options.blocks[i];
    const bool zero = options.zero_init_residual;
    layers_[i] = register_module(
        "layer" + std::to_string(i + 1),
        options.block == ResNetBlock::kBasic
            ? make_stage<BasicBlock>(in, planes, blocks, stride, zero)
            : make_stage<Bottleneck>(in, planes, blocks, stride, zero));
  }
  fc_ = register_module("fc", torch::nn::Linear(in, options.num_classes));
}

torch::Tensor ResNet::forward(const torch::Tensor& input) {
  auto x = bn1_(conv1_(input)).relu_();
  if (!options_.small_input) {
    x = torch::max_pool2d(x, /*kernel_size=*/3, /*stride=*/2, /*padding=*/1);
  }
  for (auto& layer : layers_) x = layer->forward(x);
  x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
  return fc_(x);
}

std::string ResNet::input_problem(const std::vector<int64_t>& sample_shape, int64_t /*vocab_size*/) const {
  if (sample_shape.size() == 3) return "";
  std::string shape;
  for (size_t i = 0; i < sample_shape.size(); ++i) shape += (i ? "x" : "") + std::to_string(sample_shape[i]);
  return "key 'model.name': ResNet takes images [channels, H, W], but the data gives samples of shape " + shape;
}

WeightRules ResNet::weight_rules() const {
  WeightRules rules;
  rules.head = {"fc."};
  return rules;
}

ModelPtr make_resnet(int depth, const ModelConfig& config) {
  ResNetOptions options = ResNetOptions::for_depth(depth);
  options.num_classes = config.num_classes;
  options.in_channels = config.in_channels;
  options.width = config.width;
  options.small_input = config.small_input;
  return std::make_shared<ResNet>(options);
}

}  // namespace train::models
