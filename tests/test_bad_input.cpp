// The bad-input battery: malformed configs, data files, checkpoints and command lines, each run
// through the real `train` binary in its own process. Every case must end with the documented
// exit code (2: usage, config, checkpoint; 1: data), a message naming the file (and, for a config,
// the key path and line:column), no crash, and the working directory exactly as it was before:
// no run directory, no checkpoint, no temporary file, and a run directory that predates the
// command unchanged byte for byte.
#include "testing.h"

#include <fcntl.h>
#include <png.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <turbojpeg.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "train/data/token_file.h"
#include "train/files.h"
#include "train/metrics.h"

using Catch::Matchers::Contains;
namespace files = train::files;

namespace {

const std::string kTrain = std::string(TRAIN_BINARY_DIR) + "/bin/train";

// ---- files ---------------------------------------------------------------------------------------

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void put(const std::string& path, const std::string& bytes) {
  files::make_directories(files::parent(path));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  REQUIRE(out.good());
}

std::string bytes_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
}

// An unsigned-byte IDX file: images [n, rows, cols] or labels [n].
std::string idx_images(uint32_t n, uint32_t side) {
  std::string out = be32(0x803) + be32(n) + be32(side) + be32(side);
  for (uint32_t i = 0; i < n * side * side; ++i) out.push_back(static_cast<char>((i * 7 + i / 784) % 256));
  return out;
}
std::string idx_labels(uint32_t n, uint8_t classes = 10) {
  std::string out = be32(0x801) + be32(n);
  for (uint32_t i = 0; i < n; ++i) out.push_back(static_cast<char>(i % classes));
  return out;
}

std::string jpeg(int side, int variant) {
  std::vector<uint8_t> rgb(static_cast<size_t>(side) * side * 3);
  for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<uint8_t>((i * (variant + 3)) % 251);
  const std::unique_ptr<void, int (*)(tjhandle)> handle(tjInitCompress(), &tjDestroy);
  REQUIRE(handle);
  unsigned char* data = nullptr;
  unsigned long size = 0;
  REQUIRE(tjCompress2(handle.get(), rgb.data(), side, 0, side, TJPF_RGB, &data, &size, TJSAMP_420, 90, 0) == 0);
  std::string out(reinterpret_cast<const char*>(data), size);
  tjFree(data);
  return out;
}

std::string png(int side) {
  std::vector<uint8_t> rgb(static_cast<size_t>(side) * side * 3, 128);
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = image.height = static_cast<png_uint_32>(side);
  image.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  REQUIRE(png_image_write_to_memory(&image, nullptr, &size, 0, rgb.data(), 0, nullptr) != 0);
  std::vector<uint8_t> out(size);
  REQUIRE(png_image_write_to_memory(&image, out.data(), &size, 0, rgb.data(), 0, nullptr) != 0);
  return bytes_of(out);
}

// Every file and directory under `root`, with its bytes: the before/after picture of a case.
std::map<std::string, std::string> tree(const std::string& root, const std::string& rel = "") {
  std::map<std::string, std::string> out;
  for (const std::string& name : files::list_directory(files::join(root, rel))) {
    const std::string child = rel.empty() ? name : rel + "/" + name;
    const std::string path = files::join(root, child);
    if (files::is_directory(path)) {
      out[child + "/"] = "";
      for (auto& [k, v] : tree(root, child)) out[k] = std::move(v);
    } else {
      out[child] = slurp(path);
    }
  }
  return out;
}

std::string tree_diff(const std::map<std::string, std::string>& before,
                      const std::map<std::string, std::string>& after) {
  std::string diff;
  for (const auto& [path, bytes] : after) {
    const auto it = before.find(path);
    if (it == before.end()) diff += "  created " + path + "\n";
    else if (it->second != bytes) diff += "  changed " + path + "\n";
  }
  for (const auto& [path, bytes] : before) {
    if (!after.count(path)) diff += "  removed " + path + "\n";
  }
  return diff;
}

// ---- the train binary ----------------------------------------------------------------------------

struct Outcome {
  int exit_code = -1;    // -1 when killed by a signal
  int signal = 0;
  bool timed_out = false;
  std::string out, err;
};

// Runs bin/train with `args` in directory `cwd`; stdout and stderr go to files under `logs`.
Outcome run_train(const std::vector<std::string>& args, const std::string& cwd, const std::string& logs) {
  const std::string out_path = files::join(logs, "stdout"), err_path = files::join(logs, "stderr");
  std::vector<std::string> argv_storage{kTrain};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // only async-signal-safe calls until exec
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0 || ::chdir(cwd.c_str()) != 0) ::_exit(120);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
    ::execv(kTrain.c_str(), argv.data());
    ::_exit(121);
  }
  Outcome o;
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid || done < 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      o.timed_out = true;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) o.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) o.signal = WTERMSIG(status);
  o.out = slurp(out_path);
  o.err = slurp(err_path);
  return o;
}

// ---- shared data -----------------------------------------------------------------------------------

constexpr int kExitConfig = 2;  // usage, config, checkpoint
constexpr int kExitData = 1;    // data files

// Valid data every case starts from, and a finished run with a checkpoint, made once.
struct Shared {
  std::string root = files::make_temp_directory("train_bad_input_");
  std::string idx = files::join(root, "idx");        // 28x28 IDX, 32 train / 16 val images
  std::string folder = files::join(root, "folder");  // ImageFolder: 2 classes x 4 JPEGs + a PNG
  std::string tokens = files::join(root, "tokens");  // token files + vocab.txt
  std::string tsv = files::join(root, "tsv");        // TSV + vocab.txt
  std::string mlp_checkpoint;                        // an mlp run's checkpoint (with its .crc32c)

  Shared() {
    put(files::join(idx, "train-images-idx3-ubyte"), idx_images(32, 28));
    put(files::join(idx, "train-labels-idx1-ubyte"), idx_labels(32));
    put(files::join(idx, "t10k-images-idx3-ubyte"), idx_images(16, 28));
    put(files::join(idx, "t10k-labels-idx1-ubyte"), idx_labels(16));
    for (const char* split : {"train", "val"}) {
      for (const char* cls : {"ant", "bee"}) {
        for (int i = 0; i < 2; ++i) {
          put(files::join(folder, std::string(split) + "/" + cls + "/" + std::to_string(i) + ".jpg"), jpeg(32, i));
        }
      }
    }
    put(files::join(folder, "train/bee/2.png"), png(32));

    std::string vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n";
    for (int i = 0; i < 45; ++i) vocab += "w" + std::to_string(i) + "\n";
    put(files::join(tokens, "vocab.txt"), vocab);
    std::vector<std::vector<int64_t>> docs;
    for (int d = 0; d < 16; ++d) {
      docs.emplace_back();
      for (int t = 0; t < 10 + d; ++t) docs.back().push_back(5 + (d * 7 + t * 3) % 45);
    }
    train::data::TokenFileOptions options;
    options.vocab_size = 50;
    options.special = {0, 1, 2, 3, 4};
    train::data::write_token_file(files::join(tokens, "train.tokens"), docs, options);
    train::data::write_token_file(files::join(tokens, "val.tokens"), docs, options);

    put(files::join(tsv, "vocab.txt"), "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\ndog\nsat\n");
    put(files::join(tsv, "train.tsv"), "the cat sat\tpos\nthe dog\tneg\nthe cat\tpos\ndog sat\tneg\n");
    put(files::join(tsv, "val.tsv"), "the cat\tpos\nthe dog\tneg\n");

    // A good run, for its checkpoint.
    const std::string dir = files::join(root, "good");
    files::make_directories(dir);
    put(files::join(dir, "mlp.yaml"), idx_config());
    const Outcome o = run_train({"fit", "mlp.yaml", "--run-dir", "run"}, dir, dir);
    INFO(o.err);
    REQUIRE(o.exit_code == 0);
    mlp_checkpoint = files::join(dir, "run/checkpoints/step_00000001.pt");
    REQUIRE(files::exists(mlp_checkpoint));
    REQUIRE(files::exists(mlp_checkpoint + ".crc32c"));
  }
  ~Shared() { files::remove_all(root); }

