// launch_workers with real processes (tests/dist_worker.cpp): collectives across processes,
// two "nodes" on loopback, and the failure paths (a killed worker, a non-zero exit, workers
// ignoring SIGTERM, the launcher killed, Ctrl-C forwarded, restarts after a failure).
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "dp/distributed/launcher.hpp"
#include "dp/distributed/socket.hpp"
#include "tests/process_util.hpp"
#include "tests/test_dist_util.hpp"

using namespace dp::dist;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kWorker = DP_DIST_WORKER_PATH;

// Pids the workers wrote into `dir`, once all n are there (empty after `within`).
std::vector<pid_t> wait_for_pids(const std::string& dir, int n, std::chrono::milliseconds within) {
  auto deadline = Clock::now() + within;
  while (Clock::now() < deadline) {
    std::vector<pid_t> pids;
    for (int r = 0; r < n; ++r) {
      std::ifstream f(dir + "/rank_" + std::to_string(r) + ".pid");
      long pid = 0;
      if (f >> pid) pids.push_back(static_cast<pid_t>(pid));
    }
    if (static_cast<int>(pids.size()) == n) return pids;
    std::this_thread::sleep_for(10ms);
  }
  return {};
}

using dp_test::all_gone_within;
using dp_test::wait_child;

LaunchOptions worker_options(int nproc) {
  LaunchOptions o;
  o.nproc_per_node = nproc;
  o.program = kWorker;
  o.grace_period = 1s;
  return o;
}

// Starts dist_worker as a launcher process with `args`.
pid_t spawn_launcher(const std::vector<std::string>& args) {
  std::vector<std::string> all = {kWorker};
  all.insert(all.end(), args.begin(), args.end());
  pid_t pid = dp_test::spawn(all);
  REQUIRE(pid > 0);
  return pid;
}

struct Finished {
  int status = -1;  // wait status, -1 when it ran past its time (then killed)
  std::string output;
};

// Starts dist_worker as a launcher with `args` and `extra_env` added to this environment,
// stdout and stderr to a file under `dir`. wait() collects it (bounded by `within`).
struct CapturedLauncher {
  pid_t pid = -1;
  std::string log;
  CapturedLauncher(const std::string& dir, const std::string& name,
                   const std::vector<std::string>& args,
                   const std::vector<std::string>& extra_env = {}) {
    log = dir + "/" + name + ".log";
    std::vector<std::string> all = {kWorker};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<std::string> env = extra_env;  // first: a variable's first entry wins
    for (char** e = environ; *e; ++e) env.push_back(*e);
    pid = dp_test::spawn_logged(all, env, log);
    REQUIRE(pid > 0);
  }
  Finished wait(std::chrono::milliseconds within) {
    Finished f;
    f.status = wait_child(pid, within);
    std::ifstream in(log);
    f.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    MESSAGE(log << ":\n" << f.output);
    return f;
  }
};

