#include "train/checkpoint.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <thread>
#include <torch/torch.h>
#include <utility>
#include <vector>

#include "atomic_file.h"
#include "checkpoint_name.h"
#include "compat.h"
#include "train/config.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"
#include "train/models/model.h"
#include "train/optim.h"
#include "train/safetensors.h"

namespace train {
namespace {

// Named tensors of a module: parameters, then buffers ("params/..." vs "buffers/..." would
// break torchvision-style names, so both live in one namespace like a state dict).
std::vector<std::pair<std::string, torch::Tensor>> state_entries(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : model.named_parameters()) out.emplace_back(p.key(), p.value());
  for (const auto& b : model.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

std::string shape_str(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

void read_model(torch::serialize::InputArchive& archive, torch::nn::Module& model, const std::string& path) {
  torch::serialize::InputArchive weights;
  if (!archive.try_read("model", weights)) throw CheckpointError(path + ": no 'model' entry");
  torch::NoGradGuard no_grad;
  std::set<std::string> parameters;  // the weights that must be finite (a buffer may hold a -inf mask)
  for (const auto& p : model.named_parameters()) parameters.insert(p.key());
  for (auto& [name, tensor] : state_entries(model)) {
    torch::Tensor stored;
    if (!weights.try_read(name, stored)) {
      throw CheckpointError(path + ": model entry '" + name + "' is missing (was it written by another model?)");
    }
    if (stored.sizes() != tensor.sizes()) {
      throw CheckpointError(path + ": model entry '" + name + "' has shape " + shape_str(stored) +
                            ", the model expects " + shape_str(tensor));
    }
    // copy_ would throw a LibTorch error for a sparse entry, and drop a complex one's imaginary
    // part with only a warning.
    if (stored.layout() != torch::kStrided || stored.is_complex() != tensor.is_complex() ||
        stored.is_floating_point() != tensor.is_floating_point()) {
      throw CheckpointError(path + ": model entry '" + name + "' is a " + std::string(c10::toString(stored.scalar_type())) +
                            (stored.layout() != torch::kStrided ? " sparse" : "") + " tensor, the model expects " +
                            c10::toString(tensor.scalar_type()));
    }
    if (parameters.count(name) && stored.is_floating_point() && !torch::isfinite(stored).all().item<bool>()) {
      throw CheckpointError(path + ": model entry '" + name + "' holds NaN or infinite values (the weights of a run "
                            "that diverged, or a damaged file); resume from an earlier checkpoint");
    }
    tensor.copy_(stored);
  }
}

std::string architecture_of(const torch::nn::Module& model) {
  const auto* m = dynamic_cast<const models::Model*>(&model);
  return m ? m->architecture() : std::string();
}

// What the checkpoint's model recorded (models::Model::architecture); "" in checkpoints of models
// that record nothing, and in those written before train stored it.
std::string saved_architecture(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  return archive.try_read("architecture", value) && value.isString() ? value.toStringRef() : std::string();
}

// Weights of the same shapes from a model with other settings (BERT's head count) would load and
// compute something else: refused, or with strict off (model.init_from, init_strict: false) a
// warning.
void check_architecture(const std::string& saved, const torch::nn::Module& model, const std::string& path,
                        bool strict) {
  const std::string now = architecture_of(model);
  if (saved.empty() || now.empty() || saved == now) return;
  const std::string what = path + " was written by a model with " + saved + "; this one has " + now +
                           " (the same parameter shapes, split differently)";
  if (strict) throw CheckpointError(what + ": use the checkpoint's setting");
  log::warn(what + ": loading its weights anyway (model.init_strict: false)");
}

// Every checkpoint has a sidecar "<file>.crc32c" with the CRC-32C and size of its bytes, written
// after the checkpoint itself. A checkpoint without one (a crash between the two renames, or a
// file from elsewhere) is trusted as far as its archive structure goes.
constexpr const char* kSumSuffix = ".crc32c";
std::string sum_path(const std::string& path) { return path + kSumSuffix; }

std::string sum_text(uint32_t crc, uint64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "crc32c %08x bytes %llu\n", crc, static_cast<unsigned long long>(bytes));
  return buf;
}

void verify_sum(const std::string& path) {
  const std::string sidecar = sum_path(path);
  if (!files::exists(sidecar)) return;
  unsigned expected_crc = 0;
  unsigned long long expected_bytes = 0;
  FILE* s = std::fopen(sidecar.c_str(), "rb");
  const bool parsed = s && std::fscanf(s, "crc32c %x bytes %llu", &expected_crc, &expected_bytes) == 2;
  if (s) std::fclose(s);
  if (!parsed) throw CheckpointError(sidecar + ": malformed checksum file");
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw CheckpointError(path + ": cannot open checkpoint");
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0;
  uint64_t bytes = 0;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), f)) > 0;) {
    crc = crc32c(buf.data(), n, crc);
    bytes += n;
  }
  std::fclose(f);
  if (bytes != expected_bytes || crc != expected_crc) {
    char detail[200];
    std::snprintf(detail, sizeof(detail), "%llu bytes with CRC-32C %08x, but %s records %llu bytes with %08x",
                  static_cast<unsigned long long>(bytes), crc, files::filename(sidecar).c_str(), expected_bytes,
                  expected_crc);
    throw CheckpointError(path + ": checksum mismatch: " + detail + "; the file is truncated or corrupt");
  }
}

