// ImageFolder: listing, JPEG / PNG decoding (scaled, grayscale, CMYK, alpha, 16-bit, gamma), the
// train and val transforms, error messages and the loader. Every image is generated in a
// temporary directory with TurboJPEG's encoder and libpng's writers.
#include "testing.h"

#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "train/config.h"
#include "train/data/factory.h"
#include "train/data/idx.h"
#include "train/data/image_folder.h"
#include "train/data/scan.h"
#include "train/data/tokens.h"
#include "train/data/loader.h"
#include "train/data/transforms.h"
#include "train/checkpoint.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/fit.h"
#include "train/models/model.h"
#include "train/log.h"
#include "train/run.h"
#include "train/trainer.h"

using namespace train::data;
using Catch::Matchers::Contains;
namespace files = train::files;

namespace {

// A fresh temporary directory, removed with its contents at scope end.
struct TempDir {
  std::string path = files::make_temp_directory("train_test_image_folder_");
  ~TempDir() { files::remove_all(path); }
  std::string operator/(const std::string& name) const { return files::join(path, name); }
};

// Interleaved 8-bit pixels, `channels` per pixel.
struct Pixels {
  int width;
  int height;
  int channels;
  std::vector<uint8_t> data;
};

// A smooth pattern that differs between channels and with `variant`, so that crops of
// different places differ.
Pixels pattern(int width, int height, int channels, int variant = 0) {
  Pixels p{width, height, channels, {}};
  p.data.resize(static_cast<size_t>(width) * height * channels);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      for (int c = 0; c < channels; ++c) {
        const int value = (x * (c + 1) + y * (3 - c) + 40 * variant) % 256;
        p.data[(static_cast<size_t>(y) * width + x) * channels + c] = static_cast<uint8_t>(value);
      }
    }
  }
  return p;
}

Pixels solid(int width, int height, std::vector<uint8_t> colour) {
  Pixels p{width, height, static_cast<int>(colour.size()), {}};
  for (int i = 0; i < width * height; ++i) p.data.insert(p.data.end(), colour.begin(), colour.end());
  return p;
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

// RGB, grayscale (1 channel) or CMYK (4 channels) pixels as a JPEG file.
// Subsampling -1: 4:2:0 for RGB, none for CMYK, gray for one channel.
void write_jpeg(const std::string& path, const Pixels& p, int subsampling = -1, int flags = 0) {
  const int format = p.channels == 1 ? TJPF_GRAY : p.channels == 3 ? TJPF_RGB : TJPF_CMYK;
  if (subsampling < 0) subsampling = p.channels == 1 ? TJSAMP_GRAY : p.channels == 3 ? TJSAMP_420 : TJSAMP_444;
  const std::unique_ptr<void, int (*)(tjhandle)> handle(tjInitCompress(), &tjDestroy);
  REQUIRE(handle);
  unsigned char* jpeg = nullptr;
  unsigned long size = 0;
  REQUIRE(tjCompress2(handle.get(), p.data.data(), p.width, 0, p.height, format, &jpeg, &size,
                      subsampling, 95, flags) == 0);
  write_file(path, std::vector<uint8_t>(jpeg, jpeg + size));
  tjFree(jpeg);
}

// Grayscale (1 channel), RGB (3 channels) or RGBA (4 channels) pixels as a PNG file.
void write_png(const std::string& path, const Pixels& p) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(p.width);
  image.height = static_cast<png_uint_32>(p.height);
  image.format = p.channels == 1 ? PNG_FORMAT_GRAY : p.channels == 4 ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB;
  REQUIRE(png_image_write_to_file(&image, path.c_str(), 0, p.data.data(), 0, nullptr) != 0);
}

// What libpng's simplified writer cannot write: 16-bit samples, gray of 1, 2 or 4 bits, palettes,
// tRNS transparency, a gAMA chunk, interlacing. Rows are raw samples (16-bit ones big-endian).
struct PngSpec {
  int width = 0;
  int height = 0;
  int bit_depth = 8;
  int colour_type = PNG_COLOR_TYPE_RGB;
  std::vector<std::vector<uint8_t>> rows;
  double gamma = 0.0;                   // > 0: a gAMA chunk with this file gamma
  std::vector<png_color> palette;       // PLTE
  std::vector<uint8_t> palette_alpha;   // tRNS of a palette image
  std::optional<png_color_16> trns;     // tRNS of a gray or RGB image: the transparent colour
  bool interlaced = false;              // Adam7
};

// libpng reports errors by longjmp: this function holds nothing with a destructor.
bool write_png_spec_to(std::FILE* file, const PngSpec& spec, png_bytep* rows) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png == nullptr ? nullptr : png_create_info_struct(png);
  if (info == nullptr || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return false;
  }
  png_init_io(png, file);
  png_set_IHDR(png, info, static_cast<png_uint_32>(spec.width), static_cast<png_uint_32>(spec.height),
               spec.bit_depth, spec.colour_type,
               spec.interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (spec.gamma > 0.0) png_set_gAMA(png, info, spec.gamma);
  if (!spec.palette.empty()) {
    png_set_PLTE(png, info, spec.palette.data(), static_cast<int>(spec.palette.size()));
  }
  if (!spec.palette_alpha.empty()) {
    png_set_tRNS(png, info, spec.palette_alpha.data(), static_cast<int>(spec.palette_alpha.size()), nullptr);
  }
  if (spec.trns) png_set_tRNS(png, info, nullptr, 0, &*spec.trns);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return true;
}

void write_png_spec(const std::string& path, const PngSpec& spec) {
  std::vector<png_bytep> rows;
  for (const std::vector<uint8_t>& row : spec.rows) rows.push_back(const_cast<png_bytep>(row.data()));
  REQUIRE(rows.size() == static_cast<size_t>(spec.height));
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "wb"), &std::fclose);
  REQUIRE(file);
  REQUIRE(write_png_spec_to(file.get(), spec, rows.data()));
}

// 16-bit samples, big-endian, as one PNG row.
std::vector<uint8_t> row16(const std::vector<int>& samples) {
  std::vector<uint8_t> row;
  for (const int v : samples) row.insert(row.end(), {static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v & 0xFF)});
  return row;
}

// <root>/train: ant, bee and cat with 4 images each (varied sizes, one grayscale JPEG, one PNG,
// upper-case extensions) and an empty class dog, plus files that are not listed;
// <root>/val: ant and cat with 2 images each, bee empty.
void make_image_folder(const std::string& root) {
  const std::string train = files::join(root, "train");
  for (const char* name : {"ant", "bee", "cat", "dog"}) files::make_directories(train + "/" + name);
  write_jpeg(train + "/ant/a0.jpg", pattern(500, 375, 3, 0));
  write_jpeg(train + "/ant/a1.JPG", pattern(64, 48, 3, 1));
  write_jpeg(train + "/ant/a2.jpeg", pattern(120, 90, 1, 2));  // grayscale
  write_png(train + "/ant/a3.png", pattern(40, 30, 3, 3));
  for (int i = 0; i < 4; ++i) {
    write_jpeg(train + "/bee/b" + std::to_string(i) + ".jpg", pattern(96 + 8 * i, 72, 3, i));
  }
  write_jpeg(train + "/cat/c0.jpg", pattern(1000, 800, 3, 0));  // decoded at 1/2 scale
  write_jpeg(train + "/cat/c1.JPEG", pattern(64, 64, 3, 1));
  write_png(train + "/cat/c2.PNG", pattern(50, 70, 3, 2));
  write_jpeg(train + "/cat/c3.jpg", pattern(80, 60, 3, 3));
  // Not images of the dataset: other extensions, hidden files, directories within a class.
  write_file(train + "/ant/notes.txt", {'h', 'i'});
  write_file(train + "/bee/._b0.jpg", {0, 5, 22, 7});
  files::make_directories(train + "/cat/nested");
  write_jpeg(train + "/cat/nested/c9.jpg", pattern(32, 32, 3));
  files::make_directories(train + "/.cache");

  const std::string val = files::join(root, "val");
  for (const char* name : {"ant", "bee", "cat"}) files::make_directories(val + "/" + name);
  write_jpeg(val + "/ant/v0.jpg", pattern(300, 200, 3, 4));
  write_jpeg(val + "/ant/v1.jpg", pattern(64, 48, 3, 5));
  write_jpeg(val + "/cat/v2.jpg", pattern(200, 300, 3, 6));
  write_png(val + "/cat/v3.png", pattern(40, 30, 3, 7));
}

train::DataConfig folder_config(const std::string& root) {
  train::DataConfig config;
  config.kind = "image_folder";
  config.root = root;
  config.image_size = 32;
  config.random_flip = true;
  return config;
}

std::string data_error(const std::function<void()>& action) {
  try {
    action();
  } catch (const train::DataError& e) {
    return e.what();
  }
  FAIL("expected a DataError");
  return "";
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string config_error(const train::DataConfig& config, Split split) {
  try {
    make_dataset(config, split);
  } catch (const train::ConfigError& e) {
    return e.what();
  }
  FAIL("expected a ConfigError");
  return "";
}

std::vector<Batch> run_epoch(const DatasetPtr& dataset, int64_t workers, int64_t epoch) {
  LoaderOptions options;
  options.batch_size = 5;
  options.drop_last = false;
  options.workers = workers;
  options.seed = 99;
  Loader loader(dataset, options);
  loader.start({epoch, 0});
  std::vector<Batch> batches;
  while (std::optional<Batch> batch = loader.next()) batches.push_back(*batch);
  return batches;
}

}  // namespace

TEST_CASE("ImageFolder lists sorted classes and images", "[data][image_folder]") {
  TempDir dir;
  make_image_folder(dir.path);
  // dog has no training image: still a class, and said so.
  const std::string log_path = dir / "log.txt";
  train::log::set_file(log_path);
  const auto train = make_dataset(folder_config(dir.path), Split::Train);
  train::log::set_file("");
  std::ifstream log_in(log_path);
  const std::string logged((std::istreambuf_iterator<char>(log_in)), std::istreambuf_iterator<char>());
  CHECK_THAT(logged, Contains(dir / "train") && Contains(": class directory dog holds no images") &&
                         Contains("counts among the 4 classes"));
  const auto& folder = dynamic_cast<const ImageFolderDataset&>(*train);

  CHECK(folder.classes() == std::vector<std::string>{"ant", "bee", "cat", "dog"});
  CHECK(folder.num_classes() == 4);
  REQUIRE(folder.size() == 12);
  const std::vector<std::string> expected_files = {
      "ant/a0.jpg", "ant/a1.JPG", "ant/a2.jpeg", "ant/a3.png", "bee/b0.jpg",  "bee/b1.jpg",
      "bee/b2.jpg", "bee/b3.jpg", "cat/c0.jpg",  "cat/c1.JPEG", "cat/c2.PNG", "cat/c3.jpg"};
  for (int64_t i = 0; i < folder.size(); ++i) {
    CHECK(folder.path(i) == dir / ("train/" + expected_files[i]));
    CHECK(folder.label(i) == i / 4);
  }
  CHECK(folder.input_shape() == std::vector<int64_t>{3, 32, 32});
  CHECK_THAT(folder.describe(),
             Contains(dir / "train") && Contains("(train)") && Contains("12 images") &&
                 Contains("4 classes") && Contains("3x32x32") &&
                 Contains("random_resized_crop(32, scale 0.08-1, ratio 3/4-4/3), random_flip"));

  // Val reads its own directory but labels by the training classes; bee is empty there.
  const auto val = make_dataset(folder_config(dir.path), Split::Val);
  const auto& val_folder = dynamic_cast<const ImageFolderDataset&>(*val);
  CHECK(val_folder.classes() == folder.classes());
  REQUIRE(val_folder.size() == 4);
  CHECK(val_folder.label(0) == 0);
  CHECK(val_folder.label(2) == 2);
  CHECK(val_folder.path(3) == dir / "val/cat/v3.png");
  // Dataset::fingerprint: of the listing. A file renamed (the same count) changes it.
  const uint64_t print = val_folder.fingerprint();
  CHECK(print == make_dataset(folder_config(dir.path), Split::Val)->fingerprint());
  REQUIRE(std::rename((dir / "val/cat/v3.png").c_str(), (dir / "val/cat/v4.png").c_str()) == 0);
  CHECK(print != make_dataset(folder_config(dir.path), Split::Val)->fingerprint());
  REQUIRE(std::rename((dir / "val/cat/v4.png").c_str(), (dir / "val/cat/v3.png").c_str()) == 0);
  CHECK_THAT(val_folder.describe(),
             Contains("(val)") && Contains("resize(37), center_crop(32)"));  // round(32 / 0.875)
}

