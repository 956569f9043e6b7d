#include "train/run.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "compat.h"
#include "train/checkpoint.h"
#include "train/data/factory.h"
#include "train/dist.h"
#include "train/errors.h"
#include "train/log.h"
#include "train/models/bert.h"
#include "train/optim.h"
#include "train/plan_cache.h"
#include "train/probe.h"

namespace train {
namespace {

// Parameter count and the hash of every parameter's name and shape.
std::string model_signature(const torch::nn::Module& model) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const std::string& s) {
    for (unsigned char c : s) {
      h ^= c;
      h *= 1099511628211ull;
    }
  };
  for (const auto& p : model.named_parameters()) {
    mix(p.key());
    for (int64_t d : p.value().sizes()) mix("," + std::to_string(d));
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return std::to_string(models::count_parameters(model)) + " params, shapes " + buf;
}

// What, beside the parameter shapes, sets a model's activation memory: the settings its shapes do
// not show (BERT's head count: the attention maps), dropout (its masks are kept for backward) and
// the attention implementation (the fused kernels keep no T x T maps).
std::string model_settings(const models::Model& model) {
  std::string out = model.architecture();
  double dropout = 0.0;
  for (const auto& module : model.modules(/*include_self=*/false)) {
    if (const auto* d = module->as<torch::nn::Dropout>()) dropout = std::max(dropout, d->options.p());
  }
  out += (out.empty() ? "" : ", ") + (dropout > 0.0 ? "dropout " + log::fixed(dropout, 3) : std::string("no dropout"));
  if (const auto* bert = dynamic_cast<const models::BertModel*>(&model)) {
    out += bert->attention() == models::BertAttention::kFused ? ", fused attention" : ", plain attention";
    if (bert->recompute()) out += ", recomputed layers";
  }
  return out;
}

// Which outputs the probe's loss reads: every sample's, or (masked-LM) only the masked positions,
// whose share sets the size of the head's logits and so the memory per sample.
double target_fraction(const Config& config) { return config.data.kind == "tokens" ? config.data.mask_prob : 1.0; }

std::string targets_string(const Config& config) {
  const double f = target_fraction(config);
  return f >= 1.0 ? "every position" : "masked positions, mask_prob " + log::fixed(f, 3);
}

// The optimizer as far as memory goes: the state it keeps per parameter, and the implementation
// (the multi-tensor one allocates temporaries for the whole parameter list).
std::string optimizer_string(const Config& config) {
  const std::string impl = ", impl " + config.optim.impl;
  if (config.optim.name == "sgd") return (config.optim.momentum != 0.0 ? "sgd, momentum" : "sgd, no momentum") + impl;
  return config.optim.name + impl;
}

// A program's own model's options (model.options): they may set its activation memory without
// showing in a parameter shape (a sequence length, a recomputation switch). Empty for built-ins.
std::string options_string(const Config& config) {
  std::string s;
  for (const auto& [name, value] : config.model.options.values()) s += (s.empty() ? "" : ", ") + name + " " + value;
  return s;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
  return s;
}

PlanCacheKey cache_key(const Config& config, const DeviceProfile& device, const Plan& draft, const models::Model& model,
                       const std::vector<int64_t>& input_shape, int world_size) {
  PlanCacheKey key;
  key.add("device", device.is_cuda() ? device.name + (device.named ? " (named)" : "") : "cpu: " + device.name);
  key.add("memory_gib", std::to_string(device.total_memory >> 30));
  key.add("compute_capability", std::to_string(device.cc_major) + "." + std::to_string(device.cc_minor));
  key.add("libtorch", device.torch_version);
  key.add("cuda", device.cuda_version.empty() ? "none" : device.cuda_version);
#ifdef TRAIN_WITH_CUDA
  key.add("cudnn", torch::cuda::is_available() ? std::to_string(at::detail::getCUDAHooks().versionCuDNN()) : "none");
#endif
  key.add("model", model_signature(model));
  key.add("model_settings", model_settings(model));
  if (!config.model.options.empty()) key.add("model_options", options_string(config));
  key.add("input", shape_string(input_shape));
  key.add("targets", targets_string(config));
  key.add("world_size", std::to_string(world_size));
  key.add("precision", draft.precision + (draft.channels_last ? ", channels_last" : ""));
  key.add("optimizer", optimizer_string(config));
  key.add("memory_fraction", std::to_string(config.tuning.memory_fraction));
  // Not the batch settings: the memory fit holds for every batch (within slope_known_up_to), and
  // the micro-batch sizes another plan needs timed are timed when it needs them.
  return key;
}

std::string cache_scope(const Config& config) { return config.source.empty() ? config.model.name : config.source; }

// The plan cache is an optimisation: a failure to write it is a warning, never an error.
bool store_or_warn(PlanCache& cache, const PlanCacheKey& key, const MemoryEvidence& evidence,
                   const std::string& scope) {
  try {
    cache.store(key, evidence, scope);
    return true;
  } catch (const Error& e) {
    log::warn(std::string("plan cache not written: ") + e.what());
    return false;
  }
}

// The fewest output channels of the model's 2-D convolutions (torch::nn::Conv2d modules); 0 when
// it has none (or computes its convolutions without such modules).
int64_t narrowest_convolution(torch::nn::Module& model) {
  int64_t narrowest = 0;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    if (const auto* conv = module->as<torch::nn::Conv2dImpl>()) {
      const int64_t out = conv->options.out_channels();
      narrowest = narrowest == 0 ? out : std::min(narrowest, out);
    }
  }
  return narrowest;
}