// LibTorch reads archive members without checking their CRC-32 (PyTorch builds miniz with the
// reader's CRC checks off), and its TorchScript importer can crash on a damaged code/ member
// (1.13: SIGSEGV in ScriptTypeParser; found by fuzz/fuzz_checkpoint.cpp). So a checkpoint that
// has no .crc32c sidecar has each member's CRC-32 checked here first: stored members as they
// are, deflated ones (LibTorch deflates some code/ sources) after inflating them a chunk at a
// time. The directory is found the way miniz finds it: LibTorch's writers always add a ZIP64
// end record, and when its locator is present miniz takes the directory's place from it and
// ignores the 32-bit fields, so this does too (a damaged 32-bit offset once let a damaged
// member through unchecked). Damage this cannot read past is an error, not a reason to skip.
void verify_zip_members(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) return;  // open_archive reports unreadable files
  const int64_t size = files::file_size(path);
  auto corrupt = [&](const std::string& detail) {
    return CheckpointError(path + ": not a readable checkpoint (truncated or corrupt): " + detail);
  };
  auto read_at = [&](uint64_t offset, uint64_t n, std::vector<uint8_t>& out) {
    // Bounds first, so a damaged size field cannot make this allocate.
    if (offset > static_cast<uint64_t>(size) || n > static_cast<uint64_t>(size) - offset) return false;
    out.resize(static_cast<size_t>(n));
    return std::fseek(f.get(), static_cast<long>(offset), SEEK_SET) == 0 && std::fread(out.data(), 1, out.size(), f.get()) == out.size();
  };
  auto u16 = [](const uint8_t* p) { return static_cast<uint32_t>(p[0] | p[1] << 8); };
  auto u32 = [](const uint8_t* p) { return static_cast<uint32_t>(p[0] | p[1] << 8 | p[2] << 16) | uint32_t{p[3]} << 24; };
  auto u64 = [&](const uint8_t* p) { return uint64_t{u32(p)} | uint64_t{u32(p + 4)} << 32; };
  if (size < 22) throw corrupt(std::to_string(size) + " bytes, too short for a zip archive");

  // The end-of-central-directory record: the last 22 bytes, or earlier when a comment follows.
  std::vector<uint8_t> tail;
  const int64_t tail_size = std::min<int64_t>(size, 22 + 65535);
  if (!read_at(static_cast<uint64_t>(size - tail_size), static_cast<uint64_t>(tail_size), tail)) return;
  int64_t eocd = tail_size - 22;
  while (eocd >= 0 && u32(&tail[eocd]) != 0x06054b50) --eocd;
  if (eocd < 0) throw corrupt("no zip end-of-directory record");
  uint64_t entries = u16(&tail[eocd + 10]), dir_size = u32(&tail[eocd + 12]), dir_offset = u32(&tail[eocd + 16]);
  const uint64_t eocd_at = static_cast<uint64_t>(size - tail_size + eocd);
  std::vector<uint8_t> locator, record;
  if (eocd_at >= 20 && read_at(eocd_at - 20, 20, locator) && u32(locator.data()) == 0x07064b50) {
    if (!read_at(u64(&locator[8]), 56, record) || u32(record.data()) != 0x06064b50) {
      throw corrupt("its ZIP64 end-of-directory locator points at no ZIP64 record");
    }
    entries = u64(&record[32]);
    dir_size = u64(&record[40]);
    dir_offset = u64(&record[48]);
  }
  std::vector<uint8_t> dir, local, chunk;
  if (!read_at(dir_offset, dir_size, dir)) {
    throw corrupt("its zip directory (" + std::to_string(dir_size) + " bytes at offset " + std::to_string(dir_offset) +
                  ") lies outside the file's " + std::to_string(size) + " bytes");
  }
  for (size_t p = 0, i = 0; i < entries; ++i) {
    if (p + 46 > dir.size() || u32(&dir[p]) != 0x02014b50) {
      throw corrupt("zip directory entry " + std::to_string(i) + " of " + std::to_string(entries) + " is damaged");
    }
    const uint32_t method = u16(&dir[p + 10]), crc = u32(&dir[p + 16]);
    uint64_t stored = u32(&dir[p + 20]), expanded = u32(&dir[p + 24]), local_offset = u32(&dir[p + 42]);
    const size_t name_length = u16(&dir[p + 28]), extra_length = u16(&dir[p + 30]);
    const size_t next = p + 46 + name_length + extra_length + u16(&dir[p + 32]);
    if (next > dir.size()) {
      throw corrupt("zip directory entry " + std::to_string(i) + " of " + std::to_string(entries) + " is damaged");
    }
    const std::string name(dir.begin() + static_cast<int64_t>(p) + 46, dir.begin() + static_cast<int64_t>(p + 46 + name_length));
    // ZIP64 sizes and offset (over 4 GiB): a 0xFFFFFFFF field is replaced, in order, by the
    // 64-bit values of the entry's extra field 0x0001.
    for (size_t e = p + 46 + name_length, end = e + extra_length; e + 4 <= end;) {
      const size_t id = u16(&dir[e]), length = u16(&dir[e + 2]);
      size_t at = e + 4;
      const size_t field_end = std::min(at + length, end);
      e = at + length;
      if (id != 0x0001) continue;
      for (uint64_t* field : {&expanded, &stored, &local_offset}) {
        if (*field != 0xFFFFFFFF) continue;
        if (at + 8 > field_end) throw corrupt("archive member '" + name + "' has a damaged ZIP64 extra field");
        *field = u64(&dir[at]);
        at += 8;
      }
    }
    p = next;
    // The directory names a member here, so a missing local header or data that runs past the
    // end is damage: LibTorch 1.13 read on from such archives and asked for a 4 GiB string.
    const std::string damaged = path + ": archive member '" + name + "' ";
    if (!read_at(local_offset, 30, local) || u32(local.data()) != 0x04034b50) {
      throw CheckpointError(damaged + "has no local header at its offset; the file is corrupt");
    }
    uint64_t offset = local_offset + 30 + u16(&local[26]) + u16(&local[28]);
    if (offset > static_cast<uint64_t>(size) || stored > static_cast<uint64_t>(size) - offset) {
      throw CheckpointError(damaged + "runs past the end of the file; it is truncated");
    }
    if (method != 0 && method != 8) {
      throw CheckpointError(damaged + "uses compression method " + std::to_string(method) +
                            ", which LibTorch's writer never uses; the file is corrupt");
    }
    z_stream z{};
    if (method == 8 && inflateInit2(&z, -MAX_WBITS) != Z_OK) throw std::bad_alloc();
    std::unique_ptr<z_stream, int (*)(z_stream*)> inflater(method == 8 ? &z : nullptr, &inflateEnd);
    std::vector<uint8_t> out(method == 8 ? 1 << 16 : 0);
    uLong actual = crc32(0, nullptr, 0);
    uint64_t produced = 0;
    bool ended = method == 0;
    for (uint64_t left = stored; left > 0 && produced <= expanded;) {
      const uint64_t n = std::min<uint64_t>(left, 1 << 20);
      if (!read_at(offset, n, chunk)) throw CheckpointError(damaged + "cannot be read");
      offset += n;
      left -= n;
      if (method == 0) {
        actual = crc32(actual, chunk.data(), static_cast<uInt>(n));
        continue;
      }
      z.next_in = chunk.data();
      z.avail_in = static_cast<uInt>(n);
      while (z.avail_in > 0 && !ended && produced <= expanded) {
        z.next_out = out.data();
        z.avail_out = static_cast<uInt>(out.size());
        const int rc = inflate(&z, Z_NO_FLUSH);
        const size_t got = out.size() - z.avail_out;
        actual = crc32(actual, out.data(), static_cast<uInt>(got));
        produced += got;
        if (rc == Z_STREAM_END) {
          ended = true;
        } else if (rc != Z_OK) {  // Z_BUF_ERROR too: with input and room left, no progress is damage
          throw CheckpointError(damaged + "is not a valid deflate stream; the file is corrupt");
        }
      }
      if (ended) break;
    }
    if (method == 8) {
      const std::string recorded = std::to_string(expanded) + " bytes its directory entry records; the file is corrupt";
      if (produced > expanded) throw CheckpointError(damaged + "inflates to more than the " + recorded);
      if (!ended) throw CheckpointError(damaged + "ends before its deflate stream does; the file is corrupt");
      if (produced != expanded) {
        throw CheckpointError(damaged + "inflates to " + std::to_string(produced) + " bytes, not the " + recorded);
      }
    }
    if (actual != crc) {
      throw CheckpointError(damaged + "fails its CRC-32 check; the file is corrupt");
    }
  }
}

