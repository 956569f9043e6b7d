#include "train/checkpoint.h"

#include <signal.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <torch/torch.h>
#include <vector>

#include "atomic_file.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"
#include "train/metrics.h"
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
  for (auto& [name, tensor] : state_entries(model)) {
    torch::Tensor stored;
    if (!weights.try_read(name, stored)) {
      throw CheckpointError(path + ": model entry '" + name + "' is missing (was it written by another model?)");
    }
    if (stored.sizes() != tensor.sizes()) {
      throw CheckpointError(path + ": model entry '" + name + "' has shape " + shape_str(stored) +
                            ", the model expects " + shape_str(tensor));
    }
    tensor.copy_(stored);
  }
}

// Every checkpoint has a sidecar "<file>.crc32c" with the CRC-32C and size of its bytes, written
// after the checkpoint itself. A checkpoint without one (a crash between the two renames, or a
// file from elsewhere) is trusted as far as its archive structure goes.
std::string sum_path(const std::string& path) { return path + ".crc32c"; }

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
// (1.13: SIGSEGV in ScriptTypeParser, found by fuzz/fuzz_checkpoint.cpp). So a checkpoint that
// has no .crc32c sidecar has the CRC-32 of each stored member checked here first. Structural
// problems before the members (no zip directory) are left to LibTorch to report, and so are
// ZIP64 archives (over 4 GiB), whose fields this does not read.
void verify_zip_members(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  const int64_t size = files::file_size(path);
  if (!f || size < 22) return;
  auto read_at = [&](int64_t offset, size_t n, std::vector<uint8_t>& out) {
    if (offset < 0 || offset + static_cast<int64_t>(n) > size) return false;  // before allocating n
    out.resize(n);
    return std::fseek(f.get(), offset, SEEK_SET) == 0 && std::fread(out.data(), 1, n, f.get()) == n;
  };
  auto u16 = [](const uint8_t* p) { return static_cast<uint32_t>(p[0] | p[1] << 8); };
  auto u32 = [](const uint8_t* p) { return static_cast<uint32_t>(p[0] | p[1] << 8 | p[2] << 16) | uint32_t{p[3]} << 24; };
  // The end-of-central-directory record: the last 22 bytes, or earlier when a comment follows.
  std::vector<uint8_t> tail;
  const int64_t tail_size = std::min<int64_t>(size, 22 + 65535);
  if (!read_at(size - tail_size, static_cast<size_t>(tail_size), tail)) return;
  int64_t eocd = tail_size - 22;
  while (eocd >= 0 && u32(&tail[eocd]) != 0x06054b50) --eocd;
  if (eocd < 0) return;
  const uint32_t entries = u16(&tail[eocd + 10]), dir_size = u32(&tail[eocd + 12]), dir_offset = u32(&tail[eocd + 16]);
  if (entries == 0xFFFF || dir_size == 0xFFFFFFFF || dir_offset == 0xFFFFFFFF) return;  // ZIP64
  std::vector<uint8_t> dir, local, chunk;
  if (!read_at(dir_offset, dir_size, dir)) return;
  for (size_t p = 0, i = 0; i < entries; ++i) {
    if (p + 46 > dir.size() || u32(&dir[p]) != 0x02014b50) return;
    const uint32_t method = u16(&dir[p + 10]), crc = u32(&dir[p + 16]), stored = u32(&dir[p + 20]);
    const uint32_t name_length = u16(&dir[p + 28]), local_offset = u32(&dir[p + 42]);
    const size_t next = p + 46 + name_length + u16(&dir[p + 30]) + u16(&dir[p + 32]);
    if (next > dir.size()) return;
    const std::string name(dir.begin() + static_cast<int64_t>(p) + 46, dir.begin() + static_cast<int64_t>(p) + 46 + name_length);
    p = next;
    if (method != 0 || stored == 0xFFFFFFFF || local_offset == 0xFFFFFFFF) continue;  // compressed or ZIP64
    // The directory names a member here, so a missing local header or data that runs past the
    // end is damage, not a format this check skips: LibTorch 1.13 read on from such archives and
    // asked for a 4 GiB string (found by fuzz/fuzz_checkpoint.cpp).
    const std::string damaged = path + ": archive member '" + name + "' ";
    if (!read_at(local_offset, 30, local) || u32(local.data()) != 0x04034b50) {
      throw CheckpointError(damaged + "has no local header at its offset; the file is corrupt");
    }
    int64_t offset = int64_t{local_offset} + 30 + u16(&local[26]) + u16(&local[28]);
    if (offset + int64_t{stored} > size) throw CheckpointError(damaged + "runs past the end of the file; it is truncated");
    uLong actual = crc32(0, nullptr, 0);
    for (int64_t left = stored; left > 0;) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(left, 1 << 20));
      if (!read_at(offset, n, chunk)) return;
      actual = crc32(actual, chunk.data(), static_cast<uInt>(n));
      offset += static_cast<int64_t>(n);
      left -= static_cast<int64_t>(n);
    }
    if (actual != crc) {
      throw CheckpointError(path + ": archive member '" + name + "' fails its CRC-32 check; the file is corrupt");
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

void save_checkpoint(const std::string& path, const torch::nn::Module& model,
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
  torch::serialize::OutputArchive extra;
  for (const auto& [name, tensor] : state.tensors) extra.write(name, tensor.detach().to(torch::kCPU));
  archive.write("state", extra);

  uint32_t crc = 0;
  uint64_t bytes = 0;
  detail::write_atomically(path, [&](const auto& sink) {
    archive.save_to([&](const void* data, size_t n) -> size_t {
      crc = crc32c(data, n, crc);
      bytes += n;
      return sink(data, n) ? n : 0;
    });
  });
  detail::write_text_atomically(sum_path(path), sum_text(crc, bytes));
}

TrainState load_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer* optimizer) {
  auto archive = open_archive(path);
  read_model(archive, model, path);
  if (optimizer) {
    torch::serialize::InputArchive opt;
    if (!archive.try_read("optimizer", opt)) throw CheckpointError(path + ": no 'optimizer' entry");
    try {
      optimizer->load(opt);
      place_state_like_params(*optimizer);  // the archive was read onto the CPU
    } catch (const std::invalid_argument& e) {
      throw CheckpointError(path + ": optimizer state does not match this model: " + e.what());
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      throw CheckpointError(path + ": optimizer state does not match this optimizer: " +
                            what.substr(0, what.find('\n')));
    }
  }
  TrainState state;
  state.step = read_int(archive, "step", path);
  state.epoch = read_int(archive, "epoch", path);
  state.batch_in_epoch = read_int(archive, "batch_in_epoch", path);
  state.samples_seen = read_int(archive, "samples_seen", path);
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

std::map<std::string, torch::Tensor> read_checkpoint_weights(const std::string& path) {
  auto archive = open_archive(path);
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

namespace {
bool is_safetensors_path(const std::string& path) {
  const std::string ext = ".safetensors";
  return path.size() >= ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
}

std::map<std::string, torch::Tensor> read_weights(const std::string& path) {
  return is_safetensors_path(path) ? read_safetensors(path) : read_checkpoint_weights(path);
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

void load_model_weights(const std::string& path, torch::nn::Module& model, bool strict) {
  const auto tensors = read_weights(path);
  const LoadReport report = with_strict_hint([&] { return load_state_dict(model, tensors, strict, path); });
  if (!report.complete()) {
    log::warn(log::str(path, ": loaded ", report.loaded.size(), " of ",
                       report.loaded.size() + report.missing.size() + report.mismatched.size(),
                       " model tensors (model.init_strict: false); ", report.summary()));
  }
}

void check_model_weights(const std::string& path, const torch::nn::Module& model, bool strict) {
  const auto tensors = read_weights(path);
  with_strict_hint([&] { return match_state_dict(model, tensors, strict, path); });
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "step_%08lld.pt", static_cast<long long>(step));
  return files::join(dir, name);
}

namespace {
std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& name : files::list_directory(dir)) {  // sorted; zero-padded steps sort by step
    const bool is_ckpt = name.rfind("step_", 0) == 0 && name.size() > 3 && name.substr(name.size() - 3) == ".pt";
    if (is_ckpt && files::is_regular_file(files::join(dir, name))) out.push_back(files::join(dir, name));
  }
  return out;
}
}  // namespace

std::string latest_checkpoint(const std::string& dir) {
  const auto all = list_checkpoints(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      open_archive(*it);
      return *it;
    } catch (const CheckpointError& e) {
      log::warn(std::string("skipping checkpoint: ") + e.what());
    }
  }
  return "";
}

