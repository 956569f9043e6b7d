// Antialiased bilinear resampling of 8-bit RGB into channels-first float or uint8 (resample.h).
#include "resample.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace train::data {

namespace {

// Filter taps of the output pixels [first_out, first_out + count) of an input_size -> output_size
// resize, in single precision like ATen's antialiased kernel. Each pixel gets `taps` weights
// (the widest pixel's count; the others are padded with zeros, so the inner loops have a fixed
// trip count) starting at input index first[i]; first[i] + taps never runs past the input.
int64_t compute_taps(int64_t input_size, int64_t output_size, int64_t first_out, int64_t count,
                     std::vector<int64_t>& first, std::vector<int64_t>& used,
                     std::vector<float>& weights) {
  const float scale = static_cast<float>(input_size) / static_cast<float>(output_size);
  const float support = scale >= 1.0f ? scale : 1.0f;
  const float inverse = scale >= 1.0f ? 1.0f / scale : 1.0f;
  first.resize(static_cast<size_t>(count));
  used.resize(static_cast<size_t>(count));
  int64_t taps = 1;
  for (int64_t i = 0; i < count; ++i) {
    const float center = scale * (static_cast<float>(first_out + i) + 0.5f);
    const int64_t lo = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5f), 0);
    const int64_t hi = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5f), input_size);
    first[static_cast<size_t>(i)] = lo;
    used[static_cast<size_t>(i)] = std::max<int64_t>(hi - lo, 0);
    taps = std::max(taps, used[static_cast<size_t>(i)]);
  }
  weights.assign(static_cast<size_t>(count * taps), 0.0f);
  for (int64_t i = 0; i < count; ++i) {
    const float center = scale * (static_cast<float>(first_out + i) + 0.5f);
    const int64_t lo = first[static_cast<size_t>(i)];
    const int64_t n = used[static_cast<size_t>(i)];
    // Shift the window left where it would run past the end; its extra taps weigh 0.
    const int64_t start = std::max<int64_t>(std::min(lo, input_size - taps), 0);
    float* w = weights.data() + i * taps;
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float x = (static_cast<float>(j + lo) - center + 0.5f) * inverse;
      const float value = std::max(0.0f, 1.0f - std::fabs(x));
      w[lo - start + j] = value;
      total += value;
    }
    if (total != 0.0f) {
      for (int64_t j = 0; j < taps; ++j) w[j] /= total;
    }
    first[static_cast<size_t>(i)] = start;
  }
  return taps;
}

// The pixel loops are compiled for AVX2 as well as for the baseline, and the loader picks at
// run time. Without FMA (AVX2 alone does not imply it) and without reassociation, both versions
// round identically, so a sample is bit-for-bit the same on any x86-64 machine.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TRAIN_RESAMPLE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TRAIN_RESAMPLE_CLONES
#endif

// Rows and columns are processed in blocks of this many, so that the transposing stores in
// between the passes and into the channels-first output write whole cache lines.
constexpr int64_t kBlock = 8;

// The weights are a convex combination, so only rounding takes a value outside [0, 255].
inline float clamp255(float v) { return std::min(std::max(v, 0.0f), 255.0f); }

// Where and how the window is written: uint8 (v rounded) or float (that level * scale[c] -
// shift[c]).
struct Output {
  float* floats = nullptr;
  uint8_t* bytes = nullptr;
  float scale[3] = {1.0f, 1.0f, 1.0f};
  float shift[3] = {0.0f, 0.0f, 0.0f};
};

// acc[n] (=|+=) w * in[n] over contiguous memory: the inner loop of both passes.
template <typename T>
inline void accumulate(float* __restrict acc, const T* __restrict in, float w, int64_t count,
                       bool first) {
  if (first) {
    for (int64_t n = 0; n < count; ++n) acc[n] = w * static_cast<float>(in[n]);
  } else {
    for (int64_t n = 0; n < count; ++n) acc[n] += w * static_cast<float>(in[n]);
  }
}

// A multiply, then a subtraction (not contracted into one FMA: no FMA target here), each rounded
// to float, as normalize_on_device's two tensor ops do to a uint8 batch.
inline void put(float* out, float v, int c, const Output& o) {
  *out = clamp255(std::nearbyint(v)) * o.scale[c] - o.shift[c];
}
inline void put(uint8_t* out, float v, int /*c*/, const Output& /*o*/) {
  *out = static_cast<uint8_t>(clamp255(std::nearbyint(v)));
}

// Writes the columns [j0, j0 + nb) of a window, values[b][i][c], into the channels-first
// output: for each (c, i), nb neighbouring outputs, mirrored when Flip.
template <bool Flip, typename T>
inline void store_block(const float* values, int64_t j0, int64_t nb, const ResampleSpec& spec,
                        T* output, const Output& o) {
  const int64_t ww = spec.window_width;
  const int64_t wh = spec.window_height;
  const int64_t height3 = wh * 3;
  for (int c = 0; c < 3; ++c) {
    T* plane = output + c * wh * ww;
    for (int64_t i = 0; i < wh; ++i) {
      const float* from = values + i * 3 + c;
      T* to = plane + i * ww + (Flip ? ww - 1 - j0 : j0);
      for (int64_t b = 0; b < nb; ++b) put(Flip ? to - b : to + b, from[b * height3], c, o);
    }
  }
}

