#pragma once
// Reads a whole dataset once, the way the loader would, to find the samples a run would stop on
// (or skip) before any device time is spent: `train check --data`.
//
//   data::ScanReport report = data::scan_dataset(*dataset);
//   for (const std::string& m : report.messages) std::cerr << m << "\n";  // "sample 17: <file>: ..."
//
// First the dataset's own whole-file checks run (Dataset::verify: a token file's checksum), then
// every sample is loaded with get_checked(index, seed) (get(), reading each file whole) on
// `threads` threads and, for datasets of static
// shapes, its input shape is compared with input_shape() (a sample of another shape would stop
// the batch it lands in).
#include <train/data/dataset.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace train::data {

struct ScanOptions {
  int threads = 0;            // 0: one per core
  int64_t max_messages = 20;  // messages kept, for the lowest sample indices
  uint64_t seed = 0;          // the sample seeds: sample_seed(seed, 0, index), those of epoch 0
  // Called from the calling thread about every `progress_every_s` seconds with (samples read, size).
  std::function<void(int64_t, int64_t)> progress;
  double progress_every_s = 10.0;
};

struct ScanReport {
  int64_t samples = 0;                // samples read
  int64_t bad = 0;                    // of which failed to load or had another shape
  std::vector<std::string> messages;  // "sample N: error", the lowest max_messages indices
  double seconds = 0.0;
};

// DataError (naming the file) when a whole-file check fails; sample errors are counted in the
// report instead, so that one bad file does not hide the others.
ScanReport scan_dataset(const Dataset& dataset, const ScanOptions& options = {});

}  // namespace train::data