  // An MLP on the IDX files; block style, so that lines and columns are known:
  //   1 model:            5 data:                 9 trainer:
  //   2   name: mlp       6   kind: idx          10   global_batch: 8
  //   3   in_channels: 1  7   root: <idx>        11   max_steps: 1
  //   4   num_classes: 10 8   workers: 0         12   device: cpu
  //                                              13 logging:
  //                                              14   tensorboard: false
  std::string idx_config(const std::string& root_dir = "") const {
    return "model:\n  name: mlp\n  in_channels: 1\n  num_classes: 10\n"
           "data:\n  kind: idx\n  root: " + (root_dir.empty() ? idx : root_dir) + "\n  workers: 0\n"
           "trainer:\n  global_batch: 8\n  max_steps: 1\n  device: cpu\n"
           "logging:\n  tensorboard: false\n";
  }
  // LeNet on 28x28 crops of the ImageFolder images, one loader worker thread.
  std::string folder_config(const std::string& root_dir) const {
    return "model: {name: lenet, in_channels: 3, num_classes: 2}\n"
           "data: {kind: image_folder, root: " + root_dir + ", image_size: 28, workers: 1, shuffle: false}\n"
           "trainer: {global_batch: 4, max_steps: 1, device: cpu}\n"
           "logging: {tensorboard: false}\n";
  }
  std::string tokens_config(const std::string& root_dir, const std::string& extra_data = "") const {
    return "model: {name: bert-mlm, preset: bert-tiny, vocab_size: 50, max_positions: 16}\n"
           "data: {kind: tokens, root: " + root_dir + ", vocab_file: vocab.txt, seq_len: 16" + extra_data + "}\n"
           "trainer: {global_batch: 4, max_steps: 1, device: cpu}\n"
           "logging: {tensorboard: false}\n";
  }
  std::string tsv_config(const std::string& root_dir) const {
    return "model: {name: bert-classifier, preset: bert-tiny, vocab_size: 9, max_positions: 16, num_classes: 2}\n"
           "data: {kind: tsv, root: " + root_dir + ", vocab_file: vocab.txt, seq_len: 16}\n"
           "trainer: {global_batch: 2, max_steps: 1, device: cpu}\n"
           "logging: {tensorboard: false}\n";
  }
};

Shared& shared() {
  static Shared s;
  return s;
}

// ---- cases -------------------------------------------------------------------------------------------

// A case's own directory: the working directory of the command, in which it writes its files.
struct CaseDir {
  std::string path;
  std::string operator/(const std::string& name) const { return files::join(path, name); }
  std::string write(const std::string& name, const std::string& bytes) const {
    put(*this / name, bytes);
    return *this / name;
  }
  // A copy of a shared data directory, to be damaged.
  std::string copy_of(const std::string& from, const std::string& name) const {
    for (const auto& [rel, bytes] : tree(from)) {
      if (rel.back() == '/') files::make_directories(*this / (name + "/" + rel));
      else write(name + "/" + rel, bytes);
    }
    return *this / name;
  }
};

struct Invocation {
  std::vector<std::string> args;
  std::vector<std::string> expect;  // substrings of stderr: the file, key, line:column, the problem
};

struct Case {
  std::string name;
  int exit_code;
  std::function<Invocation(const CaseDir&)> make;
};

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

std::string cut(const std::string& bytes, size_t keep) { return bytes.substr(0, keep); }

void run_case(const Case& c) {
  Shared& s = shared();
  CaseDir dir{files::make_temp_directory("train_bad_input_case_")};
  const std::string logs = files::make_temp_directory("train_bad_input_logs_");
  const Invocation inv = c.make(dir);
  const auto before = tree(dir.path);
  const auto t0 = std::chrono::steady_clock::now();
  const Outcome o = run_train(inv.args, dir.path, logs);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string command = "train";
  for (const auto& a : inv.args) command += " " + a;
  INFO("case: " << c.name << "\ncommand (in " << dir.path << "): " << command << "\nstderr:\n" << o.err
                << "stdout:\n" << o.out << "seconds: " << seconds);
  CHECK_FALSE(o.timed_out);
  CHECK(o.signal == 0);
  CHECK(o.exit_code == c.exit_code);
  for (const std::string& e : inv.expect) CHECK_THAT(o.err, Contains(e));
  for (const char* crash : {"terminate called", "Segmentation fault", "Aborted", "AddressSanitizer",
                            "runtime error:", "core dumped", "Exception raised from"}) {
    CHECK_THAT(o.err, !Contains(crash));
  }
  const std::string diff = tree_diff(before, tree(dir.path));
  INFO("the command changed its directory:\n" << diff);
  CHECK(diff.empty());
  files::remove_all(dir.path);
  files::remove_all(logs);
  (void)s;
}

void run_cases(const std::vector<Case>& cases) {
  shared();  // outside any section: made once
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) { run_case(c); }
  }
}

}  // namespace

// ---- configs: exit 2, naming the file, line:column and key -------------------------------------------