// The largest micro-batch the plan could use: the per-rank batch in fixed mode; in scale mode the
// per-rank share of the largest global batch it may grow to. Both within tuning.max_micro_batch.
int64_t largest_useful_micro_batch(const Config& config, int world_size) {
  const int64_t ranks = std::max(1, world_size);
  int64_t largest = config.trainer.global_batch / ranks;
  if (config.tuning.batch == "scale") largest = max_scaled_global_batch(config) / ranks;
  if (config.tuning.max_micro_batch > 0) largest = std::min(largest, config.tuning.max_micro_batch);
  return largest;
}

// "2, 4, 32": the batches a fit measured, in order.
std::string list_batches(const MemoryFit& fit) {
  std::vector<int64_t> batches;
  for (const ProbePoint& p : fit.points) batches.push_back(p.batch);
  std::sort(batches.begin(), batches.end());
  std::string text;
  for (size_t i = 0; i < batches.size(); ++i) text += (i ? ", " : "") + std::to_string(batches[i]);
  return text;
}

// probe_memory at `batches`, and once more with a larger batch when their peaks are flat while the
// activations grow (a transformer at 2 and 4 sequences: a parameter-sized buffer sets the peak),
// so that the line the plan extrapolates is one the peaks follow.
MemoryFit probe_with_activations_in_view(models::Model& model, const ProbeOptions& options,
                                         std::vector<int64_t> batches, int64_t largest_useful) {
  MemoryFit fit = probe_memory(model, options, batches);
  // At most twice: once for the activations to set the peak, once more for a second point on
  // that line (each doubles the batch at least, within largest_useful).
  for (int round = 0; round < 2; ++round) {
    const int64_t more = fit.batch_beyond_flat(largest_useful);
    if (more <= 0) break;
    log::info(log::str("memory probe: the peaks at ", list_batches(fit), " follow the activations at fewer than ",
                       "two batches (flat while they grow); measuring at ", more, " too"));
    batches.push_back(more);
    fit = probe_memory(model, options, batches);  // one baseline for all points
  }
  return fit;
}

// How far the slope of `fit` is known: 0 when its peaks follow the activations; otherwise they
// were still flat (largest_useful, the largest micro-batch the plan could use, stopped the probe
// from measuring further), and a plan that could use a larger micro-batch must measure again.
int64_t slope_known_up_to(const MemoryFit& fit, int64_t largest_useful) {
  return fit.batch_beyond_flat(std::numeric_limits<int64_t>::max()) > 0 ? largest_useful : 0;
}

// Why cached evidence cannot serve a plan whose micro-batch may reach `largest_useful`; "" when it can.
std::string slope_too_short(const MemoryEvidence& cached, int64_t largest_useful) {
  if (cached.slope_known_up_to <= 0 || largest_useful <= cached.slope_known_up_to) return "";
  return log::str("its memory peaks were still flat up to micro-batch ", cached.slope_known_up_to,
                  " (the slope beyond is unknown) and this plan could use ", largest_useful);
}

// The fp32 CPU measurement a named-device plan converts, from the plan cache when this machine
// already made it for the same model, input, optimizer and LibTorch.
MemoryFit cpu_measurement_for_named_device(const Config& config, models::Model& model, const ProbeOptions& options,
                                           const std::vector<int64_t>& batches, const std::string& batch_list,
                                           PlanCache& cache, const std::string& scope, bool& from_cache) {
  from_cache = false;
  PlanCacheKey key;
  key.add("measurement", "fp32 probe on this machine's CPU, for plans of named devices");
  key.add("libtorch", compat::torch_version());
  key.add("model", model_signature(model));
  key.add("model_settings", model_settings(model));
  if (!config.model.options.empty()) key.add("model_options", options_string(config));
  key.add("input", shape_string(options.input_shape));
  key.add("targets", targets_string(config));
  key.add("optimizer", optimizer_string(config));
  key.add("batches", batch_list);
  MemoryFit fit;
  const int64_t largest_useful = largest_useful_micro_batch(config, 1);
  if (auto hit = cache.find(key)) {
    const std::string too_short = slope_too_short(*hit, largest_useful);
    if (too_short.empty()) {
      log::info("plan cache hit: " + cache.dir() + "/" + key.hash() + ".json (this machine's CPU measurement)");
      fit.fixed_bytes = hit->fixed_bytes;
      fit.per_sample_bytes = hit->per_sample_bytes;
      for (int64_t b : batches) fit.points.push_back(ProbePoint{b, fit.predict(b), 0.0, false});
      from_cache = true;
      return fit;
    }
    log::info("plan cache: " + cache.dir() + "/" + key.hash() + ".json: " + too_short + "; measuring again");
  }
  fit = probe_with_activations_in_view(model, options, batches, largest_useful);
  MemoryEvidence measured;
  measured.fixed_bytes = fit.fixed_bytes;
  measured.per_sample_bytes = fit.per_sample_bytes;
  measured.slope_known_up_to = slope_known_up_to(fit, largest_useful);
  measured.source = "probe on cpu at " + list_batches(fit);
  if (fit.measured()) store_or_warn(cache, key, measured, scope + " (cpu measurement)");
  return fit;
}

