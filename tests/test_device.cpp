#include "testing.h"

#include <train/device.h>
#include <train/doctor.h>
#include <train/errors.h>
#include <train/files.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>

using namespace train;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

namespace {

int64_t gib(double g) { return static_cast<int64_t>(g * 1024 * 1024 * 1024); }
double in_gib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024 * 1024); }

// The key match_gpu picks, "" for none; `how` receives its reason.
std::string matched_key(const std::string& name, int major, int minor, double memory_gib, std::string* how = nullptr) {
  const GpuMatch m = match_gpu(name, major, minor, gib(memory_gib));
  if (how) *how = m.how;
  return m.spec ? m.spec->key : "";
}

// A detected CUDA device as detect_device() would describe it, with the table's figures.
DeviceProfile cuda_device(const std::string& name, int major, int minor, double memory_gib, int sms) {
  DeviceProfile p;
  p.kind = "cuda";
  p.name = name;
  p.cc_major = major;
  p.cc_minor = minor;
  p.total_memory = gib(memory_gib);
  p.sm_count = sms;
  fill_gpu_figures(p);
  return p;
}

// Files under a temporary directory, removed at the end of the test.
struct FakeFiles {
  std::string root = files::make_temp_directory("train_device_");
  ~FakeFiles() { files::remove_all(root); }
  std::string put(const std::string& rel, const std::string& text) const {
    const std::string path = files::join(root, rel);
    files::make_directories(files::parent(path));
    std::ofstream(path) << text;
    return path;
  }
  std::string operator/(const std::string& rel) const { return files::join(root, rel); }
};

