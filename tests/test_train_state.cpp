// The training state in safetensors layout: resuming is bit-exact (single device and DP on 4
// devices, SGD momentum and AdamW, dropout, uneven batches); mismatches and damage are refused;
// the reader reads the header and the declared ranges only; the checkpoint folder is one job's.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
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

// A single-device run's progress at step 0: one dropout stream, at offset 0.
nn::TrainingProgress single_progress() {
  nn::TrainingProgress p;
  p.mode = "single";
  p.rng_offsets = {0};
  return p;
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

TEST_CASE(
    "nn.train_state: a different model, optimizer, global batch or a damaged file is refused") {
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
  // Another global batch is refused; another world size is not (it re-shards).
  nn::TrainingProgress other_batch = single;
  other_batch.config = {{"batch", "20"}};
  CHECK_THROWS_WITH_AS(nn::load_training_state(path, *m, *sgd, other_batch),
                       doctest::Contains("saved with batch (none), this run has 20"), Error);
  nn::TrainingProgress four;
  four.mode = "dp";
  four.world_size = 4;
  CHECK(nn::load_training_state(path, *m, *sgd, four).rng_offsets.size() == 4);
  // Damage: a cut file, and a header that is not JSON.
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string cut = state_path("cut");
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  CHECK_THROWS_WITH_AS(nn::load_training_state(cut, *m, *sgd, single),
                       doctest::Contains("load_training_state"), Error);
  // The header-only check (a program's, before it builds a model or starts ranks): the same
  // refusals with no model, the model named before the batch, and a cut file refused too.
  CHECK_NOTHROW(nn::check_training_state_settings(path, {}));
  CHECK_THROWS_WITH_AS(nn::check_training_state_settings(path, other_batch.config),
                       doctest::Contains("saved with batch (none), this run has 20"), Error);
  CHECK_THROWS_WITH_AS(nn::check_training_state_settings(path, {{"batch", "20"}, {"model", "x"}}),
                       doctest::Contains("saved with model (none), this run has x"), Error);
  CHECK_THROWS_WITH_AS(nn::check_training_state_settings(cut, {}),
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
  // The killed writer's temporary file stays behind (save_training_state alone cannot know
  // that no other process writes it; save_checkpoint_in with the folder's lock removes it), and
  // does not stop later saves.
  run(0, false, 0, 2, path, "");
  CHECK_NOTHROW(nn::load_training_state(path, *m, *opt, single));
  const std::filesystem::path p(path);
  for (const auto& e : std::filesystem::directory_iterator(p.parent_path()))
    if (e.path().filename().string().rfind("." + p.filename().string() + ".tmp.", 0) == 0)
      std::filesystem::remove(e.path());
}

TEST_CASE("nn.train_state: exact floats are printf's %a in any locale and read back exactly") {
  for (double v : {0.0, 1.0, 1.5, 65536.0, 0.1, 3e-4, 1.0 / 3, 2.5e38, -0.25, 1e-310}) {
    CAPTURE(v);
    char want[64];
    std::snprintf(want, sizeof want, "%a", v);  // this test runs in the C locale
    CHECK(nn::detail::exact_text(v) == want);
    if (v >= 0) CHECK(nn::detail::parse_exact(nn::detail::exact_text(v)) == v);
  }
  for (const char* bad : {"", "0x", "1.8p+0", "0x1.8p+0 ", "0x1,8p+0", "-0x1p+0", "0xnan"})
    CHECK_FALSE(nn::detail::parse_exact(bad).has_value());
}

TEST_CASE("nn.train_state: amp, the loss scaler's state is saved exactly and restored") {
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 42);
  auto opt = optimizer(*m, false);
  nn::TrainingProgress p = single_progress();
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

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
  REQUIRE(f.good());
}

// A training state's header (JSON text) and data, split.
struct Parts {
  std::string header, data;
};
Parts split(const std::string& bytes) {
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return {bytes.substr(8, n), bytes.substr(8 + n)};
}
std::string join(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

using dp_test::error_of;

long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// A model and optimizer like run()'s, to load into.
struct Target {
  std::shared_ptr<nn::Module> m = dp_test::dropout_mlp();
  std::unique_ptr<nn::Optimizer> opt;
  nn::TrainingProgress single;
  Target() {
    m->materialize(Device::cpu(0), 1);
    opt = optimizer(*m, false);
    single.mode = "single";
  }
  std::string load(const std::string& path) {
    return error_of([&] { nn::load_training_state(path, *m, *opt, single); });
  }
};

// A training state saved by a 2-step run, split for tampering: tampered copies go to `out` and
// `t` loads them. Both files are removed at the end.
struct SavedState {
  explicit SavedState(const std::string& tag)
      : path(state_path(tag)), out(state_path(tag + "_out")) {
    run(0, false, 0, 2, path, "");
    good = split(read_bytes(path));
    header = nlohmann::json::parse(good.header);
  }
  ~SavedState() {
    std::remove(out.c_str());
    std::remove(path.c_str());
  }
  std::string path, out;
  Parts good;
  nlohmann::json header;
  Target t;
};

}  // namespace

TEST_CASE("nn.train_state: a padded file is refused from its header alone, in bounded memory") {
  const std::string path = state_path("padded");
  run(0, false, 0, 2, path, "");
  Target t;
  REQUIRE(t.load(path) == "(no error)");
  const uint64_t size = std::filesystem::file_size(path);
  for (uint64_t padded : {uint64_t{3} << 30, uint64_t{40} << 30}) {  // sparse: no disk used
    CAPTURE(padded);
    REQUIRE(::truncate(path.c_str(), static_cast<off_t>(padded)) == 0);
    const long before = peak_rss_kb();
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = t.load(path);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(e.find(path) != std::string::npos);
    CHECK(e.find("trailing bytes") != std::string::npos);
    CHECK(e.find("must end exactly at the file's end") != std::string::npos);
    CHECK(peak_rss_kb() - before < 64 * 1024);  // the old reader took 3.3 GB, or bad_alloc
    CHECK(seconds < 2.0);
  }
  REQUIRE(::truncate(path.c_str(), static_cast<off_t>(size)) == 0);
  CHECK(t.load(path) == "(no error)");
  std::remove(path.c_str());
}

TEST_CASE(
    "nn.train_state: duplicate keys, overlapping or gapped offsets, a transposed weight and an "
    "unknown tensor are refused, naming the tensor") {
  SavedState saved("tamper");
  const std::string &path = saved.path, &out = saved.out;
  const Parts& good = saved.good;
  const nlohmann::json& header = saved.header;
  Target& t = saved.t;
  const std::string w0 = "param." + t.m->named_parameters()[0].first;  // [32, 6]
  auto refused = [&](const nlohmann::json& h, const std::string& data) {
    write_bytes(out, join(h.dump(), data));
    return t.load(out);
  };
  // A key twice: nlohmann would keep the last silently.
  {
    std::string text = header.dump();
    const std::string step = "\"step\":\"2\"";
    REQUIRE(text.find(step) != std::string::npos);
    text.replace(text.find(step), step.size(), step + ",\"step\":\"9\"");
    write_bytes(out, join(text, good.data));
    const std::string e = t.load(out);
    CHECK(e.find("the key 'step' twice in one object") != std::string::npos);
    CHECK(e.find(out) != std::string::npos);
  }
  // Two tensors on the same bytes: another tensor given the first weight's range [0, 768).
  {
    nlohmann::json h = header;
    REQUIRE(h[w0]["data_offsets"] == nlohmann::json({0, 32 * 6 * 4}));
    std::string other;
    for (auto it = h.begin(); it != h.end(); ++it)
      if (it.key() != w0 && it.key() != "__metadata__") other = it.key();
    h[other]["shape"] = {32 * 6};
    h[other]["data_offsets"] = {0, 32 * 6 * 4};
    const std::string e = refused(h, good.data);
    CHECK(e.find("overlapping tensor") != std::string::npos);
  }
  // A gap: the last tensor moved 4 bytes on, the file 4 bytes longer.
  {
    nlohmann::json h = header;
    std::string last;
    uint64_t last_end = 0;
    for (auto it = h.begin(); it != h.end(); ++it)
      if (it.key() != "__metadata__" && it.value()["data_offsets"][1].get<uint64_t>() > last_end) {
        last = it.key();
        last_end = it.value()["data_offsets"][1];
      }
    const uint64_t b = h[last]["data_offsets"][0];
    h[last]["data_offsets"] = {b + 4, last_end + 4};
    const std::string e = refused(h, good.data + std::string(4, '\0'));
    CHECK(e.find("tensor '" + last + "'") != std::string::npos);
    CHECK(e.find("leaving a gap") != std::string::npos);
  }
  // A transposed weight: the same 192 floats, shape [6, 32].
  {
    nlohmann::json h = header;
    h[w0]["shape"] = {6, 32};
    const std::string e = refused(h, good.data);
    CHECK(e.find("tensor '" + w0 + "' is [6, 32] in the file, [32, 6] here") != std::string::npos);
  }
  // A tensor this model and optimizer do not have.
  {
    nlohmann::json h = header;
    const uint64_t end = good.data.size();
    h["param.extra"] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {end, end + 4}}};
    const std::string e = refused(h, good.data + std::string(4, '\0'));
    CHECK(e.find("tensor 'param.extra' is not a parameter, buffer or optimizer state") !=
          std::string::npos);
  }
  // The untampered file still loads: the checks above can pass.
  write_bytes(out, join(header.dump(), good.data));
  CHECK(t.load(out) == "(no error)");
}

