#include "train/doctor.h"

#include <dlfcn.h>
#include <torch/torch.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>

#include "compat.h"
#include "train/config.h"
#include "train/device.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"
#include "utf8.h"

#ifdef TRAIN_WITH_CUDA
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/nccl.h>
#endif

namespace train {
namespace {

std::string version_string(int v) {  // CUDA encodes 13.0 as 13000
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// Runs a small piece of work on the device; the detail says what failed.
DoctorCheck smoke(const std::string& name, const torch::Device& device, const std::function<void()>& work) {
  try {
    work();
    if (device.is_cuda()) torch::cuda::synchronize(device.index());  // the GPU it ran on, not the current one
    return {name, "ok", "on " + device.str(), ""};
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    return {name, "fail", first_line(what), cuda_failure_hint(what)};
  }
}

// Runs checks that may throw (detecting a device, asking CUDA, cuDNN or NCCL for versions); an
// exception becomes a fail line named `name`, and the report goes on.
void guarded(std::vector<DoctorCheck>& checks, const std::string& name, const std::function<void()>& body) {
  try {
    body();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    checks.push_back({name, "fail", first_line(what), cuda_failure_hint(what)});
  } catch (const std::exception& e) {
    checks.push_back({name, "fail", first_line(e.what()), cuda_failure_hint(e.what())});
  } catch (...) {
    checks.push_back({name, "fail", "unknown exception", ""});
  }
}

// An environment variable's value for a report line: invalid UTF-8 and control characters as \xNN.
std::string printable(const std::string& value) {
  std::string out;
  for (char c : detail::repair_utf8(value, [](unsigned char b) {
         char buf[8];
         std::snprintf(buf, sizeof(buf), "\\x%02x", b);
         return std::string(buf);
       })) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

bool libcuda_loadable() {
  void* handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!handle) handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!handle) return false;
  dlclose(handle);
  return true;
}

bool hardware_seen(const NvidiaPresence& hw) { return hw.pci_gpus > 0 || hw.kernel_module || hw.device_nodes > 0; }

// How CUDA_VISIBLE_DEVICES hides every GPU, "" when it does not (or cannot be told: UUIDs).
std::string hides_every_gpu(const std::string& value, int gpus_present) {
  const std::string first = value.substr(0, value.find(','));
  const auto begin = first.find_first_not_of(" \t");
  if (begin == std::string::npos) return "it is empty";
  const std::string item = first.substr(begin, first.find_last_not_of(" \t") - begin + 1);
  if (item.rfind("GPU-", 0) == 0 || item.rfind("MIG-", 0) == 0) return "";
  char* end = nullptr;
  const long index = std::strtol(item.c_str(), &end, 10);
  if (end == item.c_str() || *end != '\0') return "'" + printable(item) + "' is not a GPU index or UUID";
  if (index < 0) return "a negative index hides every GPU";
  if (gpus_present > 0 && index >= gpus_present) {
    return "index " + std::to_string(index) + " does not exist (" + std::to_string(gpus_present) + " GPU" +
           (gpus_present == 1 ? "" : "s") + " here, indices from 0)";
  }
  return "";
}

}  // namespace

DoctorCheck cuda_driver_check(int driver, int runtime, const std::string& driver_version) {
  const std::string detail =
      (driver_version.empty() ? std::string() : driver_version + ", ") + "supports CUDA " + version_string(driver);
  if (driver / 1000 < runtime / 1000) {
    return {"cuda_driver", "fail", detail,
            "the driver supports CUDA " + version_string(driver) + " but LibTorch's runtime is CUDA " +
                version_string(runtime) + ", a newer major version: update the NVIDIA driver"};
  }
  if (driver < runtime) {
    // CUDA's minor version compatibility: a driver of the same major version runs a newer runtime's
    // code, except what needs the newer driver (PTX compiled at run time, some newer APIs).
    return {"cuda_driver", "warn", detail,
            "runtime CUDA " + version_string(runtime) + " runs on this driver by CUDA's minor version "
            "compatibility; kernels compiled at run time from PTX (GPUs newer than LibTorch's build) need "
            "a driver for CUDA " + version_string(runtime)};
  }
  return {"cuda_driver", "ok", detail, ""};
}

std::string nvidia_driver_version(const std::string& text) {
  // The first line, "NVRM version: ..."; its first token of digits and dots with a dot in it
  // (x86_64, the build date and time do not qualify).
  const std::string line = first_line(text);
  if (line.rfind("NVRM version:", 0) != 0) return "";
  std::istringstream words(line);
  for (std::string word; words >> word;) {
    if (word.find('.') != std::string::npos && word.find_first_not_of("0123456789.") == std::string::npos &&
        std::isdigit(static_cast<unsigned char>(word.front()))) {
      return word;
    }
  }
  return "";
}

std::string cuda_failure_hint(const std::string& m) {
  if (m.find("no kernel image") != std::string::npos) {
    return "this LibTorch has no kernels for the GPU's compute capability: install a LibTorch/PyTorch build that "
           "lists it (torch.cuda.get_arch_list())";
  }
  if (m.find("driver version is insufficient") != std::string::npos ||
      m.find("CUDA driver version") != std::string::npos) {
    return "the NVIDIA driver is older than the CUDA runtime LibTorch was built with: update the driver, or use a "
           "LibTorch built for an older CUDA";
  }
  if (m.find("out of memory") != std::string::npos) {
    return "another process holds the GPU's memory (nvidia-smi shows which)";
  }
  if (m.find("busy or unavailable") != std::string::npos) {
    return "the GPU is in exclusive-process mode and in use by another process";
  }
  return "";
}

NvidiaPresence nvidia_presence(const std::string& pci_devices, const std::string& driver_version,
                               const std::string& dev) {
  NvidiaPresence hw;
  for (const std::string& device : files::list_directory(pci_devices)) {
    const auto first = [&](const std::string& file) {
      std::ifstream in(files::join(files::join(pci_devices, device), file));
      std::string line;
      std::getline(in, line);
      return line;
    };
    // Vendor 0x10de; class 0x0300xx (VGA controller) or 0x0302xx (3D controller, the data-center
    // GPUs). NVIDIA's audio functions, USB controllers and NVSwitches have other classes.
    const std::string cls = first("class");
    if (first("vendor") == "0x10de" && (cls.rfind("0x0300", 0) == 0 || cls.rfind("0x0302", 0) == 0)) ++hw.pci_gpus;
  }
  hw.kernel_module = files::exists(driver_version);
  for (const std::string& name : files::list_directory(dev)) {
    if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
        name.find_first_not_of("0123456789", 6) == std::string::npos) {
      ++hw.device_nodes;
    }
  }
  return hw;
}

