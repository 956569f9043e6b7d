// IDX reader (MNIST / Fashion-MNIST) and IdxDataset.
#include <train/data/idx.h>
#include <train/data/image_folder.h>
#include <train/errors.h>
#include <train/files.h>

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <iomanip>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace train::data {

namespace {

constexpr uint8_t kUnsignedByteType = 0x08;

std::string hex32(uint32_t value) {
  std::ostringstream out;
  out << "0x" << std::hex << std::setw(8) << std::setfill('0') << value;
  return out.str();
}

uint32_t read_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string join_dims(const std::vector<int64_t>& dims) {
  std::string out;
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? "x" : "") + std::to_string(dims[i]);
  return out;
}

// Deflate inflates at most 1032:1; a gzip file cannot hold more than this many bytes.
constexpr uint64_t kMaxDeflateRatio = 1032;

struct IdxContents {
  std::vector<int64_t> dims;
  std::vector<uint8_t> payload;
};

// Reads an unsigned-byte IDX file of the given rank through zlib, which inflates gzip files and
// passes any other file through unchanged, so plain and .gz files share one code path. The
// stream is read in order: the magic number after its 4 bytes, then the dimensions, then exactly
// the payload they declare (and one byte more, to find trailing data). A file with a wrong magic
// number is rejected without inflating the rest, a header that declares more than the file can
// hold before anything is allocated, and the payload buffer grows only as data arrives.
IdxContents read_idx(const std::string& path, uint8_t rank, bool header_only = false) {
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    throw DataError(path + ": " + problem + ", expected an IDX file");
  }
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw DataError(path + ": cannot open: " + std::strerror(errno));
  }
  const std::unique_ptr<gzFile_s, int (*)(gzFile)> closer(file, &gzclose);
  gzbuffer(file, 1 << 17);

  // Reads up to n bytes to out; fewer only at the end of the stream.
  auto read = [&](uint8_t* out, size_t n) {
    size_t done = 0;
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, size_t{1} << 24));
      const int got = gzread(file, out + done, chunk);
      if (got < 0) {
        int code = Z_OK;
        throw DataError(path + ": cannot read: " + gzerror(file, &code));
      }
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  };
  // A cut-off gzip stream is not an error for gzread (it returns what it could inflate) but
  // leaves Z_BUF_ERROR behind.
  auto stream_error = [&]() -> std::string {
    int code = Z_OK;
    const char* message = gzerror(file, &code);
    return code == Z_OK ? std::string() : std::string(message);
  };
  auto found = [&](uint64_t bytes) {
    const std::string error = stream_error();
    return std::to_string(bytes) + " bytes" +
           (error.empty() ? std::string() : " (gzip stream ended early: " + error + ")");
  };

  const size_t header_size = 4 + 4 * size_t{rank};
  const uint32_t expected_magic = (uint32_t{kUnsignedByteType} << 8) | rank;
  const char* kind = rank == 3 ? "idx3-ubyte images" : "idx1-ubyte labels";
  std::array<uint8_t, 4 + 4 * 3> header{};
  const size_t got_magic = read(header.data(), 4);
  if (got_magic < 4) {
    throw DataError(path + ": truncated: expected an IDX header of " + std::to_string(header_size) +
                    " bytes, found " + found(got_magic));
  }
  const uint32_t magic = read_be32(header.data());
  if (magic != expected_magic) {
    throw DataError(path + ": bad magic number " + hex32(magic) + ", expected " + hex32(expected_magic) + " (" +
                    kind + ")");
  }
  const size_t got_dims = read(header.data() + 4, header_size - 4);
  if (got_dims < header_size - 4) {
    throw DataError(path + ": truncated: expected an IDX header of " + std::to_string(header_size) +
                    " bytes, found " + found(4 + got_dims));
  }

  IdxContents contents;
  uint64_t payload = 1;
  for (size_t i = 0; i < rank; ++i) {
    const uint32_t dim = read_be32(header.data() + 4 + 4 * i);
    if (dim == 0) throw DataError(path + ": dimension " + std::to_string(i) + " is 0");
    if (payload > std::numeric_limits<uint64_t>::max() / dim) {
      throw DataError(path + ": dimensions too large for any file");
    }
    payload *= dim;
    contents.dims.push_back(dim);
  }
  if (header_only) return contents;
  const uint64_t expected = header_size + payload;
  const std::string declares = "header declares " + join_dims(contents.dims) + " so expected " +
                               std::to_string(expected) + " bytes";
  // What the file can hold at most: its size when read directly, 1032 x that when inflated.
  const int64_t on_disk = files::file_size(path);
  if (on_disk >= 0) {
    const bool direct = gzdirect(file) != 0;
    const uint64_t most = direct ? static_cast<uint64_t>(on_disk) : static_cast<uint64_t>(on_disk) * kMaxDeflateRatio;
    if (expected > most) {
      throw DataError(path + ": truncated: " + declares + ", " +
                      (direct ? "found " + std::to_string(on_disk) + " bytes"
                              : "but a gzip file of " + std::to_string(on_disk) + " bytes inflates to at most " +
                                    std::to_string(most)));
    }
  }

  constexpr size_t kChunk = size_t{1} << 20;
  while (contents.payload.size() < payload) {
    const size_t filled = contents.payload.size();
    const size_t want = static_cast<size_t>(std::min<uint64_t>(kChunk, payload - filled));
    contents.payload.resize(filled + want);
    const size_t got = read(contents.payload.data() + filled, want);
    contents.payload.resize(filled + got);
    if (got < want) {
      throw DataError(path + ": truncated: " + declares + ", found " + found(header_size + filled + got));
    }
  }
  uint8_t extra = 0;
  if (read(&extra, 1) != 0) {
    throw DataError(path + ": trailing data: " + declares + ", found more");
  }
  // Complete payload yet a damaged stream (e.g. a cut-off gzip trailer): still not trustworthy.
  if (const std::string error = stream_error(); !error.empty()) {
    throw DataError(path + ": corrupt gzip stream: " + error);
  }
  return contents;
}

}  // namespace

