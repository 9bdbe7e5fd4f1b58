// The op set. Each op checks its arguments (shape, dtype, device; a mismatch throws
// kernels::Error naming the op and the shapes), then dispatches on the device of its tensors:
// kernels::cpu::* (oneTBB, OpenBLAS) or kernels::cuda::* (cuBLASLt, cuDNN, CUB), which mirror
// each other's signatures. CUDA work is queued on the calling thread's context stream for that
// device (see runtime/context.hpp); ops that return a host value wait for it.
//
// Unless stated otherwise: all tensors of one call live on the same device, floating tensors
// are f32, tensors are contiguous, and outputs are preallocated by the caller with the shape
// given in the contract. Empty tensors (a zero dimension) are valid and do nothing.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/runtime/context.hpp"
#include "kernels/runtime/device.hpp"
#include "kernels/runtime/dtype.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/nvtx.hpp"
#include "kernels/runtime/tensor.hpp"

namespace kernels {

enum class Transpose { no, yes };
// Backward kernels either overwrite their output or add into it (gradients accumulate).
enum class Accumulate { no, yes };
enum class Nesterov { no, yes };

// A factor an op multiplies by: a value fixed when the op is queued, or a (1) f32 tensor on the
// op's device, read when the op runs. The second is how a captured op (kernels/runtime/graph.hpp)
// replays with the current step's value, written there before the replay (set_values): the
// engines' loss scale and each chunk's share.
struct Scalar {
  Scalar(float v = 1.f) : value(v) {}  // NOLINT(google-explicit-constructor): a fixed factor
  explicit Scalar(Tensor t) : at(std::move(t)) {}
  // The device's copy, or nullptr for a fixed value.
  const float* device_value() const { return at.defined() ? at.data<float>() : nullptr; }
  // The factor now. On a CPU device (where an op runs when it is reached, or replays later on
  // the device's thread): the tensor's current value.
  float read() const { return at.defined() ? at.data<float>()[0] : value; }

  float value = 1.f;
  Tensor at;  // defined: read from here when the op runs (`value` unused)
};

// Where a call's random counters start (dropout): `delta`, plus, when `base` is defined ((1) i64
// on the op's device), the value there when the op runs, modulo 2^64. A captured op replays
// with the base written since (set_counter): a graphed step draws new masks each step.
struct RngOffset {
  RngOffset(uint64_t at = 0) : delta(at) {}  // NOLINT(google-explicit-constructor): fixed
  RngOffset(Tensor on_device, uint64_t d) : delta(d), base(std::move(on_device)) {}
  // The base's address, or nullptr for a fixed offset.
  const int64_t* device_base() const { return base.defined() ? base.data<int64_t>() : nullptr; }
  // The offset now (CPU devices: the base's current value).
  uint64_t read() const {
    return delta + (base.defined() ? static_cast<uint64_t>(base.data<int64_t>()[0]) : 0);
  }

