// Optimizers over a module's flat buffers, and learning-rate schedules.
//
// Each optimizer step is ONE fused kernel over the whole flat parameter buffer; its state
// (momentum, Adam moments) is flat tensors on the module's device, laid out like the parameters.
//   kernels::SgdConfig config;  config.lr = 0.1f;  config.momentum = 0.9f;
//   nn::SGD opt(*net, config);
//   nn::CosineLR schedule(0.1f, epochs);
//   for each epoch e: opt.set_lr(schedule.lr(e)); for each batch: zero_grad, forward,
//   backward, opt.step();
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "nn/module.hpp"

namespace nn {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // requires the module's flat grads hold the gradient of this step. ensures the flat params
  // are updated in one kernel queued on the module's device; step_count() grows by one.
  void step() {
    prepare_step();
    apply_step();
  }
  // The host half of step(), outside any captured region: step_count() grows by one and this
  // step's scalars (learning rate, grad unscale, step-count terms; see kernels::sgd_scalars,
  // adamw_scalars) are written into step_scalars() by ONE launch that carries them by value.
  // Allocates nothing.
  void prepare_step() {
    ++step_;
    const int n = compute_step_scalars(host_scalars_.data());
    kernels::set_values(scalars_, host_scalars_.data(), n);
  }
  // The device half: queues the fused update alone. It reads its per-step scalars from
  // step_scalars() and the skip flag (set_skip_if) when it runs; no host value that changes
  // between steps is among its arguments, so a captured apply_step replays correctly after each
  // prepare_step. requires prepare_step() for this step.
  virtual void apply_step() = 0;
  // (kernels::kMaxValues) f32 on the module's device: the per-step scalars apply_step reads.
  const Tensor& step_scalars() const { return scalars_; }
  // Named optimizer state tensors (flat, shaped like the parameters), e.g. for checkpoints.
  virtual std::vector<std::pair<std::string, Tensor>> state() = 0;

  void zero_grad() { module_.zero_grad(); }
  float lr() const { return lr_; }
  void set_lr(float lr) {
    DP_CHECK(lr >= 0.f && std::isfinite(lr),
             "set_lr(" << lr << "): a learning rate is finite and >= 0");
    lr_ = lr;
  }
  // The factor every gradient is multiplied by inside the fused step: 1 / loss scale under
  // mixed precision (nn/amp.hpp), 1 otherwise.
  float grad_unscale() const { return grad_unscale_; }
  void set_grad_unscale(float f) {
    DP_CHECK(f > 0.f && std::isfinite(f), "set_grad_unscale(" << f << "): must be finite and > 0");
    grad_unscale_ = f;
  }
  // Undefined, or a (1) f32 flag on the module's device that the next steps' fused kernels read:
  // nonzero skips the update there (GradScaler::step_deferred), without a host read.
  void set_skip_if(Tensor flag) { skip_if_ = std::move(flag); }
  // Steps taken so far (the next step is number step_count() + 1).
  int64_t step_count() const { return step_; }
  // For resuming from a checkpoint.
  void set_step_count(int64_t n) {
    DP_CHECK(n >= 0, "set_step_count(" << n << "): must be >= 0");
    step_ = n;
  }
  Module& module() { return module_; }
  // requires nothing. ensures returns only when this optimizer steps m's flat parameters;
  // otherwise throws, naming `who` (the caller, e.g. "DataParallel") and both modules: an
  // optimizer built on another module steps that one, and m's weights never move.
  void require_steps(Module& m, const std::string& who) {
    DP_CHECK(module_.materialized() && m.materialized() &&
                 module_.flat_params().same_storage(m.flat_params()),
             who << ": the optimizer steps another module's parameters (a " << module_.type_name()
                 << "), not the " << m.type_name() << "'s given here: build it on this module");
  }

  // ZeRO stage 1: from now on this optimizer updates only flat elements [begin, end) of the
  // module and keeps state for those alone (the state is remade, zeroed, for the shard).
  // requires 0 <= begin <= end <= P and no step taken yet.
  void set_shard(int64_t begin, int64_t end) {
    int64_t p = module_.flat_params().numel();
    DP_CHECK(0 <= begin && begin <= end && end <= p, "optimizer shard [" << begin << ", " << end
                                                                         << ") is not within the "
                                                                         << p << " parameters");
    DP_CHECK(step_ == 0, "optimizer shard: set it before the first step (taken " << step_ << ")");
    begin_ = begin;
    end_ = end;
    reset_state();
  }
  int64_t shard_begin() const { return begin_; }
  int64_t shard_end() const { return end_ < 0 ? module_.flat_params().numel() : end_; }
  // Under mixed precision (Module::set_compute_dtype) the fused step also writes the 16-bit
  // copy of the weights that the next forward reads, in the same pass, so that forward casts
  // nothing (on by default; a ZeRO-1 shard writes none: the all-gather brings the rest). Off: the
  // forward casts the f32 weights as before. Writes to the parameters between a step and the
  // next forward other than nn's own need Module::parameters_changed().
  void set_writes_compute_copy(bool on) { writes_compute_copy_ = on; }
  bool writes_compute_copy() const { return writes_compute_copy_; }
  // Bytes of optimizer state this optimizer holds.
  int64_t state_bytes() {
    int64_t bytes = 0;
    for (auto& [name, t] : state()) bytes += static_cast<int64_t>(t.nbytes());
    return bytes;
  }