TEST_CASE(
    "nn.train_state: metadata numbers are range-checked 64-bit, every message names the "
    "file and the field") {
  SavedState saved("meta");
  const std::string &path = saved.path, &out = saved.out;
  const Parts& good = saved.good;
  const nlohmann::json& header = saved.header;
  Target& t = saved.t;
  struct Case {
    std::string key, value, says;
  };
  for (const Case& c : std::vector<Case>{
           {"epoch", "2147483648",
            "metadata 'epoch' = '2147483648' is out of range [0, 2147483647]"},
           {"world_size", "4294967297", "metadata 'world_size' = '4294967297' is out of range"},
           {"step", "99999999999999999999", "metadata 'step' = '99999999999999999999' is out of"},
           {"step", "-1", "metadata 'step' = '-1' is not a whole number"},
           {"batches_done", "12abc", "metadata 'batches_done' = '12abc' is not a whole number"},
           {"rng_offsets", "99999999999999999999",
            "metadata 'rng_offsets' item 0 = '99999999999999999999' is not a whole number in "
            "[0, 2^64)"},
           // Counts a run adds to: INT64_MAX would overflow at the next step.
           {"step", "9223372036854775807",
            "metadata 'step' = '9223372036854775807' is out of range [0, 9007199254740992]"},
           {"optimizer_steps", "9223372036854775807",
            "metadata 'optimizer_steps' = '9223372036854775807' is out of range"},
           {"batches_done", "9223372036854775807",
            "metadata 'batches_done' = '9223372036854775807'"},
           // A control byte is shown escaped, never printed raw to the terminal.
           {"mode", "dp\x1b[2J",
            "metadata 'mode' = 'dp\\x1b[2J' holds a control byte or a byte outside printable"},
       }) {
    CAPTURE(c.key);
    nlohmann::json h = header;
    h["__metadata__"][c.key] = c.value;
    // With its hash, any change is corrupt; without it (older files), each field is checked.
    write_bytes(out, join(h.dump(), good.data));
    CHECK(t.load(out).find("the metadata does not match its hash (meta_fnv1a64 ") !=
          std::string::npos);
    h["__metadata__"].erase("meta_fnv1a64");
    write_bytes(out, join(h.dump(), good.data));
    const std::string e = t.load(out);
    CHECK(e.find(c.says) != std::string::npos);
    CHECK(e.find(out) != std::string::npos);
  }
  // A step changed to another valid step: only the hash can tell.
  {
    nlohmann::json h = header;
    REQUIRE(h["__metadata__"].contains("meta_fnv1a64"));
    h["__metadata__"]["step"] = h["__metadata__"]["step"].get<std::string>() + "0";
    write_bytes(out, join(h.dump(), good.data));
    const std::string e = t.load(out);
    CHECK(e.find("the metadata does not match its hash") != std::string::npos);
    CHECK(e.find(out) != std::string::npos);
    h["__metadata__"].erase("meta_fnv1a64");  // an older file's: loads, with the step it says
    write_bytes(out, join(h.dump(), good.data));
    CHECK(t.load(out) == "(no error)");
  }
  // A 20-digit data offset: named, with the file, not a bare "stoull".
  {
    std::string text = header.dump();
    const std::string key = "\"data_offsets\":[0,";
    REQUIRE(text.find(key) != std::string::npos);
    text.replace(text.find(key), key.size(), "\"data_offsets\":[99999999999999999999,");
    write_bytes(out, join(text, good.data));
    const std::string e = t.load(out);
    CHECK(e.find("data_offsets[0] = ") != std::string::npos);
    CHECK(e.find("is not a count") != std::string::npos);
    CHECK(e.find(out) != std::string::npos);
  }
  // A header over the 64 MiB cap in a file big enough to hold it: the cap is named, not the file.
  {
    std::string bytes(8, '\0');
    const uint64_t n = uint64_t{100} << 20;
    std::memcpy(bytes.data(), &n, 8);
    write_bytes(out, bytes);
    REQUIRE(::truncate(out.c_str(), static_cast<off_t>(n + 1024)) == 0);
    const std::string e = t.load(out);
    CHECK(e.find("header length 104857600 is more than the 67108864 bytes (64 MiB) this reader "
                 "accepts") != std::string::npos);
    CHECK(e.find("exceeds the file") == std::string::npos);
  }
}

