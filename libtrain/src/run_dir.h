#pragma once
// The state of a run directory before a run writes to it, so that a run stopped by bad input
// (a corrupt image met by the loader, say) before its first checkpoint leaves the directory as it
// found it: nothing half-written. Internal header.
#include <cstdint>
#include <map>
#include <string>

namespace train::detail {

class RunDirSnapshot {
 public:
  // Records the entries at the top of run_dir and in run_dir/checkpoints (where a run writes):
  // sizes, and the bytes of the small files. When run_dir does not exist, records the outermost
  // directory that `mkdir -p run_dir` would create.
  explicit RunDirSnapshot(std::string run_dir);

  // A checkpoint (checkpoints/step_*.pt) that was not there before: the run can be resumed.
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
};

}  // namespace train::detail
