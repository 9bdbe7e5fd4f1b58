// SyncBatchNorm on CPU devices, replicas as threads (dp/stats_sync.hpp): the same statistics,
// outputs, gradients and running statistics as one BatchNorm over the whole batch.
#include <atomic>
#include <thread>

#include "dp/chunks.hpp"
#include "dp/data_parallel.hpp"
#include "dp/stats_sync.hpp"
#include "nn/nn.hpp"
#include "tests/test_util.hpp"
#include "tests/train_util.hpp"

using namespace kernels;

namespace {

struct Replicated {
  std::vector<std::vector<float>> y, dx, dgamma, dbeta, running_mean, running_var;
};

// Runs `bn` (materialised on cpu:0) on n replicas at once, replica i on rows chunk i of x, with
// dy_i = the global dL/dy of its rows divided by its share (each replica's gradient is of its
// own rows' mean, as in DP and DDP). Returns what each replica computed.
Replicated run_synced(nn::Module& bn, int n, const Tensor& x, const Tensor& dy_global) {
  auto sizes = dp::chunk_sizes(x.dim(0), n);
  dp::ThreadStatsSync sync(n);
  Replicated out;
  for (auto* v : {&out.y, &out.dx, &out.dgamma, &out.dbeta, &out.running_mean, &out.running_var})
    v->resize(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        Device dev = Device::cpu(i);
        DeviceContext ctx(dev, {1});
        ContextScope scope(ctx);
        auto replica = bn.clone_to(dev);
        replica->train();
        nn::set_batch_norm_sync(*replica, sync.participant(i));
        int64_t b = dp::chunk_begin(sizes, i);
        float share = dp::chunk_share(sizes[i], x.dim(0));
        Tensor xi = x.slice(b, b + sizes[i]).to(dev);
        Tensor dyi = dy_global.slice(b, b + sizes[i]).to(dev);
        scale(dyi, dyi, 1.f / share);
        out.y[i] = replica->forward(xi).to_host_f32();
        Tensor dx = replica->backward(dyi);
        scale(dx, dx, share);  // back to the global loss's units
        out.dx[i] = dx.to_host_f32();
        auto params = replica->named_parameters();
        out.dgamma[i] = params[0].second->grad.to_host_f32();
        out.dbeta[i] = params[1].second->grad.to_host_f32();
        auto buffers = replica->named_buffers();
        out.running_mean[i] = buffers[0].second->value.to_host_f32();
        out.running_var[i] = buffers[1].second->value.to_host_f32();
        for (auto& g : out.dgamma[i]) g *= share;
        for (auto& g : out.dbeta[i]) g *= share;
      } catch (...) {
        errors[i] = std::current_exception();
        sync.abort("replica " + std::to_string(i) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

std::vector<float> concat(const std::vector<std::vector<float>>& parts) {
  std::vector<float> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

std::vector<float> summed(const std::vector<std::vector<float>>& parts) {
  std::vector<float> s(parts[0].size(), 0.f);
  for (const auto& p : parts)
    for (size_t k = 0; k < p.size(); ++k) s[k] += p[k];
  return s;
}

}  // namespace

TEST_CASE("dp.sync_bn: 1-4 replicas equal one BatchNorm over the whole batch (uneven too)") {
  for (int n : {1, 2, 3, 4}) {
    for (int64_t batch : {8, 10}) {
      CAPTURE(n);
      CAPTURE(batch);
      auto bn = std::make_shared<nn::BatchNorm2d>(3);
      bn->materialize(Device::cpu(0), 5);
      // Nonzero running statistics and affine parameters, so every term is exercised.
      auto p = bn->named_parameters();
      copy(p[0].second->value, Tensor::from_vector({1.5f, -0.5f, 2.f}, {3}));
      copy(p[1].second->value, Tensor::from_vector({0.1f, 0.2f, -0.3f}, {3}));
      copy(bn->named_buffers()[0].second->value, Tensor::from_vector({0.5f, -1.f, 3.f}, {3}));
      Tensor x = Tensor::from_vector(dp_test::random_vector(batch * 3 * 16, 11, -2.f, 4.f),
                                     {batch, 3, 4, 4});
      Tensor dy = Tensor::from_vector(dp_test::random_vector(batch * 3 * 16, 12), {batch, 3, 4, 4});

      auto ref = bn->clone_to(Device::cpu(0));
      ref->train();
      std::vector<float> y_ref = ref->forward(x).to_host_f32();
      std::vector<float> dx_ref = ref->backward(dy).to_host_f32();
      auto rp = ref->named_parameters();
      auto rb = ref->named_buffers();

      Replicated got = run_synced(*bn, n, x, dy);
      CHECK(dp_test::rel_diff(concat(got.y), y_ref) <= 1e-5f);
      CHECK(dp_test::rel_diff(concat(got.dx), dx_ref) <= 1e-4f);
      CHECK(dp_test::rel_diff(summed(got.dgamma), rp[0].second->grad.to_host_f32()) <= 1e-4f);
      CHECK(dp_test::rel_diff(summed(got.dbeta), rp[1].second->grad.to_host_f32()) <= 1e-4f);
      for (int i = 0; i < n; ++i) {  // the running statistics of the whole batch, everywhere
        CHECK(dp_test::rel_diff(got.running_mean[i], rb[0].second->value.to_host_f32()) <= 1e-5f);
        CHECK(dp_test::rel_diff(got.running_var[i], rb[1].second->value.to_host_f32()) <= 1e-5f);
      }
    }
  }
}

TEST_CASE("dp.sync_bn: gradcheck of the synced layer on 2 CPU devices (finite differences)") {
  auto bn = std::make_shared<nn::BatchNorm1d>(2);
  bn->materialize(Device::cpu(0), 3);
  copy(bn->named_parameters()[0].second->value, Tensor::from_vector({1.3f, -0.7f}, {2}));
  const int64_t batch = 7;  // 4 + 3 rows
  std::vector<float> xv = dp_test::random_vector(batch * 2, 21, -1.f, 1.f);
  Tensor w = Tensor::from_vector(dp_test::random_vector(batch * 2, 22), {batch, 2});
  // The global loss L(x) = sum w * y, computed by the two synced replicas.
  auto loss = [&](const std::vector<float>& v) {
    Replicated r = run_synced(*bn, 2, Tensor::from_vector(v, {batch, 2}), w);
    std::vector<float> y = concat(r.y), wv = w.to_host_f32();
    double l = 0;
    for (size_t k = 0; k < y.size(); ++k) l += double(wv[k]) * y[k];
    return l;
  };
  std::vector<float> dx = concat(run_synced(*bn, 2, Tensor::from_vector(xv, {batch, 2}), w).dx);
  const float h = 1e-2f;
  double worst = 0;
  for (size_t k = 0; k < xv.size(); ++k) {
    std::vector<float> plus = xv, minus = xv;
    plus[k] += h;
    minus[k] -= h;
    double fd = (loss(plus) - loss(minus)) / (2 * h);
    worst = std::max(worst, std::abs(fd - dx[k]) / std::max(1.0, std::abs(fd)));
  }
  CHECK(worst <= 2e-2);
}

TEST_CASE("dp.sync_bn: a replica that fails releases the others with the reason") {
  dp::ThreadStatsSync sync(3);
  std::vector<std::string> errors(2);
  std::vector<std::thread> waiters;
  for (int i = 0; i < 2; ++i)
    waiters.emplace_back([&, i] {
      std::vector<double> v{1.0};
      try {
        sync.participant(i)->all_reduce_sum(v);
      } catch (const Error& e) {
        errors[i] = e.what();
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let them wait (no timing check)
  sync.abort("replica 2 failed in forward");
  for (auto& t : waiters) t.join();
  for (const auto& e : errors) CHECK(e.find("replica 2 failed in forward") != std::string::npos);
  sync.set_participants(2);  // usable again, now with two replicas
  std::vector<double> a{1.0, 2.0}, b{10.0, 20.0};
  std::thread t([&] { sync.participant(1)->all_reduce_sum(b); });
  sync.participant(0)->all_reduce_sum(a);
  t.join();
  CHECK(a == std::vector<double>{11.0, 22.0});
  CHECK(b == a);
}

TEST_CASE("dp.sync_bn: DP on 4 devices with synced BatchNorm follows one device, full batch") {
  const int steps = 3;
  for (int64_t batch : {8, 10}) {  // 10: chunks of 3, 3, 2, 2
    CAPTURE(batch);
    auto ref = nn::resnet(8, 1, 10, 4);
    ref->materialize(Device::cpu(0), 77);
    nn::SGD ref_opt(*ref, dp_test::momentum_sgd());
    std::vector<float> ref_losses;
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = dp_test::image_batch(batch, s);
      ref_losses.push_back(dp_test::single_step(*ref, ref_opt, x, y));
    }
    auto m = nn::resnet(8, 1, 10, 4);
    m->materialize(Device::cpu(0), 77);
    nn::SGD opt(*m, dp_test::momentum_sgd());
    dp::DataParallelOptions o;
    o.batch_norm = dp::BatchNormStats::synced;
    dp::DataParallel engine(m, opt, make_devices(DeviceType::cpu, 4), o);
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = dp_test::image_batch(batch, s);
      CHECK(engine.train_step(x, y).loss == doctest::Approx(ref_losses[s]).epsilon(1e-4));
    }
    CHECK(dp_test::rel_diff(m->flat_params().to_host_f32(), ref->flat_params().to_host_f32()) <=
          1e-4f);
    CHECK(dp_test::rel_diff(m->flat_buffers().to_host_f32(), ref->flat_buffers().to_host_f32()) <=
          1e-4f);
  }
  // Without the sync, each device normalises its own chunk: not the full batch's statistics.
  auto ghost = nn::resnet(8, 1, 10, 4);
  ghost->materialize(Device::cpu(0), 77);
  auto ref = nn::resnet(8, 1, 10, 4);
  ref->materialize(Device::cpu(0), 77);
  nn::SGD g_opt(*ghost, dp_test::momentum_sgd()), r_opt(*ref, dp_test::momentum_sgd());
  dp::DataParallel engine(ghost, g_opt, make_devices(DeviceType::cpu, 4));
  auto [x, y] = dp_test::image_batch(8, 0);
  CHECK(engine.train_step(x, y).loss != doctest::Approx(dp_test::single_step(*ref, r_opt, x, y)));
}

TEST_CASE("dp.sync_bn: a device failing before its BatchNorm releases the others, named") {
  auto armed = std::make_shared<std::atomic<bool>>(true);
  auto s = std::make_shared<nn::Sequential>();
  s->add(std::make_shared<dp_test::Faulty>(Device::cpu(2), armed));
  s->add(std::make_shared<nn::Linear>(6, 8));
  s->add(std::make_shared<nn::BatchNorm1d>(8));
  s->add(std::make_shared<nn::Linear>(8, 5));
  s->materialize(Device::cpu(0), 5);
  nn::SGD opt(*s, dp_test::momentum_sgd());
  dp::DataParallelOptions o;
  o.batch_norm = dp::BatchNormStats::synced;
  dp::DataParallel engine(s, opt, make_devices(DeviceType::cpu, 4), o);
  auto [x, y] = dp_test::toy_batch(12, 1);
  // cpu:2 fails in forward while the others wait for it in the BatchNorm layer: no hang.
  CHECK_THROWS_WITH_AS(engine.train_step(x, y), doctest::Contains("injected fault"), Error);
  *armed = false;
  CHECK(std::isfinite(engine.train_step(x, y).loss));  // usable again
}
