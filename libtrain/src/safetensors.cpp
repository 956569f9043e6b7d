#include "train/safetensors.h"

#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "atomic_file.h"
#include "train/errors.h"
#include "train/files.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian data; this reader copies it as is");

namespace train {
namespace {

using json = nlohmann::json;

// The format's header limit (the reference implementation rejects larger headers too).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DType {
  const char* name;
  torch::ScalarType type;
  int64_t size;
};

constexpr DType kDTypes[] = {
    {"F64", torch::kDouble, 8}, {"F32", torch::kFloat, 4},  {"F16", torch::kHalf, 2},
    {"BF16", torch::kBFloat16, 2}, {"I64", torch::kLong, 8}, {"I32", torch::kInt, 4},
    {"I16", torch::kShort, 2},  {"I8", torch::kChar, 1},    {"U8", torch::kByte, 1},
    {"BOOL", torch::kBool, 1},
};

const DType* dtype_by_name(const std::string& name) {
  for (const auto& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

const DType* dtype_by_type(torch::ScalarType type) {
  for (const auto& d : kDTypes)
    if (type == d.type) return &d;
  return nullptr;
}

std::string supported_dtypes() {
  std::string s;
  for (const auto& d : kDTypes) s += (s.empty() ? "" : " ") + std::string(d.name);
  return s;
}

std::string shape_str(torch::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

// One tensor's header entry, validated on its own (offsets are checked against the others later).
struct Entry {
  std::string name;
  const DType* dtype = nullptr;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

Entry parse_entry(const std::string& path, const std::string& name, const json& value) {
  auto fail = [&](const std::string& why) -> CheckpointError {
    return CheckpointError(path + ": tensor '" + name + "': " + why);
  };
  if (!value.is_object()) throw fail("header entry is not an object");
  Entry e;
  e.name = name;
  const auto dtype = value.find("dtype");
  const auto shape = value.find("shape");
  const auto offsets = value.find("data_offsets");
  if (dtype == value.end() || shape == value.end() || offsets == value.end()) {
    throw fail("header entry needs dtype, shape and data_offsets");
  }
  if (!dtype->is_string()) throw fail("dtype is not a string");
  e.dtype = dtype_by_name(dtype->get<std::string>());
  if (!e.dtype) {
    throw fail("unsupported dtype '" + dtype->get<std::string>() + "' (supported: " + supported_dtypes() + ")");
  }
  if (!shape->is_array()) throw fail("shape is not an array");
  uint64_t elements = 1;
  for (const auto& d : *shape) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      throw fail("shape " + shape->dump() + " has an entry that is not a non-negative integer");
    }
    if (__builtin_mul_overflow(elements, d.get<uint64_t>(), &elements)) throw fail("shape " + shape->dump() + " overflows");
    e.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  if (!offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    throw fail("data_offsets must be two non-negative integers [begin, end], got " + offsets->dump());
  }
  e.begin = (*offsets)[0].get<uint64_t>();
  e.end = (*offsets)[1].get<uint64_t>();
  if (e.end < e.begin) throw fail("data_offsets " + offsets->dump() + " end before they begin");
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(elements, static_cast<uint64_t>(e.dtype->size), &bytes) || bytes != e.end - e.begin) {
    throw fail("shape " + shape_str(e.shape) + " of " + e.dtype->name + " needs " + std::to_string(bytes) +
               " bytes, data_offsets " + offsets->dump() + " hold " + std::to_string(e.end - e.begin));
  }
  return e;
}

}  // namespace

TensorMap read_safetensors(const std::string& path, Metadata* metadata) {
  if (!files::is_regular_file(path)) {
    throw CheckpointError(path + (files::exists(path) ? ": not a regular file" : ": safetensors file does not exist"));
  }
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) throw CheckpointError(path + ": cannot open: " + std::strerror(errno));
  const int64_t file_size = files::file_size(path);
  uint8_t len_bytes[8];
  if (file_size < 8 || std::fread(len_bytes, 1, 8, f.get()) != 8) {
    throw CheckpointError(path + ": not a safetensors file (" + std::to_string(file_size) +
                          " bytes, too short for the 8-byte header length)");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  const uint64_t after_len = static_cast<uint64_t>(file_size) - 8;
  if (header_len > after_len) {
    throw CheckpointError(path + ": header length " + std::to_string(header_len) + " runs past the end of the file (" +
                          std::to_string(file_size) + " bytes); truncated, or not a safetensors file");
  }
  if (header_len > kMaxHeaderBytes || header_len < 2) {
    throw CheckpointError(path + ": header length " + std::to_string(header_len) +
                          " is implausible (2 to 100000000 bytes); not a safetensors file");
  }
  std::string header(header_len, '\0');
  if (std::fread(header.data(), 1, header_len, f.get()) != header_len) {
    throw CheckpointError(path + ": cannot read the " + std::to_string(header_len) + "-byte header");
  }

  // Parse, rejecting duplicate top-level keys (JSON parsers differ on which one wins).
  json root;
  std::set<std::string> seen;
  std::string duplicate;
  try {
    root = json::parse(header, [&](int depth, json::parse_event_t event, json& parsed) {
      if (depth == 1 && event == json::parse_event_t::key) {
        const auto key = parsed.get<std::string>();
        if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
      }
      return true;
    });
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number too large
    std::string what = e.what();
    const auto msg = what.find("] ");
    throw CheckpointError(path + ": header is not valid JSON: " + (msg == std::string::npos ? what : what.substr(msg + 2)));
  }
  if (!root.is_object()) throw CheckpointError(path + ": header is not a JSON object");
  if (!duplicate.empty()) throw CheckpointError(path + ": tensor '" + duplicate + "' appears twice in the header");

  std::vector<Entry> entries;
  for (const auto& [name, value] : root.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw CheckpointError(path + ": __metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) throw CheckpointError(path + ": __metadata__ '" + k + "' is not a string");
        if (metadata) (*metadata)[k] = v.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, value));
  }

  // The tensors must tile the buffer exactly, in offset order.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const uint64_t buffer_size = after_len - header_len;
  uint64_t expected = 0;
  for (const auto& e : entries) {
    if (e.begin != expected) {
      throw CheckpointError(path + ": tensor '" + e.name + "': data_offsets [" + std::to_string(e.begin) + "," +
                            std::to_string(e.end) + "] " + (e.begin < expected ? "overlap the previous tensor" :
                            "leave a gap after the previous tensor") + " (expected to begin at " +
                            std::to_string(expected) + ")");
    }
    if (e.end > buffer_size) {
      throw CheckpointError(path + ": tensor '" + e.name + "': data_offsets end at " + std::to_string(e.end) +
                            ", past the " + std::to_string(buffer_size) + "-byte data buffer (truncated file?)");
    }
    expected = e.end;
  }
  if (expected != buffer_size) {
    throw CheckpointError(path + ": " + std::to_string(buffer_size - expected) +
                          " bytes after the last tensor belong to no tensor");
  }

  TensorMap out;
  for (const auto& e : entries) {
    // BOOL bytes are read as U8 and normalised: a byte other than 0/1 is not a valid C++ bool.
    const auto read_type = e.dtype->type == torch::kBool ? torch::kByte : e.dtype->type;
    torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(read_type));
    const size_t n = e.end - e.begin;
    if (n > 0 && std::fread(t.data_ptr(), 1, n, f.get()) != n) {
      throw CheckpointError(path + ": tensor '" + e.name + "': cannot read its " + std::to_string(n) + " bytes");
    }
    if (e.dtype->type == torch::kBool) t = t.ne(0);
    out.emplace(e.name, std::move(t));
  }
  return out;
}

