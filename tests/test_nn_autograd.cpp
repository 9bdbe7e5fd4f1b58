// nn.autograd: layers written with autograd (nn/autograd.hpp, nn/composed.hpp) against the fused
// layers and finite differences; a warm composed step allocates nothing and replays inside a
// graph with the same bits; gradients add into the flat buffer and the hooks fire; edge cases
// of the tape (an input used twice, an unused input, the input returned) and its refusals.
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "kernels/runtime/graph.hpp"
#include "nn/nn.hpp"
#include "tests/test_util.hpp"

using namespace kernels;
namespace ag = nn::ag;

namespace {

Tensor rnd(const Shape& s, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  return Tensor::from_vector(
      dp_test::random_vector(static_cast<size_t>(shape_numel(s)), seed, lo, hi), s);
}

// y, dx and the parameter gradients of m on x with dy.
struct Pass {
  std::vector<float> y, dx, grads;
};
Pass run(nn::Module& m, const Tensor& x, const Tensor& dy) {
  m.zero_grad();
  Pass p;
  p.y = m.forward(x).to_host_f32();
  Tensor dx = m.backward(dy);
  if (dx.defined()) p.dx = dx.to_host_f32();
  p.grads = nn::packed_parameters(m, m.flat_grads().to_host_f32());
  return p;
}

// Every op of the set in one layer: elementwise, broadcasting, where, reductions, softmax,
// permute, expand, cat and split, and a batched matmul. x (B, T, D) -> (B, T, D).
class OpZoo : public nn::Composed {
 public:
  explicit OpZoo(int64_t d)
      : d_(d),
        w_(register_parameter("w", {d, d}, nn::InitSpec::normal(0.3f))),
        b_(register_parameter("b", {d}, nn::InitSpec::normal(0.3f))) {}
  std::string type_name() const override { return "OpZoo"; }

 protected:
  ag::Var compose(const ag::Var& x) override {
    using namespace ag;
    const Var h = linear(x, param(w_)) + param(b_);                    // (B, T, D)
    const Var att = softmax(matmul(h, transpose(x, 1, 2)) / 4.f, -1);  // (B, T, T)
    const Var mixed = matmul(att, x);                                  // (B, T, D)
    const Var g = where(h, sigmoid(h) * tanh(mixed), gelu(mixed) - relu(-h));
    const Var halves = cat(split(g, -1, {d_ / 2, d_ - d_ / 2}), 0);  // (2 B, T, D / 2)
    const Var back =
        cat({narrow(halves, 0, 0, x.dim(0)), narrow(halves, 0, x.dim(0), x.dim(0))}, -1);
    const Var norm = sqrt(mean(back * back, -1, keepdim) + 1.f) + amax(abs(back), -1, keepdim);
    const Var soft = exp(log_softmax(permute(back, {0, 2, 1}), 1));  // (B, D, T)
    const Var e = expand(reshape(sum(soft, 1), {x.dim(0), x.dim(1), 1}), x.shape());
    return maximum(back / norm, minimum(e, pow(abs(x) + 0.5f, 1.5f))) + silu(x) * 0.5f -
           log(1.f + gelu_tanh(x) * gelu_tanh(x)) + 2.f / (2.f + x * x);
  }
  std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<OpZoo>(d_); }

 private:
  int64_t d_;
  nn::Parameter& w_;
  nn::Parameter& b_;
};

// A dense mixture of experts, a research layer's shape of ops: a softmax gate over E experts,
// each a GELU MLP whose second matrix is one slice of a 3-D parameter (E, F, D), read by a
// batched matmul over the experts. x (B, T, D) -> (B, T, D).
class ExpertMix : public nn::Composed {
 public:
  ExpertMix(int64_t d, int64_t experts, int64_t hidden)
      : d_(d),
        e_(experts),
        f_(hidden),
        gate_(register_parameter("gate", {experts, d}, nn::InitSpec::normal(0.5f))),
        w1_(register_parameter("w1", {experts * hidden, d}, nn::InitSpec::normal(0.5f))),
        w2_(register_parameter("w2", {experts, hidden, d}, nn::InitSpec::normal(0.5f))) {}
  std::string type_name() const override { return "ExpertMix"; }

 protected:
  ag::Var compose(const ag::Var& x) override {
    using namespace ag;
    const int64_t n = x.dim(0) * x.dim(1);
    const Var rows = reshape(x, {n, d_});
    const Var g = softmax(linear(rows, param(gate_)), -1);                           // (n, E)
    const Var h = gelu(reshape(linear(rows, param(w1_)), {n, e_, f_}));              // (n, E, F)
    const Var each = permute(matmul(permute(h, {1, 0, 2}), param(w2_)), {1, 0, 2});  // (n, E, D)
    return reshape(sum(each * reshape(g, {n, e_, 1}), 1, false), x.shape());
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<ExpertMix>(d_, e_, f_);
  }

 private:
  int64_t d_, e_, f_;
  nn::Parameter &gate_, &w1_, &w2_;
};

// Tape edge cases: y = x * x + p (x used twice; p a parameter broadcast over rows).
class Square : public nn::Composed {
 public:
  explicit Square(int64_t d)
      : d_(d), p_(register_parameter("p", {d}, nn::InitSpec::constant(0.5f))) {}
  std::string type_name() const override { return "Square"; }

 protected:
  ag::Var compose(const ag::Var& x) override { return x * x + param(p_); }
  std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Square>(d_); }

 private:
  int64_t d_;
  nn::Parameter& p_;
};

// Returns a function of its parameter only (the input is unused) or the input itself.
class Ignores : public nn::Composed {
 public:
  explicit Ignores(bool identity)
      : identity_(identity), p_(register_parameter("p", {3}, nn::InitSpec::constant(2.f))) {}
  std::string type_name() const override { return "Ignores"; }

 protected:
  ag::Var compose(const ag::Var& x) override {
    return identity_ ? x : ag::expand(ag::exp(param(p_)), x.shape());
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<Ignores>(identity_);
  }

 private:
  bool identity_;
  nn::Parameter& p_;
};

// Returns its parameter as it is, or a reshape of it (a view of the parameter's memory), whatever
// the input: a learned table read whole.
class Table : public nn::Composed {
 public:
  explicit Table(bool reshaped)
      : reshaped_(reshaped), p_(register_parameter("p", {2, 3}, nn::InitSpec::constant(2.f))) {}
  std::string type_name() const override { return "Table"; }

 protected:
  ag::Var compose(const ag::Var&) override {
    return reshaped_ ? ag::reshape(param(p_), {3, 2}) : param(p_);
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<Table>(reshaped_);
  }

 private:
  bool reshaped_;
  nn::Parameter& p_;
};

}  // namespace

