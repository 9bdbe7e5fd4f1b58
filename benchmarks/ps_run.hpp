// dp_bench --mode ps: the asynchronous parameter server beside synchronous DP.
#pragma once

#include "benchmarks/bench_common.hpp"

namespace bench {

// Runs DP and the parameter server on the same s.gpus devices, model and samples, and prints
// (and writes with --json/--trace) throughput, staleness and loss against samples and time.
int run_ps_mode(const Options& o, const Setup& s);

}  // namespace bench
