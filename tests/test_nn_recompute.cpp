// Activation checkpointing (Module::set_recompute): a checkpointed module's forward keeps its
// input alone and its backward runs the forward again. The gradients, losses and BatchNorm's
// running statistics are the plain run's bits (dropout draws the same counters again), the
// memory held between forward and backward is smaller, nested checkpoints run again in each
// backward, and a module that cannot run again on its own refuses by name.
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nn/nn.hpp"
#include "tests/nn_test_util.hpp"
#include "tests/train_util.hpp"

using namespace kernels;

namespace {

constexpr uint64_t kSeed = 41;

// Every width a multiple of 8 (the eight-wide kernels), dropout in the embedding, attention
// and MLP: a recompute that drew other counters would change the bits.
nn::GptConfig dropout_gpt() {
  nn::GptConfig c;
  c.vocab = 64, c.context = 16, c.layers = 3, c.heads = 2, c.dim = 32, c.dropout = 0.1f;
  return c;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// How many modules of m's tree are checkpointed.
int checkpointed(nn::Module& m) {
  int n = 0;
  m.for_each_module([&](nn::Module& part) { n += part.recomputes() ? 1 : 0; });
  return n;
}

int64_t bytes_in_use() {
  return kernels::context(Device::cpu(0)).memory()->current.load();
}

// A run of 3 AdamW steps of the GPT on cpu:0: each step's loss and gradients, the weights at
// the end, and the memory the step added: held between its forward and backward, held once
// its backward is done (the layers' saved state, until the next forward), and at its peak.
struct Run {
  std::vector<float> losses, params;
  std::vector<std::vector<float>> grads;
  int64_t held_after_forward = 0, held_after_step = 0, peak = 0;
};

Run train_gpt(bool recompute, bool bf16) {
  nn::GptConfig config = dropout_gpt();
  config.recompute = recompute;  // the config sets it on every block
  auto m = nn::gpt(config);
  CHECK(checkpointed(*m) == (recompute ? 3 : 0));
  m->materialize(Device::cpu(0), kSeed);
  if (bf16) {
    m->set_compute_dtype(DType::bf16);
    m->set_activations(nn::Activations::compute);
  }
  AdamWConfig cfg;
  cfg.lr = 3e-3f;
  nn::AdamW opt(*m, cfg);
  nn::TokenCrossEntropyLoss loss_fn;
  Run run;
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = nn_test::gpt_tokens(s);
    m->zero_grad();
    const int64_t before = bytes_in_use();
    kernels::context(Device::cpu(0)).memory()->begin_window();
    Tensor out = m->forward(x);
    run.held_after_forward = std::max(run.held_after_forward, bytes_in_use() - before);
    Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(0));
    Tensor dl = Tensor::empty(out.shape(), DType::f32, Device::cpu(0));
    loss_fn.compute(loss, dl, out, y);
    m->backward(dl);
    run.held_after_step = std::max(run.held_after_step, bytes_in_use() - before);
    run.peak = std::max(run.peak, kernels::context(Device::cpu(0)).memory()->window_peak.load());
    run.grads.push_back(m->flat_grads().to_host_f32());
    opt.step();
    run.losses.push_back(loss.item());
  }
  run.params = m->flat_params().to_host_f32();
  return run;
}

// A layer that counts its forwards: how many times a checkpoint runs it.
class CountingIdentity : public nn::Module {
 public:
  explicit CountingIdentity(std::shared_ptr<int> count) : count_(std::move(count)) {}
  std::string type_name() const override { return "CountingIdentity"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    ++*count_;
    return x;
  }
  Tensor backward_impl(const Tensor& dy) override { return dy; }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<CountingIdentity>(count_);
  }

 private:
  std::shared_ptr<int> count_;
};

// One replica's SyncBatchNorm exchange (the sum over one replica is its own values), counted.
class CountingSync : public nn::StatsSync {
 public:
  void all_reduce_sum(std::vector<double>&) override { ++calls; }
  int calls = 0;
};

}  // namespace

TEST_CASE("nn.recompute: checkpointed GPT blocks give the plain run's bits and hold less") {
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    Run plain = train_gpt(false, bf16), ckpt = train_gpt(true, bf16);
    CHECK(same_bits(ckpt.losses, plain.losses));
    for (size_t s = 0; s < plain.grads.size(); ++s) {
      CAPTURE(s);
      CHECK(same_bits(ckpt.grads[s], plain.grads[s]));
    }
    CHECK(same_bits(ckpt.params, plain.params));
    // Between forward and backward, each checkpointed block holds its two inputs instead of
    // its attention, norms, MLP and dropout masks.
    MESSAGE("plain / checkpointed, bytes: held after forward "
            << plain.held_after_forward << " / " << ckpt.held_after_forward << ", after backward "
            << plain.held_after_step << " / " << ckpt.held_after_step << ", step's peak "
            << plain.peak << " / " << ckpt.peak);
    CHECK(ckpt.held_after_forward < plain.held_after_forward / 2);
    // Once backward is done a checkpointed block holds nothing (a plain layer keeps its state
    // until its next forward), and the step's peak holds one block's state at a time.
    CHECK(ckpt.held_after_step < plain.held_after_step / 2);
    CHECK(ckpt.peak < plain.peak);
  }
}

