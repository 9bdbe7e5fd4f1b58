// A GPT trained through the engines with the token cross-entropy (nn::Loss): DP on 4 devices
// and DDP on 4 ranks (plain and ZeRO-1) follow one device, on even and uneven batches and with
// ignored tokens, whose chunk shares are their share of the kept tokens; and with gradient
// clipping by global norm (device 0 after the DP reduce, ZeRO-1 from the shards' norms).
#include <cstring>
#include <functional>
#include <thread>

#include "dp/chunks.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/cross_node_group.hpp"
#include "dp/distributed/ddp.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/distributed/zero.hpp"
#include "nn/nn.hpp"
#include "tests/ddp_ranks.hpp"
#include "tests/train_util.hpp"

using namespace kernels;
using ddp_test::run_ranks;

namespace {

constexpr uint64_t kSeed = 27;
constexpr int kSteps = 3;

nn::GptConfig micro() {
  nn::GptConfig c;
  c.vocab = 13, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 16;
  return c;
}

AdamWConfig adamw() {
  AdamWConfig c;
  c.lr = 3e-3f;
  c.weight_decay = 0.1f;
  return c;
}

SgdConfig sgd() {
  SgdConfig c;
  c.lr = 0.5f;
  c.momentum = 0.9f;
  return c;
}

// Step s: ids (B, T) and next-token targets (B, T) with some targets ignored (-1) when asked.
// shift moves the ignored tokens to other rows (chunks' shares of the kept tokens change).
std::pair<Tensor, Tensor> token_batch(int64_t batch, int64_t t, int s, bool with_ignored,
                                      int shift = 0) {
  std::vector<int32_t> ids(static_cast<size_t>(batch * t)), tg(ids.size());
  for (int64_t i = 0; i < batch * t; ++i) {
    ids[i] = static_cast<int32_t>((i * 5 + s * 3 + i / 7) % 13);
    tg[i] = static_cast<int32_t>((i * 3 + s + 1) % 13);
    // Rows differ in how many they ignore, so shares by tokens differ from shares by rows.
    if (with_ignored && (i / t + shift) % 3 == 0 && i % t >= (i / t) % t) tg[i] = -1;
  }
  return {Tensor::from_ints(ids, {batch, t}), Tensor::from_ints(tg, {batch, t})};
}

using MakeModel = std::function<nn::ModulePtr()>;
nn::ModulePtr micro_gpt() {
  return nn::gpt(micro());
}
// A Llama of the same sizes (nn/llama.hpp): RMSNorm, SwiGLU, rotary attention, untied head.
nn::ModulePtr micro_llama() {
  nn::LlamaConfig c;
  c.vocab = 13, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 16, c.hidden = 24;
  return nn::llama(c);
}
// The same Llama with RMSNorm and SwiGLU written with autograd (nn/composed.hpp): the engines
// see layers whose backward is a replayed tape.
nn::ModulePtr micro_composed_llama() {
  nn::LlamaConfig c;
  c.vocab = 13, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 16, c.hidden = 24;
  c.composed = true;
  return nn::llama(c);
}
// The chunked classifier (GptConfig::loss_chunk, LlamaConfig::loss_chunk), 5 tokens a chunk: a
// device's 12 or 6 tokens run as 5, 5, 2 or 5, 1 (dp::queue_forward_and_loss hands the loss to
// the model's forward), against one device's whole logits.
nn::ModulePtr micro_gpt_chunked() {
  nn::GptConfig c = micro();
  c.loss_chunk = 5;
  return nn::gpt(c);
}
nn::ModulePtr micro_llama_chunked() {
  nn::LlamaConfig c;
  c.vocab = 13, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 16, c.hidden = 24;
  c.loss_chunk = 5;
  return nn::llama(c);
}

// One device; with clip > 0 the gradient is clipped to that global norm before each step.
std::vector<float> train_single(int64_t batch, bool ignored, std::vector<float>* losses,
                                float clip = 0.f, std::vector<float>* norms = nullptr,
                                const MakeModel& make = micro_gpt) {
  auto m = make();
  m->materialize(Device::cpu(0), kSeed);
  nn::AdamW opt(*m, adamw());
  nn::TokenCrossEntropyLoss loss_fn;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = token_batch(batch, 6, s, ignored);
    m->zero_grad();
    Tensor out = m->forward(x);
    Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(0));
    Tensor dl = Tensor::empty(out.shape(), DType::f32, Device::cpu(0));
    loss_fn.compute(loss, dl, out, y);
    m->backward(dl);
    if (clip > 0.f) norms->push_back(nn::clip_grad_norm(m->flat_grads(), clip));
    opt.step();
    losses->push_back(loss.item());
  }
  return m->flat_params().to_host_f32();
}

}  // namespace