TEST_CASE("nn.autograd: composed RMSNorm and SwiGLU equal the fused layers, forward and backward") {
  const Shape s{3, 5, 16};
  Tensor x = rnd(s, 1, -2.f, 2.f), dy = rnd(s, 2);
  {
    nn::RMSNorm fused(16);
    nn::ComposedRMSNorm composed(16);
    for (nn::Module* m : {static_cast<nn::Module*>(&fused), static_cast<nn::Module*>(&composed)})
      m->materialize(Device::cpu(0), 3);
    // Non-trivial gains, the same in both.
    Tensor g = rnd({16}, 4, 0.5f, 1.5f);
    copy(fused.flat_params(), g);
    copy(composed.flat_params(), g);
    const Pass a = run(fused, x, dy), b = run(composed, x, dy);
    CHECK(dp_test::rel_diff(a.y, b.y) <= 2e-6f);
    CHECK(dp_test::rel_diff(a.dx, b.dx) <= 2e-6f);
    CHECK(dp_test::rel_diff(a.grads, b.grads) <= 2e-6f);
  }
  {
    nn::SwiGLU fused(16, 24);
    nn::ComposedSwiGLU composed(16, 24);
    fused.materialize(Device::cpu(0), 5);
    composed.materialize(Device::cpu(0), 5);  // the same names, shapes and order: same weights
    REQUIRE(fused.flat_params().to_host_f32() == composed.flat_params().to_host_f32());
    std::vector<std::string> names_f, names_c;
    for (auto& [n, p] : fused.named_parameters()) names_f.push_back(n);
    for (auto& [n, p] : composed.named_parameters()) names_c.push_back(n);
    CHECK(names_f == names_c);
    const Pass a = run(fused, x, dy), b = run(composed, x, dy);
    CHECK(dp_test::rel_diff(a.y, b.y) <= 2e-6f);
    CHECK(dp_test::rel_diff(a.dx, b.dx) <= 2e-6f);
    CHECK(dp_test::rel_diff(a.grads, b.grads) <= 2e-6f);
  }
}

TEST_CASE("nn.autograd: composed rotary equals the rotary kernel, and its backward the inverse") {
  const int64_t b = 2, t = 5, h = 3, hd = 8, ctx = 7;
  nn::ComposedRotary rot(hd, ctx);
  rot.materialize(Device::cpu(0), 1);
  nn::CausalSelfAttention ref(h * hd, h, 0.f, [] {
    nn::AttentionOptions o;
    o.rotary_context = 7;
    return o;
  }());
  ref.materialize(Device::cpu(0), 1);
  Tensor x = rnd({b, t, h, hd}, 7), dy = rnd({b, t, h, hd}, 8);
  Tensor y = rot.forward(x);
  Tensor dx = rot.backward(dy);
  // The fused kernel on the same values, in place, with the attention layer's own tables.
  auto tables = ref.named_constants();
  REQUIRE(tables.size() == 2);
  Tensor want = Tensor::from_vector(x.to_host_f32(), {b, t, h * hd});
  rotary_embedding(want, tables[0].second->value, tables[1].second->value, hd, h * hd,
                   Rotation::forward);
  Tensor want_dx = Tensor::from_vector(dy.to_host_f32(), {b, t, h * hd});
  rotary_embedding(want_dx, tables[0].second->value, tables[1].second->value, hd, h * hd,
                   Rotation::inverse);
  CHECK(dp_test::rel_diff(y.to_host_f32(), want.to_host_f32()) <= 1e-6f);
  CHECK(dp_test::rel_diff(dx.to_host_f32(), want_dx.to_host_f32()) <= 1e-6f);
  // The tables are constants: no parameters, not averaged or saved.
  CHECK(rot.num_parameters() == 0);
  CHECK(rot.flat_buffers().numel() == 0);
}

TEST_CASE("nn.gradcheck: composed layers and every op of the set") {
  auto check = [](nn::Module& m, const Tensor& x) {
    m.materialize(Device::cpu(0), 11);
    nn::GradcheckOptions o;
    o.samples_per_tensor = 24;
    const nn::GradcheckResult r = nn::gradcheck(m, x, o);
    INFO(r.message);
    CHECK(r.ok);
    CHECK(r.checked > 0);
  };
  nn::ComposedRMSNorm norm(8);
  check(norm, rnd({2, 3, 8}, 21));
  nn::ComposedSwiGLU mlp(8, 12);
  check(mlp, rnd({2, 3, 8}, 22));
  nn::ComposedRotary rot(4, 6);
  check(rot, rnd({2, 3, 2, 4}, 23));
  OpZoo zoo(6);
  check(zoo, rnd({2, 4, 6}, 24));
  ExpertMix mix(6, 3, 4);
  check(mix, rnd({2, 3, 6}, 26));
  Square sq(5);
  check(sq, rnd({3, 5}, 25));
}

TEST_CASE(
    "nn.autograd: a warm composed step allocates nothing and replays in a graph bit for bit") {
  const Device dev = Device::cpu(0);
  nn::Sequential net;
  net.add(std::make_shared<nn::ComposedRMSNorm>(8));
  net.add(std::make_shared<nn::ComposedSwiGLU>(8, 12));
  net.add(std::make_shared<OpZoo>(8));
  net.materialize(dev, 3);
  Tensor x = rnd({2, 4, 8}, 31), dy = rnd({2, 4, 8}, 32);
  auto step = [&] {
    net.zero_grad();
    Tensor y = net.forward(x);
    net.backward(dy);
    return y;
  };
  step();  // records the tapes and makes the gradient buffers
  DeviceContext& ctx = context(dev);
  const int64_t before = ctx.memory()->allocations.load();
  const std::vector<float> y1 = step().to_host_f32();
  const std::vector<float> g1 = net.flat_grads().to_host_f32();
  CHECK(ctx.memory()->allocations.load() == before);
  // Captured: a CPU device refuses what a CUDA capture refuses (host reads, allocations the
  // cache cannot serve), so this is what a GPU graph would take.
  Tensor y_graph;
  Graph g;
  g.capture(ctx, [&] { y_graph = step(); });
  for (int i = 0; i < 2; ++i) g.replay();
  ctx.synchronize();
  CHECK(std::memcmp(y_graph.to_host_f32().data(), y1.data(), y1.size() * sizeof(float)) == 0);
  const std::vector<float> g2 = net.flat_grads().to_host_f32();
  CHECK(std::memcmp(g2.data(), g1.data(), g1.size() * sizeof(float)) == 0);
  // New values in the same input: a replay computes from them.
  copy(x, rnd({2, 4, 8}, 33));
  g.replay();
  ctx.synchronize();
  const std::vector<float> y_new = y_graph.to_host_f32();
  CHECK(y_new != y1);
  CHECK(step().to_host_f32() == y_new);
}

TEST_CASE("nn.autograd: gradients add into the flat buffer and each parameter's hook fires") {
  nn::Sequential net;
  auto norm = net.add(std::make_shared<nn::ComposedRMSNorm>(6));
  net.add(std::make_shared<nn::Linear>(6, 6));  // a built-in layer beside composed ones
  net.add(std::make_shared<nn::ComposedSwiGLU>(6, 8));
  net.materialize(Device::cpu(0), 4);
  std::vector<std::string> ready;
  auto names = net.named_parameters();
  net.flat().on_grad_ready = [&](const nn::Parameter& p) {
    for (auto& [n, q] : names)
      if (q == &p) ready.push_back(n);
  };
  Tensor x = rnd({4, 6}, 41), dy = rnd({4, 6}, 42);
  net.zero_grad();
  net.forward(x);
  net.backward(dy);
  const std::vector<float> once = net.flat_grads().to_host_f32();
  CHECK(ready == std::vector<std::string>{"2.gate_up.weight", "2.down.weight", "1.weight", "1.bias",
                                          "0.weight"});
  net.forward(x);
  net.backward(dy);  // no zero_grad: the gradients add
  const std::vector<float> twice = net.flat_grads().to_host_f32();
  for (size_t i = 0; i < once.size(); ++i) CHECK(twice[i] == doctest::Approx(2 * once[i]));
  (void)norm;
}

