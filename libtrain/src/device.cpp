#include "train/device.h"

#include <elf.h>
#include <link.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "compat.h"
#include "suggest.h"
#include "train/config.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"

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

std::string trim(const std::string& text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  return text.substr(first, text.find_last_not_of(" \t\r\n") - first + 1);
}

// The "key: value" lines of /proc/cpuinfo, in order; a line without a colon is skipped and a key
// without a value ("model name\t:") has "".
std::vector<std::pair<std::string, std::string>> cpuinfo_fields(const std::string& path) {
  std::vector<std::pair<std::string, std::string>> fields;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto colon = line.find(':');
    if (colon != std::string::npos) fields.emplace_back(trim(line.substr(0, colon)), trim(line.substr(colon + 1)));
  }
  return fields;
}

// ARM cores by "CPU implementer" and "CPU part" (the MIDR fields an aarch64 cpuinfo gives instead
// of a model name): the server and common SoC cores, from the implementers' technical reference
// manuals.
std::string arm_core_name(const std::string& implementer, const std::string& part) {
  static const std::vector<std::pair<std::pair<long, long>, const char*>> cores = {
      {{0x41, 0xd08}, "ARM Cortex-A72"},    {{0x41, 0xd0b}, "ARM Cortex-A76"},
      {{0x41, 0xd0c}, "ARM Neoverse-N1"},   {{0x41, 0xd40}, "ARM Neoverse-V1"},
      {{0x41, 0xd49}, "ARM Neoverse-N2"},   {{0x41, 0xd4f}, "ARM Neoverse-V2"},
      {{0x41, 0xd83}, "ARM Neoverse-V3AE"}, {{0x41, 0xd84}, "ARM Neoverse-V3"},
      {{0x41, 0xd8e}, "ARM Neoverse-N3"},   {{0xc0, 0xac3}, "Ampere AmpereOne"},
  };
  const long impl = std::strtol(implementer.c_str(), nullptr, 0), num = std::strtol(part.c_str(), nullptr, 0);
  for (const auto& [id, name] : cores) {
    if (id.first == impl && id.second == num) return name;
  }
  return "ARM CPU (implementer " + implementer + ", part " + part + ")";
}

