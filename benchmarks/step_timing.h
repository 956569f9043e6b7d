#pragma once
// How the C++ step benchmarks time a step (resnet_step.cpp, bert_step.cpp), exactly as
// step_timing.py does for their Python sides: `warmup` steps, then windows of `window` steps
// until exactly `steps` have run (the last window shorter when `window` does not divide `steps`),
// the device synchronised at each window's end; each window's rate is items per second. The
// median of an even number of windows is the mean of the two middle ones, on both sides.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

namespace bench {

// The median of `sorted` (ascending, not empty): the middle value, or the mean of the two middle
// values for an even count (step_timing.py's median() is the same).
inline double median_of_sorted(const std::vector<double>& sorted) {
  const size_t n = sorted.size();
  return n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

struct Rates {
  std::vector<double> sorted;  // per window, ascending
  double median() const { return median_of_sorted(sorted); }
  double min() const { return sorted.front(); }
  double max() const { return sorted.back(); }
};

// steps >= 1, window >= 1, warmup >= 0 (the callers validate their arguments).
template <typename Step, typename Sync>
Rates time_windows(Step&& step, Sync&& sync, int warmup, int steps, int window, int64_t items_per_step) {
  for (int i = 0; i < warmup; ++i) step();
  sync();
  Rates rates;
  for (int done = 0; done < steps;) {
    const int n = std::min(window, steps - done);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) step();
    sync();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.sorted.push_back(static_cast<double>(items_per_step * n) / seconds);
    done += n;
  }
  std::sort(rates.sorted.begin(), rates.sorted.end());
  return rates;
}

// Runs `run` (warmup, timed windows, one JSON line) once; or, with `serve`, keeps the process for
// as many runs as the caller asks for: prints "ready" once set up, then runs once per line "run"
// on standard input, until "quit" or the end of input. compare_resnet.py and compare_bert.py keep
// both sides alive this way and alternate them, so that a round costs its steps rather than a
// process start (LibTorch or Python + torch loading, the CUDA context, cuDNN autotuning: 7 s for
// the C++ side and 17 s for Python on the H200, 2026-12-04). Returns the exit status: 2 for an
// unknown command.
template <typename Run>
int run_or_serve(bool serve, Run&& run) {
  if (!serve) {
    run();
    return 0;
  }
  std::cout << "ready" << std::endl;
  for (std::string line; std::getline(std::cin, line);) {
    if (line == "quit") break;
    if (line != "run") {
      std::cerr << "unknown command '" << line << "' (run or quit)\n";
      return 2;
    }
    run();
  }
  return 0;
}

}  // namespace bench