 protected:
  // requires m materialised (the optimizer allocates its state on m's device).
  Optimizer(Module& m, float lr) : module_(m), lr_(lr) {
    m.require_root("an optimizer");
    scalars_ = Tensor::zeros({kernels::kMaxValues}, DType::f32, m.device());
  }
  // Writes the scalars of step step_count() (lr(), grad_unscale()) into `out` (kMaxValues
  // floats) in the layout apply_step's kernel reads; returns how many.
  virtual int compute_step_scalars(float* out) = 0;
  // State shaped like the parameters this optimizer updates (all, or its shard), zeroed.
  Tensor zeros_like_params() {
    return Tensor::zeros({shard_end() - shard_begin()}, DType::f32, module_.device());
  }
  // Views of the parameters and gradients this optimizer updates.
  Tensor params_to_update() {
    return module_.flat_params().view(shard_begin(), {shard_end() - shard_begin()});
  }
  Tensor grads_to_update() {
    return module_.flat_grads().view(shard_begin(), {shard_end() - shard_begin()});
  }
  // Remakes the state for the current shard (zeros).
  virtual void reset_state() = 0;
  // The 16-bit copy this step writes beside the parameters (writes_compute_copy): the module's
  // compute_params when it has them and this optimizer updates every parameter, else undefined.
  Tensor compute_copy_to_write() {
    FlatState& f = module_.flat();
    const bool whole = shard_begin() == 0 && shard_end() == f.params.numel();
    return writes_compute_copy_ && whole && f.compute_params.defined() ? f.compute_params
                                                                       : Tensor();
  }
  // After queueing an update that wrote `copy` (compute_copy_to_write): the next forward casts
  // nothing. A skipped update (skip_if) leaves both the weights and their copy as they were.
  void copy_written(const Tensor& copy) {
    if (copy.defined()) module_.flat().compute_copy_fresh();
  }

  Module& module_;
  float lr_;
  float grad_unscale_ = 1.f;
  Tensor skip_if_;
  Tensor scalars_;  // (kMaxValues) f32 on the module's device
  std::array<float, kernels::kMaxValues> host_scalars_{};
  int64_t step_ = 0;
  int64_t begin_ = 0, end_ = -1;  // end < 0: every parameter
  bool writes_compute_copy_ = true;
};

// PyTorch's SGD: momentum, dampening, Nesterov and (coupled) weight decay; see
// kernels::sgd_update. The momentum buffer (P) exists only when momentum != 0.
class SGD : public Optimizer {
 public:
  SGD(Module& m, kernels::SgdConfig config) : Optimizer(m, config.lr), config_(config) {
    DP_CHECK(config.lr >= 0.f && config.momentum >= 0.f && config.weight_decay >= 0.f,
             "SGD: lr " << config.lr << ", momentum " << config.momentum << ", weight_decay "
                        << config.weight_decay << " must be >= 0");
    DP_CHECK(config.nesterov == kernels::Nesterov::no ||
                 (config.momentum > 0.f && config.dampening == 0.f),
             "SGD: Nesterov momentum requires momentum > 0 and dampening 0");
    reset_state();
  }

  void apply_step() override {
    config_.skip_if = skip_if_;
    config_.compute_copy = compute_copy_to_write();
    Tensor p = params_to_update(), g = grads_to_update();
    if (p.numel() > 0) kernels::sgd_update(p, g, momentum_, config_, scalars_);
    copy_written(config_.compute_copy);
  }
  std::vector<std::pair<std::string, Tensor>> state() override {
    if (!momentum_.defined()) return {};
    return {{"momentum", momentum_}};
  }
  const kernels::SgdConfig& config() const { return config_; }

 protected:
  int compute_step_scalars(float* out) override {
    config_.lr = lr_;
    config_.grad_unscale = grad_unscale_;
    const auto s = kernels::sgd_scalars(config_, step_);
    std::copy(s.begin(), s.end(), out);
    return static_cast<int>(s.size());
  }
  void reset_state() override {
    if (config_.momentum != 0.f) momentum_ = zeros_like_params();
  }

 private:
  kernels::SgdConfig config_;
  Tensor momentum_;  // (P), undefined without momentum
};

// PyTorch's AdamW (decoupled weight decay); see kernels::adamw_update. m, v (P).
class AdamW : public Optimizer {
 public:
  AdamW(Module& m, kernels::AdamWConfig config)
      : Optimizer(m, config.lr), config_(config), groups_table_(kernels::single_group(config)) {
    DP_CHECK(config.lr >= 0.f && config.beta1 >= 0.f && config.beta1 < 1.f && config.beta2 >= 0.f &&
                 config.beta2 < 1.f && config.eps > 0.f && config.weight_decay >= 0.f,
             "AdamW: invalid config (lr " << config.lr << ", betas " << config.beta1 << ", "
                                          << config.beta2 << ", eps " << config.eps
                                          << ", weight_decay " << config.weight_decay << ")");
    reset_state();
  }

