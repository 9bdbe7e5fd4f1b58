// Starting workers: one process per device, each told its rank through the environment.
//
// A program is both its own launcher and its workers:
//   if (auto env = dp::dist::worker_env_from_environment()) return run_worker(*env);
//   return dp::dist::launch_workers(options, std::vector<std::string>(argv, argv + argc));
// The launcher re-runs /proc/self/exe with the same arguments and RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT set per worker.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dp/distributed/env.hpp"

namespace dp::dist {

// What a worker learns from its launcher.
struct WorkerEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source;  // "torchrun" (also launch_workers), "mpirun" or "slurm"
  // How many times the launcher restarted the job before this attempt (0 on the first):
  // DP_RESTART_COUNT, else torchrun's TORCHELASTIC_RESTART_COUNT. A program resumes from its
  // latest checkpoint when it is > 0.
  int restart_count = 0;
};

// Reads, in this order of precedence: torchrun-style RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; mpirun's OMPI_COMM_WORLD_RANK,
// _SIZE, _LOCAL_RANK, _LOCAL_SIZE; Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
// SLURM_NTASKS_PER_NODE/SLURM_NNODES, SLURM_NODEID. For mpirun and Slurm, MASTER_ADDR
// defaults to 127.0.0.1 on one node (required on several) and MASTER_PORT to 29500 (Slurm:
// 15000 + SLURM_JOB_ID % 20000). Without MASTER_PORT, the env:// rendezvous of a job of one
// rank takes any free port.
// restart_count from DP_RESTART_COUNT or TORCHELASTIC_RESTART_COUNT (0 when both are unset).
// Returns nullopt when none of RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID is set.
// Throws kernels::Error naming the variable for missing or inconsistent values.
std::optional<WorkerEnv> worker_env_from_environment(const EnvLookup& env = {});

// The most restarts LaunchOptions::max_restarts (--max-restarts) may ask for.
constexpr int kMaxRestarts = 1000;

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;  // this node's index in [0, nnodes)
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port (one node only)
  // After one worker failed: SIGTERM to the others, SIGKILL to those left after this long.
  std::chrono::milliseconds grace_period = std::chrono::seconds(3);
  // The executable to run; empty: this program (/proc/self/exe).
  std::string program;
  // Extra variables for every worker.
  std::vector<std::pair<std::string, std::string>> extra_env;
  // The most workers this node may start (--max-local-ranks); nullopt: local_rank_limit().
  std::optional<int> max_local_ranks;
  // A worker whose heartbeat (through the store, heartbeat.hpp) stops for this long is named
  // hung, and the job is stopped. 0: DP_HEARTBEAT_TIMEOUT (seconds) when set, else 5 s.
  std::chrono::milliseconds heartbeat_timeout{0};
  // After a failed attempt (a worker died, exited non-zero or was named hung), start all the
  // workers again, up to this many times, as torchrun's --max-restarts. In [0, kMaxRestarts].
  // With nnodes > 1 the node launchers agree through a store node 0's launcher hosts at
  // master_addr:(master_port + 1) (check_restarts_allowed): a failure on one node stops the
  // workers of every node, and all start the next attempt together.
  int max_restarts = 0;
};

// How many workers this machine can start without running out of cores or memory: the smaller
// of kRanksPerCore per core this process may run on and the host memory available (see
// kernels::host_memory_available) over kBytesPerRank, and at least 1. `reason` says how.
struct LocalRankLimit {
  static constexpr int kRanksPerCore = 4;
  static constexpr int64_t kBytesPerRank = int64_t(128) << 20;
  int ranks = 1;
  std::string reason;
};
LocalRankLimit local_rank_limit();
// Throws kernels::Error saying what is allowed when `nproc` ranks on this node are more than
// `max_local_ranks` (when given) or local_rank_limit() (otherwise). launch_workers calls it
// before starting anything; programs call it earlier still, with their other flag checks.
void check_local_ranks(int nproc, std::optional<int> max_local_ranks);

// Throws kernels::Error when max_restarts > 0 with nnodes > 1 and no master_port + 1 to host
// the launchers' store on (master_port must be in [1, 65534]).
void check_restarts_allowed(int max_restarts, int nnodes, int master_port);

// Runs nproc_per_node workers (global ranks node_rank * nproc_per_node + local) with `argv`
// (argv[0] included) and the launcher's environment plus the worker variables, and watches
// them. Returns 0 when every worker exited 0. When one exits non-zero or is killed, stops the
// others (SIGTERM, then SIGKILL after the grace period), prints one line naming the rank and
// its exit status or signal, and returns its exit code (128 + signal when killed). SIGINT or
// SIGTERM to the launcher is forwarded to the workers and returns 128 + that signal, also while
// the workers are being started (no more are started then, nor after one has exited).
// Refuses, before starting any, more workers than options.max_local_ranks or local_rank_limit().
// Workers get PR_SET_PDEATHSIG(SIGKILL): they die with the launching thread. They run the
// program's real path (not /proc/self/exe), so `ps` shows its name. Never exits.
// Job identity: workers get DP_JOB_TOKEN (the launcher's own when set, else a random one on one
// node, else one derived from DP_JOB_ID / TORCHELASTIC_RUN_ID / SLURM_JOB_ID / PMIX_NAMESPACE:
// rendezvous.hpp), which the store checks at connect, so ranks of another job on the same port
// are refused. Hung workers: with
// DP_HEARTBEAT_MS set they beat through the store; one silent for heartbeat_timeout (a
// SIGSTOP, a livelock of the whole process) is named ("rank 1 (pid N) sent no heartbeat for
// 5 s: hung"), killed, and the others stopped; the launcher returns 1.
// Restarts: after a failed attempt with restarts left, all workers are started again with the
// same argv and port, a fresh job token (unless DP_JOB_TOKEN was given) and DP_RESTART_COUNT
// one higher (0 on the first attempt), logging "launch_workers: restart 1 of K after rank R
// exited with status 3". A signal to the launcher never restarts. When the last allowed attempt
// fails, says how many restarts were used and returns that attempt's code.
// Several nodes: node 0's launcher hosts a store at master_port + 1 (others wait up to 60 s for
// it); a node whose worker fails publishes it ("rank 3 (node 1) was killed by signal 9"), the
// others stop their workers within ~0.1 s plus the grace period, every node waits (up to 60 s)
// for all nodes' attempts to end, and all restart (or all stop) together. A signal to one
// node's launcher stops every node, without restart; a lost store stops a node, without
// restart. Returns 1 on a node whose own workers ended well when another node failed last.
int launch_workers(const LaunchOptions& options, const std::vector<std::string>& argv);

// A TCP port free on `host` a moment ago (see socket.hpp); for MASTER_PORT.
int find_free_port(const std::string& host = "127.0.0.1");

}  // namespace dp::dist
