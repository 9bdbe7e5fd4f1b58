// The samples, run as a user would: train_mnist in its three modes on real Fashion-MNIST.
#include <unistd.h>

#include <sys/stat.h>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "dp/distributed/launcher.hpp"
#include "nn/train_state.hpp"
#include "tests/process_util.hpp"
#include "tests/test_util.hpp"

namespace {

std::string temp_path(const std::string& name) {
  return dp_test::temp_path("samples", name);
}

nlohmann::json train(const std::string& args) {
  std::string json = temp_path("train.json");
  std::string cmd = std::string(DP_TRAIN_MNIST_PATH) + " " + args + " --json " + json + " > " +
                    temp_path("log.txt") + " 2>&1";
  int rc = std::system(cmd.c_str());
  std::ifstream log(temp_path("log.txt"));
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  INFO(text);
  REQUIRE(rc == 0);
  std::ifstream f(json);
  nlohmann::json j = nlohmann::json::parse(f);
  std::remove(json.c_str());
  return j;
}

// True (and the case counted as skipped, with the reason) without Debian's data set.
bool skip_without_fashion_mnist() {
  struct stat st {};
  if (stat("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", &st) == 0) return false;
  std::printf("SKIPPED: /usr/share/datasets/fashion-mnist is missing (dataset-fashion-mnist)\n");
  ++dp_test::skipped_cases();
  return true;
}

}  // namespace

TEST_CASE("samples.train_mnist: single device and DP and DDP follow one loss curve") {
  if (skip_without_fashion_mnist()) return;
  const std::string common = "--device cpu --model mlp --epochs 2 --limit-batches 40 --batch 30";
  auto single = train(common);
  auto dp = train(common + " --mode dp --gpus 4");  // 30 rows over 4 devices: uneven chunks
  auto ddp = train(common + " --mode ddp --gpus 3");
  for (const auto* j : {&single, &dp, &ddp}) {
    REQUIRE((*j)["train_loss"].size() == 2);
    CHECK((*j)["test_accuracy"].get<double>() > 0.6);  // 80 steps already learn something
  }
  for (int e = 0; e < 2; ++e) {
    double ref = single["train_loss"][e].get<double>();
    CHECK(dp["train_loss"][e].get<double>() == doctest::Approx(ref).epsilon(1e-4));
    CHECK(ddp["train_loss"][e].get<double>() == doctest::Approx(ref).epsilon(1e-4));
  }
  CHECK(single["train_loss"][1].get<double>() < single["train_loss"][0].get<double>());
}

TEST_CASE("samples.train_mnist: --mode hybrid (2 node processes x 2 devices) is the single run") {
  if (skip_without_fashion_mnist()) return;
  // 31 rows: nodes of 16 and 15, devices of 8 + 8 and 8 + 7.
  const std::string common = "--device cpu --model mlp --epochs 1 --limit-batches 30 --batch 31";
  auto single = train(common);
  auto hybrid = train(common + " --mode hybrid --gpus 2");
  const std::vector<double> want = single["step_losses"], got = hybrid["step_losses"];
  REQUIRE(got.size() == want.size());
  for (size_t s = 0; s < want.size(); ++s) CHECK(got[s] == doctest::Approx(want[s]).epsilon(1e-5));
  CHECK(hybrid["test_accuracy"] == single["test_accuracy"]);
}

TEST_CASE("samples.train_mnist: --micro-batches in DP, DDP and hybrid follow the one-pass run") {
  if (skip_without_fashion_mnist()) return;
  // 31 rows: DP's chunks of 16 and 15 rows in 3 micro-batches each (6, 5, 5 and 5, 5, 5), DDP's
  // ranks in 2 (8, 8 and 8, 7), hybrid's 2 nodes x 2 devices (8, 8, 8, 7 rows) in 4 (the last
  // 2, 2, 2, 1): uneven micro-batches in every mode.
  const std::string common = "--device cpu --model mlp --epochs 1 --limit-batches 12 --batch 31";
  const std::vector<double> want = train(common)["step_losses"];
  for (const std::string& how : {std::string("--mode dp --gpus 2 --micro-batches 3"),
                                 std::string("--mode ddp --gpus 2 --micro-batches 2"),
                                 std::string("--mode hybrid --gpus 2 --micro-batches 4")}) {
    CAPTURE(how);
    const std::vector<double> got = train(common + " " + how)["step_losses"];
    REQUIRE(got.size() == want.size());
    for (size_t s = 0; s < want.size(); ++s)
      CHECK(got[s] == doctest::Approx(want[s]).epsilon(1e-5));
  }
}