  uint64_t delta = 0;
  Tensor base;
};

// ---- copies and elementwise ----------------------------------------------------------------

// requires dst.numel() == src.numel(). Any two devices (H2D, D2H, D2D, peer); across devices
// the dtypes must match, on one device f32/f16/bf16 convert. ensures dst = src, ordered on the
// dst device's stream for H2D/D2D and on the src stream for D2H, waited for when it ends on host.
// A conversion counts one cast on the calling thread's context for the device
// (DeviceContext::casts).
void copy(Tensor& dst, const Tensor& src);
// requires x floating, dtype f32/f16/bf16. ensures a new tensor on x's device holding x
// converted to dtype (a copy when the dtypes match).
Tensor cast(const Tensor& x, DType dtype);
// ensures every element of y = value (any dtype; integer dtypes take the truncated value).
void fill(Tensor& y, float value);
// 16-bit activations: add, mul, add_bias, bias_backward, relu, gelu, gelu_tanh, tanh (and
// their backwards), pooling and dropout_forward also take f16/bf16 tensors, any mix with f32 (one
// 16-bit dtype per call: f16 beside bf16 throws; dropout's mask stays f32). Their kernels read
// 16-bit values as f32, compute as the f32 kernels do, and round each 16-bit output once (an
// accumulating one: read, added to in f32, rounded once): bitwise the f32 op on the widened
// values, rounded once, with no cast and no f32 temporary. scale takes them too (a micro-batch's
// 16-bit loss gradient, weighted). sigmoid, exp and sum_leading are f32 only.

// requires y, a same shape; b a's shape or a's trailing dims (a (N, T, D) with b (D) or (T, D)).
// ensures y = a + b, b broadcast over a's leading dims. Gradient of b: sum_leading.
void add(Tensor& y, const Tensor& a, const Tensor& b);
// requires y, a same shape; b a's shape or a's trailing dims. ensures y = a * b (elementwise, b
// broadcast over a's leading dims, as a per-feature scale).
void mul(Tensor& y, const Tensor& a, const Tensor& b);
// requires out's shape = x's trailing dims (x (N, T, D), out (D) or (T, D)).
// ensures out (+)= sum of x over its leading dims: the gradient of a broadcast b.
void sum_leading(Tensor& out, const Tensor& x, Accumulate acc);
// requires x, y same shape (y may alias x); a device alpha on their device. ensures y = alpha * x.
void scale(Tensor& y, const Tensor& x, Scalar alpha);
// requires x, y same shape; y f32, x f32, f16 or bf16; a device alpha on y's device.
// ensures y += alpha * float(x).
void axpy(Tensor& y, Scalar alpha, const Tensor& x);
// requires y (N, C, ...) and bias (C). ensures y[n, c, ...] += bias[c] (a 16-bit y: read, added
// to in f32, rounded once).
void add_bias(Tensor& y, const Tensor& bias);
// requires dy (N, C, ...) and db (C). ensures db (+)= sum of dy over every dim but 1, summed in
// f32 (CPU: double) in the f32 kernel's order whatever the dtypes (a 16-bit db rounds once).
void bias_backward(Tensor& db, const Tensor& dy, Accumulate acc);

// ---- matrix product ------------------------------------------------------------------------

// requires a, b, c 2-D, op(a) (m, k), op(b) (k, n), c (m, n); bias (n) f32, c's dtype, or
// undefined. a and b are f32, f16 or bf16 (same dtype); c is f32 or a's dtype; accumulation is
// f32.
// ensures c = alpha * op(a) op(b) + beta * c + bias (bias broadcast over rows); as in BLAS, a
// and b are not read when alpha is 0, nor c when beta is 0 (their NaNs do not reach c). On the
// CPU the bias is added in f32 before a 16-bit c is rounded once. On a GPU a 16-bit c takes its
// fastest path (cuBLASLt's bias epilogue, with no rounding kernel) from a bias in its own dtype,
// added in f32 before c is rounded once; an f32 bias is first rounded to c's dtype for it; where
// the epilogue does not run (no algorithm, n odd, a misaligned bias), the product is rounded into
// c, then the bias added and the sum rounded again.
// With MathMode::tf32 on the context, f32 products may use TF32 tensor cores (GPU only).
void gemm(Tensor& c, const Tensor& a, Transpose ta, const Tensor& b, Transpose tb,
          float alpha = 1.f, float beta = 0.f, const Tensor& bias = Tensor());

// ---- activations: y = f(x), and dx (+)= dy * f'(.) -----------------------------------------
// relu, gelu, gelu_tanh, tanh and their backwards: f32, f16 or bf16 (16-bit activations above),
// f computed in f32 from the values read; sigmoid and exp: f32.

void relu(Tensor& y, const Tensor& x);
// requires dx, dy, x same shape. ensures dx (+)= dy * (x > 0).
void relu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc);
// Exact GELU: x * Phi(x) (as PyTorch's default, erf form).
void gelu(Tensor& y, const Tensor& x);
void gelu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc);
void tanh(Tensor& y, const Tensor& x);
// Takes the forward output y: dx (+)= dy * (1 - y^2).
void tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc);
// 1 / (1 + e^-x), without overflow for any x.
void sigmoid(Tensor& y, const Tensor& x);
// Takes the forward output y: dx (+)= dy * y (1 - y).
void sigmoid_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc);
// requires x, y same shape (y may alias x). ensures y = e^x. Backward: mul(dx, dy, y).
void exp(Tensor& y, const Tensor& x);

// GELU, tanh approximation (GPT-2's, PyTorch's approximate="tanh"):
// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_tanh(Tensor& y, const Tensor& x);
// requires dx, dy, x same shape. ensures dx (+)= dy * d gelu_tanh(x) / dx.
void gelu_tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc);

// A Linear's product with the GELU (tanh) after it, as GPT-2's MLP runs them (llm.c: cuBLASLt's
// GELU epilogues), forward and backward.
// Forward: pre = op(a) op(b) + bias (gemm's c, alpha 1, beta 0) and y = gelu_tanh(pre).
// requires y and pre (m, n) of one dtype (gemm's c), a, b and bias as gemm takes them.
// - CPU: gemm into pre, then gelu_tanh(y, pre): the bits of the two ops.
// - CUDA: one GEMM whose epilogue (cuBLASLt's GELU_AUX_BIAS) writes pre and y, y from the f32
//   value before it is rounded into pre, with cuBLASLt's GELU, where cuBLASLt has an algorithm
//   for it; otherwise the two ops.
void gemm_gelu_tanh(Tensor& y, Tensor& pre, const Tensor& a, Transpose ta, const Tensor& b,
                    Transpose tb, const Tensor& bias);
// Backward: dpre = (op(dy) op(w)) * gelu_tanh'(pre), and dbias (+)= dpre's column sums.
// requires dpre and pre (m, n) of one dtype (gemm's c), dy and w as gemm's a and b, dbias (n)
// f32 or undefined (no bias gradient).
// - CPU: gemm into dpre, gelu_tanh_backward in place, bias_backward: the bits of the three ops
//   (the product rounded into dpre's dtype before the derivative multiplies it).
// - CUDA: the three ops by default, their bits. With cuda_dgelu_epilogue(): one GEMM whose
//   epilogue (cuBLASLt's DGELU_BGRAD) applies the derivative to the f32 product and sums the
//   bias gradient, which it rounds into dpre's dtype before it is added to dbias, where cuBLASLt
//   has an algorithm for it; otherwise the three ops.
void gemm_gelu_tanh_backward(Tensor& dpre, Tensor& dbias, Accumulate bias_acc, const Tensor& dy,
                             Transpose tdy, const Tensor& w, Transpose tw, const Tensor& pre);