torch::serialize::InputArchive open_archive(const std::string& path) {
  if (!files::exists(path)) throw CheckpointError(path + ": checkpoint file does not exist");
  if (const std::string problem = files::input_file_problem(path); !problem.empty()) {
    throw CheckpointError(path + ": " + problem + ", expected a checkpoint file");
  }
  if (const std::string problem = files::input_file_problem(sum_path(path)); !problem.empty()) {
    throw CheckpointError(sum_path(path) + ": " + problem + ", expected a checksum file");
  }
  if (path.size() > 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0) {
    throw CheckpointError(path + ": a safetensors file holds weights alone, not a run's state (optimizer, step, data "
                          "position); start a run from its weights with model.init_from: " + path);
  }
  verify_sum(path);
  if (!files::exists(sum_path(path))) verify_zip_members(path);
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path, torch::kCPU);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    throw CheckpointError(path + ": not a readable checkpoint (truncated or corrupt): " +
                          what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {  // TorchScript's parser, on damaged code/ entries, throws its own errors
    std::string what = e.what();
    throw CheckpointError(path + ": not a readable checkpoint (truncated or corrupt): " +
                          what.substr(0, what.find('\n')));
  }
  c10::IValue format;
  if (!archive.try_read("format", format) || !format.isInt()) {
    throw CheckpointError(path + ": not a train checkpoint (no 'format' entry)");
  }
  if (format.toInt() != kCheckpointFormat) {
    throw CheckpointError(path + ": checkpoint format " + std::to_string(format.toInt()) +
                          ", this build reads format " + std::to_string(kCheckpointFormat));
  }
  return archive;
}

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key, const std::string& path) {
  c10::IValue v;
  if (!archive.try_read(key, v) || !v.isInt()) throw CheckpointError(path + ": missing integer entry '" + key + "'");
  return v.toInt();
}

}  // namespace

