#pragma once
// The trainer's training step captured in a CUDA graph and replayed (tuning.cuda_graphs; the plan
// decides where it applies). Internal: the trainer drives it.
#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>

namespace train::detail {

// A step is captured once, after warm-up steps run eagerly, and every later step copies its
// batch into the captured input tensors and replays the graph: the CPU launches one graph instead
// of every kernel of the forward, backward and optimizer step. The step must read everything that
// changes between steps from device tensors (the learning rate included) and must not wait for the
// device; the caller keeps the parameters' gradients and the optimizer's state where the capture
// left them until it calls invalidate().
//
// Where it pays off is measured, not assumed: with keep_if_faster, eager and replayed steps are
// timed (five each, after the warm-up) and the graph is dropped unless replaying is at least 3 %
// faster; the decision is logged with both medians.
class StepGraph {
 public:
  // One whole training step on the current stream, gradients dropped first (so that inside the
  // capture the backward pass allocates them from the graph's memory pool); returns the loss
  // (0-dim, on the device).
  using Step = std::function<torch::Tensor(const torch::Tensor& input, const torch::Tensor& target)>;

  // Throws std::logic_error for a device other than CUDA or a LibTorch without CUDA.
  StepGraph(torch::Device device, bool keep_if_faster);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Runs the step on (input, target): eagerly while warming up and measuring, captured once, then
  // replayed. Returns the loss, valid until the next call. What an eager step throws (out of
  // memory included) propagates. A capture that fails is logged with its cause; that step and
  // every later one run eagerly, and active() turns false.
  torch::Tensor run(const torch::Tensor& input, const torch::Tensor& target, const Step& step);

  // The gradients or the optimizer's state were replaced (a rollback to a checkpoint): drops the
  // graph; the next steps warm up and capture again (without measuring again).
  void invalidate(const std::string& why);
  // No graph for the rest of the run (the step changed: accumulation after an out-of-memory error).
  void stop(const std::string& why);

  bool active() const;     // false once stopped, dropped as slower, or after a failed capture
  bool replaying() const;  // the next run() replays a captured graph
  int64_t replays() const;  // steps replayed so far
  // For the end of the run: "replayed 1860 of 1872 steps (eager 9.14 ms, replay 3.02 ms: 3.03x)".
  std::string summary() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace train::detail