TEST_CASE("nn.train_state: the fp16 loss scale stops at 2^-24 and a state saved there loads") {
  nn::GradScaler scaler(nn::Precision::fp16);
  for (int i = 0; i < 200; ++i) scaler.update(false);  // 2^16 halved 200 times would reach 0
  CHECK(scaler.scale() == nn::kMinLossScale);
  CHECK(nn::kMinLossScale == std::ldexp(1.f, -24));
  CHECK(scaler.skipped_steps() == 200);
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 42);
  auto opt = optimizer(*m, false);
  nn::TrainingProgress p = single_progress();
  p.scaler = scaler.state();
  const std::string path = state_path("floor");
  nn::save_training_state(path, *m, *opt, p);
  nn::TrainingProgress got = nn::load_training_state(path, *m, *opt, p);
  REQUIRE(got.scaler.has_value());
  CHECK(got.scaler->scale == nn::kMinLossScale);
  // Good steps still grow it again.
  nn::GradScalerOptions o = nn::GradScaler::options_for(nn::Precision::fp16);
  o.growth_interval = 1;
  nn::GradScaler grows(o);
  grows.set_state(*got.scaler);
  grows.update(true);
  CHECK(grows.scale() == 2 * nn::kMinLossScale);
  std::remove(path.c_str());
}

