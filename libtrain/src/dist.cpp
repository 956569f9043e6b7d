#include "dist_internal.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "train/config.h"
#include "train/errors.h"
#include "train/log.h"
#ifdef TRAIN_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace train::dist {
namespace {

using Getenv = std::function<const char*(const char*)>;

// Value of an integer variable; `fallback` when unset; UsageError naming it when malformed or set
// but empty (RANK= in a script whose variable was never filled in: taking it as unset made every
// such process rank 0, and the second one's error was about a port in use).
int64_t env_int(const Getenv& get, const char* name, int64_t fallback, int64_t min_value) {
  const char* raw = get(name);
  if (raw == nullptr) return fallback;
  if (*raw == '\0') {
    throw UsageError(std::string("environment variable ") + name + " is set but empty; give it an integer >= " +
                     std::to_string(min_value) + ", or unset it");
  }
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(raw, &end, 10);
  if (errno != 0 || end == raw || *end != '\0' || v < min_value) {
    throw UsageError(std::string("environment variable ") + name + "='" + raw + "' is not an integer >= " +
                     std::to_string(min_value));
  }
  return v;
}

std::string env_str(const Getenv& get, const char* name, const std::string& fallback) {
  const char* raw = get(name);
  return raw == nullptr || *raw == '\0' ? fallback : std::string(raw);
}

// Slurm's per-node task counts, "4" or "4(x2),3" (counts per node, in node order), one entry per
// node: {4, 4, 3}. Empty when malformed.
std::vector<int64_t> slurm_counts(const std::string& tasks_per_node) {
  std::vector<int64_t> counts;
  size_t i = 0;
  auto number = [&](int64_t& v) {
    const size_t begin = i;
    v = 0;
    while (i < tasks_per_node.size() && tasks_per_node[i] >= '0' && tasks_per_node[i] <= '9' && i - begin < 9) {
      v = v * 10 + (tasks_per_node[i++] - '0');
    }
    return i > begin;
  };
  while (i < tasks_per_node.size()) {
    int64_t count = 0, repeat = 1;
    if (!number(count)) return {};
    if (i < tasks_per_node.size() && tasks_per_node[i] == '(') {
      if (tasks_per_node.compare(i, 2, "(x") != 0) return {};
      i += 2;
      if (!number(repeat) || i >= tasks_per_node.size() || tasks_per_node[i] != ')' || repeat > 100000) return {};
      ++i;
    }
    counts.insert(counts.end(), static_cast<size_t>(repeat), count);
    if (i < tasks_per_node.size() && tasks_per_node[i++] != ',') return {};
  }
  return counts;
}

// The hosts of a Slurm node list, in order: "gpu[03-04,07],cpu1" -> gpu03 gpu04 gpu07 cpu1 (ranges
// keep their zero padding). Empty when malformed.
std::vector<std::string> slurm_hosts(const std::string& list) {
  std::vector<std::string> hosts;
  size_t i = 0;
  while (i < list.size()) {
    std::string prefix;
    while (i < list.size() && list[i] != ',' && list[i] != '[') prefix += list[i++];
    if (i < list.size() && list[i] == '[') {
      const size_t close = list.find(']', i);
      if (close == std::string::npos) return {};
      std::string suffix;  // "gpu[01-02]-ib": text after the bracket belongs to every name
      size_t after = close + 1;
      while (after < list.size() && list[after] != ',') suffix += list[after++];
      std::stringstream ranges(list.substr(i + 1, close - i - 1));
      for (std::string range; std::getline(ranges, range, ',');) {
        const size_t dash = range.find('-');
        const std::string first = range.substr(0, dash), last = dash == std::string::npos ? first : range.substr(dash + 1);
        if (first.empty() || last.empty() || first.size() > 9 || last.size() > 9 ||
            first.find_first_not_of("0123456789") != std::string::npos ||
            last.find_first_not_of("0123456789") != std::string::npos) {
          return {};
        }
        const int64_t from = std::stoll(first), to = std::stoll(last);
        if (to < from || to - from > 100000) return {};
        for (int64_t n = from; n <= to; ++n) {
          std::string digits = std::to_string(n);
          if (digits.size() < first.size()) digits.insert(0, first.size() - digits.size(), '0');
          hosts.push_back(prefix + digits + suffix);
        }
      }
      i = after;
    } else if (!prefix.empty()) {
      hosts.push_back(prefix);
    }
    if (i < list.size() && list[i] == ',') ++i;
  }
  return hosts;
}

bool is_loopback(const std::string& addr) {
  return addr.empty() || addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// A default store port for a job a scheduler names: jobs that share a host do not meet on one
// port (20000-29999, below Linux's ephemeral range). Every rank of the job computes the same.
int64_t port_for_job(const std::string& job) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : job) h = (h ^ c) * 1099511628211ull;
  return 20000 + static_cast<int64_t>(h % 10000);
}