std::vector<std::string> set_aside_checkpoints_after(const std::string& dir, int64_t step) {
  std::vector<std::string> moved;
  const std::string aside = files::join(dir, "abandoned");
  for (const auto& path : list_checkpoints(dir)) {
    const std::string name = files::filename(path);
    if (std::strtoll(name.c_str() + 5, nullptr, 10) <= step) continue;  // "step_%08lld.pt"
    files::make_directories(aside);
    for (const std::string& from : {path, sum_path(path)}) {
      const std::string to = files::join(aside, files::filename(from));
      if (files::exists(from) && std::rename(from.c_str(), to.c_str()) != 0) {
        throw Error("cannot move " + from + " to " + to + ": " + std::strerror(errno));
      }
    }
    moved.push_back(files::join(aside, name));
  }
  return moved;
}

void prune_checkpoints(const std::string& dir, int64_t keep, const std::string& protect) {
  auto all = list_checkpoints(dir);
  const int64_t excess = static_cast<int64_t>(all.size()) - std::max<int64_t>(1, keep);
  for (int64_t i = 0; i < excess; ++i) {
    if (all[i] == protect) continue;
    files::remove_file(all[i]);
    if (files::exists(sum_path(all[i]))) files::remove_file(sum_path(all[i]));
  }
}

std::vector<std::string> remove_stale_checkpoint_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  for (const auto& name : files::list_directory(dir)) {
    // detail::write_atomically names its temporary file "<target>.tmp.<pid>".
    const size_t tmp = name.rfind(".tmp.");
    if (name.rfind("step_", 0) != 0 || tmp == std::string::npos) continue;
    const std::string target = name.substr(0, tmp), digits = name.substr(tmp + 5);
    const auto ends_with = [&](const std::string& suffix) {
      return target.size() > suffix.size() && target.compare(target.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (!(ends_with(".pt") || ends_with(".pt.crc32c")) || digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      continue;
    }
    const std::string path = files::join(dir, name);
    if (!files::is_regular_file(path)) continue;
    const auto pid = static_cast<pid_t>(std::stol(digits));
    const bool running = pid > 0 && pid != ::getpid() && (::kill(pid, 0) == 0 || errno == EPERM);
    if (running) {
      log::warn(log::str("kept ", path, ": its writer, pid ", pid, ", is still running (another run writing to ",
                         dir, "?)"));
      continue;
    }
    try {
      files::remove_file(path);
    } catch (const Error& e) {
      log::warn(std::string("could not remove a leftover temporary file: ") + e.what());
      continue;
    }
    log::info(log::str("removed ", path, ", left by a checkpoint write that did not finish (pid ", pid, ")"));
    removed.push_back(path);
  }
  return removed;
}

}  // namespace train