// Whether CUDA's gemm_gelu_tanh_backward may use cuBLASLt's DGELU_BGRAD epilogue (default: no;
// the environment's DP_CUDA_DGELU=epilogue says yes, =ops says no, any other value is refused
// by the first call, naming it). Why the ops by default: on an H200 (2026-12-04, GPT-2 124M at
// batch 8: m 8192, n 3072, k 768) cuBLASLt ran that epilogue as a kernel of its own after the
// GEMM, 163 us beside the GEMM's 57, where the ops read and write the same 16-bit data once
// each: bench_kernels timed the ops at 0.57x the epilogue's time (95% CI 0.56 to 0.57, 7 paired
// rounds), and GPT-2's step at 0.931x (3 alternated pairs of runs, 0.930 to 0.937;
// benchmarks/results/2026-12-04c_nvidia-h200). For benchmarks and tests; not while GEMMs run.
void set_cuda_dgelu_epilogue(bool enabled);
bool cuda_dgelu_epilogue();
// A Linear's parameter gradients: dw += dy^T x (gemm, alpha 1, beta 1) and dbias += the column
// sums of dy_for_bias (bias_backward, accumulating). requires dw (out, in) f32, dy (M, out) and
// x (M, in) of one floating dtype, dbias (out) f32 or undefined, dy_for_bias (M, out) f32 or
// dy's dtype (dy itself, or under mixed precision the f32 gradient dy was rounded from).
// - CPU: the two ops, their bits.
// - CUDA: where dy_for_bias is dy, 16-bit, one cuBLASLt GEMM whose BGRADB epilogue sums the
//   bias gradient from the operand it reads (in f32), where the heuristic has an algorithm;
//   otherwise the two ops.
void linear_param_grads(Tensor& dw, Tensor& dbias, const Tensor& dy, const Tensor& x,
                        const Tensor& dy_for_bias);

// ---- transformer: embedding lookup and scaled dot-product attention ------------------------

// requires ids (...) i32 in [0, V), table (V, D) f32, y (..., D) f32 (ids.numel() rows).
// ensures y[n] = table[ids[n]]. An id outside [0, V) throws, naming it and its position (CUDA:
// at the next read to the host, as a bad label; its row of y is 0 until then).
void embedding_forward(Tensor& y, const Tensor& ids, const Tensor& table);
// requires dtable (V, D) f32, dy (..., D) f32, f16 or bf16 (read as f32), ids as in forward.
// ensures dtable[ids[n]] += dy[n] for every n (gradients accumulate), added in increasing n on
// both backends: bitwise equal.
void embedding_backward(Tensor& dtable, const Tensor& dy, const Tensor& ids);

enum class AttentionMask { none, causal };
struct AttentionParams {
  int64_t heads = 1;
  float scale = 1.f;  // multiplies q . k; 1 / sqrt(head_dim) in GPT-2
  AttentionMask mask = AttentionMask::causal;
  // Dropout on the probabilities (training; 0: off): P[b, h, i, j] is kept iff
  // philox::uniform(dropout_seed, dropout_offset + ((b H + h) T + i) T + j) >= dropout, and
  // scaled by 1 / (1 - dropout): the same mask on CPU and CUDA. A call uses B H T T counters.
  float dropout = 0.f;
  uint64_t dropout_seed = 0;
  RngOffset dropout_offset;
};
// Multi-head scaled dot-product attention on a fused QKV projection.
// requires qkv (B, T, 3 D) f32, f16 or bf16 holding [q | k | v] along the last dim, each
// (H, D / H) head by head (the output of one Linear(D, 3 D)); y (B, T, D) of qkv's dtype;
// lse (B, H, T) f32; H divides D.
// ensures per batch b and head h, with s_ij = scale q_i . k_j (j <= i under the causal mask):
//   y[b, i, h] = sum_j softmax_j(s_i.) m_ij v_j,  lse[b, h, i] = log sum_j exp s_ij (for
//   backward), with m_ij the dropout mask's keep / (1 - p) (1 without dropout).
// CPU: exact softmax in f32 per (b, h), oneTBB over batch and heads (16-bit qkv widened to an
// f32 copy by casts, y rounded by one: the CPU kernels are f32 only).
// CUDA: f32 on the plain kernels; f16/bf16 without dropout on cuDNN's fused SDPA (flash
// attention) when cuDNN accepts the shape (head dim a multiple of 8, at most 128), else widened
// to the plain kernels.
void attention_forward(Tensor& y, Tensor& lse, const Tensor& qkv, const AttentionParams& p);
// requires the forward's qkv, y and lse, and its params (the same dropout mask); dy like y,
// dqkv like qkv (shape and dtype). ensures dqkv = the gradient of sum(y * dy) w.r.t. qkv
// (overwritten).
void attention_backward(Tensor& dqkv, const Tensor& dy, const Tensor& qkv, const Tensor& y,
                        const Tensor& lse, const AttentionParams& p);