TEST_CASE("samples.train_mnist: a missing data directory is a clear error, said once under DDP") {
  std::string cmd = std::string(DP_TRAIN_MNIST_PATH) + " --data /nonexistent/dir > " +
                    temp_path("err.txt") + " 2>&1";
  CHECK(std::system(cmd.c_str()) != 0);
  std::ifstream f(temp_path("err.txt"));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK(text.find("/nonexistent/dir") != std::string::npos);
  std::remove(temp_path("err.txt").c_str());
  // A folder without the files: under DDP said by the launcher before any rank starts, not by
  // every rank of every restart (2 ranks x 3 attempts printed it 6 times).
  const std::string empty = temp_path("no_mnist");
  std::filesystem::create_directories(empty);
  for (const std::string mode : {"single", "ddp --gpus 2 --max-restarts 2"}) {
    cmd = std::string(DP_TRAIN_MNIST_PATH) + " --device cpu --mode " + mode + " --data " + empty +
          " > " + temp_path("err.txt") + " 2>&1";
    CHECK(std::system(cmd.c_str()) != 0);
    std::ifstream g(temp_path("err.txt"));
    text.assign(std::istreambuf_iterator<char>(g), std::istreambuf_iterator<char>());
    INFO(mode << "\n" << text);
    int lines = 0;  // that name the folder
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
      lines += line.find("neither " + empty + "/train-images-idx3-ubyte") != std::string::npos;
    CHECK(lines == 1);
    CHECK(text.find("rank") == std::string::npos);
    std::remove(temp_path("err.txt").c_str());
  }
  std::filesystem::remove(empty);
}

TEST_CASE("samples.train_mnist: --mode ps with one worker at staleness 0 is the single run") {
  if (skip_without_fashion_mnist()) return;
  const std::string common = "--device cpu --model mlp --epochs 2 --limit-batches 40 --batch 30";
  auto single = train(common);
  auto ps = train(common + " --mode ps --gpus 1 --max-staleness 0");
  CHECK(ps["mode"] == "ps");
  CHECK(ps["train_loss"] == single["train_loss"]);
  CHECK(ps["test_accuracy"] == single["test_accuracy"]);
}

TEST_CASE(
    "samples.train_mnist: --mode ps on 4 async workers stays within 2.5 points of one device") {
  if (skip_without_fashion_mnist()) return;
  // Asynchronous: the order in which updates land depends on thread timing, so runs spread.
  // Measured (MLP, one epoch): one device 85.8%; sixteen async runs on 4 workers 83.8-85.0%,
  // mean 84.5%, sd 0.35 points, idle or with six runs sharing two cores. A fixed 84% floor on
  // the mean of three failed by chance in CI (83.9%), so the mean is held to the deterministic
  // single-device run less 2.5 points (about six sd of a mean of three), each run to less 4.
  const std::string common = "--device cpu --model mlp --epochs 1";
  const double single = train(common)["test_accuracy"].get<double>();
  double sum = 0;
  for (int run = 0; run < 3; ++run) {
    auto ps = train(common + " --mode ps --gpus 4");
    CHECK(ps["devices"] == 4);
    double acc = ps["test_accuracy"].get<double>();
    CAPTURE(acc);
    CAPTURE(single);
    CHECK(acc >= single - 0.04);
    sum += acc;
  }
  CHECK(sum / 3 >= single - 0.025);
  CHECK(single >= 0.85);
}

TEST_CASE("samples.train_mnist: DDP pads a last batch too short for its ranks, as DP does") {
  if (skip_without_fashion_mnist()) return;
  // 31 samples in batches of 7 leave 3 rows for 4 ranks (as 60000 does): padded to 4 by
  // wrapping round, so the epoch ends with an accuracy and a JSON report.
  const std::string common =
      "--device cpu --model mlp --epochs 1 --train-samples 31 --batch 7 "
      "--gpus 4";
  auto ddp = train(common + " --mode ddp");
  auto dp = train(common + " --mode dp");
  for (const auto* j : {&ddp, &dp}) {
    CHECK((*j)["rows_trained"] == 32);  // 4 x 7 + 3, and 1 row of padding
    CHECK((*j)["test_accuracy"].get<double>() > 0);
    // Throughput from the rows actually trained.
    CHECK((*j)["samples_per_s"].get<double>() * (*j)["seconds"].get<double>() ==
          doctest::Approx(32).epsilon(1e-6));
  }
  // DP and DDP train the same rows at every step: the same loss.
  CHECK(ddp["train_loss"][0].get<double>() ==
        doctest::Approx(dp["train_loss"][0].get<double>()).epsilon(1e-4));
  auto dropped = train(common + " --mode ddp --last-batch drop");
  CHECK(dropped["rows_trained"] == 28);
}

