#pragma once
// Include this instead of <catch2/catch.hpp> in every test file. c10 defines its own CHECK
// macro (abort on failure, invisible to Catch); LibTorch must come first and lose that macro,
// or Catch's CHECK assertions silently turn into c10's.
#include <torch/torch.h>
#undef CHECK
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/wait.h>

#include <csignal>
#include <cstdlib>
#include <string>

#define TRAIN_SOURCE_DIR (::train::testing::source_dir())
#define TRAIN_BINARY_DIR (::train::testing::binary_dir())
#define TRAIN_PYTHON (::train::testing::python())
#define TRAIN_FASHION_MNIST_DIR (::train::testing::fashion_mnist_dir())

// Ends a test that needs a CUDA device when none is visible: with a warning on a CPU machine (ctest
// leaves the [cuda] tests out there, tests/CMakeLists.txt), as a failure when TRAIN_REQUIRE_CUDA=1
// (scripts/gpu-check sets it: on the GPU machine a skipped test would hide a build that cannot
// see the GPU).
#define TRAIN_SKIP_WITHOUT_CUDA(why)                                                                \
  do {                                                                                              \
    if (!torch::cuda::is_available()) {                                                             \
      if (::train::testing::cuda_required()) FAIL("TRAIN_REQUIRE_CUDA=1 but no CUDA device is visible"); \
      WARN(why);                                                                                    \
      return;                                                                                       \
    }                                                                                               \
  } while (false)

namespace train::testing {

// Sets this process's file size limit (RLIMIT_FSIZE) while alive: a write past it fails with
// EFBIG, as a full disk fails one with ENOSPC. SIGXFSZ, which would end the process, is ignored.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &previous_) == 0);
    previous_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = previous_;
    limit.rlim_cur = bytes;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &previous_);
    std::signal(SIGXFSZ, previous_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit previous_{};
  void (*previous_handler_)(int) = SIG_DFL;
};

// Where the repository, the build, the venv's Python and Fashion-MNIST are (tests/paths.cpp.in).
const char* source_dir();
const char* binary_dir();
const char* python();
const char* fashion_mnist_dir();

inline bool cuda_required() {
  const char* v = std::getenv("TRAIN_REQUIRE_CUDA");
  return v != nullptr && std::string(v) == "1";
}

// Runs `python tests/python/<script> <args>` with the project's venv interpreter (the oracle
// packages live there) and returns its exit status. Arguments are passed to the shell as
// given, so quote paths with spaces.
inline int run_python(const std::string& script, const std::string& args = "") {
  const std::string cmd = std::string("\"") + TRAIN_PYTHON + "\" \"" + TRAIN_SOURCE_DIR + "/tests/python/" + script +
                          "\" " + args;
  const int rc = std::system(cmd.c_str());
  return rc == -1 ? -1 : WEXITSTATUS(rc);
}

}  // namespace train::testing
