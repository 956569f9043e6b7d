#include "train/device.h"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <utility>
#include <vector>

#include "compat.h"
#include "suggest.h"
#include "train/config.h"
#include "train/errors.h"
#include "train/files.h"

#ifdef TRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

namespace train {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// DeviceProfile::match starts with this when the figures are another GPU's (see match_gpu).
constexpr char kFallback[] = "fallback: ";

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// One cgroup directory's CPU limit in cores: v2 "cpu.max" ("max 100000" or "200000 100000"), or
// v1 cpu.cfs_quota_us / cpu.cfs_period_us (quota -1 = none). 0 when it sets none.
double cgroup_dir_limit(const std::string& dir, bool v2) {
  try {
    if (v2) {
      std::istringstream in(read_first_line(dir + "/cpu.max"));
      std::string quota;
      double period = 0;
      if (in >> quota >> period && quota != "max" && period > 0) return std::stod(quota) / period;
      return 0;
    }
    const std::string q = read_first_line(dir + "/cpu.cfs_quota_us");
    const std::string p = read_first_line(dir + "/cpu.cfs_period_us");
    if (!q.empty() && !p.empty() && std::stod(q) > 0 && std::stod(p) > 0) return std::stod(q) / std::stod(p);
  } catch (const std::exception&) {  // an unreadable number: no limit known
  }
  return 0;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

std::string cpu_isa() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::string out;
    for (const char* flag : {"amx_tile", "avx512_bf16", "avx512f", "avx2", "fma"}) {
      if ((" " + line + " ").find(std::string(" ") + flag + " ") != std::string::npos) {
        out += (out.empty() ? "" : " ") + std::string(flag);
      }
    }
    return out;
  }
  return "";
}

// Which BLAS LibTorch calls. For a build against "generic" BLAS (Debian), the answer is the
// libblas.so.3 the loader resolved, which only /proc/self/maps can tell.
std::string blas_in_use() {
  const std::string config = at::show_config();
  std::string blas_info;
  const auto pos = config.find("BLAS_INFO=");
  if (pos != std::string::npos) {
    blas_info = config.substr(pos + 10, config.find_first_of(", \n", pos + 10) - pos - 10);
  }
  std::ifstream maps("/proc/self/maps");
  std::string line, loaded;
  while (std::getline(maps, line)) {
    for (const char* lib : {"openblas", "libmkl", "libblis", "libblas.so"}) {
      if (line.find(lib) != std::string::npos && loaded.empty()) {
        loaded = line.substr(line.find('/'));
      }
    }
  }
  if (!loaded.empty()) {
    char resolved[4096];
    if (realpath(loaded.c_str(), resolved)) loaded = resolved;
  }
  if (blas_info.empty()) return loaded.empty() ? "unknown" : loaded;
  return loaded.empty() ? blas_info : blas_info + " (" + loaded + ")";
}

int64_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

int64_t available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return physical_memory();
}

std::string lowercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

// Whether `word` occurs in `text` with no letter or digit on either side: "a10" is in "nvidia a10"
// but not in "nvidia a100" or "nvidia a10g".
bool has_word(const std::string& text, const std::string& word) {
  const auto is_boundary = [&](size_t i) { return !std::isalnum(static_cast<unsigned char>(text[i])); };
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const size_t end = at + word.size();
    if ((at == 0 || is_boundary(at - 1)) && (end == text.size() || is_boundary(end))) return true;
  }
  return false;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

std::string keys_of(const std::vector<const GpuSpec*>& specs) {
  std::vector<std::string> keys;
  for (const GpuSpec* spec : specs) keys.push_back(spec->key);
  return join(keys);
}

// The first of `candidates` whose memory is closest to `gib`; earlier table entries win ties.
const GpuSpec* closest_memory(const std::vector<const GpuSpec*>& candidates, double gib) {
  return *std::min_element(candidates.begin(), candidates.end(), [&](const GpuSpec* a, const GpuSpec* b) {
    return std::abs(a->memory_gb - gib) < std::abs(b->memory_gb - gib);
  });
}

std::vector<const GpuSpec*> specs_where(const std::function<bool(const GpuSpec&)>& keep) {
  std::vector<const GpuSpec*> out;
  for (const GpuSpec& spec : gpu_specs()) {
    if (keep(spec)) out.push_back(&spec);
  }
  return out;
}

