// cli.outputs: the programs' output files (dp::cli::output_file, replaceable_file and
// nn::io::write_output_file). A FIFO is checked up front without being opened, so a reader that
// reads once gets the run's output, not an empty read; a FIFO nobody reads is an error after a
// bounded wait, not a hang; --save-like files refuse a FIFO, a socket or a device up front.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "dp/cli/cli.hpp"
#include "dp/cli/progress.hpp"
#include "dp/trace.hpp"
#include "nn/file_io.hpp"
#include "tests/test_util.hpp"

namespace {

// A fresh folder holding one FIFO, removed at scope exit.
struct FifoDir {
  std::string dir = dp_test::temp_path("cli_outputs", "fifo");
  std::string fifo = dir + "/out";
  FifoDir() {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  }
  ~FifoDir() { std::filesystem::remove_all(dir); }
};

// What `v` says of `path` ("" when it accepts it).
std::string verdict(CLI::Validator v, std::string path) {
  return v(path);
}

}  // namespace

TEST_CASE(
    "cli.outputs: a FIFO's reader that reads once gets the output the run writes at its end") {
  FifoDir d;
  std::string got;
  std::thread reader([&] {
    const int fd = ::open(d.fifo.c_str(), O_RDONLY);  // blocks until a writer opens it
    REQUIRE(fd >= 0);
    char buf[256];
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) got.append(buf, static_cast<size_t>(n));
    ::close(fd);  // one read to the end, as `cat` or a log shipper would
  });
  // The up-front check does not open the FIFO: opening and closing it would end the reader.
  CHECK(verdict(dp::cli::output_file(dp::cli::Output::report), d.fifo).empty());
  CHECK_NOTHROW(dp::cli::check_output_file("--json", d.fifo, dp::cli::Output::report));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  nn::io::write_output_file(d.fifo, "{\"runs\": []}\n", "--json");
  reader.join();
  CHECK(got == "{\"runs\": []}\n");
  struct stat st {};
  REQUIRE(::lstat(d.fifo.c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));  // written in place, never replaced
}

TEST_CASE("cli.outputs: a FIFO nobody reads fails the write after a bounded wait, naming it") {
  FifoDir d;
  const auto start = std::chrono::steady_clock::now();
  const std::string e =
      dp_test::error_of([&] { nn::io::write_output_file(d.fifo, "x\n", "--trace"); });
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(e.find("--trace(" + d.fifo + "): cannot open it for writing") != std::string::npos);
  CHECK(e.find("no process opened the FIFO for reading within 10 s") != std::string::npos);
  CHECK(waited >= std::chrono::milliseconds(nn::io::kFifoReaderWaitMs));
  CHECK(waited < std::chrono::milliseconds(nn::io::kFifoReaderWaitMs + 5000));
}

TEST_CASE("cli.outputs: replaceable_file refuses a FIFO, a folder and /dev/null up front") {
  FifoDir d;
  std::string v = verdict(dp::cli::replaceable_file(), d.fifo);
  CHECK(v.find("is a FIFO (named pipe), not a regular file") != std::string::npos);
  v = verdict(dp::cli::replaceable_file(), "/dev/null");  // checked, never written
  CHECK(v ==
        "'/dev/null' is a character device, not a regular file: this file is written whole "
        "to a new file that then replaces the old one, which would replace the device; "
        "give the name of a regular file");
  CHECK(verdict(dp::cli::replaceable_file(), d.dir).find("is a directory") != std::string::npos);
  CHECK(verdict(dp::cli::replaceable_file(), d.dir + "/new.safetensors").empty());
  CHECK_FALSE(std::filesystem::exists(d.dir + "/new.safetensors"));  // the probe is removed
  // output_file (--json, --trace: written in place when not regular) still takes /dev/null.
  CHECK(verdict(dp::cli::output_file(dp::cli::Output::report), "/dev/null").empty());
}

TEST_CASE("cli.outputs: --log into a FIFO: its reader gets every step's line, the FIFO stays") {
  FifoDir d;
  std::string got;
  std::thread reader([&] {
    const int fd = ::open(d.fifo.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    char buf[256];
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) got.append(buf, static_cast<size_t>(n));
    ::close(fd);
  });
  CHECK(verdict(dp::cli::output_file(dp::cli::Output::step_log), d.fifo).empty());  // not opened
  {
    dp::cli::StepLog log("--log", d.fifo, "tokens_per_s");
    for (int64_t step = 1; step <= 3; ++step) log.write({step, 2.5, 0.1, std::nullopt, 100.0, 1.0});
    log.close();
  }
  reader.join();
  size_t lines = 0;
  for (char c : got) lines += c == '\n';
  CHECK(lines == 3);
  CHECK(got.rfind("{\"step\":1,", 0) == 0);
  struct stat st {};
  REQUIRE(::lstat(d.fifo.c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));
}

