// The token file (writer, memory-mapped reader, its validation), vocab files, MLM masking
// statistics and determinism, TokenDataset's packing, the loader on tokens, and data.kind: tokens.
#include "testing.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "train/config.h"
#include "train/data/factory.h"
#include "train/data/loader.h"
#include "train/data/token_file.h"
#include "train/data/tokens.h"
#include "train/data/transforms.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"

using namespace train::data;
using Catch::Matchers::Contains;
namespace files = train::files;

namespace {

struct TempDir {
  std::string path = files::make_temp_directory("train_test_tokens_");
  ~TempDir() { files::remove_all(path); }
  std::string operator/(const std::string& name) const { return files::join(path, name); }
};

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

void put_u32(std::vector<uint8_t>& bytes, size_t at, uint32_t value) {
  for (int i = 0; i < 4; ++i) bytes[at + i] = static_cast<uint8_t>(value >> (8 * i));
}

void put_u64(std::vector<uint8_t>& bytes, size_t at, uint64_t value) {
  for (int i = 0; i < 8; ++i) bytes[at + i] = static_cast<uint8_t>(value >> (8 * i));
}

template <typename Action>
std::string data_error(Action&& action) {
  try {
    action();
  } catch (const train::DataError& e) {
    return e.what();
  }
  FAIL("expected a DataError");
  return {};
}

// A small vocabulary: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, words 5..29.
constexpr int64_t kPad = 0, kUnk = 1, kCls = 2, kSep = 3, kMask = 4;

TokenFileOptions small_vocab(int64_t vocab_size = 30) {
  TokenFileOptions options;
  options.vocab_size = vocab_size;
  options.special = SpecialTokens{kPad, kUnk, kCls, kSep, kMask};
  return options;
}

// Three documents, the middle one empty: a stream of 10 11 12 S | S | 20 21 22 23 24 S.
const std::vector<std::vector<int64_t>> kSmallCorpus = {{10, 11, 12}, {}, {20, 21, 22, 23, 24}};

std::vector<int64_t> as_vector(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

TokenDatasetOptions dataset_options(const std::string& path, int64_t seq_len, bool pack = true) {
  TokenDatasetOptions options;
  options.path = path;
  options.seq_len = seq_len;
  options.pack = pack;
  return options;
}

// A corpus of `documents` documents of 20..199 word tokens drawn from [first_word, vocab_size).
std::vector<std::vector<int64_t>> random_corpus(int64_t documents, int64_t first_word, int64_t vocab_size,
                                                uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<std::vector<int64_t>> corpus(static_cast<size_t>(documents));
  for (auto& document : corpus) {
    document.resize(20 + rng.below(180));
    for (int64_t& token : document) {
      token = first_word + static_cast<int64_t>(rng.below(static_cast<uint64_t>(vocab_size - first_word)));
    }
  }
  return corpus;
}

}  // namespace

// ---- the file format ----------------------------------------------------------------------------

TEST_CASE("Token files round-trip with 2- and 4-byte tokens", "[data][tokens]") {
  TempDir dir;
  SECTION("uint16, chosen for a small vocabulary") {
    write_token_file(dir / "a.tokens", kSmallCorpus, small_vocab());
    const TokenFile file(dir / "a.tokens");
    CHECK(file.token_bytes() == 2);
    CHECK(file.num_tokens() == 8);
    CHECK(file.num_documents() == 3);
    CHECK(file.vocab_size() == 30);
    CHECK(file.special().pad == kPad);
    CHECK(file.special().unk == kUnk);
    CHECK(file.special().cls == kCls);
    CHECK(file.special().sep == kSep);
    CHECK(file.special().mask == kMask);
    CHECK(file.document_offset(0) == 0);
    CHECK(file.document_offset(1) == 3);
    CHECK(file.document_offset(2) == 3);
    CHECK(file.document_offset(3) == 8);
    CHECK(file.document_length(1) == 0);
    CHECK(file.token(0) == 10);
    CHECK(file.token(7) == 24);
    std::vector<int64_t> tokens(5);
    file.read(3, 5, tokens.data());
    CHECK(tokens == kSmallCorpus[2]);
    CHECK_THROWS_AS(file.token(8), std::out_of_range);
    CHECK_THROWS_AS(file.document_offset(4), std::out_of_range);
    file.verify();
    // Header 128 + 8 tokens x 2 bytes + 4 offsets x 8 bytes, nothing else.
    CHECK(files::file_size(dir / "a.tokens") == 128 + 16 + 32);
  }
  SECTION("uint32 for a large vocabulary, ids above 2^16, no special ids recorded") {
    TokenFileOptions options;
    options.vocab_size = 100000;
    TokenFileWriter writer(dir / "b.tokens", options);
    writer.add_document(std::vector<int32_t>{99999, 0, 65536});
    const uint32_t raw[] = {70000, 5};
    writer.add_document(raw, 2);
    CHECK(writer.num_documents() == 2);
    CHECK(writer.num_tokens() == 5);
    writer.finish();
    const TokenFile file(dir / "b.tokens");
    CHECK(file.token_bytes() == 4);
    CHECK(file.token(0) == 99999);
    CHECK(file.token(2) == 65536);
    CHECK(file.token(3) == 70000);
    CHECK(file.special().cls == -1);
    CHECK(file.special().mask == -1);
    // 128 + 5 x 4 = 148 bytes of header and tokens, padded to 152, then 3 offsets.
    CHECK(files::file_size(dir / "b.tokens") == 152 + 24);
    file.verify();
  }
  SECTION("explicit 4-byte tokens for a small vocabulary") {
    TokenFileOptions options = small_vocab();
    options.token_bytes = 4;
    write_token_file(dir / "c.tokens", kSmallCorpus, options);
    const TokenFile file(dir / "c.tokens");
    CHECK(file.token_bytes() == 4);
    CHECK(file.token(4) == 21);
  }
}

TEST_CASE("The token file writer is atomic and checks its input", "[data][tokens]") {
  TempDir dir;
  const std::string path = dir / "corpus.tokens";
  write_token_file(path, {{5, 6, 7}}, small_vocab());
  const std::vector<uint8_t> original = read_bytes(path);

  {  // abandoned before finish(): the old file stays, no temporary file is left behind
    TokenFileWriter writer(path, small_vocab());
    writer.add_document(std::vector<int64_t>{8, 9});
  }
  CHECK(read_bytes(path) == original);
  CHECK(files::list_directory(dir.path) == std::vector<std::string>{"corpus.tokens"});

  {  // a token outside the vocabulary: that document is rejected, the writer still works
    TokenFileWriter writer(path, small_vocab());
    writer.add_document(std::vector<int64_t>{8, 9});
    try {
      writer.add_document(std::vector<int64_t>{5, 30});
      FAIL("expected std::invalid_argument");
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(std::string(e.what()), Contains(path) && Contains("document 1, position 1") &&
                                            Contains("token 30 is outside the vocabulary [0, 30)"));
    }
    CHECK_THROWS_AS(writer.add_document(std::vector<int64_t>{-1}), std::invalid_argument);
    writer.add_document(std::vector<int64_t>{10});
    writer.finish();
    CHECK_THROWS_AS(writer.add_document(std::vector<int64_t>{10}), std::logic_error);
  }
  const TokenFile file(path);
  CHECK(file.num_documents() == 2);
  CHECK(file.num_tokens() == 3);
  CHECK(files::list_directory(dir.path) == std::vector<std::string>{"corpus.tokens"});

  TokenFileOptions bad = small_vocab();
  bad.vocab_size = 0;
  CHECK_THROWS_AS(TokenFileWriter(dir / "x.tokens", bad), std::invalid_argument);
  bad = small_vocab(70000);
  bad.token_bytes = 2;
  CHECK_THROWS_AS(TokenFileWriter(dir / "x.tokens", bad), std::invalid_argument);
  bad = small_vocab();
  bad.token_bytes = 3;
  CHECK_THROWS_AS(TokenFileWriter(dir / "x.tokens", bad), std::invalid_argument);
  bad = small_vocab();
  bad.special.mask = 30;
  CHECK_THROWS_AS(TokenFileWriter(dir / "x.tokens", bad), std::invalid_argument);
  CHECK_FALSE(files::exists(dir / "x.tokens"));
  // The directory is created when missing.
  write_token_file(dir / "sub/dir/y.tokens", {{5}}, small_vocab());
  CHECK(TokenFile(dir / "sub/dir/y.tokens").num_tokens() == 1);
}

TEST_CASE("Truncated and corrupt token files are errors naming the file", "[data][tokens]") {
  TempDir dir;
  const std::string good = dir / "good.tokens";
  write_token_file(good, kSmallCorpus, small_vocab());
  const std::vector<uint8_t> bytes = read_bytes(good);
  REQUIRE(bytes.size() == 176);
  const std::string bad = dir / "bad.tokens";

  auto error_for = [&](const std::vector<uint8_t>& content) {
    write_bytes(bad, content);
    return data_error([&] { TokenFile file(bad); });
  };
  auto cut = [&](size_t size) { return std::vector<uint8_t>(bytes.begin(), bytes.begin() + size); };
  auto patched = [&](auto&& patch) {
    std::vector<uint8_t> copy = bytes;
    patch(copy);
    return copy;
  };

  CHECK_THAT(data_error([&] { TokenFile file(dir / "missing.tokens"); }),
             Contains(dir / "missing.tokens") && Contains("cannot open"));
  CHECK_THAT(data_error([&] { TokenFile file(dir.path); }), Contains("is a directory, expected a token file"));
  // A named pipe is rejected before open(), which would wait for a writer.
  REQUIRE(::mkfifo((dir / "pipe.tokens").c_str(), 0600) == 0);
  CHECK_THAT(data_error([&] { TokenFile file(dir / "pipe.tokens"); }),
             Contains(dir / "pipe.tokens") && Contains("is a named pipe (FIFO)"));
  CHECK_THAT(error_for({}), Contains(bad) && Contains("truncated token file: 0 bytes"));
  CHECK_THAT(error_for(cut(100)), Contains(bad) && Contains("truncated token file: 100 bytes"));
  CHECK_THAT(error_for(cut(170)), Contains(bad) && Contains("truncated") && Contains("expected 176 bytes") &&
                                      Contains("found 170 bytes"));
  CHECK_THAT(error_for(cut(130)), Contains("truncated"));
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  CHECK_THAT(error_for(longer), Contains("trailing data"));
  CHECK_THAT(error_for(patched([](auto& b) { b[0] = 'X'; })), Contains(bad) && Contains("bad magic"));
  CHECK_THAT(error_for(std::vector<uint8_t>{'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'}),
             Contains("bad magic"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u32(b, 8, 2); })), Contains("unsupported token file version 2"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u32(b, 12, 3); })), Contains("token size 3 bytes"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u64(b, 32, 70000); })), Contains("vocab_size 70000"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u64(b, 16, 9); })), Contains("corrupt header: index_offset"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u64(b, 24, 4); })), Contains("truncated"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u64(b, 16, uint64_t{1} << 62); })), Contains("implausible"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u32(b, 64, 31); })), Contains("special id cls = 31"));
  // The index: 128 + 16 bytes of tokens, then offsets 0, 3, 3, 8.
  CHECK_THAT(error_for(patched([](auto& b) { put_u64(b, 144, 1); })), Contains("offsets[0] is not 0"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u64(b, 152, 4); })),
             Contains("corrupt index: document 1 ends at token 3, before its start 4"));
  CHECK_THAT(error_for(patched([](auto& b) { put_u64(b, 168, 7); })),
             Contains("the documents end at token 7, not at the 8 tokens"));

  // Damage the header's checksum cannot see structurally: verify() finds it, and a token outside
  // the vocabulary is reported when it is read.
  write_bytes(bad, patched([](auto& b) { b[128 + 2 * 4] = 29; }));
  const TokenFile flipped(bad);
  CHECK_THAT(data_error([&] { flipped.verify(); }), Contains(bad) && Contains("checksum mismatch"));
  write_bytes(bad, patched([](auto& b) { b[128 + 2 * 4] = 200; }));
  const TokenFile out_of_vocab(bad);
  CHECK_THAT(data_error([&] { out_of_vocab.token(4); }),
             Contains(bad) && Contains("token 200 at position 4 is outside the vocabulary [0, 30)"));
  TokenDataset dataset(dataset_options(bad, 6));
  CHECK_THAT(data_error([&] { dataset.get(1, 0); }), Contains(bad) && Contains("token 200"));

  // Truncated after it was opened (rewritten in place while a run reads it): an error naming the
  // file. Reading the mapping's lost pages faults with SIGBUS, which files::MappedFile catches.
  const std::string moving = dir / "moving.tokens";
  write_token_file(moving, kSmallCorpus, small_vocab());
  const TokenFile opened(moving);
  TokenDataset reading(dataset_options(moving, 6));
  REQUIRE(::truncate(moving.c_str(), 0) == 0);
  CHECK_THAT(data_error([&] { opened.token(4); }), Contains(moving) && Contains("shorter than when it was opened"));
  CHECK_THAT(data_error([&] { opened.document_offset(2); }), Contains("shorter than when it was opened"));
  CHECK_THAT(data_error([&] { opened.verify(); }), Contains("shorter than when it was opened"));
  CHECK_THAT(data_error([&] { reading.get(1, 0); }), Contains(moving) && Contains("shorter than when it was opened"));
}

