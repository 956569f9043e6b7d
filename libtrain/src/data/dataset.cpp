// Dataset::collate, the image transforms, the synthetic dataset and the dataset factory.
#include <train/config.h>
#include <train/data/dataset.h>
#include <train/data/factory.h>
#include <train/text/tsv_dataset.h>
#include <train/data/idx.h>
#include <train/data/image_folder.h>
#include <train/data/synthetic.h>
#include <train/data/tokens.h>
#include <train/data/transforms.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/log.h>
#include <torch/nn/functional/upsampling.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace train::data {

// ---- Dataset --------------------------------------------------------------------------------

struct BatchMemory::Pool {
  std::mutex mutex;
  std::vector<std::pair<size_t, void*>> free;  // (bytes, buffer)
  size_t keep = 0;
  ~Pool() {
    for (const auto& buffer : free) std::free(buffer.second);
  }
};

BatchMemory::BatchMemory(size_t keep) : pool_(std::make_shared<Pool>()) { pool_->keep = keep; }

torch::Tensor BatchMemory::empty(at::IntArrayRef sizes, at::ScalarType dtype) const {
  int64_t count = 1;
  for (const int64_t size : sizes) count *= size;
  // Rounded up to whole 64-byte lines, as aligned_alloc requires.
  const size_t bytes = (static_cast<size_t>(count) * c10::elementSize(dtype) + 63) / 64 * 64;
  void* buffer = nullptr;
  {
    const std::lock_guard<std::mutex> lock(pool_->mutex);
    auto& free = pool_->free;
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->first == bytes) {
        buffer = it->second;
        free.erase(it);
        break;
      }
    }
  }
  if (buffer == nullptr) buffer = std::aligned_alloc(64, std::max<size_t>(bytes, 64));
  if (buffer == nullptr) throw std::bad_alloc();
  const std::weak_ptr<Pool> weak = pool_;
  return torch::from_blob(
      buffer, sizes,
      [weak, bytes](void* data) {
        if (const std::shared_ptr<Pool> pool = weak.lock()) {
          const std::lock_guard<std::mutex> lock(pool->mutex);
          if (pool->free.size() < pool->keep) {
            pool->free.emplace_back(bytes, data);
            return;
          }
        }
        std::free(data);
      },
      torch::TensorOptions(dtype));
}

Batch Dataset::collate(std::vector<Example>&& examples) const {
  if (examples.empty()) throw std::invalid_argument("Dataset::collate: no examples to collate");
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> targets;
  inputs.reserve(examples.size());
  targets.reserve(examples.size());
  for (Example& example : examples) {
    inputs.push_back(std::move(example.input));
    targets.push_back(std::move(example.target));
  }
  return Batch{torch::stack(inputs), torch::stack(targets)};
}

// ---- transforms -----------------------------------------------------------------------------

torch::Tensor pad_crop(const torch::Tensor& image, int64_t padding, int64_t top, int64_t left) {
  if (image.dim() != 3) throw std::invalid_argument("pad_crop: expected a [C,H,W] image");
  if (padding < 0 || top < 0 || left < 0 || top > 2 * padding || left > 2 * padding) {
    throw std::invalid_argument("pad_crop: need 0 <= top, left <= 2 * padding");
  }
  const int64_t height = image.size(1);
  const int64_t width = image.size(2);
  return torch::constant_pad_nd(image, {padding, padding, padding, padding}, 0)
      .narrow(1, top, height)
      .narrow(2, left, width);
}

torch::Tensor hflip(const torch::Tensor& image) { return image.flip({-1}); }

torch::Tensor normalize(const torch::Tensor& image, const std::vector<double>& mean,
                        const std::vector<double>& stddev) {
  const auto channels = static_cast<size_t>(image.size(0));
  if (mean.size() != channels || stddev.size() != channels) {
    throw std::invalid_argument("normalize: mean and stddev need one value per channel");
  }
  const auto options = torch::TensorOptions().dtype(image.scalar_type());
  const torch::Tensor mean_t = torch::tensor(mean, options).view({-1, 1, 1});
  const torch::Tensor std_t = torch::tensor(stddev, options).view({-1, 1, 1});
  return (image - mean_t) / std_t;
}

