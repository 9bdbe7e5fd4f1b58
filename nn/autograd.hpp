// Autograd for research layers: write a layer's forward as a composition of ops on ag::Var and
// its backward is derived. A complete layer (samples/custom_layer.cpp builds one):
//
//   namespace ag = nn::ag;
//   class MyRMSNorm : public nn::Composed {
//    public:
//     explicit MyRMSNorm(int64_t d)
//         : d_(d), g_(register_parameter("weight", {d}, nn::InitSpec::constant(1.f))) {}
//     std::string type_name() const override { return "MyRMSNorm"; }
//
//    protected:
//     Var compose(const Var& x) override {
//       return x * rsqrt(mean(x * x, -1, ag::keepdim) + 1e-6f) * param(g_);
//     }
//     nn::ModulePtr clone_config() const override { return std::make_shared<MyRMSNorm>(d_); }
//
//    private:
//     int64_t d_;
//     nn::Parameter& g_;
//   };
//
// The ops (below): + - * / with Vars and floats, exp, log, sqrt, rsqrt, reciprocal, abs, pow,
// sigmoid, tanh, silu, gelu, gelu_tanh, relu, maximum, minimum, where; sum, mean, amax over a dim;
// softmax, log_softmax; reshape, permute, transpose, narrow, split, expand, cat; matmul (batched
// over leading dims), linear, embedding; cast; call(a built-in module). Unqualified calls find
// them by argument-dependent lookup; those taking a braced list (cat) are written ag::cat.
//
// How it runs: the first forward of an input shape (and dtype and mode) calls compose() once,
// which runs each op and records it on a tape with its output; later forwards of that shape
// replay the tape into the same tensors without calling compose(). Backward walks the tape in
// reverse with gradient buffers made on the first backward. So once warm, a composed step
// allocates nothing, reads nothing back to the host and can be captured into a CUDA graph (or a
// CPU device's graph); the rule that makes it true: compose() may use only ops on Vars (no host
// reads of tensor data, no loops over values), and its structure may depend only on shapes,
// dtypes and is_training(). Host numbers compose() reads (a temperature, a schedule's value in a
// member) are part of that structure: the tape keeps the value it was recorded with, and a
// replay does not see a new one. Keep such a value in a constant or a parameter tensor, or call
// forget_tapes() after changing it (the next forward records again, allocating, and an engine's
// captured steps are captured again: Module::host_values_changed).
//
// A parameter another module owns and this layer reads through param() (a tied weight: the
// embedding table used again as the output head) gets gradient here after that module's
// backward: its gradient-ready hook is held until this layer's backward is done, so DP's and
// DDP's buckets never send it incomplete.
//
// Parameters are the module's own (register_parameter): their gradients add into the flat
// gradient buffer and the gradient-ready hooks fire after the layer's backward, as for any
// layer, so DP's reduce and DDP's buckets overlap with it. Mixed precision: param() reads the
// 16-bit weights under a 16-bit compute dtype and matmul takes its operands in the compute dtype;
// elementwise ops keep a dtype both operands share, else f32. Ops are kernels/tensor_ops.hpp's
// (CPU and CUDA); built-in layers can be called inside compose() with call().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/tensor_ops.hpp"
#include "nn/module.hpp"

namespace nn {

class Composed;

namespace ag {

using kernels::Accumulate;
using kernels::BinaryOp;
using kernels::Layout;
using kernels::ReduceOp;
using kernels::UnaryOp;

using kernels::Operand;
using kernels::Softmax;
using kernels::Transpose;

class Tape;

// A value on a tape: the layer's input, a parameter, a constant or an op's output.
class Var {
 public:
  Var() = default;
  Var(Tape* t, uint64_t serial, int id) : tape_(t), serial_(serial), id_(id) {}
  const Tensor& value() const;
  const Shape& shape() const { return value().shape(); }
  int ndim() const { return value().ndim(); }
  int64_t dim(int d) const { return value().dim(d); }  // negative counts from the end
  DType dtype() const { return value().dtype(); }
  Tape* tape() const { return tape_; }
  // The serial of the forward that made it: a tape made later at a freed tape's address has
  // another one, so a Var kept from an earlier forward is told apart from this forward's.
  uint64_t serial() const { return serial_; }
  int id() const { return id_; }

 private:
  Tape* tape_ = nullptr;
  uint64_t serial_ = 0;
  int id_ = -1;
};

constexpr bool keepdim = true;

// The tape of one composed forward (one input shape, dtype and mode): its values, and per op a
// forward that rewrites its output in place and a backward that writes or adds its inputs'
// gradients.
class Tape {
 public:
  enum class Kind { input, param, constant, op };
  struct Slot {
    Kind kind = Kind::op;
    Tensor value;
    Tensor master;  // a parameter's f32 value (value is what GEMMs read: 16-bit under AMP)
    Tensor grad;    // a parameter's: its view of the flat gradient buffer
    bool requires_grad = false;
    int consumers = 0;         // ops that read it
    bool live = false;         // gets a gradient in backward
    bool view = false;         // a view of another slot's tensor (reshape), written by no op
    bool master_read = false;  // an op reads a parameter's f32 value (read_master), not its copy
  };
  struct Node {
    std::vector<int> in;
    int out = -1;
    std::vector<bool> flows;  // whether a gradient flows to input i (not to where's mask)
    std::function<void(Tape&, const Node&)> forward;
    std::function<void(Tape&, const Node&)> backward;
    // Planned by the first backward: acc[i] writes (first writer) or adds input i's gradient;
    // need[i] whether it is wanted at all.
    std::vector<Accumulate> acc;
    std::vector<bool> need;
    bool runs_backward = false;
  };
  using Step = std::function<void(Tape&, const Node&)>;