TEST_CASE("nn.recompute: (Sync)BatchNorm under a checkpoint updates and exchanges once") {
  auto make = [](bool recompute) {
    auto body = std::make_shared<nn::Sequential>();
    body->add(std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1));
    body->add(std::make_shared<nn::BatchNorm2d>(4));
    body->add(std::make_shared<nn::ReLU>());
    body->add(std::make_shared<nn::MaxPool2d>(2));
    body->set_recompute(recompute);
    auto m = std::make_shared<nn::Sequential>();
    m->add(body);
    m->add(std::make_shared<nn::Flatten>());
    m->add(std::make_shared<nn::Dropout>(0.2f));
    m->add(std::make_shared<nn::Linear>(64, 10));
    return m;
  };
  for (bool synced : {false, true}) {
    CAPTURE(synced);
    std::vector<std::vector<float>> out[2];
    for (bool recompute : {false, true}) {
      auto m = make(recompute);
      m->materialize(Device::cpu(0), kSeed);
      auto sync = std::make_shared<CountingSync>();
      if (synced) nn::set_batch_norm_sync(*m, sync);
      nn::SGD opt(*m, dp_test::momentum_sgd());
      for (int s = 0; s < 3; ++s) {
        auto [x, y] = dp_test::image_batch(6, s);
        dp_test::single_step(*m, opt, x, y);
        out[recompute].push_back(m->flat_grads().to_host_f32());
      }
      out[recompute].push_back(m->flat_params().to_host_f32());
      out[recompute].push_back(m->flat_buffers().to_host_f32());  // the running statistics
      // Synced: one exchange in forward and one in backward a step; the run again adds none.
      CHECK(sync->calls == (synced ? 2 * 3 : 0));
    }
    REQUIRE(out[0].size() == out[1].size());
    for (size_t i = 0; i < out[0].size(); ++i) {
      CAPTURE(i);
      CHECK(same_bits(out[1][i], out[0][i]));
    }
  }
}

TEST_CASE("nn.recompute: a checkpoint inside a checkpoint runs again in each backward") {
  auto count = std::make_shared<int>(0);
  auto inner = std::make_shared<nn::Sequential>();
  inner->add(std::make_shared<nn::Linear>(6, 16));
  inner->add(std::make_shared<CountingIdentity>(count));
  inner->add(std::make_shared<nn::Dropout>(0.3f));
  auto outer = std::make_shared<nn::Sequential>();
  outer->add(inner);
  outer->add(std::make_shared<nn::GELU>());
  outer->add(std::make_shared<nn::Linear>(16, 5));
  auto plain = outer->clone_structure();
  inner->set_recompute();
  outer->set_recompute();
  outer->materialize(Device::cpu(0), kSeed);
  plain->materialize(Device::cpu(0), kSeed);
  nn::SGD opt_a(*outer, dp_test::momentum_sgd()), opt_b(*plain, dp_test::momentum_sgd());
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = dp_test::toy_batch(8, 100 + s);
    const int before = *count;
    const float la = dp_test::single_step(*outer, opt_a, x, y);
    const int runs = *count - before;
    const float lb = dp_test::single_step(*plain, opt_b, x, y);
    CHECK(la == lb);
    // The checkpointed inner module runs 3 times a step: its forward, the outer backward's run
    // again, and its own backward's (the plain model's, sharing the counter, runs once later).
    CHECK(runs == 3);
  }
  CHECK(same_bits(outer->flat_params().to_host_f32(), plain->flat_params().to_host_f32()));
  // A replica keeps the setting (DP's devices are clones).
  auto replica = outer->clone_to(Device::cpu(1));
  CHECK(replica->recomputes());
  // In eval mode a checkpointed module runs once, keeping nothing to run again.
  outer->eval();
  const int before = *count;
  auto [x, y] = dp_test::toy_batch(8, 7);
  outer->forward(x);
  CHECK(*count - before == 1);
}

TEST_CASE("nn.recompute: a part its parent runs through a fused entry point refuses by name") {
  auto m = nn::gpt(dropout_gpt());
  nn::Module* h = nullptr;
  for (auto& [name, child] : m->children())
    if (name == "h") h = child.get();
  REQUIRE(h != nullptr);
  h->set_recompute();
  m->materialize(Device::cpu(0), kSeed);
  auto [x, y] = nn_test::gpt_tokens(0);
  CHECK_THROWS_WITH_AS(m->forward(x),
                       doctest::Contains("Sequential::forward: set_recompute on a module its "
                                         "parent runs through a fused entry point"),
                       kernels::Error);
  // The same model with its blocks checkpointed instead trains.
  h->set_recompute(false);
  CHECK(nn::recompute_each<nn::GptBlock>(*m) == 3);
  m->zero_grad();
  Tensor out = m->forward(x);
  Tensor dl = Tensor::zeros(out.shape(), DType::f32, Device::cpu(0));
  m->backward(dl);
  CHECK(nn::recompute_each<nn::Linear>(*nn::mlp({4, 4})) == 1);
  nn::LlamaConfig llama = nn::LlamaConfig::preset("tiny");
  llama.recompute = true;
  CHECK(checkpointed(*nn::llama(llama)) == llama.layers);
}
