// One BERT masked-LM training step, timed: forward under autocast (the MLM head at the masked
// positions only, as train's trainer runs it) + cross-entropy + backward + AdamW step, on a fixed synthetic batch already on the device. The C++
// side of benchmarks/compare_bert.py; bert_step.py is the same model and loop in Python PyTorch
// eager.
//
//   bench_bert_step --preset bert-base --batch 64 --seq 128 --steps 40 --warmup 10 --window 5
//                   --device cuda --precision bf16|fp32 --attention auto|fused|plain [--threads N]
//                   [--serve 0|1]   (1: set up once, then time and print a line per "run" on stdin)
// Prints one JSON line: {"impl":"cpp", "seq_per_s": median over windows, "min", "max", the
// optimizer path ("adamw fused"), the attention that ran, the model's sizes and parameter count,
// and two checksums of the batch (bert_step.py builds the same batch from the same seed)}.
//
//   bench_bert_step --preset bert-tiny --batch 2 --seq 32 --device cpu --save-check FILE
// Instead of timing, writes the "same model" check file that `bert_step.py --check FILE` reads: the
// model's initial weights by their Hugging Face names, the fixed batch, the eval-mode fp32 logits
// for it, and the losses and weights of --check-steps training steps without dropout (so that the
// loss and the optimizer are compared too, not only the forward function).
#include <train/amp.h>
#include <train/config.h>
#include <train/host_memory.h>
#include <train/models/bert.h>
#include <train/models/model.h>
#include <train/optim.h>
#include <train/safetensors.h>

#include <torch/torch.h>

#include "step_timing.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kMaskId = 103;  // [MASK] in BERT's uncased vocabulary
constexpr double kMaskFraction = 0.15;
constexpr double kLr = 1e-4;

struct Args {
  std::string preset = "bert-base";
  int64_t batch = 64;
  int64_t seq = 128;
  int steps = 40;
  int warmup = 10;
  int window = 5;
  std::string device = "cuda";
  std::string precision = "bf16";
  std::string attention = "auto";
  int threads = 0;  // 0 = LibTorch's default
  std::string save_check;
  int check_steps = 2;
  bool serve = false;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "bench_bert_step: " << message << "\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage_error("missing value for " + k);
    const std::string v = argv[i + 1];
    if (k == "--preset") a.preset = v;
    else if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--seq") a.seq = std::stoll(v);
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else if (k == "--window") a.window = std::stoi(v);
    else if (k == "--device") a.device = v;
    else if (k == "--precision") a.precision = v;
    else if (k == "--attention") a.attention = v;
    else if (k == "--threads") a.threads = std::stoi(v);
    else if (k == "--save-check") a.save_check = v;
    else if (k == "--check-steps") a.check_steps = std::stoi(v);
    else if (k == "--serve") {
      if (v != "0" && v != "1") usage_error("--serve is 0 or 1, got " + v);
      a.serve = v == "1";
    }
    else usage_error("unknown argument " + k);
  }
  if (a.precision != "bf16" && a.precision != "fp32") usage_error("--precision is bf16 or fp32, got " + a.precision);
  if (a.attention != "auto" && a.attention != "fused" && a.attention != "plain") {
    usage_error("--attention is auto, fused or plain, got " + a.attention);
  }
  if (a.batch < 1 || a.seq < 1 || a.steps < 1 || a.window < 1 || a.warmup < 0 || a.check_steps < 0) {
    usage_error("--batch, --seq, --steps and --window must be >= 1, --warmup and --check-steps >= 0");
  }
  return a;
}

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

// The fixed MLM batch, built on the CPU from its own seed (bert_step.py makes the same one): ids
// uniform in [1, vocab) (never the pad id 0, so no attention is masked), each position a target
// with probability 0.15; a target's label is its id and its input [MASK], every other label -100.
struct MlmBatch {
  torch::Tensor input, labels;
};

MlmBatch make_batch(int64_t batch, int64_t seq, int64_t vocab, const torch::Device& device) {
  torch::manual_seed(1);
  const auto ids = torch::randint(1, vocab, {batch, seq}, torch::kLong);
  const auto chosen = torch::rand({batch, seq}) < kMaskFraction;
  return {ids.masked_fill(chosen, kMaskId).to(device), ids.masked_fill(chosen.logical_not(), -100).to(device)};
}

const char* attention_name(train::models::BertAttention a) {
  return a == train::models::BertAttention::kFused ? "fused" : "plain";
}

