#include <algorithm>

#include <tbb/parallel_for.h>

#include "kernels/cpu/cpu_ops.hpp"

namespace kernels::cpu {

namespace {
// Reads element i of a floating tensor as float.
inline float load(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::f32:
      return t.data<float>()[i];
    case DType::f16:
      return f16_to_f32(t.data<uint16_t>()[i]);
    case DType::bf16:
      return bf16_to_f32(t.data<uint16_t>()[i]);
    default:
      return 0.f;
  }
}
inline void store(Tensor& t, int64_t i, float v) {
  switch (t.dtype()) {
    case DType::f32:
      t.data<float>()[i] = v;
      break;
    case DType::f16:
      t.data<uint16_t>()[i] = f32_to_f16(v);
      break;
    case DType::bf16:
      t.data<uint16_t>()[i] = f32_to_bf16(v);
      break;
    default:
      break;
  }
}
constexpr int64_t kGrain = 1 << 14;
}  // namespace

void cast(Tensor& dst, const Tensor& src) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, dst.numel(), kGrain), [&](auto r) {
    for (int64_t i = r.begin(); i < r.end(); ++i) store(dst, i, load(src, i));
  });
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
