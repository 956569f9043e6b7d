#pragma once
// The token file: a corpus of tokenized documents for language-model training, written once by a
// pretokenizer and read through a memory mapping by every loader worker.
//
// Format, version 1. One file (conventionally NAME.tokens); every integer is little-endian.
//
//   offset  size  field
//        0     8  magic "TRAINTOK"
//        8     4  u32 version = 1
//       12     4  u32 token_bytes: 2 (uint16 tokens) or 4 (uint32 tokens)
//       16     8  u64 num_tokens
//       24     8  u64 num_documents
//       32     8  u64 vocab_size: every token is < vocab_size
//       40     8  u64 index_offset = 128 + num_tokens * token_bytes rounded up to a multiple of 8
//       48     8  u64 checksum: 64-bit FNV-1a of every byte from offset 128 to the end of the file
//       56     4  u32 pad_id    +
//       60     4  u32 unk_id    |
//       64     4  u32 cls_id    |  special token ids; 0xFFFFFFFF = not recorded
//       68     4  u32 sep_id    |
//       72     4  u32 mask_id   +
//       76    52  reserved, zero
//      128        the tokens of all documents, back to back: num_tokens x token_bytes
//                 zero bytes up to index_offset
//  index_offset   u64 offsets[num_documents + 1]: document d is tokens [offsets[d], offsets[d + 1]);
//                 offsets[0] = 0, non-decreasing, offsets[num_documents] = num_tokens
//          end    the file ends right after the offsets
//
// The reader checks all of this except the checksum and the token values when it opens a file
// (verify() checks the checksum; a token >= vocab_size is reported when it is read), so a
// truncated, padded or foreign file is a DataError naming the file and the field at fault.
//
// The writer streams tokens into a temporary file beside the target and renames it over the
// target in finish(), after an fsync: a reader sees the previous file or the complete new one,
// never a partial one, and a writer that fails or is abandoned leaves the target untouched.
//
// This header is free of LibTorch: a tokenizer tool can include it cheaply.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "train/files.h"

namespace train::data {

// Ids of the special tokens of a vocabulary; -1 = none / unknown.
struct SpecialTokens {
  int64_t pad = -1;
  int64_t unk = -1;
  int64_t cls = -1;
  int64_t sep = -1;
  int64_t mask = -1;
};

constexpr char kTokenFileMagic[8] = {'T', 'R', 'A', 'I', 'N', 'T', 'O', 'K'};
constexpr uint32_t kTokenFileVersion = 1;
constexpr int64_t kTokenFileHeaderBytes = 128;

struct TokenFileOptions {
  int64_t vocab_size = 0;  // required: every token must be < vocab_size (at most 2^32)
  // 2 or 4; 0 = 2 when vocab_size <= 65536, else 4.
  int token_bytes = 0;
  SpecialTokens special;   // recorded in the header for readers; -1 = not recorded
};

// Writes a token file document by document. Not thread-safe.
//
//   TokenFileOptions options;
//   options.vocab_size = 30522;
//   options.special.cls = 101;  // ... the vocabulary's special ids, for the readers
//   TokenFileWriter writer("corpus/train.tokens", options);
//   for (...) writer.add_document(ids);
//   writer.finish();  // the file appears here, complete
class TokenFileWriter {
 public:
  // Creates the temporary file; train::Error naming it when that fails, std::invalid_argument
  // for bad options (vocab_size < 1 or > 2^32, token_bytes not 0, 2 or 4, too small for the
  // vocabulary, or a special id outside it).
  TokenFileWriter(std::string path, TokenFileOptions options);
  // Without finish(), the temporary file is removed and the target stays as it was.
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  // Appends one document (may be empty). std::invalid_argument naming the document and position
  // of a token outside [0, vocab_size); nothing of that document is written then.
  void add_document(const std::vector<int64_t>& tokens);
  void add_document(const std::vector<int32_t>& tokens);
  void add_document(const uint32_t* tokens, size_t count);