TEST_CASE("nn.autograd: an output in a parameter's memory is the layer's copy") {
  // A layer that returned param(p) handed the caller the parameter itself: a write into the
  // output changed the weights (and a step would have changed the output).
  for (bool reshaped : {false, true}) {
    CAPTURE(reshaped);
    Table t(reshaped);
    t.materialize(Device::cpu(0), 1);
    const Shape out = reshaped ? Shape{3, 2} : Shape{2, 3};
    Tensor x = rnd({4}, 55), dy = rnd(out, 56);
    for (int rep = 0; rep < 2; ++rep) {  // record, then replay
      t.zero_grad();
      Tensor y = t.forward(x);
      CHECK(y.shape() == out);
      CHECK(!y.same_storage(t.flat_params()));
      CHECK(y.to_host_f32() == std::vector<float>(6, 2.f));
      kernels::fill(y, 7.f);
      CHECK(t.flat_params().to_host_f32() == std::vector<float>(6, 2.f));
      t.backward(dy);
      CHECK(t.flat_grads().to_host_f32() == dy.to_host_f32());
    }
  }
  // The input returned as it is stays the input, as a built-in layer's would.
  Ignores identity(true);
  identity.materialize(Device::cpu(0), 1);
  Tensor x = rnd({2, 3}, 57);
  CHECK(identity.forward(x).same_storage(x));
}

TEST_CASE("nn.autograd: an input used twice, an unused input, the input returned, no input grad") {
  Tensor x = rnd({3, 5}, 51), dy = rnd({3, 5}, 52);
  const auto xs = x.to_host_f32(), dys = dy.to_host_f32();
  Square sq(5);
  sq.materialize(Device::cpu(0), 1);
  const Pass p = run(sq, x, dy);
  for (size_t i = 0; i < xs.size(); ++i) {
    CHECK(p.y[i] == doctest::Approx(xs[i] * xs[i] + 0.5f));
    CHECK(p.dx[i] == doctest::Approx(2 * xs[i] * dys[i]));
  }
  for (int j = 0; j < 5; ++j)
    CHECK(p.grads[j] == doctest::Approx(dys[j] + dys[5 + j] + dys[10 + j]));
  // The input not needed: no input gradient, the parameter's still.
  sq.set_input_grad(nn::InputGrad::not_needed);
  const Pass q = run(sq, x, dy);
  CHECK(q.dx.empty());
  CHECK(q.grads == p.grads);
  // An unused input gets a zero gradient; the returned input gets dy.
  Tensor x3 = rnd({2, 3}, 53), dy3 = rnd({2, 3}, 54);
  Ignores unused(false), identity(true);
  unused.materialize(Device::cpu(0), 1);
  identity.materialize(Device::cpu(0), 1);
  for (int rep = 0; rep < 2; ++rep) {  // record, then replay
    const Pass u = run(unused, x3, dy3), i = run(identity, x3, dy3);
    CHECK(u.dx == std::vector<float>(6, 0.f));
    CHECK(u.y[0] == doctest::Approx(std::exp(2.f)));
    CHECK(i.y == x3.to_host_f32());
    CHECK(i.dx == dy3.to_host_f32());
  }
}

TEST_CASE("nn.autograd: a new shape records its own tape, bf16 follows f32, refusals name the op") {
  nn::ComposedSwiGLU mlp(8, 12);
  mlp.materialize(Device::cpu(0), 6);
  Tensor a = rnd({4, 8}, 61), b = rnd({3, 8}, 62);
  const std::vector<float> ya = mlp.forward(a).to_host_f32();
  CHECK(mlp.forward(b).numel() == 3 * 8);  // another shape (DP's last, smaller chunk)
  CHECK(mlp.forward(a).to_host_f32() == ya);
  // Under bf16 compute and activations: matmuls in bf16, the output bf16, close to f32.
  mlp.set_compute_dtype(DType::bf16);
  mlp.set_activations(nn::Activations::compute);
  Tensor y16 = mlp.forward(a);
  CHECK(y16.dtype() == DType::f32);  // the outermost forward's output is f32
  CHECK(dp_test::rel_diff(y16.to_host_f32(), ya) <= 3e-2f);
  Tensor dy = rnd({4, 8}, 63);
  const std::vector<float> dx16 = mlp.backward(dy).to_host_f32();
  mlp.set_compute_dtype(DType::f32);
  mlp.forward(a);
  CHECK(dp_test::rel_diff(dx16, mlp.backward(dy).to_host_f32()) <= 3e-2f);
  // Refusals.
  class Bad : public nn::Composed {
   public:
    std::string type_name() const override { return "Bad"; }
    ag::Var kept;
    bool cross = false;

   protected:
    ag::Var compose(const ag::Var& x) override {
      if (cross && kept.tape()) return x + kept;  // a Var of an earlier forward
      kept = x;
      return ag::matmul(x, x);
    }
    std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Bad>(); }
  };
  Bad bad;
  bad.materialize(Device::cpu(0), 1);
  CHECK(dp_test::error_of([&] {
          bad.forward(rnd({2, 3}, 64));
        }).find("matmul: [2, 3] times [2, 3]: inner dims or leading dims differ") !=
        std::string::npos);
  bad.cross = true;
  // The Var kept from the forward that threw is refused, even when the new tape is allocated at
  // the freed one's address (it was, on some runs, before tapes had serials).
  CHECK(dp_test::error_of([&] {
          bad.forward(rnd({2, 2}, 65));
        }).find("add: a Var from another forward") != std::string::npos);
  bad.kept = ag::Var();
  bad.forward(rnd({2, 2}, 65));  // records, and keeps its input
  CHECK(dp_test::error_of([&] {
          bad.forward(rnd({3, 3}, 66));
        }).find("add: a Var from another forward") != std::string::npos);
  CHECK(dp_test::error_of([&] { ag::reshape(bad.kept, {4}); }).find("outside compose()") !=
        std::string::npos);
  CHECK(dp_test::error_of([&] { ag::reshape(ag::Var(), {2}); }).find("an empty Var") !=
        std::string::npos);
}

TEST_CASE("nn.llama: composed RMSNorm and SwiGLU train the same Llama as the fused layers") {
  auto train = [](bool composed) {
    nn::LlamaConfig c;
    c.vocab = 13, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 16, c.hidden = 24;
    c.composed = composed;
    auto m = nn::llama(c);
    m->materialize(Device::cpu(0), 9);
    nn::AdamW opt(*m, [] {
      AdamWConfig a;
      a.lr = 3e-3f;
      return a;
    }());
    nn::TokenCrossEntropyLoss loss_fn;
    std::vector<float> losses;
    for (int s = 0; s < 3; ++s) {
      std::vector<int32_t> ids(5 * 6), tg(ids.size());
      for (size_t i = 0; i < ids.size(); ++i)
        ids[i] = static_cast<int32_t>((i * 5 + s) % 13),
        tg[i] = static_cast<int32_t>((i * 3 + s + 1) % 13);
      Tensor x = Tensor::from_ints(ids, {5, 6}), y = Tensor::from_ints(tg, {5, 6});
      m->zero_grad();
      Tensor out = m->forward(x);
      Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(0));
      Tensor dl = Tensor::empty(out.shape(), DType::f32, Device::cpu(0));
      loss_fn.compute(loss, dl, out, y);
      m->backward(dl);
      opt.step();
      losses.push_back(loss.item());
    }
    std::vector<float> params = m->flat_params().to_host_f32();
    losses.insert(losses.end(), params.begin(), params.end());
    return losses;
  };
  const std::vector<float> fused = train(false), composed = train(true);
  REQUIRE(fused.size() == composed.size());
  CHECK(dp_test::rel_diff(fused, composed) <= 1e-5f);
}

