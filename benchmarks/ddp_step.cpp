// Data-parallel ResNet-18 (small-input stem) training steps under torchrun: train's GradSync
// (bucketed allreduce overlapped with backward) on c10d Gloo. The C++ side of
// benchmarks/compare_ddp.py; ddp_step.py is PyTorch's DistributedDataParallel on the same model.
//
//   torchrun --no-python --nproc-per-node 2 build/bin/bench_ddp_step --batch 32 --steps 20
//
// Each rank trains on its own fixed synthetic batch. Windows of three kinds are interleaved:
//   ddp     full data-parallel steps (what training runs)
//   local   the same steps with no gradient communication (no_sync): compute alone
//   comm    the allreduce of every gradient bucket alone, as after a backward without overlap
// hidden = 1 - (ddp - local) / comm: the share of communication that backward covered.
// Rank 0 prints one JSON line with the medians.
#include <train/config.h>
#include <train/ddp.h>
#include <train/dist.h>
#include <train/models/model.h>
#include <train/optim.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
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
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else if (k == "--window") a.window = std::stoi(v);
    else if (k == "--threads") a.threads = std::stoi(v);
    else if (k == "--bucket-mb") a.bucket_mb = std::stod(v);
    else {
      std::cerr << "unknown argument " << k << "\n";
      std::exit(2);
    }
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
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
  auto optimizer = train::make_optimizer(oc, *model, 0.1);

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
  for (int done = 0; done < a.steps; done += a.window) {
    auto t0 = Clock::now();
    for (int i = 0; i < a.window; ++i) step(true);
    group->barrier();
    ddp.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / a.window);
    t0 = Clock::now();
    for (int i = 0; i < a.window; ++i) step(false);
    group->barrier();
    local.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / a.window);
    t0 = Clock::now();
    for (int i = 0; i < a.window; ++i) comm_only();
    group->barrier();
    comm.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / a.window);
  }
  const double t_ddp = median(ddp), t_local = median(local), t_comm = median(comm);
  const double hidden = t_comm > 0 ? std::clamp(1.0 - (t_ddp - t_local) / t_comm, 0.0, 1.0) : 0.0;
  const auto st = sync.stats();
  if (env.rank == 0) {
    std::cout << "{\"impl\":\"cpp\",\"world\":" << env.world_size << ",\"batch_per_rank\":" << a.batch
              << ",\"threads\":" << a.threads << ",\"buckets\":" << st.buckets << ",\"grad_mb\":" << st.bytes / 1e6
              << ",\"step_s\":" << t_ddp << ",\"local_step_s\":" << t_local << ",\"comm_s\":" << t_comm
              << ",\"hidden\":" << hidden << ",\"windows\":" << ddp.size()
              << ",\"img_per_s\":" << static_cast<double>(a.batch * env.world_size) / t_ddp << "}" << std::endl;
  }
  return 0;
}
