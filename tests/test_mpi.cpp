// MPI under a real mpirun (loopback): a failing or hung rank ends the job with a clear message
// and no orphans, and dp_bench's DDP over MPI follows the same losses as DP and DDP over Gloo.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dp/distributed/launcher.hpp"
#include "tests/test_util.hpp"

namespace {

struct Run {
  int rc = -1;
  std::string output;
};

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/dp_test_mpi_" + std::to_string(getpid()) + "_" + name;
}

// Runs a shell command bounded by `timeout` (exit 124 when it ran out), output captured.
Run run(const std::string& cmd, int timeout_s = 120) {
  std::string out = temp_path("out.txt");
  std::string full =
      "timeout -k 5 " + std::to_string(timeout_s) + " " + cmd + " > " + out + " 2>&1";
  int status = std::system(full.c_str());
  Run r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  r.output = ss.str();
  std::remove(out.c_str());
  MESSAGE(r.output);
  return r;
}

// True when a process whose command line holds `--job-tag tag` still runs a few seconds after
// the job ended (mpirun reaps its ranks as it exits; the wait only absorbs that). The pattern
// starts with "[-]" so that it does not match the shell that runs pgrep.
bool any_process_with(const std::string& tag) {
  std::string cmd = "pgrep -f -- '[-]-job-tag " + tag + "' > /dev/null";
  for (int i = 0; i < 50; ++i) {
    if (std::system(cmd.c_str()) != 0) return false;
    usleep(100 * 1000);
  }
  return true;
}

std::string mpirun(int n) {
  return std::string(DP_MPIRUN) + " -np " + std::to_string(n) + " ";
}

}  // namespace

TEST_CASE("dist.mpi: a rank that fails ends the whole mpirun job, with no orphans") {
  std::string tag = "fail_" + std::to_string(getpid());
  Run r = run(mpirun(3) + DP_MPI_WORKER_PATH + " --fail-rank 1 --job-tag " + tag);
  CHECK(r.rc != 0);
  CHECK(r.rc != 124);  // ended by the failure, not by the test's time limit
  CHECK(r.output.find("rank 1: error: injected failure on this rank") != std::string::npos);
  CHECK(r.output.find("MPI_Abort") != std::string::npos);
  CHECK_FALSE(any_process_with(tag));
}

TEST_CASE("dist.mpi: an op a rank never joins times out, is named, and ends the job") {
  std::string tag = "hang_" + std::to_string(getpid());
  Run r = run(mpirun(3) + DP_MPI_WORKER_PATH + " --hang-rank 2 --timeout-ms 1500 --job-tag " + tag);
  CHECK(r.rc != 0);
  CHECK(r.rc != 124);
  CHECK(r.output.find("mpi all_reduce(sum) of 8 x f32 on cpu:0 did not complete within 1500 ms "
                      "on rank 0 of 3") != std::string::npos);
  CHECK(r.output.find("MPI_Abort") != std::string::npos);
  CHECK_FALSE(any_process_with(tag));
}

// ---- ranks prove they agree before they talk (dp/distributed/config_check.hpp) ---------------

// `mpirun -np 1 dist_worker ... <a> : -np 1 dist_worker ... <b>`: two ranks of one job whose
// command lines differ (MPMD), as a hand-edited job script makes them.
std::string mpmd(const std::string& tag, const std::string& a, const std::string& b) {
  std::string worker =
      std::string(DP_DIST_WORKER_PATH) + " --mode ddp --backend mpi --job-tag " + tag + " ";
  return mpirun(1) + worker + a + " : -np 1 " + worker + b;
}

TEST_CASE("dist.mpi: MPMD ranks with different --batch fail together, naming the field") {
  std::string tag = "batch_" + std::to_string(getpid());
  auto t0 = std::chrono::steady_clock::now();
  Run r = run(mpmd(tag, "--batch 256", "--batch 128"), 60);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(r.rc != 0);
  CHECK(r.rc != 124);  // ended by the check, not by the test's time limit
  for (const char* rank : {"rank 0 of 2", "rank 1 of 2"})
    CHECK(r.output.find(std::string(rank) + ": config mismatch: field \"batch\": rank 0 has 256, "
                                            "rank 1 has 128") != std::string::npos);
  CHECK(r.output.find("ddp ok") == std::string::npos);
  CHECK(s < 30);
  CHECK_FALSE(any_process_with(tag));
}

