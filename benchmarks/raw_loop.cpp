// The baseline for the trainer's own overhead: the run of `train fit CONFIG` written as the minimal
// training loop a LibTorch user would write by hand. Same config file, same model (built by train's
// registry), same data (the IDX files, normalised, reshuffled every epoch, batches gathered by
// index from one tensor), same SGD settings, threads and step count; nothing else: no loader
// threads, no plan, no checkpoints, no metrics files.
//
//   bench_raw_loop CONFIG [--set key=value]... [--optim torch|fused] [--no-eval]
//
// --optim torch (default) steps with torch::optim::SGD, one parameter at a time, as a hand-written
// loop would; --optim fused calls LibTorch's fused SGD kernel once per group and step (LibTorch
// >= 2.4), as train's `optim.impl: auto` does on CPU. Weight decay follows train's make_optimizer: only on
// tensors of 2+ dimensions (not biases and normalisation weights) unless optim.decay_norm_and_bias;
// with weight_decay 0 all parameters are one group, as a hand-written loop has them. The memory
// format is the plan's: precision.channels_last on/off as given, auto = channels_last when this
// LibTorch has oneDNN and every 2-D convolution has 16+ output channels (train's plan on a CPU,
// libtrain/src/plan.cpp). Output: the
// JSON lines of benchmarks/fit.py (one per logging window, in the shape of train's metrics.jsonl
// records, then a summary with "done").
#include <train/amp.h>
#include <train/config.h>
#include <train/data/idx.h>
#include <train/models/model.h>

#include <sched.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string config;
  std::vector<std::string> overrides;
  std::string optim = "torch";
  bool eval = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--set" && has_value) {
      a.overrides.push_back(argv[++i]);
    } else if (arg == "--optim" && has_value) {
      a.optim = argv[++i];
    } else if (arg == "--no-eval") {
      a.eval = false;
    } else if (arg.rfind("--", 0) != 0 && a.config.empty()) {
      a.config = arg;
    } else {
      throw std::invalid_argument("unknown or incomplete argument '" + arg + "'");
    }
  }
  if (a.config.empty()) throw std::invalid_argument("usage: bench_raw_loop CONFIG [--set k=v]... [--optim torch|fused]");
  if (a.optim != "torch" && a.optim != "fused") throw std::invalid_argument("--optim must be torch or fused");
  return a;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what + "; bench_raw_loop reproduces only the benchmark configs' settings");
}

// The settings benchmarks/fit.py accepts too.
void check_supported(const train::Config& c) {
  require(c.data.kind == "idx", "data.kind " + c.data.kind);
  require(!c.data.random_crop && !c.data.random_flip, "data augmentation");
  require(c.data.drop_last, "data.drop_last false");
  require(c.optim.name == "sgd", "optim.name " + c.optim.name);
  require(c.optim.clip_grad_norm == 0, "optim.clip_grad_norm");
  require(c.schedule.name == "constant", "schedule.name " + c.schedule.name);
  require(c.schedule.warmup_steps == 0 && c.schedule.warmup_epochs == 0, "a warmup");
  require(c.loss.label_smoothing == 0, "loss.label_smoothing");
  require(c.precision.mode == "auto" || c.precision.mode == "fp32", "precision.mode " + c.precision.mode);
  require(c.trainer.max_steps > 0 && c.trainer.epochs == 0, "trainer.max_steps must be set, epochs not");
  require(c.model.init_from.empty(), "model.init_from");
}

// [N, 1, H, W] floats in [0, 1], normalised with data.mean / data.std, and int64 labels.
std::pair<torch::Tensor, torch::Tensor> load_split(const train::DataConfig& d, bool train) {
  auto images = train::data::read_idx_images(train::data::find_data_file(d.root, train ? d.train_images : d.val_images));
  auto labels = train::data::read_idx_labels(train::data::find_data_file(d.root, train ? d.train_labels : d.val_labels));
  auto x = images.to(torch::kFloat).div_(255.0);
  if (!d.mean.empty()) {
    x = (x - torch::tensor(d.mean, torch::kFloat).view({1, -1, 1, 1})) / torch::tensor(d.std, torch::kFloat).view({1, -1, 1, 1});
  }
  return {x.contiguous(), labels};
}