TEST_CASE("samples.train_mnist: bad flags are refused in plain words, before any work") {
  std::string dir = temp_path("outdir");
  REQUIRE(std::system(("mkdir -p " + dir).c_str()) == 0);
  struct Case {
    std::string args, says;
  };
  for (const Case& c : std::vector<Case>{
           {"--epochs abc", "--epochs: 'abc' is not a whole number: give one in [1, 100000]"},
           {"--mode dp --hybrid-procs 2", "only --mode hybrid starts node processes"},
           {"--mode hybrid --resume latest --checkpoint-dir " + dir,
            "--mode hybrid trains without --checkpoint-dir"},
           {"--epochs 0", "--epochs: 0 is out of range: give a whole number in [1, 100000]"},
           {"--batch 0", "--batch: 0 is out of range"},
           {"--lr -0.1", "--lr: -0.1 is not allowed: give a number > 0 and <= 100"},
           {"--lr abc", "--lr: 'abc' is not a number"},
           {"--gpus -1", "--gpus: -1 is out of range"},
           {"--limit-batches 0", "--limit-batches: 0 is out of range"},
           {"--json " + dir, "--json: '" + dir + "' is a directory"},
           {"--mode dp --gpus 4 --batch 3",
            "--batch 3 leaves some of the 4 devices without rows: give --batch >= 4"},
           {"--mode ddp --gpus 3 --max-local-ranks 2",
            "3 ranks on this node is more than the 2 allowed by --max-local-ranks"},
           {"--mode ddp --max-restarts -1",
            "--max-restarts: -1 is out of range: give a whole number in [0, 1000]"},
           {"--mode dp --max-restarts 1", "--max-restarts 1: only --mode ddp"},
           // Flags that would do nothing: refused (they ran with exit 0 and no note).
           {"--mode dp --max-local-ranks 2",
            "--max-local-ranks 2 with --mode dp: it bounds the processes a launcher starts"},
           {"--max-skip-fraction 0.1",
            "--max-skip-fraction 0.1 with --dtype fp32: fp32 and tf32 runs take every step"},
           {"--mode dp --backend mpi",
            "--backend mpi with --mode dp: only --mode ddp and hybrid have a communication "
            "backend"},
           {"--backend gloo", "--backend gloo with --mode single"},
           {"--mode dp --sync-bn", "--sync-bn with --mode dp --model mlp"},
           {"--mode ps --max-staleness 2 --sync-bn", "--sync-bn with --mode ps"},
           {"--mode dp --staleness-lr", "--staleness-lr with --mode dp"},
           {"--micro-batches 2", "--micro-batches 2 with --mode single: only --mode dp, ddp and"},
           {"--mode ps --micro-batches 3", "--micro-batches 3 with --mode ps"},
           {"--mode dp --model resnet --sync-bn --micro-batches 2",
            "--micro-batches 2 with --sync-bn"},
           {"--micro-batches 0", "--micro-batches: 0 is out of range"},
           {"--keep 2", "--keep requires --checkpoint-dir"},
           {"--max-skip-fraction 2",
            "--max-skip-fraction: '2' is not a fraction: give a number "
            "in [0, 1]"},
           {"--activations bf16",
            "--activations bf16 with --dtype fp32: bf16 activations need "
            "--dtype bf16"},
           {"--activations f16", "--activations: f16 not in {f32,bf16}"},
           {"--mode ddp --nnodes 2 --master-port 65535 --max-restarts 1",
            "--max-restarts 1 with --nnodes 2 and --master-port 65535: the node launchers agree"},
           // Every batch dropped: it trained nothing and reported a loss of 0, exit 0.
           {"--train-samples 3 --batch 4 --mode dp --gpus 4 --last-batch drop",
            "--last-batch drop with 3 training samples and --batch 4: every batch is dropped"},
       }) {
    std::string out = temp_path("flags.txt");
    int status = std::system(
        (std::string(DP_TRAIN_MNIST_PATH) + " --device cpu " + c.args + " > " + out + " 2>&1")
            .c_str());
    std::ifstream f(out);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    INFO(c.args << "\n" << text);
    CHECK(dp_test::shell_code(status) != 0);
    CHECK(text.find(c.says) != std::string::npos);
    CHECK(text.find("179769313486") == std::string::npos);
    CHECK(text.find("epoch 0") == std::string::npos);  // nothing was trained
  }
  std::remove(dir.c_str());
}

TEST_CASE("samples.train_mnist: SIGINT and SIGTERM to a DDP run give 130 and 143") {
  if (skip_without_fashion_mnist()) return;
  for (int sig : {SIGINT, SIGTERM}) {
    CAPTURE(sig);
    pid_t pid = dp_test::spawn({DP_TRAIN_MNIST_PATH, "--device", "cpu", "--mode", "ddp", "--gpus",
                                "2", "--epochs", "1000"});
    REQUIRE(pid > 0);
    auto workers = dp_test::wait_for_workers(pid, 2, "LOCAL_RANK=", std::chrono::seconds(30));
    REQUIRE(workers.size() == 2);
    for (pid_t w : workers) CHECK(dp_test::process_name(w) == "train_mnist");
    ::kill(pid, sig);
    int status = dp_test::wait_child(pid, std::chrono::seconds(30));
    REQUIRE(status != -1);
    CHECK(dp_test::shell_code(status) == 128 + sig);
    CHECK(dp_test::all_gone_within(workers, std::chrono::seconds(10)));
  }
}

TEST_CASE("samples.train_mnist: a resume mid-epoch gives the uninterrupted run, bit for bit") {
  if (skip_without_fashion_mnist()) return;
  const std::string common =
      "--device cpu --model mlp --train-samples 200 --batch 16 --seed 3 --epochs 3";
  // The parameter server at staleness 0 too: its server state, batch position and workers'
  // dropout streams are in the file.
  for (const std::string mode : {"", " --mode dp --gpus 4", " --mode ddp --gpus 3",
                                 " --mode ps --gpus 3 --max-staleness 0"}) {
    CAPTURE(mode);
    std::string whole_dir = temp_path("ck_whole"), part_dir = temp_path("ck_part");
    std::filesystem::create_directories(whole_dir);
    std::filesystem::create_directories(part_dir);
    auto whole = train(common + mode + " --checkpoint-dir " + whole_dir + " --save-every 5");
    // A run that saves at step 30 (epoch 2, batch 4 of 13), and a second process resuming from
    // there into its own folder.
    train(common + mode + " --checkpoint-dir " + part_dir + " --save-every 30 --keep 10");
    std::string resumed_dir = temp_path("ck_resumed");
    std::filesystem::create_directories(resumed_dir);
    auto rest = train(common + mode + " --checkpoint-dir " + resumed_dir + " --resume " +
                      nn::checkpoint_file(part_dir, 30));
    CHECK(rest["first_step"] == 30);
    std::vector<float> tail(whole["step_losses"].begin() + 30, whole["step_losses"].end());
    CHECK(rest["step_losses"].get<std::vector<float>>() == tail);
    CHECK(rest["test_accuracy"] == whole["test_accuracy"]);
    // The final states are the same file, byte for byte (weights, optimizer, RNG, position).
    auto bytes = [](const std::string& p) {
      std::ifstream f(p, std::ios::binary);
      return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    };
    std::string end_whole = nn::checkpoint_file(whole_dir, 39);
    std::string end_rest = nn::checkpoint_file(resumed_dir, 39);
    REQUIRE(std::filesystem::exists(end_whole));
    REQUIRE(std::filesystem::exists(end_rest));
    CHECK(bytes(end_whole) == bytes(end_rest));
    CHECK(nn::list_checkpoints(whole_dir).size() == 3);  // --keep 3 by default
    std::filesystem::remove_all(whole_dir);
    std::filesystem::remove_all(part_dir);
    std::filesystem::remove_all(resumed_dir);
  }
}

