// Loader: sampler order (shuffle + distributed sharding), batching, and the worker threads.
//
// Concurrency scheme. Batches are numbered across epochs (batch b of epoch e is number
// e * batches_per_epoch + b), so workers run on past the end of an epoch into the next one and an
// epoch boundary does not drain the pipeline. Each worker claims the lowest number not yet claimed,
// but only a number n < next + capacity, where `next` is the number the caller receives next and
// capacity = workers * prefetch; it stores the batch in slot (n % capacity) of a ring. So at most
// `capacity` batches are in flight and slots never collide. next() waits for its slot, takes the
// batch and frees the slot. Numbers are claimed in order, so `next` has been claimed by a worker
// that is building it, never one waiting for room: no deadlock. start() at a position the workers
// are already building towards (the next epoch, once this one is read) keeps them; any other
// position stops them and starts afresh. set_workers() adds workers to the running ones.
#include <train/data/loader.h>
#include <train/data/transforms.h>
#include <train/config.h>
#include <train/errors.h>
#include <train/log.h>

#include "error_message.h"
#include "worker_thread.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace train::data {

OnError parse_on_error(const std::string& name) {
  if (name == "raise") return OnError::Raise;
  if (name == "skip") return OnError::Skip;
  throw std::invalid_argument("on_error must be raise or skip, got '" + name + "'");
}

uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t index) {
  return mix64(mix64(mix64(seed) + static_cast<uint64_t>(epoch)) + static_cast<uint64_t>(index));
}

namespace {

// Salt so that the shuffle stream differs from every per-sample stream of the same run.
constexpr uint64_t kShuffleSalt = 0x53485546464C45ull;  // "SHUFFLE"

// Samples per rank: DistributedSampler pads the dataset up to a multiple of world_size, or
// truncates it to one when drop_last. Without padding, rank r reads the indices r, r + W, ... below
// the dataset's size.
int64_t shard_size(int64_t dataset_size, const LoaderOptions& options) {
  const int64_t world = options.world_size;
  if (options.drop_last) return dataset_size / world;
  if (!options.pad) return std::max<int64_t>(0, (dataset_size - options.rank + world - 1) / world);
  return (dataset_size + world - 1) / world;
}

// This rank's sample indices for one epoch, in delivery order: a seeded Fisher-Yates
// permutation (or identity), then DistributedSampler's sharding: pad by repeating from the start
// up to a multiple of world_size (or truncate when drop_last; neither when !pad), and take every
// world_size-th index starting at rank.
std::vector<int64_t> epoch_order(int64_t dataset_size, const LoaderOptions& options,
                                 int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (options.shuffle) {
    SplitMix64 rng(mix64(mix64(options.seed ^ kShuffleSalt) + static_cast<uint64_t>(epoch)));
    for (size_t i = order.size(); i > 1; --i) {
      std::swap(order[i - 1], order[rng.below(i)]);
    }
  }
  const int64_t total = !options.drop_last && !options.pad
                            ? dataset_size
                            : shard_size(dataset_size, options) * options.world_size;
  std::vector<int64_t> shard;
  shard.reserve(static_cast<size_t>(shard_size(dataset_size, options)));
  for (int64_t i = options.rank; i < total; i += options.world_size) {
    shard.push_back(order[static_cast<size_t>(i % dataset_size)]);
  }
  return shard;
}

void validate(const LoaderOptions& options) {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw Error("Loader: " + message, kExitInvalid);
  };
  require(options.batch_size >= 1, "batch_size must be >= 1");
  // Bounded like data.workers and data.prefetch, so that workers x prefetch (the ring of
  // prefetched batches) can neither wrap nor ask for an absurd allocation.
  require(options.workers >= 0 && options.workers <= limits::kMaxWorkers,
          "workers must be in [0, " + std::to_string(limits::kMaxWorkers) + "], got " + std::to_string(options.workers));
  require(options.prefetch >= 1 && options.prefetch <= limits::kMaxPrefetch,
          "prefetch must be in [1, " + std::to_string(limits::kMaxPrefetch) + "], got " +
              std::to_string(options.prefetch));
  require(options.epochs >= 0, "epochs must be >= 0 (0: no bound)");
  require(options.world_size >= 1, "world_size must be >= 1");
  require(options.rank >= 0 && options.rank < options.world_size,
          "rank must be in [0, world_size)");
}

