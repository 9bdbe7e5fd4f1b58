// dp_bench's DDP mode: the parent spawns N worker processes of dp_bench itself (as torchrun
// would), each trains its shard of the same global batches, and rank 0 hands the figures back
// through a result file.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "benchmarks/bench_common.hpp"
#include "dp/distributed/config_check.hpp"

namespace bench {

// Runs n ranks on this node (n x nnodes in all). The figures come back on node 0 only: other
// nodes get nullopt once their ranks finished.
// hook: with the workload's comm hook (Workload::make_comm_hook) in place of the all-reduce.
std::optional<RunResult> run_ddp(const Options& o, const Setup& s, int n, int argc, char** argv,
                                 dp::Trace* trace, bool hook = false);
int ddp_worker_main(const Options& o, int argc, char** argv);
// The workload's comm hook when this worker belongs to the launcher's "hook" or "hybrid-hook"
// run (run_workers with hook: DP_BENCH_DDP_HOOK=1), else null; never under an external launcher.
std::shared_ptr<dp::dist::CommHook> workload_hook_of_run(const Options& o, bool external);
// What every rank or node of a dp_bench run must agree on (verified before the first
// collective): the flags that shape the run, keyed as typed ("--batch": the global batch).
dp::dist::RunConfig bench_run_config(const Options& o, int64_t batch, int64_t dataset_size);

// The launch both runs share: n processes of this program on this node (n x nnodes in all),
// rank 0's figures back through a result file, each rank's trace merged. `what` names the run
// in errors ("the DDP run").
std::optional<RunResult> run_workers(const Options& o, int n, const std::string& what, int argc,
                                     char** argv, dp::Trace* trace, bool hook = false);

// dp_bench's hybrid mode: node processes (hybrid_procs(o) on this node, one per node on a real
// cluster), each the threaded DP engine over --gpus devices, their device 0s joined through
// the process group (dp::dist::GroupCrossNode). N = devices per node x nodes.
// hook: with the workload's comm hook (Workload::make_comm_hook) for the sums over nodes.
std::optional<RunResult> run_hybrid(const Options& o, const Setup& s, int n, int argc, char** argv,
                                    dp::Trace* trace, bool hook = false);
int hybrid_worker_main(const Options& o);
// Node processes started on this machine: --hybrid-procs, or 2 with --nnodes 1 (two nodes
// simulated on one machine) and 1 per real node.
int hybrid_procs(const Options& o);

}  // namespace bench
