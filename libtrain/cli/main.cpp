#include <train/cli.h>
#include <train/host_memory.h>

int main(int argc, char** argv) {
  train::tune_host_malloc();  // before the first large allocation
  return train::run_cli(argc, argv);
}
