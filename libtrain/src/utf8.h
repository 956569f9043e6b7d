#pragma once
// Checking UTF-8: what JSON output (metrics, plans, doctor reports) must be, whatever bytes a
// file name or an environment variable holds. Internal header.
#include <cstddef>
#include <functional>
#include <string>

namespace train::detail {

// The length of the valid UTF-8 sequence at text[i], 0 when it is not one.
inline size_t utf8_sequence(const std::string& text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char low = 0x80, high = 0xbf;  // the range of the second byte (excludes overlongs, surrogates)
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c == 0xe0) n = 3, low = 0xa0;
  else if (c >= 0xe1 && c <= 0xec) n = 3;
  else if (c == 0xed) n = 3, high = 0x9f;
  else if (c >= 0xee && c <= 0xef) n = 3;
  else if (c == 0xf0) n = 4, low = 0x90;
  else if (c >= 0xf1 && c <= 0xf3) n = 4;
  else if (c == 0xf4) n = 4, high = 0x8f;
  else return 0;
  if (i + n > text.size()) return 0;
  if (byte(i + 1) < low || byte(i + 1) > high) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xbf) return 0;
  }
  return n;
}

// `text` with every byte that is not part of valid UTF-8 replaced by `bad(byte)`.
inline std::string repair_utf8(const std::string& text, const std::function<std::string(unsigned char)>& bad) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_sequence(text, i);
    if (n == 0) {
      out += bad(static_cast<unsigned char>(text[i]));
      ++i;
    } else {
      out.append(text, i, n);
      i += n;
    }
  }
  return out;
}

}  // namespace train::detail
