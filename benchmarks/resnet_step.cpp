// One ResNet training step, timed: forward + backward + SGD step on a fixed synthetic batch
// already on the device. The C++ side of benchmarks/compare_resnet.py; resnet_step.py is the
// same loop in Python PyTorch eager.
//
//   bench_resnet_step --depth 50 --batch 256 --steps 60 --warmup 15 --device cuda
//                     --precision bf16|fp32 --channels-last 0|1 --image 224
// Prints one JSON line: {"impl":"cpp", "img_per_s": median over windows, ...}.
#include <train/amp.h>
#include <train/config.h>
#include <train/models/model.h>
#include <train/optim.h>

#include <torch/torch.h>

#include "step_timing.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Args {
  int depth = 50;
  int64_t batch = 256;
  int steps = 60;
  int warmup = 15;
  int window = 5;
  int64_t image = 224;
  std::string device = "cuda";
  std::string precision = "bf16";
  bool channels_last = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--depth") a.depth = std::stoi(v);
    else if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else if (k == "--window") a.window = std::stoi(v);
    else if (k == "--image") a.image = std::stoll(v);
    else if (k == "--device") a.device = v;
    else if (k == "--precision") a.precision = v;
    else if (k == "--channels-last") a.channels_last = v == "1";
    else {
      std::cerr << "unknown argument " << k << "\n";
      std::exit(2);
    }
  }
  return a;
}

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const torch::Device device(a.device);
  if (device.is_cuda()) at::globalContext().setBenchmarkCuDNN(true);
  at::globalContext().setAllowTF32CuBLAS(true);
  at::globalContext().setAllowTF32CuDNN(true);

  train::ModelConfig mc;
  mc.name = "resnet" + std::to_string(a.depth);
  mc.num_classes = 1000;
  torch::manual_seed(0);
  auto model = train::models::make_model(mc);
  model->to(device);
  if (a.channels_last) train::to_channels_last(*model);
  train::OptimConfig oc;
  oc.name = "sgd";
  oc.momentum = 0.9;
  oc.weight_decay = 5e-5;
  auto optimizer = train::make_optimizer(oc, *model, 0.1);

  auto x = torch::randn({a.batch, 3, a.image, a.image}, torch::TensorOptions().device(device));
  if (a.channels_last) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
  const auto y = torch::randint(0, 1000, {a.batch}, torch::TensorOptions().dtype(torch::kLong).device(device));
  const bool bf16 = a.precision == "bf16";

  auto step = [&] {
    optimizer->zero_grad();
    torch::Tensor loss;
    {
      train::AutocastScope amp(device.type(), torch::kBFloat16, bf16);
      loss = torch::nn::functional::cross_entropy(model->forward(x).to(torch::kFloat), y);
    }
    loss.backward();
    optimizer->step();
  };
  const bench::Rates rates =
      bench::time_windows(step, [&] { sync(device); }, a.warmup, a.steps, a.window, a.batch);
  std::cout << "{\"impl\":\"cpp\",\"depth\":" << a.depth << ",\"batch\":" << a.batch << ",\"image\":" << a.image
            << ",\"precision\":\"" << a.precision << "\",\"channels_last\":" << (a.channels_last ? "true" : "false")
            << ",\"windows\":" << rates.sorted.size() << ",\"img_per_s\":" << rates.median() << ",\"min\":" << rates.min()
            << ",\"max\":" << rates.max() << "}" << std::endl;
  return 0;
}
