// DistributedDataParallel over Gloo on CPU, ranks as threads of this process (each with its
// own device cpu:r, context and process group over a TCP store on loopback).
#include <cmath>
#include <thread>

#include "dp/chunks.hpp"
#include "dp/data/loader.hpp"
#include "dp/data/synthetic.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/ddp.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/distributed/sampler.hpp"
#include "dp/distributed/sync_batch_norm.hpp"
#include "dp/distributed/zero.hpp"
#include "nn/nn.hpp"
#include "nn/train_state.hpp"
#include "tests/amp_util.hpp"
#include "tests/ddp_ranks.hpp"
#include "tests/train_util.hpp"

using namespace kernels;
using ddp_test::run_ranks;
using dp::dist::DistributedDataParallel;

namespace {

constexpr uint64_t kSeed = 77;

// Rank r's share of a global batch of `batch` rows (B_r / B).
float share_of(int64_t batch, int rank, int world) {
  return dp::chunk_share(dp::chunk_sizes(batch, world)[rank], batch);
}

// Rank r's part of a step up to its optimizer: forward of its chunk of (x, y), the loss gradient
// times `loss_scale`, backward (launching the bucket all-reduces, or local only, for ZeRO).
// Returns rank r's loss weighted by its share: their sum over ranks is the global mean loss.
Tensor chunk_backward(DistributedDataParallel& ddp, const Tensor& x, const Tensor& y, int rank,
                      int world, float loss_scale = 1.f, bool local_only = false) {
  auto sizes = dp::chunk_sizes(x.dim(0), world);
  int64_t b = dp::chunk_begin(sizes, rank);
  Tensor xs = x.slice(b, b + sizes[rank]).to(Device::cpu(rank));
  Tensor ys = y.slice(b, b + sizes[rank]).to(Device::cpu(rank));
  ddp.set_batch_share(sizes[rank], x.dim(0));
  ddp.module().zero_grad();
  Tensor out = ddp.forward(xs);
  Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(rank));
  Tensor dl = Tensor::empty(out.shape(), DType::f32, Device::cpu(rank));
  softmax_cross_entropy(loss, dl, out, ys);
  if (loss_scale != 1.f) scale(dl, dl, loss_scale);
  if (local_only) {
    auto no_sync = ddp.no_sync();
    ddp.backward(dl);
  } else {
    ddp.backward(dl);
  }
  scale(loss, loss, share_of(x.dim(0), rank, world));
  return loss;
}

// One step of rank r on its chunk of the global batch; returns nothing, updates the module.
void ddp_step(DistributedDataParallel& ddp, nn::Optimizer& opt, const Tensor& x, const Tensor& y,
              int rank, int world) {
  chunk_backward(ddp, x, y, rank, world);
  ddp.finish_gradient_sync();
  opt.step();
}

}  // namespace

TEST_CASE("ddp.buckets: reverse registration order, small first bucket, cap") {
  // 4 parameters of 100, 300, 50, 200 floats (400, 1200, 200, 800 bytes); a bucket closes
  // once it reaches its cap.
  auto b = DistributedDataParallel::make_buckets({100, 300, 50, 200}, 800, 1600);
  REQUIRE(b.size() == 2);
  CHECK(b[0].offset == 450);  // the last parameter alone fills the 800-byte first bucket
  CHECK(b[0].numel == 200);
  CHECK(b[1].offset == 0);
  CHECK(b[1].numel == 450);
  auto one = DistributedDataParallel::make_buckets({100, 300, 50, 200}, 1 << 20, 25 << 20);
  REQUIRE(one.size() == 1);
  CHECK(one[0].numel == 650);
  auto each = DistributedDataParallel::make_buckets({10, 10, 10}, 4, 4);
  CHECK(each.size() == 3);  // a parameter larger than the cap gets a bucket of its own
}