namespace {

// The archive save_checkpoint writes: the model's state on the CPU, the optimizer's, the counters
// and the other components' tensors.
torch::serialize::OutputArchive checkpoint_archive(const torch::nn::Module& model,
                                                   const torch::optim::Optimizer* optimizer, const TrainState& state) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(kCheckpointFormat));
  torch::serialize::OutputArchive weights;
  for (const auto& [name, tensor] : state_entries(model)) weights.write(name, tensor.detach().to(torch::kCPU));
  archive.write("model", weights);
  if (optimizer) {
    torch::serialize::OutputArchive opt;
    optimizer->save(opt);
    archive.write("optimizer", opt);
  }
  archive.write("step", c10::IValue(state.step));
  archive.write("epoch", c10::IValue(state.epoch));
  archive.write("batch_in_epoch", c10::IValue(state.batch_in_epoch));
  archive.write("samples_seen", c10::IValue(state.samples_seen));
  archive.write("config", c10::IValue(state.config_yaml));
  if (const std::string arch = architecture_of(model); !arch.empty()) archive.write("architecture", c10::IValue(arch));
  torch::serialize::OutputArchive extra;
  for (const auto& [name, tensor] : state.tensors) extra.write(name, tensor.detach().to(torch::kCPU));
  archive.write("state", extra);
  return archive;
}

// Writes what `produce` hands its sink to `path` atomically, then the .crc32c sidecar.
void write_checkpoint_file(const std::string& path,
                           const std::function<void(const std::function<bool(const void*, size_t)>&)>& produce) {
  uint32_t crc = 0;
  uint64_t bytes = 0;
  // A checkpoint written again at the same step (after a rollback, say) loses its old
  // checksum just before the new file replaces it: a crash between the two renames must not pair
  // the new file with the old sum (which would reject a good checkpoint); without a sidecar its
  // ZIP members' CRCs are checked instead.
  const auto drop_old_sum = [&] {
    if (files::exists(sum_path(path))) files::remove_file(sum_path(path));
  };
  detail::write_atomically(path, [&](const auto& sink) {
    produce([&](const void* data, size_t n) {
      crc = crc32c(data, n, crc);
      bytes += n;
      return sink(data, n);
    });
  }, drop_old_sum);
  detail::write_text_atomically(sum_path(path), sum_text(crc, bytes));
}

}  // namespace

void save_checkpoint(const std::string& path, const torch::nn::Module& model,
                     const torch::optim::Optimizer* optimizer, const TrainState& state) {
  torch::serialize::OutputArchive archive = checkpoint_archive(model, optimizer, state);
  write_checkpoint_file(path, [&](const std::function<bool(const void*, size_t)>& sink) {
    archive.save_to([&](const void* data, size_t n) -> size_t {
      // Always n: told of a short write, LibTorch's writer throws from its destructor
      // (std::terminate). write_atomically remembers the failure and throws once save_to returns.
      sink(data, n);
      return n;
    });
  });
}

// ---- AsyncCheckpointWriter ------------------------------------------------------------------

struct AsyncCheckpointWriter::Impl {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<std::function<void()>> queue;
  bool running = false;  // a job is out of the queue and not done
  bool stop = false;
  std::exception_ptr failure;
  std::string buffer;  // the serialized checkpoint being written; its capacity stays for the next
  std::thread thread;

