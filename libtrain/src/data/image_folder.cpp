// ImageFolder listing, JPEG / PNG decoding and ImageFolderDataset.
#include <train/data/image_folder.h>
#include <train/data/transforms.h>
#include <train/errors.h>
#include <train/files.h>

#include "resample.h"

#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace train::data {

namespace {

bool is_hidden(const std::string& name) { return !name.empty() && name.front() == '.'; }

bool has_image_extension(const std::string& name) {
  const auto dot = name.rfind('.');
  if (dot == std::string::npos) return false;
  std::string extension = name.substr(dot + 1);
  std::transform(extension.begin(), extension.end(), extension.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return extension == "jpg" || extension == "jpeg" || extension == "png";
}

void require_directory(const std::string& directory) {
  if (!files::is_directory(directory)) {
    throw DataError(directory + ": " +
                    (files::exists(directory) ? "not a directory" : "no such directory"));
  }
}

// The file could be listed, so failing to read it now is a runtime failure, not bad input.
// Reads into `bytes` (reused across calls: no allocation once it is large enough).
void read_file(const std::string& path, std::vector<uint8_t>& bytes) {
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    throw DataError(path + ": " + problem + ", expected an image file");
  }
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw DataError(path + ": cannot open: " + std::strerror(errno), kExitRuntime);
  }
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(file, &std::fclose);
  bytes.clear();
  constexpr size_t kChunk = size_t{1} << 16;
  for (;;) {
    const size_t filled = bytes.size();
    if (bytes.capacity() < filled + kChunk) bytes.reserve(std::max(filled + kChunk, 2 * filled));
    bytes.resize(filled + kChunk);
    const size_t got = std::fread(bytes.data() + filled, 1, kChunk, file);
    bytes.resize(filled + got);
    if (got < kChunk) break;
  }
  if (std::ferror(file)) {
    throw DataError(path + ": cannot read: " + std::strerror(errno), kExitRuntime);
  }
}

bool is_jpeg(const std::vector<uint8_t>& bytes) {
  return bytes.size() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF;
}

bool is_png(const std::vector<uint8_t>& bytes) {
  return bytes.size() >= 8 && png_sig_cmp(bytes.data(), 0, 8) == 0;
}

// libjpeg warnings after which the pixels are still complete and correct: stray bytes between
// markers (a few ImageNet files have them) and an unknown JFIF version. Every other warning
// (data ended early, bad Huffman code, ...) leaves grey or garbled blocks, so it is an error.
// TurboJPEG reports the first warning of an image, or the fatal error if one followed.
bool is_harmless_jpeg_warning(const std::string& message) {
  return message.find("extraneous bytes before marker") != std::string::npos ||
         message.find("unknown JFIF revision") != std::string::npos;
}

// A header can claim up to 65,500 x 65,500 pixels (JPEG) or 1,000,000 x 1,000,000 (PNG) in a file
// of a hundred bytes; decoding would allocate gigabytes to terabytes. Larger images are refused
// before anything is allocated, at PIL's decompression-bomb limit (which torchvision's loader
// also enforces): 2 x 89,478,485 pixels.
constexpr int64_t kMaxImagePixels = 2 * 89'478'485;

void check_image_size(const std::string& path, int64_t width, int64_t height, const char* format) {
  if (width * height > kMaxImagePixels) {
    throw DataError(path + ": " + format + " header claims " + std::to_string(width) + "x" +
                    std::to_string(height) + " pixels, more than the limit of " +
                    std::to_string(kMaxImagePixels) + " (a corrupt file or a decompression bomb)");
  }
}

// A decoder's output: interleaved pixels in a caller's buffer.
using Pixels = PixelsView;

