#include "testing.h"

#include <train/checkpoint.h>
#include <train/config.h>
#include <train/data/factory.h>
#include <train/data/idx.h>
#include <train/data/loader.h>
#include <train/data/synthetic.h>
#include <train/data/token_file.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/fit.h>
#include <train/log.h>
#include <train/metrics.h>
#include <train/models/bert.h>
#include <train/models/model.h>
#include <train/optim.h>
#include <train/run.h>
#include <train/safetensors.h>
#include <train/trainer.h>

#include <torch/torch.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <sstream>
#include <thread>
#include <sys/resource.h>
#include <unistd.h>
#include <variant>

using namespace train;

namespace {

// A model without batch statistics, so that micro-batching must not change the update.
class TinyMlp : public models::Model {
 public:
  explicit TinyMlp(const ModelConfig& c) {
    fc1 = register_module("fc1", torch::nn::Linear(c.in_channels * 8 * 8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, c.num_classes));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return fc2->forward(torch::relu(fc1->forward(x.flatten(1))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

void register_tiny_mlp() {
  static const bool once = [] {
    models::register_model("tiny_mlp", [](const ModelConfig& c) { return std::make_shared<TinyMlp>(c); },
                           "two-layer MLP for tests");
    return true;
  }();
  (void)once;
}

Config synthetic_config(const std::string& extra = "") {
  return parse_config("model: {name: tiny_mlp, in_channels: 1, num_classes: 10}\n"
                      "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 256,"
                      " synthetic_val_samples: 64, workers: 0}\n"
                      "optim: {name: sgd, lr: 0.1, momentum: 0.0}\n"
                      "schedule: {name: constant}\n"
                      "trainer: {global_batch: 16, max_steps: 1, device: cpu, threads: 1}\n"
                      "logging: {every_steps: 1000}\n",
                      "trainer_test.yaml", {extra.empty() ? std::vector<std::string>{} : std::vector<std::string>{extra}});
}

std::vector<torch::Tensor> params_after_fit(Config c) {
  RunParts run = prepare_run(c);
  Trainer trainer(c, run.plan, run.model, run.train, nullptr, "");
  trainer.fit();
  std::vector<torch::Tensor> out;
  for (const auto& p : trainer.model().parameters()) out.push_back(p.detach().clone());
  return out;
}

std::string temp_dir(const std::string& name) { return files::make_temp_directory("train_test_" + name + "_"); }

}  // namespace

TEST_CASE("accumulation: 4 micro-steps of 4 equal one step of 16", "[trainer]") {
  register_tiny_mlp();
  Config whole = synthetic_config();
  Config micro = synthetic_config("tuning.micro_batch=4");
  const auto a = params_after_fit(whole);
  const auto b = params_after_fit(micro);
  RunParts run = prepare_run(micro);
  CHECK(run.plan.accum_steps == 4);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(torch::allclose(a[i], b[i], 1e-5, 1e-6));

  // The step really moved the weights (otherwise the comparison above proves nothing).
  torch::manual_seed(0);
  RunParts fresh = prepare_run(whole);
  CHECK_FALSE(torch::allclose(fresh.model->parameters()[0], a[0]));
}

namespace {

// Token tagging with a varying number of targets per sequence (MLM-like: -100 elsewhere), some
// sequences with none at all.
class TokenToy final : public data::Dataset {
 public:
  int64_t size() const override { return 256; }
  data::Example get(int64_t index, uint64_t /*seed*/) const override {
    torch::Tensor ids = torch::empty({8}, torch::kLong), target = torch::full({8}, -100, torch::kLong);
    const int64_t targets = (index * 7) % 9;  // 0..8
    for (int64_t t = 0; t < 8; ++t) {
      ids[t] = (index * 5 + t * 3) % 20;
      if (t < targets) target[t] = (index + t) % 20;
    }
    return {ids, target};
  }
  std::vector<int64_t> input_shape() const override { return {8}; }
  int64_t num_classes() const override { return 20; }
  std::string describe() const override { return "token toy"; }
};

class TinyTagger : public models::Model {
 public:
  explicit TinyTagger(const ModelConfig&) {
    embed = register_module("embed", torch::nn::Embedding(20, 16));
    out = register_module("out", torch::nn::Linear(16, 20));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return out->forward(torch::tanh(embed->forward(x))); }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear out{nullptr};
};

std::vector<torch::Tensor> tagger_after_fit(int64_t micro_batch) {
  static const bool once = [] {
    models::register_model("tiny_tagger", [](const ModelConfig& c) { return std::make_shared<TinyTagger>(c); },
                           "token tagger for tests");
    return true;
  }();
  (void)once;
  Config c = synthetic_config("model.name=tiny_tagger");
  c.tuning.micro_batch = micro_batch;
  c.trainer.max_steps = 3;
  c.optim.lr = 0.5;
  RunParts run = prepare_run(c);
  Trainer trainer(c, run.plan, run.model, std::make_shared<TokenToy>(), nullptr, "");
  trainer.fit();
  std::vector<torch::Tensor> out;
  for (const auto& p : trainer.model().parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

TEST_CASE("accumulation with token targets: the loss is the mean over the global batch's targets", "[trainer]") {
  // Micro-batches hold different numbers of targets; the mean of their means would depend on the
  // split, so 16 x 1, 4 x 4 and 2 x 8 would train differently (and an all-ignored micro-batch
  // would give NaN).
  const auto whole = tagger_after_fit(16);
  for (const int64_t micro : {4, 2}) {
    INFO("micro-batch " << micro);
    const auto split = tagger_after_fit(micro);
    REQUIRE(split.size() == whole.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      INFO("parameter " << i << ", largest difference " << (whole[i] - split[i]).abs().max().item<double>());
      CHECK(torch::allclose(whole[i], split[i], 1e-5, 1e-6));
    }
  }
  // The steps moved the weights (else the comparison above proves nothing).
  torch::manual_seed(static_cast<uint64_t>(synthetic_config().trainer.seed));  // as prepare_run seeds
  const auto initial = TinyTagger(ModelConfig{}).parameters();
  for (size_t i = 0; i < whole.size(); ++i) {
    CHECK(torch::isfinite(whole[i]).all().item<bool>());
    CHECK((whole[i] - initial[i]).abs().max().item<double>() > 1e-3);
  }
}

TEST_CASE("checkpoint: round trip restores model, optimizer and position", "[trainer][checkpoint]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("ckpt");
  Config c = synthetic_config();
  c.optim.momentum = 0.9;  // optimizer state to restore
  RunParts run = prepare_run(c);
  auto optimizer = make_optimizer(c.optim, *run.model, 0.1);
  auto loss = run.model->forward(torch::randn({4, 1, 8, 8})).sum();
  loss.backward();
  optimizer->step();
  TrainState st;
  st.step = 7;
  st.epoch = 2;
  st.batch_in_epoch = 5;
  st.samples_seen = 112;
  st.config_yaml = to_yaml(c);
  st.tensors["extra/scale"] = torch::tensor({65536.0});
  const std::string path = checkpoint_path(dir, 7);
  save_checkpoint(path, *run.model, optimizer.get(), st);
  CHECK(latest_checkpoint(dir) == path);

  RunParts other = prepare_run(synthetic_config("trainer.seed=5"));
  auto optimizer2 = make_optimizer(c.optim, *other.model, 0.1);
  const TrainState back = load_checkpoint(path, *other.model, optimizer2.get());
  CHECK(back.step == 7);
  CHECK(back.epoch == 2);
  CHECK(back.batch_in_epoch == 5);
  CHECK(back.samples_seen == 112);
  CHECK(back.config_yaml == st.config_yaml);
  CHECK(back.tensors.at("extra/scale").item<double>() == 65536.0);
  const auto pa = run.model->parameters(), pb = other.model->parameters();
  for (size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i], pb[i]));
  // Momentum buffers came back: one more identical step keeps the models identical.
  optimizer->zero_grad();
  optimizer2->zero_grad();
  for (auto* m : {run.model.get(), other.model.get()}) {
    torch::manual_seed(1);
    m->forward(torch::randn({4, 1, 8, 8})).sum().backward();
  }
  optimizer->step();
  optimizer2->step();
  for (size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i], pb[i]));
  files::remove_all(dir);
}

TEST_CASE("checkpoint: bad files are rejected with the file named", "[trainer][checkpoint]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("badckpt");
  RunParts run = prepare_run(synthetic_config());
  CHECK_THROWS_AS(load_checkpoint(files::join(dir, "missing.pt"), *run.model, nullptr), CheckpointError);

  const std::string garbage = files::join(dir, "garbage.pt");
  std::ofstream(garbage) << "not a checkpoint";
  CHECK_THROWS_WITH(load_checkpoint(garbage, *run.model, nullptr), Catch::Contains("garbage.pt"));

  const std::string good = checkpoint_path(dir, 1);
  save_checkpoint(good, *run.model, nullptr, {});
  const std::string truncated = files::join(dir, "truncated.pt");
  files::copy_file(good, truncated);
  REQUIRE(::truncate(truncated.c_str(), files::file_size(good) / 2) == 0);
  CHECK_THROWS_AS(load_checkpoint(truncated, *run.model, nullptr), CheckpointError);

  // A checkpoint of a different architecture names the mismatching entry.
  Config wider = synthetic_config("model.num_classes=12");
  RunParts other = prepare_run(wider);
  CHECK_THROWS_WITH(load_checkpoint(good, *other.model, nullptr), Catch::Contains("fc2.weight"));
  // No temporary files are left behind by successful saves.
  for (const auto& name : files::list_directory(dir)) CHECK(name.find(".tmp.") == std::string::npos);
  files::remove_all(dir);
}

TEST_CASE("checkpoint: NaN weights and optimizer state of another dtype or not finite are refused naming the file",
          "[trainer][checkpoint]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("nanckpt");
  Config c = synthetic_config();
  c.optim.momentum = 0.9;
  RunParts run = prepare_run(c);
  auto optimizer = make_optimizer(c.optim, *run.model, 0.1);
  run.model->forward(torch::randn({4, 1, 8, 8})).sum().backward();
  optimizer->step();
  auto fresh = [&] {
    RunParts other = prepare_run(c);
    return std::make_pair(other.model, make_optimizer(c.optim, *other.model, 0.1));
  };
  torch::Tensor fc2 = run.model->named_parameters()["fc2.weight"];
  const torch::Tensor kept = fc2.detach().clone();
  {
    torch::NoGradGuard no_grad;
    fc2[0][0] = std::numeric_limits<float>::quiet_NaN();
  }
  const std::string nan_weights = files::join(dir, "nan_weights.pt");
  save_checkpoint(nan_weights, *run.model, optimizer.get(), {});
  auto [model, opt] = fresh();
  CHECK_THROWS_WITH(load_checkpoint(nan_weights, *model, opt.get()),
                    Catch::Contains("nan_weights.pt: model entry 'fc2.weight' holds NaN or infinite values"));
  // The same weights as model.init_from (safetensors) are refused before the run starts.
  const std::string nan_safetensors = files::join(dir, "nan.safetensors");
  write_safetensors(nan_safetensors, state_dict(*run.model));
  CHECK_THROWS_WITH(load_model_weights(nan_safetensors, *model, true, {}),
                    Catch::Contains("nan.safetensors: tensor 'fc2.weight' holds NaN or infinite values"));
  CHECK_THROWS_AS(check_model_weights(nan_safetensors, *model, true, {}), CheckpointError);
  {
    torch::NoGradGuard no_grad;
    fc2.copy_(kept);
  }
  // Momentum of another dtype, or a non-finite one: refused at load, not at the first step.
  auto* state = dynamic_cast<torch::optim::SGDParamState*>(optimizer->state().begin()->second.get());
  REQUIRE(state != nullptr);
  const torch::Tensor momentum = state->momentum_buffer();
  state->momentum_buffer(momentum.to(torch::kLong));
  const std::string long_state = files::join(dir, "long_state.pt");
  save_checkpoint(long_state, *run.model, optimizer.get(), {});
  state->momentum_buffer(torch::full_like(momentum, std::numeric_limits<float>::infinity()));
  const std::string inf_state = files::join(dir, "inf_state.pt");
  save_checkpoint(inf_state, *run.model, optimizer.get(), {});
  state->momentum_buffer(momentum);
  for (const auto& [file, expected] : {std::pair{long_state, std::string("is Long but the parameter is Float")},
                                       std::pair{inf_state, std::string("holds NaN or infinite values")}}) {
    auto [m, o] = fresh();
    CHECK_THROWS_WITH(load_checkpoint(file, *m, o.get()),
                      Catch::Contains(file + ": optimizer state does not match this model: optimizer state of "
                                             "parameter") && Catch::Contains(expected));
  }
  files::remove_all(dir);
}

TEST_CASE("checkpoint: a write that fails part way (a full disk) throws naming the file and why, the old one stays",
          "[trainer][checkpoint]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("fullckpt");
  RunParts run = prepare_run(synthetic_config());
  const std::string path = checkpoint_path(dir, 3);
  TrainState st;
  st.step = 3;
  save_checkpoint(path, *run.model, nullptr, st);
  const auto bytes_of = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string before = bytes_of(path), sum_before = bytes_of(path + ".crc32c");
  REQUIRE(before.size() > 2048);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : run.model->parameters()) p.add_(1.0);  // another checkpoint at the same step
  }
  // Files may not grow past 2 KiB: the writes past it fail (EFBIG) as they would on a full disk.
  std::string message;
  {
    const train::testing::FileSizeLimit limit(2048);
    try {
      save_checkpoint(path, *run.model, nullptr, st);  // LibTorch's writer used to terminate the process here
    } catch (const Error& e) {
      message = e.what();
    }
  }
  INFO(message);
  CHECK_THAT(message, Catch::Contains(path) && Catch::Contains(std::strerror(EFBIG)) &&
                          Catch::Contains("unchanged"));
  CHECK(bytes_of(path) == before);
  CHECK(bytes_of(path + ".crc32c") == sum_before);
  for (const auto& name : files::list_directory(dir)) CHECK(name.find(".tmp.") == std::string::npos);
  CHECK(latest_checkpoint(dir) == path);
  files::remove_all(dir);
}

TEST_CASE("checkpoint: the newest is found and kept by step past step 99,999,999 (9-digit names)",
          "[trainer][checkpoint]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("ckptorder");
  RunParts run = prepare_run(synthetic_config());
  for (const int64_t step : {99999998LL, 99999999LL, 100000000LL, 100000001LL}) {
    TrainState st;
    st.step = step;
    save_checkpoint(checkpoint_path(dir, step), *run.model, nullptr, st);
  }
  std::ofstream(files::join(dir, "step_notes.pt")) << "not a checkpoint";  // no step: not listed
  CHECK(files::filename(latest_checkpoint(dir)) == "step_100000001.pt");
  prune_checkpoints(dir, 2, "");
  CHECK(files::exists(checkpoint_path(dir, 100000000)));
  CHECK(files::exists(checkpoint_path(dir, 100000001)));
  CHECK_FALSE(files::exists(checkpoint_path(dir, 99999999)));
  CHECK_FALSE(files::exists(checkpoint_path(dir, 99999998)));
  const auto moved = set_aside_checkpoints_after(dir, 100000000);
  REQUIRE(moved.size() == 1);
  CHECK(files::filename(moved[0]) == "step_100000001.pt");
  // Another future with a checkpoint at the same step, set aside in turn: neither is overwritten,
  // and each checksum stays beside its checkpoint.
  for (int n = 1; n <= 2; ++n) {
    TrainState st;
    st.step = 100000001 + n;  // told apart by the step they hold
    save_checkpoint(checkpoint_path(dir, 100000001), *run.model, nullptr, st);
    const auto again = set_aside_checkpoints_after(dir, 100000000);
    REQUIRE(again.size() == 1);
    CHECK(files::filename(again[0]) == "step_100000001." + std::to_string(n) + ".pt");
    CHECK(files::exists(again[0] + ".crc32c"));
  }
  const std::string aside = files::join(dir, "abandoned");
  CHECK(load_checkpoint(files::join(aside, "step_100000001.pt"), *run.model, nullptr).step == 100000001);
  CHECK(load_checkpoint(files::join(aside, "step_100000001.1.pt"), *run.model, nullptr).step == 100000002);
  CHECK(load_checkpoint(files::join(aside, "step_100000001.2.pt"), *run.model, nullptr).step == 100000003);
  CHECK_FALSE(files::exists(checkpoint_path(dir, 100000001)));
  files::remove_all(dir);
}

namespace {
// tests/data/checkpoint-libtorch-1.13-sgd-momentum.pt: a tiny_mlp checkpoint at step 1 with SGD
// momentum buffers, written by the test binary built against Debian's LibTorch 1.13 with
//   TRAIN_TEST_WORKER=fixture build-1.13/bin/train_tests
const char* const kFixture113 = "tests/data/checkpoint-libtorch-1.13-sgd-momentum.pt";

RunParts momentum_run(std::unique_ptr<torch::optim::Optimizer>& optimizer) {
  register_tiny_mlp();
  Config c = synthetic_config();
  c.optim.momentum = 0.9;
  RunParts run = prepare_run(c);
  optimizer = make_optimizer(c.optim, *run.model, 0.1);
  return run;
}
}  // namespace

// Not a test: the binary's fixture role (tests/main.cpp).
int write_checkpoint_fixture() {
  if (TORCH_VERSION_MAJOR != 1) {
    std::fprintf(stderr, "the fixture is LibTorch 1.x's: run a build against Debian's libtorch-dev\n");
    return 2;
  }
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  RunParts run = momentum_run(optimizer);
  torch::manual_seed(3);
  run.model->forward(torch::randn({4, 1, 8, 8})).sum().backward();
  optimizer->step();
  TrainState st;
  st.step = 1;
  st.config_yaml = to_yaml(synthetic_config("optim.momentum=0.9"));
  const std::string path = files::join(TRAIN_SOURCE_DIR, kFixture113);
  save_checkpoint(path, *run.model, optimizer.get(), st);
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

TEST_CASE("checkpoint: optimizer state written by LibTorch 1.13 resumes on 1.13 and is refused with a way out on 2.x",
          "[trainer][checkpoint]") {
  const std::string path = files::join(TRAIN_SOURCE_DIR, kFixture113);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  RunParts run = momentum_run(optimizer);
  // The weights read on every version (train eval, export, model.init_from).
  CHECK_NOTHROW(load_checkpoint(path, *run.model, nullptr));
  CHECK_NOTHROW(load_model_weights(path, *run.model));
  if (TORCH_VERSION_MAJOR == 1) {
    CHECK(load_checkpoint(path, *run.model, optimizer.get()).step == 1);
    CHECK(optimizer->state().size() == run.model->parameters().size());  // a momentum buffer each
  } else {
    // 2.x read 1.13's hex keys as 0: one parameter got the last state, the others none.
    std::string message;
    try {
      load_checkpoint(path, *run.model, optimizer.get());
    } catch (const CheckpointError& e) {
      message = e.what();
    }
    CHECK_THAT(message, Catch::Contains(path) && Catch::Contains("LibTorch 1.x") &&
                            Catch::Contains("model.init_from: " + path));
    CHECK(optimizer->state().empty());
  }
}

TEST_CASE("fit: a short ResNet run on synthetic data lowers the loss and writes metrics", "[trainer][e2e]") {
  const std::string dir = temp_dir("fit");
  Config c = parse_config(
      "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
      "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 128,"
      " synthetic_val_samples: 64, workers: 1}\n"
      "optim: {name: adamw, lr: 0.003, weight_decay: 0.01}\n"
      "schedule: {name: cosine, warmup_steps: 2}\n"
      "trainer: {global_batch: 32, epochs: 6, device: cpu}\n"
      "checkpoint: {every_steps: 10}\n"
      "logging: {every_steps: 4}\n",
      "e2e.yaml");
  RunParts run = prepare_run(c);
  apply_plan_globals(run.plan);
  Trainer trainer(c, run.plan, run.model, run.train, run.val, dir);
  std::vector<std::string> heard;  // what a program linking train sees of the run
  trainer.on_metrics([&heard](const MetricRecord& r) { heard.push_back(r.to_json()); });
  const EvalResult before = trainer.evaluate();
  const FitResult result = trainer.fit();
  CHECK(result.steps == 24);
  CHECK(result.val.samples == 64);
  CHECK(result.val.loss < before.loss);
  CHECK(result.val.accuracy > 0.3);  // 10 learnable classes; chance is 0.1
  {
    // Top-1 and top-5 again, by hand from the model's logits for each validation sample.
    torch::NoGradGuard no_grad;
    trainer.model().eval();
    int64_t top1 = 0, top5 = 0;
    for (int64_t i = 0; i < run.val->size(); ++i) {
      const data::Example example = run.val->get(i, data::sample_seed(0, 0, i));
      const torch::Tensor logits = trainer.model().forward(example.input.unsqueeze(0))[0];
      const int64_t target = example.target.item<int64_t>();
      top1 += logits.argmax().item<int64_t>() == target ? 1 : 0;
      top5 += std::get<1>(logits.topk(5)).eq(target).any().item<bool>() ? 1 : 0;
    }
    trainer.model().train();
    CHECK(result.val.has_top5);
    CHECK(result.val.accuracy == Approx(static_cast<double>(top1) / 64.0));
    CHECK(result.val.top5 == Approx(static_cast<double>(top5) / 64.0));
    CHECK(result.val.top5 >= result.val.accuracy);
  }
  std::ifstream metrics(files::join(dir, "metrics.jsonl"));
  std::string line;
  int train_lines = 0, val_lines = 0;
  std::vector<std::string> written;
  while (std::getline(metrics, line)) {
    written.push_back(line);
    if (line.find("\"split\":\"train\"") != std::string::npos) {
      ++train_lines;
      for (const char* key : {"\"step\"", "\"epoch\"", "\"loss\"", "\"lr\"", "\"samples_per_s\""}) {
        CHECK_THAT(line, Catch::Contains(key));
      }
    }
    if (line.find("\"split\":\"val\"") != std::string::npos) {
      ++val_lines;
      CHECK_THAT(line, Catch::Contains("\"accuracy\"") && Catch::Contains("\"top5\""));
    }
  }
  CHECK(train_lines == 6);
  CHECK(val_lines == 6);  // one per epoch
  CHECK(heard == written);  // the listener got every row, in the file's order
  CHECK(files::exists(result.last_checkpoint));
  files::remove_all(dir);
}

TEST_CASE("fit: metrics listeners hear every row of a run without a run directory, in order", "[trainer]") {
  register_tiny_mlp();
  Config c = synthetic_config();
  c.trainer.max_steps = 5;
  c.logging.every_steps = 2;
  RunParts run = prepare_run(c);
  Trainer trainer(c, run.plan, run.model, run.train, run.val, "");
  std::vector<std::string> order;
  std::vector<int64_t> train_steps;
  int64_t val_rows = 0;
  trainer.on_metrics([&](const MetricRecord& r) {
    order.push_back("first");
    std::map<std::string, MetricRecord::Value> fields(r.fields().begin(), r.fields().end());
    REQUIRE(fields.count("split") == 1);
    if (std::get<std::string>(fields["split"]) == "train") {
      train_steps.push_back(std::get<int64_t>(fields["step"]));
      CHECK(std::isfinite(std::get<double>(fields["loss"])));
      CHECK(std::get<double>(fields["lr"]) == Approx(0.1));
    } else {
      ++val_rows;
      CHECK(std::get<int64_t>(fields["samples"]) == 64);
    }
  });
  trainer.on_metrics([&](const MetricRecord&) { order.push_back("second"); });
  trainer.on_metrics(nullptr);  // ignored
  const FitResult result = trainer.fit();
  CHECK(result.steps == 5);
  CHECK(train_steps == std::vector<int64_t>{2, 4, 5});  // every 2 steps, and the last
  CHECK(val_rows == 1);                                  // the final evaluation
  REQUIRE(order.size() == 8);
  for (size_t i = 0; i < order.size(); ++i) CHECK(order[i] == (i % 2 == 0 ? "first" : "second"));
}

TEST_CASE("fit: what a metrics listener throws ends fit() with that error", "[trainer]") {
  register_tiny_mlp();
  Config c = synthetic_config();
  c.trainer.max_steps = 4;
  c.logging.every_steps = 1;
  RunParts run = prepare_run(c);
  Trainer trainer(c, run.plan, run.model, run.train, nullptr, "");
  int64_t calls = 0;
  trainer.on_metrics([&calls](const MetricRecord&) {
    if (++calls == 2) throw std::runtime_error("dashboard went away");
  });
  CHECK_THROWS_WITH(trainer.fit(), Catch::Contains("dashboard went away"));
  CHECK(calls == 2);
}

TEST_CASE("fit: stopping and resuming gives the same weights as an uninterrupted run", "[trainer][resume]") {
  register_tiny_mlp();
  const std::string dir_a = temp_dir("resume_a"), dir_b = temp_dir("resume_b");
  Config c = synthetic_config();
  c.trainer.max_steps = 0;
  c.trainer.epochs = 3;  // 16 steps per epoch -> 48 steps, crossing epoch boundaries
  c.optim.momentum = 0.9;
  c.data.workers = 2;
  c.schedule.name = "cosine";
  c.checkpoint.every_steps = 20;
  c.checkpoint.keep_last = 5;
  c.logging.every_steps = 4;
  c.logging.tensorboard = false;  // tests/test_tensorboard.cpp checks the events of a resumed run

  RunParts full = prepare_run(c);
  Trainer a(c, full.plan, full.model, full.train, nullptr, dir_a);
  a.fit();

  // A fresh trainer (as a restarted process would build) continues from the step-20 checkpoint,
  // in a run directory whose metrics.jsonl already holds the rows of steps 4 to 48 and a line cut
  // short by the kill, and which still holds the abandoned future's step-40 checkpoint.
  files::make_directories(files::join(dir_b, "checkpoints"));
  for (const int64_t step : {20, 40}) {
    files::copy_file(checkpoint_path(files::join(dir_a, "checkpoints"), step),
                     checkpoint_path(files::join(dir_b, "checkpoints"), step));
  }
  auto read_text = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  auto train_steps = [&](const std::string& path) {
    std::vector<int64_t> steps;
    std::istringstream lines(read_text(path));
    for (std::string line; std::getline(lines, line);) {
      if (line.find("\"split\":\"train\"") != std::string::npos) steps.push_back(std::stoll(line.substr(8)));
    }
    return steps;
  };
  const std::string metrics_a = files::join(dir_a, "metrics.jsonl"), metrics_b = files::join(dir_b, "metrics.jsonl");
  std::ofstream(metrics_b) << read_text(metrics_a) << "{\"step\":52,\"split\":\"tr";
  torch::manual_seed(1234);  // the resumed run must not depend on the process's RNG state
  RunParts resumed = prepare_run(synthetic_config("trainer.seed=99"));  // different initial weights, overwritten
  Trainer b2(c, full.plan, resumed.model, resumed.train, nullptr, dir_b);
  const FitResult r = b2.fit(checkpoint_path(files::join(dir_b, "checkpoints"), 20));
  CHECK(r.resumed_from_step == 20);
  CHECK(r.steps == 48);
  const auto pa = a.model().parameters(), pb = b2.model().parameters();
  for (size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i], pb[i]));
  // The old step-40 checkpoint was set aside before the resumed run wrote its own.
  CHECK(files::exists(files::join(dir_b, "checkpoints/abandoned/step_00000040.pt")));
  CHECK(files::exists(files::join(dir_b, "checkpoints/step_00000040.pt")));

