#include "testing.h"

#include <png.h>
#include <sys/resource.h>
#include <train/cli.h>
#include <train/config.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/log.h>
#include <train/metrics.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "comma_locale.h"

using Catch::Matchers::Contains;
namespace files = train::files;

namespace {

struct TempDir {
  std::string path = files::make_temp_directory("train_tensorboard_");
  ~TempDir() { files::remove_all(path); }
  std::string operator/(const std::string& name) const { return files::join(path, name); }
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

uint64_t little_endian(const std::string& bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(bytes.at(at + i));
  return v;
}

// Splits a TFRecord file into its records, checking both masked CRCs of each.
std::vector<std::string> tfrecords(const std::string& bytes) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    const uint64_t n = little_endian(bytes, at, 8);
    CHECK(little_endian(bytes, at + 8, 4) == train::masked_crc32c(bytes.data() + at, 8));
    REQUIRE(at + 12 + n + 4 <= bytes.size());
    const std::string data = bytes.substr(at + 12, n);
    CHECK(little_endian(bytes, at + 12 + n, 4) == train::masked_crc32c(data.data(), data.size()));
    out.push_back(data);
    at += 12 + n + 4;
  }
  return out;
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& name : files::list_directory(dir)) {
    if (name.rfind("events.out.tfevents.", 0) == 0) out.push_back(files::join(dir, name));
  }
  return out;
}

uint64_t varint(const std::string& bytes, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const auto byte = static_cast<uint8_t>(bytes.at(at++));
    v |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return v;
  }
}

// The top-level fields of an Event that the tests look at, decoded independently of the writer.
struct DecodedEvent {
  int64_t step = 0;
  bool summary = false;      // field 5: scalars
  bool session_log = false;  // field 7
};

DecodedEvent decode_event(const std::string& bytes) {
  DecodedEvent e;
  size_t at = 0;
  while (at < bytes.size()) {
    const uint64_t key = varint(bytes, at);
    switch (key & 7) {
      case 0: {
        const uint64_t v = varint(bytes, at);
        if ((key >> 3) == 2) e.step = static_cast<int64_t>(v);
        break;
      }
      case 1: at += 8; break;
      case 5: at += 4; break;
      case 2: {
        at += varint(bytes, at);
        if ((key >> 3) == 5) e.summary = true;
        if ((key >> 3) == 7) e.session_log = true;
        break;
      }
      default: FAIL("wire type " << (key & 7));
    }
  }
  return e;
}

// The steps of the scalar events in an event file, in order.
std::vector<int64_t> scalar_steps(const std::string& path) {
  std::vector<int64_t> steps;
  for (const std::string& record : tfrecords(read_bytes(path))) {
    const DecodedEvent e = decode_event(record);
    if (e.summary) steps.push_back(e.step);
  }
  return steps;
}

// A metrics row as the trainer writes one: step first, then the split and the loss.
train::MetricRecord loss_row(int64_t step, const char* split, double loss) {
  train::MetricRecord r;
  r.add("step", step).add("split", split).add("loss", loss);
  return r;
}

int cli(std::vector<std::string> args) {
  args.insert(args.begin(), "train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return train::run_cli(static_cast<int>(argv.size()), argv.data());
}

int run_script(const std::string& script, const std::string& args) {
  const std::string cmd = std::string("\"") + TRAIN_PYTHON + "\" \"" + TRAIN_SOURCE_DIR + "/scripts/" + script + "\" " + args;
  const int rc = std::system(cmd.c_str());
  return rc == -1 ? -1 : WEXITSTATUS(rc);
}

}  // namespace

TEST_CASE("format_duration: the unit follows the rounded value", "[metrics]") {
  CHECK(train::format_duration(5.04) == "5.0s");
  CHECK(train::format_duration(59.94) == "59.9s");
  CHECK(train::format_duration(59.96) == "1m00s");  // not "60.0s"
  CHECK(train::format_duration(61) == "1m01s");
  CHECK(train::format_duration(3599.7) == "1h00m");  // not "60m00s"
  CHECK(train::format_duration(3660) == "1h01m");
  CHECK(train::format_duration(-1) == "?");
}

