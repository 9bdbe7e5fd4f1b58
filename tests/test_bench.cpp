// dp_bench: the report's formulas, and the command's JSON, trace and sweep outputs.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "benchmarks/report.hpp"
#include "tests/test_util.hpp"

namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  return nlohmann::json::parse(f);
}

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/dp_test_bench_" + std::to_string(getpid()) + "_" +
         name;
}

int run_bench(const std::string& args) {
  std::string cmd =
      std::string(DP_BENCH_PATH) + " " + args + " > " + temp_path("out.txt") + " 2>&1";
  int rc = std::system(cmd.c_str());
  std::ifstream out(temp_path("out.txt"));
  std::stringstream ss;
  ss << out.rdbuf();
  MESSAGE(ss.str());
  return rc;
}

void throw_if(int rc) {
  if (rc != 0) throw std::runtime_error("non-zero exit");
}

}  // namespace

TEST_CASE("bench.theory: bytes moved per step") {
  const int64_t p = 1000;
  CHECK(bench::dp_bytes_theory(1, p) == 0);
  CHECK(bench::dp_bytes_theory(4, p) == 6000);  // 2 (N-1) P
  CHECK(bench::ring_bytes_theory(1, p) == 0);
  CHECK(bench::ring_bytes_theory(4, p) == 1500);  // 2 (N-1)/N P
  CHECK(bench::ring_bytes_theory(8, 8000) == 14000);
}

TEST_CASE("bench.projection: alpha-beta step time against hand-computed values") {
  bench::Link link{"test", 100e9, 10e-6};  // 100 GB/s, 10 us
  const int64_t p = 400'000'000;           // 400 MB of parameters
  // DP, N=4: 6 messages of P through device 0: 6 * (10 us + 4 ms) = 24.06 ms, + 10 + 1 ms.
  CHECK(bench::projected_step_s("dp", 4, 0.010, 0.001, p, link) ==
        doctest::Approx(0.011 + 6 * (10e-6 + 0.004)));
  // DDP ring, N=4: 6 messages of P/4: 6 * (10 us + 1 ms) = 6.06 ms.
  CHECK(bench::projected_step_s("ddp", 4, 0.010, 0.001, p, link) ==
        doctest::Approx(0.011 + 6 * (10e-6 + 0.001)));
  CHECK(bench::projected_step_s("ddp", 1, 0.010, 0.001, p, link) == doctest::Approx(0.011));
  // The star loses to the ring by nearly N: 14 messages of P against 14 of P/8.
  double dp8 = bench::projected_step_s("dp", 8, 0, 0, p, link);
  double ddp8 = bench::projected_step_s("ddp", 8, 0, 0, p, link);
  CHECK(dp8 / ddp8 == doctest::Approx((10e-6 + 0.004) / (10e-6 + 0.0005)));
}

TEST_CASE("bench.projection: compute scales from the fewest-device run") {
  bench::RunResult one, four;
  one.mode = four.mode = "dp";
  one.gpus = 1;
  four.gpus = 4;
  one.param_bytes = four.param_bytes = 64'000'000;
  one.phases_ms = {{"forward", 30}, {"backward", 50}, {"optimizer", 2}};
  four.phases_ms = {{"forward", 1}, {"backward", 1}, {"optimizer", 2}};  // ignored: not the source
  auto ps = bench::project({four, one});
  REQUIRE(ps.size() == 4);  // N = 4, 8 on NVLink4 and PCIe Gen5
  for (auto& p : ps) {
    CHECK(p.source_gpus == 1);
    CHECK(p.compute_s == doctest::Approx(0.080 / p.gpus));
  }
  // PCIe Gen5, N = 8: 80 ms / 8 = 10 ms compute, 2 ms opt, 14 transfers of 64 MB.
  auto& pcie8 = ps[3];
  CHECK(pcie8.link == "PCIe Gen5");
  CHECK(pcie8.gpus == 8);
  CHECK(pcie8.step_s == doctest::Approx(0.010 + 0.002 + 14 * (10e-6 + 64e6 / 64e9)));
}

