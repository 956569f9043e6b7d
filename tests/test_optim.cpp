#include "testing.h"

#include <torch/version.h>
#include <train/amp.h>
#include <train/checkpoint.h>
#include <train/config.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/optim.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

using namespace train;

namespace {

// LibTorch 2.4 added CPU kernels for _fused_adamw_ and _fused_sgd_.
constexpr bool kCpuFused = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);

// Weights of several shapes (the weight-decay group) and a bias (the group without weight
// decay). `late` gets no gradient in the first step, like a parameter that joins training later.
struct Net : torch::nn::Module {
  Net() {
    torch::manual_seed(0);  // every Net starts from the same values
    conv = register_parameter("conv", torch::randn({4, 3, 3, 3}));
    weight = register_parameter("weight", torch::randn({5, 7}));
    late = register_parameter("late", torch::randn({6, 2}));
    bias = register_parameter("bias", torch::randn({5}));
  }
  torch::Tensor conv, weight, late, bias;
};

// The same pseudo-random gradients and learning rate for step `step` in every run.
void run_steps(torch::optim::Optimizer& optimizer, Net& net, int from, int to) {
  for (int step = from; step < to; ++step) {
    torch::manual_seed(1000 + step);
    for (auto& p : net.parameters()) p.mutable_grad() = torch::randn_like(p);
    if (step == 0) net.late.mutable_grad() = torch::Tensor();
    set_learning_rate(optimizer, 0.1 / (1 + step));  // changes every step, as a schedule does
    optimizer.step();
  }
}

// On CUDA the fused kernels contract multiplies and adds (FMA) where the per-tensor loop rounds
// each op: a few ulp per step.
void check_same_parameters(Net& expected, Net& actual) {
  const double tolerance = expected.conv.is_cuda() ? 1e-5 : 1e-6;
  const auto actual_params = actual.named_parameters();
  for (const auto& item : expected.named_parameters()) {
    INFO("parameter " << item.key() << ", largest difference "
                      << (item.value() - actual_params[item.key()]).abs().max().item<double>());
    CHECK(torch::allclose(item.value(), actual_params[item.key()], tolerance, tolerance));
  }
}

void check_all_moved(Net& trained) {
  Net initial;
  const auto initial_params = initial.named_parameters();
  for (const auto& item : trained.named_parameters()) {
    INFO("parameter " << item.key());
    CHECK((item.value().cpu() - initial_params[item.key()]).abs().max().item<double>() > 1e-2);
  }
}

std::vector<std::string> impls_to_compare() {
  if (kCpuFused) return {"foreach", "fused"};
  return {"foreach"};
}

// Runs 5 steps with every implementation in `impls` and compares them with torch::optim's loop,
// all on `device`.
void check_impls_agree(OptimConfig config, const torch::Device& device = torch::kCPU,
                       const std::vector<std::string>& impls = impls_to_compare()) {
  Net reference;
  reference.to(device);
  config.impl = "loop";
  const auto loop = make_optimizer(config, reference, 0.1);
  CHECK(optimizer_impl(*loop) == config.name + " loop");
  run_steps(*loop, reference, 0, 5);
  check_all_moved(reference);
  for (const auto& impl : impls) {
    INFO("optim.impl " << impl << " on " << device);
    Net net;
    net.to(device);
    config.impl = impl;
    const auto optimizer = make_optimizer(config, net, 0.1);
    CHECK(optimizer_impl(*optimizer) == config.name + " " + impl);
    CHECK(optimizer->param_groups().size() == (config.decay_norm_and_bias ? 1u : 2u));
    run_steps(*optimizer, net, 0, 5);
    check_same_parameters(reference, net);
  }
}

std::string save(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void load(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  optimizer.load(archive);
}

}  // namespace

TEST_CASE("optim: SGD foreach and fused match torch::optim::SGD", "[optim]") {
  OptimConfig config;
  config.name = "sgd";
  config.weight_decay = 0.05;  // the bias group has none: two groups that differ
  SECTION("momentum") {
    config.momentum = 0.9;
    check_impls_agree(config);
  }
  SECTION("nesterov momentum") {
    config.momentum = 0.8;
    config.nesterov = true;
    check_impls_agree(config);
  }
  SECTION("no momentum") {
    config.momentum = 0.0;
    check_impls_agree(config);
  }
  SECTION("no weight decay") {
    config.weight_decay = 0.0;
    check_impls_agree(config);
  }
}

