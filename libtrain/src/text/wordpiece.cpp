// UTF-8, the Unicode lookups, the basic tokenizer, the vocab file and WordPiece.
#include "train/text/wordpiece.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "atomic_file.h"
#include "train/errors.h"
#include "train/files.h"

namespace train::text {
namespace {

// ---- Unicode tables ----------------------------------------------------------------------------

struct CategoryRange {
  char32_t first, last;
  int klass;
};
struct Mapping {
  char32_t code;
  int offset, length;
};
#include "unicode_tables.inc"

// The classes of unicode_tables.inc, each read off the tokenizers step that uses it (see
// gen_unicode_tables.py): dropped by clean_text, removed after NFD when stripping accents, split
// off by the pre-tokenizer.
enum Class { kNone = 0, kDropped = 1, kNonSpacingMark = 2, kPunctuation = 3 };

int char_class(char32_t c) {
  const auto* begin = std::begin(kCategoryRanges);
  const auto* end = std::end(kCategoryRanges);
  // First range whose last >= c.
  const auto* it = std::lower_bound(begin, end, c, [](const CategoryRange& r, char32_t v) { return r.last < v; });
  return it != end && it->first <= c ? it->klass : kNone;
}

// The mapping of c, or nullptr when it maps to itself.
const Mapping* find_mapping(const Mapping* begin, const Mapping* end, char32_t c) {
  const auto* it = std::lower_bound(begin, end, c, [](const Mapping& m, char32_t v) { return m.code < v; });
  return it != end && it->code == c ? it : nullptr;
}

void append_mapping(std::u32string& out, const Mapping& m) {
  out.append(kMappingPool + m.offset, kMappingPool + m.offset + m.length);
}

constexpr char32_t kHangulFirst = 0xAC00, kHangulLast = 0xD7A3;

// NFD of one code point (Hangul syllables by the algorithm of Unicode section 3.12).
void append_nfd(std::u32string& out, char32_t c) {
  if (c >= kHangulFirst && c <= kHangulLast) {
    const char32_t s = c - kHangulFirst;
    out.push_back(0x1100 + s / 588);
    out.push_back(0x1161 + (s % 588) / 28);
    if (s % 28 != 0) out.push_back(0x11A7 + s % 28);
    return;
  }
  if (const Mapping* m = find_mapping(std::begin(kDecompositions), std::end(kDecompositions), c)) {
    append_mapping(out, *m);
  } else {
    out.push_back(c);
  }
}

void append_lower(std::u32string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(c >= 'A' && c <= 'Z' ? c + 32 : c);
  } else if (const Mapping* m = find_mapping(std::begin(kLowercase), std::end(kLowercase), c)) {
    append_mapping(out, *m);
  } else {
    out.push_back(c);
  }
}

// The White_Space property (what Rust's char::is_whitespace tests, as Hugging Face's tokenizers do).
bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool is_punctuation(char32_t c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126)) return true;
  return c >= 0x80 && char_class(c) == kPunctuation;
}

// CJK Unified Ideographs and their extensions, and the compatibility ideographs: the blocks
// BERT's tokenizer splits into single characters (Hangul, kana and other scripts are not).
// Extension E starts at U+2B820, but Hugging Face's tokenizers (what AutoTokenizer loads) starts
// that range at U+2B920 and so does this, for the same ids; transformers' Python BertTokenizer
// splits U+2B820-2B91F too.
bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

}  // namespace

// ---- UTF-8 ------------------------------------------------------------------------------------

std::u32string decode_utf8(std::string_view text) {
  std::u32string out;
  out.reserve(text.size());
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char b = s[i];
    if (b < 0x80) {
      out.push_back(b);
      ++i;
      continue;
    }
    size_t len = 0;
    char32_t c = 0, min = 0;
    if ((b >> 5) == 0x6) {
      len = 2, c = b & 0x1F, min = 0x80;
    } else if ((b >> 4) == 0xE) {
      len = 3, c = b & 0x0F, min = 0x800;
    } else if ((b >> 3) == 0x1E) {
      len = 4, c = b & 0x07, min = 0x10000;
    }
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) ok = false;
      else c = (c << 6) | (s[i + k] & 0x3F);
    }
    if (ok && (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF))) ok = false;
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(c);
    i += len;
  }
  return out;
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else if (c < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (c >> 12)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (c >> 18)));
      out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
  }
  return out;
}