struct RemoveDir {
  std::string path;
  ~RemoveDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

bool exited_with(int status, int code) {
  return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == code;
}

int count_of(const std::string& text, const std::string& part) {
  int n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// For workers without a store: the launcher's heartbeat watch waits two intervals for a store
// that never comes, holding each attempt's end up 0.4 s (1 s / 5 x 2) instead of 2 s.
const std::vector<std::string> kFastWatch = {"DP_HEARTBEAT_TIMEOUT=1"};

// A free port for the workers' store whose next one (the launchers' store of several nodes with
// restarts) is free as well.
int free_port_pair() {
  int port = find_free_port();
  for (int tries = 0; tries < 20 && port < 65535; ++tries, port = find_free_port()) {
    try {
      net::listen_tcp("127.0.0.1", port + 1);  // closed at once: free a moment ago
      break;
    } catch (const kernels::Error&) {
    }
  }
  return port;
}

// The pid rank `rank` wrote in attempt `restart` (DP_RESTART_COUNT), or -1 when it wrote none.
pid_t attempt_pid(const std::string& dir, int restart, int rank) {
  std::ifstream f(dir + "/attempt_" + std::to_string(restart) + ".rank_" + std::to_string(rank));
  long pid = -1;
  f >> pid;
  return static_cast<pid_t>(pid);
}

// A launcher process running 2 dist_worker ranks of `mode` with `max_restarts`, its pid files
// and log in a fresh directory that goes with it.
struct RestartJob {
  static constexpr int kRanks = 2;
  std::string dir;
  RemoveDir cleanup;
  CapturedLauncher launcher;
  RestartJob(const std::string& mode, int max_restarts)
      : dir(dist_test::make_temp_dir("restart")),
        cleanup{dir},
        launcher(dir, mode,
                 {"--mode", mode, "--nproc", std::to_string(kRanks), "--pid-dir", dir,
                  "--max-restarts", std::to_string(max_restarts), "--grace-ms", "1000"},
                 kFastWatch) {}
  // How many attempts `rank` started: its attempt files for DP_RESTART_COUNT 0, 1, ...
  int attempts(int rank) const {
    int n = 0;
    while (attempt_pid(dir, n, rank) > 0) ++n;
    return n;
  }
  // Whether every worker of every attempt is gone (within 2 s).
  bool workers_gone() const {
    std::vector<pid_t> pids;
    for (int r = 0; r < kRanks; ++r)
      for (int a = 0; a < attempts(r); ++a) pids.push_back(attempt_pid(dir, a, r));
    return all_gone_within(pids, 2s);
  }
};

}  // namespace

TEST_CASE("dist.launch: three worker processes run Gloo collectives") {
  auto start = Clock::now();
  int rc = launch_workers(worker_options(3), {kWorker, "--mode", "collectives"});
  CHECK(rc == 0);
  CHECK(Clock::now() - start < 30s);
}

TEST_CASE("dist.launch: two nodes of two processes each on loopback") {
  int port = find_free_port();
  std::vector<std::string> common = {
      "--mode",    "collectives",   "--nproc",           "2", "--nnodes", "2", "--master-addr",
      "127.0.0.1", "--master-port", std::to_string(port)};
  auto node = [&](int rank) {
    auto args = common;
    args.push_back("--node-rank");
    args.push_back(std::to_string(rank));
    return spawn_launcher(args);
  };
  pid_t node1 = node(1);  // the node without rank 0 may start first: it waits for the store
  std::this_thread::sleep_for(100ms);
  pid_t node0 = node(0);
  int s0 = wait_child(node0, 30s), s1 = wait_child(node1, 30s);
  CHECK(s0 != -1);
  CHECK(s1 != -1);
  CHECK(WIFEXITED(s0));
  CHECK(WEXITSTATUS(s0) == 0);
  CHECK(WIFEXITED(s1));
  CHECK(WEXITSTATUS(s1) == 0);
}

TEST_CASE("dist.launch: a worker killed mid-run stops the others, and the launcher fails") {
  std::string dir = dist_test::make_temp_dir("kill");
  auto start = Clock::now();
  int rc = launch_workers(worker_options(3), {kWorker, "--mode", "die", "--pid-dir", dir});
  auto took = Clock::now() - start;
  CHECK(rc == 128 + SIGKILL);
  CHECK(took < 30s);
  std::vector<pid_t> pids = wait_for_pids(dir, 3, 1s);
  REQUIRE(pids.size() == 3);
  CHECK(all_gone_within(pids, 2s));
}

TEST_CASE("dist.launch: a non-zero exit is returned, workers ignoring SIGTERM get SIGKILL") {
  std::string dir = dist_test::make_temp_dir("exit");
  SUBCASE("exit status 3") {
    int rc = launch_workers(worker_options(2), {kWorker, "--mode", "exit3", "--pid-dir", dir});
    CHECK(rc == 3);
    auto pids = wait_for_pids(dir, 2, 1s);
    REQUIRE(pids.size() == 2);
    CHECK(all_gone_within(pids, 2s));
  }
  SUBCASE("SIGTERM ignored") {
    auto start = Clock::now();
    int rc = launch_workers(worker_options(3), {kWorker, "--mode", "stubborn", "--pid-dir", dir});
    auto took = Clock::now() - start;
    CHECK(rc == 5);
    CHECK(took >= 1s);  // the grace period passed before SIGKILL
    CHECK(took < 15s);
    auto pids = wait_for_pids(dir, 3, 1s);
    REQUIRE(pids.size() == 3);
    CHECK(all_gone_within(pids, 2s));
  }
}

TEST_CASE("dist.launch: workers die with their launcher, SIGINT to the launcher is forwarded") {
  std::string dir = dist_test::make_temp_dir("parent");
  SUBCASE("launcher killed") {
    pid_t launcher = spawn_launcher({"--mode", "sleep", "--nproc", "2", "--pid-dir", dir});
    auto pids = wait_for_pids(dir, 2, 10s);
    REQUIRE(pids.size() == 2);
    ::kill(launcher, SIGKILL);
    CHECK(wait_child(launcher, 5s) != -1);
    CHECK(all_gone_within(pids, 5s));  // PR_SET_PDEATHSIG
  }
  SUBCASE("SIGINT forwarded") {
    pid_t launcher =
        spawn_launcher({"--mode", "sleep", "--nproc", "2", "--pid-dir", dir, "--grace-ms", "1000"});
    auto pids = wait_for_pids(dir, 2, 10s);
    REQUIRE(pids.size() == 2);
    ::kill(launcher, SIGINT);
    int status = wait_child(launcher, 10s);
    REQUIRE(status != -1);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 128 + SIGINT);
    CHECK(all_gone_within(pids, 2s));
  }
}

