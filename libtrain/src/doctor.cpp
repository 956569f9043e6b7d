#include "train/doctor.h"

#include <torch/torch.h>

#include <cstdlib>
#include <sstream>

#include "compat.h"
#include "train/device.h"
#include "train/files.h"
#include "train/metrics.h"

#ifdef TRAIN_WITH_CUDA
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/nccl.h>
#endif

namespace train {
namespace {

std::string version_string(int v) {  // CUDA encodes 13.0 as 13000
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// Runs a small piece of work on the device; the detail says what failed.
DoctorCheck smoke(const std::string& name, const torch::Device& device, const std::function<void()>& work) {
  try {
    work();
    if (device.is_cuda()) torch::cuda::synchronize();
    return {name, "ok", "on " + device.str(), ""};
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    return {name, "fail", what.substr(0, what.find('\n')), cuda_failure_hint(what)};
  }
}

bool nvidia_hardware_present() {
  return files::exists("/dev/nvidia0") || files::exists("/proc/driver/nvidia/version");
}

}  // namespace

DoctorCheck cuda_driver_check(int driver, int runtime) {
  const std::string detail = "supports CUDA " + version_string(driver);
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

std::vector<DoctorCheck> run_doctor() {
  std::vector<DoctorCheck> checks;
  const DeviceProfile cpu = detect_device("cpu");
  checks.push_back({"libtorch", "info", compat::torch_version(), ""});
  checks.push_back({"cpu", "info", cpu.summary(), ""});
  const bool reference_blas = cpu.blas.find("libblas.so") != std::string::npos &&
                              cpu.blas.find("openblas") == std::string::npos;
  checks.push_back({"blas", reference_blas ? "warn" : "ok", cpu.blas,
                    reference_blas ? "the reference BLAS is ~40x slower than OpenBLAS: apt-get install "
                                     "libopenblas0-pthread (scripts/setup selects it)"
                                   : ""});
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string visible_str = visible ? visible : "";

#ifdef TRAIN_WITH_CUDA
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  const cudaError_t driver_err = cudaDriverGetVersion(&driver);
  checks.push_back({"cuda_runtime", "info", version_string(runtime) + " (LibTorch built with " +
                                                std::to_string(CUDA_VERSION / 1000) + "." +
                                                std::to_string(CUDA_VERSION % 1000 / 10) + ")",
                    ""});
  if (driver_err != cudaSuccess || driver == 0) {
    checks.push_back({"cuda_driver", nvidia_hardware_present() ? "fail" : "info", "no NVIDIA driver loaded",
                      nvidia_hardware_present() ? "an NVIDIA device node exists but the driver did not load: check "
                                                  "dmesg and nvidia-smi"
                                                : ""});
  } else {
    checks.push_back(cuda_driver_check(driver, runtime));
  }
  const int gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (gpus > 0) {
    checks.push_back({"cudnn", "info", std::to_string(at::detail::getCUDAHooks().versionCuDNN()), ""});
  }
  {
    // Encoded as major << 32 | minor << 16 | patch, as torch.cuda.nccl.version() decodes it.
    const uint64_t v = torch::cuda::nccl::version();
    checks.push_back({"nccl", "info",
                      std::to_string(v >> 32) + "." + std::to_string((v >> 16) & 0xffff) + "." +
                          std::to_string(v & 0xffff) + torch::cuda::nccl::version_suffix(),
                      ""});
  }
  std::string gpu_detail = std::to_string(gpus) + " visible";
  if (visible) gpu_detail += " (CUDA_VISIBLE_DEVICES=" + visible_str + ")";
  std::string gpu_hint;
  if (gpus == 0 && visible && nvidia_hardware_present()) {
    gpu_hint = "CUDA_VISIBLE_DEVICES=" + visible_str + " hides every GPU: unset it or list valid indices";
  } else if (gpus == 0 && nvidia_hardware_present()) {
    gpu_hint = "a GPU is installed but CUDA cannot use it: see cuda_driver above";
  }
  checks.push_back({"gpus", gpus > 0 ? "ok" : (gpu_hint.empty() ? "info" : "fail"), gpu_detail, gpu_hint});
  for (int i = 0; i < gpus; ++i) {
    const DeviceProfile g = detect_device("cuda:" + std::to_string(i));
    checks.push_back({"gpu" + std::to_string(i), "info", g.summary(), ""});
  }
  const torch::Device device = gpus > 0 ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
#else
  checks.push_back({"cuda", nvidia_hardware_present() ? "warn" : "info",
                    "this build of train (LibTorch " + compat::torch_version() + ") has no CUDA support",
                    nvidia_hardware_present() ? "an NVIDIA GPU is present but this LibTorch is CPU-only: build "
                                                "against a CUDA LibTorch (scripts/build with the torch wheel)"
                                              : ""});
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
    r.add("name", checks[i].name).add("status", checks[i].status).add("detail", checks[i].detail)
        .add("hint", checks[i].hint);
    out += (i ? "," : "") + r.to_json();
  }
  return out + "]";
}

}  // namespace train