Batch normalize_on_device(const Batch& batch, const std::vector<double>& mean,
                          const std::vector<double>& stddev, torch::ScalarType dtype) {
  const torch::Tensor& input = batch.input;
  if (input.dim() != 4) {
    throw std::invalid_argument("normalize_on_device: expected images [B, C, H, W], got " +
                                std::to_string(input.dim()) + " dimensions");
  }
  const auto channels = static_cast<size_t>(input.size(1));
  if (mean.size() != stddev.size() || (!mean.empty() && mean.size() != channels)) {
    throw std::invalid_argument("normalize_on_device: mean and stddev need one value per channel (" +
                                std::to_string(channels) + "), or none");
  }
  // One multiply and one subtract: x * scale[c] - shift[c], with the 1/255 folded into scale.
  const double range = input.scalar_type() == torch::kByte ? 255.0 : 1.0;
  std::vector<double> scale(channels, 1.0 / range);
  std::vector<double> shift(channels, 0.0);
  for (size_t c = 0; c < mean.size(); ++c) {
    scale[c] = 1.0 / (range * stddev[c]);
    shift[c] = mean[c] / stddev[c];
  }
  // Keeps the input's memory format (channels_last stays channels_last). Scalars per channel, not
  // small tensors copied from the host: a pageable copy to the GPU would wait for the stream.
  // Computed in float (double for a double output) and rounded to `dtype` once: in bf16 the
  // product would be rounded before the subtraction too (up to 0.0216 off with ImageNet's mean and
  // std, where one rounding stays within 0.0078).
  const torch::ScalarType compute = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
  torch::Tensor output = input.to(compute, /*non_blocking=*/false, /*copy=*/true);
  for (size_t c = 0; c < channels; ++c) {
    output.select(1, static_cast<int64_t>(c)).mul_(scale[c]).sub_(shift[c]);
  }
  if (dtype != compute) output = output.to(dtype);
  return Batch{std::move(output), batch.target};
}

CropBox random_resized_crop_box(int64_t height, int64_t width, double min_scale, double max_scale,
                                double min_ratio, double max_ratio, SplitMix64& rng) {
  if (height < 1 || width < 1) {
    throw std::invalid_argument("random_resized_crop_box: the image is empty");
  }
  if (!(min_scale > 0.0 && min_scale <= max_scale) || !(min_ratio > 0.0 && min_ratio <= max_ratio)) {
    throw std::invalid_argument(
        "random_resized_crop_box: need 0 < min_scale <= max_scale and 0 < min_ratio <= max_ratio");
  }
  const double area = static_cast<double>(height) * static_cast<double>(width);
  const double log_min_ratio = std::log(min_ratio);
  const double log_max_ratio = std::log(max_ratio);
  constexpr int kAttempts = 10;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const double target_area = area * (min_scale + (max_scale - min_scale) * rng.uniform());
    const double ratio = std::exp(log_min_ratio + (log_max_ratio - log_min_ratio) * rng.uniform());
    const auto w = static_cast<int64_t>(std::nearbyint(std::sqrt(target_area * ratio)));
    const auto h = static_cast<int64_t>(std::nearbyint(std::sqrt(target_area / ratio)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const auto top = static_cast<int64_t>(rng.below(static_cast<uint64_t>(height - h + 1)));
      const auto left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(width - w + 1)));
      return CropBox{top, left, h, w};
    }
  }
  // No draw fitted: the whole image, cut to the nearest allowed aspect ratio, centred.
  const double image_ratio = static_cast<double>(width) / static_cast<double>(height);
  int64_t w = width;
  int64_t h = height;
  if (image_ratio < min_ratio) {
    h = static_cast<int64_t>(std::nearbyint(static_cast<double>(w) / min_ratio));
  } else if (image_ratio > max_ratio) {
    w = static_cast<int64_t>(std::nearbyint(static_cast<double>(h) * max_ratio));
  }
  return CropBox{(height - h) / 2, (width - w) / 2, h, w};
}

