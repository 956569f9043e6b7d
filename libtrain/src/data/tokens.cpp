// The token file (writer and memory-mapped reader), vocab files, MLM masking and TokenDataset.
#include <train/data/token_file.h>
#include <train/data/tokens.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/log.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "atomic_file.h"

namespace train::data {

namespace {

// ---- little-endian encoding and the checksum ---------------------------------------------------

constexpr uint32_t kNoId = 0xFFFFFFFFu;
constexpr uint64_t kFnvOffsetBasis = 0xCBF29CE484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001B3ull;

uint64_t fnv1a(uint64_t hash, const uint8_t* bytes, size_t size) {
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= kFnvPrime;
  }
  return hash;
}

void put_le(uint8_t* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

uint64_t get_le(const uint8_t* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{in[i]} << (8 * i);
  return value;
}

uint64_t round_up8(uint64_t n) { return (n + 7) / 8 * 8; }

uint32_t encode_id(int64_t id) { return id < 0 ? kNoId : static_cast<uint32_t>(id); }
int64_t decode_id(uint32_t id) { return id == kNoId ? -1 : static_cast<int64_t>(id); }

// The special ids in the header's order, for loops.
struct NamedId {
  const char* name;
  int64_t SpecialTokens::*field;
};
constexpr NamedId kSpecialFields[] = {{"pad", &SpecialTokens::pad},
                                      {"unk", &SpecialTokens::unk},
                                      {"cls", &SpecialTokens::cls},
                                      {"sep", &SpecialTokens::sep},
                                      {"mask", &SpecialTokens::mask}};

std::atomic<uint64_t> g_writer_serial{0};

}  // namespace

// ---- TokenFileWriter ----------------------------------------------------------------------------

TokenFileWriter::TokenFileWriter(std::string path, TokenFileOptions options)
    : path_(std::move(path)), options_(options), checksum_(kFnvOffsetBasis) {
  const int64_t vocab = options_.vocab_size;
  if (vocab < 1 || vocab > (int64_t{1} << 32)) {
    throw std::invalid_argument("TokenFileWriter: " + path_ + ": vocab_size must be in [1, 2^32], got " +
                                std::to_string(vocab));
  }
  if (options_.token_bytes == 0) options_.token_bytes = vocab <= 65536 ? 2 : 4;
  if (options_.token_bytes != 2 && options_.token_bytes != 4) {
    throw std::invalid_argument("TokenFileWriter: " + path_ + ": token_bytes must be 0, 2 or 4, got " +
                                std::to_string(options_.token_bytes));
  }
  if (options_.token_bytes == 2 && vocab > 65536) {
    throw std::invalid_argument("TokenFileWriter: " + path_ + ": a vocabulary of " + std::to_string(vocab) +
                                " tokens does not fit 2-byte tokens");
  }
  for (const NamedId& named : kSpecialFields) {
    const int64_t id = options_.special.*(named.field);
    if (id < -1 || id >= vocab) {
      throw std::invalid_argument("TokenFileWriter: " + path_ + ": special id " + named.name + " = " +
                                  std::to_string(id) + " is outside the vocabulary [0, " +
                                  std::to_string(vocab) + ")");
    }
  }
  files::make_directories(files::parent(path_));
  tmp_path_ = path_ + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(g_writer_serial++);
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  if (file_ == nullptr) throw Error("cannot write " + tmp_path_ + ": " + std::strerror(errno));
  const std::vector<uint8_t> placeholder(kTokenFileHeaderBytes, 0);  // the header comes last
  write_bytes(placeholder.data(), placeholder.size());
}

TokenFileWriter::~TokenFileWriter() { discard(); }

void TokenFileWriter::discard() {
  if (file_ != nullptr) {
    std::fclose(file_);
    file_ = nullptr;
    std::remove(tmp_path_.c_str());
  }
}

void TokenFileWriter::write_bytes(const void* data, size_t size) {
  if (size == 0) return;  // an empty document's data() may be null, which fwrite must not get
  if (std::fwrite(data, 1, size, file_) != size) {
    const std::string why = std::strerror(errno);
    discard();
    throw Error("failed writing " + tmp_path_ + ": " + why + " (disk full?)");
  }
}

template <typename Int>
void TokenFileWriter::add(const Int* tokens, size_t count) {
  if (file_ == nullptr) throw std::logic_error("TokenFileWriter: " + path_ + ": already finished or failed");
  const int bytes = options_.token_bytes;
  buffer_.resize(count * static_cast<size_t>(bytes));
  for (size_t i = 0; i < count; ++i) {
    const auto id = static_cast<int64_t>(tokens[i]);
    if (id < 0 || id >= options_.vocab_size) {
      throw std::invalid_argument("TokenFileWriter: " + path_ + ": document " +
                                  std::to_string(num_documents()) + ", position " + std::to_string(i) +
                                  ": token " + std::to_string(id) + " is outside the vocabulary [0, " +
                                  std::to_string(options_.vocab_size) + ")");
    }
    put_le(buffer_.data() + i * static_cast<size_t>(bytes), static_cast<uint64_t>(id), bytes);
  }
  write_bytes(buffer_.data(), buffer_.size());
  checksum_ = fnv1a(checksum_, buffer_.data(), buffer_.size());
  offsets_.push_back(offsets_.back() + count);
}

void TokenFileWriter::add_document(const std::vector<int64_t>& tokens) { add(tokens.data(), tokens.size()); }
void TokenFileWriter::add_document(const std::vector<int32_t>& tokens) { add(tokens.data(), tokens.size()); }
void TokenFileWriter::add_document(const uint32_t* tokens, size_t count) { add(tokens, count); }

void TokenFileWriter::finish() {
  if (file_ == nullptr) throw std::logic_error("TokenFileWriter: " + path_ + ": already finished or failed");
  const uint64_t num_tokens = offsets_.back();
  const uint64_t token_bytes = num_tokens * static_cast<uint64_t>(options_.token_bytes);
  const uint64_t index_offset = kTokenFileHeaderBytes + round_up8(token_bytes);

  std::vector<uint8_t> tail(index_offset - kTokenFileHeaderBytes - token_bytes, 0);  // alignment
  tail.resize(tail.size() + 8 * offsets_.size());
  uint8_t* out = tail.data() + (tail.size() - 8 * offsets_.size());
  for (const uint64_t offset : offsets_) {
    put_le(out, offset, 8);
    out += 8;
  }
  write_bytes(tail.data(), tail.size());
  checksum_ = fnv1a(checksum_, tail.data(), tail.size());

  uint8_t header[kTokenFileHeaderBytes] = {};
  std::memcpy(header, kTokenFileMagic, sizeof kTokenFileMagic);
  put_le(header + 8, kTokenFileVersion, 4);
  put_le(header + 12, static_cast<uint64_t>(options_.token_bytes), 4);
  put_le(header + 16, num_tokens, 8);
  put_le(header + 24, static_cast<uint64_t>(num_documents()), 8);
  put_le(header + 32, static_cast<uint64_t>(options_.vocab_size), 8);
  put_le(header + 40, index_offset, 8);
  put_le(header + 48, checksum_, 8);
  for (size_t i = 0; i < std::size(kSpecialFields); ++i) {
    put_le(header + 56 + 4 * i, encode_id(options_.special.*(kSpecialFields[i].field)), 4);
  }
  bool ok = std::fseek(file_, 0, SEEK_SET) == 0;
  ok = ok && std::fwrite(header, 1, sizeof header, file_) == sizeof header;
  ok = ok && std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const std::string why = std::strerror(errno);
  ok = std::fclose(file_) == 0 && ok;
  file_ = nullptr;
  if (!ok) {
    std::remove(tmp_path_.c_str());
    throw Error("failed writing " + tmp_path_ + ": " + why + " (disk full?)");
  }
  if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(tmp_path_.c_str());
    throw Error("cannot rename " + tmp_path_ + " to " + path_ + ": " + reason);
  }
  detail::fsync_path(files::parent(path_), /*directory=*/true);
}

