#pragma once
// A whole training run in its run directory, as `train fit` does it, for programs that link
// train::train:
//
//   const train::Config config = train::load_config(path, overrides);
//   train::FitOptions options;
//   options.run_dir = "runs/mine";
//   options.resume = "auto";
//   train::check_fit_options(config, options);                 // before the data is read
//   train::RunParts run = train::prepare_run(config);          // device, model, data, plan
//   const train::FitReport report = train::fit_in_run_dir(config, run, options);
//   return report.exit_code;                                   // 0, or kExitStopped after a stop signal
//
// What it adds to constructing a Trainer and calling fit():
//  - the run directory is locked (a second run there is refused, UsageError) and stale temporary
//    files from a killed write are removed; config.yaml, plan.json and train.log are written;
//  - a fresh start refuses a directory that already holds checkpoints; a resume checkpoint and
//    model.init_from are read and checked against the model before anything is written;
//  - bad input (DataError, ConfigError, CheckpointError, UsageError, or an error from a library fed
//    something not checked up front) before the first checkpoint puts the run directory back as it
//    was, and removes it when this call created it; so does any failure while config.yaml,
//    plan.json and train.log are written (a full disk);
//  - SIGTERM, SIGINT, SIGUSR1 and SIGHUP stop the run after the current step with a checkpoint
//    (exit_code kExitStopped), within trainer.stop_grace_s (StopSignals);
//  - the plan cache learns a micro-batch that ran out of memory (RunParts::record_oom);
//  - in a data-parallel job, a rank's error is posted to the others, and a failure caused by
//    another rank's bad input is reported as that rank's.
#include <train/run.h>
#include <train/trainer.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace train {

// Handles SIGTERM, SIGINT (Ctrl-C), SIGUSR1 (Slurm's --signal=USR1@N before a time limit) and
// SIGHUP (a closed terminal or SSH session; left alone when it was ignored at the start, as under
// nohup) while it lives, restoring the previous handlers after. The first signal asks the attached trainer to
// stop after its current step and checkpoint; if that takes longer than `grace_seconds` the
// process exits with 128 + the signal, without a checkpoint. Another stop signal 1 s or more after
// the first exits at once (128 + signal); one sooner is the same request delivered twice (by a
// launcher and a scheduler) and changes nothing. A signal that comes before a trainer is attached
// is handed to it when it is; after it is detached (a failed run putting its directory back) the
// cleanup goes on. One at a time per process.
class StopSignals {
 public:
  explicit StopSignals(double grace_seconds);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The trainer that stop signals go to for this guard's lifetime (declare it after the trainer).
  class Attach {
   public:
    explicit Attach(Trainer& trainer);
    ~Attach();
    Attach(const Attach&) = delete;
    Attach& operator=(const Attach&) = delete;
  };

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct FitOptions {
  std::string run_dir;  // created when missing (with its parents)
  // "": a fresh start (refused when run_dir already holds checkpoints, readable or not); "auto":
  // the newest checkpoint in run_dir/checkpoints that reads back, or a fresh start when there is
  // none at all (CheckpointError when there are some but none reads back); else a checkpoint file.
  std::string resume;
  // Install StopSignals (trainer.stop_grace_s) for the run. Off: the program's own handlers stay,
  // and it may call Trainer::request_stop itself from on_trainer.
  bool handle_stop_signals = true;
  // Where the handler is kept, so that it outlives this call: a program that reports the error
  // itself after fit_in_run_dir throws (as train fit does) keeps a signal from cutting that report
  // short. Null: the handler lives for the call.
  std::optional<StopSignals>* keep_stop_signals = nullptr;
  // Called with the trainer before it starts (e.g. to keep a pointer for request_stop).
  std::function<void(Trainer&)> on_trainer;
};

struct FitReport {
  // kExitOk; kExitStopped when a stop signal ended the run early (with a checkpoint: resume with
  // "auto"); kExitRuntime when a data-parallel run ended with replicas that differ.
  int exit_code = 0;
  FitResult result;
};

// What can be checked before the data is read (which may take minutes): run_dir is a directory or
// can be created, a fresh start would not overwrite checkpoints, --resume auto has a readable one
// where there are checkpoints, a resume file exists, and the config runs on this machine
// (check_runs_here). Throws UsageError, CheckpointError, ConfigError.
// fit_in_run_dir checks it again.
void check_fit_options(const Config& config, const FitOptions& options);

// Trains `run` (from prepare_run, for `config`) in options.run_dir; see the top of this file.
// Throws train::Error (its exit_code() is the process's) or what a library threw.
FitReport fit_in_run_dir(const Config& config, RunParts& run, const FitOptions& options);

}  // namespace train