TEST_CASE("optim: AdamW foreach and fused match torch::optim::AdamW", "[optim]") {
  OptimConfig config;
  config.name = "adamw";
  config.beta1 = 0.85;
  config.beta2 = 0.99;
  config.eps = 1e-6;
  SECTION("weight decay in one group") {
    config.weight_decay = 0.05;
    check_impls_agree(config);
  }
  SECTION("weight decay on every parameter: one group") {
    config.weight_decay = 0.1;
    config.decay_norm_and_bias = true;
    check_impls_agree(config);
  }
}

TEST_CASE("cuda: SGD and AdamW foreach and fused match torch::optim on the GPU, also channels_last", "[cuda][optim]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: the GPU optimizer kernels are checked by scripts/gpu-check on a GPU machine");
  const torch::Device cuda("cuda:0");
  // LibTorch 2.0 has the CUDA _fused_adamw_, 2.3 the CUDA _fused_sgd_.
  for (const std::string name : {"sgd", "adamw"}) {
    OptimConfig config;
    config.name = name;
    config.momentum = 0.9;
    config.weight_decay = 0.05;
    const bool has_fused = name == "sgd" ? (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3))
                                         : TORCH_VERSION_MAJOR >= 2;
    std::vector<std::string> impls = {"foreach"};
    if (has_fused) impls.push_back("fused");
    INFO(name);
    check_impls_agree(config, cuda, impls);
    Net net;
    net.to(cuda);
    CHECK(optimizer_impl(*make_optimizer(config, net, 0.1)) == name + (has_fused ? " fused" : " foreach"));
    // channels_last 4-D weights: the multi-tensor kernels take one layout per tensor list.
    Net reference, last;
    for (Net* n : {&reference, &last}) {
      n->to(cuda);
      to_channels_last(*n);
    }
    config.impl = "loop";
    const auto loop = make_optimizer(config, reference, 0.1);
    run_steps(*loop, reference, 0, 5);
    config.impl = "auto";
    const auto fast = make_optimizer(config, last, 0.1);
    run_steps(*fast, last, 0, 5);
    check_same_parameters(reference, last);
    CHECK_FALSE(last.conv.is_contiguous());
  }
}

namespace {

// The fused SGD of a captured CUDA graph's step (train::detail::set_device_step_controls): the LR from a
// device tensor, the update skipped on the device, against the same SGD with the LR on the host.
void check_device_step_controls(const torch::Device& device, const std::string& name) {
  INFO(name << " on " << device);
  OptimConfig config;
  config.name = name;
  config.momentum = 0.9;
  config.weight_decay = 0.05;
  config.impl = "fused";
  Net reference, net;
  reference.to(device);
  net.to(device);
  const auto host = make_optimizer(config, reference, 0.1);
  const auto controlled = make_optimizer(config, net, 0.1);
  const auto f32 = torch::TensorOptions().device(device).dtype(torch::kFloat);
  auto lr = torch::zeros({}, f32);
  auto skip = torch::zeros({}, f32);
  REQUIRE(train::detail::set_device_step_controls(*controlled, lr, skip));
  auto grads_for = [](int step, Net& n) {
    torch::manual_seed(1000 + step);
    for (auto& p : n.parameters()) p.mutable_grad() = torch::randn_like(p);
  };
  for (int step = 0; step < 4; ++step) {  // the first step fills the momentum buffers
    const double rate = 0.25 / (1 + step);  // exact in float: the two sides get the same LR
    grads_for(step, reference);
    set_learning_rate(*host, rate);
    host->step();
    grads_for(step, net);
    lr.fill_(rate);
    set_learning_rate(*controlled, 100.0);  // not what the step reads
    controlled->step();
    check_same_parameters(reference, net);
  }
  // AdamW counts its steps on the device; what it saves has caught up with them.
  auto step_counts = [&](torch::optim::Optimizer& optimizer) {
    Net fresh;
    fresh.to(device);
    const auto loaded = make_optimizer(config, fresh, 0.1);
    load(*loaded, save(optimizer));
    std::vector<int64_t> counts;
    for (const auto& entry : loaded->state()) {
      if (name == "adamw") counts.push_back(static_cast<const torch::optim::AdamWParamState&>(*entry.second).step());
    }
    return counts;
  };
  CHECK(step_counts(*controlled) == step_counts(*host));
  if (name == "adamw") CHECK(step_counts(*controlled) == std::vector<int64_t>(4, 4));
  // A skipped step changes neither the parameters nor the optimizer's state (step counts included).
  std::vector<torch::Tensor> before;
  for (const auto& p : net.parameters()) before.push_back(p.detach().clone());
  const std::string state_before = save(*controlled);
  grads_for(9, net);
  skip.fill_(1.0);
  lr.fill_(0.5);
  controlled->step();
  const auto after = net.parameters();
  for (size_t i = 0; i < before.size(); ++i) CHECK(torch::equal(before[i], after[i]));
  CHECK(save(*controlled) == state_before);
  CHECK(step_counts(*controlled) == step_counts(*host));
  // Released: the host-side LR again.
  REQUIRE(train::detail::set_device_step_controls(*controlled, torch::Tensor(), torch::Tensor()));
  grads_for(4, reference);
  set_learning_rate(*host, 0.125);
  host->step();
  grads_for(4, net);
  set_learning_rate(*controlled, 0.125);
  controlled->step();
  check_same_parameters(reference, net);
}

}  // namespace