TEST_CASE("dist.launch: bad launch options are errors") {
  LaunchOptions o = worker_options(2);
  o.nnodes = 2;  // no master port given
  CHECK_THROWS_WITH_AS(launch_workers(o, {kWorker}), doctest::Contains("master port"),
                       kernels::Error);
  o.nnodes = 1;
  o.node_rank = 1;
  CHECK_THROWS_AS(launch_workers(o, {kWorker}), kernels::Error);
  CHECK_THROWS_AS(launch_workers(worker_options(2), {}), kernels::Error);
  o = worker_options(2);
  o.max_restarts = -1;
  CHECK_THROWS_WITH_AS(launch_workers(o, {kWorker}), doctest::Contains("max_restarts=-1"),
                       kernels::Error);
  o.max_restarts = 1;  // across nodes the launchers' store takes master_port + 1
  o.nnodes = 2;
  o.master_port = 65535;
  CHECK_THROWS_WITH_AS(launch_workers(o, {kWorker}),
                       doctest::Contains("give a --master-port in [1, 65534]"), kernels::Error);
}

TEST_CASE("dist.launcher: more ranks than the machine can start are refused before any starts") {
  std::string dir = dist_test::make_temp_dir("limit");
  // 4096 ranks: past 4 per core below 1024 cores, or 128 MiB each below 512 GiB.
  LocalRankLimit limit = local_rank_limit();
  CHECK(limit.ranks >= 1);
  CHECK(limit.reason.find("per core") != std::string::npos);
  LaunchOptions o = worker_options(4096);
  if (limit.ranks < 4096)  // a machine that can start them all would
    CHECK_THROWS_WITH_AS(launch_workers(o, {kWorker, "--mode", "sleep", "--pid-dir", dir}),
                         doctest::Contains("ranks on this node is more than this machine can "
                                           "start"),
                         kernels::Error);
  o = worker_options(3);
  o.max_local_ranks = 2;  // the override, both ways
  CHECK_THROWS_WITH_AS(launch_workers(o, {kWorker, "--mode", "sleep", "--pid-dir", dir}),
                       doctest::Contains("3 ranks on this node is more than the 2 allowed by "
                                         "--max-local-ranks"),
                       kernels::Error);
  CHECK(wait_for_pids(dir, 1, 200ms).empty());  // nothing was started
  o.max_local_ranks = 3;
  CHECK(launch_workers(o, {kWorker, "--mode", "exit3", "--pid-dir", dir}) == 3);
}

TEST_CASE("dist.launcher: SIGINT while workers start stops them all, workers carry its name") {
  std::string dir = dist_test::make_temp_dir("start");
  // Many workers, so that the signal may land while the launcher is still starting them.
  const int n = 24;
  pid_t launcher =
      spawn_launcher({"--mode", "sleep", "--nproc", std::to_string(n), "--max-local-ranks",
                      std::to_string(n), "--pid-dir", dir, "--grace-ms", "1000"});
  auto first = wait_for_pids(dir, 1, 20s);
  REQUIRE(first.size() == 1);
  // ps shows the program's name, not "exe" (the launcher runs its real path).
  CHECK(dp_test::process_name(first[0]) == "dist_worker");
  ::kill(launcher, SIGINT);
  int status = wait_child(launcher, 20s);
  REQUIRE(status != -1);
  CHECK(dp_test::shell_code(status) == 128 + SIGINT);
  std::vector<pid_t> started;
  for (int r = 0; r < n; ++r) {
    std::ifstream f(dir + "/rank_" + std::to_string(r) + ".pid");
    long pid = 0;
    if (f >> pid) started.push_back(static_cast<pid_t>(pid));
  }
  CHECK(all_gone_within(started, 5s));
}