// The micro-batch sizes a plan on a GPU times: powers of two from 16 (or less) up to the largest
// it could use (the per-rank batch in fixed mode, the largest scaled one in scale mode) that fits;
// at most 7.
std::vector<int64_t> throughput_sizes(const Config& config, const MemoryEvidence& evidence, int world_size) {
  const int64_t top = std::min(evidence.max_micro_batch, largest_useful_micro_batch(config, world_size));
  std::vector<int64_t> sizes;
  for (int64_t b = std::min<int64_t>(16, top); b > 0 && b <= top && sizes.size() < 7; b *= 2) sizes.push_back(b);
  return sizes;
}

// Chooses by throughput among every size timed that fits (the plan cache keeps the sizes earlier
// plans timed); sizes beyond what fits now (timed with more memory free, or above an
// out-of-memory trial) are dropped.
void choose_among_timed(MemoryEvidence& evidence) {
  evidence.throughput.erase(std::remove_if(evidence.throughput.begin(), evidence.throughput.end(),
                                           [&](const std::pair<int64_t, double>& t) {
                                             return t.first > evidence.max_micro_batch || !(t.second > 0);
                                           }),
                            evidence.throughput.end());
  std::vector<ProbePoint> compared;
  for (const auto& [batch, rate] : evidence.throughput) {
    ProbePoint p;
    p.batch = batch;
    p.seconds_per_step = static_cast<double>(batch) / rate;
    compared.push_back(p);
  }
  evidence.throughput_choice = choose_by_throughput(compared);
}

// Times those of `sizes` the evidence has no rate for yet (all of them after a fresh probe) and
// merges them in; a size that runs out of memory caps the micro-batch below it (confirmation by
// trial). Returns how many sizes it timed.
size_t complete_throughput(MemoryEvidence& evidence, const std::vector<int64_t>& sizes, models::Model& model,
                           const ProbeOptions& options) {
  std::vector<int64_t> missing;
  for (const int64_t b : sizes) {
    const bool timed = std::any_of(evidence.throughput.begin(), evidence.throughput.end(),
                                   [b](const std::pair<int64_t, double>& t) { return t.first == b; });
    if (!timed && b <= evidence.max_micro_batch) missing.push_back(b);
  }
  if (!missing.empty()) {
    for (const ProbePoint& p : probe_throughput(model, options, missing)) {
      if (p.oom) {
        evidence.max_micro_batch = std::min(evidence.max_micro_batch, p.batch - 1);
        evidence.source += "; out of memory at " + std::to_string(p.batch) + " in trial";
      } else if (p.seconds_per_step > 0) {
        evidence.throughput.emplace_back(p.batch, static_cast<double>(p.batch) / p.seconds_per_step);
      }
    }
    std::sort(evidence.throughput.begin(), evidence.throughput.end());
  }
  choose_among_timed(evidence);
  return missing.size();
}