TEST_CASE("optim: fused SGD and AdamW take their LR from a tensor and skip on the device as a captured step needs",
          "[optim]") {
  Net net;
  OptimConfig config;
  config.name = "sgd";
  config.impl = "foreach";
  const auto foreach_sgd = make_optimizer(config, net, 0.1);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  CHECK_FALSE(train::detail::set_device_step_controls(*foreach_sgd, torch::zeros({}, f32), torch::zeros({}, f32)));
  config.name = "adamw";
  const auto adamw = make_optimizer(config, net, 0.1);
  CHECK_FALSE(train::detail::set_device_step_controls(*adamw, torch::zeros({}, f32), torch::zeros({}, f32)));
  config.impl = "loop";
  const auto loop = make_optimizer(config, net, 0.1);
  CHECK_FALSE(train::detail::set_device_step_controls(*loop, torch::zeros({}, f32), torch::zeros({}, f32)));
  if (!kCpuFused) {
    SUCCEED("LibTorch " TORCH_VERSION " has no CPU _fused_sgd_; the GPU twin of this test covers it");
    return;
  }
  config.name = "sgd";
  config.impl = "fused";
  const auto fused = make_optimizer(config, net, 0.1);
  CHECK_THROWS_AS(train::detail::set_device_step_controls(*fused, torch::zeros({1}, f32), torch::zeros({}, f32)),
                  std::invalid_argument);
  CHECK_THROWS_AS(train::detail::set_device_step_controls(*fused, torch::zeros({}, torch::kDouble), torch::zeros({}, f32)),
                  std::invalid_argument);
  CHECK_THROWS_AS(train::detail::set_device_step_controls(*fused, torch::zeros({}, f32), torch::Tensor()),
                  std::invalid_argument);
  check_device_step_controls(torch::kCPU, "sgd");
  check_device_step_controls(torch::kCPU, "adamw");
}

TEST_CASE("cuda: fused SGD and AdamW with their LR and skip flag on the GPU match the host-side LR", "[cuda][optim]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: checked by scripts/gpu-check on a GPU machine");
  check_device_step_controls(torch::Device("cuda:0"), "sgd");
  const bool device_adamw = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);
  if (device_adamw) check_device_step_controls(torch::Device("cuda:0"), "adamw");
}

TEST_CASE("clip_grad_norm: global L2 norm, scaled down only above the limit", "[optim]") {
  torch::nn::Linear linear(2, 1);
  linear->weight.mutable_grad() = torch::tensor({{3.0, 0.0}});
  linear->bias.mutable_grad() = torch::tensor({4.0});
  CHECK(clip_grad_norm(*linear, 10.0) == Approx(5.0));  // below the limit: unchanged
  CHECK(linear->bias.grad().item<double>() == Approx(4.0));
  CHECK(clip_grad_norm(*linear, 1.0) == Approx(5.0));   // returns the norm before clipping
  CHECK(linear->weight.grad()[0][0].item<double>() == Approx(0.6).epsilon(1e-5));
  CHECK(linear->bias.grad().item<double>() == Approx(0.8).epsilon(1e-5));
}