// The entries whose longest pattern found in `lower_name` is the longest found for any entry.
std::vector<const GpuSpec*> name_matches(const std::string& lower_name) {
  std::vector<const GpuSpec*> best;
  size_t best_length = 0;
  for (const GpuSpec& spec : gpu_specs()) {
    size_t length = 0;
    for (const std::string& pattern : spec.name_patterns) {
      if (has_word(lower_name, pattern)) length = std::max(length, pattern.size());
    }
    if (length == 0 || length < best_length) continue;
    if (length > best_length) best.clear();
    best_length = length;
    best.push_back(&spec);
  }
  return best;
}

std::string cc_text(int major, int minor) { return std::to_string(major) + "." + std::to_string(minor); }

// The fallback candidates for a GPU of unknown name (match_gpu's rule 2), and in `basis` why.
std::vector<const GpuSpec*> same_architecture(int cc_major, int cc_minor, std::string* basis) {
  *basis = "compute capability " + cc_text(cc_major, cc_minor);
  auto candidates = specs_where([&](const GpuSpec& s) { return s.cc_major == cc_major && s.cc_minor == cc_minor; });
  if (!candidates.empty()) return candidates;
  *basis = "compute capability " + std::to_string(cc_major) + ".x";
  candidates = specs_where([&](const GpuSpec& s) { return s.cc_major == cc_major; });
  if (!candidates.empty()) return candidates;
  // An architecture the table lacks is planned as the newest one below it, which it supersedes.
  const auto device_cc = std::make_pair(cc_major, cc_minor);
  std::pair<int, int> newest{-1, -1};
  for (const GpuSpec& s : gpu_specs()) {
    const auto entry_cc = std::make_pair(s.cc_major, s.cc_minor);
    if (entry_cc < device_cc) newest = std::max(newest, entry_cc);
  }
  if (newest.first < 0) return {};
  *basis = "newest known compute capability below " + cc_text(cc_major, cc_minor) + " (" +
           cc_text(newest.first, newest.second) + ")";
  return specs_where([&](const GpuSpec& s) { return std::make_pair(s.cc_major, s.cc_minor) == newest; });
}

// The clock in GHz: the cpufreq maximum where the kernel exposes it, else /proc/cpuinfo's
// "cpu MHz" (the current clock on bare metal, the nominal one in most VMs); 0 when neither exists.
double cpu_clock_ghz() {
  const std::string max_khz = read_first_line("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
  if (!max_khz.empty()) return std::strtod(max_khz.c_str(), nullptr) / 1e6;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (line.rfind("cpu MHz", 0) == 0 && colon != std::string::npos) {
      return std::strtod(line.c_str() + colon + 1, nullptr) / 1e3;
    }
  }
  return 0;
}

// fp32 flop per cycle and core, assuming two vector FMA pipes (x86 server cores since Haswell and
// Zen 2); without FMA, SSE width on one add and one multiply pipe. A rough upper bound.
int cpu_fp32_flop_per_cycle(const std::string& isa) {
  if (has_word(isa, "avx512f")) return 2 * 16 * 2;
  if (has_word(isa, "avx2") && has_word(isa, "fma")) return 2 * 8 * 2;
  return 2 * 4;
}

// Fields that describe this machine's host and LibTorch build, whatever device the profile is for.
DeviceProfile host_profile() {
  DeviceProfile p;
  p.torch_version = compat::torch_version();
  p.cpu_cores = available_cores();
  p.cpu_isa = cpu_isa();
  p.blas = blas_in_use();
  p.visible_gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
#ifdef TRAIN_WITH_CUDA
  p.cuda_version = std::to_string(CUDA_VERSION / 1000) + "." + std::to_string(CUDA_VERSION % 1000 / 10);
#endif
  return p;
}

void apply_spec(DeviceProfile& p, const GpuSpec& spec) {
  p.spec_key = spec.key;
  p.peak_bf16_tflops = spec.peak_bf16_tflops;
  p.peak_fp16_tflops = spec.peak_fp16_tflops;
  p.peak_tf32_tflops = spec.peak_tf32_tflops;
  p.peak_fp32_tflops = spec.peak_fp32_tflops;
  p.bandwidth_gbs = spec.bandwidth_gbs;
}