void write_token_file(const std::string& path, const std::vector<std::vector<int64_t>>& documents,
                      const TokenFileOptions& options) {
  TokenFileWriter writer(path, options);
  for (const std::vector<int64_t>& document : documents) writer.add_document(document);
  writer.finish();
}

// ---- TokenFile ----------------------------------------------------------------------------------

TokenFile::TokenFile(const std::string& path) : path_(path) {
  // Checked before open(), which blocks on a FIFO until something writes to it.
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    throw DataError(path + ": " + problem + ", expected a token file");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw DataError(path + ": cannot open token file: " + std::strerror(errno));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    throw DataError(path + ": not a regular file");
  }
  const auto size = static_cast<size_t>(info.st_size);
  const std::string found = std::to_string(size) + " bytes";
  if (size < sizeof kTokenFileMagic) {
    ::close(fd);
    throw DataError(path + ": truncated token file: " + found + ", shorter than the " +
                    std::to_string(kTokenFileHeaderBytes) + "-byte header");
  }
  try {
    mapped_ = files::MappedFile(fd, size, path);
  } catch (const Error& e) {
    ::close(fd);
    throw DataError(e.what());
  }
  ::close(fd);  // the mapping keeps the file

  // Every read below goes through read_at, like the samples' later: a file truncated while it is
  // validated is a DataError too.
  auto fail = [&](const std::string& problem) { throw DataError(path + ": " + problem); };
  uint8_t header[kTokenFileHeaderBytes] = {};
  read_at(0, header, std::min(size, sizeof header));
  const uint8_t* data = header;
  if (std::memcmp(data, kTokenFileMagic, sizeof kTokenFileMagic) != 0) {
    fail("not a token file (bad magic; expected \"TRAINTOK\")");
  }
  if (size < static_cast<size_t>(kTokenFileHeaderBytes)) {
    fail("truncated token file: " + found + ", shorter than the " + std::to_string(kTokenFileHeaderBytes) +
         "-byte header");
  }
  const uint64_t version = get_le(data + 8, 4);
  if (version != kTokenFileVersion) {
    fail("unsupported token file version " + std::to_string(version) + " (this reader reads version " +
         std::to_string(kTokenFileVersion) + ")");
  }
  const uint64_t token_bytes = get_le(data + 12, 4);
  if (token_bytes != 2 && token_bytes != 4) {
    fail("token size " + std::to_string(token_bytes) + " bytes in the header (expected 2 or 4)");
  }
  token_bytes_ = static_cast<int>(token_bytes);
  const uint64_t num_tokens = get_le(data + 16, 8);
  const uint64_t num_documents = get_le(data + 24, 8);
  const uint64_t vocab_size = get_le(data + 32, 8);
  const uint64_t index_offset = get_le(data + 40, 8);
  checksum_ = get_le(data + 48, 8);
  if (vocab_size < 1 || vocab_size > (uint64_t{1} << (8 * token_bytes))) {
    fail("vocab_size " + std::to_string(vocab_size) + " in the header does not fit " + std::to_string(token_bytes) +
         "-byte tokens");
  }
  // Counts larger than any file could hold would overflow the size arithmetic below.
  constexpr uint64_t kMaxCount = uint64_t{1} << 56;
  if (num_tokens > kMaxCount || num_documents > kMaxCount) {
    fail("implausible counts in the header (" + std::to_string(num_tokens) + " tokens, " +
         std::to_string(num_documents) + " documents): corrupt header");
  }
  const uint64_t expected_index = kTokenFileHeaderBytes + round_up8(num_tokens * token_bytes);
  if (index_offset != expected_index) {
    fail("corrupt header: index_offset is " + std::to_string(index_offset) + " but " + std::to_string(num_tokens) +
         " tokens of " + std::to_string(token_bytes) + " bytes put the index at " + std::to_string(expected_index));
  }
  const uint64_t expected_size = expected_index + 8 * (num_documents + 1);
  if (size != expected_size) {
    fail(std::string(size < expected_size ? "truncated" : "trailing data") + ": the header declares " +
         std::to_string(num_tokens) + " tokens in " + std::to_string(num_documents) + " documents, so expected " +
         std::to_string(expected_size) + " bytes, found " + found);
  }
  num_tokens_ = static_cast<int64_t>(num_tokens);
  num_documents_ = static_cast<int64_t>(num_documents);
  vocab_size_ = static_cast<int64_t>(vocab_size);
  index_offset_ = static_cast<int64_t>(index_offset);
  for (size_t i = 0; i < std::size(kSpecialFields); ++i) {
    const int64_t id = decode_id(static_cast<uint32_t>(get_le(data + 56 + 4 * i, 4)));
    if (id >= vocab_size_) {
      fail(std::string("special id ") + kSpecialFields[i].name + " = " + std::to_string(id) +
           " in the header is outside the vocabulary [0, " + std::to_string(vocab_size_) + ")");
    }
    special_.*(kSpecialFields[i].field) = id;
  }
  // The index, in blocks of offsets.
  sparse_offsets_.reserve(num_documents / kSparseStride + 2);
  sparse_offsets_.push_back(0);
  std::vector<int64_t> block;
  uint64_t previous = 0;
  constexpr uint64_t kBlock = 8192;
  for (uint64_t first = 0; first <= num_documents; first += kBlock) {
    const uint64_t count = std::min(kBlock, num_documents + 1 - first);
    block.resize(count);
    document_offsets(static_cast<int64_t>(first), static_cast<int64_t>(count), block.data());
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t d = first + i;
      const auto offset = static_cast<uint64_t>(block[i]);
      if (d == 0) {
        if (offset != 0) fail("corrupt index: offsets[0] is not 0");
        continue;
      }
      if (d % kSparseStride == 0 || d == num_documents) sparse_offsets_.push_back(static_cast<int64_t>(offset));
      if (offset < previous || offset > num_tokens) {
        fail("corrupt index: document " + std::to_string(d - 1) + " ends at token " + std::to_string(offset) +
             ", before its start " + std::to_string(previous) + " or past the " + std::to_string(num_tokens) +
             " tokens");
      }
      previous = offset;
    }
  }
  if (previous != num_tokens) {
    fail("corrupt index: the documents end at token " + std::to_string(previous) + ", not at the " +
         std::to_string(num_tokens) + " tokens the header declares");
  }
}

