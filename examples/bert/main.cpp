// The BERT example's data tools. Training itself runs through `train fit` with
// configs/bert_tiny_mlm.yaml, configs/bert_base_mlm.yaml or configs/minilm_finetune.yaml.
//
//   bert_example prepare [--fortunes DIR] [--out DIR] [--vocab-size N] [--val-every K]
//       Reads Debian's fortunes corpus (/usr/share/games/fortunes: one file per category,
//       fortunes separated by lines "%"), holds out every K-th fortune of each file (default 10),
//       and writes into OUT (default data/fortunes):
//         vocab.txt                 a WordPiece vocab learned from the training fortunes
//         train.tokens, val.tokens  every fortune pretokenized with it (the MLM corpus)
//         train.tsv, val.tsv        text<TAB>category for the topic-classification task
//         uncased/                  with --uncased-vocab VOCAB: the same split pretokenized with a
//                                   standard BERT vocab (vocab.txt, train.tokens, val.tokens)
//       Every input (the corpus, VOCAB) is read and checked before anything is written, and each
//       output replaces its file atomically: bad input leaves OUT as it was.
//   bert_example pretokenize --vocab VOCAB --out FILE.tokens [--separator LINE] [--cased] TEXT...
//       Any corpus: documents are separated by lines equal to LINE (default: every non-empty
//       line is a document). Each TEXT must be a readable regular file; FILE is written only
//       when all of them are read.
//   bert_example baselines [--data DIR]
//       The baselines the trained models must beat: the most-frequent-token accuracy of MLM on
//       val.tokens and the majority-class accuracy on val.tsv. The token files must have been
//       written with DIR/vocab.txt (a larger vocabulary in their header is bad data).
//
// Exit codes: 0 success, 1 bad data or a runtime failure, 2 bad usage or config (a message names the
// file).
#include <train/data/token_file.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/host_memory.h>
#include <train/text/tsv_dataset.h>
#include <train/text/wordpiece.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using train::text::WordPieceTokenizer;

// The topics of the classification task: fortune files with distinct subjects.
const std::vector<std::string> kCategories = {"art",     "computers", "education", "food",    "law",
                                              "love",    "medicine",  "politics",  "science", "sports"};

struct Fortune {
  std::string category;
  std::string text;  // lines joined by '\n'
};

// Opens a text input: DataError naming the path unless it is a regular file that can be read (a
// directory reads as empty, and a named pipe would block).
std::ifstream open_text_file(const std::string& path) {
  if (const std::string problem = train::files::input_file_problem(path); !problem.empty()) {
    throw train::DataError(path + ": " + problem + ", expected a text file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw train::DataError(path + ": cannot open (" + std::strerror(errno) + ")");
  return in;
}

std::string read_file(const std::string& path) {
  std::ifstream in = open_text_file(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Replaces `path` with `text`: a temporary file beside it, synced, then renamed over it, so a
// reader sees the old file or the new one. train::Error naming the file when a step fails; the
// file there before, if any, is then unchanged.
void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) throw train::Error("cannot write " + tmp + ": " + std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 &&
            ::fsync(::fileno(f)) == 0;
  int error = ok ? 0 : errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    error = errno;
  }
  if (ok && std::rename(tmp.c_str(), path.c_str()) != 0) {
    ok = false;
    error = errno;
  }
  if (!ok) {
    std::remove(tmp.c_str());
    throw train::Error("failed writing " + path + ": " + std::strerror(error) +
                       "; the file there before, if any, is unchanged");
  }
}

// Documents of a text file: separated by lines equal to `separator`, or every non-empty line.
std::vector<std::string> split_documents(const std::string& text, const std::string& separator) {
  std::vector<std::string> docs;
  std::istringstream in(text);
  std::string line, current;
  auto flush = [&]() {
    if (current.find_first_not_of(" \t\r\n") != std::string::npos) docs.push_back(current);
    current.clear();
  };
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (separator.empty()) {
      current = line;
      flush();
    } else if (line == separator) {
      flush();
    } else {
      current += (current.empty() ? "" : "\n") + line;
    }
  }
  flush();
  return docs;
}

// One line for a TSV cell: whitespace runs (tabs and newlines included) become one space.
std::string one_line(const std::string& text) {
  std::string out;
  bool space = false;
  for (char c : text) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      space = !out.empty();
    } else {
      if (space) out.push_back(' ');
      space = false;
      out.push_back(c);
    }
  }
  return out;
}

