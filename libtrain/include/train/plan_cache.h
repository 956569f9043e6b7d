#pragma once
// The plan cache: memory and throughput measurements keyed by everything that changes them, so
// that a second run on the same machine plans without probing.
//
// Key: device (spec, name, memory, compute capability), LibTorch/CUDA/cuDNN versions, model
// signature (parameter count and shapes, settings they do not show, model.options), input shape,
// world size, precision and layout, optimizer, memory fraction. Not the batch settings: another global batch or tuning.batch mode
// reuses the measurement and times only the micro-batch sizes not timed yet. One JSON file per
// key in the cache directory.
#include <train/plan.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace train {

struct PlanCacheKey {
  std::vector<std::pair<std::string, std::string>> fields;  // ordered (name, value)
  void add(const std::string& name, const std::string& value) { fields.emplace_back(name, value); }
  std::string hash() const;  // 16 hex digits
};

class PlanCache {
 public:
  // "" = $XDG_CACHE_HOME/train/plans, else $HOME/.cache/train/plans.
  explicit PlanCache(const std::string& dir = "");
  const std::string& dir() const { return dir_; }

  // The evidence stored under `key`, its source as stored; none on a miss or a damaged entry.
  std::optional<MemoryEvidence> find(const PlanCacheKey& key) const;
  // Writes the entry atomically and remembers the key as the latest for `scope` (for example
  // the config file), so that the next miss under the same scope can say what changed.
  void store(const PlanCacheKey& key, const MemoryEvidence& evidence, const std::string& scope);
  // "device: NVIDIA A100-SXM4-80GB -> NVIDIA H100 80GB HBM3", ... against the key last stored
  // under `scope`; empty when there is none or nothing differs.
  std::vector<std::string> changes(const PlanCacheKey& key, const std::string& scope) const;

 private:
  std::string dir_;
};

}  // namespace train
