// Compare DP and DDP on your own model: dp_bench's runs, phases, bytes, memory, trace, report
// and verdict as a library call. A research user writes their model and data as a Workload and
// calls compare() from main; samples/compare_my_model.cpp is a complete program.
//
//   int main(int argc, char** argv) {
//     bench::Workload w{"my_net", [] { return my_net(); }, [](int64_t n) { return my_data(n); }};
//     return bench::compare(w, argc, argv);  // takes dp_bench's flags: --gpus 4 --repeat 5 ...
//   }
#pragma once

#include "benchmarks/bench_common.hpp"

namespace bench {

// Parses dp_bench's flags from argv (all of them but --model, which the workload replaces),
// runs DP and DDP on `workload` and prints dp_bench's report. Call it first thing in main with
// main's own argc and argv: the DDP ranks are this program started again with the same
// arguments (as torchrun starts them), and there the same call trains the rank's shard.
// Returns the exit code: 0, 1 after an error it printed, 2 for bad flags, 130 or 143 when
// stopped by SIGINT or SIGTERM.
int compare(Workload workload, int argc, char** argv);

// The dp_bench command: the same, on --model's built-in model and synthetic data.
int dp_bench_main(int argc, char** argv);

}  // namespace bench
