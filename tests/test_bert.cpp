#include "testing.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <map>

#include "train/amp.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/data/factory.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/fit.h"
#include "train/models/bert.h"
#include "train/safetensors.h"
#include "train/text/tsv_dataset.h"
#include "train/models/model.h"
#include "train/probe.h"
#include "train/run.h"

using train::models::BertAttention;
using train::models::BertHead;
using train::models::BertModel;
using train::models::BertOptions;

namespace {

BertOptions tiny(BertHead head) {
  BertOptions o = BertOptions::preset("bert-tiny");
  o.vocab_size = 100;
  o.max_positions = 32;
  o.head = head;
  o.pooler = head != BertHead::kMaskedLM;
  o.num_labels = 3;
  return o;
}

std::vector<std::string> names(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

bool has(const std::vector<std::string>& v, const std::string& s) { return std::find(v.begin(), v.end(), s) != v.end(); }

}  // namespace

TEST_CASE("BERT parameter counts match Hugging Face's", "[bert]") {
  BertOptions base = BertOptions::preset("bert-base");
  base.head = BertHead::kNone;
  CHECK(train::models::count_parameters(BertModel(base)) == 109482240);  // BertModel
  base.head = BertHead::kMaskedLM;
  base.pooler = false;
  CHECK(train::models::count_parameters(BertModel(base)) == 109514298);  // BertForMaskedLM
  // all-MiniLM-L6-v2 (BertModel): 22,713,216 parameters.
  CHECK(train::models::count_parameters(BertModel(BertOptions::preset("minilm-l6"))) == 22713216);
}

TEST_CASE("BERT parameter names are Hugging Face's", "[bert]") {
  const auto mlm = names(BertModel(tiny(BertHead::kMaskedLM)));
  for (const char* n : {"embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                        "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
                        "encoder.layer.0.attention.self.query.weight", "encoder.layer.1.attention.self.value.bias",
                        "encoder.layer.0.attention.output.dense.weight", "encoder.layer.0.attention.output.LayerNorm.bias",
                        "encoder.layer.0.intermediate.dense.weight", "encoder.layer.1.output.dense.bias",
                        "encoder.layer.1.output.LayerNorm.weight", "cls.predictions.bias",
                        "cls.predictions.transform.dense.weight", "cls.predictions.transform.LayerNorm.bias"})
    CHECK(has(mlm, n));
  CHECK_FALSE(has(mlm, "pooler.dense.weight"));
  CHECK(mlm.size() == 5 + 2 * 16 + 5);
  const auto cls = names(BertModel(tiny(BertHead::kClassifier)));
  CHECK(has(cls, "pooler.dense.weight"));
  CHECK(has(cls, "classifier.weight"));
  CHECK(has(cls, "classifier.bias"));
  CHECK(BertModel(tiny(BertHead::kNone)).named_buffers().size() == 0);
}

TEST_CASE("BERT heads: shapes, tied decoder, padding", "[bert]") {
  torch::manual_seed(0);
  BertModel mlm(tiny(BertHead::kMaskedLM));
  mlm.eval();
  const auto ids = torch::randint(5, 100, {3, 10}, torch::kLong);
  CHECK(mlm.forward(ids).sizes() == std::vector<int64_t>{3, 10, 100});
  // The decoder is the word-embedding matrix: a change to one shows in the logits.
  const auto before = mlm.forward(ids).detach().clone();
  {
    torch::NoGradGuard no_grad;
    mlm.named_parameters()["embeddings.word_embeddings.weight"][7] += 1.0;
  }
  CHECK_FALSE(torch::allclose(mlm.forward(ids), before));

  BertModel cls(tiny(BertHead::kClassifier));
  cls.eval();
  CHECK(cls.forward(ids).sizes() == std::vector<int64_t>{3, 3});

  // Padding (id 0) is masked out: appending pad tokens leaves the real positions unchanged.
  BertModel enc(tiny(BertHead::kNone));
  enc.eval();
  torch::NoGradGuard no_grad;
  const auto short_out = enc.forward(ids);
  const auto padded = torch::cat({ids, torch::zeros({3, 5}, torch::kLong)}, 1);
  const auto long_out = enc.forward(padded).slice(1, 0, 10);
  CHECK(torch::allclose(short_out, long_out, 1e-5, 1e-5));
  // An explicit mask gives the same as the derived one.
  CHECK(torch::allclose(enc.encode(padded, {}, padded.ne(0)), enc.forward(padded)));
  // A row of only padding stays finite (the mask is the lowest finite value, not -inf).
  CHECK(torch::isfinite(enc.forward(torch::zeros({2, 4}, torch::kLong))).all().item<bool>());
  // Token types change the result.
  CHECK_FALSE(torch::allclose(enc.encode(ids, torch::ones_like(ids)), short_out));
  CHECK_THROWS(enc.forward(torch::randint(1, 100, {1, 33}, torch::kLong)));  // > max_positions
}

TEST_CASE("BERT fused and plain attention agree", "[bert]") {
  torch::manual_seed(1);
  BertOptions o = BertOptions::preset("bert-mini");
  o.vocab_size = 200;
  o.max_positions = 64;
  BertModel model(o);
  model.eval();
  auto ids = torch::randint(1, 200, {4, 48}, torch::kLong);
  ids.slice(1, 40, 48).zero_();  // some padding
  ids[3].slice(0, 10, 48).zero_();
  if (train::models::bert_fused_attention_available()) {
    CHECK(model.attention() == BertAttention::kFused);  // auto resolves to fused on 2.x
    torch::NoGradGuard no_grad;
    const auto fused = model.forward(ids);
    model.set_attention(BertAttention::kPlain);
    const auto plain = model.forward(ids);
    CHECK((fused - plain).abs().max().item<double>() < 1e-5);
    // Without padding neither gets a mask (SDPA may then take a kernel that takes none).
    const auto full = torch::randint(1, 200, {4, 48}, torch::kLong);
    const auto plain_full = model.forward(full);
    model.set_attention(BertAttention::kFused);
    CHECK((model.forward(full) - plain_full).abs().max().item<double>() < 1e-5);
    // Gradients agree too.
  } else {
    CHECK(model.attention() == BertAttention::kPlain);  // auto resolves to plain on 1.13
    CHECK_THROWS_AS(model.set_attention(BertAttention::kFused), std::invalid_argument);
  }
  if (train::models::bert_fused_attention_available()) {
    model.train();
    o.dropout = o.attention_dropout = 0.0;
    BertModel a(o), b(o);
    {
      torch::NoGradGuard no_grad;
      auto pa = a.parameters(), pb = b.parameters();
      for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
    }
    b.set_attention(BertAttention::kPlain);
    a.forward(ids).pow(2).mean().backward();
    b.forward(ids).pow(2).mean().backward();
    auto ga = a.parameters(), gb = b.parameters();
    double worst = 0;
    for (size_t i = 0; i < ga.size(); ++i)
      if (ga[i].grad().defined()) worst = std::max(worst, (ga[i].grad() - gb[i].grad()).abs().max().item<double>());
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("cuda: BERT on the GPU: fused attention (SDPA) equals the plain one and the CPU, and bf16 autocast stays "
          "close", "[cuda][bert]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: attention on the GPU is checked by scripts/gpu-check on a GPU machine");
  const torch::Device cuda("cuda:0");
  // fp32 matmuls in full precision: an earlier test's plan may have allowed TF32 (10-bit mantissa).
  struct NoTf32 {
    bool was = at::globalContext().allowTF32CuBLAS();
    NoTf32() { at::globalContext().setAllowTF32CuBLAS(false); }
    ~NoTf32() { at::globalContext().setAllowTF32CuBLAS(was); }
  } no_tf32;
  torch::manual_seed(1);
  BertOptions o = BertOptions::preset("bert-mini");
  o.vocab_size = 200;
  o.max_positions = 128;
  o.dropout = o.attention_dropout = 0.0;
  BertModel model(o);
  model.eval();
  auto ids = torch::randint(1, 200, {4, 128}, torch::kLong);
  ids.slice(1, 100, 128).zero_();  // padding: SDPA gets a mask
  ids[3].slice(0, 10, 128).zero_();
  torch::NoGradGuard no_grad;
  const auto on_cpu = model.forward(ids);
  model.to(cuda);
  const auto ids_gpu = ids.to(cuda);
  const auto plain = [&] {
    if (!train::models::bert_fused_attention_available()) return model.forward(ids_gpu);
    model.set_attention(BertAttention::kPlain);
    auto out = model.forward(ids_gpu);
    model.set_attention(BertAttention::kFused);
    return out;
  }();
  CHECK(plain.isfinite().all().item<bool>());
  CHECK((plain.cpu() - on_cpu).abs().max().item<double>() < 1e-4);
  if (train::models::bert_fused_attention_available()) {
    const auto fused = model.forward(ids_gpu);
    CHECK((fused - plain).abs().max().item<double>() < 1e-4);
  }
  // bf16 autocast: hidden states after LayerNorm are of order 1; bf16 keeps about 3 digits.
  torch::Tensor low;
  {
    train::AutocastScope autocast(torch::kCUDA, torch::kBFloat16, true);
    low = model.forward(ids_gpu).to(torch::kFloat);
  }
  CHECK(low.isfinite().all().item<bool>());
  const auto diff = (low - plain).abs();
  INFO("bf16 against fp32: mean difference " << diff.mean().item<double>() << ", largest " << diff.max().item<double>());
  CHECK(diff.mean().item<double>() < 2e-2);
  CHECK(diff.max().item<double>() < 0.3);
}

TEST_CASE("BERT MLM: forward and backward under CPU bf16 autocast", "[bert][amp]") {
  torch::manual_seed(3);
  BertModel model(tiny(BertHead::kMaskedLM));
  const auto ids = torch::randint(1, 100, {2, 16}, torch::kLong);
  torch::Tensor logits;
  {
    train::AutocastScope autocast(torch::kCPU, torch::kBFloat16, true);
    logits = model.forward(ids);
  }
  REQUIRE(logits.sizes() == torch::IntArrayRef({2, 16, 100}));
  CHECK(logits.isfinite().all().item<bool>());
  torch::nn::functional::cross_entropy(logits.view({-1, 100}).to(torch::kFloat), ids.view({-1})).backward();
  for (const auto& p : model.named_parameters()) {
    INFO(p.key());
    REQUIRE(p.value().grad().defined());
    CHECK(p.value().grad().scalar_type() == torch::kFloat);  // fp32 master weights
    CHECK(p.value().grad().isfinite().all().item<bool>());
  }
}

namespace {

// The loss and every parameter's gradient of one MLM step on `ids` (on the model's device), from
// the generators at `seed`; `autocast` runs the forward in bf16.
struct StepResult {
  double loss = 0;
  std::map<std::string, torch::Tensor> grads;
  torch::Tensor drawn_after;  // what the generator gives after the step
};

StepResult mlm_step(BertModel& model, const torch::Tensor& ids, uint64_t seed, bool autocast) {
  model.train();
  model.zero_grad();
  torch::manual_seed(seed);
  torch::Tensor logits;
  {
    train::AutocastScope scope(ids.device().type(), torch::kBFloat16, autocast);
    logits = model.forward(ids);
  }
  const auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
                                                         ids.reshape({-1}));
  loss.backward();
  StepResult r;
  r.loss = loss.item<double>();
  for (const auto& p : model.named_parameters()) {
    r.grads[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::Tensor();
  }
  r.drawn_after = torch::rand({8}, torch::TensorOptions().device(ids.device()));
  return r;
}

}  // namespace

TEST_CASE("BERT recompute: the same loss and gradients as keeping the activations, dropout and padding included",
          "[bert][recompute]") {
  BertOptions o = tiny(BertHead::kMaskedLM);
  o.num_layers = 3;
  o.dropout = o.attention_dropout = 0.2;  // masks the recomputation must draw again
  torch::manual_seed(11);
  BertModel plain(o);
  o.recompute = true;
  BertModel recomputed(o);
  REQUIRE(recomputed.recompute());
  {
    torch::NoGradGuard no_grad;
    auto from = plain.parameters(), to = recomputed.parameters();
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  auto ids = torch::randint(1, 100, {3, 24}, torch::kLong);
  ids[1].slice(0, 15, 24).zero_();  // padding: the attention mask goes through the recomputation too
  for (const bool autocast : {false, true}) {
    INFO((autocast ? "bf16 autocast" : "fp32"));
    const StepResult a = mlm_step(plain, ids, 21, autocast);
    const StepResult b = mlm_step(recomputed, ids, 21, autocast);
    CHECK(a.loss == b.loss);
    for (const auto& [name, grad] : a.grads) {
      INFO(name);
      REQUIRE(grad.defined());
      REQUIRE(b.grads.at(name).defined());
      CHECK((grad - b.grads.at(name)).abs().max().item<double>() <= 1e-6 * std::max(1.0, grad.abs().max().item<double>()));
    }
    // The recomputation drew its masks from a fork of the generator: what comes after the step is
    // what comes after a plain one.
    CHECK(torch::equal(a.drawn_after, b.drawn_after));
  }
  // Frozen embeddings (a program may freeze them for fine-tuning): the layers still get their
  // gradients, the same as without recomputation.
  for (BertModel* m : {&plain, &recomputed}) {
    for (auto& p : m->named_parameters()) {
      if (p.key().rfind("embeddings.", 0) == 0) p.value().requires_grad_(false);
    }
  }
  const StepResult frozen_a = mlm_step(plain, ids, 23, false);
  const StepResult frozen_b = mlm_step(recomputed, ids, 23, false);
  CHECK(frozen_a.loss == frozen_b.loss);
  for (const auto& [name, grad] : frozen_a.grads) {
    INFO(name);
    REQUIRE(grad.defined() == frozen_b.grads.at(name).defined());
    // (LibTorch 1.13's zero_grad leaves zeros where 2.x leaves no gradient.)
    CHECK((name.rfind("embeddings.", 0) == 0) == (!grad.defined() || grad.abs().max().item<double>() == 0));
    if (grad.defined()) CHECK((grad - frozen_b.grads.at(name)).abs().max().item<double>() <= 1e-6 * std::max(1.0, grad.abs().max().item<double>()));
  }
  for (BertModel* m : {&plain, &recomputed}) {
    for (auto& p : m->parameters()) p.requires_grad_(true);
  }
  // Another seed gives other masks, and so another loss: the dropout really is in the comparison.
  CHECK(mlm_step(plain, ids, 22, false).loss != mlm_step(plain, ids, 21, false).loss);
  // Evaluation and no-grad forwards run the plain layers.
  recomputed.eval();
  plain.eval();
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(recomputed.forward(ids), plain.forward(ids)));
}

TEST_CASE("cuda: BERT recompute on the GPU redraws the fused attention's dropout: the same loss and gradients",
          "[bert][recompute][cuda]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: recomputation on the GPU is checked by scripts/gpu-check");
  const torch::Device cuda(torch::kCUDA, 0);
  BertOptions o = tiny(BertHead::kMaskedLM);
  o.num_layers = 3;
  o.dropout = o.attention_dropout = 0.2;  // the CUDA generator's masks, in SDPA's kernels too
  torch::manual_seed(11);
  BertModel plain(o);
  o.recompute = true;
  BertModel recomputed(o);
  plain.to(cuda);
  recomputed.to(cuda);
  {
    torch::NoGradGuard no_grad;
    auto from = plain.parameters(), to = recomputed.parameters();
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  for (const bool padded : {false, true}) {  // no mask (the flash kernel may run) and a padding mask
    auto ids = torch::randint(1, 100, {4, 32}, torch::kLong);
    if (padded) ids[1].slice(0, 20, 32).zero_();
    ids = ids.to(cuda);
    for (const bool autocast : {false, true}) {
      INFO((padded ? "padded, " : "unpadded, ") << (autocast ? "bf16 autocast" : "fp32"));
      const StepResult a = mlm_step(plain, ids, 21, autocast);
      const StepResult b = mlm_step(recomputed, ids, 21, autocast);
      CHECK(a.loss == b.loss);
      for (const auto& [name, grad] : a.grads) {
        INFO(name);
        REQUIRE(b.grads.at(name).defined());
        // Atomics in some backward kernels (embedding, SDPA) may sum in another order.
        CHECK((grad - b.grads.at(name)).abs().max().item<double>() <=
              1e-4 * std::max(1.0, grad.abs().max().item<double>()));
      }
      CHECK(torch::equal(a.drawn_after, b.drawn_after));
    }
  }
}

TEST_CASE("BERT recompute: the probe measures less activation memory per sample", "[bert][recompute][probe]") {
  train::ModelConfig config;
  config.name = "bert-mlm";
  config.preset = "bert-mini";  // 4 layers of 256: the activations outweigh the 1,000-token head
  config.vocab_size = 1000;
  config.max_positions = 64;
  train::ProbeOptions options;
  options.input_shape = {64};
  options.num_classes = 1000;
  options.device = "cpu";
  options.target_fraction = 0.15;
  options.optim.name = "adamw";
  auto per_sample = [&](bool recompute) {
    config.recompute = recompute;
    auto model = train::models::make_model(config);
    return train::probe_memory(*model, options, {8, 16}).per_sample_bytes;
  };
  const double plain = per_sample(false), recomputed = per_sample(true);
  CAPTURE(plain, recomputed);
  CHECK(recomputed > 0);
  CHECK(recomputed < 0.6 * plain);
}

TEST_CASE("BERT MLM forward_selected: the head at the chosen positions equals forward() there, gradients too",
          "[bert]") {
  BertOptions o = tiny(BertHead::kMaskedLM);
  o.dropout = o.attention_dropout = 0.0;
  torch::manual_seed(5);
  BertModel a(o), b(o);
  {
    torch::NoGradGuard no_grad;
    auto pa = a.parameters(), pb = b.parameters();
    for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
  }
  auto ids = torch::randint(1, 100, {3, 20}, torch::kLong);
  ids[2].slice(0, 12, 20).zero_();  // padding
  const auto positions = torch::rand({3, 20}).lt(0.2);
  const auto targets = torch::randint(0, 100, {3, 20}, torch::kLong);
  const int64_t n = positions.sum().item<int64_t>();
  REQUIRE(n > 0);

  const auto selected = a.forward_selected(ids, positions);
  REQUIRE(selected.sizes() == torch::IntArrayRef({n, 100}));
  const auto dense = b.forward(ids);
  const auto dense_selected = dense.reshape({-1, 100}).index({positions.reshape({-1})});
  CHECK((selected - dense_selected).abs().max().item<double>() < 1e-5);
  // The base class's version (select from forward()) gives the same rows.
  CHECK((a.Model::forward_selected(ids, positions) - selected).abs().max().item<double>() < 1e-5);

  torch::nn::functional::cross_entropy(selected, targets.masked_select(positions)).backward();
  torch::nn::functional::cross_entropy(dense_selected, targets.masked_select(positions)).backward();
  auto ga = a.named_parameters(), gb = b.named_parameters();
  for (const auto& item : ga) {
    INFO(item.key());
    REQUIRE(item.value().grad().defined());
    CHECK((item.value().grad() - gb[item.key()].grad()).abs().max().item<double>() < 1e-5);
  }
  // No position selected: no logits, and a loss sum of 0 that still backpropagates.
  const auto none = a.forward_selected(ids, torch::zeros({3, 20}, torch::kBool));
  CHECK(none.sizes() == torch::IntArrayRef({0, 100}));
}

TEST_CASE("BERT registry builders and config keys", "[bert]") {
  const train::Config c = train::parse_config(
      "model: {name: bert-mlm, preset: bert-tiny, vocab_size: 500, max_positions: 64, dropout: 0.0}\n"
      "data: {kind: synthetic}\ntrainer: {global_batch: 8, max_steps: 1}\n",
      "bert.yaml");
  auto model = train::models::make_model(c.model);
  auto* bert = dynamic_cast<BertModel*>(model.get());
  REQUIRE(bert);
  CHECK(bert->options().vocab_size == 500);
  CHECK(bert->options().hidden_size == 128);
  CHECK(bert->options().num_layers == 2);
  CHECK(bert->options().intermediate_size == 512);
  CHECK(bert->options().head == BertHead::kMaskedLM);
  CHECK_THROWS_WITH(train::parse_config("model: {name: bert-mlm, preset: bert-huge}\ntrainer: {global_batch: 8, max_steps: 1}\n", "x.yaml"),
                    Catch::Contains("model.preset"));
  train::ModelConfig bad = c.model;
  bad.heads = 3;  // 128 is not a multiple of 3
  CHECK_THROWS_WITH(train::models::make_model(bad), Catch::Contains("not a multiple of num_heads"));

  // What prepare_run checks before a run: sample length against the positions, the data's
  // vocabulary against the embedding (vocab 500 from c, 16 positions here).
  train::ModelConfig small = c.model;
  small.max_positions = 16;
  const auto checked = train::models::make_model(small);
  CHECK(checked->input_problem({16}, 500).empty());
  CHECK(checked->input_problem({8}, 20).empty());
  CHECK_THAT(checked->input_problem({32}, 500),
             Catch::Contains("key 'data.seq_len': 32 tokens per sample") && Catch::Contains("16 position embeddings"));
  CHECK_THAT(checked->input_problem({16}, 501),
             Catch::Contains("key 'model.vocab_size'") && Catch::Contains("501 tokens"));
  CHECK_THAT(checked->input_problem({1, 28, 28}, 0), Catch::Contains("key 'model.name'"));

  // model.recompute: BERT's layers only.
  train::ModelConfig recomputed = c.model;
  recomputed.recompute = true;
  CHECK(dynamic_cast<BertModel&>(*train::models::make_model(recomputed)).recompute());
  CHECK_THROWS_WITH(train::parse_config("model: {name: resnet18, recompute: true}\ndata: {kind: synthetic}\n"
                                        "trainer: {global_batch: 8, max_steps: 1}\n",
                                        "r.yaml"),
                    Catch::StartsWith("r.yaml:1:36: key 'model.recompute': only the BERT models") &&
                        Catch::Contains("model 'resnet18' keeps its activations"));
}

TEST_CASE("a checkpoint of a BERT with another head count is refused: the same shapes compute something else",
          "[bert][checkpoint]") {
  const std::string dir = train::files::make_temp_directory("train_test_bert_heads_");
  BertOptions two = tiny(BertHead::kMaskedLM);  // bert-tiny: 2 heads of 64
  BertOptions four = two;
  four.num_heads = 4;  // 4 heads of 32: every parameter has the same shape
  BertModel saved(two), other(four), same(two);
  CHECK(saved.architecture() == "model.heads=2");
  const std::string path = train::checkpoint_path(dir, 1);
  train::save_checkpoint(path, saved, nullptr, {});

  // Resume (load_checkpoint) and evaluation or export (load_model_weights) refuse it, naming both.
  const auto refusal = [](const std::function<void()>& load) -> std::string {
    try {
      load();
    } catch (const train::CheckpointError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  for (const std::string& what : {refusal([&] { train::load_checkpoint(path, other, nullptr); }),
                                  refusal([&] { train::load_model_weights(path, other); }),
                                  refusal([&] { train::check_model_weights(path, other); })}) {
    CHECK_THAT(what, Catch::Contains(path) && Catch::Contains("model.heads=2") && Catch::Contains("model.heads=4"));
  }
  // model.init_strict: false loads it with a warning; the matching model loads it silently.
  CHECK_NOTHROW(train::load_model_weights(path, other, /*strict=*/false));
  CHECK_NOTHROW(train::load_checkpoint(path, same, nullptr));
  for (const auto& [name, t] : train::state_dict(same)) CHECK(torch::equal(t, train::state_dict(saved).at(name)));
  train::files::remove_all(dir);
}

TEST_CASE("BERT MLM loss falls on a short run", "[bert]") {
  torch::manual_seed(2);
  BertOptions o = tiny(BertHead::kMaskedLM);
  o.dropout = o.attention_dropout = 0.0;
  BertModel model(o);
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-3));
  // Sequences that alternate between two neighbouring ids: a masked token is predictable from
  // the others.
  auto batch = [](int64_t step) {
    auto start = torch::randint(0, 90, {16, 1}, torch::kLong);
    auto ids = (start + torch::arange(24).unsqueeze(0).remainder(2)).remainder(90) + 5;
    auto target = torch::full_like(ids, -100);
    auto mask = torch::rand(ids.sizes()) < 0.15;
    target.masked_scatter_(mask, ids.masked_select(mask));
    auto input = ids.masked_fill(mask, 4);  // [MASK]
    (void)step;
    return std::make_pair(input, target);
  };
  double first = 0, last = 0;
  for (int64_t step = 0; step < 200; ++step) {
    auto [input, target] = batch(step);
    auto logits = model.forward(input);
    auto loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, o.vocab_size}), target.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (step < 5) first += loss.item<double>() / 5;
    if (step >= 195) last += loss.item<double>() / 5;
  }
  INFO("first " << first << ", last " << last);
  CHECK(first > 4.0);        // about ln(100) at the start
  CHECK(last < first - 2.0);  // and clearly falling (transformers' BertForMaskedLM, 4 seeds: 4.6 -> 0.2-0.3)
}

