#include "train/device.h"

#include <sched.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "compat.h"
#include "train/errors.h"
#include "train/log.h"

#ifdef TRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#endif

namespace train {
namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// cgroup v2 "cpu.max" ("max 100000" or "200000 100000"), then v1 cfs quota/period.
double cgroup_cpu_limit() {
  std::istringstream v2(read_first_line("/sys/fs/cgroup/cpu.max"));
  std::string quota;
  double period = 0;
  if (v2 >> quota >> period && quota != "max" && period > 0) return std::stod(quota) / period;
  const std::string q = read_first_line("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
  const std::string p = read_first_line("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  if (!q.empty() && !p.empty() && std::stod(q) > 0 && std::stod(p) > 0) return std::stod(q) / std::stod(p);
  return 0;
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

}  // namespace

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cores = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  const double quota = cgroup_cpu_limit();
  if (quota > 0) cores = std::max(1, std::min(cores, static_cast<int>(std::floor(quota))));
  return cores;
}

std::string DeviceProfile::device_string() const {
  return is_cuda() ? "cuda:" + std::to_string(index) : "cpu";
}

std::string DeviceProfile::summary() const {
  std::ostringstream out;
  out.precision(3);
  if (is_cuda()) {
    out << name << " (cuda:" << index << ", cc " << cc_major << "." << cc_minor << ", "
        << static_cast<double>(total_memory) / (1 << 30) << " GiB, " << sm_count << " SMs)";
  } else {
    out << name << " (" << cpu_cores << " cores" << (cpu_isa.empty() ? "" : ", " + cpu_isa)
        << ", BLAS " << blas << ")";
  }
  return out.str();
}

DeviceProfile detect_device(const std::string& request, int local_rank) {
  DeviceProfile p;
  p.torch_version = compat::torch_version();
  p.cpu_cores = available_cores();
  p.cpu_isa = cpu_isa();
  p.blas = blas_in_use();
  p.visible_gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;

  bool want_cuda = false;
  int index = local_rank;
  if (request == "auto") {
    want_cuda = p.visible_gpus > 0;
    if (want_cuda) index = local_rank % p.visible_gpus;
  } else if (request.rfind("cuda", 0) == 0) {
    want_cuda = true;
    if (request.size() > 5) index = std::stoi(request.substr(5));
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
  p.cuda_version = std::to_string(CUDA_VERSION / 1000) + "." + std::to_string(CUDA_VERSION % 1000 / 10);
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
    return p;
  }
#else
  if (want_cuda) {
    throw ConfigError("key 'trainer.device': '" + request + "' but this build of train has no CUDA support");
  }
#endif
  p.kind = "cpu";
  p.name = cpu_model();
  p.total_memory = physical_memory();
  p.free_memory = available_memory();
  return p;
}

}  // namespace train