  Tape(Module& owner, Device device) : owner_(owner), device_(device), serial_(next_serial()) {
    std::lock_guard<std::mutex> lock(live_mutex());
    live()[this] = serial_;
  }
  ~Tape() {
    std::lock_guard<std::mutex> lock(live_mutex());
    live().erase(this);
  }
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;
  // Whether the tape of forward `serial` is still at `t` (a layer frees its tapes past
  // kMaxTapes input shapes): a Var kept past its forward is then refused, not read freed.
  static bool is_live(const Tape* t, uint64_t serial) {
    std::lock_guard<std::mutex> lock(live_mutex());
    auto it = live().find(t);
    return it != live().end() && it->second == serial;
  }
  Module& owner() { return owner_; }
  Device device() const { return device_; }
  uint64_t serial() const { return serial_; }
  // Whether v was made by this forward (compares, never dereferences, v's tape).
  bool owns(const Var& v) const { return v.tape() == this && v.serial() == serial_; }
  Slot& slot(int id) { return slots_[static_cast<size_t>(id)]; }
  Var var(int id) { return Var(this, serial_, id); }
  // Whether slot `id` is a parameter or a constant, or a view of one's memory (a reshape).
  bool in_weights(int id) {
    const Slot& s = slot(id);
    if (s.kind == Kind::param || s.kind == Kind::constant) return true;
    if (s.kind != Kind::op || !s.view) return false;
    for (const Slot& o : slots_)
      if ((o.kind == Kind::param || o.kind == Kind::constant) && o.value.defined() &&
          o.value.same_storage(s.value))
        return true;
    return false;
  }
  // An op's tensors: its output, input i, and their gradients.
  Tensor& out(const Node& n) { return slot(n.out).value; }
  const Tensor& in(const Node& n, size_t i) { return slot(n.in[i]).value; }
  Tensor& dout(const Node& n) { return slot(n.out).grad; }
  Tensor& din(const Node& n, size_t i) { return slot(n.in[i]).grad; }
  // Input i's f32 value: a parameter's master copy (its value is 16-bit under AMP), in a replay.
  // An op that reads it records with read_master, which says so.
  const Tensor& master(const Node& n, size_t i) {
    Slot& s = slot(n.in[i]);
    return s.master.defined() ? s.master : s.value;
  }
  // Slot id's f32 value, at an op's record: a parameter read so is not read through its 16-bit
  // copy alone (Parameter::read_through_copy; Composed settles it after compose()).
  const Tensor& read_master(int id) {
    Slot& s = slot(id);
    s.master_read = true;
    return s.master.defined() ? s.master : s.value;
  }
  // Whether an op of this forward read parameter p's f32 value (read_master).
  bool master_read(const Parameter* p) const {
    auto it = named_.find(p);
    return it != named_.end() && slots_[static_cast<size_t>(it->second)].master_read;
  }

  int add_slot(Kind kind, Tensor value, bool requires_grad) {
    Slot s;
    s.kind = kind;
    s.value = std::move(value);
    s.requires_grad = requires_grad;
    slots_.push_back(std::move(s));
    return static_cast<int>(slots_.size()) - 1;
  }

  // Records an op whose forward has just run once, writing `out`. `flows` (default all) says
  // which inputs get a gradient; `has_params` marks an op whose output needs backward for its
  // own parameters (a built-in layer called inside compose()).
  Var record(const std::vector<Var>& ins, Tensor out, Step forward, Step backward,
             std::vector<bool> flows = {}, bool has_params = false) {
    Node n;
    n.flows = flows.empty() ? std::vector<bool>(ins.size(), true) : std::move(flows);
    bool rg = has_params;
    for (size_t i = 0; i < ins.size(); ++i) {
      DP_CHECK(owns(ins[i]), owner_.type_name() << ": a Var from another forward used in compose() "
                                                   "(keep no Var from one step to the next)");
      n.in.push_back(ins[i].id());
      slot(ins[i].id()).consumers++;
      rg = rg || (n.flows[i] && slot(ins[i].id()).requires_grad);
    }
    n.out = add_slot(Kind::op, std::move(out), rg);
    n.forward = std::move(forward);
    n.backward = std::move(backward);
    nodes_.push_back(std::move(n));
    return var(nodes_.back().out);
  }

  void finish(int input, int output) {
    input_ = input;
    output_ = output;
  }
  // Replays the ops with the input bound to x; returns the output. An x that is one of the
  // tensors this tape's ops write (the layer applied to its own output, m(m(x))) is copied
  // first: the ops would write over what they read. Views are skipped: a reshape of the last
  // input shares x's storage, and writes nothing.
  Tensor replay(const Tensor& x) {
    bool aliased = false;
    for (const Slot& s : slots_)
      aliased = aliased ||
                (s.kind == Kind::op && !s.view && s.value.defined() && s.value.same_storage(x));
    if (aliased) {
      Tensor copy = Tensor::empty(x.shape(), x.dtype(), device_);
      kernels::copy(copy, x);
      slot(input_).value = copy;
    } else {
      slot(input_).value = x;
    }
    for (const Node& n : nodes_) n.forward(*this, n);
    return slot(output_).value;
  }

  // dy in; the input's gradient out (undefined when the input wants none).
  Tensor backward(const Tensor& dy) {
    if (!planned_) plan_backward();
    Slot& out = slot(output_);
    DP_CHECK(dy.shape() == out.value.shape(),
             owner_.type_name() << "::backward: dy " << kernels::shape_str(dy.shape())
                                << " for an output of " << kernels::shape_str(out.value.shape()));
    if (out.requires_grad) {
      if (seed_direct_ && dy.dtype() == out.value.dtype()) {
        out.grad = dy;
      } else {
        if (!out.grad.defined() || out.grad.same_storage(dy))
          out.grad = Tensor::empty(out.value.shape(), out.value.dtype(), device_);
        const Layout l = kernels::contiguous_layout(dy.shape());
        kernels::strided_copy(out.grad, l, dy, l,
                              out.kind == Kind::param ? Accumulate::yes : Accumulate::no);
      }
    }
    for (auto it = nodes_.rbegin(); it != nodes_.rend(); ++it)
      if (it->runs_backward) it->backward(*this, *it);
    Slot& in = slot(input_);
    if (!in.requires_grad) return Tensor();
    if (!in.live) kernels::fill(in.grad, 0.f);
    return in.grad;
  }

  // Whether `m` is called (ag::call) for the first time in this forward.
  bool first_call(const void* m) { return called_.insert(m).second; }
  bool has_called(const void* m) const { return called_.count(m) > 0; }
  // The parameters this forward reads (Composed::param), each once, in first-read order.
  void note_param(Parameter* p) { params_read_.push_back(p); }
  const std::vector<Parameter*>& params_read() const { return params_read_; }
  bool has_slot(const void* key) const { return named_.count(key) > 0; }
  // The slot of a parameter or constant (one per tensor per tape).
  int slot_of(const void* key, const std::function<int()>& make) {
    auto it = named_.find(key);
    if (it != named_.end()) return it->second;
    return named_[key] = make();
  }

