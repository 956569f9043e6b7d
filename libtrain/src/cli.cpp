#include "train/cli.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>

#include "suggest.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/data/factory.h"
#include "train/data/image_folder.h"
#include "train/data/scan.h"
#include "train/device.h"
#include "train/fit.h"
#include "train/dist.h"
#include "train/doctor.h"
#include "train/launch.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"
#include "train/models/model.h"
#include "train/run.h"
#include "train/safetensors.h"
#include "train/text/tsv_dataset.h"
#include "train/trainer.h"

namespace train {
namespace {

// train launch --nproc: ranks on one host (one per GPU, or CPU processes for Gloo).
constexpr int64_t kMaxLocalRanks = 256;

struct CommonArgs {
  std::string config;
  std::vector<std::string> sets;
};

void add_common(CLI::App* cmd, CommonArgs& args) {
  cmd->add_option("config", args.config, "YAML run configuration")->required();
  cmd->add_option("--set", args.sets, "Override a config key, e.g. --set optim.lr=0.05 (repeatable)")
      ->type_name("KEY=VALUE");
}

// This program's own path, for re-executing it as each rank.
std::string self_executable(const char* argv0) {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n > 0) return std::string(buf, static_cast<size_t>(n));
  return argv0;
}

std::string default_run_dir(const std::string& config_path) {
  return files::join("runs", files::stem(config_path));
}

// Runs `body`, the part of a command after its config was loaded. A ConfigError found there (by
// the dataset factory, the model registry, the plan), and a DataError about a path the config
// names, get the file, line and column where its key was set, like the errors the parser finds.
template <typename Body>
int with_config_location(const Config& config, Body&& body) {
  try {
    return body();
  } catch (const ConfigError& e) {
    throw ConfigError(locate_config_error(config, e.what()));
  } catch (const DataError& e) {
    throw DataError(locate_data_error(config, e.what()), e.exit_code());
  }
}

// Everything that can be checked without the data (which may live on another machine): the keys,
// the model (name and sizes: it is built), a named device profile, and model.init_from. With
// --data, also the data: both splits are opened, checked against the model as train fit checks
// them, and read whole (data::scan_dataset), so that a bad file is found before a run spends
// device time on it.
int cmd_check(const CommonArgs& args, bool read_data) {
  const Config config = load_config(args.config, args.sets);
  return with_config_location(config, [&] {
    models::ModelPtr model = models::make_model(config.model);
    if (!config.tuning.device.empty()) named_device(config.tuning.device);
    check_init_from(config, *model);
    check_model_settings(config, *model, /*data_read=*/false, nullptr);
    if (!read_data) {
      std::cout << args.config << ": OK (model " << config.model.name << ", " << models::count_parameters(*model)
                << " parameters, global batch " << config.trainer.global_batch
                << "; the data was not read: --data reads it)\n";
      return kExitOk;
    }
    if (config.data.kind == "custom") {
      throw UsageError(args.config + ": data.kind is custom: the program that trains supplies the datasets, so " +
                       "train check --data has none to read");
    }
    const data::DatasetPtr train = data::make_dataset(config.data, data::Split::Train);
    const data::DatasetPtr val = data::make_dataset(config.data, data::Split::Val);
    model = make_model_for_data(config, *train);
    check_model_settings(config, *model, /*data_read=*/true, val.get());
    int64_t bad = 0;
    for (const auto& [split, dataset] : {std::pair{"train", train}, std::pair{"val", val}}) {
      data::ScanOptions options;
      options.seed = static_cast<uint64_t>(config.trainer.seed);
      options.progress = [split = std::string(split)](int64_t done, int64_t total) {
        log::info(log::str(split, " data: ", done, " of ", total, " samples read"));
      };
      const data::ScanReport report = data::scan_dataset(*dataset, options);
      std::cout << split << " data (" << dataset->describe() << "): " << report.samples << " samples read in "
                << log::str(std::fixed, std::setprecision(1), report.seconds) << " s, "
                << (report.bad == 0 ? std::string("all load") : std::to_string(report.bad) + " bad") << "\n";
      for (const std::string& message : report.messages) std::cout << "  " << message << "\n";
      if (report.bad > static_cast<int64_t>(report.messages.size())) {
        std::cout << "  ... and " << report.bad - static_cast<int64_t>(report.messages.size()) << " more\n";
      }
      bad += report.bad;
    }
    if (bad > 0 && config.data.on_error != "skip") {
      throw DataError(args.config + ": " + std::to_string(bad) + " sample(s) fail to load (listed above); with " +
                      "data.on_error: raise a run stops at the first it meets. Fix or remove the files, or set " +
                      "data.on_error: skip to train on without them");
    }
    std::cout << args.config << ": OK (model " << config.model.name << ", " << models::count_parameters(*model)
              << " parameters, global batch " << config.trainer.global_batch << "; the data was read"
              << (bad > 0 ? ", and data.on_error: skip will replace its " + std::to_string(bad) + " bad sample(s)"
                          : std::string()) << ")\n";
    return kExitOk;
  });
}

int cmd_plan(CommonArgs args, bool json, const std::string& device, int64_t world_size, int64_t local_world_size) {
  if (local_world_size > 0 && (local_world_size > world_size || world_size % local_world_size != 0)) {
    throw UsageError(log::str("--local-world-size ", local_world_size, ": the ranks per host must divide --world-size ",
                              world_size, " (", world_size, " ranks on hosts of ", local_world_size, " each)"));
  }
  if (!device.empty()) {
    // Named here as the user wrote it (not as the tuning.device override it becomes). Quietly:
    // the plan names the device again, with its warnings (a compute capability without kernels).
    try {
      log::set_level(log::Level::error);
      named_device(device);
      log::set_level(log::Level::info);
    } catch (const ConfigError& e) {
      log::set_level(log::Level::info);
      const std::string what = e.what(), key = "key 'tuning.device': ";
      throw UsageError("--device " + device + ": " + (what.rfind(key, 0) == 0 ? what.substr(key.size()) : what));
    }
    args.sets.push_back("tuning.device=" + device);
  }
  const Config config = load_config(args.config, args.sets);
  log::set_level(config.logging.level);  // before anything logs (the probe, the plan cache)
  return with_config_location(config, [&] {
    RunOptions options;
    options.data_optional = true;  // plan for data that lives on another machine
    options.plan_world_size = world_size;
    options.plan_local_world_size = local_world_size;
    const RunParts run = prepare_run(config, options);
    std::cout << (json ? run.plan.to_json() + "\n" : run.plan.to_text());
    return kExitOk;
  });
}

int cmd_fit(const CommonArgs& args, const std::string& run_dir, const std::string& resume,
            std::optional<StopSignals>& stop_signals) {
  // Everything that can be rejected is checked before the data is read and the run directory
  // is touched.
  const Config config = load_config(args.config, args.sets);
  log::set_level(config.logging.level);  // before anything logs (the probe, the plan cache)
  return with_config_location(config, [&] {
    FitOptions fit;
    fit.run_dir = run_dir.empty() ? default_run_dir(args.config) : run_dir;
    fit.resume = resume;
    fit.keep_stop_signals = &stop_signals;  // kept until the error, if any, is reported
    RunOptions options;
    options.env = dist::detect_env();
    try {
      check_fit_options(config, fit);
    } catch (const UsageError& e) {
      // torchrun --max-restarts starts the ranks again with the same command line: without
      // --resume auto every restart meets the checkpoints of the attempt before.
      if (options.env.restart == 0 || !resume.empty()) throw;
      throw UsageError(log::str(e.what(), ". This is torchrun's restart ", options.env.restart,
                                " (TORCHELASTIC_RESTART_COUNT): restarts continue the run only when the command has "
                                "--resume auto"));
    }
    log::set_rank(static_cast<int>(options.env.rank));
    RunParts run = prepare_run(config, options);
    return fit_in_run_dir(config, run, fit).exit_code;
  });
}

// Validates the config here, so that a bad one fails once, before any rank starts.
int cmd_launch(const CommonArgs& args, int nproc, int master_port, const std::string& run_dir,
               const std::string& resume, const std::string& self) {
  const Config config = load_config(args.config, args.sets);
  with_config_location(config, [&] {
    FitOptions fit;
    fit.run_dir = run_dir.empty() ? default_run_dir(args.config) : run_dir;
    fit.resume = resume;
    check_fit_options(config, fit);  // once here, rather than in every rank after all of them started
    // Every rank would find this on its own, after all of them started.
    if (config.tuning.batch == "fixed" && config.trainer.global_batch % nproc != 0) {
      throw ConfigError(log::str("key 'trainer.global_batch': ", config.trainer.global_batch,
                                 " is not divisible by --nproc ", nproc, "; choose a multiple of ", nproc));
    }
    return 0;
  });
  std::vector<std::string> argv{self, "fit", args.config};
  for (const auto& s : args.sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  if (!run_dir.empty()) argv.insert(argv.end(), {"--run-dir", run_dir});
  if (!resume.empty()) argv.insert(argv.end(), {"--resume", resume});
  LaunchOptions options;
  options.nproc = nproc;
  // The launcher serves the store: its port is bound before any rank starts, and stays up when a
  // rank freezes.
  const dist::LaunchStore store(options.master_addr, master_port, config.distributed.init_timeout_s);
  options.master_port = store.port();
  options.store_served = true;
  return launch_local(argv, options);
}

int cmd_eval(const CommonArgs& args, const std::string& checkpoint) {
  const Config config = load_config(args.config, args.sets);
  log::set_level(config.logging.level);  // before anything logs (the probe, the plan cache)
  return with_config_location(config, [&] {
    RunParts run = prepare_run(config);  // refuses tuning.device (check_runs_here)
    load_model_weights(checkpoint, *run.model);
    apply_plan_globals(run.plan);
    Trainer trainer(config, run.plan, run.model, run.train, run.val, "");
    const EvalResult ev = trainer.evaluate();
    MetricRecord r;
    r.add("checkpoint", checkpoint).add("split", "val").add("loss", ev.loss);
    if (ev.has_accuracy) r.add("accuracy", ev.accuracy);
    if (ev.has_top5) r.add("top5", ev.top5);
    for (const auto& [name, value] : ev.metrics) r.add(name, value);
    r.add("samples", ev.samples);
    std::cout << r.to_json() << "\n";
    return kExitOk;
  });
}

// The texts `train predict` classifies: each non-blank line of each file ("-": standard input);
// a line in TSV form (text<TAB>label) gives its text, so a labelled file can be passed as it is.
std::vector<std::string> read_texts(const std::vector<std::string>& paths) {
  std::vector<std::string> texts;
  for (const std::string& path : paths) {
    std::ifstream file;
    if (path != "-") {
      if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
        throw DataError(path + ": " + problem + ", expected a text file (one text per line)");
      }
      file.open(path, std::ios::binary);
      if (!file) throw DataError(path + ": cannot open (" + std::strerror(errno) + ")");
    }
    std::istream& in = path == "-" ? std::cin : file;
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (const size_t tab = line.rfind('\t'); tab != std::string::npos) line.resize(tab);
      if (line.find_first_not_of(" \t") != std::string::npos) texts.push_back(line);
    }
    if (in.bad()) throw DataError(path + ": error reading");
  }
  if (texts.empty()) throw UsageError("train predict: no text in " + paths.front() + (paths.size() > 1 ? " ..." : ""));
  return texts;
}