TEST_CASE("dist.store: two jobs on one master port: the second fails clearly, the first finishes") {
  std::string dir = dist_test::make_temp_dir("twojobs");
  RemoveDir cleanup{dir};
  const std::string port = std::to_string(find_free_port());
  // Job A joins, holds its group for 3 s, then runs its collectives.
  CapturedLauncher a(dir, "a",
                     {"--mode", "collectives", "--nproc", "3", "--master-port", port, "--hold-ms",
                      "3000", "--pid-dir", dir});
  REQUIRE(wait_for_pids(dir, 3, 20s).size() == 3);
  // Once a connection succeeds, A's rank 0 owns the port.
  net::connect_tcp("127.0.0.1", std::stoi(port), Clock::now() + 20s);
  // Job B on the same port: its rank 0 cannot bind, its ranks 1 and 2 reach A's store.
  CapturedLauncher b(dir, "b", {"--mode", "collectives", "--nproc", "3", "--master-port", port});
  Finished fb = b.wait(30s);
  Finished fa = a.wait(30s);
  CHECK(fb.status != -1);
  CHECK_FALSE(exited_with(fb.status, 0));
  CHECK(fb.output.find("another job") != std::string::npos);
  CHECK(exited_with(fa.status, 0));  // undisturbed
  CHECK(count_of(fa.output, "collectives ok") == 3);
}

TEST_CASE("dist.launch: a hung rank (SIGSTOP) is named by its heartbeat and the job stopped") {
  for (int hung : {1, 0}) {  // rank 0 also hosts the store: its silence is the store's
    CAPTURE(hung);
    std::string dir = dist_test::make_temp_dir("hung");
    RemoveDir cleanup{dir};
    CapturedLauncher l(
        dir, "hung",
        {"--mode", "hang", "--hang-rank", std::to_string(hung), "--nproc", "3", "--pid-dir", dir},
        {"DP_HEARTBEAT_TIMEOUT=2"});
    Finished f = l.wait(40s);  // the barrier's own timeout is 60 s
    CHECK(exited_with(f.status, 1));
    std::vector<pid_t> pids = wait_for_pids(dir, 3, 1s);
    REQUIRE(pids.size() == 3);
    const std::string who = "rank " + std::to_string(hung) + " (local rank " +
                            std::to_string(hung) + ", pid " + std::to_string(pids[hung]) +
                            ") sent no heartbeat for ";
    CHECK(f.output.find(who) != std::string::npos);
    CHECK(f.output.find("killed it and stopped the other 2 worker(s)") != std::string::npos);
    if (hung == 0)
      CHECK(f.output.find("the store it hosts stopped answering") != std::string::npos);
    CHECK(all_gone_within(pids, 2s));  // no orphans, the stopped one included
  }
}

// A rank stopped (SIGSTOP) before its heartbeat is missed: the others fail first, waiting for
// it (a stopped rank 0 silences the store they talk to). The launcher names the stopped rank, not
// the first to exit, and kills it (a stopped process never acts on SIGTERM).
TEST_CASE("dist.launch: a stopped rank is named when another fails waiting for it") {
  for (int stopped : {0, 2}) {
    CAPTURE(stopped);
    std::string dir = dist_test::make_temp_dir("stopped");
    RemoveDir cleanup{dir};
    const auto t0 = std::chrono::steady_clock::now();
    CapturedLauncher l(dir, "stopped",
                       {"--mode", "hang", "--hang-rank", std::to_string(stopped), "--wait-s", "3",
                        "--nproc", "3", "--pid-dir", dir},
                       {"DP_HEARTBEAT_TIMEOUT=120"});
    Finished f = l.wait(40s);
    INFO(f.output);
    CHECK(exited_with(f.status, 1));
    CHECK(std::chrono::steady_clock::now() - t0 < 30s);
    std::vector<pid_t> pids = wait_for_pids(dir, 3, 1s);
    REQUIRE(pids.size() == 3);
    const std::string who = "launch_workers: rank " + std::to_string(stopped) + " (local rank " +
                            std::to_string(stopped) + ", pid " + std::to_string(pids[stopped]) +
                            ") was stopped (SIGSTOP, process state T) when rank ";
    CHECK(f.output.find(who) != std::string::npos);
    CHECK(f.output.find("killed the stopped one and stopped the other 1 worker(s)") !=
          std::string::npos);
    CHECK(all_gone_within(pids, 2s));  // no orphans, the stopped one included
  }
}