// Tokenizer options for a raw corpus. Such text holds no special tokens: a "[PAD]" or "[SEP]"
// written in it is text ("[", "pad", "]"). Matched as a special token, a literal "[PAD]" would
// become the pad id inside a document, and the model masks pad ids out of attention
// (train/data/tokens.h), hiding it without a word; a literal "[SEP]" would fake a boundary.
train::text::WordPieceOptions raw_text_options(bool lowercase) {
  train::text::WordPieceOptions o;
  o.basic.lowercase = lowercase;
  o.match_special_tokens = false;
  return o;
}

std::vector<int64_t> encode_document(const WordPieceTokenizer& tok, const std::string& text) {
  const std::vector<int32_t> ids = tok.tokenize_ids(text);
  return {ids.begin(), ids.end()};
}

train::data::TokenFileOptions token_file_options(const WordPieceTokenizer& tok) {
  train::data::TokenFileOptions o;
  o.vocab_size = tok.vocab().size();
  o.special.pad = tok.pad_id();
  o.special.unk = tok.unk_id();
  o.special.cls = tok.cls_id();
  o.special.sep = tok.sep_id();
  o.special.mask = tok.mask_id();
  return o;
}

struct Args {
  std::map<std::string, std::string> options;
  std::vector<std::string> positional;
};

Args parse(int argc, char** argv, int first, const std::vector<std::string>& valued,
           const std::vector<std::string>& flags) {
  Args a;
  for (int i = first; i < argc; ++i) {
    const std::string arg = argv[i];
    if (std::find(valued.begin(), valued.end(), arg) != valued.end()) {
      if (i + 1 >= argc) throw train::UsageError(arg + " needs a value");
      a.options[arg] = argv[++i];
    } else if (std::find(flags.begin(), flags.end(), arg) != flags.end()) {
      a.options[arg] = "1";
    } else if (arg.size() > 1 && arg[0] == '-') {
      throw train::UsageError("unknown option " + arg);
    } else {
      a.positional.push_back(arg);
    }
  }
  return a;
}

int64_t int_option(const Args& a, const std::string& name, int64_t fallback, int64_t min) {
  const auto it = a.options.find(name);
  if (it == a.options.end()) return fallback;
  try {
    size_t used = 0;
    const int64_t v = std::stoll(it->second, &used);
    if (used == it->second.size() && v >= min) return v;
  } catch (const std::exception&) {
  }
  throw train::UsageError(name + " must be an integer >= " + std::to_string(min) + ", got '" + it->second + "'");
}

std::string option(const Args& a, const std::string& name, const std::string& fallback) {
  const auto it = a.options.find(name);
  return it == a.options.end() ? fallback : it->second;
}

