// The samples, run as a user would: train_mnist in its three modes on real Fashion-MNIST.
#include <unistd.h>

#include <sys/stat.h>
#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "tests/test_util.hpp"

namespace {

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/dp_test_samples_" + std::to_string(getpid()) + "_" +
         name;
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

TEST_CASE("samples.train_mnist: a missing data directory is a clear error") {
  std::string cmd = std::string(DP_TRAIN_MNIST_PATH) + " --data /nonexistent/dir > " +
                    temp_path("err.txt") + " 2>&1";
  CHECK(std::system(cmd.c_str()) != 0);
  std::ifstream f(temp_path("err.txt"));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK(text.find("/nonexistent/dir") != std::string::npos);
  std::remove(temp_path("err.txt").c_str());
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

TEST_CASE("samples.train_mnist: --mode ps on 4 workers reaches 84% in one epoch (MLP)") {
  if (skip_without_fashion_mnist()) return;
  auto ps = train("--device cpu --model mlp --epochs 1 --mode ps --gpus 4");
  CHECK(ps["devices"] == 4);
  CHECK(ps["test_accuracy"].get<double>() >= 0.84);
}