TEST_CASE("dist.launch: with max_restarts 1 a failed job runs again with DP_RESTART_COUNT=1") {
  RestartJob job("fail-once", 1);
  Finished f = job.launcher.wait(30s);
  CHECK(exited_with(f.status, 0));
  for (int rank : {0, 1}) {  // both ranks ran twice: DP_RESTART_COUNT 0, then 1
    CAPTURE(rank);
    CHECK(job.attempts(rank) == 2);
    CHECK(attempt_pid(job.dir, 1, rank) != attempt_pid(job.dir, 0, rank));
  }
  CHECK(count_of(f.output, "launch_workers: restart 1 of 1 after rank 1 exited with status 3") ==
        1);
  CHECK(count_of(f.output, "launch_workers: restart ") == 1);
  CHECK(job.workers_gone());
}

TEST_CASE("dist.launch: two nodes with restarts: a failure on node 1 restarts or stops both") {
  std::string dir = dist_test::make_temp_dir("nodes_restart");
  RemoveDir cleanup{dir};
  const int port = free_port_pair();
  auto node = [&](int rank, const std::string& mode) {
    return CapturedLauncher(
        dir, "node" + std::to_string(rank),
        {"--mode", mode, "--nproc", "1", "--nnodes", "2", "--node-rank", std::to_string(rank),
         "--master-addr", "127.0.0.1", "--master-port", std::to_string(port), "--pid-dir", dir,
         "--max-restarts", "1", "--grace-ms", "1000"},
        kFastWatch);
  };
  SUBCASE("rank 1 (node 1) exits 3 once: node 0 stops its rank, both nodes start attempt 2") {
    CapturedLauncher n1 = node(1, "fail-once"), n0 = node(0, "fail-once");
    Finished f0 = n0.wait(30s), f1 = n1.wait(30s);
    CHECK(exited_with(f0.status, 0));
    CHECK(exited_with(f1.status, 0));
    for (int rank : {0, 1}) {
      CAPTURE(rank);
      CHECK(attempt_pid(dir, 0, rank) > 0);
      CHECK(attempt_pid(dir, 1, rank) > 0);
    }
    for (const Finished* f : {&f0, &f1})
      CHECK(count_of(f->output,
                     "launch_workers: restart 1 of 1 after rank 1 (node 1) exited with status 3") ==
            1);
    CHECK(f0.output.find("another node failed: rank 1 (node 1)") != std::string::npos);
    CHECK(all_gone_within({attempt_pid(dir, 0, 0), attempt_pid(dir, 0, 1)}, 2s));
  }
  SUBCASE("SIGTERM to node 1's launcher stops both nodes, without restart") {
    CapturedLauncher n1 = node(1, "sleep"), n0 = node(0, "sleep");
    std::vector<pid_t> pids = wait_for_pids(dir, 2, 10s);
    REQUIRE(pids.size() == 2);
    ::kill(n1.pid, SIGTERM);
    Finished f1 = n1.wait(30s), f0 = n0.wait(30s);
    CHECK(exited_with(f1.status, 128 + SIGTERM));
    CHECK(f0.status != -1);
    CHECK(!exited_with(f0.status, 0));
    CHECK(f0.output.find("node 1's launcher got signal 15") != std::string::npos);
    CHECK(f0.output.find("no restart") != std::string::npos);
    CHECK(count_of(f0.output + f1.output, "launch_workers: restart ") == 0);
    CHECK(all_gone_within(pids, 2s));
  }
}

