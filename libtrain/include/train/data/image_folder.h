#pragma once
// torchvision's ImageFolder layout: JPEG and PNG images in one subdirectory per class,
//
//   <directory>/<class>/<image>.jpg | .jpeg | .png   (extensions in any case)
//
// Classes are the sorted subdirectory names (index = position); images are sorted by name
// within a class, so sample order is the same on every machine. Names starting with '.' are
// skipped (editor, macOS and notebook litter such as "._x.jpg"), and class directories are
// not searched recursively.
//
// Images are decoded in get() and get_batch(), not at construction: JPEGs with libjpeg-turbo
// (at a reduced DCT scale when much larger than needed; a training crop's rows and columns only,
// see decode_jpeg_crop), PNGs with libpng, into buffers each
// loader thread reuses. The crop, resize, flip and normalisation are then one antialiased
// resampling pass from the decoded pixels straight into the sample (or into its slot of the
// batch). A file whose content is neither, or that is corrupt or truncated, is a DataError
// naming it.
#include <train/data/dataset.h>
#include <train/data/factory.h>
#include <train/data/transforms.h>

#include <cstdint>
#include <string>
#include <vector>

namespace train::data {

// Sorted names of the class subdirectories of an ImageFolder split directory. DataError naming
// the directory when it does not exist.
std::vector<std::string> find_image_classes(const std::string& directory);

// The JPEG decoding scale 1/denominator (denominator 1, 2, 4 or 8): the smallest whose decoded
// image, ceil(width / d) x ceil(height / d), still has a shorter side of at least `needed`.
// `needed` <= 0 means full size.
int choose_jpeg_scale(int64_t width, int64_t height, int64_t needed);

// A crop `box` of a width x height image, in that image decoded at scale 1/denominator
// (ceil(width / d) x ceil(height / d)): pixel i there covers pixels [d i, d i + d) here, so each
// edge is divided by d and rounded to the nearest pixel edge, keeping at least one pixel.
CropBox scale_crop_box(const CropBox& box, int64_t width, int64_t height, int denominator);

// The JPEG decoding scale 1/denominator (1, 2, 4 or 8) for a crop `box` of a width x height
// image that is then resized to needed x needed: the smallest whose scale_crop_box is still at
// least `needed` pixels high and wide, so that the crop is only enlarged when the full-size crop
// itself is smaller than the output. `needed` <= 0 means full size.
int choose_jpeg_crop_scale(const CropBox& box, int64_t width, int64_t height, int64_t needed);

// The validation resize of a width x height image that was decoded at scale 1/denominator (as
// choose_jpeg_scale picks; 1 for full size): torchvision's Resize(size) of the full-size image,
// out_height x out_width with the shorter side `size` and the longer int(size * longer / shorter),
// whatever the decoded size, and `source`, the part of the decoded image that covers the full one
// (scale_crop_box of the whole image: its last row or column, which covers only a part of a DCT
// block, may fall outside). E.g. 2049x1024 at 1/4 (513x256 decoded), size 256: 512x256 from the
// decoded 512x256 at (0, 0). std::invalid_argument for an empty image or size.
struct ResizeGeometry {
  CropBox source;
  int64_t out_height = 0, out_width = 0;
  int64_t image_height = 0, image_width = 0;  // the full-size image
};
ResizeGeometry validation_resize(int64_t width, int64_t height, int denominator, int64_t size);

// Decodes a JPEG or PNG file, recognised by its first bytes, into RGB: uint8 [3, H, W], a
// channels-first view of the decoder's interleaved pixels, with the values of PIL's
// Image.open(path).convert("RGB"), which torchvision's ImageFolder loads:
//   - grayscale and palette images are expanded to RGB, and a PNG's alpha channel (or tRNS
//     transparency) is dropped, not blended;
//   - 16-bit PNG samples keep their high byte (v >> 8). PIL clips 16-bit grayscale to 255
//     instead, which makes most such images white; here it is the high byte too;
//   - no gamma or colour-profile conversion: a PNG's gAMA, cHRM, sRGB or iCCP chunk is ignored;
//   - CMYK JPEGs are converted with the Adobe (inverted) convention;
//   - libjpeg's harmless warnings (stray bytes before a marker, an unknown JFIF version) are
//     ignored, as PIL ignores them; every other warning is an error.
// A JPEG is decoded at the scale choose_jpeg_scale(width, height, needed) picks. DataError
// naming the file when it cannot be read or decoded.
torch::Tensor decode_image(const std::string& path, int64_t needed = 0);

// `box` of the JPEG at `path` decoded at scale 1/denominator (1, 2, 4 or 8), decoded as training
// crops are: the rows down to the box's last (the ones above it entropy-decoded only) and the
// columns within an iMCU (8 to 16 pixels) of it. The rows below are not decoded: a file cut short
// is still an error (its end marker is missing), but damaged data below the box is not seen
// (ImageFolderDataset::get_checked, which `train check --data` uses, decodes the whole file). The
// pixels are decode_image's at that scale, bit for bit, and 1.3x faster to get for torchvision's
// RandomResizedCrop boxes. uint8 [3, box.height, box.width]; DataError as decode_image;
// std::invalid_argument for a box outside the scaled image.
torch::Tensor decode_jpeg_crop(const std::string& path, int denominator, const CropBox& box);

struct ImageFolderOptions {
  std::string directory;             // the split directory, e.g. <root>/train
  // Class names, index = position. Empty = the subdirectories of `directory`; a validation
  // split passes the training split's list, so that labels agree.
  std::vector<std::string> classes;
  Split split = Split::Train;
  int64_t image_size = 224;          // output H = W
  // Val: the shorter side is resized to this before the center crop; 0 = round(image_size / 0.875),
  // the ImageNet convention (256 for 224).
  int64_t resize_size = 0;
  double crop_min_scale = 0.08;      // Train: smallest area fraction of the random resized crop
  bool random_flip = false;          // Train: horizontal flip with p = 0.5
  std::vector<double> mean;          // per RGB channel, for inputs in [0, 1]; empty = none
  std::vector<double> stddev;        // same length as mean
  // Deliver uint8 [3, S, S] inputs (rounded after resizing) instead of floats, without
  // normalisation; normalize_on_device() then does that on the device. mean / stddev must be
  // empty.
  bool uint8 = false;
  // Instead of listing `directory`'s class subdirectories: these image files, in this order, as
  // unlabelled samples (target -100, "no target"), transformed as `split` says. The inputs a
  // trained model predicts on (README, "Using a trained model"). A relative path is taken within
  // `directory` (empty: as given). `classes` then names the model's outputs (num_classes,
  // class_names) and may be empty.
  std::vector<std::string> files;
};

// The options make_dataset gives data.kind image_folder's `split` for `config` (its image and
// resize sizes, crop scale, flip, normalisation or uint8), with `classes` left empty (make_dataset
// reads them from the training directory). ConfigError for settings make_dataset refuses.
ImageFolderOptions image_folder_options(const DataConfig& config, Split split);

// get() returns a float [3, S, S] input in [0, 1] (normalised when mean / std are given), or
// uint8 [3, S, S] in [0, 255] with options.uint8, and a 0-d int64 class index.
//   Train: torchvision's RandomResizedCrop(S, scale = (crop_min_scale, 1), ratio = (3/4, 4/3)),
//          then a horizontal flip with p = 0.5 when random_flip; all drawn from the sample seed.
//          The crop box is drawn on the full-size image, as torchvision draws it.
//   Val:   Resize(resize_size) of the shorter side, then CenterCrop(S), sized from the full-size
//          image, as torchvision sizes it (validation_resize).
// Resizing is bilinear with antialiasing, as in torchvision, and the result is rounded to 8 bits
// as torchvision's PIL and uint8 pipelines round it; a float input is that uint8 image scaled and
// normalised with the float numbers normalize_on_device uses, so a run with float inputs (the CPU)
// and one with uint8 inputs normalised on the device (a GPU) see the same values. JPEGs are decoded at the smallest
// DCT scale at which what is resized still covers the output (Train: the crop box, mapped by
// scale_crop_box, at least S x S; Val: a shorter side of at least resize_size), so a large photo
// decodes several times faster, and a crop is only enlarged when torchvision enlarges it too.
// The result differs from resizing the full-size decode by the DCT scaling's own filtering and
// by the crop's edges moving to whole pixels of the reduced image.
class ImageFolderDataset : public Dataset {
 public:
  // Lists the images (no decoding). DataError naming the directory when it is missing, holds
  // no image, or holds a class directory that is not in options.classes. A training split's class
  // directory without images is still a class (the labels follow the sorted directory names),
  // with a warning. With options.files: those files, each of which must exist (DataError naming it).
  explicit ImageFolderDataset(ImageFolderOptions options);

