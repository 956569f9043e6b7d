#pragma once
// Small POSIX file-system helpers.
//
// The library does not use std::filesystem: the torch pip wheel's libtorch.so exports its own,
// incompatible copies of std::filesystem functions, which take precedence over libstdc++'s in a
// program that lists libtorch.so first (create_directories crashes). Programs that link
// train::train list libstdc++ first (libtrain/CMakeLists.txt), but libtrain.so may be loaded by
// one that does not.
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

}  // namespace train::files
