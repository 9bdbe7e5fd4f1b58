// Argument checks and the one dispatch point of every op: CPU ops run inside the device
// context's task arena, CUDA ops get the context (stream, handles) of the calling thread.
#include "kernels/ops.hpp"

#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_ops.hpp"
#if DP_HAVE_CUDA
#include "kernels/cuda/cuda_ops.hpp"
#define DP_CUDA_DISPATCH(call) call
#else
#define DP_CUDA_DISPATCH(call) no_cuda(ctx)
#endif

namespace kernels {

namespace {

[[maybe_unused]] void no_cuda(DeviceContext& ctx) {
  DP_THROW("device " << ctx.device() << " is not usable: " << cuda_unavailable_reason());
}

template <class F>
void run_cpu(DeviceContext& ctx, F&& f) {
  ctx.arena().execute(std::forward<F>(f));
}

[[maybe_unused]] void check_defined(const char* op, const Tensor& t, const char* name) {
  DP_CHECK(t.defined(), op << ": tensor '" << name << "' is undefined");
}

[[maybe_unused]] void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  DP_CHECK(a.device() == b.device(),
           op << ": tensors on different devices: " << a << " vs " << b);
}

}  // namespace

void copy(Tensor& dst, const Tensor& src) {
  check_defined("copy", dst, "dst");
  check_defined("copy", src, "src");
  DP_CHECK(dst.numel() == src.numel(), "copy: " << src << " into " << dst
                                                << ": element counts differ");
  if (dst.device() != src.device())
    DP_CHECK(dst.dtype() == src.dtype(),
             "copy: across devices the dtypes must match: " << src << " into " << dst);
  else if (dst.dtype() != src.dtype())
    DP_CHECK(is_floating(dst.dtype()) && is_floating(src.dtype()),
             "copy: converts only between f32, f16 and bf16: " << src << " into " << dst);
  if (dst.numel() == 0) return;
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    DeviceContext& ctx = context(dst.device());
    return run_cpu(ctx, [&] { cpu::copy(dst, src); });
  }
  DeviceContext& ctx = context(dst.device().is_cuda() ? dst.device() : src.device());
  DP_CUDA_DISPATCH(cuda::copy(dst, src, ctx));
}

void fill(Tensor& y, float value) {
  check_defined("fill", y, "y");
  if (y.numel() == 0) return;
  DeviceContext& ctx = context(y.device());
  if (y.device().is_cpu()) return run_cpu(ctx, [&] { cpu::fill(y, value); });
  DP_CUDA_DISPATCH(cuda::fill(y, value, ctx));
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  DP_CHECK(a.size() == b.size(), "max_abs_diff: sizes differ: " << a.size() << " vs " << b.size());
  float m = 0.f;
  for (size_t i = 0; i < a.size(); ++i) {
    float d = std::fabs(a[i] - b[i]);
    if (std::isnan(d)) return d;
    m = std::max(m, d);
  }
  return m;
}

}  // namespace kernels