torch::Tensor resize_bilinear(const torch::Tensor& image, int64_t height, int64_t width) {
  if (image.dim() != 3) throw std::invalid_argument("resize_bilinear: expected a [C,H,W] image");
  if (height < 1 || width < 1) throw std::invalid_argument("resize_bilinear: empty output size");
  if (image.size(1) == height && image.size(2) == width) return image;
  namespace F = torch::nn::functional;
  const auto options = F::InterpolateFuncOptions()
                           .size(std::vector<int64_t>{height, width})
                           .mode(torch::kBilinear)
                           .align_corners(false)
                           .antialias(true);
  return F::interpolate(image.unsqueeze(0), options).squeeze(0);
}

torch::Tensor resize_shorter_side(const torch::Tensor& image, int64_t size) {
  if (image.dim() != 3) throw std::invalid_argument("resize_shorter_side: expected a [C,H,W] image");
  const int64_t height = image.size(1);
  const int64_t width = image.size(2);
  if (height <= width) return resize_bilinear(image, size, size * width / height);
  return resize_bilinear(image, size * height / width, size);
}

torch::Tensor center_crop(const torch::Tensor& image, int64_t size) {
  if (image.dim() != 3) throw std::invalid_argument("center_crop: expected a [C,H,W] image");
  const int64_t height = image.size(1);
  const int64_t width = image.size(2);
  if (size < 1 || size > height || size > width) {
    throw std::invalid_argument("center_crop: size " + std::to_string(size) +
                                " does not fit a " + std::to_string(height) + "x" +
                                std::to_string(width) + " image");
  }
  const auto top = static_cast<int64_t>(std::nearbyint(static_cast<double>(height - size) / 2.0));
  const auto left = static_cast<int64_t>(std::nearbyint(static_cast<double>(width - size) / 2.0));
  return image.narrow(1, top, size).narrow(2, left, size);
}

torch::Tensor ImageTransforms::apply(const torch::Tensor& image, uint64_t seed) const {
  SplitMix64 rng(seed);
  torch::Tensor out = image;
  if (random_crop && crop_padding > 0) {
    const auto positions = static_cast<uint64_t>(2 * crop_padding + 1);
    const auto top = static_cast<int64_t>(rng.below(positions));
    const auto left = static_cast<int64_t>(rng.below(positions));
    out = pad_crop(out, crop_padding, top, left);
  }
  if (random_flip && rng.below(2) == 1) out = hflip(out);
  if (!mean.empty()) out = normalize(out, mean, stddev);
  return out;
}

std::string ImageTransforms::describe() const {
  std::vector<std::string> steps;
  if (random_crop && crop_padding > 0) {
    steps.push_back("random_crop(pad " + std::to_string(crop_padding) + ")");
  }
  if (random_flip) steps.push_back("random_flip");
  if (!mean.empty()) steps.push_back("normalize");
  if (steps.empty()) return "none";
  std::string joined = steps[0];
  for (size_t i = 1; i < steps.size(); ++i) joined += ", " + steps[i];
  return joined;
}

// ---- synthetic images -----------------------------------------------------------------------

namespace {
// Fixed so that every split, run and machine sees the same class prototypes, i.e. the same task.
constexpr uint64_t kPrototypeSeed = 0x5EED0F5EA7C0FFEEull;
}  // namespace

SyntheticImageDataset::SyntheticImageDataset(SyntheticImageOptions options)
    : options_(std::move(options)) {
  if (options_.samples < 0 || options_.channels < 1 || options_.image_size < 1 ||
      options_.num_classes < 1) {
    throw std::invalid_argument(
        "SyntheticImageDataset: need samples >= 0 and channels, image_size, num_classes >= 1");
  }
  prototypes_ = torch::empty(
      {options_.num_classes, options_.channels, options_.image_size, options_.image_size},
      torch::kFloat);
  SplitMix64 rng(kPrototypeSeed);
  float* values = prototypes_.data_ptr<float>();
  for (int64_t i = 0; i < prototypes_.numel(); ++i) values[i] = (rng.next() >> 63) ? 1.0f : -1.0f;
}