// Whether the venv's Python reads `json` as strict UTF-8 JSON that is a list of checks, and the
// assertion `python_check` (a Python expression over `d`, the parsed list) holds.
bool python_accepts_json(const std::string& json, const std::string& python_check = "True") {
  const FakeFiles dir;
  const std::string file = dir.put("doctor.json", json);
  const std::string script = dir.put("check.py", "import json, sys\n"
                                                 "d = json.load(open(sys.argv[1], encoding='utf-8'))\n"
                                                 "assert isinstance(d, list) and all(set(c) == {'name', 'status', 'detail', 'hint'} for c in d)\n"
                                                 "assert " + python_check + "\n");
  const std::string cmd = std::string("\"") + TRAIN_PYTHON + "\" \"" + script + "\" \"" + file + "\"";
  return std::system(cmd.c_str()) == 0;
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
      {"NVIDIA H100 NVL", 9, 0, 92.6, "h100-nvl"},
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
  // Names that contain a pattern only inside a longer word: a substring search would take them
  // for the L4, the A100 (or A10) and the T4; they fall back by compute capability instead.
  CHECK(matched_key("NVIDIA L40", 8, 9, 44.4, &how) == "l40s");
  CHECK_THAT(how, StartsWith("fallback: unknown name 'NVIDIA L40'"));
  CHECK(matched_key("NVIDIA RTX A1000", 8, 6, 7.7, &how) == "a10");
  CHECK_THAT(how, StartsWith("fallback: "));
  CHECK(matched_key("NVIDIA T400", 7, 5, 3.8, &how) == "t4");
  CHECK_THAT(how, StartsWith("fallback: "));
  // A pattern followed by a non-alphanumeric character is a whole word.
  CHECK(matched_key("NVIDIA A100-SXM4-40GB", 8, 0, 39.4, &how) == "a100-40gb");
  CHECK_THAT(how, StartsWith("detected: name"));
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
    const GpuMatch m = match_gpu("NVIDIA Future Ada", 8, 9, gib(23.6));
    REQUIRE(m.spec != nullptr);
    CHECK(m.spec->cc_major == 8);
    CHECK(m.spec->cc_minor == 9);
    CHECK(in_gib(m.spec->memory_bytes) == Approx(22.06).margin(0.01));
    // The RTX 4090's 23.99 GiB is closer, but within 10 %: a tie, which goes to the earlier, more
    // conservative entry.
    CHECK(m.spec->key == "l4");
    CHECK(m.approximate);
    CHECK(m.sm_scale == 1.0);  // SM count unknown
    CHECK(m.how == "fallback: unknown name 'NVIDIA Future Ada'; compute capability 8.9 and 24 GiB -> closest l4");
  }
  SECTION("cc 8.6 and 24 GB is the A10") {
    CHECK(matched_key("NVIDIA RTX A5000", 8, 6, 23.7, &how) == "a10");
    CHECK_THAT(how, Contains("compute capability 8.6 and 24 GiB -> closest a10"));
  }
  SECTION("same major when no entry has the minor") {
    CHECK(matched_key("Orin", 8, 7, 30, &how) == "a10");
    CHECK_THAT(how, Contains("compute capability 8.x and 30 GiB -> closest a10"));
  }
  SECTION("a newer architecture is planned as the newest one below it, by memory, the conservative entry on a tie") {
    CHECK(matched_key("NVIDIA GeForce RTX 5090", 12, 0, 31.4, &how) == "h100-pcie");
    CHECK_THAT(how, Contains("newest known compute capability below 12.0 (9.0) and 31 GiB -> closest h100-pcie"));
    CHECK(matched_key("NVIDIA B200", 10, 0, 178, &how) == "h200");
    CHECK_THAT(how, StartsWith("fallback: "));
  }
  SECTION("a name alone never matches an unknown GPU: GH200 is not the H200") {
    CHECK(matched_key("NVIDIA GH200 480GB", 9, 0, 94.5, &how) == "h100-nvl");  // by memory: 96 GB HBM3
    CHECK_THAT(how, StartsWith("fallback: "));
  }
  SECTION("on a memory tie an unknown GPU gets the more conservative H100 PCIe, not the SXM module") {
    CHECK(matched_key("NVIDIA Future", 10, 0, 60, &how) == "h100-pcie");
    CHECK(matched_key("NVIDIA Future", 9, 0, 80, &how) == "h100-pcie");
  }
  SECTION("the Hopper entries list lower peaks first, so that ties fall back to them") {
    for (size_t i = 1; i < gpu_specs().size(); ++i) {
      const GpuSpec& a = gpu_specs()[i - 1];
      const GpuSpec& b = gpu_specs()[i];
      if (a.cc_major != 9 || b.cc_major != 9) continue;  // Hopper: the fallback of every newer GPU
      CAPTURE(a.key, b.key);
      CHECK(a.peak_bf16_tflops <= b.peak_bf16_tflops);
    }
  }
  SECTION("a GPU older than every entry has no spec") {
    const GpuMatch m = match_gpu("Tesla P100-PCIE-16GB", 6, 0, gib(15.9), 56);
    CHECK(m.spec == nullptr);
    CHECK_THAT(m.how, StartsWith("unknown: "));
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
  CHECK(a100.total_memory == int64_t{81049} << 20);  // what CUDA reports, not the marketed 80 GB
  CHECK(a100.free_memory == a100.total_memory - kCudaContextBytes);
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
  CHECK_FALSE(a100.approximate);
  CHECK(a100.summary() == "NVIDIA A100-SXM4-80GB [a100-80gb, planned, not detected] (cc 8.0, 79.1 GiB, 108 SMs)" +
                              (a100.warning.empty() ? "" : "; " + a100.warning));

  const DeviceProfile t4 = named_device("t4");
  CHECK(t4.named);
  CHECK_FALSE(t4.bf16);
  CHECK_FALSE(t4.tf32);
  CHECK(t4.peak_bf16_tflops == 0);
  CHECK(t4.peak_tf32_tflops == 0);
  CHECK(t4.peak_fp16_tflops == 65);
  CHECK(t4.peak_fp32_tflops == 8.1);
  // A real T4 reports 15843721216 bytes: a plan for the marketed 16 GiB would promise 1.2 GiB
  // more than there is.
  CHECK(in_gib(t4.total_memory) == Approx(14.75).margin(0.01));
  CHECK(t4.free_memory < t4.total_memory);

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
    CHECK(cpu.free_memory > 0);
    CHECK(cpu.free_memory <= cpu.total_memory);
    CHECK(cpu.total_memory <= host_memory().total);
    // A peak from the clock, cores and vector width, or none when the clock is unknown; a 2-socket
    // AVX-512 server peaks near 10 TFLOP/s.
    if (cpu.match.find("clock unknown") == std::string::npos) {
      CHECK_THAT(cpu.match, Contains(" cores x "));
      CHECK(cpu.peak_fp32_tflops > 0.001);
      CHECK(cpu.peak_fp32_tflops < 100);
    } else {
      CHECK(cpu.peak_fp32_tflops == 0);
    }
    CHECK_THAT(cpu.match, StartsWith("detected: CPU"));
    CHECK_THAT(cpu.summary(), Contains("BLAS "));
  }
}