// train predict RUN_DIR INPUT...: a trained classifier's most probable classes for new inputs, one
// JSON line each: image files for a run on image_folder data, transformed as its validation split,
// or on idx data, made IDX images (grayscale, the IDX side); texts for a run on tsv data, encoded as its TSV files (README, "Using a trained model"). On the
// CPU: a few inputs need no device, and the numbers are the same anywhere.
int cmd_predict(const std::string& run_dir, const std::vector<std::string>& inputs, std::string checkpoint,
                int64_t top) {
  const std::string config_path = files::join(run_dir, "config.yaml");
  if (!files::is_directory(run_dir)) throw UsageError(run_dir + ": not a directory; give a run directory train fit wrote");
  if (!files::is_regular_file(config_path)) {
    throw UsageError(run_dir + ": no config.yaml; give a run directory train fit wrote");
  }
  Config config = load_config(config_path);
  const bool idx = config.data.kind == "idx";
  const bool images = config.data.kind == "image_folder" || idx;
  if (!images && config.data.kind != "tsv") {
    throw UsageError(log::str("train predict classifies image files or texts, for a model trained on data.kind "
                              "image_folder, idx or tsv; ", config_path, " has data.kind ", config.data.kind,
                              " (train eval evaluates any run's checkpoint on its validation split)"));
  }
  const std::string checkpoints = files::join(run_dir, "checkpoints");
  if (checkpoint.empty()) {
    const std::string best = best_checkpoint_path(checkpoints);
    checkpoint = files::is_regular_file(best) ? best : latest_checkpoint(checkpoints);
    if (checkpoint.empty()) throw UsageError(run_dir + ": no checkpoint in " + checkpoints + "; give one with --checkpoint");
  }
  log::set_level(config.logging.level);
  return with_config_location(config, [&] {
    ModelConfig model_config = config.model;
    data::DatasetPtr dataset;
    std::vector<std::string> classes, what;  // the outputs' names; each sample's file or text
    const std::string train_file = images ? files::join(config.data.root, config.data.train_dir)
                                          : (config.data.train_tsv[0] == '/' ? config.data.train_tsv
                                                                            : files::join(config.data.root, config.data.train_tsv));
    if (idx) {
      // IDX files name no classes: the labels are numbers.
    } else if (images ? files::is_directory(train_file) : files::is_regular_file(train_file)) {
      classes = images ? data::find_image_classes(train_file) : text::read_tsv_classes(train_file);
    } else {
      log::warn(train_file + " is not here: the classes are given by number, not by name");
    }
    if (idx) {
      dataset = data::make_idx_image_files(config.data, inputs);
      what = inputs;
    } else if (images) {
      config.data.uint8 = "off";  // float inputs, normalised as the workers normalise them
      data::ImageFolderOptions options = data::image_folder_options(config.data, data::Split::Val);
      options.classes = classes;
      options.files = inputs;
      auto folder = std::make_shared<data::ImageFolderDataset>(options);
      for (int64_t i = 0; i < folder->size(); ++i) what.push_back(folder->path(i));
      dataset = folder;
    } else {
      text::TsvDatasetOptions options = text::tsv_dataset_options(config.data);
      options.classes = classes;
      options.texts = read_texts(inputs);
      what = options.texts;
      // As the run: the model masks out of attention the id the data pads with.
      if (model_config.pad_id < 0) model_config.pad_id = options.tokenizer->pad_id();
      dataset = std::make_shared<text::TsvDataset>(options);
    }
    models::ModelPtr model = models::make_model(model_config);
    load_model_weights(checkpoint, *model);
    model->eval();
    torch::NoGradGuard no_grad;
    constexpr int64_t kChunk = 32;
    for (int64_t first = 0; first < dataset->size(); first += kChunk) {
      std::vector<int64_t> indices;
      for (int64_t i = first; i < std::min(dataset->size(), first + kChunk); ++i) indices.push_back(i);
      std::optional<data::Batch> batch = dataset->get_batch(indices, std::vector<uint64_t>(indices.size(), 0), false);
      if (!batch) {
        std::vector<data::Example> examples;
        for (const int64_t i : indices) examples.push_back(dataset->get(i, 0));
        batch = dataset->collate(std::move(examples));
      }
      const torch::Tensor logits = model->forward(batch->input);
      if (logits.dim() != 2) throw Error(log::str("train predict: the model gave outputs of ", logits.dim(),
                                                  " dimensions, not [inputs, classes]"));
      const int64_t k = std::min(top, logits.size(1));
      const auto [probability, label] = torch::softmax(logits.to(torch::kDouble), 1).topk(k, 1);
      for (size_t row = 0; row < indices.size(); ++row) {
        const auto i = static_cast<int64_t>(row);
        std::string line = "{\"" + std::string(images ? "file" : "text") + "\":" +
                           json_quote(what[static_cast<size_t>(indices[row])]) + ",\"checkpoint\":" +
                           json_quote(checkpoint) + ",\"top\":[";
        for (int64_t j = 0; j < k; ++j) {
          const int64_t c = label[i][j].item<int64_t>();
          MetricRecord entry;
          entry.add("label", c);
          if (c < static_cast<int64_t>(classes.size())) entry.add("class", classes[static_cast<size_t>(c)]);
          entry.add("probability", probability[i][j].item<double>());
          line += (j ? "," : "") + entry.to_json();
        }
        std::cout << line << "]}\n";
      }
    }
    std::cout.flush();
    return kExitOk;
  });
}