Example SyntheticImageDataset::get(int64_t index, uint64_t seed) const {
  if (index < 0 || index >= options_.samples) {
    throw std::out_of_range("synthetic dataset: index " + std::to_string(index) +
                            " out of range [0, " + std::to_string(options_.samples) + ")");
  }
  const int64_t label = index % options_.num_classes;
  const int64_t pixels = options_.channels * options_.image_size * options_.image_size;
  torch::Tensor image =
      torch::empty({options_.channels, options_.image_size, options_.image_size}, torch::kFloat);
  float* out = image.data_ptr<float>();
  const float* prototype = prototypes_.data_ptr<float>() + label * pixels;
  SplitMix64 noise(mix64(mix64(options_.stream) + static_cast<uint64_t>(index)));
  for (int64_t i = 0; i < pixels; ++i) {
    out[i] = 0.5f + 0.2f * prototype[i] + 0.3f * (2.0f * noise.uniform() - 1.0f);
  }
  return Example{options_.transforms.apply(image, seed), torch::scalar_tensor(label, torch::kLong)};
}

std::vector<int64_t> SyntheticImageDataset::input_shape() const {
  return {options_.channels, options_.image_size, options_.image_size};
}

std::string SyntheticImageDataset::describe() const {
  std::ostringstream out;
  out << "synthetic: " << options_.samples << " images " << options_.channels << "x"
      << options_.image_size << "x" << options_.image_size << ", " << options_.num_classes
      << " classes, transforms: " << options_.transforms.describe();
  return out.str();
}

// ---- factory --------------------------------------------------------------------------------

namespace {

// Checks the config's transform settings against the images' channel count and builds the
// pipeline for a split.
ImageTransforms transforms_for(const DataConfig& config, Split split, int64_t channels) {
  if (config.mean.size() != config.std.size()) {
    throw ConfigError("data.mean has " + std::to_string(config.mean.size()) +
                      " values but data.std has " + std::to_string(config.std.size()));
  }
  if (!config.mean.empty() && config.mean.size() != static_cast<size_t>(channels)) {
    throw ConfigError("data.mean and data.std have " + std::to_string(config.mean.size()) +
                      " values but the images have " + std::to_string(channels) + " channel(s)");
  }
  for (double s : config.std) {
    if (!(s > 0.0)) throw ConfigError("data.std values must be > 0, got " + std::to_string(s));
  }
  if (config.random_crop && config.crop_padding < 0) {
    throw ConfigError("data.crop_padding must be >= 0, got " + std::to_string(config.crop_padding));
  }

  ImageTransforms transforms;
  if (split == Split::Train) {
    transforms.random_crop = config.random_crop;
    transforms.crop_padding = config.crop_padding;
    transforms.random_flip = config.random_flip;
  }
  transforms.mean = config.mean;
  transforms.stddev = config.std;
  return transforms;
}

DatasetPtr make_synthetic(const DataConfig& config, Split split) {
  const int64_t samples =
      split == Split::Train ? config.synthetic_train_samples : config.synthetic_val_samples;
  const char* samples_key =
      split == Split::Train ? "data.synthetic_train_samples" : "data.synthetic_val_samples";
  if (samples < 1) {
    throw ConfigError(std::string(samples_key) + " must be >= 1, got " + std::to_string(samples));
  }
  if (config.channels < 1) {
    throw ConfigError("data.channels must be >= 1, got " + std::to_string(config.channels));
  }
  if (config.image_size < 0) {
    throw ConfigError("data.image_size must be >= 0, got " + std::to_string(config.image_size));
  }

  SyntheticImageOptions options;
  options.samples = samples;
  options.channels = config.channels;
  options.image_size = config.image_size > 0 ? config.image_size : kSyntheticDefaultImageSize;
  options.num_classes = kSyntheticNumClasses;
  options.stream = split == Split::Train ? 0 : 1;
  options.transforms = transforms_for(config, split, config.channels);
  return std::make_shared<SyntheticImageDataset>(std::move(options));
}

DatasetPtr make_idx(const DataConfig& config, Split split) {
  if (config.root.empty()) throw ConfigError("data.root is required when data.kind is idx");
  // Validate the cheap settings before reading tens of megabytes. IDX images have one channel.
  ImageTransforms transforms = transforms_for(config, split, 1);
  const bool train = split == Split::Train;
  const std::string images =
      find_data_file(config.root, train ? config.train_images : config.val_images);
  const std::string labels =
      find_data_file(config.root, train ? config.train_labels : config.val_labels);
  auto dataset = std::make_shared<IdxDataset>(images, labels, std::move(transforms));

  const std::vector<int64_t> shape = dataset->input_shape();
  if (config.image_size != 0 && (shape[1] != config.image_size || shape[2] != config.image_size)) {
    throw ConfigError("data.image_size is " + std::to_string(config.image_size) + " but " + images +
                      " holds " + std::to_string(shape[1]) + "x" + std::to_string(shape[2]) +
                      " images (resizing is not supported)");
  }
  return dataset;
}

}  // namespace

