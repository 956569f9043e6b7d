#pragma once
// "Did you mean" for every name a user types: config keys, enum values, model names, device
// profiles. Internal header.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace train::detail {

// Levenshtein distance: insertions, deletions and substitutions.
inline size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> previous(b.size() + 1), current(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitution = previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, substitution});
    }
    std::swap(previous, current);
  }
  return previous[b.size()];
}

inline std::string ascii_lower(std::string s) {
  for (char& c : s) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  return s;
}

// The index of the candidate closest to `word` if it is a plausible typo. Case does not count:
// "FP16" -> "fp16", "LR" -> "lr". Otherwise at most 2 edits, or a third of a long word, and never
// one that replaces every character of `word`. Failing that, a candidate of 4 or more characters
// that starts `word`, or that `word` (4 or more) starts: "optimizer" -> "optim", "sched" ->
// "schedule". Failing that, one that has `word` (4 or more) as one of its words: "steps" ->
// "max_steps".
inline std::optional<size_t> closest_index(const std::string& typed, const std::vector<std::string>& typed_candidates) {
  const std::string word = ascii_lower(typed);
  std::vector<std::string> candidates;
  for (const std::string& c : typed_candidates) candidates.push_back(ascii_lower(c));
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i] == word) return i;
  }
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::optional<size_t> best;
  size_t best_distance = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const size_t d = edit_distance(word, candidates[i]);
    if (d <= limit && d < word.size() && (!best || d < best_distance)) {
      best = i;
      best_distance = d;
    }
  }
  if (best) return best;
  auto starts = [](const std::string& text, const std::string& prefix) {
    return prefix.size() >= 4 && text.size() > prefix.size() && text.compare(0, prefix.size(), prefix) == 0;
  };
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!starts(word, candidates[i]) && !starts(candidates[i], word)) continue;
    const size_t d = edit_distance(word, candidates[i]);
    if (!best || d < best_distance) {
      best = i;
      best_distance = d;
    }
  }
  if (best || word.size() < 4) return best;
  // A word of a multi-word name ("steps" -> "max_steps"): the first that ends with it, else the
  // first that holds it.
  auto holds = [&](const std::string& name, bool last_only) {
    for (size_t at = name.find(word); at != std::string::npos; at = name.find(word, at + 1)) {
      const size_t end = at + word.size();
      const bool starts_word = at == 0 || name[at - 1] == '_' || name[at - 1] == '-';
      const bool ends_word = end == name.size() || (!last_only && (name[end] == '_' || name[end] == '-'));
      if (starts_word && ends_word && name.size() > word.size()) return true;
    }
    return false;
  };
  for (const bool last_only : {true, false}) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (holds(candidates[i], last_only)) return i;
    }
  }
  return std::nullopt;
}

// The closest candidate itself, or "" when none is plausible.
inline std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  const auto i = closest_index(word, candidates);
  return i ? candidates[*i] : std::string();
}

}  // namespace train::detail