TEST_CASE("format_duration: hours past int's range, and a bound far beyond any run", "[metrics]") {
  // An ETA from a step time of hours over millions of steps: int minutes wrapped to "-35791394h-8m".
  CHECK(train::format_duration(1e12) == "277777777h47m");
  CHECK(train::format_duration(3.5e12) == "972222222h13m");
  CHECK(train::format_duration(3.6e12) == ">1000000000h");
  CHECK(train::format_duration(1e300) == ">1000000000h");
  CHECK(train::format_duration(std::numeric_limits<double>::infinity()) == "?");
}

TEST_CASE("metrics: JSON rows and resume truncation do not depend on the global C++ locale", "[metrics]") {
  TempDir tmp;
  const std::string path = tmp / "metrics.jsonl";
  train::testing::CommaDecimalLocale comma;
  REQUIRE(comma.sample() == "12.345,5");  // a stream made now would write that
  train::MetricRecord r;
  r.add("step", int64_t{12345}).add("loss", 2.5).add("lr", 0.1);
  CHECK(r.to_json() == "{\"step\":12345,\"loss\":2.5,\"lr\":0.1}");
  {
    train::JsonlWriter jsonl(path);
    for (const int64_t step : {999, 1000, 1001, 12345}) {
      train::MetricRecord row;
      row.add("step", step).add("loss", 0.5);
      jsonl.write(row);
    }
    // Read back by its step: "1.001" would be step 1, and kept.
    jsonl.truncate_after(1000);
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str() == "{\"step\":999,\"loss\":0.5}\n{\"step\":1000,\"loss\":0.5}\n");
  // The log (train.log, error messages) too.
  CHECK(train::log::str("loss ", 2.5, " at step ", 12345) == "loss 2.5 at step 12345");
  CHECK(train::log::fixed(1234.56, 1) == "1234.6");
  // Losses and measures: 4 decimals, or 4 significant digits where those would show 0.0000.
  CHECK(train::log::measure(0.43216) == "0.4322");
  CHECK(train::log::measure(2.5) == "2.5000");
  CHECK(train::log::measure(0.001) == "0.0010");
  CHECK(train::log::measure(1.23456e-5) == "1.235e-05");
  CHECK(train::log::measure(-4e-7) == "-4.000e-07");
  CHECK(train::log::measure(0.0) == "0.0000");
  CHECK(train::log::measure(std::nan("")) == "nan");
}

TEST_CASE("metrics: a failed write names the file and the system's reason", "[metrics][tensorboard]") {
  train::MetricRecord r;
  r.add("step", int64_t{1}).add("split", "train").add("loss", 0.5);
  train::JsonlWriter jsonl("/dev/full");  // every write: ENOSPC
  CHECK_THROWS_WITH(jsonl.write(r), Contains("failed writing metrics file /dev/full") &&
                                        Contains(std::strerror(ENOSPC)));

  TempDir tmp;
  train::TensorBoardWriter events(tmp.path);  // its first record (file_version) is written now
  const std::string path = events.path();
  train::testing::FileSizeLimit limit(files::file_size(path) + 8);
  CHECK_THROWS_WITH(events.write(r), Contains("failed writing TensorBoard event file " + path) &&
                                         Contains(std::strerror(EFBIG)));
}

TEST_CASE("tensorboard: CRC-32C known answers", "[tensorboard]") {
  const std::string digits = "123456789";
  CHECK(train::crc32c(digits.data(), digits.size()) == 0xe3069283u);  // the standard check value
  // RFC 3720 (iSCSI) B.4 test vectors.
  std::vector<uint8_t> bytes(32, 0);
  CHECK(train::crc32c(bytes.data(), bytes.size()) == 0x8a9136aau);
  std::fill(bytes.begin(), bytes.end(), 0xff);
  CHECK(train::crc32c(bytes.data(), bytes.size()) == 0x62a8ab43u);
  for (int i = 0; i < 32; ++i) bytes[i] = static_cast<uint8_t>(i);
  CHECK(train::crc32c(bytes.data(), bytes.size()) == 0x46dd794eu);
  // Continuing a CRC over a second piece equals the CRC of the whole.
  CHECK(train::crc32c(digits.data() + 4, 5, train::crc32c(digits.data(), 4)) == 0xe3069283u);
  CHECK(train::crc32c(nullptr, 0) == 0u);
  // TFRecord's mask, checked against TensorBoard's own masked_crc32c(b"123456789").
  CHECK(train::masked_crc32c(digits.data(), digits.size()) == 0xc78ab0e5u);
}

