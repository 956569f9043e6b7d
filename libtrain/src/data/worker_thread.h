#pragma once
// Internal: what a thread that builds samples for others (a loader worker, a scan thread) does
// first.
#include <ATen/Parallel.h>

#include <dlfcn.h>

namespace train::data {

// Makes ATen's intra-op parallelism serial in the calling thread only; other threads keep
// at::get_num_threads().
//
// A worker is one unit of the loader's parallelism, as a DataLoader worker process is in PyTorch
// (which calls torch.set_num_threads(1) in each). LibTorch's OpenMP backend gives every thread
// that runs a parallelised ATen op (collate's stack, pin_memory's copy, a dataset's own tensor
// code) an OpenMP team of its own, at::get_num_threads() strong: W workers on C cores start W
// teams of C threads (a GPU plan on 16 cores: 8 to 15 teams of 16), which spin after each op and
// take the cores from the workers and from the training thread. at::set_num_threads would change
// the count for every thread (and MKL's), so this sets only the calling thread's OpenMP count. It
// looks omp_set_num_threads up in the process: the OpenMP runtime LibTorch was built with (the
// wheel bundles its own libgomp; linking another would load two). ATen initialises each thread's
// count the first time the thread asks, so it asks first. A LibTorch without OpenMP (a native or
// TBB thread pool, which every thread shares) has no per-thread count to set, and nothing happens.
inline void make_intra_op_serial_in_this_thread() {
  (void)at::get_num_threads();  // ATen's per-thread initialisation, which would undo what follows
  using SetThreads = void (*)(int);
  static const auto set_threads = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set_threads != nullptr) set_threads(1);
}

}  // namespace train::data