TokenFile::~TokenFile() = default;

void TokenFile::read_at(uint64_t offset, uint8_t* out, size_t bytes) const {
  if (!mapped_.copy(static_cast<size_t>(offset), out, bytes)) {
    throw DataError(path_ + ": cannot read " + std::to_string(bytes) + " bytes at offset " + std::to_string(offset) +
                    ": the file is shorter than when it was opened (rewritten in place while a run reads it? write "
                    "a new file and rename it over the old one)");
  }
}

int64_t TokenFile::token(int64_t position) const {
  int64_t value = 0;
  read(position, 1, &value);
  return value;
}

void TokenFile::read(int64_t begin, int64_t count, int64_t* out) const {
  if (begin < 0 || count < 0 || begin + count > num_tokens_) {
    throw std::out_of_range(path_ + ": tokens [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                            ") out of range [0, " + std::to_string(num_tokens_) + ")");
  }
  // One read per call, into a buffer each worker thread keeps.
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(static_cast<size_t>(count * token_bytes_));
  read_at(static_cast<uint64_t>(kTokenFileHeaderBytes + begin * token_bytes_), buffer.data(), buffer.size());
  const uint8_t* in = buffer.data();
  for (int64_t i = 0; i < count; ++i, in += token_bytes_) {
    const auto value = static_cast<int64_t>(token_bytes_ == 2 ? get_le(in, 2) : get_le(in, 4));
    if (value >= vocab_size_) {
      throw DataError(path_ + ": corrupt token file: token " + std::to_string(value) + " at position " +
                          std::to_string(begin + i) + " is outside the vocabulary [0, " +
                          std::to_string(vocab_size_) + ")",
                      kExitRuntime);
    }
    out[i] = value;
  }
}

