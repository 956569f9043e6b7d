#include "train/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iterator>
#include <map>
#include <thread>

#include "train/errors.h"
#include "train/log.h"

namespace train {
namespace {

// The stop signals the launcher forwards to its ranks: the terminal's Ctrl-C, kill's default,
// Slurm's usual `--signal=USR1@N` warning before the time limit and the hangup of a closed terminal
// or SSH session (torchrun forwards that too). A SIGHUP ignored when the launcher starts (nohup)
// stays ignored, in the launcher and in the ranks, which inherit that across exec.
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGUSR1, SIGHUP};

bool ignored_from_start(int sig) {
  struct sigaction current {};
  return sig == SIGHUP && ::sigaction(sig, nullptr, &current) == 0 && current.sa_handler == SIG_IGN;
}

std::atomic<int> g_forward_signal{0};
extern "C" void remember_signal(int sig) { g_forward_signal.store(sig); }

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int exit_code = 0;
  int signal = 0;   // the signal that ended it, 0 when it exited
  std::string how;  // "exited with code 1", "killed by signal 9"
};

// The code the launcher reports for a finished child: its own exit code, or 1 for a signal.
void record_status(Child& c, int status) {
  c.running = false;
  if (WIFEXITED(status)) {
    c.exit_code = WEXITSTATUS(status);
    c.how = "exited with code " + std::to_string(c.exit_code);
  } else if (WIFSIGNALED(status)) {
    c.exit_code = kExitRuntime;
    c.signal = WTERMSIG(status);
    c.how = "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  }
}

void signal_running(std::vector<Child>& children, int sig) {
  for (auto& c : children) {
    if (c.running) ::kill(c.pid, sig);
  }
}

}  // namespace

