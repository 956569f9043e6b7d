#pragma once
// Metric records, their sinks (metrics.jsonl, TensorBoard event files) and console progress
// formatting. Free of LibTorch: records hold plain numbers and strings.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace train {

class MetricRecord {
 public:
  using Value = std::variant<bool, int64_t, double, std::string>;
  MetricRecord& add(const std::string& key, int64_t value);
  // Above int64's range the value is stored as a double (JSON readers parse numbers as doubles).
  MetricRecord& add(const std::string& key, uint64_t value);
  // Any other integer type (int, unsigned, size_t, long long, ...): without it, add(key, v.size())
  // would be ambiguous between the int64_t, double and bool overloads.
  template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  MetricRecord& add(const std::string& key, T value) {
    if constexpr (std::is_signed_v<T>) {
      return add(key, static_cast<int64_t>(value));
    } else {
      return add(key, static_cast<uint64_t>(value));
    }
  }
  MetricRecord& add(const std::string& key, double value);
  MetricRecord& add(const std::string& key, bool value);
  MetricRecord& add(const std::string& key, const std::string& value);
  MetricRecord& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  const std::vector<std::pair<std::string, Value>>& fields() const { return fields_; }
  // The value of `key` (the last one added under it), or null when the record has none.
  const Value* find(const std::string& key) const;
  // `key`'s value as a number (a bool as 0 or 1), or none when the record has no such key or its
  // value is a string: `row.number("loss")`, `row.number("step")`.
  std::optional<double> number(const std::string& key) const;
  // One JSON object on one line. Non-finite doubles become null. Numbers are written as JSON
  // has them (1234.5) whatever the global C++ locale.
  std::string to_json() const;

 private:
  std::vector<std::pair<std::string, Value>> fields_;
};

// Appends one JSON object per line and flushes each line, so that a killed run leaves a
// readable file (at most the last line is incomplete).
class JsonlWriter {
 public:
  JsonlWriter() = default;
  // Appends to `path`, creating its directory when missing.
  explicit JsonlWriter(const std::string& path);
  bool is_open() const { return out_.is_open(); }
  void write(const MetricRecord& record);
  // Drops the rows after `step` (and a last line a kill cut short): a run resumed from the
  // checkpoint at `step` logs those steps again. With drop_val_at_step, also the validation rows
  // ("split":"val") at `step`: an evaluation put off at it is done again. The file is replaced
  // atomically.
  void truncate_after(int64_t step, bool drop_val_at_step = false);
  // The same for a file no writer has open (nothing when it does not exist).
  static void truncate_file_after(const std::string& path, int64_t step, bool drop_val_at_step = false);

 private:
  std::ofstream out_;
  std::string path_;
};

// TensorBoard scalar event file `events.out.tfevents.<unix time>.<host>.<pid>.<n>` in a
// directory: TFRecord framing (uint64 length, masked CRC-32C of the length, data, masked CRC-32C
// of the data) around Event protocol buffers, encoded here with TensorBoard's field numbers:
// Event {wall_time = 1 (double), step = 2 (int64), file_version = 3 ("brain.Event:2", first
// event only), summary = 5}, Summary {value = 1 (repeated)}, Summary.Value {tag = 1 (string),
// simple_value = 2 (float)}. Each record is flushed, so a killed run leaves a readable file.
class TensorBoardWriter {
 public:
  TensorBoardWriter() = default;
  explicit TensorBoardWriter(const std::string& dir);
  bool is_open() const { return out_.is_open(); }
  const std::string& path() const { return path_; }
  // One event holding one scalar per (tag, value).
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values, double wall_time);
  // A metrics record: every numeric field except `step` becomes the scalar "<split>/<field>"
  // (just "<field>" without a split), at the record's `step`.
  void write(const MetricRecord& record);
  // Training (re)starts after `step`: every event file in the directory (this one included) loses
  // its events with a step above `step` (and a last record a kill cut short), each file replaced
  // atomically under its own name, so that every reader shows the steps an abandoned attempt
  // logged after the checkpoint once, from the attempt that logs them again: the TensorBoard data
  // server (the default reader since TensorBoard 2.5, --load_fast) ignores SessionLog events.
  // Their file_version records stay. A file whose records cannot be read (not TFRecord-framed
  // Events, a CRC that does not match) is left as it is, with a warning naming it.
  // Then it writes Event {step + 1, session_log = 7 {status = 1 (START)}} into this file, what
  // PyTorch's SummaryWriter(purge_step) writes: a reader that had loaded the old events before the
  // rewrite (Python's EventAccumulator in a running TensorBoard) drops them when it reads it.
  // drop_val_at_step: the validation records ("val/" tags) at `step` go as well.
  void truncate_after(int64_t step, bool drop_val_at_step = false);
  // The rewrite alone, of the event files in `dir` (nothing when it does not exist), for a run
  // that has TensorBoard off after attempts that had it on. Writes no SessionLog.
  static void truncate_files_after(const std::string& dir, int64_t step, bool drop_val_at_step = false);

 private:
  void write_event(const std::string& event);
  std::ofstream out_;
  std::string dir_;
  std::string path_;
};

// CRC-32C (Castagnoli); `crc` continues an earlier value. TFRecord masks it:
// ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
uint32_t masked_crc32c(const void* data, size_t size);

struct LoggingConfig;

// Where the trainer's metric records go: metrics.jsonl (logging.jsonl) and TensorBoard event
// files (logging.tensorboard) in the run directory, which is created when missing.
// Default-constructed, it drops records.
class MetricsSink {
 public:
  MetricsSink() = default;
  MetricsSink(const std::string& run_dir, const LoggingConfig& logging);
  void write(const MetricRecord& record);
  // Training (re)starts after `step`: what earlier attempts logged after it is dropped, from
  // metrics.jsonl and the event files whether or not this run writes them. evaluation_pending:
  // the evaluation due at `step` is about to be done (a stop put it off), so what an attempt that
  // did it logged of it goes too.
  void start_after(int64_t step, bool evaluation_pending = false);

 private:
  std::string run_dir_;
  JsonlWriter jsonl_;
  TensorBoardWriter tensorboard_;
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

// "1h02m", "3m12s", "8.1s"; ">1000000000h" beyond a billion hours, "?" for a negative or
// non-finite time.
std::string format_duration(double seconds);
// JSON string escaping (quotes included); bytes that are not valid UTF-8 become U+FFFD.
std::string json_quote(const std::string& s);

}  // namespace train