void write_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  json header = json::object();
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::vector<torch::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__") throw CheckpointError(path + ": '__metadata__' is reserved and cannot name a tensor");
    if (!tensor.defined()) throw CheckpointError(path + ": tensor '" + name + "' is undefined");
    const DType* dtype = dtype_by_type(tensor.scalar_type());
    if (!dtype) {
      throw CheckpointError(path + ": tensor '" + name + "' has dtype " + std::string(c10::toString(tensor.scalar_type())) +
                            ", which safetensors files here cannot hold (supported: " + supported_dtypes() + ")");
    }
    torch::Tensor t = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(dtype->size);
    header[name] = {{"dtype", dtype->name}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data buffer starts 8-byte aligned
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  detail::write_atomically(path, [&](const auto& sink) {
    sink(len_bytes, 8);
    sink(text.data(), text.size());
    for (const auto& t : data) {
      if (t.numel() > 0) sink(t.data_ptr(), t.numel() * t.element_size());
    }
  });
}

TensorMap state_dict(const torch::nn::Module& module) {
  TensorMap out;
  for (const auto& p : module.named_parameters()) out.emplace(p.key(), p.value().detach());
  for (const auto& b : module.named_buffers()) out.emplace(b.key(), b.value().detach());
  return out;
}

std::string LoadReport::summary() const {
  std::string s;
  auto list = [&](const char* label, const std::vector<std::string>& keys) {
    if (keys.empty()) return;
    s += (s.empty() ? "" : "; ") + std::string(label) + ": ";
    for (size_t i = 0; i < keys.size(); ++i) s += (i ? ", " : "") + keys[i];
  };
  list("missing", missing);
  list("unexpected", unexpected);
  list("shape mismatch", mismatched);
  return s;
}

