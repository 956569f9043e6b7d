#pragma once
// `train doctor`: environment checks, each with a status and, for known failures, a hint that
// says what to do.
#include <cstdint>
#include <string>
#include <vector>

namespace train {

struct MemoryAmount;

struct DoctorCheck {
  std::string name;
  std::string status;  // ok | warn | fail | info
  std::string detail;
  std::string hint;    // empty when there is nothing to do
};

// Runs every check. A check that throws becomes a `fail` line naming the error; the report goes on.
std::vector<DoctorCheck> run_doctor();
std::string doctor_text(const std::vector<DoctorCheck>& checks);
// A JSON array of {name, status, detail, hint}; text that is not valid UTF-8 is repaired (U+FFFD).
std::string doctor_json(const std::vector<DoctorCheck>& checks);
// The driver against the CUDA runtime (CUDA's encoding: 12040 is 12.4): fail when the driver's
// major version is older, warn when only its minor version is (minor version compatibility).
// `driver_version`: the driver's own version ("580.95.05", nvidia_driver_version), "" if unknown.
DoctorCheck cuda_driver_check(int driver, int runtime, const std::string& driver_version = "");
// The NVIDIA driver's version from the text of /proc/driver/nvidia/version ("NVRM version: NVIDIA
// UNIX x86_64 Kernel Module  535.104.05  ..."); "" when the text has none.
std::string nvidia_driver_version(const std::string& proc_version_text);
// Hint for a CUDA failure message; empty when the message is not a known one.
std::string cuda_failure_hint(const std::string& message);

// What this machine and container show of NVIDIA hardware without asking CUDA. The paths are
// parameters for tests.
struct NvidiaPresence {
  int pci_gpus = 0;            // NVIDIA display or 3D controllers on the PCI bus (sysfs shows the
                               // host's devices, in a container too)
  bool kernel_module = false;  // /proc/driver/nvidia/version exists: the kernel driver is loaded
                               // (host-wide: a container sees it whether or not it has a GPU)
  int device_nodes = 0;        // /dev/nvidiaN here: a GPU was given to this container
};
NvidiaPresence nvidia_presence(const std::string& pci_devices = "/sys/bus/pci/devices",
                               const std::string& driver_version = "/proc/driver/nvidia/version",
                               const std::string& dev = "/dev");

// The cuda_driver line when CUDA reports no driver (version 0). `libcuda_loadable`: whether
// libcuda.so.1, the driver's user-space half, can be loaded. fail only when /dev/nvidia* exist
// (the GPU was meant to be usable here); a GPU on the host that this container was not given is
// info, a GPU without a driver installed warn.
DoctorCheck no_driver_check(const NvidiaPresence& hw, bool libcuda_loadable);
// What the cuda_driver line found: no driver (no_driver_check), a driver that cannot run this CUDA
// runtime (cuda_driver_check failed: an older major version), or a usable one.
enum class DriverState { missing, unusable, usable };
// The gpus line for `visible` CUDA devices. Without a usable driver it defers to the cuda_driver
// line. CUDA_VISIBLE_DEVICES (nullptr when unset) is blamed only when the driver is usable and the
// value hides every GPU: empty, negative ("-1"), or a first index that does not exist (the GPUs
// counted from /dev/nvidiaN, else the PCI bus).
DoctorCheck gpus_check(int visible, DriverState driver, const NvidiaPresence& hw, const char* cuda_visible_devices);
// Whether this LibTorch (its architecture list, cuda_arch_list()) has kernels for a GPU of compute
// capability major.minor: ok with machine code, warn with PTX only, fail with neither.
DoctorCheck kernels_check(const std::string& name, int cc_major, int cc_minor, const std::vector<std::string>& arch_list);
// The memory line: host memory available and in total (host_memory()) with where the figures
// come from, and the CPU memory budget a plan takes from it (tuning.memory_fraction, 0.9 by
// default, of the available); warn when host_memory had to guess (its `warning`).
DoctorCheck memory_check(const MemoryAmount& host);
// The line for a build of train without CUDA, by what the machine shows.
DoctorCheck cpu_only_build_check(const NvidiaPresence& hw, const std::string& torch_version);

// cuDNN's version number as text: 9.x encodes major*10000 + minor*100 + patch (91900 is 9.19.0),
// 8.x and older major*1000 + minor*100 + patch (8906 is 8.9.6).
std::string cudnn_version_string(int64_t version);
// Whether the BLAS in use (DeviceProfile::blas) is the slow reference implementation, which
// Debian installs as .../blas/libblas.so.3 (OpenBLAS's and BLIS's libblas.so.3 live elsewhere).
bool is_reference_blas(const std::string& blas);

}  // namespace train