TEST_CASE("dist.mpi: MPMD ranks with different --steps fail together, not inside Open MPI") {
  // Unchecked, rank 1 would run collectives rank 0 never issues (NBC_Progress segfaults,
  // MPI_ERR_TRUNCATE): the handshake stops both before the first.
  std::string tag = "steps_" + std::to_string(getpid());
  Run r = run(mpmd(tag, "--steps 3", "--steps 2"), 60);
  CHECK(r.rc != 0);
  CHECK(r.rc != 124);
  CHECK(r.output.find("config mismatch: field \"steps\": rank 0 has 3, rank 1 has 2") !=
        std::string::npos);
  CHECK(r.output.find("MPI_ERR") == std::string::npos);
  CHECK(r.output.find("ddp ok") == std::string::npos);
  CHECK_FALSE(any_process_with(tag));
}

TEST_CASE("dist.mpi: MPMD ranks that agree train over MPI") {
  std::string tag = "agree_" + std::to_string(getpid());
  Run r = run(mpmd(tag, "--batch 8 --steps 2", "--batch 8 --steps 2"), 60);
  CHECK(r.rc == 0);
  CHECK(r.output.find("[rank 0] ddp ok") != std::string::npos);
  CHECK(r.output.find("[rank 1] ddp ok") != std::string::npos);
}

TEST_CASE(
    "dist.mpi: two mpirun jobs on one MASTER_PORT (gloo): the second is refused, the "
    "first trains") {
  // Each mpirun job's ranks share its PMIX_NAMESPACE, their job id: job B's rank 1 reaches job
  // A's store and is refused at connect; B's rank 0 cannot bind the port; A is undisturbed.
  std::string tag = "twojobs_" + std::to_string(getpid());
  int port = dp::dist::find_free_port();
  std::string env =
      " -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=" + std::to_string(port) + " -x DP_TIMEOUT=15 ";
  std::string worker =
      std::string(DP_DIST_WORKER_PATH) + " --mode ddp --backend gloo --job-tag " + tag;
  std::string a = temp_path("job_a.txt"), b = temp_path("job_b.txt");
  std::string script = "(" + mpirun(2) + env + worker + " --batch 8 --hold-ms 6000 > " + a +
                       " 2>&1; echo \"job A exit $?\" >> " + a + ") & sleep 3; " + mpirun(2) + env +
                       worker + " --batch 8 > " + b + " 2>&1; echo \"job B exit $?\" >> " + b +
                       "; wait";
  Run r = run("sh -c '" + script + "'", 90);
  auto slurp = [](const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    std::remove(path.c_str());
    return ss.str();
  };
  std::string oa = slurp(a), ob = slurp(b);
  MESSAGE("job A:\n" << oa << "job B:\n" << ob);
  CHECK(r.rc == 0);  // the script itself ended in time
  CHECK(oa.find("job A exit 0") != std::string::npos);
  CHECK(oa.find("[rank 0] ddp ok") != std::string::npos);
  CHECK(oa.find("[rank 1] ddp ok") != std::string::npos);
  CHECK(ob.find("job B exit 0") == std::string::npos);
  CHECK(ob.find("ddp ok") == std::string::npos);
  CHECK(ob.find("belongs to another job") != std::string::npos);
  CHECK_FALSE(any_process_with(tag));
}

