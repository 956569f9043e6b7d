// A whole run in its run directory (fit.h): the stop signals, the run directory's lock and
// snapshot, the checks before anything is written, and the trainer.
#include "train/fit.h"

#include <torch/torch.h>

#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <thread>

#include "atomic_file.h"
#include "run_dir.h"
#include "train/checkpoint.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"

namespace train {
namespace {

// Stop signals: SIGTERM, SIGINT (Ctrl-C), SIGUSR1 (Slurm's `--signal=USR1@N` warning before the
// time limit) and SIGHUP (the terminal or SSH session closed; torchrun forwards it too), unless the
// process started with SIGHUP ignored (nohup): that choice is kept. The first asks the trainer to stop after the current step and checkpoint
// (exit 3); a watchdog ends the process with 128 + that signal, without a checkpoint, if that takes
// longer than trainer.stop_grace_s. Another stop signal kRepeatSignalSeconds or more after the
// first exits at once (128 + signal), without a checkpoint; one sooner is the same request
// delivered twice (directly and forwarded by a launcher, or by a scheduler that signals every
// process of the job) and changes nothing. The handler uses only lock-free atomics,
// clock_gettime, write and _exit, all async-signal-safe.
constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1, SIGHUP};
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

}  // namespace

// The stop signals' handler and its watchdog, from the moment a run starts on its run directory
// until the command has reported how it ended (fit_in_run_dir, or a caller through FitOptions::keep_stop_signals). Before that a stop signal has its
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
struct StopSignals::Impl {
  std::atomic<bool> done{false};
  std::thread watchdog;
  struct sigaction previous[std::size(kStopSignals)] {};
  bool installed[std::size(kStopSignals)] {};
};