int64_t TokenFile::document_offset(int64_t d) const {
  int64_t offset = 0;
  document_offsets(d, 1, &offset);
  return offset;
}

int64_t TokenFile::document_length(int64_t d) const {
  if (d < 0 || d >= num_documents_) {
    throw std::out_of_range(path_ + ": document " + std::to_string(d) + " out of range [0, " +
                            std::to_string(num_documents_) + ")");
  }
  int64_t bounds[2];
  document_offsets(d, 2, bounds);
  return bounds[1] - bounds[0];
}

void TokenFile::document_offsets(int64_t first, int64_t count, int64_t* out) const {
  if (first < 0 || count < 0 || first + count > num_documents_ + 1) {
    throw std::out_of_range(path_ + ": document offsets [" + std::to_string(first) + ", " +
                            std::to_string(first + count) + ") out of range [0, " +
                            std::to_string(num_documents_ + 1) + ")");
  }
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(static_cast<size_t>(8 * count));
  read_at(static_cast<uint64_t>(index_offset_ + 8 * first), buffer.data(), buffer.size());
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int64_t>(get_le(buffer.data() + 8 * i, 8));
}

int64_t TokenFile::find_document(int64_t position, int64_t separators) const {
  if (position < 0 || separators < 0) {
    throw std::out_of_range(path_ + ": find_document(" + std::to_string(position) + ", " +
                            std::to_string(separators) + ")");
  }
  if (num_documents_ == 0) throw std::logic_error(path_ + ": find_document in a file without documents");
  // Stream starts strictly increase when separators > 0 and never decrease otherwise, so both
  // searches find the last start at or before position.
  auto start = [&](int64_t offset, int64_t d) { return offset + d * separators; };
  // Sparse entry k is document k * kSparseStride; the last entry (num_documents) is never a start.
  int64_t lo = 0;
  int64_t hi = (num_documents_ - 1) / kSparseStride;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (start(sparse_offsets_[static_cast<size_t>(mid)], mid * kSparseStride) <= position) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t first = lo * kSparseStride;
  const int64_t count = std::min(kSparseStride, num_documents_ - first);
  thread_local std::vector<int64_t> block;
  block.resize(static_cast<size_t>(count));
  document_offsets(first, count, block.data());
  int64_t a = 0;
  int64_t b = count - 1;
  while (a < b) {
    const int64_t mid = a + (b - a + 1) / 2;
    if (start(block[static_cast<size_t>(mid)], first + mid) <= position) {
      a = mid;
    } else {
      b = mid - 1;
    }
  }
  return first + a;
}