TEST_CASE("ImageFolder over a list of files gives each the validation split's input", "[data][image_folder]") {
  TempDir dir;
  make_image_folder(dir.path);
  train::DataConfig config = folder_config(dir.path);
  config.mean = {0.485, 0.456, 0.406};
  config.std = {0.229, 0.224, 0.225};
  const auto val = make_dataset(config, Split::Val);
  const auto& val_folder = dynamic_cast<const ImageFolderDataset&>(*val);

  train::data::ImageFolderOptions options = train::data::image_folder_options(config, Split::Val);
  CHECK(options.classes.empty());
  options.classes = val_folder.classes();
  options.files = {dir / "val/cat/v3.png", dir / "val/ant/v0.jpg"};  // any order, any directory
  const ImageFolderDataset images(options);
  REQUIRE(images.size() == 2);
  CHECK(images.num_classes() == 4);
  CHECK(images.path(0) == dir / "val/cat/v3.png");
  CHECK(images.label(1) == train::data::kIgnoreIndex);
  const train::data::Example first = images.get(0, 7);
  CHECK(first.target.item<int64_t>() == train::data::kIgnoreIndex);
  CHECK(torch::equal(first.input, val->get(3, 0).input));  // bit for bit what `train eval` feeds
  CHECK(torch::equal(images.get(1, 0).input, val->get(0, 0).input));

  // Relative paths are taken within the directory; a missing file is named before any decoding.
  options.directory = dir / "val";
  options.files = {"ant/v1.jpg"};
  CHECK(torch::equal(ImageFolderDataset(options).get(0, 0).input, val->get(1, 0).input));
  options.files = {"ant/v1.jpg", "ant/nope.jpg"};
  CHECK_THAT(data_error([&] { ImageFolderDataset{options}; }), Contains(dir / "val/ant/nope.jpg") && Contains("no such file"));
  options.files = {"ant"};
  CHECK_THAT(data_error([&] { ImageFolderDataset{options}; }), Contains("not a regular file"));

  // The config's own checks.
  config.resize_size = 16;
  CHECK_THROWS_WITH(train::data::image_folder_options(config, Split::Val), Contains("data.resize_size is 16"));
}

TEST_CASE("ImageFolder training samples are random resized crops fixed by the seed",
          "[data][image_folder]") {
  TempDir dir;
  make_image_folder(dir.path);
  const auto train = make_dataset(folder_config(dir.path), Split::Train);

  for (int64_t i = 0; i < train->size(); ++i) {
    INFO("sample " << i);
    const Example example = train->get(i, 1000 + i);
    CHECK(example.input.sizes() == torch::IntArrayRef{3, 32, 32});
    CHECK(example.input.scalar_type() == torch::kFloat);
    CHECK(example.input.is_contiguous());
    CHECK(example.input.min().item<float>() >= 0.0f);
    CHECK(example.input.max().item<float>() <= 1.0f);
    CHECK(example.target.dim() == 0);
    CHECK(example.target.scalar_type() == torch::kLong);
    CHECK(example.target.item<int64_t>() == i / 4);
  }
  for (int64_t i : {0, 8}) {  // 500x375 and 1000x800 (scaled decode)
    const torch::Tensor first = train->get(i, 7).input;
    CHECK(torch::equal(first, train->get(i, 7).input));
    CHECK_FALSE(torch::equal(first, train->get(i, 8).input));
  }
}

TEST_CASE("random_resized_crop_box follows torchvision's rules", "[data][image_folder]") {
  SECTION("draws fit the image, the area range and the ratio range") {
    for (uint64_t seed = 0; seed < 200; ++seed) {
      SplitMix64 rng(seed);
      const CropBox box = random_resized_crop_box(375, 500, 0.08, 1.0, 3.0 / 4.0, 4.0 / 3.0, rng);
      INFO("seed " << seed << ": " << box.top << "," << box.left << " " << box.height << "x"
                   << box.width);
      CHECK(box.top >= 0);
      CHECK(box.left >= 0);
      CHECK(box.top + box.height <= 375);
      CHECK(box.left + box.width <= 500);
      const double area = static_cast<double>(box.height * box.width) / (375.0 * 500.0);
      CHECK(area >= 0.07);  // 0.08 up to rounding of the sides
      // 3/4 and 4/3, up to rounding of sides of at least ~100 pixels
      CHECK(static_cast<double>(box.width) / box.height >= 0.73);
      CHECK(static_cast<double>(box.width) / box.height <= 1.37);
    }
  }
  SECTION("when nothing fits, the central crop with the ratio clamped") {
    // A 10x1000 strip: any crop with a ratio in [3/4, 4/3] and area >= 0.5 is too tall.
    SplitMix64 rng(1);
    const CropBox tall = random_resized_crop_box(1000, 10, 0.5, 1.0, 3.0 / 4.0, 4.0 / 3.0, rng);
    CHECK(tall.width == 10);
    CHECK(tall.height == 13);  // round(10 / 0.75)
    CHECK(tall.top == (1000 - 13) / 2);
    CHECK(tall.left == 0);
    const CropBox wide = random_resized_crop_box(10, 1000, 0.5, 1.0, 3.0 / 4.0, 4.0 / 3.0, rng);
    CHECK(wide.height == 10);
    CHECK(wide.width == 13);  // round(10 * 4 / 3)
    CHECK(wide.left == (1000 - 13) / 2);
  }
}

// torchvision's RandomResizedCrop.get_params is the reference (tests/python/random_resized_crop_oracle.py).
// Same draws: get_params is fed the very uniforms and integers random_resized_crop_box takes from
// SplitMix64(seed), so every box must be equal, whatever the shape (strips of 1 pixel, boxes that
// fit only at the tenth attempt, the fallback). Distributions: torch's own generator against
// SplitMix64, 20000 boxes each: the area fraction and the log aspect ratio (two-sample
// Kolmogorov-Smirnov distance) and how often the fallback is taken.
TEST_CASE("random_resized_crop_box draws the boxes of torchvision's RandomResizedCrop.get_params",
          "[data][image_folder][python][oracle]") {
  TempDir dir;
  struct Case {
    uint64_t seed;
    int64_t height, width;
    double min_scale, max_scale, min_ratio, max_ratio;
  };
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{375, 500}, {500, 375}, {1, 1},    {1, 7},
                                                           {7, 1},     {2, 3},     {10, 1000}, {1000, 10},
                                                           {60, 300},  {224, 224}, {13, 17},  {3, 3}};
  const std::vector<std::pair<double, double>> scales = {{0.08, 1.0}, {0.5, 1.0}, {1.0, 1.0}, {0.25, 0.5}};
  const std::vector<std::pair<double, double>> ratios = {{3.0 / 4.0, 4.0 / 3.0}, {1.0, 1.0}, {0.5, 2.0}, {2.0, 3.0}};
  std::vector<Case> cases;
  uint64_t seed = 1000;
  for (const auto& [h, w] : shapes) {
    for (const auto& [s0, s1] : scales) {
      for (const auto& [r0, r1] : ratios) {
        for (int k = 0; k < 20; ++k) cases.push_back({seed++, h, w, s0, s1, r0, r1});
      }
    }
  }
  {
    std::ofstream out(dir / "cases.txt");
    out.precision(17);
    for (const Case& c : cases) {
      out << c.seed << ' ' << c.height << ' ' << c.width << ' ' << c.min_scale << ' ' << c.max_scale << ' '
          << c.min_ratio << ' ' << c.max_ratio << '\n';
    }
  }
  // A 375x500 photo, and a 55x400 strip where about half the boxes are the fallback.
  const std::vector<Case> distributions = {{1, 375, 500, 0.08, 1.0, 3.0 / 4.0, 4.0 / 3.0},
                                           {2, 55, 400, 0.08, 1.0, 3.0 / 4.0, 4.0 / 3.0}};
  constexpr int kDraws = 20000;
  {
    std::ofstream out(dir / "distribution.txt");
    out.precision(17);
    for (const Case& c : distributions) {
      out << c.seed << ' ' << c.height << ' ' << c.width << ' ' << c.min_scale << ' ' << c.max_scale << ' '
          << c.min_ratio << ' ' << c.max_ratio << ' ' << kDraws << '\n';
    }
  }
  REQUIRE(train::testing::run_python("random_resized_crop_oracle.py", "\"" + dir.path + "\"") == 0);

  // The oracle's copy of SplitMix64 gives the same stream.
  {
    std::ifstream in(dir / "stream.txt");
    int seeds = 0;
    for (std::string line; std::getline(in, line); ++seeds) {
      std::istringstream values(line);
      uint64_t s = 0;
      values >> s;
      SplitMix64 rng(s);
      for (uint64_t v; values >> v;) CHECK(v == rng.next());
    }
    REQUIRE(seeds == 3);
  }
  auto read_boxes = [](const std::string& path) {
    std::vector<CropBox> boxes;
    std::ifstream in(path);
    for (CropBox b; in >> b.top >> b.left >> b.height >> b.width;) boxes.push_back(b);
    return boxes;
  };
  auto same = [](const CropBox& a, const CropBox& b) {
    return a.top == b.top && a.left == b.left && a.height == b.height && a.width == b.width;
  };
  // torchvision's fallback: the whole image, cut to the nearest allowed ratio, centred.
  auto fallback = [](const Case& c) {
    const double ratio = static_cast<double>(c.width) / static_cast<double>(c.height);
    int64_t h = c.height, w = c.width;
    if (ratio < c.min_ratio) h = static_cast<int64_t>(std::nearbyint(static_cast<double>(w) / c.min_ratio));
    if (ratio > c.max_ratio) w = static_cast<int64_t>(std::nearbyint(static_cast<double>(h) * c.max_ratio));
    return CropBox{(c.height - h) / 2, (c.width - w) / 2, h, w};
  };

  const std::vector<CropBox> expected = read_boxes(dir / "boxes.txt");
  REQUIRE(expected.size() == cases.size());
  int mismatches = 0, fallbacks = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SplitMix64 rng(c.seed);
    const CropBox got = random_resized_crop_box(c.height, c.width, c.min_scale, c.max_scale, c.min_ratio, c.max_ratio, rng);
    if (same(expected[i], fallback(c))) ++fallbacks;
    if (!same(got, expected[i]) && ++mismatches <= 10) {
      UNSCOPED_INFO("seed " << c.seed << ", " << c.height << "x" << c.width << ", scale [" << c.min_scale << ", "
                            << c.max_scale << "], ratio [" << c.min_ratio << ", " << c.max_ratio << "]: train "
                            << got.top << "," << got.left << " " << got.height << "x" << got.width << ", torchvision "
                            << expected[i].top << "," << expected[i].left << " " << expected[i].height << "x"
                            << expected[i].width);
    }
  }
  CHECK(mismatches == 0);
  // The cases reach the fallback and ordinary draws alike.
  CHECK(fallbacks > 200);
  CHECK(fallbacks < static_cast<int>(cases.size()) - 1000);

  const std::vector<CropBox> reference = read_boxes(dir / "distribution_boxes.txt");
  REQUIRE(reference.size() == distributions.size() * kDraws);
  // The largest gap between two empirical distribution functions.
  auto ks_distance = [](std::vector<double> a, std::vector<double> b) {
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    size_t i = 0, j = 0;
    double d = 0;
    while (i < a.size() && j < b.size()) {
      const double x = std::min(a[i], b[j]);
      while (i < a.size() && a[i] <= x) ++i;
      while (j < b.size() && b[j] <= x) ++j;
      d = std::max(d, std::abs(static_cast<double>(i) / a.size() - static_cast<double>(j) / b.size()));
    }
    return d;
  };
  for (size_t k = 0; k < distributions.size(); ++k) {
    const Case& c = distributions[k];
    const double area = static_cast<double>(c.height * c.width);
    struct Sample {
      std::vector<double> area, log_ratio;
      int fallbacks = 0;
      void add(const CropBox& box, const CropBox& fallback_box, double image_area) {
        area.push_back(static_cast<double>(box.height * box.width) / image_area);
        log_ratio.push_back(std::log(static_cast<double>(box.width) / static_cast<double>(box.height)));
        if (box.top == fallback_box.top && box.left == fallback_box.left && box.height == fallback_box.height &&
            box.width == fallback_box.width) {
          ++fallbacks;
        }
      }
    } ours, theirs;
    for (int i = 0; i < kDraws; ++i) {
      SplitMix64 rng(mix64(c.seed * kDraws + static_cast<uint64_t>(i)));
      ours.add(random_resized_crop_box(c.height, c.width, c.min_scale, c.max_scale, c.min_ratio, c.max_ratio, rng),
               fallback(c), area);
      theirs.add(reference[k * kDraws + static_cast<size_t>(i)], fallback(c), area);
    }
    const double area_d = ks_distance(ours.area, theirs.area), ratio_d = ks_distance(ours.log_ratio, theirs.log_ratio);
    const double fallback_gap = std::abs(ours.fallbacks - theirs.fallbacks) / static_cast<double>(kDraws);
    INFO(c.height << "x" << c.width << ": KS distance of the area fractions " << area_d << ", of the log ratios "
                  << ratio_d << "; fallback " << ours.fallbacks << " (train) and " << theirs.fallbacks
                  << " (torchvision) of " << kDraws);
    // Equal distributions stay under these (KS: P < 1e-6 for two samples of 20000; the fallback
    // share: 4 standard deviations of a difference of two shares near 0.5), a uniform instead of
    // a log-uniform ratio or one attempt more or fewer does not.
    CHECK(area_d < 0.027);
    CHECK(ratio_d < 0.027);
    CHECK(fallback_gap < 0.02);
  }
}

