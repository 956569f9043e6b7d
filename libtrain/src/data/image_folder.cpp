// ImageFolder listing, JPEG / PNG decoding and ImageFolderDataset.
#include <train/data/image_folder.h>
#include <train/data/tokens.h>  // kIgnoreIndex
#include <train/data/transforms.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/log.h>

#include "resample.h"

#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <jpeglib.h>  // after <cstdio>: it uses FILE

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

// Drops from the header of a JPEG (its markers up to the first scan) the bytes that libjpeg
// skips with "Corrupt JPEG data: N extraneous bytes before marker", and makes an unknown JFIF
// major version 1 ("Warning: unknown JFIF revision"), in place. Both warnings are harmless, but
// TurboJPEG 2.1 reports only the first warning of an image, so one left in the header would hide
// a later one that means damage ("Premature end of JPEG file"). False when the markers cannot be
// followed to the first scan.
bool clean_jpeg_header(std::vector<uint8_t>& bytes) {
  const size_t size = bytes.size();
  size_t in = 2;  // after the SOI marker
  size_t out = 2;
  for (;;) {
    // libjpeg's next_marker(): bytes other than FF, and FF 00 pairs, are skipped ("extraneous");
    // FF fill bytes before a marker code are allowed.
    uint8_t code = 0;
    while (code == 0) {
      while (in < size && bytes[in] != 0xFF) ++in;
      while (in < size && bytes[in] == 0xFF) ++in;
      if (in >= size) return false;
      code = bytes[in++];
    }
    bytes[out++] = 0xFF;
    bytes[out++] = code;
    if (code == 0xDA || code == 0xD9) break;  // SOS (or EOI): the rest is copied as it is
    if (code == 0x01 || (code >= 0xD0 && code <= 0xD8)) continue;  // TEM, RSTn, SOI: no length
    if (in + 2 > size) return false;
    const size_t length = size_t{bytes[in]} << 8 | bytes[in + 1];  // includes its own 2 bytes
    if (length < 2 || in + length > size) return false;
    std::memmove(bytes.data() + out, bytes.data() + in, length);
    // APP0 "JFIF\0" with the major version at offset 7 of the segment (libjpeg reads it from 14
    // data bytes on).
    if (code == 0xE0 && length >= 16 && std::memcmp(bytes.data() + out + 2, "JFIF", 5) == 0) {
      bytes[out + 7] = 1;
    }
    in += length;
    out += length;
  }
  std::memmove(bytes.data() + out, bytes.data() + in, size - in);
  bytes.resize(out + (size - in));
  return true;
}

struct JpegHeader {
  int width = 0;
  int height = 0;
  int colorspace = 0;
};

// Reads the header of the JPEG in `bytes`. A harmless warning there (TurboJPEG 2.1 fails the call
// for a warning too, with the size filled in) is cleaned out of `bytes` by clean_jpeg_header and
// the header read again, so that a warning when decoding is about the rest of the file.
JpegHeader read_jpeg_header(const std::string& path, std::vector<uint8_t>& bytes) {
  ThreadDecompressor& decompressor = thread_decompressor();
  JpegHeader header;
  int subsampling = 0;
  const auto read = [&] {
    return tjDecompressHeader3(decompressor.get(), bytes.data(), bytes.size(), &header.width,
                               &header.height, &subsampling, &header.colorspace) == 0;
  };
  if (!read()) {
    const std::string message = tjGetErrorStr2(decompressor.handle);
    const bool warning = tjGetErrorCode(decompressor.handle) == TJERR_WARNING;
    decompressor.reset();
    if (!warning || !is_harmless_jpeg_warning(message) || !clean_jpeg_header(bytes) || !read()) {
      decompressor.reset();
      throw DataError(path + ": corrupt JPEG header: " + message);
    }
  }
  // Data that ends before the frame header "succeeds" without a size.
  if (header.width <= 0 || header.height <= 0) {
    decompressor.reset();
    throw DataError(path + ": truncated JPEG header (it ends before the image size)");
  }
  check_image_size(path, header.width, header.height, "JPEG");
  return header;
}

