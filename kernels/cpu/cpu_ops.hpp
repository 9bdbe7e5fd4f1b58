// CPU ops: the CPU (oneTBB + OpenBLAS) backend of kernels/ops.hpp. Signatures mirror
// kernels::cuda::*; contracts and argument checks live in kernels/ops.hpp and kernels/ops.cpp, so
// these functions assume valid arguments on host memory. They are called inside the device
// context's tbb::task_arena (ops.cpp arranges it).
#pragma once

#include "kernels/ops.hpp"
#include "kernels/tensor_ops.hpp"

namespace kernels::cpu {

// f32/f16/bf16 conversion on one device (same-dtype copies are the runtime's copy_bytes).
void cast(Tensor& dst, const Tensor& src);
void fill(Tensor& y, float value);
void add(Tensor& y, const Tensor& a, const Tensor& b);
void mul(Tensor& y, const Tensor& a, const Tensor& b);
void scale(Tensor& y, const Tensor& x, Scalar alpha);
void axpy(Tensor& y, Scalar alpha, const Tensor& x);
void add_bias(Tensor& y, const Tensor& bias);
void bias_backward(Tensor& db, const Tensor& dy, Accumulate acc);
void gemm(Tensor& c, const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, float alpha,
          float beta, const Tensor& bias);
void relu(Tensor& y, const Tensor& x);
void relu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc);
void gelu(Tensor& y, const Tensor& x);
void gelu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc);
void tanh(Tensor& y, const Tensor& x);
void tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc);
// pointwise.cpp: b broadcast over a's leading dims (b.numel() divides a.numel()).
void add_trailing(Tensor& y, const Tensor& a, const Tensor& b);
void mul_trailing(Tensor& y, const Tensor& a, const Tensor& b);
void sum_leading(Tensor& out, const Tensor& x, Accumulate acc);
void sigmoid(Tensor& y, const Tensor& x);
void sigmoid_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc);
void exp(Tensor& y, const Tensor& x);
void gelu_tanh(Tensor& y, const Tensor& x);
void gelu_tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc);
void gemm_gelu_tanh(Tensor& y, Tensor& pre, const Tensor& a, Transpose ta, const Tensor& b,
                    Transpose tb, const Tensor& bias);
void gemm_gelu_tanh_backward(Tensor& dpre, Tensor& dbias, Accumulate bias_acc, const Tensor& dy,
                             Transpose tdy, const Tensor& w, Transpose tw, const Tensor& pre);
void linear_param_grads(Tensor& dw, Tensor& dbias, const Tensor& dy, const Tensor& x,
                        const Tensor& dy_for_bias);
void embedding_forward(Tensor& y, const Tensor& ids, const Tensor& table);
void embedding_backward(Tensor& dtable, const Tensor& dy, const Tensor& ids);
void attention_forward(Tensor& y, Tensor& lse, const Tensor& qkv, const AttentionParams& p);
void attention_backward(Tensor& dqkv, const Tensor& dy, const Tensor& qkv, const Tensor& y,
                        const Tensor& lse, const AttentionParams& p);
void token_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                         int32_t ignore_index, Tensor& correct, const Scalar& grad_scale,
                         const Tensor& kept);
void count_kept(Tensor& out, const Tensor& targets, int32_t ignore_index);
void softmax_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits,
                           const Tensor& labels, const Tensor& weights, float label_smoothing,
                           Tensor& correct, const Scalar& grad_scale);
void mse_loss(Tensor& loss, Tensor& dpred, const Tensor& pred, const Tensor& target);
void sum(Tensor& out, const Tensor& x);
void mean(Tensor& out, const Tensor& x);
void sum_squares(Tensor& out, const Tensor& x);
void clip_by_norm(Tensor& grads, Tensor& norm_out, const Tensor& sum_squares, float max_norm,
                  Scalar unscale);
void argmax(Tensor& out, const Tensor& x);
int64_t count_correct(const Tensor& logits, const Tensor& labels);
void count_correct_into(Tensor& out, const Tensor& logits, const Tensor& labels);
void weighted_sum(Tensor& y, Scalar y_weight, const std::vector<Tensor>& xs,
                  const std::vector<Scalar>& weights);
void conv2d_forward(Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& p);
void conv2d_backward_data(Tensor& dx, const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                          Accumulate acc);
void conv2d_backward_filter(Tensor& dw, const Tensor& dy, const Tensor& x, const Conv2dParams& p,
                            Accumulate acc);
void max_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p);
void max_pool2d_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                         const Pool2dParams& p, Accumulate acc);
void avg_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p);
void avg_pool2d_backward(Tensor& dx, const Tensor& dy, const Pool2dParams& p, Accumulate acc);
void batch_norm_forward_train(Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                              Tensor& running_mean, Tensor& running_var, const Tensor& x,
                              const Tensor& gamma, const Tensor& beta, float momentum, float eps);
void batch_norm_forward_eval(Tensor& y, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             const Tensor& running_mean, const Tensor& running_var, float eps);
void batch_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, Accumulate acc);
void layer_norm_forward(Tensor& y, Tensor& save_mean, Tensor& save_rstd, const Tensor& x,
                        const Tensor& gamma, const Tensor& beta, float eps);
