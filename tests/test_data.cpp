#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <zlib.h>

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "train/config.h"
#include "train/data/dataset.h"
#include "train/data/factory.h"
#include "train/data/idx.h"
#include "train/data/loader.h"
#include "train/data/scan.h"
#include "train/data/synthetic.h"
#include "train/data/transforms.h"
#include "train/errors.h"

// After LibTorch: c10's logging header defines its own CHECK macro, and Catch's must win.
#include "testing.h"

using namespace train::data;
using Catch::Matchers::Contains;

namespace {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it at scope end.
// POSIX calls, as the library's own (train/files.h).
struct TempDir {
  std::string path;
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    path = std::string(tmp && *tmp ? tmp : "/tmp") + "/train_test_data_XXXXXX";
    if (mkdtemp(path.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  }
  ~TempDir() {
    nftw(
        path.c_str(),
        [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

bool is_directory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

// An unsigned-byte IDX file: magic 0x0000 08 <rank>, big-endian dims, then the payload.
std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims,
                               const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> bytes = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(static_cast<uint8_t>(d >> shift));
  }
  bytes.insert(bytes.end(), payload.begin(), payload.end());
  return bytes;
}

void write_plain(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

void write_gz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  REQUIRE(file != nullptr);
  REQUIRE(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())) ==
          static_cast<int>(bytes.size()));
  REQUIRE(gzclose(file) == Z_OK);
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

// Five 4x3 images with pixel (n, r, c) = 12 n + 3 r + c, and their labels.
constexpr uint32_t kImages = 5, kRows = 4, kCols = 3;
const std::vector<uint8_t> kLabels = {3, 1, 4, 1, 5};

std::vector<uint8_t> small_images_file(uint32_t count = kImages) {
  std::vector<uint8_t> pixels(count * kRows * kCols);
  std::iota(pixels.begin(), pixels.end(), uint8_t{0});
  return idx_bytes({count, kRows, kCols}, pixels);
}

std::vector<uint8_t> small_labels_file(const std::vector<uint8_t>& labels = kLabels) {
  return idx_bytes({static_cast<uint32_t>(labels.size())}, labels);
}

// The message of the DataError that `action` throws; fails the test if it throws nothing else.
template <typename Action>
std::string data_error_message(Action&& action) {
  try {
    action();
  } catch (const train::DataError& e) {
    return e.what();
  }
  FAIL("expected a DataError");
  return {};
}

// Input = [index, seed / 2^64]; target = index. Shows which sample arrived, in which order, and
// with which per-sample seed. Optionally sleeps a little, differently per index, so that workers
// finish out of order, and throws at one index.
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(int64_t size, int64_t throw_at = -1, bool jitter = false)
      : size_(size), throw_at_(throw_at), jitter_(jitter) {}
  int64_t size() const override { return size_; }
  Example get(int64_t index, uint64_t seed) const override {
    ++gets;
    if (index == throw_at_) throw std::runtime_error("cannot decode record");
    if (jitter_) std::this_thread::sleep_for(std::chrono::microseconds((index * 7919) % 300));
    torch::Tensor input = torch::tensor(
        {static_cast<double>(index), static_cast<double>(seed) * 0x1.0p-64}, torch::kDouble);
    return Example{input, torch::scalar_tensor(index, torch::kLong)};
  }
  std::vector<int64_t> input_shape() const override { return {2}; }
  int64_t num_classes() const override { return size_; }
  std::string describe() const override { return "index dataset"; }

  mutable std::atomic<int64_t> gets{0};

 private:
  int64_t size_;
  int64_t throw_at_;
  bool jitter_;
};

std::vector<Batch> run_epoch(Loader& loader, LoaderPosition from) {
  loader.start(from);
  std::vector<Batch> batches;
  while (std::optional<Batch> batch = loader.next()) batches.push_back(*batch);
  return batches;
}

std::vector<int64_t> targets_of(const std::vector<Batch>& batches) {
  std::vector<int64_t> targets;
  for (const Batch& batch : batches) {
    for (int64_t i = 0; i < batch.size(); ++i) targets.push_back(batch.target[i].item<int64_t>());
  }
  return targets;
}

void check_same_batches(const std::vector<Batch>& actual, const std::vector<Batch>& expected) {
  REQUIRE(actual.size() == expected.size());
  for (size_t b = 0; b < actual.size(); ++b) {
    INFO("batch " << b);
    CHECK(torch::equal(actual[b].input, expected[b].input));
    CHECK(torch::equal(actual[b].target, expected[b].target));
  }
}

LoaderOptions index_options(int64_t batch_size, int64_t workers = 0) {
  LoaderOptions options;
  options.batch_size = batch_size;
  options.workers = workers;
  options.seed = 1234;
  return options;
}

}  // namespace

// ---- IDX --------------------------------------------------------------------------------------

TEST_CASE("IDX images and labels parse, plain and gzipped", "[data]") {
  for (bool gzipped : {false, true}) {
    INFO("gzipped: " << gzipped);
    TempDir dir;
    const std::string suffix = gzipped ? ".gz" : "";
    auto write = gzipped ? write_gz : write_plain;
    write(dir.file("imgs" + suffix), small_images_file());
    write(dir.file("lbls" + suffix), small_labels_file());

    const std::string images_file = find_data_file(dir.path, "imgs");
    CHECK(images_file == dir.file("imgs" + suffix));
    // data.train_images may be an absolute path: it does not go under data.root then.
    CHECK(find_data_file("/elsewhere", dir.file("imgs")) == images_file);
    const torch::Tensor images = read_idx_images(images_file);
    CHECK(images.scalar_type() == torch::kByte);
    CHECK(images.sizes() == torch::IntArrayRef{kImages, 1, kRows, kCols});
    CHECK(images[2][0][1][2].item<int64_t>() == 12 * 2 + 3 * 1 + 2);

    const torch::Tensor labels = read_idx_labels(find_data_file(dir.path, "lbls"));
    CHECK(labels.scalar_type() == torch::kLong);
    CHECK(labels.sizes() == torch::IntArrayRef{kImages});
    CHECK(labels[4].item<int64_t>() == 5);

    IdxDataset dataset(images_file, find_data_file(dir.path, "lbls"));
    CHECK(dataset.size() == kImages);
    CHECK(dataset.input_shape() == std::vector<int64_t>{1, kRows, kCols});
    CHECK(dataset.num_classes() == 10);
    const Example example = dataset.get(2, 99);
    CHECK(example.input.scalar_type() == torch::kFloat);
    CHECK(example.input.sizes() == torch::IntArrayRef{1, kRows, kCols});
    CHECK(example.input[0][1][2].item<float>() == Approx((12 * 2 + 3 + 2) / 255.0));
    CHECK(example.target.dim() == 0);
    CHECK(example.target.scalar_type() == torch::kLong);
    CHECK(example.target.item<int64_t>() == 4);
    CHECK_THAT(dataset.describe(), Contains("5 images 1x4x3"));
  }
}

TEST_CASE("IdxDataset::get gives exactly the values of the tensor-op pipeline", "[data]") {
  // Every byte value, in two 16x16 images; get() computes x / 255 (and, with normalisation
  // alone, (x / 255 - mean) / std) in one loop and must match the ops bit for bit.
  TempDir dir;
  std::vector<uint8_t> pixels(512);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i < 256 ? i : 511 - i);
  write_plain(dir.file("imgs"), idx_bytes({2, 16, 16}, pixels));
  write_plain(dir.file("lbls"), idx_bytes({2}, {3, 7}));
  const torch::Tensor images = read_idx_images(dir.file("imgs"));