void TokenFile::verify() const {
  uint64_t actual = kFnvOffsetBasis;
  std::vector<uint8_t> chunk(size_t{1} << 20);
  for (auto at = static_cast<size_t>(kTokenFileHeaderBytes); at < mapped_.size();) {
    const size_t n = std::min(chunk.size(), mapped_.size() - at);
    read_at(at, chunk.data(), n);
    actual = fnv1a(actual, chunk.data(), n);
    at += n;
  }
  if (actual != checksum_) {
    std::ostringstream message;
    message << path_ << ": checksum mismatch (header 0x" << std::hex << checksum_ << ", content 0x" << actual
            << "): the file is corrupt";
    throw DataError(message.str());
  }
}

// ---- vocab files --------------------------------------------------------------------------------

VocabInfo read_vocab_file(const std::string& path) {
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    throw DataError(path + ": " + problem + ", expected a vocab file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open vocab file: " + std::strerror(errno));
  VocabInfo vocab;
  std::string line;
  for (int64_t id = 0; std::getline(in, line); ++id) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    vocab.size = id + 1;
    if (line.size() < 2 || line.front() != '[' || line.back() != ']') continue;
    vocab.bracketed.push_back(id);
    if (line == "[PAD]") vocab.special.pad = id;
    if (line == "[UNK]") vocab.special.unk = id;
    if (line == "[CLS]") vocab.special.cls = id;
    if (line == "[SEP]") vocab.special.sep = id;
    if (line == "[MASK]") vocab.special.mask = id;
  }
  if (in.bad()) throw DataError(path + ": cannot read vocab file");
  if (vocab.size == 0) throw DataError(path + ": empty vocab file (expected one token per line)");
  return vocab;
}

// ---- MlmMasker ----------------------------------------------------------------------------------

MlmMasker::MlmMasker(MlmOptions options, int64_t vocab_size, int64_t mask_id, std::vector<int64_t> special_ids,
                     int64_t draw_size)
    : options_(options), vocab_size_(vocab_size), draw_size_(draw_size > 0 ? draw_size : vocab_size),
      mask_id_(mask_id) {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument("MlmMasker: " + message);
  };
  require(vocab_size >= 1, "vocab_size must be >= 1");
  require(draw_size >= 0 && draw_size <= vocab_size, "the vocabulary random replacements are drawn from (" +
                                                         std::to_string(draw_size) + " tokens) is larger than vocab_size " +
                                                         std::to_string(vocab_size));
  require(options_.mask_prob > 0.0 && options_.mask_prob <= 1.0, "mask_prob must be in (0, 1]");
  require(options_.mask_token_prob >= 0.0 && options_.random_token_prob >= 0.0 &&
              options_.mask_token_prob + options_.random_token_prob <= 1.0 + 1e-9,
          "mask_token_prob and random_token_prob must be >= 0 with a sum <= 1");
  require(options_.mask_token_prob == 0.0 || (mask_id >= 0 && mask_id < vocab_size),
          "the [MASK] id " + std::to_string(mask_id) + " is not in the vocabulary [0, " +
              std::to_string(vocab_size) + ")");
  for (const int64_t id : special_ids) {
    if (id >= 0 && id < vocab_size) special_.push_back(id);
  }
  std::sort(special_.begin(), special_.end());
  special_.erase(std::unique(special_.begin(), special_.end()), special_.end());
  special_drawable_ = std::lower_bound(special_.begin(), special_.end(), draw_size_) - special_.begin();
  require(options_.random_token_prob == 0.0 || special_drawable_ < draw_size_,
          "every token of the vocabulary is special: no random replacement to draw");
}

