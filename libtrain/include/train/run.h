#pragma once
// Assembles a run from a validated config: device profile -> model -> datasets -> plan.
// This is what `train fit` does before handing over to the Trainer; programs that link
// train::train can call it too, or build the pieces themselves.
#include <train/config.h>
#include <train/data/dataset.h>
#include <train/dist.h>
#include <train/models/model.h>
#include <train/plan.h>

#include <functional>

namespace train {

struct RunParts {
  Config config;
  DeviceProfile device;
  models::ModelPtr model;
  data::DatasetPtr train;
  data::DatasetPtr val;
  Plan plan;
  dist::GroupPtr group;  // this job's process group; null for a single process
  // For Trainer::on_out_of_memory: records the micro-batch that fits in the plan cache, so the
  // next run with the same key plans it from the start. Null when the micro-batch is fixed by the
  // config or on ranks other than 0.
  std::function<void(int64_t failed_micro_batch, int64_t new_micro_batch)> record_oom;
};

struct RunOptions {
  // This process's place in the job (dist::detect_env() for `train fit`). With more than one
  // rank, prepare_run joins the process group (config.distributed), the ranks agree on the
  // smallest micro-batch any of them chose, and RunParts::group is set.
  dist::Env env;
  // Plan for this many ranks without joining a group (`train plan --world-size N`); 0 = env's.
  int64_t plan_world_size = 0;
  // With plan_world_size: how many of those ranks share this host's cores, which sets the threads
  // and loader workers per rank (`train plan --local-world-size M`); 0 = all of them (one host).
  int64_t plan_local_world_size = 0;
  // Plan only, for data that need not be on this machine (`train plan`): the input shape then
  // comes from the config when the data is not readable (data.seq_len tokens for tokens and tsv,
  // else model.in_channels x data.image_size^2; DataError when that is 0), train/val stay null, and the schedule length is known only from trainer.max_steps.
  // tuning.device (another device's profile) is accepted only here.
  bool data_optional = false;
  // A program's own datasets (classes derived from data::Dataset), used instead of building them
  // from the config's data section (`data.kind: custom` says so in the YAML; of that section only
  // the loader settings then apply). val may stay null. The probe, the plan cache and the checks
  // of the model against the data work as for the built-in kinds.
  data::DatasetPtr train_data;
  data::DatasetPtr val_data;
};

// First checks the config as load_config checks a file (validate_config), so a Config built or
// changed in code is held to the same rules. Seeds LibTorch's generator from trainer.seed before
// building the model, so that the initial weights are reproducible. Reads the data files
// (DataError on bad input). A ConfigError names the file and line (or --set) where the offending
// key was set. Refuses tuning.device unless data_optional (check_runs_here), and datasets from
// the program unless data.kind is custom.
//
// Process-wide effects, as for `train fit`: the plan's intra-op thread count, TF32 and cuDNN
// benchmark settings are applied (apply_plan_globals: the probe measures under them) and stay
// applied; a measured plan is stored in the plan cache (tuning.cache_dir; by default
// $XDG_CACHE_HOME/train/plans or ~/.cache/train/plans), whatever the run directory. An error in
// the program's own model or dataset met while the probe runs it comes as a train::Error that
// says what the probe was doing.
RunParts prepare_run(const Config& config, const RunOptions& options);
inline RunParts prepare_run(const Config& config) { return prepare_run(config, RunOptions{}); }

// ConfigError when the config cannot run on this machine's hardware: tuning.device names a
// device profile to plan for (train plan), not hardware to train on.
void check_runs_here(const Config& config);

// model.init_from (when set) is readable and fits `model`; a CheckpointError names the file and
// line where the key was set.
void check_init_from(const Config& config, const models::Model& model);

// The keys whose valid values depend on the model and the data, not on the config alone:
// checkpoint.best must be a measure the model's evaluations report (a model with its own loss
// reports that loss alone, and takes no loss.label_smoothing); with the data read (`data_read`),
// checkpoint.best needs a validation split (`val`, null when there is none) and top5 more than
// five classes. A ConfigError names the key, with the file and line where it was set. prepare_run,
// `train check` and the Trainer call it, so that a run fails before its run directory is touched.
void check_model_settings(const Config& config, const models::Model& model, bool data_read,
                          const data::Dataset* val);

// Builds config.model for the training data, checked as prepare_run checks it: model.in_channels
// and model.num_classes against the data's, model.pad_id against the id the data pads with (and
// taken from the data when unset), then what the model can take (input size, positions,
// vocabulary). A ConfigError names the key, with the file and line where it was set. Does not
// seed LibTorch's generator.
models::ModelPtr make_model_for_data(const Config& config, const data::Dataset& train);

// Applies the plan's process-wide settings (threads, TF32, cudnn.benchmark).
void apply_plan_globals(const Plan& plan);

}  // namespace train
