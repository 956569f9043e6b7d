#pragma once
// The state of a run directory before a run writes to it, so that a run stopped by bad input
// (a corrupt image met by the loader, say) before its first checkpoint leaves the directory as it
// found it: nothing half-written. Internal header.
#include <cstdint>
#include <map>
#include <set>
#include <string>

namespace train::detail {

class RunDirSnapshot {
 public:
  // Records the entries at the top of run_dir and in run_dir/checkpoints (where a run writes):
  // sizes, and the bytes of the small files, of metrics.jsonl and of the TensorBoard event files
  // (which a resumed run rewrites).
  // When run_dir does not exist, records the outermost
  // directory that `mkdir -p run_dir` would create.
  explicit RunDirSnapshot(std::string run_dir);

  // A checkpoint (checkpoints/step_*.pt) that was not there before: the run can be resumed. Or a
  // new best checkpoint (checkpoints/best.json changed): a result worth keeping.
  bool has_new_checkpoint() const;

  // Puts the directory back: removes what was created (the whole directory when the run created
  // it), restores small files that were rewritten and truncates larger ones that were appended
  // to. Never throws; returns what it did, for the log.
  std::string restore() const noexcept;

 private:
  struct Entry {
    bool directory = false;
    int64_t size = 0;
    bool has_bytes = false;
    std::string bytes;
  };
  std::string run_dir_;
  std::string created_root_;  // non-empty when the run directory did not exist
  std::map<std::string, Entry> entries_;  // path relative to run_dir_ -> entry
  // The names in checkpoints/abandoned/ (which entries_ does not descend into): the checkpoints a
  // resume set aside are the ones not among them.
  std::set<std::string> abandoned_before_;
};

// An exclusive lock on a run directory, held by a run's rank 0 from before it writes there until it
// ends: a second run into the same directory (the default runs/<config name>, say) stops at once
// instead of interleaving its metrics, config and checkpoints with the first one's. flock(2) on
// <run_dir>/.lock, which the kernel releases when the process ends, however it ends.
class RunDirLock {
 public:
  // run_dir must exist. Throws UsageError naming the process that holds the lock.
  explicit RunDirLock(const std::string& run_dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace train::detail