// Decodes the JPEG whose header read_jpeg_header returned, at scale 1 / denominator
// (TJSCALED(width) x TJSCALED(height) pixels).
Pixels decode_jpeg(const std::string& path, const std::vector<uint8_t>& bytes,
                   const JpegHeader& header, int denominator, std::vector<uint8_t>& buffer) {
  ThreadDecompressor& decompressor = thread_decompressor();
  const tjscalingfactor scale{1, denominator};
  const int scaled_width = TJSCALED(header.width, scale);
  const int scaled_height = TJSCALED(header.height, scale);
  // TurboJPEG 2.1 cannot convert CMYK / YCCK to RGB itself.
  const bool cmyk = header.colorspace == TJCS_CMYK || header.colorspace == TJCS_YCCK;
  const int channels = cmyk ? 4 : 3;
  buffer.resize(static_cast<size_t>(scaled_width) * static_cast<size_t>(scaled_height) *
                static_cast<size_t>(channels));
  // Asking for the scaled size makes TurboJPEG decode at that DCT scale.
  if (tjDecompress2(decompressor.get(), bytes.data(), bytes.size(), buffer.data(), scaled_width,
                    0, scaled_height, cmyk ? TJPF_CMYK : TJPF_RGB, 0) != 0) {
    const std::string message = tjGetErrorStr2(decompressor.handle);
    decompressor.reset();
    if (!is_harmless_jpeg_warning(message)) {
      throw DataError(path + ": corrupt or truncated JPEG: " + message);
    }
  }
  if (cmyk) cmyk_to_rgb(buffer.data(), int64_t{scaled_width} * scaled_height);
  return Pixels{buffer.data(), scaled_height, scaled_width, int64_t{scaled_width} * channels,
                channels};
}

// libjpeg's error handling for one decode. libjpeg's own error_exit ends the process; this one
// keeps the message and longjmps back to jpeg_decode_rows, whose frame (like libjpeg's) holds no
// object with a destructor. Of the warnings, the first that is not harmless is kept: reading
// through the rows after a crop, libjpeg skips their data as "extraneous bytes" before it finds
// that the file ends early.
struct JpegErrors {
  jpeg_error_mgr manager;  // first: libjpeg hands callbacks &manager as cinfo->err
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  char warning[JMSG_LENGTH_MAX];
};

void jpeg_on_error(j_common_ptr info) {
  auto* errors = reinterpret_cast<JpegErrors*>(info->err);
  (*info->err->format_message)(info, errors->message);
  std::longjmp(errors->jump, 1);
}

void jpeg_on_message(j_common_ptr info, int level) {
  auto* errors = reinterpret_cast<JpegErrors*>(info->err);
  if (level >= 0 || errors->warning[0] != '\0') return;  // a trace message, or one kept already
  char text[JMSG_LENGTH_MAX];
  (*info->err->format_message)(info, text);
  if (!is_harmless_jpeg_warning(text)) std::memcpy(errors->warning, text, sizeof(text));
}

// What jpeg_decode_rows is asked for and what it decoded.
struct JpegRows {
  int denominator = 1;
  bool cmyk = false;
  // Rows [top, top + rows) and at least columns [left, left + columns) of the image decoded at
  // 1 / denominator ...
  int64_t top = 0, rows = 0, left = 0, columns = 0;
  uint8_t* out = nullptr;  // room for rows x the decoded width x 3 (4 for CMYK) bytes
  // ... of which columns [first_column, first_column + width) were written, row after row.
  JDIMENSION first_column = 0, width = 0;
};

