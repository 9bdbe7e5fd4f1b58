// MPI under a real mpirun (loopback): a failing or hung rank ends the job with a clear message
// and no orphans, and dp_bench's DDP over MPI follows the same losses as DP and DDP over Gloo.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

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

TEST_CASE("bench.mpi: --backend mpi without mpirun says how to start the ranks") {
  Run r = run(std::string(DP_BENCH_PATH) + " --mode ddp --backend mpi --device cpu --steps 1");
  CHECK(r.rc == 1);
  CHECK(r.output.find("MPI ranks are started by mpirun") != std::string::npos);
  CHECK(r.output.find("mpirun -np 4 dp_bench") != std::string::npos);
}
#endif