  ImageTransforms normalize_only;
  normalize_only.mean = {0.2860};
  normalize_only.stddev = {0.3530};
  ImageTransforms augmented = normalize_only;
  augmented.random_crop = true;
  augmented.crop_padding = 2;
  augmented.random_flip = true;
  for (const ImageTransforms& transforms : {ImageTransforms{}, normalize_only, augmented}) {
    INFO(transforms.describe());
    IdxDataset dataset(dir.file("imgs"), dir.file("lbls"), transforms);
    for (int64_t i = 0; i < 2; ++i) {
      for (uint64_t seed : {1, 2, 3}) {
        const torch::Tensor expected = transforms.apply(images[i].to(torch::kFloat).div_(255.0), seed);
        const Example example = dataset.get(i, seed);
        CHECK(torch::equal(example.input, expected));
        CHECK(example.target.item<int64_t>() == (i == 0 ? 3 : 7));
      }
    }
  }
  ImageTransforms wrong_channels;
  wrong_channels.mean = {0.5, 0.5, 0.5};
  wrong_channels.stddev = {0.2, 0.2, 0.2};
  CHECK_THROWS_AS(IdxDataset(dir.file("imgs"), dir.file("lbls"), wrong_channels).get(0, 0), std::invalid_argument);
}

namespace {

// Forwards everything but get_batch: the loader goes sample by sample over the same data.
class PerSampleOnly : public Dataset {
 public:
  explicit PerSampleOnly(DatasetPtr inner) : inner_(std::move(inner)) {}
  int64_t size() const override { return inner_->size(); }
  Example get(int64_t index, uint64_t seed) const override { return inner_->get(index, seed); }
  std::vector<int64_t> input_shape() const override { return inner_->input_shape(); }
  int64_t num_classes() const override { return inner_->num_classes(); }
  std::string describe() const override { return inner_->describe(); }

 private:
  DatasetPtr inner_;
};

}  // namespace

TEST_CASE("IdxDataset::get_batch equals collate() of get(), and the loader uses it", "[data]") {
  TempDir dir;
  std::vector<uint8_t> pixels(5 * 16);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>((i * 37) % 256);
  write_plain(dir.file("imgs"), idx_bytes({5, 4, 4}, pixels));
  write_plain(dir.file("lbls"), idx_bytes({5}, {3, 7, 0, 9, 1}));
  ImageTransforms normalize_only;
  normalize_only.mean = {0.2860};
  normalize_only.stddev = {0.3530};
  ImageTransforms augmented = normalize_only;
  augmented.random_flip = true;
  const std::vector<int64_t> indices = {4, 0, 2, 2};
  const std::vector<uint64_t> seeds = {11, 12, 13, 14};
  for (const ImageTransforms& transforms : {ImageTransforms{}, normalize_only, augmented}) {
    INFO(transforms.describe());
    const auto dataset = std::make_shared<IdxDataset>(dir.file("imgs"), dir.file("lbls"), transforms);
    const std::optional<Batch> whole = dataset->get_batch(indices, seeds, /*pinned=*/false);
    // The one-pass path exists for a normalisation alone; a flip needs tensor ops per sample.
    CHECK(whole.has_value() == (transforms.mean.size() == 1 && !transforms.random_flip));
    if (whole) {
      std::vector<Example> examples;
      for (size_t i = 0; i < indices.size(); ++i) examples.push_back(dataset->get(indices[i], seeds[i]));
      const Batch expected = dataset->collate(std::move(examples));
      CHECK(torch::equal(whole->input, expected.input));
      CHECK(torch::equal(whole->target, expected.target));
      CHECK(whole->input.sizes() == torch::IntArrayRef{4, 1, 4, 4});
    }
    // An index out of range gets no one-pass batch; get() then names it.
    CHECK_FALSE(dataset->get_batch({0, 5}, {1, 2}, false).has_value());

    // Through the loader, shuffled, for 0 and 2 workers: the same batches as sample by sample.
    LoaderOptions options = index_options(2);
    options.shuffle = true;
    options.seed = 5;
    Loader reference_loader(std::make_shared<PerSampleOnly>(dataset), options);
    const std::vector<Batch> reference = run_epoch(reference_loader, {1, 0});
    REQUIRE(reference.size() == 2);
    for (int64_t workers : {0, 2}) {
      INFO("workers " << workers);
      options.workers = workers;
      Loader loader(dataset, options);
      check_same_batches(run_epoch(loader, {1, 0}), reference);
    }
  }
}