// train export CHECKPOINT --format safetensors OUT: the model weights under their state-dict
// names (torchvision's for ResNet), loadable with safetensors.torch.load_file + load_state_dict.
int cmd_export(const std::string& checkpoint, const std::string& format, const std::string& out) {
  if (format != "safetensors") throw UsageError("--format " + format + ": the only export format is safetensors");
  // Checked before the checkpoint is read, so that the error names OUT, not the temporary file.
  if (files::is_directory(out)) {
    throw UsageError(out + ": is a directory; give the file to write, e.g. " + files::join(out, "model.safetensors"));
  }
  if (!files::is_directory(files::parent(out))) {
    throw UsageError(out + ": directory " + files::parent(out) + " does not exist");
  }
  // OUT is replaced whole: never the checkpoint itself, nor another of a run's checkpoints (its
  // checksum sidecar would then condemn it, and --resume auto fall back past it).
  struct stat in_info {}, out_info {};
  if (::stat(out.c_str(), &out_info) == 0) {
    if (::stat(checkpoint.c_str(), &in_info) == 0 && in_info.st_dev == out_info.st_dev &&
        in_info.st_ino == out_info.st_ino) {
      throw UsageError(out + ": is the checkpoint being exported; give another file to write, e.g. " +
                       files::join(files::parent(out), "model.safetensors"));
    }
    if (files::exists(out + ".crc32c")) {
      throw UsageError(out + ": is a run's checkpoint (it has a checksum file, " + files::filename(out) +
                       ".crc32c); give another file to write, e.g. " +
                       files::join(files::parent(out), "model.safetensors"));
    }
  }
  const TensorMap weights = read_checkpoint_weights(checkpoint);
  Metadata metadata{{"format", "pt"}, {"producer", "train export"}, {"source", files::filename(checkpoint)}};
  write_safetensors(out, weights, metadata);
  int64_t bytes = 0;
  for (const auto& [name, t] : weights) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  std::cout << "wrote " << out << ": " << weights.size() << " tensors, " << bytes / (1024 * 1024) << " MiB from "
            << checkpoint << "\n";
  return kExitOk;
}