TEST_CASE("clip_grad_norm_on_device: the same clipping with the norm left on the device", "[optim]") {
  torch::nn::Linear linear(2, 1);
  auto set = [&](double w, double b) {
    linear->weight.mutable_grad() = torch::tensor({{w, 0.0}}, torch::kFloat);
    linear->bias.mutable_grad() = torch::tensor({b}, torch::kFloat);
  };
  set(3.0, 4.0);
  torch::Tensor norm = clip_grad_norm_on_device(*linear, 10.0);  // below the limit: unchanged
  CHECK(norm.dim() == 0);
  CHECK(norm.scalar_type() == torch::kFloat);
  CHECK(norm.item<double>() == Approx(5.0));
  CHECK(linear->weight.grad()[0][0].item<double>() == 3.0);
  CHECK(linear->bias.grad().item<double>() == 4.0);
  CHECK(clip_grad_norm_on_device(*linear, 1.0).item<double>() == Approx(5.0));
  CHECK(linear->weight.grad()[0][0].item<double>() == Approx(0.6).epsilon(1e-5));
  CHECK(linear->bias.grad().item<double>() == Approx(0.8).epsilon(1e-5));
  // A non-finite gradient gives a non-finite norm (the step that reads it skips its update).
  set(std::numeric_limits<double>::infinity(), 4.0);
  CHECK_FALSE(std::isfinite(clip_grad_norm_on_device(*linear, 1.0).item<double>()));
  set(std::nan(""), 4.0);
  CHECK_FALSE(std::isfinite(clip_grad_norm_on_device(*linear, 1.0).item<double>()));
  // The same result as the host-side clip on a whole model, mixed dtypes included.
  Net a, b;
  for (Net* n : {&a, &b}) {
    torch::manual_seed(7);
    for (auto& p : n->parameters()) p.mutable_grad() = torch::randn_like(p);
    n->bias.mutable_grad() = n->bias.grad().to(torch::kBFloat16);
  }
  const double host = clip_grad_norm(a, 2.0);
  CHECK(clip_grad_norm_on_device(b, 2.0).item<double>() == Approx(host).epsilon(1e-6));
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  for (const auto& item : pa) {
    INFO(item.key());
    // The factor in fp32 on the device, in double on the host: bf16 may round the other way (1 ulp).
    const double tolerance = item.value().grad().scalar_type() == torch::kBFloat16 ? 1e-2 : 1e-6;
    CHECK(torch::allclose(item.value().grad().to(torch::kFloat), pb[item.key()].grad().to(torch::kFloat), tolerance,
                          tolerance));
  }
}

namespace {

// Gradients of three dtypes (one list each for the multi-tensor kernels), a parameter without a
// gradient, and a 4-D channels_last one, on `device`.
struct ClipNet : torch::nn::Module {
  explicit ClipNet(const torch::Device& device) {
    torch::manual_seed(3);
    const auto on = torch::TensorOptions().device(device);
    auto add = [&](const std::string& name, torch::Tensor value) {
      auto p = register_parameter(name, value.to(on));
      p.mutable_grad() = torch::randn_like(p) * 3;  // same dtype and layout
    };
    add("a", torch::randn({7, 5}));
    add("b", torch::randn({3}));
    add("half", torch::randn({4, 4}).to(torch::kBFloat16));
    add("wide", torch::randn({2, 3}, torch::kDouble));
    add("conv", torch::randn({4, 3, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast));
    register_parameter("frozen", torch::randn({2}).to(on));  // no gradient: not counted
  }
};

void check_clip_matches_reference(const torch::Device& device) {
  for (const double max_norm : {1e9, 2.0}) {
    ClipNet net(device);
    std::vector<torch::Tensor> before;
    double square = 0;
    for (const auto& p : net.parameters()) {
      if (!p.grad().defined()) continue;
      before.push_back(p.grad().to(torch::kCPU, torch::kDouble).clone());  // not the gradient itself (fp64)
      square += before.back().pow(2).sum().item<double>();
    }
    const double reference = std::sqrt(square);
    INFO("max_norm " << max_norm << " on " << device);
    CHECK(clip_grad_norm(net, max_norm) == Approx(reference).epsilon(1e-5));
    const double scale = reference > max_norm ? max_norm / (reference + 1e-6) : 1.0;
    size_t i = 0;
    for (const auto& item : net.named_parameters()) {
      const auto& p = item.value();
      if (!p.grad().defined()) continue;
      INFO(item.key());
      const auto want = before[i++] * scale;
      // bf16 gradients are scaled in bf16: three significant digits.
      const double tolerance = p.grad().scalar_type() == torch::kBFloat16 ? 1e-2 : 1e-5;
      CHECK(torch::allclose(p.grad().to(torch::kCPU, torch::kDouble), want, tolerance, tolerance));
      CHECK(p.grad().device() == device);
    }
    CHECK(net.named_parameters()["conv"].grad().is_contiguous(at::MemoryFormat::ChannelsLast));
  }
}

}  // namespace

TEST_CASE("clip_grad_norm: fp32, bf16 and fp64 gradients together give the norm of all of them", "[optim]") {
  check_clip_matches_reference(torch::kCPU);
}

TEST_CASE("cuda: clip_grad_norm with the multi-tensor kernels matches the reference on the GPU", "[cuda][optim]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: checked by scripts/gpu-check on a GPU machine");
  check_clip_matches_reference(torch::Device("cuda:0"));
}