void layer_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_rstd, Accumulate acc);
void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& save_mean, Tensor& save_rstd,
                            const Tensor& a, const Tensor& b, const Tensor& gamma,
                            const Tensor& beta, float eps);
void layer_norm_backward_add(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                             const Tensor& dskip, const Tensor& x, const Tensor& gamma,
                             const Tensor& save_mean, const Tensor& save_rstd, Accumulate acc);
void rms_norm_forward(Tensor& y, Tensor& save_rstd, const Tensor& x, const Tensor& gamma,
                      float eps);
void rms_norm_backward(Tensor& dx, Tensor& dgamma, const Tensor& dy, const Tensor& x,
                       const Tensor& gamma, const Tensor& save_rstd, Accumulate acc);
void swiglu_forward(Tensor& y, const Tensor& h);
void swiglu_backward(Tensor& dh, const Tensor& dy, const Tensor& h);
void rotary_embedding(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                      int64_t columns, Rotation rotation);
void set_counter(Tensor& dst, uint64_t value);
void dropout_forward(Tensor& y, Tensor& mask, const Tensor& x, float p, uint64_t seed,
                     RngOffset offset);
void set_values(Tensor& dst, const Values& values);
void sgd_update(Tensor& params, const Tensor& grads, Tensor& momentum_buf, const SgdConfig& c,
                const Tensor& scalars);
// group_of undefined: every element in group 0.
void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const Tensor& group_of,
                  const AdamWConfig& c, const Tensor& scalars);
bool all_finite(const Tensor& x);
void non_finite_into(Tensor& flag, const Tensor& x);
// The BLAS's own account of itself: "OpenBLAS 0.3.21 DYNAMIC_ARCH ... (kernels: SkylakeX)".
std::string blas_version();

// gemm_bf16.cpp: bf16 x bf16 products on the CPU's bf16 instructions (oneDNN's matmul), where the
// build has oneDNN and the CPU has AVX512_BF16; gemm() widens to f32 otherwise. Enabled unless
// DP_CPU_BF16_GEMM=widen or set_bf16_gemm_enabled(false) (tests and before/after benchmarks).
bool bf16_gemm_enabled();
void set_bf16_gemm_enabled(bool enabled);
// "oneDNN 2.6.3 (bf16 kernels: brg:avx512_core_bf16)", or "" in a build without oneDNN.
std::string bf16_gemm_version();
// Makes (or finds) the calling thread's primitive for one tile shape: false when oneDNN has no
// fast kernel for it. C (m, n, ldc) is f32: C = alpha op(A) op(B) + beta C.
bool bf16_gemm_prepare(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                       int64_t lda, int64_t ldb, float beta, int64_t ldc);
void bf16_gemm_tile(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta,
                    float* c, int64_t ldc);
// gemm.cpp: C (f32) = alpha op(A) op(B) + beta C for bf16 A and B as stored: over gemm.cpp's
// tiles on the bf16 instructions, or widened to f32 where oneDNN has no kernel for a tile shape.
void bf16_gemm(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
               const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
               int64_t ldc);

// tensor_ops.cpp: the broadcasting op set (kernels/tensor_ops.hpp), arguments resolved by
// kernels/tensor_ops.cpp. Layouts are in the output's index space (y's for forward ops, dy's for
// backward ops): the output's shape with each operand's strides, 0 where it broadcasts. Reductions
// and softmax see x as (outer, n, inner) with the reduced dim n.
void unary(Tensor& y, const Tensor& x, UnaryOp op, UnaryParams p);
void unary_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, UnaryOp op,
                    UnaryParams p, Accumulate acc);
void binary(Tensor& y, const Tensor& a, const Layout& a_in_y, const Tensor& b, const Layout& b_in_y,
            BinaryOp op);
// d's layout in dy's index space has stride 0 on the dims it is summed over (d contiguous).
void binary_backward(Tensor& d, const Layout& d_in_dy, Operand which, const Tensor& dy,
                     const Tensor& a, const Layout& a_in_dy, const Tensor& b, const Layout& b_in_dy,
                     BinaryOp op, Accumulate acc);
void where(Tensor& y, const Tensor& mask, const Layout& mask_in_y, const Tensor& a,
           const Layout& a_in_y, const Tensor& b, const Layout& b_in_y);
void where_backward(Tensor& d, const Layout& d_in_dy, Operand which, const Tensor& dy,
                    const Tensor& mask, const Layout& mask_in_dy, Accumulate acc);
void reduce(Tensor& y, const Tensor& x, int64_t outer, int64_t n, int64_t inner, ReduceOp op);
void reduce_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, int64_t outer,
                     int64_t n, int64_t inner, ReduceOp op, Accumulate acc);
void softmax(Tensor& y, const Tensor& x, int64_t outer, int64_t n, int64_t inner, Softmax kind);
void softmax_backward(Tensor& dx, const Tensor& dy, const Tensor& y, int64_t outer, int64_t n,
                      int64_t inner, Softmax kind, Accumulate acc);
void strided_copy(Tensor& dst, const Layout& dst_view, const Tensor& src, const Layout& src_view,
                  Accumulate acc);

}  // namespace kernels::cpu
