#include "train/metrics.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "train/errors.h"

namespace train {

MetricRecord& MetricRecord::add(const std::string& key, int64_t value) {
  fields_.emplace_back(key, value);
  return *this;
}
MetricRecord& MetricRecord::add(const std::string& key, double value) {
  fields_.emplace_back(key, value);
  return *this;
}
MetricRecord& MetricRecord::add(const std::string& key, bool value) {
  fields_.emplace_back(key, value);
  return *this;
}
MetricRecord& MetricRecord::add(const std::string& key, const std::string& value) {
  fields_.emplace_back(key, value);
  return *this;
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string MetricRecord::to_json() const {
  std::ostringstream out;
  out.precision(std::numeric_limits<double>::max_digits10 - 2);  // 15 significant digits
  out << '{';
  bool first = true;
  for (const auto& [key, value] : fields_) {
    if (!first) out << ',';
    first = false;
    out << json_quote(key) << ':';
    if (const auto* b = std::get_if<bool>(&value)) {
      out << (*b ? "true" : "false");
    } else if (const auto* i = std::get_if<int64_t>(&value)) {
      out << *i;
    } else if (const auto* d = std::get_if<double>(&value)) {
      if (std::isfinite(*d)) out << *d; else out << "null";
    } else {
      out << json_quote(std::get<std::string>(value));
    }
  }
  out << '}';
  return out.str();
}

JsonlWriter::JsonlWriter(const std::string& path) : out_(path, std::ios::app), path_(path) {
  if (!out_) throw Error("cannot open metrics file " + path + " for writing");
}

void JsonlWriter::write(const MetricRecord& record) {
  if (!out_.is_open()) return;
  out_ << record.to_json() << '\n';
  out_.flush();
  if (!out_) throw Error("failed writing metrics file " + path_);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  char buf[32];
  if (seconds < 60) {
    std::snprintf(buf, sizeof(buf), "%.1fs", seconds);
  } else if (seconds < 3600) {
    const int s = static_cast<int>(seconds + 0.5);
    std::snprintf(buf, sizeof(buf), "%dm%02ds", s / 60, s % 60);
  } else {
    const int m = static_cast<int>(seconds / 60 + 0.5);
    std::snprintf(buf, sizeof(buf), "%dh%02dm", m / 60, m % 60);
  }
  return buf;
}

}  // namespace train