void check_ranks(const Env& e, const std::string& rank_var, const std::string& size_var) {
  if (e.rank >= e.world_size) {
    throw UsageError(rank_var + "=" + std::to_string(e.rank) + " is not below " + size_var + "=" +
                     std::to_string(e.world_size));
  }
  if (e.local_rank >= e.local_world_size) {
    throw UsageError("local rank " + std::to_string(e.local_rank) + " is not below the local world size " +
                     std::to_string(e.local_world_size) + " (from " + e.launcher + "'s variables)");
  }
  if (e.master_port < 1 || e.master_port > 65535) {
    throw UsageError("MASTER_PORT=" + std::to_string(e.master_port) + " is not a TCP port");
  }
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Sum: break;
  }
  return c10d::ReduceOp::SUM;
}

// At least 1 ms: c10d reads a zero timeout as none at all.
std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(std::ceil(seconds * 1000.0))));
}

// Runs `work` on a thread of its own and waits at most `seconds` for its result. A store call to
// a rank 0 that is frozen (SIGSTOP, a debugger, a paused VM) or whose host is gone blocks in
// recv() with no timeout of its own; a rank on its way out must not hang there. On overrun the
// thread is left behind, holding its own reference to the store, and the caller goes on.
template <class T>
std::optional<T> within(double seconds, std::function<std::optional<T>()> work) {
  auto promise = std::make_shared<std::promise<std::optional<T>>>();
  std::future<std::optional<T>> result = promise->get_future();
  try {
    std::thread([promise, work = std::move(work)] {
      std::optional<T> value;
      try {
        value = work();
      } catch (...) {
      }
      promise->set_value(std::move(value));
    }).detach();
  } catch (...) {
    return std::nullopt;  // no thread to be had
  }
  if (result.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) return std::nullopt;
  return result.get();
}

std::string store_text(c10d::Store& store, const std::string& key) {
  const std::vector<uint8_t> bytes = store.get(key);  // waits for the key, up to the store's timeout
  return std::string(bytes.begin(), bytes.end());
}

