// Ranks prove they agree before they talk: the configuration handshake (config_check.hpp), each
// rank id claimed once per job, Gloo's connection set-up bounded by the rendezvous timeout, and
// the store's defences against idle and refused connections. Ranks run as threads, and as
// processes of tests/dist_worker.cpp started by hand (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT and no job id, as torchrun's env:// allows).
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gloo/transport/tcp/address.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "dp/cli/cli.hpp"
#include "dp/distributed/config_check.hpp"
#include "dp/distributed/gloo_process_group.hpp"
#include "dp/distributed/socket.hpp"
#include "nn/train_state.hpp"
#include "tests/process_util.hpp"
#include "tests/test_dist_util.hpp"

using namespace dp::dist;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kWorker = DP_DIST_WORKER_PATH;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

int count_of(const std::string& text, const std::string& part) {
  int n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// What a rank thread ended with: "" when it returned, else its error.
struct Outcome {
  std::string error;
  double seconds = 0;
};

// One process of dist_worker started by hand as rank `rank` of `world` at 127.0.0.1:`port`
// (no job id), its stdout and stderr in `log`.
struct HandRank {
  pid_t pid = -1;
  std::string log;
  HandRank(const std::string& dir, const std::string& name, int rank, int world, int port,
           const std::vector<std::string>& args, const std::string& timeout_s = "10") {
    log = dir + "/" + name + ".log";
    std::vector<std::string> all = {kWorker};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<std::string> env = {"RANK=" + std::to_string(rank),
                                    "WORLD_SIZE=" + std::to_string(world),
                                    "LOCAL_RANK=" + std::to_string(rank),
                                    "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                    "MASTER_ADDR=127.0.0.1",
                                    "MASTER_PORT=" + std::to_string(port),
                                    "DP_TIMEOUT=" + timeout_s};
    // No job id of any kind: this test's own environment may not lend one.
    for (char** e = environ; *e; ++e) {
      std::string entry(*e);
      bool drop = false;
      for (const char* name :
           {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=",
            "MASTER_PORT=", "DP_TIMEOUT=", "DP_JOB_TOKEN=", "DP_JOB_ID=", "TORCHELASTIC_RUN_ID=",
            "SLURM_JOB_ID=", "PMIX_NAMESPACE=", "OMPI_COMM_WORLD_SIZE=", "DP_HEARTBEAT_MS=",
            "DP_HEARTBEAT_WATCH="})
        if (entry.rfind(name, 0) == 0) drop = true;
      if (!drop) env.push_back(entry);
    }
    pid = dp_test::spawn_logged(all, env, log);
    REQUIRE(pid > 0);
  }
  // Waits (killing it after `within`); returns the exit code, -1 when it ran past `within` or
  // died of a signal.
  int wait(std::chrono::milliseconds within) {
    int status = dp_test::wait_child(pid, within);
    pid = -1;
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  std::string output() const {
    std::ifstream in(log);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ~HandRank() {
    if (pid > 0) dp_test::wait_child(pid, 0ms);  // never orphaned: killed and reaped
  }
};

}  // namespace

// ---- the configuration handshake ----------------------------------------------------------------

TEST_CASE("dist.config: a mismatch names the field, the ranks and their values") {
  RunConfig a = {{"batch", "256"}, {"model", "mlp"}, {"steps", "30"}};
  RunConfig b = {{"batch", "128"}, {"model", "mlp"}, {"steps", "20"}};
  CHECK(describe_config_mismatch({a, a, a}).empty());
  CHECK(describe_config_mismatch({a, b}) ==
        "config mismatch: field \"batch\": rank 0 has 256, rank 1 has 128 (also differ: "
        "\"steps\")");
  CHECK(describe_config_mismatch({a, b, b, a}) ==
        "config mismatch: field \"batch\": ranks 0, 3 have 256, ranks 1, 2 have 128 (also differ: "
        "\"steps\")");
  RunConfig c = a;
  c.erase("model");
  CHECK(describe_config_mismatch({a, c}) ==
        "config mismatch: field \"model\": rank 0 has mlp, rank 1 has (unset)");
  // A user's flag is named before a derived field that differs with it ("engine.buckets" sorts
  // after "--batch" anyway; "dataset_size" and "buckets" would not), unquoted.
  RunConfig f = {{"--batch", "8"}, {"buckets", "3"}, {"dataset_size", "800"}, {"--seed", "1"}};
  RunConfig g = {{"--batch", "12"}, {"buckets", "2"}, {"dataset_size", "1200"}, {"--seed", "2"}};
  CHECK(describe_config_mismatch({f, g}) ==
        "config mismatch: --batch: rank 0 has 8, rank 1 has 12 (also differ: --seed "
        "\"dataset_size\" \"buckets\")");
  // A bucket plan differs because the parameters do: they are named first (two models read
  // "engine.buckets: rank 0 has 1 (...), rank 1 has 1 (...)").
  RunConfig one = {{"engine.buckets", "1 (bf81)"}, {"engine.params.numel", "451"}};
  RunConfig two = {{"engine.buckets", "1 (d643)"}, {"engine.params.numel", "83"}};
  CHECK(describe_config_mismatch({one, two}) ==
        "config mismatch: field \"engine.params.numel\": rank 0 has 451, rank 1 has 83 (also "
        "differ: \"engine.buckets\")");
  g = f;
  g["buckets"] = "2";
  CHECK(describe_config_mismatch({f, g}) ==
        "config mismatch: field \"buckets\": rank 0 has 3, rank 1 has 2");
  // Two programs: the program is named first, not the first flag they differ in.
  RunConfig mnist = f, bench = g;
  mnist["program"] = "train_mnist";
  bench["program"] = "dp_bench";
  bench["--activations"] = "f32";
  CHECK(
      describe_config_mismatch({bench, mnist})
          .find(
              "config mismatch: field \"program\": rank 0 has dp_bench, rank 1 has train_mnist") ==
      0);
  // Real flags as fields: values std::to_string made one ("0.000000") stay apart.
  CHECK(dp::dist::config_number(1e-7f) == "1e-07");
  CHECK(dp::dist::config_number(0.003f) == "0.003");
  CHECK(dp::dist::config_number(1e-7f) != dp::dist::config_number(4e-7f));
  CHECK(dp::dist::config_number(0.5) == "0.5");
  // A value's control bytes are shown escaped, not written to the terminal raw.
  g = f;
  g["--mode"] = std::string("dp\x1b[2J\n", 7);
  CHECK(describe_config_mismatch({f, g}) ==
        "config mismatch: --mode: rank 0 has (unset), rank 1 has dp\\x1b[2J\\x0a");
  // The encoding carries any bytes, and refuses text that is not one.
  RunConfig odd = {{"a:b", "1:2"}, {"", ""}, {"new\nline", std::string("\0x", 2)}};
  CHECK(decode_config(encode_config(odd), 0) == odd);
  CHECK_THROWS_WITH(decode_config("3:abc4:xy", 2),
                    doctest::Contains("the configuration rank 2 sent is malformed"));
}

TEST_CASE("dist.config: ranks that differ in one field all fail at once with the same message") {
  const int n = 3;
  std::vector<Outcome> out(n);
  auto t0 = Clock::now();
  dist_test::run_ranks(n, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, n, store, 20s);
    RunConfig mine = {{"batch", r == 2 ? "128" : "256"}, {"steps", "30"}};
    try {
      verify_same_config(*pg, mine, pg->rendezvous_timeout());
    } catch (const kernels::Error& e) {
      out[r].error = e.what();
    }
    out[r].seconds = seconds_since(t0);
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(contains(out[r].error, "rank " + std::to_string(r) +
                                     " of 3: config mismatch: field "
                                     "\"batch\": ranks 0, 1 have 256, rank 2 has 128"));
    CHECK(out[r].seconds < 5.0);  // at once, not after the 20 s timeout
  }
}

TEST_CASE("dist.config: ranks that agree pass, and the exchange is keyed per name") {
  const int n = 2;
  dist_test::run_ranks(n, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, n, store, 20s);
    verify_same_config(*pg, {{"batch", "64"}}, 5s);
    auto texts = pg->exchange_text("greeting", "hello from " + std::to_string(r), 5s);
    RANK_CHECK(texts.size() == 2 && texts[0] == "hello from 0" && texts[1] == "hello from 1",
               "got " << texts.size() << " texts");
    // The group still works after the exchanges.
    kernels::Tensor t = kernels::Tensor::from_vector({float(r + 1)}, {1});
    pg->all_reduce(t)->wait();
    RANK_CHECK(t.item() == 3.f, "all_reduce gave " << t.item());
  });
}

