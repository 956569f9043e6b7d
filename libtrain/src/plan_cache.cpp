#include "train/plan_cache.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>

#include "atomic_file.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"

namespace train {
namespace {

constexpr int kCacheFormat = 1;

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string default_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return files::join(xdg, "train/plans");
  if (const char* home = std::getenv("HOME"); home && *home) return files::join(home, ".cache/train/plans");
  return "/tmp/train-plans";
}

std::string key_json(const PlanCacheKey& key) {
  std::string out = "{";
  for (size_t i = 0; i < key.fields.size(); ++i) {
    out += (i ? "," : "") + json_quote(key.fields[i].first) + ":" + json_quote(key.fields[i].second);
  }
  return out + "}";
}

std::string number(double v) {
  std::ostringstream out;
  out.precision(std::numeric_limits<double>::max_digits10);
  out << v;
  return out.str();
}

std::map<std::string, std::string> read_key(const YAML::Node& node) {
  std::map<std::string, std::string> out;
  if (node && node.IsMap()) {
    for (const auto& kv : node) out[kv.first.as<std::string>()] = kv.second.as<std::string>();
  }
  return out;
}

// A damaged cache entry is a miss, never an error: an entry that cannot be read or parsed, or
// whose fields have the wrong types, is ignored with a warning naming it (the next store
// overwrites it).
void warn_damaged(const std::string& path, const std::string& why) {
  log::warn("plan cache: ignoring " + path + " (" + why + "); it is treated as a miss and rewritten");
}

// The entry at `path`; none when there is none (a plain miss) or it is unreadable (with a warning).
std::optional<YAML::Node> load(const std::string& path) {
  if (!files::exists(path)) return std::nullopt;
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    warn_damaged(path, problem);
    return std::nullopt;
  }
  try {
    return YAML::LoadFile(path);
  } catch (const std::exception& e) {
    warn_damaged(path, e.what());
    return std::nullopt;
  }
}

}  // namespace

std::string PlanCacheKey::hash() const { return hex(fnv1a(key_json(*this))); }

PlanCache::PlanCache(const std::string& dir) : dir_(dir.empty() ? default_dir() : dir) {}

std::optional<MemoryEvidence> PlanCache::find(const PlanCacheKey& key) const {
  const std::string path = files::join(dir_, key.hash() + ".json");
  const std::optional<YAML::Node> entry = load(path);
  if (!entry) return std::nullopt;
  const YAML::Node& doc = *entry;
  try {
    if (!doc.IsMap() || !doc["format"]) {
      warn_damaged(path, "not a plan cache entry");
      return std::nullopt;
    }
    if (doc["format"].as<int>(0) != kCacheFormat) return std::nullopt;  // another version's entry
    // Guard against hash collisions: the stored key must be the same key.
    std::map<std::string, std::string> expected(key.fields.begin(), key.fields.end());
    if (read_key(doc["key"]) != expected) return std::nullopt;
    MemoryEvidence m;
    const YAML::Node e = doc["evidence"];
    m.fixed_bytes = e["fixed_bytes"].as<int64_t>();
    m.per_sample_bytes = e["per_sample_bytes"].as<double>();
    m.budget_bytes = e["budget_bytes"].as<int64_t>();
    m.max_micro_batch = e["max_micro_batch"].as<int64_t>();
    m.estimate = e["estimate"].as<bool>();
    m.source = "plan cache " + key.hash() + ", from " + e["source"].as<std::string>();
    for (const auto& p : e["throughput"]) m.throughput.emplace_back(p[0].as<int64_t>(), p[1].as<double>());
    m.throughput_choice = e["throughput_choice"].as<int64_t>();
    bool sane = std::isfinite(m.per_sample_bytes) && m.max_micro_batch >= 0 && m.throughput_choice >= 0;
    for (const auto& [batch, rate] : m.throughput) sane = sane && batch > 0 && std::isfinite(rate) && rate >= 0;
    if (!sane) throw std::runtime_error("a negative micro-batch or a non-finite number in its evidence");
    return m;
  } catch (const std::exception& e) {
    warn_damaged(path, e.what());
    return std::nullopt;
  }
}

void PlanCache::store(const PlanCacheKey& key, const MemoryEvidence& m, const std::string& scope) {
  std::string throughput = "[";
  for (size_t i = 0; i < m.throughput.size(); ++i) {
    throughput += (i ? "," : "") + std::string("[") + std::to_string(m.throughput[i].first) + "," +
                  number(m.throughput[i].second) + "]";
  }
  throughput += "]";
  const std::string json = "{\"format\":" + std::to_string(kCacheFormat) + ",\"key\":" + key_json(key) +
                           ",\"evidence\":{\"fixed_bytes\":" + std::to_string(m.fixed_bytes) +
                           ",\"per_sample_bytes\":" + number(m.per_sample_bytes) +
                           ",\"budget_bytes\":" + std::to_string(m.budget_bytes) +
                           ",\"max_micro_batch\":" + std::to_string(m.max_micro_batch) +
                           ",\"estimate\":" + (m.estimate ? "true" : "false") + ",\"source\":" + json_quote(m.source) +
                           ",\"throughput\":" + throughput +
                           ",\"throughput_choice\":" + std::to_string(m.throughput_choice) + "}}\n";
  detail::write_text_atomically(files::join(dir_, key.hash() + ".json"), json);
  detail::write_text_atomically(files::join(dir_, "latest-" + hex(fnv1a(scope)) + ".json"), key_json(key) + "\n");
}

std::vector<std::string> PlanCache::changes(const PlanCacheKey& key, const std::string& scope) const {
  std::vector<std::string> out;
  const std::string path = files::join(dir_, "latest-" + hex(fnv1a(scope)) + ".json");
  const std::optional<YAML::Node> entry = load(path);
  if (!entry) return out;
  const YAML::Node& doc = *entry;
  std::map<std::string, std::string> before;
  try {
    if (!doc.IsMap()) throw std::runtime_error("not a map of key fields");
    before = read_key(doc);
  } catch (const std::exception& e) {
    warn_damaged(path, e.what());
    return out;
  }
  for (const auto& [name, value] : key.fields) {
    const auto it = before.find(name);
    const std::string old = it == before.end() ? "(none)" : it->second;
    if (old != value) out.push_back(name + ": " + old + " -> " + value);
  }
  return out;
}

}  // namespace train
