// The library as a program that links train::train uses it (README "Using the library"): the
// documented flows, run from a fresh directory.
#include "testing.h"

#include <train/checkpoint.h>
#include <train/config.h>
#include <train/data/dataset.h>
#include <train/data/token_file.h>
#include <train/device.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/log.h>
#include <train/fit.h>
#include <train/metrics.h>
#include <train/models/model.h>
#include <train/optim.h>
#include <train/plan.h>
#include <train/run.h>
#include <train/trainer.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using namespace train;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A dataset the library does not know: 28x28 images whose brightness is the class.
class Brightness : public data::Dataset {
 public:
  int64_t size() const override { return 40; }
  data::Example get(int64_t index, uint64_t /*seed*/) const override {
    const int64_t label = index % 4;
    return {torch::full({1, 28, 28}, static_cast<float>(label) / 4.0f), torch::tensor(label)};
  }
  std::vector<int64_t> input_shape() const override { return {1, 28, 28}; }
  int64_t num_classes() const override { return 4; }
  std::string describe() const override { return "brightness (40 samples)"; }
};

// Tabular regression, a task without classes: 8 features, a float target that is a fixed linear
// function of them plus a bias.
class LinearTargets : public data::Dataset {
 public:
  explicit LinearTargets(int64_t size, int64_t offset = 0) : size_(size), offset_(offset) {}
  int64_t size() const override { return size_; }
  data::Example get(int64_t index, uint64_t /*seed*/) const override {
    const torch::Tensor x = features(index + offset_);
    return {x, (x * weights()).sum().add(0.5).reshape({1})};
  }
  std::vector<int64_t> input_shape() const override { return {8}; }
  int64_t num_classes() const override { return 0; }
  std::string describe() const override { return "linear targets (" + std::to_string(size_) + " samples)"; }
  static torch::Tensor weights() { return torch::arange(8, torch::kFloat).sub(3.5).div(4); }

 private:
  static torch::Tensor features(int64_t index) {
    // Deterministic and varied: the sample's own generator.
    auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + index));
    return torch::randn({8}, generator, torch::TensorOptions().dtype(torch::kFloat));
  }
  int64_t size_, offset_;
};

// A model with its own loss, mean squared error, and two measures of its own. Its flaws: a loss of
// one value per sample instead of their mean, or one measure's sum missing.
enum class Flaw { kNone, kLossPerSample, kSumMissing };
class Regressor : public models::Model {
 public:
  explicit Regressor(Flaw flaw = Flaw::kNone) : fc_(register_module("fc", torch::nn::Linear(8, 1))), flaw_(flaw) {}
  torch::Tensor forward(const torch::Tensor& x) override { return fc_(x); }
  bool has_own_loss() const override { return true; }
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override {
    const torch::Tensor squared = (output.to(torch::kFloat) - target).pow(2);
    return flaw_ == Flaw::kLossPerSample ? squared.sum(1) : squared.mean();
  }
  // Mean absolute error (lower is better) and the share of predictions within 0.05 (higher).
  std::vector<EvalMetric> eval_metrics() const override { return {{"mae", false}, {"within_5pc", true}}; }
  std::vector<torch::Tensor> eval_sums(const torch::Tensor& output, const torch::Tensor& target) override {
    const torch::Tensor error = (output.to(torch::kFloat) - target).abs();
    if (flaw_ == Flaw::kSumMissing) return {error.sum()};
    return {error.sum(), error.lt(0.05).sum()};
  }

 private:
  torch::nn::Linear fc_;
  Flaw flaw_;
};

Config regression_config(const std::string& tmp, const std::string& extra) {
  return parse_config("model: {name: test_regressor}\n"
                      "data: {kind: custom, workers: 0}\n"
                      "optim: {name: sgd, lr: 0.1, momentum: 0.9}\n"
                      "schedule: {name: constant}\n"
                      "trainer: {global_batch: 16, max_steps: 200, device: cpu, threads: 1, eval_every_steps: 100}\n"
                      "logging: {every_steps: 100}\n"
                      "tuning: {cache_dir: " + files::join(tmp, "cache") + "}\n" + extra,
                      "regression.yaml");
}

}  // namespace

// The pip wheel's libtorch.so exports its own copies of some libstdc++ functions; in a program
// that lists it before libstdc++.so.6 they replace the C++ runtime's, and
// std::filesystem::create_directories crashes. Linking train::train puts libstdc++ first
// (libtrain/CMakeLists.txt). With Debian's LibTorch there are no such copies, and this holds too.
TEST_CASE("library_use: the C++ runtime's own functions win over copies that LibTorch exports", "[library_use]") {
  const char* const symbols[] = {
      // std::filesystem::create_directories(const path&, std::error_code&)
      "_ZNSt10filesystem18create_directoriesERKNS_7__cxx114pathERSt10error_code",
      // std::filesystem::remove_all(const path&, std::error_code&)
      "_ZNSt10filesystem10remove_allERKNS_7__cxx114pathERSt10error_code",
      // std::ostringstream::ostringstream() and std::stringstream::stringstream()
      "_ZNSt7__cxx1119basic_ostringstreamIcSt11char_traitsIcESaIcEEC1Ev",
      "_ZNSt7__cxx1118basic_stringstreamIcSt11char_traitsIcESaIcEEC1Ev",
  };
  for (const char* symbol : symbols) {
    INFO(symbol);
    void* address = ::dlsym(RTLD_DEFAULT, symbol);
    REQUIRE(address != nullptr);
    Dl_info info{};
    REQUIRE(::dladdr(address, &info) != 0);
    REQUIRE(info.dli_fname != nullptr);
    CHECK_THAT(std::string(info.dli_fname), Catch::Contains("libstdc++"));
  }
  // And they work: LibTorch's copy of create_directories crashed here.
  const std::string root = files::make_temp_directory("train_stdfs_");
  const std::filesystem::path nested = std::filesystem::path(root) / "a" / "b";
  std::error_code error;
  CHECK(std::filesystem::create_directories(nested, error));
  CHECK_FALSE(error);
  CHECK(std::filesystem::is_directory(nested));
  CHECK(std::filesystem::remove_all(root, error) == 3);
  CHECK_FALSE(error);
}

TEST_CASE("library_use: MetricRecord takes any integer type", "[library_use]") {
  const std::vector<int> three(3);
  MetricRecord r;
  r.add("n", three.size())
      .add("u", 5u)
      .add("i", 7)
      .add("ll", -2LL)
      .add("big", std::numeric_limits<uint64_t>::max())
      .add("b", true);
  CHECK(r.to_json() == R"({"n":3,"u":5,"i":7,"ll":-2,"big":1.84467440737096e+19,"b":true})");
}