// Measures (or, for a named device, estimates) memory per micro-batch and, on a real GPU,
// throughput per micro-batch. Empty evidence when the user fixed the micro-batch.
MemoryEvidence gather_evidence(const Config& config, const DeviceProfile& device, const Plan& draft,
                               models::Model& model, const std::vector<int64_t>& input_shape, int64_t num_classes,
                               const data::Dataset* train, int world_size) {
  MemoryEvidence evidence;
  if (config.tuning.micro_batch > 0 || !config.tuning.probe) return evidence;
  // A model with its own loss is probed with a real target (the probe cannot make one up); a first
  // sample that does not load (data.on_error skip) leaves the probe's zeros.
  torch::Tensor example_target;
  if (train && model.has_own_loss() && train->size() > 0) {
    try {
      example_target = train->get(0, config.trainer.seed).target;
    } catch (const std::exception&) {
    }
  }
  PlanCache cache(config.tuning.cache_dir);
  const PlanCacheKey key = cache_key(config, device, draft, model, input_shape, world_size);
  const std::string entry = cache.dir() + "/" + key.hash() + ".json";
  const std::string scope = cache_scope(config);
  const int64_t free_bytes = device.named ? device.total_memory : device.free_memory;
  const int64_t budget_bytes = static_cast<int64_t>(static_cast<double>(free_bytes) * config.tuning.memory_fraction);
  const int64_t largest_useful = largest_useful_micro_batch(config, world_size);

  ProbeOptions options;
  options.input_shape = input_shape;
  options.num_classes = num_classes;
  options.example_target = example_target;
  options.optim = config.optim;
  options.target_fraction = target_fraction(config);
  const bool probe_here = !device.named;  // a named device is planned from a probe on this machine
  options.device = probe_here ? device.device_string() : "cpu";
  options.bf16 = probe_here && draft.precision == "bf16";
  options.fp16 = probe_here && draft.precision == "fp16";  // measured in the precision the run trains in
  options.channels_last = probe_here && draft.channels_last;
  const bool time_sizes = device.is_cuda() && probe_here;

  const auto hit = cache.find(key);
  // A measurement taken while another process held memory (or before some was freed) caps the
  // micro-batch below what fits now, and sizes above its budget were never tried: with over 10%
  // more memory free now, measure again, if that cap is what limits this plan. (A named device's
  // budget is its datasheet memory.)
  const bool budget_grew = hit && !device.named && hit->budget_bytes > 0 &&
                           budget_bytes > hit->budget_bytes + hit->budget_bytes / 10 &&
                           hit->max_micro_batch < largest_useful;
  const std::string too_short = hit ? slope_too_short(*hit, largest_useful) : "";
  if (hit && !budget_grew && too_short.empty()) {
    // The sizes this plan could use that no plan timed yet (another global batch, scale mode):
    // timed now and added to the entry. Nothing else is measured again.
    MemoryEvidence measured = *hit;
    const std::vector<int64_t> sizes =
        time_sizes ? throughput_sizes(config, with_current_budget(measured, budget_bytes), world_size)
                   : std::vector<int64_t>{};
    const size_t timed = complete_throughput(measured, sizes, model, options);
    if (timed == 0) {
      log::info("plan cache hit: " + entry + " (no probe)");
    } else {
      log::info(log::str("plan cache hit: ", entry, " (memory measured earlier; timed ", timed,
                         " micro-batch size", timed > 1 ? "s" : "", " no earlier plan needed)"));
      store_or_warn(cache, key, measured, scope);
    }
    evidence = with_current_budget(measured, budget_bytes);  // another process may hold memory it did not
    choose_among_timed(evidence);
    evidence.source = "plan cache " + key.hash() + ", from " + evidence.source;
    return evidence;
  }
  if (budget_grew) {
    log::info("plan cache: " + entry + " was measured with a " +
              log::fixed(std::ldexp(static_cast<double>(hit->budget_bytes), -30), 1) + " GiB budget, " +
              log::fixed(std::ldexp(static_cast<double>(budget_bytes), -30), 1) + " GiB now: measuring again");
  } else if (!too_short.empty()) {
    log::info("plan cache: " + entry + ": " + too_short + "; measuring again");
  } else {
    for (const auto& change : cache.changes(key, scope)) log::info("plan cache miss: " + change);
  }

  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int64_t> batches = time_sizes ? std::vector<int64_t>{8, 16, 32} : std::vector<int64_t>{2, 4};
  std::string batch_list;
  for (size_t i = 0; i < batches.size(); ++i) batch_list += (i ? ", " : "") + std::to_string(batches[i]);
  MemoryFit fit;
  bool measurement_cached = false;
  if (device.named) {
    // The measurement behind a named-device plan depends on neither the device nor the batch
    // settings: plans for a T4, then an A100, then another global batch share one probe.
    fit = cpu_measurement_for_named_device(config, model, options, batches, batch_list, cache, scope,
                                           measurement_cached);
  } else {
    fit = probe_with_activations_in_view(model, options, batches, largest_useful);
    if (!fit.measured() && device.is_cuda()) {
      // Even the smallest size ran out of memory: measure below it, keeping those points.
      std::vector<ProbePoint> points = probe_memory(model, options, {1, 2, 4}).points;
      points.insert(points.end(), fit.points.begin(), fit.points.end());
      fit = fit_memory(std::move(points));
      batch_list = "1, 2, 4, " + batch_list;
    }
    evidence.slope_known_up_to = slope_known_up_to(fit, largest_useful);
  }
  if (!measurement_cached) batch_list = list_batches(fit);
  evidence.fixed_bytes = fit.fixed_bytes;
  evidence.per_sample_bytes = fit.per_sample_bytes;
  evidence.budget_bytes = budget_bytes;
  evidence.source = "probe on " + options.device + (options.bf16 ? " (bf16)" : options.fp16 ? " (fp16)" : "") + " at " + batch_list +
                    (measurement_cached ? " (measured earlier, from the plan cache)" : "");
  if (device.named) {
    // Activations dominate the per-sample cost and halve in bf16/fp16; weights, gradients and
    // optimizer state stay fp32. The CUDA context and cuDNN workspaces take about 1 GiB.
    evidence.estimate = true;
    if (draft.precision != "fp32") fit.per_sample_bytes *= 0.5;
    fit.fixed_bytes += int64_t{1} << 30;
    evidence.fixed_bytes = fit.fixed_bytes;
    evidence.per_sample_bytes = fit.per_sample_bytes;
    evidence.source += ", converted to " + draft.precision + " on " + device.name;
  }
  evidence.max_micro_batch = fit.max_batch(evidence.budget_bytes);
  // Throughput at powers of two up to what fits and what the per-rank batch needs.
  if (time_sizes && evidence.max_micro_batch > 0) {
    complete_throughput(evidence, throughput_sizes(config, evidence, world_size), model, options);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log::info(log::str("measured in ", log::fixed(seconds, 1), " s: ", evidence.source));
  store_or_warn(cache, key, evidence, scope);
  return evidence;
}

// Every rank resolves its own plan from its own device and probe; they must run the same one.
// The micro-batch becomes the smallest any rank chose (it divides the same per-rank batch
// everywhere), and then every number that shapes the collectives must match.
// The keys besides the trajectory's that every rank must share: they decide when the ranks meet
// (evaluations, checkpoints, logged rows, early stops, rollbacks, out-of-memory redos) and how the
// gradients travel (the buckets of the all-reduce).
constexpr const char* kCollectiveKeys[] = {
    "trainer.eval_every_steps", "trainer.eval_batch",     "trainer.early_stop_patience",
    "trainer.early_stop_min_delta", "trainer.on_nonfinite", "trainer.max_rollbacks",
    "tuning.oom_recovery",      "tuning.cuda_graphs",     "checkpoint.every_steps",
    "checkpoint.best",          "logging.every_steps",    "distributed.backend",
    "distributed.bucket_mb",    "distributed.first_bucket_mb", "distributed.find_unused_parameters"};

// A value's text as a number the ranks can compare with one collective (a 64-bit hash).
int64_t text_hash(const std::string& text) { return static_cast<int64_t>(data::Fingerprint().add(text).value()); }

void agree_across_ranks(Plan& plan, const Config& config, const DeviceProfile& device, PlanInputs inputs,
                        const data::Dataset* train, const data::Dataset* val, dist::Group& group) {
  // First what must be the same before any plan is compared: the config the ranks train by and
  // their data. A rank given another config, or a partial copy of the data, would otherwise train
  // on (silently wrong), or fail in a collective that does not match (a crash, or a hang until
  // distributed.timeout_s) with no word of the cause.
  {
    std::vector<std::string> what, have;
    std::vector<int64_t> numbers;
    for (const ConfigValue& v : config_values(config)) {
      const bool collective = std::any_of(std::begin(kCollectiveKeys), std::end(kCollectiveKeys),
                                          [&v](const char* key) { return v.key == key; });
      if (v.on_resume != OnResume::Trajectory && !collective) continue;
      what.push_back("key '" + v.key + "'");
      have.push_back(v.value);
      numbers.push_back(text_hash(v.value));
    }
    const auto data_entry = [&](const char* name, const data::Dataset* d) {
      what.push_back(name);
      have.push_back(d == nullptr ? std::string("none")
                                  : log::str(d->size(), " samples (", d->describe(), ")"));
      numbers.push_back(d == nullptr ? -1 : d->size());
      if (d == nullptr || d->fingerprint() == 0) return;
      what.push_back(std::string(name) + "'s content");
      char hex[17];
      std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(d->fingerprint()));
      have.push_back(log::str("fingerprint ", hex, " of ", d->describe()));
      numbers.push_back(static_cast<int64_t>(d->fingerprint()));
    };
    data_entry("the training set", train);
    data_entry("the validation set", val);
    const auto ranges = group.ranges(numbers);
    for (size_t i = 0; i < numbers.size(); ++i) {
      if (ranges[i].first == ranges[i].second) continue;
      const std::string message = log::str("distributed: ", what[i], " differs between the ranks (rank ", group.rank(),
                                           " has ", have[i], "); every rank must train on the same config and the "
                                           "same data (a copy of the data on each node must be complete)");
      if (what[i].rfind("key '", 0) == 0) throw ConfigError(message);
      throw DataError(message);
    }
  }
  const int64_t mine = plan.micro_batch;
  const int64_t agreed = group.reduce_int(mine, dist::ReduceOp::Min);
  if (agreed != mine) {
    Config capped = config;
    capped.tuning.max_micro_batch = agreed;
    plan = make_plan(capped, device, inputs);
  }
  for (auto& d : plan.decisions) {
    if (d.name == "micro_batch" && group.size() > 1) {
      d.reason += log::str("; agreed across ", group.size(), " ranks (smallest choice", agreed != mine ?
                           log::str(", this rank alone would use ", mine) : std::string(), ")");
    }
  }
  // Every number that shapes the collectives or the gradients' scale must match: averaging a rank
  // whose loss is scaled with one whose loss is not would mix gradients 2^16 apart.
  const int64_t precision = plan.precision == "fp32" ? 0 : plan.precision == "bf16" ? 1 : 2;
  const std::vector<int64_t> numbers = {plan.global_batch, plan.accum_steps, plan.micro_batch, precision,
                                        plan.loss_scaling ? 1 : 0};
  const char* names[] = {"global_batch", "accum_steps", "micro_batch", "precision", "loss scaling"};
  const std::string values[] = {std::to_string(plan.global_batch), std::to_string(plan.accum_steps),
                                std::to_string(plan.micro_batch), plan.precision, plan.loss_scaling ? "on" : "off"};
  const auto ranges = group.ranges(numbers);
  for (size_t i = 0; i < numbers.size(); ++i) {
    if (ranges[i].first != ranges[i].second) {
      throw Error(log::str("distributed: the ranks resolved different plans (", names[i], " differs; rank ", group.rank(), " has ",
                           values[i], "); give every rank the same config and the same kind of device"));
    }
  }
}

}  // namespace