// Decodes the rows and columns `job` asks for with libjpeg-turbo's partial decoding: the rows
// above are skipped (their entropy-coded data is still decoded, so damage there is found) and the
// columns outside cropped; the rows below are not decoded at all, so damaged data down there is
// not found (decode_jpeg_box finds a file cut short by its missing end marker, and get_checked
// decodes the whole file for `train check --data`). The
// crop is widened by one iMCU each side, because the outermost decoded columns are upsampled as if
// they were the image's edge; within the asked-for columns the pixels are those of a full decode,
// bit for bit. False on a libjpeg error (the message in `errors`).
bool jpeg_decode_rows(jpeg_decompress_struct& info, JpegErrors& errors, const uint8_t* data, size_t size,
                      JpegRows& job) {
  if (setjmp(errors.jump) != 0) return false;
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, data, static_cast<unsigned long>(size));
  jpeg_read_header(&info, TRUE);
  info.scale_num = 1;
  info.scale_denom = static_cast<unsigned int>(job.denominator);
  info.out_color_space = job.cmyk ? JCS_CMYK : JCS_RGB;
  jpeg_start_decompress(&info);
#if JPEG_LIB_VERSION >= 70
  const int64_t margin = int64_t{info.max_h_samp_factor} * info.min_DCT_h_scaled_size;
#else
  const int64_t margin = int64_t{info.max_h_samp_factor} * info.min_DCT_scaled_size;
#endif
  const int64_t begin = std::max<int64_t>(job.left - margin, 0);
  const int64_t end = std::min<int64_t>(job.left + job.columns + margin, info.output_width);
  job.first_column = static_cast<JDIMENSION>(begin);
  job.width = static_cast<JDIMENSION>(end - begin);
  jpeg_crop_scanline(&info, &job.first_column, &job.width);  // moves the start to an iMCU edge
  const size_t stride = size_t{job.width} * static_cast<size_t>(info.output_components);
  if (job.top > 0) jpeg_skip_scanlines(&info, static_cast<JDIMENSION>(job.top));
  while (info.output_scanline < job.top + job.rows) {
    JSAMPROW row = job.out + (info.output_scanline - job.top) * stride;
    jpeg_read_scanlines(&info, &row, 1);
  }
  jpeg_abort_decompress(&info);  // the rows below are not needed
  return true;
}

// Whether the JPEG in `bytes` has its end marker (FF D9) after the start of its first scan: a file
// cut short (an interrupted copy or download) has none. Inside entropy-coded data an FF byte is
// always followed by 00 or a restart marker, so FF D9 there is the end marker.
bool has_end_marker(const std::vector<uint8_t>& bytes) {
  const uint8_t start_of_scan[2] = {0xFF, 0xDA};
  const uint8_t end_of_image[2] = {0xFF, 0xD9};
  const auto scan = std::search(bytes.begin(), bytes.end(), start_of_scan, start_of_scan + 2);
  return scan != bytes.end() && std::search(scan, bytes.end(), end_of_image, end_of_image + 2) != bytes.end();
}

