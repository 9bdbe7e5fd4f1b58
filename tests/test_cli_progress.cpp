// bench.progress: the programs' progress line (redrawn on a terminal, plain periodic lines
// otherwise) and the --log JSONL step log.
#include <sys/resource.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dp/cli/cli.hpp"
#include "dp/cli/progress.hpp"
#include "tests/test_util.hpp"

namespace {

// What `f` printed to a temporary FILE.
template <class F>
std::string captured(F f) {
  std::FILE* out = std::tmpfile();
  REQUIRE(out);
  f(out);
  std::fflush(out);
  std::rewind(out);
  std::string text;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, out)) > 0;) text.append(buf, n);
  std::fclose(out);
  return text;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("bench.progress: plain lines on schedule and at the end, with rate and ETA") {
  using dp::cli::ProgressLine;
  std::string text = captured([](std::FILE* out) {
    ProgressLine p("epoch 0", 5, "steps", ProgressLine::Style::plain, out,
                   std::chrono::milliseconds(0));
    for (int i = 1; i <= 5; ++i) p.update(i, "loss 0.5");
  });
  CHECK(count(text, "\n") == 5);  // a period of 0: every update
  CHECK(count(text, "\r") == 0);
  CHECK(text.find("epoch 0  1/5 steps") != std::string::npos);
  CHECK(text.find("5/5 steps") != std::string::npos);
  CHECK(text.find("steps/s  ETA ") != std::string::npos);
  CHECK(text.find("loss 0.5") != std::string::npos);
  // A run shorter than the period prints nothing, not even its end.
  std::string quiet = captured([](std::FILE* out) {
    ProgressLine p("epoch 0", 1000, "steps", ProgressLine::Style::plain, out,
                   std::chrono::hours(1));
    for (int i = 1; i <= 1000; ++i) p.update(i);
  });
  CHECK(quiet.empty());
}

TEST_CASE("bench.progress: start() reports a first step slower than the period when it ends") {
  using dp::cli::ProgressLine;
  auto run = [](bool started) {
    return captured([started](std::FILE* out) {
      ProgressLine p("dp N=2", 3, "steps", ProgressLine::Style::plain, out,
                     std::chrono::milliseconds(50));
      if (started) p.start(0);
      std::this_thread::sleep_for(std::chrono::milliseconds(80));  // a slow first step
      p.update(1);
    });
  };
  // Without start() the first update only starts the clock: a run of minutes a step said
  // nothing until its second step had ended.
  CHECK(run(false).empty());
  const std::string text = run(true);
  CHECK(text.find("dp N=2  1/3 steps") == 0);
  CHECK(count(text, "\n") == 1);
  // A resumed run starts at its first step: the rate counts the steps it trains, and a redrawn
  // line shows the count at once.
  std::string redrawn = captured([](std::FILE* out) {
    ProgressLine p("dp N=2", 10, "steps", ProgressLine::Style::redrawn, out);
    p.start(4);
    p.start(7);  // a second call does nothing
  });
  CHECK(redrawn.find("\rdp N=2  4/10 steps  0.0 steps/s  ETA ?") == 0);
  CHECK(count(redrawn, "\r") == 1);
  CHECK(redrawn.back() == '\n');  // the destructor ends the line
}

TEST_CASE("bench.progress: a redrawn line returns to its start and ends with one newline") {
  using dp::cli::ProgressLine;
  std::string text = captured([](std::FILE* out) {
    ProgressLine p("dp N=4", 3, "steps", ProgressLine::Style::redrawn, out);
    p.update(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    p.update(2);
    p.update(3);
  });
  CHECK(count(text, "\r") == 3);
  CHECK(count(text, "\n") == 1);
  CHECK(text.back() == '\n');
  CHECK(text.find("3/3 steps") != std::string::npos);
  CHECK(dp::cli::duration_text(3725) == "1h02m");
  CHECK(dp::cli::duration_text(65) == "1m05s");
  CHECK(dp::cli::duration_text(-1) == "?");
}

TEST_CASE("bench.progress: --log writes one JSON object per step, and a full disk is an error") {
  const std::string path = dp_test::temp_path("cli", "steps.jsonl");
  {
    dp::cli::StepLog log("--log", path);
    log.write({1, 2.5, 0.01, std::nullopt, 1000.0, 1.0});
    log.write({2, 2.25, 0.01, 0.75, 1200.0, 65536.0});
    log.close();
  }
  std::ifstream in(path);
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));
  REQUIRE(rows.size() == 2);
  CHECK(rows[0]["step"] == 1);
  CHECK(rows[0]["grad_norm"].is_null());
  CHECK(rows[1]["grad_norm"] == 0.75);
  CHECK(rows[1]["samples_per_s"] == 1200.0);
  CHECK(rows[1]["loss_scale"] == 65536.0);
  CHECK(rows[1]["lr"] == 0.01);

  dp::cli::StepLog full("--log", "/dev/full");
  CHECK_THROWS_WITH_AS(full.write({1, 1.0, {}, {}, 1.0, 1.0}),
                       doctest::Contains("--log(/dev/full): writing step 1 failed"),
                       kernels::Error);
  CHECK_THROWS_WITH_AS(dp::cli::StepLog("--log", "/nonexistent/dir/x.jsonl"),
                       doctest::Contains("cannot open it for writing"), kernels::Error);
}

