#pragma once
// Small POSIX file-system helpers.
//
// The library does not use std::filesystem: the torch pip wheel's libtorch.so exports its own,
// incompatible copies of std::filesystem functions, which take precedence over libstdc++'s in a
// program that lists libtorch.so first (create_directories crashes). Programs that link
// train::train list libstdc++ first (libtrain/CMakeLists.txt), but libtrain.so may be loaded by
// one that does not.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace train::files {

bool exists(const std::string& path);
bool is_directory(const std::string& path);
bool is_regular_file(const std::string& path);
int64_t file_size(const std::string& path);  // -1 when missing
// Why `path` cannot be read as an input file: "" for a regular file (or a symlink to one) and
// for a missing one (the caller's open reports that), else "is a directory", "is a named pipe
// (FIFO)", "is a character device", ... Reading a FIFO or a terminal would block until someone
// writes to it; callers reject such paths before opening them.
std::string input_file_problem(const std::string& path);

// mkdir -p; throws train::Error naming the path on failure.
void make_directories(const std::string& path);
// Entry names (not paths) in a directory, sorted; empty when it does not exist.
std::vector<std::string> list_directory(const std::string& path);
// rm -rf; a missing path is not an error.
void remove_all(const std::string& path);
void remove_file(const std::string& path);
void copy_file(const std::string& from, const std::string& to);
// A new, empty directory under $TMPDIR (or /tmp) whose name starts with prefix.
std::string make_temp_directory(const std::string& prefix);

std::string join(const std::string& a, const std::string& b);
std::string parent(const std::string& path);   // "a/b/c.pt" -> "a/b"; "c.pt" -> "."
std::string filename(const std::string& path);  // "a/b/c.pt" -> "c.pt"
std::string stem(const std::string& path);      // "a/b/c.yaml" -> "c"

// A whole file mapped read-only, read from any number of threads. A file truncated after it was
// mapped (rewritten in place while a run reads it) makes a read of the pages it lost fault with
// SIGBUS, which would end the process; copy() catches that fault and returns false instead.
// The first mapping installs a SIGBUS handler for the process that sends every other SIGBUS on
// to the handler that was there before (or to the default action, which ends the process). A
// program that installs its own SIGBUS handler later, without chaining, turns the fault back
// into the end of the process.
class MappedFile {
 public:
  MappedFile() = default;
  // Maps the first `size` bytes of the open file `fd` (which may be closed afterwards); throws
  // train::Error naming `path` when mmap fails. size must be > 0.
  MappedFile(int fd, size_t size, const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  size_t size() const { return size_; }
  // Copies bytes [offset, offset + count) into out. False when the file no longer holds them (it
  // was truncated), with out partly written; offset + count must be within size().
  bool copy(size_t offset, void* out, size_t count) const noexcept;

 private:
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace train::files
