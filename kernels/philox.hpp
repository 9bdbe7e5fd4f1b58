// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator. The same (key, counter) gives the same numbers on the host and in
// CUDA kernels, so dropout masks and initialisations do not depend on device or thread count.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DP_HOST_DEVICE inline
#endif

namespace kernels::philox {

struct Uint4 {
  uint32_t x, y, z, w;
};

DP_HOST_DEVICE uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Four 32-bit random words for counter `ctr` under key `seed`.
DP_HOST_DEVICE Uint4 philox4x32(uint64_t seed, uint64_t ctr) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  Uint4 c{static_cast<uint32_t>(ctr), static_cast<uint32_t>(ctr >> 32), 0u, 0u};
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo(0xD2511F53u, c.x, &hi0);
    uint32_t lo1 = mulhilo(0xCD9E8D57u, c.z, &hi1);
    c = Uint4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// Word j in [0, 4) of the block for element i: element i uses block i / 4, word i % 4.
DP_HOST_DEVICE uint32_t random_u32(uint64_t seed, uint64_t i) {
  Uint4 r = philox4x32(seed, i >> 2);
  switch (i & 3u) {
    case 0:
      return r.x;
    case 1:
      return r.y;
    case 2:
      return r.z;
    default:
      return r.w;
  }
}

// Uniform in [0, 1) with 24 bits of resolution, exactly representable in f32.
DP_HOST_DEVICE float uniform(uint64_t seed, uint64_t i) {
  return static_cast<float>(random_u32(seed, i) >> 8) * (1.0f / 16777216.0f);
}

// Mixes (seed, a, b) into one key, e.g. (seed, step, device) for dropout.
DP_HOST_DEVICE uint64_t mix_key(uint64_t seed, uint64_t a, uint64_t b = 0) {
  uint64_t h = seed ^ 0x9E3779B97F4A7C15ull;
  h = (h ^ (a + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2))) * 0xBF58476D1CE4E5B9ull;
  h = (h ^ (b + 0x94D049BB133111EBull + (h << 6) + (h >> 2))) * 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

}  // namespace kernels::philox