namespace {

// The scenarios of the test below, each in a process of its own (this binary, started again with
// TRAIN_TEST_WORKER=mapped_file): the SIGBUS handler is installed once per process, with the
// first mapping.
//   chained: a SIGBUS handler installed before the first mapping still gets every SIGBUS that
//            is not a fault of a MappedFile copy (exit 42), and copy() still catches its own.
//   default: with no handler before it, a fault outside copy() ends the process with SIGBUS
//            (not swallowed, not repeated forever: alarm() would end it with SIGALRM).
[[noreturn]] void mapped_file_scenario(const std::string& scenario, const std::string& dir) {
  alarm(20);
  const struct rlimit no_core {0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  if (scenario == "chained") {
    struct sigaction earlier {};
    earlier.sa_handler = [](int) { _exit(42); };
    sigemptyset(&earlier.sa_mask);
    if (sigaction(SIGBUS, &earlier, nullptr) != 0) _exit(10);
  }
  const std::string path = dir + "/mapped-" + scenario;
  {
    std::ofstream out(path, std::ios::binary);
    out << std::string(3 * 4096, 'x');
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) _exit(11);
  const train::files::MappedFile mapped(fd, 3 * 4096, path);
  auto* raw = static_cast<const volatile char*>(::mmap(nullptr, 3 * 4096, PROT_READ, MAP_SHARED, fd, 0));
  if (raw == MAP_FAILED) _exit(12);
  ::close(fd);
  char buffer[64];
  if (!mapped.copy(2 * 4096, buffer, sizeof buffer) || buffer[0] != 'x') _exit(13);
  if (::truncate(path.c_str(), 4096) != 0) _exit(14);
  if (mapped.copy(2 * 4096 + 8, buffer, sizeof buffer)) _exit(15);  // the lost page: caught
  if (!mapped.copy(100, buffer, sizeof buffer) || buffer[0] != 'x') _exit(16);  // still there
  if (scenario == "chained") ::raise(SIGBUS);  // -> the earlier handler: exit 42
  const char lost = raw[2 * 4096];  // not through copy(): the default action
  _exit(lost == 'x' ? 17 : 18);
}

}  // namespace

int mapped_file_test_worker() {
  const char* scenario = std::getenv("TRAIN_TEST_MAPPED_FILE");
  const char* dir = std::getenv("TRAIN_TEST_MAPPED_FILE_DIR");
  if (scenario == nullptr || dir == nullptr) return 2;
  mapped_file_scenario(scenario, dir);
}

TEST_CASE("files::MappedFile catches only its own faults: other SIGBUSes reach the earlier handler or end the process",
          "[tokens][process]") {
  TempDir dir;
  auto run = [&](const char* scenario) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::setenv("TRAIN_TEST_WORKER", "mapped_file", 1);
      ::setenv("TRAIN_TEST_MAPPED_FILE", scenario, 1);
      ::setenv("TRAIN_TEST_MAPPED_FILE_DIR", dir.path.c_str(), 1);
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, STDOUT_FILENO);
      ::execl("/proc/self/exe", "train_tests", static_cast<char*>(nullptr));
      _exit(127);
    }
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    return status;
  };
  const int chained = run("chained");
  INFO("status " << chained);
  CHECK(WIFEXITED(chained));
  CHECK(WEXITSTATUS(chained) == 42);
  const int plain = run("default");
  INFO("status " << plain);
  CHECK(WIFSIGNALED(plain));
  CHECK(WTERMSIG(plain) == SIGBUS);
}