TEST_CASE("tensorboard: a process's event files sort in the order it created them", "[tensorboard]") {
  // TensorBoard reads a directory's event files in name order; a resumed run's file must come after
  // the one it replaces steps of. Within one second, one process tells them apart by a counter,
  // which sorted "…10" before "…9".
  TempDir tmp;
  std::vector<std::string> created;
  for (int i = 0; i < 12; ++i) created.push_back(files::filename(train::TensorBoardWriter(tmp.path).path()));
  std::vector<std::string> sorted = created;
  std::sort(sorted.begin(), sorted.end());
  // Names start with the Unix second; compare within the second the first file was made in.
  const auto same_second = [&](const std::string& name) { return name.substr(0, 30) == created.front().substr(0, 30); };
  std::vector<std::string> in_first_second;
  std::copy_if(sorted.begin(), sorted.end(), std::back_inserter(in_first_second), same_second);
  std::vector<std::string> made_in_first_second;
  std::copy_if(created.begin(), created.end(), std::back_inserter(made_in_first_second), same_second);
  CHECK(in_first_second == made_in_first_second);
  CHECK(sorted.back() == created.back());
}

TEST_CASE("tensorboard: events are TFRecord-framed Event protocol buffers", "[tensorboard]") {
  TempDir tmp;
  std::string path;
  {
    train::TensorBoardWriter writer(tmp.path);
    path = writer.path();
    writer.add_scalars(5, {{"a", 1.0}}, /*wall_time=*/2.0);
  }
  CHECK_THAT(files::filename(path), Contains("events.out.tfevents."));
  const auto records = tfrecords(read_bytes(path));
  REQUIRE(records.size() == 2);
  // First: wall_time (field 1, fixed64) then file_version (field 3) "brain.Event:2".
  CHECK(records[0].substr(0, 1) == "\x09");
  CHECK(records[0].substr(9) == std::string("\x1a\x0d") + "brain.Event:2");
  // Event {wall_time: 2.0, step: 5, summary {value {tag: "a", simple_value: 1.0}}}, byte for byte.
  const std::string want = std::string("\x09\x00\x00\x00\x00\x00\x00\x00\x40", 9) + "\x10\x05" + "\x2a\x0a" +
                           "\x0a\x08" + "\x0a\x01" + "a" + std::string("\x15\x00\x00\x80\x3f", 5);
  CHECK(records[1] == want);
}

TEST_CASE("tensorboard: TensorBoard's EventAccumulator reads the records metrics.jsonl holds",
          "[tensorboard][python]") {
  TempDir tmp;
  {
    train::LoggingConfig logging;  // jsonl and tensorboard on by default
    train::MetricsSink sink(tmp.path, logging);
    for (int64_t step = 1; step <= 5; ++step) {
      train::MetricRecord r;
      r.add("step", step).add("epoch", 0.25 * step).add("split", "train").add("loss", 2.0 / step)
          .add("lr", 0.1 * step).add("samples_per_s", 1234.5 + step).add("peak_memory_mib", 512.25);
      sink.write(r);
    }
    train::MetricRecord val;
    val.add("step", int64_t{5}).add("split", "val").add("loss", 0.7).add("accuracy", 0.8125)
        .add("samples", int64_t{16}).add("flag", true);
    sink.write(val);
    // A diverging step: metrics.jsonl has null (JSON has no NaN or infinity), the events the number.
    train::MetricRecord nonfinite;
    nonfinite.add("step", int64_t{6}).add("split", "train").add("loss", std::nan(""))
        .add("grad_norm", std::numeric_limits<double>::infinity());
    sink.write(nonfinite);
  }
  REQUIRE(event_files(tmp.path).size() == 1);
  CHECK(train::testing::run_python("tensorboard_events.py",
                                   "check " + tmp.path + " " + tmp / "metrics.jsonl" +
                                       " train/loss train/lr train/samples_per_s train/peak_memory_mib val/accuracy"
                                       " train/grad_norm") == 0);

  // A flipped byte in the events fails the reader's CRC check, and the oracle notices.
  const std::string events = event_files(tmp.path).front();
  std::string bytes = read_bytes(events);
  bytes[bytes.size() - 10] ^= 0x40;
  std::ofstream(events, std::ios::binary | std::ios::trunc) << bytes;
  CHECK(train::testing::run_python("tensorboard_events.py", "check " + tmp.path + " " + tmp / "metrics.jsonl") == 1);
}

