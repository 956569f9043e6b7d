// Fuzz target: the checkpoint reader (a LibTorch serialize archive: zip + pickle) as `train eval`,
// `--resume` and `train export` use it.
// Input: one checkpoint file, read for its weights and loaded into a small model with SGD and
// with AdamW.
// LibTorch's own reader is not instrumented; the fuzzer checks that whatever it makes of the file
// ends in a CheckpointError and never in another exception or a crash in train's code.
#include <train/checkpoint.h>
#include <train/errors.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "fuzz_input.h"

namespace {
// The seed checkpoints hold this model: fc1 (Linear 4 -> 3), bn (BatchNorm1d 3), fc2 (Linear 3 -> 2).
struct Tiny : torch::nn::Module {
  Tiny() {
    register_module("fc1", torch::nn::Linear(4, 3));
    register_module("bn", torch::nn::BatchNorm1d(3));
    register_module("fc2", torch::nn::Linear(3, 2));
  }
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = train::fuzz::write_scratch("step_00000001.pt", data, size);
  try {
    (void)train::read_checkpoint_weights(path);
  } catch (const train::Error&) {
  }
  try {
    Tiny model;
    torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    (void)train::load_checkpoint(path, model, &optimizer);
  } catch (const train::Error&) {
  }
  try {  // the per-parameter state of Adam-family optimizers (exp_avg, exp_avg_sq, step)
    Tiny model;
    torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-3));
    (void)train::load_checkpoint(path, model, &optimizer);
  } catch (const train::Error&) {
  }
  return 0;
}
