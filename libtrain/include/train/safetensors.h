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

#include <functional>
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

// How a model's weights relate to files written for its relatives, for starting one model from
// another's weights (model.init_from): a pretrained backbone under a new task head. Empty rules
// ask for an exact match.
struct WeightRules {
  // Prefixes of the model's task head ("fc." of a ResNet, "pooler." and "classifier." of a BERT
  // classifier). A head tensor that the file lacks, or holds with another shape (another class
  // count), keeps its initialisation and is reported as fresh, not as missing or mismatched.
  std::vector<std::string> head;
  // Prefixes of heads that other variants of the architecture carry and this model does not
  // ("cls." of a masked-LM BERT, read by a classifier): file tensors under them are reported as
  // unused, not as unexpected.
  std::vector<std::string> other_heads;
  // True for a file tensor that the model has no place for and that repeats what the file says
  // elsewhere: a tied copy (BERT's MLM decoder, equal to the word embeddings), or a buffer with a
  // fixed value (position_ids = 0, 1, 2, ...). `file` holds the tensors under the model's names.
  std::function<bool(const std::string& key, const torch::Tensor& value, const TensorMap& file)> redundant;
  // Other names files give the model's tensors, as (file suffix, model suffix): a file key equal
  // to the first or ending in "." and the first is read with that end replaced by the second,
  // unless the file also holds the new name. BERT checkpoints ported from Google's TensorFlow ones
  // (bert-base-uncased among them) call a LayerNorm's weight and bias "gamma" and "beta", which
  // Hugging Face renames on load the same way. Applied before the prefix rule of load_state_dict,
  // to every key (a head's too), so the other rules see the model's names.
  std::vector<std::pair<std::string, std::string>> renames;
};

struct LoadReport {
  std::vector<std::string> loaded;      // copied into the module
  std::vector<std::string> missing;     // in the module, not in the tensors
  std::vector<std::string> unexpected;  // in the tensors, not in the module
  std::vector<std::string> mismatched;  // "<key>: file [a,b], model [c,d]" (shape differs)
  // With WeightRules, none of which is a problem: head tensors that keep their initialisation
  // ("<key>: not in the file" or "<key>: file [a,b], model [c,d]"), file tensors of other heads,
  // and redundant file tensors (tied copies, fixed buffers), none of them loaded.
  std::vector<std::string> fresh;
  std::vector<std::string> unused;
  std::vector<std::string> redundant;
  // A base-model prefix the file's keys had and the module's do not, e.g. "bert." for a Hugging
  // Face BertForMaskedLM or BertForSequenceClassification checkpoint; "" when none was removed.
  std::string stripped_prefix;
  // The WeightRules::renames that at least one file key was read under, in the rules' order,
  // e.g. {"LayerNorm.gamma", "LayerNorm.weight"}; empty when none was.
  std::vector<std::pair<std::string, std::string>> renamed;
  bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // One line per problem kind, e.g. "missing: fc.weight, fc.bias; unexpected: head.weight".
  std::string summary() const;
};

// Copies tensors into the module's parameters and buffers by name, converting the dtype and
// device to the module's: one floating-point dtype to another (F16 or BF16 into F32), but never an
// integer or bool tensor into a floating-point one, which throws CheckpointError naming `source`,
// the file's key and both dtypes, strict or not: such a tensor holds no weights (a file written
// wrongly, or a key that means something else there).
// When the module's names appear in the file under one prefix (keys "<prefix>.<name>" whose
// <name> is the module's, and which the file does not also hold without it), every key under that
// prefix is read without it: Hugging Face head models save their encoder under "bert." and their
// heads ("cls.", "classifier.") at the top level, where train's BERT has both. `rules` sort out the
// differences expected between a pretrained model and a fine-tuned one (see WeightRules).
// strict: any missing or unexpected key or shape mismatch throws CheckpointError naming `source`
// and the keys, and the module is left untouched. Not strict: the matching entries are loaded and
// the rest is listed in the returned report.
LoadReport load_state_dict(torch::nn::Module& module, const TensorMap& tensors, bool strict,
                           const std::string& source = "state dict", const WeightRules& rules = {});

// What load_state_dict would load, and the same errors, without touching the module.
LoadReport match_state_dict(const torch::nn::Module& module, const TensorMap& tensors, bool strict,
                            const std::string& source = "state dict", const WeightRules& rules = {});

}  // namespace train