  // The same checkpoint as a 2-rank run would have written it (position counted in each rank's
  // half of the data): one process resumes at the same place in the data, and ends the same.
  {
    Config cc = c;
    cc.logging.jsonl = false;
    const std::string dir_c = temp_dir("resume_c");
    files::make_directories(files::join(dir_c, "checkpoints"));
    RunParts scratch = prepare_run(cc);
    auto optimizer = make_optimizer(cc.optim, *scratch.model, full.plan.lr);
    TrainState st = load_checkpoint(checkpoint_path(files::join(dir_a, "checkpoints"), 20), *scratch.model,
                                    optimizer.get());
    REQUIRE(st.batch_in_epoch % 2 == 0);
    st.batch_in_epoch /= 2;
    st.tensors["trainer/world_size"] = torch::tensor(int64_t{2}, torch::kLong);
    const std::string two_ranks = checkpoint_path(files::join(dir_c, "checkpoints"), 20);
    save_checkpoint(two_ranks, *scratch.model, optimizer.get(), st);
    RunParts again = prepare_run(synthetic_config("trainer.seed=99"));
    Trainer c2(cc, full.plan, again.model, again.train, nullptr, dir_c);
    CHECK(c2.fit(two_ranks).steps == 48);
    const auto pc = c2.model().parameters();
    for (size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i], pc[i]));
    files::remove_all(dir_c);
  }
  // Each step logged once: the resumed run dropped the rows after step 20 before logging them anew.
  const auto steps_a = train_steps(metrics_a), steps_b = train_steps(metrics_b);
  CHECK(steps_a.size() == 12);
  CHECK(steps_b == steps_a);
  CHECK(read_text(metrics_b).find("\"tr\n") == std::string::npos);
  // The finished run resumed once more: no step runs, and the result names the checkpoint it holds.
  {
    RunParts again = prepare_run(c);
    Trainer b3(c, full.plan, again.model, again.train, nullptr, dir_b);
    const FitResult done = b3.fit("auto");
    CHECK(done.resumed_from_step == 48);
    CHECK(done.steps == 48);
    CHECK(done.last_checkpoint == checkpoint_path(files::join(dir_b, "checkpoints"), 48));
  }
  files::remove_all(dir_a);
  files::remove_all(dir_b);
}