std::string cpu_isa(const std::string& cpuinfo) {
  for (const auto& [key, value] : cpuinfo_fields(cpuinfo)) {
    if (key != "flags") continue;
    std::string out;
    for (const char* flag : {"amx_tile", "avx512_bf16", "avx512f", "avx2", "fma"}) {
      if ((" " + value + " ").find(std::string(" ") + flag + " ") != std::string::npos) {
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

// One number from a cgroup file ("max" and an unreadable file give -1); v1 writes "no limit" as
// a number near 2^63.
int64_t cgroup_number(const std::string& path) {
  const std::string text = trim(read_first_line(path));
  int64_t value = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || value < 0) return -1;
  return value >= (int64_t{1} << 62) ? -1 : value;
}

// A "key value" entry of a cgroup memory.stat; 0 when missing.
int64_t memory_stat(const std::string& path, const std::string& key) {
  std::istringstream in(read_file(path));
  std::string name;
  int64_t value = 0;
  while (in >> name >> value) {
    if (name == key) return value;
  }
  return 0;
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

double gib_of(int64_t bytes) { return static_cast<double>(bytes) / kGiB; }

// The first of `candidates` whose memory is closest to `gib`, counting distances within 10 % of
// `gib` of the closest as a tie: boards of one marketed size report 22 to 24 GiB, and a tie goes
// to the earlier, more conservative entry.
const GpuSpec* closest_memory(const std::vector<const GpuSpec*>& candidates, double gib) {
  double best = std::numeric_limits<double>::max();
  for (const GpuSpec* spec : candidates) best = std::min(best, std::abs(gib_of(spec->memory_bytes) - gib));
  for (const GpuSpec* spec : candidates) {
    if (std::abs(gib_of(spec->memory_bytes) - gib) <= best + 0.1 * gib) return spec;
  }
  return candidates.front();
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
  for (const auto& [key, value] : cpuinfo_fields("/proc/cpuinfo")) {
    if (key == "cpu MHz") return std::strtod(value.c_str(), nullptr) / 1e3;
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
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) p.omp_num_threads = omp;
  p.cpu_isa = cpu_isa("/proc/cpuinfo");
  p.blas = blas_in_use();
  p.onednn = at::hasMKLDNN();
  p.visible_gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
#ifdef TRAIN_WITH_CUDA
  p.cuda_version = std::to_string(CUDA_VERSION / 1000) + "." + std::to_string(CUDA_VERSION % 1000 / 10);
#endif
  return p;
}

void apply_spec(DeviceProfile& p, const GpuSpec& spec, double sm_scale) {
  p.spec_key = spec.key;
  p.peak_bf16_tflops = spec.peak_bf16_tflops * sm_scale;
  p.peak_fp16_tflops = spec.peak_fp16_tflops * sm_scale;
  p.peak_tf32_tflops = spec.peak_tf32_tflops * sm_scale;
  p.peak_fp32_tflops = spec.peak_fp32_tflops * sm_scale;
  p.bandwidth_gbs = spec.bandwidth_gbs;
}

// The directories whose limits bind this process for a cgroup controller ("cpu", "memory"): its
// own cgroup (named in self_cgroup_file: "0::/path" on v2, "N:cpu,cpuacct:/path" on v1) and every
// parent up to the hierarchy's root, under each mount of the controller. Without a cgroup
// namespace the path may not exist under the mount (a container sees its own cgroup as the root),
// and then only the levels that exist count.
std::vector<std::string> cgroup_levels(const std::string& root, const std::string& self_cgroup_file,
                                       const std::string& controller, bool* v2_out) {
  const bool v2 = files::exists(root + "/cgroup.controllers");
  *v2_out = v2;
  std::string path;
  bool found = false;
  std::istringstream lines(read_file(self_cgroup_file));
  for (std::string line; std::getline(lines, line);) {
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    bool listed = false;
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) listed = listed || name == controller;
    if (v2 ? line.compare(0, first + 1, "0:") == 0 && controllers.empty() : listed) {
      path = line.substr(second + 1);
      found = true;
      break;
    }
  }
  std::vector<std::string> mounts;
  if (v2) {
    mounts = {root};
  } else {
    const std::vector<std::string> names = controller == "cpu"
                                               ? std::vector<std::string>{"/cpu", "/cpu,cpuacct", "/cpuacct,cpu"}
                                               : std::vector<std::string>{"/" + controller};
    for (const std::string& name : names) {
      if (files::exists(root + name)) mounts.push_back(root + name);
    }
  }
  std::vector<std::string> dirs;
  for (const std::string& mount : mounts) {
    std::string rel = found ? path : "/";
    while (true) {
      dirs.push_back(rel == "/" || rel.empty() ? mount : mount + rel);
      if (rel.empty() || rel == "/") break;
      const auto slash = rel.find_last_of('/');
      rel = slash == 0 || slash == std::string::npos ? "/" : rel.substr(0, slash);
    }
  }
  return dirs;
}

void detect_cpu(DeviceProfile& p) {
  p.kind = "cpu";
  p.name = cpu_model_name();
  const MemoryAmount memory = host_memory();
  p.total_memory = memory.total;
  p.free_memory = memory.available;
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

#ifdef TRAIN_WITH_CUDA
// The NVCC flags string ("-gencode;arch=compute_75,code=sm_75;...") that at::show_config()
// prints, read from the .rodata section of the loaded library whose file name contains `library`:
// on a machine without a driver LibTorch will not print it, and a plan for a named GPU still needs
// to know which GPUs this LibTorch runs on. "" when not found.
std::string nvcc_flags_in_library(const std::string& library) {
  std::string path;
  struct Search {
    const std::string* library;
    std::string* path;
  } search{&library, &path};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name && std::string(info->dlpi_name).find(*s->library) != std::string::npos) {
          *s->path = info->dlpi_name;
          return 1;
        }
        return 0;
      },
      &search);
  if (path.empty()) return "";
  std::ifstream in(path, std::ios::binary);
  Elf64_Ehdr header{};
  if (!in.read(reinterpret_cast<char*>(&header), sizeof(header)) || std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0 ||
      header.e_ident[EI_CLASS] != ELFCLASS64 || header.e_shentsize != sizeof(Elf64_Shdr) ||
      header.e_shstrndx >= header.e_shnum) {
    return "";
  }
  std::vector<Elf64_Shdr> sections(header.e_shnum);
  in.seekg(static_cast<std::streamoff>(header.e_shoff));
  if (!in.read(reinterpret_cast<char*>(sections.data()), static_cast<std::streamsize>(sections.size() * sizeof(Elf64_Shdr)))) {
    return "";
  }
  const auto read = [&](const Elf64_Shdr& section) {
    std::string bytes(section.sh_size, '\0');
    in.seekg(static_cast<std::streamoff>(section.sh_offset));
    in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return in ? bytes : std::string();
  };
  const Elf64_Shdr& names_section = sections[header.e_shstrndx];
  if (names_section.sh_size > (size_t{16} << 20)) return "";
  const std::string names = read(names_section);
  for (const Elf64_Shdr& section : sections) {
    if (section.sh_name >= names.size() || std::strcmp(names.c_str() + section.sh_name, ".rodata") != 0) continue;
    if (section.sh_size > (size_t{256} << 20)) return "";  // not LibTorch's 8 MB: do not read it
    const std::string data = read(section);
    const auto at = data.find("-gencode;arch=");
    return at == std::string::npos ? "" : std::string(data.c_str() + at);
  }
  return "";
}
#endif

}  // namespace

