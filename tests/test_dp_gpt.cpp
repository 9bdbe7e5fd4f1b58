// A GPT in bf16 with bf16 activations trained by DP on cuda:0, where its GPU paths run (the
// GEMMs' bias, GELU and bias-gradient epilogues, cuDNN's attention, the eight-wide LayerNorm,
// loss and optimizer kernels, the loss's gradient written over the logits), against the same
// run on cpu:0, where the same ops run in turn: 20 steps within the bf16 bound, and the graphed
// steps bit for bit the uncaptured ones (skips without a GPU: the GPU run's tests part runs it).
// On cpu:0 the same run graphed (Graphs::on) gives the uncaptured bits too, and learns.
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dp/data_parallel.hpp"
#include "nn/nn.hpp"
#include "tests/train_util.hpp"

using namespace kernels;

namespace {

constexpr uint64_t kSeed = 31;
constexpr int kSteps = 20;
// How far two runs of the same bf16 model that round their activations their own way (DP's
// chunks, the GPU's sums in another order) may lie apart over the 20 steps, relatively: each
// step's loss and gradient norm (means and sums over thousands of values, which average the
// single roundings of 2^-8), and the weights, which AdamW moves by up to about lr a step
// whatever the gradient's size, so that a near-zero gradient rounded otherwise moves its weight
// the other way. Two CPU devices against one: 9.7e-5, 2.8e-4 and 1.4e-2 (2026-12-01); the
// bounds are 35 to 100 times the first two and 7 times the third. A wrong epilogue, bias,
// norm or loss kernel moves the loss or the norm by its whole size.
constexpr double kLossGap = 1e-2, kNormGap = 1e-2, kWeightGap = 0.1;

// Every width a multiple of 8 (the eight-wide kernels and the GELU epilogue's rule): vocabulary
// 64, width 32, heads of 16, the MLP 128 wide.
nn::GptConfig small_gpt() {
  nn::GptConfig c;
  c.vocab = 64, c.context = 16, c.layers = 2, c.heads = 2, c.dim = 32;
  return c;
}

// Step s: ids (8, 16) and next-token targets, a few of them ignored (-1), other rows each step.
std::pair<Tensor, Tensor> tokens(int s) {
  const int64_t batch = 8, t = 16;
  std::vector<int32_t> ids(static_cast<size_t>(batch * t)), tg(ids.size());
  for (int64_t i = 0; i < batch * t; ++i) {
    ids[i] = static_cast<int32_t>((i * 7 + s * 5 + i / 9) % 64);
    tg[i] = ids[i];  // learnable at once: the tied head already leans to the id
    if ((i / t + s) % 4 == 0 && i % t >= 12) tg[i] = -1;
  }
  return {Tensor::from_ints(ids, {batch, t}), Tensor::from_ints(tg, {batch, t})};
}

struct Run {
  std::vector<float> losses, norms, params;
  std::vector<dp::StepStats> stats;
  // Elements of the parameters read only through the bf16 copy (nn::Parameter::
  // read_through_copy) after the run: the f32 ones a replica that took the copy is not sent. Of
  // them, the norms' weights (named *norm.weight). And the flat elements not sent: those, with
  // the padding between two of them.
  int64_t read_through_copy = 0, norms_through_copy = 0, not_sent = 0;
};

// DP on `devices` (one device: the single-device run) of the GPT `make` gives, the gradient's
// norm reported (a clip far above it: never applied). `before` (if any) is called with the
// engine's module before each step.
Run train(
    const std::vector<Device>& devices, dp::Graphs graphs,
    const std::function<nn::ModulePtr()>& make = [] { return nn::gpt(small_gpt()); },
    int steps = kSteps, const std::function<void(nn::Module&, int)>& before = nullptr,
    int micro_batches = 1) {
  auto m = make();
  m->materialize(devices[0], kSeed);
  m->set_compute_dtype(DType::bf16);
  m->set_activations(nn::Activations::compute);
  AdamWConfig cfg;
  cfg.lr = 3e-3f;
  nn::AdamW opt(*m, cfg);
  dp::DataParallelOptions o;
  o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
  o.precision = nn::Precision::bf16;
  o.graphs = graphs;
  o.clip_grad_norm = 1e6f;
  o.micro_batches = micro_batches;
  dp::DataParallel engine(m, opt, devices, o);
  Run run;
  for (int s = 0; s < steps; ++s) {
    if (before) before(engine.module(), s);
    auto [x, y] = tokens(s);
    run.stats.push_back(engine.train_step(x, y));
    run.losses.push_back(run.stats.back().loss);
    run.norms.push_back(run.stats.back().grad_norm);
  }
  run.params = engine.module().flat_params().to_host_f32();
  int64_t end = 0;  // of the last parameter, when it was read through the copy
  for (const auto& [name, p] : engine.module().named_parameters()) {
    if (p->numel() == 0) continue;
    run.not_sent += p->read_through_copy ? p->numel() + (end > 0 ? p->offset - end : 0) : 0;
    end = p->read_through_copy ? p->offset + p->numel() : 0;
  }
  for (const auto& [name, p] : engine.module().named_parameters())
    if (p->read_through_copy) {
      run.read_through_copy += p->numel();
      const std::string tail = "norm.weight";
      if (name.size() >= tail.size() &&
          name.compare(name.size() - tail.size(), tail.size(), tail) == 0)
        run.norms_through_copy += p->numel();
    }
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The largest relative gap between two runs' values, step by step.
double worst_gap(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t s = 0; s < a.size(); ++s)
    worst = std::max(worst, std::fabs(static_cast<double>(a[s]) - b[s]) / std::fabs(b[s]));
  return worst;
}

// Graphed from the third step with no allocation and one host wait a step, and then the
// uncaptured steps' bits.
void check_graphed(const Run& graphed, const Run& eager) {
  for (int s = 0; s < kSteps; ++s) {
    CAPTURE(s);
    CHECK(graphed.stats[s].graphed == (s >= 2));
    if (s >= 3) {
      CHECK(graphed.stats[s].allocations == 0);
      CHECK(graphed.stats[s].host_syncs == 1);
    }
  }
  CHECK(same_bits(graphed.losses, eager.losses));
  CHECK(same_bits(graphed.norms, eager.norms));
  CHECK(same_bits(graphed.params, eager.params));
}

}  // namespace