TEST_CASE("optim: auto picks fused where LibTorch has the kernel, else foreach", "[optim]") {
  for (const std::string name : {"sgd", "adamw"}) {
    OptimConfig config;
    config.name = name;
    Net net;
    CHECK(optimizer_impl(*make_optimizer(config, net, 0.1)) == name + (kCpuFused ? " fused" : " foreach"));
  }
}

TEST_CASE("optim: state saved by one implementation continues in another", "[optim]") {
  std::vector<std::pair<std::string, std::string>> handovers = {{"foreach", "loop"}, {"loop", "foreach"}};
  if (kCpuFused) {
    handovers.insert(handovers.end(), {{"fused", "loop"}, {"loop", "fused"}, {"foreach", "fused"}});
  }
  for (const std::string name : {"sgd", "adamw"}) {
    OptimConfig config;
    config.name = name;
    config.weight_decay = 0.01;
    Net uninterrupted;
    config.impl = "loop";
    const auto reference = make_optimizer(config, uninterrupted, 0.1);
    run_steps(*reference, uninterrupted, 0, 5);

    for (const auto& [from, to] : handovers) {
      INFO(name << ": saved by " << from << ", loaded by " << to);
      Net before;
      config.impl = from;
      const auto first = make_optimizer(config, before, 0.1);
      run_steps(*first, before, 0, 3);
      const std::string bytes = save(*first);

      Net after;
      {
        torch::NoGradGuard no_grad;
        const auto saved_params = before.named_parameters();
        for (auto& item : after.named_parameters()) item.value().copy_(saved_params[item.key()]);
      }
      config.impl = to;
      const auto second = make_optimizer(config, after, 0.1);
      load(*second, bytes);
      CHECK(second->state().size() == first->state().size());
      run_steps(*second, after, 3, 5);
      check_same_parameters(uninterrupted, after);
    }
  }
}

// Optimizer::state()'s key for a parameter: the TensorImpl address, as text on LibTorch 1.13.
void state_key(void* impl, void*& key) { key = impl; }
void state_key(void* impl, std::string& key) {
  std::ostringstream text;
  text << impl;
  key = text.str();
}
auto compat_key(const torch::Tensor& param) {
  std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type key;
  state_key(param.unsafeGetTensorImpl(), key);
  return key;
}

// Every state tensor (momentum, Adam moments) on its parameter's device with its strides.
void check_state_like_params(torch::optim::Optimizer& optimizer, Net& net) {
  std::vector<torch::Tensor> states;
  for (const auto& p : net.parameters()) {
    const auto it = optimizer.state().find(compat_key(p));
    if (it == optimizer.state().end()) continue;
    if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      states = {s->momentum_buffer()};
    } else if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      states = {a->exp_avg(), a->exp_avg_sq()};
    }
    for (const auto& t : states) {
      INFO("parameter of shape " << p.sizes() << ": state strides " << t.strides() << ", parameter " << p.strides());
      CHECK(t.device() == p.device());
      CHECK(t.strides() == p.strides());
    }
  }
}