TEST_CASE("dist.config: a rank that sends no configuration is named within the timeout") {
  const int n = 2;
  std::string error;
  double seconds = 0;
  std::atomic<bool> done{false};
  dist_test::run_ranks(n, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, n, store, 20s);
    if (r == 1) {  // never exchanges; keeps its group until rank 0 has given up
      while (!done.load()) std::this_thread::sleep_for(10ms);
      return;
    }
    auto t0 = Clock::now();
    try {
      verify_same_config(*pg, {{"batch", "64"}}, 1s);
    } catch (const kernels::Error& e) {
      error = e.what();
    }
    seconds = seconds_since(t0);
    done = true;
  });
  INFO(error);
  CHECK(contains(error, "rank 0 of 2: rank 1 sent no config within 1 s"));
  CHECK(seconds >= 0.9);
  CHECK(seconds < 4.0);
}

// ---- each rank id is claimed once -----------------------------------------------------------

TEST_CASE("dist.claim: a second claimant of a rank is refused at once, and the job stops") {
  // World 3: ranks 0 and 1 arrive, a second rank 1 arrives, rank 2 never does. Without claims
  // the rendezvous would count 3 arrivals and go on with a stranger; here the second rank 1 is
  // refused, and the others stop well before their 20 s rendezvous timeout.
  StoreServer server("127.0.0.1", 0);
  const int ranks[] = {0, 1, 1};
  std::vector<Outcome> out(3);
  std::vector<std::thread> threads;
  auto t0 = Clock::now();
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      if (i == 2) std::this_thread::sleep_for(300ms);  // the intruder comes second
      try {
        auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), StoreRole::client, 20s);
        auto pg = dist_test::gloo_group(ranks[i], 3, store, 20s);
        out[i].error = "(joined)";
      } catch (const kernels::Error& e) {
        out[i].error = e.what();
      }
      out[i].seconds = seconds_since(t0);
    });
  }
  for (auto& t : threads) t.join();
  CHECK(contains(out[2].error, "rank 1 is already taken: another process registered as rank 1"));
  CHECK(out[2].seconds < 3.0);
  for (int i : {0, 1}) {
    CAPTURE(i);
    CHECK(contains(out[i].error, "rank 1 was claimed by 2 processes"));
    CHECK(contains(out[i].error, "this job stops"));
    CHECK(out[i].seconds < 5.0);
  }
}

// ---- Gloo's connection set-up is bounded --------------------------------------------------------

TEST_CASE(
    "dist.gloo: a peer that publishes its address but never connects fails within the "
    "connect timeout") {
  // Rank 1's address is published, as a peer that stopped right after would have left it, but
  // nothing ever connects from it. 127.0.0.2 sorts after rank 0's 127.0.0.1, which makes rank 0
  // the pair's listening side: it waits for a connection that never comes.
  auto store = std::make_shared<FileStore>(dist_test::make_temp_dir("gloo_connect"), 10s);
  sockaddr_storage ss{};
  auto* in = reinterpret_cast<sockaddr_in*>(&ss);
  in->sin_family = AF_INET;
  in->sin_port = htons(9);
  in->sin_addr.s_addr = htonl(0x7f000002);
  store->set("1", gloo::transport::tcp::Address(ss).bytes());
  GlooOptions o;
  o.hostname = "127.0.0.1";
  o.timeout = 300s;  // the op timeout: not what bounds the set-up
  o.connect_timeout = 2s;
  auto t0 = Clock::now();
  std::string error;
  try {
    GlooProcessGroup pg(store, 0, 2, o);
  } catch (const kernels::Error& e) {
    error = e.what();
  }
  const double s = seconds_since(t0);
  CHECK(contains(error, "gloo rendezvous of rank 0 of 2"));
  CHECK(contains(error, "connect timeout 2 s"));
  CHECK(s >= 1.5);  // it did wait for the peer ...
  CHECK(s < 5.0);   // ... within the bound (2 s and the pair's rounding), not 5 x 300 s
}

namespace {

// Threads of this process whose signal mask blocks SIGPIPE (/proc/self/task/*/status, SigBlk).
std::set<std::string> threads_blocking_sigpipe() {
  std::set<std::string> out;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("SigBlk:", 0) == 0 &&
          (std::stoull(line.substr(7), nullptr, 16) >> (SIGPIPE - 1) & 1))
        out.insert(task.path().filename().string());
  }
  return out;
}

}  // namespace

// Gloo writes its sockets with writev: a write to a connection its peer closed raised SIGPIPE,
// which killed the process (exit 141, no message) in about 1 of 20 runs where one device's
// reducer failed. Its threads now start with SIGPIPE blocked (the write fails with EPIPE, the op
// with a message); the caller's own mask and the process's disposition are left alone.
TEST_CASE("dist.gloo: the group's threads block SIGPIPE, and the caller's mask is kept") {
  const std::set<std::string> before = threads_blocking_sigpipe();
  std::array<bool, 2> caller_blocks{true, true};
  std::atomic<int> made{0}, counted{0};
  size_t started = 0;
  dist_test::run_ranks(2, [&](int rank, std::shared_ptr<Store> store) {
    GlooOptions o;
    o.hostname = "127.0.0.1";
    GlooProcessGroup pg(store, rank, 2, o);
    sigset_t now;
    pthread_sigmask(SIG_BLOCK, nullptr, &now);
    caller_blocks[static_cast<size_t>(rank)] = sigismember(&now, SIGPIPE) == 1;
    // Both groups alive while rank 0 counts: each one's worker and its device's event loop.
    ++made;
    while (made.load() < 2) std::this_thread::sleep_for(1ms);
    if (rank == 0) {
      std::set<std::string> blocking = threads_blocking_sigpipe();
      for (const std::string& tid : before) blocking.erase(tid);
      started = blocking.size();
      ++counted;
    }
    while (counted.load() < 1) std::this_thread::sleep_for(1ms);
  });
  CHECK_FALSE(caller_blocks[0]);
  CHECK_FALSE(caller_blocks[1]);
  CHECK(started >= 4);
  struct sigaction now {};
  sigaction(SIGPIPE, nullptr, &now);
  const bool default_disposition = now.sa_handler == SIG_DFL;
  CHECK(default_disposition);
}