TEST_CASE("fit: an evaluation put off by a graceful stop is done first when the run resumes", "[trainer][resume]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("eval_pending");
  Config c = synthetic_config();
  c.trainer.max_steps = 3;
  c.trainer.eval_every_steps = 1;
  c.logging.every_steps = 1;
  c.logging.tensorboard = false;
  {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, dir);
    t.request_stop();  // as a SIGTERM during step 1: it stops after it, with a checkpoint, no evaluation
    CHECK(t.fit().steps == 1);
  }
  auto val_steps = [&] {
    std::ifstream in(files::join(dir, "metrics.jsonl"));
    std::vector<int64_t> steps;
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"split\":\"val\"") != std::string::npos) steps.push_back(std::stoll(line.substr(8)));
    }
    return steps;
  };
  CHECK(val_steps().empty());
  const std::string checkpoints = files::join(dir, "checkpoints");
  const std::string at_1 = checkpoint_path(checkpoints, 1);
  REQUIRE(files::exists(at_1));
  files::copy_file(at_1, files::join(dir, "step_1_copy.pt"));
  auto resume_to_end = [&] {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, dir);
    CHECK(t.fit("auto").steps == 3);
  };
  resume_to_end();
  CHECK(val_steps() == std::vector<int64_t>{1, 2, 3});
  // As if that attempt had been killed after its evaluation at step 1 and before its next
  // checkpoint: the step-1 checkpoint is the newest again, with the evaluation still pending. Its
  // evaluation replaces the one the killed attempt logged, rather than being logged twice.
  files::remove_all(checkpoints);
  files::make_directories(checkpoints);
  files::copy_file(files::join(dir, "step_1_copy.pt"), at_1);
  resume_to_end();
  CHECK(val_steps() == std::vector<int64_t>{1, 2, 3});
  files::remove_all(dir);
}

TEST_CASE("fit: the first row after a resume averages the loss over the steps since the last row, those before "
          "the checkpoint too", "[trainer][resume]") {
  register_tiny_mlp();
  const std::string dir_a = temp_dir("window_a"), dir_b = temp_dir("window_b");
  Config c = synthetic_config();
  c.trainer.max_steps = 6;
  c.checkpoint.every_steps = 3;  // step 3 is in the middle of the row for steps 3 and 4
  c.logging.every_steps = 2;
  c.logging.tensorboard = false;
  RunParts full = prepare_run(c);
  Trainer a(c, full.plan, full.model, full.train, nullptr, dir_a);
  a.fit();
  files::make_directories(files::join(dir_b, "checkpoints"));
  files::copy_file(checkpoint_path(files::join(dir_a, "checkpoints"), 3),
                   checkpoint_path(files::join(dir_b, "checkpoints"), 3));
  RunParts again = prepare_run(c);
  Trainer b(c, full.plan, again.model, again.train, nullptr, dir_b);
  CHECK(b.fit(checkpoint_path(files::join(dir_b, "checkpoints"), 3)).steps == 6);

  // step -> the "loss" of its training row, as written
  auto train_losses = [](const std::string& dir) {
    std::map<int64_t, std::string> losses;
    std::ifstream in(files::join(dir, "metrics.jsonl"));
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"split\":\"train\"") == std::string::npos) continue;
      const size_t at = line.find("\"loss\":") + 7;
      losses[std::stoll(line.substr(8))] = line.substr(at, line.find_first_of(",}", at) - at);
    }
    return losses;
  };
  const auto losses_a = train_losses(dir_a), losses_b = train_losses(dir_b);
  REQUIRE(losses_a.size() == 3);
  REQUIRE(losses_b.size() == 2);
  CHECK(losses_b.at(4) == losses_a.at(4));  // the loss of step 3 came with the checkpoint
  CHECK(losses_b.at(6) == losses_a.at(6));

  // Stopped (a stop signal) after step 1, off the logging grid: the stop logs a row of its own,
  // and the resumed run's row at step 2 still averages steps 1 and 2.
  const std::string dir_c = temp_dir("window_c");
  {
    RunParts run = prepare_run(c);
    Trainer stopped(c, run.plan, run.model, run.train, nullptr, dir_c);
    stopped.request_stop();
    REQUIRE(stopped.fit().steps == 1);
  }
  {
    RunParts run = prepare_run(c);
    Trainer resumed(c, run.plan, run.model, run.train, nullptr, dir_c);
    REQUIRE(resumed.fit("auto").steps == 6);
  }
  const auto losses_c = train_losses(dir_c);
  REQUIRE(losses_c.size() == 4);
  CHECK(losses_c.count(1) == 1);  // the stop's own row
  CHECK(losses_c.at(2) == losses_a.at(2));
  CHECK(losses_c.at(4) == losses_a.at(4));
  files::remove_all(dir_a);
  files::remove_all(dir_b);
  files::remove_all(dir_c);
}

namespace {

// What train::log writes while `body` runs (through its file sink, as train.log gets it).
std::string logged_while(const std::function<void()>& body) {
  const std::string dir = temp_dir("log");
  const std::string path = files::join(dir, "captured.log");
  log::set_file(path);
  try {
    body();
  } catch (...) {
    log::set_file("");
    files::remove_all(dir);
    throw;
  }
  log::set_file("");
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  files::remove_all(dir);
  return text;
}

// 4 steps of 16 samples with a checkpoint every 2 into `dir`; an LR that is no short decimal, so
// that the config saved in the checkpoint must give it back exactly.
Config resumable_config() {
  Config c = synthetic_config();
  c.trainer.max_steps = 4;
  c.checkpoint.every_steps = 2;
  c.optim.lr = 0.1 / 3;
  c.logging.tensorboard = false;
  return c;
}

void fit_into(const Config& c, const std::string& dir) {
  RunParts run = prepare_run(c);
  Trainer t(c, run.plan, run.model, run.train, nullptr, dir);
  REQUIRE(t.fit().steps == c.trainer.max_steps);
}

// Resumes `c` from `checkpoint` in `dir`, to the end; returns what was logged.
std::string resume_log(const Config& c, const std::string& dir, const std::string& checkpoint) {
  return logged_while([&] {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, nullptr, dir);
    const FitResult r = t.fit(checkpoint);
    CHECK(r.resumed_from_step == 2);
    CHECK(r.steps == c.trainer.max_steps);
  });
}

}  // namespace

TEST_CASE("fit: a checkpoint whose recorded settings no run writes is damaged, not a change to report",
          "[trainer][resume]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("damaged_settings");
  const Config c = resumable_config();
  fit_into(c, dir);
  const std::string checkpoint = checkpoint_path(files::join(dir, "checkpoints"), 2);
  for (const auto& [name, value] : {std::pair{"trainer/global_batch", -8.0}, std::pair{"trainer/global_batch", 0.0},
                                    std::pair{"trainer/lr", std::nan("")}, std::pair{"trainer/precision", 99.0}}) {
    INFO(name << " " << value);
    RunParts run = prepare_run(c);
    auto optimizer = make_optimizer(c.optim, *run.model, c.optim.lr);
    TrainState st = load_checkpoint(checkpoint, *run.model, optimizer.get());
    REQUIRE(st.tensors.count(name) == 1);
    st.tensors[name] = torch::tensor(value, st.tensors[name].scalar_type());
    const std::string damaged = files::join(dir, "damaged.pt");
    save_checkpoint(damaged, *run.model, optimizer.get(), st);
    Trainer t(c, run.plan, run.model, run.train, nullptr, dir);
    CHECK_THROWS_WITH(t.fit(damaged), Catch::Contains("damaged.pt: damaged trainer state: " + std::string(name)));
  }
  files::remove_all(dir);
}

