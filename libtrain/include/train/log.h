#pragma once
// Logging facade over spdlog. The header stays free of spdlog/fmt so that translation units
// that include LibTorch (whose wheel bundles its own fmt) never see Debian's fmt.
#include <locale>
#include <sstream>
#include <string>

namespace train::log {

enum class Level { trace, debug, info, warn, error, off };

void set_level(Level level);
void set_level(const std::string& name);  // trace|debug|info|warn|error|off
// Only rank 0 prints by default in multi-process runs; other ranks log warnings and errors.
void set_rank(int rank);
// Also append every message to this file (for example <run_dir>/train.log), creating its
// directory; "" stops it. Throws train::Error naming the file when it cannot be opened. A write to
// it that fails later (a full disk) stops the file with one warning on the console naming it and
// the reason; logging never throws.
void set_file(const std::string& path);

void write(Level level, const std::string& message) noexcept;
inline void trace(const std::string& m) { write(Level::trace, m); }
inline void debug(const std::string& m) { write(Level::debug, m); }
inline void info(const std::string& m) { write(Level::info, m); }
inline void warn(const std::string& m) { write(Level::warn, m); }
inline void error(const std::string& m) { write(Level::error, m); }

// str("a=", 1, " b=", 2.5) -> "a=1 b=2.5", never "b=2,5" or "12.345" under a host program's global
// C++ locale: train.log and error messages read the same everywhere, and scripts parse them.
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream out;
  out.imbue(std::locale::classic());
  (out << ... << args);
  return out.str();
}

// fixed(12.3456, 1) -> "12.3": a number for people, with a fixed count of decimals.
std::string fixed(double value, int digits);

// measure(0.4321) -> "0.4321", measure(1.234e-5) -> "1.234e-05": a loss or a model's measure for
// people, 4 decimals, or 4 significant digits below 0.001 where 4 decimals would read as 0.0000.
std::string measure(double value);

// exact(0.1 / 3) -> "0.03333333333333333": the shortest text that reads back as exactly `value`,
// for numbers that must not look equal when they differ.
std::string exact(double value);

}  // namespace train::log
