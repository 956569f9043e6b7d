// Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/ with the library itself
// (scripts/fuzz --seeds): small valid files of every kind a reader accepts, and a few damaged ones.
// The committed corpus came from this program; rerun it only when the formats change.
#include <train/checkpoint.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/safetensors.h>
#include <torch/torch.h>

#include <png.h>
#include <turbojpeg.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace std::string_literals;

namespace {

using Bytes = std::vector<uint8_t>;
std::string g_root;  // fuzz/corpus

void write(const std::string& target, const std::string& name, const Bytes& bytes) {
  const std::string dir = g_root + "/" + target;
  train::files::make_directories(dir);
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + dir + "/" + name);
}

void write(const std::string& target, const std::string& name, const std::string& text) {
  write(target, name, Bytes(text.begin(), text.end()));
}

Bytes read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

Bytes head(const Bytes& bytes, size_t n) { return Bytes(bytes.begin(), bytes.begin() + std::min(n, bytes.size())); }

Bytes gzip(const Bytes& bytes) {
  const std::string tmp = g_root + "/.gz.tmp";
  gzFile f = gzopen(tmp.c_str(), "wb9");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
  Bytes out = read(tmp);
  std::remove(tmp.c_str());
  return out;
}

// ---- IDX ----------------------------------------------------------------------------------------

Bytes idx(std::vector<uint32_t> dims, const Bytes& payload) {
  Bytes out = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(d >> shift));
  }
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

void idx_seeds() {
  Bytes pixels(2 * 3 * 4);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 11);
  const Bytes images = idx({2, 3, 4}, pixels);
  const Bytes labels = idx({5}, {0, 9, 3, 3, 7});
  write("idx", "images-2x3x4", images);
  write("idx", "images-2x3x4.gz", gzip(images));
  write("idx", "images-1x1x1", idx({1, 1, 1}, {255}));
  write("idx", "labels-5", labels);
  write("idx", "labels-5.gz", gzip(labels));
  write("idx", "labels-out-of-range", idx({2}, {1, 10}));
  write("idx", "images-truncated", head(images, images.size() - 3));
  write("idx", "images-gz-truncated", head(gzip(images), gzip(images).size() - 6));
  write("idx", "images-zero-dim", idx({0, 3, 4}, {}));
  write("idx", "images-huge-dims", idx({0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF}, {1, 2, 3}));
}

// ---- Images -------------------------------------------------------------------------------------

Bytes gradient(int width, int height, int channels) {
  Bytes out(static_cast<size_t>(width) * height * channels);
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x)
      for (int c = 0; c < channels; ++c)
        out[(static_cast<size_t>(y) * width + x) * channels + c] = static_cast<uint8_t>(x * 17 + y * 29 + c * 80);
  return out;
}

Bytes jpeg(int width, int height, int pixel_format, int channels, int subsampling, int flags) {
  const Bytes pixels = gradient(width, height, channels);
  tjhandle handle = tjInitCompress();
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  if (tjCompress2(handle, pixels.data(), width, 0, height, pixel_format, &buffer, &size, subsampling, 85, flags) != 0) {
    throw std::runtime_error(std::string("tjCompress2: ") + tjGetErrorStr2(handle));
  }
  Bytes out(buffer, buffer + size);
  tjFree(buffer);
  tjDestroy(handle);
  return out;
}

Bytes png(int width, int height, png_uint_32 format, const Bytes& colormap = {}, int colormap_entries = 0) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = width;
  image.height = height;
  image.format = format;
  image.colormap_entries = colormap_entries;
  const int channels = colormap_entries ? 1 : PNG_IMAGE_PIXEL_CHANNELS(format);
  const int component = (format & PNG_FORMAT_FLAG_LINEAR) ? 2 : 1;
  Bytes pixels = gradient(width * component, height, channels);
  if (colormap_entries) {
    for (auto& p : pixels) p %= colormap_entries;
  }
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&image, nullptr, &size, 0, pixels.data(), 0,
                                 colormap.empty() ? nullptr : colormap.data())) {
    throw std::runtime_error(std::string("png size: ") + image.message);
  }
  Bytes out(size);
  if (!png_image_write_to_memory(&image, out.data(), &size, 0, pixels.data(), 0,
                                 colormap.empty() ? nullptr : colormap.data())) {
    throw std::runtime_error(std::string("png write: ") + image.message);
  }
  out.resize(size);
  return out;
}

// A copy of a PNG whose IHDR claims another size (CRC fixed up): a tiny file that asks for a
// huge image.
Bytes png_claiming(Bytes png, uint32_t width, uint32_t height) {
  for (int i = 0; i < 4; ++i) {
    png[16 + i] = static_cast<uint8_t>(width >> (24 - 8 * i));
    png[20 + i] = static_cast<uint8_t>(height >> (24 - 8 * i));
  }
  const uint32_t crc = static_cast<uint32_t>(crc32(0, png.data() + 12, 17));
  for (int i = 0; i < 4; ++i) png[29 + i] = static_cast<uint8_t>(crc >> (24 - 8 * i));
  return png;
}