TEST_CASE("MiniLM hidden states match transformers' BertModel within 1e-4", "[bert][oracle][minilm]") {
  const std::string dir = train::files::make_temp_directory("bert_oracle");
  REQUIRE(train::testing::run_python("bert_oracle.py", dir) == 0);
  std::string model_path;
  std::getline(std::ifstream(dir + "/model_path.txt"), model_path);
  BertModel model(BertOptions::preset("minilm-l6"));
  const train::TensorMap weights = train::read_safetensors(model_path);
  const train::LoadReport report = train::load_state_dict(model, weights, /*strict=*/false, model_path);
  CHECK(report.missing.empty());
  CHECK(report.mismatched.empty());
  // transformers keeps position_ids as a non-persistent buffer; older files still store it.
  CHECK(report.unexpected == std::vector<std::string>{"embeddings.position_ids"});
  CHECK(report.loaded.size() == 103);
  // With the model's rules it is a fixed buffer, skipped, and strict loading takes the file as is.
  const auto ruled = train::load_state_dict(model, weights, /*strict=*/true, model_path, model.weight_rules());
  CHECK(ruled.redundant == std::vector<std::string>{"embeddings.position_ids"});
  CHECK(ruled.loaded.size() == 103);
  model.eval();
  torch::NoGradGuard no_grad;
  const train::TensorMap ref = train::read_safetensors(dir + "/bert_oracle.safetensors");
  std::vector<BertAttention> paths{BertAttention::kPlain};
  if (train::models::bert_fused_attention_available()) paths.push_back(BertAttention::kFused);
  for (const BertAttention path : paths) {
    model.set_attention(path);
    const auto hidden = model.encode(ref.at("input_ids"), ref.at("token_type_ids"), ref.at("attention_mask"));
    const double hidden_error = (hidden - ref.at("last_hidden_state")).abs().max().item<double>();
    const double pooled_error = (model.pool(hidden) - ref.at("pooler_output")).abs().max().item<double>();
    INFO("attention " << (path == BertAttention::kFused ? "fused" : "plain") << ": hidden " << hidden_error
                      << ", pooled " << pooled_error);
    CHECK(hidden_error < 1e-4);
    CHECK(pooled_error < 1e-4);
    // The padding-derived mask equals the tokenizer's attention mask here (pad id 0).
    const auto derived = model.encode(ref.at("input_ids"), ref.at("token_type_ids"));
    CHECK((derived - hidden).abs().max().item<double>() == 0.0);
  }
  train::files::remove_all(dir);
}

