// dp_bench's DDP mode: the parent spawns N worker processes of dp_bench itself (as torchrun
// would), each trains its shard of the same global batches, and rank 0 hands the figures back
// through a result file.
#pragma once

#include <optional>

#include "benchmarks/bench_common.hpp"

namespace bench {

// Runs n ranks on this node (n x nnodes in all). The figures come back on node 0 only: other
// nodes get nullopt once their ranks finished.
std::optional<RunResult> run_ddp(const Options& o, const Setup& s, int n, int argc, char** argv,
                                 dp::Trace* trace);
int ddp_worker_main(const Options& o, int argc, char** argv);

}  // namespace bench