TEST_CASE("samples.train_mnist: --max-restarts reaches the launcher: failing ranks are restarted") {
  // Every rank fails at once on a bad DP_TIMEOUT (or on missing data); the launcher's
  // DP_HEARTBEAT_TIMEOUT keeps its watch's wait for a store short.
  std::string out = temp_path("restarts.txt");
  int status =
      std::system(("DP_TIMEOUT=abc DP_HEARTBEAT_TIMEOUT=1 " + std::string(DP_TRAIN_MNIST_PATH) +
                   " --device cpu --mode ddp --gpus 2 --max-restarts 1 > " + out + " 2>&1")
                      .c_str());
  std::ifstream f(out);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  INFO(text);
  CHECK(dp_test::shell_code(status) == 1);
  CHECK(text.find("launch_workers: restart 1 of 1 after rank ") != std::string::npos);
  CHECK(text.find("no restarts left (1 of 1 used); exit code 1") != std::string::npos);
}

TEST_CASE(
    "samples.train_mnist: a rank killed mid-run, restarted from its checkpoint, loses nothing") {
  if (skip_without_fashion_mnist()) return;
  // 800 samples in batches of 8 on 2 ranks: 100 steps an epoch, 200 in all, a save every 5.
  const std::vector<std::string> common = {DP_TRAIN_MNIST_PATH,
                                           "--device",
                                           "cpu",
                                           "--model",
                                           "mlp",
                                           "--train-samples",
                                           "800",
                                           "--batch",
                                           "8",
                                           "--epochs",
                                           "2",
                                           "--mode",
                                           "ddp",
                                           "--gpus",
                                           "2",
                                           "--save-every",
                                           "5",
                                           "--seed",
                                           "5"};
  std::string whole_dir = temp_path("kill_whole"), killed_dir = temp_path("kill_restarted");
  std::filesystem::create_directories(whole_dir);
  std::filesystem::create_directories(killed_dir);
  auto args_with = [&](const std::vector<std::string>& more) {
    std::vector<std::string> a = common;
    a.insert(a.end(), more.begin(), more.end());
    return a;
  };
  std::string whole_cmd = "exec";
  for (const auto& a : args_with({"--checkpoint-dir", whole_dir})) whole_cmd += " " + a;
  pid_t whole = dp_test::spawn({"/bin/sh", "-c", whole_cmd + " > /dev/null 2>&1"});
  REQUIRE(whole > 0);
  REQUIRE(dp_test::shell_code(dp_test::wait_child(whole, std::chrono::seconds(120))) == 0);

  std::string log = temp_path("kill_log.txt");
  std::string cmd = "exec";
  for (const auto& a :
       args_with({"--checkpoint-dir", killed_dir, "--resume", "latest", "--max-restarts", "1"}))
    cmd += " " + a;
  pid_t run = dp_test::spawn({"/bin/sh", "-c", cmd + " > " + log + " 2>&1"});  // exec: same pid
  REQUIRE(run > 0);
  // Once step 20 is saved, rank 1 is killed (SIGKILL): the launcher stops rank 0 and starts
  // both again, and they go on from the newest checkpoint.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(nn::checkpoint_file(killed_dir, 20)) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto ranks = dp_test::wait_for_workers(run, 1, "LOCAL_RANK=1", std::chrono::seconds(10));
  REQUIRE(!ranks.empty());
  ::kill(ranks[0], SIGKILL);
  int status = dp_test::wait_child(run, std::chrono::seconds(120));
  std::ifstream f(log);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  INFO(text);
  CHECK(dp_test::shell_code(status) == 0);
  CHECK(text.find("launch_workers: restart 1 of 1 after rank 1") != std::string::npos);
  CHECK(text.find("train_mnist: resumed from") != std::string::npos);
  auto bytes = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const std::string a = nn::checkpoint_file(whole_dir, 200);
  const std::string b = nn::checkpoint_file(killed_dir, 200);
  REQUIRE(std::filesystem::exists(a));
  REQUIRE(std::filesystem::exists(b));
  CHECK(bytes(a) == bytes(b));  // the same final weights, optimizer state and position
  std::filesystem::remove_all(whole_dir);
  std::filesystem::remove_all(killed_dir);
}