TEST_CASE("bad_input: malformed configs exit 2 naming the file line:column and key", "[bad_input][process]") {
  const Shared& s = shared();
  const std::string base = s.idx_config();
  // cfg(d, text) writes cfg.yaml into the case directory.
  auto fit = [](const CaseDir& d, const std::string& text, std::vector<std::string> expect,
                std::vector<std::string> extra = {}) {
    d.write("cfg.yaml", text);
    std::vector<std::string> args{"fit", "cfg.yaml"};
    args.insert(args.end(), extra.begin(), extra.end());
    expect.insert(expect.begin(), "cfg.yaml");
    return Invocation{args, expect};
  };
  std::vector<Case> cases = {
      {"wrong type: a string for an int", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "global_batch: 8", "global_batch: \"eight\""),
                    {"cfg.yaml:10:17", "trainer.global_batch", "expected an int", "\"eight\""});
       }},
      {"wrong type: a float for an int", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "max_steps: 1", "max_steps: 1.5"),
                    {"cfg.yaml:11:14", "trainer.max_steps", "expected an int"});
       }},
      {"wrong type: a list for a map", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, base + "optim: [sgd, 0.1]\n", {"cfg.yaml:15:8", "'optim'", "expected a map", "a list"});
       }},
      {"wrong type: a bool for a float", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, base + "optim:\n  lr: true\n", {"cfg.yaml:16:7", "optim.lr", "expected a float"});
       }},
      {"wrong type: a map for a string", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "name: mlp", "name: {arch: mlp}"),
                    {"cfg.yaml:2:9", "model.name", "expected a string", "a map"});
       }},
      {"wrong type: a scalar for a list", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "workers: 0", "workers: 0\n  mean: 0.5"),
                    {"cfg.yaml:9:9", "data.mean", "expected a list of floats"});
       }},
      {"unknown top-level key", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, base + "optimizer:\n  lr: 0.1\n",
                    {"cfg.yaml:15:1", "optimizer", "unknown section", "did you mean 'optim'"});
       }},
      {"unknown nested key", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "max_steps: 1", "max_step: 1"),
                    {"cfg.yaml:11:3", "trainer.max_step", "unknown key", "did you mean"});
       }},
      {"zero global batch", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "global_batch: 8", "global_batch: 0"),
                    {"cfg.yaml:10:17", "trainer.global_batch", "must be in [1, 16777216]"});
       }},
      {"negative epochs", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "max_steps: 1", "epochs: -1"), {"cfg.yaml:11:11", "trainer.epochs", "[0, 1000000]"});
       }},
      {"zero learning rate", kExitConfig,
       [&](const CaseDir& d) { return fit(d, base + "optim: {lr: 0}\n", {"cfg.yaml:15:13", "optim.lr", "> 0"}); }},
      {"data.kind custom (a library program's datasets) in the train command", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "kind: idx", "kind: custom"),
                    {"cfg.yaml:6:9", "data.kind", "'custom' names datasets that a program linking train::train passes"});
       }},
      {"negative loader workers", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "workers: 0", "workers: -3"), {"cfg.yaml:8:12", "data.workers", "[-1, 1024]"});
       }},
      {"negative image size", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "workers: 0", "image_size: -28"), {"cfg.yaml:8:15", "data.image_size", "[0, 16384]"});
       }},
      {"out of range: momentum 1.5", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, base + "optim: {momentum: 1.5}\n", {"cfg.yaml:15:19", "optim.momentum", "1.5"});
       }},
      {"not one of the allowed values", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, base + "optim: {name: adam}\n", {"cfg.yaml:15:15", "optim.name", "did you mean 'adamw'"});
       }},
      {"global batch that micro x accum x world cannot make", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, base + "tuning:\n  micro_batch: 3\n",
                    {"cfg.yaml:16:16", "tuning.micro_batch", "does not divide the per-rank batch 8"});
       }},
      {"global batch larger than the training set", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "global_batch: 8", "global_batch: 64"),
                    {"cfg.yaml:10:17", "trainer.global_batch", "larger than the training set (32 samples)"});
       }},
      {"unknown model, found after parsing", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "name: mlp", "name: resnet19"),
                    {"cfg.yaml:2:9", "model.name", "did you mean 'resnet18'"});
       }},
      {"image size that the IDX files do not have", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "workers: 0", "image_size: 32"),
                    {"cfg.yaml:8:15", "data.image_size", "28x28"});
       }},
      {"model channels that the data does not have", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "in_channels: 1", "in_channels: 3"),
                    {"cfg.yaml:3:16", "model.in_channels", "1 channel"});
       }},
      {"invalid device", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "device: cpu", "device: gpu"), {"cfg.yaml:12:11", "trainer.device", "'gpu'"});
       }},
      {"YAML syntax error", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, base + "optim: {lr: 0.1\n", {"cfg.yaml:16", "invalid YAML"});
       }},
      {"a line indented with a tab", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "  in_channels: 1", "\tin_channels: 1"),
                    {"cfg.yaml:3", "invalid YAML", "(line 3 is indented with a tab; YAML indents with spaces)"});
       }},
      {"duplicate key", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "max_steps: 1", "max_steps: 1\n  max_steps: 2"),
                    {"cfg.yaml:12:3", "trainer.max_steps", "duplicate key (first given at 11:3)"});
       }},
      {"empty config", kExitConfig, [&](const CaseDir& d) { return fit(d, "# nothing yet\n", {"empty config"}); }},
      {"required key missing", kExitConfig,
       [&](const CaseDir& d) {
         return fit(d, replace(base, "  global_batch: 8\n", ""), {"trainer.global_batch", "required key is missing"});
       }},
      {"missing config file", kExitConfig,
       [&](const CaseDir&) {
         return Invocation{{"fit", "nowhere.yaml"}, {"nowhere.yaml", "cannot open config file"}};
       }},
      {"config path is a directory", kExitConfig,
       [&](const CaseDir& d) {
         files::make_directories(d / "configs");
         return Invocation{{"check", "configs"}, {"configs", "is a directory"}};
       }},
      {"check: a config with an out-of-range value", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", base + "loss: {label_smoothing: 1}\n");
         return Invocation{{"check", "cfg.yaml"}, {"cfg.yaml:15:25", "loss.label_smoothing"}};
       }},
  };
  run_cases(cases);
}

// ---- the command line: exit 2 --------------------------------------------------------------------------

