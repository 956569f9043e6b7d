// Data-parallel training over c10d/Gloo on loopback, with real processes: the test binary starts
// copies of itself as ranks (TRAIN_TEST_WORKER=ddp, see main.cpp) and `bin/train launch`,
// torchrun and mpirun start the CLI.
#include "testing.h"

#include "bad_samples.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <png.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/version.h>
#include <train/checkpoint.h>
#include <train/config.h>
#include <train/data/token_file.h>
#include <train/data/tokens.h>
#include <train/ddp.h>
#include <train/dist.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/launch.h>
#include <train/log.h>
#include <train/models/model.h>
#include <train/run.h>
#include <train/trainer.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <mutex>
#include <sstream>
#include <thread>

extern char** environ;

using namespace train;

namespace {

const std::string kTrain = std::string(TRAIN_BINARY_DIR) + "/bin/train";

// A size x size RGB PNG of one colour that varies with `shade`.
void write_png(const std::string& path, int size, int shade) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(size);
  image.height = static_cast<png_uint_32>(size);
  image.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> pixels(static_cast<size_t>(size * size * 3), static_cast<uint8_t>(20 + 25 * shade));
  REQUIRE(png_image_write_to_file(&image, path.c_str(), 0, pixels.data(), 0, nullptr) != 0);
}

// A BatchNorm-free model, so that data-parallel and single-process runs are the same arithmetic.
// With TRAIN_TEST_DIE_RANK / TRAIN_TEST_DIE_AT set, that rank dies (or hangs) in that forward.
// With TRAIN_TEST_OOM_RANK / TRAIN_TEST_OOM_ABOVE set, that rank runs out of memory (throws what
// CUDA's allocator throws) on every micro-batch larger than the bound: in the forward, or with
// TRAIN_TEST_OOM_IN=backward half-way through the backward, after fc2's gradients are done.
class TestMlp : public models::Model {
 public:
  TestMlp(int64_t in, int64_t classes, bool with_unused)
      : fc1_(register_module("fc1", torch::nn::Linear(in, 32))), fc2_(register_module("fc2", torch::nn::Linear(32, classes))) {
    if (with_unused) unused_ = register_module("unused", torch::nn::Linear(4, 4));
    if (const char* r = std::getenv("TRAIN_TEST_DIE_RANK")) die_rank_ = std::atoi(r);
    if (const char* a = std::getenv("TRAIN_TEST_DIE_AT")) die_at_ = std::atoi(a);
    if (const char* h = std::getenv("TRAIN_TEST_HANG")) hang_ = std::string(h) == "1";
    if (const char* r = std::getenv("RANK")) rank_ = std::atoi(r);
    if (const char* r = std::getenv("TRAIN_TEST_OOM_RANK")) oom_rank_ = std::atoi(r);
    if (const char* a = std::getenv("TRAIN_TEST_OOM_ABOVE")) oom_above_ = std::atoi(a);
    if (const char* w = std::getenv("TRAIN_TEST_OOM_IN")) oom_in_backward_ = std::string(w) == "backward";
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    if (rank_ == die_rank_ && ++calls_ == die_at_) {
      if (hang_) std::this_thread::sleep_for(std::chrono::hours(1));
      std::_Exit(3);
    }
    const bool oom = rank_ == oom_rank_ && x.size(0) > oom_above_ && is_training();
    if (oom && !oom_in_backward_) throw_oom();
    auto h = torch::relu(fc1_(x.flatten(1)));
    if (oom) h.register_hook([](const torch::Tensor&) -> torch::Tensor { throw_oom(); });
    return fc2_(h);
  }
  [[noreturn]] static void throw_oom() {
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                "test: out of memory");
  }

 private:
  torch::nn::Linear fc1_, fc2_;
  torch::nn::Linear unused_{nullptr};
  int die_rank_ = -1, die_at_ = -1, rank_ = 0, calls_ = 0, oom_rank_ = -1, oom_above_ = 1 << 30;
  bool oom_in_backward_ = false;
  bool hang_ = false;
};