TEST_CASE("samples.train_mnist: amp bf16 and fp16 reach fp32's test accuracy within 0.5 points") {
  if (skip_without_fashion_mnist()) return;
  const std::string common = "--model mlp --epochs 1 --batch 64 --device cpu";
  const double fp32 = train(common + " --dtype fp32")["test_accuracy"].get<double>();
  for (const char* dtype : {"bf16", "fp16"}) {
    CAPTURE(dtype);
    nlohmann::json j = train(common + " --dtype " + dtype);
    const double acc = j["test_accuracy"].get<double>();
    MESSAGE(std::string(dtype) << ": test accuracy " << acc << " (fp32 " << fp32 << "), loss scale "
                               << j["loss_scale"] << ", skipped " << j["skipped_steps"]);
    CHECK(std::fabs(acc - fp32) <= 0.005);
    CHECK(j["dtype"] == dtype);
  }
}

// 16-bit activations (nn::Activations::compute): Linear, Conv, ReLU, pooling keep bf16 between
// layers. One epoch of the MLP on a third of the training set, to keep the case short.
TEST_CASE(
    "samples.train_mnist: --activations bf16 reaches fp32's test accuracy within 0.5 points") {
  if (skip_without_fashion_mnist()) return;
  const std::string common = "--model mlp --epochs 1 --batch 64 --device cpu --train-samples 20000";
  const double fp32 = train(common + " --dtype fp32")["test_accuracy"].get<double>();
  nlohmann::json j = train(common + " --dtype bf16 --activations bf16");
  const double acc = j["test_accuracy"].get<double>();
  MESSAGE("bf16 activations: test accuracy " << acc << " (fp32 " << fp32 << ")");
  CHECK(std::fabs(acc - fp32) <= 0.005);
  CHECK(acc > 0.7);  // it trained
}