std::string find_data_file(const std::string& dir, const std::string& stem) {
  // POSIX stat rather than std::filesystem (train/files.h says why).
  auto is_regular_file = [](const std::string& path) {
    struct stat info {};
    return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
  };
  const std::string plain = files::join(dir, stem);  // an absolute stem stands alone
  if (is_regular_file(plain)) return plain;
  const std::string gzipped = plain + ".gz";
  if (is_regular_file(gzipped)) return gzipped;
  for (const std::string& path : {plain, gzipped}) {
    if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
      throw DataError(path + ": " + problem + ", expected an IDX file");
    }
  }
  throw DataError("data file not found: neither " + plain + " nor " + gzipped + " exists");
}

torch::Tensor read_idx_images(const std::string& path) {
  const IdxContents file = read_idx(path, 3);
  const std::vector<int64_t>& dims = file.dims;
  torch::Tensor images = torch::empty({dims[0], 1, dims[1], dims[2]}, torch::kByte);
  std::memcpy(images.data_ptr<uint8_t>(), file.payload.data(), images.numel());
  return images;
}

std::vector<int64_t> read_idx_image_dims(const std::string& path) { return read_idx(path, 3, true).dims; }

torch::Tensor read_images_as_idx(const std::vector<std::string>& paths, int64_t side) {
  // image_folder's validation transform, to uint8 RGB at side x side; then PIL's "L" conversion,
  // ITU-R 601-2 luma in 16-bit fixed point: (19595 R + 38470 G + 7471 B + 2^15) >> 16, whose
  // weights sum to 2^16, so that R = G = B = v gives v.
  ImageFolderOptions options;
  options.files = paths;
  options.split = Split::Val;
  options.image_size = side;
  options.resize_size = side;
  options.uint8 = true;
  const ImageFolderDataset files(options);
  torch::Tensor images = torch::empty({files.size(), 1, side, side}, torch::kByte);
  for (int64_t i = 0; i < files.size(); ++i) {
    const torch::Tensor rgb = files.get(i, 0).input.contiguous();  // uint8 [3, side, side]
    const uint8_t* r = rgb.data_ptr<uint8_t>();
    const uint8_t* g = r + side * side;
    const uint8_t* b = g + side * side;
    uint8_t* out = images[i].data_ptr<uint8_t>();
    for (int64_t p = 0; p < side * side; ++p) {
      out[p] = static_cast<uint8_t>((19595u * r[p] + 38470u * g[p] + 7471u * b[p] + 0x8000u) >> 16);
    }
  }
  return images;
}

torch::Tensor read_idx_labels(const std::string& path, int64_t num_classes) {
  const IdxContents file = read_idx(path, 1);
  const std::vector<int64_t>& dims = file.dims;
  torch::Tensor labels = torch::empty({dims[0]}, torch::kLong);
  int64_t* out = labels.data_ptr<int64_t>();
  const uint8_t* in = file.payload.data();
  for (int64_t i = 0; i < dims[0]; ++i) {
    if (in[i] >= num_classes) {
      throw DataError(path + ": label " + std::to_string(in[i]) + " at index " + std::to_string(i) +
                      " is out of range (expected < " + std::to_string(num_classes) + ")");
    }
    out[i] = in[i];
  }
  return labels;
}

IdxDataset::IdxDataset(const std::string& images_file, const std::string& labels_file,
                       ImageTransforms transforms)
    : images_file_(images_file),
      images_(read_idx_images(images_file)),
      labels_(read_idx_labels(labels_file)),
      transforms_(std::move(transforms)) {
  if (images_.size(0) != labels_.size(0)) {
    throw DataError(labels_file + ": holds " + std::to_string(labels_.size(0)) + " labels but " +
                    images_file + " holds " + std::to_string(images_.size(0)) + " images");
  }
  prepare_tables();
}

