#pragma once
// Per-sample image transforms, and the small PRNG that they and the loader's shuffle draw from.
//
// All randomness comes from an explicit seed, never from torch's global generator: loader
// workers run concurrently, and a sample must come out the same whichever thread loads it, in
// whatever order, on every LibTorch version.
#include <train/data/dataset.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace train::data {

// splitmix64's output function: a bijective 64-bit mix with full avalanche, used to derive
// independent seeds from structured inputs (run seed, epoch, index).
constexpr uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The splitmix64 generator: tiny state, cheap to create per sample, same stream everywhere.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    const uint64_t out = mix64(state_);
    state_ += 0x9E3779B97F4A7C15ull;
    return out;
  }

  // Uniform integer in [0, bound) for bound > 0, without modulo bias: draws below
  // 2^64 mod bound are rejected so the remaining range is a multiple of bound.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t x = next();
      if (x >= threshold) return x % bound;
    }
  }

  // Uniform float in [0, 1) with 24 random bits (a float's full mantissa).
  float uniform() { return static_cast<float>(next() >> 40) * 0x1.0p-24f; }

 private:
  uint64_t state_;
};

// Zero-pads a [C,H,W] image by `padding` on every side, then returns the HxW window whose
// top-left corner is (top, left) in the padded image; 0 <= top, left <= 2 * padding.
// (padding, padding) gives back the original image.
torch::Tensor pad_crop(const torch::Tensor& image, int64_t padding, int64_t top, int64_t left);

// Mirrors a [C,H,W] image left to right.
torch::Tensor hflip(const torch::Tensor& image);

// (image - mean[c]) / stddev[c] per channel of a float [C,H,W] image.
torch::Tensor normalize(const torch::Tensor& image, const std::vector<double>& mean,
                        const std::vector<double>& stddev);

// Turns a batch of uint8 images [B, C, H, W] (ImageFolder with data.uint8) into normalised
// floats where it lives, typically after the copy to the GPU, which then moves a quarter of the
// bytes: (input / 255 - mean[c]) / stddev[c] as `dtype`. A floating-point input is taken to be
// in [0, 1] already and only normalised. Empty mean / stddev = scaling only. The target is kept.
// std::invalid_argument when the input is not 4-d or mean / stddev do not have one value per
// channel.
Batch normalize_on_device(const Batch& batch, const std::vector<double>& mean,
                          const std::vector<double>& stddev, torch::ScalarType dtype = torch::kFloat);

// A rectangle of an image, in pixels.
struct CropBox {
  int64_t top = 0;
  int64_t left = 0;
  int64_t height = 0;
  int64_t width = 0;
};

// The crop of torchvision's RandomResizedCrop for a height x width image: up to 10 draws of an
// area fraction in [min_scale, max_scale] and a log-uniform aspect ratio (width / height) in
// [min_ratio, max_ratio], keeping the first that fits; otherwise the central crop with the ratio
// clamped to that range. Rounds half to even, as Python's round() does.
CropBox random_resized_crop_box(int64_t height, int64_t width, double min_scale, double max_scale,
                                double min_ratio, double max_ratio, SplitMix64& rng);

// Bilinear resize of a float [C,H,W] image to height x width (align_corners = false), with
// antialiasing when shrinking, like torchvision's Resize on tensors and PIL's bilinear filter.
torch::Tensor resize_bilinear(const torch::Tensor& image, int64_t height, int64_t width);

// Resizes a float [C,H,W] image so that its shorter side is `size`, keeping the aspect ratio
// (the longer side is truncated, as in torchvision's Resize(int)).
torch::Tensor resize_shorter_side(const torch::Tensor& image, int64_t size);

// The central size x size window of a [C,H,W] image at least that large (a view), placed as
// torchvision's CenterCrop places it.
torch::Tensor center_crop(const torch::Tensor& image, int64_t size);

// The pipeline applied to one float [C,H,W] image, in torchvision's usual order:
// random crop with zero padding, horizontal flip with p = 0.5, then normalisation.
struct ImageTransforms {
  bool random_crop = false;
  int64_t crop_padding = 0;
  bool random_flip = false;
  std::vector<double> mean;    // per channel; empty = no normalisation
  std::vector<double> stddev;  // per channel, same length as mean

  // Random choices are drawn from `seed` alone, so equal seeds give equal outputs.
  torch::Tensor apply(const torch::Tensor& image, uint64_t seed) const;
  // E.g. "random_crop(pad 4), random_flip, normalize" or "none".
  std::string describe() const;
};

}  // namespace train::data