TEST_CASE(
    "dist.gloo: a peer that never publishes its address fails within the connect "
    "timeout") {
  auto store = std::make_shared<FileStore>(dist_test::make_temp_dir("gloo_absent"), 10s);
  GlooOptions o;
  o.hostname = "127.0.0.1";
  o.timeout = 300s;
  o.connect_timeout = 1s;
  auto t0 = Clock::now();
  CHECK_THROWS_WITH(GlooProcessGroup(store, 0, 2, o),
                    doctest::Contains("gloo rendezvous of rank 0 of 2"));
  CHECK(seconds_since(t0) < 4.0);
}

// ---- the store's defences ---------------------------------------------------------------------

TEST_CASE("dist.store: connections that send no hello are closed after the hello timeout") {
  StoreServerLimits limits;
  limits.hello_timeout = 300ms;
  StoreServer server("127.0.0.1", 0, limits);
  std::vector<net::Socket> idle;
  for (int i = 0; i < 40; ++i)
    idle.push_back(net::connect_tcp("127.0.0.1", server.port(), Clock::now() + 5s));
  auto t0 = Clock::now();
  // Every idle connection is closed by the server: a read sees the end of the stream.
  int closed = 0;
  for (auto& s : idle) {
    char c;
    timeval tv{5, 0};
    setsockopt(s.fd(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (::recv(s.fd(), &c, 1, 0) == 0) ++closed;
  }
  CHECK(closed == 40);
  CHECK(seconds_since(t0) < 3.0);
  CHECK(server.rejected_connections() >= 40);
  // A client that says hello at once is served as before.
  TcpStore client("127.0.0.1", server.port(), StoreRole::client, 5s);
  client.set_string("k", "v");
  std::this_thread::sleep_for(600ms);  // past the hello timeout: a greeted connection stays
  CHECK(client.get_string("k") == "v");
}

TEST_CASE("dist.store: refused connections are logged once per source per interval, counted") {
  StoreServerLimits limits;
  limits.log_interval = 1500ms;
  StoreServer server("127.0.0.1", 0, limits, "token-of-job-a");
  // Stderr into a file while the flood runs.
  const std::string path = dist_test::make_temp_dir("storelog") + "/stderr.txt";
  std::fflush(stderr);
  int saved = ::dup(2);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  ::dup2(fd, 2);
  ::close(fd);
  const int flood = 300;
  auto t0 = Clock::now();
  for (int i = 0; i < flood; ++i) {
    net::Socket s = net::connect_tcp("127.0.0.1", server.port(), Clock::now() + 5s);
    const char garbage[8] = {'G', 'E', 'T', ' ', '/', ' ', 'H', 'T'};
    ::send(s.fd(), garbage, sizeof(garbage), MSG_NOSIGNAL);
  }
  // Every one is refused; then the interval ends and one line counts the rest.
  for (int i = 0; i < 500 && server.rejected_connections() < flood; ++i)
    std::this_thread::sleep_for(10ms);
  const double flood_s = seconds_since(t0);
  std::this_thread::sleep_for(limits.log_interval + 1s);
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::ifstream in(path);
  std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  MESSAGE("flood of " << flood << " in " << flood_s << " s; log:\n" << log);
  CHECK(server.rejected_connections() == flood);
  const int lines = count_of(log, "store server 127.0.0.1:");
  CHECK(lines >= 2);  // the first refusal, and the count of the others
  CHECK(lines <= 2 + static_cast<int>(flood_s / 1.5) * 2);
  CHECK(contains(log, "bad magic byte"));
  CHECK(
      contains(log, "from 127.0.0.1 refused or closed in the last 1.5 s (not logged one by one)"));
}

// ---- processes started by hand (torchrun-style env://, no job id) -----------------------------

TEST_CASE("dist.config: hand-launched ranks with different --batch fail together naming it") {
  std::string dir = dist_test::make_temp_dir("batch_mismatch");
  const int port = net::find_free_port();
  auto t0 = Clock::now();
  HandRank r0(dir, "r0", 0, 2, port, {"--mode", "ddp", "--batch", "8"});
  HandRank r1(dir, "r1", 1, 2, port, {"--mode", "ddp", "--batch", "6"});
  int c0 = r0.wait(30s), c1 = r1.wait(30s);
  const double s = seconds_since(t0);
  MESSAGE("rank 0:\n" << r0.output() << "rank 1:\n" << r1.output());
  CHECK(c0 == 1);
  CHECK(c1 == 1);
  const std::string want = "config mismatch: field \"batch\": rank 0 has 8, rank 1 has 6";
  CHECK(contains(r0.output(), want));
  CHECK(contains(r1.output(), want));
  CHECK_FALSE(contains(r0.output() + r1.output(), "ddp ok"));
  CHECK(s < 10.0);  // together and at once, not after the 10 s DP_TIMEOUT
}

TEST_CASE("dist.state: DdpTrainer::save then load resumes bit for bit on every rank") {
  std::string dir = dist_test::make_temp_dir("ddp_state");
  const std::string file = dir + "/state.safetensors";
  auto weights = [](const std::string& out) {
    auto at = out.find(" weights ");
    return at == std::string::npos ? std::string("none") : out.substr(at + 9, 16);
  };
  int port = net::find_free_port();
  HandRank a0(dir, "a0", 0, 2, port,
              {"--mode", "ddp", "--steps", "4", "--save", file, "--save-at", "2"});
  HandRank a1(dir, "a1", 1, 2, port,
              {"--mode", "ddp", "--steps", "4", "--save", file, "--save-at", "2"});
  REQUIRE(a0.wait(30s) == 0);
  REQUIRE(a1.wait(30s) == 0);
  port = net::find_free_port();
  HandRank b0(dir, "b0", 0, 2, port, {"--mode", "ddp", "--steps", "4", "--load", file});
  HandRank b1(dir, "b1", 1, 2, port, {"--mode", "ddp", "--steps", "4", "--load", file});
  REQUIRE(b0.wait(30s) == 0);
  REQUIRE(b1.wait(30s) == 0);
  CHECK(weights(a0.output()) != "none");
  CHECK(weights(b0.output()) == weights(a0.output()));
  CHECK(weights(b1.output()) == weights(a1.output()));
  CHECK(weights(a1.output()) == weights(a0.output()));
}

TEST_CASE(
    "dist.state: under ZeRO-1 DdpTrainer::save gathers the shards: the file resumes a ZeRO-1 run "
    "and an unsharded one bit for bit") {
  std::string dir = dist_test::make_temp_dir("ddp_zero_state");
  const std::string file = dir + "/zero.safetensors";
  auto weights = [](const std::string& out) {
    auto at = out.find(" weights ");
    return at == std::string::npos ? std::string("none") : out.substr(at + 9, 16);
  };
  // Momentum SGD: each rank's shard of the momentum is state the file must hold whole.
  auto pair = [&](const std::string& name, std::vector<std::string> args) {
    args.insert(args.begin(), {"--mode", "ddp", "--steps", "4", "--momentum"});
    const int port = net::find_free_port();
    HandRank r0(dir, name + "0", 0, 2, port, args), r1(dir, name + "1", 1, 2, port, args);
    const int rc0 = r0.wait(30s), rc1 = r1.wait(30s);
    CAPTURE(r0.output());
    CAPTURE(r1.output());
    CHECK(rc0 == 0);
    CHECK(rc1 == 0);
    CHECK(weights(r1.output()) == weights(r0.output()));
    return weights(r0.output());
  };
  const std::string whole_run = pair("a", {"--zero", "1", "--save", file, "--save-at", "2"});
  CHECK(whole_run != "none");
  CHECK(pair("b", {"--zero", "1", "--load", file}) == whole_run);  // ZeRO-1 goes on
  // Two ranks' sums are the same bits in any order: an unsharded DDP run from the file's whole
  // momentum lands on the same weights.
  CHECK(pair("c", {"--load", file}) == whole_run);
}

TEST_CASE(
    "dist.state: a load that fails on one rank, or reads another state there, fails on every "
    "rank, and a lagged step pending at a load is dropped") {
  std::string dir = dist_test::make_temp_dir("ddp_state_ranks");
  const std::string file = dir + "/two.safetensors", other = dir + "/three.safetensors";
  auto run = [&](const std::string& name, const std::vector<std::string>& args0,
                 const std::vector<std::string>& args1) {
    const int port = net::find_free_port();
    std::vector<std::string> common = {"--mode", "ddp", "--steps", "4"};
    std::vector<std::string> a0 = common, a1 = common;
    a0.insert(a0.end(), args0.begin(), args0.end());
    a1.insert(a1.end(), args1.begin(), args1.end());
    HandRank r0(dir, name + "0", 0, 2, port, a0, "60"), r1(dir, name + "1", 1, 2, port, a1, "60");
    const int rc0 = r0.wait(30s), rc1 = r1.wait(30s);
    return std::make_pair(std::make_pair(rc0, rc1), std::make_pair(r0.output(), r1.output()));
  };
  for (const auto& [path, at] : {std::make_pair(file, "2"), std::make_pair(other, "3")}) {
    const std::vector<std::string> save = {"--save", path, "--save-at", at};
    REQUIRE(run(std::string("save") + at, save, save).first == std::make_pair(0, 0));
  }
  // Rank 1's node lacks the file: both stop at the load, rank 0 naming rank 1.
  {
    auto [rc, out] = run("missing", {"--load", file}, {"--load", dir + "/absent.safetensors"});
    CHECK(rc == std::make_pair(1, 1));
    CAPTURE(out.first);
    CHECK(contains(out.first, "DdpTrainer: rank 1 could not load its training state"));
    CHECK(contains(out.first, "(it loaded " + file + ")"));
    CHECK(contains(out.second, "absent.safetensors"));
  }
  // The ranks read different states (steps 2 and 3): both stop, before training on.
  {
    auto [rc, out] = run("differ", {"--load", file}, {"--load", other});
    CHECK(rc == std::make_pair(1, 1));
    for (const std::string& o : {out.first, out.second}) {
      CAPTURE(o);
      CHECK(contains(o, "rank 1 loaded another state than rank 0"));
      CHECK_FALSE(contains(o, "ddp ok"));
    }
  }
  // --resume latest where each node's folder holds another newest checkpoint (steps 2 and 3),
  // or where rank 1's holds none: every rank stops, naming rank 1.
  {
    const std::string a = dir + "/node_a", b = dir + "/node_b", empty = dir + "/node_c";
    for (const std::string& d : {a, b, empty}) std::filesystem::create_directories(d);
    std::filesystem::copy_file(file, nn::checkpoint_file(a, 2));
    std::filesystem::copy_file(other, nn::checkpoint_file(b, 3));
    auto [rc, out] = run("latest", {"--resume-latest", a}, {"--resume-latest", b});
    CHECK(rc == std::make_pair(1, 1));
    for (const std::string& o : {out.first, out.second}) {
      CAPTURE(o);
      CHECK(contains(o, "rank 1 loaded another state than rank 0 (step 3 against 2"));
    }
    std::tie(rc, out) = run("none", {"--resume-latest", a}, {"--resume-latest", empty});
    CHECK(rc == std::make_pair(1, 1));
    CHECK(contains(out.first, "rank 1 loaded another state than rank 0 (step 0 against 2"));
    std::tie(rc, out) = run("same", {"--resume-latest", a}, {"--resume-latest", a});
    CHECK(rc == std::make_pair(0, 0));
  }
  // metrics_lag 1: three steps, then the load; the resumed steps report what a fresh resume
  // does (the first nothing), not the dropped run's pending step.
  {
    const std::vector<std::string> lag = {"--metrics-lag", "1", "--load", file};
    std::vector<std::string> before = lag;
    before.insert(before.end(), {"--train-before-load", "3"});
    auto losses = [](const std::string& out) {
      auto at = out.find("losses");
      return at == std::string::npos ? std::string("none")
                                     : out.substr(at, out.find('\n', at) - at);
    };
    auto fresh = run("fresh", lag, lag), late = run("late", before, before);
    REQUIRE(fresh.first == std::make_pair(0, 0));
    REQUIRE(late.first == std::make_pair(0, 0));
    CHECK(losses(fresh.second.first).rfind("losses nan ", 0) == 0);
    CHECK(losses(late.second.first) == losses(fresh.second.first));
    CHECK(losses(late.second.second) == losses(fresh.second.second));
  }
}

TEST_CASE("dist.config: hand-launched ranks that agree train, without a job id") {
  std::string dir = dist_test::make_temp_dir("batch_match");
  const int port = net::find_free_port();
  HandRank r0(dir, "r0", 0, 2, port, {"--mode", "ddp", "--batch", "8", "--steps", "3"});
  HandRank r1(dir, "r1", 1, 2, port, {"--mode", "ddp", "--batch", "8", "--steps", "3"});
  CHECK(r0.wait(30s) == 0);
  CHECK(r1.wait(30s) == 0);
  CHECK(contains(r0.output(), "[rank 0] ddp ok loss"));
  CHECK(contains(r1.output(), "[rank 1] ddp ok loss"));
}

namespace {

// What a dist_worker --mode ddp rank printed of its last step and its run.
struct LastStep {
  float norm = -1.f;
  long long syncs = -1, allocations = -1;
  int graphed = -1;
  float scale = -1.f;  // the loss scale after the last step
  int in_graph = -1;   // whether graphed steps held the bucket all-reduces
  long long payload = -1;
  int overlapped = -1;           // the last step's buckets launched while backward ran
  std::vector<float> losses;     // what each step returned (and finish_metrics, lagged)
  std::vector<long long> peaks;  // each step's most memory in use
  std::string weights;           // the hash of its final weights, 16 hex digits
  std::string output;            // all it printed
};

LastStep last_step(const std::string& out, int rank) {
  LastStep l;
  const std::string tag = "[rank " + std::to_string(rank) + "] ";
  auto at = out.find(tag + "norm ");
  if (at != std::string::npos)
    std::sscanf(out.c_str() + at + tag.size(), "norm %f syncs %lld allocations %lld", &l.norm,
                &l.syncs, &l.allocations);
  at = out.find(tag + "graphed ");
  if (at != std::string::npos)
    std::sscanf(out.c_str() + at + tag.size(),
                "graphed %d scale %f in_graph %d payload %lld overlapped %d", &l.graphed, &l.scale,
                &l.in_graph, &l.payload, &l.overlapped);
  at = out.find(tag + "losses");
  if (at != std::string::npos) {
    const size_t begin = at + tag.size() + 6, end = out.find('\n', begin);
    std::istringstream line(out.substr(begin, end - begin));
    for (std::string word; line >> word;) l.losses.push_back(std::stof(word));
  }
  at = out.find(tag + "peaks");
  if (at != std::string::npos) {
    const size_t begin = at + tag.size() + 5, end = out.find('\n', begin);
    std::istringstream line(out.substr(begin, end - begin));
    for (long long v; line >> v;) l.peaks.push_back(v);
  }
  at = out.find(" weights ");
  if (at != std::string::npos) l.weights = out.substr(at + 9, 16);
  return l;
}

// Two hand-launched dist_worker ranks with `args`, to their end; what each printed.
std::array<LastStep, 2> ddp_pair(const std::string& dir, const std::string& name,
                                 const std::vector<std::string>& args) {
  const int port = net::find_free_port();
  HandRank r0(dir, name + "_0", 0, 2, port, args);
  HandRank r1(dir, name + "_1", 1, 2, port, args);
  REQUIRE(r0.wait(30s) == 0);
  REQUIRE(r1.wait(30s) == 0);
  std::array<LastStep, 2> steps = {last_step(r0.output(), 0), last_step(r1.output(), 1)};
  steps[0].output = r0.output();
  steps[1].output = r1.output();
  return steps;
}

}  // namespace

TEST_CASE("ddp.batch: a global batch with fewer rows than ranks fails on every rank at once") {
  // Rank 1 gets no row of a 1-row batch; rank 0 gets it. Both refuse the step, naming the fix,
  // instead of rank 0 waiting alone in the step's collectives until the group's timeout.
  std::string dir = dist_test::make_temp_dir("ddp_short_batch");
  const int port = net::find_free_port();
  const std::vector<std::string> args = {"--mode", "ddp", "--steps", "1", "--batch", "1"};
  HandRank r0(dir, "b_0", 0, 2, port, args, "60"), r1(dir, "b_1", 1, 2, port, args, "60");
  CHECK(r0.wait(30s) == 1);
  CHECK(r1.wait(30s) == 1);
  for (const std::string& out : {r0.output(), r1.output()}) {
    CAPTURE(out);
    CHECK(out.find("a global batch of 1 rows leaves 1 of 2 ranks without rows") !=
          std::string::npos);
  }
}

TEST_CASE("dist.claim: ranks started with different world sizes stop at once, naming both") {
  // Rank 0 of WORLD_SIZE 2 and rank 1 of 3: rank 0 said a store key was never set, rank 1
  // that rank 2 never joined (or that the peer closed), each after the timeout.
  std::string dir = dist_test::make_temp_dir("ddp_world_sizes");
  const int port = net::find_free_port();
  const std::vector<std::string> args = {"--mode", "ddp", "--steps", "1"};
  const auto t0 = Clock::now();
  HandRank r0(dir, "w0", 0, 2, port, args, "60"), r1(dir, "w1", 1, 3, port, args, "60");
  CHECK(r0.wait(60s) == 1);
  CHECK(r1.wait(60s) == 1);
  CHECK(seconds_since(t0) < 30);
  for (const std::string& out : {r0.output(), r1.output()}) {
    CAPTURE(out);
    CHECK(contains(out, "world sizes differ: rank 0 has 2, rank 1 has 3"));
  }
}

TEST_CASE("ddp.config: ranks that clip differently, or use another loss, fail at wrap") {
  // Each rank applies these to the same all-reduced gradient: a difference would let the ranks'
  // weights drift apart without any collective failing.
  std::string dir = dist_test::make_temp_dir("ddp_engine_config");
  auto both_refuse = [&](const std::string& name, const std::vector<std::string>& extra1,
                         const std::string& says) {
    const int port = net::find_free_port();
    std::vector<std::string> a1 = {"--mode", "ddp", "--steps", "1"};
    a1.insert(a1.end(), extra1.begin(), extra1.end());
    HandRank r0(dir, name + "0", 0, 2, port, {"--mode", "ddp", "--steps", "1"}, "60");
    HandRank r1(dir, name + "1", 1, 2, port, a1, "60");
    CHECK(r0.wait(30s) == 1);
    CHECK(r1.wait(30s) == 1);
    for (const std::string& out : {r0.output(), r1.output()}) {
      CAPTURE(out);
      CHECK(contains(out, says));
      CHECK_FALSE(contains(out, "ddp ok"));
    }
  };
  both_refuse("clip", {"--clip-grad", "0.5"},
              "field \"engine.clip_grad_norm\": rank 0 has 0, rank 1 has 0.5");
  both_refuse("lag", {"--metrics-lag", "1"}, "field \"engine.metrics_lag\": rank 0 has 0");
  both_refuse("micro", {"--micro-batches", "2"},
              "field \"engine.micro_batches\": rank 0 has 1, rank 1 has 2");
  both_refuse("loss", {"--moving-shares", "3"},
              "field \"engine.loss\": rank 0 has cross_entropy, rank 1 has token_cross_entropy");
  // The optimizer's settings, not its name and rate alone: SGD with momentum 0.9 on one rank
  // and none on the other trained apart while the all-reduced loss read the same.
  both_refuse("momentum", {"--momentum"},
              "field \"engine.optimizer.settings\": rank 0 has momentum 0, dampening 0, "
              "weight_decay 0, rank 1 has momentum 0.9, dampening 0, weight_decay 0");
}

TEST_CASE("ddp.step: ranks of another global batch, or one going on after a failed step, stop") {
  std::string dir = dist_test::make_temp_dir("ddp_step_agree");
  // Two hand-launched ranks, rank 1 with `extra` flags: both must exit 1. Their outputs.
  auto both_fail = [&](const std::string& name, const std::vector<std::string>& args,
                       const std::vector<std::string>& extra) {
    std::vector<std::string> a1 = args;
    a1.insert(a1.end(), extra.begin(), extra.end());
    const int port = net::find_free_port();
    HandRank r0(dir, name + "0", 0, 2, port, args, "20"), r1(dir, name + "1", 1, 2, port, a1, "20");
    CHECK(r1.wait(60s) == 1);
    CHECK(r0.wait(60s) == 1);
    const std::array<std::string, 2> out = {r0.output(), r1.output()};
    CHECK_FALSE(contains(out[0] + out[1], "ddp ok"));
    return out;
  };
  // Rank 1 passes 3 rows where rank 0 passes 4: each took its share of its own batch (2/4 and
  // 1/3), and both went on with a wrong gradient. The loss's all-reduce now carries the batch.
  auto rows =
      both_fail("rows", {"--mode", "ddp", "--steps", "3", "--batch", "4"}, {"--rank1-rows", "3"});
  CHECK(contains(rows[0],
                 "rank 0 passed a global batch of 4 rows, but the 2 ranks' global "
                 "batches sum to 7 rows"));
  CHECK(contains(rows[1], "rank 1 passed a global batch of 3 rows"));
  // Rank 1's step 2 throws on a bad label before any collective; the worker catches it and goes
  // on. Its step 3 paired with rank 0's step 2 before: both trained 4 steps on each other's
  // gradients of other steps, and exited 0. Now rank 1's next step is refused, and rank 0,
  // left in step 2's collectives, fails too.
  auto label = both_fail("label", {"--mode", "ddp", "--steps", "4", "--batch", "8"},
                         {"--bad-label-at", "2"});
  CAPTURE(label[1]);
  CHECK(contains(label[1], "caught: "));
  CHECK(contains(label[1], "label 99"));
  CHECK(contains(label[1], "an earlier step failed midway"));
  // Rank 0's error names rank 1's failure, which rank 1 recorded before it went.
  CAPTURE(label[0]);
  CHECK(contains(label[0], "(rank 1 failed first: DdpTrainer step 2: "));
  CHECK(contains(label[0], "label 99"));
  // The same, with rank 1 waiting 15 s after it caught the error (research code that logs or
  // saves first) before its refused next step ends it. Rank 0 waits neither that long nor its
  // own 20 s timeout: rank 1's failed step left the group, so rank 0's collective fails at once,
  // naming rank 1's failure. (Before, rank 0 failed only when rank 1 exited, after 15 s.)
  const int port = net::find_free_port();
  const std::vector<std::string> args = {"--mode", "ddp", "--steps", "4", "--batch", "8"};
  std::vector<std::string> lingering = args;
  lingering.insert(lingering.end(), {"--bad-label-at", "2", "--linger-after-catch", "15000"});
  const auto t0 = std::chrono::steady_clock::now();
  HandRank r0(dir, "linger0", 0, 2, port, args, "20");
  HandRank r1(dir, "linger1", 1, 2, port, lingering, "20");
  CHECK(r0.wait(60s) == 1);
  const double rank0_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(r1.wait(60s) == 1);
  const std::string out0 = r0.output();
  CAPTURE(out0);
  CAPTURE(r1.output());
  CHECK(contains(out0, "(rank 1 failed first: DdpTrainer step 2: "));
  CHECK(rank0_s < 10);
  MESSAGE("rank 0 ended " << rank0_s << " s after both started; rank 1 waited 15 s");
}

TEST_CASE("ddp.clip: clipping on the device keeps DdpTrainer's step at one host read") {
  // Two hand-launched ranks, 3 steps, clipping off and on (to a norm far below the gradient's):
  // the last step reads the host once either way (the metrics, which bring the norm along),
  // allocates nothing, and every rank reports the same norm and takes the same clipped step.
  std::string dir = dist_test::make_temp_dir("ddp_clip");
  const std::vector<std::string> args = {"--mode", "ddp", "--steps", "3", "--clip-grad"};
  auto with = [&](const std::string& clip) {
    std::vector<std::string> all = args;
    all.push_back(clip);
    return all;
  };
  const std::array<LastStep, 2> off = ddp_pair(dir, "c_off", with("0")),
                                on = ddp_pair(dir, "c_on", with("0.001"));
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(off[r].syncs == 1);
    CHECK(on[r].syncs == off[r].syncs);
    CHECK(off[r].allocations == 0);
    CHECK(on[r].allocations == 0);
    CHECK(off[r].norm == 0.f);
    CHECK(on[r].norm > 0.001f);  // the clip was active
    CHECK(on[r].norm == on[0].norm);
    CHECK(on[r].weights == on[0].weights);
  }
  CHECK(on[0].weights.size() == 16);
  CHECK(on[0].weights != off[0].weights);
}

TEST_CASE("ddp.memory: graphed warm-up steps hold no output into the next, as uncaptured ones") {
  // The model's output, written over by the loss's gradient, is let go after backward, and a
  // graphed warm-up run's too (a captured graph's stays its graph's): no step makes its output
  // beside the last one's. Uncaptured, a rank's peak may rise once at its second step (state
  // made on the way) and stays there; graphed, the second step (the last warm-up) rises by as
  // much, and the capture and the replays go no higher. Before the fix of graphed warm-ups the
  // second step rose by one output more (rank 0: 76 bytes against 16; rank 1: 48 against 0).
  std::string dir = dist_test::make_temp_dir("ddp_memory");
  std::map<std::string, std::array<LastStep, 2>> runs;
  for (std::string graphs : {"off", "on"})
    runs[graphs] =
        ddp_pair(dir, "m_" + graphs,
                 {"--mode", "ddp", "--steps", "5", "--batch", "9", "--cuda-graphs", graphs});
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const std::vector<long long>&off = runs["off"][r].peaks, &on = runs["on"][r].peaks;
    REQUIRE(off.size() == 5);
    REQUIRE(on.size() == 5);
    CHECK(off[0] > 0);
    CHECK(on[1] - on[0] == off[1] - off[0]);
    for (size_t s = 2; s < off.size(); ++s) {
      CAPTURE(s);
      CHECK(off[s] == off[1]);
      CHECK(on[s] <= on[1]);
    }
  }
}

