#pragma once
// safetensors files (https://github.com/huggingface/safetensors): the weights format shared with
// PyTorch, torchvision and Hugging Face, and module state dicts by name.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"<name>": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string>", ...}}
// then one contiguous little-endian byte buffer; offsets are relative to its start, and the
// tensors cover it exactly (no gaps, no overlaps, no trailing bytes).
// dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
//
// Names are the module's state-dict names: parameters and buffers in one namespace, as PyTorch's
// `module.state_dict()` has them, so `conv1.weight`, `bn1.running_mean`, `layer1.0.conv1.weight`
// of a train ResNet are torchvision's names.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace train {

using TensorMap = std::map<std::string, torch::Tensor>;
using Metadata = std::map<std::string, std::string>;

// Reads every tensor (as a CPU tensor of the file's dtype) and, when `metadata` is given, the
// `__metadata__` strings. A missing, truncated or malformed file throws CheckpointError (exit
// code 2) naming the file and, where one is at fault, the tensor's key.
TensorMap read_safetensors(const std::string& path, Metadata* metadata = nullptr);

// Writes the tensors (any device; written from a contiguous CPU copy) and metadata. The file is
// written atomically: a reader sees the previous file or the complete new one. Throws Error on
// an I/O failure, CheckpointError for a dtype the format cannot hold or a reserved name.
void write_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata = {});

// The module's parameters and buffers by state-dict name (detached; they share storage with the
// module).
TensorMap state_dict(const torch::nn::Module& module);

struct LoadReport {
  std::vector<std::string> loaded;      // copied into the module
  std::vector<std::string> missing;     // in the module, not in the tensors
  std::vector<std::string> unexpected;  // in the tensors, not in the module
  std::vector<std::string> mismatched;  // "<key>: file [a,b], model [c,d]" (shape differs)
  // A base-model prefix the file's keys had and the module's do not, e.g. "bert." for a Hugging
  // Face BertForMaskedLM or BertForSequenceClassification checkpoint; "" when none was removed.
  std::string stripped_prefix;
  bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // One line per problem kind, e.g. "missing: fc.weight, fc.bias; unexpected: head.weight".
  std::string summary() const;
};

// Copies tensors into the module's parameters and buffers by name, converting the dtype and
// device to the module's. Keys "<prefix>.<name>" whose <name> is the module's, and which the
// file does not also hold without the prefix, are read as <name> when one such prefix accounts
// for all of them: Hugging Face head models save their encoder under "bert." and their heads
// ("cls.", "classifier.") at the top level, where train's BERT has both. strict: any missing or unexpected key or shape mismatch throws
// CheckpointError naming `source` and the keys, and the module is left untouched. Not strict:
// the matching entries are loaded and the rest is listed in the returned report.
LoadReport load_state_dict(torch::nn::Module& module, const TensorMap& tensors, bool strict,
                           const std::string& source = "state dict");

// What load_state_dict would load, and the same error when strict, without touching the module.
LoadReport match_state_dict(const torch::nn::Module& module, const TensorMap& tensors, bool strict,
                            const std::string& source = "state dict");

}  // namespace train