bool MlmMasker::is_special(int64_t id) const { return std::binary_search(special_.begin(), special_.end(), id); }

int64_t MlmMasker::random_token(SplitMix64& rng) const {
  const auto ordinary = static_cast<uint64_t>(draw_size_ - special_drawable_);
  auto id = static_cast<int64_t>(rng.below(ordinary));
  // The id-th ordinary token: step over each special id at or below it (it stays below draw_size).
  for (const int64_t special : special_) {
    if (special > id) break;
    ++id;
  }
  return id;
}

void MlmMasker::apply(int64_t* ids, int64_t* targets, int64_t n, uint64_t seed) const {
  std::vector<int64_t> eligible;
  eligible.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    targets[i] = kIgnoreIndex;
    if (!is_special(ids[i])) eligible.push_back(i);
  }
  if (eligible.empty()) return;
  SplitMix64 rng(seed);
  const auto count = static_cast<int64_t>(eligible.size());
  const double expected = options_.mask_prob * static_cast<double>(count);
  auto selected = static_cast<int64_t>(std::floor(expected));
  if (static_cast<double>(rng.uniform()) < expected - static_cast<double>(selected)) ++selected;
  selected = std::clamp<int64_t>(selected, 1, count);
  const double mask_below = options_.mask_token_prob;
  const double random_below = options_.mask_token_prob + options_.random_token_prob;
  for (int64_t j = 0; j < selected; ++j) {
    // A partial Fisher-Yates shuffle: eligible[j] becomes a uniformly drawn unselected position.
    const auto k = j + static_cast<int64_t>(rng.below(static_cast<uint64_t>(count - j)));
    std::swap(eligible[static_cast<size_t>(j)], eligible[static_cast<size_t>(k)]);
    const int64_t position = eligible[static_cast<size_t>(j)];
    targets[position] = ids[position];
    const double u = rng.uniform();
    if (u < mask_below) {
      ids[position] = mask_id_;
    } else if (u < random_below) {
      ids[position] = random_token(rng);
    }
  }
}

Example MlmMasker::apply(const torch::Tensor& ids, uint64_t seed) const {
  if (ids.dim() != 1) throw std::invalid_argument("MlmMasker::apply: expected a 1-d tensor of token ids");
  torch::Tensor input = ids.to(torch::kLong, /*non_blocking=*/false, /*copy=*/true).contiguous();
  torch::Tensor target = torch::empty_like(input);
  apply(input.data_ptr<int64_t>(), target.data_ptr<int64_t>(), input.numel(), seed);
  return Example{std::move(input), std::move(target)};
}

// ---- TokenDataset -------------------------------------------------------------------------------