int prepare(int argc, char** argv) {
  const Args a = parse(argc, argv, 2, {"--fortunes", "--out", "--vocab-size", "--val-every", "--uncased-vocab"}, {});
  const std::string root = option(a, "--fortunes", "/usr/share/games/fortunes");
  const std::string out = option(a, "--out", "data/fortunes");
  const int64_t vocab_size = int_option(a, "--vocab-size", 8000, 100);
  const int64_t val_every = int_option(a, "--val-every", 10, 2);
  // Every input is read and checked before anything is written: a failure leaves OUT as it was.
  if (train::files::exists(out) && !train::files::is_directory(out)) {
    throw train::UsageError("--out " + out + ": exists and is not a directory");
  }
  if (!train::files::is_directory(root)) {
    throw train::DataError(root + ": no fortunes corpus here (apt-get install fortunes, or pass --fortunes DIR)");
  }
  std::vector<Fortune> train_set, val_set;
  for (const auto& name : train::files::list_directory(root)) {
    const std::string path = train::files::join(root, name);
    // Category files have no extension; .dat are indexes and .u8 links to the same text.
    if (name.find('.') != std::string::npos || !train::files::is_regular_file(path)) continue;
    const auto docs = split_documents(read_file(path), "%");
    for (size_t i = 0; i < docs.size(); ++i)
      (static_cast<int64_t>(i % val_every) == val_every - 1 ? val_set : train_set).push_back({name, docs[i]});
  }
  if (train_set.empty()) throw train::DataError(root + ": no fortunes found (expected files of texts separated by '%' lines)");
  // The same split with a standard uncased BERT vocab (bert-base-sized models).
  std::optional<WordPieceTokenizer> standard;
  if (a.options.count("--uncased-vocab")) {
    standard.emplace(WordPieceTokenizer::from_file(a.options.at("--uncased-vocab"), raw_text_options(true)));
  }

  train::text::VocabBuilderOptions vb;
  vb.vocab_size = vocab_size;
  train::text::VocabBuilder builder(vb);
  for (const auto& f : train_set) builder.add_text(f.text);
  const train::text::Vocab vocab = builder.build();
  const WordPieceTokenizer tok(vocab, raw_text_options(true));

  // The token files stream into temporaries beside their targets (creating OUT and OUT/uncased)
  // and are renamed into place by finish(), after everything else has been computed.
  const std::vector<std::pair<std::string, const std::vector<Fortune>*>> splits = {{"train", &train_set},
                                                                                   {"val", &val_set}};
  std::vector<std::unique_ptr<train::data::TokenFileWriter>> token_files;  // per split; then uncased
  auto pretokenize_splits = [&](const WordPieceTokenizer& t, const std::string& dir) {
    for (const auto& [split, set] : splits) {
      token_files.push_back(std::make_unique<train::data::TokenFileWriter>(
          train::files::join(dir, split + ".tokens"), token_file_options(t)));
      for (const auto& f : *set) token_files.back()->add_document(encode_document(t, f.text));
    }
  };
  pretokenize_splits(tok, out);
  const std::string uncased_dir = train::files::join(out, "uncased");
  if (standard) pretokenize_splits(*standard, uncased_dir);
  std::vector<std::string> tsv_texts;
  std::vector<int64_t> tsv_rows;
  for (const auto& [split, set] : splits) {
    std::ostringstream tsv;
    int64_t rows = 0;
    for (const auto& f : *set) {
      if (std::find(kCategories.begin(), kCategories.end(), f.category) == kCategories.end()) continue;
      const std::string text = one_line(f.text);
      if (text.empty()) continue;
      tsv << text << '\t' << f.category << '\n';
      ++rows;
    }
    tsv_texts.push_back(tsv.str());
    tsv_rows.push_back(rows);
  }

  // Everything is computed: put each file in place, atomically. Only a failing write (a full
  // disk) can stop this part way, with some of the files replaced.
  for (const auto& writer : token_files) writer->finish();
  vocab.save(train::files::join(out, "vocab.txt"));
  for (size_t i = 0; i < splits.size(); ++i) {
    write_file_atomically(train::files::join(out, splits[i].first + ".tsv"), tsv_texts[i]);
  }
  if (standard) standard->vocab().save(train::files::join(uncased_dir, "vocab.txt"));

  int64_t tokens = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    tokens += token_files[i]->num_tokens();
    std::cout << splits[i].first << ": " << splits[i].second->size() << " fortunes (" << token_files[i]->num_tokens()
              << " tokens), " << tsv_rows[i] << " classification rows\n";
  }
  for (size_t i = splits.size(); i < token_files.size(); ++i) {
    std::cout << splits[i - splits.size()].first << " (uncased vocab " << standard->vocab().size()
              << "): " << token_files[i]->num_tokens() << " tokens\n";
  }
  std::cout << "vocab: " << vocab.size() << " tokens learned from " << builder.distinct_words()
            << " distinct words; " << tokens << " tokens in all; written to " << out << "\n";
  return 0;
}

int pretokenize(int argc, char** argv) {
  const Args a = parse(argc, argv, 2, {"--vocab", "--out", "--separator"}, {"--cased"});
  if (!a.options.count("--vocab") || !a.options.count("--out") || a.positional.empty())
    throw train::UsageError("usage: bert_example pretokenize --vocab VOCAB --out FILE.tokens [--separator LINE] [--cased] TEXT...");
  const WordPieceTokenizer tok =
      WordPieceTokenizer::from_file(a.options.at("--vocab"), raw_text_options(!a.options.count("--cased")));
  for (const auto& path : a.positional) open_text_file(path);  // every input checked before FILE is begun
  train::data::TokenFileWriter writer(a.options.at("--out"), token_file_options(tok));
  for (const auto& path : a.positional)
    for (const auto& doc : split_documents(read_file(path), option(a, "--separator", "")))
      writer.add_document(encode_document(tok, doc));
  writer.finish();
  std::cout << writer.num_documents() << " documents, " << writer.num_tokens() << " tokens -> " << writer.path() << "\n";
  return 0;
}

