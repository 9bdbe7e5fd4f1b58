// Mixed precision's 16-bit weights written by the optimizer's step (Optimizer::
// writes_compute_copy): the next forward casts nothing and computes the bits it computed when it
// cast; a ZeRO-1 shard writes none; what writes the parameters between a step and the next
// forward is seen after Module::parameters_changed(), which nn's loaders call.
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nn/nn.hpp"
#include "tests/nn_test_util.hpp"
#include "tests/test_util.hpp"

using namespace kernels;

namespace {

constexpr uint64_t kSeed = 43;

nn::GptConfig small_gpt() {
  nn::GptConfig c;
  c.vocab = 64, c.context = 16, c.layers = 2, c.heads = 2, c.dim = 32;
  return c;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// A bf16 GPT with bf16 activations on cpu:0 (initial weights from `seed`).
std::shared_ptr<nn::Gpt> model(uint64_t seed = kSeed) {
  auto m = std::make_shared<nn::Gpt>(small_gpt());
  m->materialize(Device::cpu(0), seed);
  m->set_compute_dtype(DType::bf16);
  m->set_activations(nn::Activations::compute);
  return m;
}

int64_t casts() {
  return kernels::context(Device::cpu(0)).casts();
}

// One training step of m on batch s; returns the loss and counts the step's casts.
float train_step(nn::Module& m, nn::Optimizer& opt, int s, int64_t* step_casts = nullptr) {
  nn::TokenCrossEntropyLoss loss_fn;
  auto [x, y] = nn_test::gpt_tokens(s);
  const int64_t before = casts();
  m.zero_grad();
  Tensor out = m.forward(x);
  Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(0));
  Tensor dl = Tensor::empty(out.shape(), out.dtype(), Device::cpu(0));
  loss_fn.compute(loss, dl, out, y);
  m.backward(dl);
  opt.step();
  if (step_casts) *step_casts = casts() - before;
  return loss.item();
}

// The debug check of the step's copy (nn::set_weight_copy_check) on for a scope.
struct CheckingCopies {
  CheckingCopies() { nn::set_weight_copy_check(true); }
  ~CheckingCopies() { nn::set_weight_copy_check(false); }
};

// The model's (f32) output on batch `s` in training mode, without a step.
Tensor output(nn::Module& m, int s) {
  return m.forward(nn_test::gpt_tokens(s).first).clone();
}

}  // namespace

TEST_CASE(
    "nn.compute_copy: the step writes the bf16 weights, the forward casts nothing, same bits") {
  const CheckingCopies checking;  // every step's copy is the cast's (it would throw)
  for (const bool sgd : {false, true}) {
    CAPTURE(sgd);
    auto make_opt = [&](nn::Module& m) -> std::unique_ptr<nn::Optimizer> {
      if (sgd) {
        SgdConfig c;
        c.lr = 0.05f, c.momentum = 0.9f;
        return std::make_unique<nn::SGD>(m, c);
      }
      AdamWConfig c;
      c.lr = 3e-3f;
      return std::make_unique<nn::AdamW>(m, c);
    };
    auto written = model(), cast = model();
    auto opt_written = make_opt(*written), opt_cast = make_opt(*cast);
    CHECK(opt_written->writes_compute_copy());
    opt_cast->set_writes_compute_copy(false);
    for (int s = 0; s < 4; ++s) {
      CAPTURE(s);
      int64_t casts_written = 0, casts_cast = 0;
      CHECK(train_step(*written, *opt_written, s, &casts_written) ==
            train_step(*cast, *opt_cast, s, &casts_cast));
      // The first forward casts the weights; after each step the copy is already written.
      CHECK(casts_cast - casts_written == (s == 0 ? 0 : 1));
      CHECK(same_bits(written->flat_params(), cast->flat_params()));
      // What the step wrote is the cast of what it stepped to; the other copy is a step behind.
      const Tensor want = kernels::cast(written->flat_params(), DType::bf16);
      CHECK(same_bits(written->flat().compute_params, want));
      CHECK_FALSE(same_bits(cast->flat().compute_params, want));
    }
    CHECK(same_bits(output(*written, 9), output(*cast, 9)));
  }
}