 private:
  // Which ops run backward, which gradients each writes or adds, and the gradient buffers.
  void plan_backward() {
    planned_ = true;
    Slot& out = slot(output_);
    std::vector<bool> written(slots_.size(), false);
    if (out.requires_grad) {
      out.live = true;
      // dy itself is the output's gradient when nothing else writes it.
      seed_direct_ = out.kind == Kind::op && out.consumers == 0;
      written[static_cast<size_t>(output_)] = true;
    }
    for (auto it = nodes_.rbegin(); it != nodes_.rend(); ++it) {
      Node& n = *it;
      n.runs_backward = slot(n.out).live;
      n.acc.assign(n.in.size(), Accumulate::yes);
      n.need.assign(n.in.size(), false);
      if (!n.runs_backward) continue;
      for (size_t i = 0; i < n.in.size(); ++i) {
        Slot& s = slot(n.in[i]);
        if (!n.flows[i] || !s.requires_grad) continue;
        n.need[i] = true;
        s.live = true;
        if (s.kind == Kind::param) continue;  // adds into the flat gradient buffer
        if (!written[static_cast<size_t>(n.in[i])]) n.acc[i] = Accumulate::no;
        written[static_cast<size_t>(n.in[i])] = true;
      }
    }
    for (size_t id = 0; id < slots_.size(); ++id) {
      Slot& s = slots_[id];
      if (s.kind == Kind::param || !s.requires_grad) continue;
      if (static_cast<int>(id) == output_ && seed_direct_) continue;
      if (s.live || static_cast<int>(id) == input_)
        s.grad = Tensor::empty(s.value.shape(), s.value.dtype(), device_);
    }
  }

  static uint64_t next_serial() {
    static std::atomic<uint64_t> counter{0};
    return ++counter;
  }
  static std::map<const Tape*, uint64_t>& live() {
    static std::map<const Tape*, uint64_t> tapes;
    return tapes;
  }
  static std::mutex& live_mutex() {
    static std::mutex m;
    return m;
  }