// BatchNorm on the input, then a linear layer: its running statistics follow the data alone (not
// the weights), so a test can say what each rank's must be.
class TestInputNorm : public models::Model {
 public:
  TestInputNorm(int64_t channels, int64_t classes)
      : bn_(register_module("bn", torch::nn::BatchNorm2d(channels))),
        fc_(register_module("fc", torch::nn::Linear(channels * 8 * 8, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) override { return fc_(bn_(x).flatten(1)); }

 private:
  torch::nn::BatchNorm2d bn_;
  torch::nn::Linear fc_;
};

// A model with its own loss and measure: the class index of the synthetic images read as a number
// to regress (mean squared error; mean absolute error).
class TestRegressor : public models::Model {
 public:
  explicit TestRegressor(int64_t in) : fc_(register_module("fc", torch::nn::Linear(in, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) override { return fc_(x.flatten(1)).squeeze(1); }
  bool has_own_loss() const override { return true; }
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override {
    return torch::mse_loss(output, target.to(torch::kFloat));
  }
  std::vector<EvalMetric> eval_metrics() const override { return {{"abs_error", false}}; }
  std::vector<torch::Tensor> eval_sums(const torch::Tensor& output, const torch::Tensor& target) override {
    return {(output - target.to(torch::kFloat)).abs().sum()};
  }

 private:
  torch::nn::Linear fc_;
};

void register_test_models() {
  models::register_model("test_regressor", [](const ModelConfig& c) {
    return std::make_shared<TestRegressor>(c.in_channels * 8 * 8);
  }, "linear regression on 8x8 inputs with its own loss");
  models::register_model("test_input_norm", [](const ModelConfig& c) {
    return std::make_shared<TestInputNorm>(c.in_channels, c.num_classes);
  }, "BatchNorm on 8x8 inputs, then a linear layer");
  models::register_model("test_mlp", [](const ModelConfig& c) {
    return std::make_shared<TestMlp>(c.in_channels * 8 * 8, c.num_classes, false);
  }, "test MLP for 8x8 inputs");
  models::register_model("test_mlp_unused", [](const ModelConfig& c) {
    return std::make_shared<TestMlp>(c.in_channels * 8 * 8, c.num_classes, true);
  }, "test MLP with a parameter that never gets a gradient");
}

std::string write_config(const std::string& dir, const std::string& name, const std::string& extra,
                         const std::string& model = "test_mlp") {
  const std::string path = files::join(dir, name + ".yaml");
  std::ofstream(path) << "model: {name: " << model << ", in_channels: 1, num_classes: 10}\n"
                         "data: {kind: synthetic, channels: 1, image_size: 8, synthetic_train_samples: 512,"
                         " synthetic_val_samples: 50, workers: 1}\n"
                         "optim: {name: sgd, lr: 0.1, momentum: 0.9, weight_decay: 0.0001}\n"
                         "schedule: {name: constant}\n"
                         "trainer: {global_batch: 16, max_steps: 24, device: cpu, threads: 1, seed: 3}\n"
                         "logging: {every_steps: 8}\n"
                      << extra;
  return path;
}

// One rank (or a single process): trains and returns every parameter (and in `buffers`, when
// given, every buffer). with_val false: no validation set, so no evaluation.
std::vector<torch::Tensor> train_once(const std::string& config_path, const dist::Env& env, FitResult* out = nullptr,
                                      std::vector<torch::Tensor>* buffers = nullptr, bool with_val = true) {
  register_test_models();
  const Config config = load_config(config_path);
  RunOptions options;
  options.env = env;
  RunParts run = prepare_run(config, options);
  apply_plan_globals(run.plan);
  Trainer trainer(config, run.plan, run.model, run.train, with_val ? run.val : nullptr, "", run.group);
  const FitResult result = trainer.fit();
  if (out) *out = result;
  std::vector<torch::Tensor> params;
  for (const auto& p : run.model->parameters()) params.push_back(p.detach().clone());
  if (buffers) {
    for (const auto& b : run.model->buffers()) buffers->push_back(b.detach().clone());
  }
  return params;
}

struct Proc {
  pid_t pid = -1;
  std::string log;  // stdout + stderr
};

// With new_group, the process leads a new process group (as a shell starts a job), so that a test
// can signal the whole group as a terminal's Ctrl-C does without signalling the test runner.
Proc spawn(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
           const std::string& log, bool new_group = false) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (!env.count(key)) env_strings.push_back(kv);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> a = args;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  if (new_group) {
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
  }
  Proc p;
  p.log = log;
  const int rc = posix_spawnp(&p.pid, a[0].c_str(), &actions, &attr, argv.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  REQUIRE(rc == 0);
  return p;
}

// Exit code, or 128 + signal; -1 when it did not finish within `seconds`.
int wait_for(const Proc& p, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(p.pid, &status, WNOHANG);
    if (r == p.pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void kill_and_reap(const Proc& p) {
  ::kill(p.pid, SIGKILL);
  int status = 0;
  waitpid(p.pid, &status, 0);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Waits up to 120 s for `text` in the file at `path` (a metrics row a running job writes); the
// checks after it say what went wrong if it never comes.
void wait_for_text(const std::string& path, const std::string& text) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (slurp(path).find(text) == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The processes of the `train` binary that `parent` started (a launcher's ranks).
std::vector<pid_t> train_children(pid_t parent) {
  std::istringstream kids(slurp("/proc/" + std::to_string(parent) + "/task/" + std::to_string(parent) + "/children"));
  std::vector<pid_t> children;
  for (pid_t c; kids >> c;) {
    char exe[4096];
    const ssize_t n = readlink(("/proc/" + std::to_string(c) + "/exe").c_str(), exe, sizeof(exe) - 1);
    if (n > 0 && files::filename(std::string(exe, static_cast<size_t>(n))) == "train") children.push_back(c);
  }
  return children;
}

// The launcher's children (its ranks), from /proc.
std::vector<pid_t> children_of(pid_t pid) {
  std::istringstream pids(slurp("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children"));
  std::vector<pid_t> out;
  for (pid_t c; pids >> c;) out.push_back(c);
  return out;
}

// A port for torchrun's --master-port whose next port is free too (a LibTorch 1.x rank 0 serves
// its store there), from below the ephemeral range (32768 and up): a port bind(0) picks is odd,
// and the even one after it is what the kernel hands out next for outgoing connections, which
// the Gloo meshes of tests running alongside open by the dozen.
int free_port_pair() {
  const auto bindable = [](int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return false;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    return ok;
  };
  std::mt19937 pick(static_cast<uint32_t>(::getpid()) ^ static_cast<uint32_t>(std::random_device{}()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = 20000 + 2 * static_cast<int>(pick() % 6000);  // 20000 to 31998
    if (bindable(port) && bindable(port + 1)) return port;
  }
  FAIL("no free pair of ports between 20000 and 32000");
  return 0;
}

// False once `pid` has exited (gone, or a zombie nobody reaped yet).
bool running(pid_t pid) {
  const std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  REQUIRE(n > 0);
  return std::string(buf, static_cast<size_t>(n));
}

// Starts `world` ranks of the worker below; returns their processes.
std::vector<Proc> start_ranks(const std::string& dir, const std::string& config, int world,
                              std::map<std::string, std::string> extra = {}) {
  const int port = free_port();
  std::vector<Proc> procs;
  for (int r = 0; r < world; ++r) {
    auto env = extra;
    env["TRAIN_TEST_WORKER"] = "ddp";
    env["TRAIN_TEST_CONFIG"] = config;
    env["TRAIN_TEST_OUT"] = files::join(dir, "params.rank" + std::to_string(r) + ".pt");
    env["TRAIN_TEST_BUFFERS_OUT"] = files::join(dir, "buffers.rank" + std::to_string(r) + ".pt");
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_WORLD_SIZE"] = std::to_string(world);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = std::to_string(port);
    procs.push_back(spawn({self_exe()}, env, files::join(dir, "rank" + std::to_string(r) + ".log")));
  }
  return procs;
}

// Starts `world` ranks of `train fit` as a scheduler starts them (only the environment, no `train
// launch`, whose launcher would serve the store): rank 0 serves the store. `args(r)` is what rank
// r gets after `train fit`; its output goes to <dir>/rank<r>.log.
std::vector<Proc> spawn_fit_ranks(const std::string& dir, int world,
                                  const std::function<std::vector<std::string>(int)>& args) {
  const int port = free_port();
  std::vector<Proc> ranks;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv = {kTrain, "fit"};
    for (auto& a : args(r)) argv.push_back(std::move(a));
    ranks.push_back(spawn(argv,
                          {{"RANK", std::to_string(r)}, {"LOCAL_RANK", std::to_string(r)},
                           {"WORLD_SIZE", std::to_string(world)}, {"LOCAL_WORLD_SIZE", std::to_string(world)},
                           {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}},
                          files::join(dir, "rank" + std::to_string(r) + ".log")));
  }
  return ranks;
}

// Rank `rank` of `world` as a thread of this process (the test runs one thread per rank), on CPU.
dist::GroupPtr thread_rank_group(int64_t rank, int64_t world, int port, const DistributedConfig& dc) {
  dist::Env env;
  env.rank = env.local_rank = rank;
  env.world_size = env.local_world_size = world;
  env.master_port = port;
  env.launcher = "test";
  return dist::Group::create(env, dc, "cpu");
}

std::vector<torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> params;
  torch::load(params, path);
  return params;
}

// Runs 2 ranks to completion and returns rank 0's and rank 1's final parameters.
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> run_two_ranks(const std::string& dir,
                                                                                 const std::string& config) {
  auto procs = start_ranks(dir, config, 2);
  for (const auto& p : procs) {
    const int rc = wait_for(p, 300);
    INFO(slurp(p.log));
    REQUIRE(rc == 0);
  }
  return {load_params(files::join(dir, "params.rank0.pt")), load_params(files::join(dir, "params.rank1.pt"))};
}

bool bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].sizes().equals(b[i].sizes()) || !torch::equal(a[i], b[i])) return false;
  }
  return true;
}

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  return m;
}

}  // namespace

// The child-process side: one rank of a run described by TRAIN_TEST_CONFIG.
int ddp_test_worker() {
  try {
    const dist::Env env = dist::detect_env();
    log::set_rank(static_cast<int>(env.rank));
    // TRAIN_TEST_BUFFERS_OUT: also save the buffers there; TRAIN_TEST_NO_VAL=1: train without
    // the validation set.
    const char* buffers_out = std::getenv("TRAIN_TEST_BUFFERS_OUT");
    const char* no_val = std::getenv("TRAIN_TEST_NO_VAL");
    std::vector<torch::Tensor> buffers;
    const auto params = train_once(std::getenv("TRAIN_TEST_CONFIG"), env, nullptr, &buffers,
                                   no_val == nullptr || std::string(no_val) != "1");
    torch::save(params, std::getenv("TRAIN_TEST_OUT"));
    if (buffers_out != nullptr) torch::save(buffers, buffers_out);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "worker error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker exception: %s\n", e.what());
    return 1;
  }
}

TEST_CASE("environment variables of torchrun, Slurm and Open MPI", "[dist]") {
  auto from = [](std::map<std::string, std::string> vars) {
    return dist::detect_env([vars](const char* name) -> const char* {
      const auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  const dist::Env single = from({});
  CHECK_FALSE(single.distributed());
  CHECK(single.world_size == 1);

  const dist::Env tr = from({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                             {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "1234"}, {"TORCHELASTIC_RUN_ID", "x"},
                             {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "2"}});
  CHECK(tr.rank == 3);
  CHECK(tr.world_size == 8);
  CHECK(tr.local_rank == 1);
  CHECK(tr.local_world_size == 2);
  CHECK(tr.master_addr == "node7");
  CHECK(tr.master_port == 1234);
  CHECK(tr.launcher == "torchrun");
  CHECK(tr.agent_store);
  CHECK(tr.restart == 2);

  // An srun step on 2 of the allocation's 4 nodes: the step's variables, not the job's.
  std::map<std::string, std::string> step{{"SLURM_PROCID", "5"},         {"SLURM_NTASKS", "16"},
                                          {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_LOCALID", "1"},
                                          {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
                                          {"SLURM_JOB_NODELIST", "gpu[01-04]"}, {"SLURM_STEP_NODELIST", "gpu[03-04]"},
                                          {"SLURMD_NODENAME", "gpu04"}, {"SLURM_JOB_ID", "4242"},
                                          {"SLURM_STEP_ID", "0"}};
  const dist::Env slurm = from(step);
  CHECK(slurm.launcher == "slurm");
  CHECK(slurm.rank == 5);
  CHECK(slurm.world_size == 8);
  CHECK(slurm.local_rank == 1);
  CHECK(slurm.local_world_size == 4);
  CHECK(slurm.master_addr == "gpu03");
  CHECK(slurm.job == "slurm-4242.0");
  // A port of the job's own, the same on every rank; another job gets another.
  CHECK(slurm.master_port >= 20000);
  CHECK(slurm.master_port < 30000);
  step["SLURM_PROCID"] = "0";
  CHECK(from(step).master_port == slurm.master_port);
  step["SLURM_JOB_ID"] = "4243";
  CHECK(from(step).master_port != slurm.master_port);
  step["MASTER_PORT"] = "1234";
  CHECK(from(step).master_port == 1234);
  // Uneven: 1 task on n01, 3 on n02 (zero-padded names); this node's count, by its name.
  const dist::Env uneven = from({{"SLURM_PROCID", "2"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_LOCALID", "1"},
                                 {"SLURM_STEP_TASKS_PER_NODE", "1,3"}, {"SLURM_STEP_NODELIST", "n[01-02]"},
                                 {"SLURMD_NODENAME", "n02"}});
  CHECK(uneven.local_world_size == 3);
  CHECK(uneven.master_addr == "n01");
  // A single Slurm task is a single process.
  CHECK_FALSE(from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_STEP_NUM_TASKS", "1"}}).distributed());
  // The batch script of `sbatch -n 4` is not one of 4 ranks: one process, and a note that says why.
  const dist::Env batch = from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "4242"}});
  CHECK_FALSE(batch.distributed());
  CHECK_THAT(batch.note, Catch::Contains("SLURM_NTASKS=4") && Catch::Contains("srun train fit"));
  // mpirun inside an allocation: its processes inherit SLURM_* of another step; Open MPI's count.
  const dist::Env mpi_in_slurm = from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_NUM_TASKS", "2"},
                                       {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}, {"OMPI_COMM_WORLD_RANK", "3"},
                                       {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_ADDR", "n01"}});
  CHECK(mpi_in_slurm.launcher == "mpirun");
  CHECK(mpi_in_slurm.rank == 3);
  CHECK(mpi_in_slurm.world_size == 4);
  // MPICH / Intel MPI (Hydra).
  const dist::Env hydra = from({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  CHECK(hydra.launcher == "mpiexec");
  CHECK(hydra.rank == 1);
  CHECK(hydra.local_world_size == 2);
  CHECK(hydra.master_addr == "127.0.0.1");
  // Hydra inside a Slurm step (its per-node helpers start with srun): the step's variables describe
  // the helpers, not the ranks.
  const dist::Env hydra_in_slurm =
      from({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"},
            {"SLURM_JOB_ID", "77"}, {"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"}, {"SLURM_LOCALID", "0"},
            {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}, {"MASTER_ADDR", "n01"}});
  CHECK(hydra_in_slurm.launcher == "mpiexec");
  CHECK(hydra_in_slurm.rank == 3);
  CHECK(hydra_in_slurm.world_size == 4);
  // A variable set but empty (a script's unfilled RANK=) is an error, not "unset".
  CHECK_THROWS_WITH(from({{"RANK", ""}, {"WORLD_SIZE", "2"}}), Catch::Contains("RANK is set but empty"));

  // RANK and WORLD_SIZE alone: one host when the store is here, one rank per host when it is not
  // (a pod per rank), and a question when only LOCAL_RANK says how the ranks are spread.
  const dist::Env here = from({{"RANK", "1"}, {"WORLD_SIZE", "4"}});
  CHECK(here.local_rank == 1);
  CHECK(here.local_world_size == 4);
  const dist::Env pod = from({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "job-master-0"}});
  CHECK(pod.local_rank == 0);
  CHECK(pod.local_world_size == 1);

  const dist::Env mpi = from({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  CHECK(mpi.launcher == "mpirun");
  CHECK(mpi.rank == 1);
  CHECK(mpi.master_addr == "127.0.0.1");

  // Malformed or inconsistent variables name themselves.
  auto message = [&](std::map<std::string, std::string> vars) {
    try {
      from(std::move(vars));
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(message({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), Catch::Contains("RANK='x'"));
  CHECK_THAT(message({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), Catch::Contains("RANK=2 is not below WORLD_SIZE=2"));
  CHECK_THAT(message({{"RANK", "0"}}), Catch::Contains("RANK and WORLD_SIZE must be set together"));
  CHECK_THAT(message({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
             Catch::Contains("MASTER_PORT=70000"));
  CHECK_THAT(message({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
             Catch::Contains("MASTER_ADDR is not set"));
  CHECK_THAT(message({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "node0"}}),
             Catch::Contains("set LOCAL_WORLD_SIZE"));
  CHECK_THAT(message({{"SLURM_PROCID", "2"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_STEP_TASKS_PER_NODE", "1,3"},
                      {"SLURM_STEP_NODELIST", "n[01-02]"}}),
             Catch::Contains("cannot tell how many tasks") && Catch::Contains("SLURM_STEP_TASKS_PER_NODE='1,3'"));
}

TEST_CASE("GradSync: abandoning a step whose finish() failed launches each bucket once, as the other ranks do",
          "[dist]") {
  // Rank 0's finish() fails after its backward launched the last layer's buckets (here: a
  // parameter without a gradient; on a GPU, an out-of-memory error in finish()). abandon() must
  // launch only the buckets still missing: a second allreduce of a launched bucket would pair with
  // the other rank's next collective.
  const int port = free_port();
  DistributedConfig dc;
  dc.backend = "gloo";
  dc.timeout_s = 5;
  std::string failure[2];
  int64_t after[2] = {0, 0};
  std::thread ranks[2];
  for (int64_t r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      try {
        auto group = thread_rank_group(r, 2, port, dc);
        torch::manual_seed(3);
        torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
        dist::GradSyncOptions options;
        options.bucket_bytes = options.first_bucket_bytes = 1;  // a bucket per parameter
        dist::GradSync sync(*net, group, options);
        const auto x = torch::randn({3, 4});
        sync.prepare(true);
        if (r == 0) {
          net[1]->as<torch::nn::Linear>()->forward(x).sum().backward();  // the first layer gets no gradient
          CHECK_THROWS_WITH(sync.finish(), Catch::Contains("received no gradient"));
          sync.abandon();
        } else {
          net->forward(x).sum().backward();
          sync.finish();
        }
        after[r] = group->reduce_int(7 + r, dist::ReduceOp::Sum);  // the next collective pairs up
      } catch (const std::exception& e) {
        failure[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  INFO("rank 0: " << failure[0] << "\nrank 1: " << failure[1]);
  CHECK(failure[0].empty());
  CHECK(failure[1].empty());
  CHECK(after[0] == 15);
  CHECK(after[1] == 15);
}

TEST_CASE("wait_for_all: work one rank does alone may outlast distributed.timeout_s, up to its own limit", "[dist]") {
  const int port = free_port();
  DistributedConfig dc;
  dc.backend = "gloo";
  dc.timeout_s = 1;  // a collective gives up after 1 s
  std::string failure[2];
  double after_wait[2] = {0, 0};
  std::atomic<bool> rank1_done{false};
  std::thread ranks[2];
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      try {
        auto group = thread_rank_group(r, 2, port, dc);
        if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // "writing a checkpoint"
        group->wait_for_all("the checkpoint of step 1", 30, "distributed.checkpoint_timeout_s");
        after_wait[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        group->barrier();  // the collective after it: both ranks arrive together
        // Rank 1 alone now: it gives up after the limit, naming the work and the setting (rank 0,
        // which serves the store, stays up meanwhile).
        if (r == 1) group->wait_for_all("the checkpoint of step 2", 1, "distributed.checkpoint_timeout_s");
        while (r == 0 && !rank1_done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      } catch (const std::exception& e) {
        failure[r] = e.what();
      }
      if (r == 1) rank1_done = true;
    });
  }
  for (auto& t : ranks) t.join();
  CHECK(failure[0].empty());
  CHECK(after_wait[1] >= 2.4);  // it waited for rank 0, 2.5 s, well past the 1 s collective timeout
  CHECK_THAT(failure[1], Catch::Contains("rank 1 of 2 (gloo): waited") &&
                             Catch::Contains("to finish the checkpoint of step 2 (distributed.checkpoint_timeout_s = 1 s)"));
}

TEST_CASE("rendezvous: a port another program holds is reported as such, at once", "[dist]") {
  // Something else listens on the port rank 0 would serve the store on.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  dist::Env env;
  env.world_size = 2;
  env.local_world_size = 2;
  env.master_port = ntohs(addr.sin_port);
  env.launcher = "test";
  DistributedConfig dc;
  dc.backend = "gloo";
  dc.init_timeout_s = 30;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(dist::Group::create(env, dc, "cpu"),
                    Catch::Contains("rank 0 could not serve the rendezvous on port " + std::to_string(env.master_port)) &&
                        Catch::Contains("set MASTER_PORT"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
  // Rank 1 finds the port answered by something that is no store: within init_timeout_s (+5 s),
  // not in recv() for ever, as LibTorch's client alone would wait.
  env.rank = 1;
  dc.init_timeout_s = 1;
  const auto t1 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(dist::Group::create(env, dc, "cpu"),
                    Catch::Contains("rank 1 could not join the rendezvous") && Catch::Contains("no answer"));
  CHECK(std::chrono::steady_clock::now() - t1 < std::chrono::seconds(20));
#if TORCH_VERSION_MAJOR < 2
  // Under torchrun a LibTorch 1.x rank 0 serves its own store on MASTER_PORT + 1 (it cannot talk to
  // a 2.x agent's store): when that port is the one taken, the message says so.
  env.rank = 0;
  env.agent_store = true;
  env.launcher = "torchrun";
  env.master_port = ntohs(addr.sin_port) - 1;
  dc.init_timeout_s = 30;
  CHECK_THROWS_WITH(dist::Group::create(env, dc, "cpu"),
                    Catch::Contains("could not serve the rendezvous on port " + std::to_string(env.master_port + 1) +
                                    " (torchrun: MASTER_PORT + 1") &&
                        Catch::Contains("with the port after it free too"));
#endif
  ::close(fd);
}

TEST_CASE("2 Gloo ranks: identical replicas, equal to one process on the same global batch", "[dist][process]") {
  const std::string dir = files::make_temp_directory("train_ddp_");
  const std::string config = write_config(dir, "ddp", "distributed: {timeout_s: 60}\n");
  const auto [r0, r1] = run_two_ranks(dir, config);
  CHECK(bitwise_equal(r0, r1));

  const auto single = train_once(config, dist::Env{});
  REQUIRE(single.size() == r0.size());
  const double diff = max_abs_diff(single, r0);
  INFO("max |single - ddp| = " << diff);
  CHECK(diff < 1e-5);
  files::remove_all(dir);
}

TEST_CASE("accumulation with no_sync equals no accumulation, and buckets equal one flat allreduce", "[dist][process]") {
  const std::string dir = files::make_temp_directory("train_ddp_accum_");
  const auto [whole, whole1] =
      run_two_ranks(files::make_temp_directory(dir + "/a_"), write_config(dir, "whole", "tuning: {micro_batch: 8}\n"));
  const auto [accum, accum1] =
      run_two_ranks(files::make_temp_directory(dir + "/b_"), write_config(dir, "accum", "tuning: {micro_batch: 2}\n"));
  CHECK(bitwise_equal(accum, accum1));
  const double diff = max_abs_diff(whole, accum);
  INFO("max |accum 4 - accum 1| = " << diff);
  CHECK(diff < 1e-5);

  // Every parameter in its own bucket vs all of them in one: the same sums, bit for bit.
  const auto [many, many1] = run_two_ranks(
      files::make_temp_directory(dir + "/c_"),
      write_config(dir, "many", "distributed: {bucket_mb: 0.000001, first_bucket_mb: 0.000001}\n"));
  const auto [flat, flat1] = run_two_ranks(files::make_temp_directory(dir + "/d_"),
                                           write_config(dir, "flat", "distributed: {bucket_mb: 1000, first_bucket_mb: 1000}\n"));
  CHECK(bitwise_equal(many, flat));
  CHECK(bitwise_equal(many, whole));
  files::remove_all(dir);
}

TEST_CASE("BERT with recomputed layers on 2 ranks: the gradients' all-reduce sees the recomputation's gradients",
          "[dist][process][recompute]") {
  // The recomputation accumulates the layers' parameter gradients in a backward of its own, inside
  // the step's: the hooks that fill the all-reduce buckets fire there. Dropout on, so the
  // recomputation must redraw each rank's masks.
  const std::string dir = files::make_temp_directory("train_ddp_recompute_");
  data::TokenFileOptions token_options;
  token_options.vocab_size = 40;
  token_options.special = data::SpecialTokens{0, 1, 2, 3, 4};
  std::vector<std::vector<int64_t>> documents;
  for (int64_t d = 0; d < 64; ++d) {
    documents.emplace_back();
    for (int64_t t = 0; t < 8 + d % 9; ++t) documents.back().push_back(5 + (d * 7 + t * 3) % 35);
  }
  data::write_token_file(files::join(dir, "train.tokens"), documents, token_options);
  data::write_token_file(files::join(dir, "val.tokens"), documents, token_options);
  const auto config = [&](const std::string& name, bool recompute) {
    const std::string path = files::join(dir, name + ".yaml");
    std::ofstream(path) << "model: {name: bert-mlm, preset: bert-tiny, vocab_size: 40, num_classes: 40, max_positions: 16,"
                           " dropout: 0.1,"
                           " recompute: " << (recompute ? "true" : "false") << "}\n"
                           "data: {kind: tokens, root: " << dir << ", seq_len: 16, workers: 1}\n"
                           "optim: {name: adamw, lr: 0.001}\n"
                           "trainer: {global_batch: 8, max_steps: 6, device: cpu, threads: 1, seed: 5}\n"
                           "tuning: {micro_batch: 2}\n"
                           "logging: {every_steps: 3}\n";
    return path;
  };
  const auto [plain0, plain1] = run_two_ranks(files::make_temp_directory(dir + "/plain_"), config("plain", false));
  const auto [re0, re1] = run_two_ranks(files::make_temp_directory(dir + "/recompute_"), config("recompute", true));
  CHECK(bitwise_equal(re0, re1));
  INFO("max |recomputed - plain| = " << max_abs_diff(re0, plain0));
  CHECK(max_abs_diff(re0, plain0) < 1e-6);
  files::remove_all(dir);
}

TEST_CASE("a parameter without a gradient is named, or tolerated when the config says so", "[dist][process]") {
  const std::string dir = files::make_temp_directory("train_ddp_unused_");
  const std::string bad = write_config(dir, "bad", "distributed: {timeout_s: 10}\n", "test_mlp_unused");
  auto procs = start_ranks(dir, bad, 2);
  for (const auto& p : procs) CHECK(wait_for(p, 120) == 1);
  CHECK_THAT(slurp(procs[0].log), Catch::Contains("unused.weight") && Catch::Contains("find_unused_parameters"));

  const std::string ok =
      write_config(dir, "ok", "distributed: {timeout_s: 10, find_unused_parameters: true}\n", "test_mlp_unused");
  const auto [r0, r1] = run_two_ranks(files::make_temp_directory(dir + "/ok_"), ok);
  CHECK(bitwise_equal(r0, r1));
  // As in PyTorch's DDP and in one process: a parameter no rank used is not stepped at all (the
  // config's weight decay and momentum would otherwise move it on an all-zero gradient).
  const auto single = train_once(ok, dist::Env{});
  REQUIRE(single.size() == r0.size());
  INFO("max |single - ddp| = " << max_abs_diff(single, r0));
  CHECK(max_abs_diff(single, r0) < 1e-5);
  CHECK(torch::equal(single[4], r0[4]));  // unused.weight, untouched since initialisation
  CHECK(torch::equal(single[5], r0[5]));  // unused.bias
  files::remove_all(dir);
}

TEST_CASE("distributed.broadcast_buffers: rank 0's BatchNorm statistics before every step and evaluation or none",
          "[dist][process]") {
  // Solid images, unshuffled: rank r reads samples r, r + 2, ..., so rank 0 sees only value 45 and
  // rank 1 only 145 (even and odd file numbers). A BatchNorm on the input then has running mean
  // m(t) = 0.9 m(t - 1) + 0.1 c (momentum 0.1, from 0) for the value c of the batch it normalises.
  const std::string dir = files::make_temp_directory("train_ddp_buffers_");
  const std::string root = files::join(dir, "images");
  for (const char* split : {"train/a", "train/b", "val/a", "val/b"}) {
    files::make_directories(files::join(root, split));
    for (int i = 0; i < 16; ++i) {
      char name[16];
      std::snprintf(name, sizeof(name), "/%02d.png", i);
      write_png(files::join(root, split) + name, 16, i % 2 == 0 ? 1 : 5);  // 20 + 25 * shade
    }
  }
  const double c0 = 45.0 / 255.0, c1 = 145.0 / 255.0;
  auto run = [&](const std::string& name, const std::string& broadcast, bool with_val) {
    const std::string config = files::join(dir, name + ".yaml");
    std::ofstream(config) << "model: {name: test_input_norm, in_channels: 3, num_classes: 2}\n"
                             "data: {kind: image_folder, root: " << root << ", image_size: 8, shuffle: false,"
                             " workers: 0}\n"
                             "optim: {name: sgd, lr: 0.1}\n"
                             "trainer: {global_batch: 8, max_steps: 3, device: cpu, threads: 1}\n"
                             "tuning: {micro_batch: 4}\n"
                             "logging: {tensorboard: false}\n"
                             "distributed: {timeout_s: 60, broadcast_buffers: " << broadcast << "}\n";
    const std::string out = files::make_temp_directory(files::join(dir, name + "_"));
    auto procs = start_ranks(out, config, 2, {{"TRAIN_TEST_NO_VAL", with_val ? "0" : "1"}});
    for (const auto& p : procs) {
      const int rc = wait_for(p, 300);
      INFO(slurp(p.log));
      REQUIRE(rc == 0);
    }
    std::vector<torch::Tensor> means;
    for (int r = 0; r < 2; ++r) {
      const auto buffers = load_params(files::join(out, "buffers.rank" + std::to_string(r) + ".pt"));
      REQUIRE(buffers.size() == 3);  // running_mean, running_var, num_batches_tracked
      REQUIRE(buffers[0].numel() == 3);
      CHECK(buffers[2].item<int64_t>() == 3);
      means.push_back(buffers[0].to(torch::kDouble));
    }
    return means;
  };
  // The largest distance of a running mean's channels from `expected`.
  auto gap = [](const torch::Tensor& mean, double expected) { return (mean - expected).abs().max().item<double>(); };
  const double after_3 = 1.0 - 0.9 * 0.9 * 0.9, after_2 = 1.0 - 0.9 * 0.9;

  SECTION("true: copied before each step, so rank 1 keeps only its last step's batch; evaluation copies again") {
    const auto steps = run("broadcast", "true", false);
    CHECK(gap(steps[0], after_3 * c0) < 1e-5);
    CHECK(gap(steps[1], 0.9 * after_2 * c0 + 0.1 * c1) < 1e-5);  // rank 0's after step 2, then its own step 3
    const auto evaluated = run("broadcast_eval", "true", true);
    CHECK(gap(evaluated[0], after_3 * c0) < 1e-5);
    CHECK(torch::equal(evaluated[0], evaluated[1]));
  }
  SECTION("false: each rank keeps its own statistics, through evaluation too") {
    const auto own = run("own", "false", true);
    CHECK(gap(own[0], after_3 * c0) < 1e-5);
    CHECK(gap(own[1], after_3 * c1) < 1e-5);
  }
  files::remove_all(dir);
}

TEST_CASE("when a rank dies or hangs, the others exit non-zero within the timeout", "[dist][process][timing]") {
  const std::string dir = files::make_temp_directory("train_ddp_dead_");
  const std::string config = write_config(dir, "dead", "distributed: {timeout_s: 5}\n");
  SECTION("killed") {
    auto procs = start_ranks(dir, config, 2, {{"TRAIN_TEST_DIE_RANK", "1"}, {"TRAIN_TEST_DIE_AT", "6"}});
    CHECK(wait_for(procs[1], 120) == 3);
    const int rc = wait_for(procs[0], 30);
    INFO(slurp(procs[0].log));
    CHECK(rc == 1);
    CHECK_THAT(slurp(procs[0].log), Catch::Contains("distributed: rank 0 of 2 (gloo)"));
  }
  SECTION("hung") {
    auto procs = start_ranks(dir, config, 2,
                             {{"TRAIN_TEST_DIE_RANK", "1"}, {"TRAIN_TEST_DIE_AT", "6"}, {"TRAIN_TEST_HANG", "1"}});
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = wait_for(procs[0], 60);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    kill_and_reap(procs[1]);
    INFO(slurp(procs[0].log));
    CHECK(rc == 1);
    CHECK(waited < 45);
    CHECK_THAT(slurp(procs[0].log), Catch::Contains("distributed.timeout_s = 5"));
  }
  files::remove_all(dir);
}

TEST_CASE("GradSync: a second backward in one synchronising step is an error", "[dist]") {
  dist::Env env;
  env.world_size = 1;
  env.master_port = free_port();
  env.launcher = "test";
  DistributedConfig dc;
  dc.backend = "gloo";
  dc.timeout_s = 30;
  auto group = dist::Group::create(env, dc, "cpu");
  torch::nn::Linear net(4, 2);
  dist::GradSync sync(*net, group);
  const auto x = torch::randn({3, 4});
  sync.prepare(true);
  net->forward(x).sum().backward();
  net->forward(x).sum().backward();  // its gradient would not be in the allreduce
  CHECK_THROWS_WITH(sync.finish(), Catch::Contains("two backward passes") && Catch::Contains("no_sync"));
  // The next step is clean again.
  net->zero_grad();
  sync.prepare(true);
  net->forward(x).sum().backward();
  CHECK_NOTHROW(sync.finish());
}

namespace {

// A dataset that records, per index, the samples the loader built (through get or get_batch) and
// how many one-pass batches it was asked for.
class RecordingDataset final : public data::Dataset {
 public:
  explicit RecordingDataset(data::DatasetPtr base) : base_(std::move(base)) {}
  int64_t size() const override { return base_->size(); }
  data::Example get(int64_t index, uint64_t seed) const override {
    data::Example example = base_->get(index, seed);
    std::lock_guard<std::mutex> lock(mutex_);
    seen_[index].push_back(example);
    return example;
  }
  std::optional<data::Batch> get_batch(const std::vector<int64_t>& indices, const std::vector<uint64_t>& seeds,
                                       bool) const override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++batches_;
    }
    std::vector<data::Example> examples;
    for (size_t i = 0; i < indices.size(); ++i) examples.push_back(get(indices[i], seeds[i]));
    return collate(std::move(examples));
  }
  std::vector<int64_t> input_shape() const override { return base_->input_shape(); }
  int64_t num_classes() const override { return base_->num_classes(); }
  std::string describe() const override { return "recording " + base_->describe(); }
  int64_t vocab_size() const override { return base_->vocab_size(); }
  int64_t pad_id() const override { return base_->pad_id(); }

  std::map<int64_t, std::vector<data::Example>> seen() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }
  int64_t batches() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return batches_;
  }

 private:
  data::DatasetPtr base_;
  mutable std::mutex mutex_;
  mutable std::map<int64_t, std::vector<data::Example>> seen_;
  mutable int64_t batches_ = 0;
};

// An embedding and a linear layer over token ids.
class TinyTokenModel : public models::Model {
 public:
  explicit TinyTokenModel(int64_t vocab)
      : embed_(register_module("embed", torch::nn::Embedding(vocab, 8))),
        out_(register_module("out", torch::nn::Linear(8, vocab))) {}
  torch::Tensor forward(const torch::Tensor& x) override { return out_(torch::tanh(embed_(x))); }

 private:
  torch::nn::Embedding embed_;
  torch::nn::Linear out_;
};

}  // namespace

TEST_CASE("distributed evaluation: each rank masks a sample as one process does and reads each sample once",
          "[dist][tokens]") {
  const std::string dir = files::make_temp_directory("train_ddp_eval_");
  // 13 documents of 6..17 words from [5, 40): 13 samples, 7 on rank 0 and 6 on rank 1.
  std::vector<std::vector<int64_t>> documents;
  for (int64_t d = 0; d < 13; ++d) {
    documents.emplace_back();
    for (int64_t t = 0; t < 6 + d; ++t) documents.back().push_back(5 + (d * 11 + t * 7) % 35);
  }
  data::TokenFileOptions file_options;
  file_options.vocab_size = 40;
  file_options.special = {0, 1, 2, 3, 4};
  const std::string path = files::join(dir, "val.tokens");
  data::write_token_file(path, documents, file_options);
  data::TokenDatasetOptions options;
  options.path = path;
  options.seq_len = 20;
  options.pack = false;
  options.mlm.mask_prob = 0.3;  // several masked positions per sample, so that masks tell seeds apart
  const auto tokens = std::make_shared<data::TokenDataset>(options);
  REQUIRE(tokens->size() == 13);

  const Config config = parse_config("model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                                     "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 64,"
                                     " synthetic_val_samples: 8, workers: 1}\n"
                                     "trainer: {global_batch: 4, max_steps: 1, device: cpu, threads: 1, eval_batch: 3}\n"
                                     "distributed: {timeout_s: 60}\n",
                                     "eval.yaml");
  const RunParts run = prepare_run(config);  // for the plan; the model and data are the test's
  // The same weights for every evaluation (made here: the threads below share the generator).
  std::vector<models::ModelPtr> replicas;
  for (int i = 0; i < 3; ++i) {
    torch::manual_seed(1);
    replicas.push_back(std::make_shared<TinyTokenModel>(40));
  }
  // Evaluates `val` as rank `rank` of `world` (a single process when world is 1).
  auto evaluate = [&](const std::shared_ptr<RecordingDataset>& val, int64_t rank, int64_t world, int port) {
    dist::GroupPtr group;
    if (world > 1) group = thread_rank_group(rank, world, port, config.distributed);
    Plan plan = run.plan;
    plan.rank = rank;
    plan.world_size = world;
    Trainer trainer(config, plan, replicas[static_cast<size_t>(world == 1 ? 2 : rank)], run.train, val, "", group);
    return trainer.evaluate();
  };

  const auto single = std::make_shared<RecordingDataset>(tokens);
  const EvalResult one = evaluate(single, 0, 1, 0);
  const auto sharded = std::make_shared<RecordingDataset>(tokens);
  const int port = free_port();
  EvalResult two[2];
  std::string failure[2];
  std::thread ranks[2];
  for (int64_t r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      try {
        two[r] = evaluate(sharded, r, 2, port);
      } catch (const std::exception& e) {
        failure[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  INFO("rank 0: " << failure[0] << "\nrank 1: " << failure[1]);
  REQUIRE(failure[0].empty());
  REQUIRE(failure[1].empty());

  // Every sample once, as the dataset's own index, with the inputs (masks) and targets it has on
  // one process.
  const auto expected = single->seen();
  const auto actual = sharded->seen();
  REQUIRE(expected.size() == 13);
  REQUIRE(actual.size() == 13);
  for (const auto& [index, examples] : actual) {
    INFO("sample " << index);
    REQUIRE(examples.size() == 1);
    REQUIRE(expected.count(index) == 1);
    CHECK(torch::equal(examples[0].input, expected.at(index)[0].input));
    CHECK(torch::equal(examples[0].target, expected.at(index)[0].target));
  }
  // The masks differ from sample to sample (else the comparison above proves little).
  CHECK_FALSE(torch::equal(expected.at(0).at(0).target.ne(-100), expected.at(1).at(0).target.ne(-100)));
  // The one-pass batch path is taken on each rank too, and the sums are the single process's.
  CHECK(single->batches() == 5);   // 13 samples in batches of 3
  CHECK(sharded->batches() == 5);  // 7 on rank 0 (3 batches), 6 on rank 1 (2)
  CHECK(two[0].samples == one.samples);
  CHECK(two[1].samples == one.samples);
  CHECK(two[0].loss == Approx(one.loss).epsilon(1e-6));
  CHECK(two[0].accuracy == Approx(one.accuracy).epsilon(1e-9));
  files::remove_all(dir);
}

// Fits `config` on 2 ranks in threads of this process, sharing `run_dir`; each rank trains on
// train_of(its training set), and evaluates when with_val. Both ranks must succeed.
std::array<FitResult, 2> fit_on_two_ranks(const Config& config, const std::string& run_dir, const std::string& resume,
                                          const std::function<data::DatasetPtr(data::DatasetPtr)>& train_of,
                                          bool with_val = false) {
  const int port = free_port();
  std::array<FitResult, 2> results;
  std::array<std::string, 2> failure;
  std::array<std::thread, 2> ranks;
  for (int64_t r = 0; r < 2; ++r) {
    ranks[static_cast<size_t>(r)] = std::thread([&, r] {
      try {
        dist::Env env;
        env.rank = env.local_rank = r;
        env.world_size = env.local_world_size = 2;
        env.master_port = port;
        env.launcher = "test";
        RunOptions options;
        options.env = env;
        RunParts run = prepare_run(config, options);
        Trainer trainer(config, run.plan, run.model, train_of(run.train), with_val ? run.val : nullptr, run_dir,
                        run.group);
        results[static_cast<size_t>(r)] = trainer.fit(resume);
      } catch (const std::exception& e) {
        failure[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  INFO("rank 0: " << failure[0] << "\nrank 1: " << failure[1]);
  REQUIRE(failure[0].empty());
  REQUIRE(failure[1].empty());
  return results;
}

TEST_CASE("data.on_error skip on 2 ranks: a resumed run counts each rank's samples replaced before its checkpoint",
          "[dist][resume][data]") {
  register_test_models();
  const std::string dir = files::make_temp_directory("train_ddp_skip_");
  // 16 samples a step in order, the even ones on rank 0 and the odd ones on rank 1: before the
  // step-4 checkpoint rank 1 replaces 5 and 7 and rank 0 replaces 40; after it, rank 0 100 and
  // rank 1 131. Each rank's own count, before and after, in one number.
  const Config config = load_config(write_config(dir, "skip", "distributed: {timeout_s: 60}\n"),
                                    {"data.on_error=skip", "data.shuffle=false", "trainer.max_steps=12",
                                     "checkpoint.every_steps=4", "checkpoint.keep_last=5", "tuning.micro_batch=8"});
  const std::set<int64_t> bad = {5, 7, 40, 100, 131};
  auto fit_two = [&](const std::string& run_dir, const std::string& resume) {
    return fit_on_two_ranks(config, run_dir, resume, [&](data::DatasetPtr train) {
      return std::make_shared<testing::BadSamples>(train, bad);
    });
  };
  const std::string dir_a = files::join(dir, "a"), dir_b = files::join(dir, "b");
  const auto uninterrupted = fit_two(dir_a, "");
  CHECK(uninterrupted[0].skipped_samples == 2);
  CHECK(uninterrupted[1].skipped_samples == 3);

  files::make_directories(files::join(dir_b, "checkpoints"));
  const std::string step4 = checkpoint_path(files::join(dir_b, "checkpoints"), 4);
  files::copy_file(checkpoint_path(files::join(dir_a, "checkpoints"), 4), step4);
  const auto resumed = fit_two(dir_b, step4);
  CHECK(resumed[0].resumed_from_step == 4);
  CHECK(resumed[0].steps == 12);
  CHECK(resumed[0].skipped_samples == uninterrupted[0].skipped_samples);
  CHECK(resumed[1].skipped_samples == uninterrupted[1].skipped_samples);
  files::remove_all(dir);
}

TEST_CASE("checkpoint.best on 2 ranks: both rank the evaluations alike, rank 0 keeps best.pt, a resume shares best.json",
          "[dist][resume][checkpoint]") {
  register_test_models();
  // Written in the loop, and by rank 0's background writer (which every rank's end waits for).
  const std::string async = GENERATE(as<std::string>{}, "off", "on");
  INFO("checkpoint.async " << async);
  const std::string dir = files::make_temp_directory("train_ddp_best_");
  const Config config = load_config(write_config(dir, "best", "distributed: {timeout_s: 60}\n"),
                                    {"trainer.max_steps=8", "trainer.eval_every_steps=2", "checkpoint.every_steps=8",
                                     "checkpoint.keep_last=1", "checkpoint.best=loss", "tuning.micro_batch=8",
                                     "checkpoint.async=" + async});
  const std::string run_dir = files::join(dir, "run");
  auto fit_two = [&](const std::string& resume) {
    return fit_on_two_ranks(config, run_dir, resume, [](data::DatasetPtr train) { return train; }, /*with_val=*/true);
  };
  const auto fresh = fit_two("");
  CHECK(fresh[0].best_step > 0);
  CHECK(fresh[1].best_step == fresh[0].best_step);
  CHECK(fresh[1].best_value == fresh[0].best_value);
  const std::string checkpoints = files::join(run_dir, "checkpoints");
  CHECK(fresh[0].best_checkpoint == best_checkpoint_path(checkpoints));
  const std::optional<BestCheckpoint> record = read_best_checkpoint(checkpoints);
  REQUIRE(record.has_value());
  CHECK(record->step == fresh[0].best_step);
  // Resumed from the final checkpoint: rank 1 gets rank 0's reading of best.json.
  const auto again = fit_two("auto");
  CHECK(again[0].best_step == fresh[0].best_step);
  CHECK(again[1].best_step == fresh[0].best_step);
  CHECK(again[0].best_value == fresh[0].best_value);
  CHECK(again[1].best_value == fresh[0].best_value);
  files::remove_all(dir);
}

TEST_CASE("trainer.early_stop_patience on 2 ranks: both stop after the same evaluation, with rank 0's checkpoint",
          "[dist][checkpoint]") {
  register_test_models();
  const std::string dir = files::make_temp_directory("train_ddp_early_");
  // lr 2: the loss goes up and down, so a patience of 1 ends the run early.
  const Config config = load_config(write_config(dir, "early", "distributed: {timeout_s: 60}\n"),
                                    {"trainer.max_steps=16", "trainer.eval_every_steps=1", "checkpoint.best=loss",
                                     "trainer.early_stop_patience=1", "optim.lr=2", "tuning.micro_batch=8"});
  const std::string run_dir = files::join(dir, "run");
  const auto results = fit_on_two_ranks(config, run_dir, "", [](data::DatasetPtr train) { return train; },
                                        /*with_val=*/true);
  CHECK(results[0].stopped_early);
  CHECK(results[1].stopped_early);
  CHECK(results[0].steps < 16);
  CHECK(results[1].steps == results[0].steps);
  CHECK(latest_checkpoint(files::join(run_dir, "checkpoints")) ==
        checkpoint_path(files::join(run_dir, "checkpoints"), results[0].steps));
  files::remove_all(dir);
}

TEST_CASE("a model's own loss and measures on 2 ranks: each rank evaluates its share and the means are one process's",
          "[dist][checkpoint]") {
  register_test_models();
  const std::string dir = files::make_temp_directory("train_ddp_own_loss_");
  const Config config =
      load_config(write_config(dir, "own", "distributed: {timeout_s: 60}\n", "test_regressor"),
                  {"trainer.max_steps=6", "trainer.eval_every_steps=3", "checkpoint.best=abs_error",
                   "checkpoint.every_steps=6", "tuning.micro_batch=4", "optim.lr=0.01"});
  const std::string run_dir = files::join(dir, "run");
  const auto results = fit_on_two_ranks(config, run_dir, "", [](data::DatasetPtr train) { return train; },
                                        /*with_val=*/true);
  for (const FitResult& r : results) {
    CHECK_FALSE(r.val.has_accuracy);
    CHECK(r.val.samples == 50);  // 25 on each rank
    REQUIRE(r.val.metrics.size() == 1);
    CHECK(r.val.metrics[0].first == "abs_error");
    CHECK(r.best_metric == "abs_error");
  }
  CHECK(results[1].val.loss == results[0].val.loss);
  CHECK(results[1].val.metrics[0].second == results[0].val.metrics[0].second);
  // The final weights evaluated by one process on the whole validation set give the same means.
  RunParts one = prepare_run(config);
  load_model_weights(checkpoint_path(files::join(run_dir, "checkpoints"), 6), *one.model);
  Trainer single(config, one.plan, one.model, one.train, one.val, "");
  const EvalResult ev = single.evaluate();
  CHECK(ev.samples == 50);
  CHECK(ev.loss == Approx(results[0].val.loss).epsilon(1e-6));
  REQUIRE(ev.metrics.size() == 1);
  CHECK(ev.metrics[0].second == Approx(results[0].val.metrics[0].second).epsilon(1e-6));
  files::remove_all(dir);
}

TEST_CASE("checkpoint.every_minutes on 2 ranks: rank 0's clock decides, and every rank takes part in each checkpoint",
          "[dist][checkpoint]") {
  register_test_models();
  const std::string dir = files::make_temp_directory("train_ddp_minutes_");
  // 1e-9 minutes: due after every step by rank 0's clock. Rank 1 does not read its own, so it
  // must learn it from the step's agreement, or it would skip the wait for rank 0's write.
  const Config config = load_config(write_config(dir, "minutes", "distributed: {timeout_s: 60}\n"),
                                    {"trainer.max_steps=3", "checkpoint.every_minutes=1e-9", "checkpoint.keep_last=10",
                                     "tuning.micro_batch=8"});
  const std::string run_dir = files::join(dir, "run");
  const auto results = fit_on_two_ranks(config, run_dir, "", [](data::DatasetPtr train) { return train; });
  CHECK(results[0].steps == 3);
  CHECK(results[1].steps == 3);
  CHECK(list_checkpoints(files::join(run_dir, "checkpoints")).size() == 3);
  files::remove_all(dir);
}

TEST_CASE("ranks given different configs or different data refuse to train, naming what differs",
          "[dist][process][bad_input]") {
  // A rank with another step count met the others' collectives out of step (a hang until
  // distributed.timeout_s); one with a partial copy of the data trained on silently, or crashed in
  // Gloo ("Received data size doesn't match expected size").
  const std::string dir = files::make_temp_directory("train_ddp_mismatch_");
  const std::string config = files::join(dir, "run.yaml");
  std::ofstream(config) << "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 256,"
                           " synthetic_val_samples: 32, workers: 0}\n"
                           "trainer: {global_batch: 16, max_steps: 12, device: cpu, threads: 1}\n"
                           "distributed: {timeout_s: 30}\n"
                           "logging: {tensorboard: false}\n";
  // Two copies of some IDX data, 64 images of 28x28: the same size, one label apart.
  const auto write_idx = [&](const std::string& root, bool changed) {
    files::make_directories(root);
    const auto be32 = [](std::ofstream& out, uint32_t v) {
      const char bytes[4] = {char(v >> 24), char(v >> 16), char(v >> 8), char(v)};
      out.write(bytes, 4);
    };
    for (const char* split : {"train", "t10k"}) {
      std::ofstream images(files::join(root, std::string(split) + "-images-idx3-ubyte"), std::ios::binary);
      be32(images, 0x803);
      for (const uint32_t d : {64u, 28u, 28u}) be32(images, d);
      for (int i = 0; i < 64 * 28 * 28; ++i) images.put(static_cast<char>((i * 7) % 256));
      std::ofstream labels(files::join(root, std::string(split) + "-labels-idx1-ubyte"), std::ios::binary);
      be32(labels, 0x801);
      be32(labels, 64);
      for (int i = 0; i < 64; ++i) labels.put(static_cast<char>((i + (changed && i == 5 ? 1 : 0)) % 10));
    }
  };
  write_idx(files::join(dir, "data_a"), false);
  write_idx(files::join(dir, "data_b"), true);
  const std::vector<std::string> idx = {"--set", "data.kind=idx", "--set", "data.root=" + files::join(dir, "data_a")};
  struct Case {
    const char* name;
    std::vector<std::string> rank0_args, rank1_args;  // --set ... each rank adds
    int exit_code;
    std::string rank0_says, rank1_says;
  };
  const Case cases[] = {
      {"steps", {}, {"--set", "trainer.max_steps=24"}, 2,
       "key 'trainer.max_steps' differs between the ranks (rank 0 has 12)",
       "key 'trainer.max_steps' differs between the ranks (rank 1 has 24)"},
      {"buckets", {}, {"--set", "distributed.bucket_mb=1"}, 2,
       "key 'distributed.bucket_mb' differs between the ranks (rank 0 has",
       "key 'distributed.bucket_mb' differs between the ranks (rank 1 has 1"},
      {"data", idx, {"--set", "data.kind=idx", "--set", "data.root=" + files::join(dir, "data_b")}, 1,
       "the training set's content differs between the ranks (rank 0 has fingerprint",
       "the training set's content differs between the ranks (rank 1 has fingerprint"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      const std::string run_dir = files::join(dir, c.name);
      auto ranks = spawn_fit_ranks(dir, 2, [&](int r) -> std::vector<std::string> {
        std::vector<std::string> args = {config, "--run-dir", run_dir};
        const std::vector<std::string>& more = r == 0 ? c.rank0_args : c.rank1_args;
        args.insert(args.end(), more.begin(), more.end());
        return args;
      });
      for (size_t r = 0; r < ranks.size(); ++r) {
        const int rc = wait_for(ranks[r], 60);
        const std::string out = slurp(ranks[r].log);
        INFO(out);
        CHECK(rc == c.exit_code);
        CHECK_THAT(out, Catch::Contains(r == 0 ? c.rank0_says : c.rank1_says));
      }
      for (const auto& p : ranks) {
        if (running(p.pid)) kill_and_reap(p);
      }
      CHECK_FALSE(files::exists(run_dir));  // bad input: nothing left behind
    }
  }
  files::remove_all(dir);
}

TEST_CASE("the rendezvous roll call: ranks of one host counted, a WORLD_SIZE that differs and a rank taken twice named",
          "[dist][process]") {
  const std::string dir = files::make_temp_directory("train_ddp_roll_call_");
  const std::string config = files::join(dir, "run.yaml");
  std::ofstream(config) << "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 256,"
                           " synthetic_val_samples: 32, workers: 0}\n"
                           "trainer: {global_batch: 16, max_steps: 4, device: cpu}\n"
                           "distributed: {init_timeout_s: 30}\n"
                           "logging: {tensorboard: false}\n";
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof(host) - 1) == 0);
  const auto ranks = [&](const std::string& name, int world, const std::string& master,
                         const std::function<std::map<std::string, std::string>(int)>& more, int64_t steps) {
    const int port = free_port();
    std::vector<Proc> procs;
    for (int r = 0; r < world; ++r) {
      std::map<std::string, std::string> env = {{"RANK", std::to_string(r)}, {"WORLD_SIZE", std::to_string(world)},
                                                {"MASTER_ADDR", master}, {"MASTER_PORT", std::to_string(port)}};
      for (const auto& [k, v] : more(r)) env[k] = v;
      procs.push_back(spawn({kTrain, "fit", config, "--run-dir", files::join(dir, name), "--set",
                             "trainer.max_steps=" + std::to_string(steps)},
                            env, files::join(dir, name + std::to_string(r) + ".log")));
    }
    return std::make_pair(procs, port);
  };
  const auto none = [](int) { return std::map<std::string, std::string>{}; };
  SECTION("MASTER_ADDR is this host's name: the ranks here are counted, and share its cores") {
    // It read as one rank per host: each rank took every core.
    auto [procs, port] = ranks("host", 2, host, none, 4);
    for (const auto& p : procs) {
      const int rc = wait_for(p, 120);
      INFO(slurp(p.log));
      CHECK(rc == 0);
    }
    CHECK_THAT(slurp(procs[0].log), Catch::Contains("distributed: 2 ranks share this host (" + std::string(host) + ")") &&
                                        Catch::Contains(" ranks on this host"));
  }
  SECTION("WORLD_SIZE differs from rank 0's: both ranks say so at once") {
    auto [procs, port] = ranks("world", 2, "127.0.0.1", [](int r) {
      return std::map<std::string, std::string>{{"WORLD_SIZE", r == 0 ? "2" : "3"}};
    }, 4);
    for (const auto& p : procs) {
      const int rc = wait_for(p, 60);
      INFO(slurp(p.log));
      CHECK(rc == 1);
      CHECK_THAT(slurp(p.log), Catch::Contains("rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"));
    }
  }
  SECTION("a second job's rank on the same MASTER_PORT stops at once; the first job goes on") {
    // It joined the first job's store and waited in Gloo's connect, silent, past every timeout.
    auto [procs, port] = ranks("first", 2, "127.0.0.1", none, 100000);
    wait_for_text(files::join(dir, "first/metrics.jsonl"), "\"step\":");
    auto intruder = spawn({kTrain, "fit", config, "--run-dir", files::join(dir, "second")},
                          {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                           {"MASTER_PORT", std::to_string(port)}},
                          files::join(dir, "second.log"));
    const int rc = wait_for(intruder, 60);
    INFO(slurp(intruder.log));
    CHECK(rc == 1);
    CHECK_THAT(slurp(intruder.log), Catch::Contains("another process joined the rendezvous at 127.0.0.1:" +
                                                    std::to_string(port) + " as rank 1 already"));
    for (const auto& p : procs) CHECK(running(p.pid));
    for (const auto& p : procs) kill_and_reap(p);
  }
  files::remove_all(dir);
}

TEST_CASE("a run directory in use by another run: every rank says so, not a connection reset",
          "[dist][process][cli]") {
  const std::string dir = files::make_temp_directory("train_ddp_dir_in_use_");
  const std::string config = files::join(dir, "run.yaml");
  std::ofstream(config) << "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 64,"
                           " synthetic_val_samples: 16, workers: 0}\n"
                           "trainer: {global_batch: 16, max_steps: 2, device: cpu, threads: 1}\n"
                           "logging: {tensorboard: false}\n";
  const std::string run_dir = files::join(dir, "run");
  files::make_directories(run_dir);
  // Another run's rank 0 holds the lock.
  const int fd = ::open(files::join(run_dir, ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
  auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", run_dir}, {}, files::join(dir, "launch.log"));
  const int rc = wait_for(p, 120);
  ::close(fd);
  const std::string out = slurp(p.log);
  INFO(out);
  CHECK(rc == 2);
  // Rank 1 learns why from rank 0; it used to fail its first collective with "Connection reset by peer".
  CHECK_THAT(out, Catch::Contains("[rank 1] rank 0 stopped first: run directory " + run_dir +
                                  " is in use by another run"));
  files::remove_all(dir);
}

TEST_CASE("ranks that resume from different steps stop with the reason", "[dist][process][resume]") {
  // Each rank finds its own latest checkpoint: here rank 0's run directory has one and rank 1's
  // is empty, as with run directories that are not shared between hosts.
  const std::string dir = files::make_temp_directory("train_ddp_resume_mismatch_");
  const std::string config = files::join(dir, "run.yaml");
  std::ofstream(config) << "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 256,"
                           " synthetic_val_samples: 32, workers: 0}\n"
                           "optim: {name: sgd, lr: 0.05}\n"
                           "trainer: {global_batch: 16, max_steps: 12, device: cpu, threads: 1}\n"
                           "checkpoint: {every_steps: 3}\n"
                           "distributed: {timeout_s: 30}\n"
                           "logging: {tensorboard: false}\n";
  const std::string a = files::join(dir, "a"), b = files::join(dir, "b");
  auto first = spawn({kTrain, "fit", config, "--run-dir", a, "--set", "trainer.max_steps=6"}, {},
                     files::join(dir, "first.log"));
  REQUIRE(wait_for(first, 120) == 0);
  auto ranks = spawn_fit_ranks(dir, 2, [&](int r) -> std::vector<std::string> {
    return {config, "--run-dir", r == 0 ? a : b, "--resume", "auto"};
  });
  for (const auto& p : ranks) {
    const int rc = wait_for(p, 60);
    const std::string out = slurp(p.log);
    INFO(out);
    CHECK(rc == 1);
    CHECK_THAT(out, Catch::Contains("the ranks start at different steps (0 to 6)") &&
                        Catch::Contains("shared run directory"));
  }
  for (const auto& p : ranks) {
    if (running(p.pid)) kill_and_reap(p);
  }
  files::remove_all(dir);
}

TEST_CASE("a 1-rank checkpoint resumed by train launch --nproc 2: a warning and the same place in the data",
          "[dist][process][resume][cli]") {
  const std::string dir = files::make_temp_directory("train_ddp_resume_ranks_");
  const std::string config = files::join(dir, "run.yaml");
  std::ofstream(config) << "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 256,"
                           " synthetic_val_samples: 32, workers: 0}\n"
                           "optim: {name: sgd, lr: 0.05, momentum: 0.9}\n"
                           "trainer: {global_batch: 16, max_steps: 4, device: cpu, threads: 1}\n"
                           "checkpoint: {every_steps: 1, keep_last: 10}\n"
                           "distributed: {timeout_s: 60}\n"
                           "logging: {tensorboard: false}\n";
  auto run = [&](const std::vector<std::string>& args, const std::string& name) {
    auto p = spawn(args, {}, files::join(dir, name + ".log"));
    const int rc = wait_for(p, 300);
    if (rc == -1) kill_and_reap(p);
    return std::make_pair(rc, slurp(p.log));
  };
  const std::string checkpoints = files::join(dir, "resumed/checkpoints");

  SECTION("more ranks than wrote it: a warning naming both counts and the position, then the 1-rank result") {
    const auto [rc_whole, out_whole] = run({kTrain, "fit", config, "--run-dir", files::join(dir, "whole")}, "whole");
    INFO(out_whole);
    REQUIRE(rc_whole == 0);
    // The 1-rank run's step-2 checkpoint (a shorter first run would have had another LR schedule).
    files::make_directories(checkpoints);
    for (const std::string suffix : {"", ".crc32c"}) {
      files::copy_file(checkpoint_path(files::join(dir, "whole/checkpoints"), 2) + suffix,
                       checkpoint_path(checkpoints, 2) + suffix);
    }
    const auto [rc, out] = run({kTrain, "launch", "--nproc", "2", config, "--run-dir", files::join(dir, "resumed"),
                                "--resume", "auto"},
                               "launch");
    INFO(out);
    REQUIRE(rc == 0);
    // 2 steps of 16 samples: sample 32 of epoch 0, 16 per rank.
    CHECK_THAT(out, Catch::Contains(checkpoint_path(checkpoints, 2) +
                                    " was written by a run on 1 rank(s); continuing on 2 at the same place in the data"
                                    " (sample 32 of epoch 0), but the result will not be bit for bit the one of an"
                                    " uninterrupted run"));
    CHECK_THAT(out, !Catch::Contains("other settings"));  // the same settings: only the rank count changed
    CHECK_THAT(out, Catch::Contains("parameters identical on all 2 ranks"));
    CHECK_THAT(out, Catch::Contains("train launch, store 127.0.0.1:") && Catch::Contains("(served by the launcher)"));
    // Steps 3 and 4 took the samples the 1-rank run took there: its weights, up to summation order.
    const Config c = load_config(config);
    auto weights = [&](const std::string& path) {
      RunParts parts = prepare_run(c);
      load_checkpoint(path, *parts.model, nullptr);
      std::vector<torch::Tensor> out;
      for (const auto& t : parts.model->parameters()) out.push_back(t.detach().clone());
      return out;
    };
    const auto whole = weights(checkpoint_path(files::join(dir, "whole/checkpoints"), 4));
    const auto resumed = weights(checkpoint_path(checkpoints, 4));
    const auto started_at_0 = weights(checkpoint_path(files::join(dir, "whole/checkpoints"), 2));
    INFO("max |1 rank - resumed on 2| = " << max_abs_diff(whole, resumed));
    CHECK(max_abs_diff(whole, resumed) < 1e-5);
    CHECK(max_abs_diff(whole, started_at_0) > 1e-3);  // the comparison can tell steps apart
  }
  SECTION("a position that does not divide among the ranks: exit 2 naming it, the checkpoint kept") {
    const auto [rc_first, out_first] = run({kTrain, "fit", config, "--run-dir", files::join(dir, "resumed"), "--set",
                                            "trainer.max_steps=1", "--set", "trainer.global_batch=3"},
                                           "first");
    INFO(out_first);
    REQUIRE(rc_first == 0);
    const auto before = files::list_directory(checkpoints);
    // 3 samples of the epoch read: 1.5 per rank on 2 ranks.
    const auto [rc, out] = run({kTrain, "launch", "--nproc", "2", config, "--run-dir", files::join(dir, "resumed"),
                                "--resume", "auto", "--set", "trainer.global_batch=4"},
                               "launch");
    INFO(out);
    CHECK(rc == 2);
    CHECK_THAT(out, Catch::Contains(checkpoint_path(checkpoints, 1) +
                                    ": its data position (3 samples of the epoch over 1 ranks) does not divide among"
                                    " 2 ranks"));
    CHECK(files::list_directory(checkpoints) == before);
    CHECK(files::exists(checkpoint_path(checkpoints, 1)));
  }
  files::remove_all(dir);
}

TEST_CASE("a frozen rank 0 (its store too): the other rank still exits non-zero with its message",
          "[dist][process][cli][timing]") {
  // SIGSTOP freezes rank 0 and the rendezvous store it serves: rank 1's collective times out, and
  // its report of the failure through that store must not wait for an answer forever.
  const std::string dir = files::make_temp_directory("train_ddp_frozen_");
  const std::string config = files::join(dir, "run.yaml");
  std::ofstream(config) << "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 256,"
                           " synthetic_val_samples: 32, workers: 0}\n"
                           "optim: {name: sgd, lr: 0.05}\n"
                           "trainer: {global_batch: 16, max_steps: 1000000, device: cpu, threads: 1}\n"
                           "checkpoint: {every_steps: 50}\n"
                           "distributed: {timeout_s: 5, checkpoint_timeout_s: 5}\n"
                           "logging: {every_steps: 50, tensorboard: false}\n";
  const std::string run_dir = files::join(dir, "run");
  // Started as a scheduler starts them (no `train launch`, whose launcher serves the store): rank 0
  // serves the store.
  auto ranks = spawn_fit_ranks(dir, 2, [&](int) -> std::vector<std::string> { return {config, "--run-dir", run_dir}; });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!files::exists(files::join(run_dir, "checkpoints/step_00000050.pt")) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(ranks[0].pid, SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = wait_for(ranks[1], 90);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  kill_and_reap(ranks[0]);
  if (rc == -1) kill_and_reap(ranks[1]);
  const std::string out = slurp(ranks[1].log);
  INFO(out);
  CHECK(rc == 1);
  CHECK(waited < 45);  // 5 s timeout, at most 5 s posting and 4 s polling the frozen store
  CHECK_THAT(out, Catch::Contains("distributed: rank 1 of 2 (gloo)"));
  files::remove_all(dir);
}

TEST_CASE("a stop signal before the ranks can handle it: the launch exits 128 + N, not as a failure",
          "[dist][process][cli][signals]") {
  const std::string dir = files::make_temp_directory("train_launch_early_signal_");
  const std::string config = files::join(dir, "run.yaml");
  std::ofstream(config) << "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 256}\n"
                           "trainer: {global_batch: 16, max_steps: 1000, device: cpu, threads: 1}\n"
                           "logging: {tensorboard: false}\n";
  auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", files::join(dir, "run")}, {},
                 files::join(dir, "out.log"));
  // As soon as both ranks exist: they are still loading, long before their stop handler.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (train_children(p.pid).size() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(train_children(p.pid).size() == 2);
  ::kill(p.pid, SIGTERM);
  const int rc = wait_for(p, 120);
  const std::string out = slurp(p.log);
  INFO(out);
  // 128 + SIGTERM; 3 only if both ranks had already installed their handlers and checkpointed.
  CHECK((rc == 128 + SIGTERM || rc == 3));
  CHECK_THAT(out, !Catch::Contains("stopping the other ranks"));
  files::remove_all(dir);
}

TEST_CASE("a stop signal that ends one rank: the others' failed collectives do not turn the launch into a failure",
          "[dist][process][signals]") {
  // Rank 0 has no stop handler yet and ends by the forwarded SIGTERM; rank 1 had one and exits 1,
  // as a rank does whose collective fails because its peer is gone.
  LaunchOptions options;
  options.nproc = 2;
  options.grace_seconds = 10;
  std::thread signal_later([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::kill(::getpid(), SIGTERM);  // to launch_local's handler, which forwards it
  });
  const int rc = launch_local({"/bin/sh", "-c",
                               "if [ \"$RANK\" = 0 ]; then exec sleep 30; fi; "
                               "sleep 30 & s=$!; trap 'kill $s; exit 1' TERM; wait"},
                              options);
  signal_later.join();
  CHECK(rc == 128 + SIGTERM);
}

TEST_CASE("out of memory on one rank: every rank halves the micro-batch and redoes the step", "[dist][process][oom]") {
  const std::string dir = files::make_temp_directory("train_ddp_oom_");
  // Per-rank batch 8; one bucket per parameter, so that some are in flight when backward fails.
  const std::string buckets = "distributed: {timeout_s: 60, bucket_mb: 0.000001, first_bucket_mb: 0.000001}\n";
  const auto [ref0, ref1] = run_two_ranks(files::make_temp_directory(dir + "/ref_"),
                                          write_config(dir, "halves", "tuning: {micro_batch: 4}\n" + buckets));
  for (const std::string where : {"forward", "backward"}) {
    DYNAMIC_SECTION("in the " << where) {
      const std::string run_dir = files::make_temp_directory(dir + "/" + where + "_");
      auto procs = start_ranks(run_dir, write_config(run_dir, "oom", "tuning: {micro_batch: 8}\n" + buckets), 2,
                               {{"TRAIN_TEST_OOM_RANK", "1"}, {"TRAIN_TEST_OOM_ABOVE", "4"}, {"TRAIN_TEST_OOM_IN", where}});
      for (const auto& p : procs) {
        const int rc = wait_for(p, 300);
        INFO(slurp(p.log));
        REQUIRE(rc == 0);
      }
      CHECK_THAT(slurp(procs[1].log), Catch::Contains("out of memory in step 1 at micro-batch 8: test: out of memory"));
      CHECK_THAT(slurp(procs[0].log), Catch::Contains("out of memory in step 1 at micro-batch 8 on another rank"));
      CHECK_THAT(slurp(procs[0].log), Catch::Contains("micro-batch 4 x 2 accumulation steps (global batch 16 unchanged)"));
      const auto r0 = load_params(files::join(run_dir, "params.rank0.pt"));
      const auto r1 = load_params(files::join(run_dir, "params.rank1.pt"));
      CHECK(bitwise_equal(r0, r1));
      // The same samples in the same micro-batches as a run planned at 4 from the start.
      CHECK(bitwise_equal(r0, ref0));
    }
  }
  files::remove_all(dir);
}

TEST_CASE("train launch runs ranks and stops them all when one fails", "[dist][process][cli]") {
  const std::string dir = files::make_temp_directory("train_launch_");
  const std::string config = files::join(dir, "launch.yaml");
  std::ofstream(config) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 256,"
                           " synthetic_val_samples: 40, workers: 1}\n"
                           "optim: {name: sgd, lr: 0.05}\n"
                           "trainer: {global_batch: 16, max_steps: 12, device: cpu}\n"
                           "checkpoint: {every_steps: 6}\n"
                           "logging: {every_steps: 4}\n";
  SECTION("two ranks train to the end") {
    const std::string run_dir = files::join(dir, "run");
    auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", run_dir}, {}, files::join(dir, "out.log"));
    const int rc = wait_for(p, 300);
    const std::string out = slurp(p.log);
    INFO(out);
    REQUIRE(rc == 0);
    CHECK_THAT(out, Catch::Contains("parameters identical on all 2 ranks"));
    CHECK_THAT(out, Catch::Contains("agreed across 2 ranks"));
    CHECK_THAT(out, Catch::Contains("2 cores available / 2 ranks on this host") ||
                        Catch::Contains("1 cores available / 2 ranks on this host") ||
                        Catch::Contains("cores available / 2 ranks"));
    CHECK(files::exists(files::join(run_dir, "checkpoints/step_00000012.pt")));
    // Metrics are written once, by rank 0, with the global batch's mean loss.
    const std::string metrics = slurp(files::join(run_dir, "metrics.jsonl"));
    size_t train_rows = 0;
    for (size_t at = metrics.find("\"split\":\"train\""); at != std::string::npos;
         at = metrics.find("\"split\":\"train\"", at + 1))
      ++train_rows;
    CHECK(train_rows == 3);
  }
  SECTION("a rank that cannot start stops the launch with its exit code") {
    auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--set", "data.kind=idx", "--set",
                    "data.root=/nonexistent", "--run-dir", files::join(dir, "bad")},
                   {}, files::join(dir, "bad.log"));
    const int rc = wait_for(p, 120);
    INFO(slurp(p.log));
    CHECK(rc == 1);  // the data is missing (kExitData)
  }
  SECTION("a corrupt file in rank 1's shard: rank 0 names it, exits 1 and leaves no run directory") {
    // ImageFolder without shuffling: rank r reads samples r, r + 2, ..., so only rank 1 meets the
    // corrupt image at index 1, in its first batch. Rank 0 sees only its allreduce fail.
    const std::string root = files::join(dir, "images");
    for (const char* split : {"train/a", "train/b", "val/a", "val/b"}) {
      files::make_directories(files::join(root, split));
      for (int i = 0; i < 8; ++i) write_png(files::join(root, std::string(split) + "/" + std::to_string(i) + ".png"), 16, i);
    }
    const std::string corrupt = files::join(root, "train/a/1.png");
    std::ofstream(corrupt, std::ios::binary | std::ios::trunc) << "this is not an image";
    const std::string run_dir = files::join(dir, "bad_shard");
    auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--set", "data.kind=image_folder", "--set",
                    "data.root=" + root, "--set", "data.image_size=12", "--set", "data.shuffle=false",
                    "--set", "data.random_flip=false", "--set", "model.in_channels=3", "--set", "model.num_classes=2",
                    "--run-dir", run_dir},
                   {}, files::join(dir, "bad_shard.log"));
    const int rc = wait_for(p, 120);
    const std::string out = slurp(p.log);
    INFO(out);
    CHECK(rc == 1);  // kExitData, rank 1's error
    CHECK_THAT(out, Catch::Contains("rank 1 stopped first") && Catch::Contains(corrupt));
    CHECK_FALSE(files::exists(run_dir));
  }
  SECTION("a rank killed mid-run ends the launch, non-zero, without a hang") {
    const std::string run_dir = files::join(dir, "killed");
    auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--set", "trainer.max_steps=100000", "--run-dir",
                    run_dir},
                   {}, files::join(dir, "killed.log"));
    // Find rank 1 (a child of the launcher) once training is under way, and kill it.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    // Any checkpoint will do: keep_last 2 prunes step 6's at step 18, a window a loaded machine can miss.
    while (latest_checkpoint(files::join(run_dir, "checkpoints")).empty() && running(p.pid) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const std::vector<pid_t> children = train_children(p.pid);
    {
      INFO(slurp(p.log));
      REQUIRE_FALSE(latest_checkpoint(files::join(run_dir, "checkpoints")).empty());
      REQUIRE(children.size() == 2);
    }
    ::kill(children[1], SIGKILL);
    const int rc = wait_for(p, 60);
    const std::string out = slurp(p.log);
    INFO(out);
    CHECK(rc == 1);
    CHECK_THAT(out, Catch::Contains("rank 1") && Catch::Contains("signal 9"));
  }
  files::remove_all(dir);
}

TEST_CASE("a stop signal while a rank reports a failure does not cut the report short", "[dist][process][fault]") {
  // train launch sends SIGTERM to the other ranks the moment one fails, which is just when they
  // find out (their collective breaks) and start reporting: undoing the run directory, waiting for
  // the failed rank's word through the store. Here rank 1 is killed, so rank 0 waits the full 3 s
  // for a word that never comes, and SIGTERM lands in that wait. It used to take the default
  // action there (exit 143), with no report and the run directory left as it was.
  const std::string dir = files::make_temp_directory("train_ddp_stop_in_report_");
  const std::string config = files::join(dir, "run.yaml");
  std::ofstream(config) << "model: {name: mlp, in_channels: 1, num_classes: 10}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 28, synthetic_train_samples: 256,"
                           " synthetic_val_samples: 32, workers: 0}\n"
                           "optim: {name: sgd, lr: 0.05}\n"
                           "trainer: {global_batch: 16, max_steps: 1000000, device: cpu, threads: 1}\n"
                           "checkpoint: {every_steps: 20}\n"
                           "distributed: {timeout_s: 30}\n"
                           "logging: {every_steps: 20, tensorboard: false}\n";
  const std::string run_dir = files::join(dir, "run");
  auto ranks = spawn_fit_ranks(dir, 2, [&](int) -> std::vector<std::string> { return {config, "--run-dir", run_dir}; });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!files::exists(files::join(run_dir, "checkpoints/step_00000020.pt")) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(files::exists(files::join(run_dir, "checkpoints/step_00000020.pt")));
  kill_and_reap(ranks[1]);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // rank 0 is in its 3 s wait by now
  ::kill(ranks[0].pid, SIGTERM);
  const int rc = wait_for(ranks[0], 60);
  if (rc == -1) kill_and_reap(ranks[0]);
  const std::string out = slurp(ranks[0].log);
  INFO(out);
  CHECK(rc == 1);  // its own failure (kExitRuntime), not 128 + SIGTERM
  CHECK_THAT(out, Catch::Contains("distributed: rank 0 of 2 (gloo)") && Catch::Contains("a peer has died"));
  files::remove_all(dir);
}

TEST_CASE("SIGTERM to train launch: every rank stops after the same step, and --resume auto is exact",
          "[dist][process][resume]") {
  const std::string dir = files::make_temp_directory("train_launch_stop_");
  const std::string config = files::join(dir, "stop.yaml");
  std::ofstream(config) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 256,"
                           " synthetic_val_samples: 40, workers: 1, random_flip: true}\n"
                           "optim: {name: sgd, lr: 0.05, momentum: 0.9}\n"
                           "trainer: {global_batch: 16, max_steps: 120, device: cpu, eval_every_steps: 1000}\n"
                           "tuning: {micro_batch: 4}\n"
                           "logging: {every_steps: 2}\n";
  const std::string whole = files::join(dir, "whole"), stopped = files::join(dir, "stopped");
  auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", whole}, {}, files::join(dir, "whole.log"));
  REQUIRE(wait_for(p, 600) == 0);

  p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", stopped}, {}, files::join(dir, "stopped.log"));
  wait_for_text(files::join(stopped, "metrics.jsonl"), "\"step\":4,");
  ::kill(p.pid, SIGTERM);
  const int rc = wait_for(p, 120);
  const std::string out = slurp(p.log);
  INFO(out);
  REQUIRE(rc == 3);  // stopped after a checkpoint (kExitStopped)
  CHECK_THAT(out, Catch::Contains("stop requested"));
  REQUIRE_FALSE(files::exists(checkpoint_path(files::join(stopped, "checkpoints"), 120)));
  const std::string mid = latest_checkpoint(files::join(stopped, "checkpoints"));
  REQUIRE_FALSE(mid.empty());

  p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", stopped, "--resume", "auto"}, {},
            files::join(dir, "resumed.log"));
  REQUIRE(wait_for(p, 600) == 0);
  const Config c = load_config(config);
  auto weights = [&](const std::string& path) {
    RunParts run = prepare_run(c);
    load_checkpoint(path, *run.model, nullptr);
    std::vector<torch::Tensor> out;
    for (const auto& t : run.model->parameters()) out.push_back(t.detach().clone());
    for (const auto& t : run.model->buffers()) out.push_back(t.detach().clone());
    return out;
  };
  const auto a = weights(checkpoint_path(files::join(whole, "checkpoints"), 120));
  const auto b = weights(checkpoint_path(files::join(stopped, "checkpoints"), 120));
  CHECK(bitwise_equal(a, b));
  files::remove_all(dir);
}

TEST_CASE("Ctrl-C to train launch's process group: each rank gets it once, checkpoints, and the launch exits 3",
          "[dist][process][resume][signals]") {
  const std::string dir = files::make_temp_directory("train_launch_ctrl_c_");
  const std::string config = files::join(dir, "stop.yaml");
  std::ofstream(config) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 512,"
                           " synthetic_val_samples: 40, workers: 1}\n"
                           "optim: {name: sgd, lr: 0.05, momentum: 0.9}\n"
                           "trainer: {global_batch: 16, max_steps: 40, device: cpu, eval_every_steps: 1000}\n"
                           "checkpoint: {every_steps: 1000}\n"
                           "logging: {every_steps: 1}\n";
  const std::string run_dir = files::join(dir, "run"), ckpts = files::join(run_dir, "checkpoints");
  // The launcher as a shell starts a job: leading a process group of its own, which the terminal
  // signals as a whole on Ctrl-C.
  auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", run_dir}, {}, files::join(dir, "ctrl_c.log"),
                 /*new_group=*/true);
  wait_for_text(files::join(run_dir, "metrics.jsonl"), "\"step\":3,");
  const std::vector<pid_t> ranks = children_of(p.pid);
  REQUIRE(ranks.size() == 2);
  for (const pid_t r : ranks) CHECK(::getpgid(r) == r);  // each rank leads its own group, not the launcher's
  ::kill(-p.pid, SIGINT);
  const int rc = wait_for(p, 120);
  const std::string out = slurp(p.log);
  INFO(out);
  REQUIRE(rc == 3);
  CHECK_THAT(out, Catch::Contains("Interrupt; forwarding it to every rank"));
  CHECK_THAT(out, Catch::Contains("stop requested: stopped after step"));
  // Each rank got the signal once (from the launcher), and exit 3 is no failure to the launcher.
  CHECK_THAT(out, !Catch::Contains("already stopping") && !Catch::Contains("without a checkpoint"));
  CHECK_THAT(out, !Catch::Contains("stopping the other ranks"));
  CHECK_THAT(out, Catch::Contains("rank 0 (pid") && Catch::Contains("rank 1 (pid") &&
                      Catch::Contains("stopped after a checkpoint (exit 3)") &&
                      Catch::Contains("launch: the ranks stopped after a checkpoint; resume with --resume auto"));
  const std::string mid = latest_checkpoint(ckpts);
  REQUIRE_FALSE(mid.empty());
  REQUIRE(mid != checkpoint_path(ckpts, 40));

  p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", run_dir, "--resume", "auto"}, {},
            files::join(dir, "resumed.log"));
  const int resumed = wait_for(p, 300);
  INFO(slurp(p.log));
  REQUIRE(resumed == 0);
  CHECK_THAT(slurp(files::join(run_dir, "train.log")), Catch::Contains("resumed from " + mid));
  CHECK(files::exists(checkpoint_path(ckpts, 40)));
  files::remove_all(dir);
}

TEST_CASE("SIGHUP (a closed terminal or SSH session) stops train launch's ranks with a checkpoint, and under nohup it "
          "changes nothing", "[dist][process][signals]") {
  const std::string dir = files::make_temp_directory("train_launch_hangup_");
  const std::string config = files::join(dir, "stop.yaml");
  std::ofstream(config) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 512,"
                           " synthetic_val_samples: 40, workers: 1}\n"
                           "optim: {name: sgd, lr: 0.05, momentum: 0.9}\n"
                           "trainer: {global_batch: 16, max_steps: 30, device: cpu, eval_every_steps: 1000}\n"
                           "checkpoint: {every_steps: 1000}\n"
                           "logging: {every_steps: 1}\n";
  const std::string run_dir = files::join(dir, "run"), ckpts = files::join(run_dir, "checkpoints");
  auto started = [&](const Proc& p) {
    wait_for_text(files::join(run_dir, "metrics.jsonl"), "\"step\":3,");
    const std::vector<pid_t> ranks = children_of(p.pid);
    REQUIRE(ranks.size() == 2);
    return ranks;
  };
  SECTION("hangup: forwarded once, every rank checkpoints, the launch exits 3") {
    // It used to end the launcher by SIGHUP's default action; the ranks then got SIGTERM through
    // PR_SET_PDEATHSIG, and a rank run without the launcher died with no checkpoint at all.
    auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", run_dir}, {}, files::join(dir, "hup.log"));
    started(p);
    ::kill(p.pid, SIGHUP);
    const int rc = wait_for(p, 120);
    const std::string out = slurp(p.log);
    INFO(out);
    REQUIRE(rc == 3);
    CHECK_THAT(out, Catch::Contains("Hangup; forwarding it to every rank"));
    CHECK_THAT(out, Catch::Contains("stop requested: stopped after step"));
    CHECK_THAT(out, Catch::Contains("launch: the ranks stopped after a checkpoint; resume with --resume auto"));
    const std::string mid = latest_checkpoint(ckpts);
    REQUIRE_FALSE(mid.empty());
    CHECK(mid != checkpoint_path(ckpts, 30));
  }
  SECTION("nohup: the launcher and the ranks keep ignoring it and finish the run") {
    auto p = spawn({"nohup", kTrain, "launch", "--nproc", "2", config, "--run-dir", run_dir}, {},
                   files::join(dir, "nohup.log"));
    const std::vector<pid_t> ranks = started(p);  // nohup execs the launcher: same pid
    ::kill(p.pid, SIGHUP);
    for (const pid_t r : ranks) ::kill(r, SIGHUP);
    const int rc = wait_for(p, 300);
    const std::string out = slurp(p.log);
    INFO(out);
    REQUIRE(rc == 0);
    CHECK_THAT(out, !Catch::Contains("forwarding") && !Catch::Contains("stop requested"));
    CHECK(files::exists(checkpoint_path(ckpts, 30)));
  }
  files::remove_all(dir);
}

TEST_CASE("a train launch killed with SIGKILL takes its ranks with it: they get SIGTERM and checkpoint",
          "[dist][process][signals]") {
  const std::string dir = files::make_temp_directory("train_launch_orphans_");
  const std::string config = files::join(dir, "l.yaml");
  std::ofstream(config) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 512,"
                           " synthetic_val_samples: 40, workers: 1}\n"
                           "trainer: {global_batch: 16, max_steps: 100000, device: cpu, eval_every_steps: 100000}\n"
                           "checkpoint: {every_steps: 100000}\n"
                           "logging: {every_steps: 1}\n";
  const std::string run_dir = files::join(dir, "run");
  auto p = spawn({kTrain, "launch", "--nproc", "2", config, "--run-dir", run_dir}, {}, files::join(dir, "out.log"),
                 /*new_group=*/true);
  wait_for_text(files::join(run_dir, "metrics.jsonl"), "\"step\":2,");
  const std::vector<pid_t> ranks = children_of(p.pid);
  REQUIRE(ranks.size() == 2);
  kill_and_reap(p);
  const auto gone_by = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool any_running = true;
  while (any_running && std::chrono::steady_clock::now() < gone_by) {
    any_running = false;
    for (const pid_t r : ranks) any_running = any_running || running(r);
    if (any_running) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (const pid_t r : ranks) {
    if (running(r)) ::kill(r, SIGKILL);  // leave nothing behind when this fails
  }
  INFO(slurp(p.log));
  CHECK_FALSE(any_running);
  CHECK_THAT(slurp(files::join(run_dir, "train.log")), Catch::Contains("stop requested: stopped after step"));
  CHECK_FALSE(latest_checkpoint(files::join(run_dir, "checkpoints")).empty());
  files::remove_all(dir);
}

TEST_CASE("runs launched by the real torchrun and by mpirun", "[dist][process][launchers]") {
  const std::string dir = files::make_temp_directory("train_launchers_");
  const std::string config = files::join(dir, "l.yaml");
  std::ofstream(config) << "model: {name: resnet18, in_channels: 1, num_classes: 10, width: 0.125, small_input: true}\n"
                           "data: {kind: synthetic, channels: 1, image_size: 12, synthetic_train_samples: 128,"
                           " synthetic_val_samples: 20, workers: 1}\n"
                           "trainer: {global_batch: 16, max_steps: 6, device: cpu}\n";
  SECTION("torchrun --no-python") {
    const std::string torchrun = files::join(files::parent(std::string(TRAIN_PYTHON)), "torchrun");
    REQUIRE(files::exists(torchrun));
    auto p = spawn({torchrun, "--no-python", "--nproc-per-node", "2", "--master-port", std::to_string(free_port_pair()),
                    kTrain, "fit", config, "--run-dir", files::join(dir, "torchrun")},
                   {}, files::join(dir, "torchrun.log"));
    const int rc = wait_for(p, 300);
    const std::string out = slurp(p.log);
    INFO(out);
    CHECK(rc == 0);
    CHECK_THAT(out, Catch::Contains("torchrun") && Catch::Contains("parameters identical on all 2 ranks"));
  }
  SECTION("torchrun --max-restarts: a killed rank is restarted with the others, and the run resumes exactly") {
    const std::string torchrun = files::join(files::parent(std::string(TRAIN_PYTHON)), "torchrun");
    REQUIRE(files::exists(torchrun));
    const std::string run_dir = files::join(dir, "elastic");
    // Steps long enough (about 0.1 s) that the run is still going when the test sees a checkpoint.
    // keep_last keeps step 8's checkpoint on disk: with the default 2 it went at step 16, and a test
    // starved of the CPU on a loaded machine could miss that window and wait in vain.
    const std::vector<std::string> overrides = {"--set", "trainer.max_steps=60", "--set", "checkpoint.every_steps=4",
                                                "--set", "checkpoint.keep_last=100", "--set", "logging.every_steps=4",
                                                "--set", "data.image_size=32", "--set", "model.width=0.25"};
    std::vector<std::string> args = {torchrun, "--no-python", "--nproc-per-node", "2", "--max-restarts", "1",
                                     "--master-port", std::to_string(free_port_pair()), kTrain, "fit", config,
                                     "--run-dir", run_dir, "--resume", "auto"};
    args.insert(args.end(), overrides.begin(), overrides.end());
    auto p = spawn(args, {}, files::join(dir, "elastic.log"));
    // Once a checkpoint exists, kill one of the ranks (torchrun's `train` children) with SIGKILL.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
    while (!files::exists(checkpoint_path(files::join(run_dir, "checkpoints"), 8)) && running(p.pid) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const std::vector<pid_t> children = train_children(p.pid);
    {
      INFO(slurp(p.log));  // why torchrun or its ranks never got to step 8, or ended before the kill
      REQUIRE(files::exists(checkpoint_path(files::join(run_dir, "checkpoints"), 8)));
      REQUIRE(children.size() == 2);
    }
    ::kill(children[1], SIGKILL);
    const int rc = wait_for(p, 300);
    const std::string out = slurp(p.log);
    INFO(out);
    REQUIRE(rc == 0);
    CHECK_THAT(out, Catch::Contains("resumed from") && Catch::Contains("parameters identical on all 2 ranks"));
    const std::string last = checkpoint_path(files::join(run_dir, "checkpoints"), 60);
    REQUIRE(files::exists(last));

    // The same run without the kill (train launch sets the same variables torchrun does).
    std::vector<std::string> whole_args = {kTrain, "launch", "--nproc", "2", config, "--run-dir",
                                           files::join(dir, "elastic_whole")};
    whole_args.insert(whole_args.end(), overrides.begin(), overrides.end());
    auto w = spawn(whole_args, {}, files::join(dir, "elastic_whole.log"));
    REQUIRE(wait_for(w, 300) == 0);
    Config c = load_config(config, {"trainer.max_steps=60", "data.image_size=32", "model.width=0.25"});
    auto weights = [&](const std::string& path) {
      RunParts run = prepare_run(c);
      load_checkpoint(path, *run.model, nullptr);
      std::vector<torch::Tensor> out;
      for (const auto& t : run.model->parameters()) out.push_back(t.detach().clone());
      for (const auto& t : run.model->buffers()) out.push_back(t.detach().clone());
      return out;
    };
    CHECK(bitwise_equal(weights(last), weights(checkpoint_path(files::join(dir, "elastic_whole/checkpoints"), 60))));
  }
  SECTION("mpirun") {
    auto p = spawn({"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x",
                    "MASTER_PORT=" + std::to_string(free_port()), kTrain, "fit", config, "--run-dir",
                    files::join(dir, "mpirun")},
                   {{"OMPI_MCA_plm_rsh_agent", ""}}, files::join(dir, "mpirun.log"));
    const int rc = wait_for(p, 300);
    const std::string out = slurp(p.log);
    INFO(out);
    CHECK(rc == 0);
    CHECK_THAT(out, Catch::Contains("mpirun") && Catch::Contains("parameters identical on all 2 ranks"));
  }
  files::remove_all(dir);
}

TEST_CASE("cuda: a one-rank NCCL group all-reduces and GradSync averages gradients on the GPU", "[dist][cuda]") {
  TRAIN_SKIP_WITHOUT_CUDA("no CUDA device visible: the NCCL path is checked by scripts/gpu-check on a GPU machine");
  dist::Env env;
  env.world_size = 1;
  env.master_port = free_port();
  env.launcher = "test";
  DistributedConfig dc;
  dc.backend = "nccl";
  dc.timeout_s = 60;
#if TORCH_VERSION_MAJOR >= 2
  // The group shuts NCCL down when it goes: no "destroy_process_group() was not called" warning.
  struct Warnings : c10::WarningHandler {
    std::vector<std::string> seen;
    void process(const c10::Warning& w) override { seen.push_back(w.msg()); }
  } warnings;
  c10::WarningUtils::WarningHandlerGuard capture(&warnings);
  {
    auto short_lived = dist::Group::create(env, dc, "cuda:0");
    auto t = torch::ones({2}, torch::TensorOptions().device(torch::kCUDA));
    short_lived->allreduce(t);
  }
  for (const auto& w : warnings.seen) CHECK_THAT(w, !Catch::Contains("destroy_process_group"));
  env.master_port = free_port();
#endif
  auto group = dist::Group::create(env, dc, "cuda:0");
  CHECK(group->backend() == "nccl");
  auto t = torch::full({4}, 3.0, torch::TensorOptions().device(torch::kCUDA));
  group->allreduce(t);
  CHECK(t.cpu().equal(torch::full({4}, 3.0)));
  CHECK(group->reduce_int(7, dist::ReduceOp::Min) == 7);

  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));
  net->to(torch::kCUDA);
  dist::GradSync sync(*net, group);
  sync.broadcast_parameters();
  const auto x = torch::randn({4, 8}, torch::TensorOptions().device(torch::kCUDA));
  sync.prepare(true);
  net->forward(x).sum().backward();
  std::vector<torch::Tensor> expected;
  for (const auto& p : net->parameters()) expected.push_back(p.grad().clone());
  sync.finish();
  size_t i = 0;
  for (const auto& p : net->parameters()) CHECK(torch::allclose(p.grad(), expected[i++]));
  CHECK(sync.count_diverged_ranks() == 0);
}
