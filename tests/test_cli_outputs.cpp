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

#include "dp/cli/cli.hpp"
#include "dp/cli/progress.hpp"
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
  CHECK(verdict(dp::cli::output_file(), d.fifo).empty());
  CHECK_NOTHROW(dp::cli::check_output_file("--json", d.fifo));
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
  CHECK(verdict(dp::cli::output_file(), "/dev/null").empty());
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
  CHECK(verdict(dp::cli::output_file(), d.fifo).empty());  // not opened by the check
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
