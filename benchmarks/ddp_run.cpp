#include "benchmarks/ddp_run.hpp"

#include "benchmarks/shared_file.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "dp/chunks.hpp"
#include "dp/cli/cli.hpp"
#include "dp/data/loader.hpp"
#include "dp/distributed/ddp_trainer.hpp"
#include "nn/nn.hpp"

namespace bench {

std::optional<RunResult> run_ddp(const Options& o, const Setup& s, int n, int argc, char** argv,
                                 dp::Trace* trace, bool hook) {
  (void)s;
  return run_workers(o, n, hook ? "the DDP run with the comm hook" : "the DDP run", argc, argv,
                     trace, hook);
}

std::optional<RunResult> run_workers(const Options& o, int n, const std::string& what, int argc,
                                     char** argv, dp::Trace* trace, bool hook) {
  SharedFile result("dp_bench_ddp_result");
  std::vector<std::unique_ptr<SharedFile>> traces;
  std::string trace_fds;
  for (int rank = 0; trace && rank < n; ++rank) {  // this node's ranks
    traces.push_back(std::make_unique<SharedFile>("dp_bench_ddp_trace"));
    trace_fds += (rank ? "," : "") + std::to_string(traces.back()->fd());
  }
  dp::dist::DdpTrainerOptions t;
  t.backend = o.backend;
  t.launch = o.launch;
  t.launch.nproc_per_node = n;
  // The workers re-run this program with the same flags plus these: they read the worker
  // environment, train their shard and rank 0 writes the figures to the `result` descriptor.
  t.launch.extra_env = {{"DP_BENCH_DDP_RESULT_FD", std::to_string(result.fd())},
                        {"DP_BENCH_DDP_TRACE_FDS", trace_fds},
                        {"DP_BENCH_DDP_N", std::to_string(n * o.launch.nnodes)},
                        {"DP_BENCH_TRACE_ORIGIN_NS", trace ? std::to_string(now_ns()) : ""},
                        {"DP_BENCH_DDP_HOOK", hook ? "1" : ""}};
  std::optional<int> rc = dp::dist::launch_if_parent(t, argc, argv);
  DP_CHECK(rc.has_value(), "dp_bench: a launch from a worker process");
  const std::string ranks = what + " on " + std::to_string(n * o.launch.nnodes) + " ranks";
  if (*rc == 128 + SIGINT || *rc == 128 + SIGTERM)
    throw RunFailed(ranks + " was stopped by " + (*rc == 128 + SIGINT ? "SIGINT" : "SIGTERM"), *rc);
  if (*rc != 0)
    throw RunFailed("error: " + ranks + " failed (launcher exit " + std::to_string(*rc) + ")", *rc);
  if (o.launch.node_rank != 0) return std::nullopt;  // rank 0, and so the figures, live on node 0
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(result.read());
  } catch (const std::exception& e) {
    DP_THROW("dp_bench: rank 0 of " << what << " wrote no result: " << e.what());
  }
  RunResult r = run_from_json(j);
  // One track per rank, merged here from what the ranks wrote.
  for (int rank = 0; rank < static_cast<int>(traces.size()); ++rank) {
    std::string text = traces[rank]->read();
    if (text.empty()) continue;
    for (auto& e : nlohmann::json::parse(text))
      trace->add({e.at("name").get<std::string>(), rank, e.at("ts").get<double>(),
                  e.at("dur").get<double>()});
  }
  return r;
}