namespace {

// A fresh folder, removed at scope exit.
struct TempDir {
  std::string dir;
  explicit TempDir(const std::string& name) : dir(dp_test::temp_path("cli_outputs", name)) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  ~TempDir() { std::filesystem::remove_all(dir); }
  std::string write(const std::string& name, const std::string& text) const {
    const std::string path = dir + "/" + name;
    std::FILE* f = std::fopen(path.c_str(), "wb");
    REQUIRE(f != nullptr);
    REQUIRE(std::fwrite(text.data(), 1, text.size(), f) == text.size());
    REQUIRE(std::fclose(f) == 0);
    return path;
  }
};

std::string read_all(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  REQUIRE(f != nullptr);
  std::string s;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) s.append(buf, n);
  std::fclose(f);
  return s;
}

}  // namespace

TEST_CASE("cli.outputs: an existing file is replaced only when one of the programs wrote it") {
  using dp::cli::Output;
  TempDir d("existing");
  const std::string notes = d.write("notes.txt", "my notes, not a program's\n");
  const std::string config = d.write("config.json", "{\"lr\": 0.1}\n");
  const std::string empty = d.write("empty.json", "");
  // What each kind refuses: a file of the user's, and one of another kind of ours.
  for (Output kind : {Output::report, Output::trace, Output::step_log, Output::sweep_table,
                      Output::sweep_chart, Output::gnuplot_script, Output::training_state}) {
    CAPTURE(static_cast<int>(kind));
    const std::string v = verdict(dp::cli::output_file(kind), notes);
    CHECK(v.find("'" + notes + "' exists and is not ") == 0);
    CHECK(v.find("it is never replaced; remove it yourself, or give another path") !=
          std::string::npos);
    CHECK_FALSE(verdict(dp::cli::output_file(kind), config).empty());
    CHECK(verdict(dp::cli::output_file(kind), empty).empty());  // nothing to lose
    CHECK(dp::cli::existing_output_problem(d.dir + "/missing", kind).empty());
  }
  CHECK(dp::cli::existing_output_problem(config, Output::report) ==
        "'" + config +
            "' exists and is not a report of dp_bench, train_mnist, bench_kernels or "
            "bench_composed (it names no \"program\"): "
            "it is never replaced; remove it yourself, or give another path");
  CHECK(read_all(notes) == "my notes, not a program's\n");  // checked, never opened to write

  // What the programs write is accepted, and reports and traces written before the marks.
  const std::string report =
      d.write("r.json", "{\n  \"program\": \"dp_bench\",\n  \"runs\": []\n}\n");
  CHECK(verdict(dp::cli::output_file(Output::report), report).empty());
  CHECK_FALSE(dp::cli::existing_output_problem(d.write("o.json", "{\"program\": \"nanoGPT\"}"),
                                               Output::report)
                  .empty());
  CHECK(dp::cli::existing_output_problem(
            d.write("old.json", "{\"ddp_step_time\": \"x\", \"runs\": []}"), Output::report)
            .empty());
  CHECK(
      dp::cli::existing_output_problem(
          d.write("mnist.json", "{\"test_accuracy\": 0.8, \"train_loss\": [1.0]}"), Output::report)
          .empty());
  const std::string trace = d.dir + "/t.json";
  dp::write_chrome_trace(trace, {});
  CHECK(dp::cli::existing_output_problem(trace, Output::trace).empty());
  CHECK(dp::cli::existing_output_problem(
            d.write("old_trace.json", "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[]}"),
            Output::trace)
            .empty());
  CHECK_FALSE(dp::cli::existing_output_problem(d.write("torch_trace.json", "{\"traceEvents\":[]}"),
                                               Output::trace)
                  .empty());
  const std::string log = d.dir + "/log.jsonl";
  {
    dp::cli::StepLog l("--log", log);
    l.write({1, 2.5, 0.1, std::nullopt, 100.0, 1.0});
  }
  CHECK(dp::cli::existing_output_problem(log, Output::step_log).empty());
  // A rank may be writing the first line while another rank checks the flag.
  CHECK(dp::cli::existing_output_problem(d.write("partial.jsonl", "{\"step\":1,\"lo"),
                                         Output::step_log)
            .empty());
  CHECK_FALSE(
      dp::cli::existing_output_problem(d.write("other.jsonl", "{\"step\":1}\n"), Output::step_log)
          .empty());
  CHECK(
      dp::cli::existing_output_problem(
          d.write("sweep.csv", "mode,gpus,batch,step_ms_median,step_ms_p90\n"), Output::sweep_table)
          .empty());
  CHECK(dp::cli::existing_output_problem(
            d.write("c.svg",
                    "<?xml version=\"1.0\"?>\n<svg><desc>Produced by GNUPLOT 5.4 "
                    "</desc></svg>\n"),
            Output::sweep_chart)
            .empty());
  CHECK(dp::cli::existing_output_problem(d.write("c.svg.gp", "set terminal svg\n"),
                                         Output::gnuplot_script)
            .empty());
  std::string state(8, '\0');
  state += "{\"__metadata__\":{\"format\":\"dptrain-training-state-1\"}}";
  CHECK(dp::cli::existing_output_problem(d.write("s.safetensors", state), Output::training_state)
            .empty());
  // replaceable_file (--save) refuses a file that is not a training state.
  CHECK(verdict(dp::cli::replaceable_file(), notes).find("is not a training state") !=
        std::string::npos);
  CHECK(verdict(dp::cli::replaceable_file(), d.dir + "/s.safetensors").empty());
}

