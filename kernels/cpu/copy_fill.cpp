#include <algorithm>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

// Between f32, f16 and bf16 (f16 into bf16 too: each side's storage type is chosen on its own):
// the pointers and storage types taken once per call, not per element, each value rounded once.
void cast(Tensor& dst, const Tensor& src) {
  with_storage(
      [&](auto d_t) {
        with_storage(
            [&](auto s_t) {
              const auto* ps = src.data<decltype(s_t)>();
              auto* pd = dst.data<decltype(d_t)>();
              parallel_range(dst.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
                float buf[kConvertBlock];  // through f32 blocks (cpu_util.hpp)
                for (int64_t b = begin; b < end; b += kConvertBlock) {
                  const int64_t m = std::min(kConvertBlock, end - b);
                  store_block(pd + b, widen_block(ps + b, m, buf), m);
                }
              });
            },
            src.dtype());
      },
      dst.dtype());
}

void fill(Tensor& y, float value) {
  int64_t n = y.numel();
  switch (y.dtype()) {
    case DType::f32:
      std::fill_n(y.data<float>(), n, value);
      break;
    case DType::f16:
      std::fill_n(y.data<uint16_t>(), n, f32_to_f16(value));
      break;
    case DType::bf16:
      std::fill_n(y.data<uint16_t>(), n, f32_to_bf16(value));
      break;
    case DType::i32:
      std::fill_n(y.data<int32_t>(), n, static_cast<int32_t>(value));
      break;
    case DType::i64:
      std::fill_n(y.data<int64_t>(), n, static_cast<int64_t>(value));
      break;
    case DType::u8:
      std::fill_n(y.data<uint8_t>(), n, static_cast<uint8_t>(value));
      break;
  }
}

}  // namespace kernels::cpu
