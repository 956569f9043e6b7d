#pragma once
// The process group's internals, shared by dist.cpp (rendezvous, collectives) and ddp.cpp
// (bucketed gradient allreduce). Internal header: not installed.
#define TRAIN_COMPAT_C10D 1
#include "compat.h"
#include "train/dist.h"

#include <string>

namespace train::dist {

struct Group::Impl {
  Env env;
  std::string backend_name;
  torch::Device device{torch::kCPU};
  double timeout_s = 0;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<compat::C10dBackend> backend;
  int64_t store_barriers = 0;  // wait_for_all calls so far: the same count on every rank

  ~Impl();  // shuts the backend down (compat::shutdown_backend)

  // "rank 1 of 2 (gloo): allreduce failed: <c10d's reason>" as a train::Error.
  [[noreturn]] void fail(const std::string& op, const std::string& reason) const;
  // Waits for a collective, turning c10d's exceptions into fail(): a failure, or
  // distributed.timeout_s passing, throws train::Error naming `op`. Gloo's wait blocks the host.
  // NCCL's plain wait only makes the current stream wait for NCCL's and never fails: with on_host (the group's own collectives, which the host reads next anyway) it
  // blocks the host with the timeout; without it (gradient buckets, whose host must run ahead)
  // the stream waits, and NCCL's watchdog catches a hang.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op, bool on_host = true) const;
};

}  // namespace train::dist
