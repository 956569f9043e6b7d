#pragma once
// The model interface the trainer drives, and the registry that maps `model.name` to a builder.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace train {
struct ModelConfig;
struct WeightRules;  // train/safetensors.h
}

namespace train::models {

class Model : public torch::nn::Module {
 public:
  // Returns logits: [B, classes] for classification, [B, T, vocab] for token tasks.
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  // Token tasks: logits [N, vocab] at the N positions where `positions` ([B, T] bool) is true, in
  // row-major order; what the loss needs when most positions have no target (MLM: 15 %). The
  // default selects them from forward(). A model whose output layer is costly overrides it to run
  // that layer at those positions only (BERT: the vocabulary projection and its logits).
  virtual torch::Tensor forward_selected(const torch::Tensor& input, const torch::Tensor& positions);
  // The training objective of a model whose task is not classification over class indices
  // (regression, a contrastive or a weighted loss). A model that overrides loss() returns true
  // from has_own_loss(); every built-in model leaves both, and trains with the trainer's
  // cross-entropy (loss.label_smoothing, -100 for token positions without a target).
  //
  // loss() gets forward(input)'s output and the collated targets (Example::target stacked: any
  // dtype and shape the dataset gives) and returns a 0-d tensor, the mean over the micro-batch's
  // samples: micro-batches have equal sizes, so the trainer averages their losses for the global
  // batch, and an evaluation reports the mean of loss() weighted by batch size. It runs inside the
  // run's autocast scope and, with tuning.cuda_graphs and capturable(), inside the capture. Such a
  // model's evaluations have no accuracy: checkpoint.best ranks by loss, and loss.label_smoothing
  // must stay 0. The plan's probe calls it with the first training sample's target repeated over
  // the batch (zeros shaped like the output when the data cannot be read).
  virtual bool has_own_loss() const { return false; }
  virtual torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target);
  // Measures an evaluation reports besides the loss (and, for classification, the accuracy):
  // mean absolute error, a hit rate, anything that is a mean over samples. eval_metrics() names
  // them (letters, digits and '_'; not loss, accuracy, top5 or samples) and says which way is
  // better; eval_sums() returns, for one batch, one 0-d tensor per metric in that order: the sum
  // of its per-sample values over the batch (over the positions with a target, for token targets,
  // with the logits at those positions and their targets). The evaluation adds them up over
  // batches and ranks and divides by the samples evaluated; metrics.jsonl's val rows, the log and
  // EvalResult::metrics carry the means, and checkpoint.best (and with it early stopping) can rank
  // by any of them. Called without autograd, in eval mode, inside the run's autocast scope.
  struct EvalMetric {
    std::string name;
    bool higher_is_better = false;
  };
  virtual std::vector<EvalMetric> eval_metrics() const { return {}; }
  virtual std::vector<torch::Tensor> eval_sums(const torch::Tensor& output, const torch::Tensor& target);
  // True when the model has batch statistics (BatchNorm), so that micro-batching changes results.
  virtual bool has_batch_stats() const { return false; }
  // True for conv nets (channels_last and cudnn choices).
  virtual bool is_convolutional() const { return false; }
  // True when a training step through forward() can be captured in a CUDA graph: the forward never
  // waits for the GPU (no .item(), no nonzero(), no data-dependent shapes or branches) and runs the
  // same kernels on every batch of one shape (tuning.cuda_graphs). False by default: a capture of a
  // model that does wait fails and the run continues without a graph, but only after the warm-up.
  virtual bool capturable() const { return false; }
  // A random input batch of `shape` ([batch, input_shape...]) for the plan's probe: standard
  // normal floats by default; token models return valid ids.
  virtual torch::Tensor random_input(const std::vector<int64_t>& shape, const torch::TensorOptions& options) const;
  // Checked before a run starts (prepare_run), so that data this model cannot take is a config
  // error up front instead of a failure in the first step: `sample_shape` is one input without the
  // batch dimension, `vocab_size` the data's vocabulary (Dataset::vocab_size; 0 for non-token
  // data). Returns "" when the model takes such input, else the problem as a ConfigError message
  // naming the key to change: "key 'data.image_size': ...". The default accepts anything.
  virtual std::string input_problem(const std::vector<int64_t>& sample_shape, int64_t vocab_size) const;
  // How weights from a relative of this model map onto it (model.init_from): its task head, the
  // heads of its other variants, and the tensors such files repeat. The default: an exact match.
  virtual WeightRules weight_rules() const;
  // The model's settings that its parameter shapes do not show, as "key=value" pairs joined by
  // ", " (BERT: "model.heads=12"). Checkpoints store it, and loading one written with other
  // settings is refused: its weights would load without complaint and compute something else.
  // The default, "": the shapes say it all.
  virtual std::string architecture() const { return ""; }
};

using ModelPtr = std::shared_ptr<Model>;

// A LibTorch module you already have (a torch::nn::Sequential, your own Module with a
// forward(Tensor)), as a Model for the trainer, without a class of your own:
//
//   train::models::register_model("my_net", [](const train::ModelConfig& c) {
//     return train::models::from_module(torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 10)));
//   }, "my network");
//
// The Model holds the module's parameters, buffers and submodules under the module's own names
// (a Sequential's "0.weight", as in Python), so checkpoints, `train export` and model.init_from
// see the module's state dict; train() and eval() reach the module too (its forward may read
// is_training()). has_batch_stats() and is_convolutional() are read off the submodules (a
// BatchNorm, a 2-d convolution); the options say the rest.
struct ModuleModelOptions {
  bool capturable = false;   // Model::capturable: the forward never waits for the GPU
  std::string architecture;  // Model::architecture: settings the shapes do not show
};
ModelPtr from_module(std::shared_ptr<torch::nn::Module> module,
                     std::function<torch::Tensor(const torch::Tensor&)> forward, ModuleModelOptions options = {});
template <typename M>
ModelPtr from_module(std::shared_ptr<M> module, ModuleModelOptions options = {}) {
  std::function<torch::Tensor(const torch::Tensor&)> forward = [m = module.get()](const torch::Tensor& x) {
    return m->forward(x);
  };
  return from_module(std::static_pointer_cast<torch::nn::Module>(module), std::move(forward), std::move(options));
}
template <typename Holder, typename = decltype(std::declval<const Holder&>().ptr())>
ModelPtr from_module(const Holder& holder, ModuleModelOptions options = {}) {  // torch::nn::Sequential, Linear, ...
  return from_module(holder.ptr(), std::move(options));
}
using ModelBuilder = std::function<ModelPtr(const ModelConfig&)>;

// Registry. Built-in models are registered on first use; users may add their own. A name that is
// registered already (a built-in one too) gets the new builder: the last registration wins.
void register_model(const std::string& name, ModelBuilder builder, const std::string& summary);
ModelPtr make_model(const ModelConfig& config);  // throws ConfigError for an unknown name
std::vector<std::string> model_names();
bool has_model(const std::string& name);

int64_t count_parameters(const torch::nn::Module& module);

}  // namespace train::models