TEST_CASE("fit: resuming with settings that change the trajectory names each of them in a warning and only them",
          "[trainer][resume]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("changed");
  const Config c = resumable_config();
  fit_into(c, dir);
  const std::string checkpoint = checkpoint_path(files::join(dir, "checkpoints"), 2);
  // As `train fit CONFIG --set ...` builds the config of the resumed run.
  auto with = [&](std::vector<std::string> sets) { return parse_config(to_yaml(c), "resumed.yaml", sets); };

  SECTION("the same settings (and ones that do not change the trajectory): no warning") {
    const std::string log = resume_log(with({"logging.every_steps=3"}), dir, checkpoint);
    CHECK_THAT(log, Catch::Contains("resumed from " + checkpoint));  // the capture works
    CHECK_THAT(log, !Catch::Contains("other settings"));
    CHECK_THAT(log, !Catch::Contains("bit for bit"));
  }
  SECTION("optim.lr set on the command line") {
    const std::string log = resume_log(with({"optim.lr=0.05"}), dir, checkpoint);
    CHECK_THAT(log, Catch::Contains(checkpoint + " was written with other settings (optim.lr 0.03333333333333333 -> 0.05): the "
                                                 "resumed run continues with the new ones and will differ from an "
                                                 "uninterrupted run"));
  }
  SECTION("global batch, seed, shuffling and the optimizer's momentum, in one warning") {
    const std::string log = resume_log(
        with({"trainer.global_batch=32", "trainer.seed=7", "data.shuffle=false", "optim.momentum=0.5"}), dir,
        checkpoint);
    INFO(log);
    CHECK_THAT(log, Catch::Contains(checkpoint + " was written with other settings (data.shuffle true -> false, "
                                                 "optim.momentum 0.0 -> 0.5, trainer.global_batch 16 -> 32, "
                                                 "trainer.seed 0 -> 7): the resumed run continues with the new ones"));
    CHECK_THAT(log, !Catch::Contains("optim.lr"));
    CHECK_THAT(log, !Catch::Contains("plan's"));  // the global batch is named once, by its key
    CHECK_THAT(log, !Catch::Contains("bit for bit"));  // its new micro-batch follows from it
  }
  SECTION("a longer run (the schedule's shape) and a learning rate that differs only in the 8th digit") {
    const std::string log = resume_log(with({"trainer.max_steps=6", "optim.lr=0.03333334"}), dir, checkpoint);
    CHECK_THAT(log, Catch::Contains("(optim.lr 0.03333333333333333 -> 0.03333334, trainer.max_steps 4 -> 6)"));
  }
  SECTION("the loss, clipping, augmentation and a schedule's milestones, which no fixed list named before") {
    const std::string log = resume_log(
        with({"loss.label_smoothing=0.1", "optim.clip_grad_norm=1", "data.random_flip=true"}), dir, checkpoint);
    CHECK_THAT(log, Catch::Contains("other settings (data.random_flip false -> true, optim.clip_grad_norm 0.0 -> 1.0, "
                                    "loss.label_smoothing 0.0 -> 0.1)"));
  }
  SECTION("the LR the plan scales: tuning.base_batch changes no trajectory key but the LR") {
    const std::string log = resume_log(with({"tuning.base_batch=32"}), dir, checkpoint);
    CHECK_THAT(log, Catch::Contains("other settings (the plan's peak lr 0.03333333333333333 -> 0.016666666666666666)"));
  }
  SECTION("the micro-batch and the threads: the same training, computed otherwise") {
    const std::string log = resume_log(with({"tuning.micro_batch=8", "trainer.threads=2"}), dir, checkpoint);
    CHECK_THAT(log, Catch::Contains("was written by a run that computed differently (trainer.threads 1 -> 2, "
                                    "micro-batch 16 -> 8): the same training, but not bit for bit"));
    CHECK_THAT(log, !Catch::Contains("other settings"));
  }
  SECTION("where the data is, the workers, evaluation and logging: no warning") {
    const std::string log = resume_log(
        with({"data.workers=3", "trainer.eval_every_steps=1", "logging.jsonl=false", "checkpoint.keep_last=9",
              "trainer.stop_grace_s=5", "tuning.probe=false"}),
        dir, checkpoint);
    CHECK_THAT(log, !Catch::Contains("other settings"));
    CHECK_THAT(log, !Catch::Contains("bit for bit"));
  }
  files::remove_all(dir);
}

TEST_CASE("fit: a checkpoint of 2 ranks resumed on 1 says the result is no longer bit for bit", "[trainer][resume]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("ranks");
  const Config c = resumable_config();
  fit_into(c, dir);
  // The step-2 checkpoint as 2 ranks would have written it: the position counted in each rank's
  // half of the data (as in "stopping and resuming gives the same weights ..." above).
  const std::string two_dir = temp_dir("ranks_two");
  const std::string two_ranks = checkpoint_path(files::join(two_dir, "checkpoints"), 2);
  {
    files::make_directories(files::join(two_dir, "checkpoints"));
    RunParts scratch = prepare_run(c);
    auto optimizer = make_optimizer(c.optim, *scratch.model, scratch.plan.lr);
    TrainState st = load_checkpoint(checkpoint_path(files::join(dir, "checkpoints"), 2), *scratch.model,
                                    optimizer.get());
    REQUIRE(st.batch_in_epoch % 2 == 0);
    st.batch_in_epoch /= 2;
    st.tensors["trainer/world_size"] = torch::tensor(int64_t{2}, torch::kLong);
    save_checkpoint(two_ranks, *scratch.model, optimizer.get(), st);
  }
  const std::string log = resume_log(c, two_dir, two_ranks);
  // 2 steps of 16 samples: sample 32 of epoch 0.
  CHECK_THAT(log, Catch::Contains(two_ranks + " was written by a run on 2 rank(s); continuing on 1 at the same place "
                                              "in the data (sample 32 of epoch 0), but the result will not be bit for "
                                              "bit the one of an uninterrupted run"));
  CHECK_THAT(log, !Catch::Contains("other settings"));
  files::remove_all(two_dir);
  files::remove_all(dir);
}

TEST_CASE("checkpoint.keep_last: the newest checkpoints stay with their .crc32c and the final one is among them",
          "[trainer][checkpoint]") {
  register_tiny_mlp();
  auto left_after = [](int64_t max_steps, int64_t keep_last) {
    const std::string dir = temp_dir("keep_last");
    Config c = synthetic_config();
    c.trainer.max_steps = max_steps;
    c.checkpoint.every_steps = 2;
    c.checkpoint.keep_last = keep_last;
    c.logging.tensorboard = false;
    fit_into(c, dir);
    const std::vector<std::string> names = files::list_directory(files::join(dir, "checkpoints"));
    for (const auto& name : names) {  // each one left is whole
      if (name.size() > 3 && name.compare(name.size() - 3, 3, ".pt") == 0) {
        RunParts run = prepare_run(c);
        CHECK_NOTHROW(load_checkpoint(files::join(dir, "checkpoints/" + name), *run.model, nullptr));
      }
    }
    files::remove_all(dir);
    return names;
  };
  auto files_of = [](std::vector<int> steps) {
    std::vector<std::string> names;
    for (const int s : steps) {
      char name[32];
      std::snprintf(name, sizeof(name), "step_%08d.pt", s);
      names.push_back(name);
      names.push_back(std::string(name) + ".crc32c");
    }
    return names;
  };
  // Checkpoints at steps 2, 4, 6 and the final 7.
  CHECK(left_after(7, 2) == files_of({6, 7}));
  CHECK(left_after(7, 3) == files_of({4, 6, 7}));
  CHECK(left_after(7, 1) == files_of({7}));
  // The final step is a periodic one too.
  CHECK(left_after(8, 2) == files_of({6, 8}));
}

TEST_CASE("checkpoint.every_minutes: a checkpoint after the first step past the interval, counted from the last one",
          "[trainer][checkpoint]") {
  register_tiny_mlp();
  auto checkpoint_steps = [](double minutes, int64_t every_steps) {
    const std::string dir = temp_dir("every_minutes");
    Config c = synthetic_config();
    c.trainer.max_steps = 4;
    c.checkpoint.every_minutes = minutes;
    c.checkpoint.every_steps = every_steps;
    c.checkpoint.keep_last = 10;
    c.logging.tensorboard = false;
    fit_into(c, dir);
    std::vector<int64_t> steps;
    for (const auto& path : list_checkpoints(files::join(dir, "checkpoints"))) {
      RunParts run = prepare_run(c);
      steps.push_back(load_checkpoint(path, *run.model, nullptr).step);
    }
    files::remove_all(dir);
    return steps;
  };
  CHECK(checkpoint_steps(1e-9, 0) == std::vector<int64_t>{1, 2, 3, 4});  // always due
  CHECK(checkpoint_steps(60, 0) == std::vector<int64_t>{4});             // never due: the final one
  CHECK(checkpoint_steps(60, 3) == std::vector<int64_t>{3, 4});          // steps and minutes together
  CHECK(checkpoint_steps(0, 0) == std::vector<int64_t>{4});              // off
  // In a config: minutes >= 0, and Lightning's name for it points here.
  CHECK_THROWS_WITH(synthetic_config("checkpoint.every_minutes=-1"), Catch::Contains("checkpoint.every_minutes"));
  CHECK_THROWS_WITH(parse_config("model: {name: tiny_mlp}\ncheckpoint: {train_time_interval: 5}\n", "t.yaml"),
                    Catch::Contains("checkpoint.every_minutes"));
}

namespace {

// 12 steps with an evaluation after each and an LR large enough that the validation loss goes up
// and down (best.pt moves), keeping best.pt by loss.
Config best_by_loss(int64_t every_steps, int64_t keep_last) {
  register_tiny_mlp();
  Config c = synthetic_config();
  c.trainer.max_steps = 12;
  c.trainer.eval_every_steps = 1;
  c.optim.lr = 2.0;
  c.checkpoint.every_steps = every_steps;
  c.checkpoint.keep_last = keep_last;
  c.checkpoint.best = "loss";
  return c;
}

}  // namespace

TEST_CASE("checkpoint.best: best.pt is the step checkpoint of the best evaluation, outlives pruning and resumes on",
          "[trainer][checkpoint][resume]") {
  Config c = best_by_loss(6, 1);
  c.logging.tensorboard = false;
  // The logged validation rows: step -> loss.
  auto val_losses = [](const std::string& dir) {
    std::map<int64_t, double> out;
    std::ifstream in(files::join(dir, "metrics.jsonl"));
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"split\":\"val\"") == std::string::npos) continue;
      const size_t at = line.find("\"loss\":") + 7;
      out[std::stoll(line.substr(8))] = std::stod(line.substr(at));
    }
    return out;
  };
  const std::string dir = temp_dir("best");
  FitResult whole;
  {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, dir);
    whole = t.fit();
  }
  const std::map<int64_t, double> losses = val_losses(dir);
  REQUIRE(losses.size() == 12);
  const auto lowest = std::min_element(losses.begin(), losses.end(),
                                       [](const auto& a, const auto& b) { return a.second < b.second; });
  // A best evaluation that is neither a periodic nor the final checkpoint, whose own step
  // checkpoint keep_last: 1 has pruned: best.pt must still be there.
  REQUIRE(lowest->first % 6 != 0);
  CHECK(whole.best_metric == "loss");
  CHECK(whole.best_step == lowest->first);
  CHECK(whole.best_value == Approx(lowest->second));
  const std::string checkpoints = files::join(dir, "checkpoints");
  CHECK(whole.best_checkpoint == best_checkpoint_path(checkpoints));
  CHECK_FALSE(files::exists(checkpoint_path(checkpoints, lowest->first)));
  const std::optional<BestCheckpoint> record = read_best_checkpoint(checkpoints);
  REQUIRE(record.has_value());
  CHECK(record->metric == "loss");
  CHECK(record->step == lowest->first);
  {
    // best.pt holds that step's state: its model evaluates to the logged loss.
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, "");
    CHECK(load_checkpoint(whole.best_checkpoint, t.model(), nullptr).step == lowest->first);
    CHECK(t.evaluate().loss == Approx(lowest->second).epsilon(1e-9));
  }

  // The same run stopped after step 1 (its evaluation put off) and resumed: the put-off
  // evaluation becomes the first best, and the resumed run keeps ranking against best.json.
  const std::string split = temp_dir("best_resumed");
  {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, split);
    t.request_stop();
    CHECK(t.fit().steps == 1);
  }
  CHECK_FALSE(read_best_checkpoint(files::join(split, "checkpoints")).has_value());
  {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, split);
    const FitResult resumed = t.fit("auto");
    CHECK(resumed.best_step == whole.best_step);
    CHECK(resumed.best_value == whole.best_value);
  }
  // A later attempt, resumed from the final checkpoint with best.json in place, reads it back.
  const std::string log = logged_while([&] {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, split);
    CHECK(t.fit("auto").best_step == whole.best_step);
  });
  CHECK_THAT(log, Catch::Contains("best checkpoint so far: val loss"));
  // Ranked by another metric now: the old best.pt is not comparable, and the next evaluation replaces it.
  c.checkpoint.best = "accuracy";
  const std::string changed = logged_while([&] {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, split);
    t.fit("auto");
  });
  CHECK_THAT(changed, Catch::Contains("checkpoint.best is now accuracy"));
  files::remove_all(dir);
  files::remove_all(split);
}