TEST_CASE("Hugging Face head-model checkpoints (encoder under 'bert.') load strictly, same logits", "[bert][oracle]") {
  const std::string dir = train::files::make_temp_directory("bert_heads");
  REQUIRE(train::testing::run_python("bert_head_oracle.py", dir) == 0);
  const train::TensorMap ref = train::read_safetensors(dir + "/reference.safetensors");
  torch::NoGradGuard no_grad;
  for (const BertHead head : {BertHead::kMaskedLM, BertHead::kClassifier}) {
    const bool mlm = head == BertHead::kMaskedLM;
    const std::string path = dir + (mlm ? "/mlm" : "/classifier") + "/model.safetensors";
    CAPTURE(path);
    BertModel model(tiny(head));
    const train::LoadReport report = train::load_state_dict(model, train::read_safetensors(path), /*strict=*/true, path);
    CHECK(report.stripped_prefix == "bert.");
    CHECK(report.loaded.size() == (mlm ? 42u : 41u));
    train::load_model_weights(path, model, /*strict=*/true);  // the model.init_from path
    model.eval();
    const auto logits = model.forward(ref.at("input_ids"));
    const auto& expected = ref.at(mlm ? "mlm_logits" : "classifier_logits");
    // Padded positions of the second row: transformers computes them too, from masked attention.
    CHECK((logits - expected).abs().max().item<double>() < 1e-4);
  }
  // Names that do not line up under one prefix are taken as they are, and the strict error says
  // which prefix was removed when one was.
  BertModel mlm(tiny(BertHead::kMaskedLM));
  train::TensorMap odd = train::read_safetensors(dir + "/mlm/model.safetensors");
  odd.erase("cls.predictions.bias");
  CHECK_THROWS_WITH(train::load_state_dict(mlm, odd, /*strict=*/true, "odd.safetensors"),
                    Catch::Contains("missing key 'cls.predictions.bias'") &&
                        Catch::Contains("(keys 'bert.*' were read without that prefix)"));
  train::files::remove_all(dir);
}

