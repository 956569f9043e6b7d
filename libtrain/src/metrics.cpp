#include "train/metrics.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <cstring>
#include <limits>
#include <locale>
#include <optional>
#include <sstream>
#include <string_view>

#include "atomic_file.h"
#include "train/config.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"
#include "utf8.h"

namespace train {

MetricRecord& MetricRecord::add(const std::string& key, int64_t value) {
  fields_.emplace_back(key, value);
  return *this;
}
MetricRecord& MetricRecord::add(const std::string& key, uint64_t value) {
  if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return add(key, static_cast<double>(value));  // past int64's range: JSON numbers are doubles anyway
  }
  return add(key, static_cast<int64_t>(value));
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

std::string json_quote(const std::string& text) {
  // JSON is UTF-8: a byte that is not part of valid UTF-8 (a path in another encoding) becomes U+FFFD.
  const std::string s = detail::repair_utf8(text, [](unsigned char) { return std::string("\xef\xbf\xbd"); });
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

const MetricRecord::Value* MetricRecord::find(const std::string& key) const {
  for (auto it = fields_.rbegin(); it != fields_.rend(); ++it) {
    if (it->first == key) return &it->second;
  }
  return nullptr;
}

std::optional<double> MetricRecord::number(const std::string& key) const {
  const Value* value = find(key);
  if (value == nullptr) return std::nullopt;
  if (const auto* b = std::get_if<bool>(value)) return *b ? 1.0 : 0.0;
  if (const auto* i = std::get_if<int64_t>(value)) return static_cast<double>(*i);
  if (const auto* d = std::get_if<double>(value)) return *d;
  return std::nullopt;
}

std::string MetricRecord::to_json() const {
  std::ostringstream out;
  // A stream takes the global locale: a host program's German one would write 2,5 and 12.345.
  out.imbue(std::locale::classic());
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

namespace {

// The reason a write to a stream failed, from the errno its last system call left (cleared before
// the write, so 0 means the failure was not the system's).
std::string write_failure(int error) {
  if (error == 0) return "write error";
  return std::string(std::strerror(error)) + (error == ENOSPC || error == EDQUOT ? "; free space there" : "");
}

}  // namespace

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) {
  files::make_directories(files::parent(path));  // a Trainer given a new run directory creates it
  out_.open(path, std::ios::app);
  if (!out_) throw Error("cannot open metrics file " + path + " for writing (" + std::strerror(errno) + ")");
}

void JsonlWriter::write(const MetricRecord& record) {
  if (!out_.is_open()) return;
  const std::string line = record.to_json() + '\n';
  errno = 0;
  out_.write(line.data(), static_cast<std::streamsize>(line.size()));
  out_.flush();
  if (!out_) throw Error("failed writing metrics file " + path_ + " (" + write_failure(errno) + ")");
}

void JsonlWriter::truncate_after(int64_t step, bool drop_val_at_step) {
  if (!out_.is_open()) return;
  out_.close();
  truncate_file_after(path_, step, drop_val_at_step);
  out_.open(path_, std::ios::app);
  if (!out_) throw Error("cannot open metrics file " + path_ + " for writing (" + std::strerror(errno) + ")");
}

void JsonlWriter::truncate_file_after(const std::string& path, int64_t step, bool drop_val_at_step) {
  if (!files::is_regular_file(path)) return;
  std::string kept;
  {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line.back() != '}') continue;  // cut short by a kill
      // Records begin with their step ("step" is the first key the trainer writes).
      static const std::string kKey = "\"step\":";
      const size_t at = line.find(kKey);
      const int64_t row_step = at == std::string::npos ? 0 : std::strtoll(line.c_str() + at + kKey.size(), nullptr, 10);
      if (at != std::string::npos && row_step > step) continue;
      if (drop_val_at_step && at != std::string::npos && row_step == step &&
          line.find("\"split\":\"val\"") != std::string::npos) {
        continue;
      }
      kept += line;
      kept += '\n';
    }
  }
  detail::write_text_atomically(path, kept);
}

// ---- TensorBoard ------------------------------------------------------------------------------