TEST_CASE("ddp.graphs: DdpTrainer's graphed steps equal its uncaptured ones bit for bit") {
  // Two hand-launched ranks, 12 steps alternating two shapes (8 rows, then 5: uneven chunks),
  // clipping active, 64-byte buckets (several), graphs off and on (CPU devices run the captured
  // segments' recordings). Each shape runs uncaptured twice, is captured on
  // its third step and replayed after: 8 of the 12 steps replay. Graphed, the bucket
  // all-reduces are held by the graph, launched from backward's hooks (as NCCL's would be on
  // GPUs: CPU graphs record them as ops), or with --graph-collectives off run between its two
  // graphs after backward. Every rank ends with the same weights, bit for bit, all three ways;
  // the last step (a replayed short one) reads the host once, allocates nothing, and hands the
  // group what an uncaptured step does; as many buckets launch before backward's end in the
  // graph as in uncaptured steps (some), none between graphs.
  std::string dir = dist_test::make_temp_dir("ddp_graphs");
  std::vector<std::string> args = {"--mode",      "ddp",           "--steps",
                                   "12",          "--short-every", "2",
                                   "--clip-grad", "0.001",         "--bucket-cap-bytes",
                                   "64",          "--cuda-graphs"};
  args.push_back("off");
  const std::array<LastStep, 2> off = ddp_pair(dir, "g_off", args);
  args.back() = "on";
  const std::array<LastStep, 2> on = ddp_pair(dir, "g_on", args);
  args.insert(args.end(), {"--graph-collectives", "off"});
  const std::array<LastStep, 2> between = ddp_pair(dir, "g_between", args);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(off[r].graphed == 0);
    CHECK(off[r].overlapped > 0);
    CHECK(off[r].payload > 0);
    for (const LastStep* l : {&on[r], &between[r]}) {
      CHECK(l->graphed == 8);
      CHECK(l->syncs == 1);
      CHECK(l->allocations == 0);
      CHECK(l->payload == off[r].payload);
      CHECK(l->norm > 0.001f);  // the clip was active
      CHECK(l->norm == off[r].norm);
      CHECK(l->weights == off[0].weights);
    }
    CHECK(on[r].in_graph == 1);
    CHECK(on[r].overlapped == off[r].overlapped);
    CHECK(between[r].in_graph == 0);
    CHECK(between[r].overlapped == 0);
    CHECK(off[r].weights == off[0].weights);
  }
  CHECK(off[0].weights.size() == 16);

  // One shape, but each rank's share of the kept tokens and the fp16 loss scale change every
  // step: both are read on the device, so 10 of the 12 steps replay the one capture, to the
  // same weights as uncaptured steps.
  args = {"--mode",          "ddp", "--steps",       "12", "--clip-grad", "0.001",
          "--moving-shares", "3",   "--cuda-graphs", "off"};
  const std::array<LastStep, 2> moving_off = ddp_pair(dir, "m_off", args);
  args.back() = "on";
  const std::array<LastStep, 2> moving_on = ddp_pair(dir, "m_on", args);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(moving_off[r].graphed == 0);
    CHECK(moving_on[r].graphed == 10);
    CHECK(moving_on[r].syncs == 1);
    CHECK(moving_on[r].allocations == 0);
    // The scale grows until a step overflows (its norm is then NaN, and it is skipped): the
    // same bits either way.
    CHECK(std::memcmp(&moving_on[r].norm, &moving_off[r].norm, sizeof(float)) == 0);
    CHECK(moving_on[r].scale == moving_off[r].scale);
    CHECK(moving_on[r].scale != 1024.f);  // the scale moved
    CHECK(moving_on[r].weights == moving_off[0].weights);
    CHECK(moving_off[r].weights == moving_off[0].weights);
  }
}