TEST_CASE("cli.outputs: two flags naming one file are refused, naming both") {
  TempDir d("distinct");
  const std::string a = d.write("a.json", "{}");
  REQUIRE(::link(a.c_str(), (d.dir + "/hard.json").c_str()) == 0);
  auto refusal = [](std::vector<dp::cli::FlagPath> files) {
    return dp_test::error_of([&] { dp::cli::check_distinct_files(files); });
  };
  CHECK(refusal({{"--json", a}, {"--trace", a}})
            .find("--json " + a + " and --trace " + a +
                  " name one file: one would replace the other; give each its own path") == 0);
  CHECK(refusal({{"--json", a}, {"--resume", d.dir + "/hard.json"}}).find("name one file") !=
        std::string::npos);                       // two names of one file
  const std::string fresh = d.dir + "/new.json";  // not written yet: compared by path
  CHECK(refusal({{"--json", fresh}, {"--log", d.dir + "/./sub/../new.json"}})
            .find("--json " + fresh + " and --log ") == 0);
  CHECK(refusal({{"--json", a}, {"--trace", fresh}, {"--log", ""}, {"--csv", ""}}) == "(no error)");
  CHECK(refusal({{"--json", "/dev/null"}, {"--trace", "/dev/null"}}) == "(no error)");

  const std::string ckdir = d.dir + "/ck";
  std::filesystem::create_directories(ckdir);
  auto outside = [&](const std::string& path) {
    return dp_test::error_of([&] {
      dp::cli::check_outside_checkpoints({{"--log", path}}, d.dir + "/./ck");
    });
  };
  CHECK(outside(ckdir + "/step_00000008.safetensors")
            .find("--log " + ckdir +
                  "/step_00000008.safetensors is a checkpoint's name in "
                  "--checkpoint-dir ") == 0);
  CHECK(outside(ckdir + "/log.jsonl") == "(no error)");  // the folder may hold other files
  CHECK(outside(d.dir + "/step_00000008.safetensors") == "(no error)");
}

TEST_CASE("cli.outputs: a save that does not fit its file system is refused before the run") {
  // train_text trained a whole run, then failed to write --save on a full disk: the check names
  // the flag, the file and both sizes up front (its own file system's free space: far below
  // 2^62 bytes, far above one).
  const std::string path = dp_test::temp_path("cli_outputs", "big.safetensors");
  const std::string e =
      dp_test::error_of([&] { dp::cli::check_free_space("--save", path, uint64_t{1} << 62); });
  CHECK(e.find("--save: writing '" + path +
               "' needs about 4611686018427.4 MB, but its file system (") != std::string::npos);
  CHECK(e.find(" free: free some space, or give another path") != std::string::npos);
  CHECK_NOTHROW(dp::cli::check_free_space("--save", path, 1));
  CHECK_FALSE(std::filesystem::exists(path));  // nothing written
}