// Before the backend connects, every rank says who it is in the store, so that what would
// otherwise hang in the backend's connect, or train with the wrong thread count, is an error or a
// correction at once:
//  - a rank number taken twice: two jobs started by hand on one MASTER_PORT (their keys are the
//    same, no launcher names the job), or one RANK given to two processes. The second stops; the
//    job it reached goes on;
//  - WORLD_SIZE that differs from rank 0's;
//  - how many ranks share this host, where no variable said (RANK and WORLD_SIZE alone, with
//    MASTER_ADDR this host's name or address): threads and workers are divided among them, and on
//    GPUs, where each local rank takes its own device, a wrong guess is an error naming the fix.
// A rank that finds a problem posts it as the verdict, which every other rank then reports.
void roll_call(c10d::Store& store, Env& env, bool cuda, double timeout_s) {
  const std::string me = std::to_string(env.rank);
  if (store.add("taken/" + me, 1) > 1) {
    throw Error(log::str("distributed: another process joined the rendezvous at ", env.master_addr, ":",
                         env.master_port, " as rank ", env.rank, " already (", env.launcher, "): two jobs on one "
                         "MASTER_PORT, or one RANK given to two processes; give each job its own MASTER_PORT"));
  }
  const auto post = [&store](const std::string& verdict) {
    store.set("verdict", std::vector<uint8_t>(verdict.begin(), verdict.end()));
  };
  try {
    if (env.rank == 0) {
      const std::string w = std::to_string(env.world_size);
      store.set("world_size", std::vector<uint8_t>(w.begin(), w.end()));
    } else if (const std::string w = store_text(store, "world_size"); w != std::to_string(env.world_size)) {
      const std::string verdict = log::str("distributed: rank ", env.rank, " has WORLD_SIZE=", env.world_size,
                                           " but rank 0 has WORLD_SIZE=", w, "; give every rank the same");
      post(verdict);
      throw Error(verdict);
    }
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0) std::snprintf(name, sizeof(name), "unknown");
    store.add(std::string("host/") + name, 1);
    if (store.add("arrived", 1) == env.world_size) post("ok");
    const std::string verdict = store_text(store, "verdict");
    if (verdict != "ok") throw Error(verdict);
    const int64_t here = store.add(std::string("host/") + name, 0);
    if (env.local_inferred && here != env.local_world_size) {
      if (cuda) {
        throw UsageError(log::str("distributed: ", here, " ranks run on this host (", name, "), but nothing says "
                                  "which GPU each takes: RANK and WORLD_SIZE alone, with MASTER_ADDR=",
                                  env.master_addr, ", read as ", env.local_world_size == 1 ? "one rank per host" : "every rank on this host",
                                  "; set LOCAL_RANK and LOCAL_WORLD_SIZE for each rank (torchrun sets them)"));
      }
      log::info(log::str("distributed: ", here, " ranks share this host (", name, "); the CPU threads and loader "
                         "workers are divided among them (LOCAL_WORLD_SIZE was not set)"));
      env.local_world_size = here;
      env.local_rank = std::min(env.local_rank, here - 1);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw Error(log::str("distributed: rank ", env.rank, " waited distributed.init_timeout_s = ", timeout_s,
                         " s for the other ranks to report at the rendezvous (", env.launcher, "): ",
                         what.substr(0, what.find('\n'))));
  }
}

}  // namespace

std::string Env::describe() const {
  if (!distributed()) return "single process";
  return log::str("rank ", rank, " of ", world_size, " (local ", local_rank, " of ", local_world_size, "), ", launcher,
                  ", store ", master_addr, ":", master_port, agent_store ? (launcher == "train launch" ? " (served by the launcher)" : " (torchrun agent)") : "");
}

Env detect_env() {
  return detect_env([](const char* name) -> const char* { return std::getenv(name); });
}