TEST_CASE("nn.amp: more than 5% skipped steps warns, --max-skip-fraction makes it an error") {
  CHECK(nn::check_skipped_steps(0, 100, std::nullopt).empty());
  CHECK(nn::check_skipped_steps(5, 100, std::nullopt).empty());  // 5% is not more than 5%
  const std::string w = nn::check_skipped_steps(6, 100, std::nullopt);
  CHECK(w.find("warning: 6 of 100 steps (6.0%) were skipped") != std::string::npos);
  CHECK(nn::check_skipped_steps(6, 100, 0.1) == w);
  const std::string e = error_of([] { nn::check_skipped_steps(30, 100, 0.25); });
  CHECK(e.find("30 of 100 steps (30.0%) were skipped") != std::string::npos);
  CHECK(e.find("more than --max-skip-fraction 0.25 allows") != std::string::npos);
}

TEST_CASE(
    "nn.train_state: a checkpoint folder: names of any width, one job's lock, stale temporaries "
    "removed, a superseded later step moved aside") {
  const std::string dir = dp_test::temp_path("train_state", "folder") + "/a/b";
  std::filesystem::remove_all(dp_test::temp_path("train_state", "folder"));
  {
    nn::CheckpointDirLock lock(dir, "test_train_state");  // creates the folder with parents
    CHECK(std::filesystem::is_directory(dir));
    CHECK_FALSE(lock.held_by_parent());
    // A second holder in this process is another open file: refused, naming the holder.
    const std::string e = error_of([&] { nn::CheckpointDirLock second(dir, "other"); });
    CHECK(e.find("in use by another job (pid " + std::to_string(::getpid())) != std::string::npos);
    CHECK(e.find("program test_train_state") != std::string::npos);
    CHECK(e.find("give each job its own --checkpoint-dir") != std::string::npos);
    // A child (a DDP worker under our launcher) sees it held by its parent: the same job.
    pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      int rc = 3;
      try {
        nn::CheckpointDirLock worker(dir, "worker");
        rc = worker.held_by_parent() ? 0 : 4;
      } catch (...) {
      }
      ::_exit(rc);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);

    // 8 and 9 digits (step 10^8 and on): ordered by number, not by name.
    for (int64_t step : {int64_t{99999999}, int64_t{100000000}, int64_t{7}})
      write_bytes(nn::checkpoint_file(dir, step), "x");
    CHECK(nn::checkpoint_file(dir, 100000000) == dir + "/step_100000000.safetensors");
    auto all = nn::list_checkpoints(dir);
    REQUIRE(all.size() == 3);
    CHECK(all.back() == nn::checkpoint_file(dir, 100000000));
    CHECK(nn::resolve_resume("latest", dir) == nn::checkpoint_file(dir, 100000000));
    // A killed save's temporary goes at the next save; files of other patterns stay.
    const std::vector<std::string> stale = {".step_00000005.safetensors.tmp.AbC123",
                                            ".step_100000001.safetensors.tmp.x9Y8z7"};
    const std::vector<std::string> others = {"notes.tmp.abcdef", ".step_00000005.safetensors.tmp",
                                             ".model.safetensors.tmp.AbC123", "step_x.safetensors"};
    for (const auto& n : stale) write_bytes(dir + "/" + n, "partial");
    for (const auto& n : others) write_bytes(dir + "/" + n, "keep");
    auto m = dp_test::dropout_mlp();
    m->materialize(Device::cpu(0), 42);
    auto opt = optimizer(*m, false);
    nn::TrainingProgress p;
    p.mode = "single";
    p.rng_offsets = {0};
    p.step = 100000002;
    nn::save_checkpoint_in(lock, 2, *m, *opt, p);
    for (const auto& n : stale) CHECK_FALSE(std::filesystem::exists(dir + "/" + n));
    for (const auto& n : others) CHECK(std::filesystem::exists(dir + "/" + n));
    all = nn::list_checkpoints(dir);  // --keep 2: the two newest, by number
    REQUIRE(all.size() == 2);
    CHECK(all[0] == nn::checkpoint_file(dir, 100000000));
    CHECK(all[1] == nn::checkpoint_file(dir, 100000002));
    // A run that resumed from step 100000000 (the newer one damaged, or a roll-back) writes
    // 100000001 under --keep 1: its file stays, the superseded 100000002 is moved aside (not
    // deleted), and "latest" is this run's.
    p.step = 100000001;
    const std::string written = nn::save_checkpoint_in(lock, 1, *m, *opt, p);
    CHECK(std::filesystem::exists(written));
    all = nn::list_checkpoints(dir);
    REQUIRE(all.size() == 1);
    CHECK(all[0] == written);
    CHECK(std::filesystem::exists(nn::checkpoint_file(dir, 100000002) + ".superseded"));
    CHECK(nn::resolve_resume("latest", dir) == written);
    // The same again (a hostile pass: a second supersede of one step replaced the first one's
    // file): the second goes beside it, and the first stays as it was.
    const std::string first_aside = nn::checkpoint_file(dir, 100000002) + ".superseded";
    write_bytes(first_aside, "the first run's");
    p.step = 100000002;
    nn::save_checkpoint_in(lock, 1, *m, *opt, p);
    p.step = 100000001;
    nn::save_checkpoint_in(lock, 1, *m, *opt, p);
    CHECK(std::filesystem::exists(first_aside + ".2"));
    std::ifstream first(first_aside);
    CHECK(std::string(std::istreambuf_iterator<char>(first), {}) == "the first run's");
    CHECK(nn::resolve_resume("latest", dir) == written);
  }
  // Released with its holder: the next job takes it.
  CHECK_NOTHROW(nn::CheckpointDirLock(dir, "next"));
  // A folder under a file cannot be made.
  write_bytes(dir + "/file", "x");
  const std::string e = error_of([&] { nn::CheckpointDirLock bad(dir + "/file/sub", "x"); });
  CHECK(e.find("--checkpoint-dir " + dir + "/file/sub: cannot create the folder") !=
        std::string::npos);
  std::filesystem::remove_all(dp_test::temp_path("train_state", "folder"));
}