TEST_CASE("device: each local rank gets a GPU of its own, and more ranks than GPUs is an error", "[device]") {
  CHECK(train::gpu_for_local_rank(0, 0) == 0);
  CHECK(train::gpu_for_local_rank(3, 8) == 3);
  CHECK(train::gpu_for_local_rank(5, 1) == 0);  // every rank sees one GPU of its own (--gpus-per-task=1)
  CHECK_THROWS_WITH(train::gpu_for_local_rank(4, 4),
                    Catch::Contains("local rank 4 but 4 GPUs are visible") && Catch::Contains("at most 4 ranks per host"));
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
                          "h100-pcie", "h100-nvl", "h200", "rtx3090", "rtx4090", "l40s"}) {
    CHECK(known.count(key) == 1);
  }
  for (const GpuSpec& spec : gpu_specs()) {
    CAPTURE(spec.key);
    CHECK(known.count(spec.key) == 1);
    CHECK(spec.peak_fp32_tflops > 0);
    CHECK(spec.peak_fp16_tflops > spec.peak_fp32_tflops);  // every entry has fp16 tensor cores
    CHECK(spec.memory_bytes > 0);
    CHECK(spec.bandwidth_gbs > 0);
    CHECK(spec.sm_count > 0);
    CHECK((spec.peak_bf16_tflops > 0) == (spec.cc_major >= 8));
    CHECK((spec.peak_tf32_tflops > 0) == (spec.cc_major >= 8));
    CHECK_FALSE(spec.name_patterns.empty());
    // The canonical device name, with the memory the table gives, finds its own entry.
    const GpuMatch own = match_gpu(spec.display_name, spec.cc_major, spec.cc_minor, spec.memory_bytes, spec.sm_count);
    REQUIRE(own.spec != nullptr);
    CHECK(own.spec->key == spec.key);
    CHECK_FALSE(own.approximate);
    CHECK(own.sm_scale == 1.0);
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

TEST_CASE("device: table memory is what CUDA reports and below the marketed size", "[device]") {
  // The marketed size in GB, taken as GiB, overstates what a plan can use by 1 to 8 %.
  const std::map<std::string, double> marketed = {
      {"v100-16gb", 16}, {"v100-32gb", 32}, {"t4", 16},       {"a100-40gb", 40}, {"a100-80gb", 80},
      {"a10", 24},       {"a10g", 24},      {"rtx3090", 24},  {"l4", 24},        {"rtx4090", 24},
      {"l40s", 48},      {"h100", 80},      {"h100-pcie", 80}, {"h100-nvl", 94}, {"h200", 141}};
  for (const GpuSpec& spec : gpu_specs()) {
    CAPTURE(spec.key);
    REQUIRE(marketed.count(spec.key) == 1);
    CHECK(in_gib(spec.memory_bytes) < marketed.at(spec.key));
    CHECK(in_gib(spec.memory_bytes) > 0.9 * marketed.at(spec.key));
    const DeviceProfile p = named_device(spec.key);
    CHECK(p.total_memory == spec.memory_bytes);
    CHECK(p.free_memory == spec.memory_bytes - kCudaContextBytes);  // an estimate: our own CUDA context
  }
  CHECK(in_gib(named_device("t4").total_memory) == Approx(15843721216.0 / (1 << 30)).margin(0.001));
  // This project's H200 printed "140 GiB" (3 significant digits: 139.5 to 140.5).
  CHECK(in_gib(named_device("h200").total_memory) == Approx(140).margin(0.5));
}

TEST_CASE("device: a name match with another SM count is approximate and scales the peaks", "[device]") {
  SECTION("H100 NVL: its own entry (lower clocks than the SXM module), 132 SMs as in the table") {
    const DeviceProfile p = cuda_device("NVIDIA H100 NVL", 9, 0, 92.6, 132);
    CHECK(p.spec_key == "h100-nvl");
    CHECK_FALSE(p.approximate);
    CHECK(p.peak_bf16_tflops == 835);
    CHECK(p.bandwidth_gbs == 3900);
    CHECK(p.match == "detected: name 'NVIDIA H100 NVL' matches h100-nvl");
  }
  SECTION("a 1g.10gb MIG slice of an A100 has 14 of its 108 SMs") {
    const DeviceProfile p = cuda_device("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 8, 0, 9.5, 14);
    CHECK_THAT(p.spec_key, StartsWith("a100-"));
    CHECK(p.approximate);
    CHECK(p.peak_bf16_tflops == Approx(312.0 * 14 / 108));
    CHECK(p.peak_fp32_tflops == Approx(19.5 * 14 / 108));
    CHECK_THAT(p.match, StartsWith("detected: name 'NVIDIA A100-SXM4-80GB MIG 1g.10gb' matches"));
    CHECK_THAT(p.match, Contains("approximate: 14 SMs, " + p.spec_key + " has 108: peaks scaled by 0.13"));
    CHECK_THAT(p.summary(), Contains("[" + p.spec_key + ", SMs scaled]"));
  }
  SECTION("the RTX 4090 Laptop GPU has 76 SMs, the desktop card 128") {
    const DeviceProfile p = cuda_device("NVIDIA GeForce RTX 4090 Laptop GPU", 8, 9, 16, 76);
    CHECK(p.spec_key == "rtx4090");
    CHECK(p.approximate);
    CHECK(p.peak_fp16_tflops == Approx(165.2 * 76 / 128));
    CHECK(p.bandwidth_gbs == 1008);  // only the compute peaks scale
  }
  SECTION("within 10 % the table's figures stand") {
    const GpuMatch m = match_gpu("NVIDIA A100-SXM4-80GB", 8, 0, gib(79.2), 100);
    CHECK_FALSE(m.approximate);
    CHECK(m.sm_scale == 1.0);
  }
  SECTION("a fallback scales down by SMs but never up") {
    const GpuMatch smaller = match_gpu("NVIDIA RTX 4000 Ada Generation", 8, 9, gib(19.7), 48);
    REQUIRE(smaller.spec != nullptr);
    CHECK(smaller.spec->key == "l4");
    CHECK(smaller.approximate);
    CHECK(smaller.sm_scale == Approx(48.0 / 58));
    const GpuMatch bigger = match_gpu("NVIDIA GeForce RTX 5090", 12, 0, gib(31.4), 170);
    REQUIRE(bigger.spec != nullptr);
    CHECK(bigger.spec->key == "h100-pcie");
    CHECK(bigger.approximate);
    CHECK(bigger.sm_scale == 1.0);
    CHECK_THAT(bigger.how, !Contains("scaled"));
  }
}

TEST_CASE("device: the GPU architectures of a LibTorch build and the compute capabilities they run", "[device]") {
  // The CUDA 13.0 wheel's flags, as at::show_config() prints them.
  const std::string cu130 =
      "  - NVCC architecture flags: -gencode;arch=compute_75,code=sm_75;-gencode;arch=compute_80,code=sm_80;"
      "-gencode;arch=compute_86,code=sm_86;-gencode;arch=compute_90,code=sm_90;-gencode;arch=compute_100,"
      "code=sm_100;-gencode;arch=compute_120,code=sm_120";
  const std::vector<std::string> archs = parse_cuda_arch_flags(cu130);
  CHECK(archs == std::vector<std::string>{"sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"});
  CHECK(kernel_support(archs, 7, 0) == KernelSupport::none);    // V100: not in the cu130 wheel
  CHECK(kernel_support(archs, 7, 5) == KernelSupport::native);  // T4
  CHECK(kernel_support(archs, 8, 9) == KernelSupport::native);  // L4 runs sm_86 code
  CHECK(kernel_support(archs, 9, 0) == KernelSupport::native);
  CHECK(kernel_support(archs, 12, 1) == KernelSupport::native);
  CHECK(kernel_support(archs, 11, 0) == KernelSupport::none);  // no PTX to compile for it
  CHECK(kernel_support(archs, 6, 1) == KernelSupport::none);
  CHECK_THAT(kernel_warning(archs, 7, 0), Contains("no kernels for compute capability 7.0"));
  CHECK_THAT(kernel_warning(archs, 7, 0), Contains("includes sm_70"));
  CHECK(kernel_warning(archs, 9, 0).empty());
  CHECK(kernel_warning({}, 7, 0).empty());  // a CPU-only build: nothing to say

  // PTX, code=compute_XY, is compiled by the driver for any newer GPU; sm_90a runs on 9.0 only.
  const std::vector<std::string> ptx =
      parse_cuda_arch_flags("-gencode;arch=compute_80,code=[sm_80,compute_80];-gencode;arch=compute_90a,code=sm_90a");
  CHECK(ptx == std::vector<std::string>{"sm_80", "compute_80", "sm_90a"});
  CHECK(kernel_support(ptx, 8, 6) == KernelSupport::native);
  CHECK(kernel_support(ptx, 9, 0) == KernelSupport::native);
  CHECK(kernel_support(ptx, 10, 0) == KernelSupport::ptx);
  CHECK(kernel_support(ptx, 7, 5) == KernelSupport::none);
  CHECK_THAT(kernel_warning(ptx, 10, 0), Contains("only PTX"));
  CHECK(parse_cuda_arch_flags("sm_50 sm_60 sm_70 compute_70") ==
        std::vector<std::string>{"sm_50", "sm_60", "sm_70", "compute_70"});

  // This build's list, and named profiles that warn when it cannot run them.
  for (const std::string& arch : cuda_arch_list()) {
    CHECK((arch.rfind("sm_", 0) == 0 || arch.rfind("compute_", 0) == 0));
  }
  for (const char* key : {"v100-16gb", "t4", "h200"}) {
    CAPTURE(key);
    const DeviceProfile p = named_device(key);
    CHECK(p.warning == kernel_warning(cuda_arch_list(), p.cc_major, p.cc_minor));
    if (!p.warning.empty()) CHECK_THAT(p.summary(), Contains(p.warning));
  }
}

TEST_CASE("device: CPU memory is capped by the cgroup memory limit", "[device]") {
  const FakeFiles f;
  const std::string self = f / "self_cgroup";
  const int64_t gi = int64_t{1} << 30;

  // cgroup v2: a 4 GiB limit two levels up binds; the working set excludes inactive page cache.
  f.put("v2/cgroup.controllers", "cpu memory\n");
  f.put("v2/memory.max", "max\n");
  f.put("v2/a/memory.max", std::to_string(4 * gi) + "\n");
  f.put("v2/a/memory.current", std::to_string(3 * gi) + "\n");
  f.put("v2/a/memory.stat", "anon 1000\ninactive_file " + std::to_string(gi) + "\nactive_file 5\n");
  f.put("v2/a/b/memory.max", "max\n");
  f.put("v2/a/b/memory.current", std::to_string(gi) + "\n");
  f.put("self_cgroup", "0::/a/b\n");
  MemoryAmount limit = cgroup_memory_limit(f / "v2", self);
  CHECK(limit.total == 4 * gi);
  CHECK(limit.available == 2 * gi);  // 4 - (3 - 1)
  f.put("v2/a/b/memory.max", std::to_string(gi + gi / 2) + "\n");  // a tighter child
  limit = cgroup_memory_limit(f / "v2", self);
  CHECK(limit.total == gi + gi / 2);
  CHECK(limit.available == gi / 2);
  f.put("self_cgroup", "0::/\n");  // the root sets no limit
  CHECK(cgroup_memory_limit(f / "v2", self).total == 0);

  // cgroup v1: the memory controller's own line and mount; "no limit" is a number near 2^63.
  f.put("v1/memory/memory.limit_in_bytes", "9223372036854771712\n");
  f.put("v1/memory/x/memory.limit_in_bytes", std::to_string(2 * gi) + "\n");
  f.put("v1/memory/x/memory.usage_in_bytes", std::to_string(gi) + "\n");
  f.put("v1/memory/x/memory.stat", "cache 0\ntotal_inactive_file " + std::to_string(gi / 4) + "\n");
  f.put("self_cgroup", "4:cpu,cpuacct:/\n3:memory:/x\n");
  limit = cgroup_memory_limit(f / "v1", self);
  CHECK(limit.total == 2 * gi);
  CHECK(limit.available == gi + gi / 4);
  f.put("self_cgroup", "3:memory:/\n");
  CHECK(cgroup_memory_limit(f / "v1", self).total == 0);

  // The host's meminfo, capped by the cgroup.
  const std::string meminfo = f.put("meminfo", "MemTotal:       16777216 kB\nMemFree:  100 kB\n"
                                               "MemAvailable:   12582912 kB\n");
  f.put("self_cgroup", "3:memory:/x\n");
  MemoryAmount host = host_memory(meminfo, f / "v1", self);
  CHECK(host.total == 2 * gi);
  CHECK(host.available == gi + gi / 4);
  f.put("self_cgroup", "3:memory:/\n");
  host = host_memory(meminfo, f / "v1", self);
  CHECK(host.total == 16 * gi);
  CHECK(host.available == 12 * gi);
  // Nothing readable: the host's physical memory, all of it available.
  host = host_memory(f / "none", f / "none", f / "none");
  CHECK(host.total > 0);
  CHECK(host.available == host.total);
}

TEST_CASE("device: host memory says where its figures come from, and when MemAvailable is missing",
          "[device][doctor]") {
  const FakeFiles f;
  const std::string self = f / "self_cgroup";
  const int64_t gi = int64_t{1} << 30;
  const std::string meminfo = f.put("meminfo", "MemTotal:       16777216 kB\nMemAvailable:   12582912 kB\n");
  f.put("self_cgroup", "0::/\n");
  MemoryAmount host = host_memory(meminfo, f / "none", self);
  CHECK(host.available == 12 * gi);
  CHECK(host.source == "MemAvailable in " + meminfo);
  CHECK(host.warning.empty());

  // A kernel before 3.14 (or a container's substitute meminfo) has no MemAvailable: all of MemTotal
  // counts, which the plan's CPU budget takes 90% of, and that is said, not done silently.
  const std::string old_kernel = f.put("meminfo_old", "MemTotal:       16777216 kB\nMemFree:  100 kB\n");
  host = host_memory(old_kernel, f / "none", self);
  CHECK(host.available == 16 * gi);
  CHECK(host.source == "MemTotal in " + old_kernel);
  CHECK_THAT(host.warning, Contains("no usable MemAvailable in " + old_kernel) && Contains("tuning.micro_batch"));
  const DoctorCheck guessed = memory_check(host);
  CHECK(guessed.name == "memory");
  CHECK(guessed.status == "warn");
  CHECK(guessed.hint == host.warning);
  CHECK_THAT(guessed.detail, Contains("16.0 GiB available of 16.0 GiB (MemTotal in " + old_kernel + ")"));

  // A cgroup v2 limit below MemAvailable: the limit's file is the source.
  f.put("v2/cgroup.controllers", "memory\n");
  f.put("v2/a/memory.max", std::to_string(4 * gi) + "\n");
  f.put("v2/a/memory.current", std::to_string(gi) + "\n");
  f.put("self_cgroup", "0::/a\n");
  host = host_memory(old_kernel, f / "v2", self);
  CHECK(host.available == 3 * gi);
  CHECK(host.source == "cgroup v2 limit " + f / "v2/a/memory.max" + ", below MemTotal in " + old_kernel);
  CHECK(host.warning.empty());  // the cgroup's own account, not a guess
  const DoctorCheck limited = memory_check(host);
  CHECK(limited.status == "info");
  CHECK(limited.detail == "3.0 GiB available of 4.0 GiB (" + host.source +
                              "); a CPU run's memory budget is tuning.memory_fraction (0.9 by default) of the "
                              "available: 2.7 GiB");
  // cgroup v1 names its own file.
  f.put("v1/memory/x/memory.limit_in_bytes", std::to_string(2 * gi) + "\n");
  f.put("self_cgroup", "3:memory:/x\n");
  CHECK(host_memory(meminfo, f / "v1", self).source ==
        "cgroup v1 limit " + f / "v1/memory/x/memory.limit_in_bytes" + ", below MemAvailable in " + meminfo);
}

TEST_CASE("device: the CPU model from cpuinfo on x86 and aarch64", "[device]") {
  const FakeFiles f;
  CHECK(cpu_model_name(f.put("x86", "processor\t: 0\nvendor_id\t: GenuineIntel\n"
                                    "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: fpu avx2\n")) ==
        "Intel(R) Xeon(R) Platinum 8480+");
  // A bare "model name\t:" (nothing after the colon) neither throws nor names the CPU "".
  CHECK(cpu_model_name(f.put("bare", "processor\t: 0\nmodel name\t:\n")) == "unknown CPU");
  CHECK(cpu_model_name(f.put("bare2", "model name:")) == "unknown CPU");
  // aarch64 has no model name: the implementer and part name the core.
  const std::string grace = "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd sve2\n"
                            "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\n"
                            "CPU part\t: 0xd4f\nCPU revision\t: 0\n";
  CHECK(cpu_model_name(f.put("grace", grace)) == "ARM Neoverse-V2");
  CHECK(cpu_model_name(f.put("arm", "CPU implementer\t: 0x48\nCPU part\t: 0xd01\n")) ==
        "ARM CPU (implementer 0x48, part 0xd01)");
  CHECK(cpu_model_name(f / "missing") == "unknown CPU");
  CHECK_FALSE(cpu_model_name().empty());
}

TEST_CASE("doctor: NVIDIA hardware is read from the PCI bus and device nodes", "[device][doctor]") {
  const FakeFiles f;
  f.put("pci/0000:00:04.0/vendor", "0x10de\n");  // a data-center GPU: 3D controller
  f.put("pci/0000:00:04.0/class", "0x030200\n");
  f.put("pci/0000:00:04.1/vendor", "0x10de\n");  // its audio function
  f.put("pci/0000:00:04.1/class", "0x040300\n");
  f.put("pci/0000:00:05.0/vendor", "0x10de\n");  // a workstation GPU: VGA controller
  f.put("pci/0000:00:05.0/class", "0x030000\n");
  f.put("pci/0000:00:02.0/vendor", "0x8086\n");
  f.put("pci/0000:00:02.0/class", "0x030000\n");
  for (const char* node : {"nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"}) f.put(std::string("dev/") + node, "");
  f.put("version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04\n");
  NvidiaPresence hw = nvidia_presence(f / "pci", f / "version", f / "dev");
  CHECK(hw.pci_gpus == 2);
  CHECK(hw.kernel_module);
  CHECK(hw.device_nodes == 2);
  hw = nvidia_presence(f / "none", f / "none", f / "none");
  CHECK(hw.pci_gpus == 0);
  CHECK_FALSE(hw.kernel_module);
  CHECK(hw.device_nodes == 0);
}

TEST_CASE("doctor: a missing driver is told apart from a GPU this container was not given", "[device][doctor]") {
  NvidiaPresence gpu_here{1, true, 1};  // on the bus, module loaded, /dev/nvidia0 in this container
  DoctorCheck c = no_driver_check(gpu_here, false);
  CHECK(c.status == "fail");
  CHECK_THAT(c.detail, Contains("libcuda.so.1 is not found"));
  CHECK_THAT(c.hint, Contains("NVIDIA container runtime"));
  CHECK_THAT(c.hint, !Contains("dmesg"));  // the module did load
  CHECK(no_driver_check(gpu_here, true).status == "fail");
  c = no_driver_check({1, false, 1}, false);
  CHECK(c.status == "fail");
  CHECK_THAT(c.detail, Contains("kernel module is not loaded"));
  // A CPU-only container on a GPU host sees the host's module (and PCI bus) but no device nodes.
  c = no_driver_check({8, true, 0}, false);
  CHECK(c.status == "info");
  CHECK_THAT(c.hint, Contains("--gpus all"));
  // A GPU host without a driver shows only the PCI device.
  c = no_driver_check({1, false, 0}, false);
  CHECK(c.status == "warn");
  CHECK_THAT(c.detail, Contains("no NVIDIA driver installed"));
  c = no_driver_check({}, false);
  CHECK(c.status == "info");
  CHECK(c.hint.empty());

  CHECK(cpu_only_build_check({1, true, 1}, "1.13.0").status == "warn");
  CHECK(cpu_only_build_check({1, true, 0}, "1.13.0").status == "info");
  CHECK(cpu_only_build_check({}, "1.13.0").hint.empty());
}

TEST_CASE("doctor: CUDA_VISIBLE_DEVICES is blamed only when it hides every GPU of a working driver", "[device][doctor]") {
  const NvidiaPresence two{2, true, 2};
  // Slurm and Kubernetes set CUDA_VISIBLE_DEVICES=0: a broken driver is not the variable's fault.
  DoctorCheck c = gpus_check(0, DriverState::missing, two, "0");
  CHECK(c.status == "fail");
  CHECK(c.hint == "see cuda_driver above");
  CHECK_THAT(c.detail, Contains("CUDA_VISIBLE_DEVICES=0"));
  // With a working driver, an empty value, -1 and a missing index hide every GPU.
  for (const char* value : {"", " ", "-1", "2", "5,0", "none"}) {
    CAPTURE(value);
    c = gpus_check(0, DriverState::usable, two, value);
    CHECK(c.status == "fail");
    CHECK_THAT(c.hint, StartsWith("CUDA_VISIBLE_DEVICES=" + std::string(value) + " hides every GPU"));
  }
  // Valid indices and UUIDs are not blamed (UUIDs cannot be checked here: compare with nvidia-smi -L).
  for (const char* value : {"0", "1", "0,1"}) {
    CAPTURE(value);
    CHECK_THAT(gpus_check(0, DriverState::usable, two, value).hint, !Contains("hides every GPU"));
  }
  c = gpus_check(0, DriverState::usable, two, "GPU-8f2a1c3e-0000-0000-0000-000000000000");
  CHECK_THAT(c.hint, !Contains("hides every GPU"));
  CHECK_THAT(c.hint, Contains("nvidia-smi -L"));
  c = gpus_check(0, DriverState::usable, two, nullptr);
  CHECK(c.status == "fail");
  CHECK_THAT(c.hint, !Contains("CUDA_VISIBLE_DEVICES"));
  CHECK(gpus_check(2, DriverState::usable, two, "0,1").status == "ok");
  // No device nodes: nothing was meant to be usable here, whatever the variable says.
  CHECK(gpus_check(0, DriverState::missing, {}, "").status == "info");
  CHECK(gpus_check(0, DriverState::missing, {}, "").hint.empty());
  CHECK(gpus_check(0, DriverState::missing, {4, true, 0}, nullptr).status == "info");
}

TEST_CASE("doctor: a driver too old for the runtime is the cause, not missing GPUs or Xid errors", "[device][doctor]") {
  const NvidiaPresence two{2, true, 2};
  const DoctorCheck driver = cuda_driver_check(12080, 13000, "570.86.15");
  REQUIRE(driver.status == "fail");
  for (const char* value : {static_cast<const char*>(nullptr), "0", "-1"}) {
    CAPTURE(value ? value : "(unset)");
    const DoctorCheck c = gpus_check(0, DriverState::unusable, two, value);
    CHECK(c.status == "fail");
    CHECK(c.hint == "see cuda_driver above");
  }
}

TEST_CASE("doctor: the driver's own version, from /proc/driver/nvidia/version", "[device][doctor]") {
  CHECK(nvidia_driver_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC "
                              "2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n") == "535.104.05");
  CHECK(nvidia_driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
                              "(dvs-builder@U16-I3-B03-4-3)  Thu Sep 25 20:16:33 UTC 2025\n") == "580.95.05");
  CHECK(nvidia_driver_version("NVRM version: NVIDIA UNIX aarch64 Kernel Module  550.54.15  Tue Mar  5 22:15:33 UTC "
                              "2024") == "550.54.15");
  CHECK(nvidia_driver_version("").empty());
  CHECK(nvidia_driver_version("GCC version:  gcc version 12.2.0\n").empty());  // not on the first line
  CHECK(cuda_driver_check(13000, 13000, "580.95.05").detail == "580.95.05, supports CUDA 13.0");
  CHECK(cuda_driver_check(13000, 13000).detail == "supports CUDA 13.0");
}

