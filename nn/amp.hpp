// Mixed precision, as PyTorch's autocast and GradScaler do it.
//
// The policy (Module::set_compute_dtype): master weights stay f32 in the flat parameter
// buffer; once per step (the first forward after any change) ONE cast kernel makes a 16-bit
// copy of the whole buffer, and Linear and Conv2d multiply 16-bit inputs with those 16-bit
// weights, accumulating in f32. By default activations between layers stay f32: softmax/
// cross-entropy, normalisation, reductions and the optimizer see f32 as before, and each GEMM or
// convolution casts its input once (the cast input is what backward keeps, at half the bytes).
// Module::set_activations(Activations::compute) keeps them 16-bit instead (module.hpp).
//
// Loss scaling (GradScaler): fp16 has 5 exponent bits, so small gradients flush to zero. The
// loss gradient is multiplied by a scale S (2^16 at first); the gradient buffer then holds
// S * grad, which the fused optimizer unscales (grad_unscale = 1 / S). A step whose gradient
// holds an inf or NaN is skipped and S halves (never below kMinLossScale, 2^-24); after 2000
// good steps in a row S doubles.
// bf16 has f32's exponent range and needs no scale (S stays 1), but takes the same check.
//
//   nn::GradScaler scaler(nn::Precision::fp16);
//   net->set_compute_dtype(nn::compute_dtype(nn::Precision::fp16));
//   for each batch: zero_grad; logits = net->forward(x); softmax_cross_entropy(loss, dlogits..);
//                   scaler.scale_loss_grad(dlogits); net->backward(dlogits);
//                   scaler.step(opt, net->flat_grads());   // checks, unscales, steps or skips
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "nn/loss.hpp"
#include "nn/module.hpp"
#include "nn/optim.hpp"