// A copy of a JPEG whose frame header (SOF0/SOF2) claims another size.
Bytes jpeg_claiming(Bytes jpeg, uint16_t width, uint16_t height) {
  for (size_t i = 2; i + 9 < jpeg.size(); ++i) {
    if (jpeg[i] == 0xFF && (jpeg[i + 1] == 0xC0 || jpeg[i + 1] == 0xC2)) {
      jpeg[i + 5] = static_cast<uint8_t>(height >> 8);
      jpeg[i + 6] = static_cast<uint8_t>(height);
      jpeg[i + 7] = static_cast<uint8_t>(width >> 8);
      jpeg[i + 8] = static_cast<uint8_t>(width);
      return jpeg;
    }
  }
  throw std::runtime_error("no SOF marker");
}

void image_seeds() {
  const Bytes rgb = jpeg(17, 13, TJPF_RGB, 3, TJSAMP_420, 0);
  write("image", "rgb-17x13-420.jpg", rgb);
  write("image", "rgb-8x8-444.jpg", jpeg(8, 8, TJPF_RGB, 3, TJSAMP_444, 0));
  write("image", "rgb-40x24-422-progressive.jpg", jpeg(40, 24, TJPF_RGB, 3, TJSAMP_422, TJFLAG_PROGRESSIVE));
  write("image", "gray-9x7.jpg", jpeg(9, 7, TJPF_GRAY, 1, TJSAMP_GRAY, 0));
  write("image", "ycck-8x8.jpg", jpeg(8, 8, TJPF_CMYK, 4, TJSAMP_444, 0));
  write("image", "rgb-truncated.jpg", head(rgb, rgb.size() / 2));
  write("image", "jpeg-soi-only.jpg", head(rgb, 3));

  const Bytes rgb_png = png(5, 4, PNG_FORMAT_RGB);
  write("image", "rgb-5x4.png", rgb_png);
  write("image", "rgba-3x3.png", png(3, 3, PNG_FORMAT_RGBA));
  write("image", "gray-4x4.png", png(4, 4, PNG_FORMAT_GRAY));
  write("image", "gray-alpha-2x5.png", png(2, 5, PNG_FORMAT_GA));
  write("image", "rgb16-3x2.png", png(3, 2, PNG_FORMAT_LINEAR_RGB));
  write("image", "palette-4x4.png", png(4, 4, PNG_FORMAT_RGB_COLORMAP, {255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9}, 4));
  write("image", "rgb-truncated.png", head(rgb_png, rgb_png.size() - 20));
  write("image", "png-claims-1000000x1000000.png", png_claiming(rgb_png, 1000000, 1000000));
  write("image", "jpeg-claims-65500x65500.jpg", jpeg_claiming(rgb, 65500, 65500));
}

// ---- Checkpoints and safetensors -----------------------------------------------------------------

// The fuzz targets' model: fc1 (Linear 4 -> 3), bn (BatchNorm1d 3), fc2 (Linear 3 -> 2).
struct Tiny : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  Tiny() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 3));
    bn = register_module("bn", torch::nn::BatchNorm1d(3));
    fc2 = register_module("fc2", torch::nn::Linear(3, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(bn(fc1(x))); }
};