// Adobe CMYK JPEGs store inverted ink values, so with c, m, y, k as decoded, R = c * k / 255 and
// so on (the conversion of OpenCV and libjpeg-turbo's tools; colour management is out of scope).
// In place: RGB goes into the first three bytes of each 4-byte pixel.
void cmyk_to_rgb(uint8_t* pixels, int64_t count) {
  for (int64_t i = 0; i < count; ++i, pixels += 4) {
    const int k = pixels[3];
    for (int c = 0; c < 3; ++c) pixels[c] = static_cast<uint8_t>((pixels[c] * k + 127) / 255);
  }
}

// TurboJPEG decompressor of the calling thread (creating one costs more than decoding a
// thumbnail). After any failure or warning the thread gets a fresh one: TurboJPEG 2.1 can carry
// state from a truncated stream into the next header it reads.
struct ThreadDecompressor {
  tjhandle handle = nullptr;
  ~ThreadDecompressor() { reset(); }
  void reset() {
    if (handle != nullptr) tjDestroy(handle);
    handle = nullptr;
  }
  tjhandle get() {
    if (handle == nullptr) handle = tjInitDecompress();
    if (handle == nullptr) {
      throw Error(std::string("cannot create a TurboJPEG decompressor: ") + tjGetErrorStr2(nullptr));
    }
    return handle;
  }
};

ThreadDecompressor& thread_decompressor() {
  thread_local ThreadDecompressor decompressor;
  return decompressor;
}

Pixels decode_jpeg(const std::string& path, const std::vector<uint8_t>& bytes, int64_t needed,
                   std::vector<uint8_t>& buffer) {
  ThreadDecompressor& decompressor = thread_decompressor();
  tjhandle handle = decompressor.get();
  int width = 0;
  int height = 0;
  int subsampling = 0;
  int colorspace = 0;
  if (tjDecompressHeader3(handle, bytes.data(), bytes.size(), &width, &height, &subsampling,
                          &colorspace) != 0) {
    const std::string message = tjGetErrorStr2(handle);
    decompressor.reset();
    throw DataError(path + ": corrupt JPEG header: " + message);
  }
  // Data that ends before the frame header "succeeds" without a size.
  if (width <= 0 || height <= 0) {
    decompressor.reset();
    throw DataError(path + ": truncated JPEG header (it ends before the image size)");
  }
  check_image_size(path, width, height, "JPEG");
  const int denominator = choose_jpeg_scale(width, height, needed);
  const tjscalingfactor scale{1, denominator};
  const int scaled_width = TJSCALED(width, scale);
  const int scaled_height = TJSCALED(height, scale);
  // TurboJPEG 2.1 cannot convert CMYK / YCCK to RGB itself.
  const bool cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
  const int channels = cmyk ? 4 : 3;
  buffer.resize(static_cast<size_t>(scaled_width) * static_cast<size_t>(scaled_height) *
                static_cast<size_t>(channels));
  // Asking for the scaled size makes TurboJPEG decode at that DCT scale.
  if (tjDecompress2(handle, bytes.data(), bytes.size(), buffer.data(), scaled_width, 0,
                    scaled_height, cmyk ? TJPF_CMYK : TJPF_RGB, 0) != 0) {
    const std::string message = tjGetErrorStr2(handle);
    decompressor.reset();
    if (!is_harmless_jpeg_warning(message)) {
      throw DataError(path + ": corrupt or truncated JPEG: " + message);
    }
  }
  if (cmyk) cmyk_to_rgb(buffer.data(), int64_t{scaled_width} * scaled_height);
  return Pixels{buffer.data(), scaled_height, scaled_width, int64_t{scaled_width} * channels,
                channels};
}

// Frees libpng's decoder state however decoding ends (png_image_free is idempotent).
struct PngImage {
  png_image image{};
  PngImage() { image.version = PNG_IMAGE_VERSION; }
  ~PngImage() { png_image_free(&image); }
  PngImage(const PngImage&) = delete;
  PngImage& operator=(const PngImage&) = delete;
};

