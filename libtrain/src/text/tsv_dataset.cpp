#include "train/text/tsv_dataset.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "train/config.h"
#include "train/data/tokens.h"  // kIgnoreIndex
#include "train/errors.h"
#include "train/files.h"

namespace train::text {

TsvDataset::TsvDataset(TsvDatasetOptions options) : options_(std::move(options)) {
  if (!options_.tokenizer) throw std::invalid_argument("TsvDataset: no tokenizer");
  if (options_.max_length < 3) {
    throw std::invalid_argument("TsvDataset: max_length must be >= 3 ([CLS], a token, [SEP]), got " +
                                std::to_string(options_.max_length));
  }
  if (!options_.texts.empty()) {
    for (size_t i = 0; i < options_.texts.size(); ++i) {
      if (options_.texts[i].find_first_not_of(" \t\r\n") == std::string::npos) {
        throw std::invalid_argument("TsvDataset: text " + std::to_string(i) + " is empty");
      }
      encode(options_.texts[i], data::kIgnoreIndex);
    }
    take_fingerprint();
    return;
  }
  const std::string& path = options_.path;
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    throw DataError(path + ": " + problem + ", expected a TSV file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open TSV file (" + std::strerror(errno) + ")");
  std::vector<std::string> texts, label_names;
  std::vector<int64_t> line_numbers;
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;  // blank lines (a trailing newline) are not examples
    const size_t tab = line.rfind('\t');
    auto fail = [&](const std::string& problem) {
      throw DataError(path + ":" + std::to_string(number) + ": " + problem +
                      " (expected one example per line: text<TAB>label)");
    };
    if (tab == std::string::npos) fail("no tab");
    if (line.find('\t') != tab) fail("more than one tab (a text with a tab, or more columns than two?)");
    std::string label = line.substr(tab + 1);
    line.resize(tab);
    if (label.empty()) fail("empty label");
    if (std::isspace(static_cast<unsigned char>(label.front())) || std::isspace(static_cast<unsigned char>(label.back()))) {
      fail("label '" + label + "' has white space around it");
    }
    if (line.find_first_not_of(" \t") == std::string::npos) fail("empty text");
    texts.push_back(std::move(line));
    label_names.push_back(std::move(label));
    line_numbers.push_back(number);
  }
  if (in.bad()) throw DataError(path + ": error reading TSV file");
  if (texts.empty()) throw DataError(path + ": no examples (expected one per line: text<TAB>label)");

  if (options_.classes.empty()) {
    const std::set<std::string> distinct(label_names.begin(), label_names.end());
    options_.classes.assign(distinct.begin(), distinct.end());
  }
  const auto& classes = options_.classes;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto it = std::find(classes.begin(), classes.end(), label_names[i]);
    if (it == classes.end()) {
      throw DataError(path + ":" + std::to_string(line_numbers[i]) + ": label '" + label_names[i] +
                      "' is not one of the training classes");
    }
    encode(texts[i], it - classes.begin());
  }
  take_fingerprint();
}

// Once: the samples do not change, and every checkpoint asks again.
void TsvDataset::take_fingerprint() {
  data::Fingerprint print;
  for (const std::string& name : options_.classes) print.add(name);
  print.add(ids_.data(), ids_.size() * sizeof(int32_t));
  print.add(offsets_.data(), offsets_.size() * sizeof(int64_t));
  print.add(labels_.data(), labels_.size() * sizeof(int64_t));
  fingerprint_ = print.value();
}

void TsvDataset::encode(const std::string& text, int64_t label) {
  if (offsets_.empty()) offsets_.push_back(0);
  labels_.push_back(label);
  std::vector<int32_t> pieces = options_.tokenizer->tokenize_ids(text);
  if (static_cast<int64_t>(pieces.size()) > options_.max_length - 2) {
    pieces.resize(static_cast<size_t>(options_.max_length - 2));
    ++truncated_;
  }
  ids_.push_back(options_.tokenizer->cls_id());
  ids_.insert(ids_.end(), pieces.begin(), pieces.end());
  ids_.push_back(options_.tokenizer->sep_id());
  offsets_.push_back(static_cast<int64_t>(ids_.size()));
}