int64_t available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

// The parameters with the weight decay each gets, in train's make_optimizer groups (empty groups
// left out); one group when there is no weight decay.
struct ParamGroup {
  std::vector<torch::Tensor> params;
  double weight_decay;
};

std::vector<ParamGroup> param_groups(torch::nn::Module& model, const train::OptimConfig& o) {
  std::vector<torch::Tensor> all = model.parameters();
  if (o.weight_decay == 0 || o.decay_norm_and_bias) return {{all, o.weight_decay}};
  ParamGroup decay{{}, o.weight_decay}, no_decay{{}, 0.0};
  for (auto& p : all) (p.dim() > 1 ? decay : no_decay).params.push_back(p);
  std::vector<ParamGroup> out;
  for (auto* g : {&decay, &no_decay}) {
    if (!g->params.empty()) out.push_back(std::move(*g));
  }
  return out;
}

// One fused SGD step per group (momentum buffers filled by the first call).
class FusedSgd {
 public:
  FusedSgd(std::vector<ParamGroup> groups, double lr, double momentum, bool nesterov)
      : groups_(std::move(groups)), lr_(lr), momentum_(momentum), nesterov_(nesterov) {
    for (auto& g : groups_) {
      buffers_.emplace_back();
      for (auto& p : g.params) buffers_.back().push_back(torch::empty_like(p));
    }
  }
  void zero_grad() {
    for (auto& g : groups_) {
      for (auto& p : g.params) p.mutable_grad().reset();
    }
  }
  void step() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < groups_.size(); ++i) {
      const auto& params = groups_[i].params;
      std::vector<torch::Tensor> grads;
      grads.reserve(params.size());
      for (const auto& p : params) grads.push_back(p.grad());
      at::_fused_sgd_(params, grads, momentum_ != 0 ? buffers_[i] : std::vector<torch::Tensor>{},
                      groups_[i].weight_decay, momentum_, lr_, /*dampening=*/0.0, nesterov_, /*maximize=*/false,
                      first_);
    }
    first_ = false;
#else
    throw std::runtime_error("--optim fused needs LibTorch 2.4 or later (CPU _fused_sgd_)");
#endif
  }

 private:
  std::vector<ParamGroup> groups_;
  std::vector<std::vector<torch::Tensor>> buffers_;
  double lr_, momentum_;
  bool nesterov_;
  bool first_ = true;
};

std::string json_number(double v) {
  std::ostringstream out;
  out.precision(10);
  out << v;
  return out.str();
}

