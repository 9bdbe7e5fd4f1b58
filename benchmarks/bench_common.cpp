#include "benchmarks/bench_common.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "benchmarks/ddp_run.hpp"
#include "dp/data/loader.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/launcher.hpp"
#include "nn/nn.hpp"

namespace bench {

using kernels::Device;
using kernels::DeviceType;

void add_flags(CLI::App& app, Options& o) {
  app.add_option("--gpus", o.gpus, "devices (DP) or ranks (DDP); 0: all GPUs, or 4 CPU devices");
  app.add_option("--device", o.device, "auto|cuda|cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  app.add_option("--mode", o.mode, "dp|ddp|both")->check(CLI::IsMember({"dp", "ddp", "both"}));
  app.add_option("--model", o.model, "mlp|cnn|resnet")
      ->check(CLI::IsMember({"mlp", "cnn", "resnet"}));
  auto* b = app.add_option("--batch", o.batch, "global batch")->check(CLI::PositiveNumber);
  app.add_option("--batch-per-device", o.batch_per_device, "per-device batch (global = N x this)")
      ->check(CLI::PositiveNumber)
      ->excludes(b);
  app.add_option("--steps", o.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--dtype", o.dtype, "fp32|tf32|bf16")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16"}));
  app.add_option("--backend", o.backend, "DDP backend: auto|nccl|gloo")
      ->check(CLI::IsMember({"auto", "nccl", "gloo"}));
  app.add_option("--seed", o.seed, "model and data seed");
  app.add_option("--json", o.json_path, "write the report as JSON");
  app.add_option("--trace", o.trace_path, "write a Chrome/Perfetto trace (one track per device)");
  app.add_option("--sweep", o.sweep, "device counts to sweep, e.g. 1,2,4 (writes CSV + chart)");
  app.add_option("--csv", o.csv_path, "sweep CSV path (default dp_bench_sweep.csv)");
  app.add_option("--chart", o.chart_path,
                 "sweep chart path, PNG or SVG (default dp_bench_sweep.svg)");
  app.add_option("--profile-steps", o.profile_steps,
                 "a:b brackets timed steps a..b with cudaProfilerStart/Stop (nsys "
                 "--capture-range=cudaProfilerApi)");
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "DDP bucket cap in MiB")
      ->check(CLI::PositiveNumber);
  app.add_option("--first-bucket-mb", o.first_bucket_mb, "DDP first bucket cap in MiB")
      ->check(CLI::PositiveNumber);
  app.add_option("--nnodes", o.nnodes, "DDP: nodes (run dp_bench on each with its --node-rank)")
      ->check(CLI::PositiveNumber);
  app.add_option("--node-rank", o.node_rank, "DDP: this node's index in [0, nnodes)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--master-addr", o.master_addr, "DDP: node 0's address (rendezvous store)");
  app.add_option("--master-port", o.master_port, "DDP: node 0's port (0: a free one, one node)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--timeout", o.timeout_s,
                 "DDP: seconds the rendezvous and each collective may take (default: DP_TIMEOUT, "
                 "else 60 s to rendezvous and 300 s per collective)")
      ->check(CLI::Range(0.001, 604800.0));
  app.add_option("--baseline", o.baseline, "also run 1 device of each mode for speedup (1/0)");
}

Setup resolve(const Options& o) {
  Setup s;
  std::string fallback;
  s.type = kernels::choose_device_type(o.device, &fallback);
  if (!fallback.empty() && !dp::dist::worker_env_from_environment())
    std::fprintf(stderr, "dp_bench: %s devices\n", fallback.c_str());
  s.physical = s.type == DeviceType::cuda ? kernels::cuda_device_count()
                                          : static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  s.gpus = o.gpus > 0 ? o.gpus : (s.type == DeviceType::cuda ? s.physical : 4);
  DP_CHECK(o.dtype != "bf16",
           "--dtype bf16: mixed-precision training is not implemented yet; use fp32 or tf32");
  s.math = o.dtype == "tf32" ? kernels::MathMode::tf32 : kernels::MathMode::strict;
  return s;
}

int64_t global_batch(const Options& o, int n) {
  return o.batch_per_device > 0 ? o.batch_per_device * n : o.batch;
}

nn::ModulePtr make_model(const std::string& name) {
  if (name == "mlp") return nn::mlp({784, 256, 256, 10});
  if (name == "cnn") return nn::lenet(1, 10);
  return nn::resnet(8, 1, 10);
}

kernels::SgdConfig optimizer_config() {
  kernels::SgdConfig c;
  c.lr = 0.05f;
  c.momentum = 0.9f;
  return c;
}

dp::data::SyntheticDataset bench_dataset(const Options& o, int64_t batch) {
  dp::data::SyntheticOptions so;
  so.signal = kBenchSignal;
  return dp::data::SyntheticDataset((o.steps + o.warmup) * batch, kernels::Shape{1, 28, 28}, 10,
                                    o.seed, so);
}

