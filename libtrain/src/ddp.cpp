#include "train/ddp.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <chrono>
#include <iomanip>
#include <map>
#include <mutex>
#include <utility>
#include <sstream>

#include "dist_internal.h"
#include "train/errors.h"
#include "train/log.h"

namespace train::dist {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The integer type with the element size of `t`, to read its bits.
torch::ScalarType bits_type(const torch::Tensor& t) {
  switch (t.element_size()) {
    case 1: return torch::kByte;
    case 2: return torch::kShort;
    case 4: return torch::kInt;
    default: return torch::kLong;
  }
}

// Broadcasts tensors from root by packing them into one flat buffer per dtype.
void broadcast_coalesced(Group& group, const std::vector<torch::Tensor>& tensors, int64_t root) {
  std::map<torch::ScalarType, std::vector<torch::Tensor>> by_type;
  for (const auto& t : tensors) by_type[t.scalar_type()].push_back(t);
  torch::NoGradGuard no_grad;
  for (auto& [type, list] : by_type) {
    std::vector<torch::Tensor> flat;
    flat.reserve(list.size());
    for (const auto& t : list) flat.push_back(t.detach().reshape({-1}));
    std::vector<torch::Tensor> buffer{torch::cat(flat)};
    group.broadcast(buffer, root);
    int64_t offset = 0;
    for (auto& t : list) {
      const int64_t n = t.numel();
      t.copy_(buffer[0].narrow(0, offset, n).view(t.sizes()));
      offset += n;
    }
  }
}

}  // namespace

struct GradSync::Impl {
  struct Param {
    torch::Tensor tensor;
    std::string name;
    size_t bucket = 0;
    int64_t offset = 0;     // element offset in the bucket's buffer
    bool ready = false;     // its gradient is in the bucket (this synchronising backward)
    bool used = false;      // its hook fired in some micro-step since the last finish()
    std::shared_ptr<torch::autograd::Node> accumulator;  // held: the variable keeps it only weakly
    uintptr_t hook_key = 0;
  };
  struct Bucket {
    std::vector<size_t> params;
    torch::Tensor buffer;
    int64_t pending = 0;
    bool launched = false;
    c10::intrusive_ptr<c10d::Work> work;
  };

  torch::nn::Module* model = nullptr;
  GroupPtr group;
  GradSyncOptions options;
  std::vector<Param> params;    // registration order
  std::vector<Bucket> buckets;  // bucket 0 holds the last parameters (ready first)
  std::mutex mutex;             // hooks may run on autograd's device threads
  bool syncing = false;         // hooks fill buckets: between prepare(true) and finish()
  bool sync_step = false;       // the step's last prepare() was prepare(true): buckets may be launched
  bool used_reduced = false;    // this step's reduce_used() collective has run
  std::string repeated;           // a parameter whose gradient arrived twice in one synchronising step
  bool collectives_done = false;  // this step's allreduces have all completed (finish() got past its waits)
  size_t next_launch = 0;       // buckets launch strictly in index order, the same on every rank
  GradSyncStats stats;

  void mark_ready(size_t index);
  torch::Tensor reduce_used();
  void launch_ready_buckets();
  void launch(Bucket& bucket);
};

namespace {

class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(GradSync::Impl* impl, size_t index) : impl_(impl), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    impl_->mark_ready(index_);
    return outputs;
  }

 private:
  GradSync::Impl* impl_;
  size_t index_;
};

}  // namespace

void GradSync::Impl::mark_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex);
  Param& p = params[index];
  p.used = true;
  if (!syncing) return;  // a no_sync micro-step: the gradient stays local
  if (p.ready) {  // a second backward: its gradient would miss the allreduce
    if (repeated.empty()) repeated = p.name;
    return;
  }
  p.ready = true;
  Bucket& b = buckets[p.bucket];
  const auto t0 = Clock::now();
  const torch::Tensor& grad = p.tensor.grad();
  b.buffer.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes()).copy_(grad);
  stats.copy_seconds += seconds_since(t0);
  if (--b.pending == 0) launch_ready_buckets();
}

