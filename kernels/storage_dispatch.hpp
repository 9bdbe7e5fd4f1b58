// The one storage dispatch of the ops that take 16-bit activations, shared by both backends:
// each backend names its own 16-bit storage types (the CPU's F16/BF16 bit holders in
// kernels/cpu/cpu_util.hpp, CUDA's __half/__nv_bfloat16 in kernels/cuda/cuda_common.cuh) and
// gets one kernel instantiation per combination of storage types.
#pragma once

#include "kernels/runtime/dtype.hpp"

namespace kernels {

namespace detail {
// Appends the storage type of each dtype to Known (f32: float, else Half), then calls f.
template <class Half, class... Known>
struct StorageOf {
  template <class F>
  static void run(F& f) {
    f(Known{}...);
  }
  template <class F, class... Rest>
  static void run(F& f, DType t, Rest... rest) {
    if (t == DType::f32)
      StorageOf<Half, Known..., float>::run(f, rest...);
    else
      StorageOf<Half, Known..., Half>::run(f, rest...);
  }
};
}  // namespace detail

// requires each dtype f32, f16 or bf16, f16 and bf16 not both (ops.cpp checks it).
// ensures f(S...) is called with a value of each dtype's storage type, in order: float for
// f32, F16Storage or BF16Storage for the 16-bit ones.
template <class F16Storage, class BF16Storage, class F, class... D>
void with_storage_of(F&& f, D... dtypes) {
  if (((dtypes == DType::bf16) || ...))
    detail::StorageOf<BF16Storage>::run(f, dtypes...);
  else
    detail::StorageOf<F16Storage>::run(f, dtypes...);
}

}  // namespace kernels