std::string gpu_name() {
  return kernels::gpu_name(0);
}

Header make_header(const Options& o, const Setup& s, int logical) {
  Header h;
  h.device = s.type == DeviceType::cuda ? gpu_name() : "cpu";
  h.physical = s.physical;
  h.logical = logical;
  h.model = o.model;
  h.params = make_model(o.model)->num_parameters();
  h.dtype = o.dtype;
  return h;
}

std::pair<int, int> profile_range(const Options& o) {
  if (o.profile_steps.empty()) return {-1, -1};
  int a = -1, b = -1;
  char c = 0;
  std::istringstream is(o.profile_steps);
  DP_CHECK((is >> a >> c >> b) && c == ':' && 0 <= a && a <= b,
           "--profile-steps '" << o.profile_steps << "': expected a:b with 0 <= a <= b");
  return {a, b};
}

void progress(const std::string& label, int step, int total) {
  if (!isatty(fileno(stderr))) return;
  int width = 30, done = total ? step * width / total : width;
  std::fprintf(stderr, "\r%-10s [%s%s] %d/%d", label.c_str(), std::string(done, '#').c_str(),
               std::string(width - done, '.').c_str(), step, total);
  if (step == total) std::fprintf(stderr, "\r%*s\r", 60, "");
  std::fflush(stderr);
}

RunResult run_dp(const Options& o, const Setup& s, int n, dp::Trace* trace) {
  int64_t batch = global_batch(o, n);
  const auto data = bench_dataset(o, batch);
  auto model = make_model(o.model);
  auto devices = kernels::make_devices(s.type, n);
  model->materialize(devices[0], o.seed);
  nn::SGD opt(*model, optimizer_config());
  dp::DataParallelOptions dopt;
  dopt.math = s.math;
  dp::DataParallel engine(model, opt, devices, dopt);

  RunResult r;
  r.mode = "dp";
  r.gpus = n;
  r.batch = batch;
  r.param_bytes = engine.parameter_bytes();
  r.bytes_theory = dp_bytes_theory(n, r.param_bytes);
  std::map<std::string, std::vector<double>> phases;
  auto [pa, pb] = profile_range(o);
  std::string label = "dp N=" + std::to_string(n);
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    int timed = step - o.warmup;
    auto b = dp::data::make_batch(data, step * batch, batch);
    if (timed == pa) kernels::profiler_start();
    if (timed == 0) engine.set_trace(trace);
    dp::StepStats st = engine.train_step(b.images, b.labels);
    if (timed == pb) kernels::profiler_stop();
    progress(label, step + 1, o.warmup + o.steps);
    if (timed < 0) continue;
    r.step_ms.push_back(st.ms.total);
    r.losses.push_back(st.loss);
    r.bytes_per_step = st.bytes_moved;
    phases["scatter"].push_back(st.ms.scatter);
    phases["replicate"].push_back(st.ms.replicate);
    phases["forward"].push_back(st.ms.forward);
    phases["backward"].push_back(st.ms.backward);
    phases["reduce"].push_back(st.ms.reduce);
    phases["optimizer"].push_back(st.ms.step);
  }
  engine.set_trace(nullptr);
  for (auto& [name, v] : phases) r.phases_ms[name] = percentile(v, 0.5);
  r.final_loss = r.losses.empty() ? 0 : r.losses.back();
  r.peak_mem_bytes = engine.peak_memory_bytes();
  return r;
}

namespace {

std::vector<int> sweep_counts(const Options& o, const Setup& s) {
  std::vector<int> counts;
  if (!o.sweep.empty()) {
    std::stringstream ss(o.sweep);
    std::string item;
    while (std::getline(ss, item, ',')) {
      char* end = nullptr;
      long v = std::strtol(item.c_str(), &end, 10);
      DP_CHECK(end && *end == '\0' && v >= 1 && v <= 64,
               "--sweep '" << o.sweep << "': '" << item << "' is not a count in [1, 64]");
      counts.push_back(static_cast<int>(v));
    }
    return counts;
  }
  if (o.baseline && s.gpus > 1) counts.push_back(1);
  counts.push_back(s.gpus);
  return counts;
}

void write_chart(const Options& o, const std::string& csv, const std::string& note) {
  std::string chart = o.chart_path.empty() ? "dp_bench_sweep.svg" : o.chart_path;
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::printf("chart: skipped (gnuplot is not installed); the CSV is %s\n", csv.c_str());
    return;
  }
  bool png = chart.size() > 4 && chart.substr(chart.size() - 4) == ".png";
  std::string script = chart + ".gp";
  std::ofstream gp(script);
  gp << "set terminal " << (png ? "pngcairo size 900,500" : "svg size 900,500") << "\n"
     << "set output '" << chart << "'\nset datafile separator ','\n"
     << "set termoption noenhanced\n"
     << "set title \"dp_bench: samples/s against device count" << (note.empty() ? "" : "\\n")
     << note << "\"\n"
     << "set xlabel 'devices (N)'\nset ylabel 'samples/s'\nset key outside right\nset grid\n"
     << "set xtics 1\nset yrange [0:*]\n"
     << "plot '" << csv << "' using 2:(strcol(1) eq 'dp' ? $6 : 1/0) with linespoints title 'DP', '"
     << csv << "' using 2:(strcol(1) eq 'ddp' ? $6 : 1/0) with linespoints title 'DDP'\n";
  gp.close();
  int rc = std::system(("gnuplot '" + script + "' 2>/dev/null").c_str());
  std::remove(script.c_str());
  if (rc == 0)
    std::printf("chart: %s\n", chart.c_str());
  else
    std::printf("chart: gnuplot failed (exit %d); the CSV is %s\n", rc, csv.c_str());
}

}  // namespace