// "train fit: unknown option '--resum'; did you mean '--resume'?" for the first argument of
// `args` that looks like an option `command` does not have; "" when there is none.
std::string unknown_option_message(const CLI::App& command, const std::vector<std::string>& args) {
  std::vector<std::string> names;
  for (const CLI::Option* option : command.get_options()) {
    for (const auto& name : option->get_lnames()) names.push_back("--" + name);
    for (const auto& name : option->get_snames()) names.push_back("-" + name);
  }
  for (const std::string& arg : args) {
    if (arg.size() < 2 || arg[0] != '-' || std::isdigit(static_cast<unsigned char>(arg[1])) || arg == "--") continue;
    const std::string name = arg.substr(0, arg.find('='));
    if (std::find(names.begin(), names.end(), name) != names.end()) continue;
    const std::string suggestion = detail::closest_match(name, names);
    return "train " + command.get_name() + ": unknown option '" + name + "'" +
           (suggestion.empty() ? "" : "; did you mean '" + suggestion + "'?") + " (train " + command.get_name() +
           " --help lists its options)";
  }
  return "";
}

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// "train fit: unexpected argument 'b.yaml' (usage: train fit CONFIG [OPTIONS]; train fit --help)"
// for an argument left over after `command`'s positionals took theirs; "" when none is.
std::string unexpected_argument_message(const CLI::App& command) {
  const std::vector<std::string> extra = command.remaining();
  if (extra.empty()) return "";
  std::string usage = "train " + command.get_name();
  for (const CLI::Option* option : command.get_options()) {
    if (option->get_positional()) usage += " " + upper(option->get_name());
  }
  return "train " + command.get_name() + ": unexpected argument '" + extra.front() + "' (usage: " + usage +
         " [OPTIONS]; train " + command.get_name() + " --help lists them)";
}

}  // namespace