TEST_CASE("Vocab files give the size, the special ids and the bracketed tokens", "[data][tokens]") {
  TempDir dir;
  std::ofstream(dir / "vocab.txt") << "[PAD]\n[unused0]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n##s\n[\n]\r\nlast";
  const VocabInfo vocab = read_vocab_file(dir / "vocab.txt");
  CHECK(vocab.size == 11);
  CHECK(vocab.special.pad == 0);
  CHECK(vocab.special.unk == 2);
  CHECK(vocab.special.cls == 3);
  CHECK(vocab.special.sep == 4);
  CHECK(vocab.special.mask == 5);
  CHECK(vocab.bracketed == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
  std::ofstream(dir / "empty.txt") << "";
  CHECK_THAT(data_error([&] { read_vocab_file(dir / "empty.txt"); }), Contains("empty vocab file"));
  CHECK_THAT(data_error([&] { read_vocab_file(dir / "none.txt"); }), Contains(dir / "none.txt"));
}

// ---- samples ------------------------------------------------------------------------------------

TEST_CASE("Packed samples run across documents with [SEP] between them", "[data][tokens]") {
  TempDir dir;
  write_token_file(dir / "c.tokens", kSmallCorpus, small_vocab());
  // seq_len 6: bodies of 4 stream tokens; the stream 10 11 12 S S 20 21 22 23 24 S has 11.
  const TokenDataset packed(dataset_options(dir / "c.tokens", 6));
  REQUIRE(packed.size() == 3);
  CHECK(as_vector(packed.tokens(0)) == std::vector<int64_t>{kCls, 10, 11, 12, kSep, kSep});
  CHECK(as_vector(packed.tokens(1)) == std::vector<int64_t>{kCls, kSep, 20, 21, 22, kSep});
  CHECK(as_vector(packed.tokens(2)) == std::vector<int64_t>{kCls, 23, 24, kSep, kSep, kPad});
  CHECK_THROWS_AS(packed.tokens(3), std::out_of_range);
  CHECK(packed.input_shape() == std::vector<int64_t>{6});
  CHECK(packed.num_classes() == 30);
  CHECK_THAT(packed.describe(), Contains("8 tokens in 3 documents") && Contains("3 samples of 6 tokens (packed)"));

  // One long sample holds everything.
  const TokenDataset whole(dataset_options(dir / "c.tokens", 16));
  REQUIRE(whole.size() == 1);
  CHECK(as_vector(whole.tokens(0)) ==
        std::vector<int64_t>{kCls, 10, 11, 12, kSep, kSep, 20, 21, 22, 23, 24, kSep, kSep, kPad, kPad, kPad});

  // One sample per document, cut to seq_len - 2 and padded.
  const TokenDataset documents(dataset_options(dir / "c.tokens", 5, /*pack=*/false));
  REQUIRE(documents.size() == 3);
  CHECK(as_vector(documents.tokens(0)) == std::vector<int64_t>{kCls, 10, 11, 12, kSep});
  CHECK(as_vector(documents.tokens(1)) == std::vector<int64_t>{kCls, kSep, kPad, kPad, kPad});
  CHECK(as_vector(documents.tokens(2)) == std::vector<int64_t>{kCls, 20, 21, 22, kSep});

  // get(): the target is -100 except at the selected positions, which hold the original token;
  // special positions are never selected.
  for (int64_t i = 0; i < packed.size(); ++i) {
    for (uint64_t seed = 0; seed < 50; ++seed) {
      const Example example = packed.get(i, seed);
      const std::vector<int64_t> original = as_vector(packed.tokens(i));
      const std::vector<int64_t> input = as_vector(example.input);
      const std::vector<int64_t> target = as_vector(example.target);
      CHECK(example.input.scalar_type() == torch::kLong);
      CHECK(example.target.scalar_type() == torch::kLong);
      int64_t selected = 0;
      for (size_t p = 0; p < original.size(); ++p) {
        if (target[p] == kIgnoreIndex) {
          CHECK(input[p] == original[p]);
        } else {
          ++selected;
          CHECK(target[p] == original[p]);
          CHECK(original[p] >= 5);
        }
        if (original[p] < 5) CHECK(target[p] == kIgnoreIndex);
      }
      CHECK(selected >= 1);  // at least one prediction when the sample has a word
    }
  }
}

TEST_CASE("Packed samples of a corpus of many documents match the stream built whole", "[data][tokens]") {
  // 1,000 documents over 16 blocks of the sparse index: runs of empty documents (a sample then
  // spans more documents than one window of offsets), single tokens and long documents.
  SplitMix64 rng(7);
  std::vector<std::vector<int64_t>> corpus(1000);
  for (size_t d = 0; d < corpus.size(); ++d) {
    const uint64_t kind = (d / 50) % 4;
    const uint64_t length = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? rng.below(5) : 20 + rng.below(300);
    for (uint64_t i = 0; i < length; ++i) corpus[d].push_back(5 + static_cast<int64_t>(rng.below(25)));
  }
  TempDir dir;
  write_token_file(dir / "c.tokens", corpus, small_vocab());
  const TokenFile file(dir / "c.tokens");
  std::vector<int64_t> stream;
  std::vector<int64_t> starts;  // stream position of each document's first token
  std::vector<int64_t> offsets{0};
  for (const auto& document : corpus) {
    starts.push_back(static_cast<int64_t>(stream.size()));
    stream.insert(stream.end(), document.begin(), document.end());
    stream.push_back(kSep);
    offsets.push_back(offsets.back() + static_cast<int64_t>(document.size()));
  }
  std::vector<int64_t> read_offsets(offsets.size());
  file.document_offsets(0, static_cast<int64_t>(offsets.size()), read_offsets.data());
  CHECK(read_offsets == offsets);
  CHECK(file.document_length(999) == static_cast<int64_t>(corpus[999].size()));
  CHECK_THROWS_AS(file.document_length(1000), std::out_of_range);
  CHECK_THROWS_AS(file.document_offsets(990, 12, read_offsets.data()), std::out_of_range);

  // find_document against a linear scan, in the stream with [SEP]s and in the bare corpus.
  for (int64_t separators : {0, 1}) {
    const int64_t size = offsets.back() + separators * 1000;
    for (int64_t position = 0; position <= size + 3; ++position) {
      int64_t expected = 0;
      for (int64_t d = 0; d < 1000; ++d) {
        if (offsets[static_cast<size_t>(d)] + d * separators <= position) expected = d;
      }
      if (file.find_document(position, separators) != expected) {
        FAIL("find_document(" << position << ", " << separators << ") = " << file.find_document(position, separators)
                              << ", expected " << expected);
      }
    }
  }
  CHECK_THROWS_AS(file.find_document(-1), std::out_of_range);

  for (int64_t seq_len : {3, 7, 64, 300}) {
    const TokenDataset packed(dataset_options(dir / "c.tokens", seq_len));
    const int64_t body = seq_len - 2;
    REQUIRE(packed.size() == (static_cast<int64_t>(stream.size()) + body - 1) / body);
    for (int64_t i = 0; i < packed.size(); ++i) {
      std::vector<int64_t> expected{kCls};
      const auto from = stream.begin() + i * body;
      expected.insert(expected.end(), from, stream.begin() + std::min<int64_t>((i + 1) * body, stream.size()));
      expected.push_back(kSep);
      expected.resize(static_cast<size_t>(seq_len), kPad);
      if (as_vector(packed.tokens(i)) != expected) FAIL("seq_len " << seq_len << ": sample " << i << " differs");
    }
  }
  const TokenDataset documents(dataset_options(dir / "c.tokens", 12, /*pack=*/false));
  for (int64_t d = 0; d < 1000; ++d) {
    std::vector<int64_t> expected{kCls};
    const auto& document = corpus[static_cast<size_t>(d)];
    expected.insert(expected.end(), document.begin(), document.begin() + std::min<size_t>(document.size(), 10));
    expected.push_back(kSep);
    expected.resize(12, kPad);
    if (as_vector(documents.tokens(d)) != expected) FAIL("document " << d << " differs");
  }
}

TEST_CASE("Special ids come from the options, else the file, and missing ones are errors", "[data][tokens]") {
  TempDir dir;
  TokenFileOptions bare;
  bare.vocab_size = 30;
  write_token_file(dir / "bare.tokens", kSmallCorpus, bare);
  CHECK_THAT(data_error([&] { TokenDataset d(dataset_options(dir / "bare.tokens", 8)); }),
             Contains(dir / "bare.tokens") && Contains("no [CLS] token id") && Contains("data.cls_id"));

  TokenDatasetOptions options = dataset_options(dir / "bare.tokens", 8);
  options.special = SpecialTokens{29, -1, 28, 27, -1};
  CHECK_THAT(data_error([&] { TokenDataset d(options); }), Contains("no [MASK] token id"));
  options.mlm.mask_token_prob = 0.0;  // no [MASK] needed then
  options.mlm.random_token_prob = 0.5;
  const TokenDataset without_mask(options);
  CHECK(without_mask.special().mask == -1);
  CHECK(as_vector(without_mask.tokens(0)).front() == 28);
  options.special.mask = 26;
  options.mlm = MlmOptions{};
  const TokenDataset explicit_ids(options);
  CHECK(explicit_ids.special().pad == 29);
  CHECK(as_vector(explicit_ids.tokens(1)).back() == 29);

  // A larger configured vocabulary is fine, a smaller one is not.
  write_token_file(dir / "c.tokens", kSmallCorpus, small_vocab());
  TokenDatasetOptions larger = dataset_options(dir / "c.tokens", 8);
  larger.vocab_size = 64;
  CHECK(TokenDataset(larger).num_classes() == 64);
  larger.vocab_size = 20;
  CHECK_THAT(data_error([&] { TokenDataset d(larger); }), Contains("more than the configured vocab_size 20"));
  // An explicit id overrides the file's.
  TokenDatasetOptions override_cls = dataset_options(dir / "c.tokens", 8);
  override_cls.special.cls = 7;
  CHECK(as_vector(TokenDataset(override_cls).tokens(0)).front() == 7);

  write_token_file(dir / "empty.tokens", {{}, {}}, small_vocab());
  CHECK_THAT(data_error([&] { TokenDataset d(dataset_options(dir / "empty.tokens", 8)); }),
             Contains("holds no tokens"));
}

TEST_CASE("data.vocab_size below the vocab file's ids is the key's error and not the token file's", "[data][tokens]") {
  TempDir dir;
  // Token ids below 100, but the vocab file has 110 entries with [MASK] at 103 (BERT's layout).
  std::string vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n";
  for (int i = 4; i < 110; ++i) vocab += i == 103 ? std::string("[MASK]\n") : "w" + std::to_string(i) + "\n";
  std::ofstream(dir / "vocab.txt") << vocab;
  TokenFileOptions bare;
  bare.vocab_size = 100;
  write_token_file(dir / "train.tokens", random_corpus(8, 4, 100, 3), bare);
  const train::Config config = train::parse_config(
      "model: {name: bert-tiny}\ntrainer: {global_batch: 8, epochs: 1}\n"
      "data:\n  kind: tokens\n  root: " + dir.path + "\n  vocab_file: vocab.txt\n  vocab_size: 100\n",
      "mlm.yaml");
  try {
    make_dataset(config.data, Split::Train);
    FAIL("expected a ConfigError");
  } catch (const train::ConfigError& e) {
    CHECK(e.exit_code() == 2);
    CHECK_THAT(std::string(e.what()), Contains("key 'data.vocab_size'") && Contains("100") &&
                                          Contains(dir / "vocab.txt") && Contains("110 tokens"));
    // The key is located in the config like any other key's error.
    CHECK_THAT(train::locate_config_error(config, e.what()), Contains("mlm.yaml:7:"));
  }
  train::DataConfig fits = config.data;
  fits.vocab_size = 112;
  const DatasetPtr dataset = make_dataset(fits, Split::Train);
  CHECK(dataset->num_classes() == 112);
  CHECK(dynamic_cast<const TokenDataset&>(*dataset).special().mask == 103);

  // Without a vocab file: an id of the token file's header that the configured vocab_size leaves
  // out names the key too.
  TokenFileOptions header = small_vocab();
  write_token_file(dir / "header.tokens", kSmallCorpus, header);
  TokenDatasetOptions options = dataset_options(dir / "header.tokens", 8);
  options.vocab_size = 30;
  options.special.mask = 40;  // as a vocab file gives it, without a key of its own
  options.keys["vocab_size"] = "data.vocab_size";
  try {
    TokenDataset d(options);
    FAIL("expected a ConfigError");
  } catch (const train::ConfigError& e) {
    CHECK_THAT(std::string(e.what()), Contains("key 'data.vocab_size'") && Contains("mask token id 40"));
  }
}

TEST_CASE("MLM random replacements come from the data's vocabulary and not the rounded-up logits", "[data][tokens]") {
  TempDir dir;
  // Vocabulary of 10: specials 0..4, words 5..9; 16 logits.
  write_token_file(dir / "small.tokens", random_corpus(30, 5, 10, 4), small_vocab(10));
  TokenDatasetOptions options = dataset_options(dir / "small.tokens", 24);
  options.vocab_size = 16;
  options.mlm = MlmOptions{1.0, 0.0, 1.0};  // every word replaced by a random one
  const TokenDataset dataset(options);
  CHECK(dataset.num_classes() == 16);
  CHECK(dataset.data_vocab_size() == 10);
  std::set<int64_t> drawn;
  for (int64_t i = 0; i < dataset.size(); ++i) {
    for (const int64_t id : as_vector(dataset.get(i, 100 + i).input)) drawn.insert(id);
  }
  CHECK(*drawn.rbegin() < 10);
  CHECK(drawn.count(5) + drawn.count(9) == 2);  // the whole range of words is drawn

  // With a vocab file, its size is the data's vocabulary (here 12 > the token file's 10).
  std::ofstream(dir / "vocab.txt") << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\nb\nc\nd\ne\nf\ng\n";
  const train::Config config = train::parse_config(
      "model: {name: bert-tiny}\ntrainer: {global_batch: 8, epochs: 1}\n"
      "data: {kind: tokens, root: " + dir.path + ", train_tokens: small.tokens, vocab_file: vocab.txt,"
      " vocab_size: 16, seq_len: 24, mask_prob: 1.0, mask_token_prob: 0.0, random_token_prob: 1.0}\n",
      "mlm.yaml");
  const DatasetPtr from_config = make_dataset(config.data, Split::Train);
  CHECK(from_config->num_classes() == 16);
  std::set<int64_t> drawn_config;
  for (int64_t i = 0; i < from_config->size(); ++i) {
    for (const int64_t id : as_vector(from_config->get(i, 7 + i).input)) drawn_config.insert(id);
  }
  CHECK(*drawn_config.rbegin() < 12);
  CHECK(drawn_config.count(11) == 1);

  // The masker itself: draws below draw_size, which may not exceed the logits.
  const MlmMasker masker(MlmOptions{1.0, 0.0, 1.0}, 16, -1, {0, 1, 2, 3, 4}, 10);
  SplitMix64 rng(5);
  std::set<int64_t> draws;
  for (int i = 0; i < 2000; ++i) draws.insert(masker.random_token(rng));
  CHECK(draws == std::set<int64_t>{5, 6, 7, 8, 9});
  CHECK_THROWS_AS(MlmMasker(MlmOptions{}, 16, 4, {}, 17), std::invalid_argument);
}

// ---- masking ------------------------------------------------------------------------------------

TEST_CASE("MLM masking rates: 15% selected, 80/10/10, special tokens never touched", "[data][tokens]") {
  TempDir dir;
  constexpr int64_t kVocab = 1000;
  write_token_file(dir / "big.tokens", random_corpus(1500, 5, kVocab, 17), small_vocab(kVocab));
  const TokenDataset dataset(dataset_options(dir / "big.tokens", 128));
  REQUIRE(dataset.size() > 1000);

  int64_t eligible = 0, selected = 0, masked = 0, randomized = 0, unchanged = 0, special_positions = 0;
  double random_sum = 0.0;
  int64_t selected_first_half = 0, selected_second_half = 0;
  for (int64_t i = 0; i < dataset.size(); ++i) {
    const std::vector<int64_t> original = as_vector(dataset.tokens(i));
    const Example example = dataset.get(i, sample_seed(3, 0, i));
    const std::vector<int64_t> input = as_vector(example.input);
    const std::vector<int64_t> target = as_vector(example.target);
    for (size_t p = 0; p < original.size(); ++p) {
      if (original[p] < 5) {  // [CLS], [SEP], [PAD]
        ++special_positions;
        CHECK(target[p] == kIgnoreIndex);
        CHECK(input[p] == original[p]);
        continue;
      }
      ++eligible;
      if (target[p] == kIgnoreIndex) {
        REQUIRE(input[p] == original[p]);
        continue;
      }
      ++selected;
      (p < 64 ? selected_first_half : selected_second_half) += 1;
      REQUIRE(target[p] == original[p]);
      if (input[p] == kMask) {
        ++masked;
      } else if (input[p] == original[p]) {
        ++unchanged;  // also the rare random draw of the original token
      } else {
        ++randomized;
        CHECK(input[p] >= 5);  // random replacements are never special
        CHECK(input[p] < kVocab);
        random_sum += static_cast<double>(input[p]);
      }
    }
  }
  REQUIRE(eligible > 100000);
  CHECK(special_positions > 0);
  const double selected_rate = static_cast<double>(selected) / static_cast<double>(eligible);
  const double mask_rate = static_cast<double>(masked) / static_cast<double>(selected);
  const double random_rate = static_cast<double>(randomized) / static_cast<double>(selected);
  const double unchanged_rate = static_cast<double>(unchanged) / static_cast<double>(selected);
  INFO("selected " << selected_rate << " mask " << mask_rate << " random " << random_rate << " unchanged "
                   << unchanged_rate);
  CHECK(selected_rate == Approx(0.15).margin(0.003));
  CHECK(mask_rate == Approx(0.80).margin(0.01));
  CHECK(random_rate == Approx(0.10).margin(0.01));
  CHECK(unchanged_rate == Approx(0.10).margin(0.01));
  // Random replacements are uniform over the words 5..999 (mean 502), positions uniform too.
  CHECK(random_sum / static_cast<double>(randomized) == Approx(502.0).margin(25.0));
  CHECK(static_cast<double>(selected_first_half) / static_cast<double>(selected) == Approx(0.5).margin(0.02));
}

TEST_CASE("MLM masking is a function of the sample seed", "[data][tokens]") {
  TempDir dir;
  write_token_file(dir / "c.tokens", random_corpus(50, 5, 200, 5), small_vocab(200));
  const TokenDataset dataset(dataset_options(dir / "c.tokens", 64));
  for (int64_t i : {0, 7, 21}) {
    const Example a = dataset.get(i, 42);
    const Example b = dataset.get(i, 42);
    CHECK(torch::equal(a.input, b.input));
    CHECK(torch::equal(a.target, b.target));
    const Example c = dataset.get(i, 43);
    CHECK_FALSE(torch::equal(a.target, c.target));
  }
  // The same masker on a tensor gives the same as through the dataset.
  const Example direct = dataset.masker().apply(dataset.tokens(7), 42);
  CHECK(torch::equal(direct.input, dataset.get(7, 42).input));
  CHECK(torch::equal(direct.target, dataset.get(7, 42).target));

  // Through the loader: the same batches for 0, 1 and 3 workers, and per epoch new masks.
  auto epoch = [&](int64_t workers, int64_t number) {
    LoaderOptions options;
    options.batch_size = 4;
    options.workers = workers;
    options.seed = 9;
    options.drop_last = false;
    Loader loader(std::make_shared<TokenDataset>(dataset_options(dir / "c.tokens", 64)), options);
    loader.start({number, 0});
    std::vector<Batch> batches;
    while (std::optional<Batch> batch = loader.next()) batches.push_back(*batch);
    return batches;
  };
  const std::vector<Batch> reference = epoch(0, 1);
  REQUIRE(reference.size() == static_cast<size_t>((dataset.size() + 3) / 4));
  CHECK(reference[0].input.sizes().vec() == std::vector<int64_t>{4, 64});
  CHECK(reference[0].target.sizes().vec() == std::vector<int64_t>{4, 64});
  for (int64_t workers : {1, 3}) {
    const std::vector<Batch> batches = epoch(workers, 1);
    REQUIRE(batches.size() == reference.size());
    for (size_t b = 0; b < batches.size(); ++b) {
      INFO("workers " << workers << " batch " << b);
      CHECK(torch::equal(batches[b].input, reference[b].input));
      CHECK(torch::equal(batches[b].target, reference[b].target));
    }
  }
  CHECK_FALSE(torch::equal(epoch(0, 2)[0].target, reference[0].target));
}

TEST_CASE("MlmMasker draws random tokens uniformly from the non-special ids", "[data][tokens]") {
  MlmOptions options;
  options.mask_prob = 1.0;
  options.mask_token_prob = 0.0;
  options.random_token_prob = 1.0;
  // Specials in any order, repeated, or outside the vocabulary (ignored).
  const MlmMasker masker(options, 12, -1, {9, 0, 3, 3, 40, -1});
  CHECK(masker.is_special(0));
  CHECK(masker.is_special(9));
  CHECK_FALSE(masker.is_special(1));
  std::map<int64_t, int64_t> counts;
  constexpr int64_t kLength = 9000;
  std::vector<int64_t> ids(kLength, 5);
  std::vector<int64_t> targets(kLength);
  masker.apply(ids.data(), targets.data(), kLength, 1);
  for (int64_t p = 0; p < kLength; ++p) {
    CHECK(targets[p] == 5);
    ++counts[ids[p]];
  }
  // 9 ordinary ids: 1 2 4 5 6 7 8 10 11, about 1000 draws each.
  CHECK(counts.size() == 9);
  for (const auto& [id, count] : counts) {
    INFO("id " << id);
    CHECK_FALSE(masker.is_special(id));
    CHECK(count > 850);
    CHECK(count < 1150);
  }

  // A sequence of special tokens only: nothing selected.
  std::vector<int64_t> specials = {0, 3, 9};
  std::vector<int64_t> special_targets(3);
  masker.apply(specials.data(), special_targets.data(), 3, 1);
  CHECK(specials == std::vector<int64_t>{0, 3, 9});
  CHECK(special_targets == std::vector<int64_t>(3, kIgnoreIndex));

  CHECK_THROWS_AS(MlmMasker(MlmOptions{0.0, 0.8, 0.1}, 12, 4, {}), std::invalid_argument);
  CHECK_THROWS_AS(MlmMasker(MlmOptions{0.15, 0.8, 0.3}, 12, 4, {}), std::invalid_argument);
  CHECK_THROWS_AS(MlmMasker(MlmOptions{}, 12, 12, {}), std::invalid_argument);
  CHECK_THROWS_AS(MlmMasker(MlmOptions{}, 2, 1, {0, 1}), std::invalid_argument);
}

// ---- config and factory -------------------------------------------------------------------------

TEST_CASE("data.kind: tokens builds MLM datasets from the config", "[data][tokens]") {
  TempDir dir;
  // A vocab file whose special ids differ from what the token file records.
  std::ofstream(dir / "vocab.txt") << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n[unused0]\n[unused1]\n"
                                   << "a\nb\nc\nd\ne\nf\ng\nh\ni\nj\nk\nl\nm\nn\no\np\nq\nr\ns\nt\nu\nv\nw\n";
  TokenFileOptions bare;
  bare.vocab_size = 30;
  write_token_file(dir / "train.tokens", random_corpus(40, 7, 30, 1), bare);
  write_token_file(dir / "held_out.tokens", random_corpus(10, 7, 30, 2), bare);

  const std::string required = "model: {name: bert-tiny}\ntrainer: {global_batch: 8, epochs: 1}\n";
  const train::Config config = train::parse_config(
      required + "data:\n  kind: tokens\n  root: " + dir.path +
          "\n  val_tokens: held_out.tokens\n  vocab_file: vocab.txt\n  seq_len: 32\n",
      "mlm.yaml");
  CHECK(config.data.train_tokens == "train.tokens");
  CHECK(config.data.mask_prob == 0.15);
  CHECK(config.data.mask_token_prob == 0.8);
  CHECK(config.data.random_token_prob == 0.1);
  CHECK(config.data.pack);
  CHECK(config.data.on_error == "raise");

  const DatasetPtr train = make_dataset(config.data, Split::Train);
  const DatasetPtr val = make_dataset(config.data, Split::Val);
  CHECK(train->input_shape() == std::vector<int64_t>{32});
  CHECK(train->num_classes() == 30);
  const auto& tokens = dynamic_cast<const TokenDataset&>(*train);
  CHECK(tokens.special().cls == 2);
  CHECK(tokens.special().mask == 4);
  CHECK(tokens.file().path() == dir / "train.tokens");
  CHECK(dynamic_cast<const TokenDataset&>(*val).file().path() == dir / "held_out.tokens");
  // [unused0] and [unused1] are never drawn as random replacements.
  CHECK(tokens.masker().is_special(5));
  CHECK(tokens.masker().is_special(6));
  CHECK_FALSE(tokens.masker().is_special(7));

  {  // A token file that records other ids for [CLS] and [SEP] than the vocab file has: said.
    TokenFileOptions swapped = bare;
    swapped.special = SpecialTokens{0, 1, 3, 2, 4};  // pad, unk, cls, sep, mask
    write_token_file(dir / "swapped.tokens", random_corpus(40, 7, 30, 3), swapped);
    train::DataConfig data = config.data;
    data.train_tokens = "swapped.tokens";
    const std::string captured = dir / "captured.log";
    train::log::set_file(captured);
    const DatasetPtr dataset = make_dataset(data, Split::Train);
    train::log::set_file("");
    const auto& swapped_tokens = dynamic_cast<const TokenDataset&>(*dataset);
    CHECK(swapped_tokens.special().cls == 2);  // the vocab file's
    const std::vector<uint8_t> log_bytes = read_bytes(captured);
    const std::string log_text(log_bytes.begin(), log_bytes.end());
    CHECK_THAT(log_text, Contains("swapped.tokens records other special token ids than those used: cls 3 -> 2 (" +
                                  (dir / "vocab.txt") + "), sep 2 -> 3 ("));
  }
  train::DataConfig data = config.data;
  data.vocab_file.clear();
  data.cls_id = 2;
  data.sep_id = 3;
  data.pad_id = 0;
  CHECK_THAT(data_error([&] { make_dataset(data, Split::Train); }), Contains("no [MASK] token id"));
  data.mask_id = 4;
  data.pack = false;
  data.train_tokens = dir / "train.tokens";  // absolute: root is not prepended
  files::make_directories(dir / "elsewhere");
  data.root = dir / "elsewhere";
  CHECK(make_dataset(data, Split::Train)->size() == 40);
  data.train_tokens = "missing.tokens";
  CHECK_THAT(data_error([&] { make_dataset(data, Split::Train); }), Contains("elsewhere/missing.tokens"));
  // A data.root that is not there is named by its key, even when every file is given absolute.
  data.train_tokens = dir / "train.tokens";
  data.root = "/nonexistent";
  CHECK_THAT(data_error([&] { make_dataset(data, Split::Train); }), Contains("key 'data.root': /nonexistent"));

  auto config_error = [&](const std::string& yaml) {
    try {
      train::parse_config(required + yaml, "mlm.yaml");
    } catch (const train::ConfigError& e) {
      return std::string(e.what());
    }
    FAIL("expected a ConfigError for " << yaml);
    return std::string();
  };
  CHECK_THAT(config_error("data:\n  kind: tokens\n  mask_token_prob: 0.9\n  random_token_prob: 0.2\n"),
             Contains("mlm.yaml:6:22") && Contains("key 'data.random_token_prob'") && Contains("<= 1"));
  CHECK_THAT(config_error("data: {kind: tokens, seq_len: 2}\n"), Contains("key 'data.seq_len'"));
  CHECK_THAT(config_error("data: {kind: tokens, mask_prob: 0}\n"), Contains("key 'data.mask_prob'"));
  CHECK_THAT(config_error("data: {kind: tokens, cls_id: -2}\n"), Contains("key 'data.cls_id'"));
  CHECK_THAT(config_error("data: {kind: tokens, uint8: on}\n"),
             Contains("key 'data.uint8'") && Contains("only image_folder"));
  CHECK_THAT(config_error("data: {kind: tokens, on_error: ignore}\n"),
             Contains("key 'data.on_error'") && Contains("raise, skip"));
}