TEST_CASE("ImageFolder validation samples are the center crop of the resized image",
          "[data][image_folder]") {
  TempDir dir;
  // Validation lists the training split's classes only; its images are not read.
  const std::string cls = dir / "val/c";
  files::make_directories(cls);
  files::make_directories(dir / "train/c");

  SECTION("a linear gradient, halved and cropped, normalised") {
    // 80x60, R = 2x, G = 4y, B = 200 - 2y: bilinear halving of a linear ramp samples it at
    // 2j + 0.5 (away from the borders, also with antialiasing), which these ramps take at whole
    // levels (no rounding to 8 bits in between). Shorter side 60 -> 30 gives 40x30, and the
    // 24x24 center crop starts at row round(3) = 3, column round(8) = 8.
    Pixels gradient{80, 60, 3, {}};
    for (int y = 0; y < 60; ++y) {
      for (int x = 0; x < 80; ++x) {
        gradient.data.insert(gradient.data.end(), {static_cast<uint8_t>(2 * x),
                                                   static_cast<uint8_t>(4 * y),
                                                   static_cast<uint8_t>(200 - 2 * y)});
      }
    }
    write_png(cls + "/gradient.png", gradient);
    train::DataConfig config = folder_config(dir.path);
    config.image_size = 24;
    config.resize_size = 30;
    config.mean = {0.5, 0.25, 0.0};
    config.std = {0.5, 2.0, 1.0};
    const auto val = make_dataset(config, Split::Val);
    const torch::Tensor out = val->get(0, 123).input;
    REQUIRE(out.sizes() == torch::IntArrayRef{3, 24, 24});

    torch::Tensor expected = torch::empty({3, 24, 24});
    auto e = expected.accessor<float, 3>();
    for (int y = 0; y < 24; ++y) {
      for (int x = 0; x < 24; ++x) {
        const double sx = 2.0 * (x + 8) + 0.5;
        const double sy = 2.0 * (y + 3) + 0.5;
        e[0][y][x] = static_cast<float>((2.0 * sx / 255.0 - 0.5) / 0.5);
        e[1][y][x] = static_cast<float>((4.0 * sy / 255.0 - 0.25) / 2.0);
        e[2][y][x] = static_cast<float>((200.0 - 2.0 * sy) / 255.0);
      }
    }
    CHECK(torch::allclose(out, expected, /*rtol=*/0.0, /*atol=*/1e-4));
    CHECK(torch::equal(out, val->get(0, 456).input));  // no randomness
  }

  SECTION("a solid colour JPEG keeps its colour") {
    write_jpeg(cls + "/solid.jpg", solid(300, 200, {200, 100, 50}));
    const auto val = make_dataset(folder_config(dir.path), Split::Val);
    const torch::Tensor out = val->get(0, 0).input;
    REQUIRE(out.sizes() == torch::IntArrayRef{3, 32, 32});
    const torch::Tensor colour = torch::tensor({200.0f, 100.0f, 50.0f}).view({3, 1, 1}) / 255.0;
    CHECK((out - colour).abs().max().item<float>() <= 3.0f / 255.0f);
  }
}

TEST_CASE("JPEGs much larger than needed decode at a reduced DCT scale", "[data][image_folder]") {
  CHECK(choose_jpeg_scale(1000, 800, 224) == 2);  // 1/4 would be 250x200
  CHECK(choose_jpeg_scale(1000, 800, 200) == 4);
  CHECK(choose_jpeg_scale(1000, 800, 100) == 8);
  CHECK(choose_jpeg_scale(1000, 801, 101) == 8);  // ceil(801 / 8) = 101
  CHECK(choose_jpeg_scale(1000, 800, 101) == 4);
  CHECK(choose_jpeg_scale(500, 375, 224) == 1);
  CHECK(choose_jpeg_scale(64, 48, 224) == 1);
  CHECK(choose_jpeg_scale(4000, 3000, 0) == 1);

  TempDir dir;
  write_jpeg(dir / "big.jpg", pattern(1000, 800, 3));
  const torch::Tensor full = decode_image(dir / "big.jpg");
  CHECK(full.sizes() == torch::IntArrayRef{3, 800, 1000});
  const torch::Tensor half = decode_image(dir / "big.jpg", 224);
  CHECK(half.sizes() == torch::IntArrayRef{3, 400, 500});
  CHECK(decode_image(dir / "big.jpg", 100).sizes() == torch::IntArrayRef{3, 100, 125});
  // The reduced image is the full one, smaller: same mean colour per channel.
  const torch::Tensor full_mean = full.to(torch::kFloat).mean({1, 2});
  const torch::Tensor half_mean = half.to(torch::kFloat).mean({1, 2});
  CHECK(torch::allclose(full_mean, half_mean, 0.0, 1.0));
}

TEST_CASE("A training crop's JPEG scale keeps the full-size crop box at least the output size",
          "[data][image_folder]") {
  // 1600 x 1200: a 600 x 800 box is 150 x 200 at 1/4 and 75 x 100 at 1/8.
  const CropBox box{100, 200, 600, 800};
  CHECK(choose_jpeg_crop_scale(box, 1600, 1200, 224) == 2);
  CHECK(choose_jpeg_crop_scale(box, 1600, 1200, 150) == 4);
  CHECK(choose_jpeg_crop_scale(box, 1600, 1200, 75) == 8);
  CHECK(choose_jpeg_crop_scale(box, 1600, 1200, 301) == 1);
  CHECK(choose_jpeg_crop_scale(box, 1600, 1200, 0) == 1);
  auto same = [](const CropBox& a, const CropBox& b) {
    return a.top == b.top && a.left == b.left && a.height == b.height && a.width == b.width;
  };
  CHECK(same(scale_crop_box(box, 1600, 1200, 4), CropBox{25, 50, 150, 200}));
  CHECK(same(scale_crop_box(box, 1600, 1200, 1), box));
  // Edges round to the nearest pixel edge: rows [3, 13) -> [1.5, 6.5) -> [2, 7) (half up).
  CHECK(same(scale_crop_box(CropBox{3, 5, 10, 13}, 40, 30, 2), CropBox{2, 3, 5, 6}));
  // Within the reduced image (ceil(1201 / 8) = 151 rows), and never empty.
  CHECK(same(scale_crop_box(CropBox{1199, 1596, 2, 4}, 1600, 1201, 8), CropBox{150, 199, 1, 1}));

  // torchvision's boxes on the full size of a 1600 x 1200 photo, for a 64-pixel output: the
  // reduced crop is never smaller than the output, and the next smaller scale would make it so.
  int reduced = 0;
  for (uint64_t seed = 0; seed < 300; ++seed) {
    SplitMix64 rng(seed);
    const CropBox full = random_resized_crop_box(1200, 1600, 0.08, 1.0, 3.0 / 4.0, 4.0 / 3.0, rng);
    const int d = choose_jpeg_crop_scale(full, 1600, 1200, 64);
    const CropBox scaled = scale_crop_box(full, 1600, 1200, d);
    INFO("seed " << seed << ": 1/" << d << " of " << full.height << "x" << full.width);
    CHECK(std::min(scaled.height, scaled.width) >= 64);
    if (d < 8) {
      const CropBox smaller = scale_crop_box(full, 1600, 1200, 2 * d);
      CHECK(std::min(smaller.height, smaller.width) < 64);
    }
    CHECK(std::abs(static_cast<double>(scaled.top) - static_cast<double>(full.top) / d) <= 0.5);
    CHECK(std::abs(static_cast<double>(scaled.top + scaled.height) -
                   static_cast<double>(full.top + full.height) / d) <= 0.5);
    CHECK(std::abs(static_cast<double>(scaled.left) - static_cast<double>(full.left) / d) <= 0.5);
    CHECK(std::abs(static_cast<double>(scaled.left + scaled.width) -
                   static_cast<double>(full.left + full.width) / d) <= 0.5);
    reduced += d > 1 ? 1 : 0;
  }
  CHECK(reduced > 250);
}

TEST_CASE("Training crops of a large JPEG are torchvision's crops of the full-size image",
          "[data][image_folder]") {
  // Two 1600 x 1200 photos, 64-pixel outputs:
  //   smooth:  waves with periods of 400 and 300 pixels, compared pixel by pixel: the crop is
  //            where torchvision's box is (the same random draws give another box when drawn on
  //            a reduced image);
  //   stripes: a period of 18 pixels. A crop box under 480 pixels keeps them (2.4 output pixels
  //            or more per period) when shrunk from the full-size image, as torchvision does,
  //            but loses a quarter of their contrast when upsampled from a 1/8-scale decode.
  TempDir dir;
  files::make_directories(dir / "train/a");
  constexpr double kPi = 3.14159265358979323846;
  auto waves = [&](const std::string& name, double period_x, double period_y) {
    Pixels p{1600, 1200, 3, {}};
    for (int y = 0; y < p.height; ++y) {
      for (int x = 0; x < p.width; ++x) {
        const double v = 128.0 + 50.0 * (std::sin(2.0 * kPi * x / period_x) + std::sin(2.0 * kPi * y / period_y));
        p.data.insert(p.data.end(), {static_cast<uint8_t>(std::lround(v)), static_cast<uint8_t>(std::lround(v)),
                                     static_cast<uint8_t>(255 - std::lround(v))});
      }
    }
    write_jpeg(dir / ("train/a/" + name), p);
    return decode_image(dir / ("train/a/" + name)).to(torch::kFloat);
  };
  const torch::Tensor smooth = waves("0_smooth.jpg", 400.0, 300.0);
  const torch::Tensor stripes = waves("1_stripes.jpg", 18.0, 18.0);
  REQUIRE(smooth.sizes() == torch::IntArrayRef{3, 1200, 1600});
  train::DataConfig config = folder_config(dir.path);
  config.image_size = 64;
  const auto train = make_dataset(config, Split::Train);

  // torchvision: RandomResizedCrop's box on the full image, resized, then the flip.
  auto torchvision_crop = [](const torch::Tensor& image, uint64_t seed, CropBox& box) {
    SplitMix64 rng(seed);
    box = random_resized_crop_box(1200, 1600, 0.08, 1.0, 3.0 / 4.0, 4.0 / 3.0, rng);
    const torch::Tensor crop = image.narrow(1, box.top, box.height).narrow(2, box.left, box.width);
    const torch::Tensor resized = resize_bilinear(crop.contiguous(), 64, 64);
    return rng.below(2) == 1 ? hflip(resized) : resized;
  };
  int small_boxes = 0;
  for (uint64_t seed = 0; seed < 100; ++seed) {
    CropBox box;
    const torch::Tensor expected = torchvision_crop(smooth, seed, box);
    // The reduced decode's box edges are whole pixels there (up to d / 2 pixels off here).
    const double error = (train->get(0, seed).input * 255.0 - expected).abs().mean().item<double>();
    INFO("seed " << seed << ": box " << box.height << "x" << box.width << ", smooth: mean error " << error);
    CHECK(error < 3.5);
    if (std::min(box.height, box.width) >= 480) continue;  // stripes too fine for the output
    ++small_boxes;
    const torch::Tensor expected_stripes = torchvision_crop(stripes, seed, box);
    const torch::Tensor actual_stripes = train->get(1, seed).input * 255.0;
    const double contrast = actual_stripes.std().item<double>() / expected_stripes.std().item<double>();
    INFO("stripes: contrast " << contrast << " of torchvision's");
    CHECK(contrast > 0.85);
    CHECK(contrast < 1.15);
  }
  CHECK(small_boxes >= 5);
}

