#include "testing.h"

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/models/model.h"
#include "train/models/small.h"

using train::ModelConfig;
using namespace train::models;

namespace {

ModelConfig small_config(const std::string& name, int64_t channels = 1, int64_t classes = 10) {
  ModelConfig config;
  config.name = name;
  config.in_channels = channels;
  config.num_classes = classes;
  return config;
}

std::string shape_text(const torch::Tensor& t) {
  std::string out;
  for (int64_t d : t.sizes()) out += (out.empty() ? "" : ",") + std::to_string(d);
  return out;
}

}  // namespace

TEST_CASE("mlp and lenet are registered with the parameter counts of their layouts", "[models]") {
  CHECK(has_model("mlp"));
  CHECK(has_model("lenet"));
  // 784*512+512 + 512*512+512 + 512*10+10
  CHECK(count_parameters(*make_model(small_config("mlp"))) == 669706);
  // conv 1->6 5x5: 156, conv 6->16 5x5: 2416, FC 400->120: 48120, 120->84: 10164, 84->10: 850
  CHECK(count_parameters(*make_model(small_config("lenet"))) == 61706);
  // Channels and classes come from the config: 3*784*512+512 + 262656 + 512*5+5
  CHECK(count_parameters(*make_model(small_config("mlp", 3, 5))) == 1469957);
  // 6*3*25+6 + 2416 + 48120 + 10164 + 84*5+5
  CHECK(count_parameters(*make_model(small_config("lenet", 3, 5))) == 61581);
}

TEST_CASE("mlp and lenet: layer shapes, forward shapes, gradients for every parameter", "[models]") {
  for (const std::string name : {"mlp", "lenet"}) {
    DYNAMIC_SECTION(name) {
      auto model = make_model(small_config(name));
      CHECK_FALSE(model->has_batch_stats());
      CHECK(model->is_convolutional() == (name == "lenet"));
      const auto params = model->named_parameters();
      if (name == "mlp") {
        CHECK(params["fc1.weight"].sizes() == torch::IntArrayRef({512, 784}));
        CHECK(params["fc2.weight"].sizes() == torch::IntArrayRef({512, 512}));
        CHECK(params["fc3.weight"].sizes() == torch::IntArrayRef({10, 512}));
      } else {
        CHECK(params["conv1.weight"].sizes() == torch::IntArrayRef({6, 1, 5, 5}));
        CHECK(params["conv2.weight"].sizes() == torch::IntArrayRef({16, 6, 5, 5}));
        CHECK(params["fc1.weight"].sizes() == torch::IntArrayRef({120, 400}));
        CHECK(params["fc2.weight"].sizes() == torch::IntArrayRef({84, 120}));
        CHECK(params["fc3.weight"].sizes() == torch::IntArrayRef({10, 84}));
      }
      const auto output = model->forward(torch::randn({3, 1, 28, 28}));
      CHECK(output.sizes() == torch::IntArrayRef({3, 10}));
      torch::nn::functional::cross_entropy(output, torch::tensor({0, 4, 9})).backward();
      for (const auto& p : model->named_parameters()) {
        INFO(p.key());
        REQUIRE(p.value().grad().defined());
        CHECK(p.value().grad().abs().sum().item<double>() > 0.0);
      }
    }
  }
}

TEST_CASE("mlp and lenet reject inputs that are not [B, C, 28, 28], naming the expected shape", "[models]") {
  for (const std::string name : {"mlp", "lenet"}) {
    auto model = make_model(small_config(name));
    CHECK_THROWS_WITH(model->forward(torch::randn({2, 1, 32, 32})),
                      Catch::Contains(name + ": expected input [B, 1, 28, 28], got [2, 1, 32, 32]"));
    CHECK_THROWS_AS(model->forward(torch::randn({2, 3, 28, 28})), std::invalid_argument);
  }
  // The builders' std::invalid_argument reaches users of the registry as a config error.
  CHECK_THROWS_AS(make_model(small_config("mlp", 0)), train::ConfigError);
  CHECK_THROWS_WITH(make_model(small_config("lenet", 1, 0)),
                    Catch::Contains("key 'model.name'") && Catch::Contains("num_classes must be >= 1"));
  // The check made before a run, naming the key to change.
  for (const std::string name : {"mlp", "lenet"}) {
    auto model = make_model(small_config(name));
    CHECK(model->input_problem({1, 28, 28}, 0).empty());
    CHECK_THAT(model->input_problem({1, 8, 8}, 0),
               Catch::Contains("key 'data.image_size': " + name + " is laid out for 28x28 images") &&
                   Catch::Contains("8x8"));
    CHECK_THAT(model->input_problem({16}, 50), Catch::Contains("key 'model.name'"));
  }
}