Pixels decode_png(const std::string& path, const std::vector<uint8_t>& bytes,
                  std::vector<uint8_t>& buffer) {
  PngImage png;
  if (png_image_begin_read_from_memory(&png.image, bytes.data(), bytes.size()) == 0) {
    throw DataError(path + ": corrupt PNG: " + png.image.message);
  }
  // Read the alpha channel too and drop it afterwards: without it libpng would blend the
  // image onto a background, while torchvision's loader (PIL's convert("RGB")) discards alpha.
  check_image_size(path, png.image.width, png.image.height, "PNG");
  const bool alpha = (png.image.format & PNG_FORMAT_FLAG_ALPHA) != 0;
  png.image.format = alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB;
  const int channels = alpha ? 4 : 3;
  const auto width = static_cast<int64_t>(png.image.width);
  const auto height = static_cast<int64_t>(png.image.height);
  buffer.resize(static_cast<size_t>(width * height * channels));
  if (png_image_finish_read(&png.image, nullptr, buffer.data(), 0, nullptr) == 0) {
    throw DataError(path + ": corrupt or truncated PNG: " + png.image.message);
  }
  return Pixels{buffer.data(), height, width, width * channels, channels};
}

// Reads and decodes a JPEG or PNG file into the given buffers.
Pixels decode_file(const std::string& path, int64_t needed, std::vector<uint8_t>& bytes,
                   std::vector<uint8_t>& buffer) {
  read_file(path, bytes);
  if (is_jpeg(bytes)) return decode_jpeg(path, bytes, needed, buffer);
  if (is_png(bytes)) return decode_png(path, bytes, buffer);
  throw DataError(path + ": not a JPEG or PNG file (unrecognised first bytes)");
}

// The buffers of the calling thread, reused from image to image.
struct ThreadBuffers {
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> pixels;
  ResampleScratch resample;
};

ThreadBuffers& thread_buffers() {
  thread_local ThreadBuffers buffers;
  return buffers;
}

}  // namespace

std::vector<std::string> find_image_classes(const std::string& directory) {
  require_directory(directory);
  std::vector<std::string> classes;
  for (const std::string& name : files::list_directory(directory)) {
    if (!is_hidden(name) && files::is_directory(files::join(directory, name))) {
      classes.push_back(name);
    }
  }
  return classes;
}

int choose_jpeg_scale(int64_t width, int64_t height, int64_t needed) {
  if (needed <= 0) return 1;
  const int64_t shorter = std::min(width, height);
  // Only 1/2, 1/4 and 1/8: libjpeg-turbo has dedicated fast reduced IDCTs for these. A scaled
  // side is rounded up, as libjpeg sizes it (TJSCALED).
  for (const int denominator : {8, 4, 2}) {
    if ((shorter + denominator - 1) / denominator >= needed) return denominator;
  }
  return 1;
}

torch::Tensor decode_image(const std::string& path, int64_t needed) {
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> buffer;
  const Pixels pixels = decode_file(path, needed, bytes, buffer);
  torch::Tensor image = torch::empty({pixels.height, pixels.width, 3}, torch::kByte);
  uint8_t* out = image.data_ptr<uint8_t>();
  for (int64_t y = 0; y < pixels.height; ++y) {
    const uint8_t* in = pixels.data + y * pixels.row_stride;
    for (int64_t x = 0; x < pixels.width; ++x, in += pixels.pixel_stride, out += 3) {
      std::memcpy(out, in, 3);
    }
  }
  return image.permute({2, 0, 1});
}