TEST_CASE("IDX errors name the file and what is wrong", "[data]") {
  TempDir dir;

  SECTION("missing file names both candidates") {
    const std::string message = data_error_message([&] { find_data_file(dir.path, "nope"); });
    CHECK_THAT(message, Contains(dir.file("nope")) && Contains(dir.file("nope.gz")));
  }

  SECTION("truncated plain file: expected vs found") {
    std::vector<uint8_t> bytes = small_images_file();
    bytes.resize(bytes.size() - 10);  // 16-byte header + 60 pixels = 76 bytes, cut to 66
    write_plain(dir.file("imgs"), bytes);
    const std::string message = data_error_message([&] { read_idx_images(dir.file("imgs")); });
    CHECK_THAT(message, Contains(dir.file("imgs")) && Contains("truncated") &&
                            Contains("expected 76 bytes") && Contains("found 66 bytes"));
  }

  SECTION("truncated header") {
    write_plain(dir.file("lbls"), {0, 0, 8, 1, 0, 0});
    const std::string message = data_error_message([&] { read_idx_labels(dir.file("lbls")); });
    CHECK_THAT(message, Contains(dir.file("lbls")) && Contains("truncated"));
  }

  SECTION("truncated gzip file") {
    write_gz(dir.file("full.gz"), small_images_file(200));
    std::vector<uint8_t> gz = read_bytes(dir.file("full.gz"));
    gz.resize(gz.size() / 2);
    write_plain(dir.file("cut.gz"), gz);
    const std::string message = data_error_message([&] { read_idx_images(dir.file("cut.gz")); });
    CHECK_THAT(message,
               Contains(dir.file("cut.gz")) && Contains("truncated") && Contains("expected"));
  }

  SECTION("trailing data") {
    std::vector<uint8_t> bytes = small_labels_file();
    bytes.push_back(0);
    write_plain(dir.file("lbls"), bytes);
    const std::string message = data_error_message([&] { read_idx_labels(dir.file("lbls")); });
    CHECK_THAT(message, Contains(dir.file("lbls")) && Contains("trailing data"));
  }

  SECTION("bad magic: a label file read as images, and text") {
    write_plain(dir.file("lbls"), small_labels_file());
    const std::string message = data_error_message([&] { read_idx_images(dir.file("lbls")); });
    CHECK_THAT(message, Contains(dir.file("lbls")) && Contains("bad magic number 0x00000801") &&
                            Contains("expected 0x00000803"));
    write_plain(dir.file("text"), {'h', 'e', 'l', 'l', 'o', '\n'});
    CHECK_THAT(data_error_message([&] { read_idx_labels(dir.file("text")); }),
               Contains(dir.file("text")) && Contains("bad magic number"));
  }

  SECTION("gzip: the magic number is checked after the first bytes, before the rest is inflated") {
    // A label file read as images, followed by 1 MiB of incompressible bytes, with one byte of the
    // compressed stream changed halfway: inflating it all ends in a CRC error, but the magic
    // number comes first and is what is wrong.
    std::vector<uint8_t> bytes = small_labels_file();
    uint32_t x = 12345;
    for (int i = 0; i < (1 << 20); ++i) {
      x = x * 1664525u + 1013904223u;
      bytes.push_back(static_cast<uint8_t>(x >> 24));
    }
    write_gz(dir.file("big.gz"), bytes);
    std::vector<uint8_t> gz = read_bytes(dir.file("big.gz"));
    gz[gz.size() / 2] ^= 0x5a;
    write_plain(dir.file("big.gz"), gz);
    const std::string message = data_error_message([&] { read_idx_images(dir.file("big.gz")); });
    CHECK_THAT(message, Contains(dir.file("big.gz")) && Contains("bad magic number 0x00000801"));
  }

  SECTION("gzip: a header that declares more than the file can inflate to is truncated, up front") {
    // 2^31 images of 28x28 (1.7 TB) declared in a gzip file of a few dozen bytes.
    write_gz(dir.file("huge.gz"), idx_bytes({1u << 31, 28, 28}, std::vector<uint8_t>(100, 7)));
    const std::string message = data_error_message([&] { read_idx_images(dir.file("huge.gz")); });
    CHECK_THAT(message, Contains(dir.file("huge.gz")) && Contains("truncated") && Contains("2147483648x28x28") &&
                            Contains("inflates to at most"));
  }

  SECTION("a named pipe is rejected without opening it") {
    REQUIRE(::mkfifo(dir.file("fifo").c_str(), 0600) == 0);
    const std::string message = data_error_message([&] { read_idx_labels(dir.file("fifo")); });
    CHECK_THAT(message, Contains(dir.file("fifo")) && Contains("named pipe"));
  }

  SECTION("label out of range") {
    write_plain(dir.file("lbls"), small_labels_file({1, 2, 10}));
    const std::string message = data_error_message([&] { read_idx_labels(dir.file("lbls")); });
    CHECK_THAT(message, Contains(dir.file("lbls")) && Contains("label 10 at index 2"));
  }

  SECTION("image and label counts differ") {
    write_plain(dir.file("imgs"), small_images_file());
    write_plain(dir.file("lbls"), small_labels_file({1, 2, 3, 4}));
    const std::string message =
        data_error_message([&] { IdxDataset(dir.file("imgs"), dir.file("lbls")); });
    CHECK_THAT(message, Contains(dir.file("lbls")) && Contains(dir.file("imgs")) &&
                            Contains("4 labels") && Contains("5 images"));
  }
}

