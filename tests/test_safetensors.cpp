#include "testing.h"

#include <train/checkpoint.h>
#include <train/cli.h>
#include <train/config.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/models/model.h>
#include <train/safetensors.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

using Catch::Matchers::Contains;
using train::CheckpointError;
using train::TensorMap;
namespace files = train::files;

namespace {

struct TempDir {
  std::string path = files::make_temp_directory("train_safetensors_");
  ~TempDir() { files::remove_all(path); }
  std::string operator/(const std::string& name) const { return files::join(path, name); }
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A safetensors file from parts: an 8-byte little-endian length (the header's unless given),
// the header text, the data bytes.
std::string safetensors_bytes(const std::string& header, const std::string& data, int64_t declared_len = -1) {
  const uint64_t n = declared_len < 0 ? header.size() : static_cast<uint64_t>(declared_len);
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// The reference tensors of tests/python/safetensors_oracle.py.
TensorMap reference_tensors() {
  TensorMap out;
  const auto base = torch::arange(6, torch::kDouble).reshape({2, 3});
  const std::vector<std::pair<std::string, torch::ScalarType>> dtypes = {
      {"F64", torch::kDouble}, {"F32", torch::kFloat}, {"F16", torch::kHalf}, {"BF16", torch::kBFloat16},
      {"I64", torch::kLong},   {"I32", torch::kInt},   {"I16", torch::kShort}, {"I8", torch::kChar},
      {"U8", torch::kByte},    {"BOOL", torch::kBool}};
  for (const auto& [name, dtype] : dtypes) {
    if (dtype == torch::kBool) {
      out[name] = base.to(torch::kLong).remainder(2).eq(1);
    } else if (dtype == torch::kByte) {
      out[name] = base.to(dtype);
    } else if (torch::isFloatingType(dtype)) {
      out[name] = ((base - 2) * 0.5).to(dtype);
    } else {
      out[name] = (base - 2).to(dtype);
    }
  }
  out["scalar"] = torch::tensor(3.5f);
  out["empty"] = torch::zeros({0, 4});
  return out;
}

void check_same(const TensorMap& got, const TensorMap& want) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, w] : want) {
    INFO(name);
    REQUIRE(got.count(name));
    const auto& g = got.at(name);
    CHECK(g.scalar_type() == w.scalar_type());
    CHECK(g.sizes() == w.sizes());
    CHECK(torch::equal(g, w));
  }
}

// Expects read_safetensors(path) to throw CheckpointError (exit code 2) whose message starts with
// the path and contains every fragment.
void check_rejected(const std::string& path, const std::vector<std::string>& fragments) {
  try {
    train::read_safetensors(path);
    FAIL("read_safetensors accepted " << path);
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(e.exit_code() == train::kExitInvalid);
    CHECK(what.rfind(path + ": ", 0) == 0);
    for (const auto& f : fragments) CHECK_THAT(what, Contains(f));
  }
}

int cli(std::vector<std::string> args) {
  args.insert(args.begin(), "train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return train::run_cli(static_cast<int>(argv.size()), argv.data());
}

train::models::ModelPtr resnet50(int64_t classes = 1000) {
  train::ModelConfig config;
  config.name = "resnet50";
  config.num_classes = classes;
  config.in_channels = 3;
  return train::models::make_model(config);
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace

TEST_CASE("safetensors: every dtype, scalars, empty tensors and metadata round-trip", "[safetensors]") {
  TempDir tmp;
  const auto path = tmp / "sub/dir/ref.safetensors";  // parent directories are created
  const train::Metadata meta{{"producer", "train"}, {"note", "h\xc3\xa9llo \"quoted\""}};
  train::write_safetensors(path, reference_tensors(), meta);
  const std::string bytes = read_text(path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  CHECK(header_len % 8 == 0);  // the data buffer starts 8-byte aligned
  CHECK(bytes.substr(8, 1) == "{");
  train::Metadata got_meta;
  check_same(train::read_safetensors(path, &got_meta), reference_tensors());
  CHECK(got_meta == meta);
  CHECK(files::list_directory(tmp / "sub/dir") == std::vector<std::string>{"ref.safetensors"});  // no temporaries
}

TEST_CASE("safetensors: files agree with the Python safetensors package both ways", "[safetensors][python]") {
  TempDir tmp;
  // train writes, safetensors reads and compares.
  train::write_safetensors(tmp / "from_train.safetensors", reference_tensors(),
                           {{"producer", "train"}, {"note", "h\xc3\xa9llo \"quoted\""}});
  CHECK(train::testing::run_python("safetensors_oracle.py", "check " + tmp / "from_train.safetensors") == 0);
  // safetensors writes (its own tensor order and padding), train reads.
  REQUIRE(train::testing::run_python("safetensors_oracle.py", "write " + tmp / "from_python.safetensors") == 0);
  train::Metadata meta;
  check_same(train::read_safetensors(tmp / "from_python.safetensors", &meta), reference_tensors());
  CHECK(meta.at("producer") == "python safetensors");
  // The oracle itself notices a wrong value (so a passing check means something).
  auto wrong = reference_tensors();
  wrong["I32"][0][0] = 7;
  train::write_safetensors(tmp / "wrong.safetensors", wrong, {{"producer", "train"}, {"note", "x"}});
  CHECK(train::testing::run_python("safetensors_oracle.py", "check " + tmp / "wrong.safetensors") == 1);
}

TEST_CASE("safetensors: malformed files are rejected naming the file and the tensor", "[safetensors]") {
  TempDir tmp;
  const std::string f32x2 = std::string(8, '\0');  // two F32 zeros
  auto file = [&](const std::string& name, const std::string& bytes) {
    write_bytes(tmp / name, bytes);
    return tmp / name;
  };
  check_rejected(tmp / "absent.safetensors", {"does not exist"});
  check_rejected(file("short", "abc"), {"too short"});
  check_rejected(file("len_past_end", safetensors_bytes("{}", "", 1000)), {"header length 1000", "past the end"});
  check_rejected(file("huge_len", safetensors_bytes("{}", "", int64_t{1} << 62)), {"past the end"});
  check_rejected(file("bad_json", safetensors_bytes(R"({"w": {"dtype": "F32",)", "")), {"not valid JSON"});
  check_rejected(file("not_object", safetensors_bytes("[1, 2]", "")), {"not a JSON object"});
  check_rejected(file("dtype", safetensors_bytes(R"({"w": {"dtype": "F8_X", "shape": [2], "data_offsets": [0, 8]}})", f32x2)),
                 {"tensor 'w'", "unsupported dtype 'F8_X'"});
  check_rejected(file("fields", safetensors_bytes(R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", f32x2)),
                 {"tensor 'w'", "dtype, shape and data_offsets"});
  check_rejected(file("bytes", safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", f32x2)),
                 {"tensor 'w'", "needs 12 bytes", "hold 8"});
  check_rejected(file("neg_shape", safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", f32x2)),
                 {"tensor 'w'", "non-negative integer"});
  check_rejected(file("neg_offset", safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", f32x2)),
                 {"tensor 'w'", "data_offsets must be"});
  check_rejected(file("reversed", safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", f32x2)),
                 {"tensor 'w'", "end before"});
  check_rejected(file("overlap", safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                                                   R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                                   std::string(12, '\0'))),
                 {"tensor 'b'", "overlap"});
  check_rejected(file("gap", safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", f32x2)),
                 {"tensor 'a'", "gap"});
  check_rejected(file("range", safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", f32x2)),
                 {"tensor 'w'", "past the 8-byte data buffer"});
  check_rejected(file("trailing", safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", f32x2)),
                 {"4 bytes after the last tensor"});
  check_rejected(file("duplicate", safetensors_bytes(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                                                     R"( "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", f32x2)),
                 {"tensor 'w' appears twice"});
  check_rejected(file("meta", safetensors_bytes(R"({"__metadata__": {"k": 1}})", "")), {"__metadata__ 'k'"});

  // A valid file's truncation is caught.
  train::write_safetensors(tmp / "ok.safetensors", {{"w", torch::ones({4})}});
  const std::string ok = read_text(tmp / "ok.safetensors");
  CHECK(train::read_safetensors(tmp / "ok.safetensors").at("w").equal(torch::ones({4})));
  check_rejected(file("truncated", ok.substr(0, ok.size() - 3)), {"tensor 'w'", "past the"});
}

TEST_CASE("safetensors: a failed write leaves the previous file intact", "[safetensors]") {
  TempDir tmp;
  const auto path = tmp / "w.safetensors";
  train::write_safetensors(path, {{"w", torch::ones({2})}});
  CHECK_THROWS_WITH(train::write_safetensors(path, {{"a", torch::ones({2})}, {"z", torch::ones({2}, torch::kComplexFloat)}}),
                    Contains("tensor 'z'") && Contains("ComplexFloat"));
  CHECK_THROWS_AS(train::write_safetensors(path, {{"__metadata__", torch::ones({2})}}), CheckpointError);
  CHECK(train::read_safetensors(path).at("w").equal(torch::ones({2})));
  CHECK(files::list_directory(tmp.path) == std::vector<std::string>{"w.safetensors"});
}

TEST_CASE("load_state_dict: strict names every problem and leaves the module untouched", "[safetensors]") {
  torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 2));
  const TensorMap before = [&] {
    TensorMap m;
    for (const auto& [k, v] : train::state_dict(*net)) m[k] = v.clone();
    return m;
  }();
  CHECK(before.count("1.running_mean"));  // buffers and parameters in one namespace
  CHECK(before.count("1.num_batches_tracked"));

  TensorMap good;
  for (const auto& [k, v] : before) good[k] = v.to(torch::kDouble) + 1;  // dtype converts on copy
  good["1.num_batches_tracked"] = torch::tensor(int64_t{5});
  auto report = train::load_state_dict(*net, good, /*strict=*/true, "good.safetensors");
  CHECK(report.complete());
  CHECK(report.loaded.size() == before.size());
  CHECK(train::state_dict(*net).at("0.weight").equal(before.at("0.weight") + 1));
  CHECK(train::state_dict(*net).at("1.num_batches_tracked").item<int64_t>() == 5);

  TensorMap bad = good;
  bad.erase("2.bias");
  bad["extra.weight"] = torch::zeros({1});
  bad["0.weight"] = torch::zeros({5, 3});
  const TensorMap loaded = [&] {
    TensorMap m;
    for (const auto& [k, v] : train::state_dict(*net)) m[k] = v.clone();
    return m;
  }();
  try {
    train::load_state_dict(*net, bad, /*strict=*/true, "bad.safetensors");
    FAIL("strict load accepted a mismatching state dict");
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Contains("bad.safetensors: weights do not match the model"));
    CHECK_THAT(what, Contains("missing key '2.bias'"));
    CHECK_THAT(what, Contains("unexpected key 'extra.weight'"));
    CHECK_THAT(what, Contains("shape mismatch for '0.weight' (file [5,3], model [4,3])"));
  }
  for (const auto& [k, v] : train::state_dict(*net)) CHECK(v.equal(loaded.at(k)));  // nothing copied

  report = train::load_state_dict(*net, bad, /*strict=*/false, "bad.safetensors");
  CHECK(report.missing == std::vector<std::string>{"2.bias"});
  CHECK(report.unexpected == std::vector<std::string>{"extra.weight"});
  CHECK(report.mismatched == std::vector<std::string>{"0.weight: file [5,3], model [4,3]"});
  CHECK(report.loaded.size() == before.size() - 2);
  CHECK(report.summary() ==
        "missing: 2.bias; unexpected: extra.weight; shape mismatch: 0.weight: file [5,3], model [4,3]");
  CHECK(train::state_dict(*net).at("2.weight").equal(bad.at("2.weight").to(torch::kFloat)));
}

TEST_CASE("load_state_dict: integer and bool tensors are refused as floating-point weights, naming file, key, dtypes",
          "[safetensors]") {
  TempDir tmp;
  torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4));
  const TensorMap before = [&] {
    TensorMap m;
    for (const auto& [k, v] : train::state_dict(*net)) m[k] = v.clone();
    return m;
  }();
  // Under a prefix that is read away, so the message must give the file's key, not the model's.
  TensorMap file;
  for (const auto& [k, v] : before) file["net." + k] = v + 1;
  file["net.1.num_batches_tracked"] = torch::tensor(int32_t{7});  // integer to integer stays allowed
  for (const auto& [dtype, name] : {std::pair{torch::kLong, "I64"}, std::pair{torch::kBool, "BOOL"}}) {
    TensorMap bad = file;
    bad["net.0.weight"] = torch::ones({4, 3}).to(dtype);
    const std::string path = tmp / (std::string(name) + ".safetensors");
    train::write_safetensors(path, bad);
    for (const bool strict : {true, false}) {
      CAPTURE(name, strict);
      CHECK_THROWS_WITH(train::load_model_weights(path, *net, strict),
                        Contains(path + ": tensor 'net.0.weight' is " + name + ", but the model's '0.weight' is F32"));
      CHECK_THROWS_AS(train::check_model_weights(path, *net, strict), CheckpointError);  // train check too
      for (const auto& [k, v] : train::state_dict(*net)) CHECK(v.equal(before.at(k)));  // nothing copied
    }
  }
  // Floating-point files of any width convert to the module's dtype, as before.
  for (const auto dtype : {torch::kHalf, torch::kBFloat16, torch::kDouble}) {
    TensorMap narrow = file;
    for (auto& [k, v] : narrow)
      if (v.is_floating_point()) v = v.to(dtype);
    const std::string path = tmp / "narrow.safetensors";
    train::write_safetensors(path, narrow);
    train::load_model_weights(path, *net, /*strict=*/true);
    CHECK(train::state_dict(*net).at("0.weight").equal(narrow.at("net.0.weight").to(torch::kFloat)));
    CHECK(train::state_dict(*net).at("1.num_batches_tracked").item<int64_t>() == 7);
  }
}

TEST_CASE("safetensors: train export writes weights that torchvision's resnet50 loads strictly, same logits",
          "[safetensors][python][slow]") {
  TempDir tmp;
  torch::manual_seed(7);
  auto model = resnet50();
  {  // non-trivial BatchNorm affine parameters and running statistics (calibrated on a batch)
    torch::NoGradGuard no_grad;
    for (auto& m : model->modules(/*include_self=*/false)) {
      if (auto* bn = m->as<torch::nn::BatchNorm2dImpl>()) {
        bn->weight.uniform_(0.5, 1.5);
        bn->bias.normal_(0, 0.1);
        bn->options.momentum(1.0);
      }
    }
    model->train();
    model->forward(torch::randn({4, 3, 64, 64}));
  }
  model->eval();
  const auto input = torch::randn({2, 3, 64, 64});
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = model->forward(input);
  }
  train::TrainState state;
  state.step = 3;
  train::save_checkpoint(tmp / "step_3.pt", *model, nullptr, state);
  REQUIRE(cli({"export", tmp / "step_3.pt", "--format", "safetensors", tmp / "resnet50.safetensors"}) == train::kExitOk);
  train::write_safetensors(tmp / "io.safetensors", {{"input", input}, {"logits", logits}});

  train::Metadata meta;
  const auto weights = train::read_safetensors(tmp / "resnet50.safetensors", &meta);
  CHECK(meta.at("format") == "pt");
  for (const char* name : {"conv1.weight", "bn1.running_mean", "bn1.num_batches_tracked", "layer1.0.conv1.weight",
                           "layer1.0.downsample.1.running_var", "layer4.2.bn3.bias", "fc.weight", "fc.bias"}) {
    CHECK(weights.count(name));
  }
  CHECK(weights.size() == 320);  // torchvision resnet50().state_dict() has 320 entries
  CHECK(train::testing::run_python("torchvision_resnet50.py",
                                   "check " + tmp / "resnet50.safetensors" + " " + tmp / "io.safetensors") == 0);

  // Usage errors: an unknown format, a missing checkpoint; nothing is written.
  CHECK(cli({"export", tmp / "step_3.pt", "--format", "onnx", tmp / "x.onnx"}) == train::kExitInvalid);
  CHECK(cli({"export", tmp / "nope.pt", tmp / "x.safetensors"}) == train::kExitInvalid);
  CHECK_FALSE(files::exists(tmp / "x.onnx"));
  CHECK_FALSE(files::exists(tmp / "x.safetensors"));
}

TEST_CASE("safetensors: torchvision's resnet50 weights, converted from .pth, load by init_from with the same logits",
          "[safetensors][python][slow]") {
  TempDir tmp;
  REQUIRE(train::testing::run_python("torchvision_resnet50.py", "make " + tmp.path) == 0);
  const std::string convert = std::string("\"") + TRAIN_PYTHON + "\" \"" + TRAIN_SOURCE_DIR +
                              "/scripts/torchvision-to-safetensors\" " + tmp / "resnet50.pth" + " " +
                              tmp / "resnet50.safetensors" + " --arch resnet50";
  REQUIRE(std::system(convert.c_str()) == 0);

  auto model = resnet50();
  train::load_model_weights(tmp / "resnet50.safetensors", *model, /*strict=*/true);
  model->eval();
  const auto io = train::read_safetensors(tmp / "resnet50_io.safetensors");
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = model->forward(io.at("input"));
  }
  const double diff = max_abs_diff(logits, io.at("logits"));
  const double scale = io.at("logits").abs().max().item<double>();
  INFO("max |logit diff| " << diff << ", logits up to " << scale);
  // Relative to the logit scale, as in torchvision_resnet50.py (LibTorch 1.13 with OpenBLAS
  // against the wheel's MKL drifts ~2.5e-5 of it); a wrong weight moves logits by O(1).
  CHECK(diff <= 1e-4 * std::max(1.0, scale));

  // Fine-tuning on 10 classes, strict (the default): the backbone loads key for key, the new fc
  // keeps its initialisation and train.log says so. Another architecture is still rejected
  // before the run directory exists.
  const std::string cfg = tmp / "finetune.yaml";
  std::ofstream(cfg) << "model: {name: resnet50, num_classes: 10, init_from: " << tmp / "resnet50.safetensors" << "}\n"
                     << "data: {kind: synthetic, channels: 3, image_size: 32, synthetic_train_samples: 8, "
                        "synthetic_val_samples: 4}\n"
                     << "trainer: {global_batch: 4, max_steps: 1, device: cpu}\n"
                     << "optim: {lr: 1.0e-6}\n";  // one step barely moves the weights
  CHECK(cli({"fit", cfg, "--run-dir", tmp / "wrong", "--set", "model.name=resnet34"}) == train::kExitInvalid);
  CHECK_FALSE(files::exists(tmp / "wrong"));
  REQUIRE(cli({"fit", cfg, "--run-dir", tmp / "run"}) == train::kExitOk);
  const std::string log = read_text(tmp / "run/train.log");
  CHECK_THAT(log, Contains("loaded 318 of 320 model tensors; the task head keeps its initialisation (train it before "
                           "use): fc.bias: file [1000], model [10], fc.weight: file [1000,2048], model [10,2048]"));
  // The backbone really came from the file: conv1 of the final checkpoint is still close to it,
  // unlike a fresh initialisation.
  auto tuned = resnet50(10);
  const auto fresh_conv1 = train::state_dict(*tuned).at("conv1.weight").clone();
  train::load_model_weights(train::latest_checkpoint(tmp / "run/checkpoints"), *tuned);
  const auto file_conv1 = train::read_safetensors(tmp / "resnet50.safetensors").at("conv1.weight");
  CHECK(max_abs_diff(train::state_dict(*tuned).at("conv1.weight"), file_conv1) < 0.01);
  CHECK(max_abs_diff(fresh_conv1, file_conv1) > 0.1);
}

TEST_CASE("init_from: malformed safetensors and mismatching checkpoints exit 2 naming the file and key",
          "[safetensors]") {
  TempDir tmp;
  const std::string cfg = tmp / "run.yaml";
  const std::string weights = tmp / "w.safetensors";
  std::ofstream(cfg) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true, "
                        "init_from: " << weights << "}\n"
                     << "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 32, "
                        "synthetic_val_samples: 8}\n"
                     << "trainer: {global_batch: 16, max_steps: 1, device: cpu}\n";
  write_bytes(weights, "garbage!garbage!");
  try {
    train::ModelConfig mc = train::load_config(cfg).model;
    auto model = train::models::make_model(mc);
    train::check_model_weights(weights, *model);
    FAIL("accepted a malformed file");
  } catch (const CheckpointError& e) {
    CHECK_THAT(std::string(e.what()), Contains(weights + ": header length"));
  }
  CHECK(cli({"fit", cfg, "--run-dir", tmp / "run"}) == train::kExitInvalid);
  CHECK_FALSE(files::exists(tmp / "run"));

  // A file with one key renamed: strict names it; the hint names model.init_strict. The model's
  // rules excuse its head (fc) but not the body.
  train::ModelConfig mc = train::load_config(cfg).model;
  auto model = train::models::make_model(mc);
  auto sd = train::state_dict(*model);
  sd["stem.weight"] = sd.at("conv1.weight");
  sd.erase("conv1.weight");
  train::write_safetensors(weights, sd);
  CHECK_THROWS_WITH(train::load_model_weights(weights, *model, true, model->weight_rules()),
                    Contains("missing key 'conv1.weight'") && Contains("unexpected key 'stem.weight'") &&
                        Contains("model.init_strict: false"));
  CHECK(cli({"fit", cfg, "--run-dir", tmp / "run"}) == train::kExitInvalid);
  CHECK_FALSE(files::exists(tmp / "run"));
  CHECK(cli({"fit", cfg, "--run-dir", tmp / "run", "--set", "model.init_strict=false"}) == train::kExitOk);
  CHECK_THAT(read_text(tmp / "run/train.log"), Contains("missing: conv1.weight; unexpected: stem.weight"));
}
