#pragma once
// Crash-safe file writes: write a temporary file beside the target, fsync it, rename it over
// the target, fsync the directory. A reader sees the old file or the new one, never half.
// Internal header.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include "train/errors.h"
#include "train/files.h"

namespace train::detail {

inline void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// `produce` writes the content through the given sink; returns false on a short write.
inline void write_atomically(const std::string& path,
                             const std::function<void(const std::function<bool(const void*, size_t)>&)>& produce) {
  const std::string dir = files::parent(path);
  files::make_directories(dir);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error("cannot write " + tmp + ": " + std::strerror(errno));
  bool ok = true;
  try {
    produce([&](const void* data, size_t n) {
      ok = ok && std::fwrite(data, 1, n, f) == n;
      return ok;
    });
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw Error("failed writing " + tmp + " (disk full?)");
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

}  // namespace train::detail