namespace {

// dist_worker --mode ddp for 8 steps with `flags` on 2 ranks, graphs off, then on: each graphed
// rank replays `graphed` steps, its last allocating nothing, says nothing of graphs, and ends
// with graphs off's losses and weights, bit for bit.
void check_graphed_as_off(const char* tag, const std::vector<std::string>& flags, int graphed) {
  std::string dir = dist_test::make_temp_dir(tag);
  std::vector<std::string> args = {"--mode", "ddp", "--steps", "8"};
  args.insert(args.end(), flags.begin(), flags.end());
  args.insert(args.end(), {"--cuda-graphs", "off"});
  const std::array<LastStep, 2> off = ddp_pair(dir, "off", args);
  args.back() = "on";
  const std::array<LastStep, 2> on = ddp_pair(dir, "on", args);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CAPTURE(on[r].output);
    CHECK(off[r].graphed == 0);
    CHECK(on[r].graphed == graphed);
    CHECK(on[r].allocations == 0);
    CHECK(on[r].losses == off[r].losses);
    CHECK(on[r].weights == off[0].weights);
    CHECK(on[r].output.find("graphs off") == std::string::npos);
  }
  CHECK(off[0].weights.size() == 16);
}

}  // namespace

TEST_CASE("ddp.graphs: an update's temporary takes the block backward freed in the first graph") {
  // A temporary in backward and one in the optimizer's step: eagerly the second reuses the
  // first's block, which the captured backward keeps. The update's graph shares the first
  // one's pool, so step 3 captures both (before, the update's capture found no block and ran
  // uncaptured): steps 3 to 8 replay.
  check_graphed_as_off("ddp_graph_pool", {"--scratch-update"}, 6);
}

