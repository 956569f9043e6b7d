#pragma once
// The Dataset interface and the Batch that flows from the loader into the trainer.
#include <torch/types.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace train::data {

// One sample. `input` has no batch dimension; `target` is a 0-d int64 class index for
// classification, or a per-position int64 tensor (with -100 = ignore) for token tasks, or, for a
// model with its own loss (Model::has_own_loss), whatever that loss takes (a float for regression).
struct Example {
  torch::Tensor input;
  torch::Tensor target;
};

// A collated batch: leading dimension = number of samples.
struct Batch {
  torch::Tensor input;
  torch::Tensor target;
  int64_t size() const { return input.defined() ? input.size(0) : 0; }
  Batch to(const torch::Device& device, bool non_blocking = false) const {
    return Batch{input.to(device, non_blocking), target.to(device, non_blocking)};
  }
};

// Random access dataset. `get` must be safe to call from several threads at once, and its
// result must depend only on (index, epoch seed) so that delivery is identical for any
// worker count.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // `seed` is derived from (run seed, epoch, index) by the loader; augmentations draw from it.
  virtual Example get(int64_t index, uint64_t seed) const = 0;
  // get(), reading the sample's file whole where get() may read part of it (an image's rows below
  // a training crop), so that damage get() would meet with another seed is found now: for
  // `train check --data` (train/data/scan.h). The default is get().
  virtual Example get_checked(int64_t index, uint64_t seed) const { return get(index, seed); }
  // Collates samples into a batch. The default stacks inputs and targets.
  virtual Batch collate(std::vector<Example>&& examples) const;
  // A whole batch in one pass, for datasets that can write samples straight into the batch
  // (no per-sample tensors, no stack): must equal collate() of get(indices[i], seeds[i]) bit for
  // bit. `pinned` asks for the input in page-locked memory. The default, and a dataset without
  // such a path, returns no batch and the loader goes sample by sample; it also does so when this
  // throws, so that a bad sample is reported (or skipped) by its index as usual.
  virtual std::optional<Batch> get_batch(const std::vector<int64_t>& /*indices*/,
                                         const std::vector<uint64_t>& /*seeds*/, bool /*pinned*/) const {
    return std::nullopt;
  }
  // Shape of one input (no batch dim), for plans and probes.
  virtual std::vector<int64_t> input_shape() const = 0;
  virtual int64_t num_classes() const = 0;
  // The classes' names, by label, where the data names them (an ImageFolder's directories, a TSV
  // file's labels); empty otherwise. Errors about the class count list them.
  virtual std::vector<std::string> class_names() const { return {}; }
  virtual std::string describe() const = 0;
  // Token datasets: the size of the vocabulary the ids come from (every input id is below it), so
  // that a model's embedding can be checked against it before training; 0 for other data.
  virtual int64_t vocab_size() const { return 0; }
  // Token datasets: the id that pads samples, which the model must mask out of attention; -1 for
  // data without padding.
  virtual int64_t pad_id() const { return -1; }
  // Whether every batch has the same input shape. False for data whose collate() pads each batch
  // only to its own longest sequence: the plan then leaves cuDNN's benchmark mode off, which would
  // search for algorithms again at every new shape.
  virtual bool static_shapes() const { return true; }
  // Checks of the data as a whole that opening it leaves out because they read everything (a
  // token file's checksum), for `train check --data` (train/data/scan.h). DataError naming the
  // file; the default checks nothing.
  virtual void verify() const {}
  // A number that changes when the samples change, as far as the dataset can tell without reading
  // more than it reads to open (Fingerprint below): IDX, its images and labels; image_folder, its
  // list of classes and files; tsv, its texts and labels; tokens, the file's checksum. Checkpoints
  // record it, so that a run resumed on other data of the same size says so. 0 (the default):
  // unknown, not compared.
  virtual uint64_t fingerprint() const { return 0; }
};

// A 64-bit hash of what a dataset's samples come from, for Dataset::fingerprint: not
// cryptographic, and fast enough for tens of megabytes when a dataset opens (8 bytes per
// multiply). value() is never 0.
class Fingerprint {
 public:
  Fingerprint& add(const void* data, size_t size);
  Fingerprint& add(const std::string& text);  // with its length: ("ab", "c") differs from ("a", "bc")
  Fingerprint& add(int64_t value);
  uint64_t value() const;

 private:
  uint64_t hash_ = 0xcbf29ce484222325ULL;
};

inline Fingerprint& Fingerprint::add(const void* data, size_t size) {
  // FNV-1a's step on 8-byte words instead of bytes; value() mixes the bits afterwards.
  constexpr uint64_t kPrime = 0x100000001b3ULL;
  const auto* bytes = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes + i, 8);
    hash_ = (hash_ ^ word) * kPrime;
  }
  uint64_t tail = static_cast<uint64_t>(size) << 56;  // the length, so that trailing zeros count
  std::memcpy(&tail, bytes + i, size - i);  // at most 7 bytes: the length's byte stays
  hash_ = (hash_ ^ tail) * kPrime;
  return *this;
}

inline Fingerprint& Fingerprint::add(const std::string& text) {
  add(static_cast<int64_t>(text.size()));
  return add(text.data(), text.size());
}

inline Fingerprint& Fingerprint::add(int64_t value) { return add(&value, sizeof(value)); }

inline uint64_t Fingerprint::value() const {
  // MurmurHash3's finaliser: every input bit reaches every output bit.
  uint64_t h = hash_;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h == 0 ? 1 : h;
}

using DatasetPtr = std::shared_ptr<const Dataset>;

// Recycles the memory of large CPU batch tensors. Without it each batch of, say, 64 ImageNet
// crops (38 MB) is mapped fresh, faulted in page by page and unmapped when freed: about a tenth
// of an image pipeline's time. A tensor from empty() hands its memory back here when the last
// reference to it goes, on any thread, and the next empty() of the same size reuses it. At most
// `keep` free buffers are held; the rest are freed. Thread-safe. Pinned memory needs none of
// this: the CUDA host allocator caches its blocks already.
class BatchMemory {
 public:
  explicit BatchMemory(size_t keep = 8);
  torch::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) const;

 private:
  struct Pool;
  std::shared_ptr<Pool> pool_;
};

}  // namespace train::data