TEST_CASE(
    "nn.train_state: --resume latest skips a truncated or corrupt newest checkpoint, naming it, "
    "and a named damaged file stays an error") {
  const std::string dir = dp_test::temp_path("train_state", "fallback");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 42);
  auto opt = optimizer(*m, true);
  nn::TrainingProgress p = single_progress();
  std::vector<std::vector<float>> saved_params;
  for (int step : {2, 4, 6}) {  // the weights differ from one checkpoint to the next
    auto [x, y] = dp_test::toy_batch(10, 900 + step);
    dp_test::single_step(*m, *opt, x, y);
    p.step = step;
    p.rng_offsets = {m->flat().rng_offset};
    nn::save_checkpoint_in(dir, 10, *m, *opt, p);
    saved_params.push_back(m->flat_params().to_host_f32());
  }
  const std::string s4 = nn::checkpoint_file(dir, 4), s6 = nn::checkpoint_file(dir, 6);
  const std::string good6 = read_bytes(s6);
  write_bytes(s6, good6.substr(0, good6.size() - 100));  // truncated: the data cut short
  std::string bad4 = read_bytes(s4);
  bad4[bad4.size() - 3] ^= 0x10;  // corrupt: one flipped bit in the data
  write_bytes(s4, bad4);

  auto fresh = dp_test::dropout_mlp();
  fresh->materialize(Device::cpu(0), 7);
  auto fresh_opt = optimizer(*fresh, true);
  nn::TrainingProgress expect;
  expect.mode = "single";
  nn::Resumed got = nn::resume_training_state("latest", dir, *fresh, *fresh_opt, expect);
  CHECK(got.path == nn::checkpoint_file(dir, 2));
  CHECK(got.progress.step == 2);
  CHECK(fresh->flat_params().to_host_f32() == saved_params[0]);
  REQUIRE(got.skipped.size() == 2);
  CHECK(got.skipped[0].rfind(s6 + ": ", 0) == 0);  // newest first, each named with its reason
  CHECK(got.skipped[0].find("truncated") != std::string::npos);
  CHECK(got.skipped[1].rfind(s4 + ": ", 0) == 0);
  CHECK(got.skipped[1].find("does not match its hash") != std::string::npos);
  // A damaged file named on its own is an error, not a fallback.
  const std::string e =
      error_of([&] { nn::resume_training_state(s6, dir, *fresh, *fresh_opt, expect); });
  CHECK(e.find(s6) != std::string::npos);
  CHECK(e.find("truncated") != std::string::npos);
  // None whole: an error naming every one; no checkpoint yet: nothing to load.
  std::filesystem::remove(nn::checkpoint_file(dir, 2));
  const std::string none =
      error_of([&] { nn::resume_training_state("latest", dir, *fresh, *fresh_opt, expect); });
  CHECK(none.find("none of the 2 checkpoint(s)") != std::string::npos);
  CHECK(none.find("skipped " + s4) != std::string::npos);
  std::filesystem::remove(s4);
  std::filesystem::remove(s6);
  const nn::Resumed empty = nn::resume_training_state("latest", dir, *fresh, *fresh_opt, expect);
  CHECK(empty.path.empty());
  const std::vector<std::string> said = nn::resume_report(empty, expect);
  REQUIRE(said.size() == 1);
  CHECK(said[0] == "--resume latest: no checkpoint in " + dir + " yet: starting from step 0");
  // A folder that cannot be listed (here a file; a folder without read permission alike) is an
  // error naming it, not "no checkpoint yet".
  const std::string not_dir = dir + "/plain_file";
  write_bytes(not_dir, "x");
  const std::string unlisted =
      error_of([&] { nn::resume_training_state("latest", not_dir, *fresh, *fresh_opt, expect); });
  CHECK(unlisted.find("checkpoint folder " + not_dir + ": cannot list it: Not a directory") !=
        std::string::npos);
  std::filesystem::remove(not_dir);
  // The whole file again loads from the named path: the checks above can pass.
  write_bytes(s6, good6);
  CHECK(nn::resume_training_state(s6, dir, *fresh, *fresh_opt, expect).progress.step == 6);
  CHECK(fresh->flat_params().to_host_f32() == saved_params[2]);
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "nn.train_state: a state resumes on another world size: the optimizer shard is the file's "
    "range, dropout streams are re-derived and the note says so") {
  const std::string path = state_path("reshard");
  Run four = run(4, true, 0, 3, path, "");  // DP on 4 devices, AdamW
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 1);
  const int64_t P = m->flat_params().numel();
  auto whole = optimizer(*m, true);
  nn::TrainingProgress dp4;
  dp4.mode = "dp";
  dp4.world_size = 4;
  nn::TrainingProgress same = nn::load_training_state(path, *m, *whole, dp4);
  CHECK(same.rng_offsets == four.rng);
  CHECK(nn::resume_note(same, dp4).empty());  // the same run shape: nothing re-sharded
  const std::vector<float> exp_avg = whole->state()[0].second.to_host_f32();
  REQUIRE(static_cast<int64_t>(exp_avg.size()) == P);
  // A ZeRO-1 shard of 3 ranks (rank 1: [S, 2S)) takes its range of the whole state.
  for (int rank : {0, 1, 2}) {
    CAPTURE(rank);
    auto shard = optimizer(*m, true);
    const int64_t s = P / 3 / 64 * 64;
    const int64_t b = rank * s, e = rank == 2 ? P : (rank + 1) * s;
    shard->set_shard(b, e);
    nn::TrainingProgress ddp3;
    ddp3.mode = "ddp";
    ddp3.world_size = 3;
    ddp3.optimizer_shards = 3;
    nn::TrainingProgress got = nn::load_training_state(path, *m, *shard, ddp3, rank);
    CHECK(shard->state()[0].second.to_host_f32() ==
          std::vector<float>(exp_avg.begin() + b, exp_avg.begin() + e));
    CHECK(shard->step_count() == 3);
    // Every rank goes on from the furthest saved dropout offset.
    const uint64_t furthest = *std::max_element(four.rng.begin(), four.rng.end());
    CHECK(got.rng_offsets == std::vector<uint64_t>(3, furthest));
    CHECK(m->flat().rng_offset == furthest);
    const std::string note = nn::resume_note(got, ddp3);
    CHECK(note.find("re-sharded a dp checkpoint of 4 devices onto ddp on 3 ranks") !=
          std::string::npos);
    CHECK(note.find("split into 3 ZeRO-1 shards here") != std::string::npos);
    CHECK(note.find("not bit-exact") != std::string::npos);
  }
  // A shard saved without gathering it first is refused, naming the way out.
  auto shard = optimizer(*m, true);
  shard->set_shard(0, 64);
  nn::TrainingProgress bare = dp4;
  bare.rng_offsets.assign(4, 0);  // complete but for the optimizer state
  const std::string e = error_of([&] { nn::save_training_state(path, *m, *shard, bare); });
  INFO(e);
  CHECK(e.find("holds 64 of the " + std::to_string(P) + " parameters' values") !=
        std::string::npos);
  CHECK(e.find("gather_optimizer_state") != std::string::npos);
  std::remove(path.c_str());
}