TEST_CASE("optim: a checkpoint's optimizer state takes its parameter's layout and device on load", "[optim]") {
  const std::string dir = files::make_temp_directory("train_optim_layout_");
  const torch::Device device = torch::cuda::is_available() ? torch::Device("cuda:0") : torch::Device(torch::kCPU);
  for (const std::string name : {"sgd", "adamw"}) {
    INFO(name << " on " << device);
    OptimConfig config;
    config.name = name;
    config.momentum = 0.9;
    auto prepare = [&](Net& net) {
      net.to(device);
      to_channels_last(net);  // the 4-D weight's strides are no longer contiguous ones
    };
    Net uninterrupted;
    prepare(uninterrupted);
    REQUIRE_FALSE(uninterrupted.conv.is_contiguous());
    const auto reference = make_optimizer(config, uninterrupted, 0.1);
    run_steps(*reference, uninterrupted, 0, 5);

    Net before;
    prepare(before);
    const auto first = make_optimizer(config, before, 0.1);
    run_steps(*first, before, 0, 3);
    const std::string path = files::join(dir, name + ".pt");
    save_checkpoint(path, before, first.get(), TrainState{});

    Net after;
    prepare(after);
    const auto second = make_optimizer(config, after, 0.1);
    load_checkpoint(path, after, second.get());  // archives are read onto the CPU, contiguous
    check_state_like_params(*second, after);
    run_steps(*second, after, 3, 5);
    check_same_parameters(uninterrupted, after);
  }
  files::remove_all(dir);
}

TEST_CASE("checkpoint: counters outside their range and non-dense or complex weights are refused naming the file",
          "[optim][checkpoint]") {
  // Structurally valid files with values train never writes: a negative step gave a negative
  // learning rate, a huge loader position overflowed, a sparse weight escaped as a LibTorch error.
  const std::string dir = files::make_temp_directory("train_checkpoint_ranges_");
  Net net;
  const std::string path = files::join(dir, "c.pt");
  for (const auto& [field, value] : std::vector<std::pair<std::string, int64_t>>{
           {"step", -3}, {"epoch", -1}, {"batch_in_epoch", int64_t{1} << 62}, {"samples_seen", -8}}) {
    INFO(field << " = " << value);
    TrainState state;
    if (field == "step") state.step = value;
    if (field == "epoch") state.epoch = value;
    if (field == "batch_in_epoch") state.batch_in_epoch = value;
    if (field == "samples_seen") state.samples_seen = value;
    save_checkpoint(path, net, nullptr, state);
    Net into;
    CHECK_THROWS_WITH(load_checkpoint(path, into, nullptr),
                      Catch::Contains(path + ": '" + field + "' is " + std::to_string(value) + ", outside 0.."));
  }
  TrainState fine;
  fine.step = 12;
  save_checkpoint(path, net, nullptr, fine);
  Net into;
  CHECK(load_checkpoint(path, into, nullptr).step == 12);

  // A complex tensor where the model has a real one (copy_ kept the real part with a warning).
  Net complex_net;
  {
    torch::NoGradGuard no_grad;
    auto& conv = complex_net.conv;
    conv.set_data(torch::complex(conv.detach(), torch::zeros_like(conv)));
  }
  save_checkpoint(path, complex_net, nullptr, fine);
  CHECK_THROWS_WITH(load_checkpoint(path, into, nullptr), Catch::Contains(path + ": model entry '") &&
                                                              Catch::Contains("tensor, the model expects Float"));
  files::remove_all(dir);
}

TEST_CASE("checkpoint: optimizer state from another optimizer names the one that wrote it", "[optim][checkpoint]") {
  const std::string dir = files::make_temp_directory("train_checkpoint_other_optim_");
  const Config written = parse_config("model: {name: m}\ndata: {kind: synthetic}\noptim: {name: adamw, impl: loop}\n"
                                      "trainer: {global_batch: 1, epochs: 1}\n", "run.yaml");
  Net net;
  const auto adamw = make_optimizer(written.optim, net, 0.1);
  run_steps(*adamw, net, 0, 2);
  TrainState state;
  state.config_yaml = to_yaml(written);
  const std::string path = files::join(dir, "adamw.pt");
  save_checkpoint(path, net, adamw.get(), state);
  OptimConfig sgd_config;
  sgd_config.name = "sgd";
  sgd_config.momentum = 0.9;
  sgd_config.impl = "loop";
  Net into;
  const auto sgd = make_optimizer(sgd_config, into, 0.1);
  CHECK_THROWS_WITH(load_checkpoint(path, into, sgd.get()),
                    Catch::Contains(path + ": optimizer state does not match this optimizer (it was written with "
                                           "optim.name adamw, optim.impl loop, optim.decay_norm_and_bias false;"));
  files::remove_all(dir);
}