TEST_CASE("bad_input: bad --set overrides and flags exit 2", "[bad_input][process]") {
  const Shared& s = shared();
  auto with_config = [&s](const CaseDir& d, std::vector<std::string> args, std::vector<std::string> expect) {
    d.write("cfg.yaml", s.idx_config());
    return Invocation{std::move(args), std::move(expect)};
  };
  std::vector<Case> cases = {
      {"--set of an unknown key", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--set", "optim.lrr=0.1"},
                            {"--set optim.lrr=0.1", "optim.lrr", "did you mean 'optim.lr'"});
       }},
      {"--set with a value of the wrong type", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--set", "trainer.max_steps=many"},
                            {"--set trainer.max_steps=many", "trainer.max_steps", "expected an int"});
       }},
      {"--set without a value", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--set", "trainer.max_steps"},
                            {"--set trainer.max_steps", "expected key=value"});
       }},
      {"--set making the batch arithmetic inexact", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--set", "tuning.micro_batch=5"},
                            {"--set tuning.micro_batch=5", "tuning.micro_batch", "does not divide"});
       }},
      {"plan: a global batch that the world size does not divide", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"plan", "cfg.yaml", "--world-size", "3"},
                            {"cfg.yaml:10:17", "trainer.global_batch", "not divisible by the world size 3"});
       }},
      {"unknown flag", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--frobnicate"},
                            {"train fit: unknown option '--frobnicate' (train fit --help lists its options)"});
       }},
      {"misspelt flag", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--resum", "auto"},
                            {"train fit: unknown option '--resum'; did you mean '--resume'?"});
       }},
      {"misspelt flag with its value after '='", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"plan", "cfg.yaml", "--world_size=2"},
                            {"train plan: unknown option '--world_size'; did you mean '--world-size'?"});
       }},
      {"a second config file", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "other.yaml"},
                            {"train fit: unexpected argument 'other.yaml' (usage: train fit CONFIG [OPTIONS]"});
       }},
      {"unknown subcommand", kExitConfig,
       [&](const CaseDir& d) { return with_config(d, {"fitt", "cfg.yaml"}, {"unknown command 'fitt'", "did you mean 'fit'"}); }},
      {"eval without --checkpoint", kExitConfig,
       [&](const CaseDir& d) { return with_config(d, {"eval", "cfg.yaml"}, {"--checkpoint"}); }},
      {"launch with --nproc 0", kExitConfig,
       [&](const CaseDir& d) { return with_config(d, {"launch", "--nproc", "0", "cfg.yaml"}, {"--nproc"}); }},
      {"launch with a negative --master-port", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"launch", "--nproc", "1", "--master-port", "-5", "cfg.yaml"}, {"--master-port"});
       }},
      {"launch with --master-port above 65535", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"launch", "--nproc", "1", "--master-port", "70000", "cfg.yaml"}, {"--master-port"});
       }},
      {"--run-dir that is empty", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--run-dir", ""}, {"--run-dir: empty; leave it out"});
       }},
      {"--resume naming a safetensors file", kExitConfig,
       [&](const CaseDir& d) {
         d.write("weights.safetensors", "not read\n");
         return with_config(d, {"fit", "cfg.yaml", "--resume", "weights.safetensors"},
                            {"weights.safetensors: a safetensors file holds weights alone",
                             "model.init_from: weights.safetensors"});
       }},
      {"--run-dir whose checkpoints is a file", kExitConfig,
       [&](const CaseDir& d) {
         d.write("mine/checkpoints", "the user's file\n");
         return with_config(d, {"fit", "cfg.yaml", "--run-dir", "mine"},
                            {"run directory mine: mine/checkpoints is a file, where the run writes its checkpoints "
                             "directory"});
       }},
      {"--run-dir that is a symbolic link to nothing", kExitConfig,
       [&](const CaseDir& d) {
         REQUIRE(::symlink("gone", (d / "dangling").c_str()) == 0);
         return with_config(d, {"fit", "cfg.yaml", "--run-dir", "dangling"},
                            {"run directory dangling: dangling is a symbolic link to nothing"});
       }},
      {"the config is the run directory's config.yaml, written by hand", kExitConfig,
       [&](const CaseDir& d) {
         d.write("mine/config.yaml", "# my notes\n" + s.idx_config());
         return Invocation{{"fit", "mine/config.yaml", "--run-dir", "mine"},
                           {"mine/config.yaml is the run directory's config.yaml, which the run replaces"}};
       }},
      {"--run-dir that is an existing file", kExitConfig,
       [&](const CaseDir& d) {
         d.write("notes.txt", "the user's file\n");
         return with_config(d, {"fit", "cfg.yaml", "--run-dir", "notes.txt"}, {"run directory notes.txt: is a file", "(--run-dir, FitOptions::run_dir)"});
       }},
      {"--run-dir under an existing file", kExitConfig,
       [&](const CaseDir& d) {
         d.write("notes.txt", "the user's file\n");
         return with_config(d, {"fit", "cfg.yaml", "--run-dir", "notes.txt/run"}, {"notes.txt/run", "is a file"});
       }},
      // A value is one whole YAML value: nothing after it is dropped, no bare comma is an empty value.
      {"--set with text after a list", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--set", "data.mean=[0.5] junk"},
                            {"--set data.mean=[0.5] junk", "data.mean", "unexpected text after the value"});
       }},
      {"--set with text after a quoted string", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--set", "model.name='mlp' junk"},
                            {"--set model.name='mlp' junk", "model.name", "unexpected text after the value"});
       }},
      {"--set of a bare comma to a list", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--set", "data.mean=,"}, {"--set data.mean=,", "data.mean", "','"});
       }},
      {"--set of a bare comma to a string", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"fit", "cfg.yaml", "--set", "data.root=,"}, {"--set data.root=,", "data.root", "','"});
       }},
      {"--set of an out-of-range CUDA index (plan)", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"plan", "cfg.yaml", "--set", "trainer.device=cuda:99999999999999999999"},
                            {"--set trainer.device=cuda:99999999999999999999", "trainer.device", "out of range"});
       }},
      {"--set of an out-of-range CUDA index (check)", kExitConfig,
       [&](const CaseDir& d) {
         return with_config(d, {"check", "cfg.yaml", "--set", "trainer.device=cuda:99999999999999999999"},
                            {"trainer.device", "out of range"});
       }},
  };
  // Values past each key's upper bound, which used to overflow downstream (a SIGFPE in the loader,
  // bad_alloc, a negative step count that "finished" at once, a negative timeout, ...).
  for (const std::vector<std::string>& sets :
       std::vector<std::vector<std::string>>{{"data.workers=4294967296", "data.prefetch=4294967296"},
                                             {"data.prefetch=1000000000000"},
                                             {"trainer.epochs=9223372036854775807"},
                                             {"schedule.warmup_epochs=1e300"},
                                             {"data.seq_len=9223372036854775807"},
                                             {"distributed.init_timeout_s=1e300"},
                                             {"trainer.threads=2147483648"},
                                             {"model.width=1e300"},
                                             {"data.image_size=3000000000"}}) {
    cases.push_back({"--set past the upper bound: " + sets.front(), kExitConfig, [&s, sets](const CaseDir& d) {
                       d.write("cfg.yaml", s.idx_config());
                       std::vector<std::string> args{"fit", "cfg.yaml"};
                       for (const std::string& set : sets) args.insert(args.end(), {"--set", set});
                       const std::string key = sets.front().substr(0, sets.front().find('='));
                       return Invocation{args, {"--set " + sets.front(), "key '" + key + "'", "must be in"}};
                     }});
  }
  run_cases(cases);
}

// ---- model and data that do not fit each other: exit 2 before anything is written -------------------

