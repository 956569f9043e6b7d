#include "train/models/bert.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "bert_presets.h"
#include "compat.h"
#include "train/amp.h"
#include "rng_state.h"
#include "train/safetensors.h"

namespace train::models {
namespace {

torch::nn::Linear make_linear(int64_t in, int64_t out, double std) {
  torch::nn::Linear linear(torch::nn::LinearOptions(in, out));
  torch::NoGradGuard no_grad;
  linear->weight.normal_(0.0, std);
  linear->bias.zero_();
  return linear;
}

torch::nn::LayerNorm make_norm(int64_t size, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({size}).eps(eps));
}

// Additive attention mask [B, 1, 1, T] in `dtype`: 0 where attended, the dtype's lowest finite
// value where padded. Finite (not -inf), so a row of only padding gets uniform weights instead of
// NaN, as in Hugging Face's BertModel; per dtype, because float's lowest overflows fp16 to -inf.
torch::Tensor additive_mask(const torch::Tensor& keep, c10::ScalarType dtype) {
  const double lowest = dtype == torch::kHalf       ? -65504.0
                        : dtype == torch::kBFloat16 ? -3.3895313892515355e38
                        : dtype == torch::kDouble   ? std::numeric_limits<double>::lowest()
                                                    : std::numeric_limits<float>::lowest();
  return torch::zeros(keep.sizes(), keep.options().dtype(dtype)).masked_fill(keep.logical_not(), lowest);
}

// A plain container, so that names nest as in Hugging Face's modules (`attention.self.query`).
struct Container : torch::nn::Module {};

// One post-LN encoder layer: x = LN(x + Attn(x)); x = LN(x + FFN(x)).
class BertLayer : public torch::nn::Module {
 public:
  BertLayer(const BertOptions& o, BertAttention* attention)
      : heads_(o.num_heads), head_dim_(o.hidden_size / o.num_heads), attention_dropout_(o.attention_dropout),
        attention_(attention) {
    const int64_t h = o.hidden_size;
    auto attn = register_module("attention", std::make_shared<Container>());
    auto self = attn->register_module("self", std::make_shared<Container>());
    query_ = self->register_module("query", make_linear(h, h, o.init_std));
    key_ = self->register_module("key", make_linear(h, h, o.init_std));
    value_ = self->register_module("value", make_linear(h, h, o.init_std));
    auto attn_out = attn->register_module("output", std::make_shared<Container>());
    attn_dense_ = attn_out->register_module("dense", make_linear(h, h, o.init_std));
    attn_norm_ = attn_out->register_module("LayerNorm", make_norm(h, o.layer_norm_eps));
    auto inter = register_module("intermediate", std::make_shared<Container>());
    inter_dense_ = inter->register_module("dense", make_linear(h, o.intermediate_size, o.init_std));
    auto out = register_module("output", std::make_shared<Container>());
    out_dense_ = out->register_module("dense", make_linear(o.intermediate_size, h, o.init_std));
    out_norm_ = out->register_module("LayerNorm", make_norm(h, o.layer_norm_eps));
    dropout_ = register_module("dropout", torch::nn::Dropout(o.dropout));
  }

  // Whether forward draws random numbers (dropout), which a recomputation must draw again.
  bool draws_random() const { return is_training() && (attention_dropout_ > 0 || dropout_->options.p() > 0); }