// Rethrows the exception in flight with `context` (the sample or batch) prefixed to its message.
// train::Error types are kept, with their exit codes; anything else becomes a DataError with the
// runtime exit code, as data that cannot be read mid-run is a runtime failure.
[[noreturn]] void rethrow_with_context(const std::string& context) {
  try {
    throw;
  } catch (const DataError& e) {
    throw DataError(context + ": " + e.what(), e.exit_code());
  } catch (const ConfigError& e) {
    throw ConfigError(context + ": " + e.what());
  } catch (const CheckpointError& e) {
    throw CheckpointError(context + ": " + e.what());
  } catch (const UsageError& e) {
    throw UsageError(context + ": " + e.what());
  } catch (const Error& e) {
    throw Error(context + ": " + e.what(), e.exit_code());
  } catch (const c10::Error& e) {
    throw DataError(context + ": " + e.what_without_backtrace(), kExitRuntime);
  } catch (const std::exception& e) {
    throw DataError(context + ": " + e.what(), kExitRuntime);
  } catch (...) {
    throw DataError(context + ": unknown exception", kExitRuntime);
  }
}

// OnError::Skip: how many indices after a failing one are tried before giving up. A run of
// this many unreadable samples is a broken dataset rather than a few bad files.
constexpr int64_t kMaxSubstituteAttempts = 100;
// OnError::Skip: skipped samples whose errors are logged and kept in skip_messages().
constexpr size_t kLoggedSkips = 5;

// A sample replaced under OnError::Skip: its dataset index and its error.
struct Skip {
  int64_t index;
  std::string message;
};

// A collated batch and the samples replaced in it (OnError::Skip).
struct Loaded {
  Batch batch;
  std::vector<Skip> skips;
  int64_t epoch = 0;
};

// A batch slot of the ring: empty, a batch, or the error raised while building it.
struct Slot {
  int64_t number = -1;  // the batch's number across epochs (Loader::Impl)
  std::optional<Loaded> loaded;
  std::exception_ptr error;
  bool ready() const { return loaded.has_value() || error != nullptr; }
};

}  // namespace

struct Loader::Impl {
  DatasetPtr dataset;
  LoaderOptions options;
  bool pin_memory = false;  // options.pin_memory and a CUDA device is present
  int64_t num_batches = 0;
  // Batches are numbered across epochs: batch b of epoch e is number e * num_batches + b. Workers
  // build numbers below `limit` only (set by start() while no worker runs).
  int64_t limit = 0;

  // Delivery state, guarded by `mutex`.
  std::mutex mutex;
  std::condition_variable slot_filled;  // a worker stored a batch: wakes next()
  std::condition_variable slot_freed;   // next() took a batch, start() moved on, or stopping: wakes workers
  int64_t epoch = 0;       // the epoch next() delivers from
  int64_t next_batch = 0;  // the batch of that epoch next() delivers
  int64_t claimed = 0;     // the lowest number no worker has taken yet
  bool started = false;
  std::vector<Slot> slots;
  bool stopping = false;

  // Sample orders by epoch, built on first use by whichever thread needs one (a few recent ones
  // are kept), guarded by `orders_mutex`.
  mutable std::mutex orders_mutex;
  mutable std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> orders;

  std::vector<std::thread> threads;
  double wait_seconds = 0.0;
  // Caller-side: the (epoch, index) of the samples replaced in delivered batches, and the first
  // errors. A set, because a batch can be delivered again (start() at an earlier batch).
  std::set<std::pair<int64_t, int64_t>> skipped;
  std::vector<std::string> skip_messages;