TEST_CASE("ddp.equivalence: 2-4 ranks follow the single-device run, replicas bitwise equal") {
  for (int world : {2, 3, 4}) {
    for (int64_t batch : {12, 10}) {
      CAPTURE(world);
      CAPTURE(batch);
      auto ref =
          dp_test::train_single(nn::mlp({6, 16, 5}), kSeed, 4, batch, dp_test::momentum_sgd());
      std::vector<std::vector<float>> params(world);
      run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
        auto m = nn::mlp({6, 16, 5});
        m->materialize(Device::cpu(r), kSeed + r);  // different seeds: rank 0's weights win
        nn::SGD opt(*m, dp_test::momentum_sgd());
        dp::dist::DdpOptions o;
        o.first_bucket_bytes = 256;  // several buckets even for this small model
        o.bucket_cap_bytes = 512;
        DistributedDataParallel ddp(m, pg, o);
        CHECK(ddp.buckets().size() > 1);
        // The buckets tile the whole gradient buffer, the views' alignment gaps included.
        int64_t end = m->flat_grads().numel();
        for (const auto& b : ddp.buckets()) {  // reverse order: each ends where the last began
          CHECK(b.offset + b.numel == end);
          end = b.offset;
        }
        CHECK(end == 0);
        for (int s = 0; s < 4; ++s) {
          auto [x, y] = dp_test::toy_batch(batch, 100 + s);
          ddp_step(ddp, opt, x, y, r, world);
        }
        params[r] = m->flat_params().to_host_f32();
      });
      CHECK(dp_test::rel_diff(params[0], ref) <= 1e-5f);
      for (int r = 1; r < world; ++r) CHECK(params[r] == params[0]);
    }
  }
}

TEST_CASE("ddp.overlap: bucket all-reduces start before backward ends") {
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 64, 64, 64, 5});
    m->materialize(Device::cpu(r), kSeed);
    nn::SGD opt(*m, dp_test::momentum_sgd());
    dp::dist::DdpOptions o;
    o.first_bucket_bytes = 1024;
    o.bucket_cap_bytes = 16 << 10;
    DistributedDataParallel ddp(m, pg, o);
    auto [x, y] = dp_test::toy_batch(8, 3);
    ddp_step(ddp, opt, x, y, r, 2);
    CHECK(ddp.stats().buckets >= 3);
    // Every bucket but the last (the first layers, which land as backward ends) is launched
    // from backward's hooks while layers are still left to run.
    CHECK(ddp.stats().launched_before_backward_end == ddp.stats().buckets - 1);
  });
}

TEST_CASE(
    "ddp.no_sync: accumulated micro-batches equal one step on their union, nested guards too") {
  std::vector<float> synced, ref;
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 8, 5});
    m->materialize(Device::cpu(r), kSeed);
    nn::SGD opt(*m, dp_test::momentum_sgd());
    DistributedDataParallel ddp(m, pg);
    auto [x, y] = dp_test::toy_batch(8, 9);  // rank r owns rows [4r, 4r+4): two micro-batches of 2
    ddp.module().zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      int64_t b = 4 * r + 2 * micro;
      Tensor xs = x.slice(b, b + 2).to(Device::cpu(r)), ys = y.slice(b, b + 2).to(Device::cpu(r));
      Tensor out = ddp.forward(xs);
      Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(r));
      Tensor dl = Tensor::empty(out.shape(), DType::f32, Device::cpu(r));
      softmax_cross_entropy(loss, dl, out, ys);
      scale(dl, dl, 0.5f);  // two micro-batches: each is half of this rank's mean
      if (micro == 0) {
        auto guard = ddp.no_sync();
        { auto nested = ddp.no_sync(); }  // its end leaves the outer guard in force
        ddp.backward(dl);
        CHECK(ddp.stats().launched_before_backward_end == 0);
      } else {
        ddp.backward(dl);
      }
    }
    ddp.finish_gradient_sync();
    opt.step();
    if (r == 0) synced = m->flat_params().to_host_f32();
  });
  auto m = nn::mlp({6, 8, 5});
  m->materialize(Device::cpu(0), kSeed);
  nn::SGD opt(*m, dp_test::momentum_sgd());
  auto [x, y] = dp_test::toy_batch(8, 9);
  dp_test::single_step(*m, opt, x, y);
  CHECK(dp_test::rel_diff(synced, m->flat_params().to_host_f32()) <= 1e-5f);
}

