#pragma once
// Internal: what a model returns, checked where the trainer and the plan's probe use it: a
// classifier's logits, a model's own loss (Model::has_own_loss) and its own evaluation measures
// (Model::eval_metrics). A model that returns the wrong thing gets a message naming the rule, not
// c10's error from deep inside the loss.
#include <train/errors.h>
#include <train/log.h>
#include <train/models/model.h>

#include <string>
#include <vector>

namespace train {
namespace {

// A classifier's logits, checked before the cross-entropy takes them: at least as many logits per
// row as the data has classes (more trains, if wastefully; fewer would fail at the first target
// beyond them), and one row per target (`targets`; -1: not checked). Sizes only: no device sync.
inline void check_logits(const std::string& name, const torch::Tensor& logits, int64_t targets, int64_t num_classes) {
  const std::string output = name.empty() ? std::string("the model's output") : "model '" + name + "': its output";
  if (logits.dim() < 1 || logits.size(-1) < num_classes) {
    throw Error(log::str(output, " has shape ", logits.sizes(), ", but the data has ", num_classes,
                         " classes: a model's forward must return logits whose last dimension is the number of "
                         "classes"));
  }
  const int64_t rows = logits.size(-1) == 0 ? 0 : logits.numel() / logits.size(-1);
  if (targets >= 0 && rows != targets) {
    throw Error(log::str(output, " has shape ", logits.sizes(), ": ", rows, " row(s) of logits for ", targets,
                         " target(s): forward must return one row of logits per sample ([batch, classes])",
                         " or per position with a target ([batch, positions, classes])"));
  }
}

// Model::loss, checked to be the 0-d floating-point mean the trainer averages: a loss of another
// shape would fail in backward() with a message that names no model.
inline torch::Tensor checked_own_loss(models::Model& model, const std::string& name, const torch::Tensor& output,
                                      const torch::Tensor& target) {
  torch::Tensor loss = model.loss(output, target);
  if (!loss.defined() || loss.dim() != 0 || !loss.is_floating_point()) {
    throw Error(log::str(name.empty() ? std::string("the model") : "model '" + name + "'", ": loss() returned ",
                         loss.defined() ? log::str("a ", loss.scalar_type(), " tensor of shape ", loss.sizes())
                                        : std::string("an undefined tensor"),
                         "; it must return a 0-d floating-point tensor, the mean loss over the micro-batch"));
  }
  return loss;
}

// Model::eval_sums, checked to be one 0-d number per metric that eval_metrics() names.
inline std::vector<torch::Tensor> checked_eval_sums(models::Model& model, const std::string& name, size_t count,
                                                    const torch::Tensor& output, const torch::Tensor& target) {
  std::vector<torch::Tensor> sums = model.eval_sums(output, target);
  bool ok = sums.size() == count;
  for (const auto& t : sums) ok = ok && t.defined() && t.numel() == 1;
  if (!ok) {
    throw Error(log::str("model '", name, "': eval_sums() returned ", sums.size(), " value(s) for the ", count,
                         " metric(s) eval_metrics() names; it must return one 0-d tensor per metric, in that order"));
  }
  return sums;
}

}  // namespace
}  // namespace train