TEST_CASE("nn.profile: each layer's forward and backward timed, own times add up to the step") {
  nn::Sequential net;
  net.add(std::make_shared<nn::Linear>(16, 32));
  net.add(std::make_shared<nn::ComposedSwiGLU>(32, 48));
  net.add(std::make_shared<nn::GELU>());
  net.materialize(Device::cpu(0), 7);
  Tensor x = rnd({64, 16}, 81), dy = rnd({64, 32}, 82);
  std::vector<nn::LayerProfiler::Row> rows;
  std::string table;
  {
    nn::LayerProfiler prof(net);
    CHECK(dp_test::error_of([&] { nn::LayerProfiler again(net); }).find("already being profiled") !=
          std::string::npos);
    for (int s = 0; s < 3; ++s) {
      net.forward(x);
      net.backward(dy);
    }
    rows = prof.rows();
    table = prof.table();
  }
  CHECK(!net.flat().layer_times);  // the profiler's end stops the timing
  REQUIRE(rows.size() == 4);
  CHECK(rows[0].type == "Sequential");
  CHECK(rows[2].path == "1");
  CHECK(rows[2].type == "ComposedSwiGLU");
  double children_fwd = 0, children_bwd = 0;
  for (const auto& r : rows) {
    CAPTURE(r.path);
    CHECK(r.forwards == 3);
    CHECK(r.backwards == 3);
    CHECK(r.forward_ms > 0);
    CHECK(r.self_forward_ms >= 0);
    CHECK(r.self_forward_ms <= r.forward_ms);
    if (!r.path.empty()) children_fwd += r.forward_ms, children_bwd += r.backward_ms;
  }
  CHECK(rows[0].self_forward_ms == doctest::Approx(rows[0].forward_ms - children_fwd));
  CHECK(rows[0].self_backward_ms == doctest::Approx(rows[0].backward_ms - children_bwd));
  CHECK(table.find("ms per step") != std::string::npos);
  CHECK(table.find("ComposedSwiGLU") != std::string::npos);
  CHECK(table.find("by type: ") != std::string::npos);
  CHECK(table.find(" Linear ") != std::string::npos);
  CHECK(table.back() == '\n');
}

TEST_CASE("nn.autograd: grouped-query attention is causal, shares its kv heads, passes gradcheck") {
  const int64_t b = 2, t = 5, d = 8, h = 4, ctx = 6;
  // GQA with 2 kv heads equals multi-head attention whose kv heads repeat them.
  nn::ComposedAttention gqa(d, h, 2, ctx), mha(d, h, h, ctx);
  gqa.materialize(Device::cpu(0), 3);
  mha.materialize(Device::cpu(0), 4);
  auto params = [](nn::Module& m) {
    std::map<std::string, std::vector<float>> out;
    for (auto& [n, p] : m.named_parameters()) out[n] = p->value.to_host_f32();
    return out;
  };
  auto g = params(gqa);
  const int64_t hd = d / h;
  std::map<std::string, std::vector<float>> tiled = g;
  for (const char* kv : {"k.weight", "v.weight"}) {
    std::vector<float> w;
    for (int64_t head = 0; head < h; ++head)
      w.insert(w.end(), g[kv].begin() + (head / 2) * hd * d,
               g[kv].begin() + (head / 2 + 1) * hd * d);
    tiled[kv] = w;
  }
  for (auto& [n, p] : mha.named_parameters())
    copy(p->value, Tensor::from_vector(tiled[n], p->shape));
  Tensor x = rnd({b, t, d}, 91);
  const std::vector<float> yg = gqa.forward(x).to_host_f32(), ym = mha.forward(x).to_host_f32();
  CHECK(dp_test::rel_diff(yg, ym) <= 1e-6f);
  // Causal: the last position's input changes only the last position's output.
  std::vector<float> xs = x.to_host_f32();
  for (int64_t r = 0; r < b; ++r)
    for (int64_t j = 0; j < d; ++j) xs[static_cast<size_t>((r * t + t - 1) * d + j)] += 1.f;
  const std::vector<float> y2 = gqa.forward(Tensor::from_vector(xs, {b, t, d})).to_host_f32();
  int changed = 0;
  for (int64_t i = 0; i < b * t * d; ++i) {
    if ((i / d) % t != t - 1)
      CHECK(y2[i] == yg[i]);  // every earlier position
    else
      changed += y2[i] != yg[i];
  }
  CHECK(changed > 0);
  nn::ComposedAttention mqa(d, h, 1, ctx);
  mqa.materialize(Device::cpu(0), 5);
  nn::GradcheckOptions o;
  o.samples_per_tensor = 16;
  const nn::GradcheckResult r = nn::gradcheck(mqa, rnd({b, t, d}, 92), o);
  INFO(r.message);
  CHECK(r.ok);
  CHECK(dp_test::error_of([] {
          nn::ComposedAttention(8, 4, 3, 6);
        }).find("kv heads divide heads") != std::string::npos);
}

// The composed Llama keeps the fused one's parameter names: a checkpoint of one loads into the
// other and gives the same logits; a clone of a composed model (a DP replica) computes the same.
TEST_CASE("nn.autograd: a fused Llama's checkpoint loads into the composed one, clones agree") {
  nn::LlamaConfig c;
  c.vocab = 13, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 16, c.hidden = 24;
  auto fused = nn::llama(c);
  fused->materialize(Device::cpu(0), 21);
  c.composed = true;
  auto composed = nn::llama(c);
  composed->materialize(Device::cpu(0), 22);  // other weights until the load
  const std::string path = dp_test::temp_path("autograd", "llama.ckpt");
  nn::save_checkpoint(*fused, path);
  nn::load_checkpoint(*composed, path);
  std::remove(path.c_str());
  std::vector<int32_t> ids(2 * 6);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7 + 1) % 13);
  Tensor x = Tensor::from_ints(ids, {2, 6});
  const std::vector<float> want = fused->forward(x).to_host_f32();
  CHECK(dp_test::rel_diff(composed->forward(x).to_host_f32(), want) <= 2e-6f);
  auto replica = composed->clone_to(Device::cpu(1));
  CHECK(dp_test::rel_diff(replica->forward(x.to(Device::cpu(1))).to_host_f32(), want) <= 2e-6f);
}

namespace {

// y = x W^T (W 3x3): a layer that can take its own output.
class Mix : public nn::Composed {
 public:
  Mix() : w_(register_parameter("w", {3, 3}, nn::InitSpec::normal(0.5f))) {}
  std::string type_name() const override { return "Mix"; }
  ag::Var kept;                      // the last recorded output, kept past its forward
  nn::Parameter* foreign = nullptr;  // a parameter of another module, taken by param()

 protected:
  ag::Var compose(const ag::Var& x) override {
    kept = ag::linear(x, param(foreign ? *foreign : w_));
    return kept;
  }
  std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Mix>(); }

 private:
  nn::Parameter& w_;
};

// y = x seen as one row: a layer whose output is a view of its input.
class Flat : public nn::Composed {
 public:
  std::string type_name() const override { return "Flat"; }

