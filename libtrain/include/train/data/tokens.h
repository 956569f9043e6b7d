#pragma once
// Masked-language-model samples from a token file (train/data/token_file.h), for BERT-style
// pretraining.
//
// Samples. A sample is always seq_len (T) tokens: [CLS] body [SEP], then [PAD] up to T.
//   pack = true (default): the documents are concatenated into one stream, each followed by
//     [SEP]; sample i's body is stream positions [i * (T - 2), (i + 1) * (T - 2)). Sequences run
//     across document boundaries (RoBERTa's FULL-SENTENCES packing), so only the last sample of
//     the corpus is padded. There are ceil((num_tokens + num_documents) / (T - 2)) samples.
//   pack = false: sample i is document i, cut to T - 2 tokens, then padded; one sample per
//     document.
//
// Masking (BERT's recipe), in the loader's workers, drawn only from the per-sample seed that
// Dataset::get receives, so a sample is the same for any worker count: of the positions whose
// token is not special, round(mask_prob x count) are selected (stochastic rounding, so the
// expected share is mask_prob), but at least one when there is any, so that every sample has a
// target: a sample with fewer than 1 / mask_prob such tokens (under 7 at 15 %; short documents
// with pack: false) is masked above mask_prob, where Hugging Face's collator, drawing each token
// independently, may select none; each selected token
// becomes [MASK] with p = mask_token_prob, a uniformly drawn non-special token with
// p = random_token_prob, and stays unchanged otherwise.
//
// Example: input = int64 [T] token ids after masking; target = int64 [T], the original token at
// selected positions and -100 (the loss's ignore_index) everywhere else. Batches are [B, T].
//
// Padding and the attention mask: padded positions hold the pad id (0 in BERT vocabularies) and
// always have target -100. There is no separate mask tensor: the model derives the attention
// mask as input != pad_id. That is exact when the pad id occurs only as padding, which holds for
// token files that bert_example writes (prepare, pretokenize): they tokenize raw text with
// special-token matching off, so a literal "[PAD]" in it is text ("[", "pad", "]"). A file whose
// documents hold the pad id (written by other means) has those positions masked out of attention
// too. Token type (segment) ids are not produced: every position is segment 0.
#include <train/data/dataset.h>
#include <train/data/token_file.h>
#include <train/data/transforms.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace train::data {

// The ignore_index of the loss: positions without a prediction target.
constexpr int64_t kIgnoreIndex = -100;

// A BERT-style vocab.txt: one token per line, line n (from 0) is token id n.
struct VocabInfo {
  int64_t size = 0;
  // [PAD], [UNK], [CLS], [SEP], [MASK] where present.
  SpecialTokens special;
  // Every id whose token is written in square brackets: the five above and placeholders such as
  // [unused0]. They are never masked and never drawn as random replacements.
  std::vector<int64_t> bracketed;
};

// Reads a vocab file; DataError naming it when it is missing, unreadable or empty.
VocabInfo read_vocab_file(const std::string& path);

struct MlmOptions {
  double mask_prob = 0.15;         // share of the non-special tokens selected for prediction
  double mask_token_prob = 0.8;    // of those: replaced by [MASK]
  double random_token_prob = 0.1;  // of those: replaced by a random non-special token
};

// BERT's masking of one sequence; const and thread-safe.
class MlmMasker {
 public:
  // `special_ids` (any order, may repeat or lie outside the vocabulary) are never selected and
  // never drawn. Random replacements are drawn from [0, draw_size), the vocabulary of the data
  // (0: all of [0, vocab_size)); vocab_size, the model's, may be larger (rounded up for speed).
  // std::invalid_argument when the probabilities are outside [0, 1] (mask_prob in (0, 1]) or
  // mask_token_prob + random_token_prob > 1, when mask_id is needed but not in [0, vocab_size),
  // when draw_size is above vocab_size, or when no token is left to draw random replacements from.
  MlmMasker(MlmOptions options, int64_t vocab_size, int64_t mask_id, std::vector<int64_t> special_ids,
            int64_t draw_size = 0);

