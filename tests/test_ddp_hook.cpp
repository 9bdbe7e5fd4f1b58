// DDP communication hooks (dp/distributed/comm_hook.hpp): research code's reducer in place of
// the bucket all-reduce, and the sample's PowerSGD hook (samples/low_rank_hook.hpp). Ranks are
// threads of this process over Gloo on CPU devices (tests/ddp_ranks.hpp).
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "dp/chunks.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/builtin_hooks.hpp"
#include "dp/distributed/comm_hook.hpp"
#include "dp/distributed/cross_node_group.hpp"
#include "dp/distributed/ddp.hpp"
#include "dp/distributed/device_reducers.hpp"
#include "nn/nn.hpp"
#include "samples/low_rank_hook.hpp"
#include "tests/ddp_ranks.hpp"
#include "tests/train_util.hpp"

using namespace kernels;
using ddp_test::run_ranks;
using dp::dist::DistributedDataParallel;

namespace {

// What DDP does without a hook, written as one; counts its calls.
class SumHook : public dp::dist::CommHook {
 public:
  std::string name() const override { return "sum"; }
  std::shared_ptr<dp::dist::Work> reduce(dp::dist::GradBucket& b) override {
    ++calls;
    return b.group->all_reduce(b.grad);
  }
  int calls = 0;
};

// Makes SumHooks and keeps them, to read their calls afterwards: ranks and devices make theirs
// from their own threads.
struct SumHooks {
  std::shared_ptr<dp::dist::CommHook> make() {
    auto h = std::make_shared<SumHook>();
    std::lock_guard<std::mutex> lock(mutex);
    made.push_back(h);
    return h;
  }
  std::vector<std::shared_ptr<SumHook>> made;
  std::mutex mutex;
};

// How a rank runs backward and the bucket sync: from backward's hooks; after backward (a graphed
// step's hooks between its segments); queued on the group from backward's hooks (a graphed step
// whose graph holds the collectives).
enum class Path { hooks, staged, queued };

struct RankRun {
  std::vector<float> params;
  std::vector<float> losses;        // the global batch's mean loss, per step (rank 0's sum)
  std::vector<int64_t> comm_bytes;  // per step
};

// The threaded engine on `devices` trains `make`'s model (seed 11, momentum SGD; buckets of
// first_bucket, then cap bytes; the rest of its options from `configure`) for `steps` steps of
// one toy batch of `batch` rows. Returns each step's loss and `bytes` (the reducer's or the
// nodes' bytes), and device 0's weights.
RankRun train_threaded(const std::vector<Device>& devices,
                       const std::function<nn::ModulePtr()>& make, int64_t first_bucket,
                       int64_t cap, const std::function<void(dp::DataParallelOptions&)>& configure,
                       int steps, int64_t batch, int64_t dp::StepStats::*bytes) {
  auto m = make();
  m->materialize(devices[0], 11);
  nn::SGD opt(*m, dp_test::momentum_sgd());
  dp::DataParallelOptions o;
  o.first_bucket_bytes = first_bucket;
  o.bucket_cap_bytes = cap;
  configure(o);
  dp::DataParallel engine(m, opt, devices, o);
  RankRun run;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = dp_test::toy_batch(batch, 200);
    const dp::StepStats st = engine.train_step(x, y);
    CHECK_FALSE(st.graphed);
    run.losses.push_back(st.loss);
    run.comm_bytes.push_back(st.*bytes);
  }
  run.params = engine.module().flat_params().to_host_f32();
  return run;
}

// Rank r of `world` trains `model` for `steps` SGD steps on one toy batch of `batch` rows (its
// chunk, scaled by its share), through `path`. Returns its parameters, per-step loss share and
// bytes.
RankRun train_rank(nn::ModulePtr m, dp::dist::ProcessGroup& pg, int r, int world, int steps,
                   int64_t batch, dp::dist::DdpOptions o, Path path = Path::hooks) {
  m->materialize(Device::cpu(r), 11);
  nn::SGD opt(*m, dp_test::momentum_sgd());
  DistributedDataParallel ddp(m, pg, o);
  RankRun run;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = dp_test::toy_batch(batch, 200);  // the same rows each step: a signal to learn
    auto sizes = dp::chunk_sizes(batch, world);
    const int64_t b = dp::chunk_begin(sizes, r);
    Tensor xs = x.slice(b, b + sizes[r]).to(Device::cpu(r));
    Tensor ys = y.slice(b, b + sizes[r]).to(Device::cpu(r));
    ddp.set_batch_share(sizes[r], batch);
    ddp.module().zero_grad();
    Tensor out = ddp.forward(xs);
    Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(r));
    Tensor dl = Tensor::empty(out.shape(), DType::f32, Device::cpu(r));
    softmax_cross_entropy(loss, dl, out, ys);
    if (path == Path::hooks) {
      ddp.backward(dl);
      ddp.finish_gradient_sync();
    } else if (path == Path::staged) {  // a graphed step's hook between its two segments
      ddp.backward_local(dl);
      ddp.stage_buckets();
      ddp.all_reduce_staged();
    } else {
      ddp.backward_queued(dl);
    }
    opt.step();
    scale(loss, loss, dp::chunk_share(sizes[r], batch));
    pg.all_reduce(loss)->wait();
    run.losses.push_back(loss.item());
    run.comm_bytes.push_back(ddp.stats().comm_bytes);
  }
  run.params = m->flat_params().to_host_f32();
  return run;
}

