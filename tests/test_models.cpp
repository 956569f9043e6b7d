#include "testing.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "train/config.h"
#include "train/errors.h"
#include "train/models/model.h"
#include "train/models/resnet.h"

using train::ModelConfig;
using namespace train::models;

namespace {

ModelConfig imagenet_config(const std::string& name) {
  ModelConfig config;
  config.name = name;
  config.num_classes = 1000;
  config.in_channels = 3;
  config.width = 1.0;
  return config;
}

}  // namespace

TEST_CASE("ResNet parameter counts match torchvision", "[models]") {
  CHECK(count_parameters(*make_model(imagenet_config("resnet18"))) == 11689512);
  CHECK(count_parameters(*make_model(imagenet_config("resnet34"))) == 21797672);
  CHECK(count_parameters(*make_model(imagenet_config("resnet50"))) == 25557032);
}

TEST_CASE("Small-input ResNet-18 on Fashion-MNIST-sized input", "[models]") {
  ModelConfig config;
  config.name = "resnet18";
  config.num_classes = 10;
  config.in_channels = 1;
  config.width = 0.25;
  config.small_input = true;
  auto model = make_model(config);
  CHECK(model->has_batch_stats());
  CHECK(model->is_convolutional());

  // width 0.25: base 16 channels, so the stem conv is [16, 1, 3, 3] and fc sees 16 * 8.
  const auto params = model->named_parameters();
  CHECK(params["conv1.weight"].sizes() == torch::IntArrayRef({16, 1, 3, 3}));
  CHECK(params["fc.weight"].sizes() == torch::IntArrayRef({10, 128}));

  const auto output = model->forward(torch::randn({2, 1, 28, 28}));
  CHECK(output.sizes() == torch::IntArrayRef({2, 10}));

  // The blocks use in-place ReLU and residual add, as torchvision does; autograd must accept them.
  output.sum().backward();
  const auto parameters = model->parameters();
  CHECK(std::all_of(parameters.begin(), parameters.end(),
                    [](const torch::Tensor& p) { return p.grad().defined(); }));
  CHECK(params["conv1.weight"].grad().abs().sum().item<double>() > 0.0);
}

TEST_CASE("ResNet-50 ImageNet forward", "[models]") {
  torch::NoGradGuard no_grad;
  auto model = make_model(imagenet_config("resnet50"));
  model->eval();
  const auto output = model->forward(torch::randn({1, 3, 224, 224}));
  CHECK(output.sizes() == torch::IntArrayRef({1, 1000}));
  CHECK(torch::isfinite(output).all().item<bool>());
}

TEST_CASE("ResNet state-dict names follow torchvision", "[models]") {
  SECTION("resnet18") {
    auto model = make_model(imagenet_config("resnet18"));
    const auto params = model->named_parameters();
    const auto buffers = model->named_buffers();
    for (const char* name : {"conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight",
                             "layer1.1.bn2.weight", "layer2.0.downsample.0.weight",
                             "layer2.0.downsample.1.bias", "layer4.1.conv2.weight", "fc.weight",
                             "fc.bias"}) {
      CHECK(params.contains(name));
    }
    // Stage 1 keeps stride and width, so torchvision gives it no projection shortcut.
    CHECK_FALSE(params.contains("layer1.0.downsample.0.weight"));
    CHECK_FALSE(params.contains("conv1.bias"));
    for (const char* name : {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked",
                             "layer3.0.downsample.1.running_var"}) {
      CHECK(buffers.contains(name));
    }
    // torchvision's resnet18 state_dict has 122 entries (62 parameters + 60 BN buffers).
    CHECK(params.size() + buffers.size() == 122);
  }
  SECTION("resnet50") {
    auto model = make_model(imagenet_config("resnet50"));
    const auto params = model->named_parameters();
    const auto buffers = model->named_buffers();
    for (const char* name : {"layer1.0.conv3.weight", "layer1.0.bn3.weight",
                             "layer1.0.downsample.0.weight", "layer1.0.downsample.1.weight",
                             "layer3.5.conv2.weight", "fc.weight"}) {
      CHECK(params.contains(name));
    }
    CHECK(buffers.contains("layer4.2.bn3.running_mean"));
    // v1.5: the stride-2 conv of a downsampling bottleneck is the 3x3 (conv2).
    auto* layer2 = model->named_modules()["layer2.0.conv2"]->as<torch::nn::Conv2d>();
    REQUIRE(layer2 != nullptr);
    CHECK(layer2->options.stride()->at(0) == 2);
    // torchvision's resnet50 state_dict has 320 entries (161 parameters + 159 BN buffers).
    CHECK(params.size() + buffers.size() == 320);
  }
}

