// One ResNet training step, timed: forward + backward + SGD step on a fixed synthetic batch
// already on the device. The C++ side of benchmarks/compare_resnet.py; resnet_step.py is the
// same loop in Python PyTorch eager.
//
//   bench_resnet_step --depth 18|34|50 --batch 256 --steps 60 --warmup 15 --window 5 --device cuda
//                     --precision bf16|fp32 --channels-last 0|1 --image 224
//                     --optim-impl auto|fused|foreach|loop [--serve 0|1]
// SGD (lr 0.1, momentum 0.9, weight decay 5e-5 on tensors of 2+ dimensions) from train's
// make_optimizer with optim.impl = --optim-impl (auto: the fused kernel where LibTorch has one for
// the device, else foreach). Prints one JSON line: {"impl":"cpp", "optimizer": "sgd fused" (what
// ran), "params": parameter count, "img_per_s": median over windows, "min", "max", ...}; exit 2
// with a message on a bad argument. --serve 1: set up once, then warm up, time and print a line for
// each "run" read from standard input (step_timing.h's run_or_serve).
#include <train/amp.h>
#include <train/config.h>
#include <train/host_memory.h>
#include <train/models/model.h>
#include <train/optim.h>

#include <torch/torch.h>

#include "step_timing.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <stdexcept>
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
  std::string optim_impl = "auto";
  bool serve = false;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "bench_resnet_step: " << message << "\n";
  std::exit(2);
}

// A whole decimal integer, or a usage error naming the flag.
int64_t integer(const std::string& flag, const std::string& v) {
  size_t used = 0;
  int64_t out = 0;
  try {
    out = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size()) usage_error(flag + " needs an integer, got '" + v + "'");
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage_error("missing value for " + k);
    const std::string v = argv[i + 1];
    if (k == "--depth") a.depth = static_cast<int>(integer(k, v));
    else if (k == "--batch") a.batch = integer(k, v);
    else if (k == "--steps") a.steps = static_cast<int>(integer(k, v));
    else if (k == "--warmup") a.warmup = static_cast<int>(integer(k, v));
    else if (k == "--window") a.window = static_cast<int>(integer(k, v));
    else if (k == "--image") a.image = integer(k, v);
    else if (k == "--device") a.device = v;
    else if (k == "--precision") a.precision = v;
    else if (k == "--channels-last") {
      if (v != "0" && v != "1") usage_error("--channels-last is 0 or 1, got " + v);
      a.channels_last = v == "1";
    } else if (k == "--optim-impl") a.optim_impl = v;
    else if (k == "--serve") {
      if (v != "0" && v != "1") usage_error("--serve is 0 or 1, got " + v);
      a.serve = v == "1";
    }
    else usage_error("unknown argument " + k);
  }
  if (a.depth != 18 && a.depth != 34 && a.depth != 50) usage_error("--depth is 18, 34 or 50");
  if (a.precision != "bf16" && a.precision != "fp32") usage_error("--precision is bf16 or fp32, got " + a.precision);
  if (a.optim_impl != "auto" && a.optim_impl != "fused" && a.optim_impl != "foreach" && a.optim_impl != "loop") {
    usage_error("--optim-impl is auto, fused, foreach or loop, got " + a.optim_impl);
  }
  if (a.batch < 1 || a.image < 1 || a.steps < 1 || a.window < 1 || a.warmup < 0) {
    usage_error("--batch, --image, --steps and --window must be >= 1, --warmup >= 0");
  }
  return a;
}

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  train::tune_host_malloc();  // as the train command does (TRAIN_HOST_MALLOC=default: glibc as it is)
  const Args a = parse(argc, argv);
  const torch::Device device = [&] {
    try {
      return torch::Device(a.device);
    } catch (const std::exception&) {
      usage_error("--device: not a device: " + a.device);
    }
  }();
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
  oc.impl = a.optim_impl;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  try {
    optimizer = train::make_optimizer(oc, *model, 0.1);
  } catch (const std::exception& e) {  // "fused" where this LibTorch has no kernel for the device
    usage_error(std::string("--optim-impl ") + a.optim_impl + ": " + e.what());
  }
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();

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
  return bench::run_or_serve(a.serve, [&] {
    const bench::Rates rates =
        bench::time_windows(step, [&] { sync(device); }, a.warmup, a.steps, a.window, a.batch);
    std::cout << "{\"impl\":\"cpp\",\"pid\":" << getpid() << ",\"depth\":" << a.depth << ",\"batch\":" << a.batch << ",\"image\":" << a.image
              << ",\"precision\":\"" << a.precision << "\",\"channels_last\":" << (a.channels_last ? "true" : "false")
              << ",\"optimizer\":\"" << train::optimizer_impl(*optimizer) << "\",\"params\":" << params
              << ",\"steps\":" << a.steps << ",\"windows\":" << rates.sorted.size() << ",\"img_per_s\":" << rates.median()
              << ",\"min\":" << rates.min() << ",\"max\":" << rates.max() << "}" << std::endl;
  });
}
