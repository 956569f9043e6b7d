#pragma once
// BERT's WordPiece tokenizer, torch-free: the basic tokenizer (text cleaning, CJK splitting,
// accent stripping, lower-casing, punctuation splitting), greedy longest-match-first WordPiece
// with `##` continuations, and encoding to ids with [CLS] / [SEP], truncation and padding.
//
// It reads the standard BERT vocab.txt (one token per line, id = line number - 1) and gives the
// same ids as Hugging Face's `tokenizers` BertWordPieceTokenizer (tests/test_tokenizer.cpp checks
// this on MiniLM's 30,522-token vocab, over hand-written texts and every code point). Unicode data
// (character classes, canonical decompositions, lower-case mappings) comes from tables read off
// tokenizers 0.23.3 itself (libtrain/src/text/gen_unicode_tables.py), not from a Unicode
// database: tokenizers uses older Unicode versions, which differ from today's on hundreds of code
// points. Known difference: combining marks are not canonically reordered after decomposition,
// which only matters for sequences of several combining marks that are not all dropped (Mn marks
// are dropped when accents are stripped).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace train::text {

// ---- UTF-8 ------------------------------------------------------------------------------------

// Invalid bytes (and overlong or surrogate encodings) decode to U+FFFD, one per bad byte.
std::u32string decode_utf8(std::string_view text);
std::string encode_utf8(std::u32string_view text);

// ---- Basic tokenization ------------------------------------------------------------------------

struct BasicTokenizerOptions {
  bool clean_text = true;      // drop NUL, U+FFFD, control, format and private-use characters;
                               // whitespace -> ' '
  bool split_cjk = true;       // every CJK ideograph becomes its own word
  bool lowercase = true;       // full Unicode lower-case mapping (an "uncased" vocab)
  std::optional<bool> strip_accents;  // NFD, then drop non-spacing marks; unset = same as lowercase
};

// The text after cleaning, CJK padding, accent stripping and lower-casing (Hugging Face's
// BertNormalizer), as UTF-32.
std::u32string normalize(std::string_view text, const BasicTokenizerOptions& options);

// Words: normalized text split on whitespace, with every punctuation character (ASCII
// punctuation or Unicode category P* as tokenizers' tables have it) a word of its own.
std::vector<std::string> basic_tokenize(std::string_view text, const BasicTokenizerOptions& options);

// ---- Vocabulary --------------------------------------------------------------------------------

class Vocab {
 public:
  Vocab() = default;
  // Id i is tokens[i]. Throws std::invalid_argument for an empty or repeated token.
  explicit Vocab(std::vector<std::string> tokens);

  // Reads vocab.txt: one token per line ("\r\n" accepted). Throws train::DataError naming the
  // file (and line) when it cannot be read, is empty, has an empty line, repeats a token or starts
  // with a UTF-8 byte order mark (which Hugging Face's tokenizers would keep in the first token).
  static Vocab load(const std::string& path);
  // Writes one token per line, atomically (a temporary file renamed over `path`: a reader sees the
  // old file or the new one). Throws train::Error naming the file on failure; the file there
  // before, if any, is then unchanged.
  void save(const std::string& path) const;

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  const std::string& token(int64_t id) const { return tokens_.at(static_cast<size_t>(id)); }
  const std::vector<std::string>& tokens() const { return tokens_; }
  // -1 when absent.
  int32_t find(const std::string& token) const {
    const auto it = ids_.find(token);
    return it == ids_.end() ? -1 : it->second;
  }
  bool contains(const std::string& token) const { return ids_.count(token) > 0; }

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int32_t> ids_;
};

// ---- WordPiece ---------------------------------------------------------------------------------

struct WordPieceOptions {
  BasicTokenizerOptions basic;
  std::string unk_token = "[UNK]";
  std::string cls_token = "[CLS]";
  std::string sep_token = "[SEP]";
  std::string pad_token = "[PAD]";
  std::string mask_token = "[MASK]";
  std::string continuation_prefix = "##";
  int64_t max_word_chars = 100;  // longer words (in code points) become [UNK]
  // Special tokens written in the text ("[MASK]") map to their ids, as in Hugging Face's
  // tokenizers; false treats them as ordinary text ("[", "mask", "]").
  bool match_special_tokens = true;
};