// How many ranks used each parameter since the last finish() (int32 on the CPU). Collective: with
// find_unused_parameters every rank calls it once per synchronised step, after its buckets.
torch::Tensor GradSync::Impl::reduce_used() {
  std::vector<int32_t> flags;
  flags.reserve(params.size());
  for (const auto& p : params) flags.push_back(p.used ? 1 : 0);
  std::vector<torch::Tensor> tensors{torch::tensor(flags, torch::kInt).to(group->impl().device)};
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = group->impl().backend->allreduce(tensors);
  } catch (const std::exception& e) {
    group->impl().fail("allreduce of used parameters", e.what());
  }
  group->impl().wait(work, "allreduce of used parameters");
  return tensors[0].cpu();
}

void GradSync::Impl::launch_ready_buckets() {
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(buckets[next_launch++]);
}

void GradSync::Impl::launch(Bucket& bucket) {
  // Dividing first makes the sum the mean, as PyTorch's DDP does (Gloo has no AVG).
  bucket.buffer.div_(static_cast<double>(group->size()));
  std::vector<torch::Tensor> tensors{bucket.buffer};
  try {
    bucket.work = group->impl().backend->allreduce(tensors);
  } catch (const std::exception& e) {
    group->impl().fail("gradient allreduce", e.what());
  }
  bucket.launched = true;
}

GradSync::GradSync(torch::nn::Module& model, GroupPtr group, GradSyncOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.model = &model;
  s.group = std::move(group);
  s.options = options;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    Impl::Param p;
    p.tensor = item.value();
    p.name = item.key();
    s.params.push_back(std::move(p));
  }
  // Buckets in reverse registration order, split by dtype and device, capped by size; the first
  // is small so that communication starts as soon as the last layers' gradients exist.
  int64_t bucket_bytes = 0;
  for (size_t k = s.params.size(); k-- > 0;) {
    Impl::Param& p = s.params[k];
    const int64_t bytes = p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
    // The bucket being filled is the first one while only one exists.
    const int64_t cap = s.buckets.size() == 1 ? options.first_bucket_bytes : options.bucket_bytes;
    bool start_new = s.buckets.empty();
    if (!start_new) {
      const Impl::Param& head = s.params[s.buckets.back().params.front()];
      start_new = head.tensor.scalar_type() != p.tensor.scalar_type() || head.tensor.device() != p.tensor.device() ||
                  bucket_bytes + bytes > cap;
    }
    if (start_new) {
      s.buckets.emplace_back();
      bucket_bytes = 0;
    }
    Impl::Bucket& b = s.buckets.back();
    p.bucket = s.buckets.size() - 1;
    p.offset = 0;
    for (size_t q : b.params) p.offset += s.params[q].tensor.numel();
    b.params.push_back(k);
    bucket_bytes += bytes;
  }
  for (auto& b : s.buckets) {
    int64_t numel = 0;
    for (size_t q : b.params) numel += s.params[q].tensor.numel();
    const auto& head = s.params[b.params.front()].tensor;
    b.buffer = torch::zeros({numel}, head.options().requires_grad(false));
    s.stats.bytes += numel * static_cast<int64_t>(head.element_size());
  }
  s.stats.buckets = static_cast<int64_t>(s.buckets.size());
  s.stats.parameters = static_cast<int64_t>(s.params.size());
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto& p = s.params[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<ReadyHook>(impl_.get(), i));
  }
}

GradSync::~GradSync() {
  auto& s = *impl_;
  for (auto& p : s.params) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
  // Outstanding collectives must not outlive their buffers.
  for (auto& b : s.buckets) {
    if (b.work) {
      try {
        b.work->wait();
      } catch (...) {
      }
    }
  }
}