TEST_CASE("Fashion-MNIST loads through the factory", "[data]") {
  // scripts/setup installs Debian's dataset-fashion-mnist; gpu-check unpacks it elsewhere.
  const std::string root = TRAIN_FASHION_MNIST_DIR;
  INFO("Fashion-MNIST directory: " << root);
  REQUIRE(is_directory(root));
  train::DataConfig config;
  config.kind = "idx";
  config.root = root;

  const DatasetPtr train_set = make_dataset(config, Split::Train);
  const DatasetPtr val_set = make_dataset(config, Split::Val);
  CHECK(train_set->size() == 60000);
  CHECK(val_set->size() == 10000);
  CHECK(train_set->input_shape() == std::vector<int64_t>{1, 28, 28});
  CHECK(train_set->num_classes() == 10);

  // Fashion-MNIST is balanced: 6000 / 1000 images per class.
  const auto& labels = dynamic_cast<const IdxDataset&>(*train_set).labels();
  CHECK(torch::equal(torch::bincount(labels), torch::full({10}, 6000, torch::kLong)));

  const Example example = val_set->get(0, 0);
  CHECK(example.input.min().item<float>() >= 0.0f);
  CHECK(example.input.max().item<float>() <= 1.0f);
  CHECK(example.input.max().item<float>() > 0.5f);
}

// ---- loader -----------------------------------------------------------------------------------

TEST_CASE("Loader delivers identical batches for 0, 1 and 3 workers", "[data]") {
  SyntheticImageOptions synthetic;
  synthetic.samples = 37;
  synthetic.channels = 1;
  synthetic.image_size = 8;
  synthetic.transforms.random_crop = true;  // inputs depend on the per-sample seed
  synthetic.transforms.crop_padding = 2;
  synthetic.transforms.random_flip = true;
  const std::vector<DatasetPtr> datasets = {
      std::make_shared<SyntheticImageDataset>(synthetic),
      std::make_shared<IndexDataset>(41, -1, /*jitter=*/true)};

  for (const DatasetPtr& dataset : datasets) {
    INFO(dataset->describe());
    LoaderOptions options = index_options(5);
    options.drop_last = false;
    options.prefetch = 1;
    Loader reference_loader(dataset, options);
    const std::vector<Batch> reference = run_epoch(reference_loader, {2, 0});
    CHECK(static_cast<int64_t>(reference.size()) == (dataset->size() + 4) / 5);
    for (int64_t workers : {1, 3}) {
      INFO("workers " << workers);
      options.workers = workers;
      Loader loader(dataset, options);
      check_same_batches(run_epoch(loader, {2, 0}), reference);
    }
  }
}

TEST_CASE("Shuffle is a permutation that depends on seed and epoch only", "[data]") {
  const auto dataset = std::make_shared<IndexDataset>(100);
  LoaderOptions options = index_options(10);
  Loader loader(dataset, options);
  const std::vector<int64_t> epoch0 = targets_of(run_epoch(loader, {0, 0}));
  const std::vector<int64_t> epoch1 = targets_of(run_epoch(loader, {1, 0}));

  std::vector<int64_t> sorted = epoch0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> identity(100);
  std::iota(identity.begin(), identity.end(), 0);
  CHECK(sorted == identity);
  CHECK(epoch0 != identity);
  CHECK(epoch1 != epoch0);
  CHECK(targets_of(run_epoch(loader, {0, 0})) == epoch0);

  options.seed = 4321;
  Loader other_seed(dataset, options);
  CHECK(targets_of(run_epoch(other_seed, {0, 0})) != epoch0);

  options.shuffle = false;
  Loader in_order(dataset, options);
  CHECK(targets_of(run_epoch(in_order, {3, 0})) == identity);
}

TEST_CASE("drop_last decides the final partial batch", "[data]") {
  const auto dataset = std::make_shared<IndexDataset>(10);
  LoaderOptions options = index_options(4);
  options.shuffle = false;

  options.drop_last = true;
  Loader dropping(dataset, options);
  CHECK(dropping.batches_per_epoch() == 2);
  std::vector<Batch> batches = run_epoch(dropping, {0, 0});
  REQUIRE(batches.size() == 2);
  CHECK(batches[1].size() == 4);

  options.drop_last = false;
  Loader keeping(dataset, options);
  CHECK(keeping.batches_per_epoch() == 3);
  batches = run_epoch(keeping, {0, 0});
  REQUIRE(batches.size() == 3);
  CHECK(batches[2].size() == 2);
  CHECK(targets_of(batches).back() == 9);
}

TEST_CASE("Distributed shards follow DistributedSampler", "[data]") {
  const auto dataset = std::make_shared<IndexDataset>(10);
  auto shard = [&](int64_t rank, bool drop_last, bool shuffle) {
    LoaderOptions options = index_options(1);
    options.world_size = 3;
    options.rank = rank;
    options.drop_last = drop_last;
    options.shuffle = shuffle;
    Loader loader(dataset, options);
    CHECK(loader.samples_per_epoch() == (drop_last ? 3 : 4));
    return targets_of(run_epoch(loader, {0, 0}));
  };

  // Unshuffled: padded from the start (0, 1) or truncated (9 dropped), then strided by rank.
  CHECK(shard(0, false, false) == std::vector<int64_t>{0, 3, 6, 9});
  CHECK(shard(1, false, false) == std::vector<int64_t>{1, 4, 7, 0});
  CHECK(shard(2, false, false) == std::vector<int64_t>{2, 5, 8, 1});
  CHECK(shard(0, true, false) == std::vector<int64_t>{0, 3, 6});
  CHECK(shard(1, true, false) == std::vector<int64_t>{1, 4, 7});
  CHECK(shard(2, true, false) == std::vector<int64_t>{2, 5, 8});

  // Shuffled: all ranks share one permutation, so shards are disjoint and cover it; padding
  // repeats its first two entries.
  std::multiset<int64_t> padded, truncated;
  for (int64_t rank = 0; rank < 3; ++rank) {
    for (int64_t i : shard(rank, false, true)) padded.insert(i);
    for (int64_t i : shard(rank, true, true)) truncated.insert(i);
  }
  CHECK(padded.size() == 12);
  CHECK(std::set<int64_t>(padded.begin(), padded.end()).size() == 10);
  CHECK(truncated.size() == 9);
  CHECK(std::set<int64_t>(truncated.begin(), truncated.end()).size() == 9);
  const std::vector<int64_t> rank0 = shard(0, false, true);
  CHECK(shard(1, false, true)[3] == rank0[0]);
  CHECK(shard(2, false, true)[3] == shard(1, false, true)[0]);
}

