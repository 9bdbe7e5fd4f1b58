// kernels::Scalar and kernels::RngOffset read on the device, the same checks on CPU devices
// (test_kernels.cpp) and on a GPU (test_kernels_cuda.cpp): what the engines' captured steps rely on
// for their loss scale and shares.
#pragma once

#include <cstring>
#include <vector>

#include "kernels/runtime/graph.hpp"
#include "tests/test_util.hpp"

namespace dp_test {

inline bool same_floats(const kernels::Tensor& a, const kernels::Tensor& b) {
  const std::vector<float> x = a.to_host_f32(), y = b.to_host_f32();
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// requires ctx the calling thread's current context (a caching one, for the capture).
// Checks, on ctx's device: each op taking a Scalar (scale, axpy, weighted_sum with more sources
// than one CUDA launch takes, clip_by_norm), and dropout with an RngOffset, gives with a device
// value the bits it gives with the same value fixed; a captured sequence replays with the values
// written since its capture; a scalar or base of the wrong shape is refused, naming the op.
inline void check_device_scalars(kernels::DeviceContext& ctx) {
  using kernels::Scalar;
  using kernels::Tensor;
  const kernels::Device d = ctx.device();
  const int64_t n = 70001;
  auto rnd = [&](uint32_t seed) {
    return Tensor::from_vector(random_vector(n, seed, -2.f, 2.f), {n}, d);
  };
  Tensor x = rnd(1), base = rnd(2);
  Tensor slots = Tensor::empty({4}, kernels::DType::f32, d);
  auto write = [&](std::vector<float> v) { kernels::set_values(slots, v.data(), 4); };
  std::vector<Scalar> at;
  for (int k = 0; k < 4; ++k) at.emplace_back(slots.view(k, {1}));

  // The ops, with the scalars fixed (v) or on the device (at); 20 sources: two CUDA launches.
  std::vector<Tensor> xs;
  for (int k = 0; k < 20; ++k) xs.push_back(rnd(10 + k));
  auto ops = [&](Tensor& y, Tensor& g, Tensor& norm, const std::vector<Scalar>& s) {
    kernels::copy(y, base);
    kernels::scale(y, y, s[0]);
    kernels::axpy(y, s[1], x);
    std::vector<Scalar> w;
    for (int k = 0; k < 20; ++k) w.push_back(k % 2 ? s[2] : s[3]);
    kernels::weighted_sum(y, s[3], xs, w);
    kernels::copy(g, x);
    kernels::sum_squares(norm, g);
    kernels::clip_by_norm(g, norm, norm, 1.f, s[2]);
  };
  auto fixed = [](const std::vector<float>& v) { return std::vector<Scalar>(v.begin(), v.end()); };
  auto expect = [&](const std::vector<float>& v, const Tensor& y, const Tensor& g,
                    const Tensor& norm) {
    Tensor ey = Tensor::empty({n}, kernels::DType::f32, d), eg = ey.clone();
    Tensor enorm = Tensor::empty({1}, kernels::DType::f32, d);
    ops(ey, eg, enorm, fixed(v));
    CHECK(same_floats(y, ey));
    CHECK(same_floats(g, eg));
    CHECK(same_floats(norm, enorm));
  };
  Tensor y = Tensor::empty({n}, kernels::DType::f32, d), g = y.clone();
  Tensor norm = Tensor::empty({1}, kernels::DType::f32, d);
  const std::vector<float> first = {0.37f, -1.25f, 1e-2f, 0.5f};
  write(first);
  ops(y, g, norm, at);
  expect(first, y, g, norm);

  // Captured once, replayed with values written after the capture. The clip (a norm near
  // 305 * unscale, against 1) is active at the first unscale, idle at the next, active again.
  ops(y, g, norm, at);  // the caches learn the sizes before the capture
  kernels::Graph graph;
  graph.capture(ctx, [&] { ops(y, g, norm, at); });
  for (const std::vector<float>& v :
       {std::vector<float>{2.f, 0.75f, 1e-6f, -0.125f}, std::vector<float>{-3.f, 4.f, 5.f, 1.f}}) {
    write(v);
    graph.replay();
    expect(v, y, g, norm);
  }

  // Dropout's offset (kernels::RngOffset): a base on the device plus a fixed delta draws the
  // mask of their sum, and a replay draws at the base written since (set_counter).
  Tensor counter = Tensor::empty({1}, kernels::DType::i64, d);
  Tensor dy = y.clone(), dm = y.clone(), ey = y.clone(), em = y.clone();
  auto drop = [&](Tensor& out, Tensor& mask, const kernels::RngOffset& offset) {
    kernels::dropout_forward(out, mask, x, 0.3f, 77, offset);
  };
  kernels::set_counter(counter, (1ull << 33) + 3);
  drop(dy, dm, kernels::RngOffset(counter, 5));
  drop(ey, em, (1ull << 33) + 8);
  CHECK(same_floats(dy, ey));
  CHECK(same_floats(dm, em));
  kernels::Graph drawing;
  drawing.capture(ctx, [&] { drop(dy, dm, kernels::RngOffset(counter, 5)); });
  kernels::set_counter(counter, 1001);
  drawing.replay();
  drop(ey, em, 1006);
  CHECK(same_floats(dm, em));
  CHECK(same_floats(dy, ey));

  Tensor two = Tensor::empty({2}, kernels::DType::f32, d);
  CHECK_THROWS_WITH_AS(drop(dy, dm, kernels::RngOffset(two, 0)),
                       doctest::Contains("dropout_forward: random offset base"), kernels::Error);
  CHECK_THROWS_WITH_AS(kernels::scale(y, y, Scalar(two)), doctest::Contains("scale: scalar alpha"),
                       kernels::Error);
  CHECK_THROWS_WITH_AS(kernels::weighted_sum(y, 1.f, {x}, {Scalar(two)}),
                       doctest::Contains("weighted_sum: scalar weights[k]"), kernels::Error);
}

}  // namespace dp_test