TEST_CASE("checkpoint.best: a best.json whose best.pt is gone does not stop the next evaluations from keeping one",
          "[trainer][checkpoint][resume]") {
  Config c = best_by_loss(6, 1);
  c.trainer.max_steps = 4;
  c.logging.tensorboard = false;
  const std::string dir = temp_dir("best_missing");
  const std::string checkpoints = files::join(dir, "checkpoints");
  {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, dir);
    REQUIRE(t.fit().best_step > 0);
  }
  files::remove_file(best_checkpoint_path(checkpoints));
  files::remove_file(best_checkpoint_path(checkpoints) + ".crc32c");
  // Continued for 2 more steps: the first evaluation of the resumed run is the best one there is.
  c.trainer.max_steps = 6;
  FitResult resumed;
  const std::string log = logged_while([&] {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, dir);
    resumed = t.fit("auto");
  });
  CHECK_THAT(log, Catch::Contains("best.pt is missing: the next evaluation replaces both"));
  CHECK(resumed.best_step >= 5);
  CHECK(resumed.best_checkpoint == best_checkpoint_path(checkpoints));
  REQUIRE(files::exists(resumed.best_checkpoint));
  RunParts run = prepare_run(c);
  CHECK(load_checkpoint(resumed.best_checkpoint, *run.model, nullptr).step == resumed.best_step);
  CHECK(read_best_checkpoint(checkpoints)->step == resumed.best_step);
  files::remove_all(dir);
}

TEST_CASE("checkpoint.best: a best from after the step a run starts from is not its own, nor an earlier run's",
          "[trainer][checkpoint][resume]") {
  Config c = best_by_loss(1, 12);  // every step's checkpoint kept
  c.logging.tensorboard = false;
  const std::string dir = temp_dir("best_future");
  const std::string checkpoints = files::join(dir, "checkpoints");
  FitResult whole;
  {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, dir);
    whole = t.fit();
  }
  REQUIRE(whole.best_step > 1);
  // Back to the step before the best: that best is a future the resumed run may not reach. It is
  // set aside with the later checkpoints, not taken as this run's best.
  const int64_t from = whole.best_step - 1;
  FitResult resumed;
  const std::string log = logged_while([&] {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, dir);
    resumed = t.fit(checkpoint_path(checkpoints, from));
  });
  CHECK_THAT(log, Catch::Contains("set aside: " + files::join(checkpoints, "abandoned/best.pt")) &&
                      Catch::Contains("set aside: " + files::join(checkpoints, "abandoned/best.json")));
  CHECK(files::is_regular_file(files::join(checkpoints, "abandoned/best.pt.crc32c")));
  CHECK(read_best_checkpoint(files::join(checkpoints, "abandoned"))->step == whole.best_step);
  CHECK(resumed.best_step == from + 1);  // the resumed run's own first evaluation
  CHECK(read_best_checkpoint(checkpoints)->step == from + 1);
  // A Trainer started fresh where an earlier run's best is (without fit_in_run_dir's check):
  // that best is not its own either.
  const std::string fresh = logged_while([&] {
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, files::join(dir, "other"));
    files::make_directories(files::join(dir, "other/checkpoints"));
    keep_best_checkpoint(files::join(dir, "other/checkpoints"), checkpoint_path(checkpoints, from),
                         BestCheckpoint{"loss", -1.0, 3});
    t.fit();
  });
  CHECK_THAT(fresh, Catch::Contains("later than step 0 this run starts from: the next evaluation replaces it"));

  // The step checkpoints moved away, best.pt and best.json left: a new run there is refused.
  for (const std::string& file : list_checkpoints(checkpoints)) files::remove_file(file);
  for (const std::string& resume : {"", "auto"}) {
    FitOptions fit;
    fit.run_dir = dir;
    fit.resume = resume;
    CHECK_THROWS_WITH(check_fit_options(c, fit),
                      Catch::Contains("holds best.pt and best.json from an earlier run") &&
                          Catch::Contains("but no step checkpoint to continue from"));
  }
  files::remove_all(dir);
}

TEST_CASE("resume: training data of the same size but other content is said, the same data is not",
          "[trainer][resume]") {
  register_tiny_mlp();
  Config c = synthetic_config();
  c.data.kind = "custom";
  c.trainer.max_steps = 8;
  c.logging.every_steps = 4;
  c.logging.tensorboard = false;
  // The program's own IDX-like data: 64 images of 8x8, one pixel apart between the two versions.
  torch::manual_seed(3);
  const torch::Tensor pixels = torch::randint(0, 256, {64, 1, 8, 8}, torch::kLong).to(torch::kByte);
  const torch::Tensor labels = torch::randint(0, 10, {64}, torch::kLong);
  const auto idx = [&](bool changed) {
    torch::Tensor images = pixels.clone();
    if (changed) images[17][0][3][4] = static_cast<uint8_t>(images[17][0][3][4].item<int64_t>() ^ 1);
    return std::make_shared<data::IdxDataset>(images, labels, data::ImageTransforms{}, "memory");
  };
  CHECK(idx(false)->fingerprint() == idx(false)->fingerprint());
  CHECK(idx(false)->fingerprint() != idx(true)->fingerprint());
  const auto run_with = [&](bool changed, const std::string& dir, const std::string& resume) {
    RunOptions options;
    options.train_data = idx(changed);
    RunParts run = prepare_run(c, options);
    FitOptions fit;
    fit.run_dir = dir;
    fit.resume = resume;
    if (resume.empty()) {  // after step 4's row
      fit.on_trainer = [](Trainer& t) { t.on_metrics([&t](const MetricRecord&) { t.request_stop(); }); };
    }
    return fit_in_run_dir(c, run, fit);
  };
  const std::string dir = temp_dir("same_size_data");
  REQUIRE(run_with(false, dir, "").exit_code == kExitStopped);
  const std::string copy = temp_dir("same_size_data_copy");
  files::remove_all(copy);
  REQUIRE(std::system(("cp -a '" + dir + "' '" + copy + "'").c_str()) == 0);
  const auto log_of = [](const std::string& d) {
    std::ifstream in(files::join(d, "train.log"));
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  CHECK(run_with(false, dir, "auto").exit_code == kExitOk);
  CHECK_THAT(log_of(dir), !Catch::Contains("was written with other settings"));
  CHECK(run_with(true, copy, "auto").exit_code == kExitOk);
  CHECK_THAT(log_of(copy), Catch::Contains("was written with other settings (the training data: the same 64 samples "
                                           "in number, but not the same samples)"));
  files::remove_all(dir);
  files::remove_all(copy);
}

TEST_CASE("resume: a training set that changed size since the checkpoint is said, and one too small for its "
          "position is an error before the run directory changes", "[trainer][resume]") {
  register_tiny_mlp();
  // The program's own data (the config stays the same): synthetic images, of some number.
  Config c = synthetic_config();
  c.data.kind = "custom";
  c.trainer.max_steps = 0;
  c.trainer.epochs = 2;
  c.checkpoint.every_steps = 10;
  c.logging.tensorboard = false;
  const auto images = [](int64_t n) {
    DataConfig d = synthetic_config().data;
    d.synthetic_train_samples = n;
    return data::make_dataset(d, data::Split::Train);
  };
  c.logging.every_steps = 10;
  const auto run_with = [&](int64_t samples, const std::string& dir, const std::string& resume, bool stop = false) {
    RunOptions options;
    options.train_data = images(samples);
    RunParts run = prepare_run(c, options);
    FitOptions fit;
    fit.run_dir = dir;
    fit.resume = resume;
    if (stop) {  // after step 10's row
      fit.on_trainer = [](Trainer& t) { t.on_metrics([&t](const MetricRecord&) { t.request_stop(); }); };
    }
    return fit_in_run_dir(c, run, fit);
  };
  const std::string dir = temp_dir("changed_data");
  // 256 samples, 16 steps an epoch: stopped at step 10, 160 samples into epoch 0.
  REQUIRE(run_with(256, dir, "", true).exit_code == kExitStopped);
  // 240 samples: said, with the run's length it changes (32 -> 30 steps).
  const std::string copy = temp_dir("changed_data_copy");
  files::remove_all(copy);
  REQUIRE(std::system(("cp -a '" + dir + "' '" + copy + "'").c_str()) == 0);
  CHECK(run_with(240, copy, "auto").exit_code == kExitOk);
  std::ifstream log_in(files::join(copy, "train.log"));
  const std::string log((std::istreambuf_iterator<char>(log_in)), std::istreambuf_iterator<char>());
  CHECK_THAT(log, Catch::Contains("was written with other settings (") &&
                      Catch::Contains("the training set's size 256 -> 240 samples, the run's steps 32 -> 30"));
  // 128 samples, 8 steps an epoch: step 10's position is past the end of an epoch.
  const auto snapshot = [](const std::string& d) {
    std::map<std::string, std::string> files_in;
    for (const std::string& name : {"config.yaml", "plan.json", "metrics.jsonl", "train.log"}) {
      std::ifstream in(files::join(d, name));
      files_in[name] = std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    }
    files_in["checkpoints"] = "";
    for (const std::string& f : files::list_directory(files::join(d, "checkpoints"))) files_in["checkpoints"] += f + " ";
    return files_in;
  };
  const auto before = snapshot(dir);
  try {
    run_with(128, dir, "auto");
    FAIL("a resume past the end of the changed data's epoch went on");
  } catch (const CheckpointError& e) {
    CHECK_THAT(e.what(), Catch::Contains("step_00000010.pt: it was written 160 samples into epoch 0, more than an "
                                         "epoch of the training set now gives (8 steps of 16 from") &&
                             Catch::Contains("the data changed since"));
  }
  CHECK(snapshot(dir) == before);
  files::remove_all(dir);
  files::remove_all(copy);
}

TEST_CASE("trainer.early_stop_patience: training stops, with a checkpoint, after that many evaluations without a "
          "better val loss", "[trainer][checkpoint][resume]") {
  // The full run's evaluations (one per step, the loss going up and down), and where a patience
  // of p stops it: the first step that ends p evaluations in a row without a new lowest loss.
  Config c = best_by_loss(100, 20);
  c.logging.tensorboard = false;
  std::vector<double> losses;
  {
    const std::string dir = temp_dir("early_full");
    RunParts run = prepare_run(c);
    Trainer t(c, run.plan, run.model, run.train, run.val, dir);
    REQUIRE(t.fit().steps == 12);
    std::ifstream in(files::join(dir, "metrics.jsonl"));
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"split\":\"val\"") != std::string::npos) {
        losses.push_back(std::stod(line.substr(line.find("\"loss\":") + 7)));
      }
    }
    files::remove_all(dir);
  }
  REQUIRE(losses.size() == 12);
  auto stop_step = [&losses](int64_t patience) {
    double best = std::numeric_limits<double>::infinity();
    int64_t bad = 0;
    for (size_t i = 0; i < losses.size(); ++i) {
      bad = losses[i] < best ? 0 : bad + 1;
      best = std::min(best, losses[i]);
      if (bad >= patience) return static_cast<int64_t>(i + 1);
    }
    return int64_t{12};
  };
  REQUIRE(stop_step(1) < 12);  // the loss does go up at some step
  for (const int64_t patience : {int64_t{1}, int64_t{2}, int64_t{3}}) {
    INFO("patience " << patience << ", stops at " << stop_step(patience));
    const std::string dir = temp_dir("early_stop");
    Config p = c;
    p.trainer.early_stop_patience = patience;
    FitOptions options;
    options.run_dir = dir;
    options.handle_stop_signals = false;
    RunParts run = prepare_run(p);
    const FitReport report = fit_in_run_dir(p, run, options);
    CHECK(report.exit_code == kExitOk);  // finished, not stopped by a signal
    CHECK(report.result.steps == stop_step(patience));
    CHECK(report.result.stopped_early == (stop_step(patience) < 12));
    CHECK(report.result.last_checkpoint == checkpoint_path(files::join(dir, "checkpoints"), report.result.steps));
    CHECK(files::exists(report.result.last_checkpoint));
    if (report.result.stopped_early) {
      // Resumed: it stays stopped, and reports the same evaluation.
      RunParts again = prepare_run(p);
      Trainer t(p, again.plan, again.model, again.train, again.val, dir);
      FitResult resumed;
      const std::string log = logged_while([&] { resumed = t.fit("auto"); });
      CHECK_THAT(log, Catch::Contains("early stopping: stopped at step " + std::to_string(report.result.steps)));
      CHECK(resumed.stopped_early);
      CHECK(resumed.steps == report.result.steps);
      CHECK(resumed.val.loss == Approx(report.result.val.loss));
      // A larger patience trains on to the end.
      p.trainer.early_stop_patience = 100;
      RunParts more = prepare_run(p);
      Trainer longer(p, more.plan, more.model, more.train, more.val, dir);
      const FitResult finished = longer.fit("auto");
      CHECK_FALSE(finished.stopped_early);
      CHECK(finished.steps == 12);
    }
    files::remove_all(dir);
  }
  // trainer.early_stop_min_delta: an improvement smaller than it counts as none. With a huge one
  // only the first evaluation (there is no best before it) improves, so a patience of 2 stops
  // after step 3, and best.pt still follows the lowest loss of those three.
  {
    const std::string dir = temp_dir("early_delta");
    Config p = c;
    p.trainer.early_stop_patience = 2;
    p.trainer.early_stop_min_delta = 1e6;
    RunParts run = prepare_run(p);
    Trainer t(p, run.plan, run.model, run.train, run.val, dir);
    const FitResult r = t.fit();
    CHECK(r.stopped_early);
    CHECK(r.steps == 3);
    const auto lowest = std::min_element(losses.begin(), losses.begin() + 3) - losses.begin();
    CHECK(r.best_step == lowest + 1);
    files::remove_all(dir);
  }
  // It watches checkpoint.best's metric: without one it is refused, naming the key.
  CHECK_THROWS_WITH(synthetic_config("trainer.early_stop_patience=3"),
                    Catch::Contains("trainer.early_stop_patience") && Catch::Contains("checkpoint.best is none"));
}

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("AsyncCheckpointWriter: save_checkpoint's bytes, of the state at save(), then jobs in order, failures "
          "reported once", "[trainer][checkpoint]") {
  register_tiny_mlp();
  const Config c = synthetic_config();
  RunParts run = prepare_run(c);
  const std::string dir = temp_dir("async_writer");
  TrainState state;
  state.step = 3;
  state.config_yaml = "x: 1";
  state.tensors["extra/t"] = torch::arange(4);
  const std::string sync = files::join(dir, "sync.pt"), async = files::join(dir, "async.pt");
  save_checkpoint(sync, *run.model, nullptr, state);
  std::vector<std::string> order;
  {
    AsyncCheckpointWriter writer;
    writer.save(async, *run.model, nullptr, state);
    // The loop goes on at once: what it changes now is not in the file.
    {
      torch::NoGradGuard no_grad;
      for (auto& p : run.model->parameters()) p.add_(1.0);
    }
    writer.then([&] { order.push_back(files::exists(async) ? "after the write" : "before the write"); });
    writer.then([&] { order.push_back("second"); });
    writer.wait();
    CHECK(writer.idle());
    CHECK(order == std::vector<std::string>{"after the write", "second"});
    CHECK(file_bytes(async) == file_bytes(sync));
    CHECK(file_bytes(async + ".crc32c") == file_bytes(sync + ".crc32c"));

    // A write that fails (a directory where its temporary file goes): reported by the next wait(),
    // once; the job queued after it (best.pt's link, say) is not run; the next save works.
    const std::string blocked = files::join(dir, "blocked.pt");
    files::make_directories(blocked + ".tmp." + std::to_string(::getpid()));
    writer.save(blocked, *run.model, nullptr, state);
    bool ran = false;
    writer.then([&] { ran = true; });
    CHECK_THROWS_WITH(writer.wait(), Catch::Contains("cannot write " + blocked + ".tmp."));
    CHECK_FALSE(ran);
    CHECK_FALSE(files::exists(blocked));
    CHECK_NOTHROW(writer.wait());
    writer.save(async, *run.model, nullptr, state);
    writer.wait();
    CHECK(file_bytes(async) != file_bytes(sync));  // the parameters moved on
  }
  files::remove_all(dir);
}

