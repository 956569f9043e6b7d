#include "train/models/small.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/safetensors.h"

namespace train::models {
namespace {

constexpr int64_t kSide = 28;  // both networks are laid out for 28x28 inputs

void check_config(const ModelConfig& config, const char* name) {
  if (config.in_channels < 1 || config.num_classes < 1) {
    throw std::invalid_argument(std::string(name) + ": in_channels and num_classes must be >= 1, got " +
                                std::to_string(config.in_channels) + " and " + std::to_string(config.num_classes));
  }
}

// Names the expected and the actual shape; without it the first Linear would report a bare
// matrix-size mismatch.
void check_input(const torch::Tensor& input, int64_t channels, const char* name) {
  if (input.dim() != 4 || input.size(1) != channels || input.size(2) != kSide || input.size(3) != kSide) {
    throw std::invalid_argument(std::string(name) + ": expected input [B, " + std::to_string(channels) +
                                ", 28, 28], got " + c10::str(input.sizes()));
  }
}

// The check made before a run: images of kSide x kSide (channels are checked by prepare_run
// against model.in_channels).
std::string image_problem(const std::vector<int64_t>& shape, const char* name) {
  std::string text;
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? "x" : "") + std::to_string(shape[i]);
  if (shape.size() != 3) {
    return std::string("key 'model.name': ") + name + " takes images [channels, 28, 28], but the data gives samples of shape " +
           text;
  }
  if (shape[1] != kSide || shape[2] != kSide) {
    return std::string("key 'data.image_size': ") + name + " is laid out for 28x28 images, but the data gives " +
           std::to_string(shape[1]) + "x" + std::to_string(shape[2]) + "; set data.image_size: 28 or use a model "
           "that takes any size (resnet18 with model.small_input)";
  }
  return "";
}

class Mlp final : public Model {
 public:
  explicit Mlp(const ModelConfig& config)
      : channels_(config.in_channels),
        fc1_(register_module("fc1", torch::nn::Linear(channels_ * kSide * kSide, 512))),
        fc2_(register_module("fc2", torch::nn::Linear(512, 512))),
        fc3_(register_module("fc3", torch::nn::Linear(512, config.num_classes))) {}

  bool capturable() const override { return true; }
  torch::Tensor forward(const torch::Tensor& input) override {
    check_input(input, channels_, "mlp");
    auto x = torch::relu(fc1_(input.flatten(1)));
    x = torch::relu(fc2_(x));
    return fc3_(x);
  }
  std::string input_problem(const std::vector<int64_t>& shape, int64_t) const override {
    return image_problem(shape, "mlp");
  }
  WeightRules weight_rules() const override {
    WeightRules rules;
    rules.head = {"fc3."};
    return rules;
  }

 private:
  int64_t channels_;
  torch::nn::Linear fc1_, fc2_, fc3_;
};

class LeNet final : public Model {
 public:
  explicit LeNet(const ModelConfig& config)
      : channels_(config.in_channels),
        conv1_(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels_, 6, 5).padding(2)))),
        conv2_(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 16, 5)))),
        fc1_(register_module("fc1", torch::nn::Linear(16 * 5 * 5, 120))),
        fc2_(register_module("fc2", torch::nn::Linear(120, 84))),
        fc3_(register_module("fc3", torch::nn::Linear(84, config.num_classes))) {}

  bool capturable() const override { return true; }
  torch::Tensor forward(const torch::Tensor& input) override {
    check_input(input, channels_, "lenet");
    auto x = torch::max_pool2d(torch::relu(conv1_(input)), 2);  // 6 x 14 x 14
    x = torch::max_pool2d(torch::relu(conv2_(x)), 2);           // 16 x 5 x 5
    x = torch::relu(fc1_(x.flatten(1)));
    x = torch::relu(fc2_(x));
    return fc3_(x);
  }
  bool is_convolutional() const override { return true; }
  std::string input_problem(const std::vector<int64_t>& shape, int64_t) const override {
    return image_problem(shape, "lenet");
  }
  WeightRules weight_rules() const override {
    WeightRules rules;
    rules.head = {"fc3."};
    return rules;
  }

 private:
  int64_t channels_;
  torch::nn::Conv2d conv1_, conv2_;
  torch::nn::Linear fc1_, fc2_, fc3_;
};

}  // namespace

ModelPtr make_mlp(const ModelConfig& config) {
  check_config(config, "mlp");
  return std::make_shared<Mlp>(config);
}

ModelPtr make_lenet(const ModelConfig& config) {
  check_config(config, "lenet");
  return std::make_shared<LeNet>(config);
}

}  // namespace train::models