  void work() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      changed.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop, and nothing left
      std::function<void()> job = std::move(queue.front());
      queue.pop_front();
      running = true;
      const bool skip = failure != nullptr;  // what follows a failed write (its best.pt link) is not done
      lock.unlock();
      std::exception_ptr error;
      if (!skip) {
        try {
          job();
        } catch (...) {
          error = std::current_exception();
        }
      }
      lock.lock();
      if (error && !failure) failure = error;
      running = false;
      changed.notify_all();
    }
  }
  void enqueue(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!thread.joinable()) thread = std::thread([this] { work(); });
    queue.push_back(std::move(job));
    changed.notify_all();
  }
  // Waits for the queue to drain; returns the failure not yet reported, if any.
  std::exception_ptr drain() {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return queue.empty() && !running; });
    return std::exchange(failure, nullptr);
  }
};

AsyncCheckpointWriter::AsyncCheckpointWriter() : impl_(std::make_unique<Impl>()) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  if (const auto failure = impl_->drain()) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      log::error(std::string("checkpoint written in the background failed: ") + e.what());
    } catch (...) {
      log::error("checkpoint written in the background failed");
    }
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stop = true;
    impl_->changed.notify_all();
  }
  if (impl_->thread.joinable()) impl_->thread.join();
}

void AsyncCheckpointWriter::save(const std::string& path, const torch::nn::Module& model,
                                 const torch::optim::Optimizer* optimizer, const TrainState& state) {
  wait();  // the buffer is free, and an earlier failure is reported before this checkpoint
  const auto started = std::chrono::steady_clock::now();
  std::string& buffer = impl_->buffer;
  buffer.clear();
  checkpoint_archive(model, optimizer, state).save_to([&](const void* data, size_t n) -> size_t {
    buffer.append(static_cast<const char*>(data), n);
    return n;
  });
  const double copy_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  impl_->enqueue([this, path, copy_s] {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string& bytes = impl_->buffer;
    write_checkpoint_file(path, [&](const std::function<bool(const void*, size_t)>& sink) {
      sink(bytes.data(), bytes.size());
    });
    log::info(log::str("checkpoint ", path, " (", log::fixed(static_cast<double>(bytes.size()) / (1 << 20), 1),
                       " MiB: ", log::fixed(copy_s, 2), " s to copy in the training loop, ",
                       log::fixed(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2),
                       " s to write in the background)"));
  });
}

void AsyncCheckpointWriter::then(std::function<void()> job) { impl_->enqueue(std::move(job)); }

void AsyncCheckpointWriter::wait() {
  if (const auto failure = impl_->drain()) std::rethrow_exception(failure);
}

bool AsyncCheckpointWriter::idle() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->queue.empty() && !impl_->running;
}

