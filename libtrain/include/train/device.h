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
  int64_t memory_bytes = 0;                // what CUDA reports (totalGlobalMem): less than the marketed size
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
  int64_t total_memory = 0;       // bytes: GPU memory, or RAM for a CPU (capped by the cgroup limit)
  int64_t free_memory = 0;        // bytes at detection time (an estimate for a named GPU)
  int sm_count = 0;
  int visible_gpus = 0;           // CUDA devices visible to the process
  bool bf16 = false;              // native bf16 tensor cores (cc >= 8.0)
  bool tf32 = false;              // TF32 tensor cores (cc >= 8.0)
  int cpu_cores = 1;              // cores available to this process (affinity + cgroup quota)
  // OMP_NUM_THREADS as the environment gives it ("" when unset). train does not read it as a
  // thread count (torchrun sets it to 1 for every rank of a multi-rank job, which would leave
  // CPU training one core per rank); trainer.threads caps the threads, and the plan says so.
  std::string omp_num_threads;
  std::string cpu_isa;            // e.g. "avx512f avx2"; "" when unknown
  std::string blas;               // BLAS library LibTorch calls on CPU
  bool onednn = false;            // this LibTorch runs CPU convolutions with oneDNN (MKL-DNN)
  std::string torch_version;
  // CUDA toolkit train was compiled against (CUDA_VERSION; "" for CPU builds). LibTorch 2.x has no
  // call for its own build's CUDA version; `train doctor` shows both sides' labels.
  std::string cuda_version;

  // Peak throughput (TFLOP/s) and memory bandwidth (GB/s); 0 = unsupported or unknown. For a GPU
  // they come from the table entry `spec_key`; for a CPU only a rough fp32 peak is estimated.
  std::string spec_key;           // table key; "" for a CPU or a GPU no entry fits
  double peak_bf16_tflops = 0, peak_fp16_tflops = 0, peak_tf32_tflops = 0, peak_fp32_tflops = 0;
  double bandwidth_gbs = 0;
  std::string match;              // how the figures were chosen, e.g. "fallback: compute capability ..."
  bool approximate = false;       // the figures are another GPU's, or scaled by the SM count (see match)
  bool named = false;             // planned-for hardware from the table, not the device we run on
  std::string warning;            // why this LibTorch may not run on it (no kernels for its compute
                                  // capability); "" when nothing is known against it

  bool is_cuda() const { return kind == "cuda"; }
  std::string device_string() const;  // "cpu" or "cuda:N"
  std::string summary() const;        // one line for logs
};

// Detects the device named by `trainer.device` ("auto", "cpu", "cuda", "cuda:N").
// "auto" picks CUDA when a device is visible. Throws ConfigError when CUDA is asked for
// and none is available. A GPU gets its peak figures from match_gpu().
DeviceProfile detect_device(const std::string& request = "auto", int local_rank = 0);
// The GPU a local rank trains on when the config names none (auto, "cuda"): local_rank modulo the
// visible GPUs, so that each rank of a host gets its own, and GPU 0 for every rank that sees one
// GPU of its own (Slurm's --gpus-per-task=1). More local ranks than GPUs (when several are
// visible) would share GPUs, which NCCL refuses at its first collective: a ConfigError here.
int gpu_for_local_rank(int local_rank, int visible_gpus);

// The profile of a known GPU (a key of known_device_keys(), case-insensitive) for planning a run
// on hardware this machine does not have: named = true, one visible GPU, total memory as CUDA
// reports it on that GPU, free memory an estimate (total less kCudaContextBytes, what a CUDA
// context takes). Host fields (cores, ISA, BLAS, LibTorch and CUDA versions) are this machine's;
// `warning` (also logged) says when this LibTorch has no kernels for the GPU's compute capability.
// "cpu" returns detect_device("cpu"). Throws ConfigError for an unknown key, with a did-you-mean
// and the keys.
DeviceProfile named_device(const std::string& key);

// The memory a CUDA context and its first kernels take on a GPU, as named_device() estimates it.
constexpr int64_t kCudaContextBytes = int64_t{512} << 20;

// The keys named_device() accepts: "cpu", then every table key.
std::vector<std::string> known_device_keys();

// The table of known GPUs, oldest architecture first.
const std::vector<GpuSpec>& gpu_specs();

// The table entry chosen for a CUDA device, and how far its figures fit.
struct GpuMatch {
  const GpuSpec* spec = nullptr;  // nullptr when no entry fits
  double sm_scale = 1.0;          // factor for the entry's compute peaks: device SMs / entry SMs
  bool approximate = false;       // a fallback, or a name match with another SM count
  std::string how;                // the reason (the DeviceProfile::match text)
};