// What a context's 16-bit attention calls ran (reports say it beside a GPT's throughput):
// calls on cuDNN's fused SDPA, calls cuDNN refused (then widened to the plain kernels), and each
// refused plan's pass, dtype, shape and cuDNN's reason. f32 attention and attention with dropout
// run the plain kernels without asking cuDNN. All zero on CPU devices.
struct AttentionReport {
  int64_t fused = 0, refused = 0;
  std::vector<std::string> refusals;
};
AttentionReport attention_report(DeviceContext& ctx);

// ---- the CPU's GEMM kernels ----------------------------------------------------------------
// OpenBLAS (a DYNAMIC_ARCH build, as Debian's) picks its kernels for the CPU model it knows; a
// release older than the CPU falls back to its Prescott (SSE3) kernels, several times slower on
// a CPU with AVX2 or AVX-512. So at the first BLAS use of a process (any program, or a project
// using the installed library), where OpenBLAS's kernels are narrower than the CPU's vector
// instructions and OPENBLAS_CORETYPE is unset, the choice is made again from the CPU's
// instruction sets (cpuid, through the compiler's __builtin_cpu_supports: never a kernel the
// CPU lacks), through OpenBLAS's own OPENBLAS_CORETYPE path. A choice the user forced stays,
// with a warning.
enum class CpuVectorIsa { sse, avx, avx2, avx512 };  // ordered: wider is greater
struct BlasKernels {
  std::string library;        // openblas_get_config(): "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
  std::string core;           // the kernels it runs: "Cooperlake", "SkylakeX", "Haswell", ...
  std::string switched_from;  // the core OpenBLAS chose itself, when chosen again ("" if not)
  CpuVectorIsa cpu = CpuVectorIsa::sse;  // the widest vector ISA this CPU runs
  bool generic = false;                  // the core's kernels are narrower than the CPU's
  std::string warning;                   // one line saying what to do when generic, else ""
  // bf16 x bf16 products on the CPU's bf16 instructions (AVX512_BF16, AMX) through oneDNN:
  // "oneDNN 2.6.3 (bf16 kernels: brg:avx512_core_bf16)"; "" where they widen to f32 on OpenBLAS
  // (a build without oneDNN, a CPU without AVX512_BF16, DP_CPU_BF16_GEMM=widen).
  std::string bf16;
};
// The process's GEMM kernels, after its one choice (made here if no GEMM ran yet).
BlasKernels cpu_blas_kernels();
CpuVectorIsa cpu_vector_isa();
// The OpenBLAS core to run on a CPU whose widest ISA is `cpu` instead of `core`, or "" when
// `core` already uses it: Cooperlake (AVX-512 with AVX512_BF16), SkylakeX (AVX-512), Haswell
// (AVX2 and FMA), Sandybridge (AVX).
std::string better_blas_core(const std::string& core, CpuVectorIsa cpu, bool has_avx512_bf16);
// Makes the choice (again): what cpu_blas_kernels() runs once. For tests that make OpenBLAS
// choose badly first; not to be called while GEMMs run.
void choose_blas_kernels();
// Whether bf16 x bf16 GEMMs on CPU devices may use the bf16 instructions (default: yes, unless
// DP_CPU_BF16_GEMM=widen): for tests and before/after benchmarks; not while GEMMs run.
void set_cpu_bf16_gemm(bool enabled);

// The libraries this process computes with, as they report themselves at run time, name and
// version: "openblas" (its build and the CPU kernels it chose, which set CPU speed), and in a
// build with the CUDA backend "cuda_runtime", "cuda_driver", "cublasLt", "cudnn" and
// "cudnn_frontend" (compiled against). NCCL is the distributed layer's (dp::dist).
std::vector<std::pair<std::string, std::string>> library_versions();

// ---- losses, reductions, metrics -----------------------------------------------------------