TEST_CASE(
    "dp.graphs: a bf16 GPT with bf16 activations graphed on cpu:0 gives the uncaptured bits") {
  const Run eager = train({Device::cpu(0)}, dp::Graphs::off);
  check_graphed(train({Device::cpu(0)}, dp::Graphs::on), eager);
  CHECK(eager.losses.back() < 0.9f * eager.losses.front());  // it learns the copy
  // Two devices round their chunks' activations their own way: the scale of the gaps the CUDA
  // case below allows between the GPU and the CPU.
  const Run two = train(make_devices(DeviceType::cpu, 2), dp::Graphs::off);
  CHECK(worst_gap(two.losses, eager.losses) <= kLossGap);
  CHECK(worst_gap(two.norms, eager.norms) <= kNormGap);
  CHECK(dp_test::rel_diff(two.params, eager.params) <= kWeightGap);
  MESSAGE("cpu:0 losses " << eager.losses.front() << " -> " << eager.losses.back()
                          << "; 2 devices against 1: losses " << worst_gap(two.losses, eager.losses)
                          << ", norms " << worst_gap(two.norms, eager.norms) << ", weights "
                          << dp_test::rel_diff(two.params, eager.params));
}

TEST_CASE(
    "dp.cuda: a bf16 GPT's fused GPU step follows the CPU's ops over 20 steps, graphs exact") {
  DP_REQUIRE_GPU();
  const Run cpu = train({Device::cpu(0)}, dp::Graphs::off);
  const Run eager = train({Device::cuda(0)}, dp::Graphs::off);
  check_graphed(train({Device::cuda(0)}, dp::Graphs::automatic), eager);
  for (int s = 0; s < kSteps; ++s) {
    CAPTURE(s);
    REQUIRE(std::isfinite(eager.losses[s]));
    REQUIRE(std::isfinite(eager.norms[s]));
  }
  const double losses = worst_gap(eager.losses, cpu.losses),
               norms = worst_gap(eager.norms, cpu.norms);
  const float weights = dp_test::rel_diff(eager.params, cpu.params);
  CHECK(losses <= kLossGap);
  CHECK(norms <= kNormGap);
  CHECK(weights <= kWeightGap);
  CHECK(eager.losses.back() < 0.9f * eager.losses.front());  // it learns the copy
  MESSAGE("cuda:0 against cpu:0 over " << kSteps << " steps: losses " << losses << ", norms "
                                       << norms << ", weights " << weights);
}