TEST_CASE("Evaluation shards (pad false) read every sample once with the seed one rank gives it", "[data]") {
  const auto dataset = std::make_shared<IndexDataset>(10);
  LoaderOptions options = index_options(3);
  options.drop_last = false;
  options.shuffle = false;
  Loader single(dataset, options);
  std::map<int64_t, torch::Tensor> expected;  // index -> [index, seed]
  for (const Batch& batch : run_epoch(single, {0, 0})) {
    for (int64_t i = 0; i < batch.size(); ++i) expected[batch.target[i].item<int64_t>()] = batch.input[i];
  }
  REQUIRE(expected.size() == 10);

  options.pad = false;
  options.world_size = 3;
  std::map<int64_t, int> seen;
  const std::vector<std::vector<int64_t>> shards = {{0, 3, 6, 9}, {1, 4, 7}, {2, 5, 8}};
  for (int64_t rank = 0; rank < 3; ++rank) {
    INFO("rank " << rank);
    options.rank = rank;
    Loader loader(dataset, options);
    CHECK(loader.samples_per_epoch() == static_cast<int64_t>(shards[rank].size()));
    const std::vector<Batch> batches = run_epoch(loader, {0, 0});
    CHECK(targets_of(batches) == shards[rank]);
    for (const Batch& batch : batches) {
      for (int64_t i = 0; i < batch.size(); ++i) {
        const int64_t index = batch.target[i].item<int64_t>();
        ++seen[index];
        CHECK(torch::equal(batch.input[i], expected.at(index)));  // the same per-sample seed
      }
    }
  }
  CHECK(seen.size() == 10);
  for (const auto& [index, count] : seen) CHECK(count == 1);

  // More ranks than samples: the last ones read nothing.
  options.world_size = 12;
  options.rank = 11;
  Loader empty(dataset, options);
  CHECK(empty.samples_per_epoch() == 0);
  CHECK(empty.batches_per_epoch() == 0);
  CHECK(run_epoch(empty, {0, 0}).empty());
  // Padding applies only without drop_last; with it, pad changes nothing.
  options.world_size = 3;
  options.rank = 1;
  options.drop_last = true;
  Loader dropping(dataset, options);
  CHECK(targets_of(run_epoch(dropping, {0, 0})) == std::vector<int64_t>{1, 4, 7});
}

TEST_CASE("on_error skip in a one-sample dataset says there is no other sample", "[data]") {
  const auto dataset = std::make_shared<IndexDataset>(1, /*throw_at=*/0);
  LoaderOptions options = index_options(1);
  options.on_error = OnError::Skip;
  Loader loader(dataset, options);
  loader.start({0, 0});
  try {
    loader.next();
    FAIL("expected a DataError");
  } catch (const train::DataError& e) {
    const std::string message = e.what();
    CHECK_THAT(message, Contains("sample 0") && Contains("cannot decode record") &&
                            Contains("the dataset has no other sample to replace it"));
    CHECK_THAT(message, !Contains("0 samples"));
  }
  // Two samples, both failing: one sample after it, named as one.
  class AllFail : public IndexDataset {
   public:
    AllFail() : IndexDataset(2) {}
    Example get(int64_t, uint64_t) const override { throw std::runtime_error("cannot decode record"); }
  };
  Loader two(std::make_shared<AllFail>(), options);
  two.start({0, 0});
  CHECK_THROWS_WITH(two.next(), Contains("the one sample after it fails to load too"));
}

TEST_CASE("start() resumes exactly at a position without loading earlier batches", "[data]") {
  const auto dataset = std::make_shared<IndexDataset>(23, -1, /*jitter=*/true);
  const LoaderOptions options = index_options(4, /*workers=*/2);
  Loader full_loader(dataset, options);
  const std::vector<Batch> full = run_epoch(full_loader, {1, 0});
  REQUIRE(full.size() == 5);
  CHECK(full_loader.position().epoch == 1);
  CHECK(full_loader.position().batch == 5);

  for (int64_t k : {0, 1, 3, 5}) {
    INFO("resume at batch " << k);
    Loader loader(dataset, options);
    loader.start({1, k});
    CHECK(loader.position().batch == k);
    std::vector<Batch> rest;
    while (std::optional<Batch> batch = loader.next()) {
      rest.push_back(*batch);
      CHECK(loader.position().batch == k + static_cast<int64_t>(rest.size()));
    }
    check_same_batches(rest, std::vector<Batch>(full.begin() + k, full.end()));
  }

  const auto counting = std::make_shared<IndexDataset>(23);
  Loader sync_loader(counting, index_options(4));
  sync_loader.start({1, 3});
  REQUIRE(sync_loader.next().has_value());
  CHECK(counting->gets == 4);
  CHECK_THROWS_AS(sync_loader.start({1, 6}), train::Error);
}