 protected:
  ag::Var compose(const ag::Var& x) override { return ag::reshape(x, {-1}); }
  std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Flat>(); }
};

// A built-in Linear called inside compose(): y = lin(x) * 2.
class Outer : public nn::Composed {
 public:
  Outer() : lin_(register_module("lin", std::make_shared<nn::Linear>(2, 2))) {}
  std::string type_name() const override { return "Outer"; }

 protected:
  ag::Var compose(const ag::Var& x) override { return ag::call(*lin_, x) * 2.f; }
  std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Outer>(); }

 private:
  std::shared_ptr<nn::Linear> lin_;
};

}  // namespace

TEST_CASE("nn.module: one module at two places of a tree, or two of one name, is refused") {
  // Before: Sequential{lin, lin} trained with wrong gradients (one forward's state for two
  // backwards, and two offsets for one parameter).
  auto lin = std::make_shared<nn::Linear>(1, 1);
  nn::Sequential twice{lin, lin};
  CHECK(dp_test::error_of([&] {
          twice.materialize(Device::cpu(0), 1);
        }).find("one Linear is registered at 0 and at 1") != std::string::npos);
  auto mix = std::make_shared<Mix>();
  nn::Sequential nested{std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{mix}), mix};
  CHECK(dp_test::error_of([&] {
          nested.materialize(Device::cpu(0), 1);
        }).find("one Mix is registered at 0.0 and at 1") != std::string::npos);
  // Two of one name would share a path in named_parameters() and checkpoints.
  class Named : public nn::Module {
   public:
    std::string type_name() const override { return "Named"; }
    void add(const std::string& n) { register_parameter(n, {1}, nn::InitSpec::constant(0.f)); }
    void child(const std::string& n, nn::ModulePtr m) { register_module(n, std::move(m)); }

   protected:
    Tensor forward_impl(const Tensor& x) override { return x; }
    Tensor backward_impl(const Tensor& dy) override { return dy; }
    std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Named>(); }
  };
  Named named;
  named.add("w");
  CHECK(dp_test::error_of([&] {
          named.add("w");
        }).find("register_parameter(w): Named has a 'w' already") != std::string::npos);
  CHECK(dp_test::error_of([&] {
          named.child("w", std::make_shared<nn::ReLU>());
        }).find("register_module(w): Named has a 'w' already") != std::string::npos);
  // A module materialised on its own flat buffers cannot join another tree.
  auto alone = std::make_shared<nn::Linear>(2, 2);
  alone->materialize(Device::cpu(0), 1);
  CHECK(dp_test::error_of([&] {
          named.child("alone", alone);
        }).find("register_module(alone): the Linear is materialised already") != std::string::npos);
}

TEST_CASE(
    "nn.autograd: a layer on its own output, a Var past its tape, another module's parameter") {
  Mix m;
  m.materialize(Device::cpu(0), 3);
  m.set_input_grad(nn::InputGrad::not_needed);
  const Tensor x = rnd({2, 3}, 71);
  // m(m(x)) replays into the tensors it reads: the input is copied first. Before, it gave
  // another value than m(copy of m(x)).
  const std::vector<float> want = m.forward(m.forward(x).clone()).to_host_f32();
  CHECK(m.forward(m.forward(x)).to_host_f32() == want);
  // A reshape of the last input is a view, which no op writes: the same input again is not
  // copied (the output is still a view of it).
  Flat flat;
  flat.materialize(Device::cpu(0), 8);
  flat.set_input_grad(nn::InputGrad::not_needed);
  for (int call = 0; call < 2; ++call) CHECK(flat.forward(x).same_storage(x));
  // A Var kept past its forward, after the layer freed its tapes (9 input shapes): refused,
  // where it read freed memory.
  m.forward(rnd({1, 3}, 72));
  const ag::Var first = m.kept;
  for (int64_t rows = 3; rows <= 10; ++rows) m.forward(rnd({rows, 3}, 73));
  CHECK(dp_test::error_of([&] {
          (void)first.dim(0);
        }).find("a Var of a forward whose tape is gone") != std::string::npos);
  // Past 8 shapes the tape used longest ago goes, not every one (a hostile pass: a shape used
  // every other call re-recorded beside shapes seen once): the busy shape's tape lives on.
  m.forward(rnd({21, 3}, 74));
  const ag::Var busy = m.kept;
  for (int64_t rows = 11; rows <= 20; ++rows) {
    m.forward(rnd({rows, 3}, 75));
    m.forward(rnd({21, 3}, 76));
  }
  CHECK(busy.dim(0) == 21);
  // param() of a parameter this layer does not hold: refused, where its gradient went into
  // the other module's buffer and no optimizer of this model saw it.
  Mix other;
  other.materialize(Device::cpu(0), 4);
  Mix taker;
  taker.materialize(Device::cpu(0), 5);
  taker.foreign = other.named_parameters()[0].second;
  CHECK(dp_test::error_of([&] {
          taker.forward(x);
        }).find("Mix::param(w): not a parameter of this layer or its children") !=
        std::string::npos);
  // An op's refusal names the layer and its input (the op alone names only shapes).
  nn::ComposedAttention attention(8, 2, 1, 4);
  attention.materialize(Device::cpu(0), 6);
  CHECK(dp_test::error_of([&] {
          attention.forward(rnd({1, 5, 8}, 74));
        }).find("ComposedAttention(8, context 4): input [1, 5, 8] must be (B, T <= 4, 8)") !=
        std::string::npos);
  nn::ComposedRMSNorm norm(4);
  norm.materialize(Device::cpu(0), 7);
  CHECK(dp_test::error_of([&] {
          norm.forward(rnd({2, 1}, 75));
        }).find("ComposedRMSNorm(4): input [2, 1] must be (..., 4)") != std::string::npos);
  class Narrow : public nn::Composed {
   public:
    int64_t start = 0;
    std::string type_name() const override { return "Narrow"; }

   protected:
    ag::Var compose(const ag::Var& x) override { return ag::narrow(x, 1, start, 2); }
    std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Narrow>(); }
  };
  Narrow narrow;
  narrow.materialize(Device::cpu(0), 1);
  narrow.start = 3;
  CHECK(dp_test::error_of([&] {
          narrow.forward(rnd({2, 4}, 76));
        }).find("Narrow::compose, input [2, 4]: narrow: start 3, length 2 along dim 1") !=
        std::string::npos);
  // start + length past int64: refused, where it overflowed the check and corrupted the heap.
  narrow.start = std::numeric_limits<int64_t>::max();
  CHECK(dp_test::error_of([&] {
          narrow.forward(rnd({2, 5}, 77));
        }).find("narrow: start 9223372036854775807, length 2") != std::string::npos);
}