TEST_CASE(
    "ddp.failure: a backward that throws after some buckets launched leaves the next step "
    "right") {
  // The last layer's buckets are counted and launched before the fault (in the middle layer's
  // backward): the next step must launch every bucket again, in order, on every rank.
  auto model = [](int r, std::shared_ptr<std::atomic<bool>> armed) {
    auto s = std::make_shared<nn::Sequential>();
    s->add(std::make_shared<nn::Linear>(6, 8));
    s->add(
        std::make_shared<dp_test::Faulty>(Device::cpu(r), armed, dp_test::Faulty::Pass::backward));
    s->add(std::make_shared<nn::Linear>(8, 5));
    s->materialize(Device::cpu(r), kSeed);
    return s;
  };
  auto [x, y] = dp_test::toy_batch(8, 9);
  std::vector<std::vector<float>> params(2);
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto armed = std::make_shared<std::atomic<bool>>(true);
    auto m = model(r, armed);
    nn::SGD opt(*m, dp_test::momentum_sgd());
    dp::dist::DdpOptions o;
    o.first_bucket_bytes = 64;  // the last Linear's parameters alone in the first buckets
    DistributedDataParallel ddp(m, pg, o);
    CHECK_THROWS_WITH_AS(chunk_backward(ddp, x, y, r, 2), doctest::Contains("injected fault"),
                         Error);
    *armed = false;
    ddp_step(ddp, opt, x, y, r, 2);
    params[r] = m->flat_params().to_host_f32();
  });
  auto m = model(0, std::make_shared<std::atomic<bool>>(false));
  nn::SGD opt(*m, dp_test::momentum_sgd());
  dp_test::single_step(*m, opt, x, y);
  const std::vector<float> ref = m->flat_params().to_host_f32();
  for (int r = 0; r < 2; ++r) CHECK(dp_test::rel_diff(params[r], ref) <= 1e-5f);
}

TEST_CASE("ddp.mismatch: different models fail on every rank, naming the tensor") {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, r == 0 ? 16 : 17, 5});
    m->materialize(Device::cpu(r), kSeed);
    try {
      DistributedDataParallel ddp(m, pg);
    } catch (const Error& e) {
      messages[r] = e.what();
    }
  });
  for (auto& msg : messages) {
    CHECK(msg.find("models differ") != std::string::npos);
    CHECK(msg.find("weight") != std::string::npos);
  }
  std::vector<std::string> counts(2);
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = r == 0 ? nn::mlp({6, 8, 5}) : nn::mlp({6, 8, 8, 5});
    m->materialize(Device::cpu(r), kSeed);
    try {
      DistributedDataParallel ddp(m, pg);
    } catch (const Error& e) {
      counts[r] = e.what();
    }
  });
  for (auto& msg : counts) CHECK(msg.find("parameter tensors") != std::string::npos);
}

TEST_CASE("ddp.buffers: BatchNorm stats follow rank 0 (broadcast) or the mean (average)") {
  for (auto mode : {dp::dist::BufferSync::broadcast, dp::dist::BufferSync::average}) {
    std::vector<std::vector<float>> buffers(2);
    run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
      auto s = std::make_shared<nn::Sequential>();
      s->add(std::make_shared<nn::Linear>(6, 5));
      s->add(std::make_shared<nn::BatchNorm1d>(5));
      s->materialize(Device::cpu(r), kSeed);
      nn::SGD opt(*s, dp_test::momentum_sgd());
      dp::dist::DdpOptions o;
      o.buffer_sync = mode;
      DistributedDataParallel ddp(s, pg, o);
      auto [x, y] = dp_test::toy_batch(8, 4);
      ddp_step(ddp, opt, x, y, r, 2);
      buffers[r] = s->flat_buffers().to_host_f32();
    });
    if (mode == dp::dist::BufferSync::average)
      CHECK(buffers[0] == buffers[1]);
    else
      CHECK(buffers[0] != buffers[1]);  // each rank updated its own from rank 0's start
  }
}

