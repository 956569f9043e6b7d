#include "run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "atomic_file.h"
#include "checkpoint_name.h"
#include "train/errors.h"
#include "train/files.h"

namespace train::detail {
namespace {

// Files up to this size are kept byte for byte (config.yaml, plan.json); larger ones (train.log,
// checkpoints) are only ever appended to or replaced whole, so their size suffices. metrics.jsonl
// and TensorBoard's event files are the exception: a resumed run rewrites them without what was
// logged after its checkpoint (MetricsSink::start_after), so they are kept byte for byte at any
// size a run plausibly reaches (a row or an event is ~200 bytes: over a million of them).
constexpr int64_t kKeepBytesUpTo = 256 * 1024;
constexpr int64_t kKeepRewrittenBytesUpTo = int64_t{256} << 20;

int64_t keep_bytes_up_to(const std::string& rel) {
  const bool rewritten = rel == "metrics.jsonl" || rel.rfind("events.out.tfevents.", 0) == 0;
  return rewritten ? kKeepRewrittenBytesUpTo : kKeepBytesUpTo;
}

bool lstat_path(const std::string& path, struct stat& info) { return ::lstat(path.c_str(), &info) == 0; }

bool read_bytes(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream text;
  text << in.rdbuf();
  out = text.str();
  return !in.bad();
}

// Whole or not at all (a full disk while putting metrics.jsonl back must not cut it short).
bool write_bytes(const std::string& path, const std::string& bytes) {
  try {
    write_text_atomically(path, bytes);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// A periodic checkpoint in checkpoints/ (`rel` relative to the run directory).
bool is_checkpoint_name(const std::string& rel) {
  const std::string dir = "checkpoints/";
  return rel.compare(0, dir.size(), dir) == 0 && checkpoint_step(rel.substr(dir.size())) >= 0;
}

// The entries a run writes to: those at the top of `root` and in its checkpoints/, relative to
// `root`, parents before children; symlinks are not followed. Other subdirectories (a user may
// give --run-dir . over their data) are neither read nor changed, only removed when new.
std::vector<std::pair<std::string, struct stat>> walk(const std::string& root) {
  std::vector<std::pair<std::string, struct stat>> out;
  std::vector<std::string> pending{""};
  while (!pending.empty()) {
    const std::string rel = pending.back();
    pending.pop_back();
    for (const std::string& name : files::list_directory(files::join(root, rel))) {
      const std::string child = rel.empty() ? name : rel + "/" + name;
      struct stat info {};
      if (!lstat_path(files::join(root, child), info)) continue;
      out.emplace_back(child, info);
      if (S_ISDIR(info.st_mode) && child == "checkpoints") pending.push_back(child);
    }
  }
  return out;
}

}  // namespace

RunDirSnapshot::RunDirSnapshot(std::string run_dir) : run_dir_(std::move(run_dir)) {
  if (!files::exists(run_dir_)) {
    std::string outermost = run_dir_;
    for (std::string up = files::parent(outermost); up != outermost && up != "." && up != "/" && !files::exists(up);
         up = files::parent(up)) {
      outermost = up;
    }
    created_root_ = outermost;
    return;
  }
  for (const std::string& name : files::list_directory(files::join(run_dir_, "checkpoints/abandoned"))) {
    abandoned_before_.insert(name);
  }
  for (const auto& [rel, info] : walk(run_dir_)) {
    Entry entry;
    entry.directory = S_ISDIR(info.st_mode);
    entry.size = static_cast<int64_t>(info.st_size);
    if (S_ISREG(info.st_mode) && entry.size <= keep_bytes_up_to(rel)) {
      entry.has_bytes = read_bytes(files::join(run_dir_, rel), entry.bytes);
    }
    entries_.emplace(rel, std::move(entry));
  }
}

bool RunDirSnapshot::has_new_checkpoint() const {
  for (const std::string& name : files::list_directory(files::join(run_dir_, "checkpoints"))) {
    const std::string rel = "checkpoints/" + name;
    if (is_checkpoint_name(rel) && entries_.count(rel) == 0) return true;
  }
  // checkpoint.best: a new best.pt (an evaluation put off by a stop and done on resume makes the
  // resumed checkpoint best.pt without writing one) is kept like a checkpoint. best.json says so.
  const std::string best = "checkpoints/best.json";
  std::string now;
  if (!read_bytes(files::join(run_dir_, best), now)) return false;
  const auto it = entries_.find(best);
  return it == entries_.end() || !it->second.has_bytes || it->second.bytes != now;
}

std::string RunDirSnapshot::restore() const noexcept {
  try {
    if (!created_root_.empty()) {
      files::remove_all(created_root_);
      return "removed " + created_root_ + ", which this run created";
    }
    int removed = 0, restored = 0;
    // Checkpoints that a resume set aside (set_aside_checkpoints_after) go back first, before a
    // new checkpoints/abandoned/ is removed with them in it. Each went under its own name, or a
    // numbered one when an earlier resume had set aside one of that name: the one to bring back
    // is the one that was not there before.
    const std::string abandoned = files::join(run_dir_, "checkpoints/abandoned");
    for (const auto& [rel, before] : entries_) {
      const std::string path = files::join(run_dir_, rel);
      if (before.directory || rel.rfind("checkpoints/", 0) != 0 || files::exists(path)) continue;
      for (int n = 0; n <= static_cast<int>(abandoned_before_.size()); ++n) {
        const std::string name = kept_checkpoint_name(files::filename(rel), n);
        const std::string aside = files::join(abandoned, name);
        if (abandoned_before_.count(name) != 0 || !files::exists(aside)) continue;
        if (std::rename(aside.c_str(), path.c_str()) == 0) ++restored;
        break;
      }
    }
    std::vector<std::string> gone;  // removed directories: skip what was under them
    for (const auto& [rel, info] : walk(run_dir_)) {
      bool under_removed = false;
      for (const std::string& g : gone) under_removed = under_removed || rel.compare(0, g.size() + 1, g + "/") == 0;
      if (under_removed) continue;
      const std::string path = files::join(run_dir_, rel);
      const auto it = entries_.find(rel);
      if (it == entries_.end()) {
        files::remove_all(path);
        gone.push_back(rel);
        ++removed;
        continue;
      }
      const Entry& before = it->second;
      if (!S_ISREG(info.st_mode) || before.directory) continue;
      std::string now;
      if (before.has_bytes) {
        if (read_bytes(path, now) && now != before.bytes && write_bytes(path, before.bytes)) ++restored;
      } else if (static_cast<int64_t>(info.st_size) > before.size) {
        if (::truncate(path.c_str(), static_cast<off_t>(before.size)) == 0) ++restored;
      }
    }
    for (const auto& [rel, before] : entries_) {  // small files the run deleted
      const std::string path = files::join(run_dir_, rel);
      if (before.has_bytes && !files::exists(path) && write_bytes(path, before.bytes)) ++restored;
    }
    return "left " + run_dir_ + " as it was before this run (" + std::to_string(removed) + " new entries removed, " +
           std::to_string(restored) + " files restored)";
  } catch (const std::exception& e) {
    return std::string("could not restore the run directory: ") + e.what();
  }
}

RunDirLock::RunDirLock(const std::string& run_dir) {
  const std::string path = files::join(run_dir, ".lock");
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error("cannot open " + path + ": " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    char buf[32] = {};
    if (::pread(fd_, buf, sizeof(buf) - 1, 0) > 0) holder = std::string(buf).substr(0, std::string(buf).find('\n'));
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK) throw Error("cannot lock " + path + ": " + std::strerror(err));
    throw UsageError("run directory " + run_dir + " is in use by another run" +
                     (holder.empty() ? std::string() : " (pid " + holder + ")") +
                     "; wait for it to end, or give this run another directory");
  }
  // Who holds it, for the message above; the lock itself is the flock, not this text.
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
    // The lock holds without it.
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

}  // namespace train::detail
