#include "testing.h"

#include <train/device.h>
#include <train/errors.h>
#include <train/files.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <string>

using namespace train;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

namespace {

int64_t gib(double g) { return static_cast<int64_t>(g * 1024 * 1024 * 1024); }

// The key match_gpu picks, "" for none; `how` receives its reason.
std::string matched_key(const std::string& name, int major, int minor, double memory_gib, std::string* how = nullptr) {
  const GpuSpec* spec = match_gpu(name, major, minor, gib(memory_gib), how);
  return spec ? spec->key : "";
}

std::string named_device_error(const std::string& key) {
  try {
    named_device(key);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("device: real CUDA device names match their table entry", "[device]") {
  struct Case {
    const char* name;
    int major, minor;
    double memory_gib;  // what the driver reports, a little under the nominal size
    const char* key;
  };
  const Case cases[] = {
      {"Tesla T4", 7, 5, 14.6, "t4"},
      {"Tesla V100-SXM2-16GB", 7, 0, 15.8, "v100-16gb"},
      {"Tesla V100-PCIE-16GB", 7, 0, 15.8, "v100-16gb"},
      {"Tesla V100-SXM2-32GB", 7, 0, 31.7, "v100-32gb"},
      {"Tesla V100S-PCIE-32GB", 7, 0, 31.7, "v100-32gb"},
      {"NVIDIA A100-SXM4-40GB", 8, 0, 39.4, "a100-40gb"},
      {"NVIDIA A100-PCIE-40GB", 8, 0, 39.4, "a100-40gb"},
      {"NVIDIA A100-SXM4-80GB", 8, 0, 79.2, "a100-80gb"},
      {"NVIDIA A100 80GB PCIe", 8, 0, 79.2, "a100-80gb"},
      {"NVIDIA A10", 8, 6, 22.0, "a10"},
      {"NVIDIA A10G", 8, 6, 22.0, "a10g"},
      {"NVIDIA GeForce RTX 3090", 8, 6, 23.7, "rtx3090"},
      {"NVIDIA L4", 8, 9, 22.0, "l4"},
      {"NVIDIA GeForce RTX 4090", 8, 9, 23.6, "rtx4090"},
      {"NVIDIA L40S", 8, 9, 44.5, "l40s"},
      {"NVIDIA H100 80GB HBM3", 9, 0, 79.1, "h100"},
      {"NVIDIA H100 PCIe", 9, 0, 79.1, "h100-pcie"},
      {"NVIDIA H200", 9, 0, 139.8, "h200"},
  };
  for (const Case& c : cases) {
    std::string how;
    CAPTURE(c.name);
    CHECK(matched_key(c.name, c.major, c.minor, c.memory_gib, &how) == c.key);
    CHECK_THAT(how, StartsWith("detected: name '" + std::string(c.name) + "' matches"));
  }
}

TEST_CASE("device: patterns match whole words only", "[device]") {
  // "a10" must not match inside "a100" or "a10g", nor "l4" inside "l40s", nor "t4" inside "t4000".
  CHECK(matched_key("NVIDIA A10", 8, 6, 22) == "a10");
  CHECK(matched_key("NVIDIA A10G", 8, 6, 22) == "a10g");
  CHECK(matched_key("NVIDIA L40S", 8, 9, 44.5) == "l40s");
  std::string how;
  CHECK(matched_key("Quadro RTX T4000", 7, 5, 8, &how) == "t4");
  CHECK_THAT(how, StartsWith("fallback: "));
}

TEST_CASE("device: the A100 variant is chosen by memory, not by name", "[device]") {
  std::string how;
  CHECK(matched_key("NVIDIA A100-SXM4-80GB", 8, 0, 39.4, &how) == "a100-40gb");
  CHECK_THAT(how, Contains("matches a100-40gb, a100-80gb; 39 GiB -> a100-40gb"));
  CHECK(matched_key("NVIDIA A100-SXM4-40GB", 8, 0, 79.2, &how) == "a100-80gb");
  CHECK_THAT(how, Contains("79 GiB -> a100-80gb"));
  CHECK(matched_key("Tesla V100-SXM2-16GB", 7, 0, 31.7) == "v100-32gb");
}

TEST_CASE("device: an unknown name falls back by compute capability and memory", "[device]") {
  std::string how;
  SECTION("same major.minor: cc 8.9 and 24 GB is an Ada entry") {
    const GpuSpec* spec = match_gpu("NVIDIA Future Ada", 8, 9, gib(23.6), &how);
    REQUIRE(spec != nullptr);
    CHECK(spec->cc_major == 8);
    CHECK(spec->cc_minor == 9);
    CHECK(spec->memory_gb == 24);
    CHECK(spec->key == "l4");  // ties with the RTX 4090 go to the earlier, more conservative entry
    CHECK(how == "fallback: unknown name 'NVIDIA Future Ada'; compute capability 8.9 and 24 GiB -> closest l4");
  }
  SECTION("cc 8.6 and 24 GB is the A10") {
    CHECK(matched_key("NVIDIA RTX A5000", 8, 6, 23.7, &how) == "a10");
    CHECK_THAT(how, Contains("compute capability 8.6 and 24 GiB -> closest a10"));
  }
  SECTION("same major when no entry has the minor") {
    CHECK(matched_key("Orin", 8, 7, 30, &how) == "a10");
    CHECK_THAT(how, Contains("compute capability 8.x and 30 GiB -> closest a10"));
  }
  SECTION("a newer architecture is planned as the newest one below it, by memory") {
    CHECK(matched_key("NVIDIA GeForce RTX 5090", 12, 0, 31.4, &how) == "h100");
    CHECK_THAT(how, Contains("newest known compute capability below 12.0 (9.0) and 31 GiB -> closest h100"));
    CHECK(matched_key("NVIDIA B200", 10, 0, 178, &how) == "h200");
    CHECK_THAT(how, StartsWith("fallback: "));
  }
  SECTION("a name alone never matches an unknown GPU: GH200 is not the H200") {
    CHECK(matched_key("NVIDIA GH200 480GB", 9, 0, 94.5, &how) == "h100");
    CHECK_THAT(how, StartsWith("fallback: "));
  }
  SECTION("a GPU older than every entry has no spec") {
    CHECK(match_gpu("Tesla P100-PCIE-16GB", 6, 0, gib(15.9), &how) == nullptr);
    CHECK_THAT(how, StartsWith("unknown: "));
  }
}

TEST_CASE("device: named_device describes a table entry", "[device]") {
  const DeviceProfile a100 = named_device("a100-80gb");
  CHECK(a100.kind == "cuda");
  CHECK(a100.is_cuda());
  CHECK(a100.named);
  CHECK(a100.spec_key == "a100-80gb");
  CHECK(a100.match == "named: a100-80gb");
  CHECK(a100.name == "NVIDIA A100-SXM4-80GB");
  CHECK(a100.cc_major == 8);
  CHECK(a100.cc_minor == 0);
  CHECK(a100.total_memory == gib(80));
  CHECK(a100.free_memory == a100.total_memory);
  CHECK(a100.sm_count == 108);
  CHECK(a100.visible_gpus == 1);
  CHECK(a100.bf16);
  CHECK(a100.tf32);
  CHECK(a100.peak_bf16_tflops == 312);
  CHECK(a100.peak_fp16_tflops == 312);
  CHECK(a100.peak_tf32_tflops == 156);
  CHECK(a100.peak_fp32_tflops == 19.5);
  CHECK(a100.bandwidth_gbs == 2039);
  CHECK(a100.cpu_cores >= 1);  // the host is this machine
  CHECK(a100.summary() == "NVIDIA A100-SXM4-80GB [a100-80gb, planned, not detected] (cc 8.0, 80 GiB, 108 SMs)");

  const DeviceProfile t4 = named_device("t4");
  CHECK(t4.named);
  CHECK_FALSE(t4.bf16);
  CHECK_FALSE(t4.tf32);
  CHECK(t4.peak_bf16_tflops == 0);
  CHECK(t4.peak_tf32_tflops == 0);
  CHECK(t4.peak_fp16_tflops == 65);
  CHECK(t4.peak_fp32_tflops == 8.1);

  CHECK(named_device("H200").spec_key == "h200");  // keys are case-insensitive
}

TEST_CASE("device: an unknown named device is a ConfigError with a suggestion", "[device]") {
  CHECK_THROWS_AS(named_device("a100-80"), ConfigError);
  const std::string message = named_device_error("a100-80");
  CHECK_THAT(message, Contains("unknown device 'a100-80'"));
  CHECK_THAT(message, Contains("did you mean 'a100-80gb'?"));
  CHECK_THAT(message, Contains("known: cpu, v100-16gb, v100-32gb, t4,"));
  CHECK_THAT(message, Contains("h200"));
  CHECK_THAT(named_device_error("tpu-v5"), !Contains("did you mean"));
  // The key, for the config's file and line; a family name lists its members, not a near miss.
  CHECK_THAT(message, StartsWith("key 'tuning.device': "));
  CHECK_THAT(named_device_error("a100"), Contains("did you mean 'a100-40gb' or 'a100-80gb'?"));
}

TEST_CASE("device: cpu is detected, by request or by name", "[device]") {
  for (const DeviceProfile& cpu : {detect_device("cpu"), named_device("cpu")}) {
    CHECK(cpu.kind == "cpu");
    CHECK_FALSE(cpu.named);
    CHECK(cpu.spec_key.empty());
    CHECK(cpu.cpu_cores >= 1);
    CHECK_FALSE(cpu.blas.empty());
    CHECK(cpu.total_memory > 0);
    CHECK(cpu.peak_fp32_tflops >= 0);
    CHECK_THAT(cpu.match, StartsWith("detected: CPU"));
    CHECK_THAT(cpu.summary(), Contains("BLAS "));
  }
}

TEST_CASE("device: summary names the table entry and how it was chosen", "[device]") {
  DeviceProfile p;
  p.kind = "cuda";
  p.name = "NVIDIA H200";
  p.cc_major = 9;
  p.total_memory = gib(140);
  p.sm_count = 132;
  p.spec_key = "h200";
  p.match = "detected: name 'NVIDIA H200' matches h200";
  CHECK(p.summary() == "NVIDIA H200 [h200] (cuda:0, cc 9.0, 140 GiB, 132 SMs)");
  p.name = "NVIDIA GeForce RTX 5090";
  p.spec_key = "h100";
  p.match = "fallback: unknown name 'NVIDIA GeForce RTX 5090'; ...";
  CHECK_THAT(p.summary(), StartsWith("NVIDIA GeForce RTX 5090 [closest h100] (cuda:0,"));
  p.spec_key.clear();
  CHECK_THAT(p.summary(), StartsWith("NVIDIA GeForce RTX 5090 (cuda:0,"));
}

TEST_CASE("device: every table entry is complete and consistent", "[device]") {
  const std::vector<std::string> keys = known_device_keys();
  const std::set<std::string> known(keys.begin(), keys.end());
  CHECK(known.size() == keys.size());
  CHECK(known.count("cpu") == 1);
  for (const char* key : {"t4", "v100-16gb", "v100-32gb", "a10", "a10g", "l4", "a100-40gb", "a100-80gb", "h100",
                          "h100-pcie", "h200", "rtx3090", "rtx4090", "l40s"}) {
    CHECK(known.count(key) == 1);
  }
  for (const GpuSpec& spec : gpu_specs()) {
    CAPTURE(spec.key);
    CHECK(known.count(spec.key) == 1);
    CHECK(spec.peak_fp32_tflops > 0);
    CHECK(spec.peak_fp16_tflops > spec.peak_fp32_tflops);  // every entry has fp16 tensor cores
    CHECK(spec.memory_gb > 0);
    CHECK(spec.bandwidth_gbs > 0);
    CHECK(spec.sm_count > 0);
    CHECK((spec.peak_bf16_tflops > 0) == (spec.cc_major >= 8));
    CHECK((spec.peak_tf32_tflops > 0) == (spec.cc_major >= 8));
    CHECK_FALSE(spec.name_patterns.empty());
    // The canonical device name, with the memory the table gives, finds its own entry.
    CHECK(matched_key(spec.display_name, spec.cc_major, spec.cc_minor, spec.memory_gb) == spec.key);
  }
}

TEST_CASE("device: the CPU quota comes from the process's own cgroup and the strictest of its parents",
          "[device]") {
  const std::string root = files::make_temp_directory("train_cgroup_");
  auto put = [&](const std::string& rel, const std::string& text) {
    const std::string path = files::join(root, rel);
    files::make_directories(path.substr(0, path.find_last_of('/')));
    std::ofstream(path) << text;
  };
  const std::string self = files::join(root, "self_cgroup");

  // cgroup v2: a systemd unit or a container without its own namespace, two levels below the root.
  put("v2/cgroup.controllers", "cpu io memory\n");
  put("v2/cpu.max", "max 100000\n");
  put("v2/a/cpu.max", "max 100000\n");
  put("v2/a/b/cpu.max", "200000 100000\n");
  put("self_cgroup", "0::/a/b\n");
  CHECK(cgroup_cpu_quota(root + "/v2", self) == Approx(2.0));
  put("v2/a/cpu.max", "150000 100000\n");  // a parent's limit binds its children
  CHECK(cgroup_cpu_quota(root + "/v2", self) == Approx(1.5));
  put("self_cgroup", "0::/\n");  // a cgroup namespace: the container's cgroup is the root
  CHECK(cgroup_cpu_quota(root + "/v2", self) == 0);
  put("v2/cpu.max", "400000 100000\n");
  CHECK(cgroup_cpu_quota(root + "/v2", self) == Approx(4.0));

  // cgroup v1: the cpu controller's line, its mount, and the levels that exist under it (without a
  // cgroup namespace a container's path is not there, and its own cgroup is the mount's root).
  put("v1/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  put("v1/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  put("v1/cpu,cpuacct/x/cpu.cfs_quota_us", "300000\n");
  put("v1/cpu,cpuacct/x/cpu.cfs_period_us", "100000\n");
  put("self_cgroup", "5:memory:/x\n4:cpu,cpuacct:/x\n1:name=systemd:/x\n");
  CHECK(cgroup_cpu_quota(root + "/v1", self) == Approx(3.0));
  put("self_cgroup", "4:cpu,cpuacct:/docker/0123abcd\n");
  CHECK(cgroup_cpu_quota(root + "/v1", self) == 0);
  put("v1/cpu,cpuacct/cpu.cfs_quota_us", "100000\n");
  CHECK(cgroup_cpu_quota(root + "/v1", self) == Approx(1.0));

  // Nothing readable: no quota.
  CHECK(cgroup_cpu_quota(root + "/none", root + "/none/cgroup") == 0);
  // This machine's own answer is consistent with the core count.
  const double quota = cgroup_cpu_quota();
  CHECK(available_cores() >= 1);
  if (quota > 0) CHECK(available_cores() <= std::max(1.0, std::floor(quota)));
  files::remove_all(root);
}