namespace {

// The train_mnist run_mnist runs: the build's, or $DP_TRAIN_MNIST_PROGRAM (scripts/gpu_check.sh
// runs the CUDA cases against a bundle's binary, away from the tree it was built in).
std::string mnist_program() {
  const char* e = std::getenv("DP_TRAIN_MNIST_PROGRAM");
  return e && *e ? std::string(e) : std::string(DP_TRAIN_MNIST_PATH);
}

// Runs train_mnist with `args` (stdout and stderr to a file); returns its exit code and output.
std::pair<int, std::string> run_mnist(const std::string& args, const std::string& redirect = "") {
  const std::string out = temp_path("run.txt");
  const std::string cmd =
      mnist_program() + " " + args +
      (redirect.empty() ? " > " + out + " 2>&1" : " " + redirect + " 2> " + out);
  std::remove(out.c_str());
  const int status = std::system(cmd.c_str());
  std::ifstream f(out);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::remove(out.c_str());
  return {dp_test::shell_code(status), text};
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A folder of MNIST-format IDX files (uncompressed): `n` images of rows x cols for train and
// test, labels 0.
void write_idx_set(const std::string& dir, int64_t train_rows, int64_t train_cols,
                   int64_t test_rows, int64_t test_cols) {
  std::filesystem::create_directories(dir);
  auto be32 = [](std::string& s, uint32_t v) {
    for (int i = 3; i >= 0; --i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  };
  auto images = [&](const std::string& name, int64_t rows, int64_t cols) {
    std::string s;
    be32(s, 0x803);
    be32(s, 4);
    be32(s, static_cast<uint32_t>(rows));
    be32(s, static_cast<uint32_t>(cols));
    s += std::string(static_cast<size_t>(4 * rows * cols), '\x10');
    std::ofstream(dir + "/" + name, std::ios::binary) << s;
  };
  auto labels = [&](const std::string& name) {
    std::string s;
    be32(s, 0x801);
    be32(s, 4);
    s += std::string(4, '\0');
    std::ofstream(dir + "/" + name, std::ios::binary) << s;
  };
  images("train-images-idx3-ubyte", train_rows, train_cols);
  images("t10k-images-idx3-ubyte", test_rows, test_cols);
  labels("train-labels-idx1-ubyte");
  labels("t10k-labels-idx1-ubyte");
}

const std::string kSmall = "--device cpu --model mlp --train-samples 64 --batch 16 --seed 2";

}  // namespace

// On CPU devices a batch whose step does not fit the host is refused with the measured figures
// (a probe step of 1 and 2 rows on the run's model and optimizer), before any training.
TEST_CASE("samples.train_mnist: a batch that does not fit the host is refused with the figures") {
  const auto t0 = std::chrono::steady_clock::now();
  auto [rc, text] = run_mnist(
      "--device cpu --model mlp --train-samples 64 --mode dp --gpus 2 --batch 2000000000");
  INFO(text);
  CHECK(rc != 0);
  CHECK(text.find("--batch 2000000000 (dp on 2 CPU device(s)) (2 x (") != std::string::npos);
  CHECK(text.find("1000000000 rows x ") != std::string::npos);
  CHECK(text.find("measured on a probe step) needs at least") != std::string::npos);
  CHECK(text.find("give a smaller batch") != std::string::npos);
  CHECK(text.find("epoch 0") == std::string::npos);  // nothing trained
  CHECK(seconds_since(t0) < 20);
}

// On CUDA devices the same probe runs on GPU 0 (DP and single runs hold their devices in this
// process) and a batch that does not fit it is refused with the figures, not met by the first
// allocation past it.
TEST_CASE("samples.train_mnist.cuda: a batch that does not fit GPU 0 is refused with the figures") {
  DP_REQUIRE_GPU();
  const std::string dir = temp_path("idx_cuda");  // 4 images: a GPU machine has no dataset
  write_idx_set(dir, 28, 28, 28, 28);
  auto [rc, text] = run_mnist("--device cuda --data " + dir +
                              " --model mlp --mode dp --gpus 2 --batch 2000000000");
  INFO(text);
  CHECK(rc != 0);
  CHECK(text.find("--batch 2000000000 (dp on 2 CUDA device(s), ") != std::string::npos);
  CHECK(text.find("1000000000 rows x ") != std::string::npos);
  CHECK(text.find("measured on a probe step) needs at least") != std::string::npos);
  CHECK(text.find("but GPU 0 has") != std::string::npos);
  CHECK(text.find("memory probe step on GPU 0 failed") == std::string::npos);
  CHECK(text.find("epoch 0") == std::string::npos);  // nothing trained
}

TEST_CASE(
    "samples.train_mnist: --resume latest of a finished run has nothing left to train, "
    "and exits 0") {
  if (skip_without_fashion_mnist()) return;
  const std::string dir = temp_path("finished");
  std::filesystem::remove_all(dir);
  train(kSmall + " --epochs 1 --checkpoint-dir " + dir);  // 4 steps, saved at its end
  REQUIRE(std::filesystem::exists(nn::checkpoint_file(dir, 4)));
  const std::string json = temp_path("finished.json");
  for (int attempt = 0; attempt < 2; ++attempt) {  // again and again: no crash loop
    auto [rc, text] = run_mnist(kSmall + " --epochs 1 --checkpoint-dir " + dir +
                                " --resume latest --json " + json);
    INFO(text);
    CHECK(rc == 0);  // was 139: epoch_loss.back() on an empty vector
    CHECK(text.find("train_mnist: nothing left to train: checkpoint at step 4 of 4") !=
          std::string::npos);
    CHECK(text.find("last epoch loss none trained") != std::string::npos);
    std::ifstream f(json);
    nlohmann::json j = nlohmann::json::parse(f);
    CHECK(j["train_loss"].empty());
    CHECK(j["first_step"] == 4);
  }
  CHECK(nn::list_checkpoints(dir).size() == 1);  // nothing new was written
  // More epochs: it trains on from there.
  auto more = train(kSmall + " --epochs 2 --checkpoint-dir " + dir + " --resume latest");
  CHECK(more["first_step"] == 4);
  CHECK(more["step_losses"].size() == 4);
  std::remove(json.c_str());
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "samples.train_mnist: a second job on one --checkpoint-dir is refused at once, naming "
    "the holder, and a missing folder is created") {
  const std::string dir = temp_path("locked") + "/deeper/still";
  std::filesystem::remove_all(temp_path("locked"));
  {
    nn::CheckpointDirLock holder(dir, "holder_test");  // another job, holding the folder
    for (const std::string mode : {"", " --mode dp --gpus 2", " --mode ddp --gpus 2"}) {
      CAPTURE(mode);
      const auto t0 = std::chrono::steady_clock::now();
      auto [rc, text] = run_mnist("--device cpu --checkpoint-dir " + dir + mode);
      INFO(text);
      CHECK(rc == 1);
      CHECK(text.find("in use by another job (pid " + std::to_string(::getpid())) !=
            std::string::npos);
      CHECK(text.find("program holder_test") != std::string::npos);
      CHECK(text.find("epoch 0") == std::string::npos);  // refused before any work
      CHECK(seconds_since(t0) < 10);
    }
  }
  CHECK(std::filesystem::is_directory(dir));  // created with its parents
  // A path under a file is refused when the flag is parsed.
  const std::string file = temp_path("locked") + "/file";
  std::ofstream(file) << "x";
  auto [rc, text] = run_mnist("--device cpu --checkpoint-dir " + file);
  CHECK(rc != 0);
  CHECK(text.find("'" + file + "' exists and is not a folder") != std::string::npos);
  std::filesystem::remove_all(temp_path("locked"));
}

// --log and --json beside the checkpoints, in a folder the run creates: refused before ("its
// directory 'ck' does not exist"), though --checkpoint-dir is made before any work.
TEST_CASE("samples.train_mnist: --log and --json may go into the checkpoint folder it creates") {
  if (skip_without_fashion_mnist()) return;
  const std::string root = temp_path("mnist_outputs_in_ck");
  std::filesystem::remove_all(root);
  const std::string dir = root + "/ck";
  auto [rc, text] = run_mnist(kSmall + " --epochs 1 --checkpoint-dir " + dir + " --log " + dir +
                              "/log.jsonl --json " + dir + "/report.json");
  INFO(text);
  CHECK(rc == 0);
  CHECK(std::filesystem::file_size(dir + "/log.jsonl") > 0);
  CHECK(std::filesystem::file_size(dir + "/report.json") > 0);
  std::filesystem::remove_all(root);
  auto [rc2, text2] = run_mnist(kSmall + " --epochs 1 --checkpoint-dir " + dir + " --log " + root +
                                "/elsewhere/log.jsonl");
  INFO(text2);
  CHECK(rc2 != 0);
  CHECK(text2.find("--log: cannot write '" + root + "/elsewhere/log.jsonl': its directory '" +
                   root + "/elsewhere' does not exist") != std::string::npos);
  CHECK(!std::filesystem::exists(root));
}

TEST_CASE("samples.train_mnist: an output that cannot be written is an error naming it") {
  if (skip_without_fashion_mnist()) return;
  auto [rc, text] = run_mnist(kSmall + " --epochs 1 --json /dev/full");
  INFO(text);
  CHECK(rc == 1);
  CHECK(text.find("--json(/dev/full): writing failed after 0 of ") != std::string::npos);
  CHECK(text.find("No space left on device") != std::string::npos);
  // stdout on a full device: the report was lost, so the run failed.
  auto [rc2, text2] = run_mnist(kSmall + " --epochs 1", "> /dev/full");
  INFO(text2);
  CHECK(rc2 == 1);
  CHECK(text2.find("train_mnist: writing to stdout failed") != std::string::npos);
  // A regular file is replaced whole.
  const std::string json = temp_path("whole.json");
  auto [rc3, text3] = run_mnist(kSmall + " --epochs 1 --json " + json);
  CHECK(rc3 == 0);
  std::ifstream f(json);
  CHECK(nlohmann::json::parse(f)["train_loss"].size() == 1);
  std::remove(json.c_str());
}

TEST_CASE(
    "samples.train_mnist: --data holding a FIFO or a link to /dev/zero, or images of "
    "another size, are refused saying what they are") {
  const std::string dir = temp_path("odd_data");
  std::filesystem::remove_all(dir);
  write_idx_set(dir, 28, 28, 28, 28);
  const std::string images = dir + "/train-images-idx3-ubyte";
  struct Case {
    std::string make, says;
  };
  for (const Case& c : std::vector<Case>{
           {"rm -f " + images + " && mkfifo " + images,
            images + " is a FIFO (named pipe), not a regular file"},
           {"rm -f " + images + " && ln -s /dev/zero " + images,
            images + " is a symbolic link to a character device, not a regular file"},
       }) {
    REQUIRE(std::system(c.make.c_str()) == 0);
    const auto t0 = std::chrono::steady_clock::now();
    auto [rc, text] = run_mnist("--device cpu --data " + dir);
    INFO(text);
    CHECK(rc == 1);
    CHECK(text.find(c.says) != std::string::npos);
    CHECK(text.find("neither") == std::string::npos);
    CHECK(seconds_since(t0) < 10);  // nothing was read from the FIFO or /dev/zero
  }
  std::filesystem::remove_all(dir);
  write_idx_set(dir, 28, 29, 28, 28);
  auto [rc, text] = run_mnist("--device cpu --model resnet --data " + dir);
  CHECK(rc == 1);
  CHECK(text.find("the training images are [1, 28, 29] but the test images [1, 28, 28]") !=
        std::string::npos);
  std::filesystem::remove_all(dir);
  write_idx_set(dir, 28, 29, 28, 29);
  std::tie(rc, text) = run_mnist("--device cpu --model resnet --data " + dir);
  CHECK(rc == 1);
  CHECK(text.find("the images are [1, 28, 29], but --model resnet takes [1, 28, 28]") !=
        std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "samples.train_mnist: a resume refuses another program's state or a smaller "
    "--train-samples, and its progress loss counts only the batches it trained") {
  if (skip_without_fashion_mnist()) return;
  const std::string dir = temp_path("resume_cfg");
  std::filesystem::remove_all(dir);
  train(kSmall + " --epochs 2 --checkpoint-dir " + dir + " --save-every 2 --keep 10");
  const std::string mid = nn::checkpoint_file(dir, 2);  // epoch 0, batch 2 of 4
  REQUIRE(std::filesystem::exists(mid));
  auto [rc, text] = run_mnist(
      "--device cpu --model mlp --train-samples 32 --batch 16 --seed 2 --epochs 2 --resume " + mid);
  CHECK(rc == 1);
  CHECK(text.find("saved with train_samples 64, this run has 32") != std::string::npos);
  // A dp_bench state (its own program and data) is not this program's.
  std::ifstream in(mid, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string from = "\"config.program\":\"train_mnist\"";
  REQUIRE(bytes.find(from) != std::string::npos);
  bytes.replace(bytes.find(from), from.size(), "\"config.program\":\"dp_bench\"\x20\x20\x20");
  // Its metadata hash goes too (blanked, so the header keeps its length): a state of a version
  // without one, whose fields are checked one by one.
  const auto hash_at = bytes.find("\"meta_fnv1a64\":\"");
  REQUIRE(hash_at != std::string::npos);
  const auto hash_end = bytes.find("\",", hash_at + 16);
  REQUIRE(hash_end != std::string::npos);
  bytes.replace(hash_at, hash_end + 2 - hash_at, std::string(hash_end + 2 - hash_at, ' '));
  const std::string other = temp_path("other_program.safetensors");
  std::ofstream(other, std::ios::binary) << bytes;
  std::tie(rc, text) = run_mnist(kSmall + " --epochs 2 --resume " + other);
  CHECK(rc == 1);
  CHECK(text.find("saved with program dp_bench, this run has train_mnist") != std::string::npos);
  // The resumed epoch's progress line averages its 2 trained batches, as its train_loss does.
  const std::string json = temp_path("resumed.json");
  std::tie(rc, text) = run_mnist(kSmall + " --epochs 2 --resume " + mid + " --json " + json);
  INFO(text);
  REQUIRE(rc == 0);
  std::ifstream jf(json);
  const double loss0 = nlohmann::json::parse(jf)["train_loss"][0].get<double>();
  const std::string line = "epoch 0: 4/4 batches, loss ";
  REQUIRE(text.find(line) != std::string::npos);
  const double shown = std::stod(text.substr(text.find(line) + line.size()));
  CHECK(shown == doctest::Approx(loss0).epsilon(1e-3));
  std::remove(json.c_str());
  std::remove(other.c_str());
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "samples.train_mnist: a diverging fp16 run: the loss scale stops at 2^-24, its "
    "checkpoints load, skips warn past 5% and fail past --max-skip-fraction") {
  if (skip_without_fashion_mnist()) return;
  // lr 100 diverges at once; then every step overflows and the scale halves each time: 192
  // halvings from 2^16 reached 0.0 before the floor.
  const std::string common =
      "--device cpu --model mlp --train-samples 3072 --batch 16 --seed 2 "
      "--dtype fp16 --lr 100";
  const std::string dir = temp_path("diverging");
  std::filesystem::remove_all(dir);
  const std::string json = temp_path("diverging.json");
  auto [rc, text] = run_mnist(common + " --epochs 1 --checkpoint-dir " + dir + " --json " + json);
  INFO(text);
  REQUIRE(rc == 0);
  CHECK(text.find("train_mnist: warning: ") != std::string::npos);
  CHECK(text.find(" of 192 steps (") != std::string::npos);
  std::ifstream f(json);
  const nlohmann::json j = nlohmann::json::parse(f);
  CHECK(j["loss_scale"].get<double>() == std::ldexp(1.0, -24));
  CHECK(j["skipped_steps"].get<int>() > 150);
  // The state saved at the floor loads: the run goes on.
  std::tie(rc, text) =
      run_mnist(common + " --epochs 2 --checkpoint-dir " + dir + " --resume latest");
  CHECK(rc == 0);
  CHECK(text.find("resumed from") != std::string::npos);
  // --max-skip-fraction: an error naming the fraction, after the report.
  std::tie(rc, text) = run_mnist(common + " --epochs 1 --max-skip-fraction 0.5 --json " + json);
  CHECK(rc == 1);
  CHECK(text.find("steps (") != std::string::npos);
  CHECK(text.find("more than --max-skip-fraction 0.5 allows") != std::string::npos);
  std::remove(json.c_str());
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "samples.train_mnist: hand-launched DDP ranks with another --batch or --data fail naming it") {
  if (skip_without_fashion_mnist()) return;
  // Another --data (here the same files through a link: the flag as typed is compared) trained
  // on other samples and exited 0.
  const std::string link = temp_path("fashion_link");
  std::filesystem::remove(link);
  std::filesystem::create_directory_symlink("/usr/share/datasets/fashion-mnist", link);
  struct Case {
    std::string rank1;
    std::string says;
  };
  for (const Case& c :
       {Case{"--batch 32", "config mismatch: --batch: rank 0 has 64, rank 1 has 32"},
        Case{"--batch 64 --data " + link, "config mismatch: --data: rank 0 has "}}) {
    CAPTURE(c.says);
    // torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by hand, no job id.
    const std::string port = std::to_string(dp::dist::find_free_port());
    std::string log0 = temp_path("rank0.txt"), log1 = temp_path("rank1.txt");
    auto rank_cmd = [&](int rank, const std::string& flags, const std::string& log) {
      return "env -u DP_JOB_ID -u DP_JOB_TOKEN -u TORCHELASTIC_RUN_ID -u SLURM_JOB_ID RANK=" +
             std::to_string(rank) + " WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
             " DP_TIMEOUT=20 " + DP_TRAIN_MNIST_PATH +
             " --device cpu --mode ddp --gpus 2 --limit-batches 2 " + flags + " > " + log + " 2>&1";
    };
    auto t0 = std::chrono::steady_clock::now();
    std::string script = "timeout -k 5 60 sh -c '(" + rank_cmd(0, "--batch 64", log0) +
                         "; echo \"exit $?\" >> " + log0 + ") & " + rank_cmd(1, c.rank1, log1) +
                         "; echo \"exit $?\" >> " + log1 + "; wait'";
    REQUIRE(std::system(script.c_str()) == 0);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const auto& log : {log0, log1}) {
      std::ifstream f(log);
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      INFO(text);
      CHECK(text.find(c.says) != std::string::npos);
      CHECK(text.find("exit 1") != std::string::npos);
      CHECK(text.find("epoch 0") == std::string::npos);  // nothing was trained
      std::remove(log.c_str());
    }
    CHECK(s < 20);  // together, not after DP_TIMEOUT
  }
  std::filesystem::remove(link);
}

TEST_CASE("samples.train_mnist: --backend mpi without mpirun names the ranks asked for") {
  std::string out = temp_path("mpirun.txt");
  int status = std::system((std::string(DP_TRAIN_MNIST_PATH) +
                            " --device cpu --mode ddp --gpus 2 --backend mpi > " + out + " 2>&1")
                               .c_str());
  std::ifstream f(out);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  INFO(text);
  CHECK(dp_test::shell_code(status) != 0);
  CHECK(text.find("mpirun -np 2 ") != std::string::npos);
  CHECK(text.find("mpirun -np 4") == std::string::npos);
}