DoctorCheck no_driver_check(const NvidiaPresence& hw, bool libcuda_found) {
  if (hw.device_nodes > 0 && hw.kernel_module && !libcuda_found) {
    return {"cuda_driver", "fail",
            "the NVIDIA kernel module is loaded and /dev/nvidia* exist, but libcuda.so.1 is not found",
            "the driver's user-space library is missing: in a container, start it with the NVIDIA container "
            "runtime (docker run --gpus all; the nvidia runtime class in Kubernetes), which mounts the host's "
            "libcuda.so.1; on a host, reinstall the driver's libraries (ldconfig -p | grep libcuda)"};
  }
  if (hw.device_nodes > 0 && hw.kernel_module) {
    return {"cuda_driver", "fail", "libcuda.so.1 loads but reports no driver",
            "a stub libcuda (the CUDA toolkit's lib64/stubs) may come first on LD_LIBRARY_PATH, or libcuda.so.1 "
            "is from another driver version than the kernel module (/proc/driver/nvidia/version)"};
  }
  if (hw.device_nodes > 0) {
    return {"cuda_driver", "fail", "/dev/nvidia* exist but the NVIDIA kernel module is not loaded",
            "on the host: check dmesg | grep -i nvidia and nvidia-smi; after a kernel update, reinstall the driver "
            "(its DKMS module)"};
  }
  if (hw.kernel_module) {
    return {"cuda_driver", "info",
            "the NVIDIA driver is loaded on this host, but this container has no /dev/nvidia* and no usable libcuda",
            "running on the CPU; to use a GPU, start the container with the NVIDIA container runtime "
            "(docker run --gpus all)"};
  }
  if (hw.pci_gpus > 0) {
    return {"cuda_driver", "warn",
            std::to_string(hw.pci_gpus) + " NVIDIA GPU" + (hw.pci_gpus == 1 ? "" : "s") +
                " on the PCI bus, but no NVIDIA driver installed (the kernel module is not loaded)",
            "install the NVIDIA driver (nvidia-smi then lists the GPU); a container needs it on the host"};
  }
  return {"cuda_driver", "info", "no NVIDIA driver or GPU", ""};
}