namespace {

// Reflected CRC-32C polynomial (Castagnoli).
constexpr uint32_t kCrc32cPoly = 0x82f63b78u;

const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protocol buffer wire format: the few pieces an Event needs.
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void put_key(std::string& out, uint32_t field, WireType wire) { put_varint(out, (field << 3) | wire); }

void put_little_endian(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  put_key(out, field, kFixed64);
  put_little_endian(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  put_key(out, field, kFixed32);
  put_little_endian(out, bits, 4);
}

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// Field numbers of tensorboard/compat/proto/event.proto and summary.proto.
namespace event_field {
constexpr uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7;
}
namespace session_log_field {
constexpr uint32_t kStatus = 1;
constexpr uint64_t kStart = 1;  // SessionLog.SessionStatus.START
}
namespace summary_field {
constexpr uint32_t kValue = 1;
}
namespace value_field {
constexpr uint32_t kTag = 1, kSimpleValue = 2;
}

double unix_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

uint64_t get_little_endian(std::string_view bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + static_cast<size_t>(i)]);
  return v;
}

bool get_varint(std::string_view bytes, size_t& at, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && at < bytes.size(); shift += 7) {
    const auto byte = static_cast<unsigned char>(bytes[at++]);
    v |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// The length-delimited field `field` of a protocol buffer message: its first occurrence, or none
// (also when the bytes are not a message).
std::optional<std::string_view> length_delimited_field(std::string_view message, uint32_t field) {
  size_t at = 0;
  while (at < message.size()) {
    uint64_t key = 0, v = 0;
    if (!get_varint(message, at, key)) return std::nullopt;
    switch (key & 7) {
      case kVarint:
        if (!get_varint(message, at, v)) return std::nullopt;
        break;
      case kFixed64:
      case kFixed32: {
        const size_t n = (key & 7) == kFixed64 ? 8 : 4;
        if (message.size() - at < n) return std::nullopt;
        at += n;
        break;
      }
      case kLengthDelimited:
        if (!get_varint(message, at, v) || v > message.size() - at) return std::nullopt;
        if ((key >> 3) == field) return message.substr(at, static_cast<size_t>(v));
        at += static_cast<size_t>(v);
        break;
      default:
        return std::nullopt;
    }
  }
  return std::nullopt;
}

// Whether an Event holds a Summary whose first value's tag starts with `prefix` ("val/": a
// validation record, whose scalars travel in one event).
bool event_tag_starts_with(std::string_view event, std::string_view prefix) {
  const auto summary = length_delimited_field(event, event_field::kSummary);
  const auto value = summary ? length_delimited_field(*summary, summary_field::kValue) : std::nullopt;
  const auto tag = value ? length_delimited_field(*value, value_field::kTag) : std::nullopt;
  return tag && tag->substr(0, prefix.size()) == prefix;
}

// An Event's step (field 2; 0 when absent, as in the file_version record), or none when the bytes
// are not a protocol buffer message.
std::optional<int64_t> event_step(std::string_view event) {
  int64_t step = 0;
  size_t at = 0;
  while (at < event.size()) {
    uint64_t key = 0, v = 0;
    if (!get_varint(event, at, key) || (key >> 3) == 0) return std::nullopt;
    const size_t left = event.size() - at;
    switch (key & 7) {
      case kVarint:
        if (!get_varint(event, at, v)) return std::nullopt;
        if ((key >> 3) == event_field::kStep) step = static_cast<int64_t>(v);  // two's complement
        break;
      case kFixed64:
        if (left < 8) return std::nullopt;
        at += 8;
        break;
      case kFixed32:
        if (left < 4) return std::nullopt;
        at += 4;
        break;
      case kLengthDelimited:
        if (!get_varint(event, at, v) || v > event.size() - at) return std::nullopt;
        at += static_cast<size_t>(v);
        break;
      default:
        return std::nullopt;  // groups: no Event field is one
    }
  }
  return step;
}

// What truncate_after keeps of one event file's bytes.
struct KeptEvents {
  std::string bytes;    // the records with a step at most the resume step, in order, framing and all
  bool changed = false;  // records were dropped, or a last record that a kill cut short
  std::string problem;  // why the file cannot be read as TFRecord-framed Events; "" when it can
};

// drop_val_at_step: the validation records at `step` go too.
KeptEvents events_up_to(std::string_view bytes, int64_t step, bool drop_val_at_step) {
  KeptEvents kept;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t left = bytes.size() - at;
    if (left < 12) {  // a length and its CRC that a kill cut short
      kept.changed = true;
      break;
    }
    const uint64_t n = get_little_endian(bytes, at, 8);
    if (get_little_endian(bytes, at + 8, 4) != masked_crc32c(bytes.data() + at, 8)) {
      kept.problem = "the length of the record at byte " + std::to_string(at) + " fails its CRC";
      return kept;
    }
    if (n > left - 12 || left - 12 - n < 4) {  // a record that a kill cut short
      kept.changed = true;
      break;
    }
    const std::string_view event = bytes.substr(at + 12, n);
    if (get_little_endian(bytes, at + 12 + n, 4) != masked_crc32c(event.data(), event.size())) {
      kept.problem = "the record at byte " + std::to_string(at) + " fails its CRC";
      return kept;
    }
    const std::optional<int64_t> event_at = event_step(event);
    if (!event_at) {
      kept.problem = "the record at byte " + std::to_string(at) + " is not an Event";
      return kept;
    }
    const size_t end = at + 12 + n + 4;
    const bool dropped_val = drop_val_at_step && *event_at == step && event_tag_starts_with(event, "val/");
    if (*event_at <= step && !dropped_val) {
      kept.bytes.append(bytes.substr(at, end - at));
    } else {
      kept.changed = true;
    }
    at = end;
  }
  return kept;
}