data::Example TsvDataset::get(int64_t index, uint64_t /*seed*/) const {
  if (index < 0 || index >= size()) throw std::out_of_range("TsvDataset: index " + std::to_string(index));
  const int64_t begin = offsets_[index], end = offsets_[index + 1];
  auto input = torch::full({options_.max_length}, options_.tokenizer->pad_id(), torch::kLong);
  auto* out = input.data_ptr<int64_t>();
  for (int64_t i = begin; i < end; ++i) out[i - begin] = ids_[i];
  return {input, torch::scalar_tensor(labels_[index], torch::kLong)};
}

data::Batch TsvDataset::collate(std::vector<data::Example>&& examples) const {
  data::Batch batch = Dataset::collate(std::move(examples));
  // Dynamic padding: cut the columns after every row's last token that is not padding. (Not the
  // count of such tokens: a text may hold a literal [PAD], which the tokenizer keeps as the pad id.)
  const auto columns = torch::arange(1, batch.input.size(1) + 1, torch::kLong);
  const auto ends = (batch.input.ne(options_.tokenizer->pad_id()).to(torch::kLong) * columns).amax(1);
  const int64_t longest = std::max<int64_t>(1, ends.max().item<int64_t>());
  if (longest < batch.input.size(1)) batch.input = batch.input.slice(1, 0, longest).contiguous();
  return batch;
}

double TsvDataset::truncated_fraction() const {
  return labels_.empty() ? 0.0 : static_cast<double>(truncated_) / static_cast<double>(labels_.size());
}

std::string TsvDataset::describe() const {
  std::ostringstream out;
  out << "tsv: " << (options_.texts.empty() ? options_.path : "texts given") << ", " << size() << " texts, "
      << num_classes() << " classes, max_length " << options_.max_length << " (" << static_cast<int>(100.0 * truncated_fraction() + 0.5) << "% truncated), vocab "
      << options_.tokenizer->vocab().size();
  return out.str();
}

std::vector<std::string> read_tsv_classes(const std::string& path) {
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    throw DataError(path + ": " + problem + ", expected a TSV file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open TSV file (" + std::strerror(errno) + ")");
  std::set<std::string> classes;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t tab = line.rfind('\t');
    if (tab != std::string::npos && tab + 1 < line.size()) classes.insert(line.substr(tab + 1));
  }
  return {classes.begin(), classes.end()};
}

TsvDatasetOptions tsv_dataset_options(const DataConfig& config) {
  if (config.root.empty()) throw ConfigError("key 'data.root': required when data.kind is tsv (the directory with the TSV files)");
  if (config.vocab_file.empty()) throw ConfigError("key 'data.vocab_file': required when data.kind is tsv (a BERT vocab.txt)");
  const std::string vocab = config.vocab_file[0] == '/' ? config.vocab_file : files::join(config.root, config.vocab_file);
  WordPieceOptions wp;
  wp.basic.lowercase = config.lowercase;
  TsvDatasetOptions options;
  options.tokenizer = std::make_shared<const WordPieceTokenizer>(WordPieceTokenizer::from_file(vocab, wp));
  options.max_length = config.seq_len;
  return options;
}

data::DatasetPtr make_tsv_dataset(const DataConfig& config, bool train_split) {
  TsvDatasetOptions options = tsv_dataset_options(config);
  auto resolve = [&](const std::string& name) { return name[0] == '/' ? name : files::join(config.root, name); };
  options.path = resolve(config.train_tsv);
  if (train_split) return std::make_shared<TsvDataset>(options);
  // Validation labels index the training classes, so read the training file's label set.
  options.classes = read_tsv_classes(options.path);
  options.path = resolve(config.val_tsv);
  return std::make_shared<TsvDataset>(options);
}

}  // namespace train::text