TEST_CASE("checkpoints with TensorFlow's LayerNorm names (gamma, beta) load strictly under BERT's rules, same logits",
          "[bert][oracle][safetensors]") {
  // Google-ported checkpoints (bert-base-uncased) name a LayerNorm's weight and bias "gamma" and
  // "beta"; the oracle writes its masked-LM file that way and checks that transformers loads it.
  const std::string dir = train::files::make_temp_directory("bert_tf_names");
  REQUIRE(train::testing::run_python("bert_head_oracle.py", dir) == 0);
  const std::string path = dir + "/mlm_tf_names/model.safetensors";
  const train::TensorMap file = train::read_safetensors(path);
  REQUIRE(file.count("bert.embeddings.LayerNorm.gamma") == 1);
  REQUIRE(file.count("cls.predictions.transform.LayerNorm.beta") == 1);  // a head's too, outside 'bert.'
  torch::NoGradGuard no_grad;
  BertModel model(tiny(BertHead::kMaskedLM));
  const train::LoadReport report = train::load_state_dict(model, file, /*strict=*/true, path, model.weight_rules());
  CHECK(report.stripped_prefix == "bert.");
  using Rename = std::pair<std::string, std::string>;
  CHECK(report.renamed ==
        std::vector<Rename>{{"LayerNorm.gamma", "LayerNorm.weight"}, {"LayerNorm.beta", "LayerNorm.bias"}});
  CHECK(report.loaded.size() == 42u);  // all 12 LayerNorm tensors among them
  // The same tensors as the file with PyTorch's names, and transformers' logits.
  BertModel same(tiny(BertHead::kMaskedLM));
  train::load_state_dict(same, train::read_safetensors(dir + "/mlm/model.safetensors"), /*strict=*/true);
  for (const auto& [name, t] : train::state_dict(same)) {
    CAPTURE(name);
    CHECK(torch::equal(t, train::state_dict(model).at(name)));
  }
  BertModel from_init(tiny(BertHead::kMaskedLM));
  train::load_model_weights(path, from_init, /*strict=*/true, from_init.weight_rules());  // the model.init_from path
  from_init.eval();
  const train::TensorMap ref = train::read_safetensors(dir + "/reference.safetensors");
  CHECK((from_init.forward(ref.at("input_ids")) - ref.at("mlm_logits")).abs().max().item<double>() < 1e-4);

  // Without the rules the names are the file's, and the strict error lists them.
  CHECK_THROWS_WITH(train::load_state_dict(model, file, /*strict=*/true, path),
                    Catch::Contains("unexpected key 'embeddings.LayerNorm.beta'") &&
                        Catch::Contains("missing key 'embeddings.LayerNorm.bias'"));
  // A file with both names keeps both: which one is meant is not guessed, and strict says so.
  train::TensorMap both = file;
  both["bert.embeddings.LayerNorm.weight"] = file.at("bert.embeddings.LayerNorm.gamma").clone();
  CHECK_THROWS_WITH(train::load_state_dict(model, both, /*strict=*/true, "both.safetensors", model.weight_rules()),
                    Catch::Contains("unexpected key 'embeddings.LayerNorm.gamma'") &&
                        Catch::Contains("(keys '*LayerNorm.gamma' were read as '*LayerNorm.weight')"));
  // Renames match whole name components: "XLayerNorm.gamma" is not a LayerNorm's.
  train::TensorMap odd = file;
  odd["bert.embeddings.XLayerNorm.gamma"] = odd.at("bert.embeddings.LayerNorm.gamma");
  odd.erase("bert.embeddings.LayerNorm.gamma");
  CHECK_THROWS_WITH(train::load_state_dict(model, odd, /*strict=*/true, "odd.safetensors", model.weight_rules()),
                    Catch::Contains("unexpected key 'embeddings.XLayerNorm.gamma'") &&
                        Catch::Contains("missing key 'embeddings.LayerNorm.weight'"));
  train::files::remove_all(dir);
}

