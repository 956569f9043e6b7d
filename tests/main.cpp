// The test runner. With TRAIN_TEST_WORKER set, the binary is instead one rank of a multi-process
// test (ddp: test_dist.cpp starts copies of itself that way), or the `train` command with test
// models registered (cli: test_kill_resume.cpp), or writes the LibTorch 1.13 checkpoint fixture
// (fixture: test_trainer.cpp; run by hand on a 1.13 build), or a SIGBUS scenario of
// files::MappedFile in a fresh process (mapped_file: test_tokens.cpp), or the heap after
// tune_host_malloc in a fresh process (host_malloc: test_plan.cpp).
#define CATCH_CONFIG_RUNNER
#include "testing.h"

#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "train/files.h"

int ddp_test_worker();
int cli_test_worker(int argc, char** argv);
int write_checkpoint_fixture();
int mapped_file_test_worker();
int host_malloc_test_worker();

int main(int argc, char** argv) {
  if (const char* role = std::getenv("TRAIN_TEST_WORKER")) {
    if (std::strcmp(role, "ddp") == 0) return ddp_test_worker();
    if (std::strcmp(role, "cli") == 0) return cli_test_worker(argc, argv);
    if (std::strcmp(role, "fixture") == 0) return write_checkpoint_fixture();
    if (std::strcmp(role, "mapped_file") == 0) return mapped_file_test_worker();
    if (std::strcmp(role, "host_malloc") == 0) return host_malloc_test_worker();
    std::fprintf(stderr, "unknown TRAIN_TEST_WORKER '%s'\n", role);
    return 2;
  }
  // No test reads or writes the user's cache (~/.cache/train/plans): a plan cached by an earlier
  // run would turn a probe into a cache hit. Processes the tests start inherit this.
  char cache[] = "/tmp/train_tests_cache_XXXXXX";
  if (::mkdtemp(cache) == nullptr || ::setenv("XDG_CACHE_HOME", cache, 1) != 0) {
    std::perror("train_tests: a temporary XDG_CACHE_HOME");
    return 2;
  }
  const int rc = Catch::Session().run(argc, argv);
  train::files::remove_all(cache);
  return rc;
}