TokenDataset::TokenDataset(TokenDatasetOptions options) : options_(std::move(options)) {
  const std::string& path = options_.path;
  if (options_.seq_len < 3) {
    throw std::invalid_argument("TokenDataset: seq_len must be >= 3 ([CLS], a token, [SEP]), got " +
                                std::to_string(options_.seq_len));
  }
  file_ = std::make_shared<const TokenFile>(path);
  // A value given by a config key that the file contradicts is that key's error (exit 2, naming
  // it); otherwise the file is at fault.
  auto key_for = [this](const std::string& field) -> std::string {
    const auto it = options_.keys.find(field);
    return it == options_.keys.end() ? "" : it->second;
  };
  vocab_size_ = options_.vocab_size > 0 ? options_.vocab_size : file_->vocab_size();
  if (vocab_size_ < file_->vocab_size()) {
    const std::string key = options_.vocab_size > 0 ? key_for("vocab_size") : "";
    if (!key.empty()) {
      throw ConfigError("key '" + key + "': " + std::to_string(vocab_size_) + " is smaller than the vocabulary of " +
                        path + " (" + std::to_string(file_->vocab_size()) + " tokens); set it to at least " +
                        std::to_string(file_->vocab_size()) + ", or 0 to take the file's");
    }
    throw DataError(path + ": the file's vocabulary has " + std::to_string(file_->vocab_size()) +
                    " tokens, more than the configured vocab_size " + std::to_string(vocab_size_));
  }
  // The vocab file's ids must have logits too.
  const std::string& vocab_file = options_.vocab_file.empty() ? std::string("the vocab file") : options_.vocab_file;
  const std::string vocab_size_key = options_.vocab_size > 0 ? key_for("vocab_size") : "";
  if (vocab_size_ < options_.vocab_file_size) {
    const std::string problem = std::to_string(vocab_size_) + " is smaller than the vocabulary of " + vocab_file +
                                " (" + std::to_string(options_.vocab_file_size) + " tokens)";
    if (!vocab_size_key.empty()) {
      throw ConfigError("key '" + vocab_size_key + "': " + problem + "; set it to at least " +
                        std::to_string(options_.vocab_file_size) + ", or 0 to take the vocab file's");
    }
    throw std::invalid_argument("TokenDataset: vocab_size " + problem);
  }
  data_vocab_size_ = options_.vocab_file_size > 0 ? options_.vocab_file_size : file_->vocab_size();
  for (const NamedId& named : kSpecialFields) {
    const int64_t configured = options_.special.*(named.field);
    int64_t& id = special_.*(named.field);
    id = configured >= 0 ? configured : file_->special().*(named.field);
    if (id >= vocab_size_) {
      const std::string key = configured >= 0 ? key_for(named.name) : "";
      if (!key.empty()) {
        throw ConfigError("key '" + key + "': " + std::to_string(id) + " is outside the vocabulary [0, " +
                          std::to_string(vocab_size_) + ") of " + path);
      }
      // An id of the files (the token file's header, the vocab file) that a configured vocab_size
      // leaves out: the key is at fault, not the files.
      if (!vocab_size_key.empty()) {
        const std::string source = configured >= 0 ? vocab_file : path;
        throw ConfigError("key '" + vocab_size_key + "': " + std::to_string(vocab_size_) + " leaves out the " +
                          named.name + " token id " + std::to_string(id) + " of " + source + "; set it to at least " +
                          std::to_string(id + 1) + ", or 0 to take the files'");
      }
      throw DataError(path + ": the " + named.name + " token id " + std::to_string(id) +
                      " is outside the vocabulary [0, " + std::to_string(vocab_size_) + ")");
    }
  }
  // The file records the ids it was tokenized with; another id for one of them (from a key or the
  // vocab file) is taken, but a vocab other than the file's would feed the model wrong tokens.
  std::string contradicted;
  for (const NamedId& named : kSpecialFields) {
    const int64_t recorded = file_->special().*(named.field), used = special_.*(named.field);
    if (recorded < 0 || recorded == used) continue;
    const std::string key = key_for(named.name);
    contradicted += std::string(contradicted.empty() ? "" : ", ") + named.name + " " + std::to_string(recorded) +
                    " -> " + std::to_string(used) + " (" + (key.empty() ? vocab_file : key) + ")";
  }
  if (!contradicted.empty()) {
    log::warn(path + " records other special token ids than those used: " + contradicted +
              "; if the file was tokenized with another vocabulary, its ids mean other tokens");
  }
  auto require_id = [&](int64_t id, const char* token, const char* key) {
    if (id < 0) {
      throw DataError(path + ": no " + token + " token id: the file records none and none is configured (data." +
                      key + " or data.vocab_file)");
    }
  };
  require_id(special_.cls, "[CLS]", "cls_id");
  require_id(special_.sep, "[SEP]", "sep_id");
  require_id(special_.pad, "[PAD]", "pad_id");
  if (options_.mlm.mask_token_prob > 0.0) require_id(special_.mask, "[MASK]", "mask_id");

  if (file_->num_tokens() == 0) throw DataError(path + ": the token file holds no tokens");
  const int64_t body = options_.seq_len - 2;
  if (options_.pack) {
    const int64_t stream = file_->num_tokens() + file_->num_documents();
    samples_ = (stream + body - 1) / body;
  } else {
    samples_ = file_->num_documents();
  }

  std::vector<int64_t> never_masked = options_.extra_special;
  for (const NamedId& named : kSpecialFields) never_masked.push_back(special_.*(named.field));
  try {
    // Random replacements come from the data's vocabulary: ids from vocab_size_'s rounding up exist
    // in no vocabulary.
    masker_ = std::make_unique<MlmMasker>(options_.mlm, vocab_size_, special_.mask, std::move(never_masked),
                                          data_vocab_size_);
  } catch (const std::invalid_argument& e) {
    throw DataError(path + ": " + e.what());
  }
}