// Decodes `box` (in the image decoded at 1 / denominator: TJSCALED(width) x TJSCALED(height)) of
// the JPEG whose header read_jpeg_header returned, and the columns around it up to the next
// iMCU edges; sets `box` to where it lies in the pixels returned. Errors and warnings are treated
// as decode_jpeg treats them.
Pixels decode_jpeg_box(const std::string& path, const std::vector<uint8_t>& bytes, const JpegHeader& header,
                       int denominator, CropBox& box, std::vector<uint8_t>& buffer) {
  const tjscalingfactor scale{1, denominator};
  const int scaled_width = TJSCALED(header.width, scale);
  const bool cmyk = header.colorspace == TJCS_CMYK || header.colorspace == TJCS_YCCK;
  const int channels = cmyk ? 4 : 3;
  buffer.resize(static_cast<size_t>(box.height) * static_cast<size_t>(scaled_width) * static_cast<size_t>(channels));
  JpegRows job;
  job.denominator = denominator;
  job.cmyk = cmyk;
  job.top = box.top;
  job.rows = box.height;
  job.left = box.left;
  job.columns = box.width;
  job.out = buffer.data();
  jpeg_decompress_struct info{};  // zeroed: jpeg_destroy_decompress is safe even if create failed
  JpegErrors errors{};
  info.err = jpeg_std_error(&errors.manager);
  errors.manager.error_exit = &jpeg_on_error;
  errors.manager.emit_message = &jpeg_on_message;
  errors.message[0] = '\0';
  errors.warning[0] = '\0';
  const bool decoded = jpeg_decode_rows(info, errors, bytes.data(), bytes.size(), job);
  jpeg_destroy_decompress(&info);
  if (!decoded) throw DataError(path + ": corrupt or truncated JPEG: " + errors.message);
  if (errors.warning[0] != '\0') throw DataError(path + ": corrupt or truncated JPEG: " + errors.warning);
  // The rows below the box were not decoded, so libjpeg did not reach the end of the data: a
  // file cut short is found by its missing end marker, with libjpeg's words for it.
  if (!has_end_marker(bytes)) throw DataError(path + ": corrupt or truncated JPEG: Premature end of JPEG file");
  if (cmyk) cmyk_to_rgb(buffer.data(), box.height * int64_t{job.width});
  box.top = 0;
  box.left -= job.first_column;
  return Pixels{buffer.data(), box.height, int64_t{job.width}, int64_t{job.width} * channels, channels};
}

// libpng's read state for one PNG in memory. libpng reports an error by longjmp to the last
// setjmp, so the functions that call it (png_start, png_read_rows) hold no object with a
// destructor; this one is owned by their caller.
struct PngReader {
  png_structp png = nullptr;
  png_infop info = nullptr;
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t offset = 0;
  int passes = 1;
  char message[128] = "";
  PngReader(const uint8_t* bytes, size_t count) : data(bytes), size(count) {}
  ~PngReader() { png_destroy_read_struct(&png, &info, nullptr); }
  PngReader(const PngReader&) = delete;
  PngReader& operator=(const PngReader&) = delete;
};

void png_on_error(png_structp png, png_const_charp message) {
  auto* reader = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(reader->message, sizeof(reader->message), "%s", message);
  png_longjmp(png, 1);
}

void png_on_warning(png_structp, png_const_charp) {}  // e.g. a damaged ancillary chunk, ignored

void png_read_memory(png_structp png, png_bytep out, size_t count) {
  auto* reader = static_cast<PngReader*>(png_get_io_ptr(png));
  if (count > reader->size - reader->offset) png_error(png, "the file ends before the image does");
  std::memcpy(out, reader->data + reader->offset, count);
  reader->offset += count;
}

