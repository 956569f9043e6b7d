#include "train/cli.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <iostream>
#include <iterator>
#include <optional>
#include <thread>

#include "atomic_file.h"
#include "run_dir.h"
#include "suggest.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/device.h"
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
#include "train/trainer.h"

namespace train {
namespace {

// train launch --nproc: ranks on one host (one per GPU, or CPU processes for Gloo).
constexpr int64_t kMaxLocalRanks = 256;

// Stop signals: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (Slurm's `--signal=USR1@N` warning before
// the time limit). The first asks the trainer to stop after the current step and checkpoint
// (exit 3); a watchdog ends the process with 128 + that signal, without a checkpoint, if that takes
// longer than trainer.stop_grace_s. Another stop signal kRepeatSignalSeconds or more after the
// first exits at once (128 + signal), without a checkpoint; one sooner is the same request
// delivered twice (directly and forwarded by a launcher, or by a scheduler that signals every
// process of the job) and changes nothing. The handler uses only lock-free atomics,
// clock_gettime, write and _exit, all async-signal-safe.
constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1};
constexpr int64_t kRepeatSignalSeconds = 1;
static_assert(std::atomic<int64_t>::is_always_lock_free && std::atomic<int>::is_always_lock_free &&
                  std::atomic<Trainer*>::is_always_lock_free,
              "the stop signal handler needs lock-free atomics");
std::atomic<Trainer*> g_active_trainer{nullptr};
std::atomic<int> g_handlers_running{0};   // handlers between reading g_active_trainer and done with it
std::atomic<int64_t> g_first_stop_ns{0};  // CLOCK_MONOTONIC time of the first stop signal; 0: none yet
std::atomic<int> g_first_stop_signal{0};

int64_t monotonic_ns() {  // clock_gettime is async-signal-safe; std::chrono's clocks are not promised to be
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

extern "C" void on_stop_signal(int sig) {
  const int saved_errno = errno;
  const int64_t now = std::max<int64_t>(monotonic_ns(), 1);
  int64_t first = 0;
  if (g_first_stop_ns.compare_exchange_strong(first, now)) {
    g_first_stop_signal.store(sig);
    g_handlers_running.fetch_add(1);
    if (Trainer* t = g_active_trainer.load()) t->request_stop();
    g_handlers_running.fetch_sub(1);
  } else if (now - first >= kRepeatSignalSeconds * 1000000000) {
    static const char msg[] = "train: another stop signal; exiting now without a checkpoint\n";
    (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    ::_exit(kExitSignalBase + sig);
  } else {
    static const char msg[] = "train: the stop signal again within 1 s (delivered twice?); already stopping\n";
    (void)!::write(STDERR_FILENO, msg, sizeof(msg) - 1);
  }
  errno = saved_errno;
}

// The stop signals' handler and its watchdog, from the moment a run starts on its run directory
// until the command has reported how it ended (run_cli owns it). Before that a stop signal has its
// default action: nothing is written yet, and a long start (loading, the probe) ends at once.
// Inside it a stop signal never kills the process outright, wherever it lands:
//  - while a trainer is attached, it asks it to stop after the current step and checkpoint;
//  - before the trainer is attached (the run directory is being set up), the trainer gets the
//    request as soon as it is attached;
//  - after it is detached (the run failed, and is putting the run directory back and finding out
//    whether a peer failed first), the cleanup goes on and the error is still reported.
//    train launch sends SIGTERM to the other ranks as soon as one fails, just when they are busy
//    doing that; the default action left half a run directory and no word of the cause.
// The watchdog bounds all of it by trainer.stop_grace_s.
class StopSignals {
 public:
  explicit StopSignals(double grace_seconds) {
    g_first_stop_ns.store(0);
    g_first_stop_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (const int sig : kStopSignals) sigaddset(&sa.sa_mask, sig);  // one handler at a time
    sa.sa_flags = SA_RESTART;
    for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &sa, &previous_[i]);
    watchdog_ = std::thread([this, grace_seconds] {
      const auto grace_ns = static_cast<int64_t>(grace_seconds * 1e9);
      while (!done_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        const int64_t first = g_first_stop_ns.load();
        if (first == 0 || monotonic_ns() - first <= grace_ns) continue;
        const int sig = g_first_stop_signal.load();
        const int code = kExitSignalBase + (sig != 0 ? sig : SIGTERM);
        log::error(log::str("stop requested but the current step and checkpoint did not finish within "
                            "trainer.stop_grace_s = ", grace_seconds, " s; exiting with ", code,
                            " (128 + the signal) without a checkpoint"));
        std::_Exit(code);
      }
    });
  }
  ~StopSignals() {
    done_.store(true);
    watchdog_.join();
    for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &previous_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The trainer that stop signals go to, for this object's lifetime (declare it after the trainer).
  class Attach {
   public:
    explicit Attach(Trainer& t) {
      g_active_trainer.store(&t);
      if (g_first_stop_ns.load() != 0) t.request_stop();  // one that came while the run was being set up
    }
    ~Attach() {
      g_active_trainer.store(nullptr);
      // A handler that read the pointer just before is done with it before the trainer goes.
      while (g_handlers_running.load() != 0) std::this_thread::yield();
    }
    Attach(const Attach&) = delete;
    Attach& operator=(const Attach&) = delete;
  };

 private:
  std::atomic<bool> done_{false};
  std::thread watchdog_;
  struct sigaction previous_[std::size(kStopSignals)] {};
};

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
// the dataset factory, the model registry, the plan) gets the file, line and column where its key
// was set, like the errors the parser finds.
template <typename Body>
int with_config_location(const Config& config, Body&& body) {
  try {
    return body();
  } catch (const ConfigError& e) {
    throw ConfigError(locate_config_error(config, e.what()));
  }
}

// The message of the exception being handled, for one that is not a train::Error.
std::string describe_current_exception() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return std::string("LibTorch error: ") + e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

// --run-dir (or its default) must be a directory or something mkdir -p can create: a regular
// file there, or on the way there, is a usage error found before anything runs.
void check_run_dir(const std::string& run_dir) {
  for (std::string path = run_dir;; path = files::parent(path)) {
    if (files::exists(path)) {
      if (!files::is_directory(path)) {
        throw UsageError("--run-dir " + run_dir + ": " + (path == run_dir ? std::string() : path + " ") +
                         "is a file, not a directory; give a directory (or a path to create)");
      }
      return;
    }
    if (files::parent(path) == path || files::parent(path) == ".") return;
  }
}

// Bad input, as opposed to a runtime failure (a diverging loss, a full disk): a run stopped by it
// leaves no trace in the run directory unless it got as far as a checkpoint.
bool is_bad_input(const Error& e) {
  return dynamic_cast<const DataError*>(&e) || dynamic_cast<const ConfigError*>(&e) ||
         dynamic_cast<const CheckpointError*>(&e) || dynamic_cast<const UsageError*>(&e);
}

// model.init_from is readable and fits the model; an error names where the file was given.
void check_init_from(const Config& config, const models::Model& model) {
  try {
    check_model_weights(config.model.init_from, model, config.model.init_strict, model.weight_rules());
  } catch (const CheckpointError& e) {
    throw CheckpointError(locate_config_error(config, std::string("key 'model.init_from': ") + e.what()));
  }
}

// tuning.device names hardware to plan for (train plan); a command that runs on this machine's
// hardware would otherwise run with another device's plan, or fail deep inside LibTorch.
void reject_named_device(const Config& config, const char* command) {
  if (config.tuning.device.empty()) return;
  throw ConfigError(log::str("key 'tuning.device': '", config.tuning.device, "' plans for a device profile, for train ",
                             "plan; train ", command, " runs on this machine's hardware (trainer.device), so remove ",
                             "tuning.device here, or see the plan with train plan --device ", config.tuning.device));
}

// Everything that can be checked without the data (which may live on another machine): the keys,
// the model (name and sizes: it is built), a named device profile, and model.init_from.
int cmd_check(const CommonArgs& args) {
  const Config config = load_config(args.config, args.sets);
  return with_config_location(config, [&] {
    const models::ModelPtr model = models::make_model(config.model);
    if (!config.tuning.device.empty()) named_device(config.tuning.device);
    if (!config.model.init_from.empty()) check_init_from(config, *model);
    std::cout << args.config << ": OK (model " << config.model.name << ", " << models::count_parameters(*model)
              << " parameters, global batch " << config.trainer.global_batch << "; the data was not read)\n";
    return kExitOk;
  });
}

int cmd_plan(CommonArgs args, bool json, const std::string& device, int64_t world_size, int64_t local_world_size) {
  if (local_world_size > 0 && (local_world_size > world_size || world_size % local_world_size != 0)) {
    throw UsageError(log::str("--local-world-size ", local_world_size, ": the ranks per host must divide --world-size ",
                              world_size, " (", world_size, " ranks on hosts of ", local_world_size, " each)"));
  }
  if (!device.empty()) args.sets.push_back("tuning.device=" + device);
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

// Creates the run directory and trains. A run stopped by bad input before its first checkpoint
// puts the run directory back as it found it (removes it when it created it).
int train_in_run_dir(const Config& config, RunParts& run, const std::string& run_dir, const std::string& resume_path,
                     bool leader, std::optional<StopSignals>& stop_signals) {
  stop_signals.emplace(config.trainer.stop_grace_s);
  std::optional<detail::RunDirSnapshot> before;
  std::optional<detail::RunDirLock> lock;
  if (leader) {
    before.emplace(run_dir);
    // Locked before anything is written; a run that cannot take the lock changes nothing.
    files::make_directories(run_dir);
    lock.emplace(run_dir);
    // What a write killed before its rename left (a kill or a full disk in an earlier run here).
    detail::remove_stale_temporaries(run_dir, [](const std::string& target) {
      return target == "config.yaml" || target == "plan.json" || target == "metrics.jsonl";
    });
    // Another run may have checkpointed here between cmd_fit's check and the lock.
    if (resume_path.empty() && !latest_checkpoint(files::join(run_dir, "checkpoints")).empty()) {
      throw UsageError("run directory " + run_dir + " now holds checkpoints (another run wrote them); pass --resume "
                       "auto to continue it, or --run-dir to start a new run");
    }
  }
  try {
    if (leader) {  // rank 0 owns the run directory
      files::make_directories(run_dir);
      log::set_file(files::join(run_dir, "train.log"));
      detail::write_text_atomically(files::join(run_dir, "config.yaml"), to_yaml(config));
      detail::write_text_atomically(files::join(run_dir, "plan.json"), run.plan.to_json() + "\n");
    }
    log::info("run directory " + run_dir);
    log::info(run.model->name() + ": " + std::to_string(run.plan.model_params) + " parameters; train " +
              run.train->describe() + "; val " + run.val->describe());
    std::istringstream plan_text(run.plan.to_text());
    for (std::string line; std::getline(plan_text, line);) log::info(line);

    apply_plan_globals(run.plan);
    FitResult result;
    {
      Trainer trainer(config, run.plan, run.model, run.train, run.val, run_dir, run.group);
      if (run.record_oom) trainer.on_out_of_memory(run.record_oom);
      StopSignals::Attach stop(trainer);
      result = trainer.fit(resume_path);
    }
    log::info(log::str("done: ", result.steps, " steps in ", format_duration(result.seconds), "; data wait ",
                       log::fixed(100.0 * result.data_wait_fraction, 2), "% of loop time",
                       result.loader_workers != run.plan.workers
                           ? log::str(" (loader workers raised to ", result.loader_workers, ")")
                           : std::string(),
                       result.val.samples ? log::str("; val top-1 ", log::fixed(100.0 * result.val.accuracy, 2), "%") : ""));
    log::set_file("");
    if (result.diverged_ranks != 0) return kExitRuntime;
    // Stopped by a signal before the end, with a checkpoint to resume from.
    return result.steps < run.plan.total_steps ? kExitStopped : kExitOk;
  } catch (const Error& e) {
    // The trainer (its loader workers, metrics and event files) is gone by now.
    std::optional<dist::Group::PeerFailure> peer;
    if (run.group && run.group->size() > 1) {
      run.group->post_failure(e.exit_code(), is_bad_input(e), e.what());
      // A collective that failed here may be the echo of another rank's bad input (a corrupt
      // file in its shard): that rank posted why before it exited.
      if (!is_bad_input(e)) peer = run.group->peer_failure(3.0);
    }
    const bool bad_input = is_bad_input(e) || (peer && peer->bad_input);
    if (before && bad_input && !before->has_new_checkpoint()) {
      log::set_file("");
      log::warn("the run stopped before its first checkpoint; " + before->restore());
    }
    if (peer) {
      throw Error(log::str("rank ", peer->rank, " stopped first: ", peer->message, "\n(rank ", run.group->rank(),
                           " then failed with: ", e.what(), ")"),
                  peer->exit_code);
    }
    throw;
  } catch (...) {
    // Not one of train's errors (std::invalid_argument, c10::Error, std::bad_alloc from a library
    // fed something that was not checked up front): it may well be bad input, so before the first
    // checkpoint the run directory is put back as for bad input. run_cli maps it to exit 1.
    const std::string what = describe_current_exception();
    if (run.group && run.group->size() > 1) run.group->post_failure(kExitRuntime, true, what);
    if (before && !before->has_new_checkpoint()) {
      log::set_file("");
      log::warn("the run stopped before its first checkpoint; " + before->restore());
    }
    throw;
  }
}

int cmd_fit(const CommonArgs& args, std::string run_dir, const std::string& resume,
            std::optional<StopSignals>& stop_signals) {
  // Everything that can be rejected is checked before the run directory is touched.
  const Config config = load_config(args.config, args.sets);
  log::set_level(config.logging.level);  // before anything logs (the probe, the plan cache)
  return with_config_location(config, [&] {
    reject_named_device(config, "fit");
    if (run_dir.empty()) run_dir = default_run_dir(args.config);
    check_run_dir(run_dir);
    const std::string ckpt_dir = files::join(run_dir, "checkpoints");
    if (resume.empty() && !latest_checkpoint(ckpt_dir).empty()) {
      throw UsageError("run directory " + run_dir + " already holds checkpoints; pass --resume auto to continue it, "
                       "or --run-dir to start a new run");
    }
    if (!resume.empty() && resume != "auto" && !files::exists(resume)) {
      throw CheckpointError(resume + ": checkpoint file does not exist (--resume)");
    }
    RunOptions options;
    options.env = dist::detect_env();
    const bool leader = options.env.rank == 0;
    log::set_rank(static_cast<int>(options.env.rank));
    RunParts run = prepare_run(config, options);
    // Resolve and validate the checkpoint now, so that a corrupt or mismatching one is rejected
    // before anything is written (the trainer loads it again, with the optimizer).
    const std::string resume_path = resume == "auto" ? latest_checkpoint(ckpt_dir) : resume;
    if (resume == "auto" && resume_path.empty()) {
      log::info("--resume auto: no checkpoint in " + ckpt_dir + "; starting fresh");
    }
    if (!resume_path.empty()) load_checkpoint(resume_path, *run.model, nullptr);
    if (resume_path.empty() && !config.model.init_from.empty()) {
      check_init_from(config, *run.model);
    }
    return train_in_run_dir(config, run, run_dir, resume_path, leader, stop_signals);
  });
}

// Validates the config here, so that a bad one fails once, before any rank starts.
int cmd_launch(const CommonArgs& args, int nproc, int master_port, const std::string& run_dir,
               const std::string& resume, const std::string& self) {
  const Config config = load_config(args.config, args.sets);
  with_config_location(config, [&] {
    reject_named_device(config, "launch");
    // Every rank would find this on its own, after all of them started.
    if (config.tuning.batch == "fixed" && config.trainer.global_batch % nproc != 0) {
      throw ConfigError(log::str("key 'trainer.global_batch': ", config.trainer.global_batch,
                                 " is not divisible by --nproc ", nproc, "; choose a multiple of ", nproc));
    }
    return 0;
  });
  check_run_dir(run_dir.empty() ? default_run_dir(args.config) : run_dir);
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
    reject_named_device(config, "eval");
    RunParts run = prepare_run(config);
    load_model_weights(checkpoint, *run.model);
    apply_plan_globals(run.plan);
    Trainer trainer(config, run.plan, run.model, run.train, run.val, "");
    const EvalResult ev = trainer.evaluate();
    MetricRecord r;
    r.add("checkpoint", checkpoint).add("split", "val").add("loss", ev.loss).add("accuracy", ev.accuracy)
        .add("samples", ev.samples);
    std::cout << r.to_json() << "\n";
    return kExitOk;
  });
}

// train export CHECKPOINT --format safetensors OUT: the model weights under their state-dict
// names (torchvision's for ResNet), loadable with safetensors.torch.load_file + load_state_dict.
int cmd_export(const std::string& checkpoint, const std::string& format, const std::string& out) {
  if (format != "safetensors") throw UsageError("--format " + format + ": the only export format is safetensors");
  const TensorMap weights = read_checkpoint_weights(checkpoint);
  Metadata metadata{{"format", "pt"}, {"producer", "train export"}, {"source", files::filename(checkpoint)}};
  write_safetensors(out, weights, metadata);
  int64_t bytes = 0;
  for (const auto& [name, t] : weights) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  std::cout << "wrote " << out << ": " << weights.size() << " tensors, " << bytes / (1024 * 1024) << " MiB from "
            << checkpoint << "\n";
  return kExitOk;
}

}  // namespace

int run_cli(int argc, char** argv) {
  CLI::App app{"train: device-adaptive training on LibTorch"};
  app.require_subcommand(1);
  app.footer("Exit codes: 0 success; 1 bad data (a missing, truncated or malformed data file) or a runtime "
             "failure; 2 invalid usage, config or checkpoint; 3 stopped by SIGTERM/SIGINT/SIGUSR1 after a "
             "checkpoint (resume with --resume auto); 128+N stopped by signal N without a checkpoint (a second "
             "signal 1 s or more after the first, or trainer.stop_grace_s exceeded); 127 train launch could not "
             "start a rank. Bad input leaves no run directory behind.");

  CommonArgs fit_args, eval_args, check_args, plan_args;
  std::string run_dir, resume, checkpoint;
  bool plan_json = false, reference = false;

  auto* fit = app.add_subcommand("fit", "Train a model from a YAML config");
  add_common(fit, fit_args);
  fit->add_option("--run-dir", run_dir, "Run directory (default: runs/<config name>)");
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
  launch->add_option("--run-dir", launch_run_dir, "Run directory (default: runs/<config name>)");
  launch->add_option("--resume", launch_resume, "Checkpoint to resume from, or 'auto'")->type_name("PATH|auto");

  auto* eval = app.add_subcommand("eval", "Evaluate a checkpoint on the validation split");
  add_common(eval, eval_args);
  eval->add_option("--checkpoint", checkpoint, "Checkpoint file")->required();

  auto* check = app.add_subcommand("check", "Validate a config without training");
  add_common(check, check_args);

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

  std::string export_checkpoint, export_format = "safetensors", export_out;
  auto* export_cmd = app.add_subcommand("export", "Write a checkpoint's model weights for other frameworks");
  export_cmd->add_option("checkpoint", export_checkpoint, "Checkpoint file written by train fit")->required();
  export_cmd->add_option("out", export_out, "Output file, e.g. model.safetensors")->required();
  export_cmd->add_option("--format", export_format, "Output format")->capture_default_str();

  // CLI11 answers an unknown command with "A subcommand is required"; name it instead.
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> commands;
    for (const CLI::App* sub : {fit, launch, eval, check, plan, doctor, config_cmd, export_cmd}) {
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
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitInvalid;
  }

  // Declared before the try: a stop signal that comes while a failed run is reported does not cut
  // the report short (StopSignals).
  std::optional<StopSignals> stop_signals;
  try {
    if (fit->parsed()) return cmd_fit(fit_args, run_dir, resume, stop_signals);
    if (eval->parsed()) return cmd_eval(eval_args, checkpoint);
    if (check->parsed()) return cmd_check(check_args);
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
