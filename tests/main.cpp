// The test runner. With TRAIN_TEST_WORKER set, the binary is instead one rank of a multi-process
// test (ddp: test_dist.cpp starts copies of itself that way), or the `train` command with test
// models registered (cli: test_kill_resume.cpp).
#define CATCH_CONFIG_RUNNER
#include "testing.h"

#include <cstdlib>
#include <cstring>

int ddp_test_worker();
int cli_test_worker(int argc, char** argv);

int main(int argc, char** argv) {
  if (const char* role = std::getenv("TRAIN_TEST_WORKER")) {
    if (std::strcmp(role, "ddp") == 0) return ddp_test_worker();
    if (std::strcmp(role, "cli") == 0) return cli_test_worker(argc, argv);
    std::fprintf(stderr, "unknown TRAIN_TEST_WORKER '%s'\n", role);
    return 2;
  }
  return Catch::Session().run(argc, argv);
}