Env detect_env(const Getenv& get) {
  Env e;
  // Which launcher: torchrun's (or train launch's, or hand-set) variables first, then an MPI
  // launcher's, then a Slurm step's. MPI before Slurm: processes that mpirun starts inside a Slurm
  // allocation inherit the batch script's or their daemon's SLURM_PROCID / SLURM_NTASKS, which
  // describe another step, not this job.
  const bool torch_style = get("RANK") != nullptr || get("WORLD_SIZE") != nullptr;
  const bool slurm_step = get("SLURM_PROCID") != nullptr && get("SLURM_STEP_NUM_TASKS") != nullptr;
  if (torch_style) {
    // torchrun, `train launch`, or variables set by hand.
    if (get("RANK") == nullptr || get("WORLD_SIZE") == nullptr) {
      throw UsageError("RANK and WORLD_SIZE must be set together (found only " +
                       std::string(get("RANK") ? "RANK" : "WORLD_SIZE") + ")");
    }
    e.world_size = env_int(get, "WORLD_SIZE", 1, 1);
    e.rank = env_int(get, "RANK", 0, 0);
    e.launcher = get("TORCHELASTIC_RUN_ID") ? "torchrun" : env_str(get, "TRAIN_LAUNCHER", "env");
    e.agent_store = env_str(get, "TORCHELASTIC_USE_AGENT_STORE", "") == "True" ||
                    (e.launcher == "train launch" && env_str(get, "TRAIN_LAUNCH_STORE", "") == "1");
    e.restart = env_int(get, "TORCHELASTIC_RESTART_COUNT", 0, 0);
    e.job = env_str(get, "TORCHELASTIC_RUN_ID", "");
    if (get("LOCAL_WORLD_SIZE") != nullptr) {
      e.local_world_size = env_int(get, "LOCAL_WORLD_SIZE", 1, 1);
      e.local_rank = env_int(get, "LOCAL_RANK", 0, 0);
    } else if (is_loopback(env_str(get, "MASTER_ADDR", ""))) {
      // Every rank meets on this host: they all run here.
      e.local_world_size = e.world_size;
      e.local_rank = env_int(get, "LOCAL_RANK", e.rank, 0);
      e.local_inferred = get("LOCAL_RANK") == nullptr;
    } else if (get("LOCAL_RANK") == nullptr) {
      // One rank per host (a Kubernetes pod per rank, say): the store is on another host. (Or
      // MASTER_ADDR names this host: the roll call in Group::create counts the ranks here.)
      e.local_world_size = 1;
      e.local_rank = 0;
      e.local_inferred = true;
    } else {
      throw UsageError("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not, and MASTER_ADDR=" +
                       env_str(get, "MASTER_ADDR", "") +
                       " is another host: set LOCAL_WORLD_SIZE to the number of ranks on each host (torchrun "
                       "sets both)");
    }
    check_ranks(e, "RANK", "WORLD_SIZE");
  } else if (get("OMPI_COMM_WORLD_RANK") != nullptr) {
    e.launcher = "mpirun";
    e.world_size = env_int(get, "OMPI_COMM_WORLD_SIZE", 1, 1);
    e.rank = env_int(get, "OMPI_COMM_WORLD_RANK", 0, 0);
    e.local_rank = env_int(get, "OMPI_COMM_WORLD_LOCAL_RANK", 0, 0);
    e.local_world_size = env_int(get, "OMPI_COMM_WORLD_LOCAL_SIZE", e.world_size, 1);
    const std::string job = env_str(get, "OMPI_MCA_ess_base_jobid", "");
    if (!job.empty()) e.job = "ompi-" + job;
    check_ranks(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
  } else if (get("PMI_RANK") != nullptr && get("MPI_LOCALNRANKS") != nullptr) {
    // MPICH's and Intel MPI's mpiexec (Hydra).
    e.launcher = "mpiexec";
    e.world_size = env_int(get, "PMI_SIZE", 1, 1);
    e.rank = env_int(get, "PMI_RANK", 0, 0);
    e.local_rank = env_int(get, "MPI_LOCALRANKID", 0, 0);
    e.local_world_size = env_int(get, "MPI_LOCALNRANKS", e.world_size, 1);
    check_ranks(e, "PMI_RANK", "PMI_SIZE");
  } else if (slurm_step && env_int(get, "SLURM_STEP_NUM_TASKS", 1, 1) > 1) {
    // An srun step: its own task count, layout and nodes (SLURM_NTASKS and SLURM_JOB_NODELIST
    // describe the allocation, which a step may only use part of).
    e.launcher = "slurm";
    e.world_size = env_int(get, "SLURM_STEP_NUM_TASKS", 1, 1);
    e.rank = env_int(get, "SLURM_PROCID", 0, 0);
    e.local_rank = env_int(get, "SLURM_LOCALID", 0, 0);
    const std::string nodes = env_str(get, "SLURM_STEP_NODELIST", env_str(get, "SLURM_JOB_NODELIST", ""));
    const std::vector<std::string> hosts = slurm_hosts(nodes);
    const std::vector<int64_t> counts = slurm_counts(env_str(get, "SLURM_STEP_TASKS_PER_NODE", ""));
    // This node's task count: by its name's place in the node list, else by SLURM_NODEID, else
    // the count every node has.
    int64_t local = 0;
    const std::string me = env_str(get, "SLURMD_NODENAME", "");
    const auto at = std::find(hosts.begin(), hosts.end(), me);
    if (!me.empty() && at != hosts.end() && hosts.size() == counts.size()) {
      local = counts[static_cast<size_t>(at - hosts.begin())];
    } else if (const int64_t node = env_int(get, "SLURM_NODEID", -1, 0); node >= 0 && node < static_cast<int64_t>(counts.size())) {
      local = counts[static_cast<size_t>(node)];
    } else if (!counts.empty() && std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; })) {
      local = counts[0];
    }
    if (local <= 0) {
      throw UsageError("cannot tell how many tasks of this srun step run on this node from SLURM_STEP_TASKS_PER_NODE='" +
                       env_str(get, "SLURM_STEP_TASKS_PER_NODE", "") + "', SLURM_STEP_NODELIST='" + nodes +
                       "' and SLURMD_NODENAME='" + me + "'");
    }
    e.local_world_size = local;
    if (!hosts.empty()) e.master_addr = hosts.front();
    e.job = "slurm-" + env_str(get, "SLURM_JOB_ID", env_str(get, "SLURM_JOBID", "")) + "." +
            env_str(get, "SLURM_STEP_ID", env_str(get, "SLURM_STEPID", ""));
    check_ranks(e, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS");
  } else {
    // One process. A batch script that asked Slurm for several tasks but started train without
    // srun gets one rank, and is told.
    if (get("SLURM_PROCID") != nullptr && !slurm_step && env_int(get, "SLURM_NTASKS", 1, 1) > 1) {
      e.note = "SLURM_NTASKS=" + env_str(get, "SLURM_NTASKS", "") +
               ", but this process is the batch script, not an srun step: training as one process; start the "
               "ranks with `srun train fit ...`";
    }
    return e;
  }
  if (e.distributed() && get("MASTER_ADDR") == nullptr && e.local_world_size < e.world_size &&
      (e.launcher == "mpirun" || e.launcher == "mpiexec")) {
    throw UsageError("ranks span several hosts but MASTER_ADDR is not set; pass it to every rank "
                     "(mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port>)");
  }
  e.master_addr = env_str(get, "MASTER_ADDR", e.master_addr);
  // A scheduler's job gets a port of its own unless MASTER_PORT says otherwise; torchrun and
  // `train launch` always set MASTER_PORT.
  if (get("MASTER_PORT") == nullptr && !torch_style && !e.job.empty()) e.master_port = port_for_job(e.job);
  e.master_port = env_int(get, "MASTER_PORT", e.master_port, 1);
  check_ranks(e, "rank", "world size");
  return e;
}

