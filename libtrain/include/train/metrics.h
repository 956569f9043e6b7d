#pragma once
// Metric records, the JSONL sink (metrics.jsonl) and console progress formatting.
// Free of LibTorch: records hold plain numbers and strings.
#include <cstdint>
#include <fstream>
#include <string>
#include <variant>
#include <vector>

namespace train {

class MetricRecord {
 public:
  using Value = std::variant<bool, int64_t, double, std::string>;
  MetricRecord& add(const std::string& key, int64_t value);
  MetricRecord& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  MetricRecord& add(const std::string& key, double value);
  MetricRecord& add(const std::string& key, bool value);
  MetricRecord& add(const std::string& key, const std::string& value);
  MetricRecord& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  const std::vector<std::pair<std::string, Value>>& fields() const { return fields_; }
  // One JSON object on one line. Non-finite doubles become null.
  std::string to_json() const;

 private:
  std::vector<std::pair<std::string, Value>> fields_;
};

// Appends one JSON object per line and flushes each line, so that a killed run leaves a
// readable file (at most the last line is incomplete).
class JsonlWriter {
 public:
  JsonlWriter() = default;
  explicit JsonlWriter(const std::string& path);
  bool is_open() const { return out_.is_open(); }
  void write(const MetricRecord& record);

 private:
  std::ofstream out_;
  std::string path_;
};

// Streaming mean of a window of values (loss, step time).
class Meter {
 public:
  void add(double value, int64_t weight = 1) { sum_ += value * static_cast<double>(weight); count_ += weight; }
  double mean() const { return count_ > 0 ? sum_ / static_cast<double>(count_) : 0.0; }
  int64_t count() const { return count_; }
  void reset() { sum_ = 0; count_ = 0; }

 private:
  double sum_ = 0;
  int64_t count_ = 0;
};

// "1h02m", "3m12s", "8.1s"
std::string format_duration(double seconds);
// JSON string escaping (quotes included).
std::string json_quote(const std::string& s);

}  // namespace train
