#include "train/data/scan.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include <torch/torch.h>

#include "error_message.h"
#include "worker_thread.h"
#include "train/data/loader.h"

namespace train::data {

namespace {

std::string shape_text(c10::IntArrayRef shape) {
  std::string text;
  for (const int64_t d : shape) text += (text.empty() ? "" : "x") + std::to_string(d);
  return text.empty() ? "a scalar" : text;
}

}  // namespace

ScanReport scan_dataset(const Dataset& dataset, const ScanOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  dataset.verify();
  const int64_t size = dataset.size();
  const std::vector<int64_t> expected = dataset.input_shape();
  const bool static_shapes = dataset.static_shapes();
  const int threads = static_cast<int>(std::clamp<int64_t>(
      options.threads > 0 ? options.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())), 1,
      std::max<int64_t>(size, 1)));

  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> bad{0};
  std::mutex mutex;
  std::map<int64_t, std::string> messages;  // the lowest max_messages indices
  auto record = [&](int64_t index, std::string message) {
    bad.fetch_add(1);
    std::lock_guard<std::mutex> lock(mutex);
    if (static_cast<int64_t>(messages.size()) < options.max_messages || index < messages.rbegin()->first) {
      messages.emplace(index, "sample " + std::to_string(index) + ": " + std::move(message));
      if (static_cast<int64_t>(messages.size()) > options.max_messages) messages.erase(std::prev(messages.end()));
    }
  };
  auto work = [&] {
    // Each thread reads small runs of consecutive indices: neighbours share files and pages.
    constexpr int64_t kChunk = 16;
    for (int64_t begin = next.fetch_add(kChunk); begin < size; begin = next.fetch_add(kChunk)) {
      const int64_t end = std::min(size, begin + kChunk);
      for (int64_t index = begin; index < end; ++index) {
        try {
          const Example example = dataset.get_checked(index, sample_seed(options.seed, 0, index));
          if (static_shapes && example.input.sizes() != c10::IntArrayRef(expected)) {
            record(index, "input of shape " + shape_text(example.input.sizes()) + ", the dataset's is " +
                              shape_text(expected) + " (" + dataset.describe() + ")");
          }
        } catch (...) {
          record(index, current_error_message());
        }
      }
      done.fetch_add(end - begin);
    }
  };

  // The threads are the parallelism: each runs its ATen ops serially (worker_thread.h).
  auto serial_work = [&] {
    make_intra_op_serial_in_this_thread();
    work();
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back(serial_work);
  if (options.progress) {
    // The calling thread reports while the pool reads, then joins in.
    std::thread last(serial_work);
    auto reported = std::chrono::steady_clock::now();
    while (done.load() < size) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const auto now = std::chrono::steady_clock::now();
      if (std::chrono::duration<double>(now - reported).count() >= options.progress_every_s) {
        options.progress(done.load(), size);
        reported = now;
      }
    }
    last.join();
  } else {
    work();
  }
  for (std::thread& thread : pool) thread.join();

  ScanReport report;
  report.samples = size;
  report.bad = bad.load();
  for (auto& [index, message] : messages) report.messages.push_back(std::move(message));
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace train::data