  int64_t size() const override { return static_cast<int64_t>(samples_.size()); }
  Example get(int64_t index, uint64_t seed) const override;
  // get() from a decode of the whole file (a training crop's pixels are the same).
  Example get_checked(int64_t index, uint64_t seed) const override;
  // Decodes and transforms each image straight into one batch tensor (the same values as
  // collating get()).
  std::optional<Batch> get_batch(const std::vector<int64_t>& indices,
                                 const std::vector<uint64_t>& seeds, bool pinned) const override;
  std::vector<int64_t> input_shape() const override;
  int64_t num_classes() const override { return static_cast<int64_t>(options_.classes.size()); }
  std::string describe() const override;

  const std::vector<std::string>& classes() const { return options_.classes; }
  std::vector<std::string> class_names() const override { return options_.classes; }
  uint64_t fingerprint() const override { return fingerprint_; }  // of the classes and the files' names
  // The image file of sample `index` and its class index (-100 for options.files).
  std::string path(int64_t index) const;
  int64_t label(int64_t index) const;

 private:
  struct Sample {
    std::string file;  // relative to options_.directory: "<class>/<name>"
    int64_t label;
  };
  const Sample& sample(int64_t index) const;
  // Decodes sample `index` and writes its transformed input (float or uint8 [3, S, S]) to output.
  // `whole_file`: a training crop from a decode of the whole JPEG (get_checked).
  void transform_into(int64_t index, uint64_t seed, void* output, bool whole_file = false) const;

  ImageFolderOptions options_;
  std::vector<Sample> samples_;
  uint64_t fingerprint_ = 0;
  // A float input is level * scale_[c] - shift_[c] (resample_to_float).
  float scale_[3] = {0.0f, 0.0f, 0.0f};
  float shift_[3] = {0.0f, 0.0f, 0.0f};
  BatchMemory batch_memory_;
};

}  // namespace train::data
