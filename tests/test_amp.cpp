#include "testing.h"

#include <train/amp.h>

using namespace train;

TEST_CASE("autocast: CPU bf16 scope, nesting and restore", "[amp]") {
  torch::nn::Linear linear(8, 4);
  const auto x = torch::randn({2, 8});
  CHECK_FALSE(autocast_enabled(torch::kCPU));
  CHECK(linear->forward(x).scalar_type() == torch::kFloat);
  {
    AutocastScope outer(torch::kCPU, torch::kBFloat16);
    CHECK(autocast_enabled(torch::kCPU));
    CHECK(linear->forward(x).scalar_type() == torch::kBFloat16);
    {
      AutocastScope disabled(torch::kCPU, torch::kBFloat16, /*enabled=*/false);  // no-op
      CHECK(linear->forward(x).scalar_type() == torch::kBFloat16);
      AutocastScope inner(torch::kCPU, torch::kBFloat16);
      CHECK(autocast_enabled(torch::kCPU));
    }
    CHECK(autocast_enabled(torch::kCPU));  // the inner scope restored the outer state
    CHECK(linear->forward(x).scalar_type() == torch::kBFloat16);
  }
  CHECK_FALSE(autocast_enabled(torch::kCPU));
  CHECK(linear->forward(x).scalar_type() == torch::kFloat);
}

TEST_CASE("autocast: gradients flow back to fp32 parameters", "[amp]") {
  torch::nn::Linear linear(8, 4);
  torch::Tensor loss;
  {
    AutocastScope amp(torch::kCPU, torch::kBFloat16);
    loss = linear->forward(torch::randn({2, 8})).to(torch::kFloat).pow(2).sum();
  }
  loss.backward();
  CHECK(linear->weight.grad().scalar_type() == torch::kFloat);
  CHECK(linear->weight.grad().abs().sum().item<double>() > 0);
}

TEST_CASE("channels_last: 4-D parameters change layout, values do not", "[amp]") {
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)), torch::nn::BatchNorm2d(8));
  const auto before = net->parameters()[0].clone();
  to_channels_last(*net);
  const auto w = net->parameters()[0];
  CHECK(w.is_contiguous(torch::MemoryFormat::ChannelsLast));
  CHECK(torch::equal(w, before));
  const auto x = torch::randn({2, 3, 10, 10}).contiguous(torch::MemoryFormat::ChannelsLast);
  CHECK(net->forward(x).sizes() == std::vector<int64_t>{2, 8, 8, 8});
}