namespace {
bool has_prefix(const std::string& name, const std::vector<std::string>& prefixes) {
  return std::any_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return name.compare(0, p.size(), p) == 0; });
}

// `name` is `suffix`, or ends in "." and `suffix`: whole name components, so that a rename of
// "LayerNorm.gamma" leaves "encoder.MyLayerNorm.gamma" alone.
bool ends_with_component(const std::string& name, const std::string& suffix) {
  if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  return name.size() == suffix.size() || name[name.size() - suffix.size() - 1] == '.';
}

// The file's tensors under the module's names, and for each renamed one the file's own key.
struct Aligned {
  TensorMap tensors;
  std::map<std::string, std::string> file_key;  // module-side name -> the file's key, where they differ
  const std::string& key_in_file(const std::string& name) const {
    const auto it = file_key.find(name);
    return it == file_key.end() ? name : it->second;
  }
};

// WeightRules::renames, then the prefix rule of load_state_dict; records both in the report.
Aligned aligned_names(const TensorMap& targets, const TensorMap& file, const WeightRules& rules, LoadReport& report) {
  // Renames first, so that the prefix rule below counts the renamed keys as the module's names
  // (a file whose only keys under "bert." were gamma/beta ones would otherwise keep the prefix).
  Aligned renamed;
  std::vector<bool> rule_used(rules.renames.size(), false);
  for (const auto& [name, tensor] : file) {
    std::string key = name;
    for (size_t r = 0; r < rules.renames.size(); ++r) {
      const auto& [from, to] = rules.renames[r];
      if (!ends_with_component(name, from)) continue;
      const std::string candidate = name.substr(0, name.size() - from.size()) + to;
      // A file that holds both names (or two keys that rename to one) is taken as it is: which
      // tensor is meant is not ours to guess, and a strict load then names the extra key.
      if (!file.count(candidate) && !renamed.tensors.count(candidate)) {
        key = candidate;
        rule_used[r] = true;
      }
      break;
    }
    if (key != name) renamed.file_key.emplace(key, name);
    renamed.tensors.emplace(key, tensor);
  }
  report.renamed.clear();
  for (size_t r = 0; r < rules.renames.size(); ++r)
    if (rule_used[r]) report.renamed.push_back(rules.renames[r]);

  const TensorMap& tensors = renamed.tensors;
  std::map<std::string, int> prefixes;  // prefix -> keys it would rename
  for (const auto& [name, tensor] : tensors) {
    const auto dot = name.find('.');
    if (targets.count(name) || dot == std::string::npos) continue;
    const std::string rest = name.substr(dot + 1);
    if (targets.count(rest) && !tensors.count(rest)) ++prefixes[name.substr(0, dot + 1)];
  }
  report.stripped_prefix.clear();
  if (prefixes.size() != 1) return renamed;  // none, or ambiguous: names are taken as they are
  const std::string stripped = report.stripped_prefix = prefixes.begin()->first;
  Aligned out;
  for (const auto& [name, tensor] : tensors) {
    // Every key under the prefix, also those the module lacks (a head model's pooler, old
    // position_ids), so that the rules see the base model's names.
    const bool strip =
        name.rfind(stripped, 0) == 0 && !targets.count(name) && !tensors.count(name.substr(stripped.size()));
    const std::string key = strip ? name.substr(stripped.size()) : name;
    if (key != name || renamed.file_key.count(name)) out.file_key.emplace(key, renamed.key_in_file(name));
    out.tensors.emplace(key, tensor);
  }
  return out;
}

// safetensors' name for a dtype, else LibTorch's (a .pt checkpoint may hold others).
std::string dtype_name(torch::ScalarType type) {
  const DType* d = dtype_by_type(type);
  return d ? d->name : std::string(c10::toString(type));
}

// Sorts every name of the module and of the file into the report; returns the file's tensors
// under the module's names. An integer or bool file tensor for a floating-point module tensor is
// an error here, strict or not (see load_state_dict): copy_ would turn token ids or flags into
// "weights" without a word.
// The module's parameter names: the weights that must be finite (a buffer may hold -inf, an
// attention mask's say).
std::set<std::string> parameter_names(const torch::nn::Module& module) {
  std::set<std::string> names;
  for (const auto& p : module.named_parameters()) names.insert(p.key());
  return names;
}