TEST_CASE("bad_input: models and data that do not fit each other exit 2 naming the key", "[bad_input][process]") {
  const Shared& s = shared();
  std::vector<Case> cases = {
      {"mlp on 8x8 synthetic images", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", "model:\n  name: mlp\n  in_channels: 1\n  num_classes: 10\n"
                             "data:\n  kind: synthetic\n  image_size: 8\n  workers: 0\n"
                             "trainer:\n  global_batch: 8\n  max_steps: 1\n  device: cpu\n"
                             "logging:\n  tensorboard: false\n");
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:7:15", "data.image_size", "28x28", "8x8"}};
       }},
      {"BERT samples longer than its position embeddings", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", replace(s.tokens_config(s.tokens), "seq_len: 16", "seq_len: 32"));
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:2:", "data.seq_len", "32 tokens", "16 position embeddings"}};
       }},
      {"BERT samples longer than its position embeddings (check)", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", replace(s.tokens_config(s.tokens), "seq_len: 16", "seq_len: 32"));
         return Invocation{{"check", "cfg.yaml"}, {"cfg.yaml:2:", "data.seq_len"}};
       }},
      {"BERT vocabulary smaller than the token data's", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", replace(s.tokens_config(s.tokens), "vocab_size: 50", "vocab_size: 20, num_classes: 50"));
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:1:56", "model.vocab_size", "50 tokens"}};
       }},
      {"BERT vocabulary smaller than the TSV data's vocab file", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", replace(s.tsv_config(s.tsv), "vocab_size: 9", "vocab_size: 5"));
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:1:63", "model.vocab_size", "9 tokens"}};
       }},
      {"BERT heads that do not divide the hidden size (check)", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", replace(s.tokens_config(s.tokens), "max_positions: 16", "max_positions: 16, heads: 3"));
         return Invocation{{"check", "cfg.yaml"}, {"cfg.yaml:1:86", "model.heads", "do not divide the hidden size 128"}};
       }},
      {"BERT hidden size that the heads do not divide", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.tokens_config(s.tokens));
         return Invocation{{"fit", "cfg.yaml", "--set", "model.hidden_size=7"},
                           {"--set model.hidden_size=7", "model.hidden_size", "not a multiple"}};
       }},
      // Checked against the model before anything is written, and by `train check` too.
      {"checkpoint.best that the model's evaluations do not report", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.idx_config());
         return Invocation{{"fit", "cfg.yaml", "--set", "checkpoint.best=perplexity"},
                           {"--set checkpoint.best=perplexity", "key 'checkpoint.best': 'perplexity' is not a measure "
                            "of model mlp's evaluations (they report: loss, accuracy, top5)"}};
       }},
      {"checkpoint.best that the model's evaluations do not report (check)", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.idx_config() + "checkpoint: {best: perplexity}\n");
         return Invocation{{"check", "cfg.yaml"}, {"cfg.yaml:15:20", "key 'checkpoint.best'"}};
       }},
      {"model.num_classes below an ImageFolder's classes, which are listed", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", replace(s.folder_config(s.folder), "num_classes: 2", "num_classes: 1"));
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:1:51", "key 'model.num_classes': 1", "has 2 classes: ant, bee"}};
       }},
      {"checkpoint.best top5 with two classes", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.folder_config(s.folder) + "checkpoint: {best: top5}\n");
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:5:20", "top5 needs more than five classes, the data has 2"}};
       }},
      // Values that contradict the token file are the keys' errors, not the file's.
      {"data.pad_id outside the token file's vocabulary", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.tokens_config(s.tokens));
         return Invocation{{"fit", "cfg.yaml", "--set", "data.pad_id=1000"},
                           {"--set data.pad_id=1000", "key 'data.pad_id'", "train.tokens"}};
       }},
      {"data.vocab_size below the token file's vocabulary", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.tokens_config(s.tokens));
         return Invocation{{"fit", "cfg.yaml", "--set", "data.vocab_size=10"},
                           {"--set data.vocab_size=10", "key 'data.vocab_size'", "50 tokens"}};
       }},
      // BERT's vocab.txt has [MASK] at 103: data.vocab_size 100 leaves it out, whatever the token file says.
      {"data.vocab_size below the vocab file's [MASK] id", kExitConfig,
       [&](const CaseDir& d) {
         std::string vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n";
         for (int i = 4; i < 110; ++i) vocab += i == 103 ? std::string("[MASK]\n") : "w" + std::to_string(i) + "\n";
         d.write("tokens/vocab.txt", vocab);
         train::data::TokenFileOptions options;
         options.vocab_size = 100;
         const std::vector<std::vector<int64_t>> docs = {{10, 11, 12, 13}, {20, 21, 22}, {30, 31}, {40, 41, 42}};
         for (const char* split : {"train.tokens", "val.tokens"}) {
           train::data::write_token_file(d / ("tokens/" + std::string(split)), docs, options);
         }
         d.write("cfg.yaml", replace(s.tokens_config(d / "tokens", ", vocab_size: 100"), "vocab_size: 50", "vocab_size: 128"));
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:2:", "key 'data.vocab_size'", "vocab.txt", "110 tokens"}};
       }},
  };
  run_cases(cases);
}

// ---- a failure that is not one of train's errors, mid-run: the run directory is put back ------------------

TEST_CASE("bad_input: a LibTorch error before the first checkpoint leaves no run directory", "[bad_input][process]") {
  std::vector<Case> cases = {
      // BatchNorm in training needs more than one value per channel: ResNet's first one gets a
      // single 1x1 image. LibTorch's c10::Error (not a train::Error) stops the first step.
      {"ResNet on a batch of one 1x1 image", kExitData,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", "model: {name: resnet18, in_channels: 1, num_classes: 10, small_input: true}\n"
                             "data: {kind: synthetic, image_size: 1, workers: 0}\n"
                             "trainer: {global_batch: 1, max_steps: 1, device: cpu}\n"
                             "logging: {tensorboard: false}\n");
         return Invocation{{"fit", "cfg.yaml"}, {"removed runs, which this run created"}};
       }},
  };
  run_cases(cases);
}

// ---- named pipes: rejected, never opened (a read would wait for a writer forever) ----------------------

TEST_CASE("bad_input: a named pipe given as a config or data file is rejected at once", "[bad_input][process]") {
  const Shared& s = shared();
  // The pipes live outside the case directories, whose files the harness reads.
  const std::string pipes = files::join(s.root, "pipes");
  files::make_directories(pipes);
  auto fifo = [&pipes](const std::string& name) {
    const std::string path = files::join(pipes, name);
    if (!files::exists(path)) REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
    return path;
  };
  std::vector<Case> cases = {
      {"config file that is a named pipe", kExitConfig,
       [&](const CaseDir&) {
         const std::string config = fifo("cfg.yaml");
         return Invocation{{"check", config}, {config, "named pipe"}};
       }},
      {"vocab file that is a named pipe", kExitData,
       [&](const CaseDir& d) {
         const std::string vocab = fifo("vocab.txt");
         d.write("cfg.yaml", replace(s.tokens_config(s.tokens), "vocab_file: vocab.txt", "vocab_file: " + vocab));
         return Invocation{{"fit", "cfg.yaml"}, {vocab, "named pipe"}};
       }},
      {"token file that is a named pipe", kExitData,
       [&](const CaseDir& d) {
         const std::string tokens = fifo("train.tokens");
         d.write("cfg.yaml", replace(s.tokens_config(s.tokens), "seq_len: 16", "seq_len: 16, train_tokens: " + tokens));
         return Invocation{{"fit", "cfg.yaml"}, {tokens, "named pipe"}};
       }},
      {"TSV file that is a named pipe", kExitData,
       [&](const CaseDir& d) {
         const std::string tsv = fifo("train.tsv");
         d.write("cfg.yaml", replace(s.tsv_config(s.tsv), "seq_len: 16", "seq_len: 16, train_tsv: " + tsv));
         return Invocation{{"fit", "cfg.yaml"}, {tsv, "named pipe"}};
       }},
  };
  run_cases(cases);
}

// ---- data files: exit 1, naming the file ----------------------------------------------------------------