std::vector<RankRun> train(int world, int steps, int64_t batch,
                           const std::function<nn::ModulePtr()>& make,
                           const std::function<dp::dist::DdpOptions(int)>& options,
                           Path path = Path::hooks) {
  std::vector<RankRun> runs(world);
  run_ranks(world, [&](int r, dp::dist::ProcessGroup& pg) {
    runs[r] = train_rank(make(), pg, r, world, steps, batch, options(r), path);
  });
  return runs;
}

// Bytes of the whole flat gradient of make()'s model (its alignment gaps included): what DDP's
// buckets all-reduce in f32.
int64_t gradient_bytes(const std::function<nn::ModulePtr()>& make) {
  auto m = make();
  m->materialize(Device::cpu(0), 1);
  return m->flat_grads().numel() * 4;
}

dp::dist::DdpOptions small_buckets() {
  dp::dist::DdpOptions o;
  o.first_bucket_bytes = 256;  // several buckets even for a small model
  o.bucket_cap_bytes = 512;
  return o;
}

}  // namespace

TEST_CASE("ddp.comm_hook: a hook that all-reduces trains the same bits as DDP, bytes counted") {
  const int world = 3, steps = 3;
  const int64_t batch = 10;  // uneven chunks: 4, 3, 3
  auto make = [] { return nn::mlp({6, 16, 5}); };
  const auto plain = train(world, steps, batch, make, [](int) { return small_buckets(); });
  std::vector<std::shared_ptr<SumHook>> hooks(world);
  auto with_hook = [&](int r) {
    dp::dist::DdpOptions o = small_buckets();
    hooks[r] = std::make_shared<SumHook>();
    o.comm_hook = hooks[r];
    return o;
  };
  for (Path path : {Path::hooks, Path::staged}) {
    CAPTURE(static_cast<int>(path));
    const auto hooked = train(world, steps, batch, make, with_hook, path);
    for (int r = 0; r < world; ++r) {
      CHECK(hooked[r].params == plain[r].params);
      CHECK(hooked[r].losses == plain[r].losses);
      CHECK(hooked[r].comm_bytes == plain[r].comm_bytes);  // from the group's payload count
      CHECK(hooked[r].comm_bytes[0] == gradient_bytes(make));
    }
    // Called once per bucket per step, on every rank.
    const int buckets = static_cast<int>(hooks[0]->calls / steps);
    CHECK(buckets > 1);
    for (int r = 0; r < world; ++r) CHECK(hooks[r]->calls == buckets * steps);
  }
}

TEST_CASE("ddp.builtin_hooks: DDP's comm dtypes are its built-in hooks, on every path") {
  // DdpOptions::comm_dtype f32 and bf16 pick AllReduceHook and Bf16CompressHook: given as comm
  // hooks they train the same bits and bytes, from backward's hooks, after backward and queued
  // in the group (both are capturable), at 3 ranks and at 1 (which hands nothing over, and
  // where bf16 still rounds every bucket once).
  auto make = [] { return nn::mlp({6, 16, 5}); };
  const int steps = 3;
  const int64_t batch = 10, grad_bytes = gradient_bytes(make);
  for (int world : {3, 1}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      CAPTURE(world);
      CAPTURE(dtype_name(dtype));
      auto by_dtype = [&](int) {
        dp::dist::DdpOptions o = small_buckets();
        o.comm_dtype = dtype;
        return o;
      };
      auto by_hook = [&](int) {
        dp::dist::DdpOptions o = small_buckets();
        o.comm_hook = dp::dist::builtin_hook(dtype);
        return o;
      };
      const auto plain = train(world, steps, batch, make, by_dtype);
      const int64_t wire = world == 1 ? 0 : grad_bytes / (dtype == DType::f32 ? 1 : 2);
      for (int r = 0; r < world; ++r)
        for (int64_t bytes : plain[r].comm_bytes) CHECK(bytes == wire);
      for (Path path : {Path::hooks, Path::staged, Path::queued}) {
        CAPTURE(static_cast<int>(path));
        using MakeOptions = std::function<dp::dist::DdpOptions(int)>;
        for (const MakeOptions& make_options : {MakeOptions(by_dtype), MakeOptions(by_hook)}) {
          const auto run = train(world, steps, batch, make, make_options, path);
          for (int r = 0; r < world; ++r) {
            CHECK(run[r].params == plain[r].params);
            CHECK(run[r].losses == plain[r].losses);
            CHECK(run[r].comm_bytes == plain[r].comm_bytes);
          }
        }
      }
    }
  }
  // bf16 rounds each rank's scaled bucket: one rank's weights differ from f32's after a step.
  auto one = [&](DType dtype) {
    return train(1, 1, batch, make,
                 [&](int) {
                   dp::dist::DdpOptions o;
                   o.comm_dtype = dtype;
                   return o;
                 })[0]
        .params;
  };
  CHECK(one(DType::f32) != one(DType::bf16));
}

