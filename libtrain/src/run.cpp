#include "train/run.h"

#include <torch/torch.h>

#include "compat.h"
#include "train/data/factory.h"
#include "train/errors.h"

namespace train {

RunParts prepare_run(const Config& config, int world_size, int rank, int local_rank) {
  RunParts r;
  r.config = config;
  r.device = detect_device(config.trainer.device, local_rank);
  r.train = data::make_dataset(config.data, data::Split::Train);
  r.val = data::make_dataset(config.data, data::Split::Val);

  const auto shape = r.train->input_shape();
  if (!shape.empty() && r.train->num_classes() > 0 && shape.size() == 3 && shape[0] != config.model.in_channels) {
    throw ConfigError("key 'model.in_channels': " + std::to_string(config.model.in_channels) + " but the data (" +
                      r.train->describe() + ") has " + std::to_string(shape[0]) + " channel(s)");
  }
  if (r.train->num_classes() > config.model.num_classes) {
    throw ConfigError("key 'model.num_classes': " + std::to_string(config.model.num_classes) + " but the data (" +
                      r.train->describe() + ") has " + std::to_string(r.train->num_classes()) + " classes");
  }

  torch::manual_seed(static_cast<uint64_t>(config.trainer.seed));
  r.model = models::make_model(config.model);

  PlanInputs inputs;
  inputs.world_size = world_size;
  inputs.rank = rank;
  inputs.model_params = models::count_parameters(*r.model);
  inputs.convolutional = r.model->is_convolutional();
  inputs.static_shapes = true;
  r.plan = make_plan(config, r.device, inputs);
  finalize_schedule(r.plan, config, r.train->size());
  return r;
}

void apply_plan_globals(const Plan& plan) {
  at::set_num_threads(static_cast<int>(plan.threads));
  if (plan.device.is_cuda()) {
    compat::set_allow_tf32(plan.tf32);
    compat::set_cudnn_benchmark(plan.cudnn_benchmark);
  }
}

}  // namespace train