TEST_CASE("dp.gpt: 4 devices with the token cross-entropy follow one device (uneven, ignored)") {
  for (int64_t batch : {8, 7}) {
    for (bool ignored : {false, true}) {
      // Clipping on device 0 after the reduce, to a norm the gradients exceed.
      const float clip = batch == 7 && ignored ? 0.05f : 0.f;
      CAPTURE(batch);
      CAPTURE(ignored);
      std::vector<float> ref_losses, losses, ref_norms;
      auto ref = train_single(batch, ignored, &ref_losses, clip, &ref_norms);
      auto m = nn::gpt(micro());
      m->materialize(Device::cpu(0), kSeed);
      nn::AdamW opt(*m, adamw());
      dp::DataParallelOptions o;
      o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
      o.first_bucket_bytes = 1024;  // several buckets
      o.bucket_cap_bytes = 4096;
      o.clip_grad_norm = clip;
      dp::DataParallel engine(m, opt, make_devices(DeviceType::cpu, 4), o);
      for (int s = 0; s < kSteps; ++s) {
        auto [x, y] = token_batch(batch, 6, s, ignored);
        dp::StepStats st = engine.train_step(x, y);
        losses.push_back(st.loss);
        if (clip > 0.f) {
          CHECK(st.grad_norm > clip);  // the clip was active
          CHECK(st.grad_norm == doctest::Approx(ref_norms[s]).epsilon(1e-5));
        }
      }
      CHECK(dp_test::rel_diff(engine.module().flat_params().to_host_f32(), ref) <= 1e-5f);
      for (int s = 0; s < kSteps; ++s)
        CHECK(losses[s] == doctest::Approx(ref_losses[s]).epsilon(1e-5));
    }
  }
}

// bf16 end to end: bf16 GEMMs, bf16 activations and bf16 logits handed to the token loss, which
// writes their gradient in bf16 (nn::output_for). DP on 4 devices sets that policy itself and
// follows one device run the same way, within bf16's rounding of each chunk's loss gradient.
TEST_CASE("dp.gpt: bf16 logits and their bf16 gradient through 4 devices follow one device") {
  const int64_t batch = 7;
  auto make = [] {
    auto m = nn::gpt(micro());
    m->materialize(Device::cpu(0), kSeed);
    m->set_compute_dtype(DType::bf16);
    m->set_activations(nn::Activations::compute);
    return m;
  };
  std::vector<float> ref_losses, losses;
  std::vector<float> ref;
  {
    auto m = make();
    m->set_output(nn::output_for(nn::Precision::bf16, nn::TokenCrossEntropyLoss()));
    nn::SGD opt(*m, sgd());
    nn::TokenCrossEntropyLoss loss_fn;
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = token_batch(batch, 6, s, true);
      m->zero_grad();
      Tensor out = m->forward(x);
      REQUIRE(out.dtype() == DType::bf16);
      Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(0));
      Tensor dl = Tensor::empty(out.shape(), out.dtype(), Device::cpu(0));
      loss_fn.compute(loss, dl, out, y);
      m->backward(dl);
      opt.step();
      ref_losses.push_back(loss.item());
    }
    ref = m->flat_params().to_host_f32();
  }
  auto m = make();
  nn::SGD opt(*m, sgd());
  dp::DataParallelOptions o;
  o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
  o.precision = nn::Precision::bf16;
  dp::DataParallel engine(m, opt, make_devices(DeviceType::cpu, 4), o);
  CHECK(engine.module().output() == nn::Output::activations);
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = token_batch(batch, 6, s, true);
    losses.push_back(engine.train_step(x, y).loss);
  }
  // Each chunk's backward stores its activation gradients in bf16 at the chunk's own scale
  // (1 / its kept tokens), so they round differently from one device's: 2^-9 relative per
  // stored value, through 2 blocks and 3 SGD steps (SGD: Adam's m / sqrt(v) would turn the
  // rounding of a near-zero gradient into a whole step of lr). Measured: 2.6e-3 relative, and
  // 3.1e-3 with f32 logits and gradient (the rounding of the activations dominates; bf16 logits
  // add none that shows). The bound: twice the f32-logits figure.
  CHECK(dp_test::rel_diff(engine.module().flat_params().to_host_f32(), ref) <= 6e-3f);
  for (int s = 0; s < kSteps; ++s) CHECK(losses[s] == doctest::Approx(ref_losses[s]).epsilon(1e-3));
}

