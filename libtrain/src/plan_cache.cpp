#include "train/plan_cache.h"

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <locale>
#include <map>
#include <sstream>
#include <stdexcept>

#include "atomic_file.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"

namespace train {
namespace {

// 2: memory probes measure forward-and-backward and the optimizer step apart (format 1 entries
// could hold a per-sample cost taken from optimizer-step peaks, near 0 for transformers).
// 3: the slope comes from two batches whose peaks follow the activations (format 2 entries could
// take it from a batch still on the flat part: about 10% short for BERT-tiny).
// 4: the key leaves out the batch settings (tuning.batch, the per-rank batch): an entry holds the
// memory fit, how far its slope is known, and every micro-batch size timed so far, and a plan that
// needs more sizes times only those.
// 5: token tasks are probed with exactly the mean share of positions with a target (format 4
// entries drew the count at random: their slopes could be off by 10% and more for MLM).
constexpr int kCacheFormat = 5;

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

// Read back by YAML: written as JSON has it (0.5), whatever the global C++ locale.
std::string number(double v) {
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out.precision(std::numeric_limits<double>::max_digits10);
  out << v;
  return out.str();
}

// A number of an entry, read as JSON writes it. Not yaml-cpp's as<double>(): that reads through a
// stream in the global C++ locale, in which "0.5" may not be a number (a host program's German
// locale makes '.' the thousands separator), and every entry would be a miss.
template <typename T>
T number_of(const YAML::Node& node, const char* name) {
  if (!node || !node.IsScalar()) throw std::runtime_error(std::string(name) + " is missing or not a number");
  const std::string& text = node.Scalar();
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) {
    throw std::runtime_error(std::string(name) + " is not a number: " + text);
  }
  return value;
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
    m.fixed_bytes = number_of<int64_t>(e["fixed_bytes"], "fixed_bytes");
    m.per_sample_bytes = number_of<double>(e["per_sample_bytes"], "per_sample_bytes");
    m.budget_bytes = number_of<int64_t>(e["budget_bytes"], "budget_bytes");
    m.max_micro_batch = number_of<int64_t>(e["max_micro_batch"], "max_micro_batch");
    m.estimate = e["estimate"].as<bool>();
    m.source = e["source"].as<std::string>();  // as stored: the caller says it came from the cache
    for (const auto& p : e["throughput"]) {
      m.throughput.emplace_back(number_of<int64_t>(p[0], "throughput"), number_of<double>(p[1], "throughput"));
    }
    m.throughput_choice = number_of<int64_t>(e["throughput_choice"], "throughput_choice");
    m.slope_known_up_to = number_of<int64_t>(e["slope_known_up_to"], "slope_known_up_to");
    bool sane = std::isfinite(m.per_sample_bytes) && m.max_micro_batch >= 0 && m.throughput_choice >= 0 &&
                m.slope_known_up_to >= 0;
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
                           ",\"throughput_choice\":" + std::to_string(m.throughput_choice) +
                           ",\"slope_known_up_to\":" + std::to_string(m.slope_known_up_to) + "}}\n";
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