TEST_CASE("A training crop decodes only the rows and columns around it, to the pixels of a full decode",
          "[data][image_folder]") {
  TempDir dir;
  // Noise, so that every pixel and every chroma sample differs from its neighbours: a crop edge
  // upsampled as if it were the image's edge would show.
  auto noise = [](int width, int height, int channels, uint64_t seed) {
    Pixels p{width, height, channels, {}};
    SplitMix64 rng(seed);
    p.data.resize(static_cast<size_t>(width) * height * channels);
    for (uint8_t& v : p.data) v = static_cast<uint8_t>(rng.next() >> 56);
    return p;
  };
  struct Case {
    const char* name;
    Pixels pixels;
    int subsampling;
    int flags;
  };
  const std::vector<Case> cases = {
      {"420.jpg", noise(333, 250, 3, 1), TJSAMP_420, 0},
      {"422.jpg", noise(250, 333, 3, 2), TJSAMP_422, 0},
      {"440.jpg", noise(301, 203, 3, 3), TJSAMP_440, 0},
      {"411.jpg", noise(299, 199, 3, 4), TJSAMP_411, 0},
      {"444.jpg", noise(203, 301, 3, 5), TJSAMP_444, 0},
      {"gray.jpg", noise(210, 190, 1, 6), TJSAMP_GRAY, 0},
      {"cmyk.jpg", noise(190, 170, 4, 7), TJSAMP_444, 0},
      {"progressive.jpg", noise(333, 250, 3, 8), TJSAMP_420, TJFLAG_PROGRESSIVE},
      {"large.jpg", noise(1001, 777, 3, 9), TJSAMP_420, 0},
  };
  SplitMix64 rng(11);
  for (const Case& c : cases) {
    write_jpeg(dir / c.name, c.pixels, c.subsampling, c.flags);
    for (const int d : {1, 2, 4, 8}) {
      // decode_image(path, needed) decodes at 1/d for needed = ceil(shorter side / d).
      const torch::Tensor full = decode_image(dir / c.name, (std::min(c.pixels.width, c.pixels.height) + d - 1) / d);
      const int64_t height = full.size(1), width = full.size(2);
      REQUIRE(height == (c.pixels.height + d - 1) / d);
      for (int trial = 0; trial < 12; ++trial) {
        CropBox box;
        box.top = static_cast<int64_t>(rng.below(static_cast<uint64_t>(height)));
        box.left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(width)));
        box.height = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(height - box.top)));
        box.width = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(width - box.left)));
        if (trial == 0) box = CropBox{0, 0, height, width};
        INFO(c.name << " at 1/" << d << ", box " << box.height << "x" << box.width << " at (" << box.top << ", "
                    << box.left << ")");
        const torch::Tensor crop = decode_jpeg_crop(dir / c.name, d, box);
        CHECK(torch::equal(crop, full.narrow(1, box.top, box.height).narrow(2, box.left, box.width)));
      }
    }
  }
  CHECK_THROWS_AS(decode_jpeg_crop(dir / "420.jpg", 1, CropBox{200, 0, 51, 10}), std::invalid_argument);
  CHECK_THROWS_AS(decode_jpeg_crop(dir / "420.jpg", 3, CropBox{0, 0, 1, 1}), std::invalid_argument);

  // Damage below the crop is still found: the rows after it are read through.
  const std::vector<uint8_t> jpeg = read_file(dir / "420.jpg");
  write_file(dir / "cut.jpg", std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + jpeg.size() * 3 / 4));
  CHECK_THAT(data_error([&] { decode_jpeg_crop(dir / "cut.jpg", 1, CropBox{0, 0, 8, 8}); }),
             Contains(dir / "cut.jpg") && Contains("Premature end of JPEG file"));
  // Through the dataset's training crops too; and data damaged below a crop, which a crop does
  // not decode, is found by get_checked (train check --data), which decodes the whole file.
  std::vector<uint8_t> garbled = jpeg;  // a marker in the middle of the last quarter's data
  garbled[garbled.size() * 7 / 8] = 0xFF;
  garbled[garbled.size() * 7 / 8 + 1] = 0xD3;
  write_file(dir / "garbled.jpg", garbled);
  CHECK_THROWS_AS(decode_image(dir / "garbled.jpg"), train::DataError);
  files::make_directories(dir / "train/a");
  write_file(dir / "train/a/cut.jpg", std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + jpeg.size() * 3 / 4));
  write_file(dir / "train/a/garbled.jpg", garbled);
  const auto train = make_dataset(folder_config(dir.path), Split::Train);
  for (uint64_t seed = 0; seed < 8; ++seed) {
    CHECK_THAT(data_error([&] { train->get(0, seed); }), Contains("cut.jpg") && Contains("Premature end of JPEG file"));
    CHECK_THAT(data_error([&] { train->get_checked(1, seed); }), Contains("garbled.jpg") && Contains("Corrupt JPEG"));
  }
  // (A crop that ends above the damage does not see it: the trade for not decoding those rows.)
  int clean_crops = 0;
  for (uint64_t seed = 0; seed < 32; ++seed) {
    try {
      clean_crops += train->get(1, seed).input.size(0) == 3 ? 1 : 0;
    } catch (const train::DataError&) {
    }
  }
  CHECK(clean_crops > 0);
  const ScanReport report = scan_dataset(*train);
  CHECK(report.bad == 2);
}

TEST_CASE("Grayscale, CMYK and alpha images decode to RGB", "[data][image_folder]") {
  TempDir dir;
  SECTION("grayscale JPEG: three equal channels") {
    write_jpeg(dir / "gray.jpg", pattern(40, 30, 1));
    const torch::Tensor image = decode_image(dir / "gray.jpg");
    REQUIRE(image.sizes() == torch::IntArrayRef{3, 30, 40});
    CHECK(torch::equal(image[0], image[1]));
    CHECK(torch::equal(image[0], image[2]));
  }
  SECTION("CMYK JPEG (inverted, as Adobe writes it)") {
    // Stored (200, 100, 50, 255) = no black ink: RGB (200, 100, 50).
    write_jpeg(dir / "cmyk.jpg", solid(24, 16, {200, 100, 50, 255}));
    const torch::Tensor image = decode_image(dir / "cmyk.jpg").to(torch::kInt);
    REQUIRE(image.sizes() == torch::IntArrayRef{3, 16, 24});
    const torch::Tensor colour = torch::tensor({200, 100, 50}, torch::kInt).view({3, 1, 1});
    CHECK((image - colour).abs().max().item<int>() <= 2);
  }
  SECTION("RGBA PNG: alpha dropped, colours not blended") {
    write_png(dir / "alpha.png", solid(8, 6, {10, 20, 30, 0}));
    const torch::Tensor image = decode_image(dir / "alpha.png").to(torch::kInt);
    REQUIRE(image.sizes() == torch::IntArrayRef{3, 6, 8});
    CHECK(torch::equal(image, torch::tensor({10, 20, 30}, torch::kInt).view({3, 1, 1}).expand({3, 6, 8})));
  }
}

TEST_CASE("PNGs decode to their stored values as PIL gives them", "[data][image_folder]") {
  // The expected values are PIL 13's Image.open(file).convert("RGB") of the same files (except
  // 16-bit grayscale, see decode_image). No gamma or colour conversion is applied.
  TempDir dir;
  const std::vector<int> samples16 = {0x8000, 0x80FF, 0x7FFF, 0xFFFF, 0x0180, 0x00FF};
  const std::vector<int> high_bytes = {128, 128, 127, 255, 1, 0};
  // The decoded [3, 1, 6] image's channels, each expected to equal `values`.
  auto check_row = [&](const std::string& name, const std::vector<int>& values) {
    INFO(name);
    const torch::Tensor image = decode_image(dir / name).to(torch::kInt);
    REQUIRE(image.sizes() == torch::IntArrayRef{3, 1, static_cast<int64_t>(values.size())});
    const torch::Tensor expected = torch::tensor(values, torch::kInt).view({1, 1, -1}).expand_as(image);
    CHECK(torch::equal(image, expected));
  };

  SECTION("a 16-bit RGB PNG of 0x8000 is 128 everywhere") {
    PngSpec spec{4, 4, 16, PNG_COLOR_TYPE_RGB};
    for (int y = 0; y < 4; ++y) spec.rows.push_back(row16(std::vector<int>(12, 0x8000)));
    write_png_spec(dir / "rgb16.png", spec);
    const torch::Tensor image = decode_image(dir / "rgb16.png");
    REQUIRE(image.sizes() == torch::IntArrayRef{3, 4, 4});
    CHECK(image.eq(128).all().item<bool>());
  }
  SECTION("16-bit samples keep their high byte, with or without alpha, gray or colour") {
    std::vector<int> rgb, rgba, gray_alpha;
    for (const int v : samples16) {
      rgb.insert(rgb.end(), {v, v, v});
      rgba.insert(rgba.end(), {v, v, v, 0x1234});
      gray_alpha.insert(gray_alpha.end(), {v, 0x1234});
    }
    write_png_spec(dir / "rgb16.png", PngSpec{6, 1, 16, PNG_COLOR_TYPE_RGB, {row16(rgb)}});
    write_png_spec(dir / "rgba16.png", PngSpec{6, 1, 16, PNG_COLOR_TYPE_RGB_ALPHA, {row16(rgba)}});
    write_png_spec(dir / "ga16.png", PngSpec{6, 1, 16, PNG_COLOR_TYPE_GRAY_ALPHA, {row16(gray_alpha)}});
    // PIL clips 16-bit gray to 255 instead (all six would be 255).
    write_png_spec(dir / "gray16.png", PngSpec{6, 1, 16, PNG_COLOR_TYPE_GRAY, {row16(samples16)}});
    for (const char* name : {"rgb16.png", "rgba16.png", "ga16.png", "gray16.png"}) check_row(name, high_bytes);
  }
  SECTION("a gAMA chunk does not change the values") {
    for (const double gamma : {1.0, 0.5, 1.0 / 2.2}) {
      PngSpec spec{6, 1, 8, PNG_COLOR_TYPE_RGB};
      spec.rows.push_back({});
      for (const int v : {128, 128, 0, 255, 64, 200}) {
        spec.rows[0].insert(spec.rows[0].end(), 3, static_cast<uint8_t>(v));
      }
      spec.gamma = gamma;
      write_png_spec(dir / "gamma.png", spec);
      INFO("gAMA " << gamma);
      check_row("gamma.png", {128, 128, 0, 255, 64, 200});
    }
  }
  SECTION("gray of 1, 2 and 4 bits, palettes and tRNS transparency") {
    write_png_spec(dir / "gray1.png", PngSpec{6, 1, 1, PNG_COLOR_TYPE_GRAY, {{0b10110000}}});
    check_row("gray1.png", {255, 0, 255, 255, 0, 0});
    write_png_spec(dir / "gray2.png", PngSpec{6, 1, 2, PNG_COLOR_TYPE_GRAY, {{0b00011011, 0b11100000}}});
    check_row("gray2.png", {0, 85, 170, 255, 255, 170});
    write_png_spec(dir / "gray4.png", PngSpec{6, 1, 4, PNG_COLOR_TYPE_GRAY, {{0x1F, 0x80, 0x0F}}});
    check_row("gray4.png", {17, 255, 136, 0, 0, 255});
    PngSpec gray_trns{6, 1, 8, PNG_COLOR_TYPE_GRAY, {{5, 7, 5, 0, 255, 128}}};
    gray_trns.trns = png_color_16{0, 0, 0, 0, 5};
    write_png_spec(dir / "gray_trns.png", gray_trns);
    check_row("gray_trns.png", {5, 7, 5, 0, 255, 128});

    PngSpec palette{6, 1, 4, PNG_COLOR_TYPE_PALETTE, {{0x01, 0x21, 0x00}}};
    palette.palette = {{10, 20, 30}, {40, 50, 60}, {70, 80, 90}};
    palette.palette_alpha = {0, 128};
    write_png_spec(dir / "palette.png", palette);
    const torch::Tensor image = decode_image(dir / "palette.png").to(torch::kInt);
    REQUIRE(image.sizes() == torch::IntArrayRef{3, 1, 6});
    const torch::Tensor expected =
        torch::tensor({10, 40, 70, 40, 10, 10, 20, 50, 80, 50, 20, 20, 30, 60, 90, 60, 30, 30}, torch::kInt)
            .view({3, 1, 6});
    CHECK(torch::equal(image, expected));
  }
  SECTION("an interlaced PNG decodes as the same image stored progressively") {
    const Pixels p = pattern(37, 23, 3, 2);
    PngSpec spec{p.width, p.height, 8, PNG_COLOR_TYPE_RGB};
    for (int y = 0; y < p.height; ++y) {
      const auto row = p.data.begin() + static_cast<std::ptrdiff_t>(y) * p.width * 3;
      spec.rows.emplace_back(row, row + p.width * 3);
    }
    spec.interlaced = true;
    write_png_spec(dir / "adam7.png", spec);
    write_png(dir / "plain.png", p);
    REQUIRE(read_file(dir / "adam7.png") != read_file(dir / "plain.png"));
    CHECK(torch::equal(decode_image(dir / "adam7.png"), decode_image(dir / "plain.png")));
  }
}