TEST_CASE("init_from a pretraining file: body strict, new head fresh, other heads and tied copies skipped",
          "[bert][safetensors]") {
  torch::manual_seed(0);
  // A BertForPreTraining-style file: encoder and pooler under 'bert.', the MLM head with the
  // decoder's tied copies, the next-sentence head, and the old position_ids buffer.
  BertModel source(tiny(BertHead::kMaskedLM));
  train::TensorMap file;
  for (const auto& [name, t] : train::state_dict(source)) {
    file.emplace(name.rfind("cls.", 0) == 0 ? name : "bert." + name, t.clone());
  }
  const int64_t h = source.options().hidden_size;
  file["bert.pooler.dense.weight"] = torch::randn({h, h});
  file["bert.pooler.dense.bias"] = torch::randn({h});
  file["bert.embeddings.position_ids"] = torch::arange(32).unsqueeze(0);
  file["cls.predictions.decoder.weight"] = file.at("bert.embeddings.word_embeddings.weight").clone();
  file["cls.predictions.decoder.bias"] = file.at("cls.predictions.bias").clone();
  file["cls.seq_relationship.weight"] = torch::randn({2, h});
  file["cls.seq_relationship.bias"] = torch::randn({2});

  // The same architecture: everything it has comes from the file.
  BertModel mlm(tiny(BertHead::kMaskedLM));
  const auto report = train::load_state_dict(mlm, file, /*strict=*/true, "pretraining.safetensors", mlm.weight_rules());
  CHECK(report.complete());
  CHECK(report.fresh.empty());
  CHECK(report.redundant == std::vector<std::string>{"cls.predictions.decoder.bias", "cls.predictions.decoder.weight",
                                                     "embeddings.position_ids"});
  CHECK(report.unused == std::vector<std::string>{"cls.seq_relationship.bias", "cls.seq_relationship.weight",
                                                  "pooler.dense.bias", "pooler.dense.weight"});
  for (const auto& [name, t] : train::state_dict(mlm)) {
    CAPTURE(name);
    CHECK(torch::equal(t, train::state_dict(source).at(name)));
  }
  // Without the model's rules the extra tensors are unexpected; with them, a decoder that is not
  // a copy of the embeddings (an untied model) or a position_ids that is not 0, 1, 2, ... is.
  CHECK_THROWS_WITH(train::load_state_dict(mlm, file, true, "pretraining.safetensors"),
                    Catch::Contains("unexpected key 'cls.predictions.decoder.bias'"));
  train::TensorMap untied = file;
  untied["cls.predictions.decoder.weight"] = untied["cls.predictions.decoder.weight"] + 1e-3;
  untied["bert.embeddings.position_ids"] = torch::arange(1, 33).unsqueeze(0);
  CHECK_THROWS_WITH(train::load_state_dict(mlm, untied, true, "untied.safetensors", mlm.weight_rules()),
                    Catch::Contains("unexpected key 'cls.predictions.decoder.weight'") &&
                        Catch::Contains("unexpected key 'embeddings.position_ids'"));

  // A classifier: encoder and pooler from the file, the classifier fresh, the MLM head unused.
  BertModel classifier(tiny(BertHead::kClassifier));
  const auto fresh_classifier = classifier.named_parameters()["classifier.weight"].clone();
  const auto cls = train::load_state_dict(classifier, file, true, "pretraining.safetensors", classifier.weight_rules());
  CHECK(cls.fresh == std::vector<std::string>{"classifier.bias: not in the file", "classifier.weight: not in the file"});
  CHECK(cls.loaded.size() == train::state_dict(classifier).size() - 2);
  CHECK(torch::equal(classifier.named_parameters()["pooler.dense.weight"], file.at("bert.pooler.dense.weight")));
  CHECK(torch::equal(classifier.named_parameters()["classifier.weight"], fresh_classifier));
  CHECK(std::count(cls.unused.begin(), cls.unused.end(), "cls.predictions.transform.dense.weight") == 1);

  // The rules never excuse the body: another encoder size is still a strict error.
  BertOptions wider = tiny(BertHead::kClassifier);
  wider.intermediate_size *= 2;
  BertModel other(wider);
  CHECK_THROWS_WITH(train::load_state_dict(other, file, true, "pretraining.safetensors", other.weight_rules()),
                    Catch::Contains("shape mismatch for 'encoder.layer.0.intermediate.dense.weight'"));
}