  // x [B, T, H]; keep [B, 1, 1, T] bool, true where a key may be attended, or undefined when every
  // key may be. `mask` is the additive mask made from keep, in the attention's dtype: the first
  // layer makes it, the others reuse it.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& keep, torch::Tensor& mask) {
    const int64_t b = x.size(0), t = x.size(1);
    // Query, key and value in one projection: one GEMM three times as wide instead of three, one
    // autocast cast of x instead of three, and in the backward one GEMM for x's gradient instead of
    // three plus the two adds that summed them. The parameters stay three (Hugging Face's names
    // and shapes); concatenating them costs a copy of 3 H^2 values per step.
    const auto qkv = torch::nn::functional::linear(x, torch::cat({query_->weight, key_->weight, value_->weight}),
                                                   torch::cat({query_->bias, key_->bias, value_->bias}));
    // [B, T, 3H] -> [3, B, heads, T, head_dim]: views, each head's values contiguous (as SDPA's
    // kernels want them).
    const auto heads = qkv.view({b, t, 3, heads_, head_dim_}).permute({2, 0, 3, 1, 4});
    const auto q = heads[0], k = heads[1], v = heads[2];
    const double p = is_training() ? attention_dropout_ : 0.0;
    if (keep.defined() && !mask.defined()) mask = additive_mask(keep, q.scalar_type());
    torch::Tensor context;
    if (*attention_ == BertAttention::kFused) {
#if TRAIN_TORCH_AT_LEAST(2, 0)
      // Without a mask, SDPA may take the flash kernel, which takes none.
      context = mask.defined() ? at::scaled_dot_product_attention(q, k, v, mask, p, /*is_causal=*/false)
                               : at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, p, /*is_causal=*/false);
#else
      throw std::logic_error("BERT: fused attention needs LibTorch 2.0 or newer");
#endif
    } else {
      auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
      if (mask.defined()) scores = scores + mask;
      auto probs = torch::softmax(scores, -1);
      if (p > 0) probs = torch::dropout(probs, p, /*train=*/true);
      context = torch::matmul(probs, v);
    }
    context = context.transpose(1, 2).reshape({b, t, heads_ * head_dim_});
    auto h = attn_norm_(dropout_(attn_dense_(context)) + x);
    auto ffn = out_dense_(torch::gelu(inter_dense_(h)));
    return out_norm_(dropout_(ffn) + h);
  }

 private:
  int64_t heads_, head_dim_;
  double attention_dropout_;
  BertAttention* attention_;  // owned by the model, so one switch changes every layer
  torch::nn::Linear query_{nullptr}, key_{nullptr}, value_{nullptr}, attn_dense_{nullptr};
  torch::nn::LayerNorm attn_norm_{nullptr}, out_norm_{nullptr};
  torch::nn::Linear inter_dense_{nullptr}, out_dense_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};

// The state of the generator that dropout on `device` draws from, and setting it back.
torch::Tensor rng_state(const torch::Device& device) {
  return device.is_cpu() ? compat::cpu_rng_state() : train::detail::cuda_rng_state(device);
}

void set_rng_state(const torch::Device& device, const torch::Tensor& state) {
  if (device.is_cpu()) {
    compat::set_cpu_rng_state(state);
  } else {
    train::detail::set_cuda_rng_state(device, state);
  }
}