TEST_CASE("optim: a checkpoint restores the optimizer's state, the config its hyperparameters", "[optim]") {
  // LibTorch's Optimizer::load also restores each group's options; a resume with another
  // weight decay, momentum or betas must run with the config's, as the run directory records.
  const std::string dir = files::make_temp_directory("train_optim_options_");
  for (const std::string name : {"sgd", "adamw"}) {
    INFO(name);
    OptimConfig before_config;
    before_config.name = name;
    before_config.weight_decay = 0.1;
    before_config.momentum = 0.9;
    Net before;
    const auto first = make_optimizer(before_config, before, 0.1);
    run_steps(*first, before, 0, 3);
    const std::string path = files::join(dir, name + ".pt");
    save_checkpoint(path, before, first.get(), TrainState{});

    OptimConfig now = before_config;
    now.weight_decay = 0.5;
    now.momentum = 0.5;
    now.nesterov = true;
    now.beta1 = 0.8;
    now.beta2 = 0.99;
    now.eps = 1e-6;
    Net after;
    const auto second = make_optimizer(now, after, 0.1);
    load_checkpoint(path, after, second.get());
    CHECK(second->state().size() == first->state().size());  // the moments did come back
    const auto& groups = second->param_groups();
    REQUIRE(groups.size() == 2);
    if (name == "sgd") {
      const auto& decay = static_cast<const torch::optim::SGDOptions&>(groups[0].options());
      const auto& no_decay = static_cast<const torch::optim::SGDOptions&>(groups[1].options());
      CHECK(decay.weight_decay() == 0.5);
      CHECK(no_decay.weight_decay() == 0.0);
      CHECK(decay.momentum() == 0.5);
      CHECK(decay.nesterov());
    } else {
      const auto& decay = static_cast<const torch::optim::AdamWOptions&>(groups[0].options());
      CHECK(decay.weight_decay() == 0.5);
      CHECK(std::get<0>(decay.betas()) == 0.8);
      CHECK(std::get<1>(decay.betas()) == 0.99);
      CHECK(decay.eps() == 1e-6);
      CHECK(static_cast<const torch::optim::AdamWOptions&>(groups[1].options()).weight_decay() == 0.0);
    }
    // And the steps after the load are those of an optimizer built with the new settings that
    // was handed the same state.
    Net reference;
    {
      torch::NoGradGuard no_grad;
      const auto saved = before.named_parameters();
      for (auto& item : reference.named_parameters()) item.value().copy_(saved[item.key()]);
    }
    const auto fresh = make_optimizer(now, reference, 0.1);
    load(*fresh, save(*first));
    for (size_t i = 0; i < fresh->param_groups().size(); ++i) {
      fresh->param_groups()[i].set_options(second->param_groups()[i].options().clone());
    }
    run_steps(*second, after, 3, 5);
    run_steps(*fresh, reference, 3, 5);
    check_same_parameters(reference, after);
  }
  files::remove_all(dir);
}

TEST_CASE("optim: impl fused without a LibTorch kernel for the device is a ConfigError", "[optim]") {
  OptimConfig config;
  config.impl = "fused";
  // Since 2.4 the CPU has the kernels; meta tensors never do.
  const auto device = kCpuFused ? torch::kMeta : torch::kCPU;
  torch::nn::Module net;
  net.register_parameter("weight", torch::empty({3, 2}, device));
  for (const std::string name : {"sgd", "adamw"}) {
    INFO(name);
    config.name = name;
    try {
      make_optimizer(config, net, 0.1);
      FAIL("expected a ConfigError");
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      CHECK_THAT(what, Catch::Contains("optim.impl") && Catch::Contains(TORCH_VERSION) &&
                           Catch::Contains(kCpuFused ? "meta" : "cpu"));
    }
  }
}
