#pragma once
// Internal: a model's own loss (Model::has_own_loss), for the trainer and the plan's probe, and
// its own evaluation measures (Model::eval_metrics), for the trainer.
#include <train/errors.h>
#include <train/log.h>
#include <train/models/model.h>

#include <string>
#include <vector>

namespace train {
namespace {

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