  Module& owner_;
  Device device_;
  uint64_t serial_;
  std::deque<Slot> slots_;  // a deque: references to a slot survive new slots
  std::vector<Node> nodes_;
  std::map<const void*, int> named_;
  std::vector<Parameter*> params_read_;
  std::set<const void*> called_;
  int input_ = -1, output_ = -1;
  bool planned_ = false, seed_direct_ = false;
};

inline const Tensor& Var::value() const {
  DP_CHECK(tape_ != nullptr, "autograd: an empty Var (default-constructed)");
  DP_CHECK(Tape::is_live(tape_, serial_),
           "autograd: a Var of a forward whose tape is gone (a composed layer keeps the tapes of "
           "8 input shapes and frees them all at the 9th): keep no Var past its compose()");
  return tape_->slot(id_).value;
}

// ---- helpers of the ops --------------------------------------------------------------------

// A dim in [0, ndim), from a possibly negative one.
inline int resolve_dim(int dim, int ndim, const char* op) {
  const int d = dim < 0 ? dim + ndim : dim;
  DP_CHECK(d >= 0 && d < ndim,
           op << ": dim " << dim << " out of range for a " << ndim << "-D tensor");
  return d;
}
// The tape this thread is recording (the innermost compose() running on it), or null.
inline Tape*& recording_tape() {
  static thread_local Tape* t = nullptr;
  return t;
}
// The forward v belongs to, which must be the one this thread records: a Var kept from an earlier
// forward is refused before its tape, possibly freed, is touched.
inline Tape& tape_of(const Var& v, const char* op) {
  DP_CHECK(v.tape() != nullptr, op << ": an empty Var (default-constructed)");
  Tape* t = recording_tape();
  DP_CHECK(t != nullptr, op << ": an ag op outside compose()");
  DP_CHECK(t->owns(v), op << ": a Var from another forward used in compose() (keep no Var "
                             "from one step to the next)");
  return *t;
}
inline Tape& tape_of(const Var& a, const Var& b, const char* op) {
  Tape& t = tape_of(a, op);
  tape_of(b, op);
  return t;
}
// The dtype two operands' result takes: theirs when they share it, else f32.
inline DType result_dtype(DType a, DType b) {
  return a == b ? a : DType::f32;
}
// dst (+)= src (src of dst's element count).
inline void copy_into(Tensor& dst, const Tensor& src, Accumulate acc) {
  const Layout l = kernels::contiguous_layout(dst.shape());
  kernels::strided_copy(dst, l, src.reshape(dst.shape()), l, acc);
}
// x's contiguous strides, as a layout of x's shape.
inline Layout layout_of(const Shape& s) {
  return kernels::contiguous_layout(s);
}

// ---- elementwise ---------------------------------------------------------------------------

// y = op(x) in x's dtype; `dtype` f32, f16 or bf16 converts (UnaryOp::identity: a cast).
inline Var unary(const Var& x, UnaryOp op, kernels::UnaryParams p = {},
                 std::optional<DType> dtype = std::nullopt) {
  Tape& t = tape_of(x, kernels::unary_name(op));
  Tensor y = Tensor::empty(x.shape(), dtype.value_or(x.dtype()), t.device());
  kernels::unary(y, x.value(), op, p);
  return t.record(
      {x}, y,
      [op, p](Tape& t, const Tape::Node& n) { kernels::unary(t.out(n), t.in(n, 0), op, p); },
      [op, p](Tape& t, const Tape::Node& n) {
        kernels::unary_backward(t.din(n, 0), t.dout(n), t.in(n, 0), t.out(n), op, p, n.acc[0]);
      });
}
inline Var cast(const Var& x, DType dtype) {
  return x.dtype() == dtype ? x : unary(x, UnaryOp::identity, {}, dtype);
}
inline Var exp(const Var& x) {
  return unary(x, UnaryOp::exp);
}
inline Var log(const Var& x) {
  return unary(x, UnaryOp::log);
}
inline Var sqrt(const Var& x) {
  return unary(x, UnaryOp::sqrt);
}
inline Var rsqrt(const Var& x) {
  return unary(x, UnaryOp::rsqrt);
}
inline Var reciprocal(const Var& x) {
  return unary(x, UnaryOp::reciprocal);
}
inline Var abs(const Var& x) {
  return unary(x, UnaryOp::abs);
}
inline Var pow(const Var& x, float exponent) {
  return unary(x, UnaryOp::pow, {exponent, 0.f});
}
inline Var sigmoid(const Var& x) {
  return unary(x, UnaryOp::sigmoid);
}
inline Var tanh(const Var& x) {
  return unary(x, UnaryOp::tanh);
}
inline Var silu(const Var& x) {
  return unary(x, UnaryOp::silu);
}
inline Var gelu(const Var& x) {
  return unary(x, UnaryOp::gelu_erf);
}
inline Var gelu_tanh(const Var& x) {
  return unary(x, UnaryOp::gelu_tanh);
}
inline Var relu(const Var& x) {
  return unary(x, UnaryOp::relu);
}
// a x + b in one op.
inline Var affine(const Var& x, float a, float b) {
  return unary(x, UnaryOp::affine, {a, b});
}
inline Var operator-(const Var& x) {
  return unary(x, UnaryOp::neg);
}
inline Var operator+(const Var& x, float s) {
  return affine(x, 1.f, s);
}
inline Var operator+(float s, const Var& x) {
  return affine(x, 1.f, s);
}
inline Var operator-(const Var& x, float s) {
  return affine(x, 1.f, -s);
}
inline Var operator-(float s, const Var& x) {
  return affine(x, -1.f, s);
}
inline Var operator*(const Var& x, float s) {
  return affine(x, s, 0.f);
}
inline Var operator*(float s, const Var& x) {
  return affine(x, s, 0.f);
}
inline Var operator/(const Var& x, float s) {
  return affine(x, 1.f / s, 0.f);
}
inline Var operator/(float s, const Var& x) {
  return affine(reciprocal(x), s, 0.f);
}

// a op b with NumPy broadcasting; the result in the dtype both share, else f32.
inline Var binary(const Var& a, const Var& b, BinaryOp op) {
  Tape& t = tape_of(a, b, kernels::binary_name(op));
  Tensor y = Tensor::empty(kernels::broadcast_shape(a.shape(), b.shape()),
                           result_dtype(a.dtype(), b.dtype()), t.device());
  kernels::binary(y, a.value(), b.value(), op);
  return t.record(
      {a, b}, y,
      [op](Tape& t, const Tape::Node& n) { kernels::binary(t.out(n), t.in(n, 0), t.in(n, 1), op); },
      [op](Tape& t, const Tape::Node& n) {
        for (size_t i = 0; i < 2; ++i)
          if (n.need[i])
            kernels::binary_backward(t.din(n, i), i == 0 ? Operand::a : Operand::b, t.dout(n),
                                     t.in(n, 0), t.in(n, 1), op, n.acc[i]);
      });
}
inline Var operator+(const Var& a, const Var& b) {
  return binary(a, b, BinaryOp::add);
}
inline Var operator-(const Var& a, const Var& b) {
  return binary(a, b, BinaryOp::sub);
}
inline Var operator*(const Var& a, const Var& b) {
  return binary(a, b, BinaryOp::mul);
}
inline Var operator/(const Var& a, const Var& b) {
  return binary(a, b, BinaryOp::div);
}
inline Var maximum(const Var& a, const Var& b) {
  return binary(a, b, BinaryOp::maximum);
}
inline Var minimum(const Var& a, const Var& b) {
  return binary(a, b, BinaryOp::minimum);
}

// mask != 0 ? a : b, broadcasting all three; no gradient flows to the mask.
inline Var where(const Var& mask, const Var& a, const Var& b) {
  Tape& t = tape_of(a, b, "where");
  tape_of(mask, a, "where");
  Tensor y = Tensor::empty(
      kernels::broadcast_shape(kernels::broadcast_shape(mask.shape(), a.shape()), b.shape()),
      result_dtype(a.dtype(), b.dtype()), t.device());
  kernels::where(y, mask.value(), a.value(), b.value());
  return t.record(
      {mask, a, b}, y,
      [](Tape& t, const Tape::Node& n) {
        kernels::where(t.out(n), t.in(n, 0), t.in(n, 1), t.in(n, 2));
      },
      [](Tape& t, const Tape::Node& n) {
        for (size_t i = 1; i < 3; ++i)
          if (n.need[i])
            kernels::where_backward(t.din(n, i), i == 1 ? Operand::a : Operand::b, t.dout(n),
                                    t.in(n, 0), n.acc[i]);
      },
      {false, true, true});
}

// ---- reductions ----------------------------------------------------------------------------

inline Var reduce(const Var& x, int dim, bool keep, ReduceOp op) {
  const char* name = kernels::reduce_name(op);
  Tape& t = tape_of(x, name);
  const int d = resolve_dim(dim, x.ndim(), name);
  Shape s = x.shape();
  if (keep)
    s[static_cast<size_t>(d)] = 1;
  else
    s.erase(s.begin() + d);
  Tensor y = Tensor::empty(s, x.dtype(), t.device());
  kernels::reduce(y, x.value(), d, op);
  return t.record(
      {x}, y,
      [d, op](Tape& t, const Tape::Node& n) { kernels::reduce(t.out(n), t.in(n, 0), d, op); },
      [d, op](Tape& t, const Tape::Node& n) {
        kernels::reduce_backward(t.din(n, 0), t.dout(n), t.in(n, 0), t.out(n), d, op, n.acc[0]);
      });
}
inline Var sum(const Var& x, int dim, bool keep = false) {
  return reduce(x, dim, keep, ReduceOp::sum);
}
inline Var mean(const Var& x, int dim, bool keep = false) {
  return reduce(x, dim, keep, ReduceOp::mean);
}
// The maximum over dim: ties each take the whole gradient (torch.amax splits it evenly among
// them; they differ only where values tie exactly).
inline Var amax(const Var& x, int dim, bool keep = false) {
  return reduce(x, dim, keep, ReduceOp::max);
}

inline Var softmax(const Var& x, int dim, Softmax kind = Softmax::softmax) {
  Tape& t = tape_of(x, "softmax");
  const int d = resolve_dim(dim, x.ndim(), "softmax");
  Tensor y = Tensor::empty(x.shape(), x.dtype(), t.device());
  kernels::softmax(y, x.value(), d, kind);
  return t.record(
      {x}, y,
      [d, kind](Tape& t, const Tape::Node& n) { kernels::softmax(t.out(n), t.in(n, 0), d, kind); },
      [d, kind](Tape& t, const Tape::Node& n) {
        kernels::softmax_backward(t.din(n, 0), t.dout(n), t.out(n), d, kind, n.acc[0]);
      });
}
inline Var log_softmax(const Var& x, int dim) {
  return softmax(x, dim, Softmax::log_softmax);
}

// ---- shapes --------------------------------------------------------------------------------

// A view of x's elements in `shape` (one dimension may be -1: inferred). No copy.
inline Var reshape(const Var& x, Shape shape) {
  Tape& t = tape_of(x, "reshape");
  int64_t known = 1;
  int infer = -1;
  for (size_t k = 0; k < shape.size(); ++k) {
    if (shape[k] == -1) {
      DP_CHECK(infer < 0, "reshape: more than one -1 in " << kernels::shape_str(shape));
      infer = static_cast<int>(k);
    } else {
      known *= shape[k];
    }
  }
  if (infer >= 0) {
    DP_CHECK(known > 0 && x.value().numel() % known == 0,
             "reshape: " << kernels::shape_str(x.shape()) << " into " << kernels::shape_str(shape));
    shape[static_cast<size_t>(infer)] = x.value().numel() / known;
  }
  Tensor y = x.value().reshape(shape);
  Var v = t.record(
      {x}, y, [shape](Tape& t, const Tape::Node& n) { t.out(n) = t.in(n, 0).reshape(shape); },
      [](Tape& t, const Tape::Node& n) { copy_into(t.din(n, 0), t.dout(n), n.acc[0]); });
  t.slot(v.id()).view = true;
  return v;
}

// Copies x's elements seen through `src` (a view of x's storage) into a new contiguous tensor;
// backward scatters (adds) the gradient back through the same view.
inline Var gather_view(const Var& x, const Layout& src, const char* name) {
  Tape& t = tape_of(x, name);
  Tensor y = Tensor::empty(src.sizes(), x.dtype(), t.device());
  const Layout dst = layout_of(src.sizes());
  kernels::strided_copy(y, dst, x.value(), src, Accumulate::no);
  // Whether the view covers every element of x once (a permutation): else backward zeroes the
  // rest first when it writes.
  const bool covers = src.numel() == x.value().numel() && src.offset == 0;
  return t.record(
      {x}, y,
      [src, dst](Tape& t, const Tape::Node& n) {
        kernels::strided_copy(t.out(n), dst, t.in(n, 0), src, Accumulate::no);
      },
      [src, dst, covers](Tape& t, const Tape::Node& n) {
        Accumulate acc = n.acc[0];
        if (acc == Accumulate::no && !covers) kernels::fill(t.din(n, 0), 0.f);
        kernels::strided_copy(t.din(n, 0), src, t.dout(n), dst, acc);
      });
}

// Dimensions reordered: y's dim k is x's dim perm[k] (a copy).
inline Var permute(const Var& x, const std::vector<int>& perm) {
  DP_CHECK(static_cast<int>(perm.size()) == x.ndim(),
           "permute: " << perm.size() << " dims for " << kernels::shape_str(x.shape()));
  const Layout xl = layout_of(x.shape());
  Layout src;
  src.ndim = x.ndim();
  std::vector<bool> seen(perm.size(), false);
  for (int k = 0; k < src.ndim; ++k) {
    const int d = resolve_dim(perm[static_cast<size_t>(k)], x.ndim(), "permute");
    DP_CHECK(!seen[static_cast<size_t>(d)], "permute: dim " << d << " given twice");
    seen[static_cast<size_t>(d)] = true;
    src.shape[k] = xl.shape[d];
    src.stride[k] = xl.stride[d];
  }
  return gather_view(x, src, "permute");
}
inline Var transpose(const Var& x, int d0, int d1) {
  std::vector<int> perm(static_cast<size_t>(x.ndim()));
  for (int k = 0; k < x.ndim(); ++k) perm[static_cast<size_t>(k)] = k;
  std::swap(perm[static_cast<size_t>(resolve_dim(d0, x.ndim(), "transpose"))],
            perm[static_cast<size_t>(resolve_dim(d1, x.ndim(), "transpose"))]);
  return permute(x, perm);
}
// Elements [start, start + length) along dim (a copy).
inline Var narrow(const Var& x, int dim, int64_t start, int64_t length) {
  const int d = resolve_dim(dim, x.ndim(), "narrow");
  DP_CHECK(start >= 0 && length >= 0 && start <= x.dim(d) && length <= x.dim(d) - start,
           "narrow: start " << start << ", length " << length << " along dim " << d << " of "
                            << kernels::shape_str(x.shape()));
  Layout src = layout_of(x.shape());
  src.offset = start * src.stride[d];
  src.shape[d] = length;
  return gather_view(x, src, "narrow");
}
// Pieces of `sizes` along dim (narrow each).
inline std::vector<Var> split(const Var& x, int dim, const std::vector<int64_t>& sizes) {
  std::vector<Var> out;
  int64_t at = 0;
  for (int64_t s : sizes) out.push_back(narrow(x, dim, at, s)), at += s;
  DP_CHECK(at == x.dim(resolve_dim(dim, x.ndim(), "split")), "split: sizes add to "
                                                                 << at << ", dim " << dim << " of "
                                                                 << kernels::shape_str(x.shape()));
  return out;
}
// x broadcast to `shape` (a copy); backward sums over the broadcast dims.
inline Var expand(const Var& x, const Shape& shape) {
  Tape& t = tape_of(x, "expand");
  DP_CHECK(shape.size() >= x.shape().size() && kernels::broadcast_shape(x.shape(), shape) == shape,
           "expand: " << kernels::shape_str(x.shape()) << " to " << kernels::shape_str(shape));
  Layout src = layout_of(shape);
  const Layout xl = layout_of(x.shape());
  const int lead = src.ndim - xl.ndim;
  for (int k = 0; k < src.ndim; ++k)
    src.stride[k] = k < lead || xl.shape[k - lead] == 1 ? 0 : xl.stride[k - lead];
  Tensor y = Tensor::empty(shape, x.dtype(), t.device());
  const Layout dst = layout_of(shape);
  kernels::strided_copy(y, dst, x.value(), src, Accumulate::no);
  return t.record(
      {x}, y,
      [src, dst](Tape& t, const Tape::Node& n) {
        kernels::strided_copy(t.out(n), dst, t.in(n, 0), src, Accumulate::no);
      },
      [](Tape& t, const Tape::Node& n) {  // the sum over the broadcast: add's gradient
        kernels::binary_backward(t.din(n, 0), Operand::a, t.dout(n), t.in(n, 0), t.dout(n),
                                 BinaryOp::add, n.acc[0]);
      });
}
// xs joined along dim (all other dims equal).
inline Var cat(const std::vector<Var>& xs, int dim) {
  DP_CHECK(!xs.empty(), "cat: no tensors");
  Tape& t = tape_of(xs[0], "cat");
  const int d = resolve_dim(dim, xs[0].ndim(), "cat");
  Shape s = xs[0].shape();
  s[static_cast<size_t>(d)] = 0;
  const Shape ref = s;
  DType dtype = xs[0].dtype();
  for (const Var& x : xs) {
    tape_of(x, xs[0], "cat");
    Shape o = x.shape();
    DP_CHECK(o.size() == s.size(), "cat: " << kernels::shape_str(o) << " and "
                                           << kernels::shape_str(xs[0].shape())
                                           << " differ in rank");
    o[static_cast<size_t>(d)] = 0;
    DP_CHECK(o == ref, "cat: " << kernels::shape_str(x.shape()) << " and "
                               << kernels::shape_str(xs[0].shape()) << " differ outside dim " << d);
    s[static_cast<size_t>(d)] += x.dim(d);
    dtype = result_dtype(dtype, x.dtype());
  }
  Tensor y = Tensor::empty(s, dtype, t.device());
  const Layout yl = layout_of(s);
  std::vector<Layout> parts;
  int64_t at = 0;
  for (const Var& x : xs) {
    Layout p = yl;
    p.shape[d] = x.dim(d);
    p.offset = at * yl.stride[d];
    at += x.dim(d);
    parts.push_back(p);
    kernels::strided_copy(y, p, x.value(), layout_of(x.shape()), Accumulate::no);
  }
  return t.record(
      xs, y,
      [parts](Tape& t, const Tape::Node& n) {
        for (size_t i = 0; i < parts.size(); ++i)
          kernels::strided_copy(t.out(n), parts[i], t.in(n, i), layout_of(t.in(n, i).shape()),
                                Accumulate::no);
      },
      [parts](Tape& t, const Tape::Node& n) {
        for (size_t i = 0; i < parts.size(); ++i)
          if (n.need[i])
            kernels::strided_copy(t.din(n, i), layout_of(t.in(n, i).shape()), t.dout(n), parts[i],
                                  n.acc[i]);
      });
}

// ---- products ------------------------------------------------------------------------------

// a (..., M, K) times b: (K, N), or (..., K, N) with a's leading dims, as stored (tb no) or
// given as its transpose (tb yes: b is (N, K) or (..., N, K)). Operands in the compute dtype
// (cast once when they are not); the result in the activation dtype.
inline Var matmul(Var a, Var b, Transpose tb = Transpose::no) {
  Tape& t = tape_of(a, b, "matmul");
  Module& m = t.owner();
  DP_CHECK(a.ndim() >= 2 && b.ndim() >= 2, "matmul: " << kernels::shape_str(a.shape()) << " and "
                                                      << kernels::shape_str(b.shape())
                                                      << " (both need 2 or more dims)");
  const DType cd = m.compute_dtype();
  a = cast(a, cd);
  b = cast(b, cd);
  const bool tr = tb == Transpose::yes;
  const int64_t M = a.dim(-2), K = a.dim(-1);
  const int64_t Kb = tr ? b.dim(-1) : b.dim(-2), N = tr ? b.dim(-2) : b.dim(-1);
  const bool flat_b = b.ndim() == 2;
  DP_CHECK(K == Kb &&
               (flat_b || (a.ndim() == b.ndim() &&
                           std::equal(a.shape().begin(), a.shape().end() - 2, b.shape().begin()))),
           "matmul: " << kernels::shape_str(a.shape()) << " times " << kernels::shape_str(b.shape())
                      << (tr ? " transposed" : "") << ": inner dims or leading dims differ");
  int64_t batch = 1;  // the product of the leading dims (not numel / (M K): K may be 0)
  for (int d = 0; d + 2 < a.ndim(); ++d) batch *= a.dim(d);
  Shape s = a.shape();
  s.back() = N;
  Tensor y = Tensor::empty(s, cd == DType::f32 ? DType::f32 : m.activation_dtype(), t.device());
  const Shape bs{tr ? N : K, tr ? K : N};
  // The i-th matrices of a tensor of `rows` x `cols` matrices.
  auto mat = [](const Tensor& x, int64_t i, int64_t rows, int64_t cols) {
    return x.view(i * rows * cols, {rows, cols});
  };
  auto run = [=](Tensor& out, const Tensor& av, const Tensor& bv) {
    if (flat_b) {
      Tensor o = out.reshape({batch * M, N});
      kernels::gemm(o, av.reshape({batch * M, K}), Transpose::no, bv, tb);
      return;
    }
    for (int64_t i = 0; i < batch; ++i) {
      Tensor o = mat(out, i, M, N);
      kernels::gemm(o, mat(av, i, M, K), Transpose::no, mat(bv, i, bs[0], bs[1]), tb);
    }
  };
  run(y, a.value(), b.value());
  auto dy_in_cd = std::make_shared<Tensor>();  // dy cast to the compute dtype, when it is not
  return t.record(
      {a, b}, y, [run](Tape& t, const Tape::Node& n) { run(t.out(n), t.in(n, 0), t.in(n, 1)); },
      [=](Tape& t, const Tape::Node& n) {
        Tensor dy = t.dout(n);
        if (dy.dtype() != cd) {
          kernels::ensure(*dy_in_cd, dy.shape(), cd, t.device());
          copy_into(*dy_in_cd, dy, Accumulate::no);
          dy = *dy_in_cd;
        }
        const Tensor &av = t.in(n, 0), &bv = t.in(n, 1);
        const float beta_a = n.acc[0] == Accumulate::yes ? 1.f : 0.f;
        const float beta_b = n.acc[1] == Accumulate::yes ? 1.f : 0.f;
        const int64_t nb = flat_b ? 1 : batch, rows = flat_b ? batch * M : M;
        for (int64_t i = 0; i < nb; ++i) {
          const Tensor dyi = mat(dy, i, rows, N), ai = mat(av, i, rows, K);
          const Tensor bi = flat_b ? bv : mat(bv, i, bs[0], bs[1]);
          if (n.need[0]) {  // da = dy op(b)^T
            Tensor dai = mat(t.din(n, 0), i, rows, K);
            kernels::gemm(dai, dyi, Transpose::no, bi, tr ? Transpose::no : Transpose::yes, 1.f,
                          beta_a);
          }
          if (n.need[1]) {  // db = a^T dy, or dy^T a when b is given transposed
            Tensor dbi = flat_b ? t.din(n, 1) : mat(t.din(n, 1), i, bs[0], bs[1]);
            if (tr)
              kernels::gemm(dbi, dyi, Transpose::yes, ai, Transpose::no, 1.f, beta_b);
            else
              kernels::gemm(dbi, ai, Transpose::yes, dyi, Transpose::no, 1.f, beta_b);
          }
        }
      });
}
// x (..., in) times w^T for a weight w (out, in), as nn::Linear (without its bias).
inline Var linear(const Var& x, const Var& w) {
  return matmul(x, w, Transpose::yes);
}

// Rows of `table` (V, D) f32 picked by `ids` (any shape, i32): (ids..., D). The gradient flows
// to the table only.
inline Var embedding(const Var& table, const Var& ids) {
  Tape& t = tape_of(table, ids, "embedding");
  const Tensor& tv = t.read_master(table.id());
  Shape s = ids.shape();
  s.push_back(table.dim(-1));
  Tensor y = Tensor::empty(s, DType::f32, t.device());
  kernels::embedding_forward(y, ids.value(), tv);
  return t.record(
      {table, ids}, y,
      [](Tape& t, const Tape::Node& n) {
        kernels::embedding_forward(t.out(n), t.in(n, 1), t.master(n, 0));
      },
      [](Tape& t, const Tape::Node& n) {
        if (n.acc[0] == Accumulate::no) kernels::fill(t.din(n, 0), 0.f);
        kernels::embedding_backward(t.din(n, 0), t.dout(n), t.in(n, 1));
      },
      {true, false});
}

// A built-in (or any) module run inside compose(): its own fused forward and backward, its
// parameters' gradients and hooks as always. requires `child` registered in the composed layer
// (register_module), so that it is materialised, cloned and saved with it, and called once per
// forward (a module keeps one forward's state for its backward).
inline Var call(Module& child, const Var& x) {
  Tape& t = tape_of(x, "call");
  if (!t.has_called(&child)) {  // the first call of a recording: a registered descendant?
    std::function<bool(const Module&)> holds = [&](const Module& m) {
      for (const auto& [name, c] : m.children())
        if (c.get() == &child || holds(*c)) return true;
      return false;
    };
    DP_CHECK(holds(t.owner()),
             "call: " << child.type_name() << " is not a registered child of "
                      << t.owner().type_name()
                      << " (its gradients would go to its own buffers, which the model's "
                         "optimizer, engines and checkpoints never see): register_module it "
                         "in the constructor");
  }
  DP_CHECK(t.first_call(&child), "call: " << child.type_name()
                                          << " called twice in one compose() "
                                             "of "
                                          << t.owner().type_name()
                                          << " (its backward keeps one forward's state): "
                                             "register one module per use");
  // The child's input gradient as this tape wants it, set again at each replay: another tape of
  // the layer (another shape, or a layer input that wants a gradient) may have changed it.
  const InputGrad g = t.slot(x.id()).requires_grad ? InputGrad::needed : InputGrad::not_needed;
  child.set_input_grad(g);
  Tensor y = child.forward(x.value());
  Module* c = &child;
  return t.record(
      {x}, y,
      [c, g](Tape& t, const Tape::Node& n) {
        if (c->input_grad_needed() != (g == InputGrad::needed)) c->set_input_grad(g);
        t.out(n) = c->forward(t.in(n, 0));
      },
      [c](Tape& t, const Tape::Node& n) {
        Tensor dx = c->backward(t.dout(n));
        if (n.need[0]) copy_into(t.din(n, 0), dx, n.acc[0]);
      },
      {}, c->num_parameters() > 0);
}

}  // namespace ag

// A layer written as a composition of ag ops (see the top of this file): subclasses implement
// compose(), type_name() and clone_config(), and register parameters, constants and children in
// their constructor as any module does.
class Composed : public Module {
 public:
  using Var = ag::Var;