TEST_CASE("mlp and lenet have the parameters of benchmarks/fit.py's Python models", "[models][python]") {
  const std::string dir = train::files::make_temp_directory("train_bench_models_");
  REQUIRE(train::testing::run_python("bench_models.py", "\"" + dir + "\"") == 0);
  std::ifstream in(train::files::join(dir, "bench_models.txt"));
  REQUIRE(in.good());
  std::map<std::string, std::map<std::string, std::string>> python;  // model -> name -> shape
  std::string model_name, param, shape;
  while (in >> model_name >> param >> shape) python[model_name][param] = shape;
  train::files::remove_all(dir);

  for (const std::string name : {"mlp", "lenet"}) {
    INFO(name);
    auto model = make_model(small_config(name));
    std::map<std::string, std::string> cpp;
    for (const auto& p : model->named_parameters()) cpp[p.key()] = shape_text(p.value());
    CHECK(cpp == python[name]);
  }
}

TEST_CASE("configs/bench: valid configs with the benchmark's fixed settings", "[models][config]") {
  const std::string dir = std::string(TRAIN_SOURCE_DIR) + "/configs/bench/";
  const std::map<std::string, std::pair<std::string, int64_t>> expected = {
      {"mlp_fashion_mnist.yaml", {"mlp", 32}},
      {"lenet_fashion_mnist.yaml", {"lenet", 32}},
      {"resnet18_small.yaml", {"resnet18", 128}}};
  for (const auto& [file, model_batch] : expected) {
    INFO(file);
    const train::Config c = train::load_config(dir + file);
    CHECK(c.model.name == model_batch.first);
    CHECK(c.trainer.global_batch == model_batch.second);
    CHECK(c.trainer.max_steps > 0);
    CHECK(c.optim.name == "sgd");
    CHECK(c.optim.lr == 0.05);
    CHECK(c.optim.momentum == 0.9);
    CHECK(c.schedule.name == "constant");
    CHECK(c.precision.mode == "fp32");
    CHECK(c.data.kind == "idx");
    CHECK(c.data.shuffle);
    CHECK(c.data.mean == std::vector<double>{0.2860});
    CHECK(c.data.std == std::vector<double>{0.3530});
    CHECK_NOTHROW(make_model(c.model));
  }
}

TEST_CASE("benchmarks: compare_resnet.py and compare_bert.py keep one process per side across rounds, or start one a round",
          "[python][bench]") {
  // Tiny CPU runs of the GPU comparisons: each round's JSON names the process that ran it.
  const std::string dir = train::files::make_temp_directory("train_bench_serve_");
  const std::string bin = std::string(TRAIN_BINARY_DIR) + "/bin/";
  const std::string resnet = std::string(" \"") + TRAIN_SOURCE_DIR + "/benchmarks/compare_resnet.py\" --bin \"" + bin +
                             "bench_resnet_step\" --device cpu --depth 18 --batch 2 --image 32 --steps 2 --warmup 1 "
                             "--window 1 --precision fp32 --channels-last 0 --rounds 3";
  const std::string bert = std::string(" \"") + TRAIN_SOURCE_DIR + "/benchmarks/compare_bert.py\" --bin \"" + bin +
                           "bench_bert_step\" --device cpu --preset bert-tiny --batch 2 --seq 16 --steps 2 --warmup 1 "
                           "--window 1 --precision fp32 --rounds 3 --threads 1";
  // {side: the pid of each round}, read from the script's --out file.
  auto pids_of = [&](const std::string& script_args, const std::string& processes) {
    const std::string out = train::files::join(dir, "out.json");
    const std::string cmd = std::string("\"") + TRAIN_PYTHON + "\"" + script_args + " --processes " + processes +
                            " --out \"" + out + "\" > \"" + dir + "/log.txt\" 2>&1";
    INFO(cmd);
    const int rc = std::system(cmd.c_str());
    std::ifstream log(dir + "/log.txt");
    INFO(std::string(std::istreambuf_iterator<char>(log), {}));
    REQUIRE(rc == 0);
    std::ifstream in(out);
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    std::map<std::string, std::vector<std::string>> pids;
    const std::regex run("\"impl\": \"(cpp|python)\",\\s*\"pid\": ([0-9]+)");
    for (std::sregex_iterator it(text.begin(), text.end(), run), end; it != end; ++it) {
      pids[(*it)[1]].push_back((*it)[2]);
    }
    return pids;
  };
  for (const std::string& script : {resnet, bert}) {
    INFO(script);
    auto kept = pids_of(script, "serve");
    for (const char* side : {"cpp", "python"}) {
      REQUIRE(kept[side].size() == 3);
      CHECK(kept[side][0] == kept[side][1]);
      CHECK(kept[side][1] == kept[side][2]);
    }
    if (script == bert) continue;  // the same Side class starts both scripts' processes
    auto fresh = pids_of(script, "fresh");
    for (const char* side : {"cpp", "python"}) {
      REQUIRE(fresh[side].size() == 3);
      CHECK(fresh[side][0] != fresh[side][1]);
      CHECK(fresh[side][1] != fresh[side][2]);
    }
  }
  train::files::remove_all(dir);
}
