// Init methods (env://, tcp://, file://) and the launcher's environment parsing.
#include "dp/distributed/heartbeat.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/distributed/rendezvous.hpp"
#include "tests/test_dist_util.hpp"

using namespace dp::dist;
using namespace std::chrono_literals;
using kernels::Tensor;

namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const kernels::Error& e) {
    return e.what();
  }
  return "";
}

using Vars = std::map<std::string, std::string>;

}  // namespace

TEST_CASE("dist.rendezvous: init methods parse into host, port, path, rank and size") {
  auto env = map_env({{"MASTER_ADDR", "10.1.2.3"},
                      {"MASTER_PORT", "29501"},
                      {"RANK", "2"},
                      {"WORLD_SIZE", "4"},
                      {"LOCAL_RANK", "0"},
                      {"LOCAL_WORLD_SIZE", "2"}});
  RendezvousSpec e = parse_init_method("env://", -1, -1, env);
  CHECK(e.kind == RendezvousSpec::Kind::tcp);
  CHECK(e.host == "10.1.2.3");
  CHECK(e.port == 29501);
  CHECK(e.rank == 2);
  CHECK(e.world_size == 4);
  CHECK(e.local_rank == 0);
  CHECK(parse_init_method("env://", 1, 4, env).rank == 1);  // explicit arguments win

  RendezvousSpec t = parse_init_method("tcp://127.0.0.1:23456", 1, 3, map_env({}));
  CHECK(t.host == "127.0.0.1");
  CHECK(t.port == 23456);
  CHECK(t.rank == 1);
  CHECK(t.world_size == 3);
  RendezvousSpec q = parse_init_method("tcp://[::1]:80?rank=0&world_size=2", -1, -1, map_env({}));
  CHECK(q.host == "::1");
  CHECK(q.port == 80);
  CHECK(q.world_size == 2);
  CHECK(q.describe() == "tcp://[::1]:80");

  RendezvousSpec f =
      parse_init_method("file:///tmp/some/dir?world_size=2&rank=1", -1, -1, map_env({}));
  CHECK(f.kind == RendezvousSpec::Kind::file);
  CHECK(f.path == "/tmp/some/dir");
  CHECK(f.rank == 1);
}

TEST_CASE("dist.rendezvous: errors name the missing or bad part") {
  auto none = map_env({});
  CHECK(
      error_of([&] {
        parse_init_method("env://", -1, -1, map_env({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}));
      }).find("RANK is not set") != std::string::npos);
  CHECK(error_of([&] {
          parse_init_method("env://", 0, 2, map_env({{"MASTER_PORT", "1"}}));
        }).find("MASTER_ADDR") != std::string::npos);
  CHECK(error_of([&] {
          parse_init_method("env://", 0, 2, map_env({{"MASTER_ADDR", "h"}}));
        }).find("MASTER_PORT is not set") != std::string::npos);
  CHECK(
      error_of([&] {
        parse_init_method("env://", 0, 2, map_env({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "http"}}));
      }).find("MASTER_PORT='http'") != std::string::npos);
  CHECK(
      error_of([&] {
        parse_init_method(
            "env://", -1, -1,
            map_env(
                {{"MASTER_ADDR", "h"}, {"MASTER_PORT", "5"}, {"RANK", "4"}, {"WORLD_SIZE", "4"}}));
      }).find("RANK=4") != std::string::npos);
  CHECK(error_of([&] { parse_init_method("tcp://host", 0, 1, none); }).find("no port") !=
        std::string::npos);
  CHECK(error_of([&] { parse_init_method("tcp://host:99999", 0, 1, none); }).find("99999") !=
        std::string::npos);
  CHECK(error_of([&] { parse_init_method("tcp://host:5", -1, 2, none); }).find("rank") !=
        std::string::npos);
  CHECK(error_of([&] { parse_init_method("file://relative", 0, 1, none); }).find("absolute") !=
        std::string::npos);
  CHECK(error_of([&] { parse_init_method("udp://x:1", 0, 1, none); }).find("udp") !=
        std::string::npos);
}

