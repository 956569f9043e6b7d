#include "train/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

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

// ---- MappedFile ---------------------------------------------------------------------------------
// A read of a mapped page that the file no longer has raises SIGBUS in the reading thread. Each
// copy() arms a per-thread guard (the pages it reads, a jump buffer); the handler jumps back into
// copy() when the fault is inside the armed range, and passes every other SIGBUS on.

namespace {

struct FaultGuard {
  sigjmp_buf resume;
  uintptr_t first_page = 0;  // [first_page, end_page): the pages the armed copy reads
  uintptr_t end_page = 0;
};

thread_local FaultGuard* t_armed = nullptr;
struct sigaction g_previous_sigbus {};
std::once_flag g_sigbus_installed;

void on_sigbus(int signal, siginfo_t* info, void* context) {
  FaultGuard* guard = t_armed;
  const auto at = reinterpret_cast<uintptr_t>(info->si_addr);
  if (guard != nullptr && at >= guard->first_page && at < guard->end_page) {
    t_armed = nullptr;
    siglongjmp(guard->resume, 1);  // SA_NODEFER: the signal mask needs no restoring
  }
  // Not a fault of copy(): the handler that was there before, else the default action.
  if ((g_previous_sigbus.sa_flags & SA_SIGINFO) != 0) {
    g_previous_sigbus.sa_sigaction(signal, info, context);
  } else if (g_previous_sigbus.sa_handler != SIG_DFL && g_previous_sigbus.sa_handler != SIG_IGN) {
    g_previous_sigbus.sa_handler(signal);
  } else {
    // Back to the default; a fault repeats when the handler returns and then ends the process
    // with SIGBUS (a core dump at the faulting access), a sent SIGBUS is sent again.
    ::signal(SIGBUS, SIG_DFL);
    if (info->si_code <= 0) ::raise(SIGBUS);
  }
}

void install_sigbus_handler() {
  struct sigaction action {};
  action.sa_sigaction = on_sigbus;
  ::sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  ::sigaction(SIGBUS, &action, &g_previous_sigbus);
}

// No objects with destructors live here: the jump back from the handler skips this frame's end.
bool guarded_copy(const unsigned char* from, void* to, size_t count) noexcept {
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  FaultGuard guard;
  guard.first_page = reinterpret_cast<uintptr_t>(from) / page * page;
  guard.end_page = (reinterpret_cast<uintptr_t>(from) + count + page - 1) / page * page;
  if (sigsetjmp(guard.resume, 0) != 0) return false;
  // The fences keep the compiler from moving the copy's loads out from between arming and
  // disarming (or from dropping the arming store as dead: memcpy does not read t_armed).
  t_armed = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(to, from, count);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_armed = nullptr;
  return true;
}

}  // namespace

MappedFile::MappedFile(int fd, size_t size, const std::string& path) {
  std::call_once(g_sigbus_installed, install_sigbus_handler);
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) throw Error(path + ": cannot map the file: " + errno_text());
  data_ = static_cast<const unsigned char*>(mapped);
  size_ = size;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

bool MappedFile::copy(size_t offset, void* out, size_t count) const noexcept {
  return count == 0 || guarded_copy(data_ + offset, out, count);
}

}  // namespace train::files
