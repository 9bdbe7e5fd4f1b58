// nn::Module: a layer or a tree of layers with explicit forward and backward.
//
// Parameters and buffers live in flat per-replica buffers owned by the root of the tree:
// one f32 buffer for parameters, one for their gradients, one for non-parameter buffers
// (BatchNorm running statistics). Each layer's weight is a view into them, so a DP broadcast is
// one copy, a reduction is one buffer, and a DDP bucket is a slice of the gradient buffer.
//
// Life of a module:
//   auto net = nn::mlp({784, 256, 10});      // declares parameters: shapes, no memory yet
//   net->materialize(Device::cpu(), seed);   // allocates the flat buffers and initialises them
//   Tensor y = net->forward(x);              // caches what backward needs
//   net->zero_grad(); Tensor dx = net->backward(dy);   // gradients accumulate
//   auto replica = net->clone_to(Device::cuda(1));      // same structure, own flat buffers
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/ops.hpp"
#include "kernels/philox.hpp"

namespace nn {

using kernels::Device;
using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

// How a parameter is initialised: a distribution and its scale. Values are generated on the
// host from (seed, parameter index), so the same seed gives the same model on every device.
struct InitSpec {
  enum class Dist { constant, uniform, normal };
  Dist dist = Dist::constant;
  float scale = 0.f;  // constant value, uniform bound (U(-b, b)) or normal std

  static InitSpec constant(float v) { return {Dist::constant, v}; }
  static InitSpec uniform(float bound) { return {Dist::uniform, bound}; }
  static InitSpec normal(float std) { return {Dist::normal, std}; }
};

// Kaiming (He) and Xavier (Glorot) initialisation, as torch.nn.init defines them.
inline InitSpec kaiming_uniform(int64_t fan_in, float a = 0.f) {
  float gain = std::sqrt(2.f / (1.f + a * a));
  return InitSpec::uniform(gain * std::sqrt(3.f / static_cast<float>(fan_in)));
}
inline InitSpec kaiming_normal(int64_t fan_in, float a = 0.f) {
  float gain = std::sqrt(2.f / (1.f + a * a));
  return InitSpec::normal(gain / std::sqrt(static_cast<float>(fan_in)));
}
inline InitSpec xavier_uniform(int64_t fan_in, int64_t fan_out, float gain = 1.f) {
  return InitSpec::uniform(gain * std::sqrt(6.f / static_cast<float>(fan_in + fan_out)));
}
inline InitSpec xavier_normal(int64_t fan_in, int64_t fan_out, float gain = 1.f) {
  return InitSpec::normal(gain * std::sqrt(2.f / static_cast<float>(fan_in + fan_out)));
}
// PyTorch's default for Linear/Conv weights and biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
inline InitSpec torch_default(int64_t fan_in) {
  return InitSpec::uniform(1.f / std::sqrt(static_cast<float>(fan_in > 0 ? fan_in : 1)));
}

// `count` values of `spec`, drawn from the counter-based generator under `key`.
inline std::vector<float> init_values(const InitSpec& spec, int64_t count, uint64_t key) {
  std::vector<float> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    switch (spec.dist) {
      case InitSpec::Dist::constant:
        v[i] = spec.scale;
        break;
      case InitSpec::Dist::uniform:
        v[i] = (2.f * kernels::philox::uniform(key, i) - 1.f) * spec.scale;
        break;
      case InitSpec::Dist::normal: {  // Box-Muller on two independent uniforms
        float u1 = kernels::philox::uniform(key, 2 * i) + 1.f / 16777216.f;
        float u2 = kernels::philox::uniform(key, 2 * i + 1);
        v[i] = spec.scale * std::sqrt(-2.f * std::log(u1)) * std::cos(6.2831853f * u2);
        break;
      }
    }
  }
  return v;
}

// Every parameter's and buffer's first element in the flat buffers sits at a multiple of
// kFlatAlignBytes: cuBLASLt's fastest kernels and its fused bias epilogue need 16-byte (better
// 256-byte) aligned operands, and a view at any 4-byte offset would forgo them. The gaps between
// views are zero when allocated and belong to no parameter; nothing writes them but whole-buffer
// ops (zero_grad, reductions, the fused optimizer, DDP buckets), which keep zeros zero: a zero
// gradient with a zero weight takes a zero step in SGD and AdamW alike.
constexpr int64_t kFlatAlignBytes = 256;
constexpr int64_t kFlatAlignElems = kFlatAlignBytes / static_cast<int64_t>(sizeof(float));
// The first offset (in f32 elements) at or after n that is kFlatAlignBytes-aligned.
inline int64_t align_flat_offset(int64_t n) {
  return (n + kFlatAlignElems - 1) / kFlatAlignElems * kFlatAlignElems;
}

// The debug check of the weights' 16-bit copy (docs/mixed-precision.md): while on, each forward
// that takes the copy an optimizer's step wrote (FlatState::compute_written), outside a step a
// graph observes or captures, first compares it with the f32 weights rounded on the host and
// throws where they differ, naming parameters_changed(). It costs two host reads and a pass over
// the weights a step. Off unless the environment sets DP_CHECK_WEIGHT_COPY=1;
// set_weight_copy_check changes it for the whole process.
inline std::atomic<bool>& weight_copy_check_flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("DP_CHECK_WEIGHT_COPY");
    return v != nullptr && std::string(v) == "1";
  }()};
  return on;
}
inline void set_weight_copy_check(bool on) {
  weight_copy_check_flag() = on;
}
inline bool weight_copy_check() {
  return weight_copy_check_flag().load();
}

// Whether AdamW's decoupled weight decay applies to a parameter (nn::decay_by_parameter): by its
// shape, nanoGPT's rule (2 or more dimensions decay: the matrices of products, convolution
// kernels and embeddings; vectors such as biases and norm scales do not), or as its layer says.
enum class Decay { by_shape, yes, no };