namespace {

// A user's token loss that reads 16-bit logits but keeps compute_scaled's default (the loss
// scale multiplied after the gradient's rounding): under fp16 the engines hand it f32 logits.
class ScaledAfterTokenLoss : public nn::Loss {
 public:
  std::string name() const override { return "scaled_after_token_loss"; }
  bool takes_16bit_pred() const override { return true; }
  void check_target(const Tensor& target) const override { inner_.check_target(target); }
  int64_t denominator(const Tensor& target) const override { return inner_.denominator(target); }
  void compute(Tensor& loss, Tensor& dpred, const Tensor& pred,
               const Tensor& target) const override {
    inner_.compute(loss, dpred, pred, target);
  }

 private:
  nn::TokenCrossEntropyLoss inner_;
};

struct Fp16Run {
  std::vector<float> losses, params;
  nn::Output output;
  int64_t skipped = 0;
};

// fp16 GEMMs and fp16 activations through DP on `devices` CPU devices, with `loss`.
Fp16Run train_fp16(const std::shared_ptr<nn::Loss>& loss, int devices) {
  auto m = nn::gpt(micro());
  m->materialize(Device::cpu(0), kSeed);
  m->set_compute_dtype(DType::f16);
  m->set_activations(nn::Activations::compute);
  nn::SGD opt(*m, sgd());
  dp::DataParallelOptions o;
  o.loss = loss;
  o.precision = nn::Precision::fp16;
  o.scaler = nn::GradScaler::options_for(nn::Precision::fp16);
  dp::DataParallel engine(m, opt, make_devices(DeviceType::cpu, devices), o);
  Fp16Run r;
  r.output = engine.module().output();
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = token_batch(7, 6, s, true);
    dp::StepStats st = engine.train_step(x, y);
    r.losses.push_back(st.loss);
    r.skipped = st.skipped_steps;
  }
  r.params = engine.module().flat_params().to_host_f32();
  return r;
}

}  // namespace