// ---- Basic tokenization ------------------------------------------------------------------------

std::u32string normalize(std::string_view text, const BasicTokenizerOptions& options) {
  const std::u32string input = decode_utf8(text);
  std::u32string a;
  a.reserve(input.size() + 8);
  // Cleaning and CJK padding in one pass (Hugging Face's order: clean, then pad CJK).
  for (char32_t c : input) {
    if (options.clean_text) {
      // NUL and U+FFFD are in the table; tab, newline and return are not (they become spaces).
      if (char_class(c) == kDropped) continue;
      if (is_whitespace(c)) c = ' ';
    }
    if (options.split_cjk && is_cjk(c)) {
      a.push_back(' ');
      a.push_back(c);
      a.push_back(' ');
    } else {
      a.push_back(c);
    }
  }
  if (options.strip_accents.value_or(options.lowercase)) {
    std::u32string b;
    b.reserve(a.size());
    std::u32string decomposed;
    for (char32_t c : a) {
      if (c < 0x80) {
        b.push_back(c);
        continue;
      }
      decomposed.clear();
      append_nfd(decomposed, c);
      for (char32_t d : decomposed)
        if (char_class(d) != kNonSpacingMark) b.push_back(d);
    }
    a.swap(b);
  }
  if (options.lowercase) {
    std::u32string b;
    b.reserve(a.size());
    for (char32_t c : a) append_lower(b, c);
    a.swap(b);
  }
  return a;
}

std::vector<std::string> basic_tokenize(std::string_view text, const BasicTokenizerOptions& options) {
  const std::u32string normalized = normalize(text, options);
  std::vector<std::string> words;
  std::u32string word;
  auto flush = [&]() {
    if (!word.empty()) words.push_back(encode_utf8(word));
    word.clear();
  };
  for (char32_t c : normalized) {
    if (is_whitespace(c)) {
      flush();
    } else if (is_punctuation(c)) {
      flush();
      words.push_back(encode_utf8(std::u32string_view(&c, 1)));
    } else {
      word.push_back(c);
    }
  }
  flush();
  return words;
}

// ---- Vocabulary --------------------------------------------------------------------------------

Vocab::Vocab(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {
  ids_.reserve(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i].empty()) throw std::invalid_argument("vocab: token " + std::to_string(i) + " is empty");
    if (!ids_.emplace(tokens_[i], static_cast<int32_t>(i)).second) {
      throw std::invalid_argument("vocab: token '" + tokens_[i] + "' appears twice (ids " +
                                  std::to_string(ids_.at(tokens_[i])) + " and " + std::to_string(i) + ")");
    }
  }
}

Vocab Vocab::load(const std::string& path) {
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    throw DataError(path + ": " + problem + ", expected a vocab file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open vocab file (" + std::strerror(errno) + ")");
  std::vector<std::string> tokens;
  std::unordered_map<std::string, int64_t> first_line;
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    // Hugging Face's tokenizers and transformers keep a byte order mark as part of the first
    // token (U+FEFF "[PAD]": they then have no [PAD]), so skipping it would make a tokenizer that
    // disagrees with theirs on this file. Refused here, naming the mark, instead of failing later
    // with "no padding token" while [PAD] is plainly on line 1.
    if (number == 1 && line.compare(0, 3, "\xEF\xBB\xBF") == 0) {
      throw DataError(path + ":1: vocab file starts with a UTF-8 byte order mark (bytes EF BB BF), which "
                      "Hugging Face's tokenizers would read as part of the first token; save it without one");
    }
    if (line.empty()) {
      throw DataError(path + ":" + std::to_string(number) +
                      ": empty line in vocab file (expected one token per line; id = line number - 1)");
    }
    const auto [it, inserted] = first_line.emplace(line, number);
    if (!inserted) {
      throw DataError(path + ":" + std::to_string(number) + ": token '" + line + "' repeats line " +
                      std::to_string(it->second));
    }
    tokens.push_back(line);
  }
  if (in.bad()) throw DataError(path + ": error reading vocab file");
  if (tokens.empty()) throw DataError(path + ": vocab file is empty");
  return Vocab(std::move(tokens));
}