TEST_CASE("ResNet initialisation", "[models]") {
  torch::manual_seed(0);
  SECTION("convs are Kaiming-normal (fan_out, ReLU), last BN gamma is 1 by default") {
    auto model = make_model(imagenet_config("resnet18"));
    const auto params = model->named_parameters();
    // Stem: fan_out = 64 * 7 * 7, so std = sqrt(2 / 3136); 9408 samples give ~1% noise.
    const double expected = std::sqrt(2.0 / (64 * 7 * 7));
    CHECK(params["conv1.weight"].std().item<double>() == Approx(expected).epsilon(0.05));
    CHECK(params["layer1.0.bn2.weight"].eq(1).all().item<bool>());
    CHECK(params["layer1.0.bn2.bias"].eq(0).all().item<bool>());
  }
  SECTION("zero_init_residual zeroes the last BN gamma of every block") {
    ResNetOptions options = ResNetOptions::for_depth(50);
    options.zero_init_residual = true;
    ResNet model(options);
    const auto params = model.named_parameters();
    CHECK(params["layer1.0.bn3.weight"].eq(0).all().item<bool>());
    CHECK(params["layer4.2.bn3.weight"].eq(0).all().item<bool>());
    CHECK(params["layer1.0.bn2.weight"].eq(1).all().item<bool>());
    CHECK(params["layer1.0.downsample.1.weight"].eq(1).all().item<bool>());
  }
}

TEST_CASE("ResNet width multiplier rounds the base width to a multiple of 8", "[models]") {
  const auto stem_channels = [](double width) {
    ResNetOptions options = ResNetOptions::for_depth(18);
    options.width = width;
    return ResNet(options).named_parameters()["conv1.weight"].size(0);
  };
  CHECK(stem_channels(1.0) == 64);
  CHECK(stem_channels(0.5) == 32);
  CHECK(stem_channels(0.3) == 16);  // 19.2 -> 16
  CHECK(stem_channels(0.01) == 8);  // never below 8
  CHECK(stem_channels(2.0) == 128);

  ResNetOptions bad = ResNetOptions::for_depth(18);
  bad.width = 0.0;
  CHECK_THROWS_AS(ResNet(bad), std::invalid_argument);
  CHECK_THROWS_AS(ResNetOptions::for_depth(101), std::invalid_argument);
}

TEST_CASE("Unknown model name is a ConfigError with a suggestion", "[models]") {
  ModelConfig config;
  config.name = "resnt18";
  try {
    make_model(config);
    FAIL("make_model accepted an unknown name");
  } catch (const train::ConfigError& e) {
    const std::string message = e.what();
    CHECK_THAT(message, Catch::StartsWith("key 'model.name': unknown model 'resnt18'; "
                                          "did you mean 'resnet18'? known: "));
    CHECK_THAT(message, Catch::Contains("resnet18, resnet34, resnet50"));
    CHECK(e.exit_code() == train::kExitInvalid);
  }

  config.name = "transformer";
  CHECK_THROWS_WITH(make_model(config), !Catch::Contains("did you mean") &&
                                            Catch::Contains("unknown model 'transformer'"));
}

namespace {

class TinyLinear : public Model {
 public:
  explicit TinyLinear(const ModelConfig& config)
      : fc_(register_module("fc", torch::nn::Linear(config.in_channels, config.num_classes))) {}
  torch::Tensor forward(const torch::Tensor& input) override { return fc_(input); }

 private:
  torch::nn::Linear fc_;
};

}  // namespace

TEST_CASE("Custom models can be registered", "[models]") {
  const std::string name = "test_models_tiny_linear";
  register_model(
      name, [](const ModelConfig& config) { return std::make_shared<TinyLinear>(config); },
      "a single linear layer (test)");
  CHECK(has_model(name));
  CHECK(has_model("resnet18"));
  CHECK_FALSE(has_model("no_such_model"));
  const auto names = model_names();
  CHECK(std::find(names.begin(), names.end(), name) != names.end());
  CHECK(std::is_sorted(names.begin(), names.end()));

  ModelConfig config;
  config.name = name;
  config.in_channels = 4;
  config.num_classes = 3;
  auto model = make_model(config);
  REQUIRE(std::dynamic_pointer_cast<TinyLinear>(model) != nullptr);
  CHECK(count_parameters(*model) == 4 * 3 + 3);
  CHECK(model->forward(torch::ones({5, 4})).sizes() == torch::IntArrayRef({5, 3}));

  CHECK_THROWS_AS(register_model("", [](const ModelConfig& c) {
                    return std::make_shared<TinyLinear>(c);
                  }, ""),
                  std::invalid_argument);
  CHECK_THROWS_AS(register_model("test_models_null", nullptr, ""), std::invalid_argument);
}
