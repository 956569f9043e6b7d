#pragma once
// Crash-safe file writes: write a temporary file beside the target, fsync it, rename it over
// the target, fsync the directory. A reader sees the old file or the new one, never half.
// Internal header.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"

namespace train::detail {

inline void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// `produce` writes the content through the given sink, which returns false once a write has
// failed (later calls write nothing). A producer that cannot stop part way (LibTorch's archive
// writer, which throws from a destructor when told of a short write) may ignore that: the failure
// is remembered and reported here, with the system's reason, after `produce` returns.
// `before_rename`, when given, runs once the new content is complete and synced, just before it
// replaces the file.
inline void write_atomically(const std::string& path,
                             const std::function<void(const std::function<bool(const void*, size_t)>&)>& produce,
                             const std::function<void()>& before_rename = {}) {
  const std::string dir = files::parent(path);
  files::make_directories(dir);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error("cannot write " + tmp + ": " + std::strerror(errno));
  bool ok = true;
  int error = 0;  // errno of the first failure
  const auto check = [&](bool step_ok) {
    if (ok && !step_ok) error = errno;
    ok = ok && step_ok;
  };
  try {
    produce([&](const void* data, size_t n) {
      if (ok) check(std::fwrite(data, 1, n, f) == n);
      return ok;
    });
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  if (ok) check(std::fflush(f) == 0);
  if (ok) check(::fsync(::fileno(f)) == 0);
  check(std::fclose(f) == 0);
  if (!ok) {
    std::remove(tmp.c_str());
    throw Error("failed writing " + path + ": " + (error ? std::strerror(error) : "write error") +
                (error == ENOSPC || error == EDQUOT ? " (free space there, or write elsewhere)" : "") +
                "; the file there before, if any, is unchanged");
  }
  if (before_rename) {
    try {
      before_rename();
    } catch (...) {
      std::remove(tmp.c_str());
      throw;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw Error("cannot rename " + tmp + " to " + path + ": " + why);
  }
  fsync_path(dir, /*directory=*/true);
}

inline void write_text_atomically(const std::string& path, const std::string& text) {
  write_atomically(path, [&](const auto& sink) { sink(text.data(), text.size()); });
}

// Removes the temporary files "<target>.tmp.<pid>" that a write_atomically killed before its rename
// left in dir, for the targets `is_target` accepts (a file name), logging each. The file of a
// writer that is still running here (another process writing to the same directory) is kept, with
// a warning. This process's own pid counts as left over: a container may give every restart the
// same pid, and callers run this before they write. Returns the paths removed.
inline std::vector<std::string> remove_stale_temporaries(const std::string& dir,
                                                         const std::function<bool(const std::string&)>& is_target) {
  std::vector<std::string> removed;
  for (const auto& name : files::list_directory(dir)) {
    const size_t tmp = name.rfind(".tmp.");
    if (tmp == std::string::npos || tmp == 0) continue;
    const std::string target = name.substr(0, tmp), digits = name.substr(tmp + 5);
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos ||
        !is_target(target)) {
      continue;
    }
    const std::string path = files::join(dir, name);
    if (!files::is_regular_file(path)) continue;
    const auto pid = static_cast<pid_t>(std::stol(digits));
    const bool running = pid > 0 && pid != ::getpid() && (::kill(pid, 0) == 0 || errno == EPERM);
    if (running) {
      log::warn(log::str("kept ", path, ": its writer, pid ", pid, ", is still running (another run writing to ",
                         dir, "?)"));
      continue;
    }
    try {
      files::remove_file(path);
    } catch (const Error& e) {
      log::warn(std::string("could not remove a leftover temporary file: ") + e.what());
      continue;
    }
    log::info(log::str("removed ", path, ", left by a write that did not finish (pid ", pid, ")"));
    removed.push_back(path);
  }
  return removed;
}

}  // namespace train::detail