// One encoded sequence: [CLS] A [SEP] (or [CLS] A [SEP] B [SEP]), then padding.
struct Encoding {
  std::vector<int32_t> ids;
  std::vector<int32_t> type_ids;        // 0 for [CLS] A [SEP], 1 for B [SEP], 0 for padding
  std::vector<uint8_t> attention_mask;  // 1 for real tokens, 0 for padding
};

class WordPieceTokenizer {
 public:
  // Throws std::invalid_argument when a special token is missing from the vocab.
  WordPieceTokenizer(Vocab vocab, WordPieceOptions options = {});
  // Vocab::load + the constructor; a missing special token is a train::DataError naming the file.
  static WordPieceTokenizer from_file(const std::string& vocab_path, WordPieceOptions options = {});

  // Word pieces of `text` (no special tokens).
  std::vector<std::string> tokenize(std::string_view text) const;
  // Ids of the word pieces of `text` (no special tokens).
  std::vector<int32_t> tokenize_ids(std::string_view text) const;
  // Word pieces of one word from basic_tokenize, appended to `out` as ids.
  void word_to_ids(const std::string& word, std::vector<int32_t>& out) const;

  // [CLS] text [SEP]. max_length > 0 truncates the word pieces so that the whole encoding
  // (specials included) fits; pad_to > 0 pads with [PAD] up to that length.
  Encoding encode(std::string_view text, int64_t max_length = 0, int64_t pad_to = 0) const;
  // [CLS] a [SEP] b [SEP]; truncation is longest-first as in Hugging Face tokenizers: the shorter
  // keeps its length when the longer can make room, else gets half the room (rounded down).
  Encoding encode_pair(std::string_view a, std::string_view b, int64_t max_length = 0,
                       int64_t pad_to = 0) const;

  // Tokens joined with spaces, "##" continuations glued to the previous piece; specials and
  // padding are skipped when skip_special is true.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = true) const;

  const Vocab& vocab() const { return vocab_; }
  const WordPieceOptions& options() const { return options_; }
  int32_t unk_id() const { return unk_id_; }
  int32_t cls_id() const { return cls_id_; }
  int32_t sep_id() const { return sep_id_; }
  int32_t pad_id() const { return pad_id_; }
  int32_t mask_id() const { return mask_id_; }

 private:
  Encoding finish(std::vector<int32_t> a, const std::vector<int32_t>* b, int64_t max_length,
                  int64_t pad_to) const;

  Vocab vocab_;
  WordPieceOptions options_;
  int32_t unk_id_ = -1, cls_id_ = -1, sep_id_ = -1, pad_id_ = -1, mask_id_ = -1;
};

// ---- Learning a vocabulary ---------------------------------------------------------------------

struct VocabBuilderOptions {
  BasicTokenizerOptions basic;
  int64_t vocab_size = 8000;   // target size, special tokens included
  int64_t min_frequency = 2;   // pairs seen fewer times are never merged
  int64_t max_alphabet = 1000; // most frequent characters kept; rarer ones end up as [UNK]
  std::vector<std::string> special_tokens = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  std::string continuation_prefix = "##";
  int64_t max_word_chars = 100;  // longer words are not counted (they would be [UNK])
};

// Learns a WordPiece vocab from text, as Hugging Face's WordPieceTrainer does: words from the
// basic tokenizer are split into characters (all but the first carrying the "##" prefix), then
// the most frequent adjacent pair is merged repeatedly (ties: the lexicographically smaller
// pair) until the vocab reaches vocab_size or no pair reaches min_frequency. The vocab is the
// special tokens (ids 0, 1, ...), then the alphabet in order of frequency (every character, then
// the "##" forms of those seen after the first character of a word: not punctuation or CJK
// ideographs, always words of their own), then the merged tokens in merge order.
class VocabBuilder {
 public:
  explicit VocabBuilder(VocabBuilderOptions options = {});
  void add_text(std::string_view text);  // counts the words of one document (or line)
  int64_t distinct_words() const { return static_cast<int64_t>(counts_.size()); }
  Vocab build() const;

 private:
  VocabBuilderOptions options_;
  std::unordered_map<std::string, int64_t> counts_;
};

}  // namespace train::text
