#include "train/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iomanip>
#include <memory>
#include <mutex>

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
  std::shared_ptr<spdlog::sinks::basic_file_sink_mt> file;
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
  auto& sinks = s.console->sinks();
  if (s.file) {
    sinks.erase(std::remove(sinks.begin(), sinks.end(), s.file), sinks.end());
    s.file.reset();
  }
  if (!path.empty()) {
    s.file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
    s.file->set_pattern("[%Y-%m-%d %H:%M:%S.%e %L] %v");
    sinks.push_back(s.file);
  }
}

void write(Level level, const std::string& message) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (level < s.level) return;
  if (s.rank != 0 && level < Level::warn) return;
  if (s.rank != 0) {
    s.console->log(to_spd(level), "[rank {}] {}", s.rank, message);
  } else {
    s.console->log(to_spd(level), "{}", message);
  }
  // train.log is read after a kill or a crash: each line reaches the file as it is logged (a few
  // lines per logging window, so the cost is nothing).
  if (s.file) s.file->flush();
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

}  // namespace train::log