TEST_CASE("Damaged and mislabelled image files are errors naming the file",
          "[data][image_folder]") {
  TempDir dir;
  write_jpeg(dir / "good.jpg", pattern(200, 150, 3));  // half of it ends within the scan
  const std::vector<uint8_t> jpeg = read_file(dir / "good.jpg");

  SECTION("truncated JPEG data") {
    write_file(dir / "cut.jpg", std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + jpeg.size() / 2));
    CHECK_THAT(data_error([&] { decode_image(dir / "cut.jpg"); }),
               Contains(dir / "cut.jpg") && Contains("Premature end of JPEG file"));
  }
  SECTION("truncated JPEG header") {
    write_file(dir / "stub.jpg", std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + 40));
    CHECK_THAT(data_error([&] { decode_image(dir / "stub.jpg"); }),
               Contains(dir / "stub.jpg") && Contains("JPEG header"));
  }
  SECTION("a damaged JPEG does not spoil the next one decoded on the same thread") {
    // Each thread keeps its TurboJPEG decompressor; a failure must not leave state behind.
    write_file(dir / "stub.jpg", std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + 40));
    write_file(dir / "cut.jpg", std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + jpeg.size() / 2));
    write_jpeg(dir / "small.jpg", pattern(32, 32, 3, 1));
    const std::vector<uint8_t> small = read_file(dir / "small.jpg");
    write_file(dir / "small_cut.jpg", std::vector<uint8_t>(small.begin(), small.begin() + 300));
    torch::Tensor fresh, fresh_small;
    std::thread([&] {
      fresh = decode_image(dir / "good.jpg");
      fresh_small = decode_image(dir / "small.jpg");
    }).join();
    for (const char* bad : {"stub.jpg", "cut.jpg", "small_cut.jpg", "stub.jpg", "small_cut.jpg"}) {
      INFO(bad);
      CHECK_THROWS_AS(decode_image(dir / bad), train::DataError);
      CHECK(torch::equal(decode_image(dir / "good.jpg"), fresh));
      CHECK_THROWS_AS(decode_image(dir / bad), train::DataError);
      CHECK(torch::equal(decode_image(dir / "small.jpg"), fresh_small));
    }
  }
  SECTION("stray bytes before a header marker are harmless, and do not hide damage after them") {
    // libjpeg: "Corrupt JPEG data: 3 extraneous bytes before marker 0xdb"; PIL loads the file.
    const std::vector<uint8_t> dqt = {0xFF, 0xDB};
    std::vector<uint8_t> stray = jpeg;
    const auto at = std::search(stray.begin(), stray.end(), dqt.begin(), dqt.end());
    REQUIRE(at != stray.end());
    stray.insert(at, {0x00, 0x01, 0x02});
    write_file(dir / "stray_header.jpg", stray);
    CHECK(torch::equal(decode_image(dir / "stray_header.jpg"), decode_image(dir / "good.jpg")));
    CHECK(torch::equal(decode_image(dir / "stray_header.jpg", 40), decode_image(dir / "good.jpg", 40)));
    // TurboJPEG reports the first warning only, so that of the stray bytes would hide this one.
    write_file(dir / "stray_cut.jpg", std::vector<uint8_t>(stray.begin(), stray.begin() + stray.size() / 2));
    CHECK_THAT(data_error([&] { decode_image(dir / "stray_cut.jpg"); }),
               Contains(dir / "stray_cut.jpg") && Contains("Premature end of JPEG file"));
    // Through the dataset, whose training crop reads the header first.
    for (const std::string split_directory : {"train/a", "val/a"}) {
      files::make_directories(dir / split_directory);
      write_file(dir / (split_directory + "/0.jpg"), jpeg);
      write_file(dir / (split_directory + "/1.jpg"), stray);
    }
    for (const Split split : {Split::Train, Split::Val}) {
      const auto dataset = make_dataset(folder_config(dir.path), split);
      CHECK(torch::equal(dataset->get(1, 5).input, dataset->get(0, 5).input));
    }
  }
  SECTION("an unknown JFIF version is harmless, and does not hide damage after it") {
    // TurboJPEG writes a JFIF APP0 segment first: FF D8 FF E0 <length> "JFIF\0" <major> <minor>.
    REQUIRE(jpeg.size() > 12);
    REQUIRE(std::string(jpeg.begin() + 6, jpeg.begin() + 10) == "JFIF");
    std::vector<uint8_t> version = jpeg;
    version[11] = 3;  // libjpeg: "Warning: unknown JFIF revision number 3.01"
    write_file(dir / "jfif3.jpg", version);
    CHECK(torch::equal(decode_image(dir / "jfif3.jpg"), decode_image(dir / "good.jpg")));
    write_file(dir / "jfif3_cut.jpg", std::vector<uint8_t>(version.begin(), version.begin() + version.size() / 2));
    CHECK_THAT(data_error([&] { decode_image(dir / "jfif3_cut.jpg"); }),
               Contains(dir / "jfif3_cut.jpg") && Contains("Premature end of JPEG file"));
  }
  SECTION("stray bytes before the end marker are harmless") {
    std::vector<uint8_t> padded(jpeg.begin(), jpeg.end() - 2);
    padded.insert(padded.end(), {0x12, 0x34, 0xFF, 0xD9});
    write_file(dir / "padded.jpg", padded);
    CHECK(torch::equal(decode_image(dir / "padded.jpg"), decode_image(dir / "good.jpg")));
  }
  SECTION("truncated PNG") {
    write_png(dir / "good.png", pattern(64, 48, 3));
    const std::vector<uint8_t> png = read_file(dir / "good.png");
    write_file(dir / "cut.png", std::vector<uint8_t>(png.begin(), png.begin() + png.size() / 2));
    CHECK_THAT(data_error([&] { decode_image(dir / "cut.png"); }),
               Contains(dir / "cut.png") && Contains("PNG"));
  }
  SECTION("text with a .jpg name, and an empty file") {
    write_file(dir / "notes.jpg", {'h', 'e', 'l', 'l', 'o'});
    write_file(dir / "empty.png", {});
    CHECK_THAT(data_error([&] { decode_image(dir / "notes.jpg"); }),
               Contains(dir / "notes.jpg") && Contains("not a JPEG or PNG file"));
    CHECK_THAT(data_error([&] { decode_image(dir / "empty.png"); }),
               Contains(dir / "empty.png") && Contains("not a JPEG or PNG file"));
  }
  SECTION("through the loader, with the sample index") {
    files::make_directories(dir / "train/a");
    write_jpeg(dir / "train/a/0.jpg", pattern(64, 48, 3));
    write_file(dir / "train/a/1.jpg", {'t', 'e', 'x', 't'});
    const auto train = make_dataset(folder_config(dir.path), Split::Train);
    LoaderOptions options;
    options.batch_size = 2;
    options.shuffle = false;
    options.workers = 1;
    Loader loader(train, options);
    loader.start({0, 0});
    CHECK_THAT(data_error([&] { loader.next(); }),
               Contains("sample 1") && Contains(dir / "train/a/1.jpg"));
  }
}

TEST_CASE("ImageFolder directory and config errors", "[data][image_folder]") {
  TempDir dir;
  make_image_folder(dir.path);

  SECTION("a missing root or split directory names the path") {
    train::DataConfig config = folder_config(dir / "nowhere");
    try {
      make_dataset(config, Split::Train);
      FAIL("expected a DataError");
    } catch (const train::DataError& e) {
      CHECK_THAT(std::string(e.what()), Contains(dir / "nowhere"));
      CHECK(e.exit_code() == train::kExitData);
    }
    config = folder_config(dir.path);
    config.val_dir = "validation";
    CHECK_THAT(data_error([&] { make_dataset(config, Split::Val); }),
               Contains("key 'data.val_dir': " + dir / "validation" + " does not exist"));
  }
  SECTION("a validation class that training lacks") {
    files::make_directories(dir / "val/emu");
    CHECK_THAT(data_error([&] { make_dataset(folder_config(dir.path), Split::Val); }),
               Contains(dir / "val/emu") && Contains("not among the training split's classes"));
  }
  SECTION("a split without images") {
    files::make_directories(dir / "empty/a");
    files::make_directories(dir / "empty/b");
    train::DataConfig config = folder_config(dir.path);
    config.train_dir = "empty";
    CHECK_THAT(data_error([&] { make_dataset(config, Split::Train); }),
               Contains(dir / "empty") && Contains("no images"));
  }
  SECTION("settings that do not fit the kind") {
    train::DataConfig config = folder_config(dir.path);
    config.root = "";
    CHECK_THAT(config_error(config, Split::Train), Contains("data.root is required"));
    config = folder_config(dir.path);
    config.random_crop = true;
    CHECK_THAT(config_error(config, Split::Train), Contains("data.random_crop"));
    config = folder_config(dir.path);
    config.resize_size = 31;
    CHECK_THAT(config_error(config, Split::Val), Contains("data.resize_size is 31"));
    config = folder_config(dir.path);
    config.mean = {0.5};
    config.std = {0.5};
    CHECK_THAT(config_error(config, Split::Train), Contains("3 channel(s)"));
  }
}

TEST_CASE("image_folder config keys have defaults and are validated", "[data][image_folder]") {
  const std::string required = "model: {name: resnet50}\ntrainer: {global_batch: 256, epochs: 90}\n";
  const train::Config config = train::parse_config(
      required + "data: {kind: image_folder, root: /data/imagenet, image_size: 224}\n", "in.yaml");
  CHECK(config.data.train_dir == "train");
  CHECK(config.data.val_dir == "val");
  CHECK(config.data.resize_size == 0);
  CHECK(config.data.crop_min_scale == 0.08);

  auto error = [&](const std::string& data) {
    try {
      train::parse_config(required + "data: " + data + "\n", "in.yaml");
    } catch (const train::ConfigError& e) {
      return std::string(e.what());
    }
    FAIL("expected a ConfigError for " << data);
    return std::string();
  };
  CHECK_THAT(error("{kind: image_folder}"),
             Contains("key 'data.root': required when data.kind is 'image_folder'"));
  CHECK_THAT(error("{kind: image_folder, root: /d, image_size: 224, resize_size: 200}"),
             Contains("key 'data.resize_size'") && Contains("smaller than data.image_size (224)"));
  CHECK_THAT(error("{kind: image_folder, root: /d, crop_min_scale: 0}"),
             Contains("key 'data.crop_min_scale'"));
}