// fp16 end to end: the token loss takes fp16 logits and writes their gradient in fp16, the loss
// scale (2^16) multiplied inside its kernel before the one rounding (nn::output_for, through
// Loss::scales_before_rounding); a loss that would scale after rounding is handed f32 logits.
TEST_CASE("dp.gpt: fp16 logits, their gradient scaled inside the loss, follow one device") {
  auto token = std::make_shared<nn::TokenCrossEntropyLoss>();
  Fp16Run one = train_fp16(token, 1), four = train_fp16(token, 4);
  Fp16Run after = train_fp16(std::make_shared<ScaledAfterTokenLoss>(), 4);
  CHECK(one.output == nn::Output::activations);
  CHECK(four.output == nn::Output::activations);
  CHECK(after.output == nn::Output::f32);
  CHECK(one.skipped == 0);
  CHECK(four.skipped == 0);
  CHECK(after.skipped == 0);
  // 4 devices against 1: each chunk's fp16 gradients round at the chunk's own scale.
  const float chunks = dp_test::rel_diff(four.params, one.params);
  // fp16 logits against f32 logits: the logits and their gradient rounded to fp16 (2^-11).
  const float logits = dp_test::rel_diff(four.params, after.params);
  MESSAGE("weights, relative: 4 devices against 1 " << chunks << ", fp16 logits against f32 "
                                                    << logits);
  // Measured: 4.7e-4 and 1.3e-4 (the chunks' rounding dominates, as under bf16).
  CHECK(chunks <= 1e-3f);
  CHECK(logits <= 1e-3f);
  for (int s = 0; s < kSteps; ++s) {
    CHECK(four.losses[s] == doctest::Approx(one.losses[s]).epsilon(1e-3));
    CHECK(four.losses[s] == doctest::Approx(after.losses[s]).epsilon(1e-3));
  }
}

TEST_CASE("dp.graphs: a GPT's graphed steps equal uncaptured ones bit for bit (ignored tokens)") {
  // Attention, LayerNorm, GELU, embeddings, the token loss with ignored tokens (shares by kept
  // tokens) and clipping, replayed. The ignored tokens move to other rows every step, so each
  // step gives the chunks other shares: they are read on the devices, so one capture replays
  // them all, from the third step on. With dropout (attention and residual), each replay draws
  // the step's own masks, read on the devices.
  auto run = [](dp::Graphs graphs, bool ignored, float dropout) {
    nn::GptConfig c = micro();
    c.dropout = dropout;
    auto m = nn::gpt(c);
    m->materialize(Device::cpu(0), kSeed);
    nn::AdamW opt(*m, adamw());
    dp::DataParallelOptions o;
    o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
    o.first_bucket_bytes = 1024;
    o.bucket_cap_bytes = 4096;
    o.clip_grad_norm = 0.5f;
    o.graphs = graphs;
    dp::DataParallel engine(m, opt, make_devices(DeviceType::cpu, 3), o);
    std::vector<float> losses;
    for (int s = 0; s < 6; ++s) {
      auto [x, y] = token_batch(7, 6, ignored ? s : 0, ignored, s);
      dp::StepStats st = engine.train_step(x, y);
      CHECK(st.graphed == (graphs == dp::Graphs::on && s >= 2));
      losses.push_back(st.loss);
      losses.push_back(st.grad_norm);
    }
    std::vector<float> params = engine.module().flat_params().to_host_f32();
    losses.insert(losses.end(), params.begin(), params.end());
    return losses;
  };
  for (auto [ignored, dropout] : {std::pair{false, 0.f}, {true, 0.f}, {true, 0.2f}}) {
    CAPTURE(ignored);
    CAPTURE(dropout);
    std::vector<float> eager = run(dp::Graphs::off, ignored, dropout),
                       graphed = run(dp::Graphs::on, ignored, dropout);
    REQUIRE(eager.size() == graphed.size());
    CHECK(std::memcmp(eager.data(), graphed.data(), eager.size() * sizeof(float)) == 0);
  }
}

