#pragma once
// Antialiased bilinear resampling of 8-bit RGB pixels straight into a channels-first output,
// with the crop, the horizontal flip and the normalisation folded in: the whole per-image
// transform of the ImageFolder pipeline in two passes over the pixels, with no tensors and no
// allocation after the first image of a thread. Internal to the data module; no LibTorch.
//
// The filter is torchvision's (and PIL's) bilinear with antialiasing, which is what
// torch.nn.functional.interpolate(mode="bilinear", antialias=True, align_corners=False) computes:
// for an input of n pixels resized to m, scale s = n / m, support r = max(s, 1), and output
// pixel i takes the inputs j in [floor(c - r + 0.5), floor(c + r + 0.5)), c = s * (i + 0.5),
// weighted by the triangle max(0, 1 - |j + 0.5 - c| / max(s, 1)), normalised to sum to 1. The
// height is resampled first, then the width (ATen does the width first: the results differ in
// rounding only), in single precision.
#include <cstdint>
#include <vector>

namespace train::data {

// Interleaved 8-bit pixels: the value of channel c at (y, x) is
// data[y * row_stride + x * pixel_stride + c], c in {0, 1, 2}.
struct PixelsView {
  const uint8_t* data = nullptr;
  int64_t height = 0;
  int64_t width = 0;
  int64_t row_stride = 0;
  int64_t pixel_stride = 3;
};

struct ResampleSpec {
  // The source region [top, top + height) x [left, left + width), resized to a virtual
  // out_height x out_width image ...
  int64_t top = 0, left = 0, height = 0, width = 0;
  int64_t out_height = 0, out_width = 0;
  // ... of which the window [window_top, + window_height) x [window_left, + window_width) is
  // written (a center crop after a resize is a window; a random resized crop is all of it).
  int64_t window_top = 0, window_left = 0, window_height = 0, window_width = 0;
  bool flip = false;  // mirror the window horizontally
};

// Per-thread scratch space (filter taps and the intermediate rows), reused across images.
struct ResampleScratch {
  std::vector<int64_t> x_first, x_count, y_first, y_count;
  std::vector<float> x_weights, y_weights, rows, columns, accumulator;
};

// Writes the window as float [3, window_height, window_width]: u * scale[c] - shift[c] for the
// uint8 value u that resample_to_uint8 writes (a resampled value v in [0, 255] rounded to 8 bits,
// as torchvision's PIL and uint8 pipelines do): scale 1 / (255 stddev) and shift mean / stddev
// give a normalised image, and the same numbers as a uint8 image normalised afterwards.
void resample_to_float(const PixelsView& source, const ResampleSpec& spec, const float scale[3],
                       const float shift[3], float* output, ResampleScratch& scratch);

// Writes the window as uint8 [3, window_height, window_width]: v rounded half to even, clamped.
void resample_to_uint8(const PixelsView& source, const ResampleSpec& spec, uint8_t* output,
                       ResampleScratch& scratch);

// Throws std::invalid_argument when the region or the window does not fit.
void check_resample_spec(const PixelsView& source, const ResampleSpec& spec);

}  // namespace train::data