// A healthy job whose rank 0 (which hosts the store) ends 4 s before the other node's rank was
// taken by that node's launcher for a partition ("the store on rank 0 (node 0, ...) stopped
// answering ...: node 0 died, froze, or is cut off"), and its working rank was stopped: its
// watch had not read rank 0's "done" before the store went. Rank 0 now waits for it. And the
// rank that outlives the store leaves at once: its heartbeat's last requests were bounded by the
// rendezvous timeout, and it took 60 s to exit (node 1's launcher then ends past the 30 s here).
TEST_CASE("dist.launch: two nodes: rank 0 ending first is no lost node") {
  std::string dir = dist_test::make_temp_dir("rank0_first");
  RemoveDir cleanup{dir};
  const int port = free_port_pair();  // port + 1: the launchers' store, with restarts
  for (const std::string restarts : {"0", "1"}) {
    CAPTURE(restarts);
    auto node = [&](int rank) {
      return CapturedLauncher(
          dir, "node" + std::to_string(rank) + "_" + restarts,
          {"--mode", "rank0-first", "--hold-ms", "4000", "--nproc", "1", "--nnodes", "2",
           "--node-rank", std::to_string(rank), "--master-addr", "127.0.0.1", "--master-port",
           std::to_string(port), "--max-restarts", restarts},
          kFastWatch);
    };
    CapturedLauncher n1 = node(1), n0 = node(0);
    Finished f0 = n0.wait(30s), f1 = n1.wait(30s);
    CHECK(exited_with(f0.status, 0));
    CHECK(exited_with(f1.status, 0));
    CHECK(f1.output.find("[rank 1] done") != std::string::npos);
    CHECK(f0.output.find("did not confirm") == std::string::npos);
    CHECK(count_of(f0.output + f1.output, "launch_workers:") == 0);
  }
}

// A job whose ranks drop their group (destroy_process_group) and then work on, rank 0 too: its
// launcher took rank 0's store, gone with the group, for a hung rank 0 ("rank 0 ... sent no
// heartbeat for 1.051 s: hung (the store it hosts stopped answering)"), killed it and failed the
// job. Rank 0 now waits for its own node's watch to see its end as well.
TEST_CASE("dist.launch: ranks that drop their group and work on are not hung") {
  std::string dir = dist_test::make_temp_dir("group_first");
  RemoveDir cleanup{dir};
  CapturedLauncher launcher(
      dir, "launcher", {"--mode", "group-first", "--hold-ms", "3000", "--nproc", "2"}, kFastWatch);
  Finished f = launcher.wait(30s);
  CHECK(exited_with(f.status, 0));
  CHECK(f.output.find("[rank 0] done") != std::string::npos);
  CHECK(f.output.find("[rank 1] done") != std::string::npos);
  CHECK(count_of(f.output, "launch_workers:") == 0);
}

TEST_CASE("dist.launch: with max_restarts 0 a failed job is not restarted and returns its code") {
  RestartJob job("fail-once", 0);
  Finished f = job.launcher.wait(30s);
  CHECK(exited_with(f.status, 3));
  CHECK(job.attempts(0) == 1);
  CHECK(job.attempts(1) == 1);
  CHECK(f.output.find("restart") == std::string::npos);
  CHECK(job.workers_gone());
}

TEST_CASE("dist.launch: a rank that always fails uses every restart, then its code is returned") {
  RestartJob job("exit3", 2);
  Finished f = job.launcher.wait(30s);
  CHECK(exited_with(f.status, 3));
  CHECK(job.attempts(1) == 3);  // rank 0 may be stopped before it writes its file
  for (int restart : {1, 2})
    CHECK(count_of(f.output, "launch_workers: restart " + std::to_string(restart) +
                                 " of 2 after rank 1 exited with status 3") == 1);
  CHECK(count_of(f.output, "launch_workers: restart ") == 2);
  CHECK(count_of(f.output, "no restarts left (2 of 2 used); exit code 3") == 1);
  CHECK(job.workers_gone());
}

TEST_CASE("dist.launch: SIGINT to the launcher with restarts left stops the job, no restart") {
  RestartJob job("sleep", 2);
  auto pids = wait_for_pids(job.dir, 2, 10s);
  REQUIRE(pids.size() == 2);
  ::kill(job.launcher.pid, SIGINT);
  Finished f = job.launcher.wait(10s);
  CHECK(exited_with(f.status, 128 + SIGINT));
  CHECK(job.attempts(0) == 1);
  CHECK(job.attempts(1) == 1);
  CHECK(f.output.find("restart") == std::string::npos);
  CHECK(job.workers_gone());
}