// Fused, numerically stable softmax + cross-entropy, forward and backward in one pass.
// requires logits (B, C) f32, f16 or bf16, labels (B) i32 in [0, C), weights (B) f32 or
// undefined, loss (1) f32, dlogits (B, C) in f32 or the logits' dtype, or undefined (forward
// only), 0 <= label_smoothing < 1. 16-bit logits are read as f32 (exactly) and a 16-bit dlogits
// holds each f32 value rounded once: the fused loss of a bf16 model output, without an f32 copy
// of the logits or of their gradient (the bits of widening, the f32 op and a cast of dlogits).
// With target t = (1 - ls) onehot(label) + ls / C, and w_i = weights[i] (or 1):
// ensures loss = (1/B) sum_i w_i * sum_c -t_c log softmax(logits_i)_c   (0 when B == 0)
//         dlogits_i = (w_i / B) (softmax(logits_i) - t).
// A label outside [0, C) throws bad_label_text of the first such row: at once on the CPU; on
// CUDA at the next read to the host on the same context (loss.item()), and the engine stays
// usable (a device-side fault record, not a trap; the row's loss is NaN and its gradient 0, so
// that work queued before the read, such as an optimizer step, stays finite).
// correct: undefined, or (1) f32 on the logits' device, which then holds count_correct's count
// (the rows whose argmax, argmax's rule, is their label), found in the same read of the logits
// as the loss (no second pass over them).
// dlogits may be logits itself (same dtype): the gradient is then written over the logits, with
// the same values (no second buffer the size of the logits).
// grad_scale: a factor dlogits is multiplied by in f32 before its one rounding (fp16's loss
// scale, a micro-batch's weight), read when the op runs; the loss is not scaled. Inside the
// op, a 16-bit dlogits loses no value below its range that the scale lifts into it, and no
// second pass over the logits' gradient is made.
void softmax_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits,
                           const Tensor& labels, const Tensor& weights = Tensor(),
                           float label_smoothing = 0.f, Tensor correct = Tensor(),
                           const Scalar& grad_scale = Scalar());
// Token cross-entropy: softmax_cross_entropy over rows (N, V) (a [B, T, V] output flattened),
// averaged over the rows whose target is not `ignore_index`.
// requires logits (N, V) f32, f16 or bf16, targets (N) i32 in [0, V) or == ignore_index, loss (1)
// f32, dlogits (N, V) in f32 or the logits' dtype, or undefined (16-bit: as above). With n = the
// count of non-ignored rows:
// ensures loss = (1/n) sum_{i kept} -log softmax(logits_i)_{t_i}   (0 when n == 0)
//         dlogits_i = (softmax(logits_i) - onehot(t_i)) / n for kept rows, 0 for ignored ones.
// A target outside [0, V) (other than ignore_index) throws bad_label_text as above. correct,
// dlogits over the logits and grad_scale: as above (an ignored row is never counted).
// kept: undefined, or (1) f32 on the logits' device holding n (count_kept over a whole batch of
// which these rows are a part, read when the op runs): the loss and gradient are then these
// rows' part of the whole batch's mean (a chunked loss: the chunks' losses add up to the batch's,
// and each row's gradient has the bits it has in one call over the batch). 0 when n == 0.
void token_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                         int32_t ignore_index, Tensor correct = Tensor(),
                         const Scalar& grad_scale = Scalar(), const Tensor& kept = Tensor());
// requires targets (N) i32, out (1) f32 on their device. ensures out = the count of targets that
// are not ignore_index (exact below 2^24), queued.
void count_kept(Tensor& out, const Tensor& targets, int32_t ignore_index);
// The error text of softmax_cross_entropy for row `row` of logits (batch, classes) whose label
// is outside [0, classes), the same on every backend.
std::string bad_label_text(int64_t label, int64_t row, int64_t batch, int64_t classes);
// requires pred, target same shape (B, ...), loss (1), dpred like pred or undefined.
// ensures loss = mean((pred - target)^2) over all elements; dpred = 2 (pred - target) / numel.
void mse_loss(Tensor& loss, Tensor& dpred, const Tensor& pred, const Tensor& target);
// requires out (1). ensures out = sum of x / mean of x (0 for an empty x).
void sum(Tensor& out, const Tensor& x);
void mean(Tensor& out, const Tensor& x);
// requires out (1) f32, x f32. ensures out = sum of x^2 (0 for an empty x), in a fixed order.
void sum_squares(Tensor& out, const Tensor& x);
// Gradient clipping by global norm on the device, without a host read (nn::clip_grad_norm_into).
// requires grads f32; sum_squares (1) f32 holding the sum of squares of grads (sum_squares(ss,
// grads), or that sum over every shard of a gradient); norm_out (1) f32; all on one device;
// max_norm finite and > 0. norm_out may alias sum_squares.
// ensures, with the host's arithmetic (kernels/clip_norm.hpp) computed on the device:
//   norm = sqrt(double(ss)) * double(unscale), norm_out = float(norm), and grads scaled by
//   clip::factor(norm, max_norm): untouched when that is 1 (norm <= max_norm, or NaN); times 0
//   for an infinite norm (an f32 sum of squares that overflowed, or an infinite gradient).
// unscale: fixed, or read on the device when the clip runs (a captured step's loss scale).
void clip_by_norm(Tensor& grads, Tensor& norm_out, const Tensor& sum_squares, float max_norm,
                  Scalar unscale);
// requires x (B, C) f32, f16 or bf16, out (B) i32. ensures out_i = argmax_c x_ic (first on
// ties); a NaN is larger than any number, as in PyTorch: a row's first NaN is its argmax.
void argmax(Tensor& out, const Tensor& x);
// requires logits (B, C) f32, f16 or bf16, labels (B) i32. Returns how many rows have argmax ==
// label (waits).
int64_t count_correct(const Tensor& logits, const Tensor& labels);
// The same without a host read: requires out (1) f32 on the logits' device. ensures out = the
// count (exact up to 2^24 rows), queued on the device.
void count_correct_into(Tensor& out, const Tensor& logits, const Tensor& labels);