void GradSync::broadcast_parameters() {
  auto& s = *impl_;
  // Same names, shapes and dtypes everywhere, or the flat buffers would not line up.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const std::string& text) {
    for (unsigned char c : text) {
      h ^= c;
      h *= 1099511628211ull;
    }
  };
  std::vector<torch::Tensor> state;
  for (const auto& item : s.model->named_parameters(true)) {
    mix(item.key());
    for (int64_t d : item.value().sizes()) mix("," + std::to_string(d));
    mix(std::string(c10::toString(item.value().scalar_type())));
    state.push_back(item.value());
  }
  for (const auto& item : s.model->named_buffers(true)) {
    mix(item.key());
    for (int64_t d : item.value().sizes()) mix("," + std::to_string(d));
    state.push_back(item.value());
  }
  const auto mine = static_cast<int64_t>(h >> 1);
  const auto [low, high] = s.group->range(mine);
  if (low != high) {
    throw Error(log::str("distributed: rank ", s.group->rank(),
                         ": the model's parameter names or shapes differ between ranks (every rank must build the "
                         "same model from the same config)"));
  }
  broadcast_coalesced(*s.group, state, 0);
}

void GradSync::broadcast_buffers() {
  auto& s = *impl_;
  std::vector<torch::Tensor> buffers;
  for (const auto& item : s.model->named_buffers(true)) buffers.push_back(item.value());
  if (!buffers.empty()) broadcast_coalesced(*s.group, buffers, 0);
}

void GradSync::prepare(bool sync) {
  auto& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.syncing = sync;
  s.sync_step = sync;
  s.used_reduced = false;
  s.collectives_done = false;
  if (!sync) return;
  s.repeated.clear();
  for (auto& p : s.params) p.ready = false;
  for (auto& b : s.buckets) {
    b.pending = static_cast<int64_t>(b.params.size());
    b.launched = false;
    b.work.reset();
  }
  s.next_launch = 0;
}

void GradSync::finish() {
  auto& s = *impl_;
  std::unique_lock<std::mutex> lock(s.mutex);
  if (!s.syncing) throw Error("GradSync::finish() without prepare(true) before backward");
  s.syncing = false;
  if (!s.repeated.empty()) {
    const std::string name = std::exchange(s.repeated, std::string());
    throw Error("distributed: parameter " + name + " received a gradient from two backward passes in one "
                "synchronising step; run all but the last backward of a step with prepare(false) (no_sync)");
  }
  // Parameters whose hook never fired took no part in this backward.
  std::vector<std::string> unused;
  for (auto& p : s.params) {
    if (p.ready) continue;
    if (!s.options.find_unused_parameters) {
      unused.push_back(p.name);
      continue;
    }
    // Unused in the last micro-step: what earlier (no_sync) micro-steps accumulated, else nothing.
    auto slot = s.buckets[p.bucket].buffer.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
    if (p.used && p.tensor.grad().defined()) slot.copy_(p.tensor.grad()); else slot.zero_();
    p.ready = true;
    --s.buckets[p.bucket].pending;
  }
  if (!unused.empty()) {
    std::string names;
    for (size_t i = 0; i < unused.size() && i < 8; ++i) names += (i ? ", " : "") + unused[i];
    if (unused.size() > 8) names += log::str(" and ", unused.size() - 8, " more");
    throw Error(log::str("distributed: ", unused.size(), " parameter(s) received no gradient in this step (", names,
                         "): they were not used to compute the loss. Set distributed.find_unused_parameters: true "
                         "to count them as zero, or freeze them"));
  }
  s.launch_ready_buckets();
  // Which parameters some rank used, as PyTorch's DDP finds out: one parameter no rank used keeps
  // its gradient as it was (none), so that the optimizer leaves it alone as a single process would
  // (no weight decay, no momentum) rather than stepping on an all-zero gradient.
  torch::Tensor used_anywhere;
  if (s.options.find_unused_parameters) {
    used_anywhere = s.reduce_used();
    s.used_reduced = true;
  }
  const auto t0 = Clock::now();
  for (auto& b : s.buckets) s.group->impl().wait(b.work, "gradient allreduce", /*on_host=*/false);
  s.collectives_done = true;
  s.stats.wait_seconds += seconds_since(t0);
  const auto t1 = Clock::now();
  torch::NoGradGuard no_grad;
  const int32_t* used = used_anywhere.defined() ? used_anywhere.data_ptr<int32_t>() : nullptr;
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto& p = s.params[i];
    p.used = false;
    if (used != nullptr && used[i] == 0) continue;
    auto slot = s.buckets[p.bucket].buffer.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
    if (p.tensor.grad().defined()) {
      p.tensor.mutable_grad().copy_(slot);
    } else {
      p.tensor.mutable_grad() = slot.clone(at::MemoryFormat::Preserve).contiguous(p.tensor.suggest_memory_format());
    }
  }
  s.stats.copy_seconds += seconds_since(t1);
  ++s.stats.syncs;
  for (auto& b : s.buckets) b.work.reset();
}