DoctorCheck gpus_check(int visible, DriverState driver, const NvidiaPresence& hw, const char* cuda_visible_devices) {
  std::string detail = std::to_string(visible) + " visible";
  const std::string value = cuda_visible_devices ? printable(cuda_visible_devices) : "";
  if (cuda_visible_devices) detail += " (CUDA_VISIBLE_DEVICES=" + value + ")";
  if (visible > 0) return {"gpus", "ok", detail, ""};
  const std::string status = hw.device_nodes > 0 ? "fail" : "info";
  // A driver too old for the runtime hides every GPU from CUDA: that, not the GPUs, is the cause.
  if (driver == DriverState::unusable) return {"gpus", status, detail, "see cuda_driver above"};
  if (driver == DriverState::missing) return {"gpus", status, detail, hardware_seen(hw) ? "see cuda_driver above" : ""};
  if (cuda_visible_devices) {
    const int present = hw.device_nodes > 0 ? hw.device_nodes : hw.pci_gpus;
    const std::string why = hides_every_gpu(cuda_visible_devices, present);
    if (!why.empty()) {
      return {"gpus", "fail", detail,
              "CUDA_VISIBLE_DEVICES=" + value + " hides every GPU (" + why + "): unset it or list valid indices"};
    }
  }
  if (hw.device_nodes == 0) {
    return {"gpus", "info", detail,
            hardware_seen(hw) ? "this container has no /dev/nvidia*: start it with --gpus all to use a GPU" : ""};
  }
  std::string hint = "the driver loaded but CUDA finds no GPU: nvidia-smi shows what the driver sees; check dmesg for "
                     "Xid errors and that this user may open /dev/nvidia*";
  if (cuda_visible_devices) hint += "; compare CUDA_VISIBLE_DEVICES=" + value + " with nvidia-smi -L";
  return {"gpus", "fail", detail, hint};
}

DoctorCheck kernels_check(const std::string& name, int cc_major, int cc_minor, const std::vector<std::string>& arch_list) {
  const std::string cc = std::to_string(cc_major) + "." + std::to_string(cc_minor);
  if (arch_list.empty()) return {name, "info", "this LibTorch's GPU architectures are unknown", ""};
  std::string archs;
  for (const std::string& a : arch_list) archs += (archs.empty() ? "" : " ") + a;
  const std::string sm = "sm_" + std::to_string(cc_major) + std::to_string(cc_minor);
  switch (kernel_support(arch_list, cc_major, cc_minor)) {
    case KernelSupport::native:
      return {name, "ok", "compute capability " + cc + " runs on this LibTorch's " + archs, ""};
    case KernelSupport::ptx:
      return {name, "warn", "compute capability " + cc + ": only PTX in this LibTorch (" + archs + ")",
              "the driver compiles every kernel at start-up (minutes, then cached); a LibTorch whose "
              "torch.cuda.get_arch_list() includes " + sm + " starts at once"};
    case KernelSupport::none:
      break;
  }
  return {name, "fail", "no kernels for compute capability " + cc + " in this LibTorch (" + archs + ")",
          "install a LibTorch/PyTorch build whose torch.cuda.get_arch_list() includes " + sm};
}