struct Parameter {
  std::string name;  // local name ("weight"); named_parameters() gives the full path
  Shape shape;
  InitSpec init;
  int64_t offset = 0;  // first element in the flat buffers (a multiple of kFlatAlignElems)
  Tensor value;        // view into the flat parameter buffer
  Tensor grad;         // view into the flat gradient buffer
  // The value GEMMs and convolutions read: `value` itself, or under mixed precision its view in
  // the 16-bit copy of the flat buffer (Module::set_compute_dtype, nn/amp.hpp).
  Tensor compute;
  Decay decay = Decay::by_shape;
  // Set by a layer whose forward and backward read this parameter only through `compute` (GEMM
  // and convolution operands: Linear's and Conv2d's weights). Under mixed precision a DP replica
  // that copies device 0's 16-bit weights then needs no f32 value of it (dp::DataParallel::
  // replicate: half the bytes). Set before the first step. A composed layer sets it on its own
  // parameters that no op of its forwards reads as f32, and clears it on any parameter one does
  // (ag::embedding's table), when it records a forward (and says so:
  // FlatState::copy_reads_version).
  bool read_through_copy = false;
  // Set for good by a composed layer's recording in which an op read this parameter's f32 value
  // (ag::embedding's table): read_through_copy is then cleared, whichever layer recorded it.
  bool read_as_f32 = false;
  int64_t numel() const { return kernels::shape_numel(shape); }
  // Whether weight decay applies (see Decay).
  bool decays() const { return decay == Decay::by_shape ? shape.size() >= 2 : decay == Decay::yes; }
};

// A module's constant table (PyTorch's register_buffer(..., persistent=False)): rotary cos/sin,
// a fixed mask. `make` gives its values on the host (shape's element count, row-major); they are
// made again on every device the module is materialised on (materialize, clone_to: once per
// replica), in an allocation of their own, so a constant is never averaged or broadcast across
// replicas and never saved in a checkpoint. Layers read `value` on the module's device.
struct Constant {
  std::string name;
  Shape shape;
  std::function<std::vector<float>(const Shape&)> make;
  Tensor value;  // (shape) f32 on the module's device, after materialize()
};

struct Buffer {
  std::string name;
  Shape shape;
  float init_value = 0.f;
  int64_t offset = 0;
  Tensor value;  // view into the flat buffer of non-parameters
  int64_t numel() const { return kernels::shape_numel(shape); }
};

// What dtype activations travel in between layers: f32 (the default), or the compute dtype of
// mixed precision (Linear, Conv2d, the activations, pooling, dropout, bias-add and LayerNorm keep
// 16-bit outputs, LayerNorm with f32 statistics; BatchNorm takes f32, and the model's output is
// f32 unless set_output keeps it 16-bit for a loss that reads it).
enum class Activations { f32, compute };

// What dtype the model's output (the outermost forward's result) has under 16-bit activations:
// f32 (the default: one cast at the end, what any loss or metric can read), or the activation
// dtype as the last layer wrote it, for a loss that reads 16-bit predictions and writes their
// gradient in the same dtype (Loss::takes_16bit_pred): no f32 copy of the logits, nor of their
// gradient, which for a language model's (B, T, V) logits are the largest tensors of the step.
enum class Output { f32, activations };

// Wall time of one module's forward and backward calls, inclusive of its children
// (nn/profile.hpp's LayerProfiler turns them on and reads them).
struct LayerTime {
  double forward_ms = 0, backward_ms = 0;
  int64_t forwards = 0, backwards = 0;
};

// The storage of one replica, shared by every module of its tree.
struct FlatState {
  Device device;
  Tensor params;   // (P) f32
  Tensor grads;    // (P) f32
  Tensor buffers;  // (B) f32, may be empty
  uint64_t seed = 0;
  // Called once a module's backward has finished writing the gradients of its parameters, in
  // backward order (DDP launches bucket all-reduces from here). Null by default.
  std::function<void(const Parameter&)> on_grad_ready;
  // Parameters whose gradient is not complete when their module's backward ends: a composed
  // layer that reads another module's parameter through param() (a tied weight) adds into its
  // gradient after that module's backward, so it holds the hook and fires it after its own
  // backward, once no enclosing layer still holds it (a count per holder).
  std::map<const Parameter*, int> hooks_held;
  // The module materialize() was called on: the tree these buffers hold (a part of it shares
  // them, and what works on whole buffers must refuse a part: Module::require_root).
  const void* root = nullptr;
  // Stream of random numbers for stochastic layers (dropout): (rng_key, rng_offset).
  uint64_t rng_key = 0;
  uint64_t rng_offset = 0;
  // Engines that replay captured steps (dp/graphs.hpp): rng_base ((1) i64 on `device`) holds
  // rng_step_start, written by begin_rng_step at each step's start, and layers draw at
  // rng_base + (rng_offset - rng_step_start), read on the device when they run: the counters
  // rng_offset names, and in a replay the current step's. Undefined: draws start at rng_offset.
  Tensor rng_base;
  uint64_t rng_step_start = 0;
  // Counts Module::host_values_changed() calls: the engines key their captured steps on it, so a
  // step after a change captures again instead of replaying the values the graphs baked in.
  uint64_t host_values_version = 0;
  // Counts changes of the parameters' Parameter::read_through_copy made by a composed layer's
  // recording (Composed): DP plans its replicas' copies again (they run outside the captured
  // segments, so nothing is captured again).
  uint64_t copy_reads_version = 0;