void GradSync::abandon() {
  auto& s = *impl_;
  std::unique_lock<std::mutex> lock(s.mutex);
  if (s.collectives_done) return;  // failed after finish()'s allreduces: nothing left to take part in
  // Failed in a no_sync micro-step: nothing of this step was launched yet. Otherwise (in the
  // synchronising backward, or in finish()) the buckets launched so far stay launched: each
  // allreduce happens once, in order, as on the other ranks.
  if (!s.sync_step) {
    for (auto& b : s.buckets) {
      b.launched = false;
      b.work.reset();
    }
    s.next_launch = 0;
  }
  s.syncing = false;
  s.repeated.clear();
  for (auto& p : s.params) p.ready = true;
  for (auto& p : s.params) p.used = false;
  for (auto& b : s.buckets) b.pending = 0;
  s.launch_ready_buckets();  // whatever the buffers hold: every rank discards this step
  // The others' finish() takes part in it, once.
  if (s.options.find_unused_parameters && !s.used_reduced) (void)s.reduce_used();
  s.used_reduced = true;
  for (auto& b : s.buckets) s.group->impl().wait(b.work, "gradient allreduce", /*on_host=*/false);
  for (auto& b : s.buckets) b.work.reset();
  s.collectives_done = true;
}

int64_t GradSync::count_diverged_ranks() {
  auto& s = *impl_;
  torch::NoGradGuard no_grad;
  torch::Tensor sum;
  for (const auto& item : s.model->named_parameters(true)) {
    const auto bits = item.value().detach().contiguous().view(bits_type(item.value())).reshape({-1}).to(torch::kLong);
    const auto weights = torch::arange(bits.numel(), bits.options()).remainder(1000003).add_(1);
    const auto part = bits.mul(weights).sum();
    sum = sum.defined() ? sum + part : part;
  }
  const int64_t mine = sum.defined() ? sum.item<int64_t>() : 0;
  std::vector<torch::Tensor> root{torch::full({1}, mine, torch::TensorOptions().dtype(torch::kLong)
                                                             .device(s.group->impl().device))};
  s.group->broadcast(root, 0);
  const int64_t differs = root[0].item<int64_t>() != mine ? 1 : 0;
  return s.group->reduce_int(differs, ReduceOp::Sum);
}

GradSyncStats GradSync::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->stats;
}

std::string GradSync::describe() const {
  const auto& s = *impl_;
  std::ostringstream out;
  out << s.stats.buckets << " bucket(s) (" << std::fixed << std::setprecision(1)
      << static_cast<double>(s.options.bucket_bytes) / (1 << 20) << " MiB, first "
      << static_cast<double>(s.options.first_bucket_bytes) / (1 << 20) << " MiB) over " << s.stats.parameters
      << " parameters, " << static_cast<double>(s.stats.bytes) / 1e6 << " MB all-reduced per step on "
      << s.group->backend() << " across " << s.group->size() << " ranks";
  return out.str();
}

}  // namespace train::dist