TEST_CASE("TSV dataset: labels, truncation, dynamic padding, errors name file and line", "[bert][tsv]") {
  using train::text::TsvDataset;
  using train::text::TsvDatasetOptions;
  const std::string dir = train::files::make_temp_directory("tsv");
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name, std::ios::binary) << text;
    return dir + "/" + name;
  };
  auto tok = std::make_shared<const train::text::WordPieceTokenizer>(train::text::Vocab(
      {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "dog", "sat", "ran", "a", "\t"}));
  TsvDatasetOptions o;
  o.tokenizer = tok;
  o.max_length = 6;
  o.path = write("train.tsv", "the cat sat\tpets\r\n\nthe dog ran\tother\na cat the dog ran sat the\tpets\n");
  const TsvDataset train_set(o);
  CHECK(train_set.size() == 3);
  CHECK(train_set.classes() == std::vector<std::string>{"other", "pets"});
  CHECK(train_set.labels() == std::vector<int64_t>{1, 0, 1});  // label = text after the tab
  CHECK(train_set.get(0, 0).input.equal(torch::tensor({2, 5, 6, 8, 3, 0}, torch::kLong)));
  CHECK(train_set.get(2, 0).input.equal(torch::tensor({2, 10, 6, 5, 7, 3}, torch::kLong)));  // truncated
  CHECK(train_set.truncated_fraction() == Approx(1.0 / 3.0));
  std::vector<train::data::Example> two{train_set.get(0, 0), train_set.get(1, 0)};
  const auto batch = train_set.collate(std::move(two));
  CHECK(batch.input.sizes() == std::vector<int64_t>{2, 5});  // trimmed to the longest row
  CHECK(batch.target.equal(torch::tensor({1, 0}, torch::kLong)));
  // A literal [PAD] inside a text is the pad id too; the trim must keep what follows it.
  TsvDatasetOptions literal = o;
  literal.path = write("literal.tsv", "the [PAD] [PAD] cat\tpets\nthe\tother\n");
  const TsvDataset with_pad(literal);
  std::vector<train::data::Example> both{with_pad.get(0, 0), with_pad.get(1, 0)};
  CHECK(with_pad.collate(std::move(both)).input[0].equal(torch::tensor({2, 5, 0, 0, 6, 3}, torch::kLong)));

  TsvDatasetOptions val = o;
  val.classes = train_set.classes();
  val.path = write("val.tsv", "the cat\tpets\nthe dog\tbirds\n");
  CHECK_THROWS_WITH(TsvDataset(val), Catch::Contains("val.tsv:2: label 'birds' is not one of the training classes"));
  val.path = write("notab.tsv", "the cat\tpets\nno tab here\n");
  CHECK_THROWS_WITH(TsvDataset(val), Catch::Contains("notab.tsv:2: no tab"));
  val.path = write("twotabs.tsv", "the cat\tpets\nthe\tdog\tpets\n");
  CHECK_THROWS_WITH(TsvDataset(val), Catch::Contains("twotabs.tsv:2: more than one tab"));
  val.path = write("spaced.tsv", "the cat\tpets \n");
  CHECK_THROWS_WITH(TsvDataset(val), Catch::Contains("spaced.tsv:1: label 'pets ' has white space around it"));
  val.path = write("nolabel.tsv", "the cat\t\n");
  CHECK_THROWS_WITH(TsvDataset(val), Catch::Contains("nolabel.tsv:1: empty label"));
  val.path = dir + "/missing.tsv";
  CHECK_THROWS_AS(TsvDataset(val), train::DataError);

  // Through the config: data.kind tsv.
  write("vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\ndog\n");
  write("val.tsv", "the dog\tother\n");
  const train::Config c = train::parse_config("model: {name: bert-classifier}\n"
                                              "data: {kind: tsv, root: " + dir + ", vocab_file: vocab.txt, seq_len: 8}\n"
                                              "trainer: {global_batch: 2, max_steps: 1}\n", "tsv.yaml");
  const auto v = train::data::make_dataset(c.data, train::data::Split::Val);
  CHECK(v->size() == 1);
  CHECK(v->num_classes() == 2);
  CHECK(v->get(0, 0).target.item<int64_t>() == 0);
  CHECK_THROWS_WITH(train::parse_config("model: {name: bert-classifier}\ndata: {kind: tsv, root: /x}\n"
                                        "trainer: {global_batch: 2, max_steps: 1}\n", "tsv.yaml"),
                    Catch::Contains("data.vocab_file"));
  train::files::remove_all(dir);
}

