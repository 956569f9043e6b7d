#include "step_graph.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <vector>

#include "compat.h"
#include "train/log.h"
#if TRAIN_CUDA_GRAPHS
#if TRAIN_HOST_GRAPH_POOLS
#include <ATen/core/CachingHostAllocator.h>
#endif
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace train::detail {
namespace {

// Steps before any timing: the first allocates the optimizer's state and lets cuDNN choose its
// algorithms; the second runs with the memory cache warm.
constexpr int kUntimedSteps = 2;
// Steps timed on each side before keep_if_faster decides.
constexpr int kTimedSteps = 5;
// A replay must be this much faster than an eager step to be kept: below it the difference is
// noise, and the graph's memory pool is not free.
constexpr double kMinGain = 0.03;

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

}  // namespace

struct StepGraph::Impl {
  enum class Phase { kEager, kSideWarm, kCapture, kMeasureReplay, kReplay, kOff };

  torch::Device device;
  bool keep_if_faster;
  Phase phase = Phase::kEager;
  bool decided = false;       // keep_if_faster measured and kept the graph
  int eager_done = 0;         // eager steps since the start or the last invalidate()
  int64_t replays = 0;
  int64_t captures = 0;
  std::vector<double> eager_ms, replay_ms;
  std::string outcome;        // why the graph is off, for summary()
  torch::Tensor static_input, static_target, static_loss;
#if TRAIN_CUDA_GRAPHS
  c10::cuda::CUDAStream side;
  std::unique_ptr<at::cuda::CUDAGraph> graph;

  Impl(torch::Device d, bool keep) : device(d), keep_if_faster(keep), side(c10::cuda::getStreamFromPool(false, d.index())) {}

  c10::cuda::CUDAStream current() const { return c10::cuda::getCurrentCUDAStream(device.index()); }

  // `second` waits for what `first` has enqueued so far.
  static void order(const c10::cuda::CUDAStream& first, const c10::cuda::CUDAStream& second) {
    c10::Event event(c10::DeviceType::CUDA);
    event.record(first.unwrap());
    event.block(second.unwrap());
  }

  template <typename F>
  torch::Tensor timed(std::vector<double>& into, F&& run_step) {
    const auto start = std::chrono::steady_clock::now();
    torch::Tensor loss = run_step();
    current().synchronize();  // the trainer reads the loss next anyway
    into.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    return loss;
  }

  torch::Tensor replay(const torch::Tensor& input, const torch::Tensor& target) {
    static_input.copy_(input);
    static_target.copy_(target);
    graph->replay();
    ++replays;
    return static_loss;
  }

  void drop() {
    graph.reset();
    static_input = static_target = static_loss = torch::Tensor();
  }

  // What a capture that capture_end did not finish leaves behind, put right (the CUDAGraph's
  // destructor only cleans up after a finished one). Each part is tried on its own: LibTorch
  // releases differ in what capture_end had done before it threw.
  //  - The device allocator and (from 2.10) the pinned host allocator still route allocations to
  //    the graph's pool, and hold the pool.
  //  - The default CUDA generator is still in capture mode (capture_end's epilogue never ran): an
  //    eager dropout after it would draw from the graph's offsets. A clone of its state, which
  //    starts outside capture mode at the same seed and offset, replaces it.
  void abandon_capture(const decltype(at::cuda::graph_pool_handle())& pool) {
    const auto quietly = [](auto&& f) {
      try {
        f();
      } catch (const std::exception&) {
      }
    };
    quietly([&] { c10::cuda::CUDACachingAllocator::endAllocateToPool(device.index(), pool); });
    quietly([&] { c10::cuda::CUDACachingAllocator::releasePool(device.index(), pool); });
#if TRAIN_HOST_GRAPH_POOLS
    quietly([&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool); });
    quietly([&] { at::getHostAllocator(at::kCUDA)->release_pool(pool); });
#endif
    quietly([&] {
      at::Generator generator = at::cuda::detail::getDefaultCUDAGenerator(device.index());
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.graphsafe_set_state(generator.clone());
    });
  }

  // Captures the step on the side stream; returns the cause when the capture failed.
  std::string capture(const torch::Tensor& input, const torch::Tensor& target, const Step& step) {
    static_input = input.clone();  // keeps the layout (channels_last)
    static_target = target.clone();
    const c10::cuda::CUDAStream main = current();
    // The eager steps' cached blocks go back: the graph's activations live in a pool of their own.
    c10::cuda::CUDACachingAllocator::emptyCache();
    order(main, side);
    auto g = std::make_unique<at::cuda::CUDAGraph>();
    const auto pool = at::cuda::graph_pool_handle();
    std::string failure;
    bool ended = false;
    {
      c10::cuda::CUDAStreamGuard guard(side);
      try {
        // Thread-local: the loader's and the checkpoint writer's threads keep using CUDA meanwhile.
        g->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
        static_loss = step(static_input, static_target);
      } catch (const std::exception& e) {
        failure = first_line(e.what());
      }
      try {
        g->capture_end();
        ended = true;
      } catch (const std::exception& e) {
        if (failure.empty()) failure = first_line(e.what());
      }
    }
    if (!ended) abandon_capture(pool);
    (void)cudaGetLastError();  // a failed capture leaves its error code behind (not a sticky error)
    order(side, main);
    if (!failure.empty()) {
      g.reset();
      drop();
      return failure;
    }
    graph = std::move(g);
    ++captures;
    return "";
  }
#else
  Impl(torch::Device d, bool keep) : device(d), keep_if_faster(keep) {
    throw std::logic_error("StepGraph: this LibTorch has no CUDA, or is older than 2.4");
  }
  void drop() {}
#endif
};