TEST_CASE("tensorboard: a resumed run's repeated steps replace the earlier attempt's, in events and jsonl",
          "[tensorboard][python][resume]") {
  TempDir tmp;
  train::LoggingConfig logging;
  auto record = [](int64_t step, double loss) { return loss_row(step, "train", loss); };
  {
    train::MetricsSink first(tmp.path, logging);
    first.start_after(0);
    for (int64_t step = 1; step <= 5; ++step) first.write(record(step, 1.0));  // killed after step 5
  }
  {
    train::MetricsSink resumed(tmp.path, logging);  // a new event file, as a new process writes
    resumed.start_after(3);                         // from the checkpoint at step 3
    for (int64_t step = 4; step <= 6; ++step) resumed.write(record(step, 2.0));
  }
  REQUIRE(event_files(tmp.path).size() == 2);
  std::ifstream in(tmp / "metrics.jsonl");
  int64_t rows = 0;
  for (std::string line; std::getline(in, line);) ++rows;
  CHECK(rows == 6);
  // The first file itself lost steps 4 and 5 (a SessionLog START alone hides them from Python's
  // EventAccumulator only, not from TensorBoard's default reader, the data server).
  std::vector<std::string> names = event_files(tmp.path);
  std::sort(names.begin(), names.end());
  CHECK(scalar_steps(names[0]) == std::vector<int64_t>{1, 2, 3});
  CHECK(scalar_steps(names[1]) == std::vector<int64_t>{4, 5, 6});
  // Both of TensorBoard's readers show the jsonl's steps 1-3 at 1.0 and 4-6 at 2.0, once each.
  CHECK(train::testing::run_python("tensorboard_events.py",
                                   "check " + tmp.path + " " + tmp / "metrics.jsonl" + " train/loss") == 0);
}

TEST_CASE("tensorboard: after a resume no event file holds a step after the checkpoint, whatever its tag",
          "[tensorboard][python][resume]") {
  TempDir tmp;
  train::LoggingConfig logging;
  auto record = loss_row;
  {  // trains to step 16, evaluating at 7 and 14; killed after step 16 (checkpoint at 10)
    train::MetricsSink first(tmp.path, logging);
    first.start_after(0);
    for (int64_t step = 1; step <= 16; ++step) {
      first.write(record(step, "train", 1.0));
      if (step % 7 == 0) first.write(record(step, "val", 1.0));
    }
  }
  {  // resumes from step 10, logs 11-13 and is killed before its evaluation at 14
    train::MetricsSink resumed(tmp.path, logging);
    resumed.start_after(10);
    for (int64_t step = 11; step <= 13; ++step) resumed.write(record(step, "train", 2.0));
  }
  std::vector<std::string> names = event_files(tmp.path);
  std::sort(names.begin(), names.end());
  REQUIRE(names.size() == 2);
  // val/loss at 14 is gone too, although the resumed attempt has not logged val/loss again.
  CHECK(scalar_steps(names[0]) == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10});
  CHECK(scalar_steps(names[1]) == std::vector<int64_t>{11, 12, 13});
  // The file_version record stays first, and the resumed file starts with a SessionLog START at 11
  // for a TensorBoard that had read the old events before they went.
  const auto first_records = tfrecords(read_bytes(names[0]));
  CHECK(first_records.at(0).find("brain.Event:2") != std::string::npos);
  const auto resumed_records = tfrecords(read_bytes(names[1]));
  REQUIRE(resumed_records.size() >= 2);
  CHECK(decode_event(resumed_records[1]).session_log);
  CHECK(decode_event(resumed_records[1]).step == 11);
  CHECK(train::testing::run_python("tensorboard_events.py",
                                   "check " + tmp.path + " " + tmp / "metrics.jsonl" + " train/loss val/loss") == 0);
}

