// dp_bench --mode hybrid: one process per node runs the threaded DP engine over its devices;
// the nodes' device 0s sum each reduced bucket over the process group while backward goes on
// (dp/cross_node.hpp). Launched as DDP is (benchmarks/ddp_run.cpp): by our launcher, one per
// node with --nnodes, or by torchrun with one process per node.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>

#include "benchmarks/ddp_run.hpp"
#include "benchmarks/shared_file.hpp"
#include "dp/cli/cli.hpp"
#include "dp/distributed/cross_node_group.hpp"
#include "dp/distributed/launcher.hpp"
#include "nn/nn.hpp"

namespace bench {

int hybrid_procs(const Options& o) {
  return dp::cli::hybrid_procs(o.hybrid_procs, o.launch.nnodes);
}

std::optional<RunResult> run_hybrid(const Options& o, const Setup& s, int n, int argc, char** argv,
                                    dp::Trace* trace, bool hook) {
  (void)s;
  (void)n;  // each node process reads --gpus itself
  return run_workers(o, hybrid_procs(o),
                     hook ? "the hybrid run with the comm hook" : "the hybrid run", argc, argv,
                     trace, hook);
}

int hybrid_worker_main(const Options& o) {
  const char* result_env = std::getenv("DP_BENCH_DDP_RESULT_FD");
  const bool external = !result_env;  // torchrun & co.: node 0 prints the report itself
  auto env = dp::dist::worker_env_from_environment();
  DP_CHECK(env, "dp_bench --mode hybrid: not started as a worker");
  Setup s = resolve(o);
  const int local = s.gpus;
  auto devices = kernels::make_devices(s.type, local);
  dp::dist::InitOptions io;
  io.backend = dp::dist::parse_backend(o.backend);
  io.device = devices[0];
  io.rank = env->rank;
  io.world_size = env->world_size;
  if (o.timeout_s > 0) io.timeout = timeout_of(o);
  std::unique_ptr<dp::dist::ProcessGroup> group = dp::dist::init_process_group(io);
  const int nodes = group->size(), n = local * nodes;

  const int64_t batch = global_batch(o, n);
  const StepBatches data(o, batch);
  // The nodes prove they agree before the first collective (STYLE.md 17): a node with another
  // --batch, --model or --steps fails every node at once, naming the flag, instead of training
  // a wrong loss, crashing in a collective or waiting out its timeout.
  dp::dist::RunConfig config = bench_run_config(o, batch, data.size());
  config["--gpus"] = std::to_string(local);  // the devices per node: uneven nodes are not split
  dp::dist::verify_same_config(*group, config, group->timeout());
  // The "hybrid-hook" run's hook takes device 0's buckets for the sums over nodes.
  std::shared_ptr<dp::dist::CommHook> hook = workload_hook_of_run(o, external);
  auto building = build_notice(o, hook ? "hybrid-hook" : "hybrid", n, group->rank() == 0);
  auto model = model_of(o);
  model->materialize(devices[0], o.seed);
  if (s.activations != kernels::DType::f32) model->set_activations(nn::Activations::compute);
  auto optimizer = make_optimizer(o, *model);
  dp::DataParallelOptions dopt = dp_options(o, s);
  dopt.cross_node = std::make_shared<dp::dist::GroupCrossNode>(*group, hook);
  dp::DataParallel engine(model, *optimizer, devices, dopt);
  building.reset();

  RunResult r;
  r.mode = hook ? "hybrid-hook" : "hybrid";
  if (hook) r.comm_hook = hook->name();
  r.optim = o.optim;
  r.comm_dtype = o.comm_dtype;
  r.micro_batches = o.micro_batches;
  r.micro_batches_run = micro_batches_run(o.micro_batches, batch, nodes, local);
  r.reduce = o.dp_reduce;
  r.peer_reads = o.dp_peer_reads;
  r.gpus = n;
  r.batch = batch;
  r.param_bytes = engine.parameter_bytes();
  r.optimizer_state_bytes = {optimizer->state_bytes()};  // each node's device 0 steps
  DpSteps timed;
  timed.timing = phase_timing_of(o);
  auto bar = progress_line("hybrid " + std::to_string(nodes) + "x" + std::to_string(local),
                           o.warmup + o.steps, 0, group->rank() == 0);
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    auto b = data.at(step);
    dp::StepStats st = engine.train_step(b.images, b.labels);
    if (group->rank() == 0) bar->update(step + 1);
    if (step < o.warmup) continue;
    timed.add(r, st, engine.scaler().scale());
  }
  timed.finish(r);
  r.bytes_theory = ring_bytes_theory(nodes, r.bytes_per_step);  // per node, over the link
  // The step ends with the slowest node's; node 0's devices' peaks stand for each node's.
  const int64_t steps = static_cast<int64_t>(r.step_ms.size());
  if (steps > 0) {
    std::vector<float> mine(r.step_ms.begin(), r.step_ms.end());
    kernels::Tensor here = kernels::Tensor::from_vector(mine, {steps}, devices[0]);
    kernels::Tensor all = kernels::Tensor::empty({nodes * steps}, kernels::DType::f32, devices[0]);
    group->all_gather(all, here)->wait();
    r.step_ms = slowest_per_step(all.to_host_f32(), nodes, steps);
    median_step_phases(r, timed.phases, DpSteps::additive_phases());  // of the slowest node's step
  }
  r.peak_mem_bytes = engine.peak_memory_bytes();

  if (group->rank() == 0 && !external) {
    SharedFile::write_fd(fd_from_env(result_env, "DP_BENCH_DDP_RESULT_FD"), run_to_json(r).dump());
  } else if (group->rank() == 0) {
    Header h = make_header(o, s, n);
    ProjectionInput projection = projection_input(h, {r}, o.project_from);
    print_table(std::cout, h, {r});
    print_projection(std::cout, projection);
    if (!o.json_path.empty())
      dp::cli::write_output("--json", o.json_path, to_json(h, {r}, projection).dump(2) + "\n");
  }
  group->barrier()->wait();
  return 0;
}

}  // namespace bench
