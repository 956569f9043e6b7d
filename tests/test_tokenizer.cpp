#include "testing.h"

#include <fstream>
#include <sstream>

#include "train/errors.h"
#include "train/files.h"
#include "train/text/wordpiece.h"

using namespace train::text;

namespace {

// A small uncased vocab for hand-checked cases.
Vocab hand_vocab() {
  return Vocab({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "un", "##aff", "##able", "cafe", "naive",
                ",", "!", ".", "中", "国", "hello", "world", "##s", "a", "##b", "##c", "abc", "'", "don", "t"});
}

std::vector<std::string> words(const std::string& text, BasicTokenizerOptions options = {}) {
  return basic_tokenize(text, options);
}

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = train::files::join(dir, name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

// The text of one block of tokenizer_sweep.txt: every code point from first to last but the
// surrogates, each as prefix + code point + suffix, joined by single spaces.
std::string block_text(char32_t first, char32_t last, const std::string& prefix, const std::string& suffix) {
  std::string text;
  for (char32_t c = first; c <= last; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    if (!text.empty()) text.push_back(' ');
    text += prefix + encode_utf8(std::u32string(1, c)) + suffix;
  }
  return text;
}

int64_t code_points_in(char32_t first, char32_t last) {
  int64_t n = 0;
  for (char32_t c = first; c <= last; ++c) n += c < 0xD800 || c > 0xDFFF;
  return n;
}

}  // namespace

TEST_CASE("basic tokenizer: accents, case, punctuation, CJK, whitespace, controls", "[tokenizer]") {
  CHECK(words("Café  Naïve!") == std::vector<std::string>{"cafe", "naive", "!"});
  // NFD + drop non-spacing marks also handles decomposed input.
  CHECK(words("Cafe\u0301") == std::vector<std::string>{"cafe"});
  // Cased: accents and case stay.
  BasicTokenizerOptions cased;
  cased.lowercase = false;
  CHECK(words("Café Naïve", cased) == std::vector<std::string>{"Café", "Naïve"});
  // Explicit strip_accents without lower-casing.
  cased.strip_accents = true;
  CHECK(words("Café", cased) == std::vector<std::string>{"Cafe"});
  // Punctuation: ASCII and Unicode P* are single words; symbols (S*) like $ and € are ASCII
  // punctuation or plain characters.
  CHECK(words("don't stop—ever…") == std::vector<std::string>{"don", "'", "t", "stop", "—", "ever", "…"});
  CHECK(words("5€ $5") == std::vector<std::string>{"5€", "$", "5"});
  // CJK ideographs are split out; kana and Hangul are not.
  CHECK(words("中国人abc") == std::vector<std::string>{"中", "国", "人", "abc"});
  BasicTokenizerOptions keep;
  keep.lowercase = false;  // (uncased, NFD would also decompose Hangul syllables into jamo)
  CHECK(words("カタカナ한국", keep) == std::vector<std::string>{"カタカナ한국"});
  // Whitespace of every kind separates; controls, format characters, NUL and U+FFFD vanish.
  CHECK(words("a\tb\nc\u00a0d\u3000e\u2028f") == std::vector<std::string>{"a", "b", "c", "d", "e", "f"});
  CHECK(words(std::string("ab\x00" "c\x07" "d\u200be\ufeff\ufffdf", 17)) == std::vector<std::string>{"abcdef"});
  CHECK(words("   ").empty());
  CHECK(words("").empty());
  // Full lower-case mappings: U+0130 (İ) lower-cases to i + U+0307, whose mark is then dropped.
  CHECK(words("İSTANBUL Straße ΑΘΗΝΑ") == std::vector<std::string>{"istanbul", "straße", "αθηνα"});
  // Invalid UTF-8 decodes to U+FFFD, which cleaning removes.
  CHECK(words("ok\xff\xfe" "fine") == std::vector<std::string>{"okfine"});
  // Character classes and mappings are those of tokenizers 0.23.3's older Unicode tables, not
  // today's (the oracle tests check every code point; these need no Python): U+2E52 (Po since
  // Unicode 13) is a letter there, U+1AC0 (Mn since 14) is kept, U+1734 (Mc since 14) is a mark
  // and dropped, U+166D (So since 12) is punctuation, U+0890 (Cf since 14) is kept, U+11938
  // does not decompose; but U+A7CB (Unicode 16) does lower-case, by Rust's newer tables.
  CHECK(words("a\u2e52b cafe\u1ac0 ha\u1734b x\u166dy a\u0890b") ==
        std::vector<std::string>{"a\u2e52b", "cafe\u1ac0", "hab", "x", "\u166d", "y", "a\u0890b"});
  CHECK(normalize("\U00011938\ua7cb", {}) == std::u32string{0x11938, 0x264});
}

TEST_CASE("UTF-8 round trip", "[tokenizer]") {
  const std::string text = "aé中😀\u0301";
  const std::u32string decoded = decode_utf8(text);
  CHECK(decoded.size() == 5);
  CHECK(decoded[3] == 0x1F600);
  CHECK(encode_utf8(decoded) == text);
  // Overlong encoding and a lone surrogate are rejected byte by byte.
  CHECK(decode_utf8("\xc0\xaf") == std::u32string{0xFFFD, 0xFFFD});
  CHECK(decode_utf8("\xed\xa0\x80") == std::u32string{0xFFFD, 0xFFFD, 0xFFFD});
}

TEST_CASE("WordPiece: ## splitting, unknown words, long words, specials, encoding", "[tokenizer]") {
  const WordPieceTokenizer tok(hand_vocab());
  CHECK(tok.tokenize("unaffable") == std::vector<std::string>{"un", "##aff", "##able"});
  CHECK(tok.tokenize("The Unaffable café, naïve!") ==
        std::vector<std::string>{"the", "un", "##aff", "##able", "cafe", ",", "naive", "!"});
  // Greedy longest match first: "abc" beats "a" + "##b" + "##c".
  CHECK(tok.tokenize("abc abcb ab") == std::vector<std::string>{"abc", "abc", "##b", "a", "##b"});
  // A word with any piece missing is one [UNK], not partial pieces.
  CHECK(tok.tokenize("unaffablex hello") == std::vector<std::string>{"[UNK]", "hello"});
  CHECK(tok.tokenize("中国美") == std::vector<std::string>{"中", "国", "[UNK]"});
  // Words over 100 code points are [UNK]; exactly 100 are tokenized.
  const std::string hundred = "a" + std::string(99, 'b');
  CHECK(tok.tokenize(hundred).size() == 100);
  CHECK(tok.tokenize(hundred + "b") == std::vector<std::string>{"[UNK]"});
  // Special tokens written in the text are recognised, unless disabled.
  CHECK(tok.tokenize_ids("hello [MASK] world") == std::vector<int32_t>{16, 4, 17});
  WordPieceOptions literal;
  literal.match_special_tokens = false;
  CHECK(WordPieceTokenizer(hand_vocab(), literal).tokenize("[MASK]") == std::vector<std::string>{"[UNK]", "[UNK]", "[UNK]"});

  const Encoding e = tok.encode("hello world", 0, 6);
  CHECK(e.ids == std::vector<int32_t>{2, 16, 17, 3, 0, 0});
  CHECK(e.attention_mask == std::vector<uint8_t>{1, 1, 1, 1, 0, 0});
  CHECK(e.type_ids == std::vector<int32_t>{0, 0, 0, 0, 0, 0});
  CHECK(tok.encode("hello world hello", 4).ids == std::vector<int32_t>{2, 16, 17, 3});
  const Encoding pair = tok.encode_pair("hello world hello", "the", 6);
  CHECK(pair.ids == std::vector<int32_t>{2, 16, 17, 3, 5, 3});
  CHECK(pair.type_ids == std::vector<int32_t>{0, 0, 0, 0, 1, 1});
  // Both too long for 3 tokens: tokenizers' longest-first gives the shorter budget / 2 = 1 and
  // the longer the other 2, whichever comes first (checked against tokenizers 0.23).
  CHECK(tok.encode_pair("hello world hello world", "[MASK] the", 6).ids == std::vector<int32_t>{2, 16, 17, 3, 4, 3});
  CHECK(tok.encode_pair("the", "hello world hello world", 6).ids == std::vector<int32_t>{2, 5, 3, 16, 17, 3});
  CHECK(tok.encode_pair("hello world hello", "the the the", 6).ids == std::vector<int32_t>{2, 16, 3, 5, 5, 3});
  CHECK_THROWS_AS(tok.encode("hello", 1), std::invalid_argument);
  CHECK(tok.decode(tok.encode("the unaffable world", 0, 8).ids) == "the unaffable world");
}

TEST_CASE("special tokens in the text: leftmost first and longest at a position when adjacent or overlapping", "[tokenizer]") {
  const WordPieceTokenizer tok(hand_vocab());
  // Adjacent, glued to words, inside brackets that are not part of them.
  CHECK(tok.tokenize_ids("[MASK][MASK]the[SEP]the[CLS]") == std::vector<int32_t>{4, 4, 5, 3, 5, 2});
  CHECK(tok.tokenize("[[MASK]] [MAS[MASK]K]") ==
        std::vector<std::string>{"[UNK]", "[MASK]", "[UNK]", "[UNK]", "[UNK]", "[MASK]", "[UNK]", "[UNK]"});
  // Special tokens that overlap each other: sep "A-", mask "-B", cls "A-B" (as plain text each
  // would become other pieces: "a", "-", "b"). The expected pieces are what Hugging Face's
  // tokenizers 0.23.3 gives for this vocab and these tokens. Where a match swallows the start of
  // another token's occurrence ("A-B-B": the "-B" at 1), that token must be looked for again
  // after the match, not reused and not given up.
  WordPieceOptions options;
  options.unk_token = "<unk>";
  options.pad_token = "<pad>";
  options.sep_token = "A-";
  options.mask_token = "-B";
  options.cls_token = "A-B";
  const WordPieceTokenizer overlapping(Vocab({"<pad>", "<unk>", "A-B", "A-", "-B", "a", "b", "x", "-", "##b"}), options);
  auto pieces = [&](const std::string& text) { return overlapping.tokenize(text); };
  CHECK(pieces("A-B") == std::vector<std::string>{"A-B"});
  CHECK(pieces("A--B") == std::vector<std::string>{"A-", "-B"});
  CHECK(pieces("xA-B-B") == std::vector<std::string>{"x", "A-B", "-B"});
  CHECK(pieces("A- b -B") == std::vector<std::string>{"A-", "b", "-B"});
  CHECK(pieces("aA-Bb") == std::vector<std::string>{"a", "A-B", "b"});
  CHECK(pieces("A-B-B") == std::vector<std::string>{"A-B", "-B"});
  CHECK(pieces("A-BA-") == std::vector<std::string>{"A-B", "A-"});
  CHECK(pieces("-B-B") == std::vector<std::string>{"-B", "-B"});
  CHECK(pieces("A-A-B") == std::vector<std::string>{"A-", "A-B"});
  // Many of them, as in a masked document: each found once, in order.
  std::string many;
  std::vector<int32_t> expected;
  for (int i = 0; i < 1000; ++i) {
    many += i % 3 == 0 ? "[MASK]" : i % 3 == 1 ? "the [SEP]" : "[CLS][PAD]";
    if (i % 3 == 0) expected.push_back(4);
    if (i % 3 == 1) expected.insert(expected.end(), {5, 3});
    if (i % 3 == 2) expected.insert(expected.end(), {2, 0});
  }
  CHECK(tok.tokenize_ids(many) == expected);
}

TEST_CASE("vocab file errors name the file and line", "[tokenizer]") {
  const std::string dir = train::files::make_temp_directory("vocab");
  auto message = [](const std::string& path) {
    try {
      Vocab::load(path);
    } catch (const train::DataError& e) {
      CHECK(e.exit_code() == train::kExitData);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(message(dir + "/missing.txt"), Catch::Contains("missing.txt: cannot open vocab file"));
  CHECK_THAT(message(write_file(dir, "empty.txt", "")), Catch::Contains("empty.txt: vocab file is empty"));
  CHECK_THAT(message(write_file(dir, "blank.txt", "[PAD]\n\nthe\n")), Catch::Contains("blank.txt:2: empty line"));
  CHECK_THAT(message(write_file(dir, "dup.txt", "[PAD]\nthe\r\nthe\n")),
             Catch::Contains("dup.txt:3: token 'the' repeats line 2"));
  const std::string no_unk = write_file(dir, "nounk.txt", "[PAD]\n[CLS]\n[SEP]\n[MASK]\nthe\n");
  CHECK_THROWS_WITH(WordPieceTokenizer::from_file(no_unk), Catch::Contains("nounk.txt: the vocab has no unknown token '[UNK]'"));
  // A leading byte order mark is refused by name: Hugging Face's tokenizers and transformers keep
  // it in the first token ("\uFEFF[PAD]", so they have no [PAD]), where skipping it would give
  // other ids and keeping it failed later with "the vocab has no padding token '[PAD]'".
  CHECK_THAT(message(write_file(dir, "bom.txt", "\xEF\xBB\xBF[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")),
             Catch::Contains("bom.txt:1: vocab file starts with a UTF-8 byte order mark"));
  // U+FEFF anywhere else is an ordinary character of a token, as it is for them.
  CHECK(Vocab::load(write_file(dir, "feff.txt", "[PAD]\n\xEF\xBB\xBFx\n")).find("\xEF\xBB\xBFx") == 1);
  // CRLF files load like LF files.
  const Vocab crlf = Vocab::load(write_file(dir, "crlf.txt", "[PAD]\r\n[UNK]\r\nthe\r\n"));
  CHECK(crlf.find("the") == 2);
  train::files::remove_all(dir);
}

TEST_CASE("vocab builder learns WordPiece merges that cover its corpus", "[tokenizer]") {
  VocabBuilderOptions options;
  options.vocab_size = 60;
  options.min_frequency = 2;
  VocabBuilder builder(options);
  for (int i = 0; i < 20; ++i) builder.add_text("the theory of the thermal thing; then there they were. Unthinkable!");
  const Vocab vocab = builder.build();
  CHECK(vocab.size() <= 60);
  CHECK(vocab.token(0) == "[PAD]");
  CHECK(vocab.token(4) == "[MASK]");
  CHECK(vocab.contains("the"));     // the most frequent merge chain
  CHECK(vocab.contains("##e"));     // characters seen inside words in both forms
  CHECK(vocab.contains("t"));
  // Characters only ever at the start of a word have no "##" form: punctuation is always a word
  // of its own, and "u" here only begins "unthinkable". Their slots go to merges.
  for (const std::string c : {";", ".", "!", "u"}) {
    CAPTURE(c);
    CHECK(vocab.contains(c));
    CHECK_FALSE(vocab.contains("##" + c));
  }
  const WordPieceTokenizer tok(vocab);
  // Every word of the corpus is covered (no [UNK]), with "the" a single piece.
  for (const auto& piece : tok.tokenize("the theory of the thermal thing; then there they were. Unthinkable!"))
    CHECK(piece != "[UNK]");
  CHECK(tok.tokenize("the") == std::vector<std::string>{"the"});
  // Deterministic: the same corpus gives the same vocab; round trip through a file.
  VocabBuilder again(options);
  for (int i = 0; i < 20; ++i) again.add_text("the theory of the thermal thing; then there they were. Unthinkable!");
  CHECK(again.build().tokens() == vocab.tokens());
  const std::string dir = train::files::make_temp_directory("vocab");
  vocab.save(dir + "/vocab.txt");
  CHECK(Vocab::load(dir + "/vocab.txt").tokens() == vocab.tokens());
  train::files::remove_all(dir);

  // CJK ideographs are split into words of their own as well: no "##" forms for them.
  VocabBuilder cjk(options);
  for (int i = 0; i < 5; ++i) cjk.add_text("中国 and 中文, the words.");
  const Vocab cjk_vocab = cjk.build();
  for (const std::string c : {"中", "国", "文", ","}) {
    CAPTURE(c);
    CHECK(cjk_vocab.contains(c));
    CHECK_FALSE(cjk_vocab.contains("##" + c));
  }
  CHECK(cjk_vocab.contains("##n"));
  for (const auto& piece : WordPieceTokenizer(cjk_vocab).tokenize("中国 and 中文, the words.")) {
    CHECK(piece != "[UNK]");
  }
}

TEST_CASE("tokenizer ids equal Hugging Face's BertWordPieceTokenizer on MiniLM's vocab", "[tokenizer][oracle][minilm]") {
  const std::string dir = train::files::make_temp_directory("tokenizer_oracle");
  REQUIRE(train::testing::run_python("tokenizer_oracle.py", dir) == 0);
  const WordPieceTokenizer tok = WordPieceTokenizer::from_file(dir + "/vocab.txt");
  REQUIRE(tok.vocab().size() == 30522);
  std::ifstream in(dir + "/tokenizer_cases.txt");
  std::string hex, line;
  int cases = 0, mismatches = 0;
  while (std::getline(in, hex) && std::getline(in, line)) {
    std::vector<int32_t> expected;
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) expected.push_back(id);
    const std::string text = unhex(hex);
    const std::vector<int32_t> got = tok.encode(text).ids;
    ++cases;
    if (got != expected) {
      ++mismatches;
      if (mismatches <= 5) UNSCOPED_INFO("mismatch on: " << text);
    }
  }
  CHECK(mismatches == 0);  // first, to carry the UNSCOPED_INFO messages
  CHECK(cases > 1000);
  train::files::remove_all(dir);
}

// Every code point, in the contexts tokenizer_oracle.py --every-code-point lists, against
// Hugging Face's tokenizers with MiniLM's tokenizer.json: the ids, and BertNormalizer's output.
// Hand-written texts cannot reach the hundreds of code points whose class tokenizers' older
// Unicode tables give differently from today's.
TEST_CASE("tokenizer ids and normalization equal Hugging Face tokenizers' on every code point", "[tokenizer][oracle][minilm]") {
  const std::string dir = train::files::make_temp_directory("tokenizer_sweep");
  REQUIRE(train::testing::run_python("tokenizer_oracle.py", "--every-code-point " + dir) == 0);
  const Vocab vocab = Vocab::load(dir + "/vocab.txt");
  WordPieceOptions cased_options;
  cased_options.basic.lowercase = false;
  const WordPieceTokenizer uncased(vocab), cased(vocab, cased_options);
  std::ifstream in(dir + "/tokenizer_sweep.txt");
  REQUIRE(in);
  int64_t id_points = 0, normalized_points = 0, mismatches = 0;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string kind, first_hex, last_hex;
    fields >> kind;
    if (kind == "ids") {
      int lower = 0;
      std::string prefix, suffix;
      fields >> lower >> prefix >> suffix >> first_hex >> last_hex;
      const auto first = static_cast<char32_t>(std::stoul(first_hex, nullptr, 16));
      const auto last = static_cast<char32_t>(std::stoul(last_hex, nullptr, 16));
      std::vector<int32_t> expected;
      for (std::string id; fields >> id;) {
        const size_t star = id.find('*');
        const int count = star == std::string::npos ? 1 : std::stoi(id.substr(star + 1));
        expected.insert(expected.end(), static_cast<size_t>(count), std::stoi(id.substr(0, star)));
      }
      const std::string text =
          block_text(first, last, prefix == "-" ? "" : unhex(prefix), suffix == "-" ? "" : unhex(suffix));
      id_points += code_points_in(first, last);
      if ((lower ? uncased : cased).tokenize_ids(text) != expected) {
        if (++mismatches <= 5) UNSCOPED_INFO("ids differ in U+" << first_hex << "-U+" << last_hex << " (lower " << lower
                                             << ", context " << prefix << " " << suffix << ")");
      }
    } else if (kind == "normalized") {
      fields >> first_hex >> last_hex;
      const auto first = static_cast<char32_t>(std::stoul(first_hex, nullptr, 16));
      const auto last = static_cast<char32_t>(std::stoul(last_hex, nullptr, 16));
      // The output is the rest of the line after three fields and their single spaces; it may
      // itself start with a space (a padded CJK ideograph), which >> would skip.
      const size_t at = kind.size() + first_hex.size() + last_hex.size() + 3;
      if (at > line.size()) FAIL("short line in tokenizer_sweep.txt: " << line);
      const std::string text = block_text(first, last, "", "");
      const std::string expected = line.compare(at, std::string::npos, "=") == 0 ? text : line.substr(at);
      normalized_points += code_points_in(first, last);
      if (encode_utf8(normalize(text, BasicTokenizerOptions{})) != expected) {
        if (++mismatches <= 5) UNSCOPED_INFO("normalization differs in U+" << first_hex << "-U+" << last_hex);
      }
    } else {
      FAIL("unknown line in tokenizer_sweep.txt: " << line.substr(0, 80));
    }
  }
  // The loop makes no assertion unless it fails, so the UNSCOPED_INFO messages stay for this one.
  CHECK(mismatches == 0);
  // Every code point but the 2,048 surrogates, in each of the three id contexts and once normalized.
  CHECK(id_points == 3 * (0x110000 - 0x800));
  CHECK(normalized_points == 0x110000 - 0x800);
  train::files::remove_all(dir);
}
