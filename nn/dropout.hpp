// nn::Dropout: zeroes each element with probability p in training, scaling the rest by 1/(1-p).
#pragma once

#include <memory>
#include <string>

#include "nn/module.hpp"

namespace nn {

// Identity in eval mode (and for p == 0). In training the mask comes from the tree's random
// stream: element i of a call keeps iff uniform(rng_key, rng_offset + i) >= p, and each call
// advances rng_offset by numel, so two calls never reuse a mask and a replica's masks are
// reproducible from (seed, device, call sequence). Setting rng_offset back replays a mask.
// The offset is read on the device under an engine's graphed steps (FlatState::rng_at).
// The mask is a buffer of the layer, remade only when the input's shape or device changes: it
// keeps one address from step to step. The output and the input gradient are new tensors, as
// every layer's are (a caching context hands them the same blocks each step), because the
// caller owns them and may hold them past the next call.
class Dropout : public Module {
 public:
  // requires 0 <= p < 1.
  explicit Dropout(float p = 0.5f) : p_(p) {
    DP_CHECK(p >= 0.f && p < 1.f, "Dropout(" << p << "): p must be in [0, 1)");
  }
  std::string type_name() const override { return "Dropout"; }
  float p() const { return p_; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    masked_ = is_training() && p_ > 0.f;
    if (!masked_) return x;
    FlatState& s = flat();
    kernels::ensure(mask_, x.shape(), DType::f32, x.device());
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());  // x's dtype (16-bit activations)
    x_dtype_ = x.dtype();
    kernels::dropout_forward(y, mask_, x, p_, s.rng_key, s.rng_at());
    s.rng_offset += static_cast<uint64_t>(x.numel());
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {
    if (!masked_) return dy;
    Tensor dx = Tensor::empty(mask_.shape(), x_dtype_, dy.device());
    kernels::mul(dx, dy, mask_);
    return dx;
  }
  std::shared_ptr<Module> clone_config() const override { return std::make_shared<Dropout>(p_); }

 private:
  float p_;
  bool masked_ = false;  // whether the cached forward applied a mask
  Tensor mask_;          // keep / (1 - p), shaped like the input, f32
  void release_saved() override { mask_ = Tensor(); }
  DType x_dtype_ = DType::f32;
};

}  // namespace nn