int free_port(const std::string& host) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(std::string("launch: socket(): ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw Error("launch: could not find a free port on " + host + ": " + why);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

int launch_local(const std::vector<std::string>& argv, const LaunchOptions& options) {
  if (options.nproc < 1) throw UsageError("launch: --nproc must be at least 1, got " + std::to_string(options.nproc));
  if (argv.empty()) throw UsageError("launch: no program to run");
  if (options.master_port < 0 || options.master_port > 65535) {
    throw UsageError("launch: --master-port must be a port in 1-65535 (or 0 for a free one), got " +
                     std::to_string(options.master_port));
  }
  const int port = options.master_port > 0 ? options.master_port : free_port(options.master_addr);
  log::info(log::str("launch: ", options.nproc, " ranks on this host, rendezvous at ", options.master_addr, ":", port));

  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const std::string cannot_run = "launch: cannot run " + argv[0] + ": ";
  // Each rank's environment, made before fork: a child of a process with other threads (the
  // store's) may only call async-signal-safe functions before exec, which setenv is not.
  std::vector<std::vector<std::string>> rank_env(static_cast<size_t>(options.nproc));
  std::vector<std::vector<char*>> rank_envp(static_cast<size_t>(options.nproc));
  for (int rank = 0; rank < options.nproc; ++rank) {
    const std::map<std::string, std::string> set{
        {"RANK", std::to_string(rank)},
        {"LOCAL_RANK", std::to_string(rank)},
        {"WORLD_SIZE", std::to_string(options.nproc)},
        {"LOCAL_WORLD_SIZE", std::to_string(options.nproc)},
        {"MASTER_ADDR", options.master_addr},
        {"MASTER_PORT", std::to_string(port)},
        {"TRAIN_LAUNCHER", "train launch"},
        {"TRAIN_LAUNCH_STORE", options.store_served ? "1" : ""}};
    auto& vars = rank_env[static_cast<size_t>(rank)];
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('='));
      if (set.count(name) || name == "TORCHELASTIC_RUN_ID" || name == "TORCHELASTIC_USE_AGENT_STORE") continue;
      vars.push_back(entry);
    }
    for (const auto& [name, value] : set) {
      if (!value.empty()) vars.push_back(name + "=" + value);
    }
    for (auto& v : vars) rank_envp[static_cast<size_t>(rank)].push_back(v.data());
    rank_envp[static_cast<size_t>(rank)].push_back(nullptr);
  }

  g_forward_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = remember_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  struct sigaction old_actions[std::size(kForwardedSignals)] {};
  bool forwarding[std::size(kForwardedSignals)] {};
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
    forwarding[i] = !ignored_from_start(kForwardedSignals[i]) && sigaction(kForwardedSignals[i], &sa, &old_actions[i]) == 0;
  }

  // The stop signals are blocked across fork: a child that gets one (forwarded) before it has
  // reset the launcher's handler would run that handler and carry on; blocked, the signal waits
  // until the child has the default action back and unblocks it.
  sigset_t stop_signals, old_mask;
  sigemptyset(&stop_signals);
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
    if (forwarding[i]) sigaddset(&stop_signals, kForwardedSignals[i]);
  }
  sigprocmask(SIG_BLOCK, &stop_signals, &old_mask);

  const pid_t launcher = ::getpid();
  std::vector<Child> children(static_cast<size_t>(options.nproc));
  for (int rank = 0; rank < options.nproc; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      signal_running(children, SIGKILL);
      sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      throw Error(std::string("launch: fork(): ") + std::strerror(errno));
    }
    if (pid == 0) {
      // A session, and so a process group, of its own (as torchrun's start_new_session): a signal
      // to the launcher's group (Ctrl-C in a terminal) reaches the launcher only, which forwards it
      // once; without this each rank got it twice, directly and forwarded. Out of the terminal's
      // session, a rank's output is not subject to job control (stty tostop). A signal to the old
      // group before this line stays blocked until the default actions are back, below: the same
      // as the launcher forwarding it a moment later.
      ::setsid();
      // A rank would outlive a launcher killed with SIGKILL, and no longer gets the SIGHUP of a
      // closing terminal: have the kernel send SIGTERM, a graceful stop, when the launcher (the
      // thread that forked, which waits here for every rank) dies, and check that it did not die
      // before this line.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) ::_exit(kExitRuntime);
      for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
        if (forwarding[i]) ::signal(kForwardedSignals[i], SIG_DFL);
      }
      sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      ::execve(args[0], args.data(), rank_envp[static_cast<size_t>(rank)].data());
      const int error = errno;
      const char* why = std::strerror(error);  // glibc's table of messages: no allocation
      (void)!::write(STDERR_FILENO, cannot_run.data(), cannot_run.size());
      (void)!::write(STDERR_FILENO, why, std::strlen(why));
      (void)!::write(STDERR_FILENO, "\n", 1);
      ::_exit(kExitLaunch);
    }
    children[static_cast<size_t>(rank)] = Child{rank, pid, true, 0, 0, ""};
  }
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);  // a signal that came meanwhile is handled now

  // A rank that exits 3 (kExitStopped) stopped after a checkpoint, as asked by a stop signal
  // (forwarded from here, or sent to it directly: the ranks agree to stop after the same step).
  // That is no failure: the others are about to do the same, so they are waited for, not signalled
  // again, up to grace_seconds. Any other non-zero exit is a failure: the rest get SIGTERM, and
  // SIGKILL grace_seconds later.
  int failure = kExitOk;
  bool any_stopped = false;
  int signalled = 0;  // 128 + N: a rank ended by the stop signal N forwarded to it, with no checkpoint
  int forwarded = 0;  // the last stop signal forwarded to the ranks
  int failed_after_stop = 0;  // the first other non-zero exit after a forwarded stop signal
  using Clock = std::chrono::steady_clock;
  Clock::time_point kill_at = Clock::time_point::max();
  const auto grace = std::chrono::milliseconds(static_cast<int64_t>(options.grace_seconds * 1000));
  for (;;) {
    if (const int sig = g_forward_signal.exchange(0)) {
      log::warn(log::str("launch: ", strsignal(sig), "; forwarding it to every rank"));
      forwarded = sig;
      signal_running(children, sig);
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (auto& c : children) {
        if (c.pid != pid || !c.running) continue;
        record_status(c, status);
        if (c.exit_code == kExitOk || failure != kExitOk) continue;
        if (c.exit_code == kExitStopped) {
          any_stopped = true;
          log::info(log::str("launch: rank ", c.rank, " (pid ", c.pid, ") stopped after a checkpoint (exit 3)",
                             forwarded ? "" : " without a signal from the launcher"));
          if (kill_at == Clock::time_point::max()) kill_at = Clock::now() + grace;
          continue;
        }
        if (forwarded != 0 && c.signal == forwarded) {
          // The signal came before the rank installed its stop handler (it was still starting:
          // loading data, meeting the others, probing), so it ended as the signal's default says.
          // It was asked to stop, as were the others: no failure to stop them for.
          signalled = 128 + forwarded;
          log::warn(log::str("launch: rank ", c.rank, " (pid ", c.pid, ") ", c.how,
                             " before it had started training; no checkpoint"));
          if (kill_at == Clock::time_point::max()) kill_at = Clock::now() + grace;
          continue;
        }
        if (forwarded != 0) {
          // Asked to stop like the others: a rank whose peer the signal ended fails its next
          // collective. The stop, not this, decides the exit code, unless no rank ended by the
          // signal or stopped after a checkpoint.
          failed_after_stop = failed_after_stop != 0 ? failed_after_stop : c.exit_code;
          log::warn(log::str("launch: rank ", c.rank, " (pid ", c.pid, ") ", c.how, " after the ",
                             strsignal(forwarded), " forwarded to every rank"));
          if (kill_at == Clock::time_point::max()) kill_at = Clock::now() + grace;
          continue;
        }
        failure = c.exit_code;
        kill_at = Clock::now() + grace;
        log::error(log::str("launch: rank ", c.rank, " (pid ", c.pid, ") ", c.how, "; stopping the other ranks"));
        signal_running(children, SIGTERM);
      }
      continue;
    }
    if (pid < 0 && errno == ECHILD) break;
    if (Clock::now() >= kill_at) {
      for (const auto& c : children) {
        if (c.running) {
          log::error(log::str("launch: rank ", c.rank, " (pid ", c.pid, ") did not stop within ",
                              options.grace_seconds, " s; killing it"));
        }
      }
      signal_running(children, SIGKILL);
      kill_at = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
    if (forwarding[i]) sigaction(kForwardedSignals[i], &old_actions[i], nullptr);
  }
  const int result = failure != kExitOk ? failure
                     : signalled != 0 ? signalled
                     : failed_after_stop != 0 ? failed_after_stop
                     : any_stopped    ? static_cast<int>(kExitStopped)
                                      : kExitOk;
  if (result == kExitStopped) {
    log::warn("launch: the ranks stopped after a checkpoint; resume with --resume auto");
  }
  if (result == kExitOk) log::info(log::str("launch: all ", options.nproc, " ranks finished"));
  return result;
}

}  // namespace train