void check_runs_here(const Config& config) {
  if (config.tuning.device.empty()) return;
  throw ConfigError(locate_config_error(
      config, log::str("key 'tuning.device': '", config.tuning.device, "' plans for a device profile, for train ",
                       "plan; training and evaluation run on this machine's hardware (trainer.device), so remove ",
                       "tuning.device here, or see the plan with train plan --device ", config.tuning.device)));
}

void check_init_from(const Config& config, const models::Model& model) {
  if (config.model.init_from.empty()) return;
  try {
    check_model_weights(config.model.init_from, model, config.model.init_strict, model.weight_rules());
  } catch (const CheckpointError& e) {
    throw CheckpointError(locate_config_error(config, std::string("key 'model.init_from': ") + e.what()));
  }
}

void check_model_settings(const Config& config, const models::Model& model, bool data_read,
                          const data::Dataset* val) {
  try {
    const std::string& best = config.checkpoint.best;
    const bool own_loss = model.has_own_loss();
    const auto metrics = model.eval_metrics();
    if (best != "none" && best != "loss" && best != "accuracy" && best != "top5" &&
        std::none_of(metrics.begin(), metrics.end(), [&best](const auto& m) { return m.name == best; })) {
      std::string known = "loss";
      if (!own_loss) known += ", accuracy, top5";
      for (const auto& m : metrics) known += ", " + m.name;
      throw ConfigError("key 'checkpoint.best': '" + best + "' is not a measure of model " + config.model.name +
                        "'s evaluations (they report: " + known + "); or none");
    }
    if (own_loss) {
      // Its evaluations have a loss and nothing else, and label smoothing is cross-entropy's.
      if (best == "accuracy" || best == "top5") {
        throw ConfigError("key 'checkpoint.best': " + best + ", but model " + config.model.name +
                          " has its own loss, and its evaluations report that loss alone; use loss or none");
      }
      if (config.loss.label_smoothing > 0) {
        throw ConfigError(log::str("key 'loss.label_smoothing': ", config.loss.label_smoothing, ", but model ",
                                   config.model.name,
                                   " has its own loss (label smoothing is the trainer's cross-entropy's); set it to 0"));
      }
    }
    if (best != "none" && data_read) {
      if (val == nullptr || val->size() == 0) {
        throw ConfigError("key 'checkpoint.best': " + best + " ranks evaluations, but this run has " +
                          (val == nullptr ? "no" : "an empty") + " validation split; set checkpoint.best: none");
      }
      const int64_t classes = val->num_classes();
      if (best == "top5" && classes > 0 && classes <= 5) {
        throw ConfigError(log::str("key 'checkpoint.best': top5 needs more than five classes, the data has ", classes,
                                   " (top-5 accuracy would always be 100%); use accuracy or loss"));
      }
    }
  } catch (const ConfigError& e) {
    throw ConfigError(locate_config_error(config, e.what()));
  }
}