// Polls `done` for up to 10 s; true once it holds.
template <typename Done>
bool eventually(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

TEST_CASE("Loader workers build the next epoch's first batches before it starts, and start() keeps them",
          "[data]") {
  // 6 batches of 4 per epoch; 2 workers x prefetch 2 hold 4 batches ahead.
  const auto dataset = std::make_shared<IndexDataset>(24);
  LoaderOptions options = index_options(4, /*workers=*/2);
  options.epochs = 2;
  Loader reference_loader(std::make_shared<IndexDataset>(24), index_options(4));

  Loader loader(dataset, options);
  check_same_batches(run_epoch(loader, {0, 0}), run_epoch(reference_loader, {0, 0}));
  CHECK(loader.position().epoch == 0);
  CHECK(loader.position().batch == 6);
  // Epoch 0 is read; its end did not stop the workers: 4 batches of epoch 1 get built.
  CHECK(eventually([&] { return dataset->gets == 24 + 16; }));

  // Starting epoch 1 uses them (nothing is loaded twice), and the batches are epoch 1's.
  check_same_batches(run_epoch(loader, {1, 0}), run_epoch(reference_loader, {1, 0}));
  CHECK(dataset->gets == 48);
  // options.epochs = 2: nothing of epoch 2 is built in advance.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(dataset->gets == 48);
  // Reading it anyway works.
  check_same_batches(run_epoch(loader, {2, 0}), run_epoch(reference_loader, {2, 0}));

  // A start() a little ahead of delivery (within what is being built) drops the batches between.
  Loader ahead(std::make_shared<IndexDataset>(24, -1, /*jitter=*/true), options);
  ahead.start({0, 0});
  REQUIRE(ahead.next().has_value());
  const std::vector<Batch> rest = run_epoch(ahead, {0, 3});
  const std::vector<Batch> full = run_epoch(reference_loader, {0, 0});
  check_same_batches(rest, std::vector<Batch>(full.begin() + 3, full.end()));
  // And one behind it starts afresh.
  check_same_batches(run_epoch(ahead, {0, 1}), std::vector<Batch>(full.begin() + 1, full.end()));
}

TEST_CASE("set_workers adds workers to a running loader: same batches, none built twice", "[data]") {
  const auto reference_set = std::make_shared<IndexDataset>(40, -1, /*jitter=*/true);
  Loader reference_loader(reference_set, index_options(4));
  const std::vector<Batch> reference = run_epoch(reference_loader, {0, 0});
  for (const int64_t first_workers : {0, 1, 2}) {
    INFO("from " << first_workers << " workers");
    const auto dataset = std::make_shared<IndexDataset>(40, -1, /*jitter=*/true);
    LoaderOptions options = index_options(4, first_workers);
    options.epochs = 1;  // nothing beyond the epoch, so that every get() is counted below
    Loader loader(dataset, options);
    loader.start({0, 0});
    std::vector<Batch> batches;
    for (int b = 0; b < 3; ++b) batches.push_back(*loader.next());
    loader.set_workers(first_workers + 2);
    CHECK(loader.options().workers == first_workers + 2);
    loader.set_workers(first_workers + 2);  // the same count again: nothing changes
    for (int b = 0; b < 2; ++b) batches.push_back(*loader.next());
    loader.set_workers(first_workers + 5);
    while (std::optional<Batch> batch = loader.next()) batches.push_back(*batch);
    check_same_batches(batches, reference);
    CHECK(dataset->gets == 40);  // every sample once: the batches in flight were kept
    CHECK_THROWS_AS(loader.set_workers(1), train::Error);  // only up
  }
}

TEST_CASE("A sample skipped in a batch built ahead counts when that batch is delivered", "[data]") {
  const auto dataset = std::make_shared<IndexDataset>(24, /*throw_at=*/7);
  LoaderOptions options = index_options(4, /*workers=*/2);
  options.on_error = OnError::Skip;
  options.shuffle = false;  // sample 7 is in batch 1 of every epoch
  Loader loader(dataset, options);
  run_epoch(loader, {0, 0});
  // Epoch 0: 24 gets and sample 8 again in place of 7; then batches 0 to 3 of epoch 1 are built
  // ahead, with the same substitution.
  CHECK(eventually([&] { return dataset->gets == 25 + 17; }));
  CHECK(loader.skipped() == 1);
  CHECK(loader.skipped_samples() == std::set<std::pair<int64_t, int64_t>>{{0, 7}});
  run_epoch(loader, {1, 0});
  CHECK(loader.skipped() == 2);
  CHECK(loader.skipped_samples() == std::set<std::pair<int64_t, int64_t>>{{0, 7}, {1, 7}});
}

TEST_CASE("A failing sample surfaces from next() with its index", "[data]") {
  for (int64_t workers : {0, 1, 3}) {
    INFO("workers " << workers);
    const auto dataset = std::make_shared<IndexDataset>(40, /*throw_at=*/7);
    LoaderOptions options = index_options(4, workers);
    options.shuffle = false;
    options.prefetch = 1;
    Loader loader(dataset, options);
    loader.start({0, 0});
    REQUIRE(loader.next().has_value());  // samples 0..3
    try {
      loader.next();  // samples 4..7
      FAIL("expected a DataError");
    } catch (const train::DataError& e) {
      CHECK_THAT(std::string(e.what()),
                 Contains("sample 7") && Contains("batch 1") && Contains("cannot decode record"));
      CHECK(e.exit_code() == train::kExitRuntime);
    }
    // Not skipped: the position stays and the error repeats.
    CHECK(loader.position().batch == 1);
    CHECK_THROWS_AS(loader.next(), train::DataError);
  }  // destruction must not hang with workers blocked on a full queue
}

TEST_CASE("Loader shuts down and restarts cleanly while workers are busy", "[data]") {
  const auto dataset = std::make_shared<IndexDataset>(60, -1, /*jitter=*/true);
  LoaderOptions options = index_options(3, /*workers=*/3);
  options.prefetch = 1;
  {
    Loader abandoned(dataset, options);
    abandoned.start({0, 0});
  }
  Loader reference_loader(dataset, index_options(3));
  const std::vector<Batch> reference = run_epoch(reference_loader, {0, 0});

  Loader loader(dataset, options);
  loader.start({0, 0});
  REQUIRE(loader.next().has_value());
  loader.start({5, 0});  // restart while the queue is full
  check_same_batches(run_epoch(loader, {0, 0}), reference);
}

// Records the intra-op thread count of the thread that loads each sample.
class ThreadCountDataset : public Dataset {
 public:
  int64_t size() const override { return 24; }
  Example get(int64_t index, uint64_t) const override {
    const int threads = at::get_num_threads();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      seen_.insert(threads);
    }
    return Example{torch::full({4096}, static_cast<float>(index)), torch::scalar_tensor(index, torch::kLong)};
  }
  std::vector<int64_t> input_shape() const override { return {4096}; }
  int64_t num_classes() const override { return 24; }
  std::string describe() const override { return "thread count dataset"; }
  std::set<int> seen() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }

 private:
  mutable std::mutex mutex_;
  mutable std::set<int> seen_;
};