DatasetPtr make_idx_image_files(const DataConfig& config, const std::vector<std::string>& paths) {
  ImageTransforms transforms = transforms_for(config, Split::Val, 1);
  int64_t side = config.image_size;
  if (side == 0) {
    const std::string root = config.root.empty() ? "." : config.root;
    std::string file;
    std::vector<int64_t> dims;
    try {
      file = find_data_file(root, config.val_images);
      dims = read_idx_image_dims(file);
    } catch (const DataError& e) {
      log::warn(log::str("the IDX images' side is not known here (", e.what(), "); taking 28, the side of MNIST and "
                         "Fashion-MNIST (set data.image_size to give another)"));
      dims = {0, 28, 28};
    }
    if (dims[1] != dims[2]) {
      throw DataError(log::str(file, " holds ", dims[1], "x", dims[2], " images, and image files are resized to a "
                               "square: train predict cannot feed this model"));
    }
    side = dims[1];
  }
  torch::Tensor images = read_images_as_idx(paths, side);
  torch::Tensor labels = torch::full({images.size(0)}, kIgnoreIndex, torch::kLong);
  return std::make_shared<IdxDataset>(std::move(images), std::move(labels), std::move(transforms),
                                      log::str(paths.size(), " image file(s)"));
}

namespace {

DatasetPtr make_image_folder(const DataConfig& config, Split split) {
  if (config.root.empty()) throw ConfigError("data.root is required when data.kind is image_folder");
  ImageFolderOptions options = image_folder_options(config, split);
  const std::string train_directory = files::join(config.root, config.train_dir);
  options.directory = split == Split::Train ? train_directory : files::join(config.root, config.val_dir);
  // Labels are positions in the training split's class list, whichever split is read.
  if (split == Split::Val) options.classes = find_image_classes(train_directory);
  return std::make_shared<ImageFolderDataset>(std::move(options));
}

// A token-dataset path: absolute, or relative to data.root.
std::string in_root(const DataConfig& config, const std::string& name) {
  if (name.empty() || name.front() == '/' || config.root.empty()) return name;
  return files::join(config.root, name);
}

DatasetPtr make_tokens(const DataConfig& config, Split split) {
  const std::string& file = split == Split::Train ? config.train_tokens : config.val_tokens;
  const char* file_key = split == Split::Train ? "data.train_tokens" : "data.val_tokens";
  if (file.empty()) throw ConfigError(std::string(file_key) + " is required when data.kind is tokens");
  if (config.seq_len < 3) {
    throw ConfigError("data.seq_len must be >= 3 ([CLS], a token, [SEP]), got " + std::to_string(config.seq_len));
  }

  TokenDatasetOptions options;
  options.path = in_root(config, file);
  options.seq_len = config.seq_len;
  options.pack = config.pack;
  options.vocab_size = config.vocab_size;
  options.special = SpecialTokens{config.pad_id, config.unk_id, config.cls_id, config.sep_id, config.mask_id};
  // The values set by keys (not taken from the vocab file below): errors about them name the key.
  if (config.vocab_size > 0) options.keys["vocab_size"] = "data.vocab_size";
  const std::pair<const char*, int64_t> ids[] = {{"pad", config.pad_id}, {"unk", config.unk_id},
                                                 {"cls", config.cls_id}, {"sep", config.sep_id},
                                                 {"mask", config.mask_id}};
  for (const auto& [field, id] : ids) {
    if (id >= 0) options.keys[field] = std::string("data.") + field + "_id";
  }
  if (!config.vocab_file.empty()) {
    options.vocab_file = in_root(config, config.vocab_file);
    const VocabInfo vocab = read_vocab_file(options.vocab_file);
    if (options.vocab_size == 0) options.vocab_size = vocab.size;
    options.vocab_file_size = vocab.size;
    SpecialTokens& special = options.special;
    for (auto field : {&SpecialTokens::pad, &SpecialTokens::unk, &SpecialTokens::cls, &SpecialTokens::sep,
                       &SpecialTokens::mask}) {
      if (special.*field < 0) special.*field = vocab.special.*field;
    }
    options.extra_special = vocab.bracketed;
  }
  options.mlm.mask_prob = config.mask_prob;
  options.mlm.mask_token_prob = config.mask_token_prob;
  options.mlm.random_token_prob = config.random_token_prob;
  try {
    return std::make_shared<TokenDataset>(std::move(options));
  } catch (const std::invalid_argument& e) {
    throw ConfigError(std::string("data: ") + e.what());
  }
}

// What a relative path is taken against (data.root and the names in it are joined first, so a
// relative path here is relative to the working directory); nothing for an absolute one.
std::string relative_note(const std::string& path) {
  if (path.empty() || path.front() == '/') return "";
  std::vector<char> buffer(4096);
  if (::getcwd(buffer.data(), buffer.size()) == nullptr) return " (relative to the working directory)";
  return " (relative to the working directory " + std::string(buffer.data()) + ")";
}

// The paths the data section names that are not there, reported by key ("key 'data.root': ..."),
// so that the command puts where the key was set in front of the message: a dataset not prepared
// yet, or a run started from another directory, is then plain from the message. Only existence is
// checked here, and the kind of file (a directory where a file is read, or the reverse); each reader
// checks its file's contents. Still a DataError (exit code 1).
void require_paths(const DataConfig& config, Split split) {
  const bool train = split == Split::Train;
  const bool uses_root = config.kind == "idx" || config.kind == "image_folder" || config.kind == "tsv" ||
                         (config.kind == "tokens" && !config.root.empty());
  if (uses_root && !config.root.empty() && !files::exists(config.root)) {
    throw DataError("key 'data.root': " + config.root + " does not exist" + relative_note(config.root));
  }
  if (uses_root && !config.root.empty() && !files::is_directory(config.root)) {
    throw DataError("key 'data.root': " + config.root + " is not a directory");
  }
  if (uses_root && config.root.empty()) return;  // the kind's own check says that data.root is required
  std::vector<std::pair<std::string, std::string>> paths;  // key, the path as the reader opens it
  if (config.kind == "idx") {
    for (const auto& [key, stem] : {train ? std::pair{"data.train_images", &config.train_images}
                                          : std::pair{"data.val_images", &config.val_images},
                                    train ? std::pair{"data.train_labels", &config.train_labels}
                                          : std::pair{"data.val_labels", &config.val_labels}}) {
      const std::string path = files::join(config.root, *stem);
      if (!files::exists(path) && !files::exists(path + ".gz")) {
        throw DataError(std::string("key '") + key + "': neither " + path + " nor " + path + ".gz exists" +
                        relative_note(path));
      }
    }
  } else if (config.kind == "image_folder") {
    paths.emplace_back("data.train_dir", files::join(config.root, config.train_dir));
    if (!train) paths.emplace_back("data.val_dir", files::join(config.root, config.val_dir));
  } else if (config.kind == "tokens") {
    if (!config.vocab_file.empty()) paths.emplace_back("data.vocab_file", in_root(config, config.vocab_file));
    if (train && !config.train_tokens.empty()) paths.emplace_back("data.train_tokens", in_root(config, config.train_tokens));
    if (!train && !config.val_tokens.empty()) paths.emplace_back("data.val_tokens", in_root(config, config.val_tokens));
  } else if (config.kind == "tsv") {
    if (!config.vocab_file.empty()) paths.emplace_back("data.vocab_file", in_root(config, config.vocab_file));
    // The validation split takes its class list from the training file.
    if (!config.train_tsv.empty()) paths.emplace_back("data.train_tsv", in_root(config, config.train_tsv));
    if (!train && !config.val_tsv.empty()) paths.emplace_back("data.val_tsv", in_root(config, config.val_tsv));
  }
  for (const auto& [key, path] : paths) {
    if (!files::exists(path)) throw DataError("key '" + key + "': " + path + " does not exist" + relative_note(path));
    // The kind of file too: a directory given for a file (or a device, a pipe) is the key's
    // mistake, named as such; the reader checks what the file holds.
    const bool directory = key == "data.train_dir" || key == "data.val_dir";
    if (directory && !files::is_directory(path)) {
      throw DataError("key '" + key + "': " + path + " is not a directory (an ImageFolder split holds one "
                      "directory per class)");
    }
    if (!directory) {
      if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
        throw DataError("key '" + key + "': " + path + ": " + problem + ", expected a file");
      }
    }
  }
}

}  // namespace

