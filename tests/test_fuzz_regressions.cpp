// Inputs the fuzz targets (fuzz/) found to crash, hang or escape as a non-train exception, checked
// here against both LibTorch versions. The files are the regression seeds in fuzz/corpus/.
#include "testing.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "train/checkpoint.h"
#include "train/config.h"
#include "train/data/image_folder.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/safetensors.h"

using Catch::Matchers::Contains;

namespace {

std::string corpus(const std::string& target, const std::string& name) {
  return std::string(TRAIN_SOURCE_DIR) + "/fuzz/corpus/" + target + "/" + name;
}

// The model of the checkpoint seeds (fuzz/make_seeds.cpp).
struct Tiny : torch::nn::Module {
  Tiny() {
    register_module("fc1", torch::nn::Linear(4, 3));
    register_module("bn", torch::nn::BatchNorm1d(3));
    register_module("fc2", torch::nn::Linear(3, 2));
  }
};

// The message of the train::Error fn throws; its exit code must be `code` (config and checkpoint
// errors exit 2, data errors 1).
template <typename Fn>
std::string error_of(Fn&& fn, int code = train::kExitInvalid) {
  try {
    fn();
  } catch (const train::Error& e) {
    CHECK(e.exit_code() == code);
    return e.what();
  }
  FAIL("expected a train::Error");
  return "";
}

// Flips one bit in a stored code/ member of a checkpoint: "class" becomes "cmass".
void damage_code_member(const std::string& path) {
  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string marker = "class ";
  const auto at = std::search(bytes.begin(), bytes.end(), marker.begin(), marker.end());
  REQUIRE(at != bytes.end());
  *(at + 2) ^= 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST_CASE("fuzz: a stray comma in a config is a syntax error, not a hang", "[config][fuzz]") {
  // yaml-cpp 0.7's LoadAll loops forever, allocating, on these.
  auto parse = [](const std::string& yaml) { return error_of([&] { train::parse_config(yaml, "test.yaml"); }); };
  CHECK_THAT(parse(",\n"), Contains("test.yaml:1:1: invalid YAML: unexpected ','"));
  CHECK_THAT(parse("  a: 1\n,\nb: 2\n"), Contains("test.yaml:2:1: invalid YAML: unexpected ','"));
}

TEST_CASE("fuzz: an image header claiming a huge size is refused before decoding", "[data][image_folder][fuzz]") {
  for (const char* name : {"png-claims-1000000x1000000.png", "jpeg-claims-65500x65500.jpg"}) {
    CAPTURE(name);
    CHECK_THAT(error_of([&] { train::data::decode_image(corpus("image", name)); }, train::kExitData),
               Contains(name) && Contains("decompression bomb"));
  }
}

TEST_CASE("fuzz: damaged checkpoints are CheckpointErrors", "[checkpoint][fuzz]") {
  CHECK_THAT(error_of([] { train::read_checkpoint_weights(corpus("checkpoint", "model-entry-not-a-tensor.pt")); }),
             Contains("model entry 'fc1.weight' is not a tensor"));
  Tiny model;
  CHECK_THAT(error_of([&] { train::load_checkpoint(corpus("checkpoint", "state-entry-not-a-tensor.pt"), model, nullptr); }),
             Contains("state entry 'scaler' is not a tensor"));
  // Damaged TorchScript code inside the archive: LibTorch 1.13 crashed (SIGSEGV) or threw its own
  // error type on these.
  for (const char* name : {"regression-damaged-code-segv.pt", "regression-damaged-code-error-report.pt",
                           "regression-pickle-4gib-string.pt", "regression-zip-directory-size-4gib.pt",
                           "regression-local-header-signature.pt"}) {
    CAPTURE(name);
    CHECK_THAT(error_of([&] { train::read_checkpoint_weights(corpus("checkpoint", name)); }), Contains(name));
  }
  // A damaged deflated code/ member (LibTorch 1.13: SIGSEGV), and a damaged 32-bit directory
  // offset that LibTorch ignores for the ZIP64 record's (1.13 then asked for a 2 GiB string).
  CHECK_THAT(error_of([] { train::read_checkpoint_weights(corpus("checkpoint", "regression-deflated-member-damaged.pt")); }),
             Contains("archive member 'archive/code/__torch__.py' ") && Contains("the file is corrupt"));
  Tiny tiny;
  CHECK_THAT(error_of([&] { train::load_checkpoint(corpus("checkpoint", "regression-zip64-record-hides-bad-offset.pt"), tiny, nullptr); }),
             Contains("regression-zip64-record-hides-bad-offset.pt: archive member '") && Contains("fails its CRC-32 check"));
}

TEST_CASE("fuzz: a checkpoint member with a wrong CRC-32 is reported before LibTorch parses it", "[checkpoint][fuzz]") {
  const std::string dir = train::files::make_temp_directory("train-crc");
  const std::string path = train::files::join(dir, "step_00000001.pt");
  Tiny model;
  train::save_checkpoint(path, model, nullptr, {});
  train::files::remove_file(path + ".crc32c");  // as if copied without its sidecar
  CHECK(train::read_checkpoint_weights(path).size() == 9);
  damage_code_member(path);
  CHECK_THAT(error_of([&] { train::read_checkpoint_weights(path); }),
             Contains("step_00000001.pt: archive member '") && Contains("fails its CRC-32 check"));
  train::files::remove_all(dir);
}

TEST_CASE("a checkpoint whose zip directory is in ZIP64 form is checked and loads without its sidecar", "[checkpoint][fuzz]") {
  // Checkpoints over 4 GiB have this form; here a small one is rewritten into it.
  const std::string dir = train::files::make_temp_directory("train-zip64");
  const std::string plain = train::files::join(dir, "plain.pt"), zip64 = train::files::join(dir, "step_00000001.pt");
  Tiny model;
  train::save_checkpoint(plain, model, nullptr, {});
  REQUIRE(train::testing::run_python("zip64_directory.py", "\"" + plain + "\" \"" + zip64 + "\"") == 0);
  REQUIRE_FALSE(train::files::exists(zip64 + ".crc32c"));
  Tiny loaded;
  train::load_checkpoint(zip64, loaded, nullptr);
  CHECK(torch::equal(loaded.named_parameters()["fc1.weight"], model.named_parameters()["fc1.weight"]));
  // The check reads the ZIP64 fields: damage in a member is still found.
  damage_code_member(zip64);
  CHECK_THAT(error_of([&] { train::read_checkpoint_weights(zip64); }), Contains("fails its CRC-32 check"));
  train::files::remove_all(dir);
}

TEST_CASE("fuzz: a safetensors header with a number too large for 64 bits is invalid JSON, not a crash", "[safetensors][fuzz]") {
  // nlohmann::json throws out_of_range, not parse_error, on such a number.
  CHECK_THAT(error_of([] { train::read_safetensors(corpus("safetensors", "regression-number-overflow.safetensors")); }),
             Contains("regression-number-overflow.safetensors: header is not valid JSON") && Contains("number overflow"));
}