TrainState load_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer* optimizer) {
  auto archive = open_archive(path);
  check_architecture(saved_architecture(archive), model, path, /*strict=*/true);
  read_model(archive, model, path);
  if (optimizer) {
    torch::serialize::InputArchive opt;
    if (!archive.try_read("optimizer", opt)) throw CheckpointError(path + ": no 'optimizer' entry");
    // LibTorch's load replaces each group's options (weight decay, momentum, betas, eps) with the
    // saved ones; the optimizer as the caller built it, from today's config, keeps its own.
    torch::serialize::InputArchive groups, group;  // LibTorch's layout: param_groups/param_groups/0/params/0
    c10::IValue key;
    if (opt.try_read("param_groups", groups) && groups.try_read("param_groups/0", group) &&
        group.try_read("params/0", key) && key.isString() &&
        !compat::reads_saved_optimizer_key(key.toStringRef())) {
      throw CheckpointError(path + ": its optimizer state was written by LibTorch 1.x, which keys it in a form LibTorch " +
                            compat::torch_version() + " cannot read back; resume it with LibTorch 1.x, or start " +
                            "a run from its weights alone with model.init_from: " + path + " (a fresh optimizer)");
    }
    std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> configured;
    for (const auto& group : optimizer->param_groups()) configured.push_back(group.options().clone());
    try {
      // LibTorch's load only assigns the state the archive has: a parameter first stepped after
      // the checkpoint would keep its newer moments through a rollback.
      optimizer->state().clear();
      optimizer->load(opt);
      for (size_t i = 0; i < configured.size() && i < optimizer->param_groups().size(); ++i) {
        optimizer->param_groups()[i].set_options(std::move(configured[i]));
      }
      place_state_like_params(*optimizer);  // the archive was read onto the CPU
    } catch (const Error&) {
      throw;
    } catch (const std::invalid_argument& e) {
      throw CheckpointError(path + ": optimizer state does not match this model: " + e.what());
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      // LibTorch's message is an internal assertion; the config the checkpoint carries says which
      // optimizer wrote it.
      std::string written_by;
      c10::IValue saved;
      if (archive.try_read("config", saved) && saved.isString()) {
        try {
          const Config config = parse_config(saved.toStringRef(), path);
          written_by = " (it was written with optim.name " + config.optim.name + ", optim.impl " + config.optim.impl +
                       ", optim.decay_norm_and_bias " + (config.optim.decay_norm_and_bias ? "true" : "false") +
                       "; resume with that optimizer, or start from its weights alone with model.init_from: " +
                       path + ")";
        } catch (const std::exception&) {
        }
      }
      throw CheckpointError(path + ": optimizer state does not match this optimizer" + written_by + ": " +
                            what.substr(0, what.find('\n')));
    } catch (const std::exception& e) {
      // TorchScript's own errors on a damaged archive (an entry the layout names but lacks).
      const std::string what = e.what();
      throw CheckpointError(path + ": optimizer state is damaged: " + what.substr(0, what.find('\n')));
    }
  }
  TrainState state;
  state.step = read_int(archive, "step", path);
  state.epoch = read_int(archive, "epoch", path);
  state.batch_in_epoch = read_int(archive, "batch_in_epoch", path);
  state.samples_seen = read_int(archive, "samples_seen", path);
  // The counters drive the LR schedule and the loader's position: a negative step would give a
  // negative learning rate, a huge position would overflow. The format writes none of these.
  const std::pair<const char*, int64_t> counters[] = {{"step", state.step},
                                                      {"epoch", state.epoch},
                                                      {"batch_in_epoch", state.batch_in_epoch},
                                                      {"samples_seen", state.samples_seen}};
  for (const auto& [name, value] : counters) {
    const int64_t limit = std::string(name) == "samples_seen" ? (int64_t{1} << 62) : limits::kMaxSteps;
    if (value < 0 || value > limit) {
      throw CheckpointError(path + ": '" + name + "' is " + std::to_string(value) + ", outside 0.." +
                            std::to_string(limit) + "; the file is corrupt or was not written by train");
    }
  }
  c10::IValue config;
  if (archive.try_read("config", config) && config.isString()) state.config_yaml = config.toStringRef();
  torch::serialize::InputArchive extra;
  if (archive.try_read("state", extra)) {
    for (const auto& key : extra.keys()) {
      torch::Tensor t;
      if (!extra.try_read(key, t)) throw CheckpointError(path + ": state entry '" + key + "' is not a tensor");
      state.tensors[key] = t;
    }
  }
  return state;
}

namespace {
std::map<std::string, torch::Tensor> read_archive_weights(const std::string& path, std::string* architecture) {
  auto archive = open_archive(path);
  if (architecture) *architecture = saved_architecture(archive);
  torch::serialize::InputArchive weights;
  if (!archive.try_read("model", weights)) throw CheckpointError(path + ": no 'model' entry");
  std::map<std::string, torch::Tensor> out;
  for (const auto& key : weights.keys()) {
    torch::Tensor t;
    if (!weights.try_read(key, t)) throw CheckpointError(path + ": model entry '" + key + "' is not a tensor");
    out.emplace(key, t);
  }
  return out;
}
}  // namespace

std::map<std::string, torch::Tensor> read_checkpoint_weights(const std::string& path) {
  return read_archive_weights(path, nullptr);
}

namespace {
bool is_safetensors_path(const std::string& path) {
  const std::string ext = ".safetensors";
  return path.size() >= ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
}

// The weights, and the architecture a checkpoint records ("" for a safetensors file) checked
// against the model's.
std::map<std::string, torch::Tensor> read_weights(const std::string& path, const torch::nn::Module& model,
                                                  bool strict) {
  if (is_safetensors_path(path)) return read_safetensors(path);
  std::string architecture;
  auto tensors = read_archive_weights(path, &architecture);
  check_architecture(architecture, model, path, strict);
  return tensors;
}

template <typename Fn>
auto with_strict_hint(Fn&& fn) {
  try {
    return fn();
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    if (what.find("do not match the model") == std::string::npos) throw;
    throw CheckpointError(what + " (for model.init_from, model.init_strict: false loads the matching keys and "
                                 "skips the rest)");
  }
}
}  // namespace

