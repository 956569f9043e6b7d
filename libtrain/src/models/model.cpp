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

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t total = 0;
  for (const auto& parameter : module.parameters(/*recurse=*/true)) total += parameter.numel();
  return total;
}

}  // namespace train::models