TensorMap match(const TensorMap& targets, const TensorMap& file_tensors, const WeightRules& rules,
                const std::set<std::string>& parameters, const std::string& source, LoadReport& report) {
  const Aligned aligned = aligned_names(targets, file_tensors, rules, report);
  const TensorMap& tensors = aligned.tensors;
  for (const auto& [name, target] : targets) {
    const auto it = tensors.find(name);
    const bool head = has_prefix(name, rules.head);
    if (it == tensors.end()) {
      (head ? report.fresh : report.missing).push_back(head ? name + ": not in the file" : name);
    } else if (it->second.sizes() != target.sizes()) {
      const std::string shapes = ": file " + shape_str(it->second.sizes()) + ", model " + shape_str(target.sizes());
      (head ? report.fresh : report.mismatched).push_back(name + shapes);
    } else if (target.is_floating_point() && !it->second.is_floating_point()) {
      const std::string& key = aligned.key_in_file(name);
      throw CheckpointError(source + ": tensor '" + key + "' is " + dtype_name(it->second.scalar_type()) +
                            ", but the model's '" + name + "' is " + dtype_name(target.scalar_type()) +
                            ": integer and bool tensors are not converted to floating-point weights");
    } else if (parameters.count(name) && it->second.is_floating_point() &&
               !torch::isfinite(it->second).all().item<bool>()) {
      throw CheckpointError(source + ": tensor '" + aligned.key_in_file(name) +
                            "' holds NaN or infinite values (the weights of a run that diverged, or a damaged "
                            "file); a model made from it gives a non-finite loss at the first step");
    } else {
      report.loaded.push_back(name);
    }
  }
  for (const auto& [name, tensor] : tensors) {
    if (targets.count(name)) continue;
    if (rules.redundant && rules.redundant(name, tensor, tensors)) {
      report.redundant.push_back(name);
    } else if (has_prefix(name, rules.other_heads)) {
      report.unused.push_back(name);
    } else {
      report.unexpected.push_back(name);
    }
  }
  return tensors;
}

void throw_if_incomplete(const LoadReport& report, const std::string& source) {
  if (report.complete()) return;
  constexpr size_t kShown = 8;
  std::string why;
  auto add = [&](const std::string& item) { why += (why.empty() ? "" : "; ") + item; };
  auto list = [&](const char* label, const std::vector<std::string>& keys) {
    for (size_t i = 0; i < std::min(keys.size(), kShown); ++i) add(std::string(label) + " '" + keys[i] + "'");
    if (keys.size() > kShown) add("... " + std::to_string(keys.size() - kShown) + " more " + label + "s");
  };
  list("missing key", report.missing);
  list("unexpected key", report.unexpected);
  for (size_t i = 0; i < std::min(report.mismatched.size(), kShown); ++i) {
    const auto& m = report.mismatched[i];
    const auto colon = m.find(": ");
    add("shape mismatch for '" + m.substr(0, colon) + "' (" + m.substr(colon + 2) + ")");
  }
  if (report.mismatched.size() > kShown) {
    add("... " + std::to_string(report.mismatched.size() - kShown) + " more shape mismatches");
  }
  if (!report.stripped_prefix.empty()) add("(keys '" + report.stripped_prefix + "*' were read without that prefix)");
  for (const auto& [from, to] : report.renamed) add("(keys '*" + from + "' were read as '*" + to + "')");
  throw CheckpointError(source + ": weights do not match the model: " + why);
}
}  // namespace

LoadReport match_state_dict(const torch::nn::Module& module, const TensorMap& file_tensors, bool strict,
                            const std::string& source, const WeightRules& rules) {
  LoadReport report;
  match(state_dict(module), file_tensors, rules, parameter_names(module), source, report);
  if (strict) throw_if_incomplete(report, source);
  return report;
}

LoadReport load_state_dict(torch::nn::Module& module, const TensorMap& tensors, bool strict, const std::string& source,
                           const WeightRules& rules) {
  LoadReport report;
  const TensorMap targets = state_dict(module);
  const TensorMap aligned = match(targets, tensors, rules, parameter_names(module), source, report);
  if (strict) throw_if_incomplete(report, source);
  torch::NoGradGuard no_grad;
  for (const auto& name : report.loaded) {
    // state_dict() tensors are detached views sharing the module's storage.
    torch::Tensor target = targets.at(name);
    target.copy_(aligned.at(name));
  }
  return report;
}

}  // namespace train