TEST_CASE("nn.compute_copy: a ZeRO-1 shard writes no copy, so the forward casts after its step") {
  auto sharded = model(), whole = model();
  AdamWConfig c;
  c.lr = 3e-3f;
  nn::AdamW opt_sharded(*sharded, c), opt_whole(*whole, c);
  // The shard is the first half; the test copies the rest from the whole run, as the all-gather
  // would.
  const int64_t half = sharded->flat_params().numel() / 2;
  opt_sharded.set_shard(0, half);
  for (int s = 0; s < 3; ++s) {
    CAPTURE(s);
    int64_t casts_sharded = 0, casts_whole = 0;
    const float a = train_step(*sharded, opt_sharded, s, &casts_sharded);
    CHECK(a == train_step(*whole, opt_whole, s, &casts_whole));
    CHECK(casts_sharded - casts_whole == (s == 0 ? 0 : 1));  // the weights' cast at every step
    CHECK_FALSE(sharded->flat().compute_written);
    Tensor rest = sharded->flat_params().view(half, {sharded->flat_params().numel() - half});
    kernels::copy(rest, whole->flat_params().view(half, {rest.numel()}));
    CHECK(same_bits(sharded->flat_params(), whole->flat_params()));
  }
}

TEST_CASE(
    "nn.compute_copy: weights written after a step are read once parameters_changed() says so") {
  AdamWConfig c;
  c.lr = 3e-3f;
  auto other = model(kSeed + 1);
  const Tensor want = output(*other, 5);

  SUBCASE("by hand, with parameters_changed(); and without it, the step's copy (the contract)") {
    for (const bool told : {true, false}) {
      CAPTURE(told);
      auto m = model();
      nn::AdamW opt(*m, c);
      train_step(*m, opt, 0);
      kernels::copy(m->flat_params(), other->flat_params());
      if (told) m->parameters_changed();
      CHECK(same_bits(output(*m, 5), want) == told);
    }
  }
  SUBCASE("without parameters_changed(), DP_CHECK_WEIGHT_COPY's check names the call") {
    const CheckingCopies checking;
    auto m = model();
    nn::AdamW opt(*m, c);
    train_step(*m, opt, 0);
    kernels::copy(m->flat_params(), other->flat_params());
    CHECK_THROWS_WITH_AS(output(*m, 5),
                         doctest::Contains("Gpt::forward: the bf16 weights the optimizer's step "
                                           "wrote differ from the f32 weights at flat element 0"),
                         kernels::Error);
  }
  SUBCASE("load_checkpoint") {
    const std::string path = dp_test::temp_path("nn_compute_copy", "other.ckpt");
    nn::save_checkpoint(*other, path);
    auto m = model();
    nn::AdamW opt(*m, c);
    train_step(*m, opt, 0);
    nn::load_checkpoint(*m, path);
    CHECK(same_bits(output(*m, 5), want));
    std::remove(path.c_str());
  }
  SUBCASE("reinitialize") {
    auto m = model();
    nn::AdamW opt(*m, c);
    train_step(*m, opt, 0);
    m->reinitialize(kSeed + 1);
    CHECK(same_bits(output(*m, 5), want));
  }
  SUBCASE("set_compute_dtype again") {
    auto m = model();
    nn::AdamW opt(*m, c);
    train_step(*m, opt, 0);
    kernels::copy(m->flat_params(), other->flat_params());
    m->set_compute_dtype(DType::bf16);  // a fresh copy: cast by the next forward
    CHECK(same_bits(output(*m, 5), want));
  }
  // f32 has no copy: the call does nothing.
  auto f32 = nn_test::materialized(nn::gpt(small_gpt()), kSeed, Device::cpu(0));
  const uint64_t version = f32->flat().host_values_version;
  f32->parameters_changed();
  CHECK(f32->flat().host_values_version == version);
}