// The reduction of data parallelism in one pass (one kernel on a GPU), reading every source
// where it lies: y = y_weight * y + sum_k weights[k] * xs[k], added in k order with f32
// accumulation. requires y f32; xs all f32 or all bf16, each of y's numel, readable from y's
// device (direct_access), as many weights as xs, each weight fixed or on y's device (read when
// the sum runs). The sources' producers must be ordered before this call on y's stream (events).
// With no sources it scales y in place.
void weighted_sum(Tensor& y, Scalar y_weight, const std::vector<Tensor>& xs,
                  const std::vector<Scalar>& weights);

// ---- convolution and pooling (NCHW) --------------------------------------------------------

struct Conv2dParams {
  int stride_h = 1, stride_w = 1;
  int pad_h = 0, pad_w = 0;
};
// Output spatial size: (in + 2 pad - k) / stride + 1.
int64_t conv_out_size(int64_t in, int64_t k, int stride, int pad);

// Dtypes of the three passes: the two tensor inputs (x, w / dy, w / dy, x) are f32, f16 or bf16
// of one dtype; the output is f32 or the inputs' dtype; accumulation is f32. With 16-bit inputs
// the f32 result is rounded once to the inputs' dtype before it is stored or (Accumulate::yes)
// added to the output (a 16-bit output rounds that sum again), as cuDNN's pseudo-16-bit configs
// do; the CPU widens the inputs, runs its f32 code and rounds, so both backends agree on that.
//
// requires x (N, C, H, W), w (K, C, R, S), y (N, K, P, Q) with P, Q from conv_out_size.
// ensures y = cross-correlation of x with w (no bias; add it with add_bias).
void conv2d_forward(Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& p);
// ensures dx (+)= d(sum y*dy)/dx.
void conv2d_backward_data(Tensor& dx, const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                          Accumulate acc);
// ensures dw (+)= d(sum y*dy)/dw.
void conv2d_backward_filter(Tensor& dw, const Tensor& dy, const Tensor& x, const Conv2dParams& p,
                            Accumulate acc);

struct Pool2dParams {
  int kernel_h = 2, kernel_w = 2;
  int stride_h = 2, stride_w = 2;
  int pad_h = 0, pad_w = 0;
};
// requires x (N, C, H, W), y (N, C, P, Q), f32, f16 or bf16 (16-bit activations above; a
// backward adds its windows into a 16-bit dx in f32 and rounds once). Padding never wins a max;
// a NaN in a window is its max (PyTorch's rule); average pooling counts the padding in the divisor
// (PyTorch's count_include_pad=True).
void max_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p);
// Takes the forward x and y; the gradient goes to the first maximum of each window (its first
// NaN where the max is NaN).
void max_pool2d_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                         const Pool2dParams& p, Accumulate acc);
void avg_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p);
void avg_pool2d_backward(Tensor& dx, const Tensor& dy, const Pool2dParams& p, Accumulate acc);

// ---- normalisation -------------------------------------------------------------------------

// BatchNorm over every dim but 1: x (N, C) or (N, C, H, W); gamma, beta, running_*,
// save_mean, save_invstd (C).
// Training: normalises with the batch statistics (biased variance), saves mean and
// 1/sqrt(var + eps) for backward, and updates running_mean/var with `momentum` (PyTorch's
// convention: r = (1 - m) r + m stat; the running variance takes the unbiased variance).
void batch_norm_forward_train(Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                              Tensor& running_mean, Tensor& running_var, const Tensor& x,
                              const Tensor& gamma, const Tensor& beta, float momentum, float eps);
void batch_norm_forward_eval(Tensor& y, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             const Tensor& running_mean, const Tensor& running_var, float eps);
// ensures dx = input gradient (overwritten), dgamma, dbeta (+)= parameter gradients.
void batch_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, Accumulate acc);

// LayerNorm over the last dim: x (M, D), gamma/beta (D), save_mean/save_rstd (M). x, y, dy and
// dx may each be f32, f16 or bf16 (one 16-bit dtype per call): the statistics, parameters and
// their gradients are f32, the arithmetic is f32 (double on the CPU), and a 16-bit output is
// rounded once, the bits of widening, the f32 op and rounding (the sums' order depends on D
// alone, never on the dtypes or the operands' alignment).
void layer_norm_forward(Tensor& y, Tensor& save_mean, Tensor& save_rstd, const Tensor& x,
                        const Tensor& gamma, const Tensor& beta, float eps);
// ensures dx = input gradient (overwritten), dgamma, dbeta (+)= parameter gradients.
void layer_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_rstd, Accumulate acc);

// A pre-LN block's skip and the norm after it in one pass over each row (GPT-2's residual +
// ln_2, as llm.c fuses them). requires a, b, h (M, D) of one dtype; y (M, D); the rest as
// layer_norm_forward's. ensures h = a + b rounded to h's dtype, then y, save_mean and save_rstd
// as layer_norm_forward(y, save_mean, save_rstd, h, gamma, beta, eps) gives them: the same bits
// as add followed by layer_norm_forward.
void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& save_mean, Tensor& save_rstd,
                            const Tensor& a, const Tensor& b, const Tensor& gamma,
                            const Tensor& beta, float eps);
