// Dropout with a counter-based mask: element i keeps iff philox::uniform(seed, offset + i) >= p,
// the same formula as the CUDA kernel, so masks agree bit for bit across devices and threads.
#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/philox.hpp"

namespace kernels::cpu {

// x and y f32, f16 or bf16 (computed in f32, y rounded once); the mask f32.
void dropout_forward(Tensor& y, Tensor& mask, const Tensor& x, float p, uint64_t seed,
                     RngOffset at) {
  const uint64_t offset = at.read();
  float* pm = mask.data<float>();
  float keep_scale = 1.f / (1.f - p);
  with_storage(
      [&](auto y_t, auto x_t) {
        const auto* px = x.data<decltype(x_t)>();
        auto* py = y.data<decltype(y_t)>();
        parallel_range(x.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          // One Philox block serves four consecutive counters (philox::random_u32's layout).
          int64_t i = begin;
          while (i < end) {
            uint64_t counter = offset + static_cast<uint64_t>(i);
            philox::Uint4 block = philox::philox4x32(seed, counter >> 2);
            const uint32_t words[4] = {block.x, block.y, block.z, block.w};
            for (uint64_t word = counter & 3u; word < 4 && i < end; ++word, ++i) {
              float u = static_cast<float>(words[word] >> 8) * (1.0f / 16777216.0f);
              pm[i] = u >= p ? keep_scale : 0.f;
              store_rounded(py[i], load_f32(px[i]) * pm[i]);
            }
          }
        });
      },
      y.dtype(), x.dtype());
}

void set_counter(Tensor& dst, uint64_t value) {
  dst.data<int64_t>()[0] = static_cast<int64_t>(value);
}

}  // namespace kernels::cpu