// While alive, the generator of `device` is where it was at `state`; afterwards it is back where
// it was before (as torch.random.fork_rng): the recomputation draws the forward's dropout masks
// again, and what is drawn after the backward is unchanged by it.
class RngFork {
 public:
  RngFork(const torch::Device& device, const torch::Tensor& state) : device_(device) {
    if (!state.defined()) return;
    now_ = rng_state(device_);
    set_rng_state(device_, state);
  }
  ~RngFork() {
    if (now_.defined()) set_rng_state(device_, now_);
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  torch::Device device_;
  torch::Tensor now_;
};

// An encoder layer whose activations are not kept for backward (BertOptions::recompute). Its
// forward runs without autograd and keeps the layer's input, the generator's state and the
// autocast setting; its backward runs the layer again with them, under autograd, and
// differentiates that: the same values, masks and casts, so the gradients are those of the plain
// layer. The parameters' gradients accumulate in that inner backward (their hooks fire there, as
// data-parallel training's overlapped all-reduce needs); the layer's input gets its gradient from
// the return value. The cost is the layer's forward once more per step.
struct RecomputedLayer : torch::autograd::Function<RecomputedLayer> {
  // `keep` by pointer: it needs no gradient, and may be undefined, which a Function's tensor
  // arguments may not.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor* keep_ptr, BertLayer* layer) {
    const torch::Tensor& keep = *keep_ptr;
    ctx->save_for_backward({x});
    if (keep.defined()) ctx->saved_data["keep"] = keep;
    ctx->saved_data["layer"] = reinterpret_cast<int64_t>(layer);
    if (layer->draws_random()) {
      const torch::Tensor state = rng_state(x.device());
      if (state.defined()) ctx->saved_data["rng"] = state;
    }
    const auto type = x.device().type();
    ctx->saved_data["autocast"] = compat::autocast_enabled(type);
    ctx->saved_data["autocast_dtype"] = static_cast<int64_t>(compat::autocast_dtype(type));
    torch::Tensor mask;
    return layer->forward(x, keep, mask);  // autograd is off in a Function's forward
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    const auto keep_it = ctx->saved_data.find("keep");
    const torch::Tensor keep = keep_it != ctx->saved_data.end() ? keep_it->second.toTensor() : torch::Tensor();
    auto* layer = reinterpret_cast<BertLayer*>(ctx->saved_data["layer"].toInt());
    const auto rng_it = ctx->saved_data.find("rng");
    torch::Tensor out;
    {
      RngFork fork(x.device(), rng_it != ctx->saved_data.end() ? rng_it->second.toTensor() : torch::Tensor());
      AutocastScope autocast(x.device().type(), static_cast<c10::ScalarType>(ctx->saved_data["autocast_dtype"].toInt()),
                             ctx->saved_data["autocast"].toBool());
      torch::AutoGradMode grad_mode(true);
      torch::Tensor mask;
      out = layer->forward(x, keep, mask);
    }
    torch::autograd::backward({out}, {grads[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor()};
  }
};

void validate(const BertOptions& o) {
  auto positive = [](int64_t v, const char* what) {
    if (v < 1) throw std::invalid_argument(std::string("BERT: ") + what + " must be >= 1, got " + std::to_string(v));
  };
  positive(o.vocab_size, "vocab_size");
  positive(o.hidden_size, "hidden_size");
  positive(o.num_layers, "num_layers");
  positive(o.num_heads, "num_heads");
  positive(o.intermediate_size, "intermediate_size");
  positive(o.max_positions, "max_positions");
  positive(o.type_vocab_size, "type_vocab_size");
  if (o.hidden_size % o.num_heads != 0) {
    throw std::invalid_argument("BERT: hidden_size " + std::to_string(o.hidden_size) +
                                " is not a multiple of num_heads " + std::to_string(o.num_heads));
  }
  if (o.pad_id < 0 || o.pad_id >= o.vocab_size) {
    throw std::invalid_argument("BERT: pad_id " + std::to_string(o.pad_id) + " is outside the vocab");
  }
  if (o.head == BertHead::kClassifier) positive(o.num_labels, "num_labels");
  if (!(o.dropout >= 0 && o.dropout < 1) || !(o.attention_dropout >= 0 && o.attention_dropout < 1)) {
    throw std::invalid_argument("BERT: dropout must be in [0, 1)");
  }
  if (o.attention == BertAttention::kFused && !bert_fused_attention_available()) {
    throw std::invalid_argument("BERT: fused attention (scaled_dot_product_attention) needs LibTorch 2.0+; this is " +
                                compat::torch_version());
  }
}

}  // namespace

bool bert_fused_attention_available() { return TRAIN_TORCH_AT_LEAST(2, 0); }

BertOptions BertOptions::preset(const std::string& name) {
  const detail::BertPresetSizes* sizes = detail::find_bert_preset(name);
  if (!sizes) throw std::invalid_argument("BERT: unknown preset '" + name + "'");
  BertOptions o;
  o.num_layers = sizes->layers;
  o.hidden_size = sizes->hidden;
  o.num_heads = sizes->heads;
  o.intermediate_size = 4 * sizes->hidden;
  o.vocab_size = detail::kBertPresetVocab;
  o.max_positions = detail::kBertPresetPositions;
  return o;
}

std::vector<std::string> BertOptions::preset_names() {
  std::vector<std::string> names;
  for (const detail::BertPresetSizes& p : detail::kBertPresets) names.emplace_back(p.name);
  return names;
}

BertModel::BertModel(const BertOptions& options) : options_(options) {
  validate(options_);
  const auto& o = options_;
  const int64_t h = o.hidden_size;
  embeddings_ = register_module("embeddings", std::make_shared<Container>());
  word_ = embeddings_->register_module(
      "word_embeddings", torch::nn::Embedding(torch::nn::EmbeddingOptions(o.vocab_size, h).padding_idx(o.pad_id)));
  position_ = embeddings_->register_module("position_embeddings", torch::nn::Embedding(o.max_positions, h));
  token_type_ = embeddings_->register_module("token_type_embeddings", torch::nn::Embedding(o.type_vocab_size, h));
  embedding_norm_ = embeddings_->register_module("LayerNorm", make_norm(h, o.layer_norm_eps));
  embedding_dropout_ = embeddings_->register_module("dropout", torch::nn::Dropout(o.dropout));
  {
    torch::NoGradGuard no_grad;
    for (auto* e : {&word_, &position_, &token_type_}) (*e)->weight.normal_(0.0, o.init_std);
    word_->weight[o.pad_id].zero_();
  }
  encoder_ = register_module("encoder", std::make_shared<Container>());
  layers_ = encoder_->register_module("layer", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers; ++i) layers_->push_back(std::make_shared<BertLayer>(o, &options_.attention));
  if (o.pooler && o.head != BertHead::kMaskedLM) {
    pooler_ = register_module("pooler", std::make_shared<Container>());
    pooler_dense_ = pooler_->register_module("dense", make_linear(h, h, o.init_std));
  }
  if (o.head == BertHead::kMaskedLM) {
    cls_ = register_module("cls", std::make_shared<Container>());
    auto predictions = cls_->register_module("predictions", std::make_shared<Container>());
    mlm_bias_ = predictions->register_parameter("bias", torch::zeros({o.vocab_size}));
    auto transform = predictions->register_module("transform", std::make_shared<Container>());
    transform_dense_ = transform->register_module("dense", make_linear(h, h, o.init_std));
    transform_norm_ = transform->register_module("LayerNorm", make_norm(h, o.layer_norm_eps));
  }
  if (o.head == BertHead::kClassifier) {
    if (!pooler_) throw std::invalid_argument("BERT: the classifier head needs the pooler");
    classifier_dropout_ = register_module("dropout", torch::nn::Dropout(o.dropout));
    classifier_ = register_module("classifier", make_linear(h, o.num_labels, o.init_std));
  }
  set_attention(o.attention);
}

BertAttention BertModel::attention() const { return options_.attention; }

void BertModel::set_attention(BertAttention attention) {
  if (attention == BertAttention::kAuto) {
    attention = bert_fused_attention_available() ? BertAttention::kFused : BertAttention::kPlain;
  }
  if (attention == BertAttention::kFused && !bert_fused_attention_available()) {
    throw std::invalid_argument("BERT: fused attention needs LibTorch 2.0+; this is " + compat::torch_version());
  }
  options_.attention = attention;  // the layers read it through a pointer
}

torch::Tensor BertModel::encode(const torch::Tensor& input_ids, const torch::Tensor& token_type_ids,
                                const torch::Tensor& attention_mask) {
  TORCH_CHECK(input_ids.dim() == 2, "BERT: input ids must be [batch, tokens], got ", input_ids.sizes());
  TORCH_CHECK(!input_ids.is_floating_point(), "BERT: input ids must be integers, got ", input_ids.scalar_type());
  const int64_t t = input_ids.size(1);
  TORCH_CHECK(t <= options_.max_positions, "BERT: ", t, " tokens exceed max_positions ", options_.max_positions);
  const auto ids = input_ids.to(torch::kLong);
  const auto positions = torch::arange(t, ids.options()).unsqueeze(0);
  auto x = word_(ids) + position_(positions);
  x = x + (token_type_ids.defined() ? token_type_(token_type_ids.to(torch::kLong))
                                    : token_type_->weight[0].view({1, 1, -1}));
  x = embedding_dropout_(embedding_norm_(x));

  torch::Tensor keep =
      (attention_mask.defined() ? attention_mask.ne(0) : ids.ne(options_.pad_id)).view({ids.size(0), 1, 1, t});
  // A batch without padding (packed MLM sequences always) needs no mask: dropped, as Hugging Face's
  // SDPA attention drops an all-ones mask, so that the flash kernel may run. One host read.
  if (keep.all().item<bool>()) keep = torch::Tensor();
  torch::Tensor mask;
  // Recomputation only where there is a backward to save memory for. With the embeddings frozen
  // their output needs no gradient, and a Function whose inputs need none gets no backward: the
  // layers' input becomes a leaf that needs one (its gradient is computed and dropped).
  const bool recompute = options_.recompute && is_training() && torch::GradMode::is_enabled();
  if (recompute && !x.requires_grad()) x = x.detach().requires_grad_(true);
  for (const auto& layer : *layers_) {
    auto* l = layer->as<BertLayer>();
    x = recompute ? RecomputedLayer::apply(x, &keep, l) : l->forward(x, keep, mask);
  }
  return x;
}

torch::Tensor BertModel::pool(const torch::Tensor& hidden) {
  TORCH_CHECK(pooler_dense_, "BERT: this model has no pooler");
  return torch::tanh(pooler_dense_(hidden.select(1, 0)));
}

torch::Tensor BertModel::mlm_logits(const torch::Tensor& hidden) {
  TORCH_CHECK(transform_dense_, "BERT: this model has no MLM head");
  auto h = torch::gelu(transform_dense_(hidden));
  // Under autocast the dense layer's output is 16-bit. LibTorch 2.x's autocast runs layer_norm in
  // fp32; 1.13's CPU autocast leaves the bf16 input next to fp32 weights, which layer_norm rejects.
  if (h.scalar_type() != transform_norm_->weight.scalar_type()) h = h.to(transform_norm_->weight.scalar_type());
  h = transform_norm_(h);
  return torch::nn::functional::linear(h, word_->weight, mlm_bias_);
}

torch::Tensor BertModel::forward(const torch::Tensor& input) {
  auto hidden = encode(input);
  switch (options_.head) {
    case BertHead::kNone: return hidden;
    case BertHead::kMaskedLM: return mlm_logits(hidden);
    case BertHead::kClassifier: return classifier_(classifier_dropout_(pool(hidden)));
  }
  return hidden;
}

torch::Tensor BertModel::forward_selected(const torch::Tensor& input, const torch::Tensor& positions) {
  if (options_.head != BertHead::kMaskedLM) return Model::forward_selected(input, positions);
  const torch::Tensor hidden = encode(input);
  const torch::Tensor rows = positions.reshape({-1}).nonzero().squeeze(1);  // one host sync: N
  return mlm_logits(hidden.reshape({-1, hidden.size(-1)}).index_select(0, rows));
}

torch::Tensor BertModel::random_input(const std::vector<int64_t>& shape, const torch::TensorOptions& options) const {
  // Ids in [1, vocab), those up to pad_id moved down by one: every id but pad_id is equally likely.
  auto ids = torch::randint(1, options_.vocab_size, shape, options.dtype(torch::kLong));
  return ids - ids.le(options_.pad_id).to(torch::kLong);
}

std::string BertModel::input_problem(const std::vector<int64_t>& sample_shape, int64_t vocab_size) const {
  std::string shape;
  for (size_t i = 0; i < sample_shape.size(); ++i) shape += (i ? "x" : "") + std::to_string(sample_shape[i]);
  if (sample_shape.size() != 1 || vocab_size <= 0) {
    return "key 'model.name': BERT takes token ids (data.kind tokens or tsv), but the data gives samples of shape " +
           shape + (vocab_size <= 0 ? " without a vocabulary" : "");
  }
  if (sample_shape[0] > options_.max_positions) {
    return "key 'data.seq_len': " + std::to_string(sample_shape[0]) + " tokens per sample, more than the model's " +
           std::to_string(options_.max_positions) +
           " position embeddings (model.max_positions); lower data.seq_len or raise model.max_positions";
  }
  if (vocab_size > options_.vocab_size) {
    return "key 'model.vocab_size': the model embeds " + std::to_string(options_.vocab_size) +
           " token ids, but the data's vocabulary has " + std::to_string(vocab_size) +
           " tokens; set model.vocab_size to at least " + std::to_string(vocab_size);
  }
  return "";
}

WeightRules BertModel::weight_rules() const {
  WeightRules rules;
  const bool mlm = options_.head == BertHead::kMaskedLM;
  rules.head = mlm ? std::vector<std::string>{"cls."} : std::vector<std::string>{"pooler.", "classifier."};
  // BertForPreTraining keeps its next-sentence head beside the MLM head, under "cls.".
  rules.other_heads = mlm ? std::vector<std::string>{"pooler.", "classifier.", "cls.seq_relationship."}
                          : std::vector<std::string>{"cls."};
  rules.redundant = [](const std::string& key, const torch::Tensor& value, const TensorMap& file) {
    auto equals = [&](const char* other) {
      const auto it = file.find(other);
      return it != file.end() && it->second.sizes() == value.sizes() && torch::equal(it->second, value);
    };
    // Files that keep the decoder's tied copies (older Hugging Face and converted ones).
    if (key == "cls.predictions.decoder.weight") return equals("embeddings.word_embeddings.weight");
    if (key == "cls.predictions.decoder.bias") return equals("cls.predictions.bias");
    // transformers before 4.31 saved the position_ids buffer: 0, 1, ..., max_positions - 1.
    if (key == "embeddings.position_ids") {
      const auto flat = value.reshape({-1});
      return !flat.is_floating_point() && torch::equal(flat.to(torch::kLong), torch::arange(flat.numel()));
    }
    return false;
  };
  // Checkpoints ported from Google's TensorFlow BERT (bert-base-uncased, bert-large-*, the
  // multilingual ones) keep TensorFlow's LayerNorm names; Hugging Face renames them on load.
  rules.renames = {{"LayerNorm.gamma", "LayerNorm.weight"}, {"LayerNorm.beta", "LayerNorm.bias"}};
  return rules;
}

std::string BertModel::architecture() const { return "model.heads=" + std::to_string(options_.num_heads); }

ModelPtr make_bert(BertHead head, const ModelConfig& config) {
  BertOptions o = BertOptions::preset(config.preset);
  auto pick = [](int64_t value, int64_t& field) {
    if (value > 0) field = value;
  };
  pick(config.vocab_size, o.vocab_size);
  pick(config.hidden_size, o.hidden_size);
  pick(config.layers, o.num_layers);
  pick(config.heads, o.num_heads);
  pick(config.intermediate_size, o.intermediate_size);
  if (config.hidden_size > 0 && config.intermediate_size == 0) o.intermediate_size = 4 * o.hidden_size;
  pick(config.max_positions, o.max_positions);
  if (config.pad_id >= 0) o.pad_id = config.pad_id;
  o.dropout = config.dropout;
  o.attention_dropout = config.dropout;
  o.head = head;
  o.pooler = head != BertHead::kMaskedLM;
  o.num_labels = config.num_classes;
  o.attention = config.attention == "fused"   ? BertAttention::kFused
                : config.attention == "plain" ? BertAttention::kPlain
                                              : BertAttention::kAuto;
  o.recompute = config.recompute;
  return std::make_shared<BertModel>(o);
}

}  // namespace train::models
