// Fuzz target: the WordPiece tokenizer (UTF-8 decoding, normalisation, basic tokenization,
// WordPiece, encoding) and the vocab.txt reader.
// Input: text, tokenized with a small built-in vocab; or, when it holds a form feed, a vocab.txt
// before the first form feed and the text after it.
// Properties: re-encoding decoded UTF-8 is stable; encodings have consistent lengths, respect
// max_length and pad_to, and hold only ids of the vocab; decode accepts every id produced.
#include <train/errors.h>
#include <train/text/wordpiece.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_input.h"

namespace {

using train::fuzz::violated;
using train::text::Encoding;
using train::text::Vocab;
using train::text::WordPieceTokenizer;

const WordPieceTokenizer& builtin_tokenizer() {
  static const WordPieceTokenizer tokenizer(Vocab({
      "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "un", "##aff", "##able", "play",
      "##ing", "##s", "##ed", "cafe", "resume", "!", ",", ".", "'", "?", "x", "##x", "e", "##e",
      "\xe4\xb8\xad", "\xe6\x96\x87", "\xc3\xa9", "\xce\xb1", "##\xce\xb2", "1", "##2", "hello", "world",
  }));
  return tokenizer;
}

void check_encoding(const WordPieceTokenizer& tok, const Encoding& e, int64_t max_length, int64_t pad_to,
                    const char* what) {
  if (e.ids.size() != e.type_ids.size() || e.ids.size() != e.attention_mask.size()) {
    violated(std::string(what) + ": ids, type_ids and attention_mask differ in length");
  }
  const int64_t n = static_cast<int64_t>(e.ids.size());
  if (pad_to > 0 && n < pad_to) violated(std::string(what) + ": shorter than pad_to");
  if (max_length > 0 && n > std::max(max_length, pad_to)) violated(std::string(what) + ": longer than max_length");
  for (int32_t id : e.ids) {
    if (id < 0 || id >= tok.vocab().size()) violated(std::string(what) + ": id out of the vocab");
  }
  (void)tok.decode(e.ids, true);
  (void)tok.decode(e.ids, false);
}

void exercise(const WordPieceTokenizer& tok, const std::string& text) {
  const std::u32string chars = train::text::decode_utf8(text);
  if (train::text::decode_utf8(train::text::encode_utf8(chars)) != chars) {
    violated("decode_utf8(encode_utf8(decode_utf8(text))) != decode_utf8(text)");
  }
  for (const std::string& piece : tok.tokenize(text)) {
    if (!tok.vocab().contains(piece)) violated("tokenize returned a piece that is not in the vocab");
  }
  const int64_t max_length = 3 + static_cast<int64_t>(text.size() % 13);
  const int64_t pad_to = static_cast<int64_t>(text.size() % 7) * 3;
  check_encoding(tok, tok.encode(text), 0, 0, "encode");
  check_encoding(tok, tok.encode(text, max_length, pad_to), max_length, pad_to, "encode(max_length, pad_to)");
  const size_t tab = text.find('\t');
  if (tab != std::string::npos) {
    const std::string a = text.substr(0, tab), b = text.substr(tab + 1);
    check_encoding(tok, tok.encode_pair(a, b, max_length, pad_to), max_length, pad_to, "encode_pair");
  }
  train::text::BasicTokenizerOptions cased;
  cased.lowercase = false;
  (void)train::text::basic_tokenize(text, cased);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\f');
  if (split == std::string::npos) {
    exercise(builtin_tokenizer(), input);
    return 0;
  }
  const std::string path =
      train::fuzz::write_scratch("vocab.txt", data, split);
  try {
    const WordPieceTokenizer tok = WordPieceTokenizer::from_file(path);
    exercise(tok, input.substr(split + 1));
  } catch (const train::Error&) {
  }
  return 0;
}