dp::dist::RunConfig bench_run_config(const Options& o, int64_t batch, int64_t dataset_size) {
  // Keyed by the flags the user types, so that a mismatch names the flag to fix; the derived
  // fields (the data set's size, and the engine's own: dp::dist::verify_same_config) come after.
  return {{"program", "dp_bench"},
          {"--mode", o.mode},
          {"--model", model_name(o)},
          {"--batch", std::to_string(batch)},
          {"--steps", std::to_string(o.steps)},
          {"--warmup", std::to_string(o.warmup)},
          {"--repeat", std::to_string(o.repeat)},
          {"--dtype", o.dtype},
          {"--activations", o.activations},
          {"--comm-dtype", o.comm_dtype},
          {"--optim", o.optim},
          {"--seed", std::to_string(o.seed)},
          {"--zero", std::to_string(o.zero)},
          {"--zero-overlap", o.zero_overlap ? "on" : "off"},
          {"--sync-bn", o.sync_bn ? "on" : "off"},
          {"--micro-batches", std::to_string(o.micro_batches)},
          {"--dropout", dp::dist::config_number(o.dropout)},
          {"--bucket-cap-mb", dp::dist::config_number(o.bucket_cap_mb)},
          {"--first-bucket-mb", dp::dist::config_number(o.first_bucket_mb)},
          {"--seq", o.seq ? std::to_string(*o.seq) : "the context"},
          // Whether and when each rank saves or loads: saves and loads are collectives, and a
          // rank without them would wait out the timeout in another collective. The folder
          // itself may differ between nodes.
          {"--checkpoint-dir", o.checkpoint_dir.empty() ? "none" : "given"},
          {"--save-every", o.save_every ? std::to_string(*o.save_every) : "none"},
          {"--resume", o.resume},
          {"dataset_size", std::to_string(dataset_size)}};
}

std::shared_ptr<dp::dist::CommHook> workload_hook_of_run(const Options& o, bool external) {
  const char* hook_env = std::getenv("DP_BENCH_DDP_HOOK");
  if (external || !hook_env || std::string(hook_env) != "1") return nullptr;
  DP_CHECK(o.workload && o.workload->make_comm_hook,
           "dp_bench worker: a comm hook run without a workload that makes one");
  std::shared_ptr<dp::dist::CommHook> hook = o.workload->make_comm_hook();
  DP_CHECK(hook, "the workload's make_comm_hook returned no hook");
  return hook;
}