TEST_CASE("tensorboard: an evaluation done again after a resume replaces its records at that step, not the "
          "training ones", "[tensorboard][resume]") {
  TempDir tmp;
  train::LoggingConfig logging;
  {  // trains steps 1 and 2; a stop after step 2 puts its evaluation off (checkpoint at 2)
    train::MetricsSink first(tmp.path, logging);
    first.start_after(0);
    for (int64_t step = 1; step <= 2; ++step) first.write(loss_row(step, "train", 1.0));
  }
  auto resume = [&](int64_t last_step) {  // evaluates at 2 first, then trains to last_step
    train::MetricsSink sink(tmp.path, logging);
    sink.start_after(2, /*evaluation_pending=*/true);
    sink.write(loss_row(2, "val", 2.0));
    for (int64_t step = 3; step <= last_step; ++step) sink.write(loss_row(step, "train", 2.0));
  };
  resume(3);  // killed after step 3, before its next checkpoint
  resume(4);  // from the checkpoint at 2 again
  std::vector<std::string> names = event_files(tmp.path);
  std::sort(names.begin(), names.end());
  REQUIRE(names.size() == 3);
  CHECK(scalar_steps(names[0]) == std::vector<int64_t>{1, 2});  // train/loss at 2 stays
  CHECK(scalar_steps(names[1]).empty());                        // its val at 2 and step 3 went
  CHECK(scalar_steps(names[2]) == std::vector<int64_t>{2, 3, 4});
  const std::string rows = read_bytes(tmp / "metrics.jsonl");
  CHECK(rows ==
        "{\"step\":1,\"split\":\"train\",\"loss\":1}\n{\"step\":2,\"split\":\"train\",\"loss\":1}\n"
        "{\"step\":2,\"split\":\"val\",\"loss\":2}\n{\"step\":3,\"split\":\"train\",\"loss\":2}\n"
        "{\"step\":4,\"split\":\"train\",\"loss\":2}\n");
}

TEST_CASE("tensorboard: a rollback rewrites the open event file, a cut-short record goes, an unreadable file stays",
          "[tensorboard][resume]") {
  TempDir tmp;
  train::LoggingConfig logging;
  auto record = [](int64_t step, double loss) { return loss_row(step, "train", loss); };
  // Not an event file this library can read: left byte for byte (with a warning).
  const std::string foreign = tmp / "events.out.tfevents.0000000001.elsewhere.1.000000";
  std::ofstream(foreign, std::ios::binary) << "not TFRecords, but with the name";
  // A killed writer's event file, its last record cut short.
  std::string killed;
  {
    train::TensorBoardWriter writer(tmp.path);
    killed = writer.path();
    writer.add_scalars(1, {{"train/loss", 1.0}}, 1.0);
    writer.add_scalars(2, {{"train/loss", 1.0}}, 2.0);
  }
  {  // the length (with its CRC) and 8 bytes of another record
    const std::string whole = read_bytes(killed);
    const size_t last = 12 + tfrecords(whole).back().size() + 4;
    std::ofstream(killed, std::ios::binary | std::ios::app) << whole.substr(whole.size() - last, 20);
  }
  std::string own;
  {
    train::MetricsSink sink(tmp.path, logging);
    sink.start_after(1);
    for (int64_t step = 2; step <= 5; ++step) sink.write(record(step, 1.0));
    sink.start_after(3);  // trainer.on_nonfinite rollback to the checkpoint at step 3, in this process
    for (int64_t step = 4; step <= 6; ++step) sink.write(record(step, 2.0));
  }
  for (const std::string& path : event_files(tmp.path)) {
    if (path != killed && path != foreign) own = path;
  }
  REQUIRE_FALSE(own.empty());
  CHECK(read_bytes(foreign) == "not TFRecords, but with the name");
  CHECK(scalar_steps(killed) == std::vector<int64_t>{1});  // tfrecords() checks every record is whole
  CHECK(scalar_steps(own) == std::vector<int64_t>{2, 3, 4, 5, 6});
}