// LayerNorm's backward and the skip's gradient in one pass. requires dskip of dx's dtype and
// shape; the rest as layer_norm_backward's. ensures dx = the input gradient layer_norm_backward
// would store in x's dtype, + dskip, rounded to dx's dtype (the bits of layer_norm_backward
// into a tensor of x's dtype followed by add); dgamma, dbeta (+)= as layer_norm_backward's.
void layer_norm_backward_add(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                             const Tensor& dskip, const Tensor& x, const Tensor& gamma,
                             const Tensor& save_mean, const Tensor& save_rstd, Accumulate acc);

// ---- Llama's layers: RMSNorm, SwiGLU, rotary embeddings -----------------------------------
// Activations and their gradients may each be f32, f16 or bf16 (one 16-bit dtype per call):
// f32 arithmetic (double statistics on the CPU), each 16-bit output rounded once.

// RMSNorm over the last dim. requires x, y (M, D); gamma (D) f32; save_rstd (M) f32; eps >= 0 (0,
// as PyTorch allows, gives NaN on an all-zero row). ensures y = x rstd gamma with rstd = 1 /
// sqrt(mean_j x_j^2 + eps), saved per row.
void rms_norm_forward(Tensor& y, Tensor& save_rstd, const Tensor& x, const Tensor& gamma,
                      float eps);
// requires as rms_norm_forward, dx and dy like x, dgamma (D) f32. ensures, with g = dy gamma,
// dx = rstd (g - x rstd^2 mean_j(g_j x_j)) (overwritten) and dgamma (+)= sum_rows dy x rstd.
void rms_norm_backward(Tensor& dx, Tensor& dgamma, const Tensor& dy, const Tensor& x,
                       const Tensor& gamma, const Tensor& save_rstd, Accumulate acc);
// SwiGLU's gate (Shazeer 2020; Llama's MLP): requires h (M, 2 H) = [a | b] (the gate and up
// projections side by side), y (M, H). ensures y = silu(a) * b, silu(a) = a sigmoid(a).
void swiglu_forward(Tensor& y, const Tensor& h);
// requires dh like h, dy like y. ensures dh = [dy b silu'(a) | dy silu(a)] (overwritten).
void swiglu_backward(Tensor& dh, const Tensor& dy, const Tensor& h);
// Rotary position embedding (RoFormer), in place, with Llama's rotate-half pairing.
// requires x (B, T, C) with columns <= C a multiple of head_dim, head_dim even; cos and sin
// (T_max, head_dim / 2) f32 with T <= T_max. ensures in each row (position t) and each head of
// columns [0, columns), for j < head_dim / 2 the pair (x_j, x_{j + head_dim / 2}) becomes
//   (x_j cos - x_{j + h} sin, x_{j + h} cos + x_j sin),  cos, sin = table[t, j];
// Rotation::inverse turns the other way (sin negated): the backward of a forward rotation, run
// on its gradient. Columns from `columns` on are untouched (a QKV row's values).
enum class Rotation { forward, inverse };
void rotary_embedding(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                      int64_t columns, Rotation rotation);

// ---- dropout -------------------------------------------------------------------------------

// Counter-based (Philox4x32-10): element i of a call keeps iff uniform(seed, offset + i) >= p.
// The same (seed, offset) gives the same mask on every device and backend.
// requires x, y, mask same shape, 0 <= p < 1; x, y f32, f16 or bf16, mask f32.
// ensures mask = keep / (1 - p), y = x * mask (computed in f32, rounded once into a 16-bit y).
// Backward is mul(dx, dy, mask).
void dropout_forward(Tensor& y, Tensor& mask, const Tensor& x, float p, uint64_t seed,
                     RngOffset offset);

// ---- small values in device memory ------------------------------------------------------

// Up to kMaxValues floats carried by value: in a kernel's launch arguments on CUDA (so the
// values are fixed when the launch is queued, and a captured launch replays them).
constexpr int kMaxValues = 32;
struct Values {
  float v[kMaxValues] = {};
  int n = 0;
};
// requires dst f32 on its device with at least n elements, 0 <= n <= kMaxValues.
// ensures dst[0, n) = values[0, n), queued on dst's device in ONE launch whose arguments hold the
// values (`values` may change as soon as this returns). Allocates nothing.
void set_values(Tensor& dst, const float* values, int n);
// requires dst (1) i64. ensures dst = value (as two's complement), queued on dst's device in one
// launch whose arguments hold it. Allocates nothing. (An RngOffset's base.)
void set_counter(Tensor& dst, uint64_t value);

// ---- fused optimizer updates over one flat buffer ------------------------------------------
// An update reads its per-step scalars (learning rate, gradient unscale, step-count terms) from a
// small f32 tensor on the parameters' device when it runs, not from its arguments: the host
// computes them (sgd_scalars, adamw_scalars) and writes them there (set_values) before queueing
// the update, so a captured update replays with the current step's values.