void load_model_weights(const std::string& path, torch::nn::Module& model, bool strict, const WeightRules& rules) {
  const auto tensors = read_weights(path, model, strict);
  const LoadReport report = with_strict_hint([&] { return load_state_dict(model, tensors, strict, path, rules); });
  auto joined = [](const std::vector<std::string>& keys) {
    std::string s;
    for (const auto& k : keys) s += (s.empty() ? "" : ", ") + k;
    return s;
  };
  if (!report.stripped_prefix.empty()) {
    log::info(path + ": keys '" + report.stripped_prefix + "*' read without that prefix (a Hugging Face head model's "
              "base model)");
  }
  for (const auto& [from, to] : report.renamed) {
    log::info(path + ": keys '*" + from + "' read as '*" + to + "' (the model's name for them)");
  }
  const size_t total = report.loaded.size() + report.missing.size() + report.mismatched.size() + report.fresh.size();
  if (!report.fresh.empty()) {
    log::warn(log::str(path, ": loaded ", report.loaded.size(), " of ", total, " model tensors; the task head ",
                       "keeps its initialisation (train it before use): ", joined(report.fresh)));
  }
  if (!report.unused.empty()) log::info(path + ": not used, heads this model does not have: " + joined(report.unused));
  if (!report.redundant.empty()) {
    log::info(path + ": skipped, copies of tied weights or fixed buffers: " + joined(report.redundant));
  }
  if (!report.complete()) {
    log::warn(log::str(path, ": loaded ", report.loaded.size(), " of ", total,
                       " model tensors (model.init_strict: false); ", report.summary()));
  }
}

void check_model_weights(const std::string& path, const torch::nn::Module& model, bool strict,
                         const WeightRules& rules) {
  const auto tensors = read_weights(path, model, strict);
  with_strict_hint([&] { return match_state_dict(model, tensors, strict, path, rules); });
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "step_%08lld.pt", static_cast<long long>(step));
  return files::join(dir, name);
}

using detail::checkpoint_step;

// Oldest first, by step: the names are padded to 8 digits, so past step 99,999,999 their text
// order is not their step order.
std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& name : files::list_directory(dir)) {
    const int64_t step = checkpoint_step(name);
    if (step >= 0 && files::is_regular_file(files::join(dir, name))) found.emplace_back(step, name);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (const auto& [step, name] : found) out.push_back(files::join(dir, name));
  return out;
}

std::string latest_checkpoint(const std::string& dir) {
  // A run looks for its checkpoint more than once (the CLI's checks, fit_in_run_dir, the trainer):
  // each damaged file is reported once per process, not at every look.
  static std::mutex reported_mutex;
  static std::set<std::string> reported;
  const auto all = list_checkpoints(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      open_archive(*it);
      return *it;
    } catch (const CheckpointError& e) {
      const std::string message = std::string("skipping checkpoint: ") + e.what();
      std::lock_guard<std::mutex> lock(reported_mutex);
      if (reported.insert(message).second) log::warn(message);
    }
  }
  return "";
}

namespace {
std::string best_record_path(const std::string& dir) { return files::join(dir, "best.json"); }

// Moves the files of `paths` that exist into `aside`, each under its name numbered with the first n
// at which none of their names is taken there (an earlier resume may have set aside files of the
// same names: none is overwritten), in the order given. Returns the names for `paths`, moved or not.
std::vector<std::string> move_aside(const std::vector<std::string>& paths, const std::string& aside) {
  files::make_directories(aside);
  const auto kept_as = [&](const std::string& path, int n) {
    return files::join(aside, detail::kept_checkpoint_name(files::filename(path), n));
  };
  int n = 0;
  while (std::any_of(paths.begin(), paths.end(), [&](const std::string& p) { return files::exists(kept_as(p, n)); })) {
    ++n;
  }
  std::vector<std::string> kept;
  for (const std::string& from : paths) {
    kept.push_back(kept_as(from, n));
    if (files::exists(from) && std::rename(from.c_str(), kept.back().c_str()) != 0) {
      throw Error("cannot move " + from + " to " + kept.back() + ": " + std::strerror(errno));
    }
  }
  return kept;
}
}  // namespace

std::vector<std::string> set_aside_checkpoints_after(const std::string& dir, int64_t step) {
  std::vector<std::string> moved;
  const std::string aside = files::join(dir, "abandoned");
  for (const auto& path : list_checkpoints(dir)) {
    if (checkpoint_step(files::filename(path)) <= step) continue;
    moved.push_back(move_aside({path, sum_path(path)}, aside)[0]);
  }
  // best.pt from that future goes with it (best.json beside it, all under one number), rather
  // than being replaced by the resumed run's first evaluation. best.json last: a kill in between
  // leaves a record without its file, which the next run replaces.
  const std::optional<BestCheckpoint> best = read_best_checkpoint(dir);
  if (best && best->step > step) {
    const std::string best_pt = best_checkpoint_path(dir);
    const std::vector<std::string> kept = move_aside({best_pt, sum_path(best_pt), best_record_path(dir)}, aside);
    for (const std::string& file : {kept[0], kept[2]}) {
      if (files::exists(file)) moved.push_back(file);
    }
  }
  return moved;
}