ImageFolderOptions image_folder_options(const DataConfig& config, Split split) {
  if (config.random_crop) {
    throw ConfigError(
        "data.random_crop (a padded crop) does not apply to image_folder, whose training split "
        "always takes a random resized crop (data.crop_min_scale)");
  }
  if (!(config.crop_min_scale > 0.0 && config.crop_min_scale <= 1.0)) {
    throw ConfigError("data.crop_min_scale must be in (0, 1], got " + std::to_string(config.crop_min_scale));
  }
  const int64_t image_size = config.image_size > 0 ? config.image_size : kImageFolderDefaultImageSize;
  if (config.resize_size != 0 && config.resize_size < image_size) {
    throw ConfigError("data.resize_size is " + std::to_string(config.resize_size) +
                      ", smaller than the crop data.image_size " + std::to_string(image_size));
  }
  const ImageTransforms transforms = transforms_for(config, split, 3);
  ImageFolderOptions options;
  options.split = split;
  options.image_size = image_size;
  options.resize_size = config.resize_size;
  options.crop_min_scale = config.crop_min_scale;
  options.random_flip = transforms.random_flip;
  // uint8 batches are normalised on the device (normalize_on_device with data.mean / data.std).
  options.uint8 = config.uint8 == "on";
  if (!options.uint8) {
    options.mean = transforms.mean;
    options.stddev = transforms.stddev;
  }
  return options;
}

DatasetPtr make_dataset(const DataConfig& config, Split split) {
  if (config.uint8 == "on" && config.kind != "image_folder") {
    throw ConfigError("data.uint8 applies to image_folder only, not to " + config.kind);
  }
  require_paths(config, split);
  if (config.kind == "synthetic") return make_synthetic(config, split);
  if (config.kind == "idx") return make_idx(config, split);
  if (config.kind == "image_folder") return make_image_folder(config, split);
  if (config.kind == "tokens") return make_tokens(config, split);
  if (config.kind == "tsv") return text::make_tsv_dataset(config, split == Split::Train);
  if (config.kind == "custom") {
    throw ConfigError("key 'data.kind': 'custom' names datasets that a program linking train::train passes to "
                      "prepare_run (RunOptions::train_data); the train command has none. Use idx, image_folder, "
                      "tokens, tsv or synthetic");
  }
  throw ConfigError("data.kind: unknown kind '" + config.kind +
                    "' (expected idx | synthetic | image_folder | tokens | tsv)");
}

}  // namespace train::data
