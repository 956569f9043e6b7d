#include "train/log.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cmath>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <locale>
#include <memory>
#include <mutex>

#include "train/errors.h"
#include "train/files.h"

namespace train::log {
namespace {

struct State {
  State() {
    // Not registered in spdlog's global registry, so a host program's own "train" logger
    // cannot clash with it.
    console = std::make_shared<spdlog::logger>(
        "train", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    console->set_pattern("%^[%H:%M:%S %L]%$ %v");
    console->set_level(spdlog::level::trace);
  }
  std::mutex mutex;
  std::shared_ptr<spdlog::logger> console;
  // The log file is written here, not through a spdlog file sink: that sink throws from flush()
  // when the disk is full, and a throw out of log::write escapes the training loop, then the
  // error report in run_cli's catch (std::terminate, exit 134), or the stop watchdog's thread.
  std::FILE* file = nullptr;
  std::string file_path;
  spdlog::pattern_formatter file_format{"[%Y-%m-%d %H:%M:%S.%e %L] %v"};
  Level level = Level::info;
  int rank = 0;
};

State& state() {
  static State s;
  return s;
}

spdlog::level::level_enum to_spd(Level l) {
  switch (l) {
    case Level::trace: return spdlog::level::trace;
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::info;
}

// Appends one line to the log file; on a failed write or flush (a full disk) the file is closed
// and no longer written, with one warning on the console naming it and the reason. Logging must
// not stop a run: metrics and checkpoints report their own write failures.
void write_file(State& s, spdlog::level::level_enum level, const std::string& message) {
  spdlog::memory_buf_t line;
  s.file_format.format(spdlog::details::log_msg("train", level, message), line);
  int error = 0;
  errno = 0;
  if (std::fwrite(line.data(), 1, line.size(), s.file) != line.size()) error = errno ? errno : EIO;
  // train.log is read after a kill or a crash: each line reaches the file as it is logged (a few
  // lines per logging window, so the cost is nothing).
  if (error == 0 && std::fflush(s.file) != 0) error = errno ? errno : EIO;
  if (error == 0) return;
  std::fclose(s.file);  // what it could not flush is lost; the result says nothing new
  s.file = nullptr;
  const std::string path = std::move(s.file_path);
  s.file_path.clear();
  s.console->log(spdlog::level::warn,
                 "cannot write the log file {} ({}); it is no longer written, the console still is", path,
                 std::strerror(error));
}

}  // namespace

void set_level(Level level) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().level = level;
}

void set_level(const std::string& name) {
  static const std::pair<const char*, Level> names[] = {
      {"trace", Level::trace}, {"debug", Level::debug}, {"info", Level::info},
      {"warn", Level::warn},   {"error", Level::error}, {"off", Level::off}};
  for (const auto& [n, l] : names) {
    if (name == n) return set_level(l);
  }
}

void set_rank(int rank) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().rank = rank;
}

void set_file(const std::string& path) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.file) {
    std::fclose(s.file);
    s.file = nullptr;
    s.file_path.clear();
  }
  if (path.empty()) return;
  files::make_directories(files::parent(path));
  // "e": close-on-exec, so that the ranks train launch starts do not inherit it.
  s.file = std::fopen(path.c_str(), "ae");
  if (!s.file) throw Error("cannot open log file " + path + " for appending (" + std::strerror(errno) + ")");
  s.file_path = path;
}

void write(Level level, const std::string& message) noexcept {
  try {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (level < s.level) return;
    if (s.rank != 0 && level < Level::warn) return;
    const std::string text = s.rank != 0 ? "[rank " + std::to_string(s.rank) + "] " + message : message;
    s.console->log(to_spd(level), "{}", text);  // spdlog reports a failing console itself, without throwing
    if (s.file) write_file(s, to_spd(level), text);
  } catch (...) {
    // Out of memory while formatting: the message is lost, the caller goes on.
  }
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out.imbue(std::locale::classic());  // see str()
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

std::string measure(double value) {
  if (value == 0.0 || !std::isfinite(value) || std::fabs(value) >= 1e-3) return fixed(value, 4);
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out << std::scientific << std::setprecision(3) << value;
  return out.str();
}

std::string exact(double value) {
  char buffer[64];
  return std::string(buffer, std::to_chars(buffer, buffer + sizeof buffer, value).ptr);
}

}  // namespace train::log
