// Element-wise reductions and averaging on host memory, for the process groups that reduce on
// the host (Gloo's reduce functions, MPI's user-defined ops for f16 and bf16).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "dp/distributed/process_group.hpp"
#include "kernels/runtime/dtype.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist::host {

using kernels::DType;

// c[i] = a[i] op b[i] for i < n (c may alias a). f16 and bf16 reduce in f32 and round back.
using ReduceFn = std::function<void(void* c, const void* a, const void* b, size_t n)>;

struct SumOp {
  template <class T>
  static T apply(T a, T b) {
    return static_cast<T>(a + b);
  }
};
struct MinOp {
  template <class T>
  static T apply(T a, T b) {
    return b < a ? b : a;
  }
};
struct MaxOp {
  template <class T>
  static T apply(T a, T b) {
    return a < b ? b : a;
  }
};

template <class T, class Op>
inline void reduce_plain(void* c, const void* a, const void* b, size_t n) {
  auto* cc = static_cast<T*>(c);
  const auto* aa = static_cast<const T*>(a);
  const auto* bb = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) cc[i] = Op::apply(aa[i], bb[i]);
}

// f16 and bf16 reduce in f32 and round back.
template <float (*Load)(uint16_t), uint16_t (*Store)(float), class Op>
inline void reduce_half(void* c, const void* a, const void* b, size_t n) {
  auto* cc = static_cast<uint16_t*>(c);
  const auto* aa = static_cast<const uint16_t*>(a);
  const auto* bb = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) cc[i] = Store(Op::apply(Load(aa[i]), Load(bb[i])));
}

template <class Op>
inline ReduceFn reduce_fn_for(DType dt) {
  switch (dt) {
    case DType::f32:
      return reduce_plain<float, Op>;
    case DType::i32:
      return reduce_plain<int32_t, Op>;
    case DType::i64:
      return reduce_plain<int64_t, Op>;
    case DType::u8:
      return reduce_plain<uint8_t, Op>;
    case DType::f16:
      return reduce_half<kernels::f16_to_f32, kernels::f32_to_f16, Op>;
    case DType::bf16:
      return reduce_half<kernels::bf16_to_f32, kernels::f32_to_bf16, Op>;
  }
  DP_THROW("no reduction for dtype " << dt);
}

// requires dt one of f32, f16, bf16, i32, i64, u8; avg reduces as sum (scale afterwards).
inline ReduceFn reduce_fn(DType dt, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return reduce_fn_for<SumOp>(dt);
    case ReduceOp::min:
      return reduce_fn_for<MinOp>(dt);
    case ReduceOp::max:
      return reduce_fn_for<MaxOp>(dt);
  }
  DP_THROW("unknown reduce op");
}

// Averaging: the sum scaled by 1/size, in place.
// requires dt floating. ensures p[i] *= factor for i < n (16-bit types rounded back).
inline void scale_host(void* p, DType dt, int64_t n, float factor) {
  switch (dt) {
    case DType::f32: {
      auto* x = static_cast<float*>(p);
      for (int64_t i = 0; i < n; ++i) x[i] *= factor;
      return;
    }
    case DType::f16: {
      auto* x = static_cast<uint16_t*>(p);
      for (int64_t i = 0; i < n; ++i)
        x[i] = kernels::f32_to_f16(kernels::f16_to_f32(x[i]) * factor);
      return;
    }
    case DType::bf16: {
      auto* x = static_cast<uint16_t*>(p);
      for (int64_t i = 0; i < n; ++i)
        x[i] = kernels::f32_to_bf16(kernels::bf16_to_f32(x[i]) * factor);
      return;
    }
    default:
      DP_THROW("avg of dtype " << dt << " (floating types only)");
  }
}

}  // namespace dp::dist::host
