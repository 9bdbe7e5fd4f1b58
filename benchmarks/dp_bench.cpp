// dp_bench: one model trained two ways, DP (threads) and DDP (processes), measured side by
// side on the same data and global batch. See docs/dp-bench.md for the flags and what it reports;
// the machinery is the dp_bench_lib library (benchmarks/compare.hpp), which any program can call.
#include "benchmarks/compare.hpp"

int main(int argc, char** argv) {
  return bench::dp_bench_main(argc, argv);
}