TEST_CASE("TSV data pads each batch to its own longest text, so the plan leaves cudnn.benchmark off", "[bert][tsv]") {
  const std::string dir = train::files::make_temp_directory("tsv_shapes");
  std::ofstream(dir + "/train.tsv") << "the cat sat\tpets\nthe dog\tother\nthe cat\tpets\nthe dog sat\tother\n";
  std::ofstream(dir + "/val.tsv") << "the dog\tother\n";
  std::ofstream(dir + "/vocab.txt") << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\ndog\nsat\n";
  const train::Config c = train::parse_config(
      "model: {name: bert-classifier, preset: bert-tiny, vocab_size: 16, max_positions: 16, num_classes: 2}\n"
      "data: {kind: tsv, root: " + dir + ", vocab_file: vocab.txt, seq_len: 16}\n"
      "trainer: {global_batch: 2, max_steps: 1}\n"
      "tuning: {device: a100-80gb, probe: false, cache_dir: " + dir + "/cache}\n", "tsv_shapes.yaml");
  const auto train_set = train::data::make_dataset(c.data, train::data::Split::Train);
  CHECK_FALSE(train_set->static_shapes());
  CHECK(train::data::make_dataset(train::parse_config("model: {name: resnet18}\ndata: {kind: synthetic}\n"
                                                      "trainer: {global_batch: 2, max_steps: 1}\n", "s.yaml").data,
                                  train::data::Split::Train)->static_shapes());
  train::RunOptions options;
  options.data_optional = true;  // as train plan does
  const train::RunParts run = train::prepare_run(c, options);
  CHECK_FALSE(run.plan.cudnn_benchmark);
  bool found = false;
  for (const auto& d : run.plan.decisions) {
    if (d.name != "cudnn_benchmark") continue;
    found = true;
    CHECK_THAT(d.reason, Catch::StartsWith("input shapes vary from batch to batch (tsv: " + dir + "/train.tsv"));
  }
  CHECK(found);
  // Planned where the data is not: the kind says as much.
  train::Config elsewhere = c;
  elsewhere.data.root = dir + "/not-here";
  const train::RunParts planned = train::prepare_run(elsewhere, options);
  CHECK(planned.train == nullptr);
  CHECK_FALSE(planned.plan.cudnn_benchmark);
  for (const auto& d : planned.plan.decisions) {
    if (d.name == "cudnn_benchmark") CHECK_THAT(d.reason, Catch::Contains("data.kind tsv"));
  }
  train::files::remove_all(dir);
}

