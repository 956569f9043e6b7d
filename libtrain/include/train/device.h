#pragma once
// DeviceProfile: what the run executes on, detected once at start-up.
#include <cstdint>
#include <string>

namespace train {

struct DeviceProfile {
  std::string kind = "cpu";       // "cpu" | "cuda"
  int index = 0;                  // CUDA device index used by this process
  std::string name;               // GPU name, or the CPU model
  int cc_major = 0, cc_minor = 0; // CUDA compute capability
  int64_t total_memory = 0;       // bytes (GPU memory, or physical RAM for CPU)
  int64_t free_memory = 0;        // bytes at detection time
  int sm_count = 0;
  int visible_gpus = 0;           // CUDA devices visible to the process
  bool bf16 = false;              // native bf16 tensor cores (cc >= 8.0)
  bool tf32 = false;              // TF32 tensor cores (cc >= 8.0)
  int cpu_cores = 1;              // cores available to this process (affinity + cgroup quota)
  std::string cpu_isa;            // e.g. "avx512f avx2"; "" when unknown
  std::string blas;               // BLAS library LibTorch calls on CPU
  std::string torch_version;
  std::string cuda_version;       // CUDA runtime LibTorch was built with ("" for CPU builds)

  bool is_cuda() const { return kind == "cuda"; }
  std::string device_string() const;  // "cpu" or "cuda:N"
  std::string summary() const;        // one line for logs
};

// Detects the device named by `trainer.device` ("auto", "cpu", "cuda", "cuda:N").
// "auto" picks CUDA when a device is visible. Throws ConfigError when CUDA is asked for
// and none is available.
DeviceProfile detect_device(const std::string& request = "auto", int local_rank = 0);

// Cores this process may run on: sched affinity, capped by a cgroup v2/v1 CPU quota.
int available_cores();

}  // namespace train
