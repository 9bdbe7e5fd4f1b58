// dp_bench: one model trained two ways, DP (threads) and DDP (processes), measured side by
// side on the same data and global batch. See README.md for the flags and what it reports.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>

#include "benchmarks/bench_common.hpp"

int main(int argc, char** argv) {
  bench::Options o;
  CLI::App app{"dp_bench: DP (threads) and DDP (processes) on the same model, side by side"};
  bench::add_flags(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return bench::run(o, argc, argv);
  } catch (const bench::Interrupted& e) {
    std::fprintf(stderr, "dp_bench: %s\n", e.what());
    return e.exit_code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_bench: error: %s\n", e.what());
    return 1;
  }
}