// Through DP on 3 devices (replicas cloned from device 0; 8 rows: uneven chunks), graphed and
// not: the plain model's bits, graphed from the third step as the plain one (the runs again
// captured with the step).
TEST_CASE("dp.recompute: checkpointed blocks through DP, graphed and not, give the plain bits") {
  auto gpt = [](bool recompute) {
    return [recompute] {
      nn::GptConfig c = small_gpt();
      c.dropout = 0.1f;  // a run again that drew other counters would change the bits
      c.recompute = recompute;
      return nn::gpt(c);
    };
  };
  const std::vector<Device> three{Device::cpu(0), Device::cpu(1), Device::cpu(2)};
  auto run = [&](bool recompute, dp::Graphs graphs) {
    return train(three, graphs, gpt(recompute), 5);
  };
  const Run plain = run(false, dp::Graphs::off);
  for (dp::Graphs g : {dp::Graphs::off, dp::Graphs::on}) {
    CAPTURE(g == dp::Graphs::on);
    const Run ckpt = run(true, g);
    CHECK(same_bits(ckpt.losses, plain.losses));
    CHECK(same_bits(ckpt.params, plain.params));
    for (size_t s = 0; s < ckpt.stats.size(); ++s) {
      CAPTURE(s);
      CHECK(ckpt.stats[s].graphed == (g == dp::Graphs::on && s >= 2));
      // The runs again are captured with the step: a replay takes no memory.
      if (g == dp::Graphs::on && s >= 3) CHECK(ckpt.stats[s].allocations == 0);
    }
  }
}

// Device 0's optimizer step writes its bf16 weights (Optimizer::writes_compute_copy), so its
// forward, uncaptured or captured, casts none. Weights written between steps (reinitialize, as
// a loaded checkpoint) are read by the next step all the same: parameters_changed() makes the
// forward cast again and the engine capture again, so the graphed run keeps the uncaptured bits.
TEST_CASE("dp.compute_copy: weights written between steps are read next step, graphed or not") {
  nn::set_weight_copy_check(true);  // each uncaptured step's copy is the cast's (or it throws)
  const std::vector<Device> two{Device::cpu(0), Device::cpu(1)};
  auto reinit_at_4 = [](nn::Module& m, int s) {
    if (s == 4) m.reinitialize(kSeed + 7);
  };
  auto make = [] { return nn::gpt(small_gpt()); };
  const Run plain = train(two, dp::Graphs::off, make, 7);
  const Run eager = train(two, dp::Graphs::off, make, 7, reinit_at_4);
  const Run graphed = train(two, dp::Graphs::on, make, 7, reinit_at_4);
  CHECK(same_bits(graphed.losses, eager.losses));
  CHECK(same_bits(graphed.params, eager.params));
  for (int s = 0; s < 7; ++s) {
    CAPTURE(s);
    CHECK((eager.losses[s] == plain.losses[s]) == (s < 4));  // the new weights took
    // Captured from the third step, and again two steps after the change.
    CHECK(graphed.stats[s].graphed == (s == 2 || s == 3 || s == 6));
    // Each device casts at the first step and at the one after the change (the replica too:
    // device 0's copy is stale then), and takes a step's written copy otherwise.
    const int64_t casts = s == 0 || s == 4 ? 2 : 0;
    CHECK(eager.stats[s].casts == casts);
    CHECK(graphed.stats[s].casts == casts);
  }
  nn::set_weight_copy_check(false);
}

// Under DP the replicas take device 0's bf16 weights in the replicate phase, as its optimizer's
// step wrote them: after the first step no device casts, graphed or not, on four devices, with
// one micro-batch a device or two (the second forward takes the copy the first made or took).
// The weight-copy check compares each uncaptured forward's copy with the f32 weights rounded (a
// copy not the cast's bits throws), and the graphed run keeps the uncaptured bits. Controls:
// with the replicas casting their own (before 2026-12-04), each step after the first counted 3
// casts; with each micro-batch's forward casting again, 4 more.
TEST_CASE("dp.compute_copy: replicas copy device 0's bf16 weights and cast none") {
  nn::set_weight_copy_check(true);
  const std::vector<Device> four{Device::cpu(0), Device::cpu(1), Device::cpu(2), Device::cpu(3)};
  auto make = [] { return nn::gpt(small_gpt()); };
  for (int micro : {1, 2}) {
    CAPTURE(micro);
    const Run eager = train(four, dp::Graphs::off, make, 6, nullptr, micro);
    const Run graphed = train(four, dp::Graphs::on, make, 6, nullptr, micro);
    // The bf16 copy each replica takes is counted with the bytes moved: none on the first step
    // (each device cast its own), P/2 to each of 3 replicas from the second on, less the f32
    // bytes of the Linear weights, read through the copy alone and then not sent (with the
    // padding between two of them).
    REQUIRE(eager.read_through_copy > 0);
    const int64_t copy_bytes = static_cast<int64_t>(eager.params.size()) * 2 - eager.not_sent * 4;
    const dp::StepStats& first = eager.stats[0];
    for (int s = 0; s < 6; ++s) {
      CAPTURE(s);
      CHECK(eager.stats[s].casts == (s == 0 ? 4 : 0));
      CHECK(graphed.stats[s].casts == (s == 0 ? 4 : 0));
      CHECK(graphed.stats[s].graphed == (s >= 2));
      const int64_t taken = s == 0 ? 0 : copy_bytes;
      for (const Run* run : {&eager, &graphed}) {
        const dp::StepStats& st = run->stats[s];
        CHECK(st.bytes_moved == first.bytes_moved + 3 * taken);
        REQUIRE(st.link_bytes.size() == 4);
        CHECK(st.link_bytes[0] == first.link_bytes[0] + 3 * taken);
        for (int r = 1; r < 4; ++r) CHECK(st.link_bytes[r] == first.link_bytes[r] + taken);
      }
    }
    CHECK(same_bits(graphed.losses, eager.losses));
    CHECK(same_bits(graphed.params, eager.params));
  }
  nn::set_weight_copy_check(false);
}

