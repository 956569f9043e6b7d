#pragma once
// How the process's C heap treats the memory a training step frees.
//
// glibc's malloc hands every block of 128 KiB or more back to the kernel when it is freed (and
// maps blocks over 32 MiB afresh each time), so a CPU training step, which frees and allocates
// the same activation tensors step after step, page-faults its way through them again: a quarter
// of a BERT-mini step's samples in `perf` were the kernel zero-filling pages. Keeping freed memory
// in the process, as a caching allocator does, avoids most of that. Measured on a 2-core Xeon,
// LibTorch 2.11, fp32, 3 interleaved rounds (benchmarks/README.md): ResNet-50 step 1.15x,
// ResNet-18 1.06x, BERT-mini within noise (0.97x), for 5-25 % more resident memory.
//
// The `train` command and the bundled examples call tune_host_malloc() first thing; a program
// that links train decides for itself.

#include <string>

namespace train {

// glibc only: disables the kernel round trip for blocks under 32 MiB (the largest mmap threshold
// glibc accepts) and keeps up to 2 GiB of freed memory at the top of the heap instead of trimming
// it. Left alone, with the reason in host_malloc_state(), when the environment already tunes malloc
// (MALLOC_*_ variables, GLIBC_TUNABLES with malloc settings, a preloaded jemalloc / tcmalloc /
// mimalloc) or sets TRAIN_HOST_MALLOC=default. Idempotent; returns whether the setting is applied.
bool tune_host_malloc();

// What tune_host_malloc() did, for the plan: "kept" or "default", and why.
struct HostMallocState {
  bool tuned = false;
  std::string reason;
};
HostMallocState host_malloc_state();

}  // namespace train