namespace nn {

// What a run computes in: f32; f32 with TF32 tensor-core GEMMs (GPU); or the autocast policy
// above with bf16 or fp16.
enum class Precision { fp32, tf32, bf16, fp16 };

inline const char* precision_name(Precision p) {
  switch (p) {
    case Precision::fp32:
      return "fp32";
    case Precision::tf32:
      return "tf32";
    case Precision::bf16:
      return "bf16";
    case Precision::fp16:
      return "fp16";
  }
  return "?";
}

// Parses "fp32", "tf32", "bf16" or "fp16"; throws naming the flag and the choices otherwise.
inline Precision parse_precision(const std::string& s, const std::string& flag = "--dtype") {
  for (Precision p : {Precision::fp32, Precision::tf32, Precision::bf16, Precision::fp16})
    if (s == precision_name(p)) return p;
  DP_THROW(flag << " " << s << ": choose fp32, tf32, bf16 or fp16");
}

// The dtype GEMMs and convolutions take their inputs in.
inline DType compute_dtype(Precision p) {
  return p == Precision::bf16 ? DType::bf16 : p == Precision::fp16 ? DType::f16 : DType::f32;
}

// The math mode of f32 products: TF32 for tf32, strict otherwise.
inline kernels::MathMode math_mode(Precision p) {
  return p == Precision::tf32 ? kernels::MathMode::tf32 : kernels::MathMode::strict;
}

// The dtype a model hands its output to `loss` in (Module::set_output), as the engines set it:
// the activation dtype when the loss takes 16-bit predictions (the cross-entropies: no f32 copy
// of the logits or of their gradient, the gradient rounded to 16 bits once, as PyTorch's
// autocast hands the LM head's backward a 16-bit gradient); f32 otherwise. Under fp16 the loss
// must also multiply its gradient by the loss scale before that rounding
// (Loss::scales_before_rounding, the cross-entropies' kernels): a loss that scales after it
// (compute_scaled's default) would already have rounded to zero every fp16 value below fp16's
// smallest step (2^-24), the values the scale exists to keep, and keeps f32. Only matters under
// 16-bit activations (Activations::compute).
inline Output output_for(Precision p, const Loss& loss) {
  if (!loss.takes_16bit_pred()) return Output::f32;
  if (p == Precision::bf16) return Output::activations;
  return p == Precision::fp16 && loss.scales_before_rounding() ? Output::activations : Output::f32;
}

// The loss scale never goes below 2^-24 (about 6e-8). Backing off past it cannot help: fp16's
// smallest step (its smallest subnormal) is 2^-24, so at this scale every loss-gradient entry of
// magnitude <= 1 (softmax cross-entropy's always are) already rounds to zero once cast to fp16,
// and a smaller scale only carries zeros. Without a floor, a run whose gradients stay non-finite
// halves the scale ~150 times to 0.0, which is no scale at all (and which a training-state file
// cannot hold: the loader requires a positive float). 2^-24 is a normal float, written and read
// back exactly.
constexpr float kMinLossScale = 1.f / 16777216.f;  // 2^-24

// More than this share of skipped steps is worth a warning (PyTorch users see a handful at the
// start of an fp16 run while the scale settles; a twentieth of the run is not that).
constexpr double kSkipWarnFraction = 0.05;

// The state of a GradScaler, for checkpoints and reports.
struct GradScalerState {
  float scale = 1.f;           // the loss scale of the next step
  int64_t growth_tracker = 0;  // good steps since the scale last changed
  int64_t skipped_steps = 0;   // steps skipped for a non-finite gradient, in all
};

struct GradScalerOptions {
  bool check = true;            // check gradients and skip non-finite steps
  bool scaling = true;          // scale the loss (fp16); false: the scale stays 1
  float init_scale = 65536.f;   // 2^16
  float growth_factor = 2.f;    // after growth_interval good steps in a row
  float backoff_factor = 0.5f;  // after a non-finite gradient
  int64_t growth_interval = 2000;
};

class GradScaler {
 public:
  // fp16: scaling and checks; bf16: checks only (scale 1); fp32/tf32: off (every step taken,
  // no check: PyTorch's default without a scaler).
  static GradScalerOptions options_for(Precision p) {
    GradScalerOptions o;
    o.check = p == Precision::bf16 || p == Precision::fp16;
    o.scaling = p == Precision::fp16;
    return o;
  }
  explicit GradScaler(Precision p) : GradScaler(options_for(p)) {}
  explicit GradScaler(GradScalerOptions o) : options_(o) {
    DP_CHECK(o.init_scale > 0.f && o.growth_factor >= 1.f && o.backoff_factor > 0.f &&
                 o.backoff_factor < 1.f && o.growth_interval > 0,
             "GradScaler: init_scale " << o.init_scale << ", growth_factor " << o.growth_factor
                                       << ", backoff_factor " << o.backoff_factor
                                       << ", growth_interval " << o.growth_interval
                                       << " (need > 0, >= 1, in (0, 1), > 0)");
    state_.scale = o.scaling ? o.init_scale : 1.f;
  }

  bool enabled() const { return options_.check; }
  float scale() const { return state_.scale; }
  int64_t skipped_steps() const { return state_.skipped_steps; }
  const GradScalerState& state() const { return state_; }
  // For resuming. requires scale > 0.
  void set_state(const GradScalerState& s) {
    DP_CHECK(
        s.scale > 0.f && std::isfinite(s.scale) && s.growth_tracker >= 0 && s.skipped_steps >= 0,
        "GradScaler: invalid state (scale " << s.scale << ", growth_tracker " << s.growth_tracker
                                            << ", skipped " << s.skipped_steps << ")");
    state_ = s;
    if (!options_.scaling) state_.scale = 1.f;
    state_.scale = std::max(state_.scale, kMinLossScale);
  }

  // dlogits *= scale (nothing when the scale is 1).
  void scale_loss_grad(Tensor& dlogits) const {
    if (state_.scale != 1.f) kernels::scale(dlogits, dlogits, state_.scale);
  }
  // Whether the loss is scaled (fp16): whether scale() can be other than 1.
  bool scaling() const { return options_.scaling; }
  // The factor the loss's gradient is multiplied by (Loss::compute_scaled), read on the device
  // when the loss runs: `scale`, which holds scale() for this step ((1) f32 on the gradient's
  // device, so that a captured step replays with the current scale), or a fixed 1 without
  // scaling.
  kernels::Scalar loss_grad_factor(const kernels::Scalar& scale) const {
    return options_.scaling ? scale : kernels::Scalar();
  }

