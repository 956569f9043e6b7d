// Fuzz target: the safetensors reader (8-byte length, JSON header, data buffer) and loading what
// it reads into a module by state-dict name (model.init_from).
// Input: one .safetensors file.
// Property: every tensor read is a contiguous CPU tensor; loading them, strict or not, ends in a
// LoadReport or a CheckpointError.
#include <train/checkpoint.h>
#include <train/errors.h>
#include <train/safetensors.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "fuzz_input.h"

namespace {
struct Tiny : torch::nn::Module {
  Tiny() {
    register_module("fc1", torch::nn::Linear(4, 3));
    register_module("bn", torch::nn::BatchNorm1d(3));
    register_module("fc2", torch::nn::Linear(3, 2));
  }
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = train::fuzz::write_scratch("weights.safetensors", data, size);
  try {
    train::Metadata metadata;
    const train::TensorMap tensors = train::read_safetensors(path, &metadata);
    for (const auto& [name, t] : tensors) {
      if (!t.defined() || !t.is_contiguous() || t.device() != torch::kCPU) {
        train::fuzz::violated("read_safetensors: tensor '" + name + "' is not a contiguous CPU tensor");
      }
    }
    Tiny model;
    (void)train::load_state_dict(model, tensors, /*strict=*/false, path);
    Tiny strict_model;
    train::load_model_weights(path, strict_model, /*strict=*/true);
  } catch (const train::Error&) {
  }
  return 0;
}