// ---- LaunchStore ---------------------------------------------------------------------------

struct LaunchStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

namespace {

// A peer that exits closes its sockets; Gloo's or the store's next write to one raises SIGPIPE,
// whose default action ends this process at once, before it can say which rank failed first (a
// launch test lost rank 0's report that way). Ignored, the write fails with EPIPE and becomes an
// error like any other, as in Python, which ignores SIGPIPE at startup. A handler the program
// installed is left alone.
void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

}  // namespace

LaunchStore::LaunchStore(const std::string& host, int port, double timeout_s) : impl_(std::make_unique<Impl>()) {
  ignore_sigpipe();
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = true;
  so.waitWorkers = false;  // the launcher starts the ranks after this returns
  so.timeout = millis(timeout_s);
  compat::store_without_libuv(so);
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(host, so);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw Error(log::str("launch: could not serve the rendezvous store on ", host, ":", port, what.find("Address already in use") != std::string::npos ? " (the port is in use)" : "", ": ",
                         what.substr(0, what.find('\n'))));
  }
}

LaunchStore::~LaunchStore() = default;

int LaunchStore::port() const { return impl_->store->getPort(); }

// ---- Group ---------------------------------------------------------------------------------

void Group::Impl::fail(const std::string& op, const std::string& reason) const {
  throw Error(log::str("distributed: rank ", env.rank, " of ", env.world_size, " (", backend_name, "): ", op,
                       " failed; a peer has died, hung, or did not answer within distributed.timeout_s = ",
                       timeout_s, " s: ", reason));
}

