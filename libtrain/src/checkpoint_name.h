#pragma once
// The file name of a periodic checkpoint, "step_<digits>.pt", read back. Internal header: the
// checkpoint store (checkpoint.cpp) lists and prunes by it, and the run-directory snapshot
// (run_dir.cpp) recognises the checkpoints a run wrote by it.
#include <cstdint>
#include <string>

namespace train::detail {

// The step of a checkpoint file name "step_<digits>.pt" (no directory), or -1 for any other name.
inline int64_t checkpoint_step(const std::string& name) {
  const std::string prefix = "step_", suffix = ".pt";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

// The name under which a checkpoint file, or its checksum sidecar, is set aside into abandoned/
// the n-th time its name is taken there: n = 0 keeps `name`, n > 0 puts ".<n>" after the stem
// ("step_00000040.pt" -> "step_00000040.1.pt", "step_00000040.pt.crc32c" ->
// "step_00000040.1.pt.crc32c"), so that a sidecar keeps pairing with its checkpoint.
inline std::string kept_checkpoint_name(const std::string& name, int n) {
  const size_t dot = name.find('.');
  if (n == 0 || dot == std::string::npos) return name;
  return name.substr(0, dot) + "." + std::to_string(n) + name.substr(dot);
}

}  // namespace train::detail
