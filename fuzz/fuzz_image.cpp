// Fuzz target: the image decode path of ImageFolder (JPEG through libjpeg-turbo, PNG through
// libpng, recognised by the first bytes).
// Input: one image file. It is decoded at full size and, when that works, again at the reduced
// DCT scale chosen for a small output, as ImageFolderDataset::get does.
// Property: the result is uint8 [3, H, W] with the expected (scaled) size.
#include <train/data/image_folder.h>
#include <train/errors.h>

#include <cstdint>
#include <string>

#include "fuzz_input.h"

namespace {
void check(const torch::Tensor& image, const char* what) {
  if (image.dim() != 3 || image.size(0) != 3 || image.size(1) < 1 || image.size(2) < 1 ||
      image.scalar_type() != torch::kByte) {
    train::fuzz::violated(std::string(what) + ": not a uint8 [3, H, W] image");
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = train::fuzz::write_scratch("image", data, size);
  try {
    const torch::Tensor full = train::data::decode_image(path);
    check(full, "decode_image");
    const int64_t height = full.size(1), width = full.size(2);
    const int64_t needed = std::max<int64_t>(1, std::min(height, width) / 5);
    const torch::Tensor scaled = train::data::decode_image(path, needed);
    check(scaled, "decode_image(needed)");
    const bool is_png = size >= 1 && data[0] == 0x89;
    const int64_t d = is_png ? 1 : train::data::choose_jpeg_scale(width, height, needed);
    if (scaled.size(1) != (height + d - 1) / d || scaled.size(2) != (width + d - 1) / d) {
      train::fuzz::violated("decode_image(needed) has size " + std::to_string(scaled.size(1)) + "x" +
                            std::to_string(scaled.size(2)) + ", expected " + std::to_string(height) + "x" +
                            std::to_string(width) + " / " + std::to_string(d));
    }
  } catch (const train::Error&) {
  }
  return 0;
}
