// CUDA ops: the CUDA (cuBLASLt, cuDNN, CUB) backend of kernels/ops.hpp. Signatures mirror
// kernels::cpu::*; contracts and argument checks live in kernels/ops.hpp and kernels/ops.cpp, so
// these functions assume valid arguments on one CUDA device. Each queues its work on ctx's stream
// (ctx.device() is the tensors' device) and checks every launch. This header is plain C++: ops.cpp
// includes it in CUDA builds.
#pragma once

#include "kernels/ops.hpp"
#include "kernels/tensor_ops.hpp"

namespace kernels::cuda {

// Lookups of a context's plan caches: found a cached plan (hit) or built one (miss).
struct PlanCounts {
  int64_t hits = 0, misses = 0;
};
PlanCounts gemm_plan_counts(DeviceContext& ctx);  // cuBLASLt matmul plans
PlanCounts conv_plan_counts(DeviceContext& ctx);  // cuDNN convolution plans (all three passes)

// f32/f16/bf16 conversion on one GPU. Byte copies between devices (H2D, D2H, D2D, peer) are
// the runtime's copy_bytes (kernels/runtime/memory.hpp).
void cast(Tensor& dst, const Tensor& src, DeviceContext& ctx);
void fill(Tensor& y, float value, DeviceContext& ctx);
void add(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx);
void mul(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx);
void scale(Tensor& y, const Tensor& x, Scalar alpha, DeviceContext& ctx);
void axpy(Tensor& y, Scalar alpha, const Tensor& x, DeviceContext& ctx);
void add_bias(Tensor& y, const Tensor& bias, DeviceContext& ctx);
void bias_backward(Tensor& db, const Tensor& dy, Accumulate acc, DeviceContext& ctx);
void gemm(Tensor& c, const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, float alpha,
          float beta, const Tensor& bias, DeviceContext& ctx);
void relu(Tensor& y, const Tensor& x, DeviceContext& ctx);
void relu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc,
                   DeviceContext& ctx);
void gelu(Tensor& y, const Tensor& x, DeviceContext& ctx);
void gelu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc,
                   DeviceContext& ctx);
void tanh(Tensor& y, const Tensor& x, DeviceContext& ctx);
void tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc,
                   DeviceContext& ctx);
// pointwise.cu: b broadcast over a's leading dims (b.numel() divides a.numel()).
void add_trailing(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx);
void mul_trailing(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx);
void sum_leading(Tensor& out, const Tensor& x, Accumulate acc, DeviceContext& ctx);
void sigmoid(Tensor& y, const Tensor& x, DeviceContext& ctx);
void sigmoid_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc,
                      DeviceContext& ctx);
void exp(Tensor& y, const Tensor& x, DeviceContext& ctx);
void gelu_tanh(Tensor& y, const Tensor& x, DeviceContext& ctx);
void gelu_tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc,
                        DeviceContext& ctx);
void gemm_gelu_tanh(Tensor& y, Tensor& pre, const Tensor& a, Transpose ta, const Tensor& b,
                    Transpose tb, const Tensor& bias, DeviceContext& ctx);
void gemm_gelu_tanh_backward(Tensor& dpre, Tensor& dbias, Accumulate bias_acc, const Tensor& dy,
                             Transpose tdy, const Tensor& w, Transpose tw, const Tensor& pre,
                             DeviceContext& ctx);
void linear_param_grads(Tensor& dw, Tensor& dbias, const Tensor& dy, const Tensor& x,
                        const Tensor& dy_for_bias, DeviceContext& ctx);
void embedding_forward(Tensor& y, const Tensor& ids, const Tensor& table, DeviceContext& ctx);
void embedding_backward(Tensor& dtable, const Tensor& dy, const Tensor& ids, DeviceContext& ctx);
void attention_forward(Tensor& y, Tensor& lse, const Tensor& qkv, const AttentionParams& p,
                       DeviceContext& ctx);
void attention_backward(Tensor& dqkv, const Tensor& dy, const Tensor& qkv, const Tensor& y,
                        const Tensor& lse, const AttentionParams& p, DeviceContext& ctx);
void token_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                         int32_t ignore_index, Tensor& correct, const Scalar& grad_scale,
                         const Tensor& kept, DeviceContext& ctx);
void count_kept(Tensor& out, const Tensor& targets, int32_t ignore_index, DeviceContext& ctx);
void softmax_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits,
                           const Tensor& labels, const Tensor& weights, float label_smoothing,
                           Tensor& correct, const Scalar& grad_scale, DeviceContext& ctx);
void mse_loss(Tensor& loss, Tensor& dpred, const Tensor& pred, const Tensor& target,
              DeviceContext& ctx);
void sum(Tensor& out, const Tensor& x, DeviceContext& ctx);
void mean(Tensor& out, const Tensor& x, DeviceContext& ctx);
void sum_squares(Tensor& out, const Tensor& x, DeviceContext& ctx);
void clip_by_norm(Tensor& grads, Tensor& norm_out, const Tensor& sum_squares, float max_norm,
                  Scalar unscale, DeviceContext& ctx);
void argmax(Tensor& out, const Tensor& x, DeviceContext& ctx);
int64_t count_correct(const Tensor& logits, const Tensor& labels, DeviceContext& ctx);
void count_correct_into(Tensor& out, const Tensor& logits, const Tensor& labels,
                        DeviceContext& ctx);
void weighted_sum(Tensor& y, Scalar y_weight, const std::vector<Tensor>& xs,
                  const std::vector<Scalar>& weights, DeviceContext& ctx);
void conv2d_forward(Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& p,
                    DeviceContext& ctx);
void conv2d_backward_data(Tensor& dx, const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                          Accumulate acc, DeviceContext& ctx);
void conv2d_backward_filter(Tensor& dw, const Tensor& dy, const Tensor& x, const Conv2dParams& p,
                            Accumulate acc, DeviceContext& ctx);