double cgroup_cpu_quota(const std::string& root, const std::string& self_cgroup_file) {
  // The smallest limit from the process's cgroup up to the mount's root: a parent's limit binds
  // its children.
  bool v2 = false;
  double limit = 0;
  for (const std::string& dir : cgroup_levels(root, self_cgroup_file, "cpu", &v2)) {
    const double here = cgroup_dir_limit(dir, v2);
    if (here > 0 && (limit == 0 || here < limit)) limit = here;
  }
  return limit;
}

MemoryAmount cgroup_memory_limit(const std::string& root, const std::string& self_cgroup_file) {
  bool v2 = false;
  MemoryAmount out;
  bool limited = false;
  for (const std::string& dir : cgroup_levels(root, self_cgroup_file, "memory", &v2)) {
    const std::string limit_file = dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes");
    const int64_t limit = cgroup_number(limit_file);
    if (limit < 0) continue;
    // The working set: usage less the page cache the kernel reclaims before it fails an allocation.
    const int64_t usage = std::max<int64_t>(0, cgroup_number(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes")));
    const int64_t inactive = memory_stat(dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file");
    const int64_t left = std::max<int64_t>(0, limit - std::max<int64_t>(0, usage - inactive));
    if (!limited || left < out.available) {
      out.source = std::string(v2 ? "cgroup v2" : "cgroup v1") + " limit " + limit_file;
    }
    out.total = limited ? std::min(out.total, limit) : limit;
    out.available = limited ? std::min(out.available, left) : left;
    limited = true;
  }
  return out;
}

MemoryAmount host_memory(const std::string& meminfo, const std::string& cgroup_root, const std::string& self_cgroup_file) {
  MemoryAmount host;
  std::istringstream in(read_file(meminfo));
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string key;
    int64_t kb = 0;
    if (!(fields >> key >> kb)) continue;
    if (key == "MemTotal:") host.total = kb * 1024;
    if (key == "MemAvailable:") host.available = kb * 1024;
  }
  // What is available drives a CPU plan's memory budget: a guess is said, not taken silently.
  const char* const overstated = ": all of it counted as available, more than a run can use; if the plan's "
                                 "micro-batch runs out of memory, set tuning.micro_batch or tuning.memory_fraction";
  if (host.total <= 0) {
    host.total = physical_memory();
    host.available = host.total;
    host.source = "physical memory (sysconf)";
    host.warning = "no MemTotal in " + meminfo + " (unreadable?), so the physical memory" + overstated;
  } else if (host.available <= 0 || host.available > host.total) {
    host.available = host.total;
    host.source = "MemTotal in " + meminfo;
    host.warning = "no usable MemAvailable in " + meminfo +
                   " (a kernel before 3.14, or a container's substitute meminfo), so MemTotal" + overstated;
  } else {
    host.source = "MemAvailable in " + meminfo;
  }
  const MemoryAmount limit = cgroup_memory_limit(cgroup_root, self_cgroup_file);
  if (limit.total > 0) {
    host.total = std::min(host.total, limit.total);
    if (limit.available < host.available) {
      host.available = limit.available;
      host.source = limit.source + ", below " + host.source;
      host.warning.clear();  // the cgroup's own account, not the guess
    }
  }
  return host;
}

std::string cpu_model_name(const std::string& cpuinfo) {
  std::string implementer, part;
  for (const auto& [key, value] : cpuinfo_fields(cpuinfo)) {
    if (key == "model name" && !value.empty()) return value;
    if (key == "CPU implementer" && implementer.empty()) implementer = value;
    if (key == "CPU part" && part.empty()) part = value;
  }
  if (!implementer.empty() && !part.empty()) return arm_core_name(implementer, part);
  return "unknown CPU";
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
// for G5 instances. V100 figures are the SXM2 module's (PCIe: 112 fp16, 14 fp32). The H100 NVL's
// are its per-GPU datasheet figures (94 GB HBM3, 3.9 TB/s; 1,671 bf16 and 835 TF32 with sparsity).
// Ordered by compute capability, and within it the more conservative entry (lower peaks) first:
// match_gpu breaks memory ties by table order, so that a GPU it does not know (a newer
// architecture, an RTX 5090 of compute capability 12.0, planned as the newest known one) falls
// back to the H100 PCIe's figures, not the SXM module's.
//
// Memory is what CUDA reports as the device's total (cudaDeviceProp::totalGlobalMem, PyTorch's
// get_device_properties().total_memory), in MiB: the marketed "16 GB" of a T4 is 14.8 GiB there.
// Figures as recorded on real devices in public logs (PyTorch's device properties, deviceQuery,
// Ultralytics' start-up line); they vary by a few MiB with the driver and ECC:
//   V100-SXM2-16GB 16160, V100-SXM2-32GB 32494, T4 15109 (15843721216 B), A100-SXM4-40GB 40339
//   (42298834944 B), A100 80GB 81049, A10G 22587, RTX 3090 24259, RTX 4090 24563, L40S 45589,
//   H100 80GB HBM3 81090, H100 PCIe 81008, H200 143156 (this project's H200 printed 140 GiB, see
//   benchmarks/results/2026-11-29-h200/). Estimates: the A10 is taken as the A10G (one board,
//   24 GB GDDR6); the L4 as its nvidia-smi total, 23034 MiB, less the ~440 MiB the A10's driver
//   keeps back (23028 vs 22587 MiB); the H100 NVL as its NVML total, 95330 MiB, less the 469 MiB
//   by which the H100 SXM's CUDA total is below its NVML total (81090 vs 81559 MiB).
const std::vector<GpuSpec>& gpu_specs() {
  constexpr int64_t MiB = int64_t{1} << 20;
  // clang-format off
  static const std::vector<GpuSpec> specs = {
      // key         display name (CUDA name)   name patterns      cc    memory MiB    SMs   bf16   fp16   tf32  fp32  GB/s
      {"v100-16gb", "Tesla V100-SXM2-16GB",    {"v100"},          7, 0,  16160 * MiB,  80,     0,   125,     0, 15.7,  900},
      {"v100-32gb", "Tesla V100-SXM2-32GB",    {"v100", "v100s"}, 7, 0,  32494 * MiB,  80,     0,   125,     0, 15.7,  900},
      {"t4",        "Tesla T4",                {"t4"},            7, 5,  15109 * MiB,  40,     0,    65,     0,  8.1,  320},
      {"a100-40gb", "NVIDIA A100-SXM4-40GB",   {"a100"},          8, 0,  40339 * MiB, 108,   312,   312,   156, 19.5, 1555},
      {"a100-80gb", "NVIDIA A100-SXM4-80GB",   {"a100"},          8, 0,  81049 * MiB, 108,   312,   312,   156, 19.5, 2039},
      {"a10",       "NVIDIA A10",              {"a10"},           8, 6,  22587 * MiB,  72,   125,   125,  62.5, 31.2,  600},
      {"a10g",      "NVIDIA A10G",             {"a10g"},          8, 6,  22587 * MiB,  80,    70,    70,    35, 35.0,  600},
      {"rtx3090",   "NVIDIA GeForce RTX 3090", {"rtx 3090"},      8, 6,  24259 * MiB,  82,    71,    71,  35.6, 35.6,  936},
      {"l4",        "NVIDIA L4",               {"l4"},            8, 9,  22593 * MiB,  58,   121,   121,    60, 30.3,  300},
      {"rtx4090",   "NVIDIA GeForce RTX 4090", {"rtx 4090"},      8, 9,  24563 * MiB, 128, 165.2, 165.2,  82.6, 82.6, 1008},
      {"l40s",      "NVIDIA L40S",             {"l40s"},          8, 9,  45589 * MiB, 142,   362,   362,   183, 91.6,  864},
      {"h100-pcie", "NVIDIA H100 PCIe",        {"h100 pcie"},     9, 0,  81008 * MiB, 114,   756,   756,   378, 51.0, 2000},
      {"h100-nvl",  "NVIDIA H100 NVL",         {"h100 nvl"},      9, 0,  94861 * MiB, 132,   835,   835,   418, 60.0, 3900},
      {"h100",      "NVIDIA H100 80GB HBM3",   {"h100"},          9, 0,  81090 * MiB, 132,   989,   989,   494, 67.0, 3350},
      {"h200",      "NVIDIA H200",             {"h200"},          9, 0, 143156 * MiB, 132,   989,   989,   494, 67.0, 4800},
  };
  // clang-format on
  return specs;
}

std::vector<std::string> known_device_keys() {
  std::vector<std::string> keys{"cpu"};
  for (const GpuSpec& spec : gpu_specs()) keys.push_back(spec.key);
  return keys;
}

GpuMatch match_gpu(const std::string& cuda_name, int cc_major, int cc_minor, int64_t memory_bytes, int sm_count) {
  const double gib = gib_of(memory_bytes);
  const std::string memory = std::to_string(std::lround(gib)) + " GiB";
  const std::string cc = cc_text(cc_major, cc_minor);
  GpuMatch m;

  const std::vector<const GpuSpec*> by_name = name_matches(lowercase(cuda_name));
  if (!by_name.empty()) {
    m.spec = closest_memory(by_name, gib);
    m.how = "detected: name '" + cuda_name + "' matches " + keys_of(by_name);
    if (by_name.size() > 1) m.how += "; " + memory + " -> " + m.spec->key;
  } else {
    std::string basis;
    const std::vector<const GpuSpec*> candidates = same_architecture(cc_major, cc_minor, &basis);
    if (candidates.empty()) {
      m.how = "unknown: '" + cuda_name + "' (compute capability " + cc + ") is older than every known GPU";
      return m;
    }
    m.spec = closest_memory(candidates, gib);
    m.approximate = true;
    m.how = std::string(kFallback) + "unknown name '" + cuda_name + "'; " + basis + " and " + memory +
            " -> closest " + m.spec->key;
  }
  // Another SM count: a MIG slice or a Laptop GPU under a datacenter or desktop name, or an unknown
  // GPU planned as a bigger one. The peaks scale with the SMs; a fallback's only down.
  const double ratio = sm_count > 0 ? static_cast<double>(sm_count) / m.spec->sm_count : 1.0;
  if (std::abs(ratio - 1.0) > 0.1 && (ratio < 1.0 || !m.approximate)) {
    m.sm_scale = ratio;
    m.approximate = true;
    std::ostringstream note;
    note.precision(2);
    note << "; approximate: " << sm_count << " SMs, " << m.spec->key << " has " << m.spec->sm_count
         << ": peaks scaled by " << ratio;
    m.how += note.str();
  }
  return m;
}

void fill_gpu_figures(DeviceProfile& p) {
  const GpuMatch m = match_gpu(p.name, p.cc_major, p.cc_minor, p.total_memory, p.sm_count);
  p.match = m.how;
  p.approximate = m.approximate;
  if (m.spec) apply_spec(p, *m.spec, m.sm_scale);
  p.warning = kernel_warning(cuda_arch_list(), p.cc_major, p.cc_minor);
}

std::vector<std::string> parse_cuda_arch_flags(const std::string& flags) {
  // With NVCC flags only the code= targets count (arch=compute_XY is the virtual architecture
  // they are compiled through, not something the library contains).
  const bool nvcc = flags.find("code=") != std::string::npos;
  std::vector<std::string> out;
  size_t at = 0;
  while (at < flags.size()) {
    const size_t sm = flags.find("sm_", at), compute = flags.find("compute_", at);
    const size_t start = std::min(sm, compute);
    if (start == std::string::npos) break;
    size_t end = start + (start == sm ? 3 : 8);
    const size_t digits = end;
    while (end < flags.size() && std::isdigit(static_cast<unsigned char>(flags[end]))) ++end;
    while (end < flags.size() && std::isalpha(static_cast<unsigned char>(flags[end]))) ++end;  // sm_90a, sm_100f
    at = end;
    if (end == digits || !std::isdigit(static_cast<unsigned char>(flags[digits]))) continue;
    if (start > 0 && std::isalnum(static_cast<unsigned char>(flags[start - 1]))) continue;
    if (nvcc) {
      // The nearest "=" before the name must be a code= one: "code=sm_75", "code=[sm_75,compute_75]".
      const size_t eq = flags.rfind('=', start), code = flags.rfind("code=", start);
      if (eq == std::string::npos || code == std::string::npos || code + 4 != eq) continue;
    }
    const std::string name = flags.substr(start, end - start);
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

std::vector<std::string> cuda_arch_list() {
#ifdef TRAIN_WITH_CUDA
  static const std::vector<std::string> list = [] {
    try {
      // LibTorch's CUDA configuration, as at::show_config() prints it on a GPU machine: "NVCC
      // architecture flags: -gencode;...". It throws where CUDA finds no driver.
      const std::string config = at::detail::getCUDAHooks().showConfig();
      const auto pos = config.find("NVCC architecture flags:");
      if (pos != std::string::npos) return parse_cuda_arch_flags(config.substr(pos, config.find('\n', pos) - pos));
    } catch (const std::exception&) {
    }
    return parse_cuda_arch_flags(nvcc_flags_in_library("libtorch_cuda.so"));
  }();
  return list;
#else
  return {};
#endif
}

KernelSupport kernel_support(const std::vector<std::string>& arch_list, int cc_major, int cc_minor) {
  KernelSupport best = KernelSupport::none;
  for (const std::string& arch : arch_list) {
    const bool ptx = arch.rfind("compute_", 0) == 0;
    const char* digits = arch.c_str() + (ptx ? 8 : 3);
    char* suffix = nullptr;
    const long number = std::strtol(digits, &suffix, 10);
    if (suffix == digits) continue;
    const int major = static_cast<int>(number / 10), minor = static_cast<int>(number % 10);
    const std::string variant = suffix;  // "a": this exact compute capability only; "f": its family
    const bool exact = major == cc_major && minor == cc_minor;
    const bool same_family = major == cc_major && minor <= cc_minor;
    if (variant == "a" ? exact : same_family) {
      if (!ptx) return KernelSupport::native;
      best = KernelSupport::ptx;
    } else if (ptx && variant.empty() && std::make_pair(major, minor) < std::make_pair(cc_major, cc_minor)) {
      best = KernelSupport::ptx;  // PTX compiles for any newer GPU
    }
  }
  return best;
}

std::string kernel_warning(const std::vector<std::string>& arch_list, int cc_major, int cc_minor) {
  if (arch_list.empty()) return "";
  const KernelSupport support = kernel_support(arch_list, cc_major, cc_minor);
  if (support == KernelSupport::native) return "";
  const std::string cc = cc_text(cc_major, cc_minor);
  const std::string sm = "sm_" + std::to_string(cc_major) + std::to_string(cc_minor);
  std::string archs;
  for (const std::string& a : arch_list) archs += (archs.empty() ? "" : " ") + a;
  if (support == KernelSupport::ptx) {
    return "this LibTorch has no machine code for compute capability " + cc + ", only PTX (" + archs +
           "): the driver compiles each kernel from PTX at start-up, which takes minutes until its cache holds them";
  }
  return "this LibTorch has no kernels for compute capability " + cc + " (it has " + archs +
         "): it cannot run there; use a LibTorch whose torch.cuda.get_arch_list() includes " + sm;
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
      if (!spec_key.empty()) {
        const bool fallback = match.rfind(kFallback, 0) == 0;
        out << " [" << (fallback ? "closest " : "") << spec_key << (approximate && !fallback ? ", SMs scaled" : "")
            << "]";
      }
      out << " (cuda:" << index << ", ";
    }
    out << "cc " << cc_major << "." << cc_minor << ", " << static_cast<double>(total_memory) / kGiB << " GiB, "
        << sm_count << " SMs)";
    if (!warning.empty()) out << "; " << warning;
  } else {
    out << name << " (" << cpu_cores << " cores" << (cpu_isa.empty() ? "" : ", " + cpu_isa)
        << ", BLAS " << blas << ")";
  }
  return out.str();
}

int gpu_for_local_rank(int local_rank, int visible_gpus) {
  if (visible_gpus <= 1) return 0;
  if (local_rank >= visible_gpus) {
    throw ConfigError("key 'trainer.device': local rank " + std::to_string(local_rank) + " but " +
                      std::to_string(visible_gpus) + " GPUs are visible on this host, so ranks would share GPUs: "
                      "start at most " + std::to_string(visible_gpus) + " ranks per host (--nproc-per-node, "
                      "--ntasks-per-node), or set trainer.device: cpu");
  }
  return local_rank;
}

DeviceProfile detect_device(const std::string& request, int local_rank) {
  DeviceProfile p = host_profile();

  bool want_cuda = false;
  int index = local_rank;
  if (request == "auto") {
    want_cuda = p.visible_gpus > 0;
    if (want_cuda) index = gpu_for_local_rank(local_rank, p.visible_gpus);
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
    // "cuda" without an index: the local rank's GPU, as with auto.
    if (request.size() == 4 && p.visible_gpus > 0) index = gpu_for_local_rank(local_rank, p.visible_gpus);
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
    fill_gpu_figures(p);
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
    p.total_memory = spec.memory_bytes;
    // An estimate: a planned GPU has nothing else running on it, but our own CUDA context will.
    p.free_memory = p.total_memory - kCudaContextBytes;
    p.sm_count = spec.sm_count;
    p.visible_gpus = 1;
    p.bf16 = p.cc_major >= 8;
    p.tf32 = p.cc_major >= 8;
    apply_spec(p, spec, 1.0);
    p.match = "named: " + spec.key;
    p.named = true;
    p.warning = kernel_warning(cuda_arch_list(), p.cc_major, p.cc_minor);
    if (!p.warning.empty()) log::warn("planning for " + spec.display_name + ", but " + p.warning);
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