TEST_CASE("ddp.sampler: PyTorch's DistributedSampler semantics") {
  using dp::dist::DistributedSampler;
  dp::dist::SamplerOptions plain;
  plain.shuffle = dp::data::Shuffle::no;
  // 10 samples, 4 ranks, padded to 12: rank r takes r, r+4, r+8 (10, 11 wrap to 0, 1).
  CHECK(DistributedSampler(10, 4, 0, plain).indices() == std::vector<int64_t>{0, 4, 8});
  CHECK(DistributedSampler(10, 4, 2, plain).indices() == std::vector<int64_t>{2, 6, 0});
  CHECK(DistributedSampler(10, 4, 3, plain).indices() == std::vector<int64_t>{3, 7, 1});
  plain.drop_last = dp::data::DropLast::yes;
  CHECK(DistributedSampler(10, 4, 3, plain).indices() == std::vector<int64_t>{3, 7});
  CHECK(DistributedSampler(10, 4, 0, plain).num_samples() == 2);
  // Shuffled: the ranks' shards partition one permutation, which changes with the epoch.
  dp::dist::SamplerOptions shuffled;
  shuffled.seed = 5;
  std::vector<int64_t> all;
  for (int r = 0; r < 4; ++r) {
    auto idx = DistributedSampler(12, 4, r, shuffled).indices();
    CHECK(idx.size() == 3);
    all.insert(all.end(), idx.begin(), idx.end());
  }
  std::sort(all.begin(), all.end());
  for (int64_t i = 0; i < 12; ++i) CHECK(all[i] == i);
  DistributedSampler s(12, 4, 1, shuffled);
  auto e0 = s.indices();
  s.set_epoch(1);
  CHECK(s.indices() != e0);
  s.set_epoch(0);
  CHECK(s.indices() == e0);
  CHECK_THROWS_AS(DistributedSampler(10, 4, 4), Error);
}

namespace {

// Rank r's step under ZeRO-1: local backward (DDP's no_sync), then the ZeRO exchange.
void zero_step(DistributedDataParallel& ddp, dp::dist::ZeroStage1& zero, const Tensor& x,
               const Tensor& y, int rank, int world) {
  chunk_backward(ddp, x, y, rank, world, 1.f, /*local_only=*/true);
  zero.step(share_of(x.dim(0), rank, world));
}

AdamWConfig adamw() {
  AdamWConfig c;
  c.lr = 0.01f;
  c.weight_decay = 0.01f;
  return c;
}

// Final parameters of every rank after 4 steps of plain DDP (zero false) or ZeRO-1 (true);
// `state_bytes` gets each rank's optimizer state bytes.
std::vector<std::vector<float>> train_ddp(int world, int64_t batch, bool adam, bool zero,
                                          std::vector<int64_t>* state_bytes = nullptr) {
  std::vector<std::vector<float>> params(world);
  if (state_bytes) state_bytes->assign(world, 0);
  run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 40, 16, 5});
    m->materialize(Device::cpu(r), kSeed + r);
    std::unique_ptr<nn::Optimizer> opt;
    if (adam)
      opt = std::make_unique<nn::AdamW>(*m, adamw());
    else
      opt = std::make_unique<nn::SGD>(*m, dp_test::momentum_sgd());
    DistributedDataParallel ddp(m, pg);
    std::unique_ptr<dp::dist::ZeroStage1> z;
    if (zero) z = std::make_unique<dp::dist::ZeroStage1>(pg, *m, *opt);
    for (int s = 0; s < 4; ++s) {
      auto [x, y] = dp_test::toy_batch(batch, 100 + s);
      if (zero)
        zero_step(ddp, *z, x, y, r, world);
      else
        ddp_step(ddp, *opt, x, y, r, world);
    }
    params[r] = m->flat_params().to_host_f32();
    if (state_bytes) (*state_bytes)[r] = opt->state_bytes();
  });
  return params;
}

}  // namespace

TEST_CASE("ddp.zero: ZeRO-1 on 2-4 ranks equals plain DDP (SGD momentum and AdamW, uneven)") {
  for (int world : {2, 3, 4}) {
    for (bool adam : {false, true}) {
      CAPTURE(world);
      CAPTURE(adam);
      const int64_t batch = 10;  // uneven over 3 and 4 ranks
      auto plain = train_ddp(world, batch, adam, false);
      auto zero = train_ddp(world, batch, adam, true);
      CHECK(dp_test::rel_diff(zero[0], plain[0]) <= 1e-6f);
      for (int r = 1; r < world; ++r) CHECK(zero[r] == zero[0]);  // replicas stay bitwise equal
    }
  }
}

