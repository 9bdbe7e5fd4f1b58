// Dropout with a counter-based mask: element i keeps iff philox::uniform(seed, offset + i) >= p,
// the same formula as kernels/cpu/dropout.cpp, so masks agree bit for bit across devices.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/philox.hpp"

namespace kernels::cuda {

namespace {

// One thread per Philox block: block b serves the four counters 4b .. 4b + 3 (the layout of
// philox::random_u32), i.e. elements counter - offset that fall in [0, n).
// n_blocks: ceil(n / 4) + 1, enough for any offset's alignment (the offset may be the device's).
// Counters are modulo 2^64, as on the CPU: past the last block (2^62 - 1) the next is block 0.
// x and y f32, f16 or bf16 (computed in f32, y rounded once); the mask f32.
template <class Y, class X>
__global__ void dropout_kernel(Y* y, float* mask, const X* x, float p, float keep_scale,
                               uint64_t seed, RngOffsetArg at, int64_t n, int64_t n_blocks) {
  const uint64_t offset = at.get();
  const uint64_t first_block = offset >> 2, last_block = (uint64_t{1} << 62) - 1;
  DP_GRID_STRIDE_LOOP(t, n_blocks) {
    const uint64_t block = (first_block + static_cast<uint64_t>(t)) & last_block;
    philox::Uint4 r = philox::philox4x32(seed, block);
    const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint64_t element = block * 4 + j - offset;  // modulo 2^64
      if (element >= static_cast<uint64_t>(n)) continue;
      const auto i = static_cast<int64_t>(element);
      // philox::uniform: 24 random bits, exactly representable in f32.
      float u = static_cast<float>(words[j] >> 8) * (1.0f / 16777216.0f);
      float m = u >= p ? keep_scale : 0.f;
      mask[i] = m;
      y[i] = from_float<Y>(to_float(x[i]) * m);
    }
  }
}

}  // namespace

void dropout_forward(Tensor& y, Tensor& mask, const Tensor& x, float p, uint64_t seed,
                     RngOffset offset, DeviceContext& ctx) {
  NvtxRange range("kernels/dropout_forward");
  require_floating("dropout_forward", {&y, &x});
  require_f32("dropout_forward", mask);
  int64_t n = x.numel();
  if (n == 0) return;
  float keep_scale = 1.f / (1.f - p);  // as the CPU backend computes it
  const int64_t n_blocks = (n + 3) / 4 + 1;
  with_storage(
      [&](auto y_t, auto x_t) {
        dropout_kernel<<<blocks_for(n_blocks), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), mask.data<float>(), x.data<decltype(x_t)>(), p, keep_scale,
            seed, RngOffsetArg::of(offset), n, n_blocks);
      },
      y.dtype(), x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

namespace {
__global__ void set_counter_kernel(int64_t* dst, int64_t value) {
  *dst = value;
}
}  // namespace

void set_counter(Tensor& dst, uint64_t value, DeviceContext& ctx) {
  NvtxRange range("kernels/set_counter");
  set_counter_kernel<<<1, 1, 0, stream_of(ctx)>>>(dst.data<int64_t>(), static_cast<int64_t>(value));
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
