#pragma once
// How the C++ step benchmarks time a step (resnet_step.cpp, bert_step.cpp), exactly as
// step_timing.py does for their Python sides: `warmup` steps, then windows of `window` steps
// until `steps` have run, the device synchronised at each window's end; each window's rate is
// items per second.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

namespace bench {

struct Rates {
  std::vector<double> sorted;  // per window, ascending
  double median() const { return sorted[sorted.size() / 2]; }
  double min() const { return sorted.front(); }
  double max() const { return sorted.back(); }
};

template <typename Step, typename Sync>
Rates time_windows(Step&& step, Sync&& sync, int warmup, int steps, int window, int64_t items_per_step) {
  for (int i = 0; i < warmup; ++i) step();
  sync();
  Rates rates;
  for (int done = 0; done < steps; done += window) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < window; ++i) step();
    sync();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.sorted.push_back(static_cast<double>(items_per_step * window) / seconds);
  }
  std::sort(rates.sorted.begin(), rates.sorted.end());
  return rates;
}

}  // namespace bench