int run(const Options& o, int argc, char** argv) {
  if (dp::dist::worker_env_from_environment()) return ddp_worker_main(o, argc, argv);
  Setup s = resolve(o);
  if (o.nnodes > 1) {
    DP_CHECK(o.mode == "ddp", "--nnodes " << o.nnodes << ": only --mode ddp spans nodes (DP is "
                                          << "one process by definition)");
    DP_CHECK(o.master_port > 0 && o.sweep.empty(),
             "--nnodes " << o.nnodes << ": give --master-addr/--master-port, and no --sweep");
    DP_CHECK(o.node_rank < o.nnodes,
             "--node-rank " << o.node_rank << " is not in [0, " << o.nnodes << ")");
  }
  std::vector<int> counts = o.nnodes > 1 ? std::vector<int>{s.gpus} : sweep_counts(o, s);
  int max_n = *std::max_element(counts.begin(), counts.end());
  if (s.type == DeviceType::cuda)
    dp::warn_if_oversubscribed(kernels::make_devices(DeviceType::cuda, max_n));
  bool want_dp = o.mode != "ddp", want_ddp = o.mode != "dp";
  bool tracing = !o.trace_path.empty();

  std::vector<RunResult> runs;
  std::vector<std::pair<std::string, std::vector<dp::TraceEvent>>> traces;
  for (const char* mode : {"dp", "ddp"}) {
    if ((mode[1] == 'p' && !want_dp) || (mode[1] == 'd' && !want_ddp)) continue;
    for (int n : counts) {
      dp::Trace trace;
      std::optional<RunResult> got = mode[1] == 'p'
                                         ? run_dp(o, s, n, tracing ? &trace : nullptr)
                                         : run_ddp(o, s, n, argc, argv, tracing ? &trace : nullptr);
      if (!got) {
        std::printf("dp_bench: node %d ran its %d ranks; node 0 prints the report\n", o.node_rank,
                    n);
        return 0;
      }
      RunResult r = std::move(*got);
      if (!isatty(fileno(stderr)))
        std::fprintf(stderr, "dp_bench: %s N=%d: %.3f ms/step, final loss %.6f\n", mode, r.gpus,
                     r.step_ms_median(), r.final_loss);
      runs.push_back(std::move(r));
      if (tracing)
        traces.emplace_back(std::string(mode) + " N=" + std::to_string(r.gpus), trace.events());
    }
  }

  Header h = make_header(o, s, max_n);
  print_table(std::cout, h, runs);
  print_projection(std::cout, runs);

  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    DP_CHECK(f, "--json: cannot write '" << o.json_path << "'");
    f << to_json(h, runs).dump(2) << "\n";
    std::printf("json: %s\n", o.json_path.c_str());
  }
  if (tracing) {
    std::ofstream f(o.trace_path);
    DP_CHECK(f, "--trace: cannot write '" << o.trace_path << "'");
    f << chrome_trace(traces).dump() << "\n";
    std::printf("trace: %s (open in ui.perfetto.dev or chrome://tracing)\n", o.trace_path.c_str());
  }
  if (!o.sweep.empty()) {
    std::string csv = o.csv_path.empty() ? "dp_bench_sweep.csv" : o.csv_path;
    std::ofstream f(csv);
    DP_CHECK(f, "--csv: cannot write '" << csv << "'");
    write_sweep_csv(f, runs);
    f.close();
    std::printf("sweep: %s\n", csv.c_str());
    std::string note;
    if (h.device == "cpu")
      note = "(CPU devices sharing cores: engine overhead, not scaling)";
    else if (oversubscribed(h))
      note = "(logical GPUs sharing one: engine overhead, not scaling)";
    write_chart(o, csv, note);
  }
  return 0;
}

}  // namespace bench