TEST_CASE("ImageFolder batches are the same for 0 and 2 loader workers", "[data][image_folder]") {
  TempDir dir;
  make_image_folder(dir.path);
  for (const Split split : {Split::Train, Split::Val}) {
    const auto dataset = make_dataset(folder_config(dir.path), split);
    for (int64_t epoch : {0, 1}) {
      const std::vector<Batch> serial = run_epoch(dataset, 0, epoch);
      const std::vector<Batch> parallel = run_epoch(dataset, 2, epoch);
      REQUIRE(serial.size() == parallel.size());
      for (size_t b = 0; b < serial.size(); ++b) {
        INFO("epoch " << epoch << " batch " << b);
        CHECK(torch::equal(serial[b].input, parallel[b].input));
        CHECK(torch::equal(serial[b].target, parallel[b].target));
      }
    }
  }
}

TEST_CASE("data.on_error: raise stops at a corrupt JPEG, skip replaces and counts it",
          "[data][image_folder]") {
  TempDir dir;
  // Indices: a/0..a/3 = 0..3, b/0..b/3 = 4..7; a/2 and a/3 are truncated JPEGs.
  for (const char* name : {"a", "b"}) files::make_directories(dir / ("train/" + std::string(name)));
  for (int i = 0; i < 4; ++i) {
    write_jpeg(dir / ("train/a/" + std::to_string(i) + ".jpg"), pattern(64, 48, 3, i));
    write_jpeg(dir / ("train/b/" + std::to_string(i) + ".jpg"), pattern(48, 64, 3, i));
  }
  for (const char* name : {"train/a/2.jpg", "train/a/3.jpg"}) {
    const std::vector<uint8_t> jpeg = read_file(dir / name);
    write_file(dir / name, std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + jpeg.size() / 2));
  }
  const auto dataset = make_dataset(folder_config(dir.path), Split::Train);
  REQUIRE(dataset->size() == 8);

  auto options_for = [](int64_t workers, OnError on_error) {
    LoaderOptions options;
    options.batch_size = 3;
    options.drop_last = false;
    options.shuffle = false;
    options.workers = workers;
    options.seed = 5;
    options.on_error = on_error;
    return options;
  };

  SECTION("raise: the error names the sample and the file, for any worker count") {
    for (int64_t workers : {0, 2}) {
      Loader loader(dataset, options_for(workers, OnError::Raise));
      loader.start({0, 0});
      CHECK_THAT(data_error([&] { loader.next(); }),
                 Contains("sample 2") && Contains(dir / "train/a/2.jpg") && Contains("JPEG"));
      CHECK(loader.skipped() == 0);
    }
  }

  SECTION("skip: the next index that loads takes the place, the same for any worker count") {
    std::vector<Batch> reference;
    for (int64_t workers : {0, 1, 3}) {
      INFO("workers " << workers);
      Loader loader(dataset, options_for(workers, OnError::Skip));
      std::vector<Batch> batches;
      for (int64_t epoch : {0, 1}) {
        loader.start({epoch, 0});
        while (std::optional<Batch> batch = loader.next()) batches.push_back(*batch);
        CHECK(loader.skipped() == 2 * (epoch + 1));  // a/2 and a/3, once per epoch
      }
      REQUIRE(batches.size() == 6);
      CHECK(batches[2].size() == 2);  // batch sizes are kept
      // Batch 0 = samples 0, 1, 2 -> 4; batch 1 = samples 3 -> 4, 4, 5.
      CHECK(torch::equal(batches[0].target, torch::tensor({0, 0, 1}, torch::kLong)));
      CHECK(torch::equal(batches[1].target, torch::tensor({1, 1, 1}, torch::kLong)));
      const Example substitute = dataset->get(4, sample_seed(5, 0, 4));
      CHECK(torch::equal(batches[0].input[2], substitute.input));
      CHECK(torch::equal(batches[1].input[0], substitute.input));
      CHECK(torch::equal(batches[1].input[1], substitute.input));
      REQUIRE(loader.skip_messages().size() == 4);
      CHECK_THAT(loader.skip_messages()[0], Contains("sample 2") && Contains(dir / "train/a/2.jpg"));
      CHECK_THAT(loader.skip_messages()[1], Contains("sample 3") && Contains(dir / "train/a/3.jpg"));
      if (reference.empty()) {
        reference = batches;
        continue;
      }
      for (size_t b = 0; b < batches.size(); ++b) {
        INFO("batch " << b);
        CHECK(torch::equal(batches[b].input, reference[b].input));
        CHECK(torch::equal(batches[b].target, reference[b].target));
      }
    }
  }

  SECTION("skip: a batch delivered again after a rewind does not count its samples again") {
    // The trainer rewinds the loader to redo steps (out-of-memory recovery, rollback).
    for (int64_t workers : {0, 2}) {
      INFO("workers " << workers);
      Loader loader(dataset, options_for(workers, OnError::Skip));
      loader.start({0, 0});
      REQUIRE(loader.next().has_value());  // samples 0, 1, 2 -> 4
      CHECK(loader.skipped() == 1);
      loader.start({0, 0});
      REQUIRE(loader.next().has_value());
      REQUIRE(loader.next().has_value());  // samples 3 -> 4, 4, 5
      CHECK(loader.skipped() == 2);
      CHECK(loader.skip_messages().size() == 2);
      CHECK(loader.skipped_samples() == std::set<std::pair<int64_t, int64_t>>{{0, 2}, {0, 3}});
      loader.start({1, 0});
      REQUIRE(loader.next().has_value());
      CHECK(loader.skipped() == 3);  // a new epoch counts again
    }
  }

  SECTION("skip: a dataset where nothing loads is still an error") {
    TempDir broken;
    files::make_directories(broken / "train/a");
    for (int i = 0; i < 3; ++i) write_file(broken / ("train/a/" + std::to_string(i) + ".jpg"), {1, 2, 3});
    Loader loader(make_dataset(folder_config(broken.path), Split::Train), options_for(2, OnError::Skip));
    loader.start({0, 0});
    CHECK_THAT(data_error([&] { loader.next(); }),
               Contains("sample 0") && Contains("the 2 samples after it fail to load too") &&
                   Contains(broken / "train/a/0.jpg"));
  }

  CHECK(parse_on_error("skip") == OnError::Skip);
  CHECK(parse_on_error("raise") == OnError::Raise);
  CHECK_THROWS_AS(parse_on_error("ignore"), std::invalid_argument);
}

TEST_CASE("uint8 ImageFolder batches normalised on the device match the float pipeline",
          "[data][image_folder]") {
  TempDir dir;
  make_image_folder(dir.path);
  const std::vector<double> mean = {0.485, 0.456, 0.406};
  const std::vector<double> stddev = {0.229, 0.224, 0.225};
  train::DataConfig config = folder_config(dir.path);
  config.mean = mean;
  config.std = stddev;
  train::DataConfig uint8_config = config;
  uint8_config.uint8 = "on";

  for (const Split split : {Split::Train, Split::Val}) {
    const auto floats = make_dataset(config, split);
    const auto bytes = make_dataset(uint8_config, split);
    CHECK_THAT(bytes->describe(), Contains("uint8"));
    for (int64_t i = 0; i < floats->size(); ++i) {
      INFO("sample " << i);
      const Example expected = floats->get(i, 77);
      const Example actual = bytes->get(i, 77);
      REQUIRE(actual.input.scalar_type() == torch::kByte);
      CHECK(actual.input.sizes().vec() == expected.input.sizes().vec());
      CHECK(torch::equal(actual.target, expected.target));
      const Batch normalised =
          normalize_on_device(Batch{actual.input.unsqueeze(0), actual.target.unsqueeze(0)}, mean, stddev);
      CHECK(normalised.input.scalar_type() == torch::kFloat);
      // The float pipeline rounds to the same 8-bit levels and normalises with the same float
      // numbers: the CPU's inputs are the GPU's, bit for bit.
      CHECK(torch::equal(normalised.input[0], expected.input));
    }
  }

  // Through the loader, and on the GPU when there is one.
  LoaderOptions options;
  options.batch_size = 4;
  options.workers = 2;
  Loader loader(make_dataset(uint8_config, Split::Train), options);
  loader.start({0, 0});
  const std::optional<Batch> batch = loader.next();
  REQUIRE(batch.has_value());
  CHECK(batch->input.scalar_type() == torch::kByte);
  CHECK(batch->input.sizes().vec() == std::vector<int64_t>{4, 3, 32, 32});
  const Batch on_cpu = normalize_on_device(*batch, mean, stddev);
  CHECK(torch::allclose(on_cpu.input, (batch->input.to(torch::kFloat) / 255.0 -
                                       torch::tensor(mean).to(torch::kFloat).view({1, 3, 1, 1})) /
                                          torch::tensor(stddev).to(torch::kFloat).view({1, 3, 1, 1}),
                        1e-5, 1e-5));
  // channels_last stays channels_last; bf16 output on request; no mean = scaling only.
  const Batch channels_last = normalize_on_device(
      Batch{batch->input.contiguous(torch::MemoryFormat::ChannelsLast), batch->target}, mean, stddev);
  CHECK(channels_last.input.is_contiguous(torch::MemoryFormat::ChannelsLast));
  CHECK(torch::allclose(channels_last.input, on_cpu.input));
  CHECK(normalize_on_device(*batch, mean, stddev, torch::kBFloat16).input.scalar_type() == torch::kBFloat16);
  CHECK(torch::allclose(normalize_on_device(*batch, {}, {}).input, batch->input.to(torch::kFloat) / 255.0));
  if (torch::cuda::is_available()) {
    const Batch on_gpu = normalize_on_device(batch->to(torch::Device(torch::kCUDA)), mean, stddev);
    CHECK(on_gpu.input.is_cuda());
    CHECK(torch::allclose(on_gpu.input.cpu(), on_cpu.input, 1e-5, 1e-5));
  } else {
    WARN("CUDA not available: normalize_on_device checked on the CPU only");
  }
  CHECK_THROWS_AS(normalize_on_device(Batch{batch->input[0], batch->target}, mean, stddev),
                  std::invalid_argument);
  CHECK_THROWS_AS(normalize_on_device(*batch, {0.5}, {0.5}), std::invalid_argument);

  train::DataConfig idx = uint8_config;
  idx.kind = "synthetic";
  CHECK_THAT(config_error(idx, Split::Train), Contains("data.uint8 applies to image_folder only"));
}

TEST_CASE("a run builds its image datasets as the plan resolves data.uint8, and trains alike either way",
          "[data][image_folder][trainer]") {
  TempDir dir;
  make_image_folder(dir.path);
  const auto config_with = [&](const std::string& uint8) {
    return train::parse_config(
        "model: {name: lenet, in_channels: 3, num_classes: 4}\n"
        "data: {kind: image_folder, root: " + dir.path + ", image_size: 28, workers: 1, shuffle: false, uint8: " +
            uint8 + ", mean: [0.5, 0.4, 0.3], std: [0.2, 0.25, 0.3]}\n"
        "optim: {name: sgd, lr: 0.05, momentum: 0.0}\n"
        "schedule: {name: constant}\n"
        "trainer: {global_batch: 4, max_steps: 3, device: cpu, threads: 1, seed: 3}\n"
        "logging: {tensorboard: false, every_steps: 1000}\n",
        "uint8_run.yaml");
  };
  const train::Config auto_config = config_with("auto");
  train::RunParts floats = train::prepare_run(auto_config);
  CHECK_FALSE(floats.plan.uint8_batches);  // on a CPU the workers normalise
  CHECK(floats.train->get(0, 1).input.scalar_type() == torch::kFloat);
  CHECK(floats.val->get(0, 1).input.scalar_type() == torch::kFloat);
  const train::Config on_config = config_with("on");
  train::RunParts bytes = train::prepare_run(on_config);
  CHECK(bytes.plan.uint8_batches);
  CHECK(bytes.train->get(0, 1).input.scalar_type() == torch::kByte);
  CHECK(bytes.val->get(0, 1).input.scalar_type() == torch::kByte);

  // The trainer normalises the uint8 batches where it computes, to the numbers the workers give
  // a float run: the same training, bit for bit.
  train::Trainer float_trainer(auto_config, floats.plan, floats.model, floats.train, floats.val, "");
  const train::FitResult float_result = float_trainer.fit();
  train::Trainer byte_trainer(on_config, bytes.plan, bytes.model, bytes.train, bytes.val, "");
  const train::FitResult byte_result = byte_trainer.fit();
  const auto float_params = float_trainer.model().parameters();
  const auto byte_params = byte_trainer.model().parameters();
  REQUIRE(float_params.size() == byte_params.size());
  for (size_t i = 0; i < float_params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(torch::equal(float_params[i], byte_params[i]));
  }
  CHECK(float_result.train_loss == byte_result.train_loss);
  CHECK(float_result.val.loss == byte_result.val.loss);
  CHECK(float_result.val.accuracy == byte_result.val.accuracy);
  CHECK_FALSE(float_result.val.has_top5);  // 4 classes: top-5 would always be 100 %
}