 protected:
  // The layer's forward on its input x. See the rule at the top of this file.
  virtual ag::Var compose(const ag::Var& x) = 0;

  // A parameter registered by this layer, as a Var (its 16-bit copy under a 16-bit compute dtype;
  // gradients add into its flat gradient view in f32).
  ag::Var param(Parameter& p) {
    ag::Tape& t = recording("param");
    if (!t.has_slot(&p)) {
      bool own = false;
      for (auto& [name, q] : named_parameters()) own = own || q == &p;
      DP_CHECK(own, type_name() << "::param(" << p.name
                                << "): not a parameter of this layer or its children (register "
                                   "it here, or register its module as a child)");
    }
    const int id = t.slot_of(&p, [&] {
      const int s = t.add_slot(ag::Tape::Kind::param, p.compute, true);
      t.slot(s).grad = p.grad;
      t.slot(s).master = p.value;
      t.note_param(&p);
      return s;
    });
    return t.var(id);
  }
  // A constant table registered by this layer (register_constant): no gradient.
  ag::Var constant(Constant& c) {
    ag::Tape& t = recording("constant");
    return t.var(
        t.slot_of(&c, [&] { return t.add_slot(ag::Tape::Kind::constant, c.value, false); }));
  }

  Tensor forward_impl(const Tensor& x) override {
    FlatState& f = flat();
    const Key key{x.shape(),
                  static_cast<int>(x.dtype()),
                  is_training(),
                  static_cast<int>(compute_dtype()),
                  static_cast<int>(f.activations),
                  f.compute_params.defined() ? f.compute_params.storage().get() : nullptr,
                  input_grad_needed()};
    // No backward through an older forward: last_ names this forward's tape once it succeeded
    // (a compose() or replay that throws leaves none, and a cleared tape is never named).
    last_ = nullptr;
    auto it = tapes_.find(key);
    if (it != tapes_.end()) {
      check_f32_reads_sent(*it->second, x.shape());
      tape_uses_[key] = ++uses_;
      Tensor y = it->second->replay(x);
      last_ = it->second.get();
      return y;
    }
    // A new shape: record (a bounded number of tapes, each holding its activations; an engine
    // sees two shapes, the full batch and the last one). Past the bound, the tape used longest
    // ago goes, not every one (a busy shape kept re-recording beside shapes seen once).
    if (tapes_.size() >= kMaxTapes) {
      auto oldest = tape_uses_.begin();
      for (auto u = tape_uses_.begin(); u != tape_uses_.end(); ++u)
        if (u->second < oldest->second) oldest = u;
      tapes_.erase(oldest->first);
      tape_uses_.erase(oldest);
    }
    auto tape = std::make_unique<ag::Tape>(*this, f.device);
    const int in = tape->add_slot(ag::Tape::Kind::input, x,
                                  input_grad_needed() && kernels::is_floating(x.dtype()));
    recording_ = tape.get();
    struct Reset {
      ag::Tape*& r;
      ag::Tape* outer;  // the enclosing composed layer's, when this one is called inside it
      ~Reset() { r = nullptr, ag::recording_tape() = outer; }
    } reset{recording_, ag::recording_tape()};
    ag::recording_tape() = tape.get();
    ag::Var y;
    try {
      y = compose(tape->var(in));
    } catch (const kernels::Error& e) {
      // Ops name their shapes, not the layer: say whose compose() refused this input.
      throw kernels::Error(type_name() + "::compose, input " + kernels::shape_str(x.shape()) +
                           ": " + e.what());
    }
    DP_CHECK(tape->owns(y), type_name() << "::compose returned a Var that is not of this forward");
    // An output in a parameter's or a constant's memory (compose() returned param(w), or a
    // reshape of it) would let a write into the output change the weights, and the optimizer's
    // step change the output: the layer returns a copy. (The input, or a view of it, is returned
    // as it is, as built-in layers do.)
    if (tape->in_weights(y.id())) y = ag::unary(y, kernels::UnaryOp::identity);
    check_f32_reads_sent(*tape, x.shape());
    settle_copy_reads(*tape);
    tape->finish(in, y.id());
    last_ = tape.get();
    tapes_[key] = std::move(tape);
    tape_uses_[key] = ++uses_;
    return last_->slot(y.id()).value;
  }