TEST_CASE("doctor: the kernels line and version formats", "[device][doctor]") {
  const std::vector<std::string> cu130{"sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"};
  CHECK(kernels_check("gpu0_kernels", 9, 0, cu130).status == "ok");
  const DoctorCheck v100 = kernels_check("gpu0_kernels", 7, 0, cu130);
  CHECK(v100.status == "fail");
  CHECK_THAT(v100.detail, Contains("no kernels for compute capability 7.0"));
  CHECK_THAT(v100.hint, Contains("sm_70"));
  CHECK(kernels_check("gpu0_kernels", 10, 0, {"sm_80", "compute_90"}).status == "warn");
  CHECK(kernels_check("gpu0_kernels", 9, 0, {}).status == "info");

  CHECK(cudnn_version_string(91900) == "9.19.0");
  CHECK(cudnn_version_string(90100) == "9.1.0");
  CHECK(cudnn_version_string(8906) == "8.9.6");
  CHECK(cudnn_version_string(7605) == "7.6.5");

  // Debian's reference BLAS, not just any libblas.so.3 that is not OpenBLAS (BLIS, ATLAS).
  CHECK(is_reference_blas("generic (/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0)"));
  CHECK_FALSE(is_reference_blas("generic (/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3)"));
  CHECK_FALSE(is_reference_blas("generic (/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3)"));
  CHECK_FALSE(is_reference_blas("generic (/usr/lib/x86_64-linux-gnu/atlas/libblas.so.3.10.3)"));
  CHECK_FALSE(is_reference_blas("mkl"));
}