void Group::Impl::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op, bool on_host) const {
  try {
    if (on_host && backend_name == "nccl") {
      work->wait(millis(timeout_s));  // blocks the host, and throws once timeout_s has passed
    } else {
      work->wait();
    }
  } catch (const c10::Error& e) {
    fail(op, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(op, e.what());
  }
}

Group::Group(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Group::Impl::~Impl() {
  if (!backend) return;
  try {
    compat::shutdown_backend(*backend);
  } catch (const std::exception& e) {
    log::warn(std::string("distributed: shutting the ") + backend_name + " backend down failed: " + e.what());
  }
}

Group::~Group() = default;

std::shared_ptr<Group> Group::create(const Env& env, const DistributedConfig& config, const std::string& device) {
  ignore_sigpipe();
  auto impl = std::make_unique<Impl>();
  impl->env = env;
  impl->device = torch::Device(device);
  impl->timeout_s = config.timeout_s;
  const bool cuda = impl->device.is_cuda();
  std::string backend = config.backend;
  if (backend == "auto") {
#ifdef TRAIN_WITH_NCCL
    backend = cuda ? "nccl" : "gloo";
#else
    backend = "gloo";
#endif
  }
  if (backend == "nccl" && !cuda) {
    throw ConfigError("key 'distributed.backend': nccl needs CUDA devices, but this rank runs on " + device +
                      "; use gloo or auto");
  }
#ifndef TRAIN_WITH_NCCL
  if (backend == "nccl") {
    throw ConfigError("key 'distributed.backend': nccl, but this build of train has no NCCL (LibTorch " +
                      compat::torch_version() + " without CUDA, or nccl.h was not found at build time)");
  }
#endif
  impl->backend_name = backend;

  // ---- rendezvous: a TCPStore served by rank 0 (or torchrun's agent) ----
  // torchrun's agent serves the store on MASTER_PORT. Its wire protocol is that of the torch
  // which runs torchrun; a LibTorch before 2.0 cannot talk to a 2.x agent, so such a build serves
  // its own store on the next port instead.
  // `train launch` runs the same LibTorch as its ranks.
  const bool use_agent = env.agent_store && (compat::kTcpStoreSpeaksAgentProtocol || env.launcher == "train launch");
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.agent_store && !use_agent ? env.master_port + 1 : env.master_port);
  so.isServer = env.rank == 0 && !use_agent;
  so.numWorkers = static_cast<size_t>(env.world_size);
  so.waitWorkers = true;  // every rank must check in (clients increment the count the server waits for)
  so.timeout = millis(config.init_timeout_s);
  compat::store_without_libuv(so);
  try {
    c10::intrusive_ptr<c10d::TCPStore> tcp;
    if (so.isServer) {
      tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } else {
      // A port held by something that accepts but is no store (another program, a frozen
      // process) leaves the client's handshake waiting in recv() with no timeout of its own.
      struct Failure {
        std::mutex mutex;
        std::string what;  // the client's error; empty while it waits
      };
      auto failure = std::make_shared<Failure>();
      const auto joined = within<c10::intrusive_ptr<c10d::TCPStore>>(
          config.init_timeout_s + 5.0, [addr = env.master_addr, so, failure]() -> std::optional<c10::intrusive_ptr<c10d::TCPStore>> {
            try {
              return c10::make_intrusive<c10d::TCPStore>(addr, so);
            } catch (const std::exception& e) {
              const std::lock_guard<std::mutex> lock(failure->mutex);
              failure->what = e.what();
              return std::nullopt;
            }
          });
      if (!joined) {
        const std::lock_guard<std::mutex> lock(failure->mutex);
        throw std::runtime_error(!failure->what.empty() ? failure->what
                                                        : std::string("no answer from what listens there (not a "
                                                                      "rendezvous store, or a frozen one)"));
      }
      tcp = *joined;
    }
    // Keys are per attempt: a store that outlives a restart (an agent's, depending on the torchrun
    // version) must not hand this attempt the Gloo addresses or failure reports of the last one.
    // ...and per job: a rank of another job that reaches this store (its own rank 0 could not
    // bind the port) neither reads nor writes this job's keys.
    impl->store = c10::make_intrusive<c10d::PrefixStore>(log::str("train/", env.job, "/", env.restart, "/"), tcp);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (so.isServer && what.find("Address already in use") != std::string::npos) {
      const bool next_port = static_cast<int>(so.port) != env.master_port;
      throw Error(log::str("distributed: rank 0 could not serve the rendezvous on port ", so.port, " (", env.launcher,
                           next_port ? log::str(": MASTER_PORT + 1, because LibTorch ", compat::torch_version(),
                                                " cannot talk to the store of torchrun's agent, which holds ",
                                                env.master_port, ")")
                                     : std::string(")"),
                           ": the port is in use, by another job on this host or an earlier run; set MASTER_PORT "
                           "(--master-port) to a free port for every rank",
                           next_port ? ", with the port after it free too" : ""));
    }
    throw Error(log::str("distributed: rank ", env.rank, " could not join the rendezvous at ", env.master_addr, ":",
                         env.master_port, " within distributed.init_timeout_s = ", config.init_timeout_s,
                         " s (", env.launcher, "): ", what.substr(0, what.find('\n'))));
  }

  roll_call(*impl->store, impl->env, impl->device.is_cuda(), config.init_timeout_s);

  // ---- backend ----
  const auto timeout = millis(config.timeout_s);
  try {
    if (backend == "gloo") {
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (ifname != nullptr && *ifname != '\0') {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (impl->env.local_world_size == impl->env.world_size) {  // (as the roll call found)
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      impl->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, static_cast<int>(env.rank),
                                                                   static_cast<int>(env.world_size), options);
    } else {
#ifdef TRAIN_WITH_NCCL
      // The rank's GPU is the current device before NCCL sees it, as torch.distributed asks.
      if (impl->device.has_index()) c10::cuda::set_device(impl->device.index());
      auto options = c10d::ProcessGroupNCCL::Options::create();
      // NCCL's watchdog ends the process (the default TORCH_NCCL_ASYNC_ERROR_HANDLING) when a
      // collective outlasts its timeout. A little later than the host's own wait (Impl::wait), so
      // that a peer that died or hung is reported by this rank, with its message and exit code;
      // the watchdog remains the last resort for gradient buckets, which the host does not wait on.
      options->timeout = timeout + millis(std::max(30.0, 0.1 * config.timeout_s));
      impl->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(impl->store, static_cast<int>(env.rank),
                                                                   static_cast<int>(env.world_size), options);
#endif
    }
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw Error(log::str("distributed: rank ", env.rank, " could not create the ", backend,
                         " process group: ", what.substr(0, what.find('\n'))));
  }
  auto group = std::shared_ptr<Group>(new Group(std::move(impl)));
  // Proves every rank is connected before anything else happens (NCCL connects lazily).
  group->barrier();
  return group;
}

int64_t Group::rank() const { return impl_->env.rank; }
int64_t Group::size() const { return impl_->env.world_size; }
const std::string& Group::backend() const { return impl_->backend_name; }
const Env& Group::env() const { return impl_->env; }
double Group::timeout_seconds() const { return impl_->timeout_s; }
Group::Impl& Group::impl() { return *impl_; }

void Group::allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op) {
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = impl_->backend->allreduce(tensors, options);
  } catch (const std::exception& e) {
    impl_->fail("allreduce", e.what());
  }
  impl_->wait(work, "allreduce");
}