 public:
  // Drops every recorded tape: the next forward calls compose() again (after a host value it
  // reads changed; see the top of this file), and the engines capture their steps again. The
  // next backward needs a forward first.
  void forget_tapes() {
    tapes_.clear();
    tape_uses_.clear();
    last_ = nullptr;
    host_values_changed();  // what an engine's captured steps replay was recorded with them
  }

 protected:
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(last_ != nullptr, type_name() << "::backward with no forward to go back through "
                                              "(none ran, or the last one threw)");
    FlatState& f = flat();
    if (!f.on_grad_ready) return last_->backward(dy);
    // Another module's parameters read through param() (a tied weight, or a child's weight
    // used directly) get gradient here after that module's backward fired its hook: held until
    // this backward is done, then fired (ours fire after this, in run_backward).
    std::vector<const Parameter*> held;
    for (const Parameter* p : last_->params_read())
      if (!owns(p)) held.push_back(p);
    for (const Parameter* p : held) ++f.hooks_held[p];
    auto release = [&](std::vector<const Parameter*>* ready) {
      for (const Parameter* p : held)
        if (--f.hooks_held[p] == 0) {
          f.hooks_held.erase(p);
          if (ready) ready->push_back(p);
        }
    };
    Tensor dx;
    try {
      dx = last_->backward(dy);
    } catch (...) {
      release(nullptr);  // nothing fires for a backward that failed
      throw;
    }
    std::vector<const Parameter*> ready;
    release(&ready);
    for (const Parameter* p : ready) f.on_grad_ready(*p);
    return dx;
  }

