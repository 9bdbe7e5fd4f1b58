// Dropout with a counter-based mask: element i keeps iff philox::uniform(seed, offset + i) >= p,
// the same formula as the CUDA kernel, so masks agree bit for bit across devices and threads.
#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/philox.hpp"

namespace kernels::cpu {

void dropout_forward(Tensor& y, Tensor& mask, const Tensor& x, float p, uint64_t seed,
                     RngOffset at) {
  const uint64_t offset = at.read();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  float* pm = mask.data<float>();
  float keep_scale = 1.f / (1.f - p);
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
        py[i] = px[i] * pm[i];
      }
    }
  });
}

void set_counter(Tensor& dst, uint64_t value) {
  dst.data<int64_t>()[0] = static_cast<int64_t>(value);
}

}  // namespace kernels::cpu