TEST_CASE("library_use: json_quote escapes and keeps JSON valid UTF-8", "[library_use]") {
  CHECK(json_quote("a\"b\\c\n\x01") == "\"a\\\"b\\\\c\\n\\u0001\"");
  CHECK(json_quote("caf\xc3\xa9 \xe2\x82\xac") == "\"caf\xc3\xa9 \xe2\x82\xac\"");  // valid UTF-8 kept
  // A Latin-1 byte, a lone continuation byte, a cut-off sequence, an overlong '/', a surrogate.
  CHECK(json_quote("caf\xe9") == "\"caf\xef\xbf\xbd\"");
  CHECK(json_quote("\x80x") == "\"\xef\xbf\xbdx\"");
  CHECK(json_quote("\xe2\x82") == "\"\xef\xbf\xbd\xef\xbf\xbd\"");
  CHECK(json_quote("\xc0\xaf") == "\"\xef\xbf\xbd\xef\xbf\xbd\"");
  CHECK(json_quote("\xed\xa0\x80") == "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"");
}

// README: a dataset of one's own goes in through RunOptions, with data.kind: custom.
TEST_CASE("library_use: a custom dataset trains into a run directory that does not exist yet", "[library_use]") {
  const std::string tmp = files::make_temp_directory("train_test_library_use_");
  const std::string run_dir = files::join(tmp, "runs/custom");
  const Config config = parse_config(
      "model: {name: mlp, in_channels: 1, num_classes: 4}\n"
      "data: {kind: custom, workers: 1}\n"  // only the loader settings apply to a dataset of one's own
      "trainer: {global_batch: 8, max_steps: 3, device: cpu}\n"
      "tuning: {batch: scale, max_micro_batch: 8, cache_dir: " + files::join(tmp, "cache") + "}\n",
      "library_use.yaml");
  RunOptions options;
  options.train_data = std::make_shared<Brightness>();
  options.val_data = options.train_data;
  RunParts run = prepare_run(config, options);
  CHECK(run.train == options.train_data);
  CHECK(run.plan.memory.source.find("probe on cpu") != std::string::npos);  // the probe ran on the program's data
  FitOptions fit;
  fit.run_dir = run_dir;
  const FitReport report = fit_in_run_dir(config, run, fit);
  CHECK(report.exit_code == kExitOk);
  const FitResult& result = report.result;
  CHECK(files::is_regular_file(files::join(run_dir, "plan.json")));
  CHECK(result.steps == 3);
  CHECK(result.val.samples == 40);
  const std::string metrics = read_text(files::join(run_dir, "metrics.jsonl"));
  CHECK(metrics.find("\"step\":3") != std::string::npos);
  CHECK_FALSE(files::list_directory(files::join(run_dir, "checkpoints")).empty());

  // Datasets from the program with a kind that builds its own, a validation set without a training
  // set, and a plan made from another config are errors, not silently one or the other.
  {
    Config synthetic = config;
    synthetic.data.kind = "synthetic";
    CHECK_THROWS_WITH(prepare_run(synthetic, options),
                      Catch::Contains("key 'data.kind': 'synthetic', but the program passes its own datasets"));
    RunOptions val_only;
    val_only.val_data = options.train_data;
    CHECK_THROWS_WITH(prepare_run(config, val_only), Catch::Contains("RunOptions::val_data without"));
    Plan fixed = run.plan;
    fixed.scaled_batch = false;
    Config other = config;
    other.trainer.global_batch = fixed.global_batch * 2;
    CHECK_THROWS_WITH(Trainer(other, fixed, run.model, run.train, run.val, ""),
                      Catch::Contains("the plan was made for a global batch of " + std::to_string(fixed.global_batch)));
  }

  // Without datasets from the program, the kind is an error that says what it means.
  try {
    prepare_run(config);
    FAIL("prepare_run accepted data.kind custom without datasets");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::Contains("key 'data.kind': 'custom'") && Catch::Contains("RunOptions::train_data"));
  }
  files::remove_all(tmp);
}

