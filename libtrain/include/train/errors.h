#pragma once
// Error types and the documented exit codes of the `train` CLI.
//
//   0  success
//   1  runtime failure (data that cannot be read mid-run, a numerical failure, I/O errors)
//   2  invalid usage or invalid input (CLI arguments, config, data files, checkpoints);
//      nothing is written to the run directory when this happens before training starts.
//   3  stopped early by SIGTERM / SIGINT after writing a checkpoint; `--resume auto` continues.
//      (A second signal exits at once with 128 + the signal number.)
#include <stdexcept>
#include <string>

namespace train {

enum ExitCode : int { kExitOk = 0, kExitRuntime = 1, kExitInvalid = 2, kExitStopped = 3 };

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

// A data file that is missing, truncated or malformed. Names the file.
class DataError : public Error {
 public:
  explicit DataError(const std::string& what, int exit_code = kExitInvalid) : Error(what, exit_code) {}
};

// A checkpoint that is missing, truncated, or does not match the model. Names the file.
class CheckpointError : public Error {
 public:
  explicit CheckpointError(const std::string& what) : Error(what, kExitInvalid) {}
};

}  // namespace train