TEST_CASE("bad_input: missing truncated or malformed data files exit 1 naming the file",
          "[bad_input][process]") {
  const Shared& s = shared();
  // A copy of the IDX directory with one file replaced, and a config pointing at it.
  auto idx_with = [&s](const CaseDir& d, const std::string& file, const std::optional<std::string>& bytes,
                       std::vector<std::string> expect) {
    const std::string root = d.copy_of(s.idx, "idx");
    if (bytes) d.write("idx/" + file, *bytes);
    else files::remove_file(files::join(root, file));
    d.write("cfg.yaml", s.idx_config(root));
    expect.insert(expect.begin(), files::join(root, file));
    return Invocation{{"fit", "cfg.yaml"}, expect};
  };
  const std::string images = idx_images(32, 28), labels = idx_labels(32);
  std::vector<Case> cases = {
      {"missing data directory", kExitData,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.idx_config(d / "no-such-dir"));
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:7:9: key 'data.root': " + d / "no-such-dir" + " does not exist\n"}};
       }},
      {"missing IDX labels file", kExitData,
       [&](const CaseDir& d) {
         return idx_with(d, "train-labels-idx1-ubyte", std::nullopt,
                         {"cfg.yaml: key 'data.train_labels': neither ", "train-labels-idx1-ubyte.gz exists"});
       }},
      {"truncated IDX images", kExitData,
       [&](const CaseDir& d) {
         return idx_with(d, "train-images-idx3-ubyte", cut(images, images.size() - 100), {"truncated", "32x28x28"});
       }},
      {"IDX images cut inside the header", kExitData,
       [&](const CaseDir& d) { return idx_with(d, "train-images-idx3-ubyte", cut(images, 10), {"truncated"}); }},
      {"truncated IDX labels", kExitData,
       [&](const CaseDir& d) { return idx_with(d, "train-labels-idx1-ubyte", cut(labels, 20), {"truncated"}); }},
      {"IDX with the wrong magic number", kExitData,
       [&](const CaseDir& d) {
         return idx_with(d, "train-images-idx3-ubyte", be32(0x0801) + images.substr(4), {"bad magic number"});
       }},
      {"IDX labels and images of different counts", kExitData,
       [&](const CaseDir& d) {
         return idx_with(d, "train-labels-idx1-ubyte", idx_labels(30), {"holds 30 labels", "32 images"});
       }},
      {"IDX label out of range", kExitData,
       [&](const CaseDir& d) {
         std::string bad = labels;
         bad[8 + 5] = 12;
         return idx_with(d, "train-labels-idx1-ubyte", bad, {"label 12 at index 5"});
       }},
      {"IDX with trailing data", kExitData,
       [&](const CaseDir& d) {
         return idx_with(d, "t10k-labels-idx1-ubyte", idx_labels(16) + "xx", {"trailing data"});
       }},
      {"truncated Fashion-MNIST gzip file", kExitData,
       [&](const CaseDir& d) {
         const std::string real = slurp(std::string(TRAIN_FASHION_MNIST_DIR) + "/t10k-labels-idx1-ubyte.gz");
         REQUIRE(real.size() > 1000);
         const std::string root = d.copy_of(s.idx, "idx");
         files::remove_file(files::join(root, "t10k-labels-idx1-ubyte"));
         files::remove_file(files::join(root, "t10k-images-idx3-ubyte"));
         d.write("idx/t10k-labels-idx1-ubyte.gz", cut(real, real.size() / 2));
         d.write("idx/t10k-images-idx3-ubyte", idx_images(10000, 1));  // the count matches; 1x1 images
         d.write("cfg.yaml", s.idx_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/t10k-labels-idx1-ubyte.gz", "truncated"}};
       }},
      {"data.vocab_file that is a directory", kExitData,
       [&](const CaseDir& d) {
         files::make_directories(d / "adir");
         d.write("cfg.yaml", s.tokens_config(s.tokens));
         return Invocation{{"fit", "cfg.yaml", "--set", "data.vocab_file=" + d / "adir"},
                           {"--set data.vocab_file=", "key 'data.vocab_file': " + d / "adir" +
                            ": is a directory, expected a file"}};
       }},
      {"data.train_dir that is a file", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.folder, "folder");
         d.write("folder/list.txt", "not a directory\n");
         d.write("cfg.yaml", s.folder_config(root));
         return Invocation{{"fit", "cfg.yaml", "--set", "data.train_dir=list.txt"},
                           {"--set data.train_dir=list.txt", "key 'data.train_dir'", "is not a directory"}};
       }},
      {"empty ImageFolder", kExitData,
       [&](const CaseDir& d) {
         files::make_directories(d / "folder/train/ant");
         files::make_directories(d / "folder/train/bee");
         d.write("folder/train/ant/notes.txt", "not an image\n");
         d.write("cfg.yaml", s.folder_config(d / "folder"));
         return Invocation{{"fit", "cfg.yaml"}, {d / "folder/train", "no images"}};
       }},
      {"ImageFolder without its val directory", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.folder, "folder");
         files::remove_all(files::join(root, "val"));
         d.write("cfg.yaml", s.folder_config(root));
         // Not set in the file: the key and the config, with the path the default led to.
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml: key 'data.val_dir': " + root + "/val does not exist"}};
       }},
      {"data.root that does not exist, relative to the working directory", kExitData,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.idx_config("not-prepared"));
         return Invocation{{"fit", "cfg.yaml"},
                           {"cfg.yaml:7:9: key 'data.root': not-prepared does not exist (relative to the working directory " +
                            d.path + ")"}};
       }},
      {"TSV validation file missing", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.tsv, "tsv");
         files::remove_file(root + "/val.tsv");
         d.write("cfg.yaml", s.tsv_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml: key 'data.val_tsv': " + root + "/val.tsv does not exist"}};
       }},
      {"truncated JPEG, met by a loader worker in the first batch", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.folder, "folder");
         d.write("folder/train/ant/1.jpg", cut(jpeg(32, 1), 300));
         d.write("cfg.yaml", s.folder_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/train/ant/1.jpg", "JPEG", "removed runs, which this run created"}};
       }},
      {"truncated JPEG mid-run, with --run-dir . holding the user's files", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.folder, "folder");
         d.write("folder/train/bee/0.jpg", cut(jpeg(32, 0), 400));
         d.write("cfg.yaml", s.folder_config(root));
         d.write("config.yaml", "# the user's own file, named like the one a run writes\n");
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "."},
                           {root + "/train/bee/0.jpg", "JPEG", "left . as it was before this run"}};
       }},
      {"garbage PNG", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.folder, "folder");
         d.write("folder/train/bee/2.png", cut(png(32), 8) + std::string(200, '\x5a'));
         // The PNG is the fifth of five training images: one batch of five takes it.
         d.write("cfg.yaml", replace(s.folder_config(root), "global_batch: 4", "global_batch: 5"));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/train/bee/2.png", "PNG", "removed runs, which this run created"}};
       }},
      {"truncated token file", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.tokens, "tokens");
         const std::string bytes = slurp(root + "/train.tokens");
         d.write("tokens/train.tokens", cut(bytes, bytes.size() - 24));
         d.write("cfg.yaml", s.tokens_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/train.tokens", "truncated"}};
       }},
      {"token file whose offsets are inconsistent", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.tokens, "tokens");
         std::string bytes = slurp(root + "/val.tokens");
         // The index is the last 8 * (documents + 1) bytes; make document 3 end before it starts.
         const size_t index = bytes.size() - 8 * 17;
         for (int i = 0; i < 8; ++i) bytes[index + 8 * 4 + i] = i == 0 ? 1 : 0;
         d.write("tokens/val.tokens", bytes);
         d.write("cfg.yaml", s.tokens_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/val.tokens", "corrupt index"}};
       }},
      {"token file with a foreign magic", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.tokens, "tokens");
         d.write("tokens/train.tokens", std::string(200, 'x'));
         d.write("cfg.yaml", s.tokens_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/train.tokens", "not a token file"}};
       }},
      {"missing vocab file", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.tokens, "tokens");
         files::remove_file(root + "/vocab.txt");
         d.write("cfg.yaml", s.tokens_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {"cfg.yaml:2:", "key 'data.vocab_file': " + root + "/vocab.txt does not exist"}};
       }},
      {"TSV with a bad row", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.tsv, "tsv");
         d.write("tsv/train.tsv", "the cat sat\tpos\nthe dog\tneg\nno tab on this line\nthe cat\tpos\n");
         d.write("cfg.yaml", s.tsv_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/train.tsv:3", "no tab"}};
       }},
      {"TSV with a label that training lacks", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.tsv, "tsv");
         d.write("tsv/val.tsv", "the cat\tpos\nthe dog\tmaybe\n");
         d.write("cfg.yaml", s.tsv_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/val.tsv:2", "'maybe'"}};
       }},
      {"TSV vocab with a blank line", kExitData,
       [&](const CaseDir& d) {
         const std::string root = d.copy_of(s.tsv, "tsv");
         d.write("tsv/vocab.txt", "[PAD]\n[UNK]\n\n[CLS]\n[SEP]\n[MASK]\nthe\n");
         d.write("cfg.yaml", s.tsv_config(root));
         return Invocation{{"fit", "cfg.yaml"}, {root + "/vocab.txt:3", "empty line"}};
       }},
  };
  run_cases(cases);
}