StopSignals::StopSignals(double grace_seconds) : impl_(std::make_unique<Impl>()) {
  g_first_stop_ns.store(0);
  g_first_stop_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  for (const int sig : kStopSignals) sigaddset(&sa.sa_mask, sig);  // one handler at a time
  sa.sa_flags = SA_RESTART;
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    // A SIGHUP ignored from the start is nohup's (or a launcher's) doing: the run outlives its terminal.
    struct sigaction current {};
    if (kStopSignals[i] == SIGHUP && ::sigaction(SIGHUP, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) {
      continue;
    }
    impl_->installed[i] = ::sigaction(kStopSignals[i], &sa, &impl_->previous[i]) == 0;
  }
  impl_->watchdog = std::thread([impl = impl_.get(), grace_seconds] {
    const auto grace_ns = static_cast<int64_t>(grace_seconds * 1e9);
    while (!impl->done.load()) {
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

StopSignals::~StopSignals() {
  impl_->done.store(true);
  impl_->watchdog.join();
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    if (impl_->installed[i]) ::sigaction(kStopSignals[i], &impl_->previous[i], nullptr);
  }
}

StopSignals::Attach::Attach(Trainer& trainer) {
  g_active_trainer.store(&trainer);
  if (g_first_stop_ns.load() != 0) trainer.request_stop();  // one that came while the run was being set up
}

StopSignals::Attach::~Attach() {
  g_active_trainer.store(nullptr);
  // A handler that read the pointer just before is done with it before the trainer goes.
  while (g_handlers_running.load() != 0) std::this_thread::yield();
}

namespace {

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

// The run directory must be a directory or something mkdir -p can create: a regular file there, or
// on the way there, is a usage error found before anything runs.
void check_run_dir(const std::string& run_dir, const std::string& config_source) {
  const std::string hint = " (--run-dir, FitOptions::run_dir)";
  for (std::string path = run_dir;; path = files::parent(path)) {
    struct stat link {};
    if (::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode) && !files::exists(path)) {
      throw UsageError("run directory " + run_dir + ": " + path +
                       " is a symbolic link to nothing (its target does not exist); give a directory" + hint);
    }
    if (files::exists(path)) {
      if (!files::is_directory(path)) {
        throw UsageError("run directory " + run_dir + ": " + (path == run_dir ? std::string() : path + " ") +
                         "is a file, not a directory; give a directory (or a path to create)" + hint);
      }
      if (::access(path.c_str(), W_OK | X_OK) != 0) {
        throw UsageError("run directory " + run_dir + ": " + (path == run_dir ? std::string() : path + " ") +
                         "is not writable (" + std::strerror(errno) + ")" + hint);
      }
      break;
    }
    if (files::parent(path) == path || files::parent(path) == ".") break;
  }
  if (!files::is_directory(run_dir)) return;
  // What the run writes must be free to write: a directory where it writes a file (or a file where
  // it makes a directory) would stop the run late, after its first steps and checkpoint interval.
  const std::pair<const char*, bool> layout[] = {{"checkpoints", true},    {"config.yaml", false},
                                                 {"plan.json", false},     {"metrics.jsonl", false},
                                                 {"train.log", false}};
  for (const auto& [name, directory] : layout) {
    const std::string path = files::join(run_dir, name);
    if (files::exists(path) && files::is_directory(path) != directory) {
      throw UsageError("run directory " + run_dir + ": " + path + " is " + (directory ? "a file" : "a directory") +
                       ", where the run writes its " + (directory ? "checkpoints directory" : std::string(name)) +
                       "; move it out of the way, or give another run directory" + hint);
    }
  }
  // The run rewrites config.yaml with every key resolved: a config of the user's own there would
  // lose its comments and layout. (One that a run wrote, resumed from, is rewritten the same.)
  struct stat mine {}, theirs {};
  const std::string written = files::join(run_dir, "config.yaml");
  if (!config_source.empty() && ::stat(config_source.c_str(), &mine) == 0 && ::stat(written.c_str(), &theirs) == 0 &&
      mine.st_dev == theirs.st_dev && mine.st_ino == theirs.st_ino) {
    std::ifstream in(written);
    std::string first;
    std::getline(in, first);
    if (first.rfind(kResolvedConfigHeader, 0) != 0) {
      throw UsageError(config_source + " is the run directory's config.yaml, which the run replaces with the resolved "
                       "config (every key, no comments); keep your config outside the run directory, or give "
                       "another one" + hint);
    }
  }
}

// The steps a fit() call took, for the "done" line, which gives this process's time: after a
// resume "steps 5-6 (2 in this run)", not the run's 6 steps against the time of 2.
std::string describe_steps(const FitResult& result) {
  const int64_t first = result.resumed_from_step, last = result.steps;
  if (first == 0) return log::str(last, " steps");
  if (last <= first) return log::str("0 steps in this run (resumed at step ", first, ")");
  if (last == first + 1) return log::str("step ", last, " (1 in this run)");
  return log::str("steps ", first + 1, "-", last, " (", last - first, " in this run)");
}

// Bad input, as opposed to a runtime failure (a diverging loss, a full disk): a run stopped by it
// leaves no trace in the run directory unless it got as far as a checkpoint.
bool is_bad_input(const Error& e) {
  return dynamic_cast<const DataError*>(&e) || dynamic_cast<const ConfigError*>(&e) ||
         dynamic_cast<const CheckpointError*>(&e) || dynamic_cast<const UsageError*>(&e);
}

// Creates the run directory and trains. A run stopped by bad input before its first checkpoint,
// or by anything while it writes its config.yaml, plan.json and train.log (a full disk), puts the
// run directory back as it found it (removes it when it created it).
FitReport train_in_run_dir(const Config& config, RunParts& run, const std::string& run_dir,
                           const std::string& resume_path, const FitOptions& options) {
  const bool leader = run.plan.rank == 0;
  std::optional<StopSignals> own_signals;
  std::optional<StopSignals>& stop_signals = options.keep_stop_signals ? *options.keep_stop_signals : own_signals;
  if (options.handle_stop_signals) {
    stop_signals.reset();  // one at a time: the old one's handlers are restored first
    stop_signals.emplace(config.trainer.stop_grace_s);
  }
  std::optional<detail::RunDirSnapshot> before;
  std::optional<detail::RunDirLock> lock;
  if (leader) try {
    before.emplace(run_dir);
    // Locked before anything is written; a run that cannot take the lock changes nothing.
    files::make_directories(run_dir);
    lock.emplace(run_dir);
    // What a write killed before its rename left (a kill or a full disk in an earlier run here).
    // An event file's would be read by TensorBoard (any name with "tfevents" in it) and shown twice.
    detail::remove_stale_temporaries(run_dir, [](const std::string& target) {
      return target == "config.yaml" || target == "plan.json" || target == "metrics.jsonl" ||
             target.rfind("events.out.tfevents.", 0) == 0;
    });
    // Another run may have checkpointed here between check_fit_options and the lock.
    if (resume_path.empty() && !list_checkpoints(files::join(run_dir, "checkpoints")).empty()) {
      throw UsageError("run directory " + run_dir + " now holds checkpoints (another run wrote them); continue it "
                       "(--resume auto, FitOptions::resume \"auto\"), or start a new run in another directory");
    }
  } catch (const Error& e) {
    // The other ranks learn why instead of "connection reset by peer" in their next collective.
    // (The directory is another run's, or as it was: nothing to put back.)
    if (run.group && run.group->size() > 1) run.group->post_failure(e.exit_code(), is_bad_input(e), e.what());
    throw;
  }
  // Until the run directory's own files are written, a failure of any kind leaves nothing behind:
  // a train.log that could not be written (a full disk) would not say why the run stopped.
  bool set_up = false;
  try {
    if (leader) {  // rank 0 owns the run directory
      files::make_directories(run_dir);
      log::set_file(files::join(run_dir, "train.log"));
      detail::write_text_atomically(files::join(run_dir, "config.yaml"), to_yaml(config));
      detail::write_text_atomically(files::join(run_dir, "plan.json"), run.plan.to_json() + "\n");
    }
    set_up = true;
    log::info("run directory " + run_dir);
    // The registry's name (a program's own model's too), not the C++ type's.
    log::info("model " + config.model.name + ": " + std::to_string(run.plan.model_params) + " parameters; train " +
              run.train->describe() + "; val " + (run.val ? run.val->describe() : std::string("none")));
    std::istringstream plan_text(run.plan.to_text());
    for (std::string line; std::getline(plan_text, line);) log::info(line);

    apply_plan_globals(run.plan);
    FitReport report;
    FitResult& result = report.result;
    int64_t total_steps = 0;
    {
      Trainer trainer(config, run.plan, run.model, run.train, run.val, run_dir, run.group);
      if (run.record_oom) trainer.on_out_of_memory(run.record_oom);
      if (options.on_trainer) options.on_trainer(trainer);
      std::optional<StopSignals::Attach> stop;
      if (stop_signals) stop.emplace(trainer);
      result = trainer.fit(resume_path);
      total_steps = trainer.plan().total_steps;
    }
    log::info(log::str("done: ", describe_steps(result), result.stopped_early ? " (stopped early)" : "", " in ",
                       format_duration(result.seconds), "; data wait ",
                       log::fixed(100.0 * result.data_wait_fraction, 2), "% of loop time",
                       result.loader_workers != run.plan.workers
                           ? log::str(" (loader workers raised to ", result.loader_workers, ")")
                           : std::string(),
                       !result.val.samples         ? std::string()
                       : !result.val.has_accuracy ? "; val loss " + log::measure(result.val.loss)
                                                  : log::str("; val top-1 ", log::fixed(100.0 * result.val.accuracy, 2),
                                                             "%",
                                                             result.val.has_top5
                                                                 ? ", top-5 " + log::fixed(100.0 * result.val.top5, 2) + "%"
                                                                 : std::string()),
                       result.best_checkpoint.empty()
                           ? std::string()
                           : log::str("; best ", result.best_metric, " at step ", result.best_step, ": ",
                                      result.best_checkpoint)));
    log::set_file("");
    // Stopped by a signal before the end, with a checkpoint to resume from.
    report.exit_code = result.diverged_ranks != 0                ? kExitRuntime
                       : result.steps < total_steps && !result.stopped_early ? kExitStopped
                                                               : kExitOk;
    return report;
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
    if (before && !set_up) {
      log::set_file("");
      log::warn("the run stopped while writing its run directory's files; " + before->restore());
    } else if (before && bad_input && !before->has_new_checkpoint()) {
      log::set_file("");
      log::warn("the run stopped before its first checkpoint; " + before->restore());
    }
    if (peer && peer->message != e.what()) {  // (the same finding on every rank needs no second telling)
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

}  // namespace

void check_fit_options(const Config& config, const FitOptions& options) {
  if (options.run_dir.empty()) throw UsageError("no run directory given (FitOptions::run_dir, --run-dir)");
  check_runs_here(config);
  check_run_dir(options.run_dir, config.source);
  // Checkpoints are never overwritten by a new run, not even damaged ones: a file that does not
  // open here may be a copy still arriving, or the only trace of the run's progress.
  const std::string ckpt_dir = files::join(options.run_dir, "checkpoints");
  const std::vector<std::string> existing = list_checkpoints(ckpt_dir);
  if (options.resume.empty() && !existing.empty()) {
    throw UsageError("run directory " + options.run_dir + " already holds checkpoints; continue it (--resume auto, "
                     "FitOptions::resume \"auto\"), or start a new run in another directory");
  }
  if (options.resume == "auto" && !existing.empty() && latest_checkpoint(ckpt_dir).empty()) {
    throw CheckpointError(log::str("--resume auto: none of the ", existing.size(), " checkpoint(s) in ", ckpt_dir,
                                   " can be read (each is named in a warning above), so the run cannot continue; "
                                   "nothing was changed. Move them (and best.pt, best.json) out of the way to start "
                                   "this run over, or start a new run in another directory"));
  }
  // An earlier run's best.pt without the step checkpoints it came from: a new run would rank its
  // evaluations against that run's best (and stop early by it) and then replace its weights.
  if (existing.empty()) {
    std::string left;
    for (const char* name : {"best.pt", "best.json"}) {
      if (files::exists(files::join(ckpt_dir, name))) left += (left.empty() ? "" : " and ") + std::string(name);
    }
    if (!left.empty()) {
      throw UsageError("run directory " + options.run_dir + " holds " + left + " from an earlier run in " + ckpt_dir +
                       " but no step checkpoint to continue from; a new run there would measure itself against that "
                       "run's best and replace it. Move " + (left.find(" and ") == std::string::npos ? "it" : "them") +
                       " out of the way, or start the run in another directory");
    }
  }
  if (!options.resume.empty() && options.resume != "auto" && !files::exists(options.resume)) {
    throw CheckpointError(options.resume + ": checkpoint file does not exist (--resume, FitOptions::resume)");
  }
}

FitReport fit_in_run_dir(const Config& config, RunParts& run, const FitOptions& options) {
  check_fit_options(config, options);
  if (!run.model || !run.train) throw UsageError("fit_in_run_dir: the run has no model or no training set (prepare_run)");
  // Resolve and validate the checkpoint now, so that a corrupt or mismatching one is rejected
  // before anything is written (the trainer loads it again, with the optimizer).
  const std::string ckpt_dir = files::join(options.run_dir, "checkpoints");
  const std::string resume_path = options.resume == "auto" ? latest_checkpoint(ckpt_dir) : options.resume;
  if (options.resume == "auto" && resume_path.empty()) {
    log::info("--resume auto: no checkpoint in " + ckpt_dir + "; starting fresh");
  }
  if (!resume_path.empty()) load_checkpoint(resume_path, *run.model, nullptr);
  if (resume_path.empty() && !config.model.init_from.empty()) check_init_from(config, *run.model);
  return train_in_run_dir(config, run, options.run_dir, resume_path, options);
}

}  // namespace train