// The table entry for a CUDA device. Rules, in order:
//  1. Name: the entries with a pattern that occurs as a whole word in the lowercased name (the
//     longest matching pattern wins, so "h100 pcie" beats "h100"); among those the closest
//     memory picks the variant (A100 40 GB vs 80 GB), whatever the name says.
//  2. Fallback for an unknown name: the entries with the same compute capability major.minor,
//     else the same major, else those of the newest compute capability below the device's (an
//     architecture the table lacks is planned as the one it supersedes, e.g. cc 12.0 as 9.0);
//     among them the closest memory. A GPU older than every entry gets no spec.
// "Closest memory" counts sizes within 10 % of the device's memory of the closest as a tie (boards
// of one marketed size report 22 to 24 GiB), and a tie goes to the earlier, more conservative entry.
// SM count (0 = unknown: no scaling): when a name match's entry has more than 10 % more or fewer
// SMs than the device (a MIG slice, a Laptop GPU), the match is approximate and the peaks scale by
// the ratio; a fallback's peaks scale down the same way, never up (an unknown GPU with more SMs is
// not assumed faster than the entry it is planned as).
GpuMatch match_gpu(const std::string& cuda_name, int cc_major, int cc_minor, int64_t memory_bytes, int sm_count = 0);

// Fills a CUDA profile's table fields from match_gpu(name, cc, total_memory, sm_count): spec_key,
// the peaks (scaled by GpuMatch::sm_scale), bandwidth, match and approximate; and `warning` from
// kernel_warning() for this LibTorch. detect_device() uses it; tests call it on made-up devices.
void fill_gpu_figures(DeviceProfile& p);

// GPU architectures this LibTorch has kernels for, named as torch.cuda.get_arch_list() names
// them: "sm_90" for machine code (SASS), "compute_90" for PTX that the driver compiles at run
// time. Read from the NVCC flags LibTorch was built with; empty for a CPU-only build.
std::vector<std::string> cuda_arch_list();
// The architectures named in NVCC flags ("-gencode;arch=compute_75,code=sm_75;...") or in a
// plain list ("sm_75 sm_80 compute_90"), in order, without repeats.
std::vector<std::string> parse_cuda_arch_flags(const std::string& flags);
// How an architecture list runs compute capability major.minor: native = machine code for it (an
// sm_XY runs on cc X.Z for Z >= Y; sm_90a only on 9.0), ptx = only PTX of an older or equal
// architecture, compiled by the driver at start-up; none = not at all.
enum class KernelSupport { native, ptx, none };
KernelSupport kernel_support(const std::vector<std::string>& arch_list, int cc_major, int cc_minor);
// "" when `arch_list` runs cc major.minor natively or is empty (a CPU-only build, nothing to
// say); else why this LibTorch will not (or only slowly) run there, and what to do.
std::string kernel_warning(const std::vector<std::string>& arch_list, int cc_major, int cc_minor);

// Cores this process may run on: sched affinity, capped by its cgroup's CPU quota (rounded down,
// at least 1).
int available_cores();
// The CPU quota of this process's cgroup, in cores; 0 when none applies. The smallest cgroup v2
// cpu.max, or v1 cpu.cfs_quota_us / cpu.cfs_period_us, from the process's own cgroup (named in
// /proc/self/cgroup) up to the root of the hierarchy: a systemd CPUQuota= or a container's --cpus
// sets it below the root. The paths are parameters for tests.
double cgroup_cpu_quota(const std::string& root = "/sys/fs/cgroup",
                        const std::string& self_cgroup_file = "/proc/self/cgroup");

// Memory in bytes; 0 = no limit or unknown.
struct MemoryAmount {
  int64_t total = 0;
  int64_t available = 0;
  // Where `available` comes from, for people: "MemAvailable in /proc/meminfo", "cgroup v2 limit
  // /sys/fs/cgroup/a/memory.max", ...; "" when nothing was found.
  std::string source;
  // host_memory: what makes `available` doubtful ("" when nothing): a meminfo without
  // MemAvailable, so all of MemTotal counted as available.
  std::string warning;
};
// The memory limit of this process's cgroup and what is left under it, the smallest from its own
// cgroup up to the root as for cgroup_cpu_quota: v2 memory.max less the working set
// (memory.current less the reclaimable inactive_file of memory.stat), or v1
// memory.limit_in_bytes less memory.usage_in_bytes less total_inactive_file. {0, 0} when no
// level sets a limit.
MemoryAmount cgroup_memory_limit(const std::string& root = "/sys/fs/cgroup",
                                 const std::string& self_cgroup_file = "/proc/self/cgroup");
// Host memory for a CPU profile: MemTotal and MemAvailable from meminfo, each capped by the
// cgroup limit (a container's --memory, a systemd MemoryMax=). Without MemAvailable (kernels
// before 3.14, some containers' substitute meminfo) all of MemTotal counts as available, and
// `warning` says so; unreadable, the physical memory (sysconf).
MemoryAmount host_memory(const std::string& meminfo = "/proc/meminfo", const std::string& cgroup_root = "/sys/fs/cgroup",
                         const std::string& self_cgroup_file = "/proc/self/cgroup");

// The CPU model from /proc/cpuinfo: "model name" (x86 and some ARM kernels), else the ARM
// implementer and part ("ARM Neoverse-V2"), else "unknown CPU".
std::string cpu_model_name(const std::string& cpuinfo = "/proc/cpuinfo");

// Peak memory so far, in MiB, for the metrics: on "cuda[:N]" the most the caching allocator has
// handed out at once (since the last peak-statistics reset); on "cpu" the process's peak
// resident set size.
double peak_memory_mib(const std::string& device);
// Starts the CUDA peak anew (so that a run's metrics do not report the memory probe's largest
// trial); the CPU's peak resident set cannot be reset and is left as it is.
void reset_peak_memory(const std::string& device);

}  // namespace train