void detect_cpu(DeviceProfile& p) {
  p.kind = "cpu";
  p.name = cpu_model();
  p.total_memory = physical_memory();
  p.free_memory = available_memory();
  const double ghz = cpu_clock_ghz();
  const int flop_per_cycle = cpu_fp32_flop_per_cycle(p.cpu_isa);
  p.peak_fp32_tflops = p.cpu_cores * ghz * flop_per_cycle / 1e3;
  std::ostringstream how;
  how.precision(3);
  how << "detected: CPU; ";
  if (ghz > 0) {
    how << "rough fp32 peak " << p.cpu_cores << " cores x " << ghz << " GHz x " << flop_per_cycle
        << " flop/cycle = " << p.peak_fp32_tflops << " TFLOP/s";
  } else {
    how << "clock unknown, no fp32 peak";
  }
  p.match = how.str();
}

}  // namespace

double cgroup_cpu_quota(const std::string& root, const std::string& self_cgroup_file) {
  // The process's cgroup path: "0::/path" (v2), or "N:cpu,cpuacct:/path" (v1, the cpu controller).
  const bool v2 = files::exists(root + "/cgroup.controllers");
  std::string path;
  bool found = false;
  std::istringstream lines(read_file(self_cgroup_file));
  for (std::string line; std::getline(lines, line);) {
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    bool cpu = false;
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) cpu = cpu || name == "cpu";
    if (v2 ? line.compare(0, first + 1, "0:") == 0 && controllers.empty() : cpu) {
      path = line.substr(second + 1);
      found = true;
      break;
    }
  }
  std::vector<std::string> mounts;
  if (v2) {
    mounts = {root};
  } else {
    for (const char* name : {"/cpu", "/cpu,cpuacct", "/cpuacct,cpu"}) {
      if (files::exists(root + name)) mounts.push_back(root + name);
    }
  }
  // The smallest limit from the process's cgroup up to the mount's root: a parent's limit binds its
  // children. Without a cgroup namespace the path may not exist under the mount (a container sees
  // its own cgroup as the root), and then only the levels that exist count.
  double limit = 0;
  for (const std::string& mount : mounts) {
    std::string rel = found ? path : "/";
    while (true) {
      const double here = cgroup_dir_limit(rel == "/" ? mount : mount + rel, v2);
      if (here > 0 && (limit == 0 || here < limit)) limit = here;
      if (rel.empty() || rel == "/") break;
      const auto slash = rel.find_last_of('/');
      rel = slash == 0 || slash == std::string::npos ? "/" : rel.substr(0, slash);
    }
  }
  return limit;
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cores = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  const double quota = cgroup_cpu_quota();
  if (quota > 0) cores = std::max(1, std::min(cores, static_cast<int>(std::floor(quota))));
  return cores;
}

// Peak figures are NVIDIA datasheet figures, dense (the datasheets' starred numbers assume 2:4
// sparsity and are twice these); tensor-core fp16/bf16 with fp32 accumulate. GeForce cards
// (RTX 3090, RTX 4090) from NVIDIA's Ampere GA102 and Ada Lovelace architecture whitepapers. The
// A10G, made for AWS, has no public NVIDIA datasheet: its figures are those AWS and NVIDIA publish
// for G5 instances. V100 figures are the SXM2 module's (PCIe: 112 fp16, 14 fp32). Ordered by
// compute capability, and within it the more common or more conservative entry first, since
// match_gpu breaks memory ties by table order.
const std::vector<GpuSpec>& gpu_specs() {
  // clang-format off
  static const std::vector<GpuSpec> specs = {
      // key         display name (CUDA name)   name patterns      cc     GB  SMs   bf16   fp16   tf32  fp32  GB/s
      {"v100-16gb", "Tesla V100-SXM2-16GB",    {"v100"},          7, 0,  16,  80,     0,   125,     0, 15.7,  900},
      {"v100-32gb", "Tesla V100-SXM2-32GB",    {"v100", "v100s"}, 7, 0,  32,  80,     0,   125,     0, 15.7,  900},
      {"t4",        "Tesla T4",                {"t4"},            7, 5,  16,  40,     0,    65,     0,  8.1,  320},
      {"a100-40gb", "NVIDIA A100-SXM4-40GB",   {"a100"},          8, 0,  40, 108,   312,   312,   156, 19.5, 1555},
      {"a100-80gb", "NVIDIA A100-SXM4-80GB",   {"a100"},          8, 0,  80, 108,   312,   312,   156, 19.5, 2039},
      {"a10",       "NVIDIA A10",              {"a10"},           8, 6,  24,  72,   125,   125,  62.5, 31.2,  600},
      {"a10g",      "NVIDIA A10G",             {"a10g"},          8, 6,  24,  80,    70,    70,    35, 35.0,  600},
      {"rtx3090",   "NVIDIA GeForce RTX 3090", {"rtx 3090"},      8, 6,  24,  82,    71,    71,  35.6, 35.6,  936},
      {"l4",        "NVIDIA L4",               {"l4"},            8, 9,  24,  58,   121,   121,    60, 30.3,  300},
      {"rtx4090",   "NVIDIA GeForce RTX 4090", {"rtx 4090"},      8, 9,  24, 128, 165.2, 165.2,  82.6, 82.6, 1008},
      {"l40s",      "NVIDIA L40S",             {"l40s"},          8, 9,  48, 142,   362,   362,   183, 91.6,  864},
      {"h100",      "NVIDIA H100 80GB HBM3",   {"h100"},          9, 0,  80, 132,   989,   989,   494, 67.0, 3350},
      {"h100-pcie", "NVIDIA H100 PCIe",        {"h100 pcie"},     9, 0,  80, 114,   756,   756,   378, 51.0, 2000},
      {"h200",      "NVIDIA H200",             {"h200"},          9, 0, 141, 132,   989,   989,   494, 67.0, 4800},
  };
  // clang-format on
  return specs;
}

