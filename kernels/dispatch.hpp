// The one dispatch point of the ops (internal to kernels/: ops.cpp and tensor_ops.cpp): CPU ops
// run inside the device context's task arena, CUDA ops get the context (stream, handles) of the
// calling thread; while a graph captures, each op's arguments are recorded as the graph keeps
// them, and while a graph observes (or captures after observing), each op's host arguments are
// noted (Graph::observe). Included by .cpp files only.
#pragma once

#include <iomanip>
#include <limits>
#include <ostream>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/ops.hpp"
#include "kernels/runtime/memory.hpp"
#include "kernels/runtime/nvtx.hpp"
#include "kernels/tensor_ops.hpp"
#if DP_HAVE_CUDA
#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/sdpa.hpp"
// The context's GPU is made current first: launches and library calls go to its stream and
// handles, which belong to that GPU (a thread may use several).
#define DP_CUDA_DISPATCH(call) (ctx.make_current(), call)
#define DP_CUDA_DISPATCH_VALUE(type, call) (ctx.make_current(), call)
#else
#define DP_CUDA_DISPATCH(call) no_cuda(ctx)
#define DP_CUDA_DISPATCH_VALUE(type, call) (no_cuda(ctx), type{})
#endif

// The one dispatch point: kernels::cpu::op(args...) inside the device's task arena, or
// kernels::cuda::op(args..., ctx) on the calling thread's context for the device.
// While a graph observes or captures on the context, the op's host arguments are noted first
// (note_host_arguments).
#define DP_DISPATCH(device, op, ...)                                            \
  do {                                                                          \
    DeviceContext& ctx = context(device);                                       \
    if (ctx.noting()) note_host_arguments(ctx, #op, #__VA_ARGS__, __VA_ARGS__); \
    if ((device).is_cpu())                                                      \
      DP_RUN_CPU(                                                               \
          ctx, [](auto&&... a) { cpu::op(a...); }, __VA_ARGS__);                \
    DP_RUN_CUDA(ctx, op, __VA_ARGS__);                                          \
  } while (0)

// A CPU op (a callable over the op's arguments): run inside the device's arena now, or, while a
// graph captures on the context (kernels/runtime/graph.hpp), recorded with its arguments as the
// graph keeps them (DeviceContext::graph_arg) to run at each replay, as a CUDA graph replays a
// launch with the arguments it was captured with.
#define DP_RUN_CPU(ctx, call, ...)                                              \
  do {                                                                          \
    if ((ctx).capturing()) return record_for_graph((ctx), (call), __VA_ARGS__); \
    return run_cpu((ctx), [&] { (call)(__VA_ARGS__); });                        \
  } while (0)

// A CUDA op, queued on ctx's stream. A captured launch keeps the raw addresses it was given, so
// while a graph captures, the op's arguments are recorded too (never run), as the graph keeps
// them (DeviceContext::graph_arg): the graph holds the memory made before it until it is
// destroyed, as a CPU recording does, and no buffer a replay writes goes back to the cache when
// its owner lets it go (a layer's buffer replaced for a new shape, while the old shape's graph
// lives on); blocks taken while capturing are the graph's reservation's already.
#define DP_RUN_CUDA(ctx, op, ...)                                                 \
  do {                                                                            \
    if ((ctx).capturing()) record_for_graph((ctx), [](auto&...) {}, __VA_ARGS__); \
    DP_CUDA_DISPATCH(cuda::op(__VA_ARGS__, ctx));                                 \
  } while (0)

namespace kernels {

namespace {

// What a recording keeps of one argument (DeviceContext::graph_arg for tensors, also inside the
// device scalars, random offsets and source lists; other values as they are).
template <class T>
T graph_arg(DeviceContext&, const T& v) {
  return v;
}
[[maybe_unused]] Tensor graph_arg(DeviceContext& ctx, const Tensor& t) {
  return ctx.graph_arg(t);
}
[[maybe_unused]] Scalar graph_arg(DeviceContext& ctx, const Scalar& s) {
  Scalar r = s;
  r.at = ctx.graph_arg(s.at);
  return r;
}
[[maybe_unused]] RngOffset graph_arg(DeviceContext& ctx, const RngOffset& o) {
  RngOffset r = o;
  r.base = ctx.graph_arg(o.base);
  return r;
}
template <class T>
std::vector<T> graph_arg(DeviceContext& ctx, const std::vector<T>& v) {
  std::vector<T> r;
  r.reserve(v.size());
  for (const T& e : v) r.push_back(graph_arg(ctx, e));
  return r;
}

// requires ctx.capturing(). ensures `call` over the arguments as the graph keeps them is recorded
// on ctx: run at each replay on a CPU device, never on a CUDA one (it only holds them there).
template <class Call, class... Args>
void record_for_graph(DeviceContext& ctx, Call call, const Args&... args) {
  ctx.record([call, held = std::make_tuple(graph_arg(ctx, args)...)]() mutable {
    std::apply(call, held);
  });
}

// What an op's argument holds that a captured launch keeps besides its memory, as text
// (note_host_arguments): a value; a tensor's dtype, shape and offset in its memory; a device
// scalar or counter as such (its value is read when the op runs). Every argument type of the
// ops has an overload: a new one fails to compile until it gets one.
template <class T>
void describe(std::ostream& os, const T& v) {
  static_assert(std::is_arithmetic_v<T> || std::is_enum_v<T>,
                "describe: an op argument of a type without an overload");
  if constexpr (std::is_enum_v<T>) {
    os << static_cast<int64_t>(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    os << std::setprecision(std::numeric_limits<T>::max_digits10) << v;
  } else {
    os << +v;
  }
}
[[maybe_unused]] void describe(std::ostream& os, const Tensor& t) {
  if (!t.defined()) {
    os << "none";
    return;
  }
  os << dtype_name(t.dtype()) << " " << shape_str(t.shape());
  if (t.offset_bytes() != 0) os << " at byte " << t.offset_bytes();
}
[[maybe_unused]] void describe(std::ostream& os, const Scalar& s) {
  if (s.at.defined())
    os << "a device scalar";
  else
    describe(os, s.value);
}
[[maybe_unused]] void describe(std::ostream& os, const RngOffset& o) {
  if (o.base.defined()) os << "a device counter + ";
  describe(os, o.delta);
}
template <class T>
void describe(std::ostream& os, const std::vector<T>& v) {
  os << "{";
  for (size_t k = 0; k < v.size(); ++k) {
    if (k) os << ", ";
    describe(os, v[k]);
  }
  os << "}";
}
template <class T, size_t N>
void describe(std::ostream& os, const T (&v)[N], int n = static_cast<int>(N)) {
  os << "{";
  for (int k = 0; k < n; ++k) {
    if (k) os << ", ";
    describe(os, v[k]);
  }
  os << "}";
}
[[maybe_unused]] void describe(std::ostream& os, const Values& v) {
  describe(os, v.v, v.n);
}
[[maybe_unused]] void describe(std::ostream& os, const Layout& l) {
  os << "view ";
  describe(os, l.shape, l.ndim);
  os << " strides ";
  describe(os, l.stride, l.ndim);
  os << " from " << l.offset;
}
// Writes each of `parts` in turn: text as it is, anything else described.
template <class... Parts>
void describe_parts(std::ostream& os, const Parts&... parts) {
  auto one = [&os](const auto& part) {
    if constexpr (std::is_convertible_v<decltype(part), const char*>)
      os << part;
    else
      describe(os, part);
  };
  (one(parts), ...);
}
[[maybe_unused]] void describe(std::ostream& os, const Conv2dParams& p) {
  describe_parts(os, "stride ", p.stride_h, "x", p.stride_w, " pad ", p.pad_h, "x", p.pad_w);
}
[[maybe_unused]] void describe(std::ostream& os, const Pool2dParams& p) {
  describe_parts(os, "kernel ", p.kernel_h, "x", p.kernel_w, " stride ", p.stride_h, "x",
                 p.stride_w, " pad ", p.pad_h, "x", p.pad_w);
}
[[maybe_unused]] void describe(std::ostream& os, const AttentionParams& p) {
  describe_parts(os, "heads ", p.heads, " scale ", p.scale, " mask ", p.mask, " dropout ",
                 p.dropout, " seed ", p.dropout_seed, " at ", p.dropout_offset);
}
// The optimizers' constants (what the kernels read of their configs: the learning rate and the
// unscale come from the scalars tensor).
[[maybe_unused]] void describe(std::ostream& os, const SgdConfig& c) {
  describe_parts(os, "momentum ", c.momentum, " dampening ", c.dampening, " weight decay ",
                 c.weight_decay, " nesterov ", c.nesterov, " skip flag ", c.skip_if);
}
[[maybe_unused]] void describe(std::ostream& os, const AdamWConfig& c) {
  describe_parts(os, "betas ", c.beta1, " ", c.beta2, " eps ", c.eps, " skip flag ", c.skip_if);
}
[[maybe_unused]] void describe(std::ostream& os, const UnaryParams& p) {
  describe_parts(os, p.a, " ", p.b);
}

// requires ctx.noting(). ensures the op's note (DeviceContext::note_op: appended while a graph
// observes, compared while it captures, which throws where the two differ).
template <class... Args>
void note_host_arguments(DeviceContext& ctx, const char* op, const char* names,
                         const Args&... args) {
  DeviceContext::OpNote note;
  note.op = op;
  note.names = names;
  note.where = RangeNames::innermost();
  note.args.reserve(sizeof...(Args));
  auto add = [&](const auto& a) {
    std::ostringstream os;
    describe(os, a);
    note.args.push_back(os.str());
  };
  (add(args), ...);
  ctx.note_op(std::move(note));
}

[[maybe_unused]] void no_cuda(DeviceContext& ctx) {
  DP_THROW("device " << ctx.device() << " is not usable: " << cuda_unavailable_reason());
}

// Runs f inside the CPU device's arena and returns its result. Not while capturing: what
// returns a value to the host (count_correct, all_finite) cannot be captured; the rest goes
// through DP_RUN_CPU.
template <class F>
decltype(auto) run_cpu(DeviceContext& ctx, F&& f) {
  ctx.refuse_in_capture("an op that returns a value to the host");
  return ctx.arena().execute(std::forward<F>(f));
}

}  // namespace
}  // namespace kernels