torch::Tensor TokenDataset::tokens(int64_t index) const {
  if (index < 0 || index >= samples_) {
    throw std::out_of_range(options_.path + ": sample " + std::to_string(index) + " out of range [0, " +
                            std::to_string(samples_) + ")");
  }
  const int64_t seq_len = options_.seq_len;
  const int64_t body = seq_len - 2;
  torch::Tensor sample = torch::full({seq_len}, special_.pad, torch::kLong);
  int64_t* out = sample.data_ptr<int64_t>();
  int64_t k = 0;
  out[k++] = special_.cls;
  const TokenFile& file = *file_;
  if (options_.pack) {
    // The stream is every document followed by its [SEP]; sample `index` is its body-token slice.
    const int64_t documents = file.num_documents();
    const int64_t stream_size = file.num_tokens() + documents;
    int64_t p = index * body;
    const int64_t end = std::min(p + body, stream_size);
    // Offsets come in windows of up to kWindow + 1, one copy each: a sample rarely spans more
    // than a few documents.
    constexpr int64_t kWindow = 32;
    int64_t window[kWindow + 1];
    int64_t window_first = 0;
    int64_t window_count = 0;
    auto offset = [&](int64_t d) {
      if (d >= window_first + window_count) {
        window_first = d;
        window_count = std::min(kWindow + 1, documents + 1 - d);
        file.document_offsets(window_first, window_count, window);
      }
      return window[d - window_first];
    };
    for (int64_t d = file.find_document(p, 1); p < end; ++d) {
      const int64_t begin = offset(d);
      const int64_t start = begin + d;  // stream position of document d's first token
      const int64_t length = offset(d + 1) - begin;
      if (p < start + length) {
        const int64_t n = std::min(start + length, end) - p;
        file.read(begin + (p - start), n, out + k);
        k += n;
        p += n;
      }
      if (p < end) {  // p is at document d's [SEP]
        out[k++] = special_.sep;
        ++p;
      }
    }
  } else {
    int64_t bounds[2];
    file.document_offsets(index, 2, bounds);
    const int64_t n = std::min(bounds[1] - bounds[0], body);
    file.read(bounds[0], n, out + k);
    k += n;
  }
  out[k] = special_.sep;
  return sample;
}

void TokenDataset::verify() const { file_->verify(); }

uint64_t TokenDataset::fingerprint() const {
  return Fingerprint().add(static_cast<int64_t>(file_->checksum())).add(file_->num_tokens()).add(samples_).value();
}

Example TokenDataset::get(int64_t index, uint64_t seed) const {
  torch::Tensor input = tokens(index);
  torch::Tensor target = torch::empty_like(input);
  masker_->apply(input.data_ptr<int64_t>(), target.data_ptr<int64_t>(), input.numel(), seed);
  return Example{std::move(input), std::move(target)};
}

std::string TokenDataset::describe() const {
  const MlmOptions& mlm = options_.mlm;
  std::ostringstream out;
  out << "tokens: " << options_.path << ": " << file_->num_tokens() << " tokens in " << file_->num_documents()
      << " documents, vocab " << vocab_size_ << ", " << samples_ << " samples of " << options_.seq_len
      << " tokens (" << (options_.pack ? "packed" : "one per document") << "), mlm " << mlm.mask_prob << " ("
      << mlm.mask_token_prob << " [MASK] / " << mlm.random_token_prob << " random)";
  return out.str();
}

}  // namespace train::data
