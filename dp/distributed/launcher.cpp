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
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "dp/distributed/heartbeat.hpp"
#include "dp/distributed/rendezvous.hpp"
#include "dp/distributed/socket.hpp"
#include "dp/distributed/store.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/memory_info.hpp"

extern char** environ;

namespace dp::dist {

int find_free_port(const std::string& host) {
  return net::find_free_port(host);
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
  // When the watch loop first found it stopped (SIGSTOP, process state T), while it stays so.
  std::optional<std::chrono::steady_clock::time_point> stopped_since;
};

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = strsignal(sig);
    return "was killed by signal " + std::to_string(sig) + " (" + (name ? name : "?") + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

// A child's scheduling state from /proc/PID/stat (the letter after the command's closing
// parenthesis): 'T' stopped by a signal (SIGSTOP, SIGTSTP), 't' stopped by a tracer; 0 when it
// cannot be read.
char process_state(pid_t pid) {
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (!f) return 0;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  return close && close[1] == ' ' ? close[2] : 0;
}

bool is_stopped(pid_t pid) {
  const char state = process_state(pid);
  return state == 'T' || state == 't';
}

int exit_code_of(int status) {
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

bool is_worker_var(const std::string& entry) {
  static const char* kVars[] = {"RANK=",
                                "WORLD_SIZE=",
                                "LOCAL_RANK=",
                                "LOCAL_WORLD_SIZE=",
                                "GROUP_RANK=",
                                "NODE_RANK=",
                                "MASTER_ADDR=",
                                "MASTER_PORT=",
                                "DP_JOB_TOKEN=",
                                "DP_HEARTBEAT_MS=",
                                "DP_HEARTBEAT_WATCH=",
                                "DP_HEARTBEAT_NODES=",
                                "DP_RESTART_COUNT="};
  for (const char* v : kVars)
    if (entry.rfind(v, 0) == 0) return true;
  return false;
}

// The token the workers of this launch present to the store (see launch_workers).
std::string launch_job_token(const LaunchOptions& o) {
  std::string token = job_token_from_env({});
  if (!token.empty() && token.rfind("id:", 0) != 0) return token;  // DP_JOB_TOKEN given
  if (o.nnodes > 1) return token;  // every node must agree: only an id they share will do
  return fresh_job_token("launch:");
}

std::chrono::milliseconds heartbeat_timeout_of(const LaunchOptions& o) {
  if (o.heartbeat_timeout.count() > 0) return o.heartbeat_timeout;
  return env_seconds(process_env(), "DP_HEARTBEAT_TIMEOUT").value_or(std::chrono::seconds(5));
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

// The node launchers of a job of several nodes with restarts agreeing on how each attempt
// ended, through a store that node 0's launcher hosts at master_addr:(master_port + 1) (the
// workers' own store, on rank 0, comes and goes with each attempt). Keys, per attempt a:
//   "launch/<a>/failed"     the first failure a node saw ("rank 3 (node 1) exited with ..."):
//                           every node's launcher polls it and stops its workers when it appears
//   "launch/<a>/stop"       a launcher got SIGINT/SIGTERM: the job ends, no node restarts
//   "launch/<a>/end/<n>"    node n's workers have all ended, with that exit code
//   "launch/<a>/seen/<n>"   node n (> 0) has read every end: node 0 waits for these before its
//                           store may go away (it returns) or the next attempt starts
// So every node decides the same: restart when any node failed, else done; and no node starts
// the next attempt's workers before every node has stopped the last ones.
class NodeAgreement {
 public:
  // How long a node waits for the others' ends, and node 0 for their reads.
  static constexpr std::chrono::seconds kEndTimeout{60}, kConnectTimeout{60}, kRequestTimeout{10};

  NodeAgreement(const LaunchOptions& o, int port, const std::string& job_token)
      : node_(o.node_rank), nnodes_(o.nnodes) {
    store_ = std::make_unique<TcpStore>(o.master_addr, port,
                                        o.node_rank == 0 ? StoreRole::server : StoreRole::client,
                                        kConnectTimeout, JobIdentity{job_token, -1});
    store_->set_timeout(kRequestTimeout);
  }

  // The bound of each request: short while the workers run (a poll must not hold up the watch
  // loop's heartbeat judgement behind a store that stopped answering), kRequestTimeout else.
  void set_request_timeout(std::chrono::milliseconds t) { store_->set_timeout(t); }

  // Says that `attempt` failed here (the first node to say it is the one every node names).
  void publish_failure(int attempt, const std::string& cause) {
    if (store_->add(key(attempt, "failures"), 1) == 1)
      store_->set_string(key(attempt, "failed"), cause);
  }
  void publish_stop(int attempt, const std::string& cause) {
    store_->set_string(key(attempt, "stop"), cause);
    publish_failure(attempt, cause);
  }
  // The failure of `attempt` a node published, if any (does not wait).
  std::optional<std::string> failure(int attempt) {
    if (!store_->check({key(attempt, "failed")})) return std::nullopt;
    return store_->get_string(key(attempt, "failed"));
  }

  struct Outcome {
    bool failed = false;  // some node's attempt failed: restart (unless stop)
    bool stop = false;    // a launcher was signalled: no restart
    std::string cause;    // the failure every node names
    int interrupted = 0;  // a signal to this launcher ended the wait
  };
  // Says that this node's workers of `attempt` have all ended, with `code`.
  void publish_end(int attempt, int code) {
    store_->set_string(key(attempt, "end/" + std::to_string(node_)), std::to_string(code));
  }
  // Publishes this node's end of `attempt` (its code) and waits for every node's, or for a
  // stop; a signal to this launcher ends the wait (out.interrupted). Throws when the store
  // stops answering or a node's end is not in within kEndTimeout.
  // `end_timeout` bounds the wait for the other nodes' ends (kEndTimeout, or less when this node
  // lost one of them: a node cut off never publishes its end).
  Outcome agree(int attempt, int code, SignalWatch& signals,
                std::chrono::milliseconds end_timeout = kEndTimeout) {
    publish_end(attempt, code);
    std::vector<std::string> ends, seen;
    for (int n = 0; n < nnodes_; ++n) {
      ends.push_back(key(attempt, "end/" + std::to_string(n)));
      if (n > 0) seen.push_back(key(attempt, "seen/" + std::to_string(n)));
    }
    Outcome out;
    if (!wait_for(attempt, ends, signals, out, "the other nodes' launchers to end attempt",
                  end_timeout))
      return out;
    for (int n = 0; n < nnodes_; ++n)
      if (!store_->check({ends[n]}) || store_->get_string(ends[n]) != "0") out.failed = true;
    if (auto f = failure(attempt)) {
      out.failed = true;
      out.cause = *f;
    } else if (out.failed) {
      out.cause = "a node's workers failed";
    }
    out.stop = store_->check({key(attempt, "stop")});
    if (out.stop) return out;  // no next attempt: the signalled node may not read any more
    if (node_ > 0)
      store_->set_string(key(attempt, "seen/" + std::to_string(node_)), "1");
    else
      wait_for(attempt, seen, signals, out, "the other nodes' launchers to read attempt",
               kEndTimeout);
    return out;
  }

 private:
  std::string key(int attempt, const std::string& what) const {
    return "launch/" + std::to_string(attempt) + "/" + what;
  }
  // Polls until every key exists, or a node published a stop. False when a signal to this
  // launcher came first (out.interrupted).
  bool wait_for(int attempt, const std::vector<std::string>& keys, SignalWatch& signals,
                Outcome& out, const char* what, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!store_->check(keys) && !store_->check({key(attempt, "stop")})) {
      if (int sig = signals.poll()) {
        out.interrupted = sig;
        return false;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        std::vector<std::string> missing;
        for (const auto& k : keys)
          if (!store_->check({k})) missing.push_back(k);
        throw std::runtime_error("node " + std::to_string(node_) + " waited " +
                                 seconds_text(timeout) + " for " + what + " " +
                                 std::to_string(attempt) + " (" + keys_text(missing) + " on " +
                                 store_->describe() + ")");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }

  int node_, nnodes_;
  std::unique_ptr<TcpStore> store_;
};

// What launch_workers works out once; every attempt starts its workers from it.
struct LaunchPlan {
  const LaunchOptions* options = nullptr;
  std::vector<std::string> argv;
  std::string program;
  std::vector<std::string> base_env;  // the launcher's, less the worker variables, plus extra_env
  int port = 0;
  std::chrono::milliseconds hb_timeout{0}, hb_interval{0};
  // The bound of a request to the launchers' store while workers run or a node was lost: two
  // heartbeat intervals, at least 1 s (a loaded machine's store may be slow to answer once; only
  // a silence longer than the heartbeats' judgement counts).
  std::chrono::milliseconds poll_bound() const {
    return std::max<std::chrono::milliseconds>(2 * hb_interval, std::chrono::seconds(1));
  }
};

// How one attempt ended.
struct AttemptEnd {
  int code = 0;         // what launch_workers returns for it (see launcher.hpp)
  int interrupted = 0;  // the signal to the launcher that stopped it, or 0
  int rank = -1;        // the rank that failed, when one did
  std::string cause;    // how it failed: "exited with status 3", "hung (no heartbeat for 5 s)"
  // Several nodes: the failure another node published, which stopped this node's workers
  // ("rank 3 (node 1) exited with status 3"), and whether the launchers' store was lost (then
  // no node can agree on a restart).
  std::string remote;
  bool agreement_lost = false;
  int lost_node = -1;  // the node this one lost (no heartbeat, or rank 0's store silent), or -1
};

// What a node that lost another says of it: "rank 2 (node 1) sent no heartbeat for 5 s", or
// "the store on rank 0 (node 0, ADDR:PORT) stopped answering for 5 s".
std::string lost_text(const SilentRank& lost, const LaunchOptions& o, const LaunchPlan& plan) {
  if (lost.store_down)
    return "the store on rank 0 (node 0, " + o.master_addr + ":" + std::to_string(plan.port) +
           ") stopped answering for " + seconds_text(lost.silent_for);
  return "rank " + std::to_string(lost.rank) + " (node " +
         std::to_string(lost.rank / o.nproc_per_node) + ") sent no heartbeat for " +
         seconds_text(lost.silent_for);
}

// Tells the other nodes (when there are, with restarts) that a signal to this launcher ends the
// job. Never throws: the other nodes find a store that went away too.
void publish_stop(NodeAgreement* nodes, int attempt, int node_rank, int sig) {
  if (!nodes) return;
  try {
    nodes->publish_stop(attempt, "node " + std::to_string(node_rank) + "'s launcher got signal " +
                                     std::to_string(sig) + " (" + strsignal(sig) + ")");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launch_workers: could not tell the other nodes: %s\n", e.what());
  }
}

// Starts the plan's workers with DP_RESTART_COUNT=restart_count, watches them until all have
// ended, and prints what ended them (launch_workers' lines). With `nodes` (several nodes with
// restarts) it also publishes this node's failure or signal, and stops its workers when another
// node publishes one. Throws when a fork fails.
AttemptEnd run_attempt(const LaunchPlan& plan, int restart_count, SignalWatch& signals,
                       NodeAgreement* nodes) {
  const LaunchOptions& o = *plan.options;
  const int world = o.nnodes * o.nproc_per_node;
  const std::string job_token = launch_job_token(o);  // fresh per attempt on one node

  // Everything the children need is built before the first fork: after fork() the child only
  // makes async-signal-safe calls.
  std::vector<char*> child_argv;
  for (const auto& a : plan.argv) child_argv.push_back(const_cast<char*>(a.c_str()));
  child_argv.push_back(nullptr);
  std::vector<std::vector<std::string>> envs(o.nproc_per_node, plan.base_env);
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
    env.push_back("MASTER_PORT=" + std::to_string(plan.port));
    if (!job_token.empty()) env.push_back("DP_JOB_TOKEN=" + job_token);
    env.push_back("DP_HEARTBEAT_MS=" + std::to_string(plan.hb_interval.count()));
    env.push_back("DP_HEARTBEAT_WATCH=" + std::to_string(o.node_rank));
    env.push_back("DP_HEARTBEAT_NODES=" + std::to_string(o.nnodes));
    env.push_back("DP_RESTART_COUNT=" + std::to_string(restart_count));
    for (auto& s : env) envps[i].push_back(const_cast<char*>(s.c_str()));
    envps[i].push_back(nullptr);
  }
  static const char kExecFailed[] = "launch_workers: exec of the worker program failed\n";

  const pid_t launcher = ::getpid();
  int started = 0;
  for (int i = 0; i < o.nproc_per_node; ++i) {
    // A signal, or a worker that has already failed, ends the starting here: the watch loop
    // below handles both, stopping the workers started so far.
    if (started == 0 && signals.pending()) {
      AttemptEnd end;
      end.interrupted = signals.poll();
      publish_stop(nodes, restart_count, o.node_rank, end.interrupted);
      end.code = 128 + end.interrupted;
      std::fprintf(stderr, "launch_workers: got signal %d (%s) before starting any worker\n",
                   end.interrupted, strsignal(end.interrupted));
      return end;
    }
    if (signals.pending() || any_failed(children)) break;
    pid_t pid = ::fork();
    if (pid == 0) {
      // Child: die with the launching thread; the parent may already be gone.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(128 + SIGKILL);
      ::execve(plan.program.c_str(), child_argv.data(), envps[i].data());
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

  // Every rank of the job is watched, this node's and the others': a rank on another node that
  // falls silent, or a store (on rank 0) that stops answering, is how a node sees a network
  // partition, a dead node or a frozen one in seconds rather than at the collective timeout.
  std::vector<int> watched;
  for (int r = 0; r < o.nnodes * o.nproc_per_node; ++r) watched.push_back(r);
  // The ranks wait for its first look at every rank before they train (heartbeat_watch_key);
  // rank 0 waits for it to see rank 0's end before its store goes (heartbeat_end_key).
  HeartbeatWatch heartbeats(
      o.master_addr, plan.port, job_token, watched, plan.hb_interval,
      heartbeat_watch_key(o.node_rank), heartbeat_end_key(o.node_rank),
      o.node_rank == 0 ? HeartbeatWatch::EndLook::each_tick : HeartbeatWatch::EndLook::each_poll);
  std::optional<SilentRank> hung;
  // A rank of another node that fell silent (or the store it hosts): this node's workers stop.
  std::optional<SilentRank> lost;

  using Clock = std::chrono::steady_clock;
  const Child* failed = nullptr;
  // A worker found stopped (SIGSTOP) when another failed: the likelier cause, named first (a
  // stopped rank 0 silences the store the others wait on, and they fail before any heartbeat
  // is missed).
  const Child* stopped = nullptr;
  bool published = false;  // this node's failure, to the other nodes
  std::optional<std::string> remote;
  bool agreement_lost = false;
  Clock::time_point next_poll = Clock::now();
  // The launchers' store answered last (a poll that fails is judged a little after the
  // heartbeats would name the node that went).
  Clock::time_point agreement_ok = Clock::now();
  if (nodes) nodes->set_request_timeout(plan.poll_bound());
  int interrupted = 0;
  bool stopping = false, killed = false;
  Clock::time_point kill_at;
  size_t alive = static_cast<size_t>(started);
  auto begin_stop = [&](int sig) {
    stopping = true;
    signal_all(children, sig);
    kill_at = Clock::now() + o.grace_period;
  };
  // This node's failure, once, to the other nodes (with restarts): a launchers' store that does
  // not take it is an agreement lost.
  auto publish_failure = [&](const std::string& who) {
    if (!nodes || published) return;
    published = true;
    try {
      nodes->publish_failure(restart_count, who);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "launch_workers: could not tell the other nodes: %s\n", e.what());
      agreement_lost = true;
    }
  };
  // A worker of this node found hung: killed (a stopped process would never act on SIGTERM),
  // the others stopped.
  auto stop_hung = [&](Child& c, std::chrono::milliseconds silent_for, bool store_down) {
    hung = SilentRank{c.rank, silent_for, store_down};
    failed = &c;
    ::kill(c.pid, SIGKILL);
    begin_stop(SIGTERM);
  };
  // How long this node's worker has been stopped (SIGSTOP), or nothing when it is not.
  auto stopped_for = [&](Child& c) -> std::optional<std::chrono::milliseconds> {
    if (!c.alive || !is_stopped(c.pid)) {
      c.stopped_since.reset();
      return std::nullopt;
    }
    if (!c.stopped_since) c.stopped_since = Clock::now();
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *c.stopped_since);
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
      if (bad && !failed && !interrupted && !remote && !lost) {
        failed = &c;
        for (auto& other : children)
          if (other.alive && is_stopped(other.pid)) {
            stopped = &other;
            ::kill(other.pid, SIGKILL);  // a stopped process would never act on SIGTERM
            break;
          }
        if (!stopping) begin_stop(SIGTERM);
      }
    }
    const bool poll_now = Clock::now() >= next_poll;
    if (poll_now) next_poll = Clock::now() + std::chrono::milliseconds(100);
    if (nodes && !stopping && !interrupted && !failed && poll_now) {
      try {
        remote = nodes->failure(restart_count);
        agreement_ok = Clock::now();
      } catch (const std::exception& e) {
        const auto quiet =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - agreement_ok);
        // Two intervals past the heartbeats' judgement, which names the node that went.
        if (quiet > plan.hb_timeout + 2 * plan.hb_interval) {
          remote = "the launchers' store (node 0's launcher, " + o.master_addr + ":" +
                   std::to_string(plan.port + 1) + ") stopped answering for " +
                   seconds_text(quiet) + ": " + e.what();
          agreement_lost = true;
        }
      }
      if (remote) begin_stop(SIGTERM);
    }
    // A worker of this node stopped (SIGSTOP) for longer than the heartbeat timeout is hung,
    // seen from its process state whether or not the store still answers.
    if (!stopping && !interrupted && !failed && poll_now)
      for (auto& c : children)
        if (auto d = stopped_for(c); d && *d > plan.hb_timeout) {
          stop_hung(c, std::max(*d, heartbeats.silent_for(c.rank)), c.rank == 0);
          break;
        }
    if (!stopping && !interrupted && !failed) {
      if (std::optional<SilentRank> silent = heartbeats.silent(plan.hb_timeout)) {
        // A worker of this node found stopped is the likelier cause of any silence: a peer node
        // that judged it first stops its own workers, rank 0's store with them.
        Child* stopped_here = nullptr;
        std::chrono::milliseconds stopped_here_for{0};
        for (auto& c : children)
          if (auto d = stopped_for(c)) {
            stopped_here = &c;
            stopped_here_for = *d;
          }
        auto child = std::find_if(children.begin(), children.end(),
                                  [&](const Child& c) { return c.rank == silent->rank; });
        if (stopped_here) {
          stop_hung(*stopped_here,
                    std::max(stopped_here_for, heartbeats.silent_for(stopped_here->rank)),
                    stopped_here->rank == 0);
        } else if (child == children.end()) {
          // Another node's rank, or the store its node hosts: that node died, froze or is cut off.
          lost = silent;
          begin_stop(SIGTERM);
          // Every node names it at the restart, or at the end without one.
          publish_failure(lost_text(*lost, o, plan) + " (seen from node " +
                          std::to_string(o.node_rank) + ")");
        } else if (child->alive) {
          stop_hung(*child, silent->silent_for, silent->store_down);
        }
      }
    }
    if (nodes && failed && !published) {
      std::string cause = hung
                              ? "sent no heartbeat for " + seconds_text(hung->silent_for) + ": hung"
                              : describe_status(failed->status);
      std::string who = "rank " + std::to_string(failed->rank) + " (node " +
                        std::to_string(o.node_rank) + ") " + cause;
      if (stopped)
        who = "rank " + std::to_string(stopped->rank) + " (node " + std::to_string(o.node_rank) +
              ") was stopped (SIGSTOP) and rank " + std::to_string(failed->rank) + " " + cause;
      publish_failure(who);
    }
    if (int sig = signals.poll(); sig != 0 && !interrupted) {
      interrupted = sig;
      publish_stop(nodes, restart_count, o.node_rank, sig);
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

  AttemptEnd end;
  if (interrupted) {
    std::fprintf(stderr, "launch_workers: got signal %d (%s); stopped %d workers\n", interrupted,
                 strsignal(interrupted), started);
    std::fflush(stderr);
    end.interrupted = interrupted;
    end.code = 128 + interrupted;
    return end;
  }
  end.agreement_lost = agreement_lost;
  if (lost && !failed && !remote) {
    const std::string node = std::to_string(lost->rank / o.nproc_per_node);
    const std::string what = lost_text(*lost, o, plan);
    std::fprintf(stderr,
                 "launch_workers: %s: node %s died, froze, or is cut off from this node (a "
                 "network partition); stopped this node's %d worker(s) instead of waiting for "
                 "the collective timeout\n",
                 what.c_str(), node.c_str(), started);
    std::fflush(stderr);
    end.code = 1;
    end.rank = lost->rank;
    end.lost_node = lost->rank / o.nproc_per_node;
    end.cause = lost->store_down
                    ? "unreachable (its store stopped answering)"
                    : "unreachable (no heartbeat for " + seconds_text(lost->silent_for) + ")";
    return end;
  }
  if (remote) {
    std::fprintf(stderr, "launch_workers: %s%s; stopped this node's %d worker(s)\n",
                 agreement_lost ? "" : "another node failed: ", remote->c_str(), started);
    std::fflush(stderr);
    end.code = 1;
    end.remote = *remote;
    return end;
  }
  if (!failed) return end;
  end.rank = failed->rank;
  if (hung) {
    std::fprintf(
        stderr,
        "launch_workers: rank %d (local rank %d, pid %d) sent no heartbeat for %s: hung%s; "
        "killed it and stopped the other %d worker(s)\n",
        failed->rank, failed->local_rank, static_cast<int>(failed->pid),
        seconds_text(hung->silent_for).c_str(),
        hung->store_down ? " (the store it hosts stopped answering)" : "", o.nproc_per_node - 1);
    std::fflush(stderr);
    end.code = 1;
    end.cause = "hung (no heartbeat for " + seconds_text(hung->silent_for) + ")";
    return end;
  }
  if (stopped) {
    std::fprintf(stderr,
                 "launch_workers: rank %d (local rank %d, pid %d) was stopped (SIGSTOP, process "
                 "state T) when rank %d (local rank %d, pid %d) %s, likely waiting for it; killed "
                 "the stopped one and stopped the other %d worker(s)\n",
                 stopped->rank, stopped->local_rank, static_cast<int>(stopped->pid), failed->rank,
                 failed->local_rank, static_cast<int>(failed->pid),
                 describe_status(failed->status).c_str(), started - 2);
    std::fflush(stderr);
    end.rank = stopped->rank;
    end.code = 1;
    end.cause = "stopped (SIGSTOP); rank " + std::to_string(failed->rank) + " " +
                describe_status(failed->status);
    return end;
  }
  std::fprintf(stderr,
               "launch_workers: rank %d (local rank %d, pid %d) %s; stopped the other %d "
               "worker(s)\n",
               failed->rank, failed->local_rank, static_cast<int>(failed->pid),
               describe_status(failed->status).c_str(), started - 1);
  std::fflush(stderr);
  int code = exit_code_of(failed->status);
  end.code = code == 0 ? 1 : code;
  end.cause = describe_status(failed->status);
  return end;
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
    DP_CHECK(nproc <= *max_local_ranks,
             "launch_workers: " << nproc << " ranks on this node is more than the "
                                << *max_local_ranks << " allowed by --max-local-ranks");
    return;
  }
  LocalRankLimit limit = local_rank_limit();
  DP_CHECK(nproc <= limit.ranks,
           "launch_workers: " << nproc << " ranks on this node is more than this machine can "
                              << "start: at most " << limit.ranks << " (" << limit.reason
                              << "); give fewer ranks, or raise the limit with --max-local-ranks");
}

void check_restarts_allowed(int max_restarts, int nnodes, int master_port) {
  DP_CHECK(max_restarts == 0 || nnodes == 1 || (master_port > 0 && master_port < 65535),
           "launch_workers: --max-restarts "
               << max_restarts << " with --nnodes " << nnodes << " and --master-port "
               << master_port
               << ": the node launchers agree on restarts through a store on node 0 at the "
                  "master port + 1; give a --master-port in [1, 65534]");
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
  DP_CHECK(o.max_restarts >= 0 && o.max_restarts <= kMaxRestarts,
           "launch_workers: max_restarts=" << o.max_restarts << " is not in [0, " << kMaxRestarts
                                           << "]");
  check_restarts_allowed(o.max_restarts, o.nnodes, o.master_port);
  check_local_ranks(o.nproc_per_node, o.max_local_ranks);
  LaunchPlan plan;
  plan.options = &o;
  plan.argv = argv;
  plan.port = o.master_port;
  if (plan.port == 0) {
    DP_CHECK(o.nnodes == 1, "launch_workers: a master port is required with nnodes="
                                << o.nnodes << " (every node must use the same one)");
    plan.port = find_free_port(o.master_addr);  // kept for every attempt
  }
  plan.program = o.program.empty() ? self_program() : o.program;
  plan.hb_timeout = heartbeat_timeout_of(o);
  plan.hb_interval = std::clamp<std::chrono::milliseconds>(
      plan.hb_timeout / 5, std::chrono::milliseconds(50), std::chrono::seconds(1));
  for (char** e = environ; e && *e; ++e) {
    std::string entry(*e);
    bool overridden = is_worker_var(entry);
    for (const auto& kv : o.extra_env)
      if (entry.rfind(kv.first + "=", 0) == 0) overridden = true;
    if (!overridden) plan.base_env.push_back(entry);
  }
  for (const auto& kv : o.extra_env) plan.base_env.push_back(kv.first + "=" + kv.second);

  SignalWatch signals;
  // Several nodes with restarts: node 0's launcher hosts the store they agree through.
  std::unique_ptr<NodeAgreement> nodes;
  if (o.nnodes > 1 && o.max_restarts > 0)
    nodes = std::make_unique<NodeAgreement>(o, plan.port + 1, launch_job_token(o));
  for (int restart = 0;; ++restart) {
    AttemptEnd end = run_attempt(plan, restart, signals, nodes.get());
    std::string after = "rank " + std::to_string(end.rank) + " " + end.cause;
    if (nodes && end.interrupted) {
      try {  // the others wait for every node's end
        nodes->publish_end(restart, end.code);
      } catch (const std::exception&) {
        // the store is gone (node 0's launcher ended): the others find that out themselves
      }
    }
    if (nodes && !end.interrupted) {
      if (end.agreement_lost) return end.code;  // run_attempt said why
      NodeAgreement::Outcome agreed;
      // A node this one lost publishes its end only if it can still reach the store: by the
      // time it named the loss itself and stopped its workers, or not at all (cut off).
      const std::chrono::milliseconds end_timeout =
          end.lost_node >= 0 ? plan.hb_timeout + o.grace_period + std::chrono::seconds(5)
                             : std::chrono::milliseconds(NodeAgreement::kEndTimeout);
      try {
        nodes->set_request_timeout(end.lost_node >= 0
                                       ? plan.poll_bound()
                                       : std::chrono::milliseconds(NodeAgreement::kRequestTimeout));
        agreed = nodes->agree(restart, end.code, signals, end_timeout);
      } catch (const std::exception& e) {
        if (end.lost_node >= 0)
          std::fprintf(stderr,
                       "launch_workers: node %d is unreachable (%s), and a restart needs every "
                       "node; no restart\n",
                       end.lost_node, e.what());
        else
          std::fprintf(stderr, "launch_workers: %s; no restart\n", e.what());
        std::fflush(stderr);
        return end.code != 0 ? end.code : 1;
      }
      if (agreed.interrupted) {
        publish_stop(nodes.get(), restart, o.node_rank, agreed.interrupted);
        std::fprintf(stderr, "launch_workers: got signal %d (%s) while the nodes agreed\n",
                     agreed.interrupted, strsignal(agreed.interrupted));
        std::fflush(stderr);
        return 128 + agreed.interrupted;
      }
      if (!agreed.failed) return end.code;
      if (end.code == 0) {
        std::fprintf(stderr, "launch_workers: this node's workers ended well, but %s\n",
                     agreed.cause.c_str());
        end.code = 1;
      }
      if (agreed.stop) {
        std::fprintf(stderr, "launch_workers: %s: no restart\n", agreed.cause.c_str());
        std::fflush(stderr);
        return end.code;
      }
      after = agreed.cause;
    }
    if (end.code == 0 || end.interrupted) return end.code;
    if (restart == o.max_restarts) {
      if (o.max_restarts > 0) {
        std::fprintf(stderr, "launch_workers: no restarts left (%d of %d used); exit code %d\n",
                     restart, o.max_restarts, end.code);
        std::fflush(stderr);
      }
      return end.code;
    }
    std::fprintf(stderr, "launch_workers: restart %d of %d after %s\n", restart + 1, o.max_restarts,
                 after.c_str());
    std::fflush(stderr);
  }
}

}  // namespace dp::dist