TEST_CASE("bench.stats: percentiles and throughput") {
  CHECK(bench::percentile({}, 0.5) == 0);
  CHECK(bench::percentile({3, 1, 2}, 0.5) == 2);
  CHECK(bench::percentile({1, 2, 3, 4}, 0.9) == doctest::Approx(3.7));
  bench::RunResult r;
  r.batch = 256;
  r.step_ms = {10, 20, 30};
  CHECK(r.samples_per_s() == doctest::Approx(256 / 0.020));
  nlohmann::json j = bench::run_to_json(r);
  bench::RunResult back = bench::run_from_json(j);
  CHECK(back.step_ms == r.step_ms);
  CHECK(back.batch == 256);
}

TEST_CASE("bench.cli: JSON schema and trace for both modes on CPU devices") {
  std::string json = temp_path("run.json"), trace = temp_path("trace.json");
  REQUIRE(run_bench("--device cpu --gpus 2 --mode both --steps 3 --warmup 1 --batch 32 --json " +
                    json + " --trace " + trace) == 0);
  auto j = read_json(json);
  CHECK(j["device"] == "cpu");
  CHECK(j["logical_devices"] == 2);
  REQUIRE(j["runs"].is_array());
  int dp_runs = 0, ddp_runs = 0;
  for (auto& r : j["runs"]) {
    for (const char* key :
         {"mode", "gpus", "step_ms_median", "step_ms_p90", "samples_per_s", "phases_ms",
          "bytes_per_step", "bytes_theory", "peak_mem_bytes", "final_loss"})
      CHECK_MESSAGE(r.contains(key), key);
    CHECK(r["peak_mem_bytes"].size() == r["gpus"].get<size_t>());
    CHECK(r["step_ms_median"].get<double>() > 0);
    dp_runs += r["mode"] == "dp";
    ddp_runs += r["mode"] == "ddp";
  }
  CHECK(dp_runs == 2);  // N=1 baseline and N=2
  CHECK(ddp_runs == 2);
  // DP and DDP follow the same loss curve on the same global batches.
  std::vector<float> dp_loss, ddp_loss;
  for (auto& r : j["runs"])
    if (r["gpus"] == 2)
      (r["mode"] == "dp" ? dp_loss : ddp_loss) = r["losses"].get<std::vector<float>>();
  REQUIRE(dp_loss.size() == 3);
  REQUIRE(ddp_loss.size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK(ddp_loss[i] == doctest::Approx(dp_loss[i]).epsilon(1e-4));

  auto t = read_json(trace);
  REQUIRE(t["traceEvents"].is_array());
  std::set<std::string> names;
  for (auto& e : t["traceEvents"]) {
    if (e["ph"] != "X") continue;
    CHECK(e["dur"].get<double>() >= 0);
    names.insert(e["name"].get<std::string>());
  }
  CHECK(names.count("dp/forward") == 1);
  CHECK(names.count("dp/reduce") == 1);
  CHECK(names.count("ddp/backward") == 1);
  std::remove(json.c_str());
  std::remove(trace.c_str());
}

TEST_CASE("bench.cli: sweep writes a CSV row per mode and count") {
  std::string csv = temp_path("sweep.csv"), chart = temp_path("sweep.svg");
  REQUIRE(run_bench("--device cpu --mode dp --sweep 1,2 --steps 2 --warmup 0 --batch 16 --csv " +
                    csv + " --chart " + chart) == 0);
  std::ifstream f(csv);
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(f, line)) lines.push_back(line);
  REQUIRE(lines.size() == 3);
  CHECK(lines[0].rfind("mode,gpus,", 0) == 0);
  CHECK(lines[1].rfind("dp,1,", 0) == 0);
  CHECK(lines[2].rfind("dp,2,", 0) == 0);
  std::remove(csv.c_str());
  std::remove(chart.c_str());
}

