// Learning a WordPiece vocab: byte-pair-style merges over words with "##" continuations.
#include <algorithm>
#include <cstdint>
#include <map>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "train/text/wordpiece.h"

namespace train::text {

VocabBuilder::VocabBuilder(VocabBuilderOptions options) : options_(std::move(options)) {
  if (options_.vocab_size < static_cast<int64_t>(options_.special_tokens.size()) + 1) {
    throw std::invalid_argument("vocab builder: vocab_size " + std::to_string(options_.vocab_size) +
                                " leaves no room beyond the special tokens");
  }
  if (options_.min_frequency < 1) throw std::invalid_argument("vocab builder: min_frequency must be >= 1");
  if (options_.max_alphabet < 1) throw std::invalid_argument("vocab builder: max_alphabet must be >= 1");
}

void VocabBuilder::add_text(std::string_view text) {
  for (auto& word : basic_tokenize(text, options_.basic)) ++counts_[word];
}

namespace {

struct Word {
  std::vector<int32_t> symbols;
  int64_t count;
};

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

}  // namespace

Vocab VocabBuilder::build() const {
  const std::string& prefix = options_.continuation_prefix;
  std::vector<std::string> tokens;                   // the vocab being built
  std::unordered_map<std::string, int32_t> token_id;  // and its index
  auto add_token = [&](const std::string& t) {
    const auto [it, inserted] = token_id.emplace(t, static_cast<int32_t>(tokens.size()));
    if (inserted) tokens.push_back(t);
    return it->second;
  };
  for (const auto& s : options_.special_tokens) add_token(s);

  // Words in a fixed order (the hash map's order is not), then the alphabet by frequency.
  std::vector<std::pair<std::string, int64_t>> words(counts_.begin(), counts_.end());
  std::sort(words.begin(), words.end());
  std::vector<std::u32string> decoded;
  std::map<char32_t, int64_t> char_counts;
  std::unordered_set<char32_t> continues;  // seen after the first character of a word
  for (const auto& [word, count] : words) {
    decoded.push_back(decode_utf8(word));
    if (static_cast<int64_t>(decoded.back().size()) > options_.max_word_chars) {
      decoded.back().clear();  // would be [UNK] anyway
      continue;
    }
    for (char32_t c : decoded.back()) char_counts[c] += count;
    if (decoded.back().size() > 1) continues.insert(decoded.back().begin() + 1, decoded.back().end());
  }
  std::vector<std::pair<char32_t, int64_t>> alphabet(char_counts.begin(), char_counts.end());
  std::stable_sort(alphabet.begin(), alphabet.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  if (static_cast<int64_t>(alphabet.size()) > options_.max_alphabet) alphabet.resize(options_.max_alphabet);
  std::unordered_map<char32_t, std::pair<int32_t, int32_t>> char_ids;  // bare, "##" form
  for (const auto& [c, n] : alphabet) {
    const std::string bare = encode_utf8(std::u32string_view(&c, 1));
    char_ids[c].first = add_token(bare);
  }
  // The "##" form only for characters seen after the first character of a word: punctuation and
  // CJK ideographs are words of their own (basic_tokenize), so "##." or "##中" would never be
  // used and would take a merge's slot. Hugging Face's WordPieceTrainer likewise adds a "##" form
  // only when a word of the corpus uses it. -1: no "##" form (no word of the corpus needs one).
  for (const auto& [c, n] : alphabet) {
    const std::string bare = encode_utf8(std::u32string_view(&c, 1));
    char_ids[c].second = continues.count(c) ? add_token(prefix + bare) : -1;
  }

  // Words as symbol sequences; a word with a character outside the alphabet is left out.
  std::vector<Word> corpus;
  for (size_t i = 0; i < words.size(); ++i) {
    if (decoded[i].empty()) continue;
    Word w{{}, words[i].second};
    bool ok = true;
    for (size_t k = 0; k < decoded[i].size() && ok; ++k) {
      const auto it = char_ids.find(decoded[i][k]);
      if (it == char_ids.end()) ok = false;
      else w.symbols.push_back(k == 0 ? it->second.first : it->second.second);
    }
    if (ok) corpus.push_back(std::move(w));
  }

  // Pair counts and where each pair occurs (word indices, possibly repeated or stale).
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const auto& s = corpus[i].symbols;
    for (size_t k = 0; k + 1 < s.size(); ++k) {
      const uint64_t key = pair_key(s[k], s[k + 1]);
      pair_count[key] += corpus[i].count;
      pair_words[key].push_back(static_cast<int32_t>(i));
    }
  }
  // Max-heap of (count, pair); entries whose count is no longer current are skipped when popped.
  // Ties go to the lexicographically smaller (left, right) pair so the result is deterministic.
  struct Entry {
    int64_t count;
    uint64_t key;
  };
  auto less = [&tokens](const Entry& x, const Entry& y) {
    if (x.count != y.count) return x.count < y.count;
    const auto& xa = tokens[x.key >> 32];
    const auto& ya = tokens[y.key >> 32];
    if (xa != ya) return xa > ya;
    return tokens[x.key & 0xFFFFFFFFu] > tokens[y.key & 0xFFFFFFFFu];
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(less)> heap(less);
  for (const auto& [key, count] : pair_count) heap.push({count, key});

  std::vector<int64_t> seen_at(corpus.size(), -1);
  int64_t merge_number = 0;
  while (static_cast<int64_t>(tokens.size()) < options_.vocab_size && !heap.empty()) {
    const Entry top = heap.top();
    heap.pop();
    const auto current = pair_count.find(top.key);
    if (current == pair_count.end() || current->second != top.count) continue;  // stale
    if (top.count < options_.min_frequency) break;
    const int32_t left = static_cast<int32_t>(top.key >> 32);
    const int32_t right = static_cast<int32_t>(top.key & 0xFFFFFFFFu);
    const std::string& right_text = tokens[right];
    const std::string merged = tokens[left] + right_text.substr(prefix.size());
    const int32_t merged_id = add_token(merged);
    ++merge_number;

    std::unordered_map<uint64_t, int64_t> delta;
    for (int32_t wi : pair_words[top.key]) {
      if (seen_at[wi] == merge_number) continue;
      seen_at[wi] = merge_number;
      Word& w = corpus[wi];
      auto& s = w.symbols;
      bool has = false;
      for (size_t k = 0; k + 1 < s.size() && !has; ++k) has = s[k] == left && s[k + 1] == right;
      if (!has) continue;
      for (size_t k = 0; k + 1 < s.size(); ++k) delta[pair_key(s[k], s[k + 1])] -= w.count;
      std::vector<int32_t> next;
      next.reserve(s.size());
      for (size_t k = 0; k < s.size(); ++k) {
        if (k + 1 < s.size() && s[k] == left && s[k + 1] == right) {
          next.push_back(merged_id);
          ++k;
        } else {
          next.push_back(s[k]);
        }
      }
      s.swap(next);
      for (size_t k = 0; k + 1 < s.size(); ++k) {
        const uint64_t key = pair_key(s[k], s[k + 1]);
        delta[key] += w.count;
        if (key >> 32 == static_cast<uint64_t>(merged_id) || (key & 0xFFFFFFFFu) == static_cast<uint64_t>(merged_id))
          pair_words[key].push_back(wi);
      }
    }
    for (const auto& [key, d] : delta) {
      if (d == 0) continue;
      int64_t& c = pair_count[key];
      c += d;
      if (c <= 0) {
        pair_count.erase(key);
      } else {
        heap.push({c, key});
      }
    }
    pair_words.erase(top.key);
  }
  return Vocab(std::move(tokens));
}

}  // namespace train::text