TEST_CASE("ddp.builtin_hooks: what each says it moves, and a hook a graph cannot hold") {
  auto make = [] { return nn::mlp({6, 16, 5}); };
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = make();
    m->materialize(Device::cpu(r), 3);
    for (DType dtype : {DType::f32, DType::bf16}) {
      dp::dist::DdpOptions o = small_buckets();
      o.comm_dtype = dtype;
      DistributedDataParallel ddp(m, pg, o);
      CHECK(ddp.comm_hook() == nullptr);
      CHECK(ddp.reducer().name() == (dtype == DType::f32 ? "allreduce" : "bf16-allreduce"));
      CHECK(ddp.reducer().capturable());
      const std::vector<int64_t> bytes = ddp.bucket_bytes();
      REQUIRE(bytes.size() == ddp.buckets().size());
      REQUIRE(bytes.size() > 1);
      for (size_t k = 0; k < bytes.size(); ++k)
        CHECK(bytes[k] == ddp.buckets()[k].numel * static_cast<int64_t>(dtype_size(dtype)));
      CHECK(ddp.reducer().bytes_for(100, 1) == 0);  // one rank: nothing handed over
    }
  });
  CHECK_THROWS_WITH(dp::dist::builtin_hook(DType::f16),
                    doctest::Contains("all-reduced in f32 or bf16, not f16"));
  // A research hook is not capturable unless it says so: reduce_queued refuses, naming it.
  SumHook sum;
  CHECK_FALSE(sum.capturable());
  dp::dist::GradBucket b;
  b.index = 4;
  CHECK_THROWS_WITH(sum.reduce_queued(b),
                    doctest::Contains("comm hook 'sum' (bucket 4) is not capturable"));
  CHECK(sum.bytes_for(100, 2) == -1);
  // The bf16 hook refuses a bucket that is not the f32 gradient.
  run_ranks(1, [&](int r, dp::dist::ProcessGroup& pg) {
    dp::dist::Bf16CompressHook bf16;
    dp::dist::GradBucket half;
    half.index = 2;
    half.grad = Tensor::zeros({8}, DType::bf16, Device::cpu(r));
    half.group = &pg;
    CHECK_THROWS_WITH(bf16.reduce(half), doctest::Contains("bucket 2 is bf16, not the f32"));
    CHECK_THROWS_WITH(bf16.complete_queued(half),
                      doctest::Contains("complete_queued of bucket 2 before its reduce_queued"));
  });
  // A hybrid run's link without research code's hook sums through the built-in one.
  run_ranks(1, [&](int, dp::dist::ProcessGroup& pg) {
    dp::dist::GroupCrossNode plain(pg);
    CHECK(plain.hook() == nullptr);
    dp::dist::GroupCrossNode hooked(pg, std::make_shared<SumHook>());
    REQUIRE(hooked.hook() != nullptr);
    CHECK(hooked.hook()->name() == "sum");
  });
}

namespace {

// A capturable hook that keeps the share each bucket came with, as a value and where an op reads
// it (GradBucket::share_at), and all-reduces queued.
class ShareHook : public dp::dist::CommHook {
 public:
  std::string name() const override { return "share"; }
  std::shared_ptr<dp::dist::Work> reduce(dp::dist::GradBucket& b) override {
    return b.group->all_reduce(b.grad);
  }
  bool capturable() const override { return true; }
  void reduce_queued(dp::dist::GradBucket& b) override {
    at.push_back(b.share_at);
    values.push_back(b.share);
    b.group->all_reduce_queued(b.grad);
  }
  std::vector<kernels::Scalar> at;
  std::vector<float> values;
};

}  // namespace