  // Where a layer's next draw starts (it then advances rng_offset by the counters it used).
  kernels::RngOffset rng_at() const {
    if (!rng_base.defined()) return rng_offset;
    return kernels::RngOffset(rng_base, rng_offset - rng_step_start);
  }
  // Queues rng_offset into rng_base (made on the first call) on the calling thread's context
  // for `device`, ahead of the step's draws; nothing when it holds rng_offset already (a model
  // that draws nothing).
  void begin_rng_step() {
    if (!rng_base.defined())
      rng_base = Tensor::empty({1}, kernels::DType::i64, device);
    else if (rng_step_start == rng_offset)
      return;
    rng_step_start = rng_offset;
    kernels::set_counter(rng_base, rng_offset);
  }
  // Mixed precision: the 16-bit copy of `params` that GEMMs and convolutions read (its dtype is
  // theirs), remade by one cast at the start of each outermost forward, unless the optimizer's
  // step wrote it since (compute_written); undefined under f32.
  Tensor compute_params;
  // Set by an optimizer whose fused step also wrote compute_params from every parameter it
  // updated (SgdConfig::compute_copy); the next outermost forward then casts nothing and clears
  // it. Module::parameters_changed() clears it.
  bool compute_written = false;
  // The 16-bit copy holds the f32 weights rounded, as a forward took or an optimizer's fused
  // step wrote them (a backward only accumulates gradients): the next outermost forward casts
  // nothing.
  void compute_copy_fresh() {
    if (compute_params.defined()) compute_written = true;
  }
  // Set by an engine that copied another replica's 16-bit weights here and, of the f32 ones,
  // only those not read through the copy (Parameter::read_through_copy): the rest, as [begin,
  // end) runs of flat elements, are stale here, so a forward refuses to cast them, a composed
  // layer's forward that would read one as f32 is refused, and the debug check skips this
  // replica, until an engine copies every f32 weight again (and empties it).
  std::vector<std::pair<int64_t, int64_t>> stale_runs;
  bool masters_stale() const { return !stale_runs.empty(); }
  // 16-bit activations (Module::set_activations): Linear and Conv2d write their outputs in the
  // compute dtype, and the layers between them keep it.
  Activations activations = Activations::f32;
  Output output = Output::f32;
  int forward_depth = 0;  // forwards in progress: 0 outside, 1 in the outermost
  // Forwards that a backward runs again (Module::set_recompute) in progress: 0 outside. Layers
  // with a side effect besides their output (BatchNorm's running statistics, SyncBatchNorm's
  // exchange) take it from the first run then.
  int recomputing = 0;
  // Set while a LayerProfiler (nn/profile.hpp) times the tree: each forward and backward in
  // training mode waits for its device before and after, and adds its wall time here, by module.
  std::shared_ptr<std::unordered_map<const void*, LayerTime>> layer_times;
};

enum class Mode { train, eval };

// Whether backward must return the gradient of the module's input. A model's input is data,
// so its first layer's input gradient is read by nothing: the engines mark the root
// not_needed, and layers then skip that product (a Linear's dx GEMM, a Conv2d's backward data).
enum class InputGrad { needed, not_needed };

class Loss;  // nn/loss.hpp