void prune_checkpoints(const std::string& dir, int64_t keep, const std::string& protect) {
  auto all = list_checkpoints(dir);
  const int64_t excess = static_cast<int64_t>(all.size()) - std::max<int64_t>(1, keep);
  for (int64_t i = 0; i < excess; ++i) {
    if (all[i] == protect) continue;
    // The checksum first: a kill in between leaves a checkpoint that still loads (its ZIP members'
    // CRCs are checked instead) and that the next pruning removes, never a checksum of nothing.
    if (files::exists(sum_path(all[i]))) files::remove_file(sum_path(all[i]));
    files::remove_file(all[i]);
  }
}

std::vector<std::string> remove_stale_checkpoint_temporaries(const std::string& dir) {
  const auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  std::vector<std::string> removed = detail::remove_stale_temporaries(dir, [&](const std::string& target) {
    return (target.rfind("step_", 0) == 0 && (ends_with(target, ".pt") || ends_with(target, sum_path(".pt")))) ||
           target == "best.pt" || target == sum_path("best.pt") || target == "best.json";
  });
  // Checksums whose checkpoint is gone (an older version's pruning, killed between the two
  // removals; a checkpoint deleted by hand): nothing reads them, and a checkpoint written later
  // under that name must not meet a stale one.
  const std::string sidecar = sum_path(".pt");
  for (const auto& name : files::list_directory(dir)) {
    const bool checksum = (name.rfind("step_", 0) == 0 || name == sum_path("best.pt")) && ends_with(name, sidecar);
    if (!checksum) continue;
    const std::string path = files::join(dir, name);
    const std::string checkpoint = path.substr(0, path.size() - std::string(kSumSuffix).size());
    if (files::exists(checkpoint) || !files::is_regular_file(path)) continue;
    log::info("removing " + path + ": the checksum of a checkpoint that is no longer there");
    files::remove_file(path);
    removed.push_back(path);
  }
  return removed;
}

std::string best_checkpoint_path(const std::string& dir) { return files::join(dir, "best.pt"); }

namespace {
// `to` becomes the file `from` is, atomically: a hard link under a temporary name renamed over
// `to`; where links fail (another file system, one without them), a copy written the same way.
void replace_with(const std::string& from, const std::string& to) {
  const std::string tmp = to + ".tmp." + std::to_string(::getpid());
  if (files::exists(tmp)) files::remove_file(tmp);
  if (::link(from.c_str(), tmp.c_str()) != 0) {
    detail::write_atomically(to, [&](const auto& sink) {
      std::FILE* in = std::fopen(from.c_str(), "rb");
      if (in == nullptr) throw Error("cannot read " + from + ": " + std::strerror(errno));
      std::vector<char> buf(1 << 20);
      size_t n = 0;
      while ((n = std::fread(buf.data(), 1, buf.size(), in)) > 0 && sink(buf.data(), n)) {
      }
      const bool failed = std::ferror(in) != 0;
      std::fclose(in);
      if (failed) throw Error("cannot read " + from + ": " + std::strerror(errno));
    });
    return;
  }
  if (std::rename(tmp.c_str(), to.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    files::remove_file(tmp);
    throw Error("cannot replace " + to + ": " + reason);
  }
  detail::fsync_path(files::parent(to), /*directory=*/true);
}
}  // namespace

bool better_than(const std::string& metric, double value, double best) {
  return metric == "loss" ? value < best : value > best;
}

std::optional<BestCheckpoint> read_best_checkpoint(const std::string& dir) {
  const std::string path = best_record_path(dir);
  if (!files::exists(path)) return std::nullopt;
  try {
    std::ifstream in(path);
    const nlohmann::json j = nlohmann::json::parse(in);
    BestCheckpoint best;
    best.metric = j.at("metric").get<std::string>();
    best.value = j.at("value").get<double>();
    best.step = j.at("step").get<int64_t>();
    return best;
  } catch (const std::exception& e) {
    log::warn(path + ": not readable (" + e.what() + "); the next evaluation replaces best.pt");
    return std::nullopt;
  }
}

void keep_best_checkpoint(const std::string& dir, const std::string& checkpoint, const BestCheckpoint& best) {
  const std::string target = best_checkpoint_path(dir);
  // Without the old checksum first: best.pt and a checksum of another file never pair up.
  if (files::exists(sum_path(target))) files::remove_file(sum_path(target));
  replace_with(checkpoint, target);
  if (files::exists(sum_path(checkpoint))) replace_with(sum_path(checkpoint), sum_path(target));
  // nlohmann writes the shortest text that reads back as the same double: a resumed run ranks
  // against exactly this value.
  const nlohmann::json record = {{"metric", best.metric},
                                 {"value", best.value},
                                 {"step", best.step},
                                 {"checkpoint", files::filename(checkpoint)}};
  detail::write_text_atomically(best_record_path(dir), record.dump() + "\n");
}

}  // namespace train
