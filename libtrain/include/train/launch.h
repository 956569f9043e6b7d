#pragma once
// `train launch`: runs one process per local rank with the variables torchrun would set
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and supervises them
// the way torchrun does: when one rank fails, the others are stopped, and the launcher exits with
// the failing rank's code. Each rank runs in a session and process group of its own, so that a
// signal to the launcher's group (Ctrl-C in a terminal) reaches the launcher only; SIGINT, SIGTERM,
// SIGUSR1 and SIGHUP (unless ignored from the start, as under nohup) sent to the launcher are forwarded, once, to every rank, which then checkpoint and
// stop after the same step (exit 3). A rank gets SIGTERM from the kernel when the launcher dies
// (Linux's PR_SET_PDEATHSIG), so none outlives it.
#include <string>
#include <vector>

namespace train {

struct LaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;         // 0 = a free port chosen on this host
  double grace_seconds = 30;   // after a rank fails: SIGTERM to the rest, SIGKILL after this long;
                               // after one stops (exit 3): SIGKILL to those still running after this long
  bool store_served = false;   // the caller serves the rendezvous store on master_port (dist::LaunchStore):
                               // the ranks join it as clients (TRAIN_LAUNCH_STORE=1)
};

// Runs `argv` (argv[0] is the program) once per rank and waits for all of them. Returns 0 when
// every rank exits 0; 3 when they stopped after a checkpoint (exit 3, the others 0 or 3, all
// within grace_seconds of the first); 128 + N when a stop signal N the launcher forwarded ended a
// rank that had not installed its handler yet (still starting up, so no checkpoint), whatever the
// other ranks exited with after it (a collective fails when a peer is gone); otherwise the first
// failing rank's exit code (1 for a rank killed by any other signal; 127 when the program could not
// be started, kExitLaunch). Throws UsageError for nproc < 1.
int launch_local(const std::vector<std::string>& argv, const LaunchOptions& options);

// A TCP port that was free on `host` a moment ago.
int free_port(const std::string& host = "127.0.0.1");

}  // namespace train