TEST_CASE("dist.launcher: worker environments from torchrun, mpirun and Slurm variables") {
  CHECK_FALSE(worker_env_from_environment(map_env({})).has_value());

  auto t = worker_env_from_environment(map_env({{"RANK", "5"},
                                                {"WORLD_SIZE", "8"},
                                                {"LOCAL_RANK", "1"},
                                                {"LOCAL_WORLD_SIZE", "4"},
                                                {"GROUP_RANK", "1"},
                                                {"MASTER_ADDR", "n0"},
                                                {"MASTER_PORT", "1234"}}));
  REQUIRE(t);
  CHECK(t->source == "torchrun");
  CHECK(t->rank == 5);
  CHECK(t->world_size == 8);
  CHECK(t->local_rank == 1);
  CHECK(t->local_world_size == 4);
  CHECK(t->node_rank == 1);
  CHECK(t->master_addr == "n0");
  CHECK(t->master_port == 1234);

  auto no_local_rank = worker_env_from_environment(map_env({{"RANK", "5"},
                                                            {"WORLD_SIZE", "8"},
                                                            {"LOCAL_WORLD_SIZE", "4"},
                                                            {"MASTER_ADDR", "n0"},
                                                            {"MASTER_PORT", "1"}}));
  REQUIRE(no_local_rank);
  CHECK(no_local_rank->local_rank == 1);
  CHECK(no_local_rank->node_rank == 1);

  auto m = worker_env_from_environment(map_env({{"OMPI_COMM_WORLD_RANK", "3"},
                                                {"OMPI_COMM_WORLD_SIZE", "4"},
                                                {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                                                {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  REQUIRE(m);
  CHECK(m->source == "mpirun");
  CHECK(m->rank == 3);
  CHECK(m->local_rank == 3);
  CHECK(m->master_addr == "127.0.0.1");
  CHECK(m->master_port == 29500);

  auto s = worker_env_from_environment(map_env({{"SLURM_PROCID", "6"},
                                                {"SLURM_NTASKS", "8"},
                                                {"SLURM_LOCALID", "2"},
                                                {"SLURM_NNODES", "2"},
                                                {"SLURM_NODEID", "1"},
                                                {"SLURM_NTASKS_PER_NODE", "4"},
                                                {"MASTER_ADDR", "node-a"}}));
  REQUIRE(s);
  CHECK(s->source == "slurm");
  CHECK(s->rank == 6);
  CHECK(s->world_size == 8);
  CHECK(s->local_world_size == 4);
  CHECK(s->node_rank == 1);
  CHECK(s->master_addr == "node-a");

  // torchrun variables win over the scheduler's (a launcher inside a Slurm job).
  auto both = worker_env_from_environment(map_env({{"SLURM_PROCID", "0"},
                                                   {"SLURM_NTASKS", "1"},
                                                   {"RANK", "1"},
                                                   {"WORLD_SIZE", "2"},
                                                   {"MASTER_ADDR", "a"},
                                                   {"MASTER_PORT", "2"}}));
  REQUIRE(both);
  CHECK(both->rank == 1);

  // Without MASTER_PORT: Slurm's port is the job's own (two jobs sharing a node do not both
  // claim 29500); a job of one rank takes any free port (no peer looks for it).
  Vars slurm_job = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "123456"}};
  CHECK(worker_env_from_environment(map_env(slurm_job))->master_port == 18456);
  slurm_job["MASTER_PORT"] = "2000";
  CHECK(worker_env_from_environment(map_env(slurm_job))->master_port == 2000);
  CHECK(parse_init_method("env://", -1, -1, map_env(slurm_job)).port == 2000);
  CHECK(parse_init_method("env://", -1, -1, map_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}})).port ==
        0);
  CHECK(parse_init_method("env://", -1, -1,
                          map_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "2001"}}))
            .port == 2001);
}