TEST_CASE("bench.cli: DDP over two nodes of two ranks equals four ranks on one node") {
  int port = 20000 + static_cast<int>(getpid() % 20000);
  std::string common =
      "--device cpu --mode ddp --gpus 2 --steps 3 --warmup 0 --batch 24 "
      "--nnodes 2 --master-port " +
      std::to_string(port);
  std::string json = temp_path("nodes.json"), one = temp_path("one.json");
  // Node 1 in the background, node 0 in the foreground; both launch two ranks on loopback.
  // (timeout: node 1 must not outlive a failed node 0)
  std::string node1 = "timeout 120 " + std::string(DP_BENCH_PATH) + " " + common +
                      " --node-rank 1 > " + temp_path("node1.txt") + " 2>&1 &";
  REQUIRE(std::system(node1.c_str()) == 0);
  REQUIRE(run_bench(common + " --node-rank 0 --json " + json) == 0);
  REQUIRE(run_bench("--device cpu --mode ddp --gpus 4 --steps 3 --warmup 0 --batch 24 "
                    "--baseline 0 --json " +
                    one) == 0);
  auto nodes = read_json(json)["runs"][0], single = read_json(one)["runs"][0];
  CHECK(nodes["gpus"] == 4);
  CHECK(nodes["losses"] == single["losses"]);
  CHECK_THROWS_AS(throw_if(run_bench("--device cpu --mode dp --nnodes 2 --master-port 1234")),
                  std::runtime_error);
  std::remove(json.c_str());
  std::remove(one.c_str());
}

TEST_CASE("bench.cli: ranks started by an external launcher join and rank 0 reports") {
  int port = 20000 + static_cast<int>((getpid() + 7919) % 20000);
  std::string json = temp_path("external.json"), ref = temp_path("external_ref.json");
  std::string env =
      "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port);
  std::string args = " --device cpu --mode ddp --steps 3 --warmup 0 --batch 24";
  // torchrun's environment, set by hand: rank 1 in the background, rank 0 in the foreground.
  std::string rank1 = env + " RANK=1 LOCAL_RANK=1 timeout 120 " + std::string(DP_BENCH_PATH) +
                      args + " > " + temp_path("rank1.txt") + " 2>&1 &";
  REQUIRE(std::system(rank1.c_str()) == 0);
  std::string rank0 = env + " RANK=0 LOCAL_RANK=0 timeout 120 " + std::string(DP_BENCH_PATH) +
                      args + " --json " + json + " > " + temp_path("rank0.txt") + " 2>&1";
  REQUIRE(std::system(rank0.c_str()) == 0);
  REQUIRE(run_bench(args + " --gpus 2 --baseline 0 --json " + ref) == 0);
  auto external = read_json(json)["runs"][0], launched = read_json(ref)["runs"][0];
  CHECK(external["gpus"] == 2);
  CHECK(external["losses"] == launched["losses"]);
  std::remove(json.c_str());
  std::remove(ref.c_str());
}

TEST_CASE("ddp.timeout: dp_bench --timeout names the rank that never joined") {
  // WORLD_SIZE=2 with only rank 0 started: it names rank 1 after 2 s instead of waiting 300 s.
  int port = 20000 + static_cast<int>((getpid() + 104729) % 20000);
  std::string out = temp_path("timeout.txt");
  std::string cmd =
      "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
      " RANK=0 LOCAL_RANK=0 timeout 60 " + std::string(DP_BENCH_PATH) +
      " --device cpu --mode ddp --steps 1 --warmup 0 --batch 8 --timeout 2 > " + out + " 2>&1";
  int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(out.c_str());
  CHECK(rc != 0);
  CHECK(WEXITSTATUS(rc) != 124);  // not the outer `timeout 60`
  CHECK_MESSAGE(text.find("rank 1 of 2 never joined within 2 s") != std::string::npos, text);
  // While it waits, rank 0 says for whom (every timeout / 3 here, every 10 s by default).
  CHECK_MESSAGE(text.find("1 of 2 ranks joined; waiting for rank 1") != std::string::npos, text);
  CHECK(run_bench("--device cpu --mode ddp --timeout 0") != 0);  // a zero timeout is refused
}

TEST_CASE("bench.cli: bad flags give a clear error") {
  CHECK(run_bench("--mode tp") != 0);
  CHECK(run_bench("--device cpu --sweep 1,x") != 0);
  CHECK(run_bench("--device cpu --dtype bf16") != 0);
}
