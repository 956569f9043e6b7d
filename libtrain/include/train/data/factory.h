#pragma once
// Builds the dataset described by the `data:` section of the config.
#include <train/data/dataset.h>

#include <string>
#include <vector>

namespace train {
struct DataConfig;
}

namespace train::data {

// Train uses the configured augmentation (random_crop, random_flip; image_folder: a random
// resized crop and random_flip); Val uses none (image_folder: resize and center crop). Both
// normalise by data.mean / data.std when given, except image_folder with data.uint8 on, whose
// uint8 batches the trainer normalises on the device (normalize_on_device). data.uint8 auto reads
// as off here: the run resolves it (resolve_uint8_batches in train/plan.h) before it builds the
// datasets.
enum class Split { Train, Val };

// Image side of synthetic data when data.image_size is 0.
constexpr int64_t kSyntheticDefaultImageSize = 32;
// Synthetic data has as many classes as MNIST-style data, so the same model config fits both.
constexpr int64_t kSyntheticNumClasses = 10;
// Crop side of image_folder data when data.image_size is 0: the ImageNet standard.
constexpr int64_t kImageFolderDefaultImageSize = 224;

// tokens: a TokenDataset (train/data/tokens.h) on data.train_tokens / data.val_tokens, with the
// vocabulary and special ids resolved from the data.*_id keys, then data.vocab_file, then the
// token file's header.
//
// Throws ConfigError for inconsistent settings (unknown kind, missing root, mean/std lengths
// that differ from the image channels, ...) and DataError for unreadable or malformed files
// (image_folder: a missing directory or no images; single images are decoded only in get()).
DatasetPtr make_dataset(const DataConfig& config, Split split);

// data.kind idx: image files (JPEG or PNG) as the unlabelled samples (target -100) of a model
// trained on `config`'s IDX data, for `train predict`: read_images_as_idx (train/data/idx.h) at
// the IDX images' side, then normalised as the validation split. The side is data.image_size when
// set, else the one the validation images' header declares, else (that file is not here) 28, the
// side of MNIST and Fashion-MNIST, with a warning. ConfigError as make_dataset for the transforms;
// DataError naming a file that cannot be read.
DatasetPtr make_idx_image_files(const DataConfig& config, const std::vector<std::string>& paths);

}  // namespace train::data