// A step's loss, handed to a model's forward in place of its output (Module::takes_loss: nn::Gpt's
// chunked classifier, which never holds the whole (B, T, V) logits): what the engines would give
// the loss after forward (dp/step.hpp's queue_forward_and_loss). The forward that takes it
// queues loss_out := the loss's mean over the chunk, a defined correct := its count of right
// predictions, and, with grad, the loss's gradient times grad_scale, carried back into the model
// as far as it can go before the model's backward (which is then called with an undefined dy).
struct LossInForward {
  const Loss* loss = nullptr;
  Tensor labels;  // the chunk's, on the device, as the loss takes them
  Tensor loss_out;
  Tensor correct;
  kernels::Scalar grad_scale;  // read when the work runs (Loss::compute_scaled's)
  bool grad = false;           // training: the gradient, for the backward that follows
  bool taken = false;          // set by the forward that took it
};

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // requires materialize() was called. ensures the output; caches what backward needs.
  Tensor forward(const Tensor& x) {
    return run_forward([&] { return forward_impl(x); }, [this, x] { (void)forward_impl(x); });
  }
  // requires forward() ran on this input. ensures the input gradient is returned and the
  // parameter gradients are ADDED into grad views; then on_grad_ready fires for each of this
  // module's own parameters (children fire their own from their backward).
  Tensor backward(const Tensor& dy) {
    return run_backward([&] { return backward_impl(dy); });
  }
  // forward() when a parent runs this module's parts itself (Gpt runs h's blocks, each one's last
  // residual sum fused with the next norm): `impl` computes the output, and it counts as this
  // module's forward (NVTX, layer times, and the forward its backward goes back through).
  template <class F>
  Tensor forward_by_parts(F&& impl) {
    return run_forward(std::forward<F>(impl), nullptr);
  }

  // Activation checkpointing (torch.utils.checkpoint, Megatron's full recompute): in training,
  // this module's forward keeps its input and drops what the layers under it saved for backward
  // (release_saved), and its backward runs the forward again on that input first. Memory: the
  // module's input instead of every activation inside it, so checkpointing each block of a deep
  // model keeps one tensor per block. Time: one more forward of the module per step. The
  // gradients are the same bits: dropout draws the same counters again, BatchNorm updates its
  // running statistics once, and SyncBatchNorm does not exchange again. A checkpointed module
  // inside another runs again in the outer one's backward, and once more in its own. Replicas
  // (clone_to, the engines' devices and ranks) inherit the setting. Layers keep a forward's
  // state in their own members; one that does not override release_saved (a layer of yours)
  // still gives the right gradients under a checkpointed parent, and keeps its memory.
  // requires this module's forward runs through forward(x), or an entry point that can run again
  // (GptBlock::forward_deferred): one its parent runs through a fused entry point (Gpt's h, run
  // by parts; a LayerNorm's forward_add; a Linear's forward_gelu) throws at its forward.
  void set_recompute(bool on = true) { recompute_ = on; }
  bool recomputes() const { return recompute_; }

 protected:
  // Drops what this module's own forward keeps for its backward (its members, not its
  // children's): called on every module under one that set_recompute, after its forward.
  // requires the next backward is preceded by a forward of this module (the recompute).
  virtual void release_saved() {}
  // Whether this forward is a checkpointed module's run again in its backward (FlatState::
  // recomputing): a layer with a side effect besides its output takes it from the first run.
  bool recomputing() const { return flat_ != nullptr && flat_->recomputing > 0; }

  // forward() around `impl` (a forward_impl, or a layer's fused entry point such as
  // LayerNorm::forward_add): the storage check, the NVTX range, the outermost forward's weight
  // refresh and f32 output, the layer timing. `replay` (nullptr: none) runs the same forward
  // again on copies of its inputs, for set_recompute; it must not touch its caller's locals.
  template <class F, class R>
  Tensor run_forward(F&& impl, R&& replay) {
    DP_CHECK(flat_ != nullptr, type_name() << "::forward: no storage; call materialize() first");
    kernels::NvtxRange r(type_name());
    const bool checkpoint = recompute_ && is_training();
    if constexpr (std::is_null_pointer_v<std::decay_t<R>>)
      DP_CHECK(!checkpoint,
               type_name() << "::forward: set_recompute on a module its parent runs through "
                              "a fused entry point (Gpt's h, run by parts; a LayerNorm's "
                              "forward_add; a Linear's forward_gelu), which cannot run again on "
                              "its own; set it on the blocks (GptBlock) or on the parent");
    // The outermost forward refreshes the 16-bit weights: whatever changed the f32 masters
    // since (a DP replicate, a loaded checkpoint) is seen, once per step. After an optimizer
    // step that wrote them (FlatState::compute_written) there is nothing to cast.
    struct Depth {
      FlatState& f;
      ~Depth() { --f.forward_depth; }
    } depth{*flat_};
    const bool outermost = flat_->forward_depth++ == 0;
    if (outermost && flat_->compute_params.defined()) {
      if (flat_->compute_written) {
        flat_->compute_written = false;
        // Not in a step a graph observes or captures: its queued ops would differ from the
        // captured step's (the engine compares them), and a capture takes no host read.
        const kernels::DeviceContext& ctx = kernels::context(flat_->device);
        if (weight_copy_check() && !flat_->masters_stale() && !ctx.capturing() && !ctx.noting())
          check_weight_copy_fresh();
      } else {
        DP_CHECK(!flat_->masters_stale(),
                 type_name() << "::forward: this replica's f32 weights are partly stale (an "
                                "engine copied its 16-bit weights and only the f32 ones read "
                                "outside them): it cannot cast them; copy every f32 weight "
                                "first (dp::DataParallel::replicate does when device 0's 16-bit "
                                "weights are not fresh)");
        kernels::NvtxRange cast("amp/cast_weights");
        kernels::copy(flat_->compute_params, flat_->params);
      }
    }
    const uint64_t call = ++forwards_begun_;
    const uint64_t rng_start = flat_->rng_offset;
    replay_ = nullptr;
    Tensor y = timing() ? timed(true, impl) : impl();
    forward_done_ = call;
    if constexpr (!std::is_null_pointer_v<std::decay_t<R>>) {
      if (checkpoint) {
        // Under a checkpointed module, nothing keeps a forward's state: the layers' saved
        // tensors, and the inputs inner checkpointed modules keep (they run again in this one's
        // backward, and checkpoint themselves again there).
        for_each_module([](Module& m) {
          m.release_saved();
          m.replay_ = nullptr;
        });
        replay_ = std::forward<R>(replay);
        replay_rng_ = rng_start;
      }
    }
    // 16-bit activations end at the model's output unless set_output(Output::activations): the
    // loss and metrics then read f32 (the backward of the last layer takes the f32 gradient as
    // it is).
    if (outermost && y.defined() && flat_->output == Output::f32 && y.dtype() != DType::f32 &&
        kernels::is_floating(y.dtype()))
      y = kernels::cast(y, DType::f32);
    return y;
  }
  // The debug check (weight_copy_check): the copy the step wrote is a cast of the f32 weights,
  // rounded on the host as the device rounds (kernels/runtime/dtype.hpp), so that the check
  // queues no op and no cast.
  void check_weight_copy_fresh() {
    std::vector<float> want = flat_->params.to_host_f32();
    const bool bf16 = flat_->compute_params.dtype() == DType::bf16;
    for (float& w : want)
      w = bf16 ? kernels::bf16_to_f32(kernels::f32_to_bf16(w))
               : kernels::f16_to_f32(kernels::f32_to_f16(w));
    const std::vector<float> got = flat_->compute_params.to_host_f32();
    size_t i = 0;
    while (i < want.size() && std::memcmp(&want[i], &got[i], sizeof(float)) == 0) ++i;
    DP_CHECK(i == want.size(),
             type_name() << "::forward: the " << flat_->compute_params.dtype()
                         << " weights the optimizer's step wrote differ from the f32 weights at "
                            "flat element "
                         << i << " (" << got[i] << ", the f32 weight rounds to " << want[i]
                         << "): the weights were written after the step without a call to "
                            "parameters_changed() on the model (DP_CHECK_WEIGHT_COPY)");
  }
  // backward() around `impl`: the NVTX range, the layer timing, then on_grad_ready for each of
  // this module's own parameters.
  template <class F>
  Tensor run_backward(F&& impl) {
    check_backward_state();
    Tensor dx;
    {
      kernels::NvtxRange r(type_name() + "/backward");
      auto body = [&] {
        if (!run_again()) return impl();
        // What the run again rebuilt goes once its backward is done: a checkpointed module
        // holds nothing between steps, and a model's backward holds one block's state at a time.
        Tensor g = impl();
        for_each_module([](Module& m) { m.release_saved(); });
        return g;
      };
      dx = flat_ && timing() ? timed(false, body) : body();
    }
    backward_of_ = forwards_begun_;
    if (flat_ && flat_->on_grad_ready)
      for (auto& p : params_)
        if (!flat_->hooks_held.count(&p)) flat_->on_grad_ready(p);
    return dx;
  }

 public:
  virtual std::string type_name() const = 0;
  // Whether backward reads this module's forward output: a layer that keeps y (Tanh, Sigmoid),
  // or whose output is a view of what a layer keeps (Flatten). The engines write the loss's
  // gradient over the model's output only where it does not (Loss::grad_in_place). Default
  // true: a layer says false only when backward never reads its output (Linear, Gpt).
  virtual bool backward_reads_output() const { return true; }
  // Whether this model's forward takes `loss` itself for these labels (the chunk's, on the host
  // or the device: their shape is read) instead of returning its output (LossInForward). A model
  // that says true takes the request set_loss_in_forward hands its next forward, returns an
  // undefined tensor from it, and takes an undefined dy in the backward that follows.
  virtual bool takes_loss(const Loss& loss, const Tensor& labels) const {
    (void)loss, (void)labels;
    return false;
  }
  // The loss the next forward takes (null: none); the engines set it around one forward of the
  // root. requires takes_loss(*r->loss, r->labels) when r is not null.
  void set_loss_in_forward(LossInForward* r) { loss_in_forward_ = r; }

  void train() { set_mode(Mode::train); }
  void eval() { set_mode(Mode::eval); }
  bool is_training() const { return mode_ == Mode::train; }

  // Parameters of the whole tree, depth first in registration order, with hierarchical names
  // ("layer1.conv.weight"). This order is the order in the flat buffers (with aligned gaps).
  std::vector<std::pair<std::string, Parameter*>> named_parameters() {
    std::vector<std::pair<std::string, Parameter*>> out;
    visit("", [&](const std::string& prefix, Module& m) {
      for (auto& p : m.params_) out.emplace_back(prefix + p.name, &p);
    });
    return out;
  }
  // The constant tables of the whole tree (see Constant), depth first in registration order.
  std::vector<std::pair<std::string, Constant*>> named_constants() {
    std::vector<std::pair<std::string, Constant*>> out;
    visit("", [&](const std::string& prefix, Module& m) {
      for (auto& c : m.constants_) out.emplace_back(prefix + c.name, &c);
    });
    return out;
  }
  std::vector<std::pair<std::string, Buffer*>> named_buffers() {
    std::vector<std::pair<std::string, Buffer*>> out;
    visit("", [&](const std::string& prefix, Module& m) {
      for (auto& b : m.buffers_) out.emplace_back(prefix + b.name, &b);
    });
    return out;
  }
  // Calls f on this module and every descendant, depth first in registration order.
  template <class F>
  void for_each_module(F&& f) {
    visit("", [&](const std::string&, Module& m) { f(m); });
  }
  // This module's own parameters (not its children's).
  std::deque<Parameter>& own_parameters() { return params_; }
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const {
    return children_;
  }

  int64_t num_parameters() {
    int64_t n = 0;
    for (auto& [name, p] : named_parameters()) n += p->numel();
    return n;
  }

  // Allocates the flat buffers on `device` and initialises every parameter and buffer from
  // `seed`: parameter i takes init_values(spec, numel, mix_key(seed, i)). Gradients are zero.
  void materialize(Device device, uint64_t seed) {
    allocate(device, seed);
    reinitialize(seed);
  }
  bool materialized() const { return flat_ != nullptr; }

  // requires materialize() was called, on the root of the tree (indices count from the root).
  // ensures every parameter and buffer holds the value materialize(device, seed) gives it (same
  // seed, same values on any device); gradients and the dropout stream are untouched.
  void reinitialize(uint64_t seed) {
    flat().seed = seed;
    auto params = named_parameters();
    std::vector<float> host(static_cast<size_t>(flat_->params.numel()));
    for (size_t i = 0; i < params.size(); ++i) {
      Parameter& p = *params[i].second;
      auto v = init_values(p.init, p.numel(), kernels::philox::mix_key(seed, i));
      std::copy(v.begin(), v.end(), host.begin() + p.offset);
    }
    Tensor h = Tensor::from_vector(host, {static_cast<int64_t>(host.size())});
    kernels::copy(flat_->params, h);
    parameters_changed();
    std::vector<float> hb(static_cast<size_t>(flat_->buffers.numel()));
    for (auto& [name, b] : named_buffers())
      std::fill_n(hb.begin() + b->offset, b->numel(), b->init_value);
    Tensor hbt = Tensor::from_vector(hb, {static_cast<int64_t>(hb.size())});
    kernels::copy(flat_->buffers, hbt);
    kernels::context(flat_->device).synchronize();  // the host staging vectors die here
  }

  // A new tree of the same structure and mode on `device`, with its own flat buffers holding a
  // copy of this tree's parameters and buffers (gradients zero).
  std::shared_ptr<Module> clone_to(Device device) {
    DP_CHECK(materialized(), "clone_to(" << device << "): " << type_name()
                                         << " has no storage; call materialize() first");
    std::shared_ptr<Module> copy = clone_structure();
    copy->allocate(device, flat_->seed);
    copy->set_mode(mode_);
    copy->set_compute_dtype(compute_dtype());
    copy->set_activations(activations());
    copy->set_output(output());
    copy_tensor_across(copy->flat_->params, flat_->params);
    copy_tensor_across(copy->flat_->buffers, flat_->buffers);
    return copy;
  }

  // Mixed precision (nn/amp.hpp): GEMMs and convolutions of the whole tree take `dtype` (f16 or
  // bf16) inputs from here on, reading a 16-bit copy of the flat parameters; f32 turns it off.
  // requires materialised. Replicas made by clone_to() inherit it.
  void set_compute_dtype(DType dtype) {
    DP_CHECK(dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16,
             "set_compute_dtype(" << dtype << "): choose f32, f16 or bf16");
    FlatState& f = flat();
    // Filled by the next outermost forward, before anything reads it.
    f.compute_written = false;
    f.compute_params =
        dtype == DType::f32 ? Tensor() : Tensor::empty({f.params.numel()}, dtype, f.device);
    visit("", [&](const std::string&, Module& m) {
      for (auto& p : m.params_)
        p.compute = dtype == DType::f32 ? p.value : f.compute_params.view(p.offset, p.shape);
    });
  }
  DType compute_dtype() {
    const Tensor& c = flat().compute_params;
    return c.defined() ? c.dtype() : DType::f32;
  }
  // 16-bit activations for the whole tree (with a 16-bit compute dtype; under f32 compute they
  // stay f32). requires materialised. Survives set_compute_dtype; replicas made by clone_to()
  // inherit it.
  void set_activations(Activations a) { flat().activations = a; }
  Activations activations() { return flat().activations; }
  // The dtype of the model's output (see Output): f32, or under 16-bit activations the last
  // layer's 16-bit dtype. requires materialised; the loss that reads it takes 16-bit
  // predictions (the engines set it from Loss::takes_16bit_pred). clone_to() replicas inherit it.
  void set_output(Output o) { flat().output = o; }
  Output output() { return flat().output; }
  // The dtype a model writes its final output in when it can write it directly (Gpt's logits):
  // the activation dtype when the output keeps it, else f32.
  DType output_dtype() {
    return flat().output == Output::activations ? activation_dtype() : DType::f32;
  }
  // x as f32 (f32-only layers under 16-bit activations: BatchNorm), and back to dtype `d`.
  static Tensor as_f32(const Tensor& x) { return as_dtype(x, DType::f32); }
  static Tensor as_dtype(const Tensor& x, DType d) {
    return x.dtype() == d ? x : kernels::cast(x, d);
  }
  // a + b in a's dtype: a residual stream (and its gradient) keeps its dtype whatever the
  // branch's (bf16 under 16-bit activations). requires a, b one shape.
  static Tensor residual_sum(const Tensor& a, const Tensor& b) {
    Tensor y = Tensor::empty(a.shape(), a.dtype(), a.device());
    kernels::add(y, a, b);
    return y;
  }
  // The dtype Linear and Conv2d write their outputs in.
  DType activation_dtype() {
    return flat().activations == Activations::compute ? compute_dtype() : DType::f32;
  }
  // x in the compute dtype: x itself under f32 (or when it already is), else a 16-bit copy.
  Tensor to_compute(const Tensor& x) {
    const DType d = compute_dtype();
    return x.dtype() == d ? x : kernels::cast(x, d);
  }

  FlatState& flat() {
    DP_CHECK(materialized(), type_name() << " has no storage; call materialize() first");
    return *flat_;
  }
  // Says that a host value this tree's layers hand their ops changed: a scale, a temperature, a
  // flag a forward reads, kept in a member and passed to kernels by value. A captured step
  // (dp/graphs.hpp: DP and DDP with graphs on, automatic on a GPU) replays the values it saw at
  // its capture, so the engines capture their steps again after this call (they key their
  // graphs on FlatState::host_values_version). Under DP, call it on each replica you changed
  // (DataParallel::replica(i)). A value kept in device memory and read by the kernels (a
  // kernels::Scalar over a tensor) needs no call. Nothing before materialize().
  void host_values_changed() {
    if (flat_) ++flat_->host_values_version;
  }
  // Says that the flat parameters were written by something other than an optimizer's step (a
  // loader, an engine's broadcast, your own code): under mixed precision the 16-bit copy the
  // last step wrote beside them is stale, so the next forward casts them again, and captured
  // steps (which then cast nothing) are captured again (host_values_changed). nn's loaders
  // (load_checkpoint, load_training_state, reinitialize) and the engines' broadcasts call it;
  // call it on the root after writing parameters yourself between a step and the next forward
  // (a projection or clamp after opt.step()). Nothing under f32 or before materialize().
  void parameters_changed() {
    if (!flat_ || !flat_->compute_params.defined()) return;
    flat_->compute_written = false;
    host_values_changed();
  }
  Device device() { return flat().device; }
  // Draws dropout from the stream of `index`: the one a module materialised on a device of that
  // index draws from. For engines whose devices are numbered per node (a DDP rank's local
  // device, a hybrid node's devices): given the global rank or device, every replica across
  // the nodes draws its own stream, as the same world on one node would.
  void set_rng_stream(uint64_t index) { flat().rng_key = rng_key_of(flat().seed, index); }
  Tensor& flat_params() { return flat().params; }
  Tensor& flat_grads() { return flat().grads; }
  Tensor& flat_buffers() { return flat().buffers; }

  // Zeroes the gradients of this module's parameters (its children's included): the whole flat
  // buffer at the root, each parameter's view for a part of a larger model.
  void zero_grad() {
    if (is_root()) return kernels::fill(flat().grads, 0.f);
    for (auto& [name, p] : named_parameters()) kernels::fill(p->grad, 0.f);
  }
  // Whether materialize() was called on this module (not on a tree that holds it): what works
  // on the flat buffers works on the whole tree they hold.
  bool is_root() const { return flat_ != nullptr && flat_->root == this; }
  // Throws unless is_root(), naming `what` (an optimizer, a checkpoint) and what it would do to
  // the rest of the model.
  void require_root(const std::string& what) const {
    DP_CHECK(flat_ != nullptr,
             what << ": " << type_name() << " has no storage; call materialize() first");
    DP_CHECK(is_root(), what << ": " << type_name() << " is a part of a larger model, and " << what
                             << " works on the flat buffers of the whole model (every parameter "
                                "of the tree), so it would act on the rest too; give it the model "
                                "you called materialize() on (per-part learning rates: "
                                "nn::GroupedAdamW)");
  }

  // A new, unmaterialised module with the same structure and configuration.
  std::shared_ptr<Module> clone_structure() const {
    std::shared_ptr<Module> m = clone_config();
    DP_CHECK(m->children_.size() == children_.size() || m->children_.empty(),
             type_name() << "::clone_config must rebuild the same children");
    if (m->children_.empty())
      for (auto& [name, child] : children_) m->register_module(name, child->clone_structure());
    m->mode_ = mode_;
    m->recompute_ = recompute_;
    m->set_input_grad(input_grad_);
    return m;
  }

  // requires backward's result is unused when g is not_needed. Containers pass it on to the
  // layers that see the input first (Sequential: up to its first layer with parameters).
  void set_input_grad(InputGrad g) {
    input_grad_ = g;
    on_input_grad(g);
  }
  bool input_grad_needed() const { return input_grad_ == InputGrad::needed; }

 protected:
  virtual Tensor forward_impl(const Tensor& x) = 0;
  virtual Tensor backward_impl(const Tensor& dy) = 0;
  // The request this forward takes (set_loss_in_forward), or null.
  LossInForward* loss_in_forward() const { return loss_in_forward_; }
  // A parent that ran a child's backward itself (nn::Llama's chunked classifier runs its
  // lm_head's GEMMs in its forward, and never calls lm_head's backward): the child's own
  // parameters' gradients are final, and on_grad_ready fires for each, as the child's backward
  // would have fired it.
  void own_grads_ready(Module& child) {
    if (flat_ && flat_->on_grad_ready)
      for (auto& p : child.params_)
        if (!flat_->hooks_held.count(&p)) flat_->on_grad_ready(p);
  }
  // A fresh module with this one's configuration. Containers may return an empty container:
  // clone_structure() then clones and registers the children in order.
  virtual std::shared_ptr<Module> clone_config() const = 0;
  // Called after the flat buffers are bound (views are valid from here on).
  virtual void on_bind() {}
  virtual void on_mode(Mode) {}
  virtual void on_input_grad(InputGrad) {}

  // `decay`: whether AdamW's weight decay applies under nn::decay_by_parameter (default: by
  // shape, 2 or more dimensions decay).
  Parameter& register_parameter(std::string name, Shape shape, InitSpec init,
                                Decay decay = Decay::by_shape) {
    DP_CHECK(!materialized(), "register_parameter(" << name << ") after materialize()");
    check_new_name("register_parameter", name);
    params_.push_back(
        Parameter{std::move(name), std::move(shape), init, 0, Tensor(), Tensor(), Tensor(), decay});
    return params_.back();
  }
  // requires make(shape) returns shape's element count of values. See Constant.
  Constant& register_constant(std::string name, Shape shape,
                              std::function<std::vector<float>(const Shape&)> make) {
    DP_CHECK(!materialized(), "register_constant(" << name << ") after materialize()");
    DP_CHECK(make != nullptr, "register_constant(" << name << "): no function makes its values");
    check_new_name("register_constant", name);
    constants_.push_back(Constant{std::move(name), std::move(shape), std::move(make), Tensor()});
    return constants_.back();
  }
  Buffer& register_buffer(std::string name, Shape shape, float init_value) {
    DP_CHECK(!materialized(), "register_buffer(" << name << ") after materialize()");
    check_new_name("register_buffer", name);
    buffers_.push_back(Buffer{std::move(name), std::move(shape), init_value, 0, Tensor()});
    return buffers_.back();
  }
  template <class M>
  std::shared_ptr<M> register_module(std::string name, std::shared_ptr<M> m) {
    DP_CHECK(!materialized(), "register_module(" << name << ") after materialize()");
    DP_CHECK(m != nullptr, "register_module(" << name << "): null module");
    DP_CHECK(!m->materialized(),
             "register_module(" << name << "): the " << m->type_name()
                                << " is materialised already, on its own flat buffers; register "
                                   "it before materialising the tree that holds it");
    check_new_name("register_module", name);
    children_.emplace_back(std::move(name), m);
    return m;
  }

  // The shared state of the tree; null before materialize().
  const std::shared_ptr<FlatState>& flat_state() const { return flat_; }

 private:
  // f() with its wall time added to the profiler's table: the device's queue drained before and
  // after, so a GPU layer's time is its kernels' (profiling only: graphs are off meanwhile).
  template <class F>
  Tensor timed(bool forward, F&& f) {
    kernels::DeviceContext& ctx = kernels::context(flat_->device);
    ctx.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    Tensor out = f();
    ctx.synchronize();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    LayerTime& t = (*flat_->layer_times)[this];
    (forward ? t.forward_ms : t.backward_ms) += ms;
    ++(forward ? t.forwards : t.backwards);
    return out;
  }

  // Whether forward and backward add their wall time to a LayerProfiler's table: in training,
  // and not in a checkpointed module's forward run again (its backward's time holds it).
  bool timing() const { return flat_->layer_times && is_training() && flat_->recomputing == 0; }
  // A checkpointed module's backward (set_recompute): its forward again, on the input it kept
  // and at the dropout counters it drew first, as an inner forward (no weight refresh, no f32
  // output), so that every layer under it holds its saved state again. Whether it ran.
  bool run_again() {
    if (!replay_) return false;
    std::function<void()> replay = std::move(replay_);
    replay_ = nullptr;
    FlatState& f = *flat_;
    struct Restore {
      FlatState& f;
      uint64_t rng_offset;
      ~Restore() {
        f.rng_offset = rng_offset;
        --f.forward_depth;
        --f.recomputing;
      }
    } restore{f, f.rng_offset};
    f.rng_offset = replay_rng_;
    ++f.forward_depth;
    ++f.recomputing;
    kernels::NvtxRange r(type_name() + "/recompute");
    replay();
    return true;
  }

  template <class F>
  void visit(const std::string& prefix, F&& f) {
    f(prefix, *this);
    for (auto& [name, child] : children_) child->visit(prefix + name + ".", f);
  }

  void set_mode(Mode m) {
    mode_ = m;
    on_mode(m);
    for (auto& [name, child] : children_) child->set_mode(m);
  }

  // A backward goes back through the last forward, which must have returned, and only once: a
  // module called twice in one step (weight sharing by reuse) keeps the second call's state, so
  // the backward of the first call would use it and give wrong gradients, silently.
  void check_backward_state() const {
    DP_CHECK(forwards_begun_ > 0,
             type_name() << "::backward with no forward to go back through: call forward first");
    DP_CHECK(forward_done_ == forwards_begun_,
             type_name() << "::backward with no forward to go back through: the last forward "
                            "threw, and its saved state is incomplete; run forward again");
    DP_CHECK(backward_of_ != forwards_begun_,
             type_name() << "::backward a second time through one forward: a module keeps one "
                            "forward's state, so one called twice in a step (weight sharing by "
                            "reuse) would give wrong gradients; register one module per use, or "
                            "read a shared weight through param() in a Composed layer");
  }

  static uint64_t rng_key_of(uint64_t seed, uint64_t index) {
    return kernels::philox::mix_key(seed, 0x5eed, index);
  }
  // A name this module has not given to a parameter, buffer, constant or child yet: two would
  // share a path in named_parameters() and checkpoints.
  void check_new_name(const char* what, const std::string& name) const {
    bool taken = false;
    for (const auto& p : params_) taken = taken || p.name == name;
    for (const auto& b : buffers_) taken = taken || b.name == name;
    for (const auto& c : constants_) taken = taken || c.name == name;
    for (const auto& [n, m] : children_) taken = taken || n == name;
    DP_CHECK(!taken, what << "(" << name << "): " << type_name() << " has a '" << name
                          << "' already; give each parameter, buffer, constant and child its "
                             "own name");
  }
  // Lays out the flat buffers and binds every view.
  void allocate(Device device, uint64_t seed) {
    DP_CHECK(!materialized(), type_name() << " is already materialised on " << flat_->device);
    // One module at two places of the tree would get two offsets and keep one forward's state
    // for two backwards: wrong gradients, silently.
    std::map<const Module*, std::string> seen;
    visit("", [&](const std::string& prefix, Module& m) {
      const std::string at = prefix.empty() ? "the root" : prefix.substr(0, prefix.size() - 1);
      auto [it, fresh] = seen.emplace(&m, at);
      DP_CHECK(fresh,
               type_name() << ": one " << m.type_name() << " is registered at " << it->second
                           << " and at " << at
                           << " (a module keeps one forward's state for its backward): register "
                              "one module per use");
    });
    // Full paths are what checkpoints and training states key by: a name with a dot may meet a
    // child's path ("lin.weight" beside child "lin"'s "weight"), and the saved file then holds
    // one key for two tensors (it was written, and refused only at the resume).
    std::map<std::string, std::string> paths;
    visit("", [&](const std::string& prefix, Module& m) {
      auto claim = [&](const std::string& name, const char* what) {
        auto [it, fresh] = paths.emplace(prefix + name, what);
        DP_CHECK(fresh, type_name() << ": two tensors share the path '" << prefix + name << "' (a "
                                    << it->second << " and a " << what
                                    << "; a name with a dot meets a child's path): rename one");
      };
      for (const auto& p : m.params_) claim(p.name, "parameter");
      for (const auto& b : m.buffers_) claim(b.name, "buffer");
    });
    auto state = std::make_shared<FlatState>();
    state->root = this;
    state->device = device;
    state->seed = seed;
    state->rng_key = rng_key_of(seed, static_cast<uint64_t>(device.index));
    int64_t np = 0, nb = 0;
    visit("", [&](const std::string&, Module& m) {
      for (auto& p : m.params_) p.offset = align_flat_offset(np), np = p.offset + p.numel();
      for (auto& b : m.buffers_) b.offset = align_flat_offset(nb), nb = b.offset + b.numel();
    });
    // Parameters and buffers get their values (and the gaps zeros) in reinitialize().
    state->params = Tensor::empty({np}, DType::f32, device);
    state->grads = Tensor::zeros({np}, DType::f32, device);
    state->buffers = Tensor::empty({nb}, DType::f32, device);
    visit("", [&](const std::string& prefix, Module& m) {
      m.flat_ = state;
      for (auto& c : m.constants_) {
        std::vector<float> v = c.make(c.shape);
        DP_CHECK(static_cast<int64_t>(v.size()) == kernels::shape_numel(c.shape),
                 "constant " << prefix << c.name << " " << kernels::shape_str(c.shape) << ": made "
                             << v.size() << " values for " << kernels::shape_numel(c.shape)
                             << " elements");
        c.value = Tensor::from_vector(v, c.shape, device);
      }
      for (auto& p : m.params_) {
        p.value = state->params.view(p.offset, p.shape);
        p.grad = state->grads.view(p.offset, p.shape);
        p.compute = p.value;
      }
      for (auto& b : m.buffers_) b.value = state->buffers.view(b.offset, b.shape);
      m.on_bind();
    });
  }

  // Copies a flat buffer into another replica's, across devices, and waits for it.
  static void copy_tensor_across(Tensor& dst, const Tensor& src) {
    if (src.numel() == 0) return;
    // Work this thread queued on src finishes first. (Work of other threads is theirs to finish
    // before they hand the module over: making a context here just to wait would cost a stream
    // and library handles per thread.)
    if (auto* ctx = kernels::existing_context(src.device())) ctx->synchronize();
    kernels::copy(dst, src);
    kernels::context(dst.device()).synchronize();
  }

  std::deque<Parameter> params_;
  std::deque<Buffer> buffers_;
  std::deque<Constant> constants_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::shared_ptr<FlatState> flat_;
  Mode mode_ = Mode::train;
  InputGrad input_grad_ = InputGrad::needed;
  // Forwards begun, the last one that returned, and the one the last backward went back through
  // (check_backward_state).
  uint64_t forwards_begun_ = 0, forward_done_ = 0, backward_of_ = 0;
  // set_recompute: whether forward checkpoints; the last checkpointed forward's run again (its
  // inputs held by value) and the dropout counter it started at; empty once backward ran it.
  bool recompute_ = false;
  LossInForward* loss_in_forward_ = nullptr;  // the engines', around one forward
  std::function<void()> replay_;
  uint64_t replay_rng_ = 0;
};

using ModulePtr = std::shared_ptr<Module>;

// Activation checkpointing for every module of type M under root (root included): M::
// set_recompute(on) on each, as Hugging Face's gradient_checkpointing_enable() does for a
// model's blocks: nn::recompute_each<nn::GptBlock>(*model). Returns how many it set (0: none
// of that type, which the caller may want to refuse).
template <class M>
int recompute_each(Module& root, bool on = true) {
  int n = 0;
  root.for_each_module([&](Module& m) {
    if (dynamic_cast<M*>(&m) == nullptr) return;
    m.set_recompute(on);
    ++n;
  });
  return n;
}

// The parameter elements of `flat` (a host copy of m's flat parameter or gradient buffer), in
// flat order without the alignment gaps: what torch's concatenated model.parameters() holds.
inline std::vector<float> packed_parameters(Module& m, const std::vector<float>& flat) {
  std::vector<float> out;
  for (auto& [name, p] : m.named_parameters())
    out.insert(out.end(), flat.begin() + p->offset, flat.begin() + p->offset + p->numel());
  return out;
}

}  // namespace nn