// A hostile pass: a capturable hook had the rank's share only as a host float, which a captured
// step replays with, where it changes every step (a token loss's ignored tokens): an error-feedback
// hook then kept wrong residuals, silently. GradBucket::share_at is DDP's device copy, which a
// captured op reads when it runs: a later step's share.
TEST_CASE("ddp.comm_hook: a capturable hook reads the share where a replay sees each step's") {
  run_ranks(2, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 16, 5});
    m->materialize(Device::cpu(r), 11);
    auto hook = std::make_shared<ShareHook>();
    dp::dist::DdpOptions o = small_buckets();
    o.comm_hook = hook;
    DistributedDataParallel ddp(m, pg, o);
    auto step = [&](int64_t rows, int64_t global) {
      auto [x, y] = dp_test::toy_batch(rows, 300 + r);
      ddp.set_batch_share(rows, global);
      ddp.module().zero_grad();
      Tensor out = ddp.forward(x.to(Device::cpu(r)));
      Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(r));
      Tensor dl = Tensor::empty(out.shape(), DType::f32, Device::cpu(r));
      softmax_cross_entropy(loss, dl, out, y.to(Device::cpu(r)));
      ddp.backward_queued(dl);
    };
    step(r == 0 ? 3 : 7, 10);
    REQUIRE(hook->at.size() > 1);  // several buckets
    const float first = r == 0 ? 0.3f : 0.7f;
    for (size_t k = 0; k < hook->at.size(); ++k) {
      CHECK(hook->values[k] == first);
      CHECK(hook->at[k].at.defined());  // on the device, not a fixed value
      CHECK(hook->at[k].read() == first);
    }
    const kernels::Scalar kept = hook->at[0];
    step(r == 0 ? 6 : 4, 10);
    CHECK(kept.read() == (r == 0 ? 0.6f : 0.4f));  // what a replay of step 1's ops would read
  });
}

TEST_CASE("ddp.comm_hook: PowerSGD at full rank is the sum, at rank 2 trains on fewer bytes") {
  auto make = [] { return nn::mlp({6, 64, 64, 5}); };  // one bucket of 4,933 floats
  const int64_t batch = 12;
  // Full rank (r = rows of the bucket's matrix) and no byte floor: P's orthonormal columns span
  // everything, so P P^T M is M: the plain sum up to float rounding.
  const auto plain = train(2, 3, batch, make, [](int) { return dp::dist::DdpOptions{}; });
  auto full = [](int) {
    dp::dist::DdpOptions o;
    samples::LowRankOptions lo;
    lo.rank = 1 << 20, lo.start_step = 0, lo.min_compression = 0;
    o.comm_hook = std::make_shared<samples::LowRankHook>(lo);
    return o;
  };
  const auto exact = train(2, 3, batch, make, full);
  CHECK(dp_test::rel_diff(exact[0].params, plain[0].params) <= 1e-4f);
  CHECK(exact[1].params == exact[0].params);

  // Rank 2 after 2 whole steps: the same bytes as DDP for those, then 2 (70 + 71) floats a step
  // in place of 4,933 (about 17 times fewer); every rank steps with the same approximation.
  const int steps = 40;
  const auto plain_long = train(2, steps, batch, make, [](int) { return dp::dist::DdpOptions{}; });
  auto low = [](int) {
    dp::dist::DdpOptions o;
    samples::LowRankOptions lo;
    lo.rank = 2, lo.start_step = 2;
    o.comm_hook = std::make_shared<samples::LowRankHook>(lo);
    return o;
  };
  const auto compressed = train(2, steps, batch, make, low);
  CHECK(compressed[1].params == compressed[0].params);
  const int64_t whole = plain_long[0].comm_bytes[0];
  CHECK(whole == gradient_bytes(make));
  CHECK(compressed[0].comm_bytes[0] == whole);
  CHECK(compressed[0].comm_bytes[1] == whole);
  // P (rows x 2) and Q (cols x 2) in f32 of the bucket's matrix (70 x 71 when written), the
  // second all-reduce issued from the hook's Work.
  const int64_t n = whole / 4, cols = static_cast<int64_t>(std::ceil(std::sqrt(double(n))));
  const int64_t low_bytes = ((n + cols - 1) / cols + cols) * 2 * 4;
  for (int s = 2; s < steps; ++s) CHECK(compressed[0].comm_bytes[s] == low_bytes);
  CHECK(whole > 15 * low_bytes);
  // It learns the batch: the last 5 steps' mean loss under half the first step's (0.41 of 1.60
  // when written; DDP's whole gradient reaches 0.03: rank 2 learns slower on this tiny model).
  auto tail = [&](const std::vector<float>& l) {
    float sum = 0;
    for (int s = steps - 5; s < steps; ++s) sum += l[s];
    return sum / 5;
  };
  const float first = compressed[0].losses[0];
  CHECK(first == plain_long[0].losses[0]);
  CHECK(tail(compressed[0].losses) < 0.5f * first);
  CHECK(tail(plain_long[0].losses) < tail(compressed[0].losses));
}

