// The training state in safetensors layout: resuming is bit-exact (single device and DP on 4
// devices, SGD momentum and AdamW, dropout, uneven batches); mismatches and damage are refused.
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "dp/data_parallel.hpp"
#include "nn/train_state.hpp"
#include "tests/train_util.hpp"

using namespace kernels;

namespace {

std::unique_ptr<nn::Optimizer> optimizer(nn::Module& m, bool adam) {
  if (adam) {
    AdamWConfig c;
    c.lr = 0.01f;
    c.weight_decay = 0.01f;
    return std::make_unique<nn::AdamW>(m, c);
  }
  SgdConfig c;
  c.lr = 0.05f;
  c.momentum = 0.9f;
  return std::make_unique<nn::SGD>(m, c);
}

std::string state_path(const std::string& tag) {
  return dp_test::temp_path("train_state", tag + ".safetensors");
}

struct Run {
  std::vector<float> losses, params;
  std::vector<uint64_t> rng;
};

// Steps [from, to) of a run on `n` devices (0: one device without DataParallel), batch 10
// (uneven over 4). With `save` the state is written after the last step; with `load` the run
// starts from it.
Run run(int n, bool adam, int from, int to, const std::string& save, const std::string& load) {
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 42);
  m->train();
  auto opt = optimizer(*m, adam);
  std::unique_ptr<dp::DataParallel> engine;
  if (n > 0) engine = std::make_unique<dp::DataParallel>(m, *opt, make_devices(DeviceType::cpu, n));
  nn::TrainingProgress expect;
  expect.mode = n > 0 ? "dp" : "single";
  expect.world_size = std::max(n, 1);
  if (!load.empty()) {
    nn::TrainingProgress got = nn::load_training_state(load, *m, *opt, expect);
    CHECK(got.step == from);
    if (engine) engine->set_rng_offsets(got.rng_offsets);
  }
  Run r;
  for (int s = from; s < to; ++s) {
    auto [x, y] = dp_test::toy_batch(10, 500 + s);
    r.losses.push_back(engine ? engine->train_step(x, y).loss
                              : dp_test::single_step(*m, *opt, x, y));
  }
  r.params = m->flat_params().to_host_f32();
  r.rng = engine ? engine->rng_offsets() : std::vector<uint64_t>{m->flat().rng_offset};
  if (!save.empty()) {
    nn::TrainingProgress p = expect;
    p.step = to;
    p.rng_offsets = r.rng;
    nn::save_training_state(save, *m, *opt, p);
  }
  return r;
}

}  // namespace

TEST_CASE("nn.train_state: N steps then a resume for M equal N + M steps, bit for bit") {
  for (int n : {0, 4}) {  // one device, and DP on 4 devices with chunks of 3, 3, 2, 2
    for (bool adam : {false, true}) {
      CAPTURE(n);
      CAPTURE(adam);
      Run whole = run(n, adam, 0, 7, "", "");
      std::string path = state_path("resume");
      Run first = run(n, adam, 0, 4, path, "");
      Run rest = run(n, adam, 4, 7, "", path);
      std::vector<float> losses = first.losses;
      losses.insert(losses.end(), rest.losses.begin(), rest.losses.end());
      CHECK(losses == whole.losses);
      CHECK(rest.params == whole.params);
      CHECK(rest.rng == whole.rng);  // the dropout streams went on where they stopped
      // Without the state the continuation differs: the check above can fail.
      Run fresh = run(n, adam, 4, 7, "", "");
      CHECK(fresh.params != whole.params);
    }
  }
}

TEST_CASE("nn.train_state: a different model, optimizer, world size or a damaged file is refused") {
  std::string path = state_path("refuse");
  run(0, false, 0, 2, path, "");
  auto other = std::make_shared<nn::Sequential>();
  other->add(std::make_shared<nn::Linear>(6, 200));
  other->materialize(Device::cpu(0), 1);
  auto opt = optimizer(*other, false);
  nn::TrainingProgress single;
  single.mode = "single";
  CHECK_THROWS_WITH_AS(nn::load_training_state(path, *other, *opt, single),
                       doctest::Contains("parameters (flat), this model has"), Error);
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 1);
  auto adam = optimizer(*m, true);
  CHECK_THROWS_WITH_AS(nn::load_training_state(path, *m, *adam, single),
                       doctest::Contains("saved with optimizer sgd, this run uses adamw"), Error);
  auto sgd = optimizer(*m, false);
  nn::TrainingProgress four;
  four.mode = "dp";
  four.world_size = 4;
  CHECK_THROWS_WITH_AS(nn::load_training_state(path, *m, *sgd, four),
                       doctest::Contains("saved by a single run on 1 device(s)/rank(s); this is a "
                                         "dp run on 4"),
                       Error);
  // Damage: a cut file, and a header that is not JSON.
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string cut = state_path("cut");
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  CHECK_THROWS_WITH_AS(nn::load_training_state(cut, *m, *sgd, single),
                       doctest::Contains("load_training_state"), Error);
  std::string junk = state_path("junk");
  std::string text = bytes;
  text[9] = '{';  // {{"param...: not JSON
  std::ofstream(junk, std::ios::binary) << text;
  CHECK_THROWS_WITH_AS(nn::load_training_state(junk, *m, *sgd, single),
                       doctest::Contains("not valid JSON"), Error);
}