// make_image_folder in `root`, and a LeNet trained on it for 3 steps into `run_dir`; `data` is
// added to the data section, `more` to the config. Returns the config.
static train::Config trained_lenet(const std::string& root, const std::string& data, const std::string& more,
                                   const std::string& run_dir) {
  make_image_folder(root);
  const train::Config config = train::parse_config(
      "model: {name: lenet, in_channels: 3, num_classes: 4}\n"
      "data: {kind: image_folder, root: " + root + ", image_size: 28, workers: 1" + data + "}\n"
      "trainer: {global_batch: 4, max_steps: 3, device: cpu, threads: 1}\n"
      "logging: {tensorboard: false}\n" + more,
      "predict.yaml");
  train::RunParts run = train::prepare_run(config);
  train::FitOptions fit;
  fit.run_dir = run_dir;
  REQUIRE(train::fit_in_run_dir(config, run, fit).exit_code == train::kExitOk);
  return config;
}

// README, "Using a trained model": the snippet, on a run trained here.
TEST_CASE("a trained model predicts on image files as its validation split would feed them", "[data][image_folder][trainer]") {
  TempDir dir;
  const std::string run_dir = dir / "run";
  trained_lenet(dir.path, ", mean: [0.5, 0.4, 0.3], std: [0.2, 0.25, 0.3]", "", run_dir);

  // The snippet.
  const train::Config config = train::load_config(run_dir + "/config.yaml");
  train::models::ModelPtr model = train::models::make_model(config.model);
  train::load_model_weights(train::latest_checkpoint(run_dir + "/checkpoints"), *model);
  model->eval();
  train::data::ImageFolderOptions options = train::data::image_folder_options(config.data, Split::Val);
  options.classes = train::data::find_image_classes(config.data.root + "/train");
  options.files = {dir / "val/cat/v2.jpg", dir / "val/ant/v0.jpg"};
  const ImageFolderDataset images(options);
  torch::NoGradGuard no_grad;
  const torch::Tensor logits = model->forward(images.get_batch({0, 1}, {0, 0}, false)->input);
  const torch::Tensor label = logits.argmax(1);
  std::vector<std::string> predicted;
  for (int64_t i = 0; i < images.size(); ++i) predicted.push_back(options.classes[label[i].item<int64_t>()]);

  // The same as the trained model on the validation split's samples of those files.
  train::RunParts evaluated = train::prepare_run(config);
  train::load_model_weights(train::latest_checkpoint(run_dir + "/checkpoints"), *evaluated.model);
  evaluated.model->eval();
  const auto& val = dynamic_cast<const ImageFolderDataset&>(*evaluated.val);
  REQUIRE(val.path(2) == dir / "val/cat/v2.jpg");
  REQUIRE(val.path(0) == dir / "val/ant/v0.jpg");
  const torch::Tensor expected = evaluated.model->forward(val.get_batch({2, 0}, {0, 0}, false)->input);
  CHECK(torch::equal(logits, expected));
  CHECK(predicted.size() == 2);
  CHECK(std::find(options.classes.begin(), options.classes.end(), predicted[0]) != options.classes.end());
}

TEST_CASE("train predict prints each image file's most probable classes", "[image_folder][cli][process]") {
  TempDir dir;
  const std::string run_dir = dir / "run";
  const train::Config config = trained_lenet(dir.path, "", "checkpoint: {best: loss}\n", run_dir);
  const std::string train_bin = std::string(TRAIN_BINARY_DIR) + "/bin/train";
  const auto predict = [&](const std::string& args, std::string& out, std::string& err) {
    const std::string command = "'" + train_bin + "' predict " + args + " > '" + (dir / "out") + "' 2> '" +
                                (dir / "err") + "'";
    const int status = std::system(command.c_str());
    out = read_text(dir / "out");
    err = read_text(dir / "err");
    return status == -1 || !WIFEXITED(status) ? -1 : WEXITSTATUS(status);
  };
  std::string out, err;
  REQUIRE(predict("'" + run_dir + "' '" + (dir / "val/cat/v2.jpg") + "' '" + (dir / "val/cat/v3.png") + "' --top 2",
                  out, err) == 0);
  INFO(out << err);
  std::istringstream lines(out);
  std::string line;
  std::vector<std::string> rows;
  while (std::getline(lines, line)) rows.push_back(line);
  REQUIRE(rows.size() == 2);
  CHECK_THAT(rows[0], Contains("{\"file\":\"" + (dir / "val/cat/v2.jpg") + "\",\"checkpoint\":\"" +
                               (run_dir + "/checkpoints/best.pt") + "\",\"top\":[{\"label\":"));
  CHECK_THAT(rows[1], Contains(dir / "val/cat/v3.png"));

  // The same top class and probability as the model on the validation split's sample of that file.
  train::RunParts evaluated = train::prepare_run(config);
  train::load_model_weights(run_dir + "/checkpoints/best.pt", *evaluated.model);
  evaluated.model->eval();
  const auto& val = dynamic_cast<const ImageFolderDataset&>(*evaluated.val);
  REQUIRE(val.path(2) == dir / "val/cat/v2.jpg");
  torch::NoGradGuard no_grad;
  const torch::Tensor p = torch::softmax(evaluated.model->forward(val.get(2, 0).input.unsqueeze(0)).to(torch::kDouble), 1);
  const int64_t top = p.argmax(1).item<int64_t>();
  CHECK_THAT(rows[0], Contains("\"top\":[{\"label\":" + std::to_string(top) + ",\"class\":\"" +
                               val.classes()[static_cast<size_t>(top)] + "\",\"probability\":"));
  const size_t at = rows[0].find("\"probability\":") + 14;
  CHECK(std::abs(std::stod(rows[0].substr(at)) - p[0][top].item<double>()) < 1e-6);  // a batch of 2 there, of 1 here
  CHECK(rows[0].find("},{\"label\":") != std::string::npos);  // --top 2: a second class
  CHECK(rows[0].find("},{\"label\":", rows[0].find("},{\"label\":") + 1) == std::string::npos);

  // Bad input: the file is named, and the exit code is train fit's for it.
  CHECK(predict("'" + run_dir + "' '" + (dir / "val/cat/nope.jpg") + "'", out, err) == 1);
  CHECK_THAT(err, Contains(dir / "val/cat/nope.jpg") && Contains("no such file"));
  CHECK(out.empty());
  CHECK(predict("'" + dir.path + "' '" + (dir / "val/cat/v2.jpg") + "'", out, err) == 2);
  CHECK_THAT(err, Contains(dir.path + ": no config.yaml; give a run directory train fit wrote"));
  CHECK(predict("'" + run_dir + "' '" + (dir / "val/cat/v2.jpg") + "' --checkpoint '" + (dir / "val/cat/v2.jpg") + "'",
                out, err) == 2);
  CHECK_THAT(err, Contains(dir / "val/cat/v2.jpg") && Contains("not a readable checkpoint"));
}

// Fashion-MNIST's first test images as 28x28 grayscale PNGs in `dir`; returns their paths.
static std::vector<std::string> fashion_pngs(const TempDir& dir, int64_t count) {
  const torch::Tensor images =
      train::data::read_idx_images(train::data::find_data_file(TRAIN_FASHION_MNIST_DIR, "t10k-images-idx3-ubyte"));
  std::vector<std::string> paths;
  for (int64_t i = 0; i < count; ++i) {
    const torch::Tensor image = images[i][0].contiguous();
    Pixels p{28, 28, 1, std::vector<uint8_t>(image.data_ptr<uint8_t>(), image.data_ptr<uint8_t>() + 28 * 28)};
    paths.push_back(dir / ("fashion" + std::to_string(i) + ".png"));
    write_png(paths.back(), p);
  }
  return paths;
}

TEST_CASE("image files as IDX samples: a grayscale PNG of an IDX image gives that image's sample, bit for bit",
          "[data][image_folder]") {
  TempDir dir;
  const std::vector<std::string> paths = fashion_pngs(dir, 3);
  train::DataConfig data;
  data.kind = "idx";
  data.root = TRAIN_FASHION_MNIST_DIR;
  data.mean = {0.2860};
  data.std = {0.3530};
  const train::data::DatasetPtr files = train::data::make_idx_image_files(data, paths);
  const train::data::DatasetPtr val = train::data::make_dataset(data, Split::Val);
  REQUIRE(files->size() == 3);
  REQUIRE(files->input_shape() == val->input_shape());
  const auto from_files = files->get_batch({0, 1, 2}, {0, 0, 0}, false);
  const auto from_idx = val->get_batch({0, 1, 2}, {0, 0, 0}, false);
  REQUIRE(from_files);
  REQUIRE(from_idx);
  CHECK(torch::equal(from_files->input, from_idx->input));
  CHECK(torch::equal(from_files->target, torch::full({3}, train::data::kIgnoreIndex, torch::kLong)));

  // Colour and size: PIL's luma of the resized image. A 56x84 RGB image of one colour is that
  // colour's luma everywhere; the side comes from data.image_size when set.
  write_png(dir / "colour.png", solid(56, 84, {200, 100, 50}));
  data.image_size = 28;
  data.root = dir.path;  // no IDX files there: the side is data.image_size's
  const torch::Tensor colour = train::data::read_images_as_idx({dir / "colour.png"}, 28);
  REQUIRE(colour.sizes() == torch::IntArrayRef({1, 1, 28, 28}));
  CHECK(colour.eq((19595 * 200 + 38470 * 100 + 7471 * 50 + 32768) >> 16).all().item<bool>());
  CHECK(train::data::make_idx_image_files(data, {dir / "colour.png"})->input_shape() == std::vector<int64_t>{1, 28, 28});
  CHECK_THROWS_WITH(train::data::make_idx_image_files(data, {dir / "missing.png"}),
                    Contains(dir / "missing.png") && Contains("no such file"));
}

TEST_CASE("train predict on a run trained on IDX data takes image files", "[image_folder][cli][process]") {
  TempDir dir;
  const std::vector<std::string> paths = fashion_pngs(dir, 2);
  const std::string run_dir = dir / "run";
  const train::Config config = train::parse_config(
      "model: {name: lenet, in_channels: 1, num_classes: 10}\n"
      "data: {kind: idx, root: " + std::string(TRAIN_FASHION_MNIST_DIR) + ", mean: [0.2860], std: [0.3530], workers: 0}\n"
      "trainer: {global_batch: 8, max_steps: 2, device: cpu, threads: 1, eval_every_steps: 1000}\n"
      "logging: {tensorboard: false}\n",
      "idx_predict.yaml");
  {
    train::RunParts run = train::prepare_run(config);
    train::FitOptions fit;
    fit.run_dir = run_dir;
    REQUIRE(train::fit_in_run_dir(config, run, fit).exit_code == train::kExitOk);
  }
  const std::string command = "'" + std::string(TRAIN_BINARY_DIR) + "/bin/train' predict '" + run_dir + "' '" +
                              paths[0] + "' '" + paths[1] + "' --top 1 > '" + (dir / "out") + "' 2> '" + (dir / "err") + "'";
  const int status = std::system(command.c_str());
  const std::string out = read_text(dir / "out");
  INFO(out << read_text(dir / "err"));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  // The model on the IDX samples those files hold: the same top class and probability.
  train::RunParts evaluated = train::prepare_run(config);
  train::load_model_weights(train::latest_checkpoint(run_dir + "/checkpoints"), *evaluated.model);
  evaluated.model->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor p =
      torch::softmax(evaluated.model->forward(evaluated.val->get_batch({0, 1}, {0, 0}, false)->input).to(torch::kDouble), 1);
  std::istringstream lines(out);
  std::string line;
  for (int64_t i = 0; i < 2; ++i) {
    REQUIRE(std::getline(lines, line));
    const int64_t top = p[i].argmax().item<int64_t>();
    CHECK_THAT(line, Contains("{\"file\":\"" + paths[static_cast<size_t>(i)] + "\"") &&
                         Contains("\"top\":[{\"label\":" + std::to_string(top) + ",\"probability\":"));
    const size_t at = line.find("\"probability\":") + 14;
    CHECK(std::abs(std::stod(line.substr(at)) - p[i][top].item<double>()) < 1e-12);
  }
  CHECK_FALSE(std::getline(lines, line));
}