int run(const Args& a) {
  const train::Config c = train::load_config(a.config, a.overrides);
  check_supported(c);
  const int64_t threads = c.trainer.threads > 0 ? c.trainer.threads : available_cores();
  at::set_num_threads(static_cast<int>(threads));
  torch::manual_seed(static_cast<uint64_t>(c.trainer.seed));
  const int64_t batch = c.trainer.global_batch, max_steps = c.trainer.max_steps;
  const int64_t log_every = std::max<int64_t>(1, c.logging.every_steps);

  auto [images, labels] = load_split(c.data, /*train=*/true);
  auto model = train::models::make_model(c.model);
  model->train();
  int64_t narrowest = 0;  // the fewest output channels of a convolution, as run.cpp finds them
  for (const auto& module : model->modules()) {
    if (const auto* conv = module->as<torch::nn::Conv2dImpl>()) {
      narrowest = narrowest == 0 ? conv->options.out_channels() : std::min(narrowest, conv->options.out_channels());
    }
  }
  const bool channels_last = c.precision.channels_last == "on" ||
                             (c.precision.channels_last == "auto" && model->is_convolutional() && at::hasMKLDNN() &&
                              narrowest >= 16);
  if (channels_last) train::to_channels_last(*model);
  const auto sgd_options = [&](double weight_decay) {
    return torch::optim::SGDOptions(c.optim.lr).momentum(c.optim.momentum).nesterov(c.optim.nesterov).weight_decay(
        weight_decay);
  };
  const std::vector<ParamGroup> groups = param_groups(*model, c.optim);
  std::vector<torch::optim::OptimizerParamGroup> torch_groups;
  for (const auto& g : groups) {
    torch_groups.emplace_back(g.params, std::make_unique<torch::optim::SGDOptions>(sgd_options(g.weight_decay)));
  }
  torch::optim::SGD torch_sgd(torch_groups, sgd_options(c.optim.weight_decay));
  FusedSgd fused_sgd(groups, c.optim.lr, c.optim.momentum, c.optim.nesterov);
  const bool fused = a.optim == "fused";

  auto generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(c.trainer.seed));
  const int64_t n = images.size(0), steps_per_epoch = n / batch;
  auto window_loss = torch::zeros({}, torch::kDouble);
  int64_t step = 0, epoch = 0, window_steps = 0;
  const auto started = Clock::now();
  auto window_start = started;
  double last_loss = 0.0;
  while (step < max_steps) {
    const auto order = c.data.shuffle ? torch::randperm(n, generator, torch::kLong) : torch::arange(n);
    for (int64_t b = 0; b < steps_per_epoch && step < max_steps; ++b) {
      const auto index = order.slice(0, b * batch, (b + 1) * batch);
      auto x = images.index_select(0, index);
      const auto y = labels.index_select(0, index);
      if (channels_last && x.dim() == 4) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
      fused ? fused_sgd.zero_grad() : torch_sgd.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
      loss.backward();
      fused ? fused_sgd.step() : static_cast<void>(torch_sgd.step());
      window_loss += loss.detach();
      ++step;
      ++window_steps;
      if (step % log_every == 0 || step == max_steps) {
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - window_start).count();
        last_loss = window_loss.item<double>() / static_cast<double>(window_steps);
        std::printf("{\"impl\": \"raw\", \"split\": \"train\", \"step\": %lld, \"epoch\": %lld, \"loss\": %s, "
                    "\"step_time_ms\": %s}\n",
                    static_cast<long long>(step), static_cast<long long>(epoch), json_number(last_loss).c_str(),
                    json_number(ms / static_cast<double>(window_steps)).c_str());
        std::fflush(stdout);
        window_loss.zero_();
        window_steps = 0;
        window_start = Clock::now();
      }
    }
    ++epoch;
  }
  const double train_seconds = std::chrono::duration<double>(Clock::now() - started).count();

  std::string accuracy;
  if (a.eval) {
    auto [val_x, val_y] = load_split(c.data, /*train=*/false);
    torch::NoGradGuard no_grad;
    model->eval();
    const int64_t eval_batch = c.trainer.eval_batch > 0 ? c.trainer.eval_batch : batch;
    int64_t correct = 0;
    for (int64_t i = 0; i < val_x.size(0); i += eval_batch) {
      auto x = val_x.slice(0, i, i + eval_batch);
      if (channels_last && x.dim() == 4) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
      const auto logits = model->forward(x);
      correct += logits.argmax(1).eq(val_y.slice(0, i, i + eval_batch)).sum().item<int64_t>();
    }
    accuracy = ", \"accuracy\": " + json_number(static_cast<double>(correct) / static_cast<double>(val_x.size(0)));
  }
  std::printf("{\"impl\": \"raw\", \"done\": true, \"steps\": %lld, \"threads\": %lld, \"train_loss\": %s, "
              "\"train_seconds\": %s, \"optim_impl\": \"%s\", \"channels_last\": %s, \"torch\": \"%d.%d.%d\"%s}\n",
              static_cast<long long>(step), static_cast<long long>(threads), json_number(last_loss).c_str(),
              json_number(train_seconds).c_str(), a.optim.c_str(), channels_last ? "true" : "false",
              TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, accuracy.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "bench_raw_loop: " << e.what() << "\n";
    return 2;
  }
}