void max_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p, DeviceContext& ctx);
void max_pool2d_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                         const Pool2dParams& p, Accumulate acc, DeviceContext& ctx);
void avg_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p, DeviceContext& ctx);
void avg_pool2d_backward(Tensor& dx, const Tensor& dy, const Pool2dParams& p, Accumulate acc,
                         DeviceContext& ctx);
void batch_norm_forward_train(Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                              Tensor& running_mean, Tensor& running_var, const Tensor& x,
                              const Tensor& gamma, const Tensor& beta, float momentum, float eps,
                              DeviceContext& ctx);
void batch_norm_forward_eval(Tensor& y, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             const Tensor& running_mean, const Tensor& running_var, float eps,
                             DeviceContext& ctx);
void batch_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, Accumulate acc, DeviceContext& ctx);
void layer_norm_forward(Tensor& y, Tensor& save_mean, Tensor& save_rstd, const Tensor& x,
                        const Tensor& gamma, const Tensor& beta, float eps, DeviceContext& ctx);
void layer_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_rstd, Accumulate acc, DeviceContext& ctx);
void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& save_mean, Tensor& save_rstd,
                            const Tensor& a, const Tensor& b, const Tensor& gamma,
                            const Tensor& beta, float eps, DeviceContext& ctx);
void layer_norm_backward_add(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                             const Tensor& dskip, const Tensor& x, const Tensor& gamma,
                             const Tensor& save_mean, const Tensor& save_rstd, Accumulate acc,
                             DeviceContext& ctx);
void rms_norm_forward(Tensor& y, Tensor& save_rstd, const Tensor& x, const Tensor& gamma, float eps,
                      DeviceContext& ctx);
void rms_norm_backward(Tensor& dx, Tensor& dgamma, const Tensor& dy, const Tensor& x,
                       const Tensor& gamma, const Tensor& save_rstd, Accumulate acc,
                       DeviceContext& ctx);
void swiglu_forward(Tensor& y, const Tensor& h, DeviceContext& ctx);
void swiglu_backward(Tensor& dh, const Tensor& dy, const Tensor& h, DeviceContext& ctx);
void rotary_embedding(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                      int64_t columns, Rotation rotation, DeviceContext& ctx);
void set_counter(Tensor& dst, uint64_t value, DeviceContext& ctx);
void dropout_forward(Tensor& y, Tensor& mask, const Tensor& x, float p, uint64_t seed,
                     RngOffset offset, DeviceContext& ctx);
void set_values(Tensor& dst, const Values& values, DeviceContext& ctx);
void sgd_update(Tensor& params, const Tensor& grads, Tensor& momentum_buf, const SgdConfig& c,
                const Tensor& scalars, DeviceContext& ctx);
// group_of undefined: every element in group 0.
void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const Tensor& group_of,
                  const AdamWConfig& c, const Tensor& scalars, DeviceContext& ctx);
bool all_finite(const Tensor& x, DeviceContext& ctx);
void non_finite_into(Tensor& flag, const Tensor& x, DeviceContext& ctx);

// The CUDA libraries as found at run time (kernels::library_versions).
std::vector<std::pair<std::string, std::string>> library_versions();

// tensor_ops.cu: the broadcasting op set (kernels/tensor_ops.hpp), arguments resolved by
// kernels/tensor_ops.cpp (mirrors kernels/cpu/tensor_ops.cpp). Layouts are in the output's index
// space (y's for forward ops, dy's for backward ops): the output's shape with each operand's
// strides, 0 where it broadcasts. Reductions and softmax see x as (outer, n, inner) with the
// reduced dim n.
void unary(Tensor& y, const Tensor& x, UnaryOp op, UnaryParams p, DeviceContext& ctx);
void unary_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, UnaryOp op,
                    UnaryParams p, Accumulate acc, DeviceContext& ctx);
void binary(Tensor& y, const Tensor& a, const Layout& a_in_y, const Tensor& b, const Layout& b_in_y,
            BinaryOp op, DeviceContext& ctx);
// d's layout in dy's index space has stride 0 on the dims it is summed over (d contiguous).
void binary_backward(Tensor& d, const Layout& d_in_dy, Operand which, const Tensor& dy,
                     const Tensor& a, const Layout& a_in_dy, const Tensor& b, const Layout& b_in_dy,
                     BinaryOp op, Accumulate acc, DeviceContext& ctx);
void where(Tensor& y, const Tensor& mask, const Layout& mask_in_y, const Tensor& a,
           const Layout& a_in_y, const Tensor& b, const Layout& b_in_y, DeviceContext& ctx);
void where_backward(Tensor& d, const Layout& d_in_dy, Operand which, const Tensor& dy,
                    const Tensor& mask, const Layout& mask_in_dy, Accumulate acc,
                    DeviceContext& ctx);
void reduce(Tensor& y, const Tensor& x, int64_t outer, int64_t n, int64_t inner, ReduceOp op,
            DeviceContext& ctx);
void reduce_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, int64_t outer,
                     int64_t n, int64_t inner, ReduceOp op, Accumulate acc, DeviceContext& ctx);
void softmax(Tensor& y, const Tensor& x, int64_t outer, int64_t n, int64_t inner, Softmax kind,
             DeviceContext& ctx);
void softmax_backward(Tensor& dx, const Tensor& dy, const Tensor& y, int64_t outer, int64_t n,
                      int64_t inner, Softmax kind, Accumulate acc, DeviceContext& ctx);
void strided_copy(Tensor& dst, const Layout& dst_view, const Tensor& src, const Layout& src_view,
                  Accumulate acc, DeviceContext& ctx);

}  // namespace kernels::cuda