// Last stops' leftover: a --log that filled its disk midway ended in a partial line (stdio
// wrote part of it then, and close() tried the rest), which a reader of the JSON lines fails on.
TEST_CASE("bench.progress: a --log whose disk fills midway ends at the last whole line") {
  const std::string path = dp_test::temp_path("cli", "filled.jsonl");
  dp::cli::StepLog log("--log", path);
  log.write({1, 2.5, 0.01, std::nullopt, 1000.0, 1.0});
  const auto whole = static_cast<rlim_t>(std::filesystem::file_size(path));
  // A file size limit stands in for the full disk: write() stops at it, then fails (EFBIG).
  struct rlimit before {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
  REQUIRE((before.rlim_cur == RLIM_INFINITY || before.rlim_cur > whole + 20));
  void (*handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = before;
  small.rlim_cur = whole + 20;  // room for 20 bytes of step 2's line
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::string error;
  try {
    log.write({2, 2.25, 0.01, 0.75, 1200.0, 65536.0});
  } catch (const kernels::Error& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, handler);
  CHECK(error.find("--log(" + path +
                   "): writing step 2 failed: File too large (the file ends at "
                   "the last step written whole)") != std::string::npos);
  log.close();  // nothing left to write
  CHECK(std::filesystem::file_size(path) == whole);
  std::ifstream in(path);
  std::string line, last;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    last = line;
  }
  CHECK(lines == 1);
  CHECK(nlohmann::json::parse(last)["step"] == 1);
}

TEST_CASE("bench.progress: SlowNotice says what a slow phase does, and nothing for a quick one") {
  using dp::cli::SlowNotice;
  using std::chrono::milliseconds;
  // Quicker than its delay: nothing, and the destructor does not wait out the delay.
  const auto begin = std::chrono::steady_clock::now();
  CHECK(captured([](std::FILE* out) {
          SlowNotice n("x: building", out, std::chrono::hours(1));
        }).empty());
  CHECK(std::chrono::steady_clock::now() - begin < std::chrono::minutes(1));
  // Slower: the line while it runs, then the line with its time.
  const std::string slow = captured([](std::FILE* out) {
    SlowNotice n("x: building", out, milliseconds(10));
    std::this_thread::sleep_for(milliseconds(400));
  });
  CHECK(slow.find("x: building ...\nx: building: ") == 0);
  CHECK(count(slow, "\n") == 2);
  CHECK(slow.find("s\n", slow.size() - 2) != std::string::npos);
  // Left by an exception: no end line (the error says what happened).
  CHECK(captured([](std::FILE* out) {
          try {
            SlowNotice n("x: building", out, milliseconds(10));
            std::this_thread::sleep_for(milliseconds(400));
            throw std::runtime_error("failed");
          } catch (const std::runtime_error&) {
          }
        }) == "x: building ...\n");
  // No stream (a rank that is not rank 0): no thread, nothing.
  SlowNotice quiet("x: building", nullptr, milliseconds(0));
}

TEST_CASE("bench.progress: rank 0 of torchrun, mpirun or Slurm speaks, or a process of no job") {
  // Whether the process speaks with these variables set (each removed after: none is set here).
  auto speaks = [](const std::vector<std::pair<const char*, const char*>>& vars) {
    for (const auto& kv : vars) setenv(kv.first, kv.second, 1);
    const bool first = dp::cli::first_rank_or_alone();
    for (const auto& kv : vars) unsetenv(kv.first);
    return first;
  };
  for (const char* name : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})
    REQUIRE(std::getenv(name) == nullptr);
  CHECK(speaks({}));
  // Under mpirun and Slurm RANK is unset: every rank took itself for rank 0.
  CHECK_FALSE(speaks({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  CHECK(speaks({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  CHECK_FALSE(speaks({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}}));
  CHECK_FALSE(
      speaks({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}));
  // Variables that do not parse: rank 0's part (the rendezvous names them).
  CHECK(speaks({{"RANK", "x"}, {"WORLD_SIZE", "2"}}));
}
