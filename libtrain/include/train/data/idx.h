#pragma once
// The IDX format of MNIST and Fashion-MNIST: unsigned-byte images (idx3-ubyte) and labels
// (idx1-ubyte), plain or gzip-compressed.
//
// Layout: two zero bytes, the type code 0x08 (unsigned byte), the number of dimensions, one
// big-endian uint32 per dimension, then the row-major payload. Every malformation (bad magic,
// wrong rank, truncated or oversized file, label out of range) is a DataError naming the file.
#include <train/data/dataset.h>
#include <train/data/transforms.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace train::data {

// The classes of MNIST and Fashion-MNIST.
constexpr int64_t kIdxNumClasses = 10;

// `dir/stem` if it exists, else `dir/stem.gz`; DataError naming both when neither does.
std::string find_data_file(const std::string& dir, const std::string& stem);

// Reads an idx3-ubyte file into a uint8 tensor [N, 1, H, W].
torch::Tensor read_idx_images(const std::string& path);

// Reads an idx1-ubyte file into an int64 tensor [N]; every label must be < num_classes.
torch::Tensor read_idx_labels(const std::string& path, int64_t num_classes = kIdxNumClasses);

// The shape {N, H, W} an idx3-ubyte file's header declares, read without its payload (a gzip
// file's first bytes only). DataError as read_idx_images for a bad header.
std::vector<int64_t> read_idx_image_dims(const std::string& path);

// JPEG or PNG files as IDX images, the inputs a model trained on IDX data predicts on: each is
// decoded, resized (shorter side) and center-cropped to side x side as image_folder's validation
// split is (an image of that size is taken as it is), then converted to grayscale as PIL's
// convert("L") does (a grayscale file keeps its values). uint8 [N, 1, side, side]. DataError
// naming a file that is missing or cannot be decoded.
torch::Tensor read_images_as_idx(const std::vector<std::string>& paths, int64_t side);

// Single-channel images held in memory as uint8. get() returns a float [1, H, W] input scaled
// to [0, 1] and then transformed, and a 0-d int64 target.
class IdxDataset : public Dataset {
 public:
  // Takes file paths (see find_data_file); the image and label counts must agree.
  IdxDataset(const std::string& images_file, const std::string& labels_file,
             ImageTransforms transforms = {});
  // Images and labels already in memory: uint8 [N, 1, H, W] and int64 [N] (labels may be -100,
  // no target); `source` names them in describe() and errors.
  IdxDataset(torch::Tensor images, torch::Tensor labels, ImageTransforms transforms, std::string source);

  int64_t size() const override { return labels_.size(0); }
  Example get(int64_t index, uint64_t seed) const override;
  // Normalisation-only transforms: the table lookup of get() written straight into the batch.
  std::optional<Batch> get_batch(const std::vector<int64_t>& indices, const std::vector<uint64_t>& seeds,
                                 bool pinned) const override;
  std::vector<int64_t> input_shape() const override;
  int64_t num_classes() const override { return kIdxNumClasses; }
  std::string describe() const override;
  uint64_t fingerprint() const override { return fingerprint_; }  // of the images and labels

  const torch::Tensor& images() const { return images_; }  // uint8 [N, 1, H, W]
  const torch::Tensor& labels() const { return labels_; }  // int64 [N]

 private:
  void prepare_tables();

  std::string images_file_;
  torch::Tensor images_;
  torch::Tensor labels_;
  ImageTransforms transforms_;
  // A sample's pixel values by byte value: x / 255, and the same normalised when the transforms
  // are a normalisation alone (then get() needs no tensor ops).
  std::array<float, 256> scaled_{};
  std::array<float, 256> normalized_{};
  bool normalize_only_ = false;
  uint64_t fingerprint_ = 0;
};

}  // namespace train::data
