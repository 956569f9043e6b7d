// tune_host_malloc: glibc mallopt settings that keep a training step's freed memory in the process.
#include "train/host_memory.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace train {
namespace {

std::mutex state_mutex;
bool attempted = false;
HostMallocState state{false, "glibc's defaults: train::tune_host_malloc() was not called"};

// Why the environment's own malloc settings win, or "" when it has none.
std::string environment_choice() {
  const char* user = std::getenv("TRAIN_HOST_MALLOC");
  if (user != nullptr && std::strcmp(user, "default") == 0) return "TRAIN_HOST_MALLOC=default";
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                           "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX"}) {
    if (std::getenv(name) != nullptr) return std::string(name) + " is set";
  }
  if (const char* tunables = std::getenv("GLIBC_TUNABLES"); tunables != nullptr && std::strstr(tunables, "malloc")) {
    return "GLIBC_TUNABLES sets malloc";
  }
  if (const char* preload = std::getenv("LD_PRELOAD"); preload != nullptr) {
    for (const char* other : {"jemalloc", "tcmalloc", "mimalloc"}) {
      if (std::strstr(preload, other) != nullptr) return std::string(other) + " is preloaded";
    }
  }
  return "";
}

}  // namespace

bool tune_host_malloc() {
  std::lock_guard<std::mutex> lock(state_mutex);
  if (attempted) return state.tuned;
  attempted = true;
  const std::string chosen = environment_choice();
  if (!chosen.empty()) {
    state = {false, "left to the environment (" + chosen + ")"};
    return false;
  }
#if defined(__GLIBC__)
  // The order matters: setting any of these stops glibc from moving the mmap threshold itself.
  constexpr int kMmapThreshold = 32 << 20;  // glibc refuses more than half its 64 MiB heap size
  constexpr int kTrimThreshold = 2047 << 20;
  constexpr int kTopPad = 64 << 20;
  const bool ok = mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1 &&
                  mallopt(M_TOP_PAD, kTopPad) == 1;
  state = ok ? HostMallocState{true,
                               "freed memory stays in the process for the next step (glibc: blocks under 32 MiB "
                               "from the heap, up to 2 GiB kept untrimmed)"}
             : HostMallocState{false, "glibc refused the settings (mallopt)"};
  if (const char* user = std::getenv("TRAIN_HOST_MALLOC"); user != nullptr && *user != '\0') {
    state.reason += std::string("; TRAIN_HOST_MALLOC=") + user + " ignored: the one value it takes is 'default'";
  }
  return ok;
#else
  state = {false, "not glibc: the C library's own malloc"};
  return false;
#endif
}

HostMallocState host_malloc_state() {
  std::lock_guard<std::mutex> lock(state_mutex);
  return state;
}

}  // namespace train
