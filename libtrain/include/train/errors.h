#pragma once
// Error types and the documented exit codes of the `train` CLI.
//
//   0  success
//   1  bad data or a runtime failure: a data file that is missing, truncated or malformed (IDX,
//      JPEG / PNG, token file, vocab, TSV), found before training or by a loader mid-run; a
//      numerical failure; I/O errors
//   2  invalid usage or configuration: CLI arguments, the config file and --set overrides (type,
//      range, unknown or duplicate key, YAML syntax, batch arithmetic), and a checkpoint given with
//      --resume, --checkpoint or model.init_from that is unreadable or does not fit the model
//   3  stopped early by SIGTERM / SIGINT / SIGUSR1 / SIGHUP after writing a checkpoint; `--resume auto`
//      continues. A second stop signal within 1 s of the first (the same one delivered directly
//      and by a launcher) changes nothing.
//   128 + N  stopped by signal N without a checkpoint: another stop signal 1 s or more after the
//      first, or the step and checkpoint took longer than trainer.stop_grace_s (N is then the first
//      signal's number: 143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1), as for a process killed
//      by that signal. `--resume auto` continues from the newest earlier checkpoint.
//   127  `train launch` could not start a rank (exec of the train executable failed).
//
// Nothing is left half-written: input is validated (config, data file headers and sizes,
// checkpoints) before the run directory is created, and a run that fails before its first
// checkpoint removes what it created in the run directory. That is `train fit`'s promise, and
// fit_in_run_dir's (fit.h) for a program that links the library; a Trainer alone does neither.
#include <stdexcept>
#include <string>

namespace train {

enum ExitCode : int {
  kExitOk = 0,
  kExitRuntime = 1,
  kExitData = 1,
  kExitInvalid = 2,
  kExitStopped = 3,
  kExitLaunch = 127,      // train launch could not start a rank
  kExitSignalBase = 128,  // + the signal number: stopped by a signal without a checkpoint
};

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, int exit_code = kExitRuntime)
      : std::runtime_error(what), exit_code_(exit_code) {}
  int exit_code() const noexcept { return exit_code_; }

 private:
  int exit_code_;
};

// Bad command line (unknown flag, missing argument).
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& what) : Error(what, kExitInvalid) {}
};

// Bad configuration: the message names the source (file or --set), the key path,
// and line:column when known.
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& what) : Error(what, kExitInvalid) {}
};

// A data file that is missing, truncated or malformed. Names the file. Exit code 1, like any
// other failure to read the data, whether found up front or by a loader mid-run.
class DataError : public Error {
 public:
  explicit DataError(const std::string& what, int exit_code = kExitData) : Error(what, exit_code) {}
};

// A checkpoint that is missing, truncated, or does not match the model. Names the file.
class CheckpointError : public Error {
 public:
  explicit CheckpointError(const std::string& what) : Error(what, kExitInvalid) {}
};

}  // namespace train
