#pragma once
// BERT (Devlin et al. 2019) with the original architecture: word + position + token-type
// embeddings followed by LayerNorm (eps 1e-12), post-LN encoder layers with exact (erf) GELU, a
// tanh pooler over [CLS], a masked-LM head whose decoder is tied to the word embeddings, and a
// sequence-classification head.
//
// Parameter names are Hugging Face's BertModel names (`embeddings.word_embeddings.weight`,
// `encoder.layer.0.attention.self.query.weight`, `pooler.dense.weight`, ...); the heads add
// BertForMaskedLM's `cls.predictions.{bias, transform.dense, transform.LayerNorm}` and
// BertForSequenceClassification's `classifier`. Hugging Face's head models put the encoder under
// a `bert.` prefix, which its from_pretrained adds or strips as needed; here the encoder names
// carry no prefix, so one BertModel file (such as MiniLM's model.safetensors) loads by name into
// the encoder of every head, and an MLM checkpoint initialises a classifier by name. The tied
// decoder weight is the word-embedding matrix itself, so it is not a separate entry.
//
// Padding: id `pad_id` (0, [PAD] in BERT vocabularies) marks padding. The model derives the
// attention mask from `input != pad_id` itself, so the trainer's single input tensor suffices;
// padded keys get no attention weight. Token types are all 0 through forward(input); encode()
// takes them explicitly.
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <string>
#include <vector>

#include "train/config.h"
#include "train/models/model.h"

namespace train::models {

enum class BertHead {
  kNone,        // BertModel: forward returns the last hidden states [B, T, H]
  kMaskedLM,    // BertForMaskedLM: logits [B, T, vocab]
  kClassifier,  // BertForSequenceClassification: logits [B, num_labels]
};

enum class BertAttention {
  kAuto,   // fused where LibTorch has it (2.0+), else plain
  kFused,  // at::scaled_dot_product_attention (LibTorch 2.0+)
  kPlain,  // softmax(QK^T / sqrt(d) + mask) V written out
};

struct BertOptions {
  int64_t vocab_size = 30522;
  int64_t hidden_size = 768;
  int64_t num_layers = 12;
  int64_t num_heads = 12;
  int64_t intermediate_size = 3072;
  int64_t max_positions = 512;
  int64_t type_vocab_size = 2;
  double dropout = 0.1;            // hidden dropout
  double attention_dropout = 0.1;  // on the attention probabilities
  double layer_norm_eps = 1e-12;
  double init_std = 0.02;          // normal init of weights and embeddings, as BERT's
  int64_t pad_id = 0;
  BertHead head = BertHead::kNone;
  bool pooler = true;              // BertModel / classifier: true; the MLM head has none
  int64_t num_labels = 2;          // classifier outputs
  BertAttention attention = BertAttention::kAuto;
  // Activation recomputation: in training, each encoder layer keeps only its input for backward and
  // runs again there (with the same dropout masks) to get its gradients: a second forward of each
  // layer for a fraction of the activation memory (a larger micro-batch, fewer accumulation steps).
  bool recompute = false;

  // Sizes of a named preset: bert-base (L12 H768 A12), bert-small (L4 H512 A8), bert-mini
  // (L4 H256 A4), bert-tiny (L2 H128 A2) (Turc et al. 2019's compact BERTs), minilm-l6
  // (L6 H384 A12, all-MiniLM-L6-v2). Intermediate size 4H, 512 positions, vocab 30522. Throws
  // std::invalid_argument for another name.
  static BertOptions preset(const std::string& name);
  static std::vector<std::string> preset_names();
};

class BertModel : public Model {
 public:
  // Throws std::invalid_argument when hidden_size is not a multiple of num_heads or a size is < 1.
  explicit BertModel(const BertOptions& options);

  // input: int64 ids [B, T] (T <= max_positions). Returns what the head gives (see BertHead).
  torch::Tensor forward(const torch::Tensor& input) override;
  // MLM head: the encoder over every position, the head (transform and the tied vocabulary
  // projection) only at `positions`; other heads select from forward().
  torch::Tensor forward_selected(const torch::Tensor& input, const torch::Tensor& positions) override;
  // Ids uniform over the vocab except the pad id (the probe's inputs).
  torch::Tensor random_input(const std::vector<int64_t>& shape, const torch::TensorOptions& options) const override;
  // Token ids [T] with T <= max_positions, from a vocabulary no larger than vocab_size.
  std::string input_problem(const std::vector<int64_t>& sample_shape, int64_t vocab_size) const override;
  // Hugging Face's BERT files and train's: the head is "cls." (MLM) or "pooler." and
  // "classifier." (classifier, BertModel), the other variants' heads are unused, and the MLM
  // decoder's tied copies and the position_ids buffer are redundant.
  WeightRules weight_rules() const override;
  // "model.heads=N": the head count splits the same projections differently.
  std::string architecture() const override;

  // Last hidden states [B, T, H]. `token_type_ids` may be undefined (all 0); `attention_mask`
  // ([B, T], nonzero = attend) may be undefined (derived from input != pad_id).
  torch::Tensor encode(const torch::Tensor& input_ids, const torch::Tensor& token_type_ids = {},
                       const torch::Tensor& attention_mask = {});
  // tanh(dense(h[:, 0])): the pooled [CLS] representation [B, H]. Needs the pooler.
  torch::Tensor pool(const torch::Tensor& hidden);
  // MLM logits [B, T, vocab] from hidden states. Needs the MLM head.
  torch::Tensor mlm_logits(const torch::Tensor& hidden);

  const BertOptions& options() const { return options_; }
  // The attention implementation that runs (kAuto resolved for this LibTorch).
  BertAttention attention() const;
  void set_attention(BertAttention attention);
  bool recompute() const { return options_.recompute; }

 private:
  BertOptions options_;
  std::shared_ptr<torch::nn::Module> embeddings_, encoder_, pooler_, cls_;
  torch::nn::Embedding word_{nullptr}, position_{nullptr}, token_type_{nullptr};
  torch::nn::LayerNorm embedding_norm_{nullptr};
  torch::nn::Dropout embedding_dropout_{nullptr};
  torch::nn::ModuleList layers_{nullptr};
  torch::nn::Linear pooler_dense_{nullptr};
  torch::nn::Linear transform_dense_{nullptr};
  torch::nn::LayerNorm transform_norm_{nullptr};
  torch::Tensor mlm_bias_;
  torch::nn::Dropout classifier_dropout_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};

// The registry's builders: `bert` (BertModel), `bert-mlm`, `bert-classifier`, sized by
// model.preset and the model.* size keys (0 = the preset's value).
ModelPtr make_bert(BertHead head, const ModelConfig& config);

// True when this LibTorch has at::scaled_dot_product_attention.
bool bert_fused_attention_available();

}  // namespace train::models