namespace {

// The input a config describes on its own, for planning where the data is not (train plan on
// another machine): token sequences of data.seq_len, or model.in_channels images of
// data.image_size; empty when the config does not say (an image set's own size).
std::vector<int64_t> described_input_shape(const Config& config) {
  if (config.data.kind == "tokens" || config.data.kind == "tsv") return {config.data.seq_len};
  if (config.data.image_size > 0) return {config.model.in_channels, config.data.image_size, config.data.image_size};
  return {};
}

models::ModelPtr model_for_data_unlocated(const Config& config, const data::Dataset& train) {
  const std::vector<int64_t> shape = train.input_shape();
  if (shape.size() == 3 && shape[0] != config.model.in_channels) {
    throw ConfigError("key 'model.in_channels': " + std::to_string(config.model.in_channels) + " but the data (" +
                      train.describe() + ") has " + std::to_string(shape[0]) + " channel(s)");
  }
  if (train.num_classes() > config.model.num_classes) {
    // Named: a stray directory or a header line read as a label shows up here.
    const std::vector<std::string> names = train.class_names();
    std::string listed;
    constexpr size_t kShown = 12;
    for (size_t i = 0; i < names.size() && i < kShown; ++i) listed += (i ? ", " : ": ") + names[i];
    if (names.size() > kShown) listed += log::str(", ... (", names.size() - kShown, " more)");
    throw ConfigError("key 'model.num_classes': " + std::to_string(config.model.num_classes) + " but the data (" +
                      train.describe() + ") has " + std::to_string(train.num_classes()) + " classes" + listed);
  }
  if (const int64_t classes = train.num_classes();
      classes > 0 && classes < config.model.num_classes && config.model.name != "bert-mlm" &&
      config.origins.count("model.num_classes") == 0) {
    // The default (10) left for data with fewer classes: outputs that match no class train to
    // never win, and cost little, but it is seldom meant.
    log::warn(log::str("model.num_classes is ", config.model.num_classes, " (not set), but the data (", train.describe(),
                       ") has ", classes, " classes: ", config.model.num_classes - classes,
                       " of the model's outputs match no class; set model.num_classes: ", classes));
  }
  // The model masks padding out of attention by the id the data pads with.
  ModelConfig model_config = config.model;
  if (const int64_t data_pad = train.pad_id(); data_pad >= 0) {
    if (model_config.pad_id >= 0 && model_config.pad_id != data_pad) {
      throw ConfigError("key 'model.pad_id': " + std::to_string(model_config.pad_id) + ", but the data pads with id " +
                        std::to_string(data_pad) + " (" + train.describe() +
                        "); padding would be attended to. Remove model.pad_id or make it equal");
    }
    model_config.pad_id = data_pad;
  }
  models::ModelPtr model = models::make_model(model_config);
  // What the model can take (its input size, positions, vocabulary) against what the data gives:
  // a mismatch is a config error now, before anything is written, not a failure in the first step.
  const std::string problem = model->input_problem(shape, train.vocab_size());
  if (!problem.empty()) throw ConfigError(problem + " (data: " + train.describe() + ")");
  return model;
}

// Milliseconds since this process started (Linux: its start time in /proc/self/stat against the
// uptime, to the clock tick), or -1 where that cannot be read.
double ms_since_process_start() {
  std::ifstream stat("/proc/self/stat"), uptime("/proc/uptime");
  std::string line;
  double up = 0;
  if (!std::getline(stat, line) || !(uptime >> up)) return -1;
  // Field 22 (starttime, in clock ticks since boot) counts from the field after the command
  // name, which may itself hold spaces and parentheses: fields 3 onwards follow its last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(line.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return -1;
  }
  const long ticks = sysconf(_SC_CLK_TCK);
  if (ticks <= 0) return -1;
  const double started = std::strtod(field.c_str(), nullptr) / static_cast<double>(ticks);
  return std::max(0.0, (up - started) * 1000.0);
}

