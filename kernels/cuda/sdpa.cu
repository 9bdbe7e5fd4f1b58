// cuDNN's fused SDPA (flash attention) forward and backward through the cuDNN frontend's graph
// API, for f16/bf16 qkv: 16-bit I/O, f32 softmax statistics (lse), f32 compute.
//
// Layout: qkv (B, T, 3, H, hd) as stored by one Linear(D, 3 D) is read in place. cuDNN takes
// Q, K and V as [B, H, T, hd] with any strides, so each is the qkv pointer (plus D for K, 2 D
// for V) with strides (T 3 D, hd, 3 D, 1); y and dy (B, T, H, hd) are [B, H, T, hd] with strides
// (T D, hd, D, 1); dQ, dK, dV land in dqkv with qkv's strides; lse (B, H, T) is cuDNN's Stats
// [B, H, T, 1]. Nothing is copied or transposed.
//
// Graphs are built once per (pass, shape, dtype, scale, mask) in the context's PlanCache
// (ctx.state<SdpaPlans>(), like the cuBLASLt and convolution plans): validate, lower to a cuDNN
// operation graph, rank engine configurations by heuristic A, build the first supported one (the
// frontend goes down the ranked list while cuDNN answers NOT_SUPPORTED). A graph that fails any
// step is cached as refused, with the reason (logged under DP_LOG=debug); the caller then runs
// the plain path. Workspace comes from ctx.workspace() (grown once, then reused).
//
// Built only when CMake found the frontend's headers (DP_HAVE_CUDNN_FRONTEND); otherwise every
// call is refused and 16-bit attention widens to the plain f32 kernels.
#include <array>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/sdpa.hpp"
#include "kernels/runtime/algo_select.hpp"
#include "kernels/runtime/plan_cache.hpp"

#ifndef DP_HAVE_CUDNN_FRONTEND
#define DP_HAVE_CUDNN_FRONTEND 0
#endif
#if DP_HAVE_CUDNN_FRONTEND
#include <cudnn_frontend.h>
#endif