TEST_CASE("nn.autograd: call() sets its child's input gradient per tape, gradcheck without dx") {
  // Before: a tape recorded without an input gradient left the child at not_needed, and a
  // later tape that needs one got none ("reshape: [] has 0 elements").
  Outer outer;
  outer.materialize(Device::cpu(0), 8);
  const Tensor x = rnd({3, 2}, 81), dy = rnd({3, 2}, 82);
  outer.set_input_grad(nn::InputGrad::not_needed);
  CHECK(run(outer, x, dy).dx.empty());
  outer.set_input_grad(nn::InputGrad::needed);
  const Pass needed = run(outer, x, dy);
  CHECK(needed.dx.size() == 6);
  outer.set_input_grad(nn::InputGrad::not_needed);
  CHECK(run(outer, x, dy).dx.empty());  // the first tape, replayed
  outer.set_input_grad(nn::InputGrad::needed);
  CHECK(run(outer, x, dy).dx == needed.dx);  // the second, replayed
  // gradcheck of a layer that returns no input gradient: its parameters with CheckInput::no;
  // with CheckInput::yes, a message saying so (it read an undefined tensor).
  outer.set_input_grad(nn::InputGrad::not_needed);
  nn::GradcheckOptions o;
  o.check_input = nn::CheckInput::no;
  const nn::GradcheckResult r = nn::gradcheck(outer, x, o);
  CHECK_MESSAGE(r.ok, r.message);
  CHECK(dp_test::error_of([&] { nn::gradcheck(outer, x); }).find("returned no input gradient") !=
        std::string::npos);
}

TEST_CASE("nn.autograd: zero-size dims, pow(x, 0) at 0, MSE's target shape, set_lr") {
  class Zero : public nn::Composed {
   public:
    std::string type_name() const override { return "Zero"; }

   protected:
    ag::Var compose(const ag::Var& x) override {
      // x (2, 4): an empty narrow, an empty part in cat, a matmul with K = 0 (zeros).
      const ag::Var empty = ag::narrow(x, 1, 1, 0);                                       // (2, 0)
      const ag::Var joined = ag::cat({empty, x}, 1);                                      // (2, 4)
      const ag::Var k0 = ag::matmul(empty, ag::narrow(ag::transpose(x, 0, 1), 0, 0, 0));  // (2, 2)
      return joined + ag::sum(k0, 1, ag::keepdim) + ag::pow(x, 0.f);
    }
    std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Zero>(); }
  };
  Zero z;
  z.materialize(Device::cpu(0), 1);
  Tensor x = Tensor::from_vector({0.f, 1.f, -2.f, 0.f, 3.f, 0.f, 0.5f, 4.f}, {2, 4});
  const Pass p = run(z, x, Tensor::from_vector(std::vector<float>(8, 1.f), {2, 4}));
  const std::vector<float> xs = x.to_host_f32();
  for (size_t i = 0; i < 8; ++i) {
    CHECK(p.y[i] == xs[i] + 1.f);  // x^0 = 1, the K = 0 product 0
    CHECK(p.dx[i] == 1.f);         // d x^0 / dx = 0 at x = 0 too (it was NaN), plus 1
  }
  // MSE in the engines' path: a target of the same size in another shape is refused (it was
  // paired element by element); (B, 1) against (B) is taken.
  nn::MSELoss mse;
  Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(0)),
         d = Tensor::empty({2, 3}, DType::f32, Device::cpu(0));
  const Tensor pred = rnd({2, 3}, 91);
  CHECK(dp_test::error_of([&] {
          mse.compute(loss, d, pred, rnd({3, 2}, 92));
        }).find("mse: pred [2, 3] and target [3, 2] differ in shape") != std::string::npos);
  Tensor d1 = Tensor::empty({4, 1}, DType::f32, Device::cpu(0));
  mse.compute(loss, d1, rnd({4, 1}, 93), rnd({4}, 94));
  // set_lr as the constructors: a NaN or negative rate is refused, where it trained on.
  Mix m;
  m.materialize(Device::cpu(0), 1);
  nn::AdamW adamw(m, kernels::AdamWConfig{});
  CHECK(dp_test::error_of([&] { adamw.set_lr(std::nanf("")); }).find("set_lr(nan)") !=
        std::string::npos);
  CHECK(dp_test::error_of([&] { adamw.set_lr(-1.f); }).find("a learning rate is finite and >= 0") !=
        std::string::npos);
  adamw.set_lr(0.f);
}

namespace {

// A language model's tied head: the child head's weight is read again through param() as the
// embedding table, so its gradient is complete only after this layer's whole backward.
class TiedLm : public nn::Composed {
 public:
  TiedLm() : head_(register_module("head", std::make_shared<nn::Linear>(4, 6, nn::Bias::no))) {}
  std::string type_name() const override { return "TiedLm"; }
  bool call_head = true;  // false: the head's weight only through param(), no call()

 protected:
  ag::Var compose(const ag::Var& ids) override {
    const ag::Var h = ag::tanh(ag::embedding(param(head_->weight()), ids)) * 3.f;  // (B, T, 4)
    return call_head ? ag::call(*head_, h) : ag::linear(h, param(head_->weight()));
  }
  std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<TiedLm>(); }

 private:
  std::shared_ptr<nn::Linear> head_;
};

// Refuses inputs of 9 or more rows in compose(), as a layer's own shape check would.
class Picky : public nn::Composed {
 public:
  Picky() : w_(register_parameter("w", {3, 3}, nn::InitSpec::normal(0.5f))) {}
  std::string type_name() const override { return "Picky"; }
  float scale = 1.f;  // a host number compose() reads

 protected:
  ag::Var compose(const ag::Var& x) override {
    DP_CHECK(x.dim(0) < 9, "Picky: " << x.dim(0) << " rows");
    return ag::linear(x, param(w_)) * scale;
  }
  std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Picky>(); }

 private:
  nn::Parameter& w_;
};

// Embeds ids with one of its two tables (f32 reads: ag::embedding), then maps them back through
// `b` as a GEMM operand (its 16-bit copy under mixed precision).
class TwoTables : public nn::Composed {
 public:
  TwoTables()
      : a_(register_parameter("a", {6, 4}, nn::InitSpec::normal(0.5f))),
        b_(register_parameter("b", {6, 4}, nn::InitSpec::normal(0.5f))) {}
  std::string type_name() const override { return "TwoTables"; }
  bool embed_b = false;  // a host value compose() reads: a new shape records with it

 protected:
  ag::Var compose(const ag::Var& ids) override {
    return ag::linear(ag::embedding(param(embed_b ? b_ : a_), ids), param(b_));
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<TwoTables>();
  }

 private:
  nn::Parameter& a_;
  nn::Parameter& b_;
};

// Embeds ids (values < 3) with its child's weight (f32) for chunks of 2 rows, else with its own
// table, then runs the child: the child's weight is read as f32 by one of its parent's tapes.
class ParentReads : public nn::Composed {
 public:
  ParentReads()
      : t_(register_parameter("t", {3, 3}, nn::InitSpec::normal(0.5f))),
        child_(register_module("child", std::make_shared<Picky>())) {}
  std::string type_name() const override { return "ParentReads"; }
  nn::Parameter& child_weight() { return *child_->named_parameters().at(0).second; }

 protected:
  ag::Var compose(const ag::Var& ids) override {
    const ag::Var h = ag::embedding(param(ids.dim(0) == 2 ? child_weight() : t_), ids);
    return ag::call(*child_, h);
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<ParentReads>();
  }

 private:
  nn::Parameter& t_;
  std::shared_ptr<Picky> child_;
};

}  // namespace