TEST_CASE(
    "ddp.comm_hook: refusals name the hook: a 16-bit comm dtype, a replaced bucket, its error") {
  class Replacing : public dp::dist::CommHook {
   public:
    std::string name() const override { return "replacing"; }
    std::shared_ptr<dp::dist::Work> reduce(dp::dist::GradBucket& b) override {
      b.grad = Tensor::zeros(b.grad.shape(), DType::f32, b.grad.device());
      return nullptr;
    }
  };
  class Throwing : public dp::dist::CommHook {
   public:
    std::string name() const override { return "throwing"; }
    std::shared_ptr<dp::dist::Work> reduce(dp::dist::GradBucket&) override {
      throw std::runtime_error("boom in research code");
    }
  };
  run_ranks(1, [&](int r, dp::dist::ProcessGroup& pg) {
    auto m = nn::mlp({6, 8, 5});
    m->materialize(Device::cpu(r), 3);
    dp::dist::DdpOptions o;
    o.comm_hook = std::make_shared<Replacing>();
    o.comm_dtype = DType::bf16;
    CHECK(dp_test::error_of([&] {
            DistributedDataParallel ddp(m, pg, o);
          }).find("comm hook 'replacing' with comm dtype bf16") != std::string::npos);
    o.comm_dtype = DType::f32;
    DistributedDataParallel ddp(m, pg, o);
    auto [x, y] = dp_test::toy_batch(4, 1);
    Tensor out = ddp.forward(x.to(Device::cpu(r)));
    Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu(r));
    Tensor dl = Tensor::empty(out.shape(), DType::f32, Device::cpu(r));
    softmax_cross_entropy(loss, dl, out, y.to(Device::cpu(r)));
    CHECK(dp_test::error_of([&] { ddp.backward(dl); }).find("'replacing' replaced bucket 0") !=
          std::string::npos);
    CHECK(dp_test::error_of([&] {
            ddp.backward_queued(dl);
          }).find("backward_queued with comm hook 'replacing'") != std::string::npos);
    // A hook's own error says which hook and bucket it came from (it said only "boom ...").
    auto m2 = nn::mlp({6, 8, 5});
    m2->materialize(Device::cpu(r), 3);
    o.comm_hook = std::make_shared<Throwing>();
    DistributedDataParallel throwing(m2, pg, o);
    out = throwing.forward(x.to(Device::cpu(r)));
    softmax_cross_entropy(loss, dl, out, y.to(Device::cpu(r)));
    const std::string error = dp_test::error_of([&] { throwing.backward(dl); });
    CAPTURE(error);
    CHECK(error.find("DDP: comm hook 'throwing' (bucket 0) threw: boom in research code") !=
          std::string::npos);
  });
}

// ---- hybrid: the DP engine in each node, its device 0s joined by a hook -----------------------

namespace {

// Node 0 holds devices cpu:0 and cpu:1, node 1 cpu:2 (uneven nodes). Each node trains `make`'s
// model with the threaded engine for `steps` SGD steps on one toy batch, its buckets summed over
// the nodes by `hook` (null: the all-reduce). Returns each node's weights, losses and bytes.
std::vector<RankRun> train_hybrid(int steps, const std::function<nn::ModulePtr()>& make,
                                  const std::function<std::shared_ptr<dp::dist::CommHook>()>& hook,
                                  int64_t first_bucket, int64_t cap) {
  const std::vector<std::vector<int>> node_devices = {{0, 1}, {2}};
  std::vector<RankRun> runs(node_devices.size());
  run_ranks(
      static_cast<int>(node_devices.size()),
      [&](int r, dp::dist::ProcessGroup& pg) {
        std::vector<Device> devices;
        for (int d : node_devices[r]) devices.push_back(Device::cpu(d));
        runs[r] = train_threaded(
            devices, make, first_bucket, cap,
            [&](dp::DataParallelOptions& o) {
              o.cross_node =
                  std::make_shared<dp::dist::GroupCrossNode>(pg, hook ? hook() : nullptr);
            },
            steps, 12, &dp::StepStats::cross_node_bytes);
      },
      [&](int r) { return Device::cpu(node_devices[r][0]); });
  return runs;
}

}  // namespace