ImageFolderDataset::ImageFolderDataset(ImageFolderOptions options) : options_(std::move(options)) {
  if (options_.resize_size == 0) {
    options_.resize_size = std::lround(static_cast<double>(options_.image_size) / 0.875);
  }
  if (options_.image_size < 1 || options_.resize_size < options_.image_size) {
    throw std::invalid_argument("ImageFolderDataset: need 1 <= image_size <= resize_size");
  }
  if (!(options_.crop_min_scale > 0.0 && options_.crop_min_scale <= 1.0)) {
    throw std::invalid_argument("ImageFolderDataset: crop_min_scale must be in (0, 1]");
  }
  if (options_.mean.size() != options_.stddev.size() ||
      (!options_.mean.empty() && options_.mean.size() != 3)) {
    throw std::invalid_argument("ImageFolderDataset: mean and stddev need 3 values each, or none");
  }
  if (options_.uint8 && !options_.mean.empty()) {
    throw std::invalid_argument(
        "ImageFolderDataset: uint8 images are not normalised; pass mean / stddev to "
        "normalize_on_device instead");
  }

  for (size_t c = 0; c < 3; ++c) {
    mean_[c] = options_.mean.empty() ? 0.0f : static_cast<float>(options_.mean[c]);
    stddev_[c] = options_.stddev.empty() ? 1.0f : static_cast<float>(options_.stddev[c]);
  }

  const std::string& directory = options_.directory;
  const std::vector<std::string> found = find_image_classes(directory);
  if (options_.classes.empty()) options_.classes = found;
  std::map<std::string, int64_t> label_of;
  for (size_t i = 0; i < options_.classes.size(); ++i) {
    label_of.emplace(options_.classes[i], static_cast<int64_t>(i));
  }

  for (const std::string& name : found) {
    const auto label = label_of.find(name);
    const std::string class_directory = files::join(directory, name);
    if (label == label_of.end()) {
      throw DataError(class_directory + ": class '" + name +
                      "' is not among the training split's classes");
    }
    for (const std::string& file : files::list_directory(class_directory)) {
      if (!is_hidden(file) && has_image_extension(file)) {
        samples_.push_back(Sample{name + "/" + file, label->second});
      }
    }
  }
  if (samples_.empty()) {
    throw DataError(directory + ": no images (.jpg, .jpeg or .png) in any class subdirectory");
  }
}

const ImageFolderDataset::Sample& ImageFolderDataset::sample(int64_t index) const {
  if (index < 0 || index >= size()) {
    throw std::out_of_range(options_.directory + ": index " + std::to_string(index) +
                            " out of range [0, " + std::to_string(size()) + ")");
  }
  return samples_[static_cast<size_t>(index)];
}

std::string ImageFolderDataset::path(int64_t index) const {
  return files::join(options_.directory, sample(index).file);
}

int64_t ImageFolderDataset::label(int64_t index) const { return sample(index).label; }

void ImageFolderDataset::transform_into(int64_t index, uint64_t seed, void* output) const {
  const int64_t side = options_.image_size;
  ThreadBuffers& buffers = thread_buffers();
  ResampleSpec spec;
  spec.window_height = side;
  spec.window_width = side;
  Pixels pixels;
  if (options_.split == Split::Train) {
    pixels = decode_file(path(index), side, buffers.bytes, buffers.pixels);
    SplitMix64 rng(seed);
    const CropBox box = random_resized_crop_box(pixels.height, pixels.width,
                                                options_.crop_min_scale, 1.0, 3.0 / 4.0, 4.0 / 3.0,
                                                rng);
    spec.top = box.top;
    spec.left = box.left;
    spec.height = box.height;
    spec.width = box.width;
    spec.out_height = side;
    spec.out_width = side;
    spec.flip = options_.random_flip && rng.below(2) == 1;
  } else {
    // Resize the shorter side to resize_size, then take the centred side x side window.
    const int64_t size = options_.resize_size;
    pixels = decode_file(path(index), size, buffers.bytes, buffers.pixels);
    spec.height = pixels.height;
    spec.width = pixels.width;
    spec.out_height = pixels.height <= pixels.width ? size : size * pixels.height / pixels.width;
    spec.out_width = pixels.height <= pixels.width ? size * pixels.width / pixels.height : size;
    if (side > spec.out_height || side > spec.out_width) {
      throw DataError(path(index) + ": a " + std::to_string(pixels.height) + "x" +
                      std::to_string(pixels.width) + " image resized to a shorter side of " +
                      std::to_string(size) + " is too narrow for a " + std::to_string(side) +
                      "-pixel center crop");
    }
    spec.window_top = static_cast<int64_t>(std::nearbyint(static_cast<double>(spec.out_height - side) / 2.0));
    spec.window_left = static_cast<int64_t>(std::nearbyint(static_cast<double>(spec.out_width - side) / 2.0));
  }
  if (options_.uint8) {
    resample_to_uint8(pixels, spec, static_cast<uint8_t*>(output), buffers.resample);
  } else {
    resample_to_float(pixels, spec, mean_, stddev_, static_cast<float*>(output), buffers.resample);
  }
  // The buffers of an unusually large image are not kept: they would stay with this thread for
  // the rest of the run (a 4000 x 3000 RGBA PNG decodes to 48 MB).
  constexpr size_t kKeep = size_t{32} << 20;
  for (std::vector<uint8_t>* buffer : {&buffers.bytes, &buffers.pixels}) {
    if (buffer->capacity() > kKeep) std::vector<uint8_t>().swap(*buffer);
  }
}