namespace {

// DDP on `world` ranks (ZeRO-1 with `zero`) trains `make`'s model on the token batches, each rank
// its chunk, as DdpTrainer shares the loss (by kept tokens). Each rank's parameters and losses
// (the all-reduced mean), and rank 0's gradient norms with clipping.
struct DdpRun {
  std::vector<std::vector<float>> params, losses;
  std::vector<float> norms0;
};
DdpRun run_ddp(int world, const MakeModel& make, int64_t batch, bool zero, float clip) {
  DdpRun out;
  out.params.resize(world);
  out.losses.resize(world);
  run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
    const Device dev = Device::cpu(r);
    auto m = make();
    m->materialize(dev, kSeed + r);  // rank 0's weights win
    nn::AdamW opt(*m, adamw());
    dp::dist::DdpOptions o;
    o.first_bucket_bytes = 1024;
    o.bucket_cap_bytes = 4096;
    dp::dist::DistributedDataParallel ddp(m, pg, o);
    std::unique_ptr<dp::dist::ZeroStage1> zero1;
    if (zero) {
      zero1 = std::make_unique<dp::dist::ZeroStage1>(pg, ddp.module(), opt);
      zero1->set_clip_grad_norm(clip);
    }
    nn::TokenCrossEntropyLoss loss_fn;
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = token_batch(batch, 6, s, true);
      // As DdpTrainer: rank r's share is its chunk's share of the kept tokens.
      auto sizes = dp::chunk_sizes(batch, world);
      std::vector<int64_t> denominators(world);
      for (int q = 0; q < world; ++q) {
        int64_t b = dp::chunk_begin(sizes, q);
        denominators[q] = loss_fn.denominator(y.slice(b, b + sizes[q]));
      }
      int64_t total = 0;
      for (int64_t d : denominators) total += d;
      const float share = dp::loss_shares(denominators)[r];
      int64_t b = dp::chunk_begin(sizes, r);
      Tensor xs = x.slice(b, b + sizes[r]).to(dev), ys = y.slice(b, b + sizes[r]).to(dev);
      ddp.set_batch_share(denominators[r], total);
      ddp.module().zero_grad();
      Tensor out_r = ddp.forward(xs);
      Tensor loss = Tensor::empty({1}, DType::f32, dev);
      Tensor dl = Tensor::empty(out_r.shape(), DType::f32, dev);
      loss_fn.compute(loss, dl, out_r, ys);
      if (zero1) {
        auto local_only = ddp.no_sync();
        ddp.backward(dl);
      } else {
        ddp.backward(dl);
      }
      float norm = 0.f;
      if (zero1) {
        zero1->step(share);
        norm = zero1->last_grad_norm();
      } else {
        ddp.finish_gradient_sync();
        if (clip > 0.f) norm = nn::clip_grad_norm(m->flat_grads(), clip);
        opt.step();
      }
      if (r == 0 && clip > 0.f) out.norms0.push_back(norm);
      scale(loss, loss, share);
      pg.all_reduce(loss, dp::dist::ReduceOp::sum)->wait();
      out.losses[r].push_back(loss.item());
    }
    out.params[r] = m->flat_params().to_host_f32();
  });
  return out;
}

}  // namespace

TEST_CASE("ddp.gpt: 4 ranks (plain and ZeRO-1) with the token cross-entropy follow one device") {
  const int world = 4;
  for (bool zero : {false, true}) {
    for (int64_t batch : {8, 7}) {
      CAPTURE(zero);
      CAPTURE(batch);
      // ZeRO-1 clips from one all-reduce of the shards' squared norms; plain DDP after its
      // all-reduce: both as one device clipping its whole gradient.
      const float clip = batch == 7 ? 0.05f : 0.f;
      std::vector<float> ref_losses, ref_norms;
      auto ref = train_single(batch, true, &ref_losses, clip, &ref_norms);
      DdpRun run = run_ddp(world, micro_gpt, batch, zero, clip);
      CHECK(dp_test::rel_diff(run.params[0], ref) <= 1e-5f);
      for (int r = 1; r < world; ++r) CHECK(run.params[r] == run.params[0]);
      for (int s = 0; s < kSteps; ++s)
        CHECK(run.losses[0][s] == doctest::Approx(ref_losses[s]).epsilon(1e-5));
      for (size_t s = 0; s < run.norms0.size(); ++s)
        CHECK(run.norms0[s] == doctest::Approx(ref_norms[s]).epsilon(1e-5));
      CHECK(run.norms0.size() == (clip > 0.f ? static_cast<size_t>(kSteps) : 0u));
    }
  }
}