TEST_CASE("ddp.graphs: a hook that baked the host share in is replayed only at that share") {
  // Research code's capturable hook reads GradBucket::share on the host in its queued ops
  // (dist_worker --host-share-hook scales by 1 / share, then by the device's share_at). With
  // --moving-shares K, each rank's share of the kept tokens changes from step to step, the
  // shape staying:
  //   - K = 3: the share of step 3's capture differs from step 2's, which was observed
  //     (kernels::Graph::observe): the capture names the scale it was handed and fails, and
  //     every step runs uncaptured;
  //   - K = 5: steps 2 and 3 share a share, so step 3's capture bakes it in and step 4, at
  //     another share, turns graphs off, saying why (a replay would divide by step 3's share).
  // Either way graphs off's losses and weights, bit for bit. With an even batch the share stays
  // 0.5: steps 3 to 8 replay, and nothing is said.
  std::string dir = dist_test::make_temp_dir("ddp_host_share");
  for (int moving : {3, 5, 0}) {
    CAPTURE(moving);
    std::vector<std::string> args = {"--mode", "ddp", "--steps", "8", "--host-share-hook"};
    if (moving) args.insert(args.end(), {"--moving-shares", std::to_string(moving)});
    args.insert(args.end(), {"--cuda-graphs", "off"});
    const std::string name = "moving_" + std::to_string(moving);
    const std::array<LastStep, 2> off = ddp_pair(dir, name + "_off", args);
    args.back() = "on";
    const std::array<LastStep, 2> on = ddp_pair(dir, name + "_on", args);
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      CAPTURE(on[r].output);
      CHECK(off[r].graphed == 0);
      CHECK(on[r].graphed == (moving == 3 ? 0 : moving == 5 ? 1 : 6));
      REQUIRE(on[r].losses.size() == 8);
      CHECK(on[r].losses == off[r].losses);
      CHECK(on[r].weights == off[0].weights);
      const std::string where =
          "ddp: graphs off: rank " + std::to_string(r) + " (cpu:" + std::to_string(r) + "): ";
      const std::string observed =
          "ddp: graphs off: capture failed on rank " + std::to_string(r) +
          " (cpu:" + std::to_string(r) +
          "): a host value changed between steps on cpu:" + std::to_string(r) +
          " (in Sequential/backward > ddp/comm_hook[bucket 0]): scale's argument `alpha` was ";
      const std::string read = where +
                               "the comm hook 'host-share' read GradBucket::share on the host "
                               "while the step was captured (";
      CHECK((on[r].output.find(observed) != std::string::npos) == (moving == 3));
      CHECK((on[r].output.find(read) != std::string::npos) == (moving == 5));
      CHECK((on[r].output.find("graphs off") != std::string::npos) == (moving != 0));
    }
    CHECK(off[0].weights.size() == 16);
  }
}