TEST_CASE("dist.launcher: the restart count comes from DP_RESTART_COUNT, else torchrun's") {
  Vars base = {{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  auto with = [&](Vars extra) {
    Vars v = base;
    v.insert(extra.begin(), extra.end());
    auto w = worker_env_from_environment(map_env(v));
    REQUIRE(w);
    return w->restart_count;
  };
  CHECK(with({}) == 0);
  CHECK(with({{"DP_RESTART_COUNT", "2"}}) == 2);
  CHECK(with({{"TORCHELASTIC_RESTART_COUNT", "3"}}) == 3);
  CHECK(with({{"DP_RESTART_COUNT", "1"}, {"TORCHELASTIC_RESTART_COUNT", "3"}}) == 1);
  Vars bad = base;
  bad["DP_RESTART_COUNT"] = "-1";
  CHECK(error_of([&] { worker_env_from_environment(map_env(bad)); }).find("DP_RESTART_COUNT") !=
        std::string::npos);
}

TEST_CASE("dist.launcher: inconsistent worker variables are errors naming them") {
  auto err = [](Vars v) { return error_of([&] { worker_env_from_environment(map_env(v)); }); };
  CHECK(err({{"RANK", "0"}}).find("WORLD_SIZE is not") != std::string::npos);
  CHECK(err({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK=2") != std::string::npos);
  CHECK(err({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x'") != std::string::npos);
  // strtoll's leading space and '+' are not taken: RANK=" 1" was rank 1.
  CHECK(err({{"RANK", " 1"}, {"WORLD_SIZE", "2"}}).find("RANK=' 1' is not an integer") !=
        std::string::npos);
  CHECK(err({{"RANK", "+1"}, {"WORLD_SIZE", "2"}}).find("RANK='+1'") != std::string::npos);
  CHECK(err({{"RANK", "-"}, {"WORLD_SIZE", "2"}}).find("RANK='-'") != std::string::npos);
  CHECK(err({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}}).find("MASTER_PORT") !=
        std::string::npos);
  CHECK(err({{"RANK", "0"},
             {"WORLD_SIZE", "4"},
             {"LOCAL_RANK", "3"},
             {"LOCAL_WORLD_SIZE", "2"},
             {"MASTER_ADDR", "a"},
             {"MASTER_PORT", "1"}})
            .find("LOCAL_RANK=3") != std::string::npos);
  CHECK(err({{"RANK", "0"},
             {"WORLD_SIZE", "2"},
             {"LOCAL_WORLD_SIZE", "4"},
             {"MASTER_ADDR", "a"},
             {"MASTER_PORT", "1"}})
            .find("LOCAL_WORLD_SIZE=4") != std::string::npos);
  CHECK(err({{"OMPI_COMM_WORLD_RANK", "0"}}).find("OMPI_COMM_WORLD_SIZE") != std::string::npos);
  CHECK(err({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODEID", "3"}})
            .find("SLURM_NODEID=3") != std::string::npos);
}

// mpirun or Slurm on several nodes without MASTER_ADDR: the worker variables read (MPI's own
// backend meets the ranks without a store, so `mpirun --hostfile hosts -np 2 dp_bench --mode ddp
// --backend mpi` runs as docs/several-machines.md writes it); a store's rendezvous then refuses,
// saying what to pass for that launcher. (This case once asserted the error at the worker
// variables: it moved to where an address is needed.)
TEST_CASE("dist.launcher: mpirun and Slurm on several nodes need MASTER_ADDR only for a store") {
  auto err = [](Vars v) { return error_of([&] { worker_env_from_environment(map_env(v)); }); };
  const Vars mpi = {{"OMPI_COMM_WORLD_RANK", "1"},
                    {"OMPI_COMM_WORLD_SIZE", "2"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}};
  auto m = worker_env_from_environment(map_env(mpi));
  REQUIRE(m);
  CHECK(m->node_rank == 1);
  CHECK(m->master_addr.empty());  // unknown here
  std::string e = error_of([&] { parse_init_method("env://", -1, -1, map_env(mpi)); });
  CHECK(e.find("MASTER_ADDR is not set") != std::string::npos);
  CHECK(e.find("mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500") != std::string::npos);
  CHECK(e.find("--backend mpi needs neither") != std::string::npos);
  const Vars slurm = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NNODES", "2"}};
  auto s = worker_env_from_environment(map_env(slurm));
  REQUIRE(s);
  CHECK(s->master_addr.empty());
  e = error_of([&] { parse_init_method("env://", -1, -1, map_env(slurm)); });
  CHECK(e.find("a Slurm job on several nodes exports it") != std::string::npos);
  // One node keeps the loopback default; torchrun's variables still require it.
  Vars one = mpi;
  one["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
  one["OMPI_COMM_WORLD_LOCAL_RANK"] = "1";
  CHECK(worker_env_from_environment(map_env(one))->master_addr == "127.0.0.1");
  CHECK(err({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).find("MASTER_ADDR") !=
        std::string::npos);
}

namespace {

// Every rank meets through `init_method` (per-rank variables in `env_of`), then all-reduces.
void meet_and_reduce(int n, const std::function<InitOptions(int)>& options_of) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        auto pg = init_process_group(options_of(r));
        Tensor t = Tensor::from_vector({float(r + 1)}, {1});
        pg->all_reduce(t)->wait();
        if (t.item() != n * (n + 1) / 2.f) errors[r] = "sum " + std::to_string(t.item());
        if (pg->rank() != r || pg->size() != n) errors[r] = "wrong rank or size";
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) CHECK_MESSAGE(errors[r].empty(), "rank " << r << ": " << errors[r]);
}

}  // namespace

TEST_CASE("dist.rendezvous: groups meet through env://, tcp:// and file://") {
  const int n = 3;
  SUBCASE("env://") {
    int port = find_free_port();
    meet_and_reduce(n, [&](int r) {
      InitOptions o;
      o.backend = Backend::gloo;
      o.init_method = "env://";
      o.timeout = 20s;
      o.env = map_env({{"MASTER_ADDR", "127.0.0.1"},
                       {"MASTER_PORT", std::to_string(port)},
                       {"RANK", std::to_string(r)},
                       {"WORLD_SIZE", std::to_string(n)},
                       {"LOCAL_RANK", std::to_string(r)}});
      return o;
    });
  }
  SUBCASE("tcp://") {
    int port = find_free_port();
    meet_and_reduce(n, [&](int r) {
      InitOptions o;
      o.backend = Backend::auto_select;
      o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
      o.rank = r;
      o.world_size = n;
      o.timeout = 20s;
      o.env = map_env({});
      return o;
    });
  }
  SUBCASE("file://") {
    std::string dir = dist_test::make_temp_dir("rdzv");
    meet_and_reduce(n, [&](int r) {
      InitOptions o;
      o.backend = Backend::gloo;
      o.init_method = "file://" + dir + "?world_size=" + std::to_string(n);
      o.rank = r;
      o.timeout = 20s;
      o.gloo_hostname = "127.0.0.1";
      o.env = map_env({});
      return o;
    });
  }
}

namespace {

// Runs init_process_group on `ranks` threads of a tcp:// job of `world` ranks (a free port,
// DP_TIMEOUT from `timeout_env`); returns each thread's error message ("" when it joined).
std::vector<std::string> join_partial(const std::vector<int>& ranks, int world,
                                      const std::string& timeout_env) {
  const int port = find_free_port();
  std::vector<std::string> errors(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      errors[i] = error_of([&] {
        InitOptions o;
        o.backend = Backend::gloo;
        o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
        o.rank = ranks[i];
        o.world_size = world;
        o.env = map_env({{"DP_TIMEOUT", timeout_env}});  // o.timeout 0: the variable decides
        init_process_group(o);
      });
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

TEST_CASE("dist.rendezvous: a rank that never joins is named when DP_TIMEOUT runs out") {
  // WORLD_SIZE=3 with only ranks 0 and 1 started: both name rank 2, after 1.5 s, not 300.
  for (const std::string& e : join_partial({0, 1}, 3, "1.5")) {
    CHECK_MESSAGE(e.find("rank 2 of 3 never joined within 1.5 s") != std::string::npos, e);
    CHECK_MESSAGE(e.find("2 of 3 arrived") != std::string::npos, e);
  }
  // Several missing ranks are listed; rank 0 missing means no store at all.
  for (const std::string& e : join_partial({1}, 4, "1")) {
    CHECK_MESSAGE(e.find("rank 0 of 4 never joined within 1 s: no store server answered") !=
                      std::string::npos,
                  e);
    // What the last connect said, without the last slice's own bound (a false "within 1 ms").
    CHECK_MESSAGE(e.find("the last try: could not connect") != std::string::npos, e);
    CHECK_MESSAGE(e.find(" ms:") == std::string::npos, e);
  }
  for (const std::string& e : join_partial({0}, 4, "1"))
    CHECK_MESSAGE(e.find("ranks 1, 2, 3 of 4 never joined within 1 s") != std::string::npos, e);
  // A bad DP_TIMEOUT is refused before anything waits.
  for (const std::string& e : join_partial({0}, 2, "soon"))
    CHECK_MESSAGE(e.find("DP_TIMEOUT='soon' is not a number of seconds") != std::string::npos, e);
  for (const std::string& e : join_partial({0}, 2, "0"))
    CHECK_MESSAGE(e.find("DP_TIMEOUT=0 s is not in [0.001, 604800] seconds") != std::string::npos,
                  e);
}

namespace {

// Joins 2 ranks of a tcp:// job on `port` as launch_workers' ranks (DP_HEARTBEAT_MS and
// DP_HEARTBEAT_WATCH=0), each on a thread: each one's error ("" when it joined) and group.
struct Joined {
  std::vector<std::string> errors = std::vector<std::string>(2);
  std::vector<std::unique_ptr<ProcessGroup>> groups = std::vector<std::unique_ptr<ProcessGroup>>(2);
  ~Joined() {  // rank 1 first: rank 0 hosts the store its heartbeat's last write goes to
    groups[1].reset();
    groups[0].reset();
  }
};
void join_watched(Joined& out, int port, const std::string& timeout_s,
                  const std::string& nodes = "") {
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      out.errors[r] = error_of([&] {
        InitOptions o;
        o.backend = Backend::gloo;
        o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
        o.rank = r;
        o.world_size = 2;
        std::map<std::string, std::string> env = {
            {"DP_TIMEOUT", timeout_s}, {"DP_HEARTBEAT_MS", "20"}, {"DP_HEARTBEAT_WATCH", "0"}};
        if (!nodes.empty()) env["DP_HEARTBEAT_NODES"] = nodes;
        o.env = map_env(env);
        out.groups[r] = init_process_group(o);
      });
    });
  for (auto& t : threads) t.join();
}

}  // namespace

// A partition in a job's first second was left to the collective timeout when a launcher's watch
// had not yet seen the store answer or a rank beat (net.partition, under load): a launched rank
// now waits for its launcher's first look at every rank before it trains.
TEST_CASE("dist.rendezvous: launched ranks wait for their launcher's watch to see every rank") {
  SUBCASE("no watch: both ranks say so when the timeout runs out") {
    Joined j;
    join_watched(j, find_free_port(), "1");
    for (const std::string& e : j.errors) {
      CHECK_MESSAGE(e.find("the launcher of node 0 did not see every rank's heartbeat on "
                           "tcp://127.0.0.1:") != std::string::npos,
                    e);
      CHECK_MESSAGE(e.find("within 1 s, though every rank joined") != std::string::npos, e);
    }
  }
  SUBCASE("a watch started before the ranks: they join once it saw them, and it can judge") {
    const int port = find_free_port();
    HeartbeatWatch watch("127.0.0.1", port, "", {0, 1}, 1s, heartbeat_watch_key(0));
    Joined j;
    join_watched(j, port, "20");
    for (const std::string& e : j.errors) CHECK_MESSAGE(e.empty(), e);
    // The moment they joined, with no wait: the watch has had an answer from the store and seen
    // rank 0 beat, so a store silent for longer than 0 ms is named as rank 0's (it names none
    // before its first answer, or before rank 0's first beat: the partition that went unseen).
    std::optional<SilentRank> s = watch.silent(0ms);
    REQUIRE(s.has_value());
    CHECK(s->rank == 0);
    CHECK(s->store_down);
  }
}

// A healthy job whose rank 0 ended first was taken for a partition on another node: rank 0's
// "done" and its store went together, before that node's watch (polling every interval) had
// read the "done", and a store that stops answering before rank 0's "done" is a lost node 0
// (on rank 0's own node, a hung rank 0). Rank 0 now waits for every node's watch to see its end
// (DP_HEARTBEAT_NODES).
TEST_CASE("dist.rendezvous: rank 0's store stays until every node's watch saw it end") {
  using Clock = std::chrono::steady_clock;
  const int port = find_free_port();
  // Node 0's watch lets the ranks train; "node 1"'s polls every 1 s, as a slow launcher's would.
  HeartbeatWatch node0("127.0.0.1", port, "", {0, 1}, 20ms, heartbeat_watch_key(0),
                       heartbeat_end_key(0));
  // Two ranks of a job of `nodes` nodes join, rank 1 ends, then rank 0: how long rank 0 took.
  auto rank0_end = [&](const std::string& nodes) {
    Joined j;
    join_watched(j, port, "20", nodes);
    for (const std::string& e : j.errors) REQUIRE_MESSAGE(e.empty(), e);
    j.groups[1].reset();
    const auto start = Clock::now();
    j.groups[0].reset();  // "done", then the wait for the nodes' watches
    return Clock::now() - start;
  };
  SUBCASE("node 1's watch sees rank 0's end before the store goes, and names no lost node") {
    HeartbeatWatch node1("127.0.0.1", port, "", {0, 1}, 1s, heartbeat_watch_key(1),
                         heartbeat_end_key(1));
    CHECK(rank0_end("2") < Heartbeat::confirm_bound(20ms));  // one poll of node 1's: <= 1 s
    std::this_thread::sleep_for(300ms);  // the store is gone: silent for longer than 100 ms
    std::optional<SilentRank> s = node1.silent(100ms);
    CHECK_MESSAGE(!s.has_value(), "node 1 named rank " << s->rank << " silent for "
                                                       << s->silent_for.count() << " ms");
  }
  SUBCASE("no watch on node 1: rank 0 waits its bound, then goes") {
    const auto took = rank0_end("2");
    CHECK(took >= Heartbeat::confirm_bound(20ms));
    CHECK(took < Heartbeat::confirm_bound(20ms) + 5s);
  }
  SUBCASE("one node: rank 0 waits for its own node's watch only, which names no hang") {
    CHECK(rank0_end("1") < 1s);  // one poll of node 0's (20 ms)
    std::this_thread::sleep_for(300ms);
    std::optional<SilentRank> s = node0.silent(100ms);
    CHECK_MESSAGE(!s.has_value(), "node 0 named rank " << s->rank << " silent for "
                                                       << s->silent_for.count() << " ms");
  }
  SUBCASE("a start that fails (rank 1 never joins) waits for no node") {
    const auto start = Clock::now();
    const std::string e = error_of([&] {
      InitOptions o;
      o.backend = Backend::gloo;
      o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
      o.rank = 0;
      o.world_size = 2;
      o.env = map_env({{"DP_TIMEOUT", "1"},
                       {"DP_HEARTBEAT_MS", "20"},
                       {"DP_HEARTBEAT_WATCH", "0"},
                       {"DP_HEARTBEAT_NODES", "2"}});
      init_process_group(o);
    });
    CHECK_MESSAGE(e.find("never joined") != std::string::npos, e);
    // The rendezvous timeout (1 s) and no more: it added the confirm bound (2.1 s) before.
    CHECK(Clock::now() - start < 1s + Heartbeat::confirm_bound(20ms) - 200ms);
  }
}

TEST_CASE("dist.rendezvous: job tokens come from DP_JOB_TOKEN, else a launcher's job id") {
  CHECK(job_token_from_env(map_env({{"DP_JOB_TOKEN", "t1"}, {"DP_JOB_ID", "9"}})) == "t1");
  CHECK(job_token_from_env(map_env({{"TORCHELASTIC_RUN_ID", "r7"}})) == "id:r7");
  CHECK(job_token_from_env(map_env({{"SLURM_JOB_ID", "1234"}})) == "id:1234");
  CHECK(job_token_from_env(map_env({})).empty());
  auto spec =
      parse_init_method("tcp://h:1?rank=0&world_size=1", -1, -1, map_env({{"DP_JOB_ID", "abc"}}));
  CHECK(spec.job_token == "id:abc");
  CHECK(error_of([] {
          parse_init_method("tcp://h:1?rank=0&world_size=1", -1, -1,
                            map_env({{"DP_JOB_TOKEN", std::string(300, 'x')}}));
        }).find("at most 256") != std::string::npos);
}
