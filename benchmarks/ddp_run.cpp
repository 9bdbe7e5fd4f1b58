#include "benchmarks/ddp_run.hpp"

#include <cmath>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "dp/chunks.hpp"
#include "dp/data/loader.hpp"
#include "dp/distributed/ddp_trainer.hpp"
#include "nn/nn.hpp"

namespace bench {

namespace {

std::string temp_file(const char* what) {
  const char* dir = std::getenv("TMPDIR");
  std::string path = std::string(dir ? dir : "/tmp") + "/dp_bench_" + what + "_XXXXXX";
  std::vector<char> buf(path.begin(), path.end());
  buf.push_back('\0');
  int fd = mkstemp(buf.data());
  DP_CHECK(fd >= 0, "cannot create a temporary file like " << path);
  close(fd);
  return buf.data();
}

std::string trace_file_of(const std::string& result_file, int rank) {
  return result_file + ".trace" + std::to_string(rank);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::optional<RunResult> run_ddp(const Options& o, const Setup& s, int n, int argc, char** argv,
                                 dp::Trace* trace) {
  std::string result = temp_file("ddp");
  dp::dist::DdpTrainerOptions t;
  t.nproc = n;
  t.nnodes = o.nnodes;
  t.node_rank = o.node_rank;
  t.master_addr = o.master_addr;
  t.master_port = o.master_port;
  // The workers re-run this program with the same flags plus these: they read the worker
  // environment, train their shard and rank 0 writes the figures to `result`.
  t.extra_env = {{"DP_BENCH_DDP_RESULT", result},
                 {"DP_BENCH_DDP_N", std::to_string(n * o.nnodes)},
                 {"DP_BENCH_TRACE_ORIGIN_NS", trace ? std::to_string(now_ns()) : ""}};
  (void)s;
  std::optional<int> rc = dp::dist::launch_if_parent(t, argc, argv);
  DP_CHECK(rc.has_value(), "dp_bench: DDP launch from a worker process");
  if (*rc != 0) {
    std::remove(result.c_str());
    DP_THROW("dp_bench: the DDP run on " << n * o.nnodes << " ranks failed (launcher exit " << *rc
                                         << ")");
  }
  if (o.node_rank != 0) {  // rank 0, and so the figures, live on node 0
    std::remove(result.c_str());
    return std::nullopt;
  }
  std::ifstream f(result);
  nlohmann::json j;
  try {
    f >> j;
  } catch (const std::exception& e) {
    DP_THROW("dp_bench: rank 0 of the DDP run wrote no result to " << result << ": " << e.what());
  }
  std::remove(result.c_str());
  RunResult r = run_from_json(j);
  if (trace) {
    // One track per rank, merged here from the files the ranks wrote.
    for (int rank = 0; rank < n; ++rank) {  // this node's ranks (node 0: 0..n-1)
      std::string path = trace_file_of(result, rank);
      std::ifstream tf(path);
      if (!tf) continue;
      nlohmann::json events;
      tf >> events;
      for (auto& e : events)
        trace->add({e.at("name").get<std::string>(), rank, e.at("ts").get<double>(),
                    e.at("dur").get<double>()});
      std::remove(path.c_str());
    }
  }
  return r;
}

int ddp_worker_main(const Options& o, int argc, char** argv) {
  (void)argc;
  (void)argv;
  // Started by our own launcher (run_ddp), or by an external one (torchrun, mpirun, Slurm):
  // then rank 0 prints the report itself.
  const char* result_env = std::getenv("DP_BENCH_DDP_RESULT");
  const char* n_env = std::getenv("DP_BENCH_DDP_N");
  bool external = !result_env || !n_env;
  const char* origin_env = std::getenv("DP_BENCH_TRACE_ORIGIN_NS");
  bool tracing = !external && origin_env && *origin_env;
  std::string result = external ? "" : result_env;
  DP_CHECK(!external || o.mode != "dp",
           "dp_bench: started as rank of an external launcher (RANK is set): only --mode ddp "
           "runs that way; DP is one process");

  Setup s = resolve(o);
  dp::dist::DdpOptions ddp_options;
  ddp_options.bucket_cap_bytes = static_cast<int64_t>(o.bucket_cap_mb * (1 << 20));
  ddp_options.first_bucket_bytes = static_cast<int64_t>(o.first_bucket_mb * (1 << 20));
  dp::dist::DdpTrainer trainer(s.type, o.backend, ddp_options,
                               std::chrono::milliseconds(std::llround(o.timeout_s * 1000)));
  int n = external ? trainer.world_size() : std::atoi(n_env);
  DP_CHECK(trainer.world_size() == n, "dp_bench worker: world size " << trainer.world_size()
                                                                     << " but " << n
                                                                     << " ranks were asked for");
  int64_t batch = global_batch(o, n);
  const auto data = bench_dataset(o, batch);
  auto model = make_model(o.model);
  model->materialize(trainer.device(), o.seed);
  nn::SGD opt(*model, optimizer_config());
  trainer.wrap(model, opt);
  if (s.math == kernels::MathMode::tf32) kernels::context(trainer.device()).set_math(s.math);

  std::unique_ptr<dp::Trace> trace;
  if (tracing) {
    auto origin = std::chrono::steady_clock::time_point(
        std::chrono::nanoseconds(std::strtoll(origin_env, nullptr, 10)));
    trace = std::make_unique<dp::Trace>(origin);
  }
  RunResult r;
  r.mode = "ddp";
  r.gpus = n;
  r.batch = batch;
  r.param_bytes = model->flat_params().nbytes();
  r.bytes_theory = ring_bytes_theory(n, r.param_bytes);
  std::map<std::string, std::vector<double>> phases;
  auto [pa, pb] = profile_range(o);
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    int timed = step - o.warmup;
    auto b = dp::data::make_batch(data, step * batch, batch);
    if (timed == pa) kernels::profiler_start();
    if (timed == 0) trainer.ddp().set_trace(trace.get());
    float loss = trainer.train_step(b.images, b.labels);
    if (timed == pb) kernels::profiler_stop();
    if (trainer.rank() == 0) progress("ddp N=" + std::to_string(n), step + 1, o.warmup + o.steps);
    if (timed < 0) continue;
    const auto& t = trainer.last_times();
    r.step_ms.push_back(t.total);
    r.losses.push_back(loss);
    r.buckets = trainer.ddp().stats().buckets;
    r.buckets_overlapped = trainer.ddp().stats().launched_before_backward_end;
    phases["forward"].push_back(t.forward);
    phases["backward"].push_back(t.backward);
    phases["allreduce_exposed"].push_back(t.allreduce_wait);
    phases["optimizer"].push_back(t.optimizer);
  }
  trainer.ddp().set_trace(nullptr);
  for (auto& [name, v] : phases) r.phases_ms[name] = percentile(v, 0.5);
  r.final_loss = r.losses.empty() ? 0 : r.losses.back();
  // Payload each rank all-reduces per step (gradients, and buffers when averaged), under the
  // ring model: 2 (N-1)/N of it crosses each rank's link.
  r.bytes_per_step = ring_bytes_theory(n, model->flat_grads().nbytes());

  // Peak memory of every rank, gathered to rank 0.
  float mine = static_cast<float>(kernels::context(trainer.device()).memory()->peak.load() +
                                  model->flat_params().nbytes() + model->flat_grads().nbytes());
  kernels::Tensor one = kernels::Tensor::from_vector({mine / 1024.f}, {1}, trainer.device());
  kernels::Tensor all = kernels::Tensor::empty({n}, kernels::DType::f32, trainer.device());
  trainer.group().all_gather(all, one)->wait();
  for (float kib : all.to_host_f32()) r.peak_mem_bytes.push_back(static_cast<int64_t>(kib) * 1024);

  if (trace) {
    nlohmann::json events = nlohmann::json::array();
    for (auto& e : trace->events())
      events.push_back({{"name", e.name}, {"ts", e.begin_us}, {"dur", e.duration_us}});
    std::ofstream tf(trace_file_of(result, trainer.rank()));
    tf << events.dump() << "\n";
  }
  if (trainer.rank() == 0 && !external) {
    std::ofstream f(result);
    DP_CHECK(f, "dp_bench worker: cannot write " << result);
    f << run_to_json(r).dump() << "\n";
  } else if (trainer.rank() == 0) {
    Header h = make_header(o, s, trainer.env().local_world_size);
    print_table(std::cout, h, {r});
    print_projection(std::cout, {r});
    if (!o.json_path.empty()) {
      std::ofstream f(o.json_path);
      DP_CHECK(f, "--json: cannot write '" << o.json_path << "'");
      f << to_json(h, {r}).dump(2) << "\n";
    }
  }
  trainer.group().barrier()->wait();  // every trace file is written before the parent reads
  return 0;
}

}  // namespace bench