// Llama's layers through both engines: RMSNorm's and SwiGLU's gradients, rotary attention (its
// tables are constants, made on each device and never communicated) and the untied head, on
// uneven batches with ignored tokens.
TEST_CASE(
    "dp.llama: 4 devices follow one device (uneven, ignored tokens, fused, composed, chunked)") {
  for (auto [batch, make] : {std::pair<int64_t, MakeModel>{8, micro_llama},
                             {7, micro_llama},
                             {8, micro_composed_llama},
                             {7, micro_composed_llama},
                             {7, micro_llama_chunked},
                             {7, micro_gpt_chunked}}) {
    CAPTURE(batch);
    std::vector<float> ref_losses, losses;
    auto ref = train_single(batch, true, &ref_losses, 0.f, nullptr, make);
    auto m = make();
    m->materialize(Device::cpu(0), kSeed);
    nn::AdamW opt(*m, adamw());
    dp::DataParallelOptions o;
    o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
    o.first_bucket_bytes = 1024;
    o.bucket_cap_bytes = 4096;
    dp::DataParallel engine(m, opt, make_devices(DeviceType::cpu, 4), o);
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = token_batch(batch, 6, s, true);
      losses.push_back(engine.train_step(x, y).loss);
    }
    CHECK(dp_test::rel_diff(engine.module().flat_params().to_host_f32(), ref) <= 1e-5f);
    for (int s = 0; s < kSteps; ++s)
      CHECK(losses[s] == doctest::Approx(ref_losses[s]).epsilon(1e-5));
  }
}

TEST_CASE("ddp.llama: 4 ranks follow one device (uneven, ignored tokens, fused and composed)") {
  const int world = 4, batch = 7;
  for (const MakeModel& make : {MakeModel(micro_llama), MakeModel(micro_composed_llama)}) {
    std::vector<float> ref_losses;
    auto ref = train_single(batch, true, &ref_losses, 0.f, nullptr, make);
    DdpRun run = run_ddp(world, make, batch, false, 0.f);
    CHECK(dp_test::rel_diff(run.params[0], ref) <= 1e-5f);
    for (int r = 1; r < world; ++r) CHECK(run.params[r] == run.params[0]);
    for (int s = 0; s < kSteps; ++s)
      CHECK(run.losses[0][s] == doctest::Approx(ref_losses[s]).epsilon(1e-5));
  }
}

// Composed layers inside captured steps: each replica's tapes replay inside the graph (no host
// read, no allocation), on uneven chunks, with the same bits as uncaptured steps; from the third
// step on (the capture step included) nothing is allocated and the metrics are the one host read.
TEST_CASE("dp.graphs: a composed Llama's graphed steps equal uncaptured ones bit for bit") {
  auto run = [](dp::Graphs graphs) {
    auto m = micro_composed_llama();
    m->materialize(Device::cpu(0), kSeed);
    nn::AdamW opt(*m, adamw());
    dp::DataParallelOptions o;
    o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
    o.graphs = graphs;
    dp::DataParallel engine(m, opt, make_devices(DeviceType::cpu, 3), o);
    std::vector<float> out;
    for (int s = 0; s < 5; ++s) {
      auto [x, y] = token_batch(7, 6, s, true);
      dp::StepStats st = engine.train_step(x, y);
      CHECK(st.graphed == (graphs == dp::Graphs::on && s >= 2));
      if (s >= 2) {  // the capture step included: the tapes' buffers are the warm steps' own
        CHECK(st.allocations == 0);
        CHECK(st.host_syncs == 1);
      }
      out.push_back(st.loss);
    }
    std::vector<float> params = engine.module().flat_params().to_host_f32();
    out.insert(out.end(), params.begin(), params.end());
    return out;
  };
  const std::vector<float> eager = run(dp::Graphs::off), graphed = run(dp::Graphs::on);
  REQUIRE(eager.size() == graphed.size());
  CHECK(std::memcmp(eager.data(), graphed.data(), eager.size() * sizeof(float)) == 0);
}