TEST_CASE("cuda: a checkpoint of GPU tensors written in the background is the one written in the loop",
          "[cuda][checkpoint]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: checked by scripts/gpu-check on a GPU machine");
  register_tiny_mlp();
  const Config c = synthetic_config();
  RunParts run = prepare_run(c);
  run.model->to(torch::kCUDA);
  OptimConfig adamw;
  adamw.name = "adamw";
  const auto optimizer = make_optimizer(adamw, *run.model, 0.01);
  for (auto& p : run.model->parameters()) p.mutable_grad() = torch::ones_like(p);
  optimizer->step();  // moments on the GPU
  TrainState state;
  state.step = 1;
  const std::string dir = temp_dir("async_cuda");
  const std::string sync = files::join(dir, "sync.pt"), async = files::join(dir, "async.pt");
  save_checkpoint(sync, *run.model, optimizer.get(), state);
  {
    AsyncCheckpointWriter writer;
    writer.save(async, *run.model, optimizer.get(), state);
    optimizer->step();  // the next step's update does not reach the file being written
    writer.wait();
  }
  CHECK(file_bytes(async) == file_bytes(sync));
  files::remove_all(dir);
}

TEST_CASE("checkpoint.async: the files of a run written in the background are those written in the loop",
          "[trainer][checkpoint][resume]") {
  Config c = best_by_loss(3, 2);
  c.logging.tensorboard = false;
  std::map<std::string, std::vector<std::string>> names;  // mode -> the files left in checkpoints/
  const std::string base = temp_dir("async");
  for (const std::string mode : {"off", "on"}) {
    c.checkpoint.async = mode;
    const std::string dir = files::join(base, mode);
    const std::string log = logged_while([&] {
      RunParts run = prepare_run(c);
      CHECK(run.plan.checkpoint_async == (mode == "on"));
      Trainer t(c, run.plan, run.model, run.train, run.val, dir);
      const FitResult r = t.fit();
      CHECK(r.steps == 12);
      CHECK(files::exists(r.best_checkpoint));
    });
    CHECK((log.find("s to write in the background") != std::string::npos) == (mode == "on"));
    names[mode] = files::list_directory(files::join(dir, "checkpoints"));
  }
  // Steps 9 and 12 kept (keep_last 2), each with its checksum, best.pt with its own and best.json.
  CHECK(names["on"].size() == 7);
  CHECK(names["on"] == names["off"]);
  // The same contents: the files differ only in the config they carry (checkpoint.async).
  for (const auto& name : names["on"]) {
    INFO(name);
    const std::string on = files::join(base, "on/checkpoints/" + name), off = files::join(base, "off/checkpoints/" + name);
    if (name == "best.json") CHECK(file_bytes(on) == file_bytes(off));
    if (name.size() < 3 || name.compare(name.size() - 3, 3, ".pt") != 0) continue;
    const auto w_on = read_checkpoint_weights(on), w_off = read_checkpoint_weights(off);
    REQUIRE(w_on.size() == w_off.size());
    for (const auto& [key, value] : w_on) CHECK(torch::equal(value, w_off.at(key)));
    RunParts run = prepare_run(c);
    const TrainState s_on = load_checkpoint(on, *run.model, nullptr), s_off = load_checkpoint(off, *run.model, nullptr);
    CHECK(s_on.step == s_off.step);
    CHECK(s_on.samples_seen == s_off.samples_seen);
    CHECK(s_on.batch_in_epoch == s_off.batch_in_epoch);
    REQUIRE(s_on.tensors.size() == s_off.tensors.size());
    for (const auto& [key, value] : s_on.tensors) CHECK(torch::equal(value, s_off.tensors.at(key)));
    CHECK_THAT(s_on.config_yaml, Catch::Contains("async: on"));
  }
  files::remove_all(base);

  SECTION("a stop request: the checkpoint is complete when fit returns") {
    c.checkpoint.async = "on";
    const std::string dir = temp_dir("async_stop");
    {
      RunParts run = prepare_run(c);
      Trainer t(c, run.plan, run.model, run.train, run.val, dir);
      t.request_stop();
      CHECK(t.fit().steps == 1);
    }
    const std::string first = checkpoint_path(files::join(dir, "checkpoints"), 1);
    CHECK(latest_checkpoint(files::join(dir, "checkpoints")) == first);
    {
      RunParts run = prepare_run(c);
      Trainer t(c, run.plan, run.model, run.train, run.val, dir);
      CHECK(t.fit("auto").steps == 12);
    }
    files::remove_all(dir);
  }
}

TEST_CASE("checkpoint.best needs a validation split, and top5 more than five classes", "[trainer][config]") {
  register_tiny_mlp();
  Config c = synthetic_config("checkpoint.best=accuracy");
  RunParts run = prepare_run(c);
  CHECK_THROWS_WITH(Trainer(c, run.plan, run.model, run.train, nullptr, ""),
                    Catch::Contains("key 'checkpoint.best'") && Catch::Contains("no validation split"));
  c.checkpoint.best = "top5";
  CHECK_NOTHROW(Trainer(c, run.plan, run.model, run.train, run.val, ""));  // 10 classes
  data::SyntheticImageOptions four;
  four.samples = 8;
  four.channels = 1;
  four.image_size = 8;
  four.num_classes = 4;
  CHECK_THROWS_WITH(Trainer(c, run.plan, run.model, run.train, std::make_shared<data::SyntheticImageDataset>(four), ""),
                    Catch::Contains("top5 needs more than five classes"));
}

TEST_CASE("cuda: the plan picks bf16 + channels_last on a tensor-core GPU and training converges", "[cuda]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: the CUDA path is checked by scripts/gpu-check on a GPU machine");
  Config c = parse_config(
      "model: {name: resnet18, in_channels: 3, num_classes: 10, width: 0.25, small_input: true}\n"
      "data: {kind: synthetic, channels: 3, image_size: 16, synthetic_train_samples: 512, synthetic_val_samples: 128}\n"
      "optim: {name: adamw, lr: 0.003}\n"
      "trainer: {global_batch: 64, epochs: 4, device: auto}\n"
      // The probe on the GPU has tests of its own (test_probe.cpp, test_cli.cpp); here it would
      // only add cuDNN's autotuning of six more batch shapes.
      "tuning: {probe: false}\n",
      "cuda.yaml");
  RunParts run = prepare_run(c);
  CHECK(run.plan.device.is_cuda());
  CHECK(run.plan.device.total_memory > 0);
  CHECK(run.plan.device.sm_count > 0);
  CHECK(run.plan.pin_memory);
  CHECK(run.plan.cudnn_benchmark);
  if (run.plan.device.cc_major >= 8) {
    CHECK(run.plan.precision == "bf16");
    CHECK(run.plan.channels_last);
    CHECK(run.plan.tf32);
  }
  apply_plan_globals(run.plan);
  Trainer trainer(c, run.plan, run.model, run.train, run.val, "");
  const EvalResult before = trainer.evaluate();
  FitResult result;
  const std::string log = logged_while([&] { result = trainer.fit(); });
  INFO(log);
  CHECK(result.val.loss < before.loss);
  CHECK(result.val.accuracy > 0.3);
  for (const auto& p : trainer.model().parameters()) {
    CHECK(p.device().is_cuda());
    CHECK(p.scalar_type() == torch::kFloat);  // master weights stay fp32 under autocast
  }
  if (run.plan.cuda_graphs) {
    // The one capture of the whole fast path (bf16 autocast, channels_last, cuDNN benchmark, fused
    // AdamW, the pinned-memory loader's threads, evaluations between epochs): it must succeed,
    // whether the timing then keeps the graph or not.
    CHECK_THAT(log, !Catch::Contains("capturing the training step failed"));
    CHECK_THAT(log, Catch::Contains("cuda_graphs: kept (") || Catch::Contains("cuda_graphs: dropped,"));
  }
}