// A hostile pass found the hook of a tied weight fired after the child's backward, before the
// composed layer added the embedding's share: DP's and DDP's buckets sent it incomplete (DP on 2
// devices drifted from 1 by 2e-3, differently each run). The hook is held until the layer's
// backward is done; a child's weight read only through param() now fires too (it never did).
// (DP's 1 against 2 devices: dp.tied in test_dp.cpp.)
TEST_CASE("nn.autograd: a tied weight's hook fires once its gradient is complete") {
  for (const bool call_head : {true, false}) {
    CAPTURE(call_head);
    TiedLm m;
    m.call_head = call_head;
    m.materialize(Device::cpu(0), 7);
    const nn::Parameter* w = m.named_parameters().at(0).second;
    std::vector<std::vector<float>> at_hook;
    m.flat().on_grad_ready = [&](const nn::Parameter& p) {
      CHECK(&p == w);
      at_hook.push_back(p.grad.to_host_f32());
    };
    const Tensor ids = Tensor::from_ints({0, 5, 2, 3, 1, 4}, {2, 3});
    m.zero_grad();
    const Tensor y = m.forward(ids);
    m.backward(rnd(y.shape(), 81));
    REQUIRE(at_hook.size() == 1);  // once, and only once
    CHECK(at_hook[0] == w->grad.to_host_f32());
  }
}

// A composed layer's own parameters that no op reads as f32 are read through the bf16 copy alone
// (nn::Parameter::read_through_copy: a DP replica that takes device 0's copy is not sent their f32
// values); one that ag::embedding reads as f32 is not, nor is a child's weight read so (a tied
// head). A flag that changes says so once (FlatState::copy_reads_version: DP plans its copies
// again; its graphs, which replicas' copies run outside of, are not captured again); a
// replica whose f32 weights are partly stale refuses a forward that reads a stale one as f32,
// naming it.
TEST_CASE("nn.autograd: a composed layer marks the weights it reads through the bf16 copy alone") {
  const Tensor ids = Tensor::from_ints({0, 5, 2, 3, 1, 4}, {2, 3});
  const Tensor ids1 = Tensor::from_ints({0, 5, 2}, {1, 3});
  {
    Picky m;
    m.materialize(Device::cpu(0), 5);
    m.set_compute_dtype(DType::bf16);
    const nn::Parameter& w = *m.named_parameters().at(0).second;
    CHECK_FALSE(w.read_through_copy);
    const uint64_t v0 = m.flat().copy_reads_version, h0 = m.flat().host_values_version;
    m.forward(rnd({2, 3}, 1));
    CHECK(w.read_through_copy);
    CHECK(m.flat().copy_reads_version == v0 + 1);
    m.forward(rnd({4, 3}, 2));  // another tape: nothing changes, nothing said
    CHECK(m.flat().copy_reads_version == v0 + 1);
    CHECK(m.flat().host_values_version == h0);
  }
  {
    TwoTables m;
    m.materialize(Device::cpu(0), 6);
    m.set_compute_dtype(DType::bf16);
    const nn::Parameter& a = *m.named_parameters().at(0).second;
    const nn::Parameter& b = *m.named_parameters().at(1).second;
    m.forward(ids);
    CHECK_FALSE(a.read_through_copy);  // the table read as f32
    CHECK(b.read_through_copy);        // the GEMM operand
    const uint64_t v = m.flat().copy_reads_version;
    m.embed_b = true;
    m.forward(ids1);  // a new shape reads b as f32 too: unmarked for good
    CHECK_FALSE(b.read_through_copy);
    CHECK(m.flat().copy_reads_version == v + 1);
    m.embed_b = false;
    m.forward(Tensor::from_ints({1, 2}, {1, 2}));
    CHECK_FALSE(b.read_through_copy);
    CHECK_FALSE(a.read_through_copy);
  }
  {
    // A DP replica sent, of the f32 weights, all but b's (FlatState::stale_runs) refuses a
    // forward that reads b as f32, recorded or replayed, naming the layer, the input and the
    // weight; one that reads only a as f32 runs, and so does one with a alone stale.
    TwoTables m;
    m.materialize(Device::cpu(0), 6);
    m.set_compute_dtype(DType::bf16);
    const nn::Parameter& a = *m.named_parameters().at(0).second;
    const nn::Parameter& b = *m.named_parameters().at(1).second;
    m.forward(ids);  // records with a read as f32
    m.embed_b = true;
    m.forward(ids1);  // records with b read as f32
    auto as_replica = [&](const nn::Parameter& stale) {
      // As DP's replicate leaves it: the copy taken, fresh.
      m.flat().stale_runs = {{stale.offset, stale.offset + stale.numel()}};
      m.flat().compute_written = true;
    };
    const Tensor ids2 = Tensor::from_ints({1, 2}, {1, 2});
    for (const Tensor* in : {&ids1, &ids2}) {  // a replay, a recording
      CAPTURE(in->shape()[1]);
      as_replica(b);
      const std::string e = dp_test::error_of([&] { m.forward(*in); });
      CHECK(e.find("TwoTables::compose, input " + kernels::shape_str(in->shape()) +
                   ": reads b as f32, which this DP replica was not sent") != std::string::npos);
      CHECK(e.find("read_through_copy") != std::string::npos);
    }
    as_replica(b);
    m.embed_b = false;
    CHECK_NOTHROW(m.forward(ids));  // reads a as f32, b through the copy
    as_replica(a);
    m.embed_b = true;
    CHECK_NOTHROW(m.forward(ids1));
    m.flat().stale_runs.clear();
  }
  {
    // A child composed layer marks its weight; its parent reads it as f32 for one shape: it stays
    // unmarked when the child records again for another shape (read_as_f32 is for good).
    ParentReads m;
    m.materialize(Device::cpu(0), 8);
    m.set_compute_dtype(DType::bf16);
    const nn::Parameter& w = m.child_weight();
    m.forward(Tensor::from_ints({0, 2, 1, 1, 0, 2}, {2, 3}));
    CHECK_FALSE(w.read_through_copy);
    CHECK(w.read_as_f32);
    m.forward(Tensor::from_ints({1, 0, 2}, {1, 3}));  // the child records again, the parent
    CHECK_FALSE(w.read_through_copy);                 // reads its own table
  }
  {
    // The tied head: Linear marks its weight; the composed layer reads it as the embedding's
    // table (f32), so it is unmarked, whether the head runs by call() or by param().
    for (const bool call_head : {true, false}) {
      CAPTURE(call_head);
      TiedLm m;
      m.call_head = call_head;
      m.materialize(Device::cpu(0), 7);
      m.set_compute_dtype(DType::bf16);
      const nn::Parameter& w = *m.named_parameters().at(0).second;
      CHECK(w.read_through_copy);
      m.forward(ids);
      CHECK_FALSE(w.read_through_copy);
    }
  }
}

// A compose() that throws for a new shape left the backward pointing at a freed tape (ASan:
// heap-use-after-free; without it, a bad device index or bad_alloc). Now the backward refuses.
TEST_CASE(
    "nn.autograd: a backward after a forward that threw is refused, not run on a freed tape") {
  Picky m;
  m.materialize(Device::cpu(0), 5);
  for (int64_t rows = 1; rows <= 8; ++rows) m.forward(rnd({rows, 3}, 90 + rows));  // 8 tapes
  CHECK(dp_test::error_of([&] {
          m.forward(rnd({9, 3}, 99));
        }).find("Picky: 9 rows") != std::string::npos);
  CHECK(dp_test::error_of([&] {
          m.backward(rnd({8, 3}, 98));
        }).find("Picky::backward with no forward to go back through") != std::string::npos);
  // A forward that works makes the backward work again.
  m.forward(rnd({2, 3}, 97));
  CHECK_NOTHROW(m.backward(rnd({2, 3}, 96)));
  // A host number compose() reads is part of the tape; forget_tapes() records it again.
  const Tensor x = rnd({2, 3}, 95);
  const std::vector<float> y1 = m.forward(x).to_host_f32();
  m.scale = 10.f;
  CHECK(m.forward(x).to_host_f32() == y1);  // the recorded value
  m.forget_tapes();
  const std::vector<float> y10 = m.forward(x).to_host_f32();
  for (size_t i = 0; i < y1.size(); ++i) CHECK(y10[i] == doctest::Approx(10 * y1[i]));
}