TEST_CASE("ddp.zero: each rank holds 1/N of the optimizer state") {
  auto probe = nn::mlp({6, 40, 16, 5});
  probe->materialize(Device::cpu(0), kSeed);
  const int64_t p = probe->flat_params().numel();  // the flat buffer: padding gaps included
  for (int world : {1, 2, 4}) {
    CAPTURE(world);
    std::vector<int64_t> plain, zero;
    train_ddp(world, 8, true, false, &plain);
    train_ddp(world, 8, true, true, &zero);
    auto plan = dp::dist::make_zero_plan(p, world);
    int64_t total = 0;
    for (int r = 0; r < world; ++r) {
      CHECK(plain[r] == 2 * p * 4);  // AdamW: m and v, f32
      CHECK(zero[r] == 2 * (plan.end(r) - plan.begin(r)) * 4);
      CHECK(zero[r] <= 2 * (p / world + 64 * world) * 4);  // P / N, and the last rank's tail
      total += zero[r];
    }
    CHECK(total == 2 * p * 4);  // the shards cover the state exactly once
  }
}

TEST_CASE("ddp.zero: a rank with a different shard plan is refused, named") {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, r == 0 ? 40 : 200, 5});  // flat buffers of different sizes
    m->materialize(Device::cpu(r), kSeed);
    nn::SGD opt(*m, dp_test::momentum_sgd());
    try {
      dp::dist::ZeroStage1 z(pg, *m, opt);
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  });
  CHECK(errors[0].find("ZeRO-1: rank 1 has a different shard plan") != std::string::npos);
  CHECK(errors[1].find("ZeRO-1: rank 0 has a different shard plan") != std::string::npos);
}

TEST_CASE("ddp.sampler: a short last batch is padded by wrapping round, or dropped") {
  using dp::data::Loader;
  dp::data::SyntheticDataset data(10, {6}, 5, kSeed);
  auto indices_of = [](Loader& loader) {
    std::vector<std::vector<int64_t>> out;
    for (auto& b : loader) out.push_back(b.indices);
    return out;
  };
  dp::data::LoaderOptions lo;
  lo.batch_size = 7;
  lo.shuffle = dp::data::Shuffle::no;
  lo.pad_last_batch_to = 4;  // 4 ranks: a last batch of 3 rows would leave rank 3 without one
  Loader plain(data, lo);
  auto batches = indices_of(plain);
  REQUIRE(batches.size() == 2);
  CHECK(batches[0].size() == 7);
  CHECK(batches[1] == std::vector<int64_t>{7, 8, 9, 0});  // wrapped round to the epoch's start
  for (int64_t rows : dp::chunk_sizes(static_cast<int64_t>(batches[1].size()), 4)) CHECK(rows == 1);
  CHECK(plain.padding() == 1);

  // Shuffled: the padding repeats the first samples of the epoch's own order.
  lo.shuffle = dp::data::Shuffle::yes;
  lo.seed = 3;
  Loader shuffled(data, lo);
  auto order = shuffled.epoch_order(0);
  REQUIRE(order.size() == 11);
  batches = indices_of(shuffled);
  REQUIRE(batches.size() == 2);
  CHECK(batches[1] == std::vector<int64_t>{order[7], order[8], order[9], order[0]});

  // Fewer samples than ranks: the wrap goes round more than once.
  dp::data::SyntheticDataset two(2, {6}, 5, kSeed);
  lo.shuffle = dp::data::Shuffle::no;
  lo.batch_size = 4;
  Loader tiny(two, lo);
  CHECK(indices_of(tiny) == std::vector<std::vector<int64_t>>{{0, 1, 0, 1}});

  // A last batch with a row for each rank is left alone; drop_last drops a short one instead.
  lo.batch_size = 7;
  lo.pad_last_batch_to = 3;
  Loader enough(data, lo);
  CHECK(indices_of(enough).back() == std::vector<int64_t>{7, 8, 9});
  lo.pad_last_batch_to = 4;
  lo.drop_last = dp::data::DropLast::yes;
  Loader dropped(data, lo);
  batches = indices_of(dropped);
  REQUIRE(batches.size() == 1);
  CHECK(batches[0].size() == 7);
  lo.pad_last_batch_to = 8;  // more than a batch holds
  CHECK_THROWS_WITH_AS(Loader(data, lo), doctest::Contains("pad_last_batch_to"), Error);
}