#ifdef DP_BENCH_PATH
TEST_CASE("bench.mpi: DDP over MPI under mpirun follows DP's and Gloo DDP's losses") {
  std::string args = " --device cpu --steps 4 --warmup 1 --batch 42 --baseline 0 --json ";
  std::string mpi = temp_path("mpi.json"), dp = temp_path("dp.json"), gloo = temp_path("gloo.json");
  Run a = run(mpirun(4) + DP_BENCH_PATH + " --mode ddp --backend mpi" + args + mpi);
  REQUIRE(a.rc == 0);
  REQUIRE(run(std::string(DP_BENCH_PATH) + " --mode dp --gpus 4" + args + dp).rc == 0);
  REQUIRE(
      run(std::string(DP_BENCH_PATH) + " --mode ddp --backend gloo --gpus 4" + args + gloo).rc ==
      0);
  auto read = [](const std::string& path) {
    std::ifstream f(path);
    REQUIRE(f.good());
    return nlohmann::json::parse(f)["runs"][0];
  };
  auto m = read(mpi), d = read(dp), g = read(gloo);
  CHECK(m["mode"] == "ddp");
  CHECK(m["gpus"] == 4);
  REQUIRE(m["losses"].size() == d["losses"].size());
  REQUIRE(m["losses"].size() == g["losses"].size());
  for (size_t i = 0; i < m["losses"].size(); ++i) {
    double lm = m["losses"][i], ld = d["losses"][i], lg = g["losses"][i];
    CAPTURE(i);
    // Sums in another order: float rounding apart, nothing more.
    CHECK(std::abs(lm - ld) <= 1e-5 * std::abs(ld));
    CHECK(std::abs(lm - lg) <= 1e-5 * std::abs(lg));
  }
  for (const auto& p : {mpi, dp, gloo}) std::remove(p.c_str());
}

TEST_CASE("bench.mpi: graphed DDP over MPI replays its all-reduces in the graph, bit for bit") {
  // CPU devices' graphs record MPI's bucket all-reduces (launched from backward's hooks) and
  // replay them: every timed step replays, the losses are the uncaptured run's bit for bit.
  std::string args =
      " --mode ddp --backend mpi --device cpu --steps 4 --warmup 2 --batch 42 "
      "--baseline 0 --bucket-cap-mb 0.1 --first-bucket-mb 0.1 --json ";
  std::map<std::string, nlohmann::json> runs;
  for (const char* graphs : {"off", "on"}) {
    std::string json = temp_path(std::string("mpi_graphs_") + graphs + ".json");
    REQUIRE(run(mpirun(2) + DP_BENCH_PATH + " --cuda-graphs " + graphs + args + json).rc == 0);
    std::ifstream f(json);
    REQUIRE(f.good());
    runs[graphs] = nlohmann::json::parse(f)["runs"][0];
    std::remove(json.c_str());
  }
  const auto &on = runs["on"], &off = runs["off"];
  CHECK(on["gpus"] == 2);
  CHECK(on["graphed_steps"] == 4);
  CHECK(on["graph_collectives"] == "in graph");
  CHECK(on["buckets"].get<int>() > 1);
  CHECK(on["buckets_overlapped"] == off["buckets_overlapped"]);
  CHECK(on["bytes_per_step"] == off["bytes_per_step"]);
  CHECK(on["losses"] == off["losses"]);
}

TEST_CASE("bench.mpi: dp_bench ranks started with different --batch (MPMD) fail naming it") {
  std::string bench = std::string(DP_BENCH_PATH) +
                      " --mode ddp --backend mpi --device cpu --steps 2 --warmup 0 --baseline 0 ";
  Run r = run(mpirun(1) + bench + "--batch 256 : -np 1 " + bench + "--batch 128", 60);
  CHECK(r.rc != 0);
  CHECK(r.rc != 124);
  CHECK(r.output.find("config mismatch: --batch: rank 0 has 256, rank 1 has 128") !=
        std::string::npos);
}

TEST_CASE("bench.mpi: --backend mpi without mpirun says how to start the ranks") {
  Run r = run(std::string(DP_BENCH_PATH) + " --mode ddp --backend mpi --device cpu --steps 1");
  CHECK(r.rc == 1);
  CHECK(r.output.find("MPI ranks are started by mpirun") != std::string::npos);
  CHECK(r.output.find("mpirun -np 4 dp_bench") != std::string::npos);
}
#endif