// ---- checkpoints: exit 2, naming the file ---------------------------------------------------------------

TEST_CASE("bad_input: garbage truncated or mismatched checkpoints exit 2", "[bad_input][process]") {
  const Shared& s = shared();
  const std::string good = slurp(s.mlp_checkpoint);
  const std::string good_sum = slurp(s.mlp_checkpoint + ".crc32c");
  auto fit_resume = [&s](const CaseDir& d, const std::string& checkpoint_bytes, std::vector<std::string> expect,
                         const std::string& config = "") {
    d.write("cfg.yaml", config.empty() ? s.idx_config() : config);
    const std::string ckpt = d.write("ckpt/step_00000001.pt", checkpoint_bytes);
    expect.insert(expect.begin(), ckpt);
    return Invocation{{"fit", "cfg.yaml", "--resume", ckpt}, expect};
  };
  std::vector<Case> cases = {
      {"--resume: garbage checkpoint", kExitConfig,
       [&](const CaseDir& d) {
         return fit_resume(d, "this is not a checkpoint\n", {"not a readable checkpoint"});
       }},
      {"--resume: truncated checkpoint", kExitConfig,
       [&](const CaseDir& d) { return fit_resume(d, cut(good, good.size() / 2), {"not a readable checkpoint"}); }},
      {"--resume: truncated checkpoint with its checksum file", kExitConfig,
       [&](const CaseDir& d) {
         d.write("ckpt/step_00000001.pt.crc32c", good_sum);
         return fit_resume(d, cut(good, good.size() - 1000), {"checksum mismatch"});
       }},
      {"--resume: a checkpoint of a different model", kExitConfig,
       [&](const CaseDir& d) {
         return fit_resume(d, good, {"conv1.weight", "missing"}, replace(s.idx_config(), "name: mlp", "name: lenet"));
       }},
      {"--resume: a checkpoint of the same model with other sizes", kExitConfig,
       [&](const CaseDir& d) {
         return fit_resume(d, good, {"fc3.weight", "shape"}, replace(s.idx_config(), "num_classes: 10", "num_classes: 12"));
       }},
      {"a fresh run where an earlier run left best.pt and best.json but no step checkpoint", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.idx_config());
         d.write("run/checkpoints/best.pt", good);
         d.write("run/checkpoints/best.json", "{\"metric\": \"loss\", \"value\": 0.5, \"step\": 7}");
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "auto"},
                           {"holds best.pt and best.json from an earlier run", "no step checkpoint to continue from"}};
       }},
      {"--resume: no such file", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.idx_config());
         return Invocation{{"fit", "cfg.yaml", "--resume", "gone.pt"}, {"gone.pt", "does not exist"}};
       }},
      {"eval: garbage checkpoint", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", s.idx_config());
         const std::string ckpt = d.write("model.pt", std::string(4096, '\0'));
         return Invocation{{"eval", "cfg.yaml", "--checkpoint", ckpt}, {ckpt, "checkpoint"}};
       }},
      {"eval: a checkpoint of a different model", kExitConfig,
       [&](const CaseDir& d) {
         d.write("cfg.yaml", replace(s.idx_config(), "name: mlp", "name: lenet"));
         const std::string ckpt = d.write("model.pt", good);
         return Invocation{{"eval", "cfg.yaml", "--checkpoint", ckpt}, {ckpt, "conv1.weight"}};
       }},
      {"model.init_from: garbage safetensors", kExitConfig,
       [&](const CaseDir& d) {
         const std::string weights = d.write("init.safetensors", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10));
         d.write("cfg.yaml", replace(s.idx_config(), "num_classes: 10", "num_classes: 10\n  init_from: " + weights));
         return Invocation{{"fit", "cfg.yaml"}, {weights}};
       }},
      {"export: garbage checkpoint", kExitConfig,
       [&](const CaseDir& d) {
         const std::string ckpt = d.write("model.pt", "PK\x03\x04 garbage");
         return Invocation{{"export", ckpt, "--format", "safetensors", "out.safetensors"}, {ckpt}};
       }},
      {"export: OUT is a directory", kExitConfig,
       [&](const CaseDir& d) {
         const std::string ckpt = d.write("model.pt", good);
         files::make_directories(d / "weights");
         return Invocation{{"export", ckpt, "weights"}, {"weights: is a directory", "weights/model.safetensors"}};
       }},
      {"export: OUT is the checkpoint itself", kExitConfig,
       [&](const CaseDir& d) {
         const std::string ckpt = d.write("model.pt", good);
         return Invocation{{"export", ckpt, ckpt}, {"model.pt: is the checkpoint being exported"}};
       }},
      {"export: OUT is another of a run's checkpoints", kExitConfig,
       [&](const CaseDir& d) {
         const std::string ckpt = d.write("model.pt", good);
         const std::string other = d.write("step_00000004.pt", good);
         d.write("step_00000004.pt.crc32c", "not read\n");
         return Invocation{{"export", ckpt, other}, {"step_00000004.pt: is a run's checkpoint"}};
       }},
      {"export: OUT in a directory that does not exist", kExitConfig,
       [&](const CaseDir& d) {
         const std::string ckpt = d.write("model.pt", good);
         return Invocation{{"export", ckpt, "nowhere/model.safetensors"},
                           {"nowhere/model.safetensors: directory nowhere does not exist"}};
       }},
  };
  run_cases(cases);
}

// ---- an existing run directory stays exactly as it was ---------------------------------------------------

