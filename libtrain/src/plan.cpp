#include "train/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <locale>
#include <sstream>
#include <utility>

#include "compat.h"
#include "optimizer_names.h"
#include "train/errors.h"
#include "train/host_memory.h"
#include "train/log.h"
#include "train/metrics.h"

namespace train {
namespace {

// The plan's numbers go to plan.json and the log as JSON and C write them (0.1, 12345), whatever
// the global C++ locale a host program set: a stream takes it by default.
std::string num(double v) {
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out << v;
  return out.str();
}

int64_t pow2_at_most(int64_t n) {
  int64_t p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

std::string gib(double bytes) {
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out.precision(3);
  out << bytes / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return out.str();
}

std::string mib(double bytes) {
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out.precision(3);
  out << bytes / (1024.0 * 1024.0) << " MiB";
  return out.str();
}

std::string describe_memory(const MemoryEvidence& m) {
  std::string s = (m.estimate ? "estimate: " : "measured: ") + gib(static_cast<double>(m.fixed_bytes)) + " fixed + " +
                  mib(m.per_sample_bytes) + "/sample, budget " + gib(static_cast<double>(m.budget_bytes));
  if (!m.source.empty()) s += " (" + m.source + ")";
  return s;
}

// A probe ran (it set a budget) and predicts that not even one sample fits: the fixed cost alone
// exceeds the budget, or every size tried ran out of memory.
bool nothing_fits(const MemoryEvidence& m) { return m.budget_bytes > 0 && m.max_micro_batch == 0; }

std::string nothing_fits_warning(const MemoryEvidence& m) {
  return "not even one sample fits the memory budget, expect out-of-memory; use a smaller model, input or "
         "precision, or raise tuning.memory_fraction (" + describe_memory(m) + ")";
}

// The throughput choice caps the micro-batch only when a larger size was timed and gained too
// little; when the choice is the largest size timed, nothing beyond it was measured.
bool larger_size_timed(const MemoryEvidence& m) {
  return std::any_of(m.throughput.begin(), m.throughput.end(),
                     [&](const std::pair<int64_t, double>& t) { return t.first > m.throughput_choice; });
}

// Largest divisor of n that is <= cap.
int64_t largest_divisor_at_most(int64_t n, int64_t cap) {
  for (int64_t d = std::min(n, cap); d >= 1; --d) {
    if (n % d == 0) return d;
  }
  return 1;
}

// The per-rank batches nearest to `per_rank`, one below and one above, that have a divisor of at
// least half of `cap` (and at most `cap`). A per-rank batch that is prime, or twice a prime, has
// none, and would run as many passes of a tiny micro-batch. O(cap): for each such divisor, its
// multiples on either side. Assumes cap < per_rank, so that a multiple below exists.
std::pair<int64_t, int64_t> nearest_splittable(int64_t per_rank, int64_t cap) {
  int64_t below = 0, above = std::numeric_limits<int64_t>::max();
  for (int64_t d = (cap + 1) / 2; d <= cap; ++d) {
    const int64_t lower = per_rank / d * d;
    below = std::max(below, lower < per_rank ? lower : lower - d);
    above = std::min(above, lower + d);
  }
  return {below, above};
}

// "global 320 (micro-batch 64 x accum 5)", with the per-rank batch when there are several ranks.
std::string split_text(int64_t per_rank, int64_t cap, int64_t world) {
  const int64_t micro = largest_divisor_at_most(per_rank, cap);
  return log::str(per_rank * world, " (", world > 1 ? log::str(per_rank, " per rank: ") : std::string(),
                  "micro-batch ", micro, " x accum ", per_rank / micro, ")");
}

// The micro_batch warning when the divisor chosen is below half the cap: what the split costs, and
// the nearest global batches (multiples of the world size) that split well. The batch stays as
// configured: changing it would change the optimisation.
std::string poor_split_warning(int64_t per_rank, int64_t cap, int64_t micro, int64_t world) {
  const auto [below, above] = nearest_splittable(per_rank, cap);
  return log::str("the per-rank batch ", per_rank, " has no divisor from ", (cap + 1) / 2, " to ", cap,
                  ", so each step runs ", per_rank / micro, " passes of micro-batch ", micro,
                  " (slow); the nearest global batches that split well are ", split_text(below, cap, world), " and ",
                  split_text(above, cap, world), " (trainer.global_batch)");
}

// The warmup rules' reasons, said the same whether or not the epoch length is known yet.
const char* const kWarmupReason = "schedule.warmup_steps + warmup_epochs x steps/epoch";
std::string auto_warmup_reason(double lr_scale) {
  return "lr scaled x" + num(lr_scale) + " with no warmup configured: min(5 epochs, 10% of training)";
}

}  // namespace

MemoryEvidence with_current_budget(MemoryEvidence cached, int64_t budget_bytes) {
  if (cached.budget_bytes <= 0 || budget_bytes <= 0 || budget_bytes >= cached.budget_bytes) return cached;
  const int64_t was = cached.max_micro_batch;
  int64_t fits = 0;
  if (cached.per_sample_bytes > 0) {
    const double solution = std::floor(static_cast<double>(budget_bytes - cached.fixed_bytes) / cached.per_sample_bytes);
    fits = solution <= 0 ? 0 : solution >= static_cast<double>(was) ? was : static_cast<int64_t>(solution);
  } else {
    fits = cached.fixed_bytes <= budget_bytes ? was : 0;
  }
  const std::string budgets = gib(static_cast<double>(budget_bytes)) + " budget now, " +
                              gib(static_cast<double>(cached.budget_bytes)) + " when measured";
  cached.budget_bytes = budget_bytes;
  if (fits < was) {
    cached.max_micro_batch = fits;
    cached.source += "; " + budgets + ": largest micro-batch " + std::to_string(fits) + ", was " + std::to_string(was);
  }
  return cached;
}

int64_t max_scaled_global_batch(const Config& config) {
  const int64_t base_batch = config.tuning.base_batch > 0 ? config.tuning.base_batch : config.trainer.global_batch;
  return config.tuning.max_global_batch > 0 ? config.tuning.max_global_batch : 32 * base_batch;
}

Plan make_plan(const Config& config, const DeviceProfile& device, const PlanInputs& inputs) {
  Plan plan;
  plan.device = device;
  plan.world_size = inputs.world_size;
  plan.rank = inputs.rank;
  plan.model_params = inputs.model_params;
  plan.global_batch = config.trainer.global_batch;
  plan.warmup_epochs = config.schedule.warmup_epochs;
  auto decide = [&plan](const std::string& name, const std::string& value, const std::string& reason,
                        std::vector<std::string> warnings = {}) {
    plan.decisions.push_back({name, value, reason, std::move(warnings)});
  };
  decide("device", device.device_string(), device.summary());

  plan.memory = inputs.memory;
  const MemoryEvidence& mem = inputs.memory;
  const bool scale_mode = config.tuning.batch == "scale";
  const int64_t base_batch = config.tuning.base_batch > 0 ? config.tuning.base_batch : config.trainer.global_batch;

  // ---- scale mode: grow the global batch with the memory available (accumulation 1) ----
  if (scale_mode && config.tuning.micro_batch == 0 && mem.max_micro_batch > 0) {
    const int64_t limit = max_scaled_global_batch(config);
    // The micro-batch each rank adds, and what stopped it growing further.
    int64_t micro = pow2_at_most(mem.max_micro_batch);
    std::string bound = std::string(mem.estimate ? "estimated" : "measured") + " memory fits " +
                        std::to_string(mem.max_micro_batch) + ", rounded down to a power of two";
    auto cap = [&](int64_t value, const std::string& why) {
      if (value < micro) {
        micro = value;
        bound = why;
      }
    };
    if (mem.throughput_choice > 0 && larger_size_timed(mem)) {
      cap(mem.throughput_choice, "throughput: doubling beyond " + std::to_string(mem.throughput_choice) + " gained < 5%");
    }
    cap(std::max<int64_t>(1, limit / plan.world_size),
        (config.tuning.max_global_batch > 0 ? "tuning.max_global_batch " : "32 x the base batch, ") +
            std::to_string(limit) + " over world " + std::to_string(plan.world_size));
    if (config.tuning.max_micro_batch > 0) {
      cap(config.tuning.max_micro_batch, "tuning.max_micro_batch " + std::to_string(config.tuning.max_micro_batch));
    }
    if (micro * plan.world_size > plan.global_batch) {
      plan.global_batch = micro * plan.world_size;
      plan.scaled_batch = true;
    }
    decide("global_batch", std::to_string(plan.global_batch),
           plan.scaled_batch ? "tuning.batch scale: micro-batch " + std::to_string(micro) + " x world " +
                                   std::to_string(plan.world_size) + " (" + bound + ")"
                             : "tuning.batch scale: no more than trainer.global_batch, since micro-batch " +
                                   std::to_string(micro) + " x world " + std::to_string(plan.world_size) +
                                   " is not larger (" + bound + ")");
  } else {
    decide("global_batch", std::to_string(plan.global_batch),
           !scale_mode ? "trainer.global_batch (tuning.batch fixed: the same on every device)"
           : config.tuning.micro_batch > 0
               ? "tuning.batch scale, but tuning.micro_batch " + std::to_string(config.tuning.micro_batch) +
                     " fixes the micro-batch (and nothing is measured): trainer.global_batch"
           : nothing_fits(mem)
               ? "tuning.batch scale, but not even one sample fits the memory budget: trainer.global_batch"
               : "tuning.batch scale, but no memory measurement on this device: trainer.global_batch");
  }

  // ---- batch arithmetic: global = micro x accum x world ----
  if (plan.global_batch % plan.world_size != 0) {
    throw ConfigError("key 'trainer.global_batch': " + std::to_string(plan.global_batch) +
                      " is not divisible by the world size " + std::to_string(plan.world_size) +
                      "; choose a multiple of " + std::to_string(plan.world_size));
  }
  const int64_t per_rank = plan.global_batch / plan.world_size;
  std::string micro_reason;
  std::vector<std::string> micro_warnings;
  if (config.tuning.micro_batch > 0) {
    plan.micro_batch = config.tuning.micro_batch;
    if (per_rank % plan.micro_batch != 0) {
      throw ConfigError("key 'tuning.micro_batch': " + std::to_string(plan.micro_batch) +
                        " does not divide the per-rank batch " + std::to_string(per_rank) +
                        " (trainer.global_batch " + std::to_string(plan.global_batch) + " / world " +
                        std::to_string(plan.world_size) + "), so the global batch would not be exact");
    }
    micro_reason = "set by tuning.micro_batch";
    if (mem.max_micro_batch > 0 && plan.micro_batch > mem.max_micro_batch) {
      micro_warnings.push_back("the memory model predicts at most " + std::to_string(mem.max_micro_batch));
    }
  } else {
    int64_t cap = per_rank;
    std::vector<std::string> why;
    if (config.tuning.max_micro_batch > 0 && config.tuning.max_micro_batch < cap) {
      cap = config.tuning.max_micro_batch;
      why.push_back("tuning.max_micro_batch " + std::to_string(cap));
    }
    if (mem.max_micro_batch > 0 && mem.max_micro_batch < cap) {
      cap = mem.max_micro_batch;
      why.push_back(std::string(mem.estimate ? "estimated" : "measured") + " memory fits " + std::to_string(cap));
    }
    if (mem.throughput_choice > 0 && mem.throughput_choice < cap && larger_size_timed(mem)) {
      cap = mem.throughput_choice;
      why.push_back("throughput: doubling beyond " + std::to_string(cap) + " gained < 5%");
    }
    plan.micro_batch = largest_divisor_at_most(per_rank, cap);
    if (!nothing_fits(mem) && plan.micro_batch * 2 < cap) {
      micro_warnings.push_back(poor_split_warning(per_rank, cap, plan.micro_batch, plan.world_size));
    }
    if (nothing_fits(mem)) {
      plan.micro_batch = 1;
      micro_reason = "the smallest micro-batch";
    } else if (why.empty()) {
      micro_reason = "whole per-rank batch in one pass (global " + std::to_string(plan.global_batch) + " / world " +
                     std::to_string(plan.world_size) + ")";
    } else {
      micro_reason = "largest divisor of the per-rank batch " + std::to_string(per_rank) + " within ";
      for (size_t i = 0; i < why.size(); ++i) micro_reason += (i ? "; " : "") + why[i];
    }
  }
  if (nothing_fits(mem)) {
    micro_warnings.push_back(nothing_fits_warning(mem));
  } else if (mem.max_micro_batch > 0 || mem.per_sample_bytes > 0) {
    micro_reason += "; " + describe_memory(mem);
    if (config.model.recompute) micro_reason += ", the encoder layers recomputed in backward (model.recompute)";
  }
  plan.accum_steps = per_rank / plan.micro_batch;
  decide("micro_batch", std::to_string(plan.micro_batch), micro_reason, std::move(micro_warnings));
  decide("accum_steps", std::to_string(plan.accum_steps),
         std::to_string(plan.micro_batch) + " x " + std::to_string(plan.accum_steps) + " x world " +
             std::to_string(plan.world_size) + " = global " + std::to_string(plan.global_batch));

  // ---- learning rate: scaled only when the global batch differs from the one lr was tuned for ----
  const double ratio = static_cast<double>(plan.global_batch) / static_cast<double>(base_batch);
  const std::string& rule = config.tuning.lr_scaling;
  if (ratio == 1.0 || rule == "none") {
    plan.lr_scale = 1.0;
  } else {
    plan.lr_scale = rule == "sqrt" ? std::sqrt(ratio) : ratio;
  }
  plan.lr = config.optim.lr * plan.lr_scale;
  if (ratio == 1.0) {
    decide("lr", num(plan.lr), "optim.lr: the global batch equals the batch it was tuned for (" +
                                   std::to_string(base_batch) + ")");
  } else {
    decide("lr", num(plan.lr),
           "optim.lr " + num(config.optim.lr) + " x " + num(plan.lr_scale) + " (" + rule + " rule, global " +
               std::to_string(plan.global_batch) + " / base " + std::to_string(base_batch) + ")" +
               (rule == "linear" ? "; Goyal et al. 2017" : rule == "sqrt" ? "; the usual choice for Adam-family" : ""));
  }

  // ---- precision ----
  const std::string cc = std::to_string(device.cc_major) + "." + std::to_string(device.cc_minor);
  const std::string& mode = config.precision.mode;
  if (mode == "bf16" && device.is_cuda() && !device.bf16) {
    throw ConfigError("key 'precision.mode': bf16 requested, but " + device.name + " (compute capability " + cc +
                      ") has no bf16 tensor cores; use auto, fp16 or fp32");
  }
  if (mode == "fp16" && !device.is_cuda()) {
    throw ConfigError("key 'precision.mode': fp16 autocast is for GPUs; on a CPU use bf16 or fp32");
  }
  std::string precision_reason;
  std::vector<std::string> precision_warnings;
  if (mode == "fp32" || mode == "bf16" || mode == "fp16") {
    plan.precision = mode;
    precision_reason = "precision.mode";
  } else if (device.is_cuda() && device.bf16) {
    plan.precision = "bf16";
    precision_reason = "compute capability " + cc + " has bf16 tensor cores; bf16 needs no loss scaling";
  } else if (device.is_cuda() && device.cc_major >= 7) {
    plan.precision = "fp16";
    precision_reason = "compute capability " + cc + " has fp16 tensor cores but no bf16: fp16 autocast";
  } else if (device.is_cuda()) {
    plan.precision = "fp32";
    precision_reason = "compute capability " + cc + " has no tensor cores";
  } else {
    plan.precision = "fp32";
    // fp32 stays the CPU default: a CPU run gives the reference numbers. On a CPU with AMX, bf16
    // autocast moves convolutions and matmuls onto its tile units: 2.2x the ResNet-50 steps,
    // 1.3x BERT-mini's and 1.6x the default example's on a 2-core Xeon VM with AMX, where the
    // example reaches the same accuracy (benchmarks/README.md). The plan says so on such a CPU.
    const bool amx = (" " + device.cpu_isa + " ").find(" amx_tile ") != std::string::npos;
    precision_reason = amx ? "CPU: fp32 (the CPU default); this CPU has AMX tile units, on which precision.mode: bf16 "
                             "runs convolutions and matmuls (measured 1.3x to 2.2x faster steps, benchmarks/README.md)"
                           : "CPU: fp32 (bf16 autocast is available with precision.mode: bf16)";
  }
  const std::string& scaling = config.precision.loss_scaling;
  plan.loss_scaling = scaling == "dynamic" || (scaling == "auto" && plan.precision == "fp16");
  if (plan.loss_scaling) {
    precision_reason += plan.precision == "fp16" ? " + dynamic loss scaling (fp16 gradients underflow without it)"
                                                 : " + dynamic loss scaling (precision.loss_scaling)";
  } else if (plan.precision == "fp16") {
    precision_warnings.push_back("loss scaling off (precision.loss_scaling), small gradients may underflow");
  }
  plan.tf32 = device.is_cuda() && device.tf32;
  decide("precision", plan.precision + (plan.tf32 ? " + TF32" : ""),
         precision_reason + (device.is_cuda() ? (plan.tf32 ? "; TF32 for remaining fp32 matmuls/convs"
                                                           : "; no TF32 below compute capability 8.0")
                                              : ""),
         std::move(precision_warnings));

  // ---- cuDNN / memory format ----
  plan.cudnn_benchmark = device.is_cuda() && inputs.static_shapes;
  decide("cudnn_benchmark", plan.cudnn_benchmark ? "on" : "off",
         !device.is_cuda()     ? "CPU run"
         : inputs.static_shapes ? "input shapes are static"
                                : "input shapes vary from batch to batch" +
                                      (inputs.varying_shapes.empty() ? std::string()
                                                                     : " (" + inputs.varying_shapes + ")") +
                                      ": benchmark mode would search for algorithms again at every new shape");
  const std::string& cl = config.precision.channels_last;
  if (cl == "on" || cl == "off") {
    plan.channels_last = cl == "on";
    decide("channels_last", cl, "precision.channels_last");
  } else {
    // On a CPU, oneDNN computes convolutions in NHWC (or blocked) layouts, vectorised over the
    // channels: NCHW tensors are reordered around every convolution, but a convolution with fewer
    // output channels than a 16-lane vector fills it only in part. Step time NCHW / NHWC on a 2-core
    // Xeon (AVX-512): ResNet-50 224² 1.24x, the Fashion-MNIST example (16+ channels) 1.13x on
    // LibTorch 1.13 and 1.17x on 2.11; LeNet (6 channels) 0.90x.
    constexpr int64_t kCpuNhwcMinChannels = 16;
    const bool gpu = device.is_cuda() && plan.precision != "fp32";
    const bool cpu_onednn = !device.is_cuda() && device.onednn;
    const bool cpu = cpu_onednn && inputs.narrowest_conv >= kCpuNhwcMinChannels;
    plan.channels_last = inputs.convolutional && (gpu || cpu);
    decide("channels_last", plan.channels_last ? "on" : "off",
           !inputs.convolutional ? "not a convolutional model"
           : gpu                 ? "tensor-core convolutions run on NHWC without layout transposes"
           : cpu ? log::str("CPU: oneDNN's convolutions run on NHWC without reordering every activation (",
                            inputs.narrowest_conv, "+ channels each)")
           : device.is_cuda() ? "NCHW: channels_last pays off with mixed precision on a GPU"
           : !cpu_onednn      ? "NCHW: this LibTorch has no oneDNN for CPU convolutions"
           : inputs.narrowest_conv > 0
               ? log::str("NCHW: a convolution with ", inputs.narrowest_conv, " output channels would fill less than a ",
                          kCpuNhwcMinChannels, "-lane vector in NHWC")
               : std::string("NCHW: the model's convolution widths are not known"));
  }

  // ---- CUDA graphs ----
  // Replaying a captured step costs the CPU one launch instead of one per kernel: the win of
  // small steps, whose GPU otherwise idles while the CPU launches. A graph replays the same
  // kernels on the same memory, so everything in the step must be on the GPU and static.
  {
    const std::string& mode = config.tuning.cuda_graphs;
    std::string blocker;
    if (mode == "off") {
      blocker = "tuning.cuda_graphs";
    } else if (!device.is_cuda()) {
      blocker = "CPU run";
    } else if (inputs.world_size > 1) {
      blocker = "data-parallel: the gradient allreduce runs outside the step a graph could capture";
    } else if (plan.accum_steps > 1) {
      blocker = log::str("gradient accumulation (", plan.accum_steps, " micro-batches a step)");
    } else if (!inputs.static_shapes) {
      blocker = "input shapes vary from batch to batch; a graph replays one shape";
    } else if (!inputs.capturable) {
      blocker = "the model's forward may wait for the GPU or change shape with the data (Model::capturable)";
    } else if (config.optim.name != "sgd" && config.optim.name != "adamw") {
      blocker = "optim.name " + config.optim.name + ", a registered optimizer; the captured step needs the fused sgd "
                "or adamw kernel";
    } else if (config.optim.impl != "auto" && config.optim.impl != "fused") {
      blocker = "optim.impl " + config.optim.impl + "; the captured step needs the fused " + config.optim.name + " kernel";
    } else if (config.optim.name == "sgd" && !compat::has_fused_sgd(c10::DeviceType::CUDA)) {
      blocker = "this LibTorch has no fused SGD kernel with a learning rate on the GPU (2.3 or later)";
    } else if (config.optim.name == "adamw" && !compat::kAdamwStepOnDevice) {
      blocker = "this LibTorch has no fused AdamW kernel with its learning rate and step count on the GPU (2.4 or "
                "later)";
    } else if (!compat::kCudaGraphCapture) {
      blocker = "this LibTorch (" + compat::torch_version() + ") is older than 2.4, which train's step capture needs";
    } else if (plan.loss_scaling) {
      blocker = "fp16 loss scaling decides on the host whether each step is applied";
    }
    plan.cuda_graphs = blocker.empty();
    std::vector<std::string> warnings;
    if (mode == "on" && !plan.cuda_graphs && device.is_cuda()) {
      warnings.push_back("tuning.cuda_graphs is on, but the step cannot be captured: " + blocker);
    }
    decide("cuda_graphs", plan.cuda_graphs ? "on" : "off",
           plan.cuda_graphs
               ? "one process, static shapes, a capturable model and fused " + config.optim.name +
                     ": the step is captured after a few eager steps and replayed" +
                     (mode == "on" ? "; kept (tuning.cuda_graphs on)"
                                   : "; kept only if a replay measures faster than an eager step")
               : blocker,
           std::move(warnings));
  }

  // ---- CPU threads ----
  const int64_t sharing = std::max<int64_t>(1, inputs.local_world_size);
  plan.threads = config.trainer.threads > 0 ? config.trainer.threads : std::max<int64_t>(1, device.cpu_cores / sharing);
  std::vector<std::string> thread_warnings;
  if (config.trainer.threads > 0 && device.cpu_cores > 0 && plan.threads * sharing > device.cpu_cores) {
    thread_warnings.push_back(log::str(plan.threads, " threads", sharing > 1 ? log::str(" x ", sharing, " ranks") : "",
                                       " on ", device.cpu_cores,
                                       " cores: threads that wait for a core slow every operation down; leave "
                                       "trainer.threads at 0 for one per core"));
  }
  std::string omp;  // a thread count the environment asks for, which a PyTorch user expects obeyed
  if (config.trainer.threads == 0 && !device.omp_num_threads.empty() &&
      device.omp_num_threads != std::to_string(plan.threads)) {
    omp = "; OMP_NUM_THREADS=" + device.omp_num_threads + " is not read: set trainer.threads to use fewer";
  }
  decide("threads", std::to_string(plan.threads),
         config.trainer.threads > 0 ? "trainer.threads"
         : sharing > 1 ? log::str(device.cpu_cores, " cores available / ", sharing, " ranks on this host", omp)
                       : std::to_string(device.cpu_cores) + " cores available to this process" + omp,
         std::move(thread_warnings));

  const HostMallocState heap = host_malloc_state();
  plan.host_malloc_kept = heap.tuned;
  decide("host_malloc", heap.tuned ? "kept" : "default", heap.reason);

  // ---- loader ----
  plan.pin_memory = device.is_cuda();
  plan.prefetch = config.data.prefetch;
  if (config.data.workers >= 0) {
    plan.workers = config.data.workers;
    decide("workers", std::to_string(plan.workers), "data.workers");
  } else {
    // Raised at run time while the loader starves the step, up to every core of this rank but
    // the training thread's (CPU training: every core, since the step then waits anyway).
    const int64_t per_rank = std::max<int64_t>(1, device.cpu_cores / sharing);
    plan.workers_adaptive = true;
    plan.max_workers = std::max<int64_t>(1, device.is_cuda() ? per_rank - 1 : per_rank);
    std::string reason;
    if (device.is_cuda()) {
      plan.workers = std::clamp<int64_t>(per_rank - 1, 1, 8);
      reason = "cores per GPU minus one for the training thread, at most 8";
    } else {
      plan.workers = 1;
      reason = "CPU training uses the cores for compute; one worker prefetches the next batch";
    }
    if (plan.max_workers > plan.workers) {
      reason += log::str("; raised up to ", plan.max_workers, " while data wait exceeds 5% of a logging window");
    }
    decide("workers", std::to_string(plan.workers), reason);
  }
  plan.uint8_batches = resolve_uint8_batches(config, device);
  if (config.data.kind == "image_folder") {
    decide("uint8_batches", plan.uint8_batches ? "on" : "off",
           config.data.uint8 != "auto" ? std::string("data.uint8")
           : plan.uint8_batches
               ? std::string("images cross to the GPU as bytes, a quarter of the bytes to pin and copy, and the "
                             "loader skips the float conversion; mean/std applied on the GPU")
               : std::string("CPU training: the loader's workers normalise, not the training thread"));
  }
  decide("pin_memory", plan.pin_memory ? "on" : "off",
         plan.pin_memory ? "page-locked buffers; each batch is copied on a side stream while the previous one computes"
                          : "no GPU");

  // ---- checkpoints ----
  // fp32 parameters and the optimizer's state: AdamW keeps two moments per parameter, SGD with
  // momentum one buffer, a registered optimizer what it declared.
  const int64_t state_copies =
      inputs.optimizer_state_per_parameter >= 0
          ? inputs.optimizer_state_per_parameter
          : std::max(0, detail::built_in_state_per_parameter(config.optim));  // (registered, uncounted: 0)
  const int64_t checkpoint_bytes = inputs.model_params * 4 * (1 + state_copies);
  const std::string size = log::str("about ", log::fixed(static_cast<double>(checkpoint_bytes) / (1 << 20), 0),
                                    " MiB (parameters", state_copies > 0 ? " + " + config.optim.name + " state" : "", ")");
  constexpr int64_t kAsyncFrom = int64_t{256} << 20;
  if (config.checkpoint.async != "auto") {
    plan.checkpoint_async = config.checkpoint.async == "on";
    decide("checkpoints", plan.checkpoint_async ? "async" : "sync", "checkpoint.async; a checkpoint is " + size);
  } else {
    // On a CPU the training's threads take every core: a thread writing beside them slows the
    // steps more than the write it hides (BERT-base on 2 cores: 92.9 s with sync checkpoints, 96.8
    // with async ones, benchmarks/README.md).
    plan.checkpoint_async = device.is_cuda() && checkpoint_bytes >= kAsyncFrom;
    decide("checkpoints", plan.checkpoint_async ? "async" : "sync",
           plan.checkpoint_async
               ? "a checkpoint is " + size + ": written on a background thread while the GPU trains on; it costs "
                     "a copy of that size in host memory"
           : !device.is_cuda()
               ? "a checkpoint is " + size + "; on a CPU a background write would take cores from the training's "
                     "threads, so it is written in the loop"
               : "a checkpoint is " + size + ", under 256 MiB: written in the training loop");
  }
  return plan;
}

bool resolve_uint8_batches(const Config& config, const DeviceProfile& device) {
  if (config.data.uint8 != "auto") return config.data.uint8 == "on";
  return config.data.kind == "image_folder" && device.is_cuda();
}

void finalize_schedule(Plan& plan, const Config& config, int64_t train_samples) {
  const int64_t samples_per_rank = train_samples / plan.world_size;
  plan.steps_per_epoch = samples_per_rank / (plan.micro_batch * plan.accum_steps);
  if (plan.steps_per_epoch <= 0) {
    throw ConfigError("key 'trainer.global_batch': " + std::to_string(plan.global_batch) +
                      " is larger than the training set (" + std::to_string(train_samples) + " samples)");
  }
  // The config bounds epochs and max_steps (limits::kMaxEpochs, kMaxSteps); the product with the
  // epoch length is checked here, so that the step count is never wrapped or absurd.
  int64_t from_epochs = 0;
  if (__builtin_mul_overflow(config.trainer.epochs, plan.steps_per_epoch, &from_epochs) ||
      from_epochs > limits::kMaxSteps) {
    if (config.trainer.max_steps == 0) {
      throw ConfigError("key 'trainer.epochs': " + std::to_string(config.trainer.epochs) + " epochs of " +
                        std::to_string(plan.steps_per_epoch) + " steps are more than " +
                        std::to_string(limits::kMaxSteps) + " optimizer steps; train fewer epochs or set "
                        "trainer.max_steps");
    }
    from_epochs = limits::kMaxSteps + 1;  // max_steps (<= kMaxSteps) ends the run first
  }
  if (config.trainer.max_steps > 0 && (from_epochs == 0 || config.trainer.max_steps < from_epochs)) {
    plan.total_steps = config.trainer.max_steps;
  } else {
    plan.total_steps = from_epochs;
  }
  // In floating point, then capped by the run's length: warmup_epochs x a long epoch may exceed
  // any integer, and the warmup never outlasts the run anyway.
  const double warmup = static_cast<double>(config.schedule.warmup_steps) +
                        std::round(config.schedule.warmup_epochs * static_cast<double>(plan.steps_per_epoch));
  plan.warmup_steps = warmup >= static_cast<double>(plan.total_steps) ? plan.total_steps : static_cast<int64_t>(warmup);
  std::string warmup_reason = kWarmupReason;
  if (warmup > static_cast<double>(plan.total_steps)) {
    // Said, not silent: a config tuned for a long run, shortened by trainer.max_steps, never
    // leaves its warmup.
    warmup_reason += log::str(" = ", log::fixed(warmup, 0), ", capped by the run's ", plan.total_steps,
                              " steps: the LR rises for the whole run");
  }
  if (plan.lr_scale > 1.0 && plan.warmup_steps == 0) {
    // A scaled-up LR needs a gradual warmup (Goyal et al. 2017 use 5 epochs).
    plan.warmup_steps = std::min<int64_t>(5 * plan.steps_per_epoch, plan.total_steps / 10);
    warmup_reason = auto_warmup_reason(plan.lr_scale);
  }
  plan.warmup_steps = std::min(plan.warmup_steps, plan.total_steps);
  plan.decisions.push_back({"total_steps", std::to_string(plan.total_steps),
                            std::to_string(plan.steps_per_epoch) + " steps/epoch over " +
                                std::to_string(train_samples) + " samples" +
                                (plan.total_steps == config.trainer.max_steps ? "; capped by trainer.max_steps"
                                                                              : "; trainer.epochs " +
                                                                                    std::to_string(config.trainer.epochs))});
  plan.decisions.push_back({"warmup_steps", std::to_string(plan.warmup_steps), warmup_reason});
  plan.schedule_known = true;
}

void defer_schedule(Plan& plan, const Config& config) {
  const std::string later = "resolved when the data is read";
  const std::string epochs = std::to_string(config.trainer.epochs) + " epochs";
  // Known without the data only when trainer.max_steps alone bounds the run.
  plan.total_steps = config.trainer.epochs == 0 ? config.trainer.max_steps : 0;
  plan.warmup_steps = -1;
  plan.steps_per_epoch = 0;
  if (plan.total_steps > 0) {
    plan.decisions.push_back({"total_steps", std::to_string(config.trainer.max_steps), "trainer.max_steps"});
  } else if (config.trainer.max_steps > 0) {
    plan.decisions.push_back({"total_steps", "<= " + std::to_string(config.trainer.max_steps),
                              "trainer.max_steps, or trainer.epochs " + std::to_string(config.trainer.epochs) +
                                  " if they end first; " + later});
  } else {
    plan.decisions.push_back({"total_steps", epochs, "trainer.epochs; the steps per epoch are " + later});
  }
  const ScheduleConfig& s = config.schedule;
  std::string value, reason;
  if (s.warmup_epochs > 0) {
    value = (s.warmup_steps > 0 ? std::to_string(s.warmup_steps) + " steps + " : std::string()) +
            num(s.warmup_epochs) + " epochs";
    reason = std::string(kWarmupReason) + "; " + later;
  } else if (s.warmup_steps > 0 && plan.total_steps > 0) {
    plan.warmup_steps = std::min(s.warmup_steps, plan.total_steps);
    value = std::to_string(plan.warmup_steps);
    reason = plan.warmup_steps < s.warmup_steps ? "schedule.warmup_steps, capped by the run's length"
                                                : "schedule.warmup_steps";
  } else if (s.warmup_steps > 0) {
    value = std::to_string(s.warmup_steps);
    reason = "schedule.warmup_steps (fewer if the run is shorter); " + later;
  } else if (plan.lr_scale > 1.0) {
    value = "min(5 epochs, 10%)";
    reason = auto_warmup_reason(plan.lr_scale) + "; " + later;
  } else {
    plan.warmup_steps = 0;
    value = "0";
    reason = "no warmup configured (schedule.warmup_steps, warmup_epochs)";
  }
  plan.decisions.push_back({"warmup_steps", value, reason});
  plan.schedule_known = false;
}

std::string PlanDecision::text() const {
  std::string s = reason;
  for (const std::string& w : warnings) s += (s.empty() ? "WARNING: " : "; WARNING: ") + w;
  return s;
}

std::string Plan::to_text() const {
  size_t name_w = 0, value_w = 0;
  for (const auto& d : decisions) {
    name_w = std::max(name_w, d.name.size());
    value_w = std::max(value_w, d.value.size());
  }
  std::ostringstream out;
  out << "plan:\n";
  for (const auto& d : decisions) {
    out << "  " << d.name << std::string(name_w - d.name.size() + 2, ' ') << d.value
        << std::string(value_w - d.value.size() + 2, ' ') << d.text() << '\n';
  }
  return out.str();
}

std::string Plan::to_json() const {
  MetricRecord r;
  r.add("device", device.device_string())
      .add("device_name", device.name)
      .add("micro_batch", micro_batch)
      .add("accum_steps", accum_steps)
      .add("global_batch", global_batch)
      .add("world_size", world_size)
      .add("lr", lr)
      .add("lr_scale", lr_scale)
      .add("scaled_batch", scaled_batch);
  // Unknown until the data is read: null (a non-finite double), never a misleading 0.
  const double unknown = std::numeric_limits<double>::quiet_NaN();
  const auto add_count = [&](const char* key, int64_t v, bool is_known) {
    if (is_known) {
      r.add(key, v);
    } else {
      r.add(key, unknown);
    }
  };
  add_count("warmup_steps", warmup_steps, schedule_known || warmup_steps >= 0);
  add_count("steps_per_epoch", steps_per_epoch, schedule_known);
  add_count("total_steps", total_steps, schedule_known || total_steps > 0);
  r.add("warmup_epochs", warmup_epochs)
      .add("precision", precision)
      .add("loss_scaling", loss_scaling)
      .add("tf32", tf32)
      .add("channels_last", channels_last)
      .add("cudnn_benchmark", cudnn_benchmark)
      .add("threads", threads)
      .add("host_malloc_kept", host_malloc_kept)
      .add("workers", workers)
      .add("workers_adaptive", workers_adaptive)
      .add("max_workers", max_workers)
      .add("prefetch", prefetch)
      .add("pin_memory", pin_memory)
      .add("uint8_batches", uint8_batches)
      .add("checkpoint_async", checkpoint_async)
      .add("cuda_graphs", cuda_graphs)
      .add("model_params", model_params)
      .add("memory_fixed_bytes", memory.fixed_bytes)
      .add("memory_per_sample_bytes", memory.per_sample_bytes)
      .add("memory_budget_bytes", memory.budget_bytes)
      .add("memory_max_micro_batch", memory.max_micro_batch)
      .add("memory_is_estimate", memory.estimate)
      .add("memory_source", memory.source)
      .add("device_named", device.named)
      .add("torch_version", device.torch_version);
  std::string json = r.to_json();
  // Append the decisions with their reasons.
  json.pop_back();
  json += ",\"decisions\":[";
  for (size_t i = 0; i < decisions.size(); ++i) {
    json += (i ? "," : "") + std::string("{\"name\":") + json_quote(decisions[i].name) +
            ",\"value\":" + json_quote(decisions[i].value) + ",\"reason\":" + json_quote(decisions[i].reason);
    if (!decisions[i].warnings.empty()) {
      json += ",\"warnings\":[";
      for (size_t w = 0; w < decisions[i].warnings.size(); ++w) {
        json += (w ? "," : "") + json_quote(decisions[i].warnings[w]);
      }
      json += "]";
    }
    json += "}";
  }
  return json + "]}";
}

}  // namespace train