DoctorCheck memory_check(const MemoryAmount& host) {
  const double fraction = TuningConfig{}.memory_fraction;
  const auto gib = [](double bytes) { return log::fixed(bytes / (1024.0 * 1024.0 * 1024.0), 1) + " GiB"; };
  const std::string detail =
      gib(static_cast<double>(host.available)) + " available of " + gib(static_cast<double>(host.total)) + " (" +
      (host.source.empty() ? std::string("source unknown") : host.source) + "); a CPU run's memory budget is " +
      log::str("tuning.memory_fraction (", fraction, " by default) of the available: ") +
      gib(fraction * static_cast<double>(host.available));
  if (!host.warning.empty()) return {"memory", "warn", detail, host.warning};
  return {"memory", "info", detail, ""};
}

DoctorCheck cpu_only_build_check(const NvidiaPresence& hw, const std::string& torch_version) {
  const std::string detail = "this build of train (LibTorch " + torch_version + ") has no CUDA support";
  const std::string hint = "build against a CUDA LibTorch (scripts/build with the torch wheel)";
  if (hw.device_nodes > 0) return {"cuda", "warn", detail, "a GPU is usable here but this LibTorch is CPU-only: " + hint};
  if (hardware_seen(hw)) return {"cuda", "info", detail, "the host has an NVIDIA GPU; to use it, " + hint};
  return {"cuda", "info", detail, ""};
}

std::string cudnn_version_string(int64_t v) {
  if (v <= 0) return "none";
  const int64_t major_unit = v >= 90000 ? 10000 : 1000;
  return std::to_string(v / major_unit) + "." + std::to_string(v % major_unit / 100) + "." + std::to_string(v % 100);
}

bool is_reference_blas(const std::string& blas) { return blas.find("/blas/libblas.so") != std::string::npos; }