TEST_CASE("bad_input: a finished run's directory is left unchanged", "[bad_input][process]") {
  const Shared& s = shared();
  // A finished ImageFolder run in the case directory; then each case damages something and runs again.
  // `extra`: more arguments for that run.
  auto finished_run = [&s](const CaseDir& d, const std::vector<std::string>& extra = {}) {
    const std::string root = d.copy_of(s.folder, "folder");
    d.write("cfg.yaml", s.folder_config(root));
    std::vector<std::string> args{"fit", "cfg.yaml", "--run-dir", "run"};
    args.insert(args.end(), extra.begin(), extra.end());
    const Outcome o = run_train(args, d.path, d.path);
    INFO(o.err);
    REQUIRE(o.exit_code == 0);
    files::remove_file(d / "stdout");
    files::remove_file(d / "stderr");
    REQUIRE(files::exists(d / "run/checkpoints/step_00000001.pt"));
    return root;
  };
  std::vector<Case> cases = {
      {"fit again without --resume", kExitConfig,
       [&](const CaseDir& d) {
         finished_run(d);
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run"}, {"run", "already holds checkpoints"}};
       }},
      {"--resume auto where metrics.jsonl is a directory", kExitConfig,
       [&](const CaseDir& d) {
         finished_run(d);
         files::remove_file(d / "run/metrics.jsonl");
         files::make_directories(d / "run/metrics.jsonl");
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "auto", "--set", "trainer.max_steps=3"},
                           {"run directory run: run/metrics.jsonl is a directory, where the run writes its "
                            "metrics.jsonl"}};
       }},
      {"fit again without --resume where every checkpoint is damaged", kExitConfig,
       [&](const CaseDir& d) {
         finished_run(d);
         d.write("run/checkpoints/step_00000001.pt", "garbage");
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run"}, {"run", "already holds checkpoints"}};
       }},
      {"--resume auto where every checkpoint is damaged", kExitConfig,
       [&](const CaseDir& d) {
         finished_run(d);
         d.write("run/checkpoints/step_00000001.pt", "garbage");
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "auto", "--set", "trainer.max_steps=3"},
                           {"run/checkpoints/step_00000001.pt", "none of the 1 checkpoint(s) in run/checkpoints can "
                            "be read", "nothing was changed"}};
       }},
      {"--resume naming a garbage checkpoint", kExitConfig,
       [&](const CaseDir& d) {
         finished_run(d);
         d.write("run/checkpoints/step_00000002.pt", "garbage");
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "run/checkpoints/step_00000002.pt",
                            "--set", "trainer.max_steps=3"},
                           {"run/checkpoints/step_00000002.pt", "not a readable checkpoint"}};
       }},
      {"--resume auto, then a truncated JPEG mid-run", kExitData,
       [&](const CaseDir& d) {
         const std::string root = finished_run(d);
         d.write("folder/train/bee/1.jpg", cut(jpeg(32, 1), 250));
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "auto", "--set", "trainer.max_steps=3"},
                           {root + "/train/bee/1.jpg", "JPEG", "left run as it was before this run"}};
       }},
      {"--resume from an older checkpoint, then a truncated JPEG: the newer one it set aside is put back", kExitData,
       [&](const CaseDir& d) {
         const std::string root =
             finished_run(d, {"--set", "trainer.max_steps=2", "--set", "checkpoint.every_steps=1"});
         REQUIRE(files::exists(d / "run/checkpoints/step_00000002.pt"));
         d.write("folder/train/bee/1.jpg", cut(jpeg(32, 1), 250));
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "run/checkpoints/step_00000001.pt",
                            "--set", "trainer.max_steps=3"},
                           {root + "/train/bee/1.jpg", "JPEG", "left run as it was before this run"}};
       }},
      {"--resume from an older checkpoint, then a truncated JPEG: an earlier resume's set-aside checkpoint of the "
       "same step stays as it was", kExitData,
       [&](const CaseDir& d) {
         const std::string root =
             finished_run(d, {"--set", "trainer.max_steps=2", "--set", "checkpoint.every_steps=1"});
         d.write("run/checkpoints/abandoned/step_00000002.pt", "an earlier attempt's future");
         d.write("run/checkpoints/abandoned/step_00000002.pt.crc32c", "its checksum");
         d.write("folder/train/bee/1.jpg", cut(jpeg(32, 1), 250));
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "run/checkpoints/step_00000001.pt",
                            "--set", "trainer.max_steps=3"},
                           {root + "/train/bee/1.jpg", "JPEG", "left run as it was before this run"}};
       }},
      {"--resume from an older checkpoint, then a truncated JPEG: the later best.pt and best.json it set aside are "
       "put back", kExitData,
       [&](const CaseDir& d) {
         const std::string root =
             finished_run(d, {"--set", "trainer.max_steps=2", "--set", "checkpoint.every_steps=1"});
         d.write("run/checkpoints/best.pt", "the best of step 2");
         d.write("run/checkpoints/best.pt.crc32c", "its checksum");
         d.write("run/checkpoints/best.json", "{\"metric\": \"loss\", \"value\": 0.5, \"step\": 2}");
         d.write("folder/train/bee/1.jpg", cut(jpeg(32, 1), 250));
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "run/checkpoints/step_00000001.pt",
                            "--set", "trainer.max_steps=3"},
                           {root + "/train/bee/1.jpg", "JPEG", "left run as it was before this run"}};
       }},
      {"--resume from an older checkpoint with a metrics.jsonl over 256 KiB, then a truncated JPEG: its rows come back",
       kExitData,
       [&](const CaseDir& d) {
         const std::string root =
             finished_run(d, {"--set", "trainer.max_steps=2", "--set", "checkpoint.every_steps=1"});
         // Rows after step 1, which the resumed run cuts (more than the snapshot kept of any file).
         {
           std::ofstream metrics(d / "run/metrics.jsonl", std::ios::app);
           for (int i = 0; i < 3000; ++i) {
             metrics << "{\"step\":2,\"split\":\"train\",\"note\":\"" << std::string(100, 'x') << i << "\"}\n";
           }
         }
         REQUIRE(files::file_size(d / "run/metrics.jsonl") > 256 * 1024);
         d.write("folder/train/bee/1.jpg", cut(jpeg(32, 1), 250));
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "run/checkpoints/step_00000001.pt",
                            "--set", "trainer.max_steps=3"},
                           {root + "/train/bee/1.jpg", "JPEG", "left run as it was before this run"}};
       }},
      {"--resume from an older checkpoint with an event file over 256 KiB, then a truncated JPEG: its events come back",
       kExitData,
       [&](const CaseDir& d) {
         const std::string root =
             finished_run(d, {"--set", "trainer.max_steps=2", "--set", "checkpoint.every_steps=1"});
         // Events after step 1, which the resumed run (with TensorBoard on) rewrites the file without.
         {
           train::TensorBoardWriter events(d / "run");
           for (int i = 0; i < 6000; ++i) events.add_scalars(2, {{"train/note", i}}, 1.0);
           REQUIRE(files::file_size(events.path()) > 256 * 1024);
         }
         d.write("folder/train/bee/1.jpg", cut(jpeg(32, 1), 250));
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "run/checkpoints/step_00000001.pt",
                            "--set", "trainer.max_steps=3", "--set", "logging.tensorboard=true"},
                           {root + "/train/bee/1.jpg", "JPEG", "left run as it was before this run"}};
       }},
      {"eval: a truncated JPEG in the val split", kExitData,
       [&](const CaseDir& d) {
         const std::string root = finished_run(d);
         d.write("folder/val/bee/0.jpg", cut(jpeg(32, 0), 200));
         return Invocation{{"eval", "cfg.yaml", "--checkpoint", "run/checkpoints/step_00000001.pt"},
                           {root + "/val/bee/0.jpg", "JPEG"}};
       }},
      {"--resume auto with a config error found after parsing", kExitConfig,
       [&](const CaseDir& d) {
         finished_run(d);
         return Invocation{{"fit", "cfg.yaml", "--run-dir", "run", "--resume", "auto", "--set", "tuning.micro_batch=3"},
                           {"--set tuning.micro_batch=3", "does not divide"}};
       }},
  };
  run_cases(cases);
}