TEST_CASE("Loader workers and scan threads run ATen ops serially, and the calling thread keeps its threads", "[data]") {
  const int before = at::get_num_threads();
  at::set_num_threads(3);  // as the plan sets them: every core for the training thread
  struct Restore {
    int threads;
    ~Restore() { at::set_num_threads(threads); }
  } restore{before};
  {
    const auto dataset = std::make_shared<ThreadCountDataset>();
    Loader loader(dataset, index_options(4, /*workers=*/2));
    CHECK(run_epoch(loader, {0, 0}).size() == 6);
    CHECK(dataset->seen() == std::set<int>{1});
  }
  {
    const auto dataset = std::make_shared<ThreadCountDataset>();
    Loader loader(dataset, index_options(4, /*workers=*/0));  // synchronous: the calling thread loads
    CHECK(run_epoch(loader, {0, 0}).size() == 6);
    CHECK(dataset->seen() == std::set<int>{3});
  }
  {
    ThreadCountDataset dataset;
    ScanOptions options;
    options.threads = 3;
    options.progress = [](int64_t, int64_t) {};  // every sample read by a thread of the scan's own
    options.progress_every_s = 0.01;
    CHECK(scan_dataset(dataset, options).bad == 0);
    CHECK(dataset.seen() == std::set<int>{1});
  }
  CHECK(at::get_num_threads() == 3);
}

TEST_CASE("pin_memory pins collated batches when CUDA is available", "[data]") {
  LoaderOptions options = index_options(4, /*workers=*/2);
  options.pin_memory = true;
  Loader loader(std::make_shared<IndexDataset>(12), options);
  loader.start({0, 0});
  const std::optional<Batch> batch = loader.next();
  REQUIRE(batch.has_value());
  TRAIN_SKIP_WITHOUT_CUDA("CUDA not available: pin_memory is a no-op here");
  CHECK(batch->input.is_pinned());
  CHECK(batch->target.is_pinned());
  const Batch on_gpu = batch->to(torch::Device(torch::kCUDA), /*non_blocking=*/true);
  CHECK(torch::equal(on_gpu.input.cpu(), batch->input));
  CHECK(torch::equal(on_gpu.target.cpu(), batch->target));
}

TEST_CASE("sample_seed mixes all of its inputs", "[data]") {
  const uint64_t base = sample_seed(1, 2, 3);
  CHECK(sample_seed(1, 2, 3) == base);
  CHECK(sample_seed(0, 2, 3) != base);
  CHECK(sample_seed(1, 3, 3) != base);
  CHECK(sample_seed(1, 2, 4) != base);
  CHECK(sample_seed(1, 3, 2) != sample_seed(1, 2, 3));
}

// ---- transforms, synthetic data, factory ------------------------------------------------------

TEST_CASE("Image transforms", "[data]") {
  const torch::Tensor image = torch::arange(2 * 4 * 5, torch::kFloat).view({2, 4, 5});

  CHECK(torch::equal(hflip(hflip(image)), image));
  CHECK(hflip(image)[1][2][0].item<float>() == image[1][2][4].item<float>());

  CHECK(torch::equal(pad_crop(image, 0, 0, 0), image));
  CHECK(torch::equal(pad_crop(image, 2, 2, 2), image));
  const torch::Tensor shifted = pad_crop(image, 1, 0, 0);  // content moves down and right by 1
  CHECK(shifted.sizes() == image.sizes());
  CHECK(shifted[0][0].abs().sum().item<float>() == 0.0f);
  CHECK(
      torch::equal(shifted.narrow(1, 1, 3).narrow(2, 1, 4), image.narrow(1, 0, 3).narrow(2, 0, 4)));
  CHECK_THROWS(pad_crop(image, 1, 3, 0));

  const torch::Tensor normalized = normalize(image, {1.0, 2.0}, {2.0, 4.0});
  CHECK(normalized[0][1][1].item<float>() == Approx((image[0][1][1].item<float>() - 1.0) / 2.0));
  CHECK(normalized[1][3][4].item<float>() == Approx((image[1][3][4].item<float>() - 2.0) / 4.0));

  ImageTransforms augment;
  augment.random_crop = true;
  augment.crop_padding = 2;
  augment.random_flip = true;
  CHECK(torch::equal(augment.apply(image, 7), augment.apply(image, 7)));
  bool varies = false;
  for (uint64_t seed = 0; seed < 8 && !varies; ++seed) {
    varies = !torch::equal(augment.apply(image, seed), augment.apply(image, 100 + seed));
  }
  CHECK(varies);
  CHECK(augment.describe() == "random_crop(pad 2), random_flip");
  CHECK(ImageTransforms{}.describe() == "none");
  CHECK(torch::equal(ImageTransforms{}.apply(image, 3), image));
}

TEST_CASE("Collate stacks inputs and targets", "[data]") {
  IndexDataset dataset(5);
  std::vector<Example> examples = {dataset.get(0, 0), dataset.get(3, 0)};
  const Batch batch = dataset.collate(std::move(examples));
  CHECK(batch.size() == 2);
  CHECK(batch.input.sizes() == torch::IntArrayRef{2, 2});
  CHECK(batch.target.sizes() == torch::IntArrayRef{2});
  CHECK(batch.target[1].item<int64_t>() == 3);
}