// The folder's lock file is its own: a symbolic link placed at DIR/.lock is refused (not
// followed: its target is neither opened nor truncated), and so is a FIFO there; both say what
// to remove. Time bound: the FIFO is not waited on.
TEST_CASE("nn.train_state: a checkpoint folder's lock never follows a link or opens a FIFO") {
  const std::string base = dp_test::temp_path("train_state", "lock_link");
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base + "/ck");
  const std::string victim = base + "/victim";
  write_bytes(victim, "precious");
  REQUIRE(::symlink(victim.c_str(), (base + "/ck/.lock").c_str()) == 0);
  std::string e = error_of([&] { nn::CheckpointDirLock lock(base + "/ck", "test"); });
  CHECK(e.find("the lock file") != std::string::npos);
  CHECK(e.find("/ck/.lock is a symbolic link; the lock must be the folder's own file: remove "
               "the link") != std::string::npos);
  std::ifstream in(victim);
  std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(kept == "precious");
  std::filesystem::remove(base + "/ck/.lock");
  REQUIRE(::mkfifo((base + "/ck/.lock").c_str(), 0600) == 0);
  const auto start = std::chrono::steady_clock::now();
  e = error_of([&] { nn::CheckpointDirLock lock(base + "/ck", "test"); });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(e.find("/ck/.lock is a FIFO (named pipe), not a regular file: remove it") !=
        std::string::npos);
  std::filesystem::remove(base + "/ck/.lock");
  CHECK_NOTHROW(nn::CheckpointDirLock(base + "/ck", "test"));  // a fresh lock file is made
  std::filesystem::remove_all(base);
}

// An engine's save() makes its folder with its parents, as --checkpoint-dir does, so a program
// need not; a path on the way that is a file is refused by name, and nothing is written.
TEST_CASE("nn.train_state: DataParallel::save creates its folder, refuses one that is a file") {
  const std::string base = dp_test::temp_path("train_state", "save_dirs");
  std::filesystem::remove_all(base);
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), 42);
  auto opt = optimizer(*m, true);
  dp::DataParallel engine(m, *opt, make_devices(DeviceType::cpu, 2));
  auto [x, y] = dp_test::toy_batch(10, 500);
  (void)engine.train_step(x, y);
  nn::TrainingProgress p;
  p.mode = "dp";
  p.world_size = 2;
  const std::string deep = base + "/runs/a/state.safetensors";
  engine.save(deep, p);
  CHECK(std::filesystem::is_regular_file(deep));
  CHECK(engine.load(deep, p).step == 1);
  write_bytes(base + "/file", "x");
  const std::string e = error_of([&] { engine.save(base + "/file/sub/state.safetensors", p); });
  CHECK(e.find("cannot create its folder") != std::string::npos);
  CHECK(e.find(base + "/file/sub") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(base + "/file/sub"));
  std::filesystem::remove_all(base);
}
