#include "dp/distributed/launcher.hpp"

#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "dp/distributed/socket.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/memory_info.hpp"

extern char** environ;

namespace dp::dist {

int find_free_port(const std::string& host) {
  return net::find_free_port(host);
}

// ---- worker_env_from_environment ------------------------------------------------------------

namespace {

constexpr int kMaxRanks = 1 << 20;

struct VarNames {
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;
};

void check_consistent(const WorkerEnv& w, const VarNames& n) {
  DP_CHECK(w.rank < w.world_size,
           n.rank << "=" << w.rank << " is not in [0, " << n.world << "=" << w.world_size << ")");
  DP_CHECK(w.local_world_size <= w.world_size, n.local_world << "=" << w.local_world_size
                                                             << " exceeds " << n.world << "="
                                                             << w.world_size);
  DP_CHECK(w.local_rank < w.local_world_size, n.local_rank << "=" << w.local_rank
                                                           << " is not in [0, " << n.local_world
                                                           << "=" << w.local_world_size << ")");
}

// MASTER_ADDR / MASTER_PORT with defaults on one node; required on several.
void read_master(WorkerEnv& w, const EnvLookup& env, bool multi_node, bool required) {
  std::optional<std::string> addr = env("MASTER_ADDR");
  std::optional<int> port = env_int(env, "MASTER_PORT", 1, 65535);
  if (addr && !addr->empty())
    w.master_addr = *addr;
  else
    DP_CHECK(!(required || multi_node), "MASTER_ADDR is not set ("
                                            << w.source << " job with " << w.world_size << " ranks"
                                            << (multi_node ? " on several nodes" : "")
                                            << "): set it to rank 0's host");
  if (port)
    w.master_port = *port;
  else
    DP_CHECK(!required, "MASTER_PORT is not set ("
                            << w.source << " job with " << w.world_size
                            << " ranks): set it to a free port on rank 0's host");
}

}  // namespace

std::optional<WorkerEnv> worker_env_from_environment(const EnvLookup& env_in) {
  EnvLookup env = env_or_process(env_in);
  WorkerEnv w;
  if (env("RANK") || env("WORLD_SIZE")) {
    VarNames n{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
    w.source = "torchrun";
    std::optional<int> rank = env_int(env, "RANK", 0, kMaxRanks);
    std::optional<int> world = env_int(env, "WORLD_SIZE", 1, kMaxRanks);
    DP_CHECK(rank, "WORLD_SIZE is set but RANK is not");
    DP_CHECK(world, "RANK is set but WORLD_SIZE is not");
    w.rank = *rank;
    w.world_size = *world;
    std::optional<int> local_rank = env_int(env, "LOCAL_RANK", 0, kMaxRanks);
    std::optional<int> local_world = env_int(env, "LOCAL_WORLD_SIZE", 1, kMaxRanks);
    // Without LOCAL_* the job is taken as one node.
    w.local_world_size = local_world ? *local_world : w.world_size;
    w.local_rank = local_rank ? *local_rank : w.rank % w.local_world_size;
    std::optional<int> group = env_int(env, "GROUP_RANK", 0, kMaxRanks);
    if (!group) group = env_int(env, "NODE_RANK", 0, kMaxRanks);
    w.node_rank = group ? *group : w.rank / w.local_world_size;
    check_consistent(w, n);
    read_master(w, env, w.local_world_size<w.world_size, w.world_size> 1);
    return w;
  }
  if (env("OMPI_COMM_WORLD_RANK")) {
    VarNames n{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"};
    w.source = "mpirun";
    w.rank = *env_int(env, n.rank, 0, kMaxRanks);
    std::optional<int> world = env_int(env, n.world, 1, kMaxRanks);
    DP_CHECK(world, n.rank << " is set but " << n.world << " is not");
    w.world_size = *world;
    std::optional<int> local_rank = env_int(env, n.local_rank, 0, kMaxRanks);
    std::optional<int> local_world = env_int(env, n.local_world, 1, kMaxRanks);
    w.local_rank = local_rank ? *local_rank : w.rank;
    w.local_world_size = local_world ? *local_world : w.world_size;
    w.node_rank = w.rank / w.local_world_size;  // mpirun's default by-slot placement
    check_consistent(w, n);
    read_master(w, env, w.local_world_size < w.world_size, false);
    return w;
  }
  if (env("SLURM_PROCID")) {
    VarNames n{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"};
    w.source = "slurm";
    w.rank = *env_int(env, n.rank, 0, kMaxRanks);
    std::optional<int> world = env_int(env, n.world, 1, kMaxRanks);
    DP_CHECK(world, n.rank << " is set but " << n.world << " is not");
    w.world_size = *world;
    std::optional<int> local_rank = env_int(env, n.local_rank, 0, kMaxRanks);
    w.local_rank = local_rank ? *local_rank : 0;
    int nnodes = env_int(env, "SLURM_NNODES", 1, kMaxRanks).value_or(1);
    // SLURM_NTASKS_PER_NODE is a plain number only with --ntasks-per-node.
    std::optional<std::string> per_node = env("SLURM_NTASKS_PER_NODE");
    bool plain = per_node && !per_node->empty() &&
                 per_node->find_first_not_of("0123456789") == std::string::npos;
    w.local_world_size = plain ? parse_int(*per_node, 1, kMaxRanks, "SLURM_NTASKS_PER_NODE")
                               : (w.world_size + nnodes - 1) / nnodes;
    w.node_rank = env_int(env, "SLURM_NODEID", 0, kMaxRanks).value_or(0);
    DP_CHECK(w.node_rank < nnodes,
             "SLURM_NODEID=" << w.node_rank << " is not in [0, SLURM_NNODES=" << nnodes << ")");
    check_consistent(w, n);
    read_master(w, env, nnodes > 1, false);
    return w;
  }
  return std::nullopt;
}

// ---- launch_workers -------------------------------------------------------------------------

namespace {

// SIGINT/SIGTERM to the launcher, recorded by a handler shared by concurrent launches.
std::atomic<int> g_last_signal{0};
std::atomic<unsigned> g_signal_count{0};
std::mutex g_signal_mu;
int g_signal_users = 0;
struct sigaction g_old_int, g_old_term;

extern "C" void on_launcher_signal(int sig) {
  g_last_signal.store(sig);
  g_signal_count.fetch_add(1);
}

// Installs the handler for the launch's lifetime; the previous handlers come back after the
// last concurrent launch.
class SignalWatch {
 public:
  SignalWatch() {
    std::lock_guard<std::mutex> lock(g_signal_mu);
    if (g_signal_users++ == 0) {
      struct sigaction sa {};
      sa.sa_handler = on_launcher_signal;
      sigemptyset(&sa.sa_mask);
      sigaction(SIGINT, &sa, &g_old_int);
      sigaction(SIGTERM, &sa, &g_old_term);
    }
    seen_ = g_signal_count.load();
  }
  ~SignalWatch() {
    std::lock_guard<std::mutex> lock(g_signal_mu);
    if (--g_signal_users == 0) {
      sigaction(SIGINT, &g_old_int, nullptr);
      sigaction(SIGTERM, &g_old_term, nullptr);
    }
  }
  // Whether a signal came since the last poll() (which still reports it).
  bool pending() const { return g_signal_count.load() != seen_; }
  // The signal received since the last call, or 0.
  int poll() {
    unsigned now = g_signal_count.load();
    if (now == seen_) return 0;
    seen_ = now;
    return g_last_signal.load();
  }

 private:
  unsigned seen_ = 0;
};

struct Child {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  int status = 0;
};

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = strsignal(sig);
    return "was killed by signal " + std::to_string(sig) + " (" + (name ? name : "?") + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

int exit_code_of(int status) {
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

bool is_worker_var(const std::string& entry) {
  static const char* kVars[] = {"RANK=",       "WORLD_SIZE=", "LOCAL_RANK=",  "LOCAL_WORLD_SIZE=",
                                "GROUP_RANK=", "NODE_RANK=",  "MASTER_ADDR=", "MASTER_PORT="};
  for (const char* v : kVars)
    if (entry.rfind(v, 0) == 0) return true;
  return false;
}

void signal_all(std::vector<Child>& children, int sig) {
  for (auto& c : children)
    if (c.alive) ::kill(c.pid, sig);
}

// Whether one of the started children has failed (exited non-zero or been killed), without
// reaping it: the watch loop does, and names it.
bool any_failed(const std::vector<Child>& children) {
  for (const auto& c : children) {
    if (!c.alive) continue;
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid != 0 && !(info.si_code == CLD_EXITED && info.si_status == 0))
      return true;
  }
  return false;
}

// This program's real path, so that `ps` names the workers after it rather than "exe";
// /proc/self/exe when the file is gone (rebuilt while running) or cannot be read.
std::string self_program() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "/proc/self/exe";
  std::string path(buf, static_cast<size_t>(n));
  if (::access(path.c_str(), X_OK) != 0) return "/proc/self/exe";  // "... (deleted)"
  return path;
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
}

}  // namespace

LocalRankLimit local_rank_limit() {
  LocalRankLimit l;
  const int cores = usable_cores();
  const kernels::AvailableMemory mem = kernels::host_memory_available();
  const int64_t by_memory = mem.bytes / LocalRankLimit::kBytesPerRank;
  const int64_t by_cores = int64_t(LocalRankLimit::kRanksPerCore) * cores;
  l.ranks = static_cast<int>(std::max<int64_t>(1, std::min(by_cores, by_memory)));
  l.reason = std::to_string(LocalRankLimit::kRanksPerCore) + " per core on " +
             std::to_string(cores) + " core(s) allow " + std::to_string(by_cores) + "; " +
             std::to_string(mem.bytes >> 20) + " MiB of memory available (" + mem.source + ") at " +
             std::to_string(LocalRankLimit::kBytesPerRank >> 20) + " MiB per rank allow " +
             std::to_string(by_memory);
  return l;
}

void check_local_ranks(int nproc, std::optional<int> max_local_ranks) {
  if (max_local_ranks) {
    DP_CHECK(*max_local_ranks >= 1,
             "launch_workers: max_local_ranks=" << *max_local_ranks << " must be >= 1");
    DP_CHECK(nproc <= *max_local_ranks, "launch_workers: " << nproc
                                                           << " ranks on this node is more than the "
                                                           << *max_local_ranks
                                                           << " allowed by --max-local-ranks");
    return;
  }
  LocalRankLimit limit = local_rank_limit();
  DP_CHECK(nproc <= limit.ranks,
           "launch_workers: " << nproc << " ranks on this node is more than this machine can "
                              << "start: at most " << limit.ranks << " (" << limit.reason
                              << "); give fewer ranks, or raise the limit with --max-local-ranks");
}

int launch_workers(const LaunchOptions& o, const std::vector<std::string>& argv) {
  DP_CHECK(!argv.empty(), "launch_workers: argv is empty (it needs at least argv[0])");
  DP_CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= 4096,
           "launch_workers: nproc_per_node=" << o.nproc_per_node << " is not in [1, 4096]");
  DP_CHECK(o.nnodes >= 1, "launch_workers: nnodes=" << o.nnodes << " must be >= 1");
  DP_CHECK(
      o.node_rank >= 0 && o.node_rank < o.nnodes,
      "launch_workers: node_rank=" << o.node_rank << " is not in [0, nnodes=" << o.nnodes << ")");
  DP_CHECK(o.master_port >= 0 && o.master_port <= 65535,
           "launch_workers: master_port=" << o.master_port << " is not a port");
  DP_CHECK(!o.master_addr.empty(), "launch_workers: master_addr is empty");
  check_local_ranks(o.nproc_per_node, o.max_local_ranks);
  int port = o.master_port;
  if (port == 0) {
    DP_CHECK(o.nnodes == 1, "launch_workers: a master port is required with nnodes="
                                << o.nnodes << " (every node must use the same one)");
    port = find_free_port(o.master_addr);
  }
  const int world = o.nnodes * o.nproc_per_node;
  const std::string program = o.program.empty() ? self_program() : o.program;

  // Everything the children need is built before the first fork: after fork() the child only
  // makes async-signal-safe calls.
  std::vector<std::string> base_env;
  for (char** e = environ; e && *e; ++e) {
    std::string entry(*e);
    bool overridden = is_worker_var(entry);
    for (const auto& kv : o.extra_env)
      if (entry.rfind(kv.first + "=", 0) == 0) overridden = true;
    if (!overridden) base_env.push_back(entry);
  }
  for (const auto& kv : o.extra_env) base_env.push_back(kv.first + "=" + kv.second);
  std::vector<char*> child_argv;
  for (const auto& a : argv) child_argv.push_back(const_cast<char*>(a.c_str()));
  child_argv.push_back(nullptr);

  std::vector<std::vector<std::string>> envs(o.nproc_per_node, base_env);
  std::vector<std::vector<char*>> envps(o.nproc_per_node);
  std::vector<Child> children(o.nproc_per_node);
  for (int i = 0; i < o.nproc_per_node; ++i) {
    int rank = o.node_rank * o.nproc_per_node + i;
    children[i].local_rank = i;
    children[i].rank = rank;
    auto& env = envs[i];
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("WORLD_SIZE=" + std::to_string(world));
    env.push_back("LOCAL_RANK=" + std::to_string(i));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(o.nproc_per_node));
    env.push_back("GROUP_RANK=" + std::to_string(o.node_rank));
    env.push_back("MASTER_ADDR=" + o.master_addr);
    env.push_back("MASTER_PORT=" + std::to_string(port));
    for (auto& s : env) envps[i].push_back(const_cast<char*>(s.c_str()));
    envps[i].push_back(nullptr);
  }
  static const char kExecFailed[] = "launch_workers: exec of the worker program failed\n";

  SignalWatch signals;
  const pid_t launcher = ::getpid();
  int started = 0;
  for (int i = 0; i < o.nproc_per_node; ++i) {
    // A signal, or a worker that has already failed, ends the starting here: the watch loop
    // below handles both, stopping the workers started so far.
    if (started == 0 && signals.pending()) {
      int sig = signals.poll();
      std::fprintf(stderr, "launch_workers: got signal %d (%s) before starting any worker\n", sig,
                   strsignal(sig));
      return 128 + sig;
    }
    if (signals.pending() || any_failed(children)) break;
    pid_t pid = ::fork();
    if (pid == 0) {
      // Child: die with the launching thread; the parent may already be gone.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(128 + SIGKILL);
      ::execve(program.c_str(), child_argv.data(), envps[i].data());
      ssize_t ignored = ::write(2, kExecFailed, sizeof(kExecFailed) - 1);
      (void)ignored;
      ::_exit(127);
    }
    if (pid < 0) {
      int e = errno;
      signal_all(children, SIGKILL);
      for (auto& c : children)
        if (c.alive) ::waitpid(c.pid, &c.status, 0);
      DP_THROW("launch_workers: fork of local rank " << i << " failed: " << std::strerror(e));
    }
    children[i].pid = pid;
    children[i].alive = true;
    ++started;
  }

  using Clock = std::chrono::steady_clock;
  const Child* failed = nullptr;
  int interrupted = 0;
  bool stopping = false, killed = false;
  Clock::time_point kill_at;
  size_t alive = static_cast<size_t>(started);
  auto begin_stop = [&](int sig) {
    stopping = true;
    signal_all(children, sig);
    kill_at = Clock::now() + o.grace_period;
  };
  while (alive > 0) {
    for (auto& c : children) {
      if (!c.alive) continue;
      pid_t r = ::waitpid(c.pid, &c.status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      c.alive = false;
      --alive;
      if (r < 0) c.status = 0;  // not ours any more (someone else reaped it)
      bool bad = WIFSIGNALED(c.status) || (WIFEXITED(c.status) && WEXITSTATUS(c.status) != 0);
      if (bad && !failed && !interrupted) {
        failed = &c;
        if (!stopping) begin_stop(SIGTERM);
      }
    }
    if (int sig = signals.poll(); sig != 0 && !interrupted) {
      interrupted = sig;
      if (!stopping)
        begin_stop(sig);
      else
        signal_all(children, sig);
    }
    if (stopping && !killed && alive > 0 && Clock::now() >= kill_at) {
      signal_all(children, SIGKILL);
      killed = true;
    }
    if (alive > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  if (interrupted) {
    std::fprintf(stderr, "launch_workers: got signal %d (%s); stopped %d workers\n", interrupted,
                 strsignal(interrupted), started);
    std::fflush(stderr);
    return 128 + interrupted;
  }
  if (failed) {
    std::fprintf(stderr,
                 "launch_workers: rank %d (local rank %d, pid %d) %s; stopped the other %d "
                 "worker(s)\n",
                 failed->rank, failed->local_rank, static_cast<int>(failed->pid),
                 describe_status(failed->status).c_str(), started - 1);
    std::fflush(stderr);
    int code = exit_code_of(failed->status);
    return code == 0 ? 1 : code;
  }
  return 0;
}

}  // namespace dp::dist