  int64_t capacity() const { return options.workers * options.prefetch; }
  int64_t next_number() const { return epoch * num_batches + next_batch; }

  int64_t batch_count(int64_t samples) const {
    return options.drop_last ? samples / options.batch_size
                             : (samples + options.batch_size - 1) / options.batch_size;
  }

  std::shared_ptr<const std::vector<int64_t>> order_of(int64_t e) const {
    std::lock_guard<std::mutex> lock(orders_mutex);
    auto found = orders.find(e);
    if (found != orders.end()) return found->second;
    auto order = std::make_shared<const std::vector<int64_t>>(epoch_order(dataset->size(), options, e));
    orders.emplace(e, order);
    constexpr size_t kKeptOrders = 3;  // the epoch being delivered, the next one, and a rewind's
    while (orders.size() > kKeptOrders) {
      // Drop the one furthest from e: an old epoch, or after a rewind a future one.
      auto first = orders.begin();
      auto last = std::prev(orders.end());
      orders.erase(e - first->first >= last->first - e ? first : last);
    }
    return order;
  }

  Example get(int64_t e, int64_t index) const {
    return dataset->get(index, sample_seed(options.seed, e, index));
  }

  // OnError::Skip: the first of index + 1, index + 2, ... (wrapping) that loads. Rethrows the
  // original error (in flight in the caller's catch) with `context` when none does.
  Example substitute(int64_t e, int64_t index, const std::string& context) const {
    const int64_t size = dataset->size();
    const int64_t attempts = std::min(size - 1, kMaxSubstituteAttempts);
    for (int64_t step = 1; step <= attempts; ++step) {
      try {
        return get(e, (index + step) % size);
      } catch (...) {
      }
    }
    if (attempts == 0) {
      rethrow_with_context(context + "; data.on_error is skip, but the dataset has no other sample to replace it");
    }
    rethrow_with_context(context + "; data.on_error is skip, but " +
                         (attempts == 1 ? std::string("the one sample after it fails")
                                        : "the " + std::to_string(attempts) + " samples after it fail") +
                         " to load too");
  }

  // The dataset's one-pass batch of order[begin, end), if it has that path. Any error there
  // sends the batch down the per-sample path, which names (or skips) the sample at fault.
  std::optional<Batch> whole_batch(int64_t e, const std::vector<int64_t>& order, size_t begin, size_t end) const {
    std::vector<int64_t> indices(order.begin() + static_cast<std::ptrdiff_t>(begin),
                                 order.begin() + static_cast<std::ptrdiff_t>(end));
    std::vector<uint64_t> seeds;
    seeds.reserve(indices.size());
    for (const int64_t index : indices) seeds.push_back(sample_seed(options.seed, e, index));
    try {
      return dataset->get_batch(indices, seeds, pin_memory);
    } catch (...) {
      return std::nullopt;
    }
  }

  // Loads and collates batch `b` of epoch `e`. Errors carry the sample or batch index.
  Loaded load_batch(int64_t e, int64_t b) const {
    const std::shared_ptr<const std::vector<int64_t>> order_holder = order_of(e);
    const std::vector<int64_t>& order = *order_holder;
    const auto begin = static_cast<size_t>(b * options.batch_size);
    const size_t end = std::min(order.size(), begin + static_cast<size_t>(options.batch_size));
    if (std::optional<Batch> whole = whole_batch(e, order, begin, end)) return Loaded{std::move(*whole), {}, e};
    std::vector<Example> examples;
    examples.reserve(end - begin);
    std::vector<Skip> skips;
    for (size_t i = begin; i < end; ++i) {
      const int64_t index = order[i];
      try {
        examples.push_back(get(e, index));
      } catch (...) {
        const std::string context = "loading sample " + std::to_string(index) + " (batch " +
                                    std::to_string(b) + " of epoch " + std::to_string(e) + ")";
        if (options.on_error == OnError::Raise) rethrow_with_context(context);
        skips.push_back(Skip{index, context + ": " + current_error_message()});
        examples.push_back(substitute(e, index, context));
      }
    }
    try {
      Batch batch = dataset->collate(std::move(examples));
      if (pin_memory) {
        batch.input = batch.input.pin_memory();
        batch.target = batch.target.pin_memory();
      }
      return Loaded{std::move(batch), std::move(skips), e};
    } catch (...) {
      rethrow_with_context("collating batch " + std::to_string(b) + " of epoch " + std::to_string(e));
    }
  }