TEST_CASE("doctor: the JSON report parses also with invalid UTF-8 in CUDA_VISIBLE_DEVICES", "[device][doctor]") {
  // This machine's report: every check ran, and the smoke tests pass here.
  const std::vector<DoctorCheck> checks = run_doctor();
  std::set<std::string> names;
  for (const DoctorCheck& c : checks) names.insert(c.name);
  for (const char* name : {"libtorch", "cpu", "blas", "memory", "smoke_tensor", "smoke_matmul", "smoke_conv"}) {
    CAPTURE(name);
    CHECK(names.count(name) == 1);
  }
  CHECK(names.count("gpus") + names.count("cuda") == 1);  // a CUDA build's GPU line, or a CPU build's
  for (const DoctorCheck& c : checks) {
    CAPTURE(c.name, c.detail);
    CHECK((c.status == "ok" || c.status == "warn" || c.status == "fail" || c.status == "info"));
    if (c.name.rfind("smoke_", 0) == 0) CHECK(c.status == "ok");
  }
  CHECK(python_accepts_json(doctor_json(checks), "any(c['name'] == 'smoke_conv' and c['status'] == 'ok' for c in d)"));
  // Host memory, which a CPU plan's memory budget comes from, with its source, in the text and the JSON.
  CHECK_THAT(doctor_text(checks), Contains(" available of ") && Contains("/proc/meminfo"));
  CHECK(python_accepts_json(doctor_json(checks), "any(c['name'] == 'memory' and '/proc/meminfo' in c['detail'] "
                                                 "and 'tuning.memory_fraction' in c['detail'] for c in d)"));

  // The variable's bytes are shown as \xNN; any other invalid UTF-8 becomes U+FFFD.
  const DoctorCheck gpus = gpus_check(0, DriverState::usable, {1, true, 1}, "\xff\xfe\"0\n");
  CHECK_THAT(gpus.detail, Contains("CUDA_VISIBLE_DEVICES=\\xff\\xfe\"0\\x0a"));
  const std::vector<DoctorCheck> odd{gpus, {"cpu", "info", "caf\xc3\xa9 \xc3\x28 \xed\xa0\x80 \xf0\x9f\x98", ""}};
  const std::string json = doctor_json(odd);
  CHECK(python_accepts_json(json, "d[0]['detail'] == '0 visible (CUDA_VISIBLE_DEVICES=\\\\xff\\\\xfe\"0\\\\x0a)'"));
  CHECK(python_accepts_json(json, "d[1]['detail'] == 'caf\\u00e9 \\ufffd( \\ufffd\\ufffd\\ufffd \\ufffd\\ufffd\\ufffd'"));
}