// Replicas that take device 0's bf16 weights are sent, of the f32 ones, only those read outside
// the copy: the Linear weights' stay stale there (NaN while the debug check is on, so that a
// read of one would show in the losses), and DP on 4 devices follows one device all the same,
// graphed or not, with fused layers and with composed ones (autograd: a composed layer's own
// weights that no op reads as f32 are not sent either; before 2026-12-05 they all were, so the
// composed Llama sent its SwiGLU's f32 weights).
TEST_CASE("dp.compute_copy: replicas take only the f32 weights read outside the bf16 copy") {
  nn::set_weight_copy_check(true);
  auto llama = [](bool composed) {
    return [composed] {
      nn::LlamaConfig c;
      c.vocab = 64, c.context = 16, c.layers = 2, c.heads = 2, c.dim = 32, c.hidden = 64;
      c.composed = composed;
      return nn::llama(c);
    };
  };
  using Make = std::function<nn::ModulePtr()>;
  const std::vector<Device> four{Device::cpu(0), Device::cpu(1), Device::cpu(2), Device::cpu(3)};
  std::map<std::string, std::pair<int64_t, int64_t>> through;  // elements: all, of norms
  for (const auto& [name, make] :
       {std::pair<const char*, Make>{"gpt", [] { return nn::gpt(small_gpt()); }},
        {"llama", llama(false)},
        {"composed llama", llama(true)}}) {
    CAPTURE(name);
    const Run one = train({Device::cpu(0)}, dp::Graphs::off, make, 5);
    for (dp::Graphs graphs : {dp::Graphs::off, dp::Graphs::on}) {
      CAPTURE(graphs == dp::Graphs::on);
      const Run dp4 = train(four, graphs, make, 5);
      REQUIRE(dp4.read_through_copy > 0);
      for (float loss : dp4.losses) CHECK(std::isfinite(loss));
      CHECK(worst_gap(dp4.losses, one.losses) <= kLossGap);
      CHECK(dp_test::rel_diff(dp4.params, one.params) <= kWeightGap);
      const int64_t sent_less = dp4.not_sent * 4 - static_cast<int64_t>(dp4.params.size()) * 2;
      for (size_t s = 1; s < dp4.stats.size(); ++s)
        CHECK(dp4.stats[s].bytes_moved == dp4.stats[0].bytes_moved - 3 * sent_less);
      through[name] = {dp4.read_through_copy, dp4.norms_through_copy};
    }
  }
  // The composed Llama reads through the copy what the fused one does (its SwiGLU's matrices,
  // the attention's and the head's) and its RMSNorms' weights besides (a GEMM-free op of the
  // copy), which the fused RMSNorm reads as f32.
  CHECK(through["llama"].second == 0);
  CHECK(through["composed llama"].second == 5 * 32);  // 2 norms a block, 2 blocks, the last
  CHECK(through["composed llama"].first == through["llama"].first + 5 * 32);
  nn::set_weight_copy_check(false);
}

namespace {

// Embeds token ids with table a, or with table b when the chunk has one row, then maps them back
// through b as a GEMM operand: b is read as f32 for one input shape alone.
class RowsTable : public nn::Composed {
 public:
  RowsTable()
      : a_(register_parameter("a", {6, 4}, nn::InitSpec::normal(0.5f))),
        b_(register_parameter("b", {6, 4}, nn::InitSpec::normal(0.5f))) {}
  std::string type_name() const override { return "RowsTable"; }