TEST_CASE("ddp.sampler: DP and DDP train the same rows of a padded last batch, to one result") {
  // 31 samples in batches of 7 over 4 devices or ranks: 31 mod 7 = 3 rows are left, padded to
  // 4 so that each rank trains one (the case of train_mnist --batch 7 --gpus 4 on 60000).
  dp::data::SyntheticDataset data(31, {6}, 5, kSeed);
  dp::data::LoaderOptions lo;
  lo.batch_size = 7;
  lo.seed = 9;
  lo.pad_last_batch_to = 4;
  dp::data::Loader loader(data, lo);
  std::vector<dp::data::Batch> batches;
  for (auto& b : loader) batches.push_back(b);
  REQUIRE(batches.size() == 5);
  CHECK(batches.back().size() == 4);

  auto dp_model = nn::mlp({6, 16, 5});
  dp_model->materialize(Device::cpu(0), kSeed);
  nn::SGD dp_opt(*dp_model, dp_test::momentum_sgd());
  {
    dp::DataParallel engine(dp_model, dp_opt, make_devices(DeviceType::cpu, 4));
    for (auto& b : batches) engine.train_step(b.images, b.labels);
  }
  std::vector<float> dp_params = dp_model->flat_params().to_host_f32();

  std::vector<std::vector<float>> params(4);
  run_ranks(4, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 16, 5});
    m->materialize(Device::cpu(r), kSeed);
    nn::SGD opt(*m, dp_test::momentum_sgd());
    DistributedDataParallel ddp(m, pg, {});
    for (auto& b : batches) ddp_step(ddp, opt, b.images, b.labels, r, 4);
    params[r] = m->flat_params().to_host_f32();
  });
  CHECK(dp_test::rel_diff(params[0], dp_params) <= 1e-5f);
  for (int r = 1; r < 4; ++r) CHECK(params[r] == params[0]);
}

namespace {

nn::ModulePtr small_resnet() {
  return nn::resnet(8, 1, 10, 4);
}

}  // namespace

TEST_CASE("ddp.sync_bn: 4 ranks with SyncBatchNorm follow one device on the full batch") {
  const int world = 4, steps = 3;
  const int64_t batch = 10;  // chunks of 3, 3, 2, 2 rows
  auto ref = small_resnet();
  ref->materialize(Device::cpu(0), kSeed);
  nn::SGD ref_opt(*ref, dp_test::momentum_sgd());
  std::vector<float> ref_losses;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = dp_test::image_batch(batch, s);
    ref_losses.push_back(dp_test::single_step(*ref, ref_opt, x, y));
  }
  std::vector<std::vector<float>> params(world), buffers(world);
  run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = small_resnet();
    m->materialize(Device::cpu(r), kSeed);
    nn::set_batch_norm_sync(*m, std::make_shared<dp::dist::GroupStatsSync>(pg, Device::cpu(r)));
    nn::SGD opt(*m, dp_test::momentum_sgd());
    DistributedDataParallel ddp(m, pg);
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = dp_test::image_batch(batch, s);
      ddp_step(ddp, opt, x, y, r, world);
    }
    params[r] = m->flat_params().to_host_f32();
    buffers[r] = m->flat_buffers().to_host_f32();
  });
  CHECK(dp_test::rel_diff(params[0], ref->flat_params().to_host_f32()) <= 1e-4f);
  CHECK(dp_test::rel_diff(buffers[0], ref->flat_buffers().to_host_f32()) <= 1e-4f);
  for (int r = 1; r < world; ++r) {
    CHECK(params[r] == params[0]);
    CHECK(buffers[r] == buffers[0]);
  }
}

