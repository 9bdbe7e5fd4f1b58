// cuDNN's fused scaled dot-product attention (flash attention), through the cuDNN frontend's
// graph API (kernels/cuda/sdpa.cu): the 16-bit path of kernels::cuda::attention_forward and
// attention_backward (kernels/cuda/attention.cu), which widen to the plain f32 kernels for a
// shape cuDNN refuses. Plain C++: tests include it.
#pragma once

#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.hpp"

namespace kernels::cuda {

// requires qkv (B, T, 3 D) f16 or bf16 and y (B, T, D) of its dtype, lse (B, H, T) f32, all on
// ctx's device, p valid (kernels/ops.hpp). ensures, when cuDNN accepts the shape, dtype and
// mask (head dim D / H a multiple of 8 and at most 128, a GPU and cuDNN with a fused SDPA
// engine): y and lse as kernels::attention_forward (lse = log sum exp of the scaled scores,
// natural log), queued on ctx's stream, and returns true. Otherwise returns false having
// written nothing. Accepting or refusing is decided once per (pass, shape, dtype, scale, mask)
// and context, and logged under DP_LOG=debug.
bool sdpa_forward(Tensor& y, Tensor& lse, const Tensor& qkv, const AttentionParams& p,
                  DeviceContext& ctx);
// requires the forward's qkv, y and lse (lse from sdpa_forward); dy like y, dqkv like qkv.
// ensures, when cuDNN accepts: dqkv = the gradient of sum(y * dy) w.r.t. qkv (overwritten),
// returns true; otherwise false, nothing written.
bool sdpa_backward(Tensor& dqkv, const Tensor& dy, const Tensor& qkv, const Tensor& y,
                   const Tensor& lse, const AttentionParams& p, DeviceContext& ctx);

// Whether this build has the fused path (compiled against the cuDNN frontend's headers).
bool sdpa_built();

// What a context's fused attention did: plan lookups (hits, misses) and calls the fused path
// ran (`fused`) or left to the plain one (`refused`), both passes together.
struct SdpaCounts {
  PlanCounts plans;
  int64_t fused = 0, refused = 0;
  std::vector<std::string> refusals;  // each refused plan's pass, dtype, shape and cuDNN's reason
};
SdpaCounts sdpa_counts(DeviceContext& ctx);
// The cuDNN frontend's version this build was compiled against ("" without it).
std::string sdpa_frontend_version();

}  // namespace kernels::cuda
