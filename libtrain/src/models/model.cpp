// The Model interface's default behaviour (train/models/model.h), apart from the registry: the
// checkpoint code needs the interface (Model::architecture) but none of the models.
#include "train/models/model.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "train/safetensors.h"

namespace train::models {

std::string Model::input_problem(const std::vector<int64_t>& /*sample_shape*/, int64_t /*vocab_size*/) const {
  return "";
}

WeightRules Model::weight_rules() const { return {}; }

torch::Tensor Model::forward_selected(const torch::Tensor& input, const torch::Tensor& positions) {
  const torch::Tensor logits = forward(input);
  return logits.reshape({-1, logits.size(-1)}).index_select(0, positions.reshape({-1}).nonzero().squeeze(1));
}

torch::Tensor Model::loss(const torch::Tensor& /*output*/, const torch::Tensor& /*target*/) {
  throw std::logic_error("Model::loss: this model has no loss of its own (has_own_loss() is false); the trainer "
                         "uses cross-entropy");
}

std::vector<torch::Tensor> Model::eval_sums(const torch::Tensor& /*output*/, const torch::Tensor& /*target*/) {
  if (!eval_metrics().empty()) {
    throw std::logic_error("Model::eval_sums: a model that names eval_metrics() must compute them");
  }
  return {};
}

torch::Tensor Model::random_input(const std::vector<int64_t>& shape, const torch::TensorOptions& options) const {
  return torch::randn(shape, options);
}

namespace {

// from_module's Model: the module's own parameters and buffers, and its submodules, registered
// here under their names; forward() calls the module's.
class ModuleModel : public Model {
 public:
  ModuleModel(std::shared_ptr<torch::nn::Module> module, std::function<torch::Tensor(const torch::Tensor&)> forward,
              ModuleModelOptions options)
      : module_(std::move(module)), forward_(std::move(forward)), options_(std::move(options)) {
    for (const auto& p : module_->named_parameters(/*recurse=*/false)) register_parameter(p.key(), p.value());
    for (const auto& b : module_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
    for (const auto& c : module_->named_children()) register_module(c.key(), c.value());
    for (const auto& m : module_->modules(/*include_self=*/true)) {
      const std::string name = m->name();
      if (name.rfind("torch::nn::BatchNorm", 0) == 0) batch_stats_ = true;
      if (name.rfind("torch::nn::Conv2d", 0) == 0) convolutional_ = true;
    }
    module_->train(is_training());
  }
  torch::Tensor forward(const torch::Tensor& input) override { return forward_(input); }
  void train(bool on = true) override {
    Model::train(on);
    module_->train(on);  // its own flag: the children are ours too, and follow the call above
  }
  bool has_batch_stats() const override { return batch_stats_; }
  bool is_convolutional() const override { return convolutional_; }
  bool capturable() const override { return options_.capturable; }
  std::string architecture() const override { return options_.architecture; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::function<torch::Tensor(const torch::Tensor&)> forward_;
  ModuleModelOptions options_;
  bool batch_stats_ = false;
  bool convolutional_ = false;
};

}  // namespace

ModelPtr from_module(std::shared_ptr<torch::nn::Module> module, std::function<torch::Tensor(const torch::Tensor&)> forward,
                     ModuleModelOptions options) {
  if (!module) throw std::invalid_argument("from_module: no module");
  if (!forward) throw std::invalid_argument("from_module: no forward function");
  return std::make_shared<ModuleModel>(std::move(module), std::move(forward), std::move(options));
}

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t total = 0;
  for (const auto& parameter : module.parameters(/*recurse=*/true)) total += parameter.numel();
  return total;
}

}  // namespace train::models