TEST_CASE("cuda: precision fp16 (a T4's plan) trains with dynamic loss scaling on the GPU and checkpoints the scale",
          "[cuda][amp]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: fp16 with loss scaling is checked by scripts/gpu-check on a GPU machine");
  const std::string dir = files::make_temp_directory("train_fp16_");
  Config c = parse_config(
      "model: {name: resnet18, in_channels: 3, num_classes: 10, width: 0.25, small_input: true}\n"
      "data: {kind: synthetic, channels: 3, image_size: 16, synthetic_train_samples: 512, synthetic_val_samples: 128}\n"
      "optim: {name: sgd, lr: 0.05, momentum: 0.9}\n"
      "precision: {mode: fp16}\n"
      "trainer: {global_batch: 64, epochs: 4, device: cuda}\n"
      "tuning: {probe: false}\n"  // as above: the probe is not what this test is about
      "logging: {every_steps: 4}\n",
      "fp16.yaml");
  RunParts run = prepare_run(c);
  CHECK(run.plan.precision == "fp16");
  CHECK(run.plan.loss_scaling);
  apply_plan_globals(run.plan);
  Trainer trainer(c, run.plan, run.model, run.train, run.val, dir);
  const EvalResult before = trainer.evaluate();
  const FitResult result = trainer.fit();
  CHECK(result.val.loss < before.loss);
  CHECK(result.val.accuracy > 0.3);
  for (const auto& p : trainer.model().parameters()) CHECK(p.scalar_type() == torch::kFloat);  // fp32 master weights
  // Every logged window carries the scale: finite, positive, a power of two (x2 / x0.5 from 65536).
  std::ifstream metrics(files::join(dir, "metrics.jsonl"));
  int windows = 0;
  for (std::string line; std::getline(metrics, line);) {
    if (line.find("\"split\":\"train\"") == std::string::npos) continue;
    const auto at = line.find("\"loss_scale\":");
    REQUIRE(at != std::string::npos);
    const double scale = std::stod(line.substr(at + 13));
    INFO(line);
    CHECK(scale > 0);
    CHECK(std::isfinite(scale));
    CHECK(std::exp2(std::round(std::log2(scale))) == scale);
    ++windows;
  }
  CHECK(windows > 0);
  const std::string last = latest_checkpoint(files::join(dir, "checkpoints"));
  REQUIRE_FALSE(last.empty());
  const TrainState state = load_checkpoint(last, trainer.model(), nullptr);
  REQUIRE(state.tensors.count("scaler/scale"));
  CHECK(state.tensors.at("scaler/scale").item<double>() > 0);
  files::remove_all(dir);
}

TEST_CASE("plan: configs/resnet50_imagenet.yaml on a T4 and an A100, without the data", "[plan][probe]") {
  const std::string cache = files::make_temp_directory("train_plan_devices_");
  const std::string config = std::string(TRAIN_SOURCE_DIR) + "/configs/resnet50_imagenet.yaml";
  RunOptions options;
  options.data_optional = true;  // ImageNet is not on this machine
  auto plan_for = [&](std::vector<std::string> sets) {
    sets.push_back("tuning.cache_dir=" + cache);
    sets.push_back("data.root=" + cache + "/no-imagenet-here");
    return prepare_run(load_config(config, sets), options);
  };
  const RunParts t4 = plan_for({"tuning.device=t4"});
  const RunParts a100 = plan_for({"tuning.device=a100-80gb"});
  // One CPU measurement serves every named device and batch setting.
  CHECK_THAT(t4.plan.memory.source, !Catch::Contains("measured earlier"));
  CHECK_THAT(a100.plan.memory.source, Catch::Contains("probe on cpu at 2, 4 (measured earlier, from the plan cache)"));
  CHECK(a100.plan.memory.per_sample_bytes == t4.plan.memory.per_sample_bytes);  // both halved for 16-bit
  CHECK(t4.plan.global_batch == 256);
  CHECK(a100.plan.global_batch == 256);
  CHECK(t4.plan.precision == "fp16");  // 7.5: fp16 tensor cores, no bf16
  CHECK(t4.plan.loss_scaling);
  CHECK(a100.plan.precision == "bf16");
  CHECK_FALSE(a100.plan.loss_scaling);
  CHECK(a100.plan.channels_last);
  CHECK(t4.plan.memory.estimate);
  CHECK(t4.plan.memory.max_micro_batch < a100.plan.memory.max_micro_batch);
  CHECK(t4.train == nullptr);
  // At 256 both hold the whole batch under mixed precision (as NVIDIA's V100-16GB recipe does);
  // at a global batch of 1024 the T4 must accumulate and the A100 need not.
  const RunParts t4_1k = plan_for({"tuning.device=t4", "trainer.global_batch=1024"});
  const RunParts a100_1k = plan_for({"tuning.device=a100-80gb", "trainer.global_batch=1024"});
  CHECK(t4_1k.plan.micro_batch < a100_1k.plan.micro_batch);
  CHECK(t4_1k.plan.accum_steps > 1);
  CHECK(a100_1k.plan.accum_steps == 1);
  CHECK(t4_1k.plan.micro_batch * t4_1k.plan.accum_steps == 1024);
  // In fp32 a T4 cannot hold 256 ResNet-50 samples in one pass.
  const RunParts t4_fp32 = plan_for({"tuning.device=t4", "precision.mode=fp32"});
  CHECK(t4_fp32.plan.accum_steps > 1);

  // Scale mode grows the batch on the A100 and scales the LR linearly.
  const RunParts scaled = plan_for({"tuning.device=a100-80gb", "tuning.batch=scale"});
  CHECK(scaled.plan.global_batch > 256);
  CHECK(scaled.plan.lr == Approx(0.1 * scaled.plan.global_batch / 256.0));

  // The second identical request is served from the plan cache.
  const RunParts again = plan_for({"tuning.device=t4"});
  CHECK_THAT(again.plan.memory.source, Catch::Contains("plan cache"));
  CHECK(again.plan.micro_batch == t4.plan.micro_batch);
  // SGD without momentum keeps no state per parameter: another measurement.
  const RunParts plain_sgd = plan_for({"tuning.device=t4", "optim.momentum=0"});
  CHECK_THAT(plain_sgd.plan.memory.source, !Catch::Contains("plan cache"));
  CHECK(plain_sgd.plan.memory.fixed_bytes < t4.plan.memory.fixed_bytes);

  // fit still needs the data: the missing folder is an input error.
  CHECK_THROWS_AS(prepare_run(load_config(config, {"data.root=" + cache + "/none"})), DataError);
  files::remove_all(cache);
}

namespace {

// A 50-token vocabulary (vocab.txt) and train/val token files in dir: [PAD] at id pad_id, the
// other specials [UNK] [CLS] [SEP] [MASK] at the lowest other ids, documents of 12 to 35 tokens
// from the remaining 45 ids.
void write_mlm_corpus(const std::string& dir, int64_t pad_id) {
  std::vector<std::string> words(50);
  std::vector<int64_t> specials, plain;
  for (int64_t id = 0; id < 50; ++id) {
    if (id == pad_id) continue;
    (specials.size() < 4 ? specials : plain).push_back(id);
  }
  words[static_cast<size_t>(pad_id)] = "[PAD]";
  const char* names[] = {"[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  for (size_t i = 0; i < 4; ++i) words[static_cast<size_t>(specials[i])] = names[i];
  for (size_t i = 0; i < plain.size(); ++i) words[static_cast<size_t>(plain[i])] = "w" + std::to_string(i);
  {
    std::ofstream vocab(files::join(dir, "vocab.txt"));
    for (const auto& w : words) vocab << w << "\n";
  }
  std::vector<std::vector<int64_t>> docs;
  for (int d = 0; d < 24; ++d) {
    docs.emplace_back();
    for (int t = 0; t < 12 + d; ++t) docs.back().push_back(plain[static_cast<size_t>((d * 7 + t * 3) % 45)]);
  }
  train::data::TokenFileOptions token_options;
  token_options.vocab_size = 50;
  token_options.special = {pad_id, specials[0], specials[1], specials[2], specials[3]};
  train::data::write_token_file(files::join(dir, "train.tokens"), docs, token_options);
  train::data::write_token_file(files::join(dir, "val.tokens"), docs, token_options);
}

}  // namespace

TEST_CASE("plan cache: a masked-LM plan is keyed by data.mask_prob since it sets the size of the head", "[plan][probe][bert]") {
  const std::string dir = temp_dir("mlm_cache");
  write_mlm_corpus(dir, 0);
  auto plan_with = [&](const std::string& mask_prob) {
    const Config c = parse_config(
        "model: {name: bert-mlm, preset: bert-tiny, vocab_size: 50, num_classes: 50, max_positions: 16}\n"
        "data: {kind: tokens, root: " + dir + ", vocab_file: vocab.txt, seq_len: 16, workers: 0, mask_prob: " +
            mask_prob + "}\n"
        "trainer: {global_batch: 8, max_steps: 1}\n"
        "tuning: {device: a100-80gb, cache_dir: " + dir + "/cache}\n",
        "mlm.yaml");
    RunOptions planning;
    planning.data_optional = true;  // as train plan --device does: tuning.device is for planning only
    return prepare_run(c, planning).plan.memory.source;
  };
  CHECK_THAT(plan_with("0.15"), !Catch::Contains("plan cache"));
  CHECK_THAT(plan_with("0.15"), Catch::Contains("plan cache"));
  // Twice the masked positions: twice the head's logits per sample, so neither the plan nor the
  // CPU measurement behind it may come from the cache.
  const std::string other = plan_with("0.3");
  CHECK_THAT(other, !Catch::Contains("plan cache"));
  CHECK_THAT(other, !Catch::Contains("measured earlier"));
  files::remove_all(dir);
}

TEST_CASE("plan cache: dropout, the head count and the optimizer implementation are in the key (activation and "
          "optimizer memory)", "[plan][probe][bert]") {
  const std::string dir = temp_dir("settings_cache");
  write_mlm_corpus(dir, 0);
  auto plan_with = [&](const std::string& model_extra, const std::string& optim) {
    const Config c = parse_config(
        "model: {name: bert-mlm, preset: bert-tiny, vocab_size: 50, num_classes: 50, max_positions: 16" + model_extra +
            "}\n"
            "data: {kind: tokens, root: " + dir + ", vocab_file: vocab.txt, seq_len: 16, workers: 0}\n"
            "optim: {name: adamw, lr: 0.001, impl: " + optim + "}\n"
            "trainer: {global_batch: 8, max_steps: 1}\n"
            "tuning: {device: a100-80gb, cache_dir: " + dir + "/cache}\n",
        "mlm.yaml");
    RunOptions planning;
    planning.data_optional = true;  // as train plan --device does: tuning.device is for planning only
    return prepare_run(c, planning).plan.memory.source;
  };
  CHECK_THAT(plan_with("", "loop"), !Catch::Contains("plan cache"));
  CHECK_THAT(plan_with("", "loop"), Catch::Contains("plan cache"));
  // Each of these changes the memory of a step, so neither the plan nor the CPU measurement
  // behind it may come from the cache (which the same shapes used to hit).
  for (const auto& [model_extra, optim] : std::vector<std::pair<std::string, std::string>>{
           {", dropout: 0.0", "loop"}, {", heads: 4", "loop"}, {"", "foreach"}}) {
    INFO(model_extra << " " << optim);
    const std::string other = plan_with(model_extra, optim);
    CHECK_THAT(other, !Catch::Contains("plan cache"));
    CHECK_THAT(other, !Catch::Contains("measured earlier"));
  }
  files::remove_all(dir);
}

TEST_CASE("a BERT model masks the id its data pads with, not a fixed 0", "[bert][trainer]") {
  const std::string dir = temp_dir("mlm_pad");
  write_mlm_corpus(dir, 5);  // [PAD] is id 5, as in a vocabulary that does not start with it
  auto config = [&](const std::string& model_extra) {
    return parse_config("model: {name: bert-mlm, preset: bert-tiny, vocab_size: 50, num_classes: 50, max_positions: 16, "
                        "dropout: 0.0" + model_extra + "}\n"
                        "data: {kind: tokens, root: " + dir + ", vocab_file: vocab.txt, seq_len: 16, workers: 0}\n"
                        "trainer: {global_batch: 8, max_steps: 1}\n",
                        "mlm.yaml");
  };
  RunParts run = prepare_run(config(""));
  auto* bert = dynamic_cast<models::BertModel*>(run.model.get());
  REQUIRE(bert);
  CHECK(bert->options().pad_id == 5);
  // Padding changes nothing at the real positions: the model does not attend to it.
  bert->eval();
  torch::NoGradGuard no_grad;
  const auto real = torch::tensor({{1, 7, 8, 9, 2}}, torch::kLong);  // [CLS] w w w [SEP]
  const auto padded = torch::cat({real, torch::full({1, 4}, 5, torch::kLong)}, 1);
  const auto alone = bert->forward(real);
  const auto with_padding = bert->forward(padded).narrow(1, 0, 5);
  CHECK(torch::allclose(alone, with_padding, 1e-5, 1e-5));
  // An explicit model.pad_id that contradicts the data's is a config error naming the key.
  try {
    prepare_run(config(", pad_id: 0"));
    FAIL("expected a ConfigError");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::Contains("key 'model.pad_id': 0, but the data pads with id 5"));
  }
  CHECK(dynamic_cast<models::BertModel&>(*prepare_run(config(", pad_id: 5")).model).options().pad_id == 5);
  files::remove_all(dir);
}