  // Each worker claims the lowest number nobody has claimed yet, once it lies within `capacity`
  // of delivery, builds that batch and stores it: past the end of the epoch being delivered into
  // the next ones, so that an epoch boundary does not drain the pipeline.
  void worker_loop() {
    make_intra_op_serial_in_this_thread();
    for (;;) {
      int64_t n = 0;
      {
        std::unique_lock<std::mutex> lock(mutex);
        slot_freed.wait(lock, [&] { return stopping || claimed >= limit || claimed < next_number() + capacity(); });
        if (stopping || claimed >= limit) return;
        n = claimed++;
      }
      Slot result;
      result.number = n;
      try {
        result.loaded = load_batch(n / num_batches, n % num_batches);
      } catch (...) {
        result.error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (stopping) return;
        if (n < next_number()) continue;  // start() moved delivery past it while it was built
        slots[static_cast<size_t>(n % capacity())] = std::move(result);
      }
      slot_filled.notify_all();
    }
  }

  void spawn_workers(int64_t count) {
    for (int64_t w = 0; w < count; ++w) threads.emplace_back(&Impl::worker_loop, this);
  }

  // More workers on the same delivery: the ring grows to the new capacity, the batches built or
  // being built stay (a slot's place is its number modulo the capacity when it is stored).
  void add_workers(int64_t workers) {
    if (workers <= options.workers) return;
    const int64_t added = workers - options.workers;
    if (threads.empty()) {  // synchronous so far (or not started): start the workers where delivery is
      options.workers = workers;
      if (started) start(LoaderPosition{epoch, next_batch});
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      options.workers = workers;
      std::vector<Slot> grown(static_cast<size_t>(capacity()));
      for (Slot& slot : slots) {
        if (slot.number >= 0) grown[static_cast<size_t>(slot.number % capacity())] = std::move(slot);
      }
      slots = std::move(grown);
    }
    spawn_workers(added);
    slot_freed.notify_all();
  }

  // Joins the workers; those waiting for a free slot are woken, those inside get() finish it.
  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    slot_freed.notify_all();
    for (std::thread& thread : threads) thread.join();
    threads.clear();
    stopping = false;
  }

  void start(LoaderPosition position) {
    const int64_t target = position.epoch * num_batches + position.batch;
    // Workers stop at the end of the last epoch the caller said it reads (or of this one).
    const int64_t end = options.epochs > 0 ? std::max(options.epochs, position.epoch + 1) * num_batches
                                           : std::numeric_limits<int64_t>::max();
    if (!threads.empty() && end == limit && target >= next_number() && target < next_number() + capacity()) {
      // Forward within what the workers are building (the next epoch after this one ends, or a
      // few batches on): keep them and the batches they have built from `target` on.
      {
        std::lock_guard<std::mutex> lock(mutex);
        for (int64_t n = next_number(); n < target; ++n) slots[static_cast<size_t>(n % capacity())] = Slot{};
        epoch = position.epoch;
        next_batch = position.batch;
        claimed = std::max(claimed, target);
      }
      slot_freed.notify_all();
      return;
    }
    stop_workers();
    epoch = position.epoch;
    next_batch = position.batch;
    limit = end;
    started = true;
    if (options.workers == 0 || num_batches == 0) return;
    slots.assign(static_cast<size_t>(capacity()), Slot{});
    claimed = target;
    if (target < limit) spawn_workers(options.workers);
  }

  // Caller thread: counts and reports the samples replaced in a batch being delivered, each
  // once per epoch.
  Batch deliver(Loaded&& loaded) {
    for (Skip& skip : loaded.skips) {
      if (!skipped.emplace(loaded.epoch, skip.index).second) continue;
      if (skip_messages.size() >= kLoggedSkips) continue;
      log::warn("data.on_error skip: " + skip.message + "; replaced by the next sample that loads");
      skip_messages.push_back(std::move(skip.message));
      if (skip_messages.size() == kLoggedSkips) {
        log::warn("data.on_error skip: further skipped samples are counted but not logged");
      }
    }
    return std::move(loaded.batch);
  }

  std::optional<Batch> next() {
    if (!started) start(LoaderPosition{});  // next() without start() reads epoch 0 from its start
    if (next_batch >= num_batches) return std::nullopt;
    if (threads.empty()) {
      Loaded loaded = load_batch(epoch, next_batch);
      ++next_batch;
      return deliver(std::move(loaded));
    }
    const int64_t number = next_number();
    Slot& slot = slots[static_cast<size_t>(number % capacity())];
    std::optional<Loaded> loaded;
    {
      std::unique_lock<std::mutex> lock(mutex);
      slot_filled.wait(lock, [&] { return slot.ready() && slot.number == number; });
      // The error stays in its slot: calling next() again reports it again instead of skipping.
      if (slot.error) std::rethrow_exception(slot.error);
      loaded = std::move(slot.loaded);
      slot = Slot{};
      ++next_batch;
    }
    slot_freed.notify_all();
    return deliver(std::move(*loaded));
  }
};