std::vector<std::string> known_device_keys() {
  std::vector<std::string> keys{"cpu"};
  for (const GpuSpec& spec : gpu_specs()) keys.push_back(spec.key);
  return keys;
}

const GpuSpec* match_gpu(const std::string& cuda_name, int cc_major, int cc_minor, int64_t memory_bytes,
                         std::string* how) {
  const double gib = static_cast<double>(memory_bytes) / kGiB;
  const std::string memory = std::to_string(std::lround(gib)) + " GiB";
  const std::string cc = cc_text(cc_major, cc_minor);
  const GpuSpec* spec = nullptr;
  std::string reason;

  const std::vector<const GpuSpec*> by_name = name_matches(lowercase(cuda_name));
  if (!by_name.empty()) {
    spec = closest_memory(by_name, gib);
    reason = "detected: name '" + cuda_name + "' matches " + keys_of(by_name);
    if (by_name.size() > 1) reason += "; " + memory + " -> " + spec->key;
  } else {
    std::string basis;
    const std::vector<const GpuSpec*> candidates = same_architecture(cc_major, cc_minor, &basis);
    if (candidates.empty()) {
      reason = "unknown: '" + cuda_name + "' (compute capability " + cc + ") is older than every known GPU";
    } else {
      spec = closest_memory(candidates, gib);
      reason = std::string(kFallback) + "unknown name '" + cuda_name + "'; " + basis + " and " + memory +
               " -> closest " + spec->key;
    }
  }
  if (how) *how = reason;
  return spec;
}

std::string DeviceProfile::device_string() const {
  return is_cuda() ? "cuda:" + std::to_string(index) : "cpu";
}

std::string DeviceProfile::summary() const {
  std::ostringstream out;
  out.precision(3);
  if (is_cuda()) {
    out << name;
    if (named) {
      out << " [" << spec_key << ", planned, not detected] (";
    } else {
      if (!spec_key.empty()) out << " [" << (match.rfind(kFallback, 0) == 0 ? "closest " : "") << spec_key << "]";
      out << " (cuda:" << index << ", ";
    }
    out << "cc " << cc_major << "." << cc_minor << ", " << static_cast<double>(total_memory) / kGiB << " GiB, "
        << sm_count << " SMs)";
  } else {
    out << name << " (" << cpu_cores << " cores" << (cpu_isa.empty() ? "" : ", " + cpu_isa)
        << ", BLAS " << blas << ")";
  }
  return out.str();
}

DeviceProfile detect_device(const std::string& request, int local_rank) {
  DeviceProfile p = host_profile();

  bool want_cuda = false;
  int index = local_rank;
  if (request == "auto") {
    want_cuda = p.visible_gpus > 0;
    if (want_cuda) index = local_rank % p.visible_gpus;
  } else if (request.rfind("cuda", 0) == 0) {
    want_cuda = true;
    if (request.size() > 5) {
      // The config allows cuda:N up to limits::kMaxCudaIndex; a request from elsewhere is checked here.
      const std::string digits = request.substr(5);
      int64_t parsed = -1;
      const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), parsed);
      if (request[4] != ':' || error != std::errc() || end != digits.data() + digits.size() || parsed < 0 ||
          parsed > limits::kMaxCudaIndex) {
        throw ConfigError("key 'trainer.device': '" + request + "' is not auto, cpu, cuda or cuda:N with N in [0, " +
                          std::to_string(limits::kMaxCudaIndex) + "]");
      }
      index = static_cast<int>(parsed);
    }
    // "cuda" without an index: the local rank's GPU, as with auto (and GPU 0 for every rank when
    // each sees one GPU of its own, as under Slurm's --gpus-per-task=1).
    if (request.size() == 4 && p.visible_gpus > 0) index = local_rank % p.visible_gpus;
    if (p.visible_gpus == 0) {
      throw ConfigError("key 'trainer.device': '" + request +
                        "' requested but no CUDA device is visible (LibTorch " + p.torch_version +
                        (torch::cuda::is_available() ? "" : ", CUDA unavailable") +
                        "); use trainer.device: auto or cpu");
    }
    if (index >= p.visible_gpus) {
      throw ConfigError("key 'trainer.device': '" + request + "' but only " +
                        std::to_string(p.visible_gpus) + " CUDA device(s) are visible");
    }
  }