  // Masks ids[0, n) in place and writes targets[0, n): the original token at selected
  // positions, kIgnoreIndex elsewhere. The result depends only on (ids, seed).
  void apply(int64_t* ids, int64_t* targets, int64_t n, uint64_t seed) const;
  // Same on a 1-d int64 tensor; returns {masked ids, targets}.
  Example apply(const torch::Tensor& ids, uint64_t seed) const;

  bool is_special(int64_t id) const;
  // Uniform over the non-special ids of [0, draw_size).
  int64_t random_token(SplitMix64& rng) const;
  const MlmOptions& options() const { return options_; }

 private:
  MlmOptions options_;
  int64_t vocab_size_;
  int64_t draw_size_;
  int64_t mask_id_;
  std::vector<int64_t> special_;  // sorted, unique, within [0, vocab_size)
  int64_t special_drawable_ = 0;  // how many of them are below draw_size
};

struct TokenDatasetOptions {
  std::string path;           // the token file
  int64_t seq_len = 128;      // T, including [CLS] and [SEP]; at least 3
  bool pack = true;           // see above
  // The number of logits: 0 = the file's vocab_size; otherwise at least the file's and the vocab
  // file's (a model may have a larger vocab, e.g. rounded up to a multiple of 8).
  int64_t vocab_size = 0;
  // The vocab file the ids come from, if any ("" = none), and its size. The data's vocabulary,
  // which random replacements are drawn from, is the vocab file's size, else the token file's
  // vocab_size; never vocab_size above it.
  std::string vocab_file;
  int64_t vocab_file_size = 0;
  // Explicit ids win; -1 entries are taken from the token file's header. cls, sep and pad are
  // required, mask too when mask_token_prob > 0. pad/unk/cls/sep/mask are never masked.
  SpecialTokens special;
  std::vector<int64_t> extra_special;  // more never-masked ids, e.g. VocabInfo::bracketed
  MlmOptions mlm;
  // The config keys that gave explicit values, by field: "vocab_size", "pad", "unk", "cls",
  // "sep", "mask" -> "data.vocab_size", "data.pad_id", ... A value the token file contradicts
  // (a vocab_size below the file's or the vocab file's, an id outside the vocabulary) is then a
  // ConfigError naming that key; a value without a key here is reported as a DataError naming the
  // file. A special id of the files outside a vocab_size set by a key is that key's error.
  std::map<std::string, std::string> keys;
};

class TokenDataset : public Dataset {
 public:
  // Maps the file (TokenFile) and resolves the vocabulary. DataError naming the file when it is
  // invalid, holds no tokens, or lacks a special id that the options do not supply.
  explicit TokenDataset(TokenDatasetOptions options);

  int64_t size() const override { return samples_; }
  Example get(int64_t index, uint64_t seed) const override;
  std::vector<int64_t> input_shape() const override { return {options_.seq_len}; }
  // The vocabulary size: the number of logits per position.
  int64_t num_classes() const override { return vocab_size_; }
  // The data's vocabulary: the vocab file's size, else the token file's (at most vocab_size()).
  int64_t data_vocab_size() const { return data_vocab_size_; }
  std::string describe() const override;
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t pad_id() const override { return special_.pad; }
  // The token file's checksum (TokenFile::verify).
  void verify() const override;
  // The header's checksum of the token file, with the sample length.
  uint64_t fingerprint() const override;

  // Sample `index` before masking: [CLS] body [SEP] [PAD]..., int64 [T].
  torch::Tensor tokens(int64_t index) const;
  const TokenFile& file() const { return *file_; }
  const SpecialTokens& special() const { return special_; }
  const MlmMasker& masker() const { return *masker_; }

 private:
  TokenDatasetOptions options_;
  std::shared_ptr<const TokenFile> file_;
  SpecialTokens special_;
  int64_t vocab_size_ = 0;
  int64_t data_vocab_size_ = 0;
  int64_t samples_ = 0;
  std::unique_ptr<MlmMasker> masker_;
};

}  // namespace train::data