int ddp_worker_main(const Options& o, int argc, char** argv) {
  (void)argc;
  (void)argv;
  // Started by our own launcher (run_ddp), or by an external one (torchrun, mpirun, Slurm):
  // then rank 0 prints the report itself.
  const char* result_env = std::getenv("DP_BENCH_DDP_RESULT_FD");
  const char* n_env = std::getenv("DP_BENCH_DDP_N");
  bool external = !result_env || !n_env;
  const char* origin_env = std::getenv("DP_BENCH_TRACE_ORIGIN_NS");
  const char* trace_fds_env = std::getenv("DP_BENCH_DDP_TRACE_FDS");
  bool tracing = !external && origin_env && *origin_env && trace_fds_env;

  Setup s = resolve(o);
  dp::dist::DdpOptions ddp_options;
  ddp_options.bucket_cap_bytes = static_cast<int64_t>(o.bucket_cap_mb * (1 << 20));
  ddp_options.first_bucket_bytes = static_cast<int64_t>(o.first_bucket_mb * (1 << 20));
  ddp_options.comm_dtype = s.comm_dtype;
  ddp_options.comm_hook = workload_hook_of_run(o, external);
  const bool hooked = ddp_options.comm_hook != nullptr;
  dp::dist::DdpTrainer trainer(s.type, o.backend, ddp_options, timeout_of(o));
  int n = external ? trainer.world_size() : std::atoi(n_env);
  DP_CHECK(trainer.world_size() == n, "dp_bench worker: world size " << trainer.world_size()
                                                                     << " but " << n
                                                                     << " ranks were asked for");
  int64_t batch = global_batch(o, n);
  const StepBatches data(o, batch);
  auto building = build_notice(o, hooked ? "hook" : "ddp", n, trainer.rank() == 0);
  auto model = model_of(o);
  model->materialize(trainer.device(), o.seed);
  if (s.activations != kernels::DType::f32) model->set_activations(nn::Activations::compute);
  auto optimizer = make_optimizer(o, *model);
  nn::Optimizer& opt = *optimizer;
  trainer.set_zero_stage(o.zero);
  trainer.set_zero_overlap(o.zero_overlap);
  trainer.set_sync_batch_norm(o.sync_bn);
  trainer.set_precision(s.precision);
  trainer.set_graphs(graphs_of(o));
  trainer.set_graph_collectives(o.ddp_graph_collectives == "auto");
  trainer.set_phase_timing(phase_timing_of(o));
  trainer.set_metrics_lag(o.metrics_lag);
  trainer.set_micro_batches(o.micro_batches);
  if (nn::LossPtr loss = loss_of(o)) trainer.set_loss(std::move(loss));
  if (o.workload) trainer.set_clip_grad_norm(o.workload->clip_grad_norm);
  // What every rank must agree on, verified by wrap() before the weights are broadcast.
  trainer.set_run_config(bench_run_config(o, batch, data.size()));
  trainer.wrap(model, opt);
  building.reset();
  if (s.math == kernels::MathMode::tf32) kernels::context(trainer.device()).set_math(s.math);

  std::unique_ptr<dp::Trace> trace;
  if (tracing) {
    auto origin = std::chrono::steady_clock::time_point(
        std::chrono::nanoseconds(std::strtoll(origin_env, nullptr, 10)));
    trace = std::make_unique<dp::Trace>(origin);
  }
  RunResult r;
  r.mode = hooked ? "hook" : "ddp";
  if (hooked) r.comm_hook = ddp_options.comm_hook->name();
  r.optim = o.optim;
  r.comm_dtype = o.comm_dtype;
  r.micro_batches = o.micro_batches;
  r.micro_batches_run = micro_batches_run(o.micro_batches, batch, 1, n);
  r.zero = o.zero;
  r.zero_overlap = o.zero_overlap;  // refused without --zero 1
  if (o.sync_bn) r.sync_bn_values = nn::batch_norm_sync_values_per_step(*model);
  r.gpus = n;
  r.batch = batch;
  r.param_bytes = model->flat_params().nbytes();
  std::map<std::string, std::vector<double>> phases;
  ReplayCounts replay;
  std::vector<std::vector<double>> ready_frac;  // per bucket, one per timed step
  auto [pa, pb] = profile_range(o);
  nn::TrainingProgress state = bench_state(o, r.mode.c_str(), n);
  // Rank 0 writes the checkpoints: it holds the folder's lock (held by the launcher when ours
  // started it: then this only checks that).
  std::optional<nn::CheckpointDirLock> lock;
  if (!o.checkpoint_dir.empty() && trainer.rank() == 0) lock.emplace(o.checkpoint_dir, "dp_bench");
  int first = 0;
  // After wrap(): under ZeRO-1 each rank takes its shard of the file's whole optimizer state.
  // Every rank reads the same folder, so every rank skips the same damaged files (checked).
  const nn::Resumed resumed = trainer.resume(o.resume, o.checkpoint_dir, state);
  if (trainer.rank() == 0) print_resume_report(resumed, state);
  if (const std::string& path = resumed.path; !path.empty()) {
    const nn::TrainingProgress& got = resumed.progress;
    // Every rank reads the same file, so every rank takes this way out alike.
    if (auto msg = nn::nothing_left_to_train(got.step, o.warmup + o.steps, path,
                                             "give more --steps to train further")) {
      r.nothing_left = *msg;
      if (trainer.rank() == 0 && !external)
        SharedFile::write_fd(fd_from_env(result_env, "DP_BENCH_DDP_RESULT_FD"),
                             run_to_json(r).dump());
      else if (trainer.rank() == 0)
        std::printf("dp_bench: %s\n", msg->c_str());
      trainer.group().barrier()->wait();
      return 0;
    }
    if (got.scaler) trainer.scaler().set_state(*got.scaler);
    first = static_cast<int>(got.step);  // < warmup + steps
  }
  auto save = [&](int step) {  // collective: rank 0 writes, the others wait for it
    state.step = step;
    state.rng_offsets = trainer.all_gather(model->flat().rng_offset);
    if (trainer.scaler().enabled()) state.scaler = trainer.scaler().state();
    // ZeRO-1: the shards gathered into the whole state (collective), so the file does not
    // depend on the world size.
    const nn::OptimizerState whole =
        trainer.zero() ? trainer.zero()->gather_optimizer_state() : nn::OptimizerState{};
    if (trainer.rank() == 0) nn::save_checkpoint_in(*lock, o.keep, *model, opt, state, whole);
    trainer.group().barrier()->wait();
  };
  auto bar = progress_line(r.mode + " N=" + std::to_string(n), o.warmup + o.steps, first,
                           trainer.rank() == 0);
  CaptureWatch capture;
  for (int step = first; step < o.warmup + o.steps; ++step) {
    int timed = step - o.warmup;
    auto b = data.at(step);
    if (timed == pa) kernels::profiler_start();
    if (timed == 0) trainer.ddp().set_trace(trace.get());
    float loss = trainer.train_step(b.images, b.labels);
    if (timed == pb) kernels::profiler_stop();
    {
      const auto& t = trainer.last_times();
      capture.see(r, step, t.captured, t.allocations, t.peak_bytes);
    }
    if (o.save_every && (step + 1) % *o.save_every == 0) save(step + 1);
    if (trainer.rank() == 0) bar->update(step + 1);
    if (timed < 0) continue;
    const auto& t = trainer.last_times();
    r.step_ms.push_back(t.total);
    r.losses.push_back(loss);
    r.loss_scale = trainer.scaler().scale();
    r.skipped_steps = trainer.scaler().skipped_steps();
    r.bytes_per_step = trainer.last_payload_bytes();
    const dp::dist::DdpStats& ds = trainer.ddp().stats();
    r.buckets = ds.buckets;
    r.buckets_overlapped = ds.launched_before_backward_end;
    ready_frac.resize(ds.bucket_ready_ms.size());
    for (size_t k = 0; k < ds.bucket_ready_ms.size(); ++k)
      ready_frac[k].push_back(ds.backward_ms > 0 && ds.bucket_ready_ms[k] >= 0
                                  ? std::min(1.0, ds.bucket_ready_ms[k] / ds.backward_ms)
                                  : 1.0);  // not issued in backward: ready at its end
    replay.add(t.allocations, t.host_syncs, t.graph_nodes, t.casts);
    if (o.phase_times == "on") {
      phases["forward"].push_back(t.forward);
      phases["backward"].push_back(t.backward);
      phases["allreduce_exposed"].push_back(t.allreduce_wait);
      phases["optimizer"].push_back(t.optimizer);
    }
    r.graphed_steps += t.graphed;
  }
  trainer.ddp().set_trace(nullptr);
  r.graphs_fallback = trainer.graphs_fallback();
  r.attention = attention_summary(o, s, trainer.attention_report());
  if (r.graphed_steps > 0)
    r.graph_collectives = trainer.collectives_in_graph() ? "in graph" : "between graphs";
  if (o.metrics_lag > 0) file_lagged_losses(r, trainer.finish_metrics());
  if (!o.checkpoint_dir.empty()) save(o.warmup + o.steps);  // the end of the run
  replay.report(r);
  for (auto& f : ready_frac) r.bucket_ready_frac.push_back(median(f));
  r.bucket_bytes = trainer.ddp().bucket_bytes();
  // A synchronous step ends when its last rank ends: the step time is the slowest rank's, per
  // step, gathered from every rank (rank 0 alone would flatter the figures).
  if (!r.step_ms.empty()) {
    const int64_t steps = static_cast<int64_t>(r.step_ms.size());
    std::vector<float> mine(r.step_ms.begin(), r.step_ms.end());
    kernels::Tensor local = kernels::Tensor::from_vector(mine, {steps}, trainer.device());
    kernels::Tensor all =
        kernels::Tensor::empty({n * steps}, kernels::DType::f32, trainer.device());
    trainer.group().all_gather(all, local)->wait();
    r.step_ms = slowest_per_step(all.to_host_f32(), n, steps);
  }
  // Rank 0's phases of the median step; "other" holds the rest of that step (the slowest rank's
  // time), a slower rank's lead included.
  median_step_phases(r, phases, {"forward", "backward", "allreduce_exposed", "optimizer"});
  r.final_loss = r.losses.empty() ? 0 : r.losses.back();
  // The payload handed to the group was counted (the last step's); the ring model says
  // 2 (N-1)/N of it crosses each rank's link.
  r.bytes_theory = ring_bytes_theory(n, r.bytes_per_step);
  if (const dp::dist::ZeroStage1* zero = trainer.zero(); zero && n > 1) {
    // ZeRO-1's exchange as a ring moves it: the all-gather sends each rank's shard to the N-1
    // others ((N-1)/N of the parameters per rank, the tail's broadcast alike), after a
    // reduce-scatter of as many bytes, or (overlapped) DDP's all-reduce of what the buckets
    // handed over: the payload counted less the all-gather's (this rank's shard and the tail).
    const dp::dist::ZeroShardPlan& plan = zero->plan();
    const int64_t params = plan.numel * 4, gathered_in = (params - plan.shard * (n - 1) * 4);
    const int64_t gather = (n - 1) * params / n;
    r.bytes_theory =
        gather +
        (trainer.zero_overlapped() ? ring_bytes_theory(n, r.bytes_per_step - gathered_in) : gather);
  }

  // Peak memory of every rank, gathered to rank 0.
  float mine = static_cast<float>(kernels::context(trainer.device()).memory()->peak.load() +
                                  model->flat_params().nbytes() + model->flat_grads().nbytes());
  kernels::Tensor one = kernels::Tensor::from_vector({mine / 1024.f}, {1}, trainer.device());
  kernels::Tensor all = kernels::Tensor::empty({n}, kernels::DType::f32, trainer.device());
  trainer.group().all_gather(all, one)->wait();
  for (float kib : all.to_host_f32()) r.peak_mem_bytes.push_back(static_cast<int64_t>(kib) * 1024);
  // Optimizer state of every rank (a whole copy each, or one shard each under ZeRO-1).
  for (uint64_t b : trainer.all_gather(static_cast<uint64_t>(opt.state_bytes())))
    r.optimizer_state_bytes.push_back(static_cast<int64_t>(b));

  if (trace) {
    nlohmann::json events = nlohmann::json::array();
    for (auto& e : trace->events())
      events.push_back({{"name", e.name}, {"ts", e.begin_us}, {"dur", e.duration_us}});
    // This node's ranks' descriptors, in local rank order.
    std::stringstream fds(trace_fds_env);
    std::string item;
    for (int i = 0; std::getline(fds, item, ','); ++i)
      if (i == trainer.env().local_rank)
        SharedFile::write_fd(fd_from_env(item.c_str(), "DP_BENCH_DDP_TRACE_FDS"), events.dump());
  }
  if (trainer.rank() == 0 && !external) {
    SharedFile::write_fd(fd_from_env(result_env, "DP_BENCH_DDP_RESULT_FD"), run_to_json(r).dump());
  } else if (trainer.rank() == 0) {
    Header h = make_header(o, s, trainer.env().local_world_size);
    ProjectionInput projection = projection_input(h, {r}, o.project_from);
    print_table(std::cout, h, {r});
    print_memory_model(std::cout, {r});
    print_sync_bn(std::cout, {r});
    print_projection(std::cout, projection);
    if (!o.json_path.empty())
      dp::cli::write_output("--json", o.json_path, to_json(h, {r}, projection).dump(2) + "\n");
  }
  trainer.group().barrier()->wait();  // every trace file is written before the parent reads
  return 0;
}

}  // namespace bench