void Group::allreduce(torch::Tensor& tensor, ReduceOp op) {
  std::vector<torch::Tensor> tensors{tensor};
  allreduce(tensors, op);
}

void Group::broadcast(std::vector<torch::Tensor>& tensors, int64_t root) {
  c10d::BroadcastOptions options;
  options.rootRank = root;
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = impl_->backend->broadcast(tensors, options);
  } catch (const std::exception& e) {
    impl_->fail("broadcast", e.what());
  }
  impl_->wait(work, "broadcast");
}

void Group::barrier() {
  // A one-element allreduce: works the same on every backend and proves all ranks are alive.
  auto t = torch::zeros({1}, torch::TensorOptions().device(impl_->device));
  allreduce(t, ReduceOp::Sum);
}

std::vector<std::pair<int64_t, int64_t>> Group::ranges(const std::vector<int64_t>& values) {
  std::vector<int64_t> both;  // max of v and of -v: the largest, and minus the smallest
  for (const int64_t v : values) both.insert(both.end(), {v, -v});
  const std::vector<int64_t> max = reduce_ints(both, ReduceOp::Max);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t i = 0; i < values.size(); ++i) out.emplace_back(-max[2 * i + 1], max[2 * i]);
  return out;
}

std::pair<int64_t, int64_t> Group::range(int64_t value) { return ranges({value}).front(); }

int64_t Group::reduce_int(int64_t value, ReduceOp op) {
  auto t = torch::full({1}, value, torch::TensorOptions().dtype(torch::kLong).device(impl_->device));
  allreduce(t, op);
  return t.item<int64_t>();
}