// A module of the program's own that reads is_training() in its forward, as LibTorch's MNIST
// example does.
struct DropoutNetImpl : torch::nn::Module {
  DropoutNetImpl() : fc(register_module("fc", torch::nn::Linear(64, 4))) {
    register_parameter("scale", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc->forward(torch::dropout(x.flatten(1), 0.5, is_training())) * named_parameters(false)["scale"];
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(DropoutNet);

TEST_CASE("library_use: from_module trains a torch::nn::Sequential or a module of one's own under its own names",
          "[library_use]") {
  const auto sequential = [] {
    return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 16), torch::nn::BatchNorm1d(16),
                                 torch::nn::ReLU(), torch::nn::Linear(16, 4));
  };
  {
    torch::nn::Sequential seq = sequential();
    const models::ModelPtr model = models::from_module(seq);
    std::vector<std::string> names, expected;
    for (const auto& p : model->named_parameters()) names.push_back(p.key());
    for (const auto& p : seq->named_parameters()) expected.push_back(p.key());
    CHECK(names == expected);  // "1.weight", ... as in Python
    CHECK(model->named_buffers().size() == seq->named_buffers().size());
    CHECK(model->has_batch_stats());
    CHECK_FALSE(model->is_convolutional());
    CHECK(models::from_module(torch::nn::Sequential(torch::nn::Conv2d(1, 2, 3)))->is_convolutional());
    const torch::Tensor x = torch::randn({5, 1, 28, 28});
    model->eval();
    CHECK_FALSE(seq[2]->is_training());
    CHECK(torch::equal(model->forward(x), seq->forward(x)));
  }
  {  // the module's own flag: its forward reads is_training()
    const DropoutNet net;
    const models::ModelPtr model = models::from_module(net);
    CHECK(model->named_parameters().contains("scale"));
    CHECK(model->named_parameters().contains("fc.weight"));
    model->eval();
    CHECK_FALSE(net->is_training());
    const torch::Tensor x = torch::randn({3, 1, 8, 8});
    CHECK(torch::equal(model->forward(x), model->forward(x)));  // no dropout in eval mode
    model->train();
    CHECK(net->is_training());
  }
  // Through the registry, a run and its checkpoint, which a fresh Sequential loads by its names.
  const std::string tmp = files::make_temp_directory("train_test_from_module_");
  models::register_model("test_sequential", [&](const ModelConfig&) { return models::from_module(sequential()); },
                         "a Sequential");
  const Config config = parse_config(
      "model: {name: test_sequential, in_channels: 1, num_classes: 4}\n"
      "data: {kind: custom, workers: 0}\n"
      "trainer: {global_batch: 8, max_steps: 3, device: cpu}\n"
      "tuning: {cache_dir: " + files::join(tmp, "cache") + "}\n",
      "from_module.yaml");
  RunOptions options;
  options.train_data = std::make_shared<Brightness>();
  options.val_data = options.train_data;
  RunParts run = prepare_run(config, options);
  FitOptions fit;
  fit.run_dir = files::join(tmp, "run");
  REQUIRE(fit_in_run_dir(config, run, fit).exit_code == kExitOk);
  const models::ModelPtr loaded = models::from_module(sequential());
  load_model_weights(latest_checkpoint(files::join(fit.run_dir, "checkpoints")), *loaded);
  for (const auto& p : run.model->named_parameters()) CHECK(torch::equal(p.value(), loaded->named_parameters()[p.key()]));
  files::remove_all(tmp);
}

// examples/resnet/main.cpp, the README's snippet written out, run where nothing exists yet.
TEST_CASE("library_use: an optimizer of one's own, registered by name, trains, checkpoints and resumes exactly",
          "[library_use]") {
  const std::string tmp = files::make_temp_directory("train_test_own_optimizer_");
  const auto yaml = [&](const std::string& optim) {
    return "model: {name: mlp, in_channels: 1, num_classes: 4}\n"
           "data: {kind: custom, workers: 0}\n"
           "optim: {" + optim + "}\n"
           "schedule: {name: cosine, warmup_steps: 2}\n"
           "trainer: {global_batch: 8, max_steps: 6, device: cpu, threads: 1}\n"
           "checkpoint: {every_steps: 3, keep_last: 10}\n"
           "tuning: {micro_batch: 8, cache_dir: " + files::join(tmp, "cache") + "}\n";
  };
  const std::string own = "name: test_rmsprop, lr: 0.001, weight_decay: 0.01, eps: 0.0001";
  // Unknown until registered: the config says so at its line, as for any misspelt value.
  CHECK_THROWS_WITH(parse_config(yaml(own), "own.yaml"),
                    Catch::Contains("own.yaml:3:") && Catch::Contains("key 'optim.name': must be one of sgd, adamw") &&
                        Catch::Contains("got 'test_rmsprop'"));
  CHECK_THROWS_AS(register_optimizer("sgd", [](const OptimizerParams&) { return nullptr; }, "mine", 1),
                  std::invalid_argument);
  CHECK_THROWS_AS(register_optimizer("test_rmsprop", nullptr, "mine", 1), std::invalid_argument);

  int built = 0;
  OptimizerParams seen;
  register_optimizer("test_rmsprop", [&](const OptimizerParams& p) -> std::unique_ptr<torch::optim::Optimizer> {
    ++built;
    seen = p;
    auto options = torch::optim::RMSpropOptions(p.lr).alpha(0.9).eps(p.config.eps);
    return std::make_unique<torch::optim::RMSprop>(param_groups(p, options), options);
  }, "RMSprop, alpha 0.9", /*state_per_parameter=*/1);
  const std::vector<std::string> names = optimizer_names();
  CHECK(std::find(names.begin(), names.end(), "test_rmsprop") != names.end());
  CHECK_THROWS_WITH(parse_config(yaml("name: test_rmsprp"), "own.yaml"),
                    Catch::Contains("own.yaml:3:") && Catch::Contains("did you mean 'test_rmsprop'"));
  CHECK_THROWS_WITH(prepare_run(parse_config(yaml(own + ", impl: fused"), "own.yaml"), [] {
                      RunOptions o;
                      o.train_data = std::make_shared<Brightness>();
                      return o;
                    }()),
                    Catch::Contains("key 'optim.impl': fused picks among the sgd and adamw kernels") &&
                        Catch::Contains("RMSprop, alpha 0.9"));

  const Config config = parse_config(yaml(own), "own.yaml");
  const auto run_from = [&](const std::string& dir, const std::string& resume, const Config& c) {
    RunOptions options;
    options.train_data = std::make_shared<Brightness>();
    RunParts run = prepare_run(c, options);
    FitOptions fit;
    fit.run_dir = files::join(tmp, dir);
    fit.resume = resume;
    REQUIRE(fit_in_run_dir(c, run, fit).exit_code == kExitOk);
    std::vector<torch::Tensor> weights;
    for (const auto& p : run.model->parameters()) weights.push_back(p.detach().clone());
    return std::make_pair(run.plan, weights);
  };
  const auto [plan, whole] = run_from("whole", "", config);
  CHECK(built >= 1);
  CHECK(seen.config.name == "test_rmsprop");
  CHECK(std::abs(seen.lr - plan.lr) < 1e-12);
  CHECK(seen.decay.size() == 3);     // the MLP's three weight matrices
  CHECK(seen.no_decay.size() == 3);  // and their biases
  bool sized = false;
  for (const auto& d : plan.decisions) sized = sized || (d.name == "checkpoints" && d.reason.find("+ test_rmsprop state") != std::string::npos);
  CHECK(sized);
  CHECK(plan.cuda_graphs == false);

  // The checkpoint holds RMSprop's state, which a resume puts back (through the optimizer's own
  // save() and load(): train does not know its state class)...
  const std::string step3 = checkpoint_path(files::join(tmp, "whole/checkpoints"), 3);
  REQUIRE(files::exists(step3));
  {
    RunOptions options;
    options.train_data = std::make_shared<Brightness>();
    RunParts run = prepare_run(config, options);
    const auto optimizer = make_optimizer(config.optim, *run.model, plan.lr);
    REQUIRE(dynamic_cast<torch::optim::RMSprop*>(optimizer.get()) != nullptr);
    load_checkpoint(step3, *run.model, optimizer.get());
    REQUIRE(optimizer->state().size() == 6);
    for (const auto& [key, state] : optimizer->state()) {
      const auto* rms = dynamic_cast<const torch::optim::RMSpropParamState*>(state.get());
      REQUIRE(rms != nullptr);
      CHECK(rms->step() == 3);
      CHECK(rms->square_avg().abs().sum().item<double>() > 0);
    }
    // ...with the hyperparameters of today's config, not the saved ones.
    CHECK(std::abs(optimizer->param_groups()[0].options().get_lr() - plan.lr) < 1e-12);
  }
  // ...and the run ends where the uninterrupted one did, bit for bit.
  const auto resumed = run_from("resumed", step3, config).second;
  REQUIRE(resumed.size() == whole.size());
  bool same = true;
  for (size_t i = 0; i < whole.size(); ++i) same = same && torch::equal(resumed[i], whole[i]);
  CHECK(same);
  files::remove_all(tmp);
}

TEST_CASE("library_use: resnet_example trains from an empty directory", "[library_use][process]") {
  const std::string example = std::string(TRAIN_BINARY_DIR) + "/bin/resnet_example";
  if (!files::is_regular_file(example)) FAIL(example + " is missing (TRAIN_BUILD_EXAMPLES=OFF?)");
  const std::string tmp = files::make_temp_directory("train_test_resnet_example_");
  {
    std::ofstream config(files::join(tmp, "tiny.yaml"));
    config << "model: {name: resnet18, in_channels: 1, width: 0.125, small_input: true}\n"
              "data: {kind: synthetic, channels: 1, image_size: 16, synthetic_train_samples: 16,"
              " synthetic_val_samples: 8}\n"
              "trainer: {global_batch: 4, max_steps: 2, device: cpu}\n"
              "tuning: {probe: false}\n"
              "logging: {level: warn}\n";
  }
  const std::string log = files::join(tmp, "out.log");
  const std::string command = "cd '" + tmp + "' && '" + example + "' tiny.yaml --set tuning.cache_dir='" +
                              files::join(tmp, "plans") + "' > '" + log + "' 2>&1";
  const int status = std::system(command.c_str());
  INFO(read_text(log));
  REQUIRE(status != -1);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // runs/<config name>, as train fit: another config does not resume this one's checkpoints.
  CHECK(files::is_regular_file(files::join(tmp, "runs/tiny/metrics.jsonl")));
  CHECK(files::is_regular_file(files::join(tmp, "runs/tiny/plan.json")));
  CHECK(read_text(log).find("top-1 ") != std::string::npos);

  // Bad input: the exit code train fit gives, a message that says where, and no run directory
  // left behind.
  struct Bad {
    std::string args;
    int rc;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {"tiny.yaml --bogus", 2, "unknown option --bogus"},
      {"tiny.yaml --set", 2, "--set needs a value"},
      {"tiny.yaml other.yaml", 2, "one config file, not two"},
      {"tiny.yaml --set tuning.device=a100-80gb", 2, "--set tuning.device=a100-80gb: key 'tuning.device'"},
      {"tiny.yaml --set model.in_channels=3", 2, "--set model.in_channels=3: key 'model.in_channels': 3 but the data"},
      {"tiny.yaml --set model.init_from=missing.safetensors", 2, "key 'model.init_from'"},
  };
  for (const Bad& b : bad) {
    const std::string run_dir = files::join(tmp, "bad_run");
    const std::string cmd = "cd '" + tmp + "' && '" + example + "' --run-dir '" + run_dir + "' --set tuning.cache_dir='" +
                            files::join(tmp, "plans") + "' " + b.args + " > '" + log + "' 2>&1";
    const int rc = std::system(cmd.c_str());
    INFO(b.args << ": " << read_text(log));
    REQUIRE(WIFEXITED(rc));
    CHECK(WEXITSTATUS(rc) == b.rc);
    CHECK(read_text(log).find(b.says) != std::string::npos);
    CHECK_FALSE(files::exists(run_dir));
  }
  const std::string help = "'" + example + "' --help > '" + log + "' 2>&1";
  CHECK(std::system(help.c_str()) == 0);
  CHECK(read_text(log).find("usage: resnet_example") != std::string::npos);
  files::remove_all(tmp);
}

// examples/bert/main.cpp: a split without rows is bad data naming the file (exit 1), not a crash
// or a NaN baseline.
TEST_CASE("library_use: bert_example baselines rejects an empty TSV split", "[library_use][process]") {
  const std::string example = std::string(TRAIN_BINARY_DIR) + "/bin/bert_example";
  if (!files::is_regular_file(example)) FAIL(example + " is missing (TRAIN_BUILD_EXAMPLES=OFF?)");
  const std::string tmp = files::make_temp_directory("train_test_bert_baselines_");
  std::ofstream(files::join(tmp, "vocab.txt")) << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\n";
  std::ofstream(files::join(tmp, "corpus.txt")) << "hello world\nworld\n";
  const std::string log = files::join(tmp, "out.log");
  auto run = [&](const std::string& args) {
    const std::string command = "cd '" + tmp + "' && '" + example + "' " + args + " > '" + log + "' 2>&1";
    const int status = std::system(command.c_str());
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  REQUIRE(run("pretokenize --vocab vocab.txt --out train.tokens corpus.txt") == 0);
  files::copy_file(files::join(tmp, "train.tokens"), files::join(tmp, "val.tokens"));
  for (const std::string empty : {"train.tsv", "val.tsv"}) {
    std::ofstream(files::join(tmp, "train.tsv")) << (empty == "train.tsv" ? "" : "hello\tart\n");
    std::ofstream(files::join(tmp, "val.tsv")) << (empty == "val.tsv" ? "" : "world\tart\n");
    const int rc = run("baselines --data .");
    const std::string said = read_text(log);
    INFO("empty " << empty << ": " << said);
    CHECK(rc == 1);
    CHECK(said.find(empty + ": no rows") != std::string::npos);
  }
  std::ofstream(files::join(tmp, "train.tsv")) << "hello\tart\n";
  std::ofstream(files::join(tmp, "val.tsv")) << "world\tart\n";
  CHECK(run("baselines --data .") == 0);
  CHECK(read_text(log).find("'art' = 100.00% of 1 validation texts") != std::string::npos);
  files::remove_all(tmp);
}

namespace {

// Runs examples/bert's tool in `dir` with `args`, its output to `log`; the exit code, -1 when it
// did not exit normally.
int run_bert_example(const std::string& dir, const std::string& args, const std::string& log) {
  const std::string example = std::string(TRAIN_BINARY_DIR) + "/bin/bert_example";
  const std::string command = "cd '" + dir + "' && '" + example + "' " + args + " > '" + log + "' 2>&1";
  const int status = std::system(command.c_str());
  return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Every entry under dir (recursively): a file's size and a hash of its bytes (readable when a check
// fails), "<dir>" for a directory.
std::map<std::string, std::string> snapshot(const std::string& dir, const std::string& prefix = "") {
  std::map<std::string, std::string> entries;
  for (const auto& name : files::list_directory(dir)) {
    const std::string path = files::join(dir, name);
    if (files::is_directory(path)) {
      entries[prefix + name] = "<dir>";
      for (const auto& [sub, bytes] : snapshot(path, prefix + name + "/")) entries[sub] = bytes;
    } else {
      const std::string bytes = read_text(path);
      entries[prefix + name] = std::to_string(bytes.size()) + " bytes, hash " +
                               std::to_string(std::hash<std::string>()(bytes));
    }
  }
  return entries;
}

const char* const kSmallVocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\n";

}  // namespace

// examples/bert/main.cpp: prepare reads and checks every input, --uncased-vocab included, before
// it writes anything, so bad input leaves an existing OUT as it was.
TEST_CASE("library_use: bert_example prepare with a missing uncased vocab leaves OUT untouched",
          "[library_use][process]") {
  const std::string example = std::string(TRAIN_BINARY_DIR) + "/bin/bert_example";
  if (!files::is_regular_file(example)) FAIL(example + " is missing (TRAIN_BUILD_EXAMPLES=OFF?)");
  const std::string tmp = files::make_temp_directory("train_test_bert_prepare_");
  files::make_directories(files::join(tmp, "fortunes"));
  for (const std::string category : {"art", "food"}) {
    std::ofstream corpus(files::join(tmp, "fortunes/" + category));
    for (int i = 0; i < 12; ++i) corpus << "the " << category << " of fortune number " << i << "\nis here\n%\n";
  }
  // An OUT from an earlier run: every file must stay as it is.
  files::make_directories(files::join(tmp, "out"));
  for (const std::string name : {"vocab.txt", "train.tokens", "val.tokens", "train.tsv", "val.tsv"}) {
    std::ofstream(files::join(tmp, "out/" + name)) << "earlier " << name << "\n";
  }
  const auto before = snapshot(files::join(tmp, "out"));
  const std::string log = files::join(tmp, "out.log");
  const int rc = run_bert_example(tmp, "prepare --fortunes fortunes --out out --uncased-vocab missing/vocab.txt", log);
  const std::string said = read_text(log);
  INFO(said);
  CHECK(rc == 1);
  CHECK(said.find("missing/vocab.txt") != std::string::npos);
  CHECK(snapshot(files::join(tmp, "out")) == before);  // no file rewritten, no uncased/, no temporaries
  CHECK_FALSE(files::exists(files::join(tmp, "out/uncased")));

  // With the vocab there, the same command replaces every file and writes uncased/.
  std::ofstream(files::join(tmp, "uncased_vocab.txt")) << kSmallVocab;
  REQUIRE(run_bert_example(tmp, "prepare --fortunes fortunes --out out --uncased-vocab uncased_vocab.txt", log) == 0);
  const auto after = snapshot(files::join(tmp, "out"));
  for (const auto& [name, entry] : before) CHECK(after.at(name) != entry);
  CHECK(read_text(files::join(tmp, "out/uncased/vocab.txt")) == kSmallVocab);
  CHECK(after.count("uncased/train.tokens") == 1);
  CHECK(after.size() == before.size() + 4);  // uncased/ and its three files; no temporaries
  files::remove_all(tmp);
}

// examples/bert/main.cpp: a token file written with a larger vocabulary than vocab.txt is bad data
// naming both files (exit 1), not an out-of-range crash inside the count.
TEST_CASE("library_use: bert_example baselines rejects token files of a larger vocabulary",
          "[library_use][process]") {
  const std::string example = std::string(TRAIN_BINARY_DIR) + "/bin/bert_example";
  if (!files::is_regular_file(example)) FAIL(example + " is missing (TRAIN_BUILD_EXAMPLES=OFF?)");
  const std::string tmp = files::make_temp_directory("train_test_bert_baselines_vocab_");
  std::string big = kSmallVocab;
  for (int i = 7; i < 17; ++i) big += "word" + std::to_string(i) + "\n";
  big += "zebra\n";  // id 17
  std::ofstream(files::join(tmp, "big_vocab.txt")) << big;
  std::ofstream(files::join(tmp, "corpus.txt")) << "hello zebra\nworld zebra\n";
  std::ofstream(files::join(tmp, "train.tsv")) << "hello\tart\n";
  std::ofstream(files::join(tmp, "val.tsv")) << "world\tart\n";
  const std::string log = files::join(tmp, "out.log");
  REQUIRE(run_bert_example(tmp, "pretokenize --vocab big_vocab.txt --out train.tokens corpus.txt", log) == 0);
  files::copy_file(files::join(tmp, "train.tokens"), files::join(tmp, "val.tokens"));
  std::ofstream(files::join(tmp, "vocab.txt")) << kSmallVocab;  // 7 tokens
  const int rc = run_bert_example(tmp, "baselines --data .", log);
  const std::string said = read_text(log);
  INFO(said);
  CHECK(rc == 1);
  CHECK(said.find("train.tokens: written with a vocabulary of 18 tokens") != std::string::npos);
  CHECK(said.find("vocab.txt has 7") != std::string::npos);
  // With the vocab the files were written with, the same data has a baseline.
  std::ofstream(files::join(tmp, "vocab.txt")) << big;
  CHECK(run_bert_example(tmp, "baselines --data .", log) == 0);
  CHECK(read_text(log).find("'zebra' = 50.00% of 4 validation tokens") != std::string::npos);
  files::remove_all(tmp);
}

// examples/bert/main.cpp: a raw corpus holds no special tokens, so a literal "[PAD]" (or "[SEP]")
// in it is text. Read as the pad id, it would sit inside a document where the model masks pad ids
// out of attention (train/data/tokens.h), silently hiding it; both prepare and pretokenize.
TEST_CASE("library_use: bert_example token files hold a literal [PAD] as text, never the pad id",
          "[library_use][process][bert]") {
  const std::string example = std::string(TRAIN_BINARY_DIR) + "/bin/bert_example";
  if (!files::is_regular_file(example)) FAIL(example + " is missing (TRAIN_BUILD_EXAMPLES=OFF?)");
  const std::string tmp = files::make_temp_directory("train_test_bert_literal_pad_");
  std::ofstream(files::join(tmp, "vocab.txt")) << kSmallVocab << "[\n]\npad\nsep\n";  // ids 7 8 9 10
  std::ofstream(files::join(tmp, "corpus.txt")) << "hello [PAD] world [SEP]\n";
  const std::string log = files::join(tmp, "out.log");
  REQUIRE(run_bert_example(tmp, "pretokenize --vocab vocab.txt --out corpus.tokens corpus.txt", log) == 0);
  data::TokenFile pretokenized(files::join(tmp, "corpus.tokens"));
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < pretokenized.num_tokens(); ++i) ids.push_back(pretokenized.token(i));
  CHECK(pretokenized.special().pad == 0);
  CHECK(ids == std::vector<int64_t>{5, 7, 9, 8, 6, 7, 10, 8});  // hello [ pad ] world [ sep ]

  // prepare: a vocab learned from fortunes that write "[PAD]", and their token files.
  files::make_directories(files::join(tmp, "fortunes"));
  {
    std::ofstream corpus(files::join(tmp, "fortunes/art"));
    for (int i = 0; i < 20; ++i) corpus << "fill the [PAD] with paint " << i << "\n%\n";
  }
  REQUIRE(run_bert_example(tmp, "prepare --fortunes fortunes --out out --vocab-size 100", log) == 0);
  for (const std::string split : {"train", "val"}) {
    data::TokenFile file(files::join(tmp, "out/" + split + ".tokens"));
    CAPTURE(split);
    REQUIRE(file.num_tokens() > 0);
    int64_t pads = 0;
    for (int64_t i = 0; i < file.num_tokens(); ++i) pads += file.token(i) == file.special().pad;
    CHECK(pads == 0);
  }
  files::remove_all(tmp);
}

// examples/bert/main.cpp: pretokenize reads only regular files; a directory is bad input naming
// it (exit 1, as for a missing file), and the output is not written.
TEST_CASE("library_use: bert_example pretokenize rejects a directory as TEXT", "[library_use][process]") {
  const std::string example = std::string(TRAIN_BINARY_DIR) + "/bin/bert_example";
  if (!files::is_regular_file(example)) FAIL(example + " is missing (TRAIN_BUILD_EXAMPLES=OFF?)");
  const std::string tmp = files::make_temp_directory("train_test_bert_pretokenize_");
  std::ofstream(files::join(tmp, "vocab.txt")) << kSmallVocab;
  std::ofstream(files::join(tmp, "corpus.txt")) << "hello world\n";
  files::make_directories(files::join(tmp, "big"));
  std::ofstream(files::join(tmp, "big/part1.txt")) << "hello\n";
  std::ofstream(files::join(tmp, "kept.tokens")) << "an earlier output\n";
  const std::string log = files::join(tmp, "out.log");
  for (const std::string inputs : {"big/", "corpus.txt big/"}) {
    const auto before = snapshot(tmp, "");
    for (const std::string out : {"o1.tokens", "kept.tokens"}) {
      const int rc = run_bert_example(tmp, "pretokenize --vocab vocab.txt --out " + out + " " + inputs, log);
      const std::string said = read_text(log);
      INFO(inputs << " -> " << out << ": " << said);
      CHECK(rc == 1);
      CHECK(said.find("big/: is a directory") != std::string::npos);
      auto now = snapshot(tmp, "");
      now.erase("out.log");
      auto expected = before;
      expected.erase("out.log");
      CHECK(now == expected);  // no o1.tokens, kept.tokens as it was, no temporaries
    }
  }
  CHECK(run_bert_example(tmp, "pretokenize --vocab vocab.txt --out o1.tokens corpus.txt big/part1.txt", log) == 0);
  CHECK(read_text(log).find("2 documents, 3 tokens") != std::string::npos);
  files::remove_all(tmp);
}

// A program's model with its own loss (Model::has_own_loss) trains a task that is not
// classification through the whole flow: the probe, accumulation, evaluation, metrics and best.pt.
TEST_CASE("library_use: a model with its own loss trains a regression", "[library_use]") {
  models::register_model("test_regressor", [](const ModelConfig&) { return std::make_shared<Regressor>(); },
                         "linear regression with mean squared error");
  models::register_model("test_bad_regressor",
                         [](const ModelConfig&) { return std::make_shared<Regressor>(Flaw::kLossPerSample); },
                         "a loss of one value per sample");
  models::register_model("test_bad_sums", [](const ModelConfig&) { return std::make_shared<Regressor>(Flaw::kSumMissing); },
                         "one of two measures missing");
  const std::string tmp = files::make_temp_directory("train_test_own_loss_");
  RunOptions options;
  options.train_data = std::make_shared<LinearTargets>(64);
  options.val_data = std::make_shared<LinearTargets>(32, 1000);

  const Config config = regression_config(tmp, "checkpoint: {best: mae}\n");
  RunParts run = prepare_run(config, options);
  CHECK(run.plan.memory.source.find("probe on cpu") != std::string::npos);  // the probe took the model's loss
  FitOptions fit;
  fit.run_dir = files::join(tmp, "run");
  const FitReport report = fit_in_run_dir(config, run, fit);
  REQUIRE(report.exit_code == kExitOk);
  const FitResult& result = report.result;
  CHECK(result.steps == 200);
  CHECK_FALSE(result.val.has_accuracy);
  CHECK(result.val.samples == 32);

  // The regression is learnt (the targets' variance is about 1.3).
  const torch::Tensor fc = run.model->named_parameters()["fc.weight"].detach();
  CHECK(torch::allclose(fc.reshape({8}), LinearTargets::weights(), 0, 0.02));
  CHECK(result.val.loss < 1e-3);
  // The evaluation's loss is the model's loss over the validation set.
  {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> xs, ys;
    for (int64_t i = 0; i < 32; ++i) {
      const auto example = options.val_data->get(i, 0);
      xs.push_back(example.input);
      ys.push_back(example.target);
    }
    const torch::Tensor output = run.model->forward(torch::stack(xs));
    const double mse = run.model->loss(output, torch::stack(ys)).item<double>();
    CHECK(result.val.loss == Approx(mse).epsilon(1e-5));
    // And its own measures are their means over the validation set.
    const torch::Tensor error = (output - torch::stack(ys)).abs();
    REQUIRE(result.val.metrics.size() == 2);
    CHECK(result.val.metrics[0].first == "mae");
    CHECK(result.val.metrics[0].second == Approx(error.mean().item<double>()).epsilon(1e-5));
    CHECK(result.val.metrics[1].first == "within_5pc");
    CHECK(result.val.metrics[1].second == Approx(error.lt(0.05).to(torch::kDouble).mean().item<double>()));
  }
  // Its rows have a loss and its measures, no accuracy; best.pt follows the mean absolute error.
  const std::string metrics = read_text(files::join(fit.run_dir, "metrics.jsonl"));
  CHECK(metrics.find("\"split\":\"val\"") != std::string::npos);
  CHECK(metrics.find("accuracy") == std::string::npos);
  CHECK(metrics.find("\"mae\":") != std::string::npos);
  CHECK(metrics.find("\"within_5pc\":") != std::string::npos);
  CHECK(result.best_metric == "mae");
  CHECK(result.best_step == 200);
  CHECK(files::is_regular_file(files::join(fit.run_dir, "checkpoints/best.pt")));
  // A measure where higher is better is ranked that way (0.78 at step 100, 1.0 at 200).
  {
    const Config hits = regression_config(tmp, "checkpoint: {best: within_5pc}\n");
    RunParts r = prepare_run(hits, options);
    FitOptions f;
    f.run_dir = files::join(tmp, "run-hits");
    const FitReport hit_report = fit_in_run_dir(hits, r, f);
    CHECK(hit_report.result.best_metric == "within_5pc");
    CHECK(hit_report.result.best_step == 200);
    CHECK(hit_report.result.best_value == 1.0);
  }

  // Micro-batches of 4 with 4 accumulation steps give the weights of whole batches of 16: the
  // trainer averages the model's per-micro-batch means.
  {
    Config whole = regression_config(tmp, "");
    whole.trainer.max_steps = 5;
    Config split = whole;
    split.tuning.micro_batch = 4;
    std::vector<torch::Tensor> weights;
    for (const Config& c : {whole, split}) {
      RunParts r = prepare_run(c, options);
      Trainer trainer(c, r.plan, r.model, r.train, r.val, "");
      trainer.fit();
      weights.push_back(r.model->named_parameters().find("fc.weight")->detach().clone());
      INFO("accum_steps " << r.plan.accum_steps);
      CHECK(r.plan.accum_steps == (c.tuning.micro_batch == 4 ? 4 : 1));
    }
    CHECK(torch::allclose(weights[0], weights[1], 1e-5, 1e-6));
  }

  // What such a model cannot have is a config error naming the key.
  {
    RunParts r = prepare_run(regression_config(tmp, ""), options);
    Config accuracy = regression_config(tmp, "checkpoint: {best: accuracy}\n");
    CHECK_THROWS_WITH(Trainer(accuracy, r.plan, r.model, r.train, r.val, ""),
                      Catch::Contains("key 'checkpoint.best': accuracy") && Catch::Contains("has its own loss"));
    Config unknown = regression_config(tmp, "checkpoint: {best: mse}\n");
    CHECK_THROWS_WITH(Trainer(unknown, r.plan, r.model, r.train, r.val, ""),
                      Catch::Contains("key 'checkpoint.best': 'mse' is not a measure of model test_regressor's evaluations") &&
                          Catch::Contains("(they report: loss, mae, within_5pc)"));
    // prepare_run checks the same, before a program creates its run directory.
    CHECK_THROWS_WITH(prepare_run(unknown, options), Catch::Contains("key 'checkpoint.best': 'mse'"));
    Config smoothing = regression_config(tmp, "loss: {label_smoothing: 0.1}\n");
    CHECK_THROWS_WITH(Trainer(smoothing, r.plan, r.model, r.train, r.val, ""),
                      Catch::Contains("key 'loss.label_smoothing'") && Catch::Contains("set it to 0"));
  }
  // A loss that is not a 0-d mean is refused with the model's name, in the probe and in training.
  {
    Config bad = regression_config(tmp, "");
    bad.model.name = "test_bad_regressor";
    bad.tuning.cache_dir = files::join(tmp, "cache-bad");  // the same shapes: the cache would skip the probe
    CHECK_THROWS_WITH(prepare_run(bad, options), Catch::Contains("loss() returned a Float tensor of shape [") &&
                                                     Catch::Contains("0-d floating-point tensor"));
    bad.tuning.micro_batch = 16;  // no probe
    RunParts r = prepare_run(bad, options);
    Trainer trainer(bad, r.plan, r.model, r.train, r.val, "");
    CHECK_THROWS_WITH(trainer.fit(), Catch::Contains("model 'test_bad_regressor': loss() returned"));
    CHECK_THROWS_WITH(trainer.evaluate(), Catch::Contains("model 'test_bad_regressor': loss() returned"));
    bad.model.name = "test_bad_sums";
    RunParts sums = prepare_run(bad, options);
    Trainer evaluating(bad, sums.plan, sums.model, sums.train, sums.val, "");
    CHECK_THROWS_WITH(evaluating.evaluate(), Catch::Contains("model 'test_bad_sums': eval_sums() returned 1 value(s) "
                                                             "for the 2 metric(s) eval_metrics() names"));
  }
  files::remove_all(tmp);
}

// model.options carry a program's own model's settings from YAML to its builder; an option the
// builder does not read is an error located in the file.
TEST_CASE("library_use: model.options reach a program's model builder and unread ones are errors", "[library_use]") {
  models::register_model("test_options_mlp", [](const ModelConfig& c) {
    const int64_t hidden = c.options.get_int("hidden", 16);
    const bool bias = c.options.get_bool("bias", true);
    auto model = std::make_shared<Regressor>();
    model->replace_module("fc", torch::nn::Linear(torch::nn::LinearOptions(8, hidden).bias(bias)));
    return model;
  }, "a regression whose width comes from model.options");
  const std::string tmp = files::make_temp_directory("train_test_model_options_");
  RunOptions options;
  options.train_data = std::make_shared<LinearTargets>(64);
  const auto config_with = [&tmp](const std::string& model_options) {
    return parse_config("model:\n  name: test_options_mlp\n  options: " + model_options + "\n" +
                        "data: {kind: custom, workers: 0}\n"
                        "trainer: {global_batch: 16, max_steps: 1, device: cpu, threads: 1}\n"
                        "tuning: {micro_batch: 16, cache_dir: " + files::join(tmp, "cache") + "}\n",
                        "options.yaml");
  };
  {
    RunParts run = prepare_run(config_with("{hidden: 3, bias: off}"), options);
    const auto params = run.model->named_parameters();
    CHECK(params.find("fc.weight")->sizes() == std::vector<int64_t>{3, 8});
    CHECK(params.find("fc.bias") == nullptr);
  }
  try {
    prepare_run(config_with("{hidden: 3, hiden: 4}"), options);
    FAIL("an option the builder does not read was accepted");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::StartsWith("options.yaml:3:31: key 'model.options.hiden': model 'test_options_mlp' "
                                           "does not read this option; did you mean 'hidden'? (it reads: bias, hidden)"));
  }
  try {
    prepare_run(config_with("{hidden: wide}"), options);
    FAIL("a value of the wrong type was accepted");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::StartsWith("options.yaml:3:21: key 'model.options.hidden': expected an int, got 'wide'"));
  }
  // The plan cache keys on the options too: one that shows in no parameter shape (here a switch the
  // builder reads, as a recomputation flag would be) can still change the memory a step takes.
  {
    const auto probed = [&](const std::string& model_options) {
      Config c = config_with(model_options);
      c.tuning.micro_batch = 0;  // probe, or reuse a probe from the cache
      c.tuning.cache_dir = files::join(tmp, "probe-cache");
      return prepare_run(c, options).plan.memory.source;
    };
    CHECK_THAT(probed("{hidden: 4, bias: on}"), Catch::StartsWith("probe on cpu"));
    CHECK_THAT(probed("{hidden: 4, bias: on}"), Catch::StartsWith("plan cache "));
    CHECK_THAT(probed("{hidden: 4, bias: true}"), Catch::StartsWith("probe on cpu"));  // spelt otherwise: measured again
  }
  // A built-in model reads none.
  Config builtin = parse_config("model: {name: mlp, in_channels: 1, num_classes: 4, options: {depth: 3}}\n"
                                "data: {kind: custom}\ntrainer: {global_batch: 8, max_steps: 1, device: cpu}\n",
                                "builtin.yaml");
  RunOptions images;
  images.train_data = std::make_shared<Brightness>();
  CHECK_THROWS_WITH(prepare_run(builtin, images),
                    Catch::Contains("key 'model.options.depth': model 'mlp' does not read this option (it reads no options)"));
  files::remove_all(tmp);
}