TEST_CASE("fit: dynamic loss scaling changes nothing but the scale, and resumes with it", "[trainer][amp]") {
  register_tiny_mlp();
  const std::string dir = temp_dir("scaling");
  Config c = synthetic_config();
  c.trainer.max_steps = 6;
  c.precision.mode = "bf16";  // CPU autocast; the scaler path is the same as with fp16 on a GPU
  auto run_with = [&](const std::string& scaling, const std::string& run_dir) {
    Config cfg = c;
    cfg.precision.loss_scaling = scaling;
    RunParts run = prepare_run(cfg);
    CHECK(run.plan.loss_scaling == (scaling == "dynamic"));
    Trainer t(cfg, run.plan, run.model, run.train, nullptr, run_dir);
    t.fit();
    std::vector<torch::Tensor> out;
    for (const auto& p : t.model().parameters()) out.push_back(p.detach().clone());
    return out;
  };
  const auto plain = run_with("off", "");
  const auto scaled = run_with("dynamic", dir);
  for (size_t i = 0; i < plain.size(); ++i) CHECK(torch::allclose(plain[i], scaled[i], 1e-4, 1e-5));

  // The scaler's state is in the checkpoint.
  RunParts probe = prepare_run(c);
  const TrainState st = load_checkpoint(checkpoint_path(files::join(dir, "checkpoints"), 6), *probe.model, nullptr);
  REQUIRE(st.tensors.count("scaler/scale"));
  CHECK(st.tensors.at("scaler/scale").item<double>() == 65536.0);  // 6 clean steps < growth interval
  CHECK(st.tensors.at("scaler/growth_tracker").item<int64_t>() == 6);
  files::remove_all(dir);
}

namespace {

// TinyMlp whose forward gives NaN in the forward calls [from, to).
class NanMlp : public TinyMlp {
 public:
  NanMlp(const ModelConfig& c, int64_t from, int64_t to) : TinyMlp(c), from_(from), to_(to) {}
  torch::Tensor forward(const torch::Tensor& x) override {
    const int64_t call = calls_++;
    const torch::Tensor y = TinyMlp::forward(x);
    return call >= from_ && call < to_ ? y * std::numeric_limits<float>::quiet_NaN() : y;
  }

 private:
  int64_t from_, to_, calls_ = 0;
};

}  // namespace

TEST_CASE("fit: with loss scaling, an isolated non-finite loss is skipped, a run of them stops the run",
          "[trainer][amp]") {
  register_tiny_mlp();
  Config c = synthetic_config();
  c.trainer.max_steps = 20;
  c.precision.mode = "bf16";
  c.precision.loss_scaling = "dynamic";
  RunParts run = prepare_run(c);
  REQUIRE(run.plan.loss_scaling);
  {
    auto model = std::make_shared<NanMlp>(c.model, 3, 4);  // one bad step: the scaler skips it
    Trainer t(c, run.plan, model, run.train, nullptr, "");
    const FitResult r = t.fit();
    CHECK(r.steps == 20);
    CHECK(std::isfinite(r.train_loss));
  }
  {
    auto model = std::make_shared<NanMlp>(c.model, 3, 1000);  // diverged for good
    Trainer t(c, run.plan, model, run.train, nullptr, "");
    try {
      t.fit();
      FAIL("a model whose loss stays NaN trained to the end");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("nan at step 13") && Catch::Contains("The weights are still those after step 12"));
    }
  }
}

TEST_CASE("cuda: copying batches one ahead on a side stream trains exactly like synchronous copies", "[cuda]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: the side-stream feeder is checked by scripts/gpu-check on a GPU machine");
  const std::string dir = files::make_temp_directory("train_feeder_");
  const Config c = parse_config(
      "model: {name: resnet18, in_channels: 3, num_classes: 10, width: 0.25, small_input: true}\n"
      "data: {kind: synthetic, channels: 3, image_size: 16, synthetic_train_samples: 512, synthetic_val_samples: 64,"
      " workers: 2}\n"
      "optim: {name: sgd, lr: 0.05}\n"
      "trainer: {global_batch: 32, max_steps: 20, device: cuda}\n"
      "tuning: {micro_batch: 16}\n"
      "precision: {mode: fp32, channels_last: on}\n"
      "checkpoint: {every_steps: 7, keep_last: 5}\n",
      "feeder.yaml");
  auto train_with = [&](bool pinned, const std::string& run_dir) {
    RunParts run = prepare_run(c);
    run.plan.pin_memory = pinned;  // pinned: the feeder; otherwise blocking copies in the loop
    run.plan.cudnn_benchmark = false;
    apply_plan_globals(run.plan);
    at::globalContext().setDeterministicCuDNN(true);
    Trainer trainer(c, run.plan, run.model, run.train, run.val, run_dir);
    trainer.fit();
    std::vector<torch::Tensor> params;
    for (const auto& p : trainer.model().parameters()) params.push_back(p.detach().cpu());
    return params;
  };
  const auto fed = train_with(true, files::join(dir, "fed"));
  const auto plain = train_with(false, files::join(dir, "plain"));
  REQUIRE(fed.size() == plain.size());
  for (size_t i = 0; i < fed.size(); ++i) CHECK(torch::allclose(fed[i], plain[i], 1e-4, 1e-5));
  // The checkpoint records the batches consumed, not the one staged ahead: step 7 x 2 micro-batches.
  RunParts probe = prepare_run(c);
  const TrainState st = load_checkpoint(checkpoint_path(files::join(dir, "fed/checkpoints"), 7), *probe.model, nullptr);
  CHECK(st.batch_in_epoch == 14);
  files::remove_all(dir);
}

namespace {

class DropoutMlp : public models::Model {
 public:
  explicit DropoutMlp(const ModelConfig& c) {
    fc1 = register_module("fc1", torch::nn::Linear(c.in_channels * 8 * 8, 64));
    drop = register_module("drop", torch::nn::Dropout(0.3));
    fc2 = register_module("fc2", torch::nn::Linear(64, c.num_classes));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return fc2->forward(drop->forward(torch::relu(fc1->forward(x.flatten(1)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};

}  // namespace

TEST_CASE("cuda: a run resumed on the GPU ends where the uninterrupted one does (optimizer state, dropout)",
          "[cuda][resume]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: resuming on a GPU is checked by scripts/gpu-check on a GPU machine");
  models::register_model("dropout_mlp", [](const ModelConfig& c) { return std::make_shared<DropoutMlp>(c); },
                         "MLP with dropout for tests");
  const std::string dir = files::make_temp_directory("train_cuda_resume_");
  const Config c = parse_config(
      "model: {name: dropout_mlp, in_channels: 1, num_classes: 10}\n"
      "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 512, workers: 1}\n"
      "optim: {name: adamw, lr: 0.003, weight_decay: 0.01}\n"
      "trainer: {global_batch: 32, max_steps: 24, device: cuda}\n"
      "tuning: {micro_batch: 16}\n"
      "precision: {mode: fp32}\n"
      "checkpoint: {every_steps: 8, keep_last: 5}\n",
      "cuda_resume.yaml");
  auto weights = [](Trainer& t) {
    std::vector<torch::Tensor> out;
    for (const auto& p : t.model().parameters()) out.push_back(p.detach().cpu());
    return out;
  };
  RunParts full = prepare_run(c);
  apply_plan_globals(full.plan);
  Trainer a(c, full.plan, full.model, full.train, nullptr, files::join(dir, "whole"));
  a.fit();
  const std::string mid = checkpoint_path(files::join(dir, "whole/checkpoints"), 8);
  // A fresh process would start with other generator states: the checkpoint's must win.
  torch::manual_seed(4321);
  RunParts again = prepare_run(c);
  Trainer b(c, full.plan, again.model, again.train, nullptr, files::join(dir, "resumed"));
  CHECK(b.fit(mid).resumed_from_step == 8);
  const auto wa = weights(a), wb = weights(b);
  for (size_t i = 0; i < wa.size(); ++i) {
    INFO("parameter " << i << ", largest difference " << (wa[i] - wb[i]).abs().max().item<double>());
    CHECK(torch::allclose(wa[i], wb[i], 1e-5, 1e-6));
  }
  files::remove_all(dir);
}

namespace {

// The same samples, each taking `delay` to load: a loader with one worker starves the step.
class SlowDataset : public data::Dataset {
 public:
  SlowDataset(data::DatasetPtr inner, std::chrono::microseconds delay) : inner_(std::move(inner)), delay_(delay) {}
  int64_t size() const override { return inner_->size(); }
  data::Example get(int64_t index, uint64_t seed) const override {
    std::this_thread::sleep_for(delay_);
    return inner_->get(index, seed);
  }
  std::vector<int64_t> input_shape() const override { return inner_->input_shape(); }
  int64_t num_classes() const override { return inner_->num_classes(); }
  std::string describe() const override { return "slow " + inner_->describe(); }

 private:
  data::DatasetPtr inner_;
  std::chrono::microseconds delay_;
};

}  // namespace

TEST_CASE("fit: loader workers are raised while the step waits for data, on the same batches",
          "[trainer][data]") {
  register_tiny_mlp();
  const auto fit_with = [](const std::string& workers, int64_t max_workers) {
    Config c = parse_config("model: {name: tiny_mlp, in_channels: 1, num_classes: 10}\n"
                            "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 256,"
                            " synthetic_val_samples: 64, workers: " + workers + "}\n"
                            "optim: {name: sgd, lr: 0.1, momentum: 0.9}\n"
                            "schedule: {name: constant}\n"
                            "trainer: {global_batch: 16, max_steps: 40, device: cpu, threads: 1}\n"
                            "logging: {every_steps: 4}\n",
                            "adaptive_workers.yaml");
    RunParts run = prepare_run(c);
    if (max_workers > 0) {
      REQUIRE(run.plan.workers_adaptive);
      CHECK(run.plan.workers == 1);
      run.plan.max_workers = max_workers;  // whatever this machine's cores
    } else {
      CHECK_FALSE(run.plan.workers_adaptive);
    }
    const auto slow = std::make_shared<SlowDataset>(run.train, std::chrono::microseconds(2000));
    Trainer trainer(c, run.plan, run.model, slow, nullptr, "");
    const FitResult result = trainer.fit();
    std::vector<torch::Tensor> params;
    for (const auto& p : trainer.model().parameters()) params.push_back(p.detach().clone());
    return std::make_pair(result, params);
  };
  const auto [adaptive, adaptive_params] = fit_with("-1", 4);
  // 16 samples x 2 ms a step against a step of well under 1 ms: the wait is nearly all of it.
  CHECK(adaptive.loader_workers == 4);
  CHECK(adaptive.steps == 40);
  const auto [fixed, fixed_params] = fit_with("1", 0);
  CHECK(fixed.loader_workers == 1);
  REQUIRE(adaptive_params.size() == fixed_params.size());
  for (size_t i = 0; i < fixed_params.size(); ++i) CHECK(torch::equal(adaptive_params[i], fixed_params[i]));
}