std::vector<int64_t> Group::reduce_ints(const std::vector<int64_t>& values, ReduceOp op) {
  auto t = torch::tensor(values, torch::kLong).to(impl_->device);
  allreduce(t, op);
  t = t.cpu();
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

std::vector<double> Group::reduce_doubles(const std::vector<double>& values, ReduceOp op) {
  auto t = torch::tensor(values, torch::kDouble).to(impl_->device);
  allreduce(t, op);
  t = t.cpu();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

double Group::reduce_double(double value, ReduceOp op) {
  auto t = torch::full({1}, value, torch::TensorOptions().dtype(torch::kDouble).device(impl_->device));
  allreduce(t, op);
  return t.item<double>();
}

namespace {

std::string failure_key(int64_t rank) { return "failure/" + std::to_string(rank); }

constexpr double kPostSeconds = 5.0;

}  // namespace

void Group::wait_for_all(const std::string& what, double timeout_s, const std::string& setting) {
  if (size() <= 1) return;
  const std::string key = log::str("wait/", ++impl_->store_barriers);
  const auto t0 = std::chrono::steady_clock::now();
  // A store whose server is frozen (SIGSTOP, a debugger) never answers: bounded by within().
  auto failure = std::make_shared<std::string>();
  const std::optional<bool> arrived =
      within<bool>(timeout_s, [store = impl_->store, key, world = size(), timeout_s, failure]() -> std::optional<bool> {
        try {
          if (store->add(key, 1) == world) store->set(key + "/all", std::vector<uint8_t>{1});
          store->wait({key + "/all"}, millis(timeout_s));
          return true;
        } catch (const std::exception& e) {
          const std::string reason = e.what();
          *failure = reason.substr(0, reason.find('\n'));
          return std::nullopt;
        }
      });
  if (arrived) {
    // Every rank also meets in the backend, whether its store wait succeeded or not: a rank whose
    // store connection broke after the others had got through (rank 0's store, say, torn down as
    // it left) falls back to barrier() below, and would wait there alone if the ranks that got
    // through had moved on. The store has just shown that every rank arrived, so this collective
    // cannot hang on a missing one.
    barrier();
    return;
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (waited < 0.9 * timeout_s && !failure->empty()) {
    // Failed long before the limit: the store is gone (its launcher was killed, and the ranks are
    // stopping after this checkpoint). The ranks still reach each other through the backend.
    log::warn(log::str("distributed: the rendezvous store did not answer (", *failure, "); waiting for ", what,
                       " in a collective instead"));
    barrier();
    return;
  }
  throw Error(log::str("distributed: rank ", rank(), " of ", size(), " (", backend(), "): waited ",
                       log::fixed(waited, 0), " s for every rank to finish ", what, " (", setting, " = ", timeout_s,
                       " s); a rank has died, hung or is still at it",
                       failure->empty() ? std::string() : ": " + *failure));
}

void Group::post_failure(int exit_code, bool bad_input, const std::string& message) noexcept {
  try {
    const std::string text = std::to_string(exit_code) + (bad_input ? " bad-input " : " runtime ") + message;
    const std::string key = failure_key(rank());
    // The store lives in rank 0 (or torchrun's agent); when it is gone there is no one to tell.
    (void)within<bool>(kPostSeconds, [store = impl_->store, key, text]() -> std::optional<bool> {
      store->set(key, std::vector<uint8_t>(text.begin(), text.end()));
      // A round trip on the same connection: the server has the key before this rank exits.
      return store->check({key});
    });
  } catch (...) {
  }
}

std::optional<Group::PeerFailure> Group::peer_failure(double wait_seconds) noexcept {
  try {
    const int64_t me = rank(), world = size();
    auto poll = [store = impl_->store, me, world, wait_seconds]() -> std::optional<PeerFailure> {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_seconds);
      for (;;) {
        for (int64_t r = 0; r < world; ++r) {
          if (r == me || !store->check({failure_key(r)})) continue;
          const std::vector<uint8_t> bytes = store->get(failure_key(r));
          const std::string text(bytes.begin(), bytes.end());
          PeerFailure failure;
          failure.rank = r;
          const size_t code_end = text.find(' ');
          const size_t kind_end = text.find(' ', code_end + 1);
          if (code_end == std::string::npos || kind_end == std::string::npos) return std::nullopt;
          failure.exit_code = std::atoi(text.substr(0, code_end).c_str());
          failure.bad_input = text.compare(code_end + 1, kind_end - code_end - 1, "bad-input") == 0;
          failure.message = text.substr(kind_end + 1);
          return failure;
        }
        if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    };
    return within<PeerFailure>(wait_seconds + 1.0, poll);
  } catch (...) {
    return std::nullopt;
  }
}

}  // namespace train::dist