TEST_CASE("ddp.train_state: 4 ranks with dropout resume bit for bit (SGD momentum, AdamW)") {
  for (bool adam : {false, true}) {
    CAPTURE(adam);
    const int world = 4;
    const std::string path = dp_test::temp_path("ddp", adam ? "state_adam" : "state_sgd");
    // Steps [from, 7) on every rank; `save_at` writes the state (rank 0) after that step, `load`
    // starts from it. Returns rank r's final parameters.
    auto train = [&](int from, int save_at, bool load) {
      std::vector<std::vector<float>> params(world);
      run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
        auto m = dp_test::dropout_mlp();
        m->materialize(Device::cpu(r), kSeed);
        std::unique_ptr<nn::Optimizer> opt;
        if (adam)
          opt = std::make_unique<nn::AdamW>(*m, AdamWConfig{});
        else
          opt = std::make_unique<nn::SGD>(*m, dp_test::momentum_sgd());
        nn::TrainingProgress state;
        state.mode = "ddp";
        state.world_size = world;
        if (load) nn::load_training_state(path, *m, *opt, state, r);
        DistributedDataParallel ddp(m, pg);
        for (int s = from; s < 7; ++s) {
          auto [x, y] = dp_test::toy_batch(10, 600 + s);  // 3, 3, 2, 2 rows
          ddp_step(ddp, *opt, x, y, r, world);
          if (s + 1 != save_at) continue;
          // Every rank's dropout offset, gathered; rank 0 writes, the others wait.
          Tensor mine = Tensor::empty({1}, DType::i64, Device::cpu(r));
          mine.data<int64_t>()[0] = static_cast<int64_t>(m->flat().rng_offset);
          Tensor all = Tensor::empty({world}, DType::i64, Device::cpu(r));
          pg.all_gather(all, mine)->wait();
          state.step = s + 1;
          for (int q = 0; q < world; ++q) state.rng_offsets.push_back(all.data<int64_t>()[q]);
          if (r == 0) nn::save_training_state(path, *m, *opt, state);
          pg.barrier()->wait();
        }
        params[r] = m->flat_params().to_host_f32();
      });
      return params;
    };
    auto whole = train(0, 4, false);  // saves after step 4 on the way
    auto resumed = train(4, -1, true);
    for (int r = 0; r < world; ++r) CHECK(resumed[r] == whole[r]);
    CHECK(whole[1] == whole[0]);
  }
}

// ---- mixed precision: what DdpTrainer does each step, on ranks as threads --------------------

namespace {

// One rank's step as DdpTrainer::train_step takes it: the loss gradient scaled, backward with
// the bucket all-reduces, then the scaler's check of the reduced gradient and the step or skip.
// Returns the global mean loss.
float ddp_amp_step(DistributedDataParallel& ddp, nn::Optimizer& opt, nn::GradScaler& scaler,
                   dp::dist::ProcessGroup& pg, const Tensor& x, const Tensor& y, int rank,
                   int world) {
  Tensor loss = chunk_backward(ddp, x, y, rank, world, scaler.scale());
  ddp.finish_gradient_sync();
  scaler.step(opt, ddp.module().flat_grads());
  pg.all_reduce(loss, dp::dist::ReduceOp::sum)->wait();
  return loss.item();
}

}  // namespace

TEST_CASE("ddp.amp: 4 ranks follow the single-device bf16 loss curve within the rounding bound") {
  const int world = 4, steps = 6;
  for (int64_t batch : {32, 30}) {
    CAPTURE(batch);
    const dp_test::MixedPrecisionCurve single = dp_test::mixed_precision_curve(
        nn::mlp({6, 64, 64, 5}), kSeed, dp_test::momentum_sgd(), batch, steps, DType::bf16);
    const std::vector<float>& ref = single.losses;
    const std::vector<double>& bound = single.bounds;
    std::vector<std::vector<float>> losses(world), params(world);
    run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
      auto m = nn::mlp({6, 64, 64, 5});
      m->materialize(Device::cpu(r), kSeed);
      m->set_compute_dtype(DType::bf16);
      nn::SGD opt(*m, dp_test::momentum_sgd());
      nn::GradScaler scaler(nn::Precision::bf16);
      dp::dist::DdpOptions o;
      o.first_bucket_bytes = 256;
      o.bucket_cap_bytes = 4096;
      DistributedDataParallel ddp(m, pg, o);
      for (int s = 0; s < steps; ++s) {
        auto [x, y] = dp_test::toy_batch(batch, 100 + s);
        losses[r].push_back(ddp_amp_step(ddp, opt, scaler, pg, x, y, r, world));
      }
      params[r] = m->flat_params().to_host_f32();
    });
    double worst = 0;
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      CHECK(std::fabs(losses[0][s] - ref[s]) <= bound[s]);
      worst = std::max(worst, std::fabs(losses[0][s] - ref[s]) / bound[s]);
    }
    MESSAGE("largest |loss_ddp - loss_single| / bound: " << worst);
    for (int r = 1; r < world; ++r) CHECK(params[r] == params[0]);  // one decision, one update
  }
}