int run(const Args& a) {
  const bool check = !a.save_check.empty();
  const torch::Device device(a.device);
  if (a.threads > 0) at::set_num_threads(a.threads);
  // As resnet_step: TF32 matmuls allowed when timing fp32 on a GPU; the check compares fp32 exactly.
  at::globalContext().setAllowTF32CuBLAS(!check);

  train::ModelConfig mc;
  mc.name = "bert-mlm";
  mc.preset = a.preset;
  mc.attention = a.attention;
  mc.dropout = check ? 0.0 : 0.1;  // the check's training steps must be deterministic
  torch::manual_seed(0);
  auto model = train::models::make_model(mc);
  auto& bert = dynamic_cast<train::models::BertModel&>(*model);
  const auto& sizes = bert.options();
  model->to(device);
  model->train();
  train::OptimConfig oc;
  oc.name = "adamw";
  oc.weight_decay = 0.01;
  oc.beta1 = 0.9;
  oc.beta2 = 0.999;
  oc.eps = 1e-6;
  auto optimizer = train::make_optimizer(oc, *model, kLr);

  const MlmBatch data = make_batch(a.batch, a.seq, sizes.vocab_size, device);
  const bool bf16 = a.precision == "bf16" && !check;
  const int64_t vocab = sizes.vocab_size;

  auto step = [&] {
    optimizer->zero_grad();
    torch::Tensor loss;
    {
      train::AutocastScope amp(device.type(), torch::kBFloat16, bf16);
      // As train's trainer does: the MLM head (and its vocabulary-sized logits) only at the
      // positions that have a target.
      const auto has_target = data.labels.ne(-100);
      const auto logits = model->forward_selected(data.input, has_target);
      loss = torch::nn::functional::cross_entropy(logits.view({-1, vocab}).to(torch::kFloat),
                                                  data.labels.masked_select(has_target));
    }
    loss.backward();
    optimizer->step();
    return loss;
  };

  if (check) {
    train::TensorMap out;
    for (const auto& [name, tensor] : train::state_dict(*model)) out["initial." + name] = tensor.cpu().clone();
    out["check.input"] = data.input.cpu();
    out["check.labels"] = data.labels.cpu();
    {
      torch::NoGradGuard no_grad;
      model->eval();
      out["check.eval_logits"] = model->forward(data.input).cpu();
      model->train();
    }
    std::vector<torch::Tensor> losses;
    for (int i = 0; i < a.check_steps; ++i) losses.push_back(step().detach().cpu().view({1}));
    out["check.losses"] = losses.empty() ? torch::zeros({0}) : torch::cat(losses);
    for (const auto& [name, tensor] : train::state_dict(*model)) out["after." + name] = tensor.cpu();
    train::write_safetensors(
        a.save_check, out,
        {{"written_by", "benchmarks/bert_step.cpp (bench_bert_step --save-check)"},
         {"preset", a.preset},
         {"batch", std::to_string(a.batch)},
         {"seq", std::to_string(a.seq)},
         {"device", a.device},
         {"attention", attention_name(bert.attention())},
         {"optimizer", train::optimizer_impl(*optimizer)},
         {"lr", std::to_string(kLr)},
         {"check_steps", std::to_string(a.check_steps)},
         {"torch", std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                       std::to_string(TORCH_VERSION_PATCH)}});
    std::cout << "{\"impl\":\"cpp\",\"check_file\":\"" << a.save_check << "\",\"attention\":\""
              << attention_name(bert.attention()) << "\",\"optimizer\":\"" << train::optimizer_impl(*optimizer)
              << "\"}" << std::endl;
    return 0;
  }

  return bench::run_or_serve(a.serve, [&] {
    const bench::Rates rates =
        bench::time_windows(step, [&] { sync(device); }, a.warmup, a.steps, a.window, a.batch);
    std::cout << "{\"impl\":\"cpp\",\"pid\":" << getpid() << ",\"preset\":\"" << a.preset << "\",\"layers\":" << sizes.num_layers
              << ",\"hidden\":" << sizes.hidden_size << ",\"heads\":" << sizes.num_heads
              << ",\"intermediate\":" << sizes.intermediate_size << ",\"vocab\":" << vocab
              << ",\"params\":" << train::models::count_parameters(*model) << ",\"batch\":" << a.batch
              << ",\"seq\":" << a.seq << ",\"precision\":\"" << a.precision << "\",\"attention\":\""
              << attention_name(bert.attention()) << "\",\"optimizer\":\"" << train::optimizer_impl(*optimizer)
              << "\",\"threads\":" << at::get_num_threads()
              << ",\"targets\":" << data.labels.ne(-100).sum().item<int64_t>()
              << ",\"input_sum\":" << data.input.sum().item<int64_t>() << ",\"windows\":" << rates.sorted.size()
              << ",\"seq_per_s\":" << rates.median() << ",\"min\":" << rates.min() << ",\"max\":" << rates.max() << "}"
              << std::endl;
  });
}

}  // namespace

int main(int argc, char** argv) {
  train::tune_host_malloc();  // as the train command does (TRAIN_HOST_MALLOC=default: glibc as it is)
  const Args a = parse(argc, argv);
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::cerr << "bench_bert_step: " << e.what() << "\n";
    return 1;
  }
}