std::vector<DoctorCheck> run_doctor() {
  std::vector<DoctorCheck> checks;
  checks.push_back({"libtorch", "info", compat::torch_version(), ""});
  guarded(checks, "cpu", [&] {
    const DeviceProfile cpu = detect_device("cpu");
    checks.push_back({"cpu", "info", cpu.summary(), ""});
    const bool reference = is_reference_blas(cpu.blas);
    checks.push_back({"blas", reference ? "warn" : "ok", cpu.blas,
                      reference ? "the reference BLAS is ~40x slower than OpenBLAS: apt-get install "
                                  "libopenblas0-pthread (scripts/setup selects it)"
                                : ""});
  });
  guarded(checks, "memory", [&] { checks.push_back(memory_check(host_memory())); });
  NvidiaPresence hw;
  guarded(checks, "nvidia", [&] { hw = nvidia_presence(); });
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");

#ifdef TRAIN_WITH_CUDA
  DriverState driver_state = DriverState::missing;
  guarded(checks, "cuda_driver", [&] {
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    const cudaError_t driver_err = cudaDriverGetVersion(&driver);
    // The CUDA LibTorch was compiled with (torch.version.cuda), and train's own headers' when they
    // differ; the runtime is the libcudart loaded.
    std::string built = "train built with CUDA " + version_string(CUDA_VERSION);
    try {
      const long torch_cuda = at::detail::getCUDAHooks().versionCUDART();
      if (torch_cuda != CUDA_VERSION) {
        built = "LibTorch built with CUDA " + version_string(static_cast<int>(torch_cuda)) + ", " + built;
      } else {
        built = "LibTorch and train built with CUDA " + version_string(CUDA_VERSION);
      }
    } catch (const c10::Error&) {
      // LibTorch's CUDA library is not loaded: only train's own version is known.
    }
    checks.push_back({"cuda_runtime", "info", version_string(runtime) + " (" + built + ")", ""});
    if (driver_err == cudaSuccess && driver > 0) {
      std::ifstream proc("/proc/driver/nvidia/version");
      const std::string text((std::istreambuf_iterator<char>(proc)), std::istreambuf_iterator<char>());
      DoctorCheck check = cuda_driver_check(driver, runtime, nvidia_driver_version(text));
      driver_state = check.status == "fail" ? DriverState::unusable : DriverState::usable;
      checks.push_back(std::move(check));
    } else {
      checks.push_back(no_driver_check(hw, libcuda_loadable()));
    }
  });
  int gpus = 0;
  guarded(checks, "gpus", [&] {
    gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  });
  // The cuDNN LibTorch was built with: known without a GPU, and most wanted when none is found.
  guarded(checks, "cudnn", [&] {
    checks.push_back({"cudnn", "info", cudnn_version_string(at::detail::getCUDAHooks().versionCuDNN()) +
                                           " (the version LibTorch was built with)", ""});
  });
  guarded(checks, "nccl", [&] {
    // Encoded as major << 32 | minor << 16 | patch, as torch.cuda.nccl.version() decodes it.
    const uint64_t v = torch::cuda::nccl::version();
    checks.push_back({"nccl", "info",
                      std::to_string(v >> 32) + "." + std::to_string((v >> 16) & 0xffff) + "." +
                          std::to_string(v & 0xffff) + torch::cuda::nccl::version_suffix(),
                      ""});
  });
  checks.push_back(gpus_check(gpus, driver_state, hw, visible));
  for (int i = 0; i < gpus; ++i) {
    const std::string name = "gpu" + std::to_string(i);
    guarded(checks, name, [&] {
      const DeviceProfile g = detect_device("cuda:" + std::to_string(i));
      DeviceProfile shown = g;
      shown.warning.clear();  // the kernels line says it, with a hint
      checks.push_back({name, "info", shown.summary(), ""});
      checks.push_back(kernels_check(name + "_kernels", g.cc_major, g.cc_minor, cuda_arch_list()));
    });
  }
  const torch::Device device = gpus > 0 ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
#else
  (void)visible;
  checks.push_back(cpu_only_build_check(hw, compat::torch_version()));
  const torch::Device device(torch::kCPU);
#endif
  checks.push_back(smoke("smoke_tensor", device, [&] { (torch::ones({4}, device) + 1).sum().item<float>(); }));
  checks.push_back(smoke("smoke_matmul", device, [&] {
    const auto a = torch::randn({256, 256}, device);
    a.matmul(a).sum().item<float>();
  }));
  checks.push_back(smoke("smoke_conv", device, [&] {
    torch::nn::functional::conv2d(torch::randn({2, 3, 16, 16}, device), torch::randn({4, 3, 3, 3}, device))
        .sum()
        .item<float>();
  }));
  return checks;
}

std::string doctor_text(const std::vector<DoctorCheck>& checks) {
  std::ostringstream out;
  for (const auto& c : checks) {
    out << "  " << c.status << std::string(6 - std::min<size_t>(5, c.status.size()), ' ') << c.name
        << std::string(c.name.size() < 14 ? 14 - c.name.size() : 1, ' ') << c.detail << '\n';
    if (!c.hint.empty()) out << "        hint: " << c.hint << '\n';
  }
  return out.str();
}

std::string doctor_json(const std::vector<DoctorCheck>& checks) {
  std::string out = "[";
  for (size_t i = 0; i < checks.size(); ++i) {
    MetricRecord r;
    // json_quote turns bytes that are not UTF-8 (a CUDA_VISIBLE_DEVICES of any bytes) into U+FFFD.
    r.add("name", checks[i].name).add("status", checks[i].status).add("detail", checks[i].detail)
        .add("hint", checks[i].hint);
    out += (i ? "," : "") + r.to_json();
  }
  return out + "]";
}

}  // namespace train