StepGraph::StepGraph(torch::Device device, bool keep_if_faster) {
  if (!device.is_cuda()) throw std::logic_error("StepGraph: CUDA graphs need a CUDA device, not " + device.str());
  impl_ = std::make_unique<Impl>(device, keep_if_faster);
}

StepGraph::~StepGraph() = default;

torch::Tensor StepGraph::run(const torch::Tensor& input, const torch::Tensor& target, const Step& step) {
  Impl& m = *impl_;
#if TRAIN_CUDA_GRAPHS
  using Phase = Impl::Phase;
  const bool measuring = m.keep_if_faster && !m.decided;
  switch (m.phase) {
    case Phase::kEager: {
      const bool timed = measuring && m.eager_done >= kUntimedSteps;
      torch::Tensor loss = timed ? m.timed(m.eager_ms, [&] { return step(input, target); }) : step(input, target);
      ++m.eager_done;
      if (m.eager_done >= kUntimedSteps + (measuring ? kTimedSteps : 0)) m.phase = Phase::kSideWarm;
      return loss;
    }
    case Phase::kSideWarm: {
      // One eager step on the stream the capture will use, so that what a stream sets up on first
      // use (cuBLAS's workspace) is set up before the capture, not inside it.
      const c10::cuda::CUDAStream main = m.current();
      Impl::order(main, m.side);
      torch::Tensor loss;
      try {
        c10::cuda::CUDAStreamGuard guard(m.side);
        loss = step(input, target);
      } catch (...) {
        Impl::order(m.side, main);  // what the caller does next (out-of-memory recovery) follows it
        throw;
      }
      Impl::order(m.side, main);
      loss.record_stream(main.unwrap());
      m.phase = Phase::kCapture;
      return loss;
    }
    case Phase::kCapture: {
      const auto start = std::chrono::steady_clock::now();
      const std::string failure = m.capture(input, target, step);
      if (!failure.empty()) {
        m.phase = Phase::kOff;
        m.outcome = "the capture failed: " + failure;
        log::warn("cuda_graphs: capturing the training step failed (" + failure +
                  "); training goes on without a graph");
        return step(input, target);
      }
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      log::info(log::str("cuda_graphs: captured the training step in ", log::fixed(ms, 0),
                         " ms; replaying it from now on", measuring ? " (timing it against the eager step)" : ""));
      m.phase = measuring ? Phase::kMeasureReplay : Phase::kReplay;
      return m.replay(input, target);
    }
    case Phase::kMeasureReplay: {
      torch::Tensor loss = m.timed(m.replay_ms, [&] { return m.replay(input, target); });
      if (static_cast<int>(m.replay_ms.size()) >= kTimedSteps) {
        const double eager = median(m.eager_ms), replayed = median(m.replay_ms);
        const std::string numbers = log::str("median step ", log::fixed(eager, 2), " ms eager, ",
                                             log::fixed(replayed, 2), " ms replayed, ", kTimedSteps, " steps each");
        if (replayed <= (1 - kMinGain) * eager) {
          m.decided = true;
          m.phase = Phase::kReplay;
          log::info("cuda_graphs: kept (" + numbers + ")");
        } else {
          // The loss tensor lives in the graph's pool; the copy outlives the graph.
          loss = loss.clone();
          m.drop();
          m.phase = Phase::kOff;
          m.outcome = "dropped: no faster than the eager step (" + numbers + ")";
          log::info(log::str("cuda_graphs: dropped, replaying gains less than ", static_cast<int>(kMinGain * 100),
                             "% (", numbers, "); the step runs eagerly"));
        }
      }
      return loss;
    }
    case Phase::kReplay:
      return m.replay(input, target);
    case Phase::kOff:
      break;
  }
#endif
  return step(input, target);
}

void StepGraph::invalidate(const std::string& why) {
  Impl& m = *impl_;
  if (m.phase == Impl::Phase::kOff) return;
  const bool had_graph = m.phase == Impl::Phase::kReplay || m.phase == Impl::Phase::kMeasureReplay;
  m.drop();
  m.phase = Impl::Phase::kEager;
  m.eager_done = 0;
  m.eager_ms.clear();
  m.replay_ms.clear();
  if (had_graph) log::info("cuda_graphs: " + why + "; the step is captured again after warm-up");
}

void StepGraph::stop(const std::string& why) {
  Impl& m = *impl_;
  if (m.phase == Impl::Phase::kOff) return;
  m.drop();
  m.phase = Impl::Phase::kOff;
  m.outcome = "stopped: " + why;
  log::info("cuda_graphs: off for the rest of the run (" + why + ")");
}

bool StepGraph::active() const { return impl_->phase != Impl::Phase::kOff; }

bool StepGraph::replaying() const {
  return impl_->phase == Impl::Phase::kReplay || impl_->phase == Impl::Phase::kMeasureReplay;
}

int64_t StepGraph::replays() const { return impl_->replays; }

std::string StepGraph::summary() const {
  const Impl& m = *impl_;
  std::string text = log::str("replayed ", m.replays, " steps");
  if (m.captures > 1) text += log::str(" (", m.captures, " captures)");
  if (!m.eager_ms.empty() && !m.replay_ms.empty()) {
    const double eager = median(m.eager_ms), replayed = median(m.replay_ms);
    text += log::str("; median step ", log::fixed(eager, 2), " ms eager, ", log::fixed(replayed, 2), " ms replayed");
    if (replayed > 0) text += log::str(" (", log::fixed(eager / replayed, 2), "x)");
  }
  if (!m.outcome.empty()) text += "; " + m.outcome;
  return text;
}

}  // namespace train::detail