TEST_CASE("nn.train_state: a reader written from the safetensors specification reads the file") {
  if (std::system("command -v python3 > /dev/null 2>&1") != 0) {
    std::printf("SKIPPED: python3 is not installed\n");
    ++dp_test::skipped_cases();
    return;
  }
  std::string path = state_path("python");
  run(0, true, 0, 3, path, "");
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 1);
  auto opt = optimizer(*m, true);
  nn::TrainingProgress single;
  single.mode = "single";
  nn::load_training_state(path, *m, *opt, single);
  std::string out = state_path("python_out.txt");
  REQUIRE(std::system(("python3 " + std::string(DP_SOURCE_DIR) +
                       "/benchmarks/read_safetensors.py " + path + " > " + out + " 2>&1")
                          .c_str()) == 0);
  std::ifstream f(out);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  INFO(text);
  auto params = m->named_parameters();
  // The first Linear's weight: its shape, and its sum as this engine sees it.
  std::vector<float> w = params[0].second->value.to_host_f32();
  double sum = 0;
  for (float v : w) sum += v;
  std::ostringstream expect;
  expect.setf(std::ios::fixed);
  expect.precision(6);
  expect << "param." << params[0].first << " F32 [32, 6] ";
  CHECK(text.find(expect.str()) != std::string::npos);
  size_t at = text.find(expect.str());
  REQUIRE(at != std::string::npos);
  double theirs = std::stod(text.substr(at + expect.str().size()));
  CHECK(theirs == doctest::Approx(sum).epsilon(1e-5));
  CHECK(text.find("optim.exp_avg F32") != std::string::npos);
  CHECK(text.find("meta optimizer adamw") != std::string::npos);
  CHECK(text.find("meta step 3") != std::string::npos);
}

TEST_CASE("nn.train_state: a writer killed while saving leaves the previous state loadable") {
  std::string path = state_path("killed");
  run(0, false, 0, 2, path, "");  // the state a crash must not lose
  // A child process rewrites the file in a loop and is killed by SIGKILL in the middle of it.
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto big = std::make_shared<nn::Sequential>();
    big->add(std::make_shared<nn::Linear>(6, 32));
    big->add(std::make_shared<nn::ReLU>());
    big->add(std::make_shared<nn::Dropout>(0.3f));
    big->add(std::make_shared<nn::Linear>(32, 5));
    big->materialize(Device::cpu(0), 42);
    SgdConfig c;
    c.momentum = 0.9f;
    nn::SGD opt(*big, c);
    nn::TrainingProgress p;
    p.mode = "single";
    p.rng_offsets = {0};
    for (int i = 0;; ++i) {
      p.step = i;
      nn::save_training_state(path, *big, opt, p);
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let it be mid-write
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFSIGNALED(status));
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 1);
  auto opt = optimizer(*m, false);
  nn::TrainingProgress single;
  single.mode = "single";
  nn::TrainingProgress got = nn::load_training_state(path, *m, *opt, single);  // a whole file
  CHECK(got.step >= 0);
  // The killed writer's temporary file stays behind (nothing can remove it), and does not
  // stop later saves.
  run(0, false, 0, 2, path, "");
  CHECK_NOTHROW(nn::load_training_state(path, *m, *opt, single));
  const std::filesystem::path p(path);
  for (const auto& e : std::filesystem::directory_iterator(p.parent_path()))
    if (e.path().filename().string().rfind("." + p.filename().string() + ".tmp.", 0) == 0)
      std::filesystem::remove(e.path());
}

TEST_CASE("nn.train_state: amp, the loss scaler's state is saved exactly and restored") {
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 42);
  auto opt = optimizer(*m, false);
  nn::TrainingProgress p;
  p.mode = "single";
  p.rng_offsets = {0};
  const std::string path = state_path("scaler");
  // A scale that is no power of two and needs all 24 bits: written as a hexadecimal float.
  p.scaler = nn::GradScalerState{std::nextafter(3000.f, 4000.f), 1234, 7};
  nn::save_training_state(path, *m, *opt, p);
  nn::TrainingProgress got = nn::load_training_state(path, *m, *opt, p);
  REQUIRE(got.scaler.has_value());
  CHECK(got.scaler->scale == p.scaler->scale);
  CHECK(got.scaler->growth_tracker == 1234);
  CHECK(got.scaler->skipped_steps == 7);
  nn::GradScaler scaler(nn::Precision::fp16);
  scaler.set_state(*got.scaler);
  CHECK(scaler.scale() == p.scaler->scale);
  // A run without a scaler (fp32) writes none, and a file without one restores none.
  p.scaler.reset();
  nn::save_training_state(path, *m, *opt, p);
  CHECK_FALSE(nn::load_training_state(path, *m, *opt, p).scaler.has_value());
  std::remove(path.c_str());
}