namespace kernels::cuda {

namespace {

enum class SdpaPass { forward, backward };

// A fused graph: built, or refused with cuDNN's (or the frontend's) reason.
struct SdpaPlan {
#if DP_HAVE_CUDNN_FRONTEND
  std::shared_ptr<cudnn_frontend::graph::Graph> graph;
#endif
  std::unordered_map<int64_t, void*> pack;  // uid -> pointer, reassigned by each call
  int64_t workspace_bytes = 0;
  std::string what;     // pass, dtype and shape, for logs and errors
  std::string refusal;  // empty: accepted
};

// pass, dtype, B, T, H, hd, the scale's bits, mask. qkv and y are contiguous, so the shape
// fixes every stride.
using SdpaKey = std::array<int64_t, 8>;

struct SdpaPlans {
  PlanCache<SdpaKey, SdpaPlan> cache;
  int64_t fused = 0, refused = 0;
  std::vector<std::string> refusals;  // "what: reason" of each plan refused, as made
};

// (B, T, H, hd) of an attention call.
struct SdpaShape {
  int64_t b, t, h, hd;
};

SdpaShape sdpa_shape(const Tensor& qkv, const AttentionParams& p) {
  const int64_t d = qkv.dim(2) / 3;
  return {qkv.dim(0), qkv.dim(1), p.heads, d / p.heads};
}

SdpaKey sdpa_key(SdpaPass pass, DType dtype, const SdpaShape& s, const AttentionParams& p) {
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &p.scale, sizeof scale_bits);
  return {static_cast<int64_t>(pass),       static_cast<int64_t>(dtype), s.b, s.t, s.h, s.hd,
          static_cast<int64_t>(scale_bits), static_cast<int64_t>(p.mask)};
}

std::string plan_what(SdpaPass pass, DType dtype, const SdpaShape& s, const AttentionParams& p) {
  std::ostringstream os;
  os << (pass == SdpaPass::forward ? "sdpa_forward" : "sdpa_backward") << " " << dtype_name(dtype)
     << " B " << s.b << ", T " << s.t << ", H " << s.h << ", head dim " << s.hd
     << (p.mask == AttentionMask::causal ? ", causal" : "");
  return os.str();
}

// The head dims cuDNN's fused engines document for 16-bit forward and backward on sm_80 and
// sm_90: multiples of 8 up to 128 (forward allows 256 on Hopper; one bound keeps the two
// passes on one path). Checked first: no graph is built for a shape that cannot pass.
std::string shape_refusal(const SdpaShape& s) {
  if (s.hd % 8 != 0 || s.hd > 128) {
    std::ostringstream os;
    os << "head dim " << s.hd << " is not a multiple of 8 in [8, 128]";
    return os.str();
  }
  return {};
}

#if DP_HAVE_CUDNN_FRONTEND

namespace fe = cudnn_frontend;

// Tensor uids of the variant pack.
enum SdpaUid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

fe::DataType_t fe_dtype(DType t) {
  return t == DType::f16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

// [B, H, T, hd] views: of qkv (row 3 D) and of y, dy (row D); Stats [B, H, T, 1].
struct SdpaLayout {
  std::vector<int64_t> dims, qkv_strides, y_strides, stats_dims, stats_strides;
};

SdpaLayout sdpa_layout(const SdpaShape& s) {
  const int64_t d = s.h * s.hd;  // D
  return {{s.b, s.h, s.t, s.hd},
          {s.t * 3 * d, s.hd, 3 * d, 1},
          {s.t * d, s.hd, d, 1},
          {s.b, s.h, s.t, 1},
          {s.h * s.t, s.t, 1, 1}};
}

using FeTensor = std::shared_ptr<fe::graph::Tensor_attributes>;

FeTensor input(fe::graph::Graph& g, const char* name, SdpaUid uid, const std::vector<int64_t>& dims,
               const std::vector<int64_t>& strides) {
  return g.tensor(
      fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(strides));
}

void mark_output(const FeTensor& t, SdpaUid uid, const std::vector<int64_t>& dims,
                 const std::vector<int64_t>& strides) {
  t->set_output(true).set_uid(uid).set_dim(dims).set_stride(strides);
}

// The causal mask: key j is visible to query i when j <= i (the band's right bound is the
// diagonal, aligned top left: T_q = T_kv here).
template <class Attributes>
void mask_future(Attributes& options) {
  options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
      .set_diagonal_band_right_bound(0);
}

// The graph of one pass, not yet lowered.
std::shared_ptr<fe::graph::Graph> describe(SdpaPass pass, DType dtype, const SdpaShape& s,
                                           const AttentionParams& p) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe_dtype(dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const SdpaLayout l = sdpa_layout(s);
  const bool causal = p.mask == AttentionMask::causal;
  FeTensor q = input(*g, "Q", kQ, l.dims, l.qkv_strides);
  FeTensor k = input(*g, "K", kK, l.dims, l.qkv_strides);
  FeTensor v = input(*g, "V", kV, l.dims, l.qkv_strides);
  if (pass == SdpaPass::forward) {
    auto options =
        fe::graph::SDPA_attributes().set_name("dp_sdpa").set_generate_stats(true).set_attn_scale(
            p.scale);
    if (causal) mask_future(options);
    auto [o, stats] = g->sdpa(q, k, v, options);
    mark_output(o, kO, l.dims, l.y_strides);
    mark_output(stats, kStats, l.stats_dims, l.stats_strides);
    stats->set_data_type(fe::DataType_t::FLOAT);
  } else {
    FeTensor o = input(*g, "O", kO, l.dims, l.y_strides);
    FeTensor d_o = input(*g, "dO", kDO, l.dims, l.y_strides);
    FeTensor stats = input(*g, "Stats", kStats, l.stats_dims, l.stats_strides);
    stats->set_data_type(fe::DataType_t::FLOAT);
    auto options =
        fe::graph::SDPA_backward_attributes().set_name("dp_sdpa_backward").set_attn_scale(p.scale);
    if (causal) mask_future(options);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
    mark_output(dq, kDQ, l.dims, l.qkv_strides);
    mark_output(dk, kDK, l.dims, l.qkv_strides);
    mark_output(dv, kDV, l.dims, l.qkv_strides);
  }
  return g;
}

// Builds the plan of one pass, or the reason cuDNN refuses it. Only frontend and cuDNN
// refusals end up here; a failing CUDA call after the build throws at execute().
SdpaPlan make_plan(SdpaPass pass, DType dtype, const SdpaShape& s, const AttentionParams& p,
                   DeviceContext& ctx) {
  SdpaPlan plan;
  plan.refusal = shape_refusal(s);
  if (!plan.refusal.empty()) return plan;
  auto handle = static_cast<cudnnHandle_t>(ctx.cudnn());
  std::shared_ptr<fe::graph::Graph> g;
  try {
    g = describe(pass, dtype, s, p);
  } catch (const std::exception& e) {  // the frontend throws on a malformed description
    plan.refusal = std::string("describe: ") + e.what();
    return plan;
  }
  auto failed = [&](fe::error_t e, const char* step) {
    if (e.is_good()) return false;
    plan.refusal = std::string(step) + ": " + e.get_message();
    return true;
  };
  if (failed(g->validate(), "validate") ||
      failed(g->build_operation_graph(handle), "build_operation_graph") ||
      failed(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans") ||
      failed(g->check_support(handle), "check_support") ||
      failed(g->build_plans(handle), "build_plans") ||
      failed(g->get_workspace_size(plan.workspace_bytes), "get_workspace_size"))
    return plan;
  plan.graph = std::move(g);
  return plan;
}

// Runs a built plan on the tensors' pointers, given in uid order from kQ (the first call makes
// the pack's keys; later calls only assign them).
template <size_t N>
void execute(SdpaPlan& plan, const std::array<void*, N>& pointers, DeviceContext& ctx) {
  for (size_t i = 0; i < N; ++i) plan.pack[kQ + static_cast<int64_t>(i)] = pointers[i];
  void* workspace =
      plan.workspace_bytes > 0 ? ctx.workspace(static_cast<size_t>(plan.workspace_bytes)) : nullptr;
  fe::error_t e =
      plan.graph->execute(static_cast<cudnnHandle_t>(ctx.cudnn()), plan.pack, workspace);
  DP_CHECK(e.is_good(),
           plan.what << ": cuDNN's fused attention failed at execute: " << e.get_message());
}

#else  // no frontend: every shape is refused

SdpaPlan make_plan(SdpaPass, DType, const SdpaShape& s, const AttentionParams&, DeviceContext&) {
  SdpaPlan plan;
  plan.refusal = shape_refusal(s);
  if (plan.refusal.empty())
    plan.refusal = "built without the cuDNN frontend (cudnn_frontend.h not found at configure)";
  return plan;
}

#endif

// The plan of one call, counting a refusal. Logs each plan once, when made, under DP_LOG=debug.
SdpaPlan* lookup(SdpaPass pass, const Tensor& qkv, const AttentionParams& p, DeviceContext& ctx) {
  SdpaPlans& plans = ctx.state<SdpaPlans>();
  const SdpaShape s = sdpa_shape(qkv, p);
  SdpaPlan& plan = plans.cache.get(sdpa_key(pass, qkv.dtype(), s, p), [&] {
    SdpaPlan made = make_plan(pass, qkv.dtype(), s, p, ctx);
    made.what = plan_what(pass, qkv.dtype(), s, p);
    if (!made.refusal.empty()) plans.refusals.push_back(made.what + ": " + made.refusal);
    if (debug_logging())
      std::fprintf(
          stderr, "dp: debug: %s: %s\n", made.what.c_str(),
          made.refusal.empty() ? "cuDNN fused SDPA" : ("plain path: " + made.refusal).c_str());
    return made;
  });
  if (!plan.refusal.empty()) {
    ++plans.refused;
    return nullptr;
  }
  ++plans.fused;
  return &plan;
}

// cuDNN's fused attention moves its Q, K, V, O and gradient tensors in 16-byte vectors and
// refuses, at execution, a pointer that is not 16-byte aligned: such views (a 16-bit tensor at
// an offset that is not a multiple of 8 elements, or a width that is not) take the plain path.
bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

}  // namespace

bool sdpa_built() {
  return DP_HAVE_CUDNN_FRONTEND != 0;
}

SdpaCounts sdpa_counts(DeviceContext& ctx) {
  SdpaPlans& plans = ctx.state<SdpaPlans>();
  return {{plans.cache.hits(), plans.cache.misses()}, plans.fused, plans.refused, plans.refusals};
}

std::string sdpa_frontend_version() {
#if DP_HAVE_CUDNN_FRONTEND
  return std::to_string(CUDNN_FRONTEND_MAJOR_VERSION) + "." +
         std::to_string(CUDNN_FRONTEND_MINOR_VERSION) + "." +
         std::to_string(CUDNN_FRONTEND_PATCH_VERSION);
#else
  return "";
#endif
}

bool sdpa_forward(Tensor& y, Tensor& lse, const Tensor& qkv, const AttentionParams& p,
                  DeviceContext& ctx) {
  char* q = static_cast<char*>(qkv.raw());
  const size_t third = static_cast<size_t>(qkv.dim(2) / 3) * dtype_size(qkv.dtype());
  if (!aligned16({q, q + third, q + 2 * third, y.raw()})) return false;
  SdpaPlan* plan = lookup(SdpaPass::forward, qkv, p, ctx);
  if (!plan) return false;
#if DP_HAVE_CUDNN_FRONTEND
  NvtxRange range("kernels/sdpa_forward");
  // uid order: Q, K, V, O, Stats
  execute(*plan, std::array<void*, 5>{q, q + third, q + 2 * third, y.raw(), lse.raw()}, ctx);
#else
  (void)y, (void)lse;
#endif
  return true;
}

bool sdpa_backward(Tensor& dqkv, const Tensor& dy, const Tensor& qkv, const Tensor& y,
                   const Tensor& lse, const AttentionParams& p, DeviceContext& ctx) {
  char* q = static_cast<char*>(qkv.raw());
  char* dq = static_cast<char*>(dqkv.raw());
  const size_t third = static_cast<size_t>(qkv.dim(2) / 3) * dtype_size(qkv.dtype());
  if (!aligned16({q, q + third, q + 2 * third, y.raw(), dy.raw(), dq, dq + third, dq + 2 * third}))
    return false;
  SdpaPlan* plan = lookup(SdpaPass::backward, qkv, p, ctx);
  if (!plan) return false;
#if DP_HAVE_CUDNN_FRONTEND
  NvtxRange range("kernels/sdpa_backward");
  // uid order: Q, K, V, O, Stats, dO, dQ, dK, dV
  execute(*plan,
          std::array<void*, 9>{q, q + third, q + 2 * third, y.raw(), lse.raw(), dy.raw(), dq,
                               dq + third, dq + 2 * third},
          ctx);
#else
  (void)dqkv, (void)dy, (void)y, (void)lse;
#endif
  return true;
}

}  // namespace kernels::cuda