namespace {

// Brightness, with one of the mistakes a program's own dataset makes.
enum class DataFlaw { kFloatTargets, kLabelBeyondClasses, kInputShapeOtherThanSaid, kNoTargets };
class FlawedBrightness : public Brightness {
 public:
  explicit FlawedBrightness(DataFlaw flaw) : flaw_(flaw) {}
  data::Example get(int64_t index, uint64_t seed) const override {
    data::Example e = Brightness::get(index, seed);
    switch (flaw_) {
      case DataFlaw::kFloatTargets: e.target = e.target.to(torch::kFloat); break;
      case DataFlaw::kLabelBeyondClasses: if (index == 5) e.target = torch::tensor(int64_t{7}); break;
      case DataFlaw::kInputShapeOtherThanSaid: e.input = e.input.reshape({1, 14, 56}); break;
      case DataFlaw::kNoTargets: e.target = torch::Tensor(); break;
    }
    return e;
  }

 private:
  DataFlaw flaw_;
};

// A classifier whose forward returns one value per sample instead of a row of logits: the mistake
// a model edited after its plan was cached makes (the plan cache keys on parameter shapes).
class OneValuePerSample : public models::Model {
 public:
  OneValuePerSample() : fc_(register_module("fc", torch::nn::Linear(28 * 28, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) override { return fc_(x.flatten(1)).sum(1); }

 private:
  torch::nn::Linear fc_;
};

}  // namespace

// What a program's own dataset or model gets wrong is found before the loss, every step and every
// evaluation, on a plan made without a probe (tuning.micro_batch, or a plan-cache hit) as well:
// a DataError or an Error naming the data, the rule and the model, never c10's "Target 7 is out of
// bounds" or "mat1 and mat2 shapes cannot be multiplied" (and on a GPU, no device-side assert).
TEST_CASE("library_use: a custom dataset's or model's mistakes are errors that name them", "[library_use]") {
  models::register_model("test_one_value_per_sample",
                         [](const ModelConfig&) { return std::make_shared<OneValuePerSample>(); },
                         "returns [batch] instead of [batch, classes]");
  const auto config = [](const std::string& model, const std::string& extra = "") {
    return parse_config("model: {name: " + model + ", in_channels: 1, num_classes: 4}\n"
                        "data: {kind: custom, workers: 0}\n"
                        "trainer: {global_batch: 8, max_steps: 10, device: cpu, threads: 1, eval_every_steps: 0}\n"
                        "tuning: {micro_batch: 8}\n" + extra,
                        "flawed.yaml");
  };
  const auto fit_with = [](const Config& c, data::DatasetPtr train, data::DatasetPtr val = nullptr) {
    RunOptions options;
    options.train_data = std::move(train);
    options.val_data = std::move(val);
    RunParts run = prepare_run(c, options);
    Trainer(c, run.plan, run.model, run.train, run.val, "").fit();
  };
  const Config mlp = config("mlp");
  const auto flawed = [](DataFlaw flaw) { return std::make_shared<FlawedBrightness>(flaw); };

  CHECK_THROWS_AS(fit_with(mlp, flawed(DataFlaw::kFloatTargets)), DataError);
  CHECK_THROWS_WITH(fit_with(mlp, flawed(DataFlaw::kFloatTargets)),
                    Catch::Contains("the training data (brightness (40 samples)) gave Float targets") &&
                        Catch::Contains("model 'mlp' is trained with cross-entropy on int64 class indices"));
  // Sample 5 is in the first batch of one epoch or another: found within the run's 10 steps.
  CHECK_THROWS_WITH(fit_with(mlp, flawed(DataFlaw::kLabelBeyondClasses)),
                    Catch::Contains("gave the target 7, outside its classes [0, 4)") &&
                        Catch::Contains("below num_classes()"));
  CHECK_THROWS_WITH(fit_with(mlp, flawed(DataFlaw::kInputShapeOtherThanSaid)),
                    Catch::Contains("gave a batch of inputs of shape [8, 1, 14, 56], but its input_shape() is [1, 28, 28]"));
  CHECK_THROWS_AS(fit_with(mlp, flawed(DataFlaw::kNoTargets)), DataError);
  // The validation data is checked as well.
  CHECK_THROWS_WITH(fit_with(config("mlp", "checkpoint: {best: accuracy}\n"), std::make_shared<Brightness>(),
                             flawed(DataFlaw::kLabelBeyondClasses)),
                    Catch::Contains("the validation data (brightness (40 samples)) gave the target 7"));
  // The model's output, without a probe to find it first.
  CHECK_THROWS_WITH(fit_with(config("test_one_value_per_sample"), std::make_shared<Brightness>()),
                    Catch::Contains("model 'test_one_value_per_sample': its output has shape [8]: 1 row(s) of logits "
                                    "for 8 target(s)"));

  // The Trainer built by hand: a null model or training set is a UsageError, not a crash.
  RunOptions options;
  options.train_data = std::make_shared<Brightness>();
  RunParts run = prepare_run(mlp, options);
  CHECK_THROWS_AS(Trainer(mlp, run.plan, nullptr, run.train, nullptr, ""), UsageError);
  CHECK_THROWS_WITH(Trainer(mlp, run.plan, run.model, nullptr, nullptr, ""), Catch::Contains("no training set"));

  // An empty validation set is none: no evaluations (with a warning), and checkpoint.best, which
  // ranks evaluations, says so.
  class Empty : public Brightness {
   public:
    int64_t size() const override { return 0; }
  };
  const auto empty = std::make_shared<Empty>();
  Trainer trainer(mlp, run.plan, run.model, run.train, empty, "");
  const FitResult result = trainer.fit();
  CHECK(result.steps == 10);
  CHECK(result.val.samples == 0);
  const Config best = config("mlp", "checkpoint: {best: loss}\n");
  CHECK_THROWS_WITH(Trainer(best, run.plan, run.model, run.train, empty, ""),
                    Catch::Contains("key 'checkpoint.best'") && Catch::Contains("an empty validation split"));
}

// What a program attached to the run reads and does: a metrics row's values by name, a stop asked
// from a listener (after that very step, said in the result), and a model wider than its data
// (warned of, and no top-5 for four classes).
TEST_CASE("library_use: a metrics listener reads values by name and stops the run at its step", "[library_use]") {
  MetricRecord row;
  row.add("split", "train").add("step", 10).add("loss", 0.25).add("finite", true);
  REQUIRE(row.find("split") != nullptr);
  CHECK(std::get<std::string>(*row.find("split")) == "train");
  CHECK(row.find("accuracy") == nullptr);
  CHECK(row.number("step") == 10.0);
  CHECK(row.number("loss") == 0.25);
  CHECK(row.number("finite") == 1.0);
  CHECK_FALSE(row.number("split").has_value());
  CHECK_FALSE(row.number("accuracy").has_value());
  row.add("loss", 0.5);  // the last one added, as a JSON reader of to_json() takes it
  CHECK(row.number("loss") == 0.5);

  const std::string tmp = files::make_temp_directory("train_test_listener_");
  const std::string log_path = files::join(tmp, "log.txt");
  // model.num_classes left at its default (10) for the four brightness classes.
  const Config config = parse_config("model: {name: mlp, in_channels: 1}\n"
                                     "data: {kind: custom, workers: 0}\n"
                                     "trainer: {global_batch: 8, max_steps: 30, device: cpu, threads: 1, "
                                     "eval_every_steps: 0}\n"
                                     "logging: {every_steps: 5}\n"
                                     "tuning: {micro_batch: 8}\n",
                                     "listener.yaml");
  RunOptions options;
  options.train_data = std::make_shared<Brightness>();
  options.val_data = options.train_data;
  train::log::set_file(log_path);
  RunParts run = prepare_run(config, options);
  for (const std::string run_dir : {std::string(), files::join(tmp, "run")}) {
    Trainer trainer(config, run.plan, run.model, run.train, run.val, run_dir);
    std::vector<double> steps;
    trainer.on_metrics([&](const MetricRecord& r) {
      if (r.find("split") && std::get<std::string>(*r.find("split")) == "train") steps.push_back(*r.number("step"));
      if (r.number("step") == 10.0) trainer.request_stop();
    });
    const FitResult result = trainer.fit();
    CHECK(result.steps == 10);
    CHECK(result.stopped);
    CHECK_FALSE(result.stopped_early);
    CHECK(steps == std::vector<double>{5, 10});
    CHECK(result.last_checkpoint == (run_dir.empty() ? "" : checkpoint_path(files::join(run_dir, "checkpoints"), 10)));
    // No top-5 for four classes, however many outputs the model has.
    CHECK(result.val.samples == 40);
    CHECK_FALSE(result.val.has_top5);
  }
  // A run that is not stopped says so too; a second fit() of a finished run trains no more and
  // still names the newest checkpoint.
  {
    const std::string run_dir = files::join(tmp, "whole");
    Trainer trainer(config, run.plan, run.model, run.train, nullptr, run_dir);
    const FitResult first = trainer.fit();
    CHECK_FALSE(first.stopped);
    CHECK(first.steps == 30);
    const std::string newest = checkpoint_path(files::join(run_dir, "checkpoints"), 30);
    CHECK(first.last_checkpoint == newest);
    const FitResult second = trainer.fit();
    CHECK(second.steps == 30);
    CHECK(second.last_checkpoint == newest);
  }
  train::log::set_file("");
  const std::string logged = read_text(log_path);
  CHECK_THAT(logged, Catch::Contains("model.num_classes is 10 (not set), but the data (brightness (40 samples)) has 4 "
                                     "classes: 6 of the model's outputs match no class; set model.num_classes: 4"));
  CHECK_THAT(logged, Catch::Contains("stopped after step 10; no run directory, so nothing was saved to resume from"));
  CHECK_THAT(logged, Catch::Contains("stopped after step 10; resume with --resume auto"));
  files::remove_all(tmp);
}