Example ImageFolderDataset::get(int64_t index, uint64_t seed) const {
  const int64_t side = options_.image_size;
  torch::Tensor image = torch::empty({3, side, side}, options_.uint8 ? torch::kByte : torch::kFloat);
  transform_into(index, seed, image.data_ptr());
  return Example{image, torch::scalar_tensor(label(index), torch::kLong)};
}

std::optional<Batch> ImageFolderDataset::get_batch(const std::vector<int64_t>& indices,
                                                   const std::vector<uint64_t>& seeds,
                                                   bool pinned) const {
  if (indices.empty() || seeds.size() != indices.size()) return std::nullopt;
  const auto n = static_cast<int64_t>(indices.size());
  const int64_t side = options_.image_size;
  const at::ScalarType dtype = options_.uint8 ? torch::kByte : torch::kFloat;
  torch::Tensor input = pinned ? torch::empty({n, 3, side, side},
                                              torch::TensorOptions(dtype).pinned_memory(true))
                               : batch_memory_.empty({n, 3, side, side}, dtype);
  torch::Tensor target = torch::empty({n}, torch::TensorOptions(torch::kLong).pinned_memory(pinned));
  auto* out = static_cast<uint8_t*>(input.data_ptr());
  const int64_t stride = 3 * side * side * static_cast<int64_t>(input.element_size());
  int64_t* labels = target.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t index = indices[static_cast<size_t>(i)];
    // A bad sample throws; the loader then redoes the batch sample by sample, where the error
    // names the sample or data.on_error: skip replaces it.
    transform_into(index, seeds[static_cast<size_t>(i)], out + i * stride);
    labels[i] = label(index);
  }
  return Batch{std::move(input), std::move(target)};
}

std::vector<int64_t> ImageFolderDataset::input_shape() const {
  return {3, options_.image_size, options_.image_size};
}

std::string ImageFolderDataset::describe() const {
  const int64_t side = options_.image_size;
  std::ostringstream out;
  out << "image_folder: " << options_.directory << " ("
      << (options_.split == Split::Train ? "train" : "val") << "): " << samples_.size()
      << " images, " << options_.classes.size() << " classes, 3x" << side << "x" << side
      << ", transforms: ";
  if (options_.split == Split::Train) {
    out << "random_resized_crop(" << side << ", scale " << options_.crop_min_scale
        << "-1, ratio 3/4-4/3)";
    if (options_.random_flip) out << ", random_flip";
  } else {
    out << "resize(" << options_.resize_size << "), center_crop(" << side << ")";
  }
  if (!options_.mean.empty()) out << ", normalize";
  if (options_.uint8) out << ", uint8 (normalised on the device)";
  return out.str();
}

}  // namespace train::data