TEST_CASE("ddp.graphs: a capture that lacked cached memory once is captured at the next step") {
  // A backward temporary that grows once more at step 3's capture: it lacks cached memory, runs
  // uncaptured (caching a block of the new size), and step 4 captures it: steps 4 to 8 replay,
  // graphs staying on.
  check_graphed_as_off("ddp_graph_retry", {"--scratch-grows-until", "2"}, 5);
}

TEST_CASE("ddp.metrics_lag: each step returns the one before's loss, the run trains bit for bit") {
  // Two hand-launched ranks, 6 steps alternating two shapes, clipping active, graphs off and
  // on, and ZeRO-1 (its clip from the shards' norms, on the device): with --metrics-lag 1 each
  // step returns the previous step's loss (NaN first) and finish_metrics() the last, every one
  // the loss lag 0 returned; the weights and the last norm are lag 0's, and each step waits on
  // the host once (for the step before it).
  std::string dir = dist_test::make_temp_dir("ddp_lag");
  for (auto [graphs, zero] :
       {std::pair<std::string, std::string>{"off", "0"}, {"on", "0"}, {"off", "1"}}) {
    CAPTURE(graphs);
    CAPTURE(zero);
    std::vector<std::string> args = {"--mode",        "ddp",   "--steps",       "6",
                                     "--clip-grad",   "0.001", "--short-every", "2",
                                     "--cuda-graphs", graphs,  "--zero",        zero};
    const std::string name = graphs + "_zero" + zero;
    const std::array<LastStep, 2> now = ddp_pair(dir, "now_" + name, args);
    args.insert(args.end(), {"--metrics-lag", "1"});
    const std::array<LastStep, 2> lagged = ddp_pair(dir, "lag_" + name, args);
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      REQUIRE(now[r].losses.size() == 6);
      REQUIRE(lagged[r].losses.size() == 7);
      CHECK(std::isnan(lagged[r].losses[0]));
      for (size_t s = 0; s < 6; ++s) CHECK(lagged[r].losses[s + 1] == now[r].losses[s]);
      CHECK(lagged[r].weights == now[0].weights);
      CHECK(lagged[r].norm == now[r].norm);
      CHECK(lagged[r].syncs == 1);
      CHECK(lagged[r].allocations == 0);
    }
  }
}