 private:
  static constexpr size_t kMaxTapes = 8;
  using Key = std::tuple<Shape, int, bool, int, int, const void*, bool>;

  // A forward (recorded or replayed) on a DP replica whose f32 weights are partly stale
  // (FlatState::stale_runs: device 0's forwards read them only through the 16-bit copy it
  // sent) that reads one of them as f32 is refused: a compose() that reads a weight as f32 for
  // some input shapes alone, one device 0 did not see.
  void check_f32_reads_sent(const ag::Tape& t, const Shape& input) {
    const FlatState& f = flat();
    if (!f.masters_stale()) return;
    for (const Parameter* p : t.params_read()) {
      if (!t.master_read(p)) continue;
      for (const auto& [begin, end] : f.stale_runs)
        DP_CHECK(p->offset + p->numel() <= begin || p->offset >= end,
                 type_name() << "::compose, input " << kernels::shape_str(input) << ": reads "
                             << p->name
                             << " as f32, which this DP replica was not sent this step (device "
                                "0's forwards read it only through its 16-bit copy: "
                                "Parameter::read_through_copy); read a parameter the same way "
                                "for every input");
    }
  }

  // After a recording: which parameters this layer's forwards read through their 16-bit copy
  // alone (Parameter::read_through_copy, which tells DP's replicas to take no f32 value of
  // them). Its own parameters that no composed layer's forward read as f32 (ag::embedding's
  // table does; GEMM operands and everything else read the copy) are marked; a parameter read as
  // f32 (Parameter::read_as_f32, for good) is not, a child's included (an embedding's table used
  // as an LM head, read through param()), whichever layer recorded the read. Flags are
  // written only when they change (replicas record on their threads, each its own), and then
  // DP plans its copies again (FlatState::copy_reads_version).
  void settle_copy_reads(const ag::Tape& t) {
    bool changed = false;
    for (Parameter* p : t.params_read()) {
      if (t.master_read(p)) p->read_as_f32 = true;
      const bool own = owns(p);
      const bool through_copy = own && !p->read_as_f32;
      if ((own || p->read_as_f32) && p->read_through_copy != through_copy) {
        p->read_through_copy = through_copy;
        changed = true;
      }
    }
    if (changed) ++flat().copy_reads_version;
  }

  // Whether p is one of this layer's own parameters (not a child's, nor another module's).
  bool owns(const Parameter* p) {
    for (const Parameter& q : own_parameters())
      if (&q == p) return true;
    return false;
  }

  ag::Tape& recording(const char* what) {
    DP_CHECK(recording_ != nullptr, type_name() << "::" << what << " outside compose()");
    return *recording_;
  }

  std::map<Key, std::unique_ptr<ag::Tape>> tapes_;
  std::map<Key, uint64_t> tape_uses_;  // by key: uses_ at its last forward
  uint64_t uses_ = 0;
  ag::Tape* recording_ = nullptr;
  ag::Tape* last_ = nullptr;
};

}  // namespace nn