  // requires `grads` the step's final gradient (DP: device 0's reduced one; DDP: this rank's
  // after the all-reduce, the same bytes on every rank), scaled by scale(). Checks it, then
  // either steps `opt` with the gradients unscaled inside its fused kernel, or skips the step;
  // then updates the scale. Returns whether the step was taken. Waits for the check.
  bool step(Optimizer& opt, const Tensor& grads) {
    return step_if(opt, !options_.check || kernels::all_finite(grads));
  }
  // step() without its host wait: the verdict goes to `non_finite` ((1) f32 on the gradients'
  // device: 1 when some gradient is not finite, 0 otherwise) and the fused update reads it
  // there, skipping itself. The caller reads the verdict later, with the step's other metrics,
  // and calls settle() before the next step. Without a check (enabled() false) nothing is
  // written to `non_finite` and settle() does not look at it.
  void step_deferred(Optimizer& opt, const Tensor& grads, Tensor& non_finite) {
    prepare_deferred(opt);
    apply_deferred(opt, grads, non_finite);
  }
  // The host half of step_deferred, outside any captured region: sets opt's unscale to
  // 1 / scale() and calls opt.prepare_step(). requires settle() of the previous step done.
  void prepare_deferred(Optimizer& opt) {
    opt.set_grad_unscale(1.f / state_.scale);
    opt.prepare_step();
  }
  // The device half: queues the check into `non_finite` (with a check) and opt.apply_step(),
  // which skips itself on the flag. Capturable. requires prepare_deferred(opt) for this step.
  void apply_deferred(Optimizer& opt, const Tensor& grads, Tensor& non_finite) {
    if (!options_.check) {
      opt.apply_step();
      return;
    }
    kernels::non_finite_into(non_finite, grads);
    opt.set_skip_if(non_finite);
    opt.apply_step();
    opt.set_skip_if(Tensor());
  }
  // requires step_deferred ran and `finite` is its verdict as read (ignored without a check).
  // ensures the step count and the scale are what step() leaves. Returns whether the step was
  // taken.
  bool settle(Optimizer& opt, bool finite) {
    if (!options_.check) return true;
    if (!finite) opt.set_step_count(opt.step_count() - 1);  // the kernel skipped it
    update(finite);
    return finite;
  }

  // The same with the check already made (ZeRO-1: every rank's shard, combined): steps `opt`
  // unscaled when `finite`, skips otherwise, then updates the scale.
  bool step_if(Optimizer& opt, bool finite) {
    if (finite) {
      opt.set_grad_unscale(1.f / state_.scale);
      opt.step();
    }
    update(finite);
    return finite;
  }

  // The scale's rule alone: a non-finite step backs off and resets the count; 2000 good steps
  // in a row grow the scale.
  void update(bool finite) {
    if (!options_.check) return;
    if (!finite) {
      ++state_.skipped_steps;
      state_.growth_tracker = 0;
      if (options_.scaling)
        state_.scale = std::max(state_.scale * options_.backoff_factor, kMinLossScale);
      return;
    }
    if (!options_.scaling) return;
    if (++state_.growth_tracker == options_.growth_interval) {
      const float grown = state_.scale * options_.growth_factor;
      if (std::isfinite(grown)) state_.scale = grown;
      state_.growth_tracker = 0;
    }
  }

 private:
  GradScalerOptions options_;
  GradScalerState state_;
};

// The verdict on a run's skipped steps (a non-finite gradient each): `skipped` of `steps`.
// Returns a warning line when more than kSkipWarnFraction of them were skipped ("" otherwise);
// throws kernels::Error naming both fractions when `max_fraction` is given and exceeded
// (--max-skip-fraction). requires 0 <= skipped <= steps.
inline std::string check_skipped_steps(int64_t skipped, int64_t steps,
                                       std::optional<double> max_fraction) {
  if (steps <= 0 || skipped <= 0) return "";
  const double fraction = static_cast<double>(skipped) / static_cast<double>(steps);
  char text[256];
  std::snprintf(text, sizeof text,
                "%lld of %lld steps (%.1f%%) were skipped for a non-finite gradient (loss "
                "scaling: fp16 overflow, or a diverging run)",
                static_cast<long long>(skipped), static_cast<long long>(steps), 100 * fraction);
  DP_CHECK(!max_fraction || fraction <= *max_fraction,
           text << "; more than --max-skip-fraction " << *max_fraction << " allows");
  return fraction > kSkipWarnFraction ? std::string("warning: ") + text : std::string();
}

}  // namespace nn