  // Writes the index and the header, fsyncs and renames the file into place. train::Error when
  // any write fails (the target is then untouched). Calling anything after finish() is an error.
  void finish();

  int64_t num_documents() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  int64_t num_tokens() const { return static_cast<int64_t>(offsets_.back()); }
  const std::string& path() const { return path_; }

 private:
  template <typename Int>
  void add(const Int* tokens, size_t count);
  void write_bytes(const void* data, size_t size);
  void discard();

  std::string path_;
  std::string tmp_path_;
  TokenFileOptions options_;
  std::FILE* file_ = nullptr;
  std::vector<uint64_t> offsets_{0};
  std::vector<uint8_t> buffer_;  // encoded tokens of the document being added
  uint64_t checksum_;
  bool write_failed_ = false;
};

// Convenience: writes a whole corpus at once.
void write_token_file(const std::string& path, const std::vector<std::vector<int64_t>>& documents,
                      const TokenFileOptions& options);

// A token file, mapped into memory and validated whole when opened. Reads copy out of the mapping
// (files::MappedFile): a file truncated under a running job is a DataError naming it, not the
// SIGBUS that would end the process. All accessors are const and safe to call from any number of
// threads at once; the destructor unmaps the file.
class TokenFile {
 public:
  // Opens and validates; DataError naming the file on any problem (missing, unreadable,
  // truncated, trailing data, bad magic, unsupported version or token size, inconsistent counts,
  // offsets out of order).
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  int token_bytes() const { return token_bytes_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const { return num_documents_; }
  int64_t vocab_size() const { return vocab_size_; }
  const SpecialTokens& special() const { return special_; }
  // The checksum the header records (verify() checks it against the content).
  uint64_t checksum() const { return checksum_; }

  // Token `position` of the corpus, 0 <= position < num_tokens. std::out_of_range otherwise;
  // DataError naming the file and position when the stored value is >= vocab_size.
  int64_t token(int64_t position) const;
  // Copies tokens [begin, begin + count) to out, checked like token().
  void read(int64_t begin, int64_t count, int64_t* out) const;
  // offsets[d] for 0 <= d <= num_documents: document d is tokens [offset(d), offset(d + 1)).
  int64_t document_offset(int64_t d) const;
  int64_t document_length(int64_t d) const;
  // offsets[first], ..., offsets[first + count - 1] into out, in one read; std::out_of_range unless
  // 0 <= first and first + count <= num_documents + 1.
  void document_offsets(int64_t first, int64_t count, int64_t* out) const;
  // The last document d (0 <= d < num_documents) that starts at or before `position` of a stream
  // in which every document is followed by `separators` tokens of its own (0: the corpus itself),
  // that is the largest d with offset(d) + d * separators <= position. A search of the sparse
  // index kept in memory, then of one block of offsets copied out of the mapping. std::out_of_range
  // when position < 0 or separators < 0; std::logic_error when the file has no documents.
  int64_t find_document(int64_t position, int64_t separators = 0) const;

  // Recomputes the checksum over the whole payload (reads every byte); DataError naming the file
  // when it differs from the header's.
  void verify() const;

 private:
  // Reads exactly `bytes` at `offset`; DataError naming the file when it has become shorter.
  void read_at(uint64_t offset, uint8_t* out, size_t bytes) const;

  std::string path_;
  files::MappedFile mapped_;  // the whole file
  int token_bytes_ = 0;
  int64_t num_tokens_ = 0;
  int64_t num_documents_ = 0;
  int64_t vocab_size_ = 0;
  int64_t index_offset_ = 0;
  uint64_t checksum_ = 0;
  SpecialTokens special_;
  // offsets[k * kSparseStride] for k = 0, 1, ... and offsets[num_documents], taken while the index
  // is validated at open: find_document's first search runs in memory (8 bytes per 64 documents).
  static constexpr int64_t kSparseStride = 64;
  std::vector<int64_t> sparse_offsets_;
};

}  // namespace train::data