IdxDataset::IdxDataset(torch::Tensor images, torch::Tensor labels, ImageTransforms transforms, std::string source)
    : images_file_(std::move(source)),
      images_(std::move(images)),
      labels_(std::move(labels)),
      transforms_(std::move(transforms)) {
  if (images_.scalar_type() != torch::kByte || images_.dim() != 4 || images_.size(1) != 1 ||
      labels_.scalar_type() != torch::kLong || labels_.dim() != 1 || labels_.size(0) != images_.size(0)) {
    throw std::invalid_argument(images_file_ + ": IdxDataset takes uint8 images [N, 1, H, W] and int64 labels [N], got " +
                                join_dims(images_.sizes().vec()) + " and " + join_dims(labels_.sizes().vec()));
  }
  images_ = images_.contiguous();
  labels_ = labels_.contiguous();
  prepare_tables();
}

void IdxDataset::prepare_tables() {
  Fingerprint print;
  for (const int64_t d : images_.sizes()) print.add(d);
  print.add(images_.data_ptr<uint8_t>(), static_cast<size_t>(images_.numel()));
  print.add(labels_.data_ptr<int64_t>(), static_cast<size_t>(labels_.numel()) * sizeof(int64_t));
  fingerprint_ = print.value();
  // Every byte value through the tensor ops that define a sample: x / 255, then, when the
  // transforms are a normalisation alone (no crop, whose zero padding comes before it, no flip),
  // normalize(). get() looks pixels up here.
  const torch::Tensor bytes = torch::arange(256, torch::kFloat).div_(255.0);
  std::memcpy(scaled_.data(), bytes.data_ptr<float>(), sizeof(float) * 256);
  normalize_only_ = transforms_.mean.size() == 1 && transforms_.stddev.size() == 1 &&
                    !(transforms_.random_crop && transforms_.crop_padding > 0) && !transforms_.random_flip;
  if (normalize_only_) {
    const torch::Tensor normalized = normalize(bytes.view({1, 1, 256}), transforms_.mean, transforms_.stddev);
    std::memcpy(normalized_.data(), normalized.contiguous().data_ptr<float>(), sizeof(float) * 256);
  }
}

Example IdxDataset::get(int64_t index, uint64_t seed) const {
  if (index < 0 || index >= size()) {
    throw std::out_of_range(images_file_ + ": index " + std::to_string(index) +
                            " out of range [0, " + std::to_string(size()) + ")");
  }
  // One table lookup per pixel instead of a chain of tensor ops: at batch 32 the ~10 small ops
  // per sample (select, cast, divide, and normalize's mean/std tensors, subtract, divide) cost the
  // loader ~15% of an MLP's training step (benchmarks/README.md). The table holds the ops' own
  // results for each byte value, so the values are identical.
  const int64_t pixels = images_.size(1) * images_.size(2) * images_.size(3);
  torch::Tensor image = torch::empty({images_.size(1), images_.size(2), images_.size(3)}, torch::kFloat);
  const uint8_t* in = images_.data_ptr<uint8_t>() + index * pixels;
  float* out = image.data_ptr<float>();
  const std::array<float, 256>& table = normalize_only_ ? normalized_ : scaled_;
  for (int64_t i = 0; i < pixels; ++i) out[i] = table[in[i]];
  torch::Tensor target = torch::scalar_tensor(labels_.data_ptr<int64_t>()[index], torch::kLong);
  if (normalize_only_) return Example{std::move(image), std::move(target)};
  return Example{transforms_.apply(image, seed), std::move(target)};
}

std::optional<Batch> IdxDataset::get_batch(const std::vector<int64_t>& indices, const std::vector<uint64_t>& seeds,
                                           bool pinned) const {
  // With a crop or a flip each sample goes through tensor ops anyway: the per-sample path.
  if (!normalize_only_ || indices.empty() || seeds.size() != indices.size()) return std::nullopt;
  const auto n = static_cast<int64_t>(indices.size());
  const int64_t pixels = images_.size(1) * images_.size(2) * images_.size(3);
  torch::Tensor input = torch::empty({n, images_.size(1), images_.size(2), images_.size(3)},
                                     torch::TensorOptions(torch::kFloat).pinned_memory(pinned));
  torch::Tensor target = torch::empty({n}, torch::TensorOptions(torch::kLong).pinned_memory(pinned));
  float* out = input.data_ptr<float>();
  int64_t* labels_out = target.data_ptr<int64_t>();
  const uint8_t* images = images_.data_ptr<uint8_t>();
  const int64_t* labels = labels_.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t index = indices[static_cast<size_t>(i)];
    if (index < 0 || index >= size()) return std::nullopt;  // get() names it
    const uint8_t* in = images + index * pixels;
    for (int64_t p = 0; p < pixels; ++p) out[p] = normalized_[in[p]];
    out += pixels;
    labels_out[i] = labels[index];
  }
  return Batch{std::move(input), std::move(target)};
}

std::vector<int64_t> IdxDataset::input_shape() const {
  return {images_.size(1), images_.size(2), images_.size(3)};
}

std::string IdxDataset::describe() const {
  return "idx: " + images_file_ + ": " + std::to_string(size()) + " images " +
         join_dims(input_shape()) + ", " + std::to_string(kIdxNumClasses) +
         " classes, transforms: " + transforms_.describe();
}

}  // namespace train::data