TEST_CASE("nn.autograd: call() of a module that is not a registered child is refused") {
  class Stray : public nn::Composed {
   public:
    std::shared_ptr<nn::Linear> outside = std::make_shared<nn::Linear>(3, 3);
    std::string type_name() const override { return "Stray"; }

   protected:
    ag::Var compose(const ag::Var& x) override { return ag::call(*outside, x); }
    std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Stray>(); }
  };
  Stray m;
  m.materialize(Device::cpu(0), 1);
  m.outside->materialize(Device::cpu(0), 2);
  CHECK(dp_test::error_of([&] {
          m.forward(rnd({2, 3}, 1));
        }).find("call: Linear is not a registered child of Stray") != std::string::npos);
}

// An optimizer, zero_grad() or a checkpoint given a part of a model acted on the whole flat
// buffer: SGD on the head moved the body too.
TEST_CASE("nn.module: a part of a model gets its own zero_grad, and no whole-model optimizer") {
  auto body = std::make_shared<nn::Linear>(3, 3), head = std::make_shared<nn::Linear>(3, 2);
  nn::Sequential net{body, head};
  net.materialize(Device::cpu(0), 3);
  kernels::fill(net.flat_grads(), 1.f);
  head->zero_grad();  // the head's gradients only
  for (const float g : body->weight().grad.to_host_f32()) CHECK(g == 1.f);
  for (const float g : head->weight().grad.to_host_f32()) CHECK(g == 0.f);
  CHECK(dp_test::error_of([&] {
          nn::SGD opt(*head, kernels::SgdConfig{0.1f});
        }).find("an optimizer: Linear is a part of a larger model") != std::string::npos);
  CHECK(dp_test::error_of([&] {
          nn::save_checkpoint(*head, dp_test::temp_path("nn", "part.ckpt"));
        }).find("save_checkpoint: Linear is a part of a larger model") != std::string::npos);
  CHECK_NOTHROW(nn::SGD(net, kernels::SgdConfig{0.1f}));
  // GroupedAdamW refuses an infinite group setting (inf turned the weights into NaN).
  nn::ParamGroups groups = nn::decay_by_parameter(net, 0.1f);
  groups.groups[0].lr_scale = std::numeric_limits<float>::infinity();
  CHECK(dp_test::error_of([&] {
          nn::GroupedAdamW opt(net, kernels::AdamWConfig{}, groups);
        }).find("both must be finite and >= 0") != std::string::npos);
}

TEST_CASE("nn.module: a dotted name that meets a child's path is refused at materialize") {
  class Dotted : public nn::Module {
   public:
    Dotted() {
      register_module("lin", std::make_shared<nn::Linear>(2, 2));
      register_parameter("lin.weight", {2, 2}, nn::InitSpec::constant(0.f));
    }
    std::string type_name() const override { return "Dotted"; }

   protected:
    Tensor forward_impl(const Tensor& x) override { return x; }
    Tensor backward_impl(const Tensor& dy) override { return dy; }
    std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Dotted>(); }
  };
  Dotted m;
  CHECK(dp_test::error_of([&] {
          m.materialize(Device::cpu(0), 1);
        }).find("two tensors share the path 'lin.weight'") != std::string::npos);
  // A shape past int64 wrapped to 0 elements; refused, and an empty one stays empty.
  CHECK(dp_test::error_of([&] {
          Tensor::empty({int64_t(1) << 32, int64_t(1) << 32}, DType::f32, Device::cpu(0));
        }).find("has more elements than an int64 counts") != std::string::npos);
  CHECK(shape_numel({int64_t(1) << 62, int64_t(1) << 62, 0}) == 0);
}

// A hand-written layer that runs one child twice kept the second call's state for both
// backwards: the first call's weight gradient was computed from the second call's input.
TEST_CASE("nn.module: a module called twice in one step is refused at its second backward") {
  class Twice : public nn::Module {
   public:
    Twice() { lin_ = register_module("lin", std::make_shared<nn::Linear>(3, 3)); }
    std::string type_name() const override { return "Twice"; }

   protected:
    Tensor forward_impl(const Tensor& x) override { return lin_->forward(lin_->forward(x)); }
    Tensor backward_impl(const Tensor& dy) override { return lin_->backward(lin_->backward(dy)); }
    std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Twice>(); }

   private:
    std::shared_ptr<nn::Linear> lin_;
  };
  Twice m;
  m.materialize(Device::cpu(0), 4);
  const Tensor x = rnd({2, 3}, 7);
  Tensor y = m.forward(x);
  CHECK(dp_test::error_of([&] {
          m.backward(y);
        }).find("Linear::backward a second time through one forward") != std::string::npos);
  // The usual step, and one that runs forward again (a validation pass) before its backward.
  nn::Linear lin(3, 3);
  lin.materialize(Device::cpu(0), 4);
  CHECK(dp_test::error_of([&] {
          lin.backward(x);
        }).find("Linear::backward with no forward to go back through") != std::string::npos);
  for (int step = 0; step < 2; ++step) {
    lin.forward(x);
    Tensor out = lin.forward(x);
    CHECK_NOTHROW(lin.backward(out));
  }
  CHECK(dp_test::error_of([&] {
          lin.backward(x);
        }).find("Linear::backward a second time through one forward") != std::string::npos);
}

// gradcheck passed a 14% wrong gradient at eps 1e-6 ("max error 0"): its allowance for the
// loss's f32 rounding grows as 1/eps. Past tolerance x the largest gradient it cannot tell, and
// says so; a step that rounds away, and a 16-bit layer, are refused with what to do.
TEST_CASE("nn.gradcheck: an eps too small to tell, one that rounds away, and 16-bit are refused") {
  nn::Linear lin(64, 64);
  lin.materialize(Device::cpu(0), 3);
  const Tensor x = rnd({64, 64}, 5, -3.f, 3.f);
  nn::GradcheckOptions o;
  CHECK(nn::gradcheck(lin, x, o).ok);  // the default eps tells
  o.eps = 1e-6f;
  const nn::GradcheckResult small = nn::gradcheck(lin, x, o);
  CHECK_FALSE(small.ok);
  CHECK(small.message.find("cannot tell: the loss's f32 rounding allows differences of") !=
        std::string::npos);
  nn::Linear big(1, 1);
  big.materialize(Device::cpu(0), 3);
  kernels::fill(big.flat_params(), 3000.f);
  o.eps = 1e-4f;
  CHECK(dp_test::error_of([&] {
          nn::gradcheck(big, rnd({2, 1}, 6), o);
        }).find("eps 0.0001 is below the f32 spacing at weight[0] = 3000") != std::string::npos);
  lin.set_compute_dtype(DType::bf16);
  CHECK(dp_test::error_of([&] {
          nn::gradcheck(lin, x);
        }).find("gradcheck: Linear computes in bf16") != std::string::npos);
}
