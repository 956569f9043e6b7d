#pragma once
// DeviceProfile: what the run executes on, detected once at start-up, or a named GPU from the
// table of known GPUs that a run is planned for without running on it.
#include <cstdint>
#include <string>
#include <vector>

namespace train {

// One known GPU: identity, and peak figures from its NVIDIA datasheet (dense, no sparsity).
// A peak of 0 means the precision has no tensor-core support on that GPU.
struct GpuSpec {
  std::string key;                         // short table key, e.g. "a100-80gb"
  std::string display_name;                // the CUDA device name of the canonical variant
  std::vector<std::string> name_patterns;  // lowercase words that identify it in a CUDA device name
  int cc_major = 0, cc_minor = 0;
  double memory_gb = 0;                    // nominal memory as marketed (taken as GiB)
  int sm_count = 0;
  double peak_bf16_tflops = 0;             // tensor cores, fp32 accumulate
  double peak_fp16_tflops = 0;             // tensor cores, fp32 accumulate
  double peak_tf32_tflops = 0;             // tensor cores
  double peak_fp32_tflops = 0;             // CUDA cores, no tensor cores
  double bandwidth_gbs = 0;                // memory bandwidth, GB/s
};

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

  // Peak throughput (TFLOP/s) and memory bandwidth (GB/s); 0 = unsupported or unknown. For a GPU
  // they come from the table entry `spec_key`; for a CPU only a rough fp32 peak is estimated.
  std::string spec_key;           // table key; "" for a CPU or a GPU no entry fits
  double peak_bf16_tflops = 0, peak_fp16_tflops = 0, peak_tf32_tflops = 0, peak_fp32_tflops = 0;
  double bandwidth_gbs = 0;
  std::string match;              // how the figures were chosen, e.g. "fallback: compute capability ..."
  bool named = false;             // planned-for hardware from the table, not the device we run on

  bool is_cuda() const { return kind == "cuda"; }
  std::string device_string() const;  // "cpu" or "cuda:N"
  std::string summary() const;        // one line for logs
};

// Detects the device named by `trainer.device` ("auto", "cpu", "cuda", "cuda:N").
// "auto" picks CUDA when a device is visible. Throws ConfigError when CUDA is asked for
// and none is available. A GPU gets its peak figures from match_gpu().
DeviceProfile detect_device(const std::string& request = "auto", int local_rank = 0);

// The profile of a known GPU (a key of known_device_keys(), case-insensitive) for planning a run
// on hardware this machine does not have: named = true, one visible GPU, free memory = total
// memory. Host fields (cores, ISA, BLAS, LibTorch and CUDA versions) are this machine's. "cpu" returns
// detect_device("cpu"). Throws ConfigError for an unknown key, with a did-you-mean and the keys.
DeviceProfile named_device(const std::string& key);

// The keys named_device() accepts: "cpu", then every table key.
std::vector<std::string> known_device_keys();

// The table of known GPUs, oldest architecture first.
const std::vector<GpuSpec>& gpu_specs();

// The table entry for a CUDA device, or nullptr when none fits. Rules, in order:
//  1. Name: the entries with a pattern that occurs as a whole word in the lowercased name (the
//     longest matching pattern wins, so "h100 pcie" beats "h100"); among those the closest
//     memory picks the variant (A100 40 GB vs 80 GB), whatever the name says.
//  2. Fallback for an unknown name: the entries with the same compute capability major.minor,
//     else the same major, else those of the newest compute capability below the device's (an
//     architecture the table lacks is planned as the one it supersedes, e.g. cc 12.0 as 9.0);
//     among them the closest memory, the earlier table entry on a tie. A GPU older than every
//     entry gets nullptr: no entry describes it.
// `how`, when given, receives the reason (the DeviceProfile::match text).
const GpuSpec* match_gpu(const std::string& cuda_name, int cc_major, int cc_minor, int64_t memory_bytes,
                         std::string* how = nullptr);

// Cores this process may run on: sched affinity, capped by its cgroup's CPU quota (rounded down,
// at least 1).
int available_cores();
// The CPU quota of this process's cgroup, in cores; 0 when none applies. The smallest cgroup v2
// cpu.max, or v1 cpu.cfs_quota_us / cpu.cfs_period_us, from the process's own cgroup (named in
// /proc/self/cgroup) up to the root of the hierarchy: a systemd CPUQuota= or a container's --cpus
// sets it below the root. The paths are parameters for tests.
double cgroup_cpu_quota(const std::string& root = "/sys/fs/cgroup",
                        const std::string& self_cgroup_file = "/proc/self/cgroup");

// Peak memory so far, in MiB, for the metrics: on "cuda[:N]" the most the caching allocator has
// handed out at once (since the last peak-statistics reset); on "cpu" the process's peak
// resident set size.
double peak_memory_mib(const std::string& device);
// Starts the CUDA peak anew (so that a run's metrics do not report the memory probe's largest
// trial); the CPU's peak resident set cannot be reset and is left as it is.
void reset_peak_memory(const std::string& device);

}  // namespace train