int baselines(int argc, char** argv) {
  const Args a = parse(argc, argv, 2, {"--data"}, {});
  const std::string dir = option(a, "--data", "data/fortunes");
  // MLM: masked positions are drawn uniformly from the non-special tokens, so always guessing the
  // training set's most frequent token scores its share of the validation set's tokens.
  const std::string vocab_path = train::files::join(dir, "vocab.txt");
  const auto vocab = train::text::Vocab::load(vocab_path);
  auto is_special = [&](int64_t id) { return vocab.token(id).size() > 2 && vocab.token(id)[0] == '['; };
  auto counts = [&](const std::string& name) {
    train::data::TokenFile file(train::files::join(dir, name));
    // Every id read is below the header's vocab_size (TokenFile checks); vocab.txt must cover them.
    if (file.vocab_size() > vocab.size()) {
      throw train::DataError(file.path() + ": written with a vocabulary of " + std::to_string(file.vocab_size()) +
                             " tokens, but " + vocab_path + " has " + std::to_string(vocab.size()) +
                             " (pretokenize the corpus with that vocab)");
    }
    std::vector<int64_t> c(static_cast<size_t>(vocab.size()), 0);
    for (int64_t i = 0; i < file.num_tokens(); ++i) {
      const int64_t id = file.token(i);
      if (!is_special(id)) ++c[static_cast<size_t>(id)];
    }
    return c;
  };
  auto total = [](const std::vector<int64_t>& c) {
    int64_t n = 0;
    for (int64_t k : c) n += k;
    return n;
  };
  const auto train_counts = counts("train.tokens");
  const auto val_counts = counts("val.tokens");
  for (const auto& [name, c] : {std::make_pair("train.tokens", &train_counts), std::make_pair("val.tokens", &val_counts)}) {
    if (total(*c) == 0) throw train::DataError(train::files::join(dir, name) + ": no tokens other than special ones");
  }
  const auto top = std::max_element(train_counts.begin(), train_counts.end()) - train_counts.begin();
  const int64_t val_total = total(val_counts);
  std::cout << std::fixed << std::setprecision(2) << "MLM most-frequent-token baseline: '" << vocab.token(top) << "' = "
            << 100.0 * static_cast<double>(val_counts[static_cast<size_t>(top)]) / static_cast<double>(val_total)
            << "% of " << val_total << " validation tokens\n";

  const auto classes = train::text::read_tsv_classes(train::files::join(dir, "train.tsv"));
  std::map<std::string, int64_t> train_labels, val_labels;
  for (const auto& [name, target] : {std::make_pair("train.tsv", &train_labels), std::make_pair("val.tsv", &val_labels)}) {
    const std::string path = train::files::join(dir, name);
    std::ifstream in(path);
    if (!in) throw train::DataError(path + ": cannot open (" + std::strerror(errno) + ")");
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      const size_t tab = line.rfind('\t');
      if (tab != std::string::npos && tab + 1 < line.size()) ++(*target)[line.substr(tab + 1)];
    }
    if (target->empty()) throw train::DataError(path + ": no rows (text<TAB>category)");
  }
  const auto majority = std::max_element(train_labels.begin(), train_labels.end(),
                                         [](const auto& x, const auto& y) { return x.second < y.second; });
  int64_t val_rows = 0;
  for (const auto& [label, n] : val_labels) val_rows += n;
  std::cout << "classification majority-class baseline: '" << majority->first << "' = "
            << 100.0 * static_cast<double>(val_labels[majority->first]) / static_cast<double>(val_rows) << "% of "
            << val_rows << " validation texts (" << classes.size() << " classes)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  train::tune_host_malloc();  // as the train command does (train/host_memory.h)
  const std::string usage = "usage: bert_example prepare|pretokenize|baselines [options] (see examples/bert/main.cpp)";
  try {
    if (argc < 2) throw train::UsageError(usage);
    const std::string command = argv[1];
    if (command == "--help" || command == "-h" || command == "help") {
      std::cout << usage << "\n"
                << "  prepare [--fortunes DIR] [--out DIR] [--vocab-size N] [--val-every K] [--uncased-vocab VOCAB]\n"
                << "      the fortunes corpus -> vocab.txt, train/val .tokens and .tsv in OUT (default data/fortunes)\n"
                << "  pretokenize --vocab VOCAB --out FILE.tokens [--separator LINE] [--cased] TEXT...\n"
                << "      any corpus -> a token file\n"
                << "  baselines [--data DIR]\n"
                << "      the most-frequent-token and majority-class accuracies the trained models must beat\n"
                << "Training runs through train fit (configs/bert_tiny_mlm.yaml, configs/minilm_finetune.yaml).\n";
      return 0;
    }
    if (command == "prepare") return prepare(argc, argv);
    if (command == "pretokenize") return pretokenize(argc, argv);
    if (command == "baselines") return baselines(argc, argv);
    throw train::UsageError("unknown command '" + command + "'; " + usage);
  } catch (const train::Error& e) {
    std::cerr << "bert_example: " << e.what() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << "bert_example: " << e.what() << "\n";
    return train::kExitRuntime;
  }
}
