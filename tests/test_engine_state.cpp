// dp.state: DataParallel::save and load (the whole training state from the engine, no progress
// filled by hand) and the low-level save_training_state's defaults.
#include <cstring>

#include "dp/data_parallel.hpp"
#include "nn/nn.hpp"
#include "nn/safetensors.hpp"
#include "tests/train_util.hpp"

using namespace kernels;

namespace {

constexpr uint64_t kSeed = 4321;

// A dropout MLP with momentum SGD under DataParallel on `n` CPU devices.
struct Engine {
  nn::ModulePtr model = dp_test::dropout_mlp();
  std::unique_ptr<nn::SGD> opt;
  std::unique_ptr<dp::DataParallel> dp;
  explicit Engine(int n) {
    model->materialize(Device::cpu(0), kSeed);
    SgdConfig c;
    c.lr = 0.1f;
    c.momentum = 0.9f;
    opt = std::make_unique<nn::SGD>(*model, c);
    dp = std::make_unique<dp::DataParallel>(model, *opt, make_devices(DeviceType::cpu, n));
  }
  void train(int from, int to) {
    for (int s = from; s < to; ++s) {
      auto [x, y] = dp_test::toy_batch(10, 700 + s);  // uneven chunks: 3, 3, 2, 2
      dp->train_step(x, y);
    }
  }
  std::vector<float> weights() { return model->flat_params().to_host_f32(); }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("dp.state: DataParallel::save then load resumes bit for bit") {
  const std::string path = dp_test::temp_path("dp_state", "engine.safetensors");
  Engine a(4);
  a.train(0, 3);
  a.dp->save(path);
  a.train(3, 6);

  Engine b(4);
  nn::TrainingProgress at = b.dp->load(path);
  CHECK(at.step == 3);
  CHECK(at.mode == "dp");
  CHECK(at.world_size == 4);
  CHECK(b.dp->rng_offsets() != std::vector<uint64_t>(4, 0));  // dropout streams restored
  b.train(3, 6);
  CHECK(same_bits(a.weights(), b.weights()));

  // The weights are plain safetensors entries (F32, their own shapes).
  nn::io::FileReader r(path, "test");
  nn::safetensors::File f = nn::safetensors::read(r);
  for (auto& [name, p] : a.model->named_parameters()) {
    REQUIRE(f.tensors.count("param." + name));
    CHECK(f.tensors.at("param." + name).shape == p->shape);
  }

  // Another device count re-shards (nn::resume_note says so): the weights load, each device
  // gets a dropout stream.
  Engine two(2);
  two.dp->load(path);
  CHECK(two.dp->rng_offsets().size() == 2);
}

TEST_CASE("dp.state: the minimal save_training_state loads, and a missing offset is refused") {
  const std::string path = dp_test::temp_path("dp_state", "minimal.safetensors");
  auto m = dp_test::dropout_mlp();
  m->materialize(Device::cpu(0), kSeed);
  nn::SGD opt(*m, SgdConfig{});
  m->flat().rng_offset = 77;
  nn::save_training_state(path, *m, opt, {});  // one device: the offsets are the module's
  m->flat().rng_offset = 0;
  nn::TrainingProgress got = nn::load_training_state(path, *m, opt, {});
  CHECK(got.rng_offsets == std::vector<uint64_t>{77});
  CHECK(m->flat().rng_offset == 77);

  nn::TrainingProgress four;
  four.mode = "dp";
  four.world_size = 4;
  CHECK_THROWS_WITH_AS(nn::save_training_state(path, *m, opt, four),
                       doctest::Contains("0 dropout offsets for world size 4"), Error);
}