TEST_CASE("hybrid.comm_hook: a hook sums the nodes' buckets: the same bits, or PowerSGD's") {
  auto small = [] { return nn::mlp({6, 16, 5}); };
  // An all-reducing hook: the same weights, losses and bytes as the built-in sum, called once per
  // bucket per step on each node.
  SumHooks hooks;
  auto sum_hook = [&] { return hooks.make(); };
  const auto& made = hooks.made;
  const auto plain = train_hybrid(3, small, nullptr, 256, 512);
  const auto summed = train_hybrid(3, small, sum_hook, 256, 512);
  REQUIRE(made.size() == 2);
  for (int r = 0; r < 2; ++r) {
    CHECK(summed[r].params == plain[r].params);
    CHECK(summed[r].losses == plain[r].losses);
    CHECK(summed[r].comm_bytes == plain[r].comm_bytes);
    CHECK(made[r]->calls > 3);  // several buckets a step
  }
  CHECK(plain[1].params == plain[0].params);

  // PowerSGD at full rank: the sum over nodes up to rounding, so node shares are right (node 0
  // holds 6 of the 12 rows on 2 devices, node 1 the other 6 on one).
  auto big = [] { return nn::mlp({6, 64, 64, 5}); };  // one bucket
  const auto exact_ref = train_hybrid(3, big, nullptr, 1 << 20, 25 << 20);
  auto full = []() -> std::shared_ptr<dp::dist::CommHook> {
    samples::LowRankOptions lo;
    lo.rank = 1 << 20, lo.start_step = 0, lo.min_compression = 0;
    return std::make_shared<samples::LowRankHook>(lo);
  };
  const auto exact = train_hybrid(3, big, full, 1 << 20, 25 << 20);
  CHECK(dp_test::rel_diff(exact[0].params, exact_ref[0].params) <= 1e-4f);
  CHECK(exact[1].params == exact[0].params);
  // Rank 2: every node steps with the same approximation, on P and Q's bytes (+ the 2 metrics).
  auto low = []() -> std::shared_ptr<dp::dist::CommHook> {
    samples::LowRankOptions lo;
    lo.rank = 2, lo.start_step = 0;
    return std::make_shared<samples::LowRankHook>(lo);
  };
  const auto compressed = train_hybrid(3, big, low, 1 << 20, 25 << 20);
  CHECK(compressed[1].params == compressed[0].params);
  const int64_t n = gradient_bytes(big) / 4;
  const int64_t cols = static_cast<int64_t>(std::ceil(std::sqrt(double(n))));
  for (int64_t bytes : compressed[0].comm_bytes)
    CHECK(bytes == ((n + cols - 1) / cols + cols) * 2 * 4 + 2 * 4);
  CHECK(exact_ref[0].comm_bytes[0] == (n + 2) * 4);
}

