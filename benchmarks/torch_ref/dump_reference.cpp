// Reference numbers from the C++ engine for check_compat.py: Philox words, mix_key, uniform,
// synthetic samples and labels, the initial flat parameters of the bench models and the losses
// of a few CPU training steps. Floats are written as their uint32 bit patterns so the comparison
// is bit-exact. Not part of the CMake build: check_compat.py --engine-build BUILD_DIR compiles
// it against BUILD_DIR/kernels/libdp_kernels.a (see README.md).
//
//   dump_reference OUT.json [SEED]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dp/data/synthetic.hpp"
#include "kernels/philox.hpp"
#include "nn/nn.hpp"

namespace {

namespace philox = kernels::philox;
using nlohmann::json;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

json float_bits(const float* v, size_t n) {
  json out = json::array();
  for (size_t i = 0; i < n; ++i) out.push_back(bits(v[i]));
  return out;
}

json philox_section(uint64_t seed) {
  // (key, counter) pairs that exercise both key halves and both counter halves.
  const std::vector<std::pair<uint64_t, uint64_t>> cases = {
      {0, 0},
      {1, 0},
      {seed, 1},
      {0xFFFFFFFFFFFFFFFFull, 0xFFFFFFFFFFFFFFFFull},
      {0x123456789ABCDEF0ull, 0x0FEDCBA987654321ull},
      {42, 1ull << 32}};
  json out = json::array();
  for (auto [key, ctr] : cases) {
    philox::Uint4 r = philox::philox4x32(key, ctr);
    out.push_back({{"key", std::to_string(key)},
                   {"ctr", std::to_string(ctr)},
                   {"words", {r.x, r.y, r.z, r.w}}});
  }
  json mix = json::array();
  for (uint64_t a : {0ull, 1ull, 2ull, 3ull, 0x5eedull})
    for (uint64_t b : {0ull, 1ull, 9ull, 123456789ull})
      mix.push_back({{"seed", std::to_string(seed)},
                     {"a", std::to_string(a)},
                     {"b", std::to_string(b)},
                     {"key", std::to_string(philox::mix_key(seed, a, b))}});
  const uint64_t key = philox::mix_key(seed, 7);
  std::vector<float> u;
  json words = json::array();
  for (uint64_t i = 0; i < 64; ++i) {
    u.push_back(philox::uniform(key, i));
    words.push_back(philox::random_u32(key, i));
  }
  return {{"philox", out},
          {"mix_key", mix},
          {"stream_key", std::to_string(key)},
          {"random_u32", words},
          {"uniform_bits", float_bits(u.data(), u.size())}};
}

json synthetic_section(uint64_t seed) {
  const int64_t size = 100000;
  dp::data::SyntheticDataset ds(size, {1, 28, 28}, 10, seed);
  json labels = json::array();
  for (int64_t i = 0; i < 2000; ++i) labels.push_back(ds.label(i));
  json samples = json::array();
  std::vector<float> image(28 * 28);
  for (int64_t i : {0, 1, 2, 255, 256, 1234, 99999}) {
    int32_t label = -1;
    ds.get(i, image.data(), &label);
    samples.push_back({{"index", i}, {"label", label}, {"bits", float_bits(image.data(), 784)}});
  }
  // An odd-sized sample shape exercises the last half-used Philox block.
  dp::data::SyntheticDataset odd(10, {3, 5}, 7, seed);
  std::vector<float> small(15);
  int32_t small_label = -1;
  odd.get(3, small.data(), &small_label);
  return {{"size", size},
          {"labels", labels},
          {"samples", samples},
          {"odd",
           {{"shape", {3, 5}},
            {"classes", 7},
            {"index", 3},
            {"label", small_label},
            {"bits", float_bits(small.data(), small.size())}}}};
}

json params_section(uint64_t seed) {
  json out = json::object();
  const std::vector<std::pair<std::string, nn::ModulePtr>> models = {
      {"mlp", nn::mlp({784, 256, 256, 10})},
      {"cnn", nn::lenet(1, 10)},
      {"resnet", nn::resnet(8, 1, 10)}};
  for (auto& [name, model] : models) {
    model->materialize(kernels::Device::cpu(), seed);
    // The parameters packed in flat order, without the buffer's alignment gaps (as torch's
    // concatenated model.parameters()).
    std::vector<float> flat = nn::packed_parameters(*model, model->flat_params().to_host_f32());
    json names = json::array();
    for (auto& [pname, p] : model->named_parameters())
      names.push_back({{"name", pname}, {"shape", p->shape}});
    out[name] = {{"parameters", names}, {"bits", float_bits(flat.data(), flat.size())}};
  }
  return out;
}

// A few single-device CPU training steps of each bench model (the bench's SGD, global batch of
// step s = samples [s B, (s + 1) B)): the torch models should follow the same losses closely.
json train_section(uint64_t seed) {
  const int64_t batch = 32;
  const int steps = 6;
  dp::data::SyntheticDataset ds(batch * steps, {1, 28, 28}, 10, seed);
  json out = {{"batch", batch}, {"steps", steps}, {"losses", json::object()}};
  for (const char* name : {"mlp", "cnn", "resnet"}) {
    std::string n = name;
    nn::ModulePtr model = n == "mlp"   ? nn::ModulePtr(nn::mlp({784, 256, 256, 10}))
                          : n == "cnn" ? nn::ModulePtr(nn::lenet(1, 10))
                                       : nn::ModulePtr(nn::resnet(8, 1, 10));
    model->materialize(kernels::Device::cpu(), seed);
    kernels::SgdConfig config;
    config.lr = 0.05f;
    config.momentum = 0.9f;
    nn::SGD opt(*model, config);
    nn::CrossEntropyLoss loss_fn;
    json losses = json::array();
    for (int s = 0; s < steps; ++s) {
      std::vector<float> images(static_cast<size_t>(batch * 784));
      std::vector<int32_t> labels(static_cast<size_t>(batch));
      for (int64_t b = 0; b < batch; ++b)
        ds.get(s * batch + b, images.data() + b * 784, labels.data() + b);
      kernels::Tensor x = kernels::Tensor::from_vector(images, {batch, 1, 28, 28});
      kernels::Tensor y = kernels::Tensor::from_ints(labels, {batch});
      opt.zero_grad();
      kernels::Tensor loss = loss_fn.forward(model->forward(x), y);
      model->backward(loss_fn.backward());
      opt.step();
      losses.push_back(loss.item());
    }
    out["losses"][n] = losses;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT.json [SEED]\n", argv[0]);
    return 2;
  }
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  json j = {{"seed", std::to_string(seed)}};
  j.update(philox_section(seed));
  j["synthetic"] = synthetic_section(seed);
  j["params"] = params_section(seed);
  j["train"] = train_section(seed);
  std::ofstream f(argv[1]);
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", argv[1]);
    return 1;
  }
  f << j.dump() << "\n";
  return 0;
}