  void apply_step() override {
    config_.skip_if = skip_if_;
    config_.compute_copy = compute_copy_to_write();
    Tensor p = params_to_update(), g = grads_to_update();
    if (p.numel() > 0) kernels::adamw_update(p, g, m_, v_, config_, scalars_);
    copy_written(config_.compute_copy);
  }
  std::vector<std::pair<std::string, Tensor>> state() override {
    return {{"exp_avg", m_}, {"exp_avg_sq", v_}};
  }
  const kernels::AdamWConfig& config() const { return config_; }

 protected:
  int compute_step_scalars(float* out) override {
    config_.lr = lr_;
    config_.grad_unscale = grad_unscale_;
    const auto s = kernels::adamw_scalars(config_, groups_table_, step_);
    std::copy(s.begin(), s.end(), out);
    return static_cast<int>(s.size());
  }
  void reset_state() override {
    m_ = zeros_like_params();
    v_ = zeros_like_params();
  }

  kernels::AdamWConfig config_;
  // The groups the scalars are computed for: one with config_.weight_decay (GroupedAdamW: its
  // own).
  kernels::AdamWGroups groups_table_;
  Tensor m_, v_;  // (P) first and second moments
};

// ---- learning-rate schedules ---------------------------------------------------------------
// A schedule maps a step or epoch count t >= 0 to a learning rate; the caller applies it with
// optimizer.set_lr(schedule.lr(t)). Schedules are stateless, so resuming needs only t.

class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  virtual float lr(int64_t t) const = 0;
};

class ConstantLR : public LrSchedule {
 public:
  explicit ConstantLR(float lr) : lr_(lr) {}
  float lr(int64_t) const override { return lr_; }

 private:
  float lr_;
};

// lr(t) = base_lr * gamma^floor(t / step_size).
class StepLR : public LrSchedule {
 public:
  StepLR(float base_lr, int64_t step_size, float gamma = 0.1f)
      : base_(base_lr), step_size_(step_size), gamma_(gamma) {
    DP_CHECK(step_size > 0, "StepLR: step_size " << step_size << " must be > 0");
  }
  float lr(int64_t t) const override {
    return base_ *
           static_cast<float>(std::pow(static_cast<double>(gamma_),
                                       static_cast<double>(std::max<int64_t>(t, 0) / step_size_)));
  }

 private:
  float base_;
  int64_t step_size_;
  float gamma_;
};

// Cosine annealing from base_lr at t = 0 to min_lr at t = total (held there afterwards):
// lr(t) = min_lr + (base_lr - min_lr) (1 + cos(pi t / total)) / 2.
class CosineLR : public LrSchedule {
 public:
  CosineLR(float base_lr, int64_t total, float min_lr = 0.f)
      : base_(base_lr), total_(total), min_(min_lr) {
    DP_CHECK(total > 0, "CosineLR: total " << total << " must be > 0");
  }
  float lr(int64_t t) const override {
    const double frac =
        static_cast<double>(std::clamp<int64_t>(t, 0, total_)) / static_cast<double>(total_);
    const double pi = 3.14159265358979323846;
    return static_cast<float>(min_ + (base_ - min_) * 0.5 * (1.0 + std::cos(pi * frac)));
  }

 private:
  float base_;
  int64_t total_;
  float min_;
};

// Linear warmup in front of another schedule: for t < warmup, lr(t) = after.lr(0) (t + 1) /
// warmup (so the first step already moves); from t = warmup on, lr(t) = after.lr(t - warmup).
class LinearWarmup : public LrSchedule {
 public:
  LinearWarmup(std::shared_ptr<const LrSchedule> after, int64_t warmup)
      : after_(std::move(after)), warmup_(warmup) {
    DP_CHECK(after_ != nullptr, "LinearWarmup: null schedule");
    DP_CHECK(warmup >= 0, "LinearWarmup: warmup " << warmup << " must be >= 0");
  }
  // Wraps a copy of any schedule: LinearWarmup(CosineLR(0.1f, 90), 5).
  template <class S, class = std::enable_if_t<std::is_base_of_v<LrSchedule, S>>>
  LinearWarmup(S after, int64_t warmup)
      : LinearWarmup(std::make_shared<const S>(std::move(after)), warmup) {}

  float lr(int64_t t) const override {
    if (t < warmup_)
      return after_->lr(0) * static_cast<float>(std::max<int64_t>(t, 0) + 1) /
             static_cast<float>(warmup_);
    return after_->lr(t - warmup_);
  }

 private:
  std::shared_ptr<const LrSchedule> after_;
  int64_t warmup_;
};

}  // namespace nn
