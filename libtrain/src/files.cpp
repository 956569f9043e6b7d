#include "train/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "train/errors.h"

namespace train::files {
namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_regular_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

int64_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

std::string input_file_problem(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return "";
  if (S_ISDIR(st.st_mode)) return "is a directory";
  if (S_ISFIFO(st.st_mode)) return "is a named pipe (FIFO)";
  if (S_ISCHR(st.st_mode)) return "is a character device";
  if (S_ISBLK(st.st_mode)) return "is a block device";
  if (S_ISSOCK(st.st_mode)) return "is a socket";
  return "is not a regular file";
}

void make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  const std::string up = parent(path);
  if (up != path && up != "." && up != "/") make_directories(up);
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    throw Error("cannot create directory " + path + ": " + errno_text());
  }
  if (!is_directory(path)) throw Error("cannot create directory " + path + ": a file is in the way");
}

std::vector<std::string> list_directory(const std::string& path) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(path.c_str());
  if (!dir) return names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

void remove_all(const std::string& path) {
  if (!exists(path)) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    throw Error("cannot remove " + path + ": " + errno_text());
  }
}

void remove_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw Error("cannot remove " + path + ": " + errno_text());
}

void copy_file(const std::string& from, const std::string& to) {
  const int in = ::open(from.c_str(), O_RDONLY);
  if (in < 0) throw Error("cannot read " + from + ": " + errno_text());
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (out < 0) {
    ::close(in);
    throw Error("cannot write " + to + ": " + errno_text());
  }
  char buf[1 << 16];
  ssize_t n = 0;
  bool ok = true;
  while (ok && (n = ::read(in, buf, sizeof(buf))) > 0) ok = ::write(out, buf, static_cast<size_t>(n)) == n;
  ::close(in);
  ok = (::close(out) == 0) && ok && n == 0;
  if (!ok) throw Error("failed copying " + from + " to " + to);
}

std::string make_temp_directory(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = join(tmp && *tmp ? tmp : "/tmp", prefix + "XXXXXX");
  if (!::mkdtemp(pattern.data())) throw Error("cannot create a temporary directory: " + errno_text());
  return pattern;
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty() || (!b.empty() && b.front() == '/')) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

std::string parent(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

std::string filename(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string stem(const std::string& path) {
  const std::string name = filename(path);
  const auto dot = name.rfind('.');
  return dot == std::string::npos || dot == 0 ? name : name.substr(0, dot);
}

}  // namespace train::files