RunParts prepare_run_unlocated(const Config& config, const RunOptions& options) {
  if (!options.data_optional) check_runs_here(config);
  if (options.val_data && !options.train_data) {
    throw ConfigError("RunOptions::val_data without RunOptions::train_data: give the training set too (data.kind: "
                      "custom), or neither to build both from the config's data section");
  }
  if (options.train_data && config.data.kind != "custom") {
    throw ConfigError("key 'data.kind': '" + config.data.kind + "', but the program passes its own datasets "
                      "(RunOptions::train_data); set data.kind: custom, so that the config says where the data "
                      "comes from");
  }
  const auto started = std::chrono::steady_clock::now();
  RunParts r;
  r.config = config;
  const dist::Env& env = options.env;
  const int64_t world_size = options.plan_world_size > 0 ? options.plan_world_size : env.world_size;
  // Where a cache hit's time goes, for its log line: the device, the data, the model.
  auto lap = [last = started]() mutable {
    const auto now = std::chrono::steady_clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - last).count();
    last = now;
    return ms;
  };
  r.device = config.tuning.device.empty() ? detect_device(config.trainer.device, static_cast<int>(env.local_rank))
                                          : named_device(config.tuning.device);
  const double device_ms = lap();
  if (r.device.is_cuda() && options.plan_world_size == 0 && env.local_world_size > 1 && r.device.visible_gpus > 1 &&
      config.trainer.device.rfind("cuda:", 0) == 0 && config.distributed.backend != "gloo") {
    // NCCL takes one GPU per rank; an explicit index would put every local rank on the same one.
    throw ConfigError(log::str("key 'trainer.device': '", config.trainer.device, "' puts all ", env.local_world_size,
                               " ranks of this node on one GPU while ", r.device.visible_gpus,
                               " are visible; use trainer.device: cuda or auto (local rank r takes GPU r)"));
  }
  std::vector<int64_t> shape;
  int64_t num_classes = config.model.num_classes;
  try {
    if (options.train_data) {
      r.train = options.train_data;
      r.val = options.val_data;
    } else {
      DataConfig data_config = config.data;  // with data.uint8 resolved for this device
      data_config.uint8 = resolve_uint8_batches(config, r.device) ? "on" : "off";
      r.train = data::make_dataset(data_config, data::Split::Train);
      r.val = data::make_dataset(data_config, data::Split::Val);
    }
    shape = r.train->input_shape();
    num_classes = r.train->num_classes();
  } catch (const DataError& e) {
    if (!options.data_optional) throw;
    shape = described_input_shape(config);
    if (shape.empty()) {
      throw DataError(std::string(e.what()) + "; to plan without the data, set data.image_size (the input's height "
                      "and width; with model.in_channels, the input's shape)", e.exit_code());
    }
    std::string input = shape.size() == 1 ? "sequences of " + std::to_string(shape[0]) + " tokens" : "";
    for (size_t i = 0; shape.size() > 1 && i < shape.size(); ++i) input += (i ? "x" : "") + std::to_string(shape[i]);
    log::warn("data not readable here (" + locate_data_error(config, e.what()) + "); planning for input " + input +
              " from the config");
  }
  const double data_ms = lap();
  torch::manual_seed(static_cast<uint64_t>(config.trainer.seed));
  r.model = r.train ? model_for_data_unlocated(config, *r.train) : models::make_model(config.model);
  check_model_settings(config, *r.model, r.train != nullptr, r.val.get());
  const double model_ms = lap();

  if (!env.note.empty() && options.plan_world_size == 0) log::warn(env.note);
  // Join the job before the plan: the ranks must agree on it. A rank that failed above (bad
  // data, bad config) has exited already, and its launcher stops the others.
  if (options.plan_world_size == 0 && env.distributed()) {
    if (!config.tuning.device.empty()) {
      throw ConfigError("key 'tuning.device': a named device profile plans for hardware that is not here; it cannot "
                        "be used for a distributed run (" + env.describe() + ")");
    }
    DistributedConfig distributed = config.distributed;
    if (distributed.backend == "nccl" && r.device.is_cuda() && env.local_world_size > r.device.visible_gpus) {
      throw ConfigError(log::str("key 'distributed.backend': nccl takes one GPU per rank, but ", env.local_world_size,
                                 " ranks on this node share ", r.device.visible_gpus,
                                 " visible GPU(s); use gloo or auto, or fewer ranks per node"));
    }
    if (distributed.backend == "auto" && r.device.is_cuda() && env.local_world_size > r.device.visible_gpus) {
      // NCCL refuses two ranks on one GPU ("Duplicate GPU detected") at its first collective.
      distributed.backend = "gloo";
      log::warn(log::str("distributed: ", env.local_world_size, " ranks on this node share ", r.device.visible_gpus,
                         " visible GPU(s); NCCL takes one GPU per rank, so the backend is gloo (slower: the "
                         "gradients cross through host memory)"));
    }
    r.group = dist::Group::create(env, distributed, r.device.device_string());
    log::info("distributed: " + env.describe() + ", backend " + r.group->backend());
  }

  PlanInputs inputs;
  inputs.world_size = world_size;
  inputs.rank = env.rank;
  // `train plan --world-size N` plans N ranks on one host unless --local-world-size says fewer
  // share it (several hosts): threads and workers divide this host's cores among them.
  // (The roll call corrects the local world size that RANK and WORLD_SIZE alone leave to a guess.)
  inputs.local_world_size = options.plan_world_size == 0         ? (r.group ? r.group->env() : env).local_world_size
                            : options.plan_local_world_size > 0 ? options.plan_local_world_size
                                                                : options.plan_world_size;
  inputs.model_params = models::count_parameters(*r.model);
  inputs.convolutional = r.model->is_convolutional();
  inputs.narrowest_conv = narrowest_convolution(*r.model);
  // Without the data, what its kind implies: TSV batches pad to their longest text.
  inputs.static_shapes = r.train ? r.train->static_shapes() : config.data.kind != "tsv";
  inputs.capturable = r.model->capturable();
  inputs.optimizer_state_per_parameter = optimizer_state_per_parameter(config.optim);  // (an unknown name stops here)
  if (!inputs.static_shapes) {
    inputs.varying_shapes = r.train ? r.train->describe() : "data.kind tsv: each batch padded to its longest text";
  }
  // Precision and layout decide what the probe measures; the probe then bounds the micro-batch.
  const Plan draft = make_plan(config, r.device, inputs);
  apply_plan_globals(draft);  // the probe measures under the run's threads and cuDNN settings
  inputs.memory = gather_evidence(config, r.device, draft, *r.model, shape, num_classes, r.train.get(),
                                  static_cast<int>(world_size));
  r.plan = make_plan(config, r.device, inputs);
  if (inputs.memory.source.rfind("plan cache", 0) == 0) {
    // What a cache hit costs once the process is up (the rest is loading LibTorch and, on a GPU,
    // creating the CUDA context).
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    const double since_start = ms_since_process_start();
    log::info(log::str("plan ready in ", log::fixed(ms, 0), " ms (device ", log::fixed(device_ms, 0), ", data ",
                       log::fixed(data_ms, 0), ", model ", log::fixed(model_ms, 0), ", the rest ",
                       log::fixed(ms - device_ms - data_ms - model_ms, 0), "): memory from the plan cache",
                       since_start >= 0 ? "; the process started " + log::fixed(since_start, 0) +
                                              " ms ago (the rest of that: loading LibTorch and its CUDA libraries, "
                                              "reading the config)"
                                        : std::string()));
  }
  if (r.group) {
    // A rank that measures memory can take longer than distributed.timeout_s while one that hit
    // the plan cache waits in the agreement's first collective.
    r.group->wait_for_all("measuring memory for the plan", config.distributed.init_timeout_s,
                          "distributed.init_timeout_s");
    agree_across_ranks(r.plan, config, r.device, inputs, r.train.get(), r.val.get(), *r.group);
  }
  if (config.tuning.micro_batch == 0 && config.tuning.probe && env.rank == 0) {
    // A micro-batch that ran out of memory during training caps the next run's plan.
    r.record_oom = [dir = config.tuning.cache_dir, key = cache_key(config, r.device, draft, *r.model, shape,
                                                                    static_cast<int>(world_size)),
                    scope = cache_scope(config), evidence = inputs.memory](int64_t failed, int64_t fits) mutable {
      evidence.max_micro_batch = evidence.max_micro_batch > 0 ? std::min(evidence.max_micro_batch, fits) : fits;
      // Stored as measured: a plan that reads it back says itself that it came from the cache.
      const std::string from_cache = "plan cache " + key.hash() + ", from ";
      if (evidence.source.rfind(from_cache, 0) == 0) evidence.source.erase(0, from_cache.size());
      evidence.source += (evidence.source.empty() ? "" : "; ") +
                         log::str("out of memory at micro-batch ", failed, " during training");
      PlanCache cache(dir);
      if (store_or_warn(cache, key, evidence, scope)) {
        log::info(log::str("plan cache: recorded micro-batch ", fits, " as the largest that fits (",
                           cache.dir(), "/", key.hash(), ".json)"));
      }
    };
  }
  if (r.train) {
    finalize_schedule(r.plan, config, r.train->size());
  } else {
    defer_schedule(r.plan, config);
  }
  for (const PlanDecision& d : r.plan.decisions) {
    for (const std::string& w : d.warnings) log::warn("plan: " + d.name + " " + d.value + ": " + w);
  }
  return r;
}

}  // namespace

RunParts prepare_run(const Config& config, const RunOptions& options) {
  validate_config(config);  // a config built or changed in code gets the file's checks
  try {
    return prepare_run_unlocated(config, options);
  } catch (const ConfigError& e) {
    // The dataset factory, the model registry and the plan name keys; the error gets the file,
    // line and column (or --set) where the key was set, like the parser's own.
    throw ConfigError(locate_config_error(config, e.what()));
  } catch (const DataError& e) {
    throw DataError(locate_data_error(config, e.what()), e.exit_code());
  }
}

models::ModelPtr make_model_for_data(const Config& config, const data::Dataset& train) {
  try {
    return model_for_data_unlocated(config, train);
  } catch (const ConfigError& e) {
    throw ConfigError(locate_config_error(config, e.what()));
  }
}

void apply_plan_globals(const Plan& plan) {
  at::set_num_threads(static_cast<int>(plan.threads));
  if (plan.device.is_cuda() && !plan.device.named) {
    compat::set_allow_tf32(plan.tf32);
    compat::set_cudnn_benchmark(plan.cudnn_benchmark);
  }
}

}  // namespace train