TEST_CASE(
    "hybrid.comm_hook: a node whose step fails leaves the nodes' group: the others fail at once") {
  // Node 0 (cpu:0, cpu:1) fails in its hook over the nodes at its first bucket, while node 1
  // (cpu:2) waits in that bucket's sum for it. Node 0 leaves the group as a dead node would
  // (CrossNode::abort), so node 1's step fails at once, not at the group's 60 s timeout.
  class Failing : public dp::dist::CommHook {
   public:
    std::string name() const override { return "failing"; }
    std::shared_ptr<dp::dist::Work> reduce(dp::dist::GradBucket& b) override {
      DP_CHECK(b.group->rank() != 0, "the hook of node 0 failed");
      return b.group->all_reduce(b.grad);
    }
  };
  const std::vector<std::vector<int>> node_devices = {{0, 1}, {2}};
  std::vector<std::string> errors(2);
  // Node 0 hosts the store that holds its note (rank 0 of the group, as under torchrun): it
  // stays up until node 1 has read it (the note of a host that is gone is lost, and its error
  // says a peer closed its connection instead).
  std::promise<void> node1_failed;
  std::shared_future<void> node1_done = node1_failed.get_future().share();
  const auto t0 = std::chrono::steady_clock::now();
  run_ranks(
      2,
      [&](int r, dp::dist::ProcessGroup& pg) {
        std::vector<Device> on;
        for (int d : node_devices[r]) on.push_back(Device::cpu(d));
        auto m = nn::mlp({6, 8, 5});
        m->materialize(on[0], 3);
        nn::SGD opt(*m, dp_test::momentum_sgd());
        dp::DataParallelOptions o;
        o.cross_node = std::make_shared<dp::dist::GroupCrossNode>(pg, std::make_shared<Failing>());
        dp::DataParallel engine(m, opt, on, o);
        auto [x, y] = dp_test::toy_batch(12, 1);
        errors[r] = dp_test::error_of([&] { engine.train_step(x, y); });
        if (r == 1) node1_failed.set_value();
        if (r == 0)  // this node's later steps are refused, naming the failure
          CHECK(dp_test::error_of([&] { engine.train_step(x, y); })
                    .find("this node left their collectives' group in an earlier step, when "
                          "device cpu:0 failed: hybrid: comm hook 'failing' (bucket 0) threw: "
                          "the hook of node 0 failed") != std::string::npos);
        if (r == 0)  // and so is an evaluation, which sums over the nodes
          CHECK(dp_test::error_of([&] {
                  engine.evaluate(x, y);
                }).find("evaluate: this node left their collectives' group") != std::string::npos);
        if (r == 0)
          CHECK(node1_done.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
      },
      [&](int r) { return Device::cpu(node_devices[r][0]); });
  CAPTURE(errors[0]);
  CAPTURE(errors[1]);
  CHECK(errors[0].find("the hook of node 0 failed") != std::string::npos);
  CHECK(errors[1].find("rank 1 of 2") != std::string::npos);  // its own op, failed by the peer
  // Node 0 recorded why it left (CrossNode::abort): node 1's error names it.
  CHECK(errors[1].find("(rank 0 failed first: device cpu:0 failed: hybrid: comm hook 'failing' "
                       "(bucket 0) threw: the hook of node 0 failed") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

namespace {

// The threaded engine on cpu:0..devices-1 trains `make`'s model for `steps` SGD steps on one toy
// batch of `batch` rows, its gradients meeting through `hook` (one per device, over an in-process
// group: dp::dist::device_reducers), or through the star without one. Returns device 0's weights,
// the losses and each step's reducer bytes.
RankRun train_dp(int devices, int steps, int64_t batch, const std::function<nn::ModulePtr()>& make,
                 const std::function<std::shared_ptr<dp::dist::CommHook>(int)>& hook,
                 dp::Graphs graphs = dp::Graphs::off, int64_t first_bucket = 256,
                 int64_t cap = 512) {
  std::vector<Device> on;
  for (int i = 0; i < devices; ++i) on.push_back(Device::cpu(i));
  return train_threaded(
      on, make, first_bucket, cap,
      [&](dp::DataParallelOptions& o) {
        o.graphs = graphs;
        if (hook) o.reducers = dp::dist::device_reducers(devices, hook);
      },
      steps, batch, &dp::StepStats::reducer_bytes);
}

}  // namespace

TEST_CASE("dp.comm_hook: a hook under the threaded engine: the star's training, bytes counted") {
  auto small = [] { return nn::mlp({6, 16, 5}); };
  SumHooks hooks;
  auto sum_hook = [&](int) { return hooks.make(); };
  const auto& made = hooks.made;
  // 11 rows on 3 devices (4, 4, 3): each device's gradient weighted by its share, as the star's.
  const RankRun star = train_dp(3, 4, 11, small, nullptr);
  const RankRun summed = train_dp(3, 4, 11, small, sum_hook);
  REQUIRE(made.size() == 3);
  // The all-reduce adds the weighted gradients in another order than the star's fused sum.
  CHECK(dp_test::rel_diff(summed.params, star.params) <= 1e-5f);
  for (size_t s = 0; s < star.losses.size(); ++s)
    CHECK(summed.losses[s] == doctest::Approx(star.losses[s]).epsilon(1e-5));
  CHECK(summed.losses.back() < summed.losses.front());  // it trains
  for (const auto& h : made) {  // the same buckets (two or more) every step, on every device
    CHECK(h->calls == made[0]->calls);
    CHECK(h->calls % 4 == 0);
    CHECK(h->calls >= 2 * 4);
  }
  // Each device hands its whole gradient to the all-reduce once a step; the star counts none.
  for (int64_t bytes : summed.comm_bytes) CHECK(bytes == 3 * gradient_bytes(small));
  for (int64_t bytes : star.comm_bytes) CHECK(bytes == 0);
  // Graphs asked for: the step runs uncaptured (a hook runs host code), with the same result.
  const RankRun graphed = train_dp(3, 4, 11, small, sum_hook, dp::Graphs::on);
  CHECK(graphed.params == summed.params);

  // PowerSGD at rank 2 from the first step, one bucket: device 0 steps with the approximation,
  // on P and Q's bytes from each device, and still learns.
  auto big = [] { return nn::mlp({6, 64, 64, 5}); };
  auto low = [](int) -> std::shared_ptr<dp::dist::CommHook> {
    samples::LowRankOptions lo;
    lo.rank = 2, lo.start_step = 0;
    return std::make_shared<samples::LowRankHook>(lo);
  };
  const RankRun compressed = train_dp(2, 6, 12, big, low, dp::Graphs::off, 1 << 20, 25 << 20);
  const int64_t n = gradient_bytes(big) / 4;
  const int64_t cols = static_cast<int64_t>(std::ceil(std::sqrt(double(n))));
  CHECK(compressed.losses.back() < compressed.losses.front());
  for (int64_t bytes : compressed.comm_bytes)
    CHECK(bytes == 2 * ((n + cols - 1) / cols + cols) * 2 * 4);
}

TEST_CASE("dp.comm_hook: refusals: a batch that leaves a device idle, a reducer per device") {
  auto sum = [](int) -> std::shared_ptr<dp::dist::CommHook> { return std::make_shared<SumHook>(); };
  std::vector<Device> on = {Device::cpu(0), Device::cpu(1), Device::cpu(2)};
  auto m = nn::mlp({6, 8, 5});
  m->materialize(on[0], 3);
  nn::SGD opt(*m, dp_test::momentum_sgd());
  dp::DataParallelOptions o;
  o.reducers = dp::dist::device_reducers(2, sum);
  CHECK(dp_test::error_of([&] {
          dp::DataParallel engine(m, opt, on, o);
        }).find("2 reducers for 3 devices") != std::string::npos);
  o.reducers = dp::dist::device_reducers(3, sum);
  o.comm_dtype = DType::bf16;
  CHECK(dp_test::error_of([&] {
          dp::DataParallel engine(m, opt, on, o);
        }).find("reducers with comm dtype bf16") != std::string::npos);
  o.comm_dtype = DType::f32;
  dp::DataParallel engine(m, opt, on, o);
  auto [x, y] = dp_test::toy_batch(2, 1);
  CHECK(dp_test::error_of([&] {
          engine.train_step(x, y);
        }).find("a batch of 2 rows leaves 1 of 3 devices without rows") != std::string::npos);
  auto [x3, y3] = dp_test::toy_batch(3, 1);  // the refusal lost nothing: the engine trains on
  CHECK(std::isfinite(engine.train_step(x3, y3).loss));
}

TEST_CASE(
    "dp.comm_hook: a hook that fails on one device ends the step at once, not at the timeout") {
  // Device 1's hook throws at its first bucket while device 0 waits in its all-reduce for it.
  // Device 1 then leaves the group as a dead rank would (CrossNode::abort): device 0's op fails
  // at once, long before the group's 60 s timeout, and the step reports device 1's error.
  class Failing : public dp::dist::CommHook {
   public:
    explicit Failing(int device) : device_(device) {}
    std::string name() const override { return "failing"; }
    std::shared_ptr<dp::dist::Work> reduce(dp::dist::GradBucket& b) override {
      DP_CHECK(device_ != 1 || failed_++ > 0, "the hook of device 1 failed");
      return b.group->all_reduce(b.grad);
    }

   private:
    int device_;
    int failed_ = 0;
  };
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::vector<Device> on = {Device::cpu(0), Device::cpu(1)};
    auto m = nn::mlp({6, 8, 5});
    m->materialize(on[0], 3);
    nn::SGD opt(*m, dp_test::momentum_sgd());
    dp::DataParallelOptions o;
    o.reducers = dp::dist::device_reducers(
        2, [](int i) { return std::make_shared<Failing>(i); }, std::chrono::seconds(60));
    dp::DataParallel engine(m, opt, on, o);
    auto [x, y] = dp_test::toy_batch(4, 1);
    const std::string first = dp_test::error_of([&] { engine.train_step(x, y); });
    CHECK(first.find("the hook of device 1 failed") != std::string::npos);
    CHECK(first.find("cpu:1") != std::string::npos);
    // The group is gone for good: the next step is refused up front, naming the failure.
    const std::string next = dp_test::error_of([&] { engine.train_step(x, y); });
    CHECK(next.find("train_step: research code's reducers left their collectives' group") !=
          std::string::npos);
    CHECK(next.find("device cpu:1 failed: DP: comm hook 'failing' (bucket 0) threw: the hook of "
                    "device 1 failed") != std::string::npos);
    // An evaluation does not use the reducers: it still runs.
    CHECK(std::isfinite(engine.evaluate(x, y).loss));
  }  // the engine and its group are gone too
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}