// Resamples the window in two separable passes whose inner loops both run over contiguous
// memory. Pass 1 (height): each window row from the source rows, for the source columns the
// window needs, stored transposed: columns[x][i][c]. Pass 2 (width): blocks of up to kBlock
// window columns from those columns, values[b][i][c] in [0, 255], stored channels-first.
TRAIN_RESAMPLE_CLONES
void resample(const PixelsView& source, const ResampleSpec& spec, ResampleScratch& s,
              const Output& output) {
  check_resample_spec(source, spec);
  const int64_t ww = spec.window_width;
  const int64_t wh = spec.window_height;
  const int64_t tx = compute_taps(spec.width, spec.out_width, spec.window_left, ww, s.x_first,
                                  s.x_count, s.x_weights);
  const int64_t ty = compute_taps(spec.height, spec.out_height, spec.window_top, wh, s.y_first,
                                  s.y_count, s.y_weights);
  // The source columns the window needs (first[] is non-decreasing).
  const int64_t col0 = s.x_first.front();
  const int64_t cols = s.x_first.back() + tx - col0;
  const int64_t width3 = cols * 3;
  const int64_t height3 = wh * 3;
  s.rows.resize(static_cast<size_t>(kBlock * width3));
  s.columns.resize(static_cast<size_t>(cols * height3));
  s.accumulator.resize(static_cast<size_t>(kBlock * height3));

  const int64_t ps = source.pixel_stride;
  const uint8_t* origin = source.data + spec.top * source.row_stride + (spec.left + col0) * ps;
  for (int64_t i0 = 0; i0 < wh; i0 += kBlock) {
    const int64_t nb = std::min(kBlock, wh - i0);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = i0 + b;
      const float* w = s.y_weights.data() + i * ty;
      float* row = s.rows.data() + b * width3;
      const uint8_t* in = origin + s.y_first[static_cast<size_t>(i)] * source.row_stride;
      for (int64_t k = 0; k < ty; ++k, in += source.row_stride) {
        if (ps == 3) {
          accumulate(row, in, w[k], width3, k == 0);
        } else {
          for (int64_t x = 0; x < cols; ++x) {
            for (int c = 0; c < 3; ++c) {
              const float v = w[k] * static_cast<float>(in[x * ps + c]);
              row[x * 3 + c] = k == 0 ? v : row[x * 3 + c] + v;
            }
          }
        }
      }
    }
    // Transpose the block: nb rows of [cols, 3] -> for each column, nb x 3 contiguous floats.
    float* column = s.columns.data() + i0 * 3;
    for (int64_t x = 0; x < cols; ++x, column += height3) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* from = s.rows.data() + b * width3 + x * 3;
        column[b * 3] = from[0];
        column[b * 3 + 1] = from[1];
        column[b * 3 + 2] = from[2];
      }
    }
  }

  for (int64_t j0 = 0; j0 < ww; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, ww - j0);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t j = j0 + b;
      const float* w = s.x_weights.data() + j * tx;
      const float* in = s.columns.data() + (s.x_first[static_cast<size_t>(j)] - col0) * height3;
      float* acc = s.accumulator.data() + b * height3;
      for (int64_t k = 0; k < tx; ++k, in += height3) accumulate(acc, in, w[k], height3, k == 0);
    }
    // Store the block channels-first: for each (c, i), nb neighbouring outputs (mirrored with
    // flip).
    if (output.floats != nullptr) {
      if (spec.flip) store_block<true>(s.accumulator.data(), j0, nb, spec, output.floats, output);
      else store_block<false>(s.accumulator.data(), j0, nb, spec, output.floats, output);
    } else {
      if (spec.flip) store_block<true>(s.accumulator.data(), j0, nb, spec, output.bytes, output);
      else store_block<false>(s.accumulator.data(), j0, nb, spec, output.bytes, output);
    }
  }
}

}  // namespace

void check_resample_spec(const PixelsView& source, const ResampleSpec& spec) {
  const bool region_fits = spec.height >= 1 && spec.width >= 1 && spec.top >= 0 &&
                           spec.left >= 0 && spec.top + spec.height <= source.height &&
                           spec.left + spec.width <= source.width;
  const bool window_fits = spec.out_height >= 1 && spec.out_width >= 1 &&
                           spec.window_height >= 1 && spec.window_width >= 1 &&
                           spec.window_top >= 0 && spec.window_left >= 0 &&
                           spec.window_top + spec.window_height <= spec.out_height &&
                           spec.window_left + spec.window_width <= spec.out_width;
  if (!region_fits || !window_fits || source.pixel_stride < 3 ||
      source.row_stride < source.width * source.pixel_stride) {
    throw std::invalid_argument(
        "resample: region " + std::to_string(spec.height) + "x" + std::to_string(spec.width) +
        " at (" + std::to_string(spec.top) + ", " + std::to_string(spec.left) + ") of a " +
        std::to_string(source.height) + "x" + std::to_string(source.width) + " image, window " +
        std::to_string(spec.window_height) + "x" + std::to_string(spec.window_width) + " at (" +
        std::to_string(spec.window_top) + ", " + std::to_string(spec.window_left) + ") of " +
        std::to_string(spec.out_height) + "x" + std::to_string(spec.out_width));
  }
}

void resample_to_float(const PixelsView& source, const ResampleSpec& spec, const float scale[3],
                       const float shift[3], float* output, ResampleScratch& scratch) {
  Output out;
  out.floats = output;
  for (int c = 0; c < 3; ++c) {
    out.scale[c] = scale[c];
    out.shift[c] = shift[c];
  }
  resample(source, spec, scratch, out);
}

void resample_to_uint8(const PixelsView& source, const ResampleSpec& spec, uint8_t* output,
                       ResampleScratch& scratch) {
  Output out;
  out.bytes = output;
  resample(source, spec, scratch, out);
}

}  // namespace train::data