 protected:
  nn::ag::Var compose(const nn::ag::Var& ids) override {
    return nn::ag::linear(nn::ag::embedding(param(ids.dim(0) == 1 ? b_ : a_), ids), param(b_));
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<RowsTable>();
  }

 private:
  nn::Parameter& a_;
  nn::Parameter& b_;
};

}  // namespace

// Device 0 of two sees chunks of 2 rows, in which b is read through the bf16 copy alone, so the
// replica is not sent b's f32 value; the replica's chunk of 1 row reads it as f32: refused at
// the second step (the first sends every f32 weight), naming the layer, the input and the
// weight, not trained on stale values. With even chunks the same layer trains.
TEST_CASE("dp.compute_copy: a replica's forward that reads a weight it was not sent is refused") {
  for (int64_t rows : {4, 3}) {
    CAPTURE(rows);
    auto m = std::make_shared<RowsTable>();
    m->materialize(Device::cpu(0), kSeed);
    m->set_compute_dtype(DType::bf16);
    AdamWConfig cfg;
    cfg.lr = 1e-2f;
    nn::AdamW opt(*m, cfg);
    dp::DataParallelOptions o;
    o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
    o.precision = nn::Precision::bf16;
    dp::DataParallel engine(m, opt, {Device::cpu(0), Device::cpu(1)}, o);
    std::vector<int32_t> ids(static_cast<size_t>(rows * 5));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 5 + 1) % 6);
    const Tensor x = Tensor::from_ints(ids, {rows, 5}), y = Tensor::from_ints(ids, {rows, 5});
    const dp::StepStats first = engine.train_step(x, y);
    CHECK(std::isfinite(first.loss));
    std::vector<float> losses;
    const std::string e = dp_test::error_of([&] {
      for (int s = 1; s < 3; ++s) losses.push_back(engine.train_step(x, y).loss);
    });
    for (float loss : losses) CHECK(std::isfinite(loss));
    if (rows == 4) {
      CHECK(e == "(no error)");
      CHECK(losses.size() == 2);
    } else {
      CHECK(losses.empty());
      CHECK(e.find("RowsTable::compose, input [1, 5]: reads b as f32, which this DP replica was "
                   "not sent this step") != std::string::npos);
    }
  }
}

// The chunked classifier (GptConfig::loss_chunk, 24 tokens; the vocabulary 512 wide, so that
// the logits weigh in the peak) through DP: one device (128 tokens: 6 chunks), and 2 devices of
// 2 micro-batches each (32 tokens: 24 and 8), graphed and not, against one device holding the
// whole logits. Each token's loss gradient has the same bits, the sums another order: within the
// bf16 bounds; graphed, the uncaptured bits; and the peak lower without the (B, T, V) logits.
TEST_CASE("dp.gpt: the chunked classifier through DP, micro-batches and graphs follows the whole") {
  auto gpt = [](int64_t chunk) {
    return [chunk] {
      nn::GptConfig c = small_gpt();
      c.vocab = 512;
      c.loss_chunk = chunk;
      return nn::gpt(c);
    };
  };
  const Run whole = train({Device::cpu(0)}, dp::Graphs::off, gpt(0));
  const Run one = train({Device::cpu(0)}, dp::Graphs::off, gpt(24));
  const std::vector<Device> two = make_devices(DeviceType::cpu, 2);
  const Run split = train(two, dp::Graphs::off, gpt(24), kSteps, nullptr, 2);
  const Run graphed = train(two, dp::Graphs::on, gpt(24), kSteps, nullptr, 2);
  for (const Run* r : {&one, &split}) {
    CHECK(worst_gap(r->losses, whole.losses) <= kLossGap);
    CHECK(worst_gap(r->norms, whole.norms) <= kNormGap);
    CHECK(dp_test::rel_diff(r->params, whole.params) <= kWeightGap);
  }
  check_graphed(graphed, split);
  CHECK(one.losses.back() < 0.9f * one.losses.front());  // it learns the copy
  CHECK(one.stats.back().peak_bytes < whole.stats.back().peak_bytes);
  MESSAGE("chunked against whole, one device: losses "
          << worst_gap(one.losses, whole.losses) << ", norms " << worst_gap(one.norms, whole.norms)
          << ", weights " << dp_test::rel_diff(one.params, whole.params) << "; peak "
          << one.stats.back().peak_bytes << " against " << whole.stats.back().peak_bytes
          << " bytes; 2 devices of 2 micro-batches: losses "
          << worst_gap(split.losses, whole.losses));
}