void Vocab::save(const std::string& path) const {
  std::string text;
  for (const auto& token : tokens_) text.append(token).push_back('\n');
  detail::write_text_atomically(path, text);
}

// ---- WordPiece ---------------------------------------------------------------------------------

WordPieceTokenizer::WordPieceTokenizer(Vocab vocab, WordPieceOptions options)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  auto id_of = [&](const std::string& token, const char* role) {
    const int32_t id = vocab_.find(token);
    if (id < 0) throw std::invalid_argument(std::string("the vocab has no ") + role + " token '" + token + "'");
    return id;
  };
  unk_id_ = id_of(options_.unk_token, "unknown");
  cls_id_ = id_of(options_.cls_token, "classification");
  sep_id_ = id_of(options_.sep_token, "separator");
  pad_id_ = id_of(options_.pad_token, "padding");
  mask_id_ = id_of(options_.mask_token, "mask");
  if (options_.max_word_chars < 1) throw std::invalid_argument("max_word_chars must be >= 1");
}

WordPieceTokenizer WordPieceTokenizer::from_file(const std::string& vocab_path, WordPieceOptions options) {
  Vocab vocab = Vocab::load(vocab_path);
  try {
    return WordPieceTokenizer(std::move(vocab), std::move(options));
  } catch (const std::invalid_argument& e) {
    throw DataError(vocab_path + ": " + e.what());
  }
}

void WordPieceTokenizer::word_to_ids(const std::string& word, std::vector<int32_t>& out) const {
  size_t chars = 0;
  for (unsigned char b : word) chars += (b & 0xC0) != 0x80;
  if (static_cast<int64_t>(chars) > options_.max_word_chars) {
    out.push_back(unk_id_);
    return;
  }
  const size_t mark = out.size();
  std::string candidate;
  size_t start = 0;
  while (start < word.size()) {
    // Character boundaries of word[start..].
    size_t end = word.size();
    int32_t found = -1;
    while (end > start) {
      candidate.assign(start > 0 ? options_.continuation_prefix : std::string());
      candidate.append(word, start, end - start);
      found = vocab_.find(candidate);
      if (found >= 0) break;
      // Step back one code point.
      do --end;
      while (end > start && (static_cast<unsigned char>(word[end]) & 0xC0) == 0x80);
    }
    if (found < 0) {
      out.resize(mark);
      out.push_back(unk_id_);
      return;
    }
    out.push_back(found);
    start = end;
  }
}

std::vector<int32_t> WordPieceTokenizer::tokenize_ids(std::string_view text) const {
  std::vector<int32_t> ids;
  auto plain = [&](std::string_view segment) {
    for (const auto& word : basic_tokenize(segment, options_.basic)) word_to_ids(word, ids);
  };
  if (!options_.match_special_tokens) {
    plain(text);
    return ids;
  }
  // Special tokens written in the text are matched verbatim, before normalisation, as Hugging
  // Face's added-token matching does: leftmost occurrence first, the longest at a position.
  struct Special {
    const std::string* token;
    int32_t id;
    size_t next;  // its first occurrence at or after the last search position; npos when none
  };
  Special specials[] = {{&options_.unk_token, unk_id_, 0}, {&options_.cls_token, cls_id_, 0},
                        {&options_.sep_token, sep_id_, 0}, {&options_.pad_token, pad_id_, 0},
                        {&options_.mask_token, mask_id_, 0}};
  for (Special& s : specials) s.next = text.find(*s.token);
  size_t start = 0;
  while (start < text.size()) {
    size_t best = std::string_view::npos, best_length = 0;
    int32_t best_id = -1;
    for (Special& s : specials) {
      // An occurrence at or after `start` is still the first one there; only one that the last
      // match consumed or overlapped is searched for again. Searching every token afresh from
      // each match made a text with many special tokens quadratic.
      if (s.next != std::string_view::npos && s.next < start) s.next = text.find(*s.token, start);
      if (s.next == std::string_view::npos) continue;
      if (s.next < best || (s.next == best && s.token->size() > best_length)) {
        best = s.next;
        best_length = s.token->size();
        best_id = s.id;
      }
    }
    if (best == std::string_view::npos) break;
    plain(text.substr(start, best - start));
    ids.push_back(best_id);
    start = best + best_length;
  }
  plain(text.substr(start));
  return ids;
}