// Reads the header and sets up the conversion to 8-bit RGB that PIL's convert("RGB") makes:
// 16-bit samples keep their high byte, palettes and 1, 2 or 4-bit gray are expanded, gray is
// repeated into R, G and B, and alpha (or tRNS) is dropped, not blended. No gamma or colour
// conversion: a gAMA, sRGB or iCCP chunk does not change the values. False on an error.
bool png_start(PngReader& reader) {
  if (setjmp(png_jmpbuf(reader.png))) return false;
  png_set_read_fn(reader.png, &reader, &png_read_memory);
  png_read_info(reader.png, reader.info);
  const png_byte colour = png_get_color_type(reader.png, reader.info);
  if (png_get_bit_depth(reader.png, reader.info) == 16) png_set_strip_16(reader.png);
  if (colour == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(reader.png);
  if (colour == PNG_COLOR_TYPE_GRAY) png_set_expand_gray_1_2_4_to_8(reader.png);
  if ((colour & PNG_COLOR_MASK_COLOR) == 0) png_set_gray_to_rgb(reader.png);
  if ((colour & PNG_COLOR_MASK_ALPHA) != 0 ||
      png_get_valid(reader.png, reader.info, PNG_INFO_tRNS) != 0) {
    png_set_strip_alpha(reader.png);
  }
  reader.passes = png_set_interlace_handling(reader.png);
  png_read_update_info(reader.png, reader.info);
  return true;
}

// Reads the rows (all passes of an interlaced image) into height rows of row_bytes each. The
// chunks after the image data are not read: like PIL, a file damaged only there still loads.
bool png_read_rows(PngReader& reader, uint8_t* pixels, png_uint_32 height, size_t row_bytes) {
  if (setjmp(png_jmpbuf(reader.png))) return false;
  for (int pass = 0; pass < reader.passes; ++pass) {
    for (png_uint_32 y = 0; y < height; ++y) {
      png_read_row(reader.png, pixels + y * row_bytes, nullptr);
    }
  }
  return true;
}

// Decodes a PNG to 8-bit RGB as PIL's Image.open(path).convert("RGB") does (see png_start), except
// that 16-bit grayscale keeps its high byte where PIL clips the 16-bit value to 255.
Pixels decode_png(const std::string& path, const std::vector<uint8_t>& bytes,
                  std::vector<uint8_t>& buffer) {
  PngReader reader(bytes.data(), bytes.size());
  reader.png =
      png_create_read_struct(PNG_LIBPNG_VER_STRING, &reader, &png_on_error, &png_on_warning);
  if (reader.png != nullptr) reader.info = png_create_info_struct(reader.png);
  if (reader.info == nullptr) throw Error("cannot create a libpng decoder (out of memory?)");
  if (!png_start(reader)) throw DataError(path + ": corrupt PNG: " + reader.message);
  const png_uint_32 width = png_get_image_width(reader.png, reader.info);
  const png_uint_32 height = png_get_image_height(reader.png, reader.info);
  check_image_size(path, width, height, "PNG");
  const size_t row_bytes = png_get_rowbytes(reader.png, reader.info);
  if (png_get_channels(reader.png, reader.info) != 3 || row_bytes != size_t{width} * 3) {
    throw DataError(path + ": PNG of an unsupported kind (libpng does not make it 8-bit RGB)");
  }
  buffer.resize(row_bytes * height);
  if (!png_read_rows(reader, buffer.data(), height, row_bytes)) {
    throw DataError(path + ": corrupt or truncated PNG: " + reader.message);
  }
  return Pixels{buffer.data(), int64_t{height}, int64_t{width}, static_cast<int64_t>(row_bytes), 3};
}

[[noreturn]] void throw_not_an_image(const std::string& path) {
  throw DataError(path + ": not a JPEG or PNG file (unrecognised first bytes)");
}

// Reads and decodes a JPEG or PNG file into the given buffers, a JPEG at the scale
// choose_jpeg_scale(width, height, needed) picks.
Pixels decode_file(const std::string& path, int64_t needed, std::vector<uint8_t>& bytes,
                   std::vector<uint8_t>& buffer) {
  read_file(path, bytes);
  if (is_jpeg(bytes)) {
    const JpegHeader header = read_jpeg_header(path, bytes);
    return decode_jpeg(path, bytes, header,
                       choose_jpeg_scale(header.width, header.height, needed), buffer);
  }
  if (is_png(bytes)) return decode_png(path, bytes, buffer);
  throw_not_an_image(path);
}

// The validation resize: reads the file and decodes a JPEG at the scale choose_jpeg_scale picks
// for a shorter side of `size`; sets `geometry` to torchvision's Resize(size) of the full-size
// image (from the header), mapped into the decoded pixels.
Pixels decode_for_resize(const std::string& path, int64_t size, ResizeGeometry& geometry,
                         std::vector<uint8_t>& bytes, std::vector<uint8_t>& buffer) {
  read_file(path, bytes);
  if (is_jpeg(bytes)) {
    const JpegHeader header = read_jpeg_header(path, bytes);
    const int denominator = choose_jpeg_scale(header.width, header.height, size);
    geometry = validation_resize(header.width, header.height, denominator, size);
    return decode_jpeg(path, bytes, header, denominator, buffer);
  }
  if (is_png(bytes)) {
    const Pixels pixels = decode_png(path, bytes, buffer);
    geometry = validation_resize(pixels.width, pixels.height, 1, size);
    return pixels;
  }
  throw_not_an_image(path);
}

// The training crop: reads the file, draws torchvision's RandomResizedCrop box on the image's
// full size (from `rng`), and decodes a JPEG at the smallest scale at which that box is still
// at least `side` pixels high and wide: the box's rows and columns only (decode_jpeg_box), or the
// whole image with `whole_file` (the same pixels). Sets `box` to the crop in the decoded pixels.
Pixels decode_random_crop(const std::string& path, int64_t side, double min_scale, SplitMix64& rng,
                          CropBox& box, std::vector<uint8_t>& bytes, std::vector<uint8_t>& buffer,
                          bool whole_file) {
  constexpr double kMinRatio = 3.0 / 4.0;
  constexpr double kMaxRatio = 4.0 / 3.0;
  read_file(path, bytes);
  if (is_jpeg(bytes)) {
    const JpegHeader header = read_jpeg_header(path, bytes);
    const CropBox full = random_resized_crop_box(header.height, header.width, min_scale, 1.0,
                                                 kMinRatio, kMaxRatio, rng);
    const int denominator = choose_jpeg_crop_scale(full, header.width, header.height, side);
    box = scale_crop_box(full, header.width, header.height, denominator);
    if (whole_file) return decode_jpeg(path, bytes, header, denominator, buffer);
    return decode_jpeg_box(path, bytes, header, denominator, box, buffer);
  }
  if (is_png(bytes)) {
    const Pixels pixels = decode_png(path, bytes, buffer);
    box = random_resized_crop_box(pixels.height, pixels.width, min_scale, 1.0, kMinRatio,
                                  kMaxRatio, rng);
    return pixels;
  }
  throw_not_an_image(path);
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

CropBox scale_crop_box(const CropBox& box, int64_t width, int64_t height, int denominator) {
  if (denominator == 1) return box;
  // Pixel i of the image decoded at 1/d covers pixels [d i, d (i + 1)) of the full one, so an
  // edge at x lies at x / d, rounded to the nearest pixel edge; each side keeps one pixel.
  const auto edges = [denominator](int64_t first, int64_t length, int64_t full_size) {
    const int64_t d = denominator;
    const int64_t scaled_size = (full_size + d - 1) / d;
    const int64_t begin = std::min((2 * first + d) / (2 * d), scaled_size - 1);
    const int64_t end = std::clamp((2 * (first + length) + d) / (2 * d), begin + 1, scaled_size);
    return std::pair<int64_t, int64_t>{begin, end - begin};
  };
  const auto [top, box_height] = edges(box.top, box.height, height);
  const auto [left, box_width] = edges(box.left, box.width, width);
  return CropBox{top, left, box_height, box_width};
}

ResizeGeometry validation_resize(int64_t width, int64_t height, int denominator, int64_t size) {
  if (width < 1 || height < 1 || size < 1) throw std::invalid_argument("validation_resize: empty image or size");
  ResizeGeometry geometry;
  geometry.image_height = height;
  geometry.image_width = width;
  // torchvision: the shorter side becomes size, the longer int(size * longer / shorter).
  geometry.out_height = height <= width ? size : size * height / width;
  geometry.out_width = height <= width ? size * width / height : size;
  geometry.source = scale_crop_box(CropBox{0, 0, height, width}, width, height, denominator);
  return geometry;
}

int choose_jpeg_crop_scale(const CropBox& box, int64_t width, int64_t height, int64_t needed) {
  if (needed <= 0) return 1;
  for (const int denominator : {8, 4, 2}) {
    const CropBox scaled = scale_crop_box(box, width, height, denominator);
    if (scaled.height >= needed && scaled.width >= needed) return denominator;
  }
  return 1;
}

namespace {

// `box` of decoded pixels as uint8 [3, H, W] (a channels-first view of a copy).
torch::Tensor to_tensor(const Pixels& pixels, const CropBox& box) {
  torch::Tensor image = torch::empty({box.height, box.width, 3}, torch::kByte);
  uint8_t* out = image.data_ptr<uint8_t>();
  for (int64_t y = 0; y < box.height; ++y) {
    const uint8_t* in = pixels.data + (box.top + y) * pixels.row_stride + box.left * pixels.pixel_stride;
    for (int64_t x = 0; x < box.width; ++x, in += pixels.pixel_stride, out += 3) {
      std::memcpy(out, in, 3);
    }
  }
  return image.permute({2, 0, 1});
}

}  // namespace

torch::Tensor decode_image(const std::string& path, int64_t needed) {
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> buffer;
  const Pixels pixels = decode_file(path, needed, bytes, buffer);
  return to_tensor(pixels, CropBox{0, 0, pixels.height, pixels.width});
}

torch::Tensor decode_jpeg_crop(const std::string& path, int denominator, const CropBox& box) {
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> buffer;
  read_file(path, bytes);
  if (!is_jpeg(bytes)) throw DataError(path + ": not a JPEG file (unrecognised first bytes)");
  const JpegHeader header = read_jpeg_header(path, bytes);
  const tjscalingfactor scale{1, denominator};
  const int64_t height = TJSCALED(header.height, scale);
  const int64_t width = TJSCALED(header.width, scale);
  if ((denominator != 1 && denominator != 2 && denominator != 4 && denominator != 8) || box.top < 0 ||
      box.left < 0 || box.height < 1 || box.width < 1 || box.top + box.height > height ||
      box.left + box.width > width) {
    throw std::invalid_argument("decode_jpeg_crop: box outside the " + std::to_string(width) + "x" +
                                std::to_string(height) + " image at 1/" + std::to_string(denominator));
  }
  CropBox where = box;
  const Pixels pixels = decode_jpeg_box(path, bytes, header, denominator, where, buffer);
  return to_tensor(pixels, where);
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

  // The float numbers normalize_on_device multiplies and subtracts (from the double mean and
  // stddev): an image normalised here is bit for bit the uint8 image normalised on a device.
  for (size_t c = 0; c < 3; ++c) {
    const double mean = options_.mean.empty() ? 0.0 : options_.mean[c];
    const double stddev = options_.stddev.empty() ? 1.0 : options_.stddev[c];
    scale_[c] = static_cast<float>(1.0 / (255.0 * stddev));
    shift_[c] = static_cast<float>(mean / stddev);
  }

  // The classes and the samples' files and labels: what a listing shows (a file edited in place
  // keeps the fingerprint; reading every file to see it would cost an epoch's I/O).
  auto take_fingerprint = [this] {
    Fingerprint print;
    for (const std::string& name : options_.classes) print.add(name);
    for (const Sample& s : samples_) print.add(s.file).add(s.label);
    fingerprint_ = print.value();
  };
  if (!options_.files.empty()) {
    for (const std::string& file : options_.files) {
      const std::string where = files::join(options_.directory, file);
      if (!files::is_regular_file(where)) {
        throw DataError(where + ": " + (files::exists(where) ? "not a regular file" : "no such file") +
                        ", expected a JPEG or PNG image");
      }
      samples_.push_back(Sample{file, kIgnoreIndex});
    }
    take_fingerprint();
    return;
  }
  const std::string& directory = options_.directory;
  const std::vector<std::string> found = find_image_classes(directory);
  const bool training_split = options_.classes.empty();  // the split that defines the classes
  if (training_split) options_.classes = found;
  std::map<std::string, int64_t> label_of;
  for (size_t i = 0; i < options_.classes.size(); ++i) {
    label_of.emplace(options_.classes[i], static_cast<int64_t>(i));
  }

  std::vector<std::string> empty_classes;
  for (const std::string& name : found) {
    const auto label = label_of.find(name);
    const std::string class_directory = files::join(directory, name);
    if (label == label_of.end()) {
      throw DataError(class_directory + ": class '" + name +
                      "' is not among the training split's classes");
    }
    const size_t before = samples_.size();
    for (const std::string& file : files::list_directory(class_directory)) {
      if (!is_hidden(file) && has_image_extension(file)) {
        samples_.push_back(Sample{name + "/" + file, label->second});
      }
    }
    if (training_split && samples_.size() == before) {
      // Still a class of the model (label and output), one that no image teaches. torchvision's
      // ImageFolder refuses it; here it is said, and kept, so that the labels stay those of the
      // directory list.
      empty_classes.push_back(name);
    }
  }
  if (samples_.empty()) {
    throw DataError(directory + ": no images (.jpg, .jpeg or .png) in any class subdirectory");
  }
  if (!empty_classes.empty()) {
    std::string names;
    for (const auto& name : empty_classes) names += (names.empty() ? "" : ", ") + name;
    const bool one = empty_classes.size() == 1;
    log::warn(log::str(directory, ": ", one ? "class directory " : "class directories ", names,
                       one ? " holds" : " hold", " no images (.jpg, .jpeg or .png) but ", one ? "counts" : "count",
                       " among the ", options_.classes.size(), " classes; remove ", one ? "it" : "them",
                       " unless the model should have ", one ? "that output" : "those outputs"));
  }
  take_fingerprint();
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

void ImageFolderDataset::transform_into(int64_t index, uint64_t seed, void* output, bool whole_file) const {
  const int64_t side = options_.image_size;
  ThreadBuffers& buffers = thread_buffers();
  ResampleSpec spec;
  spec.window_height = side;
  spec.window_width = side;
  Pixels pixels;
  if (options_.split == Split::Train) {
    SplitMix64 rng(seed);
    CropBox box;
    pixels = decode_random_crop(path(index), side, options_.crop_min_scale, rng, box,
                                buffers.bytes, buffers.pixels, whole_file);
    spec.top = box.top;
    spec.left = box.left;
    spec.height = box.height;
    spec.width = box.width;
    spec.out_height = side;
    spec.out_width = side;
    spec.flip = options_.random_flip && rng.below(2) == 1;
  } else {
    // Resize the shorter side to resize_size, then take the centred side x side window. The output
    // size is torchvision's for the full-size image, whatever scale a JPEG was decoded at.
    const int64_t size = options_.resize_size;
    ResizeGeometry geometry;
    pixels = decode_for_resize(path(index), size, geometry, buffers.bytes, buffers.pixels);
    spec.top = geometry.source.top;
    spec.left = geometry.source.left;
    spec.height = geometry.source.height;
    spec.width = geometry.source.width;
    spec.out_height = geometry.out_height;
    spec.out_width = geometry.out_width;
    if (side > spec.out_height || side > spec.out_width) {
      throw DataError(path(index) + ": a " + std::to_string(geometry.image_height) + "x" +
                      std::to_string(geometry.image_width) + " image resized to a shorter side of " +
                      std::to_string(size) + " is too narrow for a " + std::to_string(side) +
                      "-pixel center crop");
    }
    spec.window_top = static_cast<int64_t>(std::nearbyint(static_cast<double>(spec.out_height - side) / 2.0));
    spec.window_left = static_cast<int64_t>(std::nearbyint(static_cast<double>(spec.out_width - side) / 2.0));
  }
  if (options_.uint8) {
    resample_to_uint8(pixels, spec, static_cast<uint8_t*>(output), buffers.resample);
  } else {
    resample_to_float(pixels, spec, scale_, shift_, static_cast<float*>(output), buffers.resample);
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

Example ImageFolderDataset::get_checked(int64_t index, uint64_t seed) const {
  const int64_t side = options_.image_size;
  torch::Tensor image = torch::empty({3, side, side}, options_.uint8 ? torch::kByte : torch::kFloat);
  transform_into(index, seed, image.data_ptr(), /*whole_file=*/true);
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