#ifdef TRAIN_WITH_CUDA
  if (want_cuda) {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
    p.kind = "cuda";
    p.index = index;
    p.name = prop->name;
    p.cc_major = prop->major;
    p.cc_minor = prop->minor;
    p.sm_count = prop->multiProcessorCount;
    p.total_memory = static_cast<int64_t>(prop->totalGlobalMem);
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(index) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      p.free_memory = static_cast<int64_t>(free_bytes);
    }
    p.bf16 = p.cc_major >= 8;
    p.tf32 = p.cc_major >= 8;
    if (const GpuSpec* spec = match_gpu(p.name, p.cc_major, p.cc_minor, p.total_memory, &p.match)) {
      apply_spec(p, *spec);
    }
    return p;
  }
#else
  if (want_cuda) {
    throw ConfigError("key 'trainer.device': '" + request + "' but this build of train has no CUDA support");
  }
#endif
  detect_cpu(p);
  return p;
}

DeviceProfile named_device(const std::string& key) {
  const std::string wanted = lowercase(key);
  if (wanted == "cpu") return detect_device("cpu");
  for (const GpuSpec& spec : gpu_specs()) {
    if (spec.key != wanted) continue;
    DeviceProfile p = host_profile();
    p.kind = "cuda";
    p.name = spec.display_name;
    p.cc_major = spec.cc_major;
    p.cc_minor = spec.cc_minor;
    p.total_memory = static_cast<int64_t>(spec.memory_gb * kGiB);
    p.free_memory = p.total_memory;  // a planned GPU has nothing else running on it
    p.sm_count = spec.sm_count;
    p.visible_gpus = 1;
    p.bf16 = p.cc_major >= 8;
    p.tf32 = p.cc_major >= 8;
    apply_spec(p, spec);
    p.match = "named: " + spec.key;
    p.named = true;
    return p;
  }
  const std::vector<std::string> keys = known_device_keys();
  // "a100" names a family: the profiles it starts, rather than "a10", one edit away.
  std::vector<std::string> family;
  for (const std::string& k : keys) {
    if (k.size() > wanted.size() && k.compare(0, wanted.size(), wanted) == 0 && k[wanted.size()] == '-') family.push_back(k);
  }
  std::string hint;
  if (!family.empty()) {
    for (size_t i = 0; i < family.size(); ++i) hint += (i ? (i + 1 == family.size() ? "' or '" : "', '") : "") + family[i];
  } else {
    hint = detail::closest_match(wanted, keys);
  }
  throw ConfigError("key 'tuning.device': unknown device '" + key + "'; " +
                    (hint.empty() ? "" : "did you mean '" + hint + "'? ") + "known: " + join(keys));
}

void reset_peak_memory(const std::string& device) {
#ifdef TRAIN_WITH_CUDA
  if (device.rfind("cuda", 0) == 0) {
    const torch::Device d(device);
    c10::cuda::CUDACachingAllocator::resetPeakStats(d.has_index() ? d.index() : static_cast<c10::DeviceIndex>(0));
  }
#endif
  (void)device;
}

double peak_memory_mib(const std::string& device) {
  constexpr double kMiB = 1024.0 * 1024.0;
#ifdef TRAIN_WITH_CUDA
  if (device.rfind("cuda", 0) == 0) {
    const torch::Device d(device);
    const auto index = d.has_index() ? d.index() : static_cast<c10::DeviceIndex>(0);
    return static_cast<double>(compat::cuda_allocated_bytes(index).peak) / kMiB;
  }
#endif
  (void)device;
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0 / kMiB;  // Linux reports KiB
}

}  // namespace train