struct SgdConfig {
  float lr = 0.01f;
  float momentum = 0.f;
  float dampening = 0.f;
  float weight_decay = 0.f;
  Nesterov nesterov = Nesterov::no;
  // Every gradient is multiplied by this first (1 / loss scale under mixed precision; 1: as is).
  float grad_unscale = 1.f;
  // Undefined, or (1) f32 on the parameters' device: the update does nothing when it holds a
  // nonzero value (a non-finite gradient, non_finite_into), read by the kernel, not the host.
  Tensor skip_if;
  // Undefined, or an f16 or bf16 tensor of the parameters' element count on their device, apart
  // from them: the update also writes each updated parameter there, rounded to its dtype (the
  // bits copy() gives), in the same pass; skipped with the update. Mixed precision's 16-bit
  // weights (Module::set_compute_dtype), so the next forward needs no cast.
  Tensor compute_copy;
};
// SGD's per-step scalars, at these indices of the scalars tensor.
struct SgdScalar {
  static constexpr int lr = 0, grad_unscale = 1, first_step = 2 /* 1 or 0 */, count = 3;
};
// requires step t >= 1. ensures the SgdScalar values of step t under c (c.lr, c.grad_unscale).
std::array<float, SgdScalar::count> sgd_scalars(const SgdConfig& c, int64_t step);
// PyTorch's SGD: g = grad * unscale + wd * p; if momentum: buf = first_step ? g : m buf + (1 -
// damp) g, g = nesterov ? g + m buf : buf; p -= lr * g. lr, unscale and first_step are read
// from `scalars` (sgd_scalars there) when the update runs; c's other fields are constants.
// `momentum_buf` is unused when momentum == 0. requires params, grads, momentum_buf same shape,
// f32; scalars f32 with >= SgdScalar::count elements, on the parameters' device.
void sgd_update(Tensor& params, const Tensor& grads, Tensor& momentum_buf, const SgdConfig& c,
                const Tensor& scalars);

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  // Every gradient is multiplied by this first (1 / loss scale under mixed precision; 1: as is).
  float grad_unscale = 1.f;
  Tensor skip_if;       // as SgdConfig::skip_if
  Tensor compute_copy;  // as SgdConfig::compute_copy
};
// Parameter groups of one flat buffer (nanoGPT's: weight decay on matrices only), each with
// its learning-rate scale and weight decay. A group is a set of ranges; group_of names each
// element's group, so the grouped step stays one pass over the buffer.
constexpr int kMaxAdamWGroups = 8;
struct AdamWGroups {
  int count = 1;
  float lr_scale[kMaxAdamWGroups] = {1, 1, 1, 1, 1, 1, 1, 1};
  float weight_decay[kMaxAdamWGroups] = {};
};
// One group with c's weight decay: what adamw_update does.
AdamWGroups single_group(const AdamWConfig& c);
// AdamW's per-step scalars, at these indices of the scalars tensor: the gradient unscale,
// sqrt(1 - b2^t), and per group k: decay[k] = 1 - lr_k wd_k, step_size[k] = lr_k / (1 - b1^t).
struct AdamWScalar {
  static constexpr int grad_unscale = 0, correction2_sqrt = 1, decay = 2,
                       step_size = decay + kMaxAdamWGroups, count = step_size + kMaxAdamWGroups;
};
// requires step t >= 1, 1 <= groups.count <= kMaxAdamWGroups. ensures the AdamWScalar values of
// step t, computed in double as PyTorch does in Python and rounded to float once, with
// lr_k = c.lr * groups.lr_scale[k] (c.weight_decay is not used: the groups hold theirs).
std::array<float, AdamWScalar::count> adamw_scalars(const AdamWConfig& c, const AdamWGroups& groups,
                                                    int64_t step);
// PyTorch's AdamW (decoupled weight decay): p *= 1 - lr wd; m = b1 m + (1-b1) g;
// v = b2 v + (1-b2) g^2 with g = grad * unscale; p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) +
// eps), with group 0's scalars of adamw_scalars(c, single_group(c), t) read from `scalars` when
// it runs (betas and eps are c's). requires params, grads, m, v same shape, f32; scalars f32 with
// >= AdamWScalar::count elements, on the parameters' device.
void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const AdamWConfig& c,
                  const Tensor& scalars);
// requires as adamw_update; group_of (P) u8 like params with values < the groups' count in
// `scalars` (adamw_scalars(c, groups, t)). ensures adamw_update's step on each element with
// the scalars of its group.
void adamw_update_grouped(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                          const Tensor& group_of, const AdamWConfig& c, const Tensor& scalars);
// True when every element of x is finite (waits for the result).
bool all_finite(const Tensor& x);
// The same verdict left on the device: requires flag (1) f32 on x's device. ensures flag = 0
// when every element of x is finite, 1 otherwise, queued on the device (no host read).
void non_finite_into(Tensor& flag, const Tensor& x);

// ---- helpers for tests ---------------------------------------------------------------------

// Largest |a_i - b_i| over two host vectors of equal length (throws otherwise).
float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace kernels