// "events.out.tfevents.*", but not what a write_atomically of one left ("<name>.tmp.<pid>").
bool is_event_file_name(const std::string& name) {
  if (name.rfind("events.out.tfevents.", 0) != 0) return false;
  const size_t tmp = name.rfind(".tmp.");
  return tmp == std::string::npos || name.find_first_not_of("0123456789", tmp + 5) != std::string::npos;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto& table = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) : dir_(dir) {
  static std::atomic<int> counter{0};
  files::make_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  host[sizeof(host) - 1] = '\0';
  char name[512];
  std::snprintf(name, sizeof(name), "events.out.tfevents.%010lld.%s.%d.%06d",
                static_cast<long long>(unix_time_now()), host, static_cast<int>(::getpid()), counter++);
  path_ = files::join(dir, name);
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw Error("cannot open TensorBoard event file " + path_ + " for writing (" + std::strerror(errno) + ")");
  std::string event;
  put_double(event, event_field::kWallTime, unix_time_now());
  put_bytes(event, event_field::kFileVersion, "brain.Event:2");
  write_event(event);
}

void TensorBoardWriter::write_event(const std::string& event) {
  std::string header;
  put_little_endian(header, event.size(), 8);
  std::string record = header;
  put_little_endian(record, masked_crc32c(header.data(), header.size()), 4);
  record += event;
  put_little_endian(record, masked_crc32c(event.data(), event.size()), 4);
  errno = 0;
  out_.write(record.data(), static_cast<std::streamsize>(record.size()));
  out_.flush();
  if (!out_) throw Error("failed writing TensorBoard event file " + path_ + " (" + write_failure(errno) + ")");
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values,
                                    double wall_time) {
  if (!out_.is_open() || values.empty()) return;
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string v;
    put_bytes(v, value_field::kTag, tag);
    put_float(v, value_field::kSimpleValue, static_cast<float>(value));
    put_bytes(summary, summary_field::kValue, v);
  }
  std::string event;
  put_double(event, event_field::kWallTime, wall_time);
  put_key(event, event_field::kStep, kVarint);
  put_varint(event, static_cast<uint64_t>(step));  // int64: two's complement, as protobuf encodes it
  put_bytes(event, event_field::kSummary, summary);
  write_event(event);
}

void TensorBoardWriter::truncate_after(int64_t step, bool drop_val_at_step) {
  if (!out_.is_open()) return;
  out_.close();  // this file is rewritten too: a rollback restarts after a step it has logged
  truncate_files_after(dir_, step, drop_val_at_step);
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_) throw Error("cannot open TensorBoard event file " + path_ + " for writing (" + std::strerror(errno) + ")");
  std::string session_log;
  put_key(session_log, session_log_field::kStatus, kVarint);
  put_varint(session_log, session_log_field::kStart);
  std::string event;
  put_double(event, event_field::kWallTime, unix_time_now());
  put_key(event, event_field::kStep, kVarint);
  put_varint(event, static_cast<uint64_t>(step + 1));
  put_bytes(event, event_field::kSessionLog, session_log);
  write_event(event);
}