TEST_CASE(
    "ddp.zero: overlapped ZeRO-1 trains plain DDP's bits: graphs off and on, lagged, clipped") {
  // --zero-overlap: the gradient meets in DDP's buckets while backward runs, each rank steps its
  // shard of it (SGD momentum: state to shard; the flat buffer of 195 values gives rank 0 [0, 64)
  // and rank 1 the rest), then the shards are all-gathered. Every rank holds the same reduced
  // gradient as plain DDP and the update is elementwise, so the losses, the clip's norm and the
  // weights are plain DDP's, bit for bit, graphed (the all-gather after the graphs) or not.
  std::string dir = dist_test::make_temp_dir("ddp_zero_overlap");
  for (auto [graphs, lag] :
       {std::pair<std::string, std::string>{"off", "0"}, {"on", "0"}, {"off", "1"}}) {
    CAPTURE(graphs);
    CAPTURE(lag);
    std::vector<std::string> args = {
        "--mode",        "ddp",  "--steps",       "6", "--clip-grad", "0.001", "--short-every", "2",
        "--cuda-graphs", graphs, "--metrics-lag", lag, "--momentum"};
    const std::string name = graphs + "_lag" + lag;
    const std::array<LastStep, 2> plain = ddp_pair(dir, "plain_" + name, args);
    args.insert(args.end(), {"--zero", "1", "--zero-overlap"});
    const std::array<LastStep, 2> zero = ddp_pair(dir, "zero_" + name, args);
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      REQUIRE(zero[r].losses.size() == plain[r].losses.size());
      // Bit for bit (lagged, the first step's is NaN on both).
      CHECK(std::memcmp(zero[r].losses.data(), plain[r].losses.data(),
                        plain[r].losses.size() * sizeof(float)) == 0);
      CHECK(zero[r].weights == plain[0].weights);
      CHECK(zero[r].norm == plain[r].norm);
      CHECK(zero[r].graphed == plain[r].graphed);        // graphed where plain DDP is
      if (graphs == "on") CHECK(zero[r].graphed == 2);   // each shape's third run on
      CHECK(zero[r].overlapped == plain[r].overlapped);  // the buckets launched beside backward
      // The all-gather's bytes beside the all-reduce's, as every rank hands them over: its own
      // shard of 64 values, and the tail of 67 that rank 1 broadcasts.
      CHECK(zero[r].payload == plain[r].payload + (64 + 67) * 4);
    }
  }
}

TEST_CASE(
    "dist.claim: two hand-launched jobs on one port, no job id: no rank trains with the "
    "other job's") {
  // Job A (batch 8) and job B (batch 6), each of 2 ranks, on one port. A's rank 0 hosts the
  // store (and holds it 3 s once it trained); B's rank 0 cannot bind the port.
  // Round 0: B's rank 1 comes before A's and takes rank 1; A's rank 1 comes 0.2 s later. A's
  // rank 0 and B's rank 1 stop, naming the batch, or, when A's rank 1 collided before the
  // rendezvous was sealed, the collision (under load B's rank 0 may bind the port A's rank 0 just
  // freed and pair with A's rank 1, which stops them too). Round 1: job A assembled and trained
  // first; B's rank 1
  // is refused at once and A is undisturbed. Either way B never trains, no rank of A trains
  // with B's, and every process ends well within the bounds (DP_TIMEOUT 10 s).
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    std::string dir = dist_test::make_temp_dir("two_jobs");
    const int port = net::find_free_port();
    const std::vector<std::string> job_a = {"--mode", "ddp", "--batch", "8", "--hold-ms", "3000"};
    const std::vector<std::string> job_b = {"--mode", "ddp", "--batch", "6"};
    auto t0 = Clock::now();
    HandRank a0(dir, "a0", 0, 2, port, job_a);
    std::unique_ptr<HandRank> a1, b0, b1;
    if (round == 0) {
      std::this_thread::sleep_for(200ms);
      b0 = std::make_unique<HandRank>(dir, "b0", 0, 2, port, job_b);
      b1 = std::make_unique<HandRank>(dir, "b1", 1, 2, port, job_b);
      std::this_thread::sleep_for(200ms);
      a1 = std::make_unique<HandRank>(dir, "a1", 1, 2, port, job_a, "3");
    } else {
      a1 = std::make_unique<HandRank>(dir, "a1", 1, 2, port, job_a);
      for (int i = 0; i < 2000 && !contains(a0.output(), "ddp ok"); ++i)
        std::this_thread::sleep_for(10ms);
      REQUIRE(contains(a0.output(), "ddp ok"));
      b0 = std::make_unique<HandRank>(dir, "b0", 0, 2, port, job_b);
      b1 = std::make_unique<HandRank>(dir, "b1", 1, 2, port, job_b);
    }
    int ca0 = a0.wait(40s), ca1 = a1->wait(40s), cb0 = b0->wait(40s), cb1 = b1->wait(40s);
    const double s = seconds_since(t0);
    const std::string oa0 = a0.output(), oa1 = a1->output(), ob0 = b0->output(), ob1 = b1->output();
    MESSAGE("a0:\n" << oa0 << "a1:\n" << oa1 << "b0:\n" << ob0 << "b1:\n" << ob1);
    CHECK(cb0 == 1);
    CHECK(cb1 == 1);  // B never trains
    // B's rank 0 finds the port taken; or, in round 0 on a loaded machine, it binds only after
    // A's rank 0 stopped at its mismatch with B's rank 1 and freed the port, and then it hosts
    // a store for A's rank 1: that pair stops at the batch too (seen under a full CPU load).
    const bool b0_hosted_a1 =
        round == 0 && contains(ob0, "config mismatch: field \"batch\"") && !contains(oa1, "ddp ok");
    CHECK((contains(ob0, "cannot start the store server") || b0_hosted_a1));
    CHECK_FALSE(contains(ob0 + ob1, "ddp ok"));
    if (round == 0) {
      CHECK(ca0 == 1);
      CHECK(ca1 == 1);
      CHECK_FALSE(contains(oa0 + oa1, "ddp ok"));
      const std::string mismatch = "config mismatch: field \"batch\": rank 0 has 8, rank 1 has 6";
      const std::string collision = "rank 1 was claimed by 2 processes";
      CHECK((contains(oa0, mismatch) || contains(oa0, collision)));
      CHECK((contains(ob1, mismatch) || contains(ob1, collision)));
    } else {
      CHECK(ca0 == 0);
      CHECK(ca1 == 0);
      CHECK(contains(ob1, "rank 1 is already taken"));
    }
    CHECK(s < 20.0);
  }
}

TEST_CASE("dist.rendezvous: a rank waiting for rank 0's store says so, then fails in time") {
  std::string dir = dist_test::make_temp_dir("wait_store");
  const int port = net::find_free_port();
  auto t0 = Clock::now();
  HandRank r1(dir, "r1", 1, 2, port, {"--mode", "ddp"}, "3");
  int code = r1.wait(20s);
  const double s = seconds_since(t0);
  const std::string out = r1.output();
  MESSAGE(out);
  CHECK(code == 1);
  CHECK(count_of(out, "dp: rank 1: waiting for the store at 127.0.0.1:" + std::to_string(port)) >=
        2);
  CHECK(contains(out, "rank 0 of 2 never joined within 3 s"));
  CHECK(!contains(out, " ms:"));  // no slice's bound posing as the wait ("within 1 ms")
  CHECK(s < 8.0);
}

// ---- the --timeout flag -----------------------------------------------------------------------

TEST_CASE("dist.cli: a --timeout below the 1 ms resolution is refused, not taken as the default") {
  auto parse = [](const std::string& value) -> std::string {
    CLI::App app("t");
    double seconds = 0;
    app.add_option("--timeout", seconds)->check(dp::cli::timeout_seconds(604800));
    std::vector<std::string> args = {value, "--timeout"};  // CLI11 parses from the back
    try {
      app.parse(args);
    } catch (const CLI::ParseError& e) {
      return e.what();
    }
    return "ok";
  };
  CHECK(parse("0.001") == "ok");
  CHECK(parse("30") == "ok");
  CHECK(parse("0.0001") ==
        "--timeout: 0.0001 is below the resolution of 0.001 s (it would round "
        "to 0, the default): give seconds in [0.001, 604800]");
  CHECK(contains(parse("0"), "0 is not allowed: give seconds in [0.001, 604800]"));
  CHECK(contains(parse("abc"), "'abc' is not a number"));
  CHECK(contains(parse("1e9"), "is not allowed"));
}