// train plan on a machine without the data: a token config describes its input (data.seq_len); an
// image config without data.image_size does not, and the error says which key would.
TEST_CASE("plan without the data: token configs plan for data.seq_len and image configs need data.image_size",
          "[bert][plan]") {
  const std::string dir = train::files::make_temp_directory("plan_no_data");
  train::RunOptions options;
  options.data_optional = true;  // as train plan does
  for (const std::string kind : {"tokens", "tsv"}) {
    INFO(kind);
    const train::Config c = train::parse_config(
        "model: {name: " + std::string(kind == "tokens" ? "bert-mlm" : "bert-classifier") +
            ", preset: bert-tiny, vocab_size: 64, max_positions: 32}\n"
            "data: {kind: " + kind + ", root: " + dir + "/not-here, vocab_file: vocab.txt, seq_len: 32}\n"
            "trainer: {global_batch: 4, max_steps: 1, device: cpu}\n"
            "tuning: {cache_dir: " + dir + "/cache, max_micro_batch: 4}\n",
        "no_data.yaml");
    const train::RunParts run = train::prepare_run(c, options);
    CHECK(run.train == nullptr);
    CHECK(run.plan.global_batch == 4);
    CHECK(run.plan.micro_batch >= 1);
    CHECK_THAT(run.plan.memory.source, Catch::Contains("probe on cpu"));  // the model ran on [b, 32] token ids
    CHECK_THROWS_AS(train::prepare_run(c), train::DataError);  // a run (not a plan) needs its data
  }
  const train::Config images = train::parse_config(
      "model: {name: resnet18}\ndata: {kind: image_folder, root: " + dir + "/not-here}\n"
      "trainer: {global_batch: 4, max_steps: 1, device: cpu}\n", "no_images.yaml");
  CHECK_THROWS_WITH(train::prepare_run(images, options),
                    Catch::Contains(dir + "/not-here") &&
                        Catch::Contains("to plan without the data, set data.image_size"));
  train::files::remove_all(dir);
}

TEST_CASE("BERT random_input gives valid non-pad ids for the probe", "[bert]") {
  BertModel model(tiny(BertHead::kMaskedLM));
  const auto ids = model.random_input({64, 32}, torch::TensorOptions());
  CHECK(ids.scalar_type() == torch::kLong);
  CHECK(ids.min().item<int64_t>() >= 1);
  CHECK(ids.max().item<int64_t>() <= 99);
  CHECK(model.forward(ids).sizes() == std::vector<int64_t>{64, 32, 100});
}

TEST_CASE("train predict classifies texts as the run's TSV data encodes them, padding masked by the data's id",
          "[bert][tsv][cli][process]") {
  const std::string dir = train::files::make_temp_directory("tsv_predict");
  // [PAD] is id 3 here, not 0: a model built without the data's pad id would attend to padding.
  std::ofstream(dir + "/vocab.txt") << "[UNK]\n[CLS]\n[SEP]\n[PAD]\n[MASK]\nthe\ncat\ndog\nsat\non\nmat\n";
  const std::string texts = "the cat sat on the mat\tpets\nthe dog\tother\nthe cat\tpets\nthe dog sat\tother\n";
  std::ofstream(dir + "/train.tsv") << texts;
  std::ofstream(dir + "/val.tsv") << texts;
  const train::Config config = train::parse_config(
      "model: {name: bert-classifier, preset: bert-tiny, vocab_size: 16, max_positions: 16, num_classes: 2}\n"
      "data: {kind: tsv, root: " + dir + ", vocab_file: vocab.txt, seq_len: 16, workers: 1}\n"
      "optim: {lr: 0.01}\n"
      "trainer: {global_batch: 2, max_steps: 4, device: cpu, threads: 1}\n"
      "logging: {tensorboard: false}\n", "predict.yaml");
  const std::string run_dir = dir + "/run";
  {
    train::RunParts run = train::prepare_run(config);
    train::FitOptions fit;
    fit.run_dir = run_dir;
    REQUIRE(train::fit_in_run_dir(config, run, fit).exit_code == train::kExitOk);
  }
  // The val file itself (text<TAB>label lines give their text) and a blank line, which is skipped.
  std::ofstream(dir + "/more.txt") << "\n";
  const std::string command = "'" + std::string(TRAIN_BINARY_DIR) + "/bin/train' predict '" + run_dir + "' '" + dir +
                              "/val.tsv' '" + dir + "/more.txt' --top 2 > '" + dir + "/out' 2> '" + dir + "/err'";
  const int status = std::system(command.c_str());
  std::ifstream out_file(dir + "/out"), err_file(dir + "/err");
  const std::string out((std::istreambuf_iterator<char>(out_file)), std::istreambuf_iterator<char>());
  const std::string err((std::istreambuf_iterator<char>(err_file)), std::istreambuf_iterator<char>());
  INFO(out << err);
  REQUIRE(status != -1);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  std::vector<std::string> rows;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) rows.push_back(line);
  REQUIRE(rows.size() == 4);
  CHECK_THAT(rows[1], Catch::Contains("{\"text\":\"the dog\",\"checkpoint\":\"" + run_dir + "/checkpoints/"));

  // The model as the run builds it (pad id from the data), on the validation split: one batch of
  // the four texts, padded to the longest, as predict batches them.
  train::RunParts evaluated = train::prepare_run(config);
  train::load_model_weights(train::latest_checkpoint(run_dir + "/checkpoints"), *evaluated.model);
  evaluated.model->eval();
  std::vector<train::data::Example> examples;
  for (int64_t i = 0; i < 4; ++i) examples.push_back(evaluated.val->get(i, 0));
  torch::NoGradGuard no_grad;
  const torch::Tensor p = torch::softmax(
      evaluated.model->forward(evaluated.val->collate(std::move(examples)).input).to(torch::kDouble), 1);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t top = p[static_cast<int64_t>(i)].argmax().item<int64_t>();
    INFO("text " << i);
    CHECK_THAT(rows[i], Catch::Contains("\"top\":[{\"label\":" + std::to_string(top) + ",\"class\":\"" +
                                        (top == 0 ? "other" : "pets") + "\",\"probability\":"));
    const size_t at = rows[i].find("\"probability\":") + 14;
    CHECK(std::abs(std::stod(rows[i].substr(at)) - p[static_cast<int64_t>(i)][top].item<double>()) < 1e-12);
  }
  // In a program: the run's tokenizer and length, given texts; an empty one is a mistake.
  train::text::TsvDatasetOptions options = train::text::tsv_dataset_options(config.data);
  CHECK(options.tokenizer->pad_id() == 3);
  options.texts = {"the cat", "dog dog dog"};
  const train::text::TsvDataset given(options);
  CHECK(given.size() == 2);
  CHECK(given.get(1, 0).target.item<int64_t>() == -100);
  CHECK(torch::equal(given.get(0, 0).input, evaluated.val->get(2, 0).input));
  CHECK_THAT(given.describe(), Catch::Contains("tsv: texts given, 2 texts"));
  // Dataset::fingerprint: of the encoded texts; another text of the same count changes it.
  options.texts = {"the cat", "dog dog dog"};
  CHECK(train::text::TsvDataset(options).fingerprint() == given.fingerprint());
  options.texts = {"the cat", "dog dog"};
  CHECK(train::text::TsvDataset(options).fingerprint() != given.fingerprint());
  options.texts = {"the cat", " \t"};
  CHECK_THROWS_AS(train::text::TsvDataset(options), std::invalid_argument);
  train::files::remove_all(dir);
}
