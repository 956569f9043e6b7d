#pragma once
// Rendezvous and process groups for data-parallel training, on LibTorch's c10d.
//
// A run learns its place in the job from the environment that its launcher sets:
//   torchrun / `train launch`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   Open MPI (mpirun):         OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   MPICH / Intel MPI:         PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   Slurm (an srun step):      SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE,
//                              SLURM_STEP_NODELIST, SLURMD_NODENAME
// in that order: an MPI launcher's processes inside a Slurm allocation inherit SLURM_* variables
// of another step. MASTER_ADDR / MASTER_PORT name the rendezvous store in every case. The address
// defaults to 127.0.0.1 (Slurm: the step's first node); the port to 29500, or for a Slurm or Open
// MPI job to one derived from its job id, so that two jobs on one host do not meet on one port.
// RANK / WORLD_SIZE without LOCAL_WORLD_SIZE mean one host when MASTER_ADDR is this host (or unset),
// and one rank per host otherwise.
//
// The rendezvous is a c10d TCPStore (served by rank 0, or by torchrun's agent), and the group is
// c10d's NCCL backend when the ranks have GPUs and Gloo otherwise. c10d stays out of this header.
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace train {
struct DistributedConfig;
}

namespace train::dist {

struct Env {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  std::string launcher = "none";  // none | torchrun | env | slurm | mpirun | train launch
  bool agent_store = false;       // torchrun's agent or `train launch` serves the store: every rank is a client
  int64_t restart = 0;            // torchrun's TORCHELASTIC_RESTART_COUNT: keys of earlier attempts are not read
  std::string job;                // the launcher's job id ("slurm-123.0", torchrun's run id); "" when none
  std::string note;               // something the caller should log (a launcher setup that looks wrong)
  // local_rank and local_world_size were inferred (RANK and WORLD_SIZE alone), not given by a
  // launcher: Group::create counts the ranks that share this host and corrects them.
  bool local_inferred = false;

  bool distributed() const { return world_size > 1; }
  std::string describe() const;
};

// Reads the launcher's variables from the environment. A single process without any of them is
// rank 0 of 1. Throws UsageError naming the variable when one is malformed or inconsistent.
Env detect_env();
// Same, from an explicit variable lookup (for tests).
Env detect_env(const std::function<const char*(const char*)>& getenv_fn);

// The rendezvous store of `train launch`, served by the launcher itself, on `port` or, for 0, a
// port the kernel assigns as the store binds it: no window in which another process can take the
// port between choosing and binding it, and a rank that freezes does not take the store with it.
// Ranks started with TRAIN_LAUNCH_STORE=1 join it as clients. Throws train::Error when the port
// cannot be bound.
class LaunchStore {
 public:
  LaunchStore(const std::string& host, int port, double timeout_s);
  ~LaunchStore();
  LaunchStore(const LaunchStore&) = delete;
  LaunchStore& operator=(const LaunchStore&) = delete;
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

enum class ReduceOp { Sum, Min, Max };

// A c10d process group. Collectives are synchronous and throw train::Error (exit code 1) with the
// rank, the operation and c10d's reason when a peer dies or does not answer within
// distributed.timeout_s.
class Group {
 public:
  // Joins the rendezvous and builds the backend. `device` is where this rank's tensors live
  // ("cpu", "cuda:N"); backend auto picks NCCL for CUDA devices (when LibTorch has it) and Gloo
  // otherwise. Sets SIGPIPE to ignored unless the program handles it (a write to a peer that has
  // exited then fails with an error instead of ending this process).
  static std::shared_ptr<Group> create(const Env& env, const DistributedConfig& config, const std::string& device);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int64_t rank() const;
  int64_t size() const;
  const std::string& backend() const;  // "gloo" | "nccl"
  const Env& env() const;
  double timeout_seconds() const;

  void allreduce(std::vector<torch::Tensor>& tensors, ReduceOp op = ReduceOp::Sum);
  void allreduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  void broadcast(std::vector<torch::Tensor>& tensors, int64_t root = 0);
  void barrier();
  // Returns once every rank has called it, waiting up to timeout_s: for work that some ranks do
  // alone and that may take longer than distributed.timeout_s (rank 0 writing a checkpoint, a rank
  // measuring memory while the others hit the plan cache). Through the rendezvous store, so no
  // backend timeout applies. `what` names the work and `setting` the key that sets timeout_s, for
  // the error (train::Error) when a rank does not arrive in time. Once all have arrived, they
  // also meet in a barrier() in the backend; when the store is gone (its launcher was killed), that
  // barrier alone takes the store's place.
  void wait_for_all(const std::string& what, double timeout_s, const std::string& setting);
  // Scalar conveniences (a one-element allreduce on the group's device).
  int64_t reduce_int(int64_t value, ReduceOp op);
  double reduce_double(double value, ReduceOp op);
  // The smallest and the largest of each value over the ranks, in one allreduce: equal when every
  // rank has the same. Values must be above INT64_MIN.
  std::vector<std::pair<int64_t, int64_t>> ranges(const std::vector<int64_t>& values);
  std::pair<int64_t, int64_t> range(int64_t value);
  // Several values in one allreduce, element by element.
  std::vector<int64_t> reduce_ints(const std::vector<int64_t>& values, ReduceOp op);
  std::vector<double> reduce_doubles(const std::vector<double>& values, ReduceOp op);

  // Failure reports through the rendezvous store, so that when one rank stops on bad input (a
  // corrupt file in its shard) the others, which only see a collective fail, can name the cause.
  // post_failure records this rank's failure; it never throws (the store may be gone).
  void post_failure(int exit_code, bool bad_input, const std::string& message) noexcept;
  struct PeerFailure {
    int64_t rank = 0;
    int exit_code = 1;
    bool bad_input = false;
    std::string message;
  };
  // The lowest-ranked failure another rank posted, waiting up to wait_seconds for one to arrive
  // (a peer posts just before it exits, which is what makes this rank's collective fail). Never
  // throws; nullopt when none came.
  std::optional<PeerFailure> peer_failure(double wait_seconds) noexcept;

  struct Impl;
  Impl& impl();

 private:
  explicit Group(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

using GroupPtr = std::shared_ptr<Group>;

}  // namespace train::dist