void checkpoint_seeds() {
  torch::manual_seed(0);
  Tiny model;
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  model.forward(torch::randn({5, 4})).sum().backward();
  optimizer.step();
  train::TrainState state;
  state.step = 1;
  state.epoch = 0;
  state.batch_in_epoch = 1;
  state.samples_seen = 5;
  state.config_yaml = "model:\n  name: tiny\n";
  state.tensors["scaler"] = torch::tensor({65536.0, 0.0});
  const std::string tmp = g_root + "/.ckpt.tmp";
  train::save_checkpoint(tmp, model, &optimizer, state);
  const Bytes full = read(tmp);
  train::save_checkpoint(tmp, model, nullptr, train::TrainState{});
  const Bytes no_optimizer = read(tmp);
  std::remove(tmp.c_str());
  std::remove((tmp + ".crc32c").c_str());
  write("checkpoint", "tiny-sgd-step1.pt", full);
  write("checkpoint", "tiny-no-optimizer.pt", no_optimizer);
  write("checkpoint", "tiny-truncated.pt", head(full, full.size() * 2 / 3));

  // Valid archives with the wrong things inside, so that the fuzzer starts past the zip layer.
  auto archive_bytes = [&](const std::function<void(torch::serialize::OutputArchive&)>& fill) {
    torch::serialize::OutputArchive archive;
    fill(archive);
    archive.save_to(tmp);
    Bytes out = read(tmp);
    std::remove(tmp.c_str());
    return out;
  };
  // The model's entries, less those named in `skip`.
  auto weights_of = [](const torch::nn::Module& m, const std::vector<std::string>& skip = {}) {
    torch::serialize::OutputArchive w;
    for (const auto& [name, t] : train::state_dict(m)) {
      if (std::find(skip.begin(), skip.end(), name) == skip.end()) w.write(name, t);
    }
    return w;
  };
  auto header = [](torch::serialize::OutputArchive& a, const c10::IValue& format) {
    a.write("format", format);
    for (const char* key : {"step", "epoch", "batch_in_epoch", "samples_seen"}) a.write(key, c10::IValue(int64_t{0}));
  };
  write("checkpoint", "format-2.pt", archive_bytes([&](torch::serialize::OutputArchive& a) {
    header(a, c10::IValue(int64_t{2}));
    torch::serialize::OutputArchive w = weights_of(model);
    a.write("model", w);
  }));
  write("checkpoint", "format-is-a-string.pt", archive_bytes([&](torch::serialize::OutputArchive& a) {
    header(a, c10::IValue(std::string("1")));
    torch::serialize::OutputArchive w = weights_of(model);
    a.write("model", w);
  }));
  write("checkpoint", "model-is-an-int.pt", archive_bytes([&](torch::serialize::OutputArchive& a) {
    header(a, c10::IValue(int64_t{1}));
    a.write("model", c10::IValue(int64_t{7}));
  }));
  write("checkpoint", "model-entry-not-a-tensor.pt", archive_bytes([&](torch::serialize::OutputArchive& a) {
    header(a, c10::IValue(int64_t{1}));
    torch::serialize::OutputArchive w = weights_of(model, {"fc1.weight"});
    w.write("fc1.weight", c10::IValue(std::string("not a tensor")));
    w.write("extra", c10::IValue(1.5));
    a.write("model", w);
  }));
  write("checkpoint", "model-entry-wrong-shape-and-dtype.pt", archive_bytes([&](torch::serialize::OutputArchive& a) {
    header(a, c10::IValue(int64_t{1}));
    torch::serialize::OutputArchive w = weights_of(model, {"fc1.weight", "fc2.bias"});
    w.write("fc1.weight", torch::zeros({2, 2}, torch::kLong));
    w.write("fc2.bias", torch::zeros({2}, torch::kInt));
    a.write("model", w);
  }));
  write("checkpoint", "state-entry-not-a-tensor.pt", archive_bytes([&](torch::serialize::OutputArchive& a) {
    header(a, c10::IValue(int64_t{1}));
    torch::serialize::OutputArchive w = weights_of(model);
    a.write("model", w);
    torch::serialize::OutputArchive opt;
    optimizer.save(opt);
    a.write("optimizer", opt);
    torch::serialize::OutputArchive extra;
    extra.write("scaler", c10::IValue(std::string("x")));
    a.write("state", extra);
    a.write("config", c10::IValue(int64_t{3}));
  }));
  write("checkpoint", "optimizer-from-adam.pt", archive_bytes([&](torch::serialize::OutputArchive& a) {
    header(a, c10::IValue(int64_t{1}));
    torch::serialize::OutputArchive w = weights_of(model);
    a.write("model", w);
    torch::optim::Adam adam(model.parameters());
    model.forward(torch::randn({5, 4})).sum().backward();
    adam.step();
    torch::serialize::OutputArchive opt;
    adam.save(opt);
    a.write("optimizer", opt);
  }));
  write("checkpoint", "step-missing.pt", archive_bytes([&](torch::serialize::OutputArchive& a) {
    a.write("format", c10::IValue(int64_t{1}));
    torch::serialize::OutputArchive w = weights_of(model);
    a.write("model", w);
  }));

  const std::string st = g_root + "/.st.tmp";
  auto safetensors = [&](const train::TensorMap& tensors, const train::Metadata& metadata) {
    train::write_safetensors(st, tensors, metadata);
    Bytes out = read(st);
    std::remove(st.c_str());
    return out;
  };
  const Bytes weights = safetensors(train::state_dict(model), {{"format", "pt"}});
  write("safetensors", "tiny-state-dict.safetensors", weights);
  write("safetensors", "every-dtype.safetensors",
        safetensors({{"f64", torch::arange(3, torch::kDouble)}, {"f32", torch::ones({2, 2})},
                     {"f16", torch::ones({2}, torch::kHalf)}, {"bf16", torch::ones({1, 2}, torch::kBFloat16)},
                     {"i64", torch::arange(2)}, {"i32", torch::arange(2, torch::kInt)},
                     {"i16", torch::arange(2, torch::kShort)}, {"i8", torch::arange(2, torch::kChar)},
                     {"u8", torch::arange(4, torch::kByte)}, {"bool", torch::tensor({true, false})},
                     {"scalar", torch::tensor(1.5)}, {"empty", torch::empty({0, 3})}},
                    {}));
  write("safetensors", "no-tensors.safetensors", safetensors({}, {{"note", "empty"}}));
  write("safetensors", "truncated.safetensors", head(weights, weights.size() - 5));
  auto raw = [](const std::string& header, size_t buffer_bytes) {
    Bytes out;
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i)));
    out.insert(out.end(), header.begin(), header.end());
    out.insert(out.end(), buffer_bytes, 0);
    return out;
  };
  write("safetensors", "overlapping-offsets.safetensors",
        raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8));
  write("safetensors", "zero-size-huge-dims.safetensors",
        raw(R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]}})", 0));
  write("safetensors", "duplicate-key.safetensors",
        raw(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", 2));
  write("safetensors", "nested-shape.safetensors",
        raw(R"({"a":{"dtype":"F32","shape":)" + std::string(2000, '[') + std::string(2000, ']') +
                R"(,"data_offsets":[0,4]}})", 4));
  {
    // AdamW's state (exp_avg, exp_avg_sq, step per parameter): the fuzz target loads every input
    // into AdamW as well. A model of its own, last, so that the seeds above stay as they were.
    torch::manual_seed(1);
    Tiny model;
    torch::optim::AdamW adamw(model.parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    model.forward(torch::randn({5, 4})).sum().backward();
    adamw.step();
    train::save_checkpoint(tmp, model, &adamw, state);
    write("checkpoint", "tiny-adamw-step1.pt", read(tmp));
    std::remove(tmp.c_str());
    std::remove((tmp + ".crc32c").c_str());
  }
}

// ---- Text ---------------------------------------------------------------------------------------

void text_seeds(const std::string& source_dir) {
  write("tokenizer", "ascii.txt", std::string("The unaffable cafe, playing!  Hello world?"));
  write("tokenizer", "pair.txt", std::string("resume the play\tunaffable x ##x [MASK] [SEP]"));
  write("tokenizer", "unicode.txt",
        std::string("Caf\xc3\xa9 R\xc3\xa9sum\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xce\xb1\xce\xb2 "
                    "\xef\xbc\x81 \xe2\x80\x94 \xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xe2\x80\x8b \x01\x7f"));
  write("tokenizer", "invalid-utf8.txt", std::string("\xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82 ok \xff"));
  write("tokenizer", "long-word.txt", std::string(130, 'x') + " " + std::string(99, 'e'));
  write("tokenizer", "vocab-and-text.txt",
        std::string("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n##s\nworld\n\fhellos world [UNK]!"));
  write("tokenizer", "vocab-crlf-and-text.txt",
        std::string("[PAD]\r\n[UNK]\r\n[CLS]\r\n[SEP]\r\n[MASK]\r\nab\r\n##c\r\n\fabc abd\tab"));
  write("tokenizer", "vocab-missing-special.txt", std::string("[PAD]\n[UNK]\nhello\n\fhello"));

  for (const char* name : {"resnet_fashion_mnist.yaml", "resnet50_imagenet.yaml", "bert_tiny_mlm.yaml",
                           "bert_tiny_finetune.yaml", "minilm_finetune.yaml", "bench/mlp_fashion_mnist.yaml"}) {
    std::string seed = name;
    for (char& c : seed) c = c == '/' ? '-' : c;
    write("config", seed, read(source_dir + "/configs/" + name));
  }
  write("config", "minimal-with-overrides.yaml",
        std::string("model: {name: mlp}\ndata: {kind: synthetic}\ntrainer:\n  epochs: 1\n  global_batch: 8\n") +
            "\0optim.lr=0.5\0data.mean=[0.5]\0data.std=[0.25]"s);
  write("config", "flow-and-anchors.yaml",
        std::string("base: &b {epochs: 2}\nmodel: {name: \"resnet18\", width: 0.25}\ntrainer: *b\n"));
  write("config", "bad-types.yaml",
        std::string("model:\n  name: [a, b]\noptim:\n  lr: \"0.1\"\n  momentum: .inf\ntrainer: {epochs: -1, epochs: 2}\n"));
  write("config", "two-documents.yaml", std::string("model: {name: mlp}\n---\ntrainer: {}\n"));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds SOURCE_DIR   (writes SOURCE_DIR/fuzz/corpus/<target>/)\n");
    return 2;
  }
  const std::string source_dir = argv[1];
  g_root = source_dir + "/fuzz/corpus";
  try {
    idx_seeds();
    image_seeds();
    checkpoint_seeds();
    text_seeds(source_dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  std::printf("make_seeds: wrote %s\n", g_root.c_str());
  return 0;
}
