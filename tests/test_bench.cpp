// dp_bench: the report's formulas, and the command's JSON, trace and sweep outputs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "benchmarks/report.hpp"
#include "dp/distributed/launcher.hpp"
#include "nn/train_state.hpp"
#include "tests/process_util.hpp"
#include "tests/test_util.hpp"

namespace {

// The dp_bench under test: the build's, or $DP_BENCH_PROGRAM (scripts/gpu_check.sh runs this
// binary from a bundle, away from the tree it was built in).
std::string bench_program() {
  const char* e = std::getenv("DP_BENCH_PROGRAM");
  return e && *e ? std::string(e) : std::string(DP_BENCH_BUILT);
}
#define DP_BENCH_PATH bench_program()

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  return nlohmann::json::parse(f);
}

std::string temp_path(const std::string& name) {
  return dp_test::temp_path("bench", name);
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

// Runs dp_bench with `env` ("NAME=value ...") added; returns its exit code as a shell reports
// it, and what it printed.
std::pair<int, std::string> bench_output(const std::string& args, const std::string& env = "") {
  std::string out = temp_path("flags.txt");
  int status =
      std::system((env + " " + DP_BENCH_PATH + " " + args + " > " + out + " 2>&1").c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {dp_test::shell_code(status), ss.str()};
}

// dp_bench refuses `args` before any run, saying `says`.
void refused(const std::string& args, const std::string& says) {
  auto [rc, text] = bench_output(args);
  INFO("dp_bench " << args << "\n" << text);
  CHECK(rc != 0);
  CHECK(text.find(says) != std::string::npos);
  CHECK(text.find("179769313486") == std::string::npos);  // CLI11's DBL_MAX range message
  CHECK(text.find("ms/step") == std::string::npos);       // no run happened
}

void throw_if(int rc) {
  if (rc != 0) throw std::runtime_error("non-zero exit");
}

}  // namespace

TEST_CASE("bench.theory: bytes moved per step") {
  const int64_t p = 1000;
  CHECK(bench::dp_bytes_theory(1, p) == 0);
  CHECK(bench::dp_bytes_theory(4, p) == 6000);            // 2 (N-1) P
  CHECK(bench::dp_bytes_theory(4, p, p / 2) == 4500);     // bf16 gradients: (N-1) (P + P/2)
  CHECK(bench::dp_bytes_theory(4, p, p, p / 2) == 7500);  // and bf16 weights: (N-1) (P + P/2 + P)
  // without the f32 bytes of the weights read through the bf16 ones: (N-1) (P - S + P/2 + P)
  CHECK(bench::dp_bytes_theory(4, p, p, p / 2, 800) == 5100);
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

TEST_CASE("bench.projection: printed only from GPU compute, else one line saying why") {
  bench::RunResult one;
  one.mode = "dp";
  one.gpus = 1;
  one.batch = 16;
  one.step_ms = {82};  // a report's run has its steps (read_projection_file checks them)
  one.param_bytes = 64'000'000;
  one.phases_ms = {{"forward", 30}, {"backward", 50}, {"optimizer", 2}};
  bench::Header cpu;
  cpu.device = "cpu";
  auto none = bench::projection_input(cpu, {one}, "");
  CHECK(none.runs.empty());
  std::ostringstream text;
  bench::print_projection(text, none);
  CHECK(text.str().find("left out") != std::string::npos);
  CHECK(text.str().find("CPU devices") != std::string::npos);
  CHECK(text.str().find("NVLink4 N=") == std::string::npos);
  CHECK(bench::to_json(cpu, {one}, none)["projection"].empty());

  bench::Header gpu = cpu;
  gpu.device = "NVIDIA H100 80GB HBM3";
  auto measured = bench::projection_input(gpu, {one}, "");
  REQUIRE(measured.runs.size() == 1);
  std::ostringstream gtext;
  bench::print_projection(gtext, measured);
  CHECK(gtext.str().find("NVLink4 N=4") != std::string::npos);
  CHECK(bench::to_json(gpu, {one}, measured)["projection"].size() == 4);

  // A CPU run projects from a GPU results file; a CPU results file is refused with a reason.
  std::string file = temp_path("gpu.json");
  {
    std::ofstream f(file);
    f << bench::to_json(gpu, {one}, measured).dump();
  }
  auto from_file = bench::projection_input(cpu, {}, file);
  REQUIRE(from_file.runs.size() == 1);
  CHECK(from_file.source.find("H100") != std::string::npos);
  CHECK(bench::project(from_file.runs)[0].compute_s == doctest::Approx(0.080 / 4));
  {
    std::ofstream f(file);
    f << bench::to_json(cpu, {one}, none).dump();
  }
  CHECK_THROWS_WITH_AS(bench::projection_input(cpu, {}, file),
                       doctest::Contains("holds CPU compute; the projection needs a GPU's"),
                       kernels::Error);
  {
    std::ofstream f(file);
    f << "not json";
  }
  CHECK_THROWS_WITH_AS(bench::projection_input(cpu, {}, file), doctest::Contains("--project-from"),
                       kernels::Error);
  // Values no run writes are refused, naming the run and the field; no runs: said so.
  struct Bad {
    const char* field;
    nlohmann::json value;
    const char* says;
  };
  const nlohmann::json good = bench::to_json(gpu, {one}, measured);
  for (const Bad& b :
       {Bad{"param_bytes", -1e18, "runs[0].param_bytes is -1e+18"},
        Bad{"step_ms", {1e308, 1e308}, "runs[0].step_ms[0] is 1e+308"},
        Bad{"step_ms", nlohmann::json::array(), "runs[0].step_ms is empty"},
        Bad{"gpus", 1099511627777, "runs[0].gpus is 1099511627777"},
        Bad{"gpus", 0, "runs[0].gpus is 0"}, Bad{"gpus", "four", "runs[0].gpus is \"four\""},
        Bad{"bucket_ready_frac", {1e308}, "bucket_ready_frac"},
        Bad{"phases_ms", nlohmann::json::object(),
            "runs[0].phases_ms is empty: the run's phases were not timed (--phase-times off)"},
        Bad{"phases_ms",
            {{"forward", -30}, {"backward", 50}},
            "runs[0].phases_ms.forward is -30: a dp_bench report holds [0, "},
        Bad{"phases_ms",
            {{"forward", 0}, {"backward", 0}, {"optimizer", 2}},
            "runs[0].phases_ms: forward + backward is 0 ms"}}) {
    CAPTURE(b.field);
    nlohmann::json j = good;
    j["runs"][0][b.field] = b.value;
    if (std::string(b.field) == "bucket_ready_frac") j["runs"][0]["bucket_bytes"] = {4096};
    {
      std::ofstream f(file);
      f << j.dump();
    }
    CHECK_THROWS_WITH_AS(bench::projection_input(cpu, {}, file), doctest::Contains(b.says),
                         kernels::Error);
  }
  {
    nlohmann::json j = good;
    j["runs"] = nlohmann::json::array();
    std::ofstream f(file);
    f << j.dump();
  }
  CHECK_THROWS_WITH_AS(bench::projection_input(cpu, {}, file),
                       doctest::Contains("holds no runs to project from"), kernels::Error);
  // "other" (the step less its timed phases) may fall a little below 0; it is not used.
  {
    nlohmann::json j = good;
    j["runs"][0]["phases_ms"]["other"] = -0.001;
    std::ofstream f(file);
    f << j.dump();
  }
  CHECK(bench::projection_input(cpu, {}, file).runs.size() == 1);
  // Another model's runs: refused, naming both.
  {
    nlohmann::json j = good;
    j["model"] = "gpt";
    j["params"] = 124;
    std::ofstream f(file);
    f << j.dump();
  }
  bench::Header mlp = cpu;
  mlp.model = "mlp";
  mlp.params = 7;
  CHECK_THROWS_WITH_AS(bench::projection_input(mlp, {}, file),
                       doctest::Contains("holds runs of gpt (124 parameters), and this run trains "
                                         "mlp (7): its projection would describe the other model"),
                       kernels::Error);
  std::remove(file.c_str());
  // off: no projection, said so, whatever the run (a GPU run makes no compute runs for it).
  auto off = bench::projection_input(cpu, {one}, "off");
  CHECK(off.runs.empty());
  CHECK(off.why_not == "--project-from off");
}

TEST_CASE("bench.overhead: (t_N - t_1) / N per mode, none without a baseline") {
  bench::RunResult one, four, ddp4;
  one.mode = four.mode = "dp";
  ddp4.mode = "ddp";
  one.gpus = 1;
  four.gpus = ddp4.gpus = 4;
  one.step_ms = {1.0, 1.0, 1.0};
  four.step_ms = {1.2, 1.4, 1.2};
  ddp4.step_ms = {2.0};
  std::vector<bench::RunResult> runs{one, four, ddp4};
  CHECK_FALSE(bench::overhead_us_per_device(runs, one).has_value());
  REQUIRE(bench::overhead_us_per_device(runs, four).has_value());
  CHECK(*bench::overhead_us_per_device(runs, four) == doctest::Approx(50.0));  // 200 us / 4
  CHECK_FALSE(bench::overhead_us_per_device(runs, ddp4).has_value());
  bench::Header h;
  h.device = "cpu";
  auto j = bench::to_json(h, runs, bench::projection_input(h, runs, ""));
  CHECK(j["runs"][1]["overhead_us_per_device"].get<double>() == doctest::Approx(50.0));
  CHECK_FALSE(j["runs"][0].contains("overhead_us_per_device"));
}

TEST_CASE("bench.ddp: a step's time is its slowest rank's") {
  // Two ranks, three steps: rank 1 is slower on steps 0 and 2.
  std::vector<float> all{1.0f, 2.0f, 1.0f, 1.5f, 1.0f, 3.0f};
  CHECK(bench::slowest_per_step(all, 2, 3) == std::vector<double>{1.5, 2.0, 3.0});
  CHECK(bench::slowest_per_step({}, 4, 0).empty());
  CHECK_THROWS_AS(bench::slowest_per_step(all, 4, 3), kernels::Error);
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

// The report's phases are those of each run's median step, with "other" the rest of it: they
// add up to that step, which is the run's step median (an odd count of steps: the median is a
// step), "other" never negative. DP's reduce_in_backward is inside backward and not added.
TEST_CASE("bench.report: the phases of the median step and other add up to the step median") {
  const std::string json = temp_path("phases.json");
  REQUIRE(run_bench("--device cpu --gpus 2 --mode both --steps 5 --warmup 1 --batch 16 --json " +
                    json) == 0);
  auto j = read_json(json);
  REQUIRE(j["runs"].size() == 4);
  for (auto& r : j["runs"]) {
    CAPTURE(r["mode"].get<std::string>());
    CAPTURE(r["gpus"].get<int>());
    const auto phases = r["phases_ms"].get<std::map<std::string, double>>();
    REQUIRE(phases.count("other") == 1);
    double sum = 0;
    for (const auto& [name, ms] : phases)
      if (name != "reduce_in_backward") sum += ms;
    const double step = r["phases_step_ms"].get<double>();
    CHECK(sum == doctest::Approx(step).epsilon(1e-9));
    CHECK(step == doctest::Approx(r["step_ms_median"].get<double>()).epsilon(0.01));
    // DP's phases are device 0's critical path, DDP's rank 0's: they never exceed the step.
    CHECK(phases.at("other") >= 0.0);
  }
}

// --model llama: the tiny Llama (nn/llama.hpp) on synthetic tokens, as --model gpt: DP and DDP
// follow one loss curve, with tokens/s and MFU.
TEST_CASE("bench.cli: --model llama runs DP and DDP on the tiny Llama, one loss curve") {
  const std::string json = temp_path("llama.json");
  REQUIRE(run_bench("--device cpu --model llama --gpus 2 --mode both --baseline 0 --steps 3 "
                    "--warmup 0 --seq 16 --json " +
                    json) == 0);
  auto j = read_json(json);
  CHECK(j["model"] == "llama-tiny");
  std::vector<float> dp_loss, ddp_loss;
  for (auto& r : j["runs"]) {
    CHECK(r["tokens_per_s"].get<double>() > 0);
    (r["mode"] == "dp" ? dp_loss : ddp_loss) = r["losses"].get<std::vector<float>>();
  }
  REQUIRE(dp_loss.size() == 3);
  REQUIRE(ddp_loss.size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK(ddp_loss[i] == doctest::Approx(dp_loss[i]).epsilon(1e-4));
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
  CHECK(names.count("dp/reduce[bucket 0]") == 1);
  CHECK(names.count("ddp/backward") == 1);
  // Tracks: DP's are devices, DDP's are ranks (one process each).
  std::map<std::string, std::set<std::string>> tracks;  // run name -> its track names
  std::map<int, std::string> run_of;
  for (auto& e : t["traceEvents"])
    if (e["name"] == "process_name") run_of[e["pid"].get<int>()] = e["args"]["name"];
  for (auto& e : t["traceEvents"])
    if (e["name"] == "thread_name")
      tracks[run_of[e["pid"].get<int>()]].insert(e["args"]["name"].get<std::string>());
  CHECK(tracks["dp N=2"].count("device 1") == 1);
  CHECK(tracks["ddp N=2"].count("rank 0") == 1);
  CHECK(tracks["ddp N=2"].count("rank 1") == 1);
  for (const std::string& name : tracks["ddp N=2"]) CHECK(name.rfind("rank ", 0) == 0);
  std::remove(json.c_str());
  std::remove(trace.c_str());
}

TEST_CASE("bench.cli: the DP trace shows bucket reductions overlapping backward") {
  // Small buckets (forced by flags) and both reduce topologies. A step overlaps when one of
  // its reduce slices starts before its last backward slice ends; the report counts buckets
  // the same way.
  for (const char* reduce : {"star", "tree"}) {
    CAPTURE(reduce);
    std::string trace = temp_path("overlap.json"), json = temp_path("overlap_run.json");
    REQUIRE(run_bench(std::string("--device cpu --mode dp --gpus 4 --baseline 0 --model mlp "
                                  "--batch 64 --steps 30 --warmup 1 --first-bucket-mb 0.01 "
                                  "--bucket-cap-mb 0.05 --dp-reduce ") +
                      reduce + " --trace " + trace + " --json " + json) == 0);
    auto run = read_json(json)["runs"][0];
    CHECK(run["reduce"] == reduce);
    CHECK(run["buckets"].get<int>() >= 3);
    REQUIRE(run["link_bytes"].size() == 4);
    // Device 0 sends its parameters to three replicas and takes in three gradients (star) or
    // two (tree: 1 -> 0, 3 -> 2, 2 -> 0).
    int64_t p = run["param_bytes"].get<int64_t>();
    CHECK(run["link_bytes"][0].get<int64_t>() == (std::string(reduce) == "star" ? 6 : 5) * p);
    std::map<int64_t, double> first_reduce, last_backward_end;
    auto events = read_json(trace);
    for (auto& e : events["traceEvents"]) {
      if (e["ph"] != "X" || !e.contains("args")) continue;
      int64_t step = e["args"]["step"].get<int64_t>();
      std::string name = e["name"].get<std::string>();
      double ts = e["ts"].get<double>(), end = ts + e["dur"].get<double>();
      if (name.rfind("dp/reduce[", 0) == 0)
        first_reduce[step] = first_reduce.count(step) ? std::min(first_reduce[step], ts) : ts;
      if (name == "dp/backward") last_backward_end[step] = std::max(last_backward_end[step], end);
    }
    REQUIRE(first_reduce.size() == 30);
    // Overlap needs two workers running at once: over 30 steps some do even on 2 busy cores.
    int overlapped = 0;
    for (auto& [step, ts] : first_reduce) overlapped += ts < last_backward_end[step];
    CHECK(overlapped > 0);
    std::remove(trace.c_str());
    std::remove(json.c_str());
  }
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
  CHECK(lines[0].find("overhead_us_per_device") != std::string::npos);
  std::remove(csv.c_str());
  std::remove(chart.c_str());
}

TEST_CASE("bench.cli: DDP over two nodes of two ranks equals four ranks on one node") {
  // With dropout: node 1's ranks draw as ranks 2 and 3 do on one node, not as its local 0, 1.
  int port = dp::dist::find_free_port();
  const std::string model = "--model gpt --gpt-config tiny --seq 16 --dropout 0.1 ";
  std::string common = "--device cpu --mode ddp --gpus 2 --steps 3 --warmup 0 --batch 24 " + model +
                       "--nnodes 2 --master-port " + std::to_string(port);
  std::string json = temp_path("nodes.json"), one = temp_path("one.json");
  // Node 1 in the background, node 0 in the foreground; both launch two ranks on loopback.
  // (timeout: node 1 must not outlive a failed node 0)
  std::string node1 = "timeout 120 " + std::string(DP_BENCH_PATH) + " " + common +
                      " --node-rank 1 > " + temp_path("node1.txt") + " 2>&1 &";
  REQUIRE(std::system(node1.c_str()) == 0);
  REQUIRE(run_bench(common + " --node-rank 0 --json " + json) == 0);
  REQUIRE(run_bench("--device cpu --mode ddp --gpus 4 --steps 3 --warmup 0 --batch 24 " + model +
                    "--baseline 0 --json " + one) == 0);
  auto nodes = read_json(json)["runs"][0], single = read_json(one)["runs"][0];
  CHECK(nodes["gpus"] == 4);
  CHECK(nodes["losses"] == single["losses"]);
  CHECK_THROWS_AS(throw_if(run_bench("--device cpu --mode dp --nnodes 2 --master-port 1234")),
                  std::runtime_error);
  std::remove(json.c_str());
  std::remove(one.c_str());
}

TEST_CASE("bench.cli: ranks started by an external launcher join and rank 0 reports") {
  int port = dp::dist::find_free_port();
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

TEST_CASE("bench.cli: an external rank refuses flags it cannot honour, and ranks of two --seq") {
  int port = dp::dist::find_free_port();
  const std::string env =
      "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
      " RANK=0 LOCAL_RANK=0 timeout 60";
  // Before, each ran DDP alone and ignored the flag: --mode both ran no DP, --trace wrote no
  // file, --gpus 3 ran 2 ranks. Refused before any rendezvous (no rank 1 is started).
  auto external_refuses = [&](const std::string& flags, const std::string& why) {
    auto [rc, out] = bench_output("--device cpu --steps 1 " + flags, env);
    CHECK(rc != 0);
    CHECK_MESSAGE(out.find(why) != std::string::npos, out);
    CHECK(out.find("never joined") == std::string::npos);
  };
  external_refuses("--mode both", "--mode both in a rank started by torchrun (2 ranks)");
  external_refuses("--mode ddp --trace " + temp_path("t.json"),
                   "--trace in a rank started by torchrun");
  external_refuses("--mode ddp --sweep 1,2", "--sweep in a rank started by torchrun");
  external_refuses("--mode ddp --gpus 3",
                   "--gpus 3 in a rank started by torchrun (2 ranks) with 2 on this");
  external_refuses("--mode ddp --nnodes 2 --master-port 1234", "the launcher sets the nodes");
  // Ranks of another --seq trained apart with no error (dp_bench's run config lacked it).
  const std::string both = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                           std::to_string(dp::dist::find_free_port());
  const std::string args =
      " --device cpu --mode ddp --steps 1 --warmup 0 --baseline 0 --model gpt --batch 4";
  const std::string rank1 = both + " RANK=1 LOCAL_RANK=1 timeout 60 " + std::string(DP_BENCH_PATH) +
                            args + " --seq 32 > " + temp_path("seq1.txt") + " 2>&1 &";
  REQUIRE(std::system(rank1.c_str()) == 0);
  auto [rc, out] = bench_output(args + " --seq 16", both + " RANK=0 LOCAL_RANK=0 timeout 60");
  CHECK(rc != 0);
  CHECK_MESSAGE(
      out.find("config mismatch: --seq: rank 0 has 16, rank 1 has 32") != std::string::npos, out);
}

TEST_CASE("ddp.timeout: dp_bench --timeout names the rank that never joined") {
  // WORLD_SIZE=2 with only rank 0 started: it names rank 1 after 2 s instead of waiting 300 s.
  int port = dp::dist::find_free_port();
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
  CHECK(run_bench("--device cpu --dtype fp8") != 0);
  CHECK(run_bench("--device cpu --comm-dtype fp16") != 0);
  CHECK(run_bench("--device cpu --dp-reduce ring") != 0);
  CHECK(run_bench("--device cpu --dp-peer-reads sometimes") != 0);
  CHECK(run_bench("--device cpu --project-from /nonexistent/gpu.json") != 0);
}

TEST_CASE("bench.ps: --mode ps sets the parameter server beside DP on the same samples") {
  std::string json = temp_path("ps.json"), trace = temp_path("ps_trace.json");
  REQUIRE(run_bench("--device cpu --mode ps --gpus 3 --steps 4 --warmup 1 --batch 30 --json " +
                    json + " --trace " + trace) == 0);
  auto j = read_json(json);
  CHECK(j["mode"] == "ps");
  CHECK(j["samples"] == 150);
  CHECK(j["dp"]["updates"] == 5);
  CHECK(j["dp"]["curve"].size() == 5);
  CHECK(j["ps"]["updates"] == 15);  // 150 samples in batches of 30 / 3
  CHECK(j["ps"]["curve"].size() == 15);
  CHECK(j["ps"]["curve"].back()["samples"] == 150);
  // What the figures rest on, as every report says it (the ps report named no library).
  CHECK(j["environment"]["libraries"].contains("openblas"));
  CHECK(j["environment"].contains("cpu_gemm"));
  {
    auto [rc, text] = bench_output("--device cpu --mode ps --gpus 2 --steps 2 --warmup 0");
    CHECK(rc == 0);
    CHECK(text.find("\nlibraries: openblas ") != std::string::npos);
  }
  int64_t hist = 0;
  for (auto c : j["ps"]["staleness_histogram"]) hist += c.get<int64_t>();
  CHECK(hist == 15);
  int64_t pushes = 0;
  for (auto c : j["ps"]["pushes_per_worker"]) pushes += c.get<int64_t>();
  CHECK(pushes == 15);
  std::set<int> tracks;
  auto events = read_json(trace)["traceEvents"];
  for (auto& e : events)
    if (e["ph"] == "X") tracks.insert(e["tid"].get<int>());
  CHECK(tracks == std::set<int>{0, 1, 2, 3});  // three workers and the server
  REQUIRE(run_bench("--device cpu --mode ps --gpus 2 --steps 2 --warmup 0 --batch 8 "
                    "--max-staleness 0 --json " +
                    json) == 0);
  CHECK(read_json(json)["ps"]["staleness_histogram"] == nlohmann::json::array({4}));
  std::remove(json.c_str());
  std::remove(trace.c_str());
}

TEST_CASE("bench.zero: --zero 1 holds 1/N of the optimizer state per rank, same losses") {
  std::string plain = temp_path("plain.json"), zero = temp_path("zero.json");
  std::string args =
      "--device cpu --mode ddp --gpus 3 --optim adamw --steps 3 --warmup 1 "
      "--batch 30 --baseline 0 --json ";
  REQUIRE(run_bench(args + plain) == 0);
  REQUIRE(run_bench(args + zero + " --zero 1") == 0);
  auto p = read_json(plain)["runs"][0], z = read_json(zero)["runs"][0];
  CHECK(z["zero"] == 1);
  CHECK(z["optim"] == "adamw");
  int64_t whole = p["optimizer_state_bytes"][0].get<int64_t>(), sum = 0;
  for (auto b : p["optimizer_state_bytes"]) CHECK(b.get<int64_t>() == whole);
  for (auto b : z["optimizer_state_bytes"]) {
    CHECK(b.get<int64_t>() <= whole / 3 + 8 * 64 * 3);  // a third, and the last rank's tail
    sum += b.get<int64_t>();
  }
  CHECK(sum == whole);
  REQUIRE(z["losses"].size() == p["losses"].size());
  for (size_t i = 0; i < p["losses"].size(); ++i)
    CHECK(z["losses"][i].get<double>() ==
          doctest::Approx(p["losses"][i].get<double>()).epsilon(1e-5));
  std::remove(plain.c_str());
  std::remove(zero.c_str());
}

TEST_CASE("bench.zero: --zero-overlap: 1/N of the state, plain DDP's losses, bf16 buckets too") {
  std::string plain = temp_path("plain.json"), zero = temp_path("zero.json");
  for (std::string comm : {"fp32", "bf16"}) {
    CAPTURE(comm);
    std::string args =
        "--device cpu --mode ddp --gpus 3 --optim adamw --steps 3 --warmup 1 --batch 30 "
        "--baseline 0 --comm-dtype " +
        comm + " --json ";
    REQUIRE(run_bench(args + plain) == 0);
    REQUIRE(run_bench(args + zero + " --zero 1 --zero-overlap") == 0);
    auto p = read_json(plain)["runs"][0], z = read_json(zero)["runs"][0];
    CHECK(z["zero"] == 1);
    CHECK(z["zero_overlap"] == true);
    int64_t whole = p["optimizer_state_bytes"][0].get<int64_t>(), sum = 0;
    for (auto b : z["optimizer_state_bytes"]) {
      CHECK(b.get<int64_t>() <= whole / 3 + 8 * 64 * 3);  // a third, and the last rank's tail
      sum += b.get<int64_t>();
    }
    CHECK(sum == whole);
    CHECK(z["losses"] == p["losses"]);  // the same bits: the same reduced gradient everywhere
  }
  std::remove(plain.c_str());
  std::remove(zero.c_str());
}

TEST_CASE("bench.flags: zero, negative, text and huge values are refused in plain words") {
  const std::string cpu = "--device cpu --steps 1 --warmup 0 ";
  refused(cpu + "--batch 0", "--batch: 0 is out of range: give a whole number in [1, 2147483648]");
  refused(cpu + "--batch -8", "--batch: -8 is out of range");
  refused(cpu + "--batch 99999999999999999999", "--batch: 99999999999999999999 is out of range");
  refused(cpu + "--gpus -1", "--gpus: -1 is out of range: give a whole number in [1, 1024]");
  refused(cpu + "--gpus 0", "--gpus: 0 is out of range");
  refused("--device cpu --steps abc", "--steps: 'abc' is not a whole number: give one in [1, ");
  refused("--device cpu --steps 2147483647", "--steps: 2147483647 is out of range");
  refused("--device cpu --warmup -5", "--warmup: -5 is out of range");
  refused(cpu + "--seed -1", "--seed: -1 is out of range");
  refused(cpu + "--baseline 2", "--baseline: 2 is out of range: give a whole number in [0, 1]");
  refused(cpu + "--bucket-cap-mb -1", "--bucket-cap-mb: -1 is not allowed: give a number > 0");
  refused(cpu + "--first-bucket-mb nan", "--first-bucket-mb: nan is not allowed");
  // Flags that would do nothing with the others given are refused, naming what they need.
  refused(cpu + "--mode ddp --dp-reduce tree",
          "--dp-reduce tree with --mode ddp: it sets DP's reduce to device 0");
  refused(cpu + "--mode dp --max-staleness 2", "--max-staleness 2 with --mode dp");
  refused(cpu + "--mode dp --staleness-lr", "--staleness-lr with --mode dp");
  refused(cpu + "--mode ps --sweep 1,2", "--sweep 1,2 with --mode ps");
  refused(cpu + "--mode ps --repeat 2", "--repeat 2 with --mode ps");
  refused(cpu + "--mode dp --sweep 1,2 --gpus 4",
          "--gpus 4 with --sweep 1,2: the sweep's counts are the device counts (the largest is 2)");
  refused(cpu + "--mode dp --sweep 2,2", "--sweep '2,2': 2 is given twice");
  refused(cpu + "--mode dp --sweep ''", "--sweep: the list is empty");
  refused(cpu + "--mode dp --keep 2", "--keep requires --checkpoint-dir");
  refused(cpu + "--mode dp --sync-bn", "--sync-bn with --model mlp: the model has no BatchNorm");
  refused(cpu + "--mode ps --model resnet --sync-bn", "--sync-bn with --mode ps");
  refused(cpu + "--mode dp --max-local-ranks 2",
          "--max-local-ranks 2 with --mode dp: it bounds the processes a launcher starts");
  refused(cpu + "--mode ps --max-local-ranks 2", "--max-local-ranks 2 with --mode ps");
  refused(cpu + "--dtype tf32 --max-skip-fraction 0.1",
          "--max-skip-fraction 0.1 with --dtype tf32: fp32 and tf32 runs take every step");
  refused(cpu + "--mode hybrid --model resnet --sync-bn",
          "--sync-bn with --mode hybrid: its devices would combine BatchNorm statistics within "
          "their node only");
  refused(cpu + "--first-bucket-mb 0.0000001",
          "--first-bucket-mb: 0.0000001 MiB is 0 bytes, less than one f32 gradient: give at "
          "least");
  refused(cpu + "--master-port 70000", "--master-port: 70000 is out of range");
  // Products: per-device batch x devices, checked instead of wrapping round.
  refused(cpu + "--mode dp --gpus 4 --batch-per-device 1073741824",
          "--batch-per-device 1073741824 x --gpus 4 = 4294967296 is more than the 2147483648 "
          "allowed");
  refused(cpu + "--mode dp --gpus 4 --batch-per-device 4611686018427387904",
          "--batch-per-device: 4611686018427387904 is out of range");
  // A device or rank without rows.
  refused(cpu + "--mode ddp --gpus 4 --batch 3",
          "--batch 3 leaves some of the 4 ranks without rows: give --batch >= 4");
}

TEST_CASE("bench.flags: output paths are checked before the run") {
  std::string dir = temp_path("outdir");
  REQUIRE(std::system(("mkdir -p " + dir).c_str()) == 0);
  const std::string cpu = "--device cpu --mode dp --gpus 1 --baseline 0 --steps 1 --warmup 0 ";
  refused(cpu + "--json " + dir,
          "--json: '" + dir + "' is a directory: give a file name inside it");
  refused(cpu + "--trace /nonexistent_dp_dir/t.json",
          "--trace: cannot write '/nonexistent_dp_dir/t.json': its directory "
          "'/nonexistent_dp_dir' does not exist");
  std::string file = temp_path("plain.txt");
  std::ofstream(file) << "x\n";
  refused(cpu + "--json " + file + "/out.json", "is not a directory");
  refused(cpu + "--json /proc/dp_bench_test.json",
          "--json: cannot create '/proc/dp_bench_test.json'");
  refused(cpu + "--sweep 1 --csv " + dir, "--csv: '" + dir + "' is a directory");
  refused(cpu + "--sweep 1 --csv " + temp_path("s.csv") + " --chart " + dir,
          "--chart: '" + dir + "' is a directory");
  // A file that is not the program's is never replaced; nor is a checkpoint, or one output by
  // another.
  refused(
      cpu + "--json " + file,
      "--json: '" + file +
          "' exists and is not a report of dp_bench, train_mnist, bench_kernels or bench_composed");
  refused(cpu + "--trace " + file, "--trace: '" + file + "' exists and is not a trace of dp_bench");
  refused(cpu + "--sweep 1 --csv " + file,
          "--csv: '" + file + "' exists and is not a sweep table of dp_bench");
  const std::string both = temp_path("both.json");
  refused(cpu + "--json " + both + " --trace " + both,
          "--json " + both + " and --trace " + both + " name one file");
  refused(cpu + "--checkpoint-dir " + dir + " --json " + dir + "/step_00000001.safetensors",
          "--json " + dir +
              "/step_00000001.safetensors is a checkpoint's name in "
              "--checkpoint-dir " +
              dir);
  std::ifstream kept(file);
  CHECK(std::string((std::istreambuf_iterator<char>(kept)), std::istreambuf_iterator<char>()) ==
        "x\n");
  std::filesystem::remove_all(dir);
  // A writable path is accepted, and not left behind by the check when the run fails later.
  std::string json = temp_path("never.json");
  refused(cpu + "--json " + json + " --profile-steps 5", "--profile-steps '5'");
  CHECK(!std::filesystem::exists(json));
}

TEST_CASE("bench.flags: a batch too large for memory is refused before anything is allocated") {
  // Under a 6 GiB address-space limit: building the batch first (an 8 GB index vector, 3 TB of
  // images) would fail differently, and could not take the machine down. A sanitizer build's
  // program maps terabytes of shadow at start, which that limit forbids: its allocator is bounded
  // instead (no single allocation over 6 GiB; a larger one throws std::bad_alloc).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  const std::string bound = "max_allocation_size_mb=6144:allocator_may_return_null=1";
  const std::string limit = "export ASAN_OPTIONS=\"$ASAN_OPTIONS:" + bound +
                            "\" TSAN_OPTIONS=\"$TSAN_OPTIONS:" + bound + "\"; ";
#else
  const std::string limit = "ulimit -v 6291456; ";
#endif
  std::string out = temp_path("memory.txt");
  for (const char* mode : {"dp", "ddp"}) {
    CAPTURE(mode);
    std::string cmd = limit + DP_BENCH_PATH + " --device cpu --gpus 2 --baseline 0 --mode " + mode +
                      " --batch 1000000000 --steps 1 --warmup 0 > " + out + " 2>&1";
    int status = std::system(("bash -c '" + cmd + "'").c_str());
    std::ifstream f(out);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    INFO(text);
    CHECK(dp_test::shell_code(status) == 1);
    CHECK(text.find("--batch 1000000000 (" +
                    std::string(mode[1] == 'd' ? "DDP on 2 ranks" : "DP on 2 devices")) !=
          std::string::npos);
    CHECK(text.find("needs at least") != std::string::npos);
    CHECK(text.find("but the host has") != std::string::npos);
    CHECK(text.find("give a smaller batch") != std::string::npos);
    CHECK(text.find("launch_workers") == std::string::npos);  // no rank was started
  }
}

// The inputs fit (a million rows of 128 tokens), the activations do not: each tiny-GPT sequence
// takes about 5 MiB through a step, measured on a probe step of 1 and 2 rows, so the run is
// refused with that figure before any engine starts, instead of the OOM killer ending it.
TEST_CASE("bench.flags: a batch whose activations do not fit the host is refused with the figure") {
  const auto t0 = std::chrono::steady_clock::now();
  auto [rc, text] = bench_output(
      "--device cpu --model gpt --gpt-config tiny --gpus 2 --mode both --batch 1000000 --steps 1 "
      "--warmup 0");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(text);
  CHECK(rc == 1);
  CHECK(text.find("--batch 1000000 (DP on 2 devices (cpu): 2 x (") != std::string::npos);
  CHECK(text.find("500000 rows x ") != std::string::npos);
  CHECK(text.find("of activations, measured on a probe step") != std::string::npos);
  CHECK(text.find("needs at least") != std::string::npos);
  CHECK(text.find("give a smaller batch") != std::string::npos);
  CHECK(text.find("ms/step") == std::string::npos);  // no run happened
  CHECK(seconds < 20);
  // In micro-batches, a device holds one micro-batch's rows: the figure says so, and more
  // micro-batches is advice while a micro-batch holds more than one row.
  auto [rc4, text4] = bench_output(
      "--device cpu --model gpt --gpt-config tiny --gpus 2 --mode dp --batch 1000000 --steps 1 "
      "--warmup 0 --micro-batches 4");
  INFO(text4);
  CHECK(rc4 == 1);
  CHECK(text4.find("125000 rows (one micro-batch of a 500000-row chunk) x ") != std::string::npos);
  CHECK(text4.find("give a smaller batch, or more --micro-batches") != std::string::npos);
}

// The same on a GPU: DP's step is measured on GPU 0 (its process holds a context anyway), and
// the batch is refused against GPU 0's memory with the figure; DDP's ranks then take the same
// figure (a DDP launcher alone creates no context: it checks the input chunks only).
TEST_CASE("bench.cuda: a batch whose activations do not fit GPU 0 is refused with the figure") {
  DP_REQUIRE_GPU();
  auto [rc, text] = bench_output(
      "--device cuda --model gpt --gpt-config tiny --gpus 2 --mode both --batch 1000000 "
      "--steps 1 --warmup 0");
  INFO(text);
  CHECK(rc == 1);
  CHECK(text.find("--batch 1000000 (DP on 2 devices (cuda), on GPU 0: ") != std::string::npos);
  CHECK(text.find("500000 rows x ") != std::string::npos);
  CHECK(text.find("of activations, measured on a probe step") != std::string::npos);
  CHECK(text.find("but GPU 0 has") != std::string::npos);
  CHECK(text.find("memory probe step on GPU 0 failed") == std::string::npos);
  CHECK(text.find("ms/step") == std::string::npos);  // no run happened
}

TEST_CASE("bench.flags: --max-restarts is bounded, DDP only, and needs a port for its nodes") {
  const std::string cpu = "--device cpu --steps 1 --warmup 0 --batch 8 ";
  refused(cpu + "--mode ddp --max-restarts -1",
          "--max-restarts: -1 is out of range: give a whole number in [0, 1000]");
  refused(cpu + "--mode ddp --max-restarts 1001", "--max-restarts: 1001 is out of range");
  refused(cpu + "--mode dp --max-restarts 1", "--max-restarts 1: only DDP");
  refused(cpu + "--mode ddp --nnodes 2 --master-port 65535 --max-restarts 1",
          "--max-restarts 1 with --nnodes 2 and --master-port 65535: the node launchers agree on "
          "restarts through a store on node 0 at the master port + 1");
}

TEST_CASE("bench.ddp: --max-restarts reaches the launcher: failing ranks are restarted") {
  // Every rank fails at once on a bad DP_TIMEOUT; the launcher's DP_HEARTBEAT_TIMEOUT keeps
  // its watch's wait for a store short.
  auto [rc, text] = bench_output(
      "--device cpu --mode ddp --gpus 2 --baseline 0 --steps 1 --warmup 0 --batch 8 "
      "--max-restarts 2",
      "DP_TIMEOUT=abc DP_HEARTBEAT_TIMEOUT=1");
  INFO(text);
  CHECK(rc == 1);  // the last attempt's exit code, which the launcher names
  CHECK(text.find("launch_workers: restart 1 of 2 after rank ") != std::string::npos);
  CHECK(text.find("launch_workers: restart 2 of 2 after rank ") != std::string::npos);
  CHECK(text.find("no restarts left (2 of 2 used); exit code 1") != std::string::npos);
}

TEST_CASE("bench.flags: DDP refuses more ranks than allowed, before starting any") {
  refused("--device cpu --mode ddp --gpus 3 --max-local-ranks 2 --batch 6 --steps 1 --warmup 0",
          "3 ranks on this node is more than the 2 allowed by --max-local-ranks");
  // 1024 ranks: more than 4 per core below 256 cores (a larger machine would start them).
  if (sysconf(_SC_NPROCESSORS_ONLN) < 256)
    refused("--device cpu --mode ddp --gpus 1024 --batch-per-device 1 --steps 1 --warmup 0",
            "ranks on this node is more than this machine can start");
}

TEST_CASE("bench.exit: SIGINT and SIGTERM give 130 and 143, workers are named, no file is left") {
  // TMPDIR is a fresh directory: whatever dp_bench leaves in it shows.
  std::string tmp = temp_path("tmpdir");
  std::filesystem::create_directories(tmp);
  auto start = [&] {
    pid_t pid =
        dp_test::spawn({DP_BENCH_PATH, "--device", "cpu", "--mode", "ddp", "--gpus", "2",
                        "--baseline", "0", "--batch", "8", "--steps", "10000000", "--warmup", "0"},
                       {"TMPDIR=" + tmp});
    REQUIRE(pid > 0);
    auto workers = dp_test::wait_for_workers(pid, 2, "LOCAL_RANK=", std::chrono::seconds(30));
    REQUIRE(workers.size() == 2);
    return std::make_pair(pid, workers);
  };
  for (int sig : {SIGINT, SIGTERM, SIGKILL}) {
    CAPTURE(sig);
    auto [launcher, workers] = start();
    for (pid_t w : workers) CHECK(dp_test::process_name(w) == "dp_bench");  // not "exe"
    ::kill(launcher, sig);
    int status = dp_test::wait_child(launcher, std::chrono::seconds(30));
    REQUIRE(status != -1);
    CHECK(dp_test::shell_code(status) == 128 + sig);
    CHECK(dp_test::all_gone_within(workers, std::chrono::seconds(10)));
    CHECK(std::filesystem::is_empty(tmp));
  }
  std::filesystem::remove_all(tmp);
}

TEST_CASE("bench.sync_bn: --sync-bn in DP and DDP follows one device and reports the exchange") {
  std::string json = temp_path("syncbn.json");
  REQUIRE(run_bench("--device cpu --model resnet --mode both --gpus 4 --steps 2 --warmup 0 "
                    "--batch 10 --sync-bn --json " +
                    json) == 0);
  auto runs = read_json(json)["runs"];
  REQUIRE(runs.size() == 4);  // dp 1, dp 4, ddp 1, ddp 4
  for (auto& r : runs) {
    CAPTURE(r["mode"]);
    CHECK(r["sync_bn_values_per_step"].get<int64_t>() > 0);
    // ResNet-8 (width 16): 9 BatchNorm layers (3 of 16 channels, 3 of 32, 3 of 64), 1 + 4C
    // values each.
    CHECK(r["sync_bn_values_per_step"] == 9 + 4 * (16 * 3 + 32 * 3 + 64 * 3));
  }
  for (int k : {1, 3}) {  // N = 4 against N = 1 of the same mode: the full batch's statistics
    auto one = runs[k - 1]["losses"], four = runs[k]["losses"];
    REQUIRE(one.size() == four.size());
    for (size_t i = 0; i < one.size(); ++i)
      CHECK(four[i].get<double>() == doctest::Approx(one[i].get<double>()).epsilon(1e-4));
  }
  std::remove(json.c_str());
}

TEST_CASE("bench.checkpoint: dp_bench resumes DP and DDP runs bit for bit (fp32, amp fp16)") {
  // fp16: the loss scaler's state travels in the file too.
  for (const auto& [mode, dtype] : std::vector<std::pair<std::string, std::string>>{
           {"dp", "fp32"}, {"ddp", "fp32"}, {"dp", "fp16"}, {"ddp", "fp16"}}) {
    CAPTURE(mode);
    CAPTURE(dtype);
    std::string a = temp_path("ck_a_" + mode + dtype), b = temp_path("ck_b_" + mode + dtype);
    std::filesystem::create_directories(a);
    std::filesystem::create_directories(b);
    const std::string common =
        "--device cpu --mode " + mode + " --gpus " + (mode == "dp" ? "4" : "2") +
        " --baseline 0 --steps 6 --warmup 0 --batch 10 --optim adamw " + "--dtype " + dtype + " ";
    std::string whole = temp_path("ck_whole.json"), rest = temp_path("ck_rest.json");
    REQUIRE(run_bench(common + "--checkpoint-dir " + a + " --save-every 3 --json " + whole) == 0);
    REQUIRE(run_bench(common + "--checkpoint-dir " + b + " --resume " + nn::checkpoint_file(a, 3) +
                      " --json " + rest) == 0);
    auto w = read_json(whole)["runs"][0]["losses"], r = read_json(rest)["runs"][0]["losses"];
    REQUIRE(w.size() == 6);
    REQUIRE(r.size() == 3);  // steps 3, 4, 5
    for (size_t i = 0; i < 3; ++i) CHECK(r[i] == w[i + 3]);
    std::ifstream fa(nn::checkpoint_file(a, 6), std::ios::binary),
        fb(nn::checkpoint_file(b, 6), std::ios::binary);
    std::string sa((std::istreambuf_iterator<char>(fa)), std::istreambuf_iterator<char>());
    std::string sb((std::istreambuf_iterator<char>(fb)), std::istreambuf_iterator<char>());
    CHECK(!sa.empty());
    CHECK(sa == sb);
    std::filesystem::remove_all(a);
    std::filesystem::remove_all(b);
  }
  refused("--device cpu --mode both --checkpoint-dir /tmp", "one run at a time");
  refused("--device cpu --mode dp --baseline 0 --save-every 3",
          "--save-every needs --checkpoint-dir");
}

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Every "param." tensor of a training state file, in name order, concatenated.
std::vector<float> saved_params(const std::string& path) {
  nn::io::FileReader r(path, "saved_params");
  const nn::safetensors::File f = nn::safetensors::read(r);
  std::vector<float> out;
  for (const auto& [name, t] : f.tensors) {
    if (name.rfind("param.", 0) != 0) continue;
    std::vector<float> v(static_cast<size_t>(t.numel));
    nn::safetensors::read_tensor(r, f, t, v.data(), "a tensor");
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

}  // namespace

TEST_CASE(
    "bench.checkpoint: --zero 1 resumes bit for bit at 2 and 4 ranks, and its 4-rank state "
    "resumes on 2 and 3 ranks and on DP with 3 devices and 1, following the run") {
  const std::string common =
      "--device cpu --baseline 0 --steps 6 --warmup 0 --batch 12 --optim adamw ";
  const std::string whole_json = temp_path("z_whole.json"), rest_json = temp_path("z_rest.json");
  std::map<int, std::string> dirs;
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    const std::string a = temp_path("z_a" + std::to_string(ranks)), b = temp_path("z_b");
    std::filesystem::remove_all(b);
    const std::string zero = common + "--mode ddp --zero 1 --gpus " + std::to_string(ranks) + " ";
    REQUIRE(run_bench(zero + "--checkpoint-dir " + a + " --save-every 3 --json " + whole_json) ==
            0);
    REQUIRE(run_bench(zero + "--checkpoint-dir " + b + " --resume " + nn::checkpoint_file(a, 3) +
                      " --json " + rest_json) == 0);
    auto w = read_json(whole_json)["runs"][0]["losses"],
         r = read_json(rest_json)["runs"][0]["losses"];
    REQUIRE(w.size() == 6);
    REQUIRE(r.size() == 3);
    for (size_t i = 0; i < 3; ++i) CHECK(r[i] == w[i + 3]);
    const std::string end_a = file_bytes(nn::checkpoint_file(a, 6));
    CHECK(!end_a.empty());
    CHECK(end_a == file_bytes(nn::checkpoint_file(b, 6)));  // state and step, bit for bit
    std::filesystem::remove_all(b);
    dirs[ranks] = a;
  }
  // The 4-rank state on another world: the same weights at the start (the file's), then the
  // uninterrupted run's losses and weights to float tolerance (another reduction order).
  const auto whole = read_json(whole_json)["runs"][0]["losses"];  // the 4-rank run, last
  const std::vector<float> end_weights = saved_params(nn::checkpoint_file(dirs[4], 6));
  for (const std::string& run :
       {std::string("--mode ddp --zero 1 --gpus 2"), std::string("--mode ddp --zero 1 --gpus 3"),
        std::string("--mode dp --gpus 3"), std::string("--mode dp --gpus 1")}) {
    CAPTURE(run);
    const std::string c = temp_path("z_c");
    std::filesystem::remove_all(c);
    auto [rc, text] = bench_output(common + run + " --checkpoint-dir " + c + " --resume " +
                                   nn::checkpoint_file(dirs[4], 3) + " --json " + rest_json);
    INFO(text);
    REQUIRE(rc == 0);
    CHECK(text.find("dp_bench: re-sharded a ddp checkpoint of 4 ranks onto") != std::string::npos);
    CHECK(text.find("so the continuation is not bit-exact") != std::string::npos);
    auto r = read_json(rest_json)["runs"][0]["losses"];
    REQUIRE(r.size() == 3);
    // The first step runs on the file's weights: the same loss but for the reduction order.
    CHECK(r[0].get<double>() == doctest::Approx(whole[3].get<double>()).epsilon(1e-6));
    for (size_t i = 0; i < 3; ++i)
      CHECK(r[i].get<double>() == doctest::Approx(whole[i + 3].get<double>()).epsilon(1e-5));
    const std::vector<float> got = saved_params(nn::checkpoint_file(c, 6));
    REQUIRE(got.size() == end_weights.size());
    CHECK(dp_test::rel_diff(got, end_weights) < 1e-4f);
    std::filesystem::remove_all(c);
  }
  // Another global batch stays refused, naming it.
  refused(
      "--device cpu --baseline 0 --steps 6 --warmup 0 --batch 10 --optim adamw --mode dp "
      "--gpus 2 --resume " +
          nn::checkpoint_file(dirs[4], 3),
      "saved with batch 12, this run has 10");
  for (auto& [n, dir] : dirs) std::filesystem::remove_all(dir);
}

TEST_CASE(
    "bench.checkpoint: --resume latest under --max-restarts skips a truncated newest checkpoint "
    "and goes on from the previous one, and a named damaged file is an error") {
  const std::string a = temp_path("trunc_a"), b = temp_path("trunc_b");
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
  const std::string common =
      "--device cpu --mode ddp --gpus 2 --baseline 0 --steps 6 --warmup 0 --batch 8 --optim adamw "
      "--save-every 2 ";
  REQUIRE(run_bench(common + "--checkpoint-dir " + a) == 0);
  const std::string end = file_bytes(nn::checkpoint_file(a, 6));
  REQUIRE(!end.empty());
  // A copy of the run's folder, its newest checkpoint cut short (a disk that lost its tail).
  std::filesystem::create_directories(b);
  for (int step : {2, 4}) std::filesystem::copy(nn::checkpoint_file(a, step), b);
  const std::string cut = nn::checkpoint_file(b, 6);
  std::ofstream(cut, std::ios::binary) << end.substr(0, end.size() / 2);
  auto [rc, text] =
      bench_output(common + "--checkpoint-dir " + b + " --resume latest --max-restarts 1");
  INFO(text);
  CHECK(rc == 0);
  CHECK(text.find("dp_bench: --resume latest: skipped " + cut + ": ") != std::string::npos);
  CHECK(text.find("truncated") != std::string::npos);
  CHECK(text.find("resuming from " + nn::checkpoint_file(b, 4)) != std::string::npos);
  CHECK(text.find("launch_workers: restart") == std::string::npos);  // the first attempt went on
  CHECK(file_bytes(cut) == end);  // steps 4 and 5 again: the run's own end, bit for bit
  // The damaged file named by --resume: an error naming it, no fallback.
  std::ofstream(cut, std::ios::binary) << end.substr(0, end.size() / 2);
  refused(
      "--device cpu --mode dp --gpus 2 --baseline 0 --steps 6 --warmup 0 --batch 8 --optim "
      "adamw --resume " +
          cut,
      "truncated");
  // Another model's state is refused from its header, once, before DDP's ranks start (each
  // rank refused it before, and the launcher then reported their exits).
  std::tie(rc, text) = bench_output(
      "--device cpu --mode ddp --gpus 2 --baseline 0 --steps 6 --warmup 0 --batch 8 --optim "
      "adamw --model cnn --resume " +
      nn::checkpoint_file(a, 6));
  CHECK(rc != 0);
  const std::string why = "saved with model mlp, this run has cnn";
  const size_t at = text.find(why);
  CHECK(at != std::string::npos);
  CHECK(text.find(why, at + 1) == std::string::npos);  // said once
  CHECK(text.find("rank") == std::string::npos);
  CHECK(text.find("launch") == std::string::npos);
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
}

TEST_CASE(
    "bench.amp: --dtype bf16 and fp16 report fp32's fields plus loss scale and skipped steps") {
  std::map<std::string, nlohmann::json> got;
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    std::string json = temp_path(std::string("amp_") + dtype + ".json");
    REQUIRE(run_bench("--device cpu --gpus 2 --mode both --steps 3 --warmup 1 --batch 32 --dtype " +
                      std::string(dtype) + " --json " + json) == 0);
    got[dtype] = read_json(json);
    std::remove(json.c_str());
  }
  for (const char* dtype : {"bf16", "fp16"}) {
    CAPTURE(dtype);
    const auto& j = got[dtype];
    CHECK(j["dtype"] == dtype);
    REQUIRE(j["runs"].size() == got["fp32"]["runs"].size());
    for (size_t i = 0; i < j["runs"].size(); ++i) {
      const auto& r = j["runs"][i];
      for (auto& [key, value] : got["fp32"]["runs"][i].items()) CHECK_MESSAGE(r.contains(key), key);
      CHECK(r["skipped_steps"] == 0);
      CHECK(r["loss_scale"].get<double>() == (std::string(dtype) == "fp16" ? 65536.0 : 1.0));
      // Rounding moves the curve a little, not a lot: within 1% of fp32's loss after 4 steps.
      CHECK(r["final_loss"].get<double>() ==
            doctest::Approx(got["fp32"]["runs"][i]["final_loss"].get<double>()).epsilon(0.01));
    }
  }
  std::string json = temp_path("amp_comm.json");
  auto [rc, text] = bench_output(
      "--device cpu --gpus 2 --mode both --baseline 0 --steps 2 "
      "--warmup 0 --batch 32 --dtype bf16 --comm-dtype bf16 --json " +
      json);
  CHECK(rc == 0);
  CHECK(text.find("loss scale 1, skipped steps 0") != std::string::npos);
  CHECK(text.find("gradients travel in bf16") != std::string::npos);
  nlohmann::json report = read_json(json);  // named: a range over a temporary's member
  for (auto& r : report["runs"]) {          // would read it after it is freed
    CAPTURE(r["mode"].get<std::string>());
    const int64_t p = r["param_bytes"].get<int64_t>();
    // DP: the bf16 weights (P/2, device 0's optimizer wrote them), the f32 biases (the Linear
    // weights are read through the bf16 copy alone) out and P/2 back per replica, counted as
    // copied; DDP: P/2 bytes of bf16 buckets handed to the group, which the ring model at N=2
    // puts on each rank's link whole.
    if (r["mode"] == "dp") {
      CHECK(r["bytes_theory"].get<int64_t>() > p / 2 + p / 2);
      CHECK(r["bytes_theory"].get<int64_t>() < p / 2 + p / 2 + p / 20);
    } else {
      CHECK(r["bytes_theory"] == p / 2);
    }
    CHECK(r["bytes_per_step"] == r["bytes_theory"]);
    CHECK(r["comm_dtype"] == "bf16");
  }
  std::remove(json.c_str());
}

TEST_CASE("bench.flags: flags another mode reads are refused, not ignored") {
  refused("--device cpu --gpus 2 --mode dp --zero 1",
          "--zero 1 with --mode dp: ZeRO-1 shards DDP's optimizer state");
  refused("--device cpu --gpus 2 --mode ps --zero 1", "--zero 1 with --mode ps");
  refused("--device cpu --gpus 2 --mode dp --backend mpi",
          "--backend mpi with --mode dp: MPI carries DDP's collectives");
  refused("--device cpu --gpus 2 --mode both --backend mpi", "--backend mpi with --mode both");
  refused("--device cpu --gpus 2 --mode ddp --dp-peer-reads off",
          "--dp-peer-reads off with --mode ddp: it sets how DP's reduce reads the replicas");
  refused("--device cpu --gpus 2 --mode dp --ddp-graph-collectives off",
          "--ddp-graph-collectives off with --mode dp: it places DDP's bucket all-reduces");
  refused("--device cpu --gpus 2 --mode ddp --cuda-graphs on --dp-graph-pulls beside",
          "--dp-graph-pulls beside with --mode ddp: it places DP's sums in a graphed step");
  // A flag that would change nothing is refused too: these steps are not graphed.
  refused("--device cpu --gpus 2 --mode dp --dp-graph-pulls beside",
          "--dp-graph-pulls beside places the sums of graphed DP steps, and this run's are not "
          "graphed: add --cuda-graphs on (auto is off on CPU devices)");
  refused("--device cpu --gpus 2 --mode dp --cuda-graphs off --dp-graph-pulls beside",
          "this run's are not graphed");
}

TEST_CASE("bench.cli: --dp-peer-reads off stages DP's pulls, with the losses of reads in place") {
  std::map<std::string, nlohmann::json> runs;
  for (const char* reads : {"auto", "off"}) {
    std::string json = temp_path(std::string("peer_reads_") + reads + ".json");
    REQUIRE(run_bench(std::string("--device cpu --mode dp --gpus 3 --batch 10 --steps 4 "
                                  "--warmup 1 --baseline 0 --dp-peer-reads ") +
                      reads + " --json " + json) == 0);
    runs[reads] = read_json(json)["runs"][0];
    std::remove(json.c_str());
  }
  CHECK(runs["auto"]["peer_reads"] == "auto");
  CHECK(runs["off"]["peer_reads"] == "off");
  CHECK(runs["off"]["losses"] == runs["auto"]["losses"]);
  // Device 0 holds a copy of each of the two replicas' gradients (f32) besides.
  const int64_t p = runs["auto"]["param_bytes"].get<int64_t>();
  CHECK(runs["off"]["peak_mem_bytes"][0].get<int64_t>() -
            runs["auto"]["peak_mem_bytes"][0].get<int64_t>() >=
        2 * p);
}

TEST_CASE("bench.flags: --zero 1 refuses bf16 communication, --mode ps mixed precision") {
  auto [rc, text] = bench_output("--device cpu --gpus 2 --mode ddp --zero 1 --comm-dtype bf16");
  CHECK(rc != 0);
  CHECK(text.find("--zero 1 with --comm-dtype bf16") != std::string::npos);
  CHECK(text.find("add --zero-overlap") != std::string::npos);
  auto [rc1, text1] = bench_output("--device cpu --gpus 2 --mode ddp --zero-overlap");
  CHECK(rc1 != 0);
  CHECK(text1.find("--zero-overlap without --zero 1") != std::string::npos);
  auto [rc2, text2] = bench_output("--device cpu --gpus 2 --mode ps --dtype fp16");
  CHECK(rc2 != 0);
  CHECK(text2.find("--mode ps with --dtype fp16") != std::string::npos);
}

TEST_CASE("bench.stats: the 95% bootstrap CI covers a known median about 95% of the time") {
  // Log-normal step times with median exp(mu) exactly: over many trials of K samples the
  // percentile bootstrap's interval must hold the true median (and the true ratio) in about 95%
  // of them. A broken resampler (too narrow, off-centre) fails this by a wide margin.
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> a_ms(std::log(2.0), 0.3), b_ms(std::log(0.5), 0.3);
  const int trials = 300, k = 25;
  int median_hits = 0, ratio_hits = 0;
  double width = 0;
  for (int t = 0; t < trials; ++t) {
    std::vector<double> a(k), b(k);
    for (int i = 0; i < k; ++i) a[i] = a_ms(rng), b[i] = b_ms(rng);
    bench::Estimate m = bench::median_ci(a, 100 + t);
    median_hits += m.contains(2.0);
    width += (m.hi - m.lo) / trials;
    bench::Estimate r = bench::ratio_ci(a, b, bench::Pairing::independent, 100 + t);
    ratio_hits += r.contains(4.0);
    CHECK(m.lo <= m.value);
    CHECK(m.value <= m.hi);
  }
  CHECK(median_hits >= 0.88 * trials);
  CHECK(median_hits <= 0.995 * trials);
  CHECK(ratio_hits >= 0.88 * trials);
  CHECK(ratio_hits <= 0.995 * trials);
  // sigma 0.3 at K = 25: the median's standard error is about 1.25 * 0.3 / 5 = 7.5% of it,
  // so the 95% interval is about 30% of 2.0 wide; a degenerate one would be near 0.
  CHECK(width == doctest::Approx(0.6).epsilon(0.35));
  // Reproducible: the same seed gives the same interval.
  std::vector<double> xs = {1, 2, 3, 4, 5, 6, 7};
  CHECK(bench::median_ci(xs, 3).lo == bench::median_ci(xs, 3).lo);
  CHECK(bench::median_ci(xs, 3).hi == bench::median_ci(xs, 3).hi);
  CHECK(bench::median_ci({}).samples == 0);
}

TEST_CASE("bench.stats: equal inputs are within noise, a clear difference is not") {
  std::vector<double> x = {1.10, 0.95, 1.02, 1.30, 0.98};
  bench::Estimate same = bench::ratio_ci(x, x, bench::Pairing::paired);
  CHECK(same.value == 1.0);
  CHECK(same.contains(1.0));
  CHECK(bench::describe(same, 1.0, 2).rfind("within noise (95% CI 1.00 to 1.00)", 0) == 0);
  bench::Estimate zero = bench::difference_ci(x, x, 1000.0 / 4, bench::Pairing::paired);
  CHECK(zero.contains(0.0));
  CHECK(bench::describe(zero, 0.0, 1).rfind("within noise", 0) == 0);
  std::vector<double> twice;
  for (double v : x) twice.push_back(2 * v);
  bench::Estimate two = bench::ratio_ci(twice, x, bench::Pairing::paired);
  CHECK(two.value == doctest::Approx(2.0));
  CHECK_FALSE(two.contains(1.0));
  CHECK(bench::describe(two, 1.0, 2) == "2.00 (95% CI 2.00 to 2.00)");
  // One sample resamples to itself: no interval, and never "within noise".
  bench::Estimate one = bench::ratio_ci({7.75}, {1.0}, bench::Pairing::paired);
  CHECK_FALSE(one.has_interval());
  CHECK_FALSE(bench::ratio_ci({1.0}, {1.0}, bench::Pairing::paired).contains(1.0));
  CHECK(bench::describe(one, 1.0, 2) == "7.75 (95% CI n/a: one sample)");
  CHECK_THROWS_WITH_AS(bench::ratio_ci({1, 2}, {1}, bench::Pairing::paired),
                       doctest::Contains("bootstrap: paired samples of 2 and 1 values"),
                       kernels::Error);
  // Noisy: p90 above 1.5 x the median.
  CHECK_FALSE(bench::noisy({1, 1, 1, 1, 1, 1, 1, 1, 1, 1.4}));
  CHECK(bench::noisy({1, 1, 1, 1, 1, 1, 1, 1, 3, 3}));
}

namespace {

bench::RunResult timed_run(const std::string& mode, int n, std::vector<double> repeats) {
  bench::RunResult r;
  r.mode = mode;
  r.gpus = n;
  r.batch = 256;
  r.step_ms = {repeats.front()};
  r.repeat_ms = std::move(repeats);
  return r;
}

}  // namespace

TEST_CASE("bench.report: time-sliced runs are named and get no speedup or efficiency") {
  bench::Header cpu{"cpu", 2, 4, "mlp", 1000, "fp32"};
  CHECK(bench::time_sliced_label(cpu, "dp", 1).empty());
  CHECK(bench::time_sliced_label(cpu, "dp", 4) == "time-sliced: overhead, not scaling");
  CHECK(bench::time_sliced_label(cpu, "ddp", 4) == "time-sliced: overhead, not scaling");
  bench::Header one_gpu{"NVIDIA H100", 1, 4, "mlp", 1000, "fp32"};
  CHECK(bench::time_sliced_label(one_gpu, "dp", 4) == "time-sliced: overhead, not scaling");
  CHECK(bench::time_sliced_label(one_gpu, "ddp", 4) ==
        "correctness only: ranks time-slice one GPU through host staging");
  bench::Header four_gpus{"NVIDIA H100", 4, 4, "mlp", 1000, "fp32"};
  CHECK(bench::time_sliced_label(four_gpus, "dp", 4).empty());
  CHECK(bench::time_sliced_label(four_gpus, "ddp", 4).empty());

  std::vector<bench::RunResult> runs = {
      timed_run("dp", 1, {1.0, 1.1, 0.9}), timed_run("dp", 4, {0.5, 0.55, 0.45}),
      timed_run("ddp", 1, {1.0, 1.0, 1.0}), timed_run("ddp", 4, {0.4, 0.4, 0.4})};
  for (const bench::Header& h : {cpu, one_gpu, four_gpus}) {
    CAPTURE(h.physical);
    nlohmann::json j = bench::to_json(h, runs, {});
    std::ostringstream table;
    bench::print_table(table, h, runs);
    const bool sliced = h.device == "cpu" || h.physical < 4;
    for (auto& r : j["runs"]) {
      if (r["gpus"] == 1) continue;
      CHECK(r["time_sliced"] == sliced);
      CHECK(r.contains("speedup") == !sliced);
      CHECK(r.contains("efficiency") == !sliced);
      CHECK(r.contains("ratio_to_one"));  // the ratio stays: overhead is what it measures
    }
    CHECK((table.str().find("[time-sliced: overhead, not scaling]") != std::string::npos) ==
          sliced);
    // The sweep's table too: speedup and efficiency empty (columns 7 and 8) where time-sliced.
    std::ostringstream csv;
    bench::write_sweep_csv(csv, h, runs);
    std::istringstream lines(csv.str());
    std::string line;
    std::getline(lines, line);  // the header
    while (std::getline(lines, line)) {
      std::vector<std::string> cells;
      std::istringstream row(line);
      for (std::string cell; std::getline(row, cell, ',');) cells.push_back(cell);
      REQUIRE(cells.size() > 8);
      CAPTURE(line);
      const bool empty = sliced && cells[1] == "4";
      CHECK(cells[6].empty() == empty);
      CHECK(cells[7].empty() == empty);
    }
  }
}

TEST_CASE("bench.report: the verdict names the faster mode, its CI and where the other loses") {
  bench::Header four_gpus{"NVIDIA H100", 4, 4, "mlp", 1000, "fp32"};
  auto dp = timed_run("dp", 4, {2.0, 2.1, 1.9, 2.05, 1.95});
  auto ddp = timed_run("ddp", 4, {1.0, 1.05, 0.95, 1.0, 1.02});
  dp.phases_ms = {
      {"forward", 0.3}, {"backward", 0.5}, {"reduce", 0.9}, {"replicate", 0.2}, {"other", 0.1}};
  dp.phases_step_ms = 2.0;
  ddp.phases_ms = {{"forward", 0.3}, {"backward", 0.5}, {"allreduce_exposed", 0.1}, {"other", 0.1}};
  ddp.phases_step_ms = 1.0;
  std::string v = bench::verdict(four_gpus, {dp, ddp});
  INFO(v);
  CHECK(v.rfind("mlp, batch 256, 4 devices here: DDP is 2.00x faster than DP (95% CI ", 0) == 0);
  CHECK(v.find("; DP loses most in communication (1.10 ms exposed of the 1.00 ms between the "
               "median steps); try --dp-reduce tree, --comm-dtype bf16, or DDP") !=
        std::string::npos);
  // The rest of the step (waiting, host work) named when it is the largest gap.
  auto waiting = dp;
  waiting.phases_ms = {{"forward", 0.3}, {"backward", 0.5}, {"reduce", 0.1}, {"other", 1.1}};
  v = bench::verdict(four_gpus, {waiting, ddp});
  INFO(v);
  CHECK(v.find("; DP loses most in the rest of the step: waiting for the slowest device or rank, "
               "and host work (+1.00 ms of the 1.00 ms between the median steps); try "
               "--cuda-graphs on") != std::string::npos);

  auto same = timed_run("ddp", 4, {2.0, 2.1, 1.9, 2.05, 1.95});
  v = bench::verdict(four_gpus, {dp, same});
  CHECK(v.find("DP and DDP are within noise of each other (t_DP / t_DDP within noise") !=
        std::string::npos);
  bench::Header cpu{"cpu", 2, 4, "mlp", 1000, "fp32"};
  CHECK(bench::verdict(cpu, {dp, ddp}).find("4 devices here (time-sliced): DDP is") !=
        std::string::npos);
  CHECK(bench::verdict(cpu, {dp}).empty());  // one mode: nothing to compare
}

TEST_CASE("bench.bytes: DDP counts the payload handed to the group, fp32 and bf16") {
  for (const char* comm : {"fp32", "bf16"}) {
    CAPTURE(comm);
    std::string json = temp_path(std::string("payload_") + comm + ".json");
    REQUIRE(run_bench("--device cpu --gpus 4 --mode ddp --baseline 0 --steps 2 --warmup 0 "
                      "--batch 32 --comm-dtype " +
                      std::string(comm) + " --json " + json) == 0);
    auto j = read_json(json);
    std::remove(json.c_str());
    REQUIRE(j["runs"].size() == 1);
    const auto& r = j["runs"][0];
    const int64_t p = r["param_bytes"].get<int64_t>();
    // The MLP has no buffers: the payload is the gradient buckets, whole, in the comm dtype.
    const int64_t payload = std::string(comm) == "bf16" ? p / 2 : p;
    CHECK(r["bytes_per_step"].get<int64_t>() == payload);
    CHECK(r["bytes_theory"].get<int64_t>() == bench::ring_bytes_theory(4, payload));
  }
  // A model with BatchNorm buffers (ResNet-8, buffers averaged after each step) hands more.
  std::string json = temp_path("payload_resnet.json");
  REQUIRE(run_bench("--device cpu --gpus 2 --mode ddp --baseline 0 --steps 1 --warmup 0 "
                    "--batch 4 --model resnet --json " +
                    json) == 0);
  auto r = read_json(json)["runs"][0];
  std::remove(json.c_str());
  CHECK(r["bytes_per_step"].get<int64_t>() > r["param_bytes"].get<int64_t>());
}

TEST_CASE("bench.report: repeats combine into the median repeat's figures") {
  auto repeat = [](std::vector<double> steps, double phase) {
    bench::RunResult r;
    r.mode = "dp";
    r.gpus = 2;
    r.step_ms = std::move(steps);
    r.phases_ms = {{"forward", phase}};
    r.losses = {static_cast<float>(phase)};
    r.bytes_per_step = static_cast<int64_t>(phase);
    return r;
  };
  // Medians 5, 3 and 7: the median repeat is the first; its figures, every repeat's median.
  bench::RunResult r =
      bench::combine_repeats({repeat({5, 4, 9}, 1), repeat({3, 3, 2}, 2), repeat({7, 100, 6}, 3)});
  CHECK(r.from_repeat == 1);
  CHECK(r.repeat_ms == std::vector<double>{5, 3, 7});
  CHECK(r.phases_ms.at("forward") == 1);
  CHECK(r.losses == std::vector<float>{1});
  CHECK(r.bytes_per_step == 1);
  CHECK(r.step_ms == std::vector<double>{5, 4, 9});
  CHECK(r.step_ms_median() == 5);
  // Even K: the lower of the middle two (medians 4, 2, 6, 8: the one of 4); equal medians in
  // repeat order.
  CHECK(bench::combine_repeats({repeat({4}, 1), repeat({2}, 2), repeat({6}, 3), repeat({8}, 4)})
            .from_repeat == 1);
  CHECK(bench::combine_repeats({repeat({3}, 1), repeat({3}, 2), repeat({3}, 3)}).from_repeat == 2);
  // One run: its own median, no repeat named.
  bench::RunResult one = bench::combine_repeats({repeat({2, 1, 9}, 1)});
  CHECK(one.repeat_ms == std::vector<double>{2});
  CHECK(one.from_repeat == 0);
  bench::RunResult other = repeat({1}, 1);
  other.gpus = 4;
  CHECK_THROWS_WITH_AS(bench::combine_repeats({repeat({1}, 1), other}),
                       doctest::Contains("repeat 2 is dp N=4 with 1 steps, repeat 1 dp N=2"),
                       kernels::Error);
}

TEST_CASE("bench.cli: --repeat interleaves runs and reports CIs in text, JSON and CSV") {
  std::string json = temp_path("repeat.json"), csv = temp_path("repeat.csv");
  auto [rc, text] = bench_output(
      "--device cpu --gpus 2 --mode both --steps 3 --warmup 1 "
      "--batch 16 --repeat 3 --json " +
      json + " --sweep 1,2 --csv " + csv + " --chart " + temp_path("repeat.svg"));
  INFO(text);
  REQUIRE(rc == 0);
  CHECK(text.find("median of 3 interleaved repeats' medians") != std::string::npos);
  CHECK(text.find("t_N / t_1 ") != std::string::npos);
  CHECK(text.find("verdict: mlp, batch 16, 2 devices here (time-sliced): ") != std::string::npos);
  auto j = read_json(json);
  CHECK(j["repeats"] == 3);
  CHECK(j["verdict"].get<std::string>().rfind("mlp, batch 16, 2 devices here", 0) == 0);
  for (auto& r : j["runs"]) {
    REQUIRE(r["repeat_ms"].size() == 3);
    // The other figures are the median repeat's: its phases add up to its median step (3
    // steps: the middle one), which is the median of the three repeats' medians.
    const int from = r["from_repeat"].get<int>();
    REQUIRE((from >= 1 && from <= 3));
    CHECK(r["phases_step_ms"].get<double>() == r["repeat_ms"][from - 1].get<double>());
    CHECK(r["phases_step_ms"].get<double>() == doctest::Approx(r["step_ms_median"].get<double>()));
    double sum = 0;
    for (auto& [name, ms] : r["phases_ms"].items())
      if (name != "reduce_in_backward") sum += ms.get<double>();
    CHECK(sum == doctest::Approx(r["phases_step_ms"].get<double>()));
    CHECK(r["step_ms_ci95"][0].get<double>() <= r["step_ms_median"].get<double>());
    CHECK(r["step_ms_median"].get<double>() <= r["step_ms_ci95"][1].get<double>());
    if (r["gpus"] == 2) {
      CHECK(r.contains("overhead_us_per_device_ci95"));
      CHECK(r["ratio_to_one"].contains("within_noise"));
    }
  }
  std::ifstream f(csv);
  std::string header;
  std::getline(f, header);
  CHECK(header.find(",step_ms_ci_lo,step_ms_ci_hi,ratio_to_one,ratio_ci_lo,ratio_ci_hi,"
                    "overhead_ci_lo,overhead_ci_hi,repeats,noisy") != std::string::npos);
  std::remove(json.c_str());
  std::remove(csv.c_str());
  std::remove(temp_path("repeat.svg").c_str());
  // A training state belongs to one run.
  refused("--device cpu --mode dp --baseline 0 --repeat 2 --resume latest --checkpoint-dir /tmp",
          "--repeat 2 with --checkpoint-dir/--resume");
  // --help shows the defaults.
  auto [hrc, help] = bench_output("--help");
  CHECK(hrc == 0);
  CHECK(help.find("=256") != std::string::npos);   // --batch
  CHECK(help.find("=both") != std::string::npos);  // --mode
  CHECK(help.find("--repeat INT:[1, 1000]=1") != std::string::npos);
}

TEST_CASE("bench.projection: a range from full overlap to none, from a fixed JSON report") {
  // A GPU report: DP at 1 device and DDP at 4 ranks (batch 256, P = 64 MB, two buckets of 16
  // and 48 MB, ready halfway through backward and at its end), and the per-rank compute runs
  // at batch 64 (N=4: step 20 ms, of which backward 12 ms and optimizer 2 ms) and 32 (N=8).
  const char* report = R"({"device": "NVIDIA H100 80GB HBM3", "model": "mlp",
   "params": 16000000, "runs": [
    {"mode": "dp", "gpus": 1, "batch": 256, "step_ms": [82.0], "param_bytes": 64000000,
     "phases_ms": {"forward": 30, "backward": 50, "optimizer": 2}, "bytes_per_step": 0,
     "bytes_theory": 0, "peak_mem_bytes": [0], "losses": [1.0], "final_loss": 1.0},
    {"mode": "ddp", "gpus": 4, "batch": 256, "step_ms": [25.0], "param_bytes": 64000000,
     "phases_ms": {"forward": 8, "backward": 13, "optimizer": 2}, "bytes_per_step": 64000000,
     "bytes_theory": 96000000, "peak_mem_bytes": [0], "losses": [1.0], "final_loss": 1.0,
     "bucket_bytes": [16000000, 48000000], "bucket_ready_frac": [0.5, 1.0]}],
   "compute_runs": [
    {"mode": "dp", "gpus": 1, "batch": 64, "step_ms": [20.0], "param_bytes": 64000000,
     "phases_ms": {"forward": 6, "backward": 12, "optimizer": 2}, "bytes_per_step": 0,
     "bytes_theory": 0, "peak_mem_bytes": [0], "losses": [1.0], "final_loss": 1.0},
    {"mode": "dp", "gpus": 1, "batch": 32, "step_ms": [11.0], "param_bytes": 64000000,
     "phases_ms": {"forward": 3, "backward": 6, "optimizer": 2}, "bytes_per_step": 0,
     "bytes_theory": 0, "peak_mem_bytes": [0], "losses": [1.0], "final_loss": 1.0}]})";
  std::string file = temp_path("fixed_projection.json");
  {
    std::ofstream f(file);
    f << report;
  }
  bench::Header cpu{"cpu", 2, 1, "mlp", 16000000, "fp32"};
  auto in = bench::projection_input(cpu, {}, file);
  std::remove(file.c_str());
  REQUIRE(in.runs.size() == 2);
  REQUIRE(in.compute_runs.size() == 2);
  auto ps = bench::project(in.runs, in.compute_runs);
  REQUIRE(ps.size() == 8);  // dp and ddp, N = 4 and 8, NVLink4 and PCIe Gen5
  const bench::Projection* ddp4 = nullptr;
  const bench::Projection* dp4 = nullptr;
  for (auto& p : ps) {
    CHECK(p.overlap_s <= p.step_s);
    CHECK(p.compute_from == "1-device run at batch " + std::to_string(256 / p.gpus));
    CHECK(p.buckets == 2);
    if (p.link == "NVLink4" && p.gpus == 4) (p.mode == "ddp" ? ddp4 : dp4) = &p;
  }
  REQUIRE(ddp4);
  REQUIRE(dp4);
  // compute 20 - 2 = 18 ms, optimizer 2 ms. DDP ring on NVLink4 (450 GB/s, 5 us), N=4:
  // bucket 1: 6 (5 us + 16 MB / 1.8 TB/s) = 83.33 us; bucket 2: 6 (5 us + 26.67 us) = 190 us.
  CHECK(ddp4->compute_s == doctest::Approx(0.018));
  CHECK(ddp4->optimizer_s == doctest::Approx(0.002));
  CHECK(ddp4->step_s == doctest::Approx(0.020 + 83.3333e-6 + 190e-6).epsilon(1e-6));
  // Full overlap: bucket 1 leaves at 6 ms (half of backward's 12) and is done by 6.08 ms;
  // bucket 2 leaves at 12 ms, when backward ends, and 190 us of it stay exposed.
  CHECK(ddp4->overlap_s == doctest::Approx(0.020 + 190e-6).epsilon(1e-6));
  // DP on NVLink4, N=4: replicate 3 (5 us + 64 MB / 450 GB/s) = 441.67 us before forward;
  // buckets into device 0: 3 (5 us + 35.56 us) = 121.67 us and 3 (5 us + 106.67 us) = 335 us.
  CHECK(dp4->step_s == doctest::Approx(0.020 + 441.667e-6 + 121.667e-6 + 335e-6).epsilon(1e-6));
  CHECK(dp4->overlap_s == doctest::Approx(0.020 + 441.667e-6 + 335e-6).epsilon(1e-6));
  // The report prints the range and where compute came from.
  std::ostringstream text;
  bench::print_projection(text, in);
  CHECK(text.str().find("ddp    NVLink4 N=4: 20.190-20.273 ms  (compute 18.000 ms from 1-device "
                        "run at batch 64, opt 2.000 ms, 2 buckets") != std::string::npos);
}

TEST_CASE("bench.checkpoint: a finished run resumed has nothing left to train and exits 0") {
  // The folder does not exist yet: dp_bench creates it (with its parent) and locks it.
  const std::string dir = temp_path("finished") + "/ck";
  std::filesystem::remove_all(temp_path("finished"));
  for (const char* mode : {"dp", "ddp"}) {
    CAPTURE(mode);
    const std::string args = std::string(
                                 "--device cpu --gpus 2 --baseline 0 --steps 2 --warmup 0 "
                                 "--batch 8 --mode ") +
                             mode + " --checkpoint-dir " + dir;
    REQUIRE(run_bench(args) == 0);
    CHECK(std::filesystem::exists(nn::checkpoint_file(dir, 2)));
    auto [rc, text] = bench_output(args + " --resume latest");
    INFO(text);
    CHECK(rc == 0);
    CHECK(text.find("nothing left to train: checkpoint at step 2 of 2") != std::string::npos);
    CHECK(text.find("give more --steps to train further") != std::string::npos);
    CHECK(text.find("ms/step") == std::string::npos);  // no report of zeros
    CHECK(text.find("final loss 0.000000") == std::string::npos);
    std::filesystem::remove_all(dir);
  }
  std::filesystem::remove_all(temp_path("finished"));
}

// A report or trace inside a checkpoint folder the run has yet to create was refused ("its
// directory does not exist"), though the folder is made before any work: the natural layout of
// a run's files in one folder. A missing folder that is not the checkpoint folder still is.
TEST_CASE("bench.checkpoint: --json and --trace may go into the checkpoint folder it creates") {
  const std::string root = temp_path("outputs_in_ck");
  std::filesystem::remove_all(root);
  const std::string dir = root + "/ck";
  const std::string args =
      "--device cpu --gpus 2 --baseline 0 --steps 2 --warmup 0 --batch 8 --mode dp "
      "--checkpoint-dir " +
      dir + "/ ";  // a trailing slash names the same folder
  auto [rc, text] = bench_output(args + "--json " + dir + "/report.json --trace " + dir +
                                 "//trace.json");  // a doubled slash too
  INFO(text);
  CHECK(rc == 0);
  CHECK(std::filesystem::exists(dir + "/report.json"));
  CHECK(std::filesystem::exists(dir + "/trace.json"));
  CHECK(std::filesystem::exists(nn::checkpoint_file(dir, 2)));
  std::filesystem::remove_all(root);
  refused(args + "--json " + root + "/other/report.json",
          "--json: cannot write '" + root + "/other/report.json': its directory '" + root +
              "/other' does not exist");
  refused(args + "--trace " + dir + "/sub/trace.json", "its directory '" + dir + "/sub' does not");
  CHECK(!std::filesystem::exists(root));  // nothing made before the refusal
}

TEST_CASE("bench.exit: an output that cannot be written is an error naming it") {
  auto [rc, text] = bench_output(
      "--device cpu --gpus 2 --mode dp --steps 1 --warmup 0 "
      "--batch 8 --json /dev/full");
  INFO(text);
  CHECK(rc == 1);
  CHECK(text.find("--json") != std::string::npos);
  CHECK(text.find("/dev/full") != std::string::npos);
  CHECK(text.find("No space left on device") != std::string::npos);
  CHECK(text.find("json: /dev/full") == std::string::npos);  // never claimed as written
  auto [rc2, text2] = bench_output(
      "--device cpu --gpus 2 --mode dp --steps 1 --warmup 0 "
      "--batch 8 --trace /dev/full");
  CHECK(rc2 == 1);
  INFO(text2);
  CHECK(text2.find("trace: /dev/full") == std::string::npos);
  CHECK(text2.find("No space left on device") != std::string::npos);
  CHECK(text2.find("--trace") != std::string::npos);  // the flag that named the file
}

TEST_CASE("bench.ps: --mode ps --gpus 64 runs 64 worker threads, no DDP rank limit applies") {
  // The parameter server's workers are threads: the per-node rank limit of DDP is not theirs.
  auto [rc, text] =
      bench_output("--device cpu --mode ps --gpus 64 --steps 1 --warmup 0 --batch 64");
  INFO(text);
  CHECK(rc == 0);
  CHECK(text.find("ranks") == std::string::npos);
  CHECK(text.find("pushes per worker:") != std::string::npos);
}

TEST_CASE("bench.replay: after warm-up, DP and DDP steps allocate nothing and sync once") {
  for (const char* dtype : {"fp32", "bf16"}) {
    CAPTURE(dtype);
    std::string json = temp_path("replay.json");
    REQUIRE(run_bench(std::string("--device cpu --gpus 3 --mode both --steps 3 --warmup 2 ") +
                      "--batch 31 --dtype " + dtype + " --json " + json) == 0);
    auto j = read_json(json);
    REQUIRE(j["runs"].size() == 4);
    for (auto& r : j["runs"]) {
      CAPTURE(r["mode"].get<std::string>());
      CAPTURE(r["gpus"].get<int>());
      CHECK(r["allocations_per_step"].get<double>() == 0);
      CHECK(r["host_syncs_per_step"].get<double>() == 1);
    }
    std::remove(json.c_str());
  }
}

// casts_per_step: the f32/f16/bf16 conversions a step performs (each a cast kernel and often an
// f32 temporary on a GPU), counted by the runtime; a replayed step counts its graphs' casts, so
// --cuda-graphs on and off report the same. With 16-bit activations the elementwise, bias,
// activation, pooling and dropout ops read and write bf16 themselves, the losses take the bf16
// output and write a bf16 gradient, and the optimizer's step writes the weights' bf16 copy (at
// one device or rank: a DP replica that does not step casts its copy at the start of forward);
// what remains per step:
//   MLP: the f32 batch into bf16 for the first GEMM = 1;
//   tiny GPT: nothing (token ids in, the residual stream, LayerNorms and attention bf16 on the
//     CPU too) = 0, whatever the depth; with 2 micro-batches too (the second forward takes the
//     copy the first made: before 2026-12-04 it cast again, 1 a step).
// (Before the native kernels: MLP 16, tiny GPT 79; before the bf16 stream, LayerNorm and CPU
// attention, tiny GPT 43; before the step wrote the weights' copy, MLP 2 and tiny GPT 1.) f32
// runs convert nothing.
TEST_CASE("bench.json: casts_per_step, the same graphed or not, exact with bf16 activations") {
  struct Run {
    std::string flags;
    double per_step;  // every timed step's casts
  };
  const Run runs[] = {
      {"--model mlp --dtype fp32", 0},
      {"--model mlp --dtype bf16 --activations bf16", 1},
      {"--model gpt --gpt-config tiny --seq 32 --dtype bf16 --activations bf16", 0},
      {"--model gpt --gpt-config tiny --seq 32 --dtype bf16 --activations bf16 --micro-batches 2",
       0},
  };
  for (const Run& run : runs) {
    std::map<std::string, nlohmann::json> results;  // DP and DDP at 1 device, graphs off and on
    for (const char* graphs : {"off", "on"}) {
      CAPTURE(run.flags);
      CAPTURE(graphs);
      std::string json = temp_path("casts.json");
      auto [rc, text] = bench_output(
          "--device cpu --mode both --gpus 1 --baseline 0 --steps 2 --warmup 2 --batch 8 " +
          run.flags + " --cuda-graphs " + graphs + " --json " + json);
      INFO(text);
      REQUIRE(rc == 0);
      results[graphs] = read_json(json)["runs"];
      REQUIRE(results[graphs].size() == 2);
      for (const auto& r : results[graphs]) {
        REQUIRE(r.contains("casts_per_step"));
        CHECK(r["graphed_steps"].get<int>() == (std::string(graphs) == "on" ? 2 : 0));
        const std::string mode = r["mode"].get<std::string>();  // the report's replay line
        const std::string line = " " + mode + std::string(5 - mode.size(), ' ') +
                                 " 1   allocations 0, host syncs 1, casts " +
                                 std::to_string(std::lround(r["casts_per_step"].get<double>()));
        CHECK_MESSAGE(text.find(line) != std::string::npos, line);
      }
      std::remove(json.c_str());
    }
    for (size_t i = 0; i < 2; ++i) {
      const auto &off = results["off"][i], &on = results["on"][i];
      CAPTURE(run.flags);
      CAPTURE(off["mode"].get<std::string>());
      const double casts = off["casts_per_step"].get<double>();
      CHECK(casts == run.per_step);
      CHECK(on["casts_per_step"].get<double>() == casts);
      CHECK(on["casts_per_step"] == results["off"][0]["casts_per_step"]);  // DP's = DDP's
    }
  }
}

TEST_CASE("bench.graphs: --cuda-graphs on replays DP and DDP steps, losses bitwise those of off") {
  // CPU devices run the captured segments' recordings: every timed step (after 2 warm-up
  // steps) replays, with one host read and no allocation, and every loss equals the
  // uncaptured run's bit for bit. fp16 with AdamW (the loss scale and the optimizer's scalars
  // on the device), bf16 with bf16 buckets, and uneven chunks (31 rows over 3 devices). DDP's
  // bucket all-reduces run inside its graph (CPU graphs record them), or between its graphs
  // with --ddp-graph-collectives off; the report says which, and both hand the group what the
  // uncaptured run does. The phases a captured segment times together are printed merged. DP's
  // sums beside backward (--dp-graph-pulls beside: after it on CPU devices too) give the same
  // bits.
  for (std::string extra : {"--dtype fp16 --optim adamw", "--dtype bf16 --comm-dtype bf16"}) {
    CAPTURE(extra);
    std::map<std::string, nlohmann::json> runs;
    for (std::string graphs :
         {"off", "on", "on --ddp-graph-collectives off", "on --dp-graph-pulls beside"}) {
      std::string json = temp_path("graphs_" + std::to_string(runs.size()) + ".json");
      auto [rc, text] =
          bench_output(std::string("--device cpu --gpus 3 --mode both --steps 4 --warmup 2 ") +
                       "--batch 31 --cuda-graphs " + graphs + " " + extra + " --json " + json);
      REQUIRE(rc == 0);
      const bool graphed = graphs != "off";
      const bool beside = graphs.find("beside") != std::string::npos;
      auto has = [&](const char* what) { return text.find(what) != std::string::npos; };
      CHECK(has(" forward+backward ") == graphed);  // DP's, and DDP's between graphs
      CHECK(has(" forward+backward+allreduce ") == (graphs == "on" || beside));  // DDP's in graph
      CHECK(has(" reduce+optimizer ") == graphed);                               // DP's
      // What a graphed DP step gives up, and the flags that take it back.
      CHECK(has("; graphed: summed after backward, --cuda-graphs off overlaps them") == graphed);
      CHECK(has(" overlaps them (GPUs: --dp-graph-pulls beside too))") == (graphed && !beside));
      CHECK(has(" overlaps them)") == beside);  // on CPU devices it sums after backward too
      CHECK_FALSE(has(" backward 0.000"));
      runs[graphs] = read_json(json)["runs"];
      std::remove(json.c_str());
    }
    for (const char* graphed :
         {"on", "on --ddp-graph-collectives off", "on --dp-graph-pulls beside"}) {
      CAPTURE(graphed);
      const bool between = std::string(graphed).find("collectives off") != std::string::npos;
      REQUIRE(runs[graphed].size() == 4);  // DP and DDP, 1 and 3 devices
      REQUIRE(runs["off"].size() == runs[graphed].size());
      for (size_t i = 0; i < runs[graphed].size(); ++i) {
        const auto &on = runs[graphed][i], &off = runs["off"][i];
        CAPTURE(on["mode"].get<std::string>());
        CAPTURE(on["gpus"].get<int>());
        CHECK(on["graphed_steps"].get<int>() == 4);
        CHECK(off["graphed_steps"].get<int>() == 0);
        CHECK(on["graph_nodes_per_step"].get<double>() > 0);  // the ops each replay runs
        CHECK(off["graph_nodes_per_step"].get<double>() == 0);
        if (on["mode"] == "dp" && on["gpus"] == 3)  // three devices' graphs, one device's
          CHECK(on["graph_nodes_per_step"].get<double>() >
                2 * runs[graphed][i - 1]["graph_nodes_per_step"].get<double>());
        CHECK(on["allocations_per_step"].get<double>() == 0);
        CHECK(on["host_syncs_per_step"].get<double>() == 1);
        CHECK(on["losses"] == off["losses"]);
        CHECK(on["bytes_per_step"] == off["bytes_per_step"]);
        CHECK(on["graph_collectives"] == (on["mode"] == "dp" ? ""
                                          : between          ? "between graphs"
                                                             : "in graph"));
        CHECK(off["graph_collectives"] == "");
        if (on["mode"] == "dp")
          CHECK(on["graph_pulls"] ==
                (std::string(graphed).find("beside") == std::string::npos ? "after" : "beside"));
        // One rank hands the group nothing: a bucket's sum over one rank is the bucket.
        if (on["mode"] == "ddp" && on["gpus"] == 1) CHECK(on["bytes_per_step"].get<int64_t>() == 0);
      }
    }
  }
}

TEST_CASE("bench.cuda: graphed DDP steps on a GPU (NCCL at 1 rank, Gloo at 2) equal uncaptured") {
  // The CUDA segments are real graphs here: the bucket all-reduces go through NCCL inside the
  // graph (one rank: nothing to sum, but the path is NCCL's), or through Gloo between the
  // graphs (two logical GPUs sharing the one GPU, through pinned host memory).
  DP_REQUIRE_GPU();
  std::map<std::string, nlohmann::json> runs;
  for (const char* graphs : {"off", "on"}) {
    std::string json = temp_path(std::string("cuda_graphs_") + graphs + ".json");
    REQUIRE(run_bench(std::string("--device cuda --gpus 2 --mode ddp --steps 4 --warmup 2 ") +
                      "--batch 31 --dtype bf16 --optim adamw --cuda-graphs " + graphs + " --json " +
                      json) == 0);
    runs[graphs] = read_json(json)["runs"];
    std::remove(json.c_str());
  }
  REQUIRE(runs["on"].size() == 2);
  REQUIRE(runs["off"].size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    const auto &on = runs["on"][i], &off = runs["off"][i];
    CAPTURE(on["gpus"].get<int>());
    CHECK(on["graphed_steps"].get<int>() == 4);
    CHECK(on["allocations_per_step"].get<double>() == 0);
    // NCCL: the metrics read only. Gloo stages CUDA buckets through the host, which waits.
    if (on["gpus"].get<int>() == 1) CHECK(on["host_syncs_per_step"].get<double>() == 1);
    CHECK(on["graph_collectives"] == (on["gpus"].get<int>() == 1 ? "in graph" : "between graphs"));
    CHECK(on["losses"] == off["losses"]);
  }
}

TEST_CASE("bench.phase_times: --phase-times off reports the step time alone, the same losses") {
  // Untimed marks (DP's workers, DDP's ranks) only order the work: the losses are the timed
  // runs' bit for bit, and the report says the phases were not timed instead of printing zeros.
  std::map<std::string, nlohmann::json> runs;
  std::string untimed_text;
  for (const char* phases : {"on", "off"}) {
    std::string json = temp_path(std::string("phases_") + phases + ".json");
    auto [rc, text] =
        bench_output(std::string("--device cpu --gpus 2 --mode both --steps 3 ") +
                     "--warmup 1 --batch 16 --phase-times " + phases + " --json " + json);
    INFO(text);
    REQUIRE(rc == 0);
    runs[phases] = read_json(json)["runs"];
    if (std::string(phases) == "off") untimed_text = text;
    std::remove(json.c_str());
  }
  REQUIRE(runs["off"].size() == 4);
  REQUIRE(runs["on"].size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    const auto &off = runs["off"][i], &on = runs["on"][i];
    CAPTURE(off["mode"].get<std::string>());
    CAPTURE(off["gpus"].get<int>());
    CHECK(off["phases_ms"].empty());
    CHECK(!on["phases_ms"].empty());
    CHECK(off["losses"] == on["losses"]);
    CHECK(off["step_ms_median"].get<double>() > 0);
  }
  CHECK(untimed_text.find("not timed (--phase-times off)") != std::string::npos);
  refused("--device cpu --phase-times off --trace " + temp_path("t.json"),
          "--trace with --phase-times off");
  refused("--device cpu --phase-times sometimes", "--phase-times");
}

TEST_CASE("bench.metrics_lag: --metrics-lag 1 gives each step its own loss, as 0 does") {
  // The engines hand each step the one before's metrics; dp_bench files every loss under its
  // own step (the last from finish_metrics), so the curves are equal bit for bit. DP graphed,
  // DDP uncaptured, 1 and 2 devices each; DDP under ZeRO-1, which decides on the device too
  // (its verdict and norm come back with the loss).
  // Each run's steps with lag 0 and lag 1 side by side: the same losses, and host waits per step
  // (DP: until each device took its inputs, N waits; DDP: for the step before, 1).
  auto lag_pair = [&](const std::string& args, size_t n_runs) {
    std::map<int, nlohmann::json> runs;
    for (int lag : {0, 1}) {
      std::string json = temp_path("lag" + std::to_string(lag) + ".json");
      REQUIRE(run_bench(args + " --steps 4 --warmup 1 --batch 16 --phase-times off --metrics-lag " +
                        std::to_string(lag) + " --json " + json) == 0);
      runs[lag] = read_json(json)["runs"];
      std::remove(json.c_str());
    }
    REQUIRE(runs[1].size() == n_runs);
    REQUIRE(runs[0].size() == n_runs);
    for (size_t i = 0; i < n_runs; ++i) {
      CAPTURE(runs[1][i]["mode"].get<std::string>());
      CAPTURE(runs[1][i]["gpus"].get<int>());
      CHECK(runs[1][i]["losses"].size() == 4);
      CHECK(runs[1][i]["losses"] == runs[0][i]["losses"]);
      const double syncs = runs[1][i]["mode"] == "dp" ? runs[1][i]["gpus"].get<double>() : 1.0;
      CHECK(runs[1][i]["host_syncs_per_step"].get<double>() == syncs);
    }
  };
  lag_pair("--device cpu --gpus 2 --mode both --cuda-graphs on", 4);
  lag_pair("--device cpu --gpus 2 --mode ddp --zero 1 --optim adamw", 2);
  refused("--device cpu --mode dp --metrics-lag 1", "--metrics-lag 1 needs --phase-times off");
  refused("--device cpu --mode hybrid --metrics-lag 1 --phase-times off", "DP and DDP only");
  refused("--device cpu --mode dp --metrics-lag 1 --phase-times off --cuda-graphs on --dtype bf16",
          "use fp32 or tf32");
  refused("--device cpu --mode dp --metrics-lag 1 --phase-times off",
          "--metrics-lag 1 needs graphed DP steps");
  refused("--device cpu --metrics-lag 2", "--metrics-lag");
}

TEST_CASE("bench.micro_batches: DP and DDP in micro-batches follow one pass, graphed in bf16 too") {
  // --micro-batches K: each device or rank runs its chunk in K micro-batches; the same global
  // batch follows the curve of one pass (10 rows: chunks of 5 on 2 devices, micro-batches of 2
  // and 1 rows, uneven).
  auto runs_of = [&](const std::string& args, const std::string& name, std::string* text) {
    std::string json = temp_path("micro_" + name + ".json");
    auto [rc, out] = bench_output(args + " --json " + json);
    INFO(out);
    REQUIRE(rc == 0);
    if (text) *text = out;
    nlohmann::json runs = read_json(json)["runs"];
    std::remove(json.c_str());
    return runs;
  };
  auto close = [](const nlohmann::json& a, const nlohmann::json& b, double rel) {
    REQUIRE(a.size() == b.size());
    for (size_t s = 0; s < a.size(); ++s) {
      CAPTURE(s);
      CHECK(a[s].get<double>() == doctest::Approx(b[s].get<double>()).epsilon(rel));
    }
  };
  const std::string mlp = "--device cpu --gpus 2 --mode both --steps 3 --warmup 1 --batch 10 ";
  std::string text;
  const nlohmann::json one = runs_of(mlp + "--micro-batches 1", "one", nullptr);
  const nlohmann::json three = runs_of(mlp + "--micro-batches 3", "three", &text);
  REQUIRE(three.size() == 4);  // DP at 1 and 2 devices, DDP at 1 and 2 ranks
  REQUIRE(one.size() == three.size());
  for (size_t i = 0; i < three.size(); ++i) {
    CAPTURE(three[i]["mode"].get<std::string>());
    CAPTURE(three[i]["gpus"].get<int>());
    CHECK(three[i]["micro_batches"] == 3);
    CHECK(one[i]["micro_batches"] == 1);
    close(three[i]["losses"], one[i]["losses"], 1e-5);
  }
  CHECK(text.find("3 micro-batches per device and step") != std::string::npos);
  CHECK(text.find("3 micro-batches per rank and step") != std::string::npos);
  // More micro-batches than a chunk has rows: one a row ran, and the report says so (the
  // buffers are those of the micro-batches that run: K = 2^20 costs what 5 does).
  const nlohmann::json many = runs_of(mlp + "--micro-batches 1048576", "many", &text);
  const nlohmann::json five = runs_of(mlp + "--micro-batches 5", "five", nullptr);
  REQUIRE(many.size() == one.size());
  REQUIRE(five.size() == one.size());
  for (size_t i = 0; i < many.size(); ++i) {
    CAPTURE(many[i]["mode"].get<std::string>());
    const bool two_devices = many[i]["gpus"] == 2;
    CHECK(many[i]["micro_batches"] == 1048576);
    CHECK(many[i]["micro_batches_run"] == (two_devices ? 5 : 10));
    CHECK(three[i]["micro_batches_run"] == 3);
    close(many[i]["losses"], one[i]["losses"], 1e-5);
    if (two_devices) CHECK(many[i]["peak_mem_bytes"] == five[i]["peak_mem_bytes"]);
  }
  CHECK(text.find("5 micro-batches per device and step: their gradients summed before one "
                  "reduction and update (1048576 asked: a device's chunk has at most 5 rows)") !=
        std::string::npos);
  CHECK(text.find("(1048576 asked: a rank's chunk has at most 5 rows)") != std::string::npos);
  // The traces: each device's or rank's earlier micro-batch backward is a slice of its own,
  // between the forwards (forward, backward, forward, backward in the timed step; warm-up is not
  // traced). DP's showed one forward over both micro-batches' first half (FB).
  for (const std::string mode : {"dp", "ddp"}) {
    CAPTURE(mode);
    const std::string trace = temp_path("micro_trace_" + mode + ".json");
    REQUIRE(run_bench("--device cpu --gpus 2 --mode " + mode +
                      " --steps 1 --warmup 1 --batch 8 --baseline 0 --micro-batches 2 --trace " +
                      trace) == 0);
    std::map<std::pair<int, int>, std::vector<std::pair<double, std::string>>> slices;
    const nlohmann::json events = read_json(trace)["traceEvents"];
    for (auto& e : events)
      if (e["ph"] == "X" && (e["name"] == mode + "/forward" || e["name"] == mode + "/backward"))
        slices[{e["pid"].get<int>(), e["tid"].get<int>()}].emplace_back(
            e["ts"].get<double>(), e["name"].get<std::string>());
    std::remove(trace.c_str());
    CHECK(slices.size() == 2);  // the two devices or ranks
    for (auto& [track, list] : slices) {
      std::sort(list.begin(), list.end());
      std::string order;
      for (auto& [ts, name] : list) order += name == mode + "/forward" ? "F" : "B";
      CHECK(order == "FBFB");
    }
  }
  // One run of `args` in one pass and in 2 micro-batches: the same losses.
  auto in_two = [&](const std::string& args, const std::string& name) {
    const nlohmann::json whole = runs_of(args + " --micro-batches 1", name + "_one", nullptr);
    const nlohmann::json two = runs_of(args + " --micro-batches 2", name + "_two", nullptr);
    REQUIRE(two.size() == 1);
    REQUIRE(whole.size() == 1);
    CHECK(two[0]["micro_batches"] == 2);
    close(two[0]["losses"], whole[0]["losses"], 1e-5);
  };
  // ZeRO-1's reduce-scatter after backward takes the summed gradient too.
  in_two(
      "--device cpu --gpus 2 --mode ddp --zero 1 --optim adamw --steps 3 --warmup 1 --batch 10 "
      "--baseline 0",
      "zero");
  // Hybrid: DP in each of 2 node processes, the nodes' sums after the last micro-batch.
  in_two("--device cpu --mode hybrid --gpus 2 --steps 3 --warmup 1 --batch 12", "hybrid");

  // The tiny GPT with bf16 activations: each micro-batch's bf16 loss gradient is weighted in
  // place, and the captured loop replays the uncaptured steps' bits (DP and DDP, 2 each).
  const std::string gpt =
      "--device cpu --gpus 2 --mode both --steps 3 --warmup 2 --baseline 0 --batch 6 --model gpt "
      "--gpt-config tiny --seq 16 --dtype bf16 --activations bf16 ";
  const nlohmann::json off = runs_of(gpt + "--micro-batches 2 --cuda-graphs off", "off", nullptr);
  const nlohmann::json on = runs_of(gpt + "--micro-batches 2 --cuda-graphs on", "on", nullptr);
  const nlohmann::json whole =
      runs_of(gpt + "--micro-batches 1 --cuda-graphs off", "whole", nullptr);
  REQUIRE(on.size() == 2);
  REQUIRE(off.size() == on.size());
  REQUIRE(whole.size() == on.size());
  for (size_t i = 0; i < on.size(); ++i) {
    CAPTURE(on[i]["mode"].get<std::string>());
    CHECK(on[i]["graphed_steps"].get<int>() == 3);
    CHECK(on[i]["graphs_fallback"] == "");
    CHECK(on[i]["losses"] == off[i]["losses"]);
    // bf16 rounds each micro-batch's logits and gradients on their own: within 3% of one pass.
    close(on[i]["losses"], whole[i]["losses"], 3e-2);
  }
  refused("--device cpu --mode ps --micro-batches 2", "--micro-batches 2 with --mode ps");
  refused("--device cpu --model resnet --sync-bn --micro-batches 2",
          "--micro-batches 2 with --sync-bn");
  refused("--device cpu --micro-batches 0", "--micro-batches");
}

TEST_CASE("bench.recompute: --recompute keeps DP's and DDP's losses and lowers the peak") {
  // Every block of the GPT (and the Llama) checkpointed: the same losses in DP and DDP (2
  // devices or ranks, dropout drawn again in backward), graphed too, and one device's peak
  // memory lower; HFU counts the blocks' second forward, MFU does not. Each flag that cannot
  // apply is refused by name.
  auto report_of = [&](const std::string& args, const std::string& name) {
    std::string json = temp_path("recompute_" + name + ".json");
    auto [rc, out] = bench_output(args + " --json " + json);
    INFO(out);
    REQUIRE(rc == 0);
    CHECK((out.find(", HFU ") != std::string::npos) == (name == "again"));
    nlohmann::json report = read_json(json);
    std::remove(json.c_str());
    return report;
  };
  // The blocks' forward FLOPs per token at --seq 16, 2 P_blocks + 4 L T D: the GPT's blocks
  // (4 of 198,272 parameters, width 128) and the Llama's (4 of 200,960).
  const std::map<std::string, double> again_flops = {
      {"gpt --dropout 0.1", 2.0 * 4 * 198272 + 4.0 * 4 * 16 * 128},
      {"llama", 2.0 * 4 * 200960 + 4.0 * 4 * 16 * 128}};
  for (const std::string model : {"gpt --dropout 0.1", "llama"}) {
    CAPTURE(model);
    const std::string args =
        "--device cpu --gpus 2 --mode both --steps 3 --warmup 1 --batch 4 "
        "--seq 16 --cuda-graphs on --model " +
        model;
    const nlohmann::json kept_report = report_of(args, "kept");
    const nlohmann::json again_report = report_of(args + " --recompute", "again");
    CHECK(kept_report["recompute_flops_per_token"].get<double>() == 0);
    CHECK(again_report["recompute_flops_per_token"].get<double>() == again_flops.at(model));
    const nlohmann::json &kept = kept_report["runs"], &again = again_report["runs"];
    REQUIRE(kept.size() == 4);  // DP at 1 and 2 devices, DDP at 1 and 2 ranks
    REQUIRE(again.size() == kept.size());
    for (size_t i = 0; i < kept.size(); ++i) {
      CAPTURE(kept[i]["mode"].get<std::string>());
      CAPTURE(kept[i]["gpus"].get<int>());
      CHECK(again[i]["losses"] == kept[i]["losses"]);
      CHECK(kept[i]["hfu"].get<double>() == kept[i]["mfu"].get<double>());
      const double flops = again_report["flops_per_token"].get<double>();
      CHECK(
          again[i]["hfu"].get<double>() ==
          doctest::Approx(again[i]["mfu"].get<double>() * (flops + again_flops.at(model)) / flops));
    }
    // One device or rank (DP, then DDP: its ranks, started again with the flag, checkpoint
    // too): the activations are the peak's largest part.
    for (size_t i : {0, 2}) {
      CAPTURE(i);
      CHECK(again[i]["peak_mem_bytes"][0].get<int64_t>() <
            kept[i]["peak_mem_bytes"][0].get<int64_t>());
    }
  }
  auto [rc, out] = bench_output("--device cpu --steps 1 --recompute");
  CHECK(rc != 0);
  CHECK(out.find("--recompute: is for --model gpt or llama; this run trains mlp") !=
        std::string::npos);
}

TEST_CASE("bench.graphs: a GPT with dropout replays new masks, losses bitwise those of off") {
  // Attention and residual dropout: the offsets are read on the devices, so every timed step
  // replays (DP and DDP on 2 devices) and draws what an uncaptured step draws.
  std::map<std::string, nlohmann::json> runs;
  for (const char* graphs : {"off", "on"}) {
    std::string json = temp_path(std::string("dropout_graphs_") + graphs + ".json");
    REQUIRE(run_bench(std::string("--device cpu --gpus 2 --mode both --steps 3 --warmup 2 ") +
                      "--model gpt --gpt-config tiny --batch 5 --seq 16 --dropout 0.1 " +
                      "--baseline 0 --cuda-graphs " + graphs + " --json " + json) == 0);
    runs[graphs] = read_json(json)["runs"];
    std::remove(json.c_str());
  }
  REQUIRE(runs["on"].size() == 2);
  REQUIRE(runs["off"].size() == runs["on"].size());
  for (size_t i = 0; i < runs["on"].size(); ++i) {
    const auto &on = runs["on"][i], &off = runs["off"][i];
    CAPTURE(on["mode"].get<std::string>());
    CHECK(on["graphed_steps"].get<int>() == 3);
    CHECK(on["losses"] == off["losses"]);
  }
}

TEST_CASE(
    "bench.graphs: every configuration the GPU check runs captures in the eager step's memory") {
  // The step that captures (--warmup 2: the first timed one) takes nothing from the device and
  // has the eager step's peak: a GPU refuses a capture whose cache misses (CPU devices refuse it
  // too, so a miss would fail these runs). MLP and CNN in fp32, bf16, fp16 and bf16 with 16-bit
  // activations, the tiny GPT in fp32 and bf16; DP at 1 and 4 devices, DDP at 1 and 2 ranks.
  std::vector<std::string> configs;
  for (const char* model : {"mlp", "cnn"})
    for (const char* dtype :
         {"--dtype fp32", "--dtype bf16", "--dtype fp16", "--dtype bf16 --activations bf16"})
      configs.push_back(std::string("--model ") + model + " " + dtype);
  for (const char* dtype : {"--dtype fp32", "--dtype bf16 --activations bf16"})
    configs.push_back(std::string("--model gpt --gpt-config tiny --seq 32 ") + dtype);
  for (const std::string& config : configs)
    for (const char* mode : {"--mode dp --gpus 4", "--mode ddp --gpus 2"}) {
      CAPTURE(config);
      CAPTURE(mode);
      std::string json = temp_path("capture_memory.json");
      auto [rc, text] = bench_output(std::string("--device cpu --steps 1 --warmup 2 --batch 16 ") +
                                     "--cuda-graphs on " + mode + " " + config + " --json " + json);
      INFO(text);
      REQUIRE(rc == 0);
      const nlohmann::json runs = read_json(json)["runs"];
      REQUIRE(runs.size() == 2);  // the baseline at 1, and 4 devices or 2 ranks
      for (const auto& r : runs) {
        CAPTURE(r["gpus"].get<int>());
        CHECK(r["graphs_fallback"] == "");
        REQUIRE(r["capture"].is_object());
        const auto& c = r["capture"];
        CHECK(c["step"] == 2);
        CHECK(c["allocations"] == 0);
        CHECK(c["peak_bytes"].get<int64_t>() > 0);
        CHECK(c["peak_bytes"] == c["eager_peak_bytes"]);
        CHECK(r["graphed_steps"] == 1);
      }
      CHECK(text.find("capture (step 2): allocations 0") != std::string::npos);
      std::remove(json.c_str());
    }
}

TEST_CASE("bench.graphs: a capture that fails turns graphs off with one line, losses as off") {
  // The test hook fails every capture once its body ran (a refusal at the capture's end): each
  // engine says so once, records it in the JSON and the report, runs that step and the rest
  // uncaptured, and trains exactly as --cuda-graphs off (dropout too: no draw is repeated). DP's
  // sums beside backward too: the failed capture had recorded its bucket events in the graph.
  std::map<std::string, nlohmann::json> runs;
  const std::string args =
      "--device cpu --gpus 2 --mode both --steps 4 --warmup 2 --model gpt "
      "--gpt-config tiny --batch 6 --seq 16 --dropout 0.1 --cuda-graphs ";
  const std::vector<std::string> graphed = {"on", "on --dp-graph-pulls beside"};
  for (const std::string& graphs : {std::string("off"), graphed[0], graphed[1]}) {
    std::string json = temp_path("fallback_" + std::to_string(runs.size()) + ".json");
    auto [rc, text] = bench_output(args + graphs + " --json " + json,
                                   graphs == "off" ? "" : "DP_TEST_FAIL_CAPTURE=1");
    INFO(text);
    REQUIRE(rc == 0);
    runs[graphs] = read_json(json)["runs"];
    std::remove(json.c_str());
    if (graphs == "off") continue;
    for (const char* says :
         {"dp: graphs off: capture failed on cpu:0: the capture was made to "
          "fail by DP_TEST_FAIL_CAPTURE",
          "ddp: graphs off: capture failed on rank 0 (cpu:0)", "   graphs off: capture failed"}) {
      CAPTURE(says);
      CHECK(text.find(says) != std::string::npos);
    }
  }
  for (const std::string& graphs : graphed) {
    CAPTURE(graphs);
    REQUIRE(runs[graphs].size() == 4);  // DP and DDP at 1 and 2
    for (size_t i = 0; i < runs[graphs].size(); ++i) {
      const auto &on = runs[graphs][i], &off = runs["off"][i];
      CAPTURE(on["mode"].get<std::string>());
      CAPTURE(on["gpus"].get<int>());
      CHECK(on["graphs_fallback"].get<std::string>().find("capture failed on ") == 0);
      CHECK(off["graphs_fallback"] == "");
      CHECK(on["graphed_steps"] == 0);
      CHECK(on["capture"].is_null());
      CHECK(on["losses"] == off["losses"]);
    }
  }
}

TEST_CASE("bench.graphs: what cannot be captured runs uncaptured and says why, once") {
  // SyncBatchNorm (collectives inside forward), ZeRO-1 (a host decision inside the step);
  // hybrid and the parameter server are refused before any run.
  struct Case {
    const char* args;
    const char* says;
  };
  for (const Case& c : {Case{"--mode ddp --model resnet --batch 8 --sync-bn",
                             "ddp: graphs off: SyncBatchNorm exchanges statistics"},
                        Case{"--mode ddp --batch 8 --zero 1", "ddp: graphs off: ZeRO-1"}}) {
    CAPTURE(std::string(c.args));
    std::string json = temp_path("graphs_off.json");
    auto [rc, text] = bench_output(std::string("--device cpu --gpus 2 --steps 3 --warmup 1 ") +
                                   "--baseline 0 --cuda-graphs on --json " + json + " " + c.args);
    INFO(text);
    REQUIRE(rc == 0);
    const size_t at = text.find(c.says);
    CHECK(at != std::string::npos);
    CHECK(text.find(c.says, at + 1) == std::string::npos);  // once
    nlohmann::json report = read_json(json);
    for (auto& r : report["runs"]) CHECK(r["graphed_steps"].get<int>() == 0);
    std::remove(json.c_str());
  }
  refused("--device cpu --gpus 2 --mode hybrid --cuda-graphs on", "hybrid");
  refused("--device cpu --gpus 2 --mode ps --cuda-graphs on", "parameter server");
}

TEST_CASE("bench.hybrid: 2 node processes x 2 devices and 3 x 1 follow DP on one process") {
  // Uneven: 61 rows over 2 nodes (31, 30) and their devices (16 + 15, 15 + 15); over 3 nodes
  // of one device each (21, 20, 20).
  const std::string common = "--device cpu --steps 4 --warmup 1 --batch 61 --baseline 0 ";
  std::string two = temp_path("hybrid2.json"), three = temp_path("hybrid3.json"),
              ref = temp_path("hybrid_ref.json");
  REQUIRE(run_bench(common + "--mode hybrid --gpus 2 --json " + two) == 0);
  REQUIRE(run_bench(common + "--mode hybrid --gpus 1 --hybrid-procs 3 --json " + three) == 0);
  REQUIRE(run_bench(common + "--mode dp --gpus 1 --json " + ref) == 0);
  auto a = read_json(two)["runs"][0], b = read_json(three)["runs"][0],
       single = read_json(ref)["runs"][0];
  // With the baseline on (the default), the node processes still train on --gpus devices: one
  // run, not a second of the same N.
  std::string with_baseline = temp_path("hybrid_baseline.json");
  REQUIRE(run_bench("--device cpu --steps 2 --warmup 0 --batch 8 --mode hybrid --gpus 2 --json " +
                    with_baseline) == 0);
  CHECK(read_json(with_baseline)["runs"].size() == 1);
  CHECK(a["mode"] == "hybrid");
  CHECK(a["gpus"] == 4);
  CHECK(b["gpus"] == 3);
  // The header counts every node process's devices (it said "1 CPU devices share" for 3 x 1).
  CHECK(read_json(two)["logical_devices"] == 4);
  CHECK(read_json(three)["logical_devices"] == 3);
  const std::vector<double> want = single["losses"];
  for (auto* run : {&a, &b}) {
    const std::vector<double> got = (*run)["losses"];
    REQUIRE(got.size() == want.size());
    for (size_t s = 0; s < want.size(); ++s)
      CHECK(got[s] == doctest::Approx(want[s]).epsilon(1e-5));
    // What crosses between nodes: the gradient (P floats) and 2 metric floats per step.
    CHECK((*run)["bytes_per_step"] == (*run)["param_bytes"].get<int64_t>() + 8);
    // The phases add up to the step, each once: the exposed wait for the sums over the nodes
    // is a part of device 0's reduce, not added to it (it was: "other -0.923").
    const auto phases = (*run)["phases_ms"].get<std::map<std::string, double>>();
    REQUIRE(phases.count("cross_node_exposed") == 1);
    for (const auto& [name, ms] : phases) {
      CAPTURE(name);
      CHECK(ms >= 0);
    }
  }
  // With dropout, node k's device i draws as device 2k + i of a 4-device DP run.
  const std::string gpt =
      "--device cpu --steps 3 --warmup 1 --batch 8 --baseline 0 --model gpt --gpt-config tiny "
      "--seq 16 --dropout 0.1 ";
  REQUIRE(run_bench(gpt + "--mode hybrid --gpus 2 --json " + two) == 0);
  REQUIRE(run_bench(gpt + "--mode dp --gpus 4 --json " + ref) == 0);
  const std::vector<double> hybrid = read_json(two)["runs"][0]["losses"],
                            four = read_json(ref)["runs"][0]["losses"];
  REQUIRE(hybrid.size() == four.size());
  for (size_t s = 0; s < four.size(); ++s)
    CHECK(hybrid[s] == doctest::Approx(four[s]).epsilon(1e-5));
  auto [rc, text] = bench_output("--device cpu --mode dp --hybrid-procs 2");
  CHECK(rc != 0);
  CHECK(text.find("only --mode hybrid starts node processes") != std::string::npos);
  for (auto& p : {two, three, ref}) std::remove(p.c_str());
}

TEST_CASE("bench.hybrid: nodes that disagree on a flag fail together at once, naming the flag") {
  // Before any collective: a node with another --batch trained a wrong loss, another --model
  // crashed in Gloo, another --steps waited out the 300 s collective timeout. Uneven nodes
  // (another --gpus) would split the batch wrongly.
  struct Case {
    const char* node0;
    const char* node1;
    const char* says;
  };
  const std::string common = "--device cpu --mode hybrid --warmup 0 --baseline 0 ";
  for (const Case& c :
       {Case{"--batch 8", "--batch 12", "--batch: rank 0 has 8, rank 1 has 12"},
        Case{"--model mlp", "--model cnn", "--model: rank 0 has mlp, rank 1 has cnn"},
        Case{"--steps 3", "--steps 2", "--steps: rank 0 has 3, rank 1 has 2"},
        Case{"--gpus 2", "--gpus 3", "--gpus: rank 0 has 2, rank 1 has 3"}}) {
    CAPTURE(c.says);
    auto split = [](const std::string& text) {
      std::vector<std::string> out;
      std::istringstream is(text);
      for (std::string w; is >> w;) out.push_back(w);
      return out;
    };
    const bool steps_differ = std::string(c.node0).rfind("--steps", 0) == 0;
    const std::string base = common + (steps_differ ? "" : "--steps 2 ");
    const dp_test::HandRanks r = dp_test::run_hand_ranks(
        DP_BENCH_PATH, {split(base + c.node0), split(base + c.node1)}, dp::dist::find_free_port(),
        temp_path("hybrid_mismatch_node"), std::chrono::seconds(60));
    for (size_t node = 0; node < 2; ++node) {
      CAPTURE(node);
      INFO(r.outputs[node]);
      REQUIRE(r.statuses[node] != -1);  // ended by the check, not the deadline
      CHECK(dp_test::shell_code(r.statuses[node]) == 1);
      CHECK(r.outputs[node].find("config mismatch: " + std::string(c.says)) != std::string::npos);
      CHECK(r.outputs[node].find("0x") == std::string::npos);       // values in decimal
      CHECK(r.outputs[node].find("ms/step") == std::string::npos);  // nothing trained
    }
    CHECK(r.seconds < 20);
  }
}

TEST_CASE("bench.link: bytes out of each node and their time, flat DDP against hybrid, hooks") {
  bench::RunResult ddp, hybrid, dp;
  ddp.mode = "ddp", ddp.gpus = 8, ddp.bytes_per_step = 1000000, ddp.step_ms = {20};
  hybrid.mode = "hybrid", hybrid.gpus = 8, hybrid.bytes_per_step = 1000000, hybrid.step_ms = {5};
  dp.mode = "dp", dp.gpus = 4, dp.bytes_per_step = 1000000;
  auto t = bench::link_times({ddp, hybrid, dp}, 2, 1.0);
  REQUIRE(t.size() == 2);                   // DP crosses no link
  CHECK(t[0].bytes == 1750000);             // a ring of 8: 2 (8-1)/8 of the payload
  CHECK(t[0].ms == doctest::Approx(14.0));  // 1.75 MB at 125 MB/s
  CHECK(t[1].bytes == 1000000);             // a ring of 2 nodes: 2 (2-1)/2
  CHECK(t[1].ms == doctest::Approx(8.0));
  CHECK(bench::link_times({ddp}, 1, 1.0).empty());  // one node: nothing crosses
  std::ostringstream os;
  bench::print_link_times(os, t, 2, 1.0);
  CHECK(os.str().find("1.75 MB -> 14.00 ms of the measured 20.00 ms step") != std::string::npos);
  // Longer than the step the run measured: the link it crossed was faster than the flag says.
  CHECK(os.str().find("1.00 MB -> 8.00 ms, more than the whole measured 5.00 ms step: the nodes' "
                      "link is faster than --link-gbps says") != std::string::npos);
  // A comm hook's runs cross the link with their own payload (taken as all-reduces), over the
  // ring of the ranks (DDP's) or of the nodes (hybrid's); its DP runs cross none.
  bench::RunResult hook = ddp, hybrid_hook = hybrid, dp_hook = dp;
  hook.mode = "hook", hook.bytes_per_step = 100000;
  hybrid_hook.mode = "hybrid-hook", hybrid_hook.bytes_per_step = 100000;
  dp_hook.mode = "dp-hook";
  t = bench::link_times({ddp, hook, hybrid, hybrid_hook, dp_hook}, 2, 1.0);
  REQUIRE(t.size() == 4);
  CHECK(t[1].mode == "hook");
  CHECK(t[1].bytes == 175000);
  CHECK(t[3].mode == "hybrid-hook");
  CHECK(t[3].bytes == 100000);
  CHECK(t[3].ms == doctest::Approx(0.8));
  os.str("");
  bench::print_link_times(os, t, 2, 1.0);
  INFO(os.str());
  CHECK(os.str().find(" hook        8   0.17 MB -> 1.40 ms") != std::string::npos);
  CHECK(os.str().find(" hybrid-hook 8   0.10 MB -> 0.80 ms") != std::string::npos);
  auto [rc, text] = bench_output("--device cpu --mode dp --link-gbps 0");
  CHECK(rc != 0);
  CHECK(text.find("--link-gbps") != std::string::npos);
  refused("--device cpu --mode dp --link-gbps 1", "nothing crosses a link between nodes");
  refused("--device cpu --mode ddp --link-gbps 1", "nothing crosses a link between nodes");
}

TEST_CASE("bench.gpt: --model gpt reports tokens/s and MFU, DP and DDP follow one device") {
  std::string json = temp_path("gpt.json");
  REQUIRE(run_bench("--device cpu --model gpt --gpt-config tiny --seq 16 --gpus 2 --mode both "
                    "--steps 3 --warmup 1 --batch 4 --peak-tflops 0.5 --json " +
                    json) == 0);
  auto j = read_json(json);
  CHECK(j["model"] == "gpt-tiny");
  CHECK(j["tokens_per_sample"] == 16);
  CHECK(j["peak_tflops"].get<double>() == doctest::Approx(0.5));
  CHECK(j["peak_source"] == "--peak-tflops");
  // 6 P + 12 L T D: the tiny preset has 4 layers of width 128.
  const double p = j["params"].get<double>();
  CHECK(j["flops_per_token"].get<double>() == doctest::Approx(6 * p + 12.0 * 4 * 16 * 128));
  REQUIRE(j["runs"].size() == 4);
  std::vector<float> single;
  for (auto& r : j["runs"]) {
    for (const char* key : {"tokens_per_s", "mfu", "phases_ms", "bytes_per_step",
                            "allocations_per_step", "host_syncs_per_step", "losses"})
      CHECK_MESSAGE(r.contains(key), key);
    CHECK(r["optim"] == "adamw");
    const double tokens_per_s = r["tokens_per_s"].get<double>();
    CHECK(tokens_per_s == doctest::Approx(r["samples_per_s"].get<double>() * 16));
    // One CPU's peak for every N (CPU devices share it).
    CHECK(r["mfu"].get<double>() ==
          doctest::Approx(j["flops_per_token"].get<double>() * tokens_per_s / 0.5e12));
    auto losses = r["losses"].get<std::vector<float>>();
    REQUIRE(losses.size() == 3);
    if (r["mode"] == "dp" && r["gpus"] == 1) single = losses;
  }
  REQUIRE(single.size() == 3);
  CHECK(single[0] == doctest::Approx(std::log(256.0)).epsilon(0.05));  // uniform tokens
  for (auto& r : j["runs"]) {
    auto losses = r["losses"].get<std::vector<float>>();
    for (size_t i = 0; i < 3; ++i) CHECK(losses[i] == doctest::Approx(single[i]).epsilon(1e-5));
  }
  std::remove(json.c_str());
  // The GPT flags are checked where they enter.
  refused("--device cpu --model gpt --gpt-config tiny --seq 129", "--seq: 129 is longer than");
  refused("--device cpu --model llama --seq 129",
          "--seq: 129 is longer than llama-tiny's context 128");
  refused("--device cpu --model llama --gpt-config 124m",
          "--gpt-config: is for --model gpt; this run trains llama");
  refused("--device cpu --model llama --dropout 0.1",
          "--dropout: is for --model gpt; this run trains llama");
  refused("--device cpu --model mlp --seq 16", "--seq: is for --model gpt");
}

// --project-from is read before any work: a malformed file or a FIFO (which the reading would
// wait on) fails at once, naming the flag and the file, without a step measured.
TEST_CASE("bench.projection: --project-from off runs and reports no projection") {
  auto [rc, text] = bench_output("--device cpu --gpus 1 --steps 3 --warmup 1 --project-from off");
  CHECK(rc == 0);
  CHECK(text.find("projection to NVLink/PCIe: left out: --project-from off") != std::string::npos);
}

TEST_CASE("bench.errors: --project-from is read up front: malformed, a FIFO, both fail at once") {
  const std::string bad = temp_path("project_bad.json"), fifo = temp_path("project_fifo");
  {
    std::ofstream f(bad);
    f << "{\"device\": ";
  }
  std::remove(fifo.c_str());
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  struct Case {
    std::string path, says;
  };
  for (const Case& c : {Case{bad, "--project-from '" + bad + "': not a dp_bench JSON report"},
                        Case{fifo, "--project-from(" + fifo +
                                       "): is a FIFO (named pipe), not a "
                                       "regular file"}}) {
    CAPTURE(c.path);
    const auto start = std::chrono::steady_clock::now();
    auto [rc, text] = bench_output("--device cpu --gpus 1 --steps 200 --project-from " + c.path);
    INFO(text);
    CHECK(rc != 0);
    CHECK(text.find(c.says) != std::string::npos);
    CHECK(text.find("ms/step") == std::string::npos);  // nothing was measured
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
  }
  std::remove(bad.c_str());
  std::remove(fifo.c_str());
}

// A GPU's report projects a CPU run's model: the file's compute, named with its device, model
// and dtype. A report of another model, or of a run with untimed phases, is refused before any
// work.
TEST_CASE("bench.projection: --project-from a GPU report of this model, refused for another") {
  const std::string json = temp_path("project_from.json");
  REQUIRE(run_bench("--device cpu --gpus 1 --mode dp --baseline 0 --steps 2 --warmup 1 "
                    "--batch 8 --json " +
                    json) == 0);
  nlohmann::json j = read_json(json);
  j["device"] = "NVIDIA H100 80GB HBM3";  // as a GPU run writes it
  auto write = [&](const nlohmann::json& out) {
    std::ofstream f(json);
    f << out.dump();
  };
  write(j);
  {
    auto [rc, text] = bench_output(
        "--device cpu --gpus 1 --steps 2 --warmup 1 --batch 8 "
        "--project-from " +
        json);
    INFO(text);
    CHECK(rc == 0);
    CHECK(text.find("compute " + json + " (NVIDIA H100 80GB HBM3, mlp fp32)") != std::string::npos);
    CHECK(text.find("NVLink4 N=4") != std::string::npos);
  }
  struct Case {
    std::string args, says;
  };
  nlohmann::json untimed = j, small = j, micro = j, half = j;
  untimed["runs"][0]["phases_ms"] = nlohmann::json::object();
  small["model"] = "gpt-tiny";  // the same model, another size
  small["params"] = 5;
  micro["runs"][0]["micro_batches"] = 3;  // another step's compute
  micro["runs"][0]["micro_batches_run"] = 3;
  half["runs"][0]["micro_batches"] = 2.5;
  for (const auto& [file, c] :
       {std::pair{j, Case{"--model cnn", "' holds runs of mlp ("}},
        std::pair{micro,
                  Case{"", "holds runs of 3 micro-batches a step, and this run takes one pass"}},
        std::pair{j, Case{"--micro-batches 2",
                          "holds runs of one pass a step, and this run takes 2 micro-batches"}},
        std::pair{half, Case{"",
                             "runs[0].micro_batches is 2.5: a dp_bench report holds a whole "
                             "number there"}},
        std::pair{untimed, Case{"", "runs[0].phases_ms is empty: the run's phases were not timed"}},
        std::pair{small, Case{"--model gpt --gpt-config tiny",
                              "holds runs of gpt-tiny (5 parameters), and this run trains "
                              "gpt-tiny (842496)"}}}) {
    CAPTURE(c.args);
    write(file);
    auto [rc, text] =
        bench_output("--device cpu --gpus 1 --steps 200 --project-from " + json + " " + c.args);
    INFO(text);
    CHECK(rc != 0);
    CHECK(text.find(c.says) != std::string::npos);
    CHECK(text.find("ms/step") == std::string::npos);  // nothing was measured
  }
  std::remove(json.c_str());
}

// The CPU's GEMM kernels are named in the header and the JSON environment; where they are
// narrower than the CPU's (OPENBLAS_CORETYPE=Prescott forced on an AVX2 or AVX-512 CPU), one
// warning line says so and what to do. Skipped on a CPU without AVX2.
TEST_CASE("bench.environment: the CPU GEMM kernels are named, a generic choice warned once") {
  if (kernels::cpu_vector_isa() < kernels::CpuVectorIsa::avx2) {
    MESSAGE("SKIPPED: no AVX2 on this CPU: OpenBLAS's SSE kernels are its widest here");
    return;
  }
  const std::string json = temp_path("gemm_env.json");
  // The kernels OpenBLAS and the choice make of this CPU, without a core the machine's
  // environment may force (OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU: a user's choice, kept
  // with a warning, as Prescott below).
  const std::string unforced = "env -u OPENBLAS_CORETYPE";
  auto [rc, text] = bench_output("--device cpu --gpus 1 --steps 2 --json " + json, unforced);
  INFO(text);
  REQUIRE(rc == 0);
  nlohmann::json env = read_json(json)["environment"];
  REQUIRE(env.contains("cpu_gemm"));
  CHECK_FALSE(env["cpu_gemm"]["generic"].get<bool>());
  CHECK(env["cpu_gemm"]["warning"] == "");
  const std::string core = env["cpu_gemm"]["kernels"].get<std::string>();
  CHECK(env["libraries"]["openblas"].get<std::string>().find("(kernels: " + core) !=
        std::string::npos);
  CHECK(text.find("warning: OpenBLAS") == std::string::npos);
  // bf16 GEMMs: oneDNN's kernel where they run on the CPU's bf16 instructions, "" where they
  // widen (a build without oneDNN, no AVX512_BF16, or turned off).
  const std::string bf16 = env["cpu_gemm"]["bf16"].get<std::string>();
  __builtin_cpu_init();
  if (env["libraries"].contains("onednn") && __builtin_cpu_supports("avx512bf16")) {
    CHECK(bf16.find("oneDNN ") == 0);
    CHECK(bf16.find("bf16 kernels: ") != std::string::npos);
  } else {
    MESSAGE("bf16 GEMMs widen to f32 here (no oneDNN in the build, or no AVX512_BF16)");
    CHECK(bf16.empty());
  }
  auto [rc_widen, widened] = bench_output("--device cpu --gpus 1 --steps 2 --json " + json,
                                          unforced + " DP_CPU_BF16_GEMM=widen");
  REQUIRE(rc_widen == 0);
  CHECK(read_json(json)["environment"]["cpu_gemm"]["bf16"] == "");
  auto [rc2, forced] =
      bench_output("--device cpu --gpus 1 --steps 2 --json " + json, "OPENBLAS_CORETYPE=Prescott");
  INFO(forced);
  REQUIRE(rc2 == 0);
  env = read_json(json)["environment"];
  CHECK(env["cpu_gemm"]["kernels"] == "Prescott");
  CHECK(env["cpu_gemm"]["generic"].get<bool>());
  size_t lines = 0;
  for (size_t at = forced.find("warning: OpenBLAS runs its Prescott kernels (SSE) on a CPU with");
       at != std::string::npos; at = forced.find("warning: OpenBLAS runs its Prescott", at + 1))
    ++lines;
  CHECK(lines == 1);
  CHECK(forced.find("OPENBLAS_CORETYPE=Prescott chose them: unset it") != std::string::npos);
  std::remove(json.c_str());
}

// DP_CUDA_DGELU (kernels::cuda_dgelu_epilogue) is read before any work: a value that is neither
// ops nor epilogue is refused, naming it, on any device; epilogue runs (on a CPU the ops either
// way).
TEST_CASE("bench.environment: DP_CUDA_DGELU other than epilogue or ops is refused before work") {
  auto [rc, text] = bench_output("--device cpu --gpus 1 --steps 2", "DP_CUDA_DGELU=fused");
  INFO(text);
  CHECK(rc != 0);
  CHECK(text.find("DP_CUDA_DGELU=fused: give ops") != std::string::npos);
  CHECK(text.find("ms/step") == std::string::npos);
  auto [rc_ep, ep] = bench_output("--device cpu --gpus 1 --steps 2", "DP_CUDA_DGELU=epilogue");
  INFO(ep);
  CHECK(rc_ep == 0);
  CHECK(ep.find("ms/step") != std::string::npos);
}

// Flags that would do nothing are refused before any work, naming what they need: --csv or
// --chart without --sweep, a --chart name that is neither .svg nor .png (it was written as SVG
// whatever the name), --profile-steps ending past --steps (the profiler never stopped), on CPU
// devices or with text after it, DP's reduce flags at one device, --timeout where DP has no
// collective, and a --link-gbps too small to mean a link (1e-300 Gbit/s gave an absurd transfer
// time).
TEST_CASE("bench.cli: flags that would do nothing are refused, saying what they need") {
  refused("--device cpu --csv " + temp_path("t.csv"),
          "--csv writes the sweep's table: give --sweep too");
  refused("--device cpu --chart " + temp_path("t.svg"),
          "--chart writes the sweep's chart: give --sweep too");
  refused("--device cpu --sweep 1 --chart " + temp_path("chart.pdf"),
          "the chart is drawn as SVG or PNG, by the name's ending");
  refused("--device cpu --steps 5 --profile-steps 2:7",
          "--profile-steps 2:7: timed steps are 0 to 4 (--steps 5); step 7 never runs");
  refused("--device cpu --steps 5 --profile-steps 0:1",
          "--profile-steps 0:1: it brackets steps for a CUDA profiler (nsys "
          "--capture-range=cudaProfilerApi), and this run is on CPU devices");
  refused("--device cpu --steps 5 --profile-steps 0:1:2",
          "--profile-steps '0:1:2': expected a:b with 0 <= a <= b");
  refused("--device cpu --gpus 1 --mode both --dp-reduce tree",
          "--dp-reduce tree with --gpus 1: one device has no gradients to reduce");
  refused("--device cpu --gpus 1 --mode dp --comm-dtype bf16",
          "--comm-dtype bf16 with --mode dp --gpus 1: one device sends no gradients");
  refused("--device cpu --gpus 2 --mode dp --timeout 5",
          "--timeout with --mode dp: it bounds DDP's rendezvous and collectives");
  // NCCL on CPU tensors was refused by every rank after the launch ("rank 0 has its tensors on
  // the CPU", once per rank); now once, before any rank starts.
  {
    auto [rc, text] = bench_output("--device cpu --gpus 2 --mode ddp --backend nccl");
    INFO(text);
    CHECK(rc == 1);
    CHECK((text.find("--backend nccl: NCCL needs a CUDA device on every rank, and these ranks' "
                     "tensors are on the CPU") != std::string::npos ||
           text.find("--backend nccl: this build has no NCCL") != std::string::npos));
    CHECK(text.find("launch_workers") == std::string::npos);  // no rank started
  }
  refused("--device cpu --link-gbps 1e-300",
          "--link-gbps: 1e-300 is not allowed: give a number in [0.001, 100000]");
}

TEST_CASE("bench.loss_chunk: --loss-chunk keeps DP's and DDP's losses and lowers the peak") {
  // The tiny GPT's and Llama's chunked classifier (nn::GptConfig::loss_chunk: 48 tokens a chunk,
  // 256 or 128 tokens a device) against the whole (B, T, V) logits (0), DP and DDP at 1 and 2
  // devices or ranks, graphed: each token's loss gradient has the same bits, the sums (the loss,
  // the head's gradient) another order, so the losses agree within f32 rounding; every device's
  // peak is lower; the flag is refused by name where there is no language model.
  for (const std::string model : {"gpt", "llama"}) {
    CAPTURE(model);
    auto report_of = [&](const std::string& chunk) {
      std::string json = temp_path("loss_chunk_" + model + chunk + ".json");
      auto [rc, out] = bench_output(
          "--device cpu --gpus 2 --mode both --steps 3 --warmup 2 --batch 4 --seq 64 "
          "--cuda-graphs on --model " +
          model + " --loss-chunk " + chunk + " --json " + json);
      INFO(out);
      REQUIRE(rc == 0);
      nlohmann::json report = read_json(json);
      std::remove(json.c_str());
      return report;
    };
    const nlohmann::json whole = report_of("0")["runs"], parts = report_of("48")["runs"];
    REQUIRE(whole.size() == 4);  // DP at 1 and 2 devices, DDP at 1 and 2 ranks
    REQUIRE(parts.size() == whole.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      CAPTURE(whole[i]["mode"].get<std::string>());
      CAPTURE(whole[i]["gpus"].get<int>());
      CHECK(parts[i]["graphed_steps"].get<int>() == 3);
      CHECK(parts[i]["graphs_fallback"] == "");
      const std::vector<double> a = parts[i]["losses"], b = whole[i]["losses"];
      REQUIRE(a.size() == b.size());
      for (size_t s = 0; s < a.size(); ++s) CHECK(a[s] == doctest::Approx(b[s]).epsilon(1e-5));
      const std::vector<int64_t> peak = parts[i]["peak_mem_bytes"],
                                 whole_peak = whole[i]["peak_mem_bytes"];
      REQUIRE(peak.size() == whole_peak.size());
      for (size_t d = 0; d < peak.size(); ++d) CHECK(peak[d] < whole_peak[d]);
    }
  }
  auto [rc, out] = bench_output("--device cpu --steps 1 --loss-chunk 8");
  CHECK(rc != 0);
  CHECK(out.find("--loss-chunk: is for --model gpt or llama; this run trains mlp") !=
        std::string::npos);
}