int run_cli(int argc, char** argv) {
  CLI::App app{"train: device-adaptive training on LibTorch"};
  app.require_subcommand(1);
  app.footer("Exit codes: 0 success; 1 bad data (a missing, truncated or malformed data file) or a runtime "
             "failure; 2 invalid usage, config or checkpoint; 3 stopped by SIGTERM/SIGINT/SIGUSR1/SIGHUP after a "
             "checkpoint (resume with --resume auto); 128+N stopped by signal N without a checkpoint (a second "
             "signal 1 s or more after the first, or trainer.stop_grace_s exceeded); 127 train launch could not "
             "start a rank. Bad input leaves the run directory as it was (none, if there was none).");

  CommonArgs fit_args, eval_args, check_args, plan_args;
  std::string run_dir, resume, checkpoint;
  bool plan_json = false, reference = false;

  auto* fit = app.add_subcommand("fit", "Train a model from a YAML config");
  add_common(fit, fit_args);
  fit->add_option("--run-dir", run_dir, "Run directory (default: runs/<config name>)")
      ->check(CLI::Validator([](std::string& v) { return v.empty() ? std::string("empty; leave it out for runs/<config name>") : std::string(); },
                             "", "non-empty"));
  fit->add_option("--resume", resume, "Checkpoint to resume from, or 'auto' for the newest in the run directory")
      ->type_name("PATH|auto");

  CommonArgs launch_args;
  int nproc = 0, master_port = 0;
  std::string launch_run_dir, launch_resume;
  auto* launch = app.add_subcommand("launch", "Train with N data-parallel ranks on this host (like torchrun)");
  add_common(launch, launch_args);
  launch->add_option("--nproc", nproc, "Number of ranks to start on this host, 1-" + std::to_string(kMaxLocalRanks))
      ->required()
      ->check(CLI::Range(1, static_cast<int>(kMaxLocalRanks)));
  launch->add_option("--master-port", master_port, "Rendezvous port, 1-65535 (default or 0: a free one)")
      ->check(CLI::Range(0, 65535));
  launch->add_option("--run-dir", launch_run_dir, "Run directory (default: runs/<config name>)")
      ->check(CLI::Validator([](std::string& v) { return v.empty() ? std::string("empty; leave it out for runs/<config name>") : std::string(); },
                             "", "non-empty"));
  launch->add_option("--resume", launch_resume, "Checkpoint to resume from, or 'auto'")->type_name("PATH|auto");

  auto* eval = app.add_subcommand("eval", "Evaluate a checkpoint on the validation split");
  add_common(eval, eval_args);
  eval->add_option("--checkpoint", checkpoint, "Checkpoint file")->required();

  auto* check = app.add_subcommand("check", "Validate a config without training");
  add_common(check, check_args);
  bool check_data = false;
  check->add_flag("--data", check_data,
                  "Also read the data: every sample of both splits, checked as the loader and the model would, "
                  "and token files against their checksums");

  auto* plan = app.add_subcommand("plan", "Print the resolved plan for this device without training");
  add_common(plan, plan_args);
  plan->add_flag("--json", plan_json, "Print JSON");
  std::string plan_device;
  int64_t plan_world_size = 0;
  auto* world_size_option =
      plan->add_option("--world-size", plan_world_size, "Plan for this many data-parallel ranks (default: this process's)")
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  int64_t plan_local_world_size = 0;
  plan->add_option("--local-world-size", plan_local_world_size,
                   "Of the --world-size ranks, how many share one host's cores, which sets each rank's threads and "
                   "loader workers; must divide --world-size (default: all of them, one host)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->needs(world_size_option);
  plan->add_option("--device", plan_device,
                   "Plan for a named device profile instead of this machine's (e.g. t4, a100-80gb, h100, cpu)");

  bool doctor_json_flag = false;
  auto* doctor = app.add_subcommand("doctor", "Check LibTorch, CUDA, the GPU and the BLAS, with hints");
  doctor->add_flag("--json", doctor_json_flag, "Print JSON");

  auto* config_cmd = app.add_subcommand("config", "Config schema tools");
  config_cmd->add_flag("--reference", reference, "Print the reference of every config key (Markdown)")->required();

  std::string predict_run_dir, predict_checkpoint;
  std::vector<std::string> predict_inputs;
  int64_t predict_top = 5;
  auto* predict = app.add_subcommand("predict", "Classify image files or texts with a model a run trained");
  predict->add_option("run_dir", predict_run_dir, "Run directory written by train fit")->required();
  predict->add_option("inputs", predict_inputs,
                      "JPEG or PNG files (a run on image_folder or idx data), or text files with one text per line, "
                      "- for standard input (a run on tsv data)")
      ->required();
  predict->add_option("--checkpoint", predict_checkpoint,
                      "Checkpoint file (default: the run's best.pt, else its newest checkpoint)");
  predict->add_option("--top", predict_top, "Classes per image, most probable first")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();

  std::string export_checkpoint, export_format = "safetensors", export_out;
  auto* export_cmd = app.add_subcommand("export", "Write a checkpoint's model weights for other frameworks");
  export_cmd->add_option("checkpoint", export_checkpoint, "Checkpoint file written by train fit")->required();
  export_cmd->add_option("out", export_out, "Output file, e.g. model.safetensors")->required();
  export_cmd->add_option("--format", export_format, "Output format")->capture_default_str();

  // CLI11 answers an unknown command with "A subcommand is required"; name it instead.
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> commands;
    for (const CLI::App* sub : {fit, launch, eval, predict, check, plan, doctor, config_cmd, export_cmd}) {
      commands.push_back(sub->get_name());
    }
    const std::string word = argv[1];
    if (std::find(commands.begin(), commands.end(), word) == commands.end()) {
      const std::string suggestion = detail::closest_match(word, commands);
      std::string known;
      for (const auto& c : commands) known += (known.empty() ? "" : ", ") + c;
      std::cerr << "unknown command '" << word << "'"
                << (suggestion.empty() ? "" : "; did you mean '" + suggestion + "'?") << " (commands: " << known
                << "; train --help for more)\n";
      return kExitInvalid;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr && argc > 1) {
      // CLI11 says "The following arguments were not expected: auto --resum"; name the option
      // and the one it is probably a typo of.
      for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
        if (sub->get_name() != argv[1]) continue;
        std::string message = unknown_option_message(*sub, std::vector<std::string>(argv + 2, argv + argc));
        if (message.empty()) message = unexpected_argument_message(*sub);
        if (message.empty()) break;
        std::cerr << message << "\n";
        return kExitInvalid;
      }
    }
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitInvalid;
  }

  // Declared before the try: a stop signal that comes while a failed run is reported does not cut
  // the report short (StopSignals).
  std::optional<StopSignals> stop_signals;
  try {
    if (fit->parsed()) return cmd_fit(fit_args, run_dir, resume, stop_signals);
    if (eval->parsed()) return cmd_eval(eval_args, checkpoint);
    if (check->parsed()) return cmd_check(check_args, check_data);
    if (plan->parsed()) return cmd_plan(plan_args, plan_json, plan_device, plan_world_size, plan_local_world_size);
    if (launch->parsed()) {
      return cmd_launch(launch_args, nproc, master_port, launch_run_dir, launch_resume, self_executable(argv[0]));
    }
    if (doctor->parsed()) {
      const auto checks = run_doctor();
      std::cout << (doctor_json_flag ? doctor_json(checks) + "\n" : doctor_text(checks));
      for (const auto& c : checks) {
        if (c.status == "fail") return kExitRuntime;
      }
      return kExitOk;
    }
    if (export_cmd->parsed()) return cmd_export(export_checkpoint, export_format, export_out);
    if (predict->parsed()) return cmd_predict(predict_run_dir, predict_inputs, predict_checkpoint, predict_top);
    if (config_cmd->parsed()) {
      std::cout << config_reference();
      return kExitOk;
    }
  } catch (const Error& e) {
    log::error(e.what());
    return e.exit_code();
  } catch (const c10::Error& e) {
    log::error(std::string("LibTorch error: ") + e.what_without_backtrace());
    return kExitRuntime;
  } catch (const std::exception& e) {
    log::error(e.what());
    return kExitRuntime;
  }
  return kExitInvalid;
}

}  // namespace train
