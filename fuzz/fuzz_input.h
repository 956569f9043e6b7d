#pragma once
// Shared by the fuzz targets: the readers under test take file paths, so each input is written to
// a scratch file of the process (in $TMPDIR, removed at exit) before it is parsed.
//
// The contract every target checks: bad input may only end in a train::Error (ConfigError,
// DataError, CheckpointError, ...). Any other exception escapes LLVMFuzzerTestOneInput, which
// aborts, and libFuzzer reports the input as a crash, as it does for sanitizer reports, absurd
// allocations (-malloc_limit_mb) and hangs (-timeout).
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

namespace train::fuzz {

namespace detail {
struct Scratch {
  std::string dir;
  std::set<std::string> files;
  Scratch() {
    const char* tmp = std::getenv("TMPDIR");
    dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/train-fuzz-" + std::to_string(::getpid());
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) std::abort();
  }
  ~Scratch() {
    for (const std::string& f : files) ::unlink(f.c_str());
    ::rmdir(dir.c_str());
  }
};
inline Scratch& scratch() {
  static Scratch s;
  return s;
}
}  // namespace detail

// Writes `size` bytes to the scratch file `name` and returns its path.
inline std::string write_scratch(const std::string& name, const uint8_t* data, size_t size) {
  detail::Scratch& s = detail::scratch();
  const std::string path = s.dir + "/" + name;
  s.files.insert(path);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  if (std::fclose(f) != 0) std::abort();
  return path;
}

// A property the target checks failed: print why and abort, which libFuzzer reports as a crash.
[[noreturn]] inline void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz: property violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace train::fuzz