TEST_CASE("metrics: a resume with TensorBoard or JSONL off still trims what earlier attempts wrote",
          "[tensorboard][resume]") {
  TempDir tmp;
  auto record = [](int64_t step) { return loss_row(step, "train", 1.0); };
  std::string events;
  {  // the first attempt, both on, logs steps 1-6 and dies
    train::MetricsSink sink(tmp.path, train::LoggingConfig{});
    for (int64_t step = 1; step <= 6; ++step) sink.write(record(step));
  }
  REQUIRE(event_files(tmp.path).size() == 1);
  events = event_files(tmp.path)[0];
  REQUIRE(scalar_steps(events) == std::vector<int64_t>{1, 2, 3, 4, 5, 6});
  {  // the resume from step 3 has both off
    train::LoggingConfig off;
    off.tensorboard = false;
    off.jsonl = false;
    train::MetricsSink sink(tmp.path, off);
    sink.start_after(3);
    sink.write(record(4));
  }
  CHECK(event_files(tmp.path) == std::vector<std::string>{events});
  CHECK(scalar_steps(events) == std::vector<int64_t>{1, 2, 3});
  const std::string rows = read_bytes(tmp / "metrics.jsonl");
  CHECK(rows.find("\"step\":3") != std::string::npos);
  CHECK(rows.find("\"step\":4") == std::string::npos);
  // A run directory without such files gains none.
  TempDir empty;
  train::LoggingConfig off;
  off.tensorboard = false;
  off.jsonl = false;
  train::MetricsSink(empty.path, off).start_after(3);
  CHECK(event_files(empty.path).empty());
  CHECK_FALSE(files::exists(empty / "metrics.jsonl"));
}

TEST_CASE("tensorboard: train fit writes event files, and scripts/plot draws the curves", "[tensorboard][plot][python]") {
  TempDir tmp;
  const std::string cfg = tmp / "run.yaml";
  std::ofstream(cfg) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                        "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 64, "
                        "synthetic_val_samples: 16}\n"
                        "trainer: {global_batch: 16, max_steps: 4, eval_every_steps: 2, device: cpu}\n"
                        "logging: {every_steps: 1}\n";
  const std::string run = tmp / "run";
  REQUIRE(cli({"fit", cfg, "--run-dir", run}) == train::kExitOk);
  REQUIRE(event_files(run).size() == 1);
  CHECK(train::testing::run_python("tensorboard_events.py",
                                   "check " + run + " " + files::join(run, "metrics.jsonl") +
                                       " train/loss train/lr train/samples_per_s train/step_time_ms"
                                       " train/peak_memory_mib val/loss val/accuracy val/top5") == 0);

  // logging.tensorboard: false writes none.
  REQUIRE(cli({"fit", cfg, "--run-dir", tmp / "off", "--set", "logging.tensorboard=false"}) == train::kExitOk);
  CHECK(event_files(tmp / "off").empty());
  CHECK(files::exists(tmp / "off/metrics.jsonl"));

  // scripts/plot: one PNG per curve, each a complete image that libpng decodes.
  REQUIRE(run_script("plot", run) == 0);
  for (const char* name : {"loss.png", "accuracy.png", "lr.png", "throughput.png", "memory.png"}) {
    INFO(name);
    const std::string png = files::join(run, std::string("plots/") + name);
    REQUIRE(files::exists(png));
    png_image image;
    std::memset(&image, 0, sizeof(image));
    image.version = PNG_IMAGE_VERSION;
    REQUIRE(png_image_begin_read_from_file(&image, png.c_str()) != 0);
    CHECK(image.width == 640);
    CHECK(image.height == 400);
    image.format = PNG_FORMAT_RGBA;
    std::vector<uint8_t> pixels(PNG_IMAGE_SIZE(image));
    CHECK(png_image_finish_read(&image, nullptr, pixels.data(), 0, nullptr) != 0);
    // Not a blank canvas: some pixels differ from the first one.
    bool varied = false;
    for (size_t i = 4; i < pixels.size() && !varied; i += 4) varied = std::memcmp(&pixels[i], &pixels[0], 4) != 0;
    CHECK(varied);
  }
  // A truncated last line (a killed run) is skipped; a missing run directory is an input error.
  std::ofstream(files::join(run, "metrics.jsonl"), std::ios::app) << "{\"step\": 9, \"spl";
  CHECK(run_script("plot", run + " --out " + tmp / "plots2") == 0);
  CHECK(files::exists(tmp / "plots2/loss.png"));
  CHECK(run_script("plot", tmp / "nonexistent") == 2);
}
