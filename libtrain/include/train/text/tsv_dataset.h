#pragma once
// Sentence classification from a TSV file: one example per line, `text<TAB>label` (the label is
// the text after the last tab). Texts are WordPiece-encoded once, when the file is read, as
// [CLS] text [SEP] truncated to max_length. A sample is its ids padded with [PAD] to max_length;
// collate() trims a batch to its longest sequence (dynamic padding), so the model sees
// [B, longest] and derives the attention mask from the padding id.
#include <train/data/dataset.h>
#include <train/text/wordpiece.h>

#include <memory>
#include <string>
#include <vector>

namespace train {
struct DataConfig;
}

namespace train::text {

struct TsvDatasetOptions {
  std::string path;
  std::shared_ptr<const WordPieceTokenizer> tokenizer;
  int64_t max_length = 128;          // tokens per sample, [CLS] and [SEP] included
  // Label names in class-index order. Empty: the sorted distinct labels of this file. Give the
  // training file's classes when reading a validation file; an unknown label is then an error.
  std::vector<std::string> classes;
  // Instead of reading `path`: these texts, in this order, as unlabelled samples (target -100,
  // "no target"), encoded as the file's would be: the inputs a trained classifier predicts on.
  std::vector<std::string> texts;
};

class TsvDataset : public data::Dataset {
 public:
  // Throws DataError naming the file (and line) when it cannot be read, a line has no tab or more
  // than one, an empty text or label, a label with white space around it, or a label outside
  // `classes`; std::invalid_argument for bad options (with `texts`: an empty one).
  explicit TsvDataset(TsvDatasetOptions options);

  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  data::Example get(int64_t index, uint64_t seed) const override;
  data::Batch collate(std::vector<data::Example>&& examples) const override;
  std::vector<int64_t> input_shape() const override { return {options_.max_length}; }
  int64_t num_classes() const override { return static_cast<int64_t>(options_.classes.size()); }
  std::string describe() const override;
  int64_t vocab_size() const override { return options_.tokenizer->vocab().size(); }
  int64_t pad_id() const override { return options_.tokenizer->pad_id(); }
  bool static_shapes() const override { return false; }  // dynamic padding: [B, longest] varies

  const std::vector<std::string>& classes() const { return options_.classes; }
  std::vector<std::string> class_names() const override { return options_.classes; }
  const std::vector<int64_t>& labels() const { return labels_; }
  // Share of samples cut by max_length.
  double truncated_fraction() const;
  uint64_t fingerprint() const override { return fingerprint_; }  // of the encoded samples and labels

 private:
  void encode(const std::string& text, int64_t label);  // appends one sample
  void take_fingerprint();

  TsvDatasetOptions options_;
  std::vector<int32_t> ids_;         // all sequences back to back
  std::vector<int64_t> offsets_;     // sequence i is ids_[offsets_[i], offsets_[i + 1])
  std::vector<int64_t> labels_;
  int64_t truncated_ = 0;
  uint64_t fingerprint_ = 0;
};

// The sorted distinct labels of a TSV file (what TsvDataset uses when given no classes).
std::vector<std::string> read_tsv_classes(const std::string& path);

// The options make_tsv_dataset gives data.kind tsv for `config`: its WordPiece tokenizer
// (data.vocab_file, data.lowercase) and max_length (data.seq_len), without a path or classes.
// ConfigError for a missing key, DataError for an unreadable vocabulary.
TsvDatasetOptions tsv_dataset_options(const DataConfig& config);

// data.kind: tsv. Reads root/train_tsv or root/val_tsv with the vocab in data.vocab_file
// (uncased unless data.lowercase is false) and data.seq_len; validation labels are indexed by
// the training file's classes.
data::DatasetPtr make_tsv_dataset(const DataConfig& config, bool train_split);

}  // namespace train::text