TEST_CASE("Synthetic images are fixed per index and learnable", "[data]") {
  SyntheticImageOptions options;
  options.samples = 400;
  options.channels = 2;
  options.image_size = 6;
  SyntheticImageDataset train_set(options);
  options.stream = 1;
  SyntheticImageDataset val_set(options);

  CHECK(train_set.input_shape() == std::vector<int64_t>{2, 6, 6});
  const Example a = train_set.get(13, 1);
  CHECK(torch::equal(a.input, train_set.get(13, 2).input));  // no transforms: seed is irrelevant
  CHECK(a.target.item<int64_t>() == 3);
  CHECK(!torch::equal(a.input, val_set.get(13, 1).input));
  CHECK(a.input.min().item<float>() >= 0.0f);
  CHECK(a.input.max().item<float>() <= 1.0f);

  // Class means estimated on the train stream classify the val stream (nearest mean).
  torch::Tensor means = torch::zeros({10, 2, 6, 6});
  for (int64_t i = 0; i < train_set.size(); ++i) {
    const Example example = train_set.get(i, 0);
    means[example.target.item<int64_t>()] += example.input / 40.0;
  }
  int64_t correct = 0;
  for (int64_t i = 0; i < 100; ++i) {
    const Example example = val_set.get(i, 0);
    const torch::Tensor distances = (means - example.input).pow(2).sum({1, 2, 3});
    correct += distances.argmin().item<int64_t>() == example.target.item<int64_t>();
  }
  CHECK(correct >= 90);
}

TEST_CASE("make_dataset builds synthetic splits and validates the config", "[data]") {
  train::DataConfig config;
  config.kind = "synthetic";
  config.channels = 3;
  config.image_size = 8;
  config.synthetic_train_samples = 64;
  config.synthetic_val_samples = 16;
  config.random_flip = true;
  config.random_crop = true;
  config.mean = {0.5, 0.5, 0.5};
  config.std = {0.25, 0.25, 0.25};

  const DatasetPtr train_set = make_dataset(config, Split::Train);
  const DatasetPtr val_set = make_dataset(config, Split::Val);
  CHECK(train_set->size() == 64);
  CHECK(val_set->size() == 16);
  CHECK(train_set->input_shape() == std::vector<int64_t>{3, 8, 8});
  CHECK_THAT(train_set->describe(), Contains("random_crop(pad 2), random_flip, normalize"));
  CHECK_THAT(val_set->describe(), Contains("transforms: normalize"));
  CHECK(torch::equal(val_set->get(1, 5).input, val_set->get(1, 6).input));  // no augmentation
  // Normalised: pixels in [0, 1] map to [-2, 2].
  CHECK(val_set->get(1, 5).input.abs().max().item<float>() <= 2.0f);

  config.mean = {0.5};
  config.std = {0.25};
  CHECK_THROWS_AS(make_dataset(config, Split::Train), train::ConfigError);
  config.mean.clear();
  config.std.clear();
  config.kind = "csv";
  CHECK_THROWS_AS(make_dataset(config, Split::Train), train::ConfigError);
  config.kind = "idx";
  CHECK_THROWS_AS(make_dataset(config, Split::Val), train::ConfigError);  // no root
  TempDir empty;
  config.root = empty.path;
  CHECK_THROWS_AS(make_dataset(config, Split::Val), train::DataError);
}

TEST_CASE("scan_dataset reads every sample once and reports the bad ones by index, for any thread count",
          "[data]") {
  // Samples that throw, a sample of another shape, and a whole-file check.
  class Damaged : public IndexDataset {
   public:
    Damaged() : IndexDataset(1000) {}
    Example get(int64_t index, uint64_t seed) const override {
      seen[static_cast<size_t>(index)].fetch_add(1);
      seeds[static_cast<size_t>(index)] = seed;
      if (index % 97 == 13) throw train::DataError("record " + std::to_string(index) + ": truncated");
      if (index == 500) return Example{torch::zeros({3}, torch::kDouble), torch::scalar_tensor(0, torch::kLong)};
      return IndexDataset::get(index, seed);
    }
    void verify() const override {
      if (broken) throw train::DataError("damaged.bin: checksum mismatch");
    }
    mutable std::vector<std::atomic<int>> seen = std::vector<std::atomic<int>>(1000);
    mutable std::vector<uint64_t> seeds = std::vector<uint64_t>(1000);
    bool broken = false;
  };
  // Indices 13, 110, 207, ..., 982 throw: 11 of them, and 500 has shape 3.
  for (int threads : {1, 3}) {
    INFO("threads " << threads);
    Damaged dataset;
    ScanOptions options;
    options.threads = threads;
    options.max_messages = 4;
    options.seed = 21;
    const ScanReport report = scan_dataset(dataset, options);
    CHECK(report.samples == 1000);
    CHECK(report.bad == 12);
    REQUIRE(report.messages.size() == 4);
    CHECK(report.messages[0] == "sample 13: record 13: truncated");
    CHECK(report.messages[1] == "sample 110: record 110: truncated");
    CHECK(report.messages[3] == "sample 304: record 304: truncated");
    for (int64_t i = 0; i < 1000; ++i) {
      INFO("sample " << i);
      CHECK(dataset.seen[static_cast<size_t>(i)].load() == 1);
      CHECK(dataset.seeds[static_cast<size_t>(i)] == sample_seed(21, 0, i));
    }
    options.max_messages = 100;
    const ScanReport all = scan_dataset(dataset, options);
    REQUIRE(all.messages.size() == 12);
    CHECK(all.messages[5] == "sample 498: record 498: truncated");
    CHECK(all.messages[6] == "sample 500: input of shape 3, the dataset's is 2 (index dataset)");
  }
  Damaged broken;
  broken.broken = true;
  CHECK_THROWS_WITH(scan_dataset(broken), "damaged.bin: checksum mismatch");
  CHECK(broken.seen[0].load() == 0);  // the whole-file check comes first

  // Progress reports from the calling thread while the others read.
  IndexDataset slow(200, -1, /*jitter=*/true);
  ScanOptions options;
  options.threads = 2;
  options.progress_every_s = 0.0;
  std::vector<std::pair<int64_t, int64_t>> reports;
  options.progress = [&](int64_t done, int64_t total) { reports.emplace_back(done, total); };
  CHECK(scan_dataset(slow, options).bad == 0);
  CHECK(slow.gets.load() == 200);
  for (const auto& [done, total] : reports) {
    CHECK(total == 200);
    CHECK(done <= 200);
  }
}
