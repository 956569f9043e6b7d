// Data-parallel ResNet-18 (small-input stem) training steps under torchrun: train's GradSync
// (bucketed allreduce overlapped with backward) on c10d Gloo. The C++ side of
// benchmarks/compare_ddp.py; ddp_step.py is PyTorch's DistributedDataParallel on the same model.
//
//   torchrun --no-python --nproc-per-node 2 build/bin/bench_ddp_step --batch 32 --steps 20
//            [--warmup 3] [--window 2] [--threads 1] [--bucket-mb 25] [--optim-impl auto|fused|foreach|loop]
//
// SGD (lr 0.1, momentum 0.9, weight decay 5e-4 on tensors of 2+ dimensions) from train's
// make_optimizer with optim.impl = --optim-impl (auto: the fused kernel where LibTorch has one,
// else foreach); the JSON reports what ran ("optimizer": "sgd fused") and the parameter count, and
// compare_ddp.py gives ddp_step.py the same implementation.
//
// Each rank trains on its own fixed synthetic batch. Windows of three kinds are interleaved:
//   ddp     full data-parallel steps (what training runs)
//   local   the same steps with no gradient communication (no_sync): compute alone
//   comm    the allreduce of every gradient bucket alone, as after a backward without overlap
// hidden = 1 - (ddp - local) / comm: the share of communication that backward covered.
// Each kind runs exactly `steps` times, in windows of `window` (the last one shorter when `window`
// does not divide `steps`). Rank 0 prints one JSON line with the medians (the mean of the two
// middle windows for an even count, as ddp_step.py). Exit 2 with a message on a bad argument.
#include <train/config.h>
#include <train/ddp.h>
#include <train/dist.h>
#include <train/models/model.h>
#include <train/optim.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Args {
  int64_t batch = 32;  // per rank
  int steps = 20;
  int warmup = 3;
  int window = 2;
  int threads = 1;
  double bucket_mb = 25;
  std::string optim_impl = "auto";
};

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "bench_ddp_step: " << message << "\n";
  std::exit(2);
}

double number(const std::string& flag, const std::string& v, bool integer) {
  size_t used = 0;
  double out = 0;
  try {
    out = integer ? static_cast<double>(std::stoll(v, &used)) : std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size()) {
    usage_error(flag + " needs " + (integer ? "an integer" : "a number") + ", got '" + v + "'");
  }
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage_error("missing value for " + k);
    const std::string v = argv[i + 1];
    if (k == "--batch") a.batch = static_cast<int64_t>(number(k, v, true));
    else if (k == "--steps") a.steps = static_cast<int>(number(k, v, true));
    else if (k == "--warmup") a.warmup = static_cast<int>(number(k, v, true));
    else if (k == "--window") a.window = static_cast<int>(number(k, v, true));
    else if (k == "--threads") a.threads = static_cast<int>(number(k, v, true));
    else if (k == "--bucket-mb") a.bucket_mb = number(k, v, false);
    else if (k == "--optim-impl") a.optim_impl = v;
    else usage_error("unknown argument " + k);
  }
  if (a.batch < 1 || a.steps < 1 || a.window < 1 || a.threads < 1 || a.warmup < 0 || !(a.bucket_mb > 0)) {
    usage_error("--batch, --steps, --window and --threads must be >= 1, --warmup >= 0, --bucket-mb > 0");
  }
  if (a.optim_impl != "auto" && a.optim_impl != "fused" && a.optim_impl != "foreach" && a.optim_impl != "loop") {
    usage_error("--optim-impl is auto, fused, foreach or loop, got " + a.optim_impl);
  }
  return a;
}

// The middle value, or the mean of the two middle values for an even count (ddp_step.py's median).
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  at::set_num_threads(a.threads);
  const train::dist::Env env = train::dist::detect_env();
  train::DistributedConfig dc;
  dc.bucket_mb = a.bucket_mb;
  auto group = train::dist::Group::create(env, dc, "cpu");

  train::ModelConfig mc;
  mc.name = "resnet18";
  mc.num_classes = 10;
  mc.small_input = true;
  torch::manual_seed(0);
  auto model = train::models::make_model(mc);
  train::dist::GradSyncOptions so;
  so.bucket_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
  train::dist::GradSync sync(*model, group, so);
  sync.broadcast_parameters();
  train::OptimConfig oc;
  oc.momentum = 0.9;
  oc.weight_decay = 5e-4;
  oc.impl = a.optim_impl;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  try {
    optimizer = train::make_optimizer(oc, *model, 0.1);
  } catch (const std::exception& e) {  // "fused" where this LibTorch has no kernel
    usage_error(std::string("--optim-impl ") + a.optim_impl + ": " + e.what());
  }
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();

  torch::manual_seed(1 + env.rank);
  const auto x = torch::randn({a.batch, 3, 32, 32});
  const auto y = torch::randint(0, 10, {a.batch}, torch::kLong);

  auto step = [&](bool communicate) {
    optimizer->zero_grad();
    sync.broadcast_buffers();  // as DDP does before each forward (BatchNorm statistics)
    sync.prepare(communicate);
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    if (communicate) sync.finish();
    optimizer->step();
  };
  // The communication alone: every bucket's bytes, all-reduced back to back after "backward".
  std::vector<torch::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(torch::zeros_like(p).reshape({-1}));
  auto flat = torch::cat(grads);
  const int64_t bucket_elems = so.bucket_bytes / 4;
  auto comm_only = [&] {
    for (int64_t off = 0; off < flat.numel(); off += bucket_elems) {
      auto part = flat.narrow(0, off, std::min(bucket_elems, flat.numel() - off));
      group->allreduce(part);
    }
  };

  for (int i = 0; i < a.warmup; ++i) step(true);
  group->barrier();
  using Clock = std::chrono::steady_clock;
  std::vector<double> ddp, local, comm;
  for (int done = 0; done < a.steps; done += std::min(a.window, a.steps - done)) {
    const int n = std::min(a.window, a.steps - done);
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) step(true);
    group->barrier();
    ddp.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / n);
    t0 = Clock::now();
    for (int i = 0; i < n; ++i) step(false);
    group->barrier();
    local.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / n);
    t0 = Clock::now();
    for (int i = 0; i < n; ++i) comm_only();
    group->barrier();
    comm.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / n);
  }
  const double t_ddp = median(ddp), t_local = median(local), t_comm = median(comm);
  const double hidden = t_comm > 0 ? std::clamp(1.0 - (t_ddp - t_local) / t_comm, 0.0, 1.0) : 0.0;
  const auto st = sync.stats();
  if (env.rank == 0) {
    std::cout << "{\"impl\":\"cpp\",\"world\":" << env.world_size << ",\"batch_per_rank\":" << a.batch
              << ",\"threads\":" << a.threads << ",\"optimizer\":\"" << train::optimizer_impl(*optimizer)
              << "\",\"params\":" << params << ",\"steps\":" << a.steps << ",\"buckets\":" << st.buckets
              << ",\"grad_mb\":" << st.bytes / 1e6
              << ",\"step_s\":" << t_ddp << ",\"local_step_s\":" << t_local << ",\"comm_s\":" << t_comm
              << ",\"hidden\":" << hidden << ",\"windows\":" << ddp.size()
              << ",\"img_per_s\":" << static_cast<double>(a.batch * env.world_size) / t_ddp << "}" << std::endl;
  }
  return 0;
}