// Hybrid: DataParallel inside each node, device 0's buckets summed over the nodes (Gloo over
// loopback; each node a thread here, a process on a real cluster). Nodes of 2, 1 and 3 devices
// on batches of 8 and 7 rows: uneven nodes, uneven chunks, a node with one device (its own
// share scales its gradient), a node with fewer rows than devices, ignored tokens (shares by
// kept tokens of the global batch) and clipping after the sum over nodes.
TEST_CASE("hybrid.gpt: nodes of 2, 1 and 3 CPU devices follow one device (uneven, ignored)") {
  const std::vector<std::vector<int>> node_devices = {{0, 1}, {2}, {3, 4, 5}};
  const int nodes = static_cast<int>(node_devices.size());
  for (int64_t batch : {8, 7}) {
    CAPTURE(batch);
    const float clip = batch == 7 ? 0.05f : 0.f;
    std::vector<float> ref_losses, ref_norms;
    auto ref = train_single(batch, true, &ref_losses, clip, &ref_norms);
    std::vector<std::vector<float>> params(nodes), losses(nodes), norms(nodes);
    std::vector<int64_t> cross_bytes(nodes);
    run_ranks(
        nodes,
        [&](int r, dp::dist::ProcessGroup& pg) {
          std::vector<Device> devices;
          for (int d : node_devices[r]) devices.push_back(Device::cpu(d));
          auto m = nn::gpt(micro());
          m->materialize(devices[0], kSeed + r);  // node 0's weights win
          nn::AdamW opt(*m, adamw());
          dp::DataParallelOptions o;
          o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
          o.first_bucket_bytes = 1024;  // several buckets, summed over nodes one by one
          o.bucket_cap_bytes = 4096;
          o.clip_grad_norm = clip;
          o.cross_node = std::make_shared<dp::dist::GroupCrossNode>(pg);
          dp::DataParallel engine(m, opt, devices, o);
          for (int s = 0; s < kSteps; ++s) {
            auto [x, y] = token_batch(batch, 6, s, true);
            dp::StepStats st = engine.train_step(x, y);
            losses[r].push_back(st.loss);
            if (clip > 0.f) norms[r].push_back(st.grad_norm);
            CHECK(st.samples == batch);
            cross_bytes[r] = st.cross_node_bytes;
          }
          params[r] = engine.module().flat_params().to_host_f32();
        },
        [&](int r) { return Device::cpu(node_devices[r][0]); });
    CHECK(dp_test::rel_diff(params[0], ref) <= 1e-5f);
    for (int r = 0; r < nodes; ++r) {
      CAPTURE(r);
      CHECK(params[r] == params[0]);  // every node took the same step
      for (int s = 0; s < kSteps; ++s)
        CHECK(losses[r][s] == doctest::Approx(ref_losses[s]).epsilon(1e-5));
      for (size_t s = 0; s < norms[r].size(); ++s)
        CHECK(norms[r][s] == doctest::Approx(ref_norms[s]).epsilon(1e-5));
      // The gradient (P floats) and the 2 metric floats crossed once per step.
      CHECK(cross_bytes[r] == static_cast<int64_t>(ref.size() + 2) * 4);
    }
  }
}

TEST_CASE("hybrid.errors: a batch with fewer rows than nodes is refused by name on every node") {
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::gpt(micro());
    m->materialize(Device::cpu(r), kSeed);
    nn::AdamW opt(*m, adamw());
    dp::DataParallelOptions o;
    o.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
    o.cross_node = std::make_shared<dp::dist::GroupCrossNode>(pg);
    dp::DataParallel engine(m, opt, {Device::cpu(r)}, o);
    // Refused on every node alike (none is left waiting in a collective).
    auto [x, y] = token_batch(1, 6, 0, false);
    CHECK_THROWS_WITH_AS(
        engine.train_step(x, y),
        doctest::Contains("a global batch of 1 rows leaves 1 of 2 nodes without rows"), Error);
  });
}