TEST_CASE("normalize_on_device to bf16 rounds once: every byte value within half a bf16 ulp", "[data][image_folder]") {
  const std::vector<double> mean = {0.485, 0.456, 0.406};
  const std::vector<double> stddev = {0.229, 0.224, 0.225};
  // Every byte value in each channel: [1, 3, 16, 16].
  const torch::Tensor bytes = torch::arange(256, torch::kLong).to(torch::kByte).view({1, 1, 16, 16}).repeat({1, 3, 1, 1});
  const torch::Tensor output = normalize_on_device(Batch{bytes, torch::zeros({1}, torch::kLong)}, mean, stddev,
                                                   torch::kBFloat16).input;
  REQUIRE(output.scalar_type() == torch::kBFloat16);
  const torch::Tensor actual = output.to(torch::kDouble);
  double worst = 0;  // in half-ulps
  for (int64_t c = 0; c < 3; ++c) {
    for (int64_t v = 0; v < 256; ++v) {
      const double expected = (static_cast<double>(v) / 255.0 - mean[c]) / stddev[c];
      const double got = actual[0][c][v / 16][v % 16].item<double>();
      // bf16 keeps 8 significant bits: half an ulp of a value in [2^e, 2^(e+1)) is 2^(e-8). The
      // float arithmetic before the one rounding adds at most a few float ulps.
      const double half_ulp = std::ldexp(1.0, std::ilogb(expected) - 8);
      INFO("channel " << c << ", byte " << v << ": " << got << " for " << expected);
      CHECK(std::abs(got - expected) <= half_ulp + 1e-6);
      worst = std::max(worst, std::abs(got - expected) / half_ulp);
    }
  }
  CHECK(worst > 0.5);  // values are rounded (the bound above is tight)
}

// The reference: the pipeline as composed from LibTorch ops (decode, crop, ATen's antialiased
// bilinear interpolate, flip, normalise), which the dataset's one-pass resampler replaces.
torch::Tensor reference_sample(const std::string& path, Split split, int64_t side, int64_t resize,
                               uint64_t seed) {
  torch::Tensor image;
  if (split == Split::Train) {
    // The box on the full size; a JPEG decoded at the scale that keeps it at least side x side.
    const torch::Tensor full = decode_image(path);
    const int64_t height = full.size(1), width = full.size(2);
    SplitMix64 rng(seed);
    const CropBox full_box =
        random_resized_crop_box(height, width, 0.08, 1.0, 3.0 / 4.0, 4.0 / 3.0, rng);
    const bool jpeg = path.size() > 4 && path.substr(path.size() - 4) == ".jpg";
    const int d = jpeg ? choose_jpeg_crop_scale(full_box, width, height, side) : 1;
    // decode_image(path, needed) decodes at 1/d when needed = ceil(shorter side / d).
    const torch::Tensor decoded = d == 1 ? full : decode_image(path, (std::min(height, width) + d - 1) / d);
    REQUIRE(decoded.sizes() == torch::IntArrayRef{3, (height + d - 1) / d, (width + d - 1) / d});
    const CropBox box = scale_crop_box(full_box, width, height, d);
    const torch::Tensor crop = decoded.narrow(1, box.top, box.height).narrow(2, box.left, box.width);
    image = resize_bilinear(crop.to(torch::kFloat).contiguous(), side, side);
    if (rng.below(2) == 1) image = hflip(image);
  } else {
    // torchvision's Resize of the full-size image (int(resize x longer / shorter) for the longer
    // side), from the part of a JPEG's reduced decode that covers the full image.
    const torch::Tensor full = decode_image(path);
    const int64_t height = full.size(1), width = full.size(2);
    const bool jpeg = path.size() > 4 && path.substr(path.size() - 4) == ".jpg";
    const int d = jpeg ? choose_jpeg_scale(width, height, resize) : 1;
    const torch::Tensor decoded = d == 1 ? full : decode_image(path, resize);
    const CropBox box = scale_crop_box(CropBox{0, 0, height, width}, width, height, d);
    const torch::Tensor covered = decoded.narrow(1, box.top, box.height).narrow(2, box.left, box.width);
    const int64_t out_height = height <= width ? resize : resize * height / width;
    const int64_t out_width = height <= width ? resize * width / height : resize;
    image = center_crop(resize_bilinear(covered.to(torch::kFloat).contiguous(), out_height, out_width), side);
  }
  return image;
}

TEST_CASE("the validation resize is sized from the full image as torchvision's Resize", "[data][image_folder]") {
  // 2049x1024 at resize 256: torchvision gives 256 x int(256 x 2049 / 1024) = 256 x 512. Decoded at
  // 1/4 the JPEG is 513x256; its first 512 columns cover the image.
  CHECK(choose_jpeg_scale(2049, 1024, 256) == 4);
  const ResizeGeometry wide = validation_resize(2049, 1024, 4, 256);
  CHECK(wide.out_height == 256);
  CHECK(wide.out_width == 512);
  CHECK(wide.source.top == 0);
  CHECK(wide.source.left == 0);
  CHECK(wide.source.height == 256);
  CHECK(wide.source.width == 512);
  CHECK(wide.image_width == 2049);
  // Portrait, and full size (a PNG).
  const ResizeGeometry tall = validation_resize(375, 500, 1, 55);
  CHECK(tall.out_width == 55);
  CHECK(tall.out_height == 73);  // int(55 x 500 / 375) = int(73.3)
  CHECK(tall.source.height == 500);
  CHECK(tall.source.width == 375);
  CHECK_THROWS_AS(validation_resize(0, 10, 1, 8), std::invalid_argument);

  // The images decoded at a reduced scale are compared with this geometry in the resampler test below
  // (val/a/6.jpg, 2049x1024).
}

TEST_CASE("ImageFolder's one-pass resampler matches ATen's antialiased resize, crop and flip",
          "[data][image_folder]") {
  TempDir dir;
  for (const char* split_directory : {"train/a", "val/a"}) {
    const std::string a = dir / split_directory;
    files::make_directories(a);
    write_jpeg(a + "/0.jpg", pattern(500, 375, 3, 0));    // downscaled crops
    write_jpeg(a + "/1.jpg", pattern(40, 30, 3, 1));      // upscaled crops
    write_jpeg(a + "/2.jpg", pattern(1000, 800, 3, 2));   // decoded at a reduced DCT scale
    write_jpeg(a + "/3.jpg", pattern(90, 120, 1, 3));     // grayscale, portrait
    write_png(a + "/4.png", pattern(70, 50, 4, 4));       // RGBA: 4-byte pixels
    write_jpeg(a + "/5.jpg", pattern(60, 45, 4, 5));      // CMYK: 4-byte pixels
  }
  // Decoded at 1/8 (257x128), whose last column covers one pixel of the full image: resized as
  // the full 2049x1024 is, from the decoded 256x128 that covers it.
  write_jpeg(dir / "val/a/6.jpg", pattern(2049, 1024, 3, 6));
  const std::vector<double> mean = {0.485, 0.456, 0.406};
  const std::vector<double> stddev = {0.229, 0.224, 0.225};
  train::DataConfig config = folder_config(dir.path);
  config.image_size = 48;
  config.mean = mean;
  config.std = stddev;
  train::DataConfig plain = config;
  plain.mean.clear();
  plain.std.clear();
  train::DataConfig bytes = plain;
  bytes.uint8 = "on";
  const int64_t resize = 55;  // round(48 / 0.875)

  for (const Split split : {Split::Train, Split::Val}) {
    const auto normalised = make_dataset(config, split);
    const auto unit = make_dataset(plain, split);
    const auto levels = make_dataset(bytes, split);
    const auto* folder = dynamic_cast<const ImageFolderDataset*>(normalised.get());
    REQUIRE(folder != nullptr);
    for (int64_t i = 0; i < folder->size(); ++i) {
      for (uint64_t seed : {1u, 2u, 3u, 40u}) {
        INFO((split == Split::Train ? "train " : "val ") << folder->path(i) << " seed " << seed);
        // ATen's resize in float, before rounding to 8 bits; our summation order differs, so a
        // value within rounding noise of a half level may round the other way.
        const torch::Tensor raw = reference_sample(folder->path(i), split, 48, resize, seed);
        const torch::Tensor near_tie = ((raw - raw.floor()) - 0.5).abs() < 1e-3;
        const torch::Tensor rounded = raw.round().clamp(0, 255);  // half to even, as PIL's and ours
        auto differ_off_ties = [&](const torch::Tensor& actual, const torch::Tensor& expected, double tolerance) {
          REQUIRE(actual.sizes() == expected.sizes());
          return ((actual - expected).abs() > tolerance).logical_and(near_tie.logical_not()).sum().item<int64_t>();
        };
        const Example level_sample = levels->get(i, seed);
        const torch::Tensor level_values = level_sample.input.to(torch::kFloat);
        CHECK(differ_off_ties(level_values, rounded, 0.0) == 0);
        CHECK((level_values - raw).abs().max().item<float>() <= 0.5f + 1e-3f);
        // The float inputs are those levels scaled and normalised, bit for bit as
        // normalize_on_device does it to the uint8 batch on a GPU ...
        const torch::Tensor actual_unit = unit->get(i, seed).input;
        const torch::Tensor actual = normalised->get(i, seed).input;
        const Batch level_batch{level_sample.input.unsqueeze(0), level_sample.target.unsqueeze(0)};
        CHECK(torch::equal(actual_unit, normalize_on_device(level_batch, {}, {}).input[0]));
        CHECK(torch::equal(actual, normalize_on_device(level_batch, mean, stddev).input[0]));
        CHECK(actual_unit.max().item<float>() <= 1.0f);
        // ... and torchvision's ToTensor and Normalize of them, to float rounding.
        CHECK(differ_off_ties(actual_unit, rounded / 255.0, 1e-6) == 0);
        CHECK(differ_off_ties(actual, normalize(rounded / 255.0, mean, stddev), 1e-5) == 0);
      }
    }
  }
}

TEST_CASE("ImageFolder batches built in one pass equal collated samples, and recycle memory",
          "[data][image_folder]") {
  TempDir dir;
  make_image_folder(dir.path);
  train::DataConfig config = folder_config(dir.path);
  config.mean = {0.5, 0.5, 0.5};
  config.std = {0.25, 0.25, 0.25};
  for (const bool uint8 : {false, true}) {
    train::DataConfig c = config;
    if (uint8) {
      c.uint8 = "on";
      c.mean.clear();
      c.std.clear();
    }
    for (const Split split : {Split::Train, Split::Val}) {
      const auto dataset = make_dataset(c, split);
      std::vector<int64_t> indices;
      std::vector<uint64_t> seeds;
      for (int64_t i = dataset->size() - 1; i >= 0; --i) {
        indices.push_back(i);
        seeds.push_back(static_cast<uint64_t>(100 + 7 * i));
      }
      std::vector<Example> examples;
      for (size_t k = 0; k < indices.size(); ++k) examples.push_back(dataset->get(indices[k], seeds[k]));
      const Batch expected = dataset->collate(std::move(examples));
      const void* first_memory = nullptr;
      for (int round = 0; round < 3; ++round) {
        std::optional<Batch> batch = dataset->get_batch(indices, seeds, /*pinned=*/false);
        REQUIRE(batch.has_value());
        CHECK(torch::equal(batch->input, expected.input));
        CHECK(torch::equal(batch->target, expected.target));
        // The previous round's batch was freed, so its memory comes back.
        if (round == 0) first_memory = batch->input.data_ptr();
        else CHECK(batch->input.data_ptr() == first_memory);
      }
    }
  }
}