Loader::Loader(DatasetPtr dataset, LoaderOptions options) : impl_(std::make_unique<Impl>()) {
  if (!dataset) throw Error("Loader: no dataset", kExitInvalid);
  validate(options);
  impl_->dataset = std::move(dataset);
  impl_->options = options;
  impl_->pin_memory = options.pin_memory && torch::cuda::is_available();
  impl_->num_batches = impl_->batch_count(samples_per_epoch());
}

Loader::~Loader() { impl_->stop_workers(); }

void Loader::start(LoaderPosition position) {
  if (position.epoch < 0 || position.batch < 0 || position.batch > impl_->num_batches) {
    throw Error("Loader: cannot start at epoch " + std::to_string(position.epoch) + " batch " +
                    std::to_string(position.batch) + " (an epoch has " +
                    std::to_string(impl_->num_batches) + " batches)",
                kExitInvalid);
  }
  impl_->start(position);
}

std::optional<Batch> Loader::next() {
  const auto began = std::chrono::steady_clock::now();
  // Counted even when next() throws, so that the total stays honest.
  struct AddElapsed {
    double& total;
    std::chrono::steady_clock::time_point began;
    ~AddElapsed() {
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    }
  } add_elapsed{impl_->wait_seconds, began};
  return impl_->next();
}

void Loader::set_workers(int64_t workers) {
  if (workers < impl_->options.workers || workers > limits::kMaxWorkers) {
    throw Error("Loader::set_workers: " + std::to_string(workers) + " workers; the loader has " +
                    std::to_string(impl_->options.workers) + " and can only add up to " +
                    std::to_string(limits::kMaxWorkers),
                kExitInvalid);
  }
  impl_->add_workers(workers);
}

LoaderPosition Loader::position() const { return LoaderPosition{impl_->epoch, impl_->next_batch}; }

int64_t Loader::batches_per_epoch() const { return impl_->num_batches; }

int64_t Loader::samples_per_epoch() const {
  return shard_size(impl_->dataset->size(), impl_->options);
}

double Loader::wait_seconds() const { return impl_->wait_seconds; }

int64_t Loader::skipped() const { return static_cast<int64_t>(impl_->skipped.size()); }

const std::set<std::pair<int64_t, int64_t>>& Loader::skipped_samples() const {
  return impl_->skipped;
}

const std::vector<std::string>& Loader::skip_messages() const { return impl_->skip_messages; }

const Dataset& Loader::dataset() const { return *impl_->dataset; }

const LoaderOptions& Loader::options() const { return impl_->options; }

}  // namespace train::data