std::vector<std::string> WordPieceTokenizer::tokenize(std::string_view text) const {
  std::vector<std::string> pieces;
  for (int32_t id : tokenize_ids(text)) pieces.push_back(vocab_.token(id));
  return pieces;
}

Encoding WordPieceTokenizer::finish(std::vector<int32_t> a, const std::vector<int32_t>* b, int64_t max_length,
                                    int64_t pad_to) const {
  std::vector<int32_t> second = b ? *b : std::vector<int32_t>{};
  const int64_t specials = b ? 3 : 2;
  if (max_length > 0) {
    if (max_length < specials) {
      throw std::invalid_argument("encode: max_length " + std::to_string(max_length) + " leaves no room for the " +
                                  std::to_string(specials) + " special tokens");
    }
    const size_t budget = static_cast<size_t>(max_length - specials);
    if (!b) {
      if (a.size() > budget) a.resize(budget);
    } else if (a.size() + second.size() > budget) {
      // Longest first, with Hugging Face tokenizers' split: the shorter sequence keeps its length
      // when the longer can make room; otherwise the shorter gets budget / 2 and the longer the
      // rest, the odd token included.
      size_t shorter = std::min(a.size(), second.size()), longer = std::max(a.size(), second.size());
      longer = shorter > budget ? shorter : std::max(shorter, budget - shorter);
      if (shorter + longer > budget) {
        shorter = budget / 2;
        longer = shorter + budget % 2;
      }
      const bool first_is_longer = a.size() > second.size();
      a.resize(std::min(a.size(), first_is_longer ? longer : shorter));
      second.resize(std::min(second.size(), first_is_longer ? shorter : longer));
    }
  }
  Encoding e;
  e.ids.push_back(cls_id_);
  e.ids.insert(e.ids.end(), a.begin(), a.end());
  e.ids.push_back(sep_id_);
  e.type_ids.assign(e.ids.size(), 0);
  if (b) {
    e.ids.insert(e.ids.end(), second.begin(), second.end());
    e.ids.push_back(sep_id_);
    e.type_ids.resize(e.ids.size(), 1);
  }
  e.attention_mask.assign(e.ids.size(), 1);
  if (pad_to > 0 && static_cast<int64_t>(e.ids.size()) < pad_to) {
    e.ids.resize(static_cast<size_t>(pad_to), pad_id_);
    e.type_ids.resize(static_cast<size_t>(pad_to), 0);
    e.attention_mask.resize(static_cast<size_t>(pad_to), 0);
  }
  return e;
}

Encoding WordPieceTokenizer::encode(std::string_view text, int64_t max_length, int64_t pad_to) const {
  return finish(tokenize_ids(text), nullptr, max_length, pad_to);
}

Encoding WordPieceTokenizer::encode_pair(std::string_view a, std::string_view b, int64_t max_length,
                                         int64_t pad_to) const {
  const std::vector<int32_t> second = tokenize_ids(b);
  return finish(tokenize_ids(a), &second, max_length, pad_to);
}

std::string WordPieceTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  const std::string& prefix = options_.continuation_prefix;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_.size()) throw std::out_of_range("decode: id " + std::to_string(id) + " not in vocab");
    if (skip_special && (id == cls_id_ || id == sep_id_ || id == pad_id_ || id == mask_id_)) continue;
    const std::string& token = vocab_.token(id);
    if (!out.empty() && token.size() > prefix.size() && token.compare(0, prefix.size(), prefix) == 0) {
      out.append(token, prefix.size(), std::string::npos);
    } else {
      if (!out.empty()) out.push_back(' ');
      out += token;
    }
  }
  return out;
}

}  // namespace train::text