void TensorBoardWriter::truncate_files_after(const std::string& dir, int64_t step, bool drop_val_at_step) {
  if (!files::is_directory(dir)) return;
  for (const std::string& name : files::list_directory(dir)) {
    const std::string path = files::join(dir, name);
    if (!is_event_file_name(name) || !files::is_regular_file(path)) continue;
    std::ifstream in(path, std::ios::binary);
    std::ostringstream bytes;
    if (in) bytes << in.rdbuf();
    if (!in || in.bad()) throw Error("cannot read TensorBoard event file " + path + " (" + std::strerror(errno) + ")");
    const KeptEvents kept = events_up_to(bytes.str(), step, drop_val_at_step);
    if (!kept.problem.empty()) {
      log::warn(log::str("TensorBoard event file ", path, ": ", kept.problem, "; left as it is, so TensorBoard may "
                         "show the steps after ", step, " that an earlier attempt logged there"));
      continue;
    }
    if (kept.changed) detail::write_text_atomically(path, kept.bytes);
  }
}

void TensorBoardWriter::write(const MetricRecord& record) {
  if (!out_.is_open()) return;
  int64_t step = 0;
  std::string split;
  for (const auto& [key, value] : record.fields()) {
    if (key == "step" && std::holds_alternative<int64_t>(value)) step = std::get<int64_t>(value);
    if (key == "split" && std::holds_alternative<std::string>(value)) split = std::get<std::string>(value);
  }
  std::vector<std::pair<std::string, double>> scalars;
  for (const auto& [key, value] : record.fields()) {
    if (key == "step") continue;
    const std::string tag = split.empty() ? key : split + "/" + key;
    if (const auto* i = std::get_if<int64_t>(&value)) scalars.emplace_back(tag, static_cast<double>(*i));
    if (const auto* d = std::get_if<double>(&value)) scalars.emplace_back(tag, *d);
  }
  add_scalars(step, scalars, unix_time_now());
}

MetricsSink::MetricsSink(const std::string& run_dir, const LoggingConfig& logging) : run_dir_(run_dir) {
  if (logging.jsonl) jsonl_ = JsonlWriter(files::join(run_dir, "metrics.jsonl"));
  if (logging.tensorboard) tensorboard_ = TensorBoardWriter(run_dir);
}

void MetricsSink::start_after(int64_t step, bool evaluation_pending) {
  // A writer this run has off still trims what earlier attempts with it on logged after `step`:
  // those files would otherwise show the abandoned steps next to this attempt's.
  if (jsonl_.is_open()) {
    jsonl_.truncate_after(step, evaluation_pending);
  } else if (!run_dir_.empty()) {
    JsonlWriter::truncate_file_after(files::join(run_dir_, "metrics.jsonl"), step, evaluation_pending);
  }
  if (tensorboard_.is_open()) {
    tensorboard_.truncate_after(step, evaluation_pending);
  } else if (!run_dir_.empty()) {
    TensorBoardWriter::truncate_files_after(run_dir_, step, evaluation_pending);
  }
}

void MetricsSink::write(const MetricRecord& record) {
  jsonl_.write(record);
  tensorboard_.write(record);
}

namespace {
// A billion hours: longer than any run, and far inside int64 minutes.
constexpr double kMaxDurationSeconds = 3.6e12;
}  // namespace

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  char buf[32];
  // The unit is chosen after rounding: 59.96 s is "1m00s", not "60.0s".
  if (seconds < 59.95) {
    std::snprintf(buf, sizeof(buf), "%.1fs", seconds);
  } else if (seconds < 3599.5) {
    const int s = static_cast<int>(seconds + 0.5);
    std::snprintf(buf, sizeof(buf), "%dm%02ds", s / 60, s % 60);
  } else if (seconds < kMaxDurationSeconds) {
    // In int64: an ETA from a step time of hours on a long run passes int's 2^31 minutes.
    const auto m = static_cast<long long>(seconds / 60 + 0.5);
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", m / 60, m % 60);
  } else {
    std::snprintf(buf, sizeof(buf), ">%.0fh", kMaxDurationSeconds / 3600);
  }
  return buf;
}

}  // namespace train