TEST_CASE(
    "ddp.amp: every rank skips an overflowing fp16 step alike, bf16 buckets halve the bytes") {
  const int world = 4;
  std::vector<std::vector<float>> before(world), after(world);
  std::vector<float> scales(world);
  std::vector<int64_t> skipped(world), comm_bytes(world), grad_bytes(world);
  run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 16, 5});
    m->materialize(Device::cpu(r), kSeed);
    m->set_compute_dtype(DType::f16);
    nn::SGD opt(*m, dp_test::momentum_sgd());
    nn::GradScalerOptions so = nn::GradScaler::options_for(nn::Precision::fp16);
    so.init_scale = std::ldexp(1.f, 40);
    nn::GradScaler scaler(so);
    dp::dist::DdpOptions o;
    o.comm_dtype = DType::bf16;
    DistributedDataParallel ddp(m, pg, o);
    before[r] = m->flat_params().to_host_f32();
    auto [x, y] = dp_test::toy_batch(30, 1);
    ddp_amp_step(ddp, opt, scaler, pg, x, y, r, world);
    after[r] = m->flat_params().to_host_f32();
    scales[r] = scaler.scale();
    skipped[r] = scaler.skipped_steps();
    comm_bytes[r] = ddp.stats().comm_bytes;
    grad_bytes[r] = m->flat_grads().nbytes();
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(after[r] == before[r]);
    CHECK(scales[r] == std::ldexp(1.f, 39));
    CHECK(skipped[r] == 1);
    CHECK(comm_bytes[r] * 2 == grad_bytes[r]);
  }
}

TEST_CASE("ddp.zero: amp, bf16 ZeRO-1 follows bf16 DDP, and a NaN in one shard stops every rank") {
  const int world = 4, steps = 4;
  const int64_t batch = 10;  // 3, 3, 2, 2 rows
  // The reference: plain bf16 DDP, with the rounding bound of each step's loss.
  std::vector<float> plain_losses;
  std::vector<double> bound;
  run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 40, 16, 5});
    m->materialize(Device::cpu(r), kSeed);
    m->set_compute_dtype(DType::bf16);
    nn::AdamW opt(*m, adamw());
    nn::GradScaler scaler(nn::Precision::bf16);
    DistributedDataParallel ddp(m, pg);
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = dp_test::toy_batch(batch, 100 + s);
      if (r == 0) bound.push_back(2 * dp_test::mixed_precision_loss_bound(*m, x, DType::bf16));
      float l = ddp_amp_step(ddp, opt, scaler, pg, x, y, r, world);
      if (r == 0) plain_losses.push_back(l);
    }
  });
  // ZeRO-1: rank 0 poisons, at step 2, one gradient element of rank 3's shard.
  std::vector<std::vector<float>> before(world), after(world);
  std::vector<int64_t> skipped(world);
  std::vector<float> zero_losses;
  run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 40, 16, 5});
    m->materialize(Device::cpu(r), kSeed);
    m->set_compute_dtype(DType::bf16);
    nn::AdamW opt(*m, adamw());
    nn::GradScaler scaler(nn::Precision::bf16);
    DistributedDataParallel ddp(m, pg);
    dp::dist::ZeroStage1 zero(pg, *m, opt);
    for (int s = 0; s < steps + 1; ++s) {
      auto [x, y] = dp_test::toy_batch(batch, 100 + (s < 2 ? s : s - 1));
      Tensor loss = chunk_backward(ddp, x, y, r, world, scaler.scale(), /*local_only=*/true);
      const bool poison = s == 2;
      if (poison && r == 0) m->flat_grads().data<float>()[zero.plan().begin(3)] = std::nanf("");
      if (poison) before[r] = m->flat_params().to_host_f32();
      const bool taken = zero.step(share_of(batch, r, world), &scaler);
      CHECK(taken == !poison);
      if (poison) after[r] = m->flat_params().to_host_f32();
      pg.all_reduce(loss, dp::dist::ReduceOp::sum)->wait();
      if (r == 0 && !poison) zero_losses.push_back(loss.item());
    }
    skipped[r] = scaler.skipped_steps();
  });
  REQUIRE(zero_losses.size() == plain_losses.size());
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    CHECK(std::fabs(zero_losses[s] - plain_losses[s]) <= bound[s]);
  }
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(skipped[r] == 1);
    CHECK(after[r] == before[r]);  // without the combined verdict, ranks 0-2 would have stepped
  }
}
