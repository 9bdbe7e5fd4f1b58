// nn::gradcheck: central finite differences against Module::backward.
//
// The scalar checked is L = sum_i y_i r_i for a fixed random r, summed in double on the host,
// so one backward with dy = r gives the analytic gradient of every parameter and of the input.
// For each parameter tensor (and the input) a bounded sample of elements is perturbed by +-eps:
//   numeric = (L(p + eps) - L(p - eps)) / (2 eps),
//   error   = max(0, |analytic - numeric| - noise) / max(|analytic|, |numeric|, abs_floor),
// where noise = sum_i |y_i r_i| 2^-24 / eps bounds what rounding y to f32 does to the numeric
// gradient. When the central difference fails, a one-sided difference that matches is accepted
// and counted: a kink (ReLU at 0, a max changing hands) lay within eps of the point.
//
// The module runs in whatever mode it is in: BatchNorm in training mode uses batch statistics
// (a smooth function of the whole batch). Dropout in training mode replays one mask: the random
// stream offset is reset before every forward. Parameters, gradients, buffers (running stats),
// the random stream and the grad-ready hook are restored on return.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "nn/module.hpp"

namespace nn {

enum class CheckInput { no, yes };

struct GradcheckOptions {
  float eps = 1e-3f;
  double tolerance = 1e-2;          // ok iff every checked element's error <= tolerance
  double abs_floor = 1e-2;          // below this magnitude errors are absolute, not relative
  double noise_scale = 1.0;         // multiplies the f32 rounding noise allowance (see above)
  int64_t samples_per_tensor = 12;  // elements checked per parameter tensor and for the input
  uint64_t seed = 0x6c3d;           // for r and for the element sample
  CheckInput check_input = CheckInput::yes;
};

struct GradcheckResult {
  bool ok = false;
  double max_rel_error = 0;  // the largest error over every checked element, beyond the noise
  // That element's error before the noise allowance: analytic and numeric apart, relatively.
  double worst_raw_error = 0;
  std::string worst;  // the element that gave it: "0.weight[7]" or "input[12]"
  double worst_analytic = 0, worst_numeric = 0;
  int64_t checked = 0;    // elements compared
  int64_t one_sided = 0;  // of which matched a one-sided difference (a kink was within eps)
  std::string message;    // one line naming the worst element, its values and the verdict
};

namespace detail {

// Up to k distinct indices of [0, n), always including the first, the last and `extra`.
inline std::vector<int64_t> sample_indices(int64_t n, int64_t k, int64_t extra, uint64_t seed) {
  std::set<int64_t> picked;
  if (n <= k) {
    for (int64_t i = 0; i < n; ++i) picked.insert(i);
  } else {
    picked = {0, n - 1, extra};
    std::mt19937_64 gen(seed);
    std::uniform_int_distribution<int64_t> dist(0, n - 1);
    while (static_cast<int64_t>(picked.size()) < k) picked.insert(dist(gen));
  }
  return {picked.begin(), picked.end()};
}

// Writes one element of a device tensor from the host and waits.
inline void set_element(Tensor& t, int64_t i, float v) {
  Tensor dst = t.view(i, {1});
  Tensor src = Tensor::from_vector({v}, {1});
  kernels::copy(dst, src);
  kernels::context(t.device()).synchronize();
}

}  // namespace detail

// requires m materialised, x on m's device. ensures m's state as on entry (see above).
inline GradcheckResult gradcheck(Module& m, const Tensor& x, GradcheckOptions o = {}) {
  FlatState& fs = m.flat();
  DP_CHECK(x.defined() && x.device() == fs.device,
           "gradcheck: input must live on the module's device " << fs.device);
  DP_CHECK(o.eps > 0.f && o.samples_per_tensor > 0, "gradcheck: eps and samples must be > 0");
  // A 16-bit copy of the weights (or input) rounds v0 +- eps to v0 or a neighbour 2^-8 away:
  // the difference then measures the rounding, not the gradient.
  DP_CHECK(m.compute_dtype() == DType::f32 && x.dtype() != DType::f16 && x.dtype() != DType::bf16,
           "gradcheck: " << m.type_name() << " computes in " << m.compute_dtype() << " on input "
                         << x.dtype()
                         << ", whose spacing (2^-8 relative for bf16) is larger than any useful "
                            "eps; check the layer in f32 (its gradients' formulas are the same), "
                            "and compare its 16-bit run against that");

  // Saved state, restored by the guard whatever happens.
  struct Restore {
    FlatState& fs;
    Tensor params, grads, buffers;
    uint64_t rng_offset;
    std::function<void(const Parameter&)> hook;
    ~Restore() {
      try {
        kernels::copy(fs.params, params);
        kernels::copy(fs.grads, grads);
        if (buffers.numel() > 0) kernels::copy(fs.buffers, buffers);
        kernels::context(fs.device).synchronize();
      } catch (const std::exception& e) {
        DP_LOG_ERROR("gradcheck: could not restore the module's state: " << e.what());
      }
      fs.rng_offset = rng_offset;
      fs.on_grad_ready = std::move(hook);
    }
  } restore{fs,
            fs.params.clone(),
            fs.grads.clone(),
            fs.buffers.clone(),
            fs.rng_offset,
            std::move(fs.on_grad_ready)};
  fs.on_grad_ready = nullptr;

  Tensor xw = x.clone();  // the input, perturbed in place
  std::vector<double> r;  // the random projection, one weight per output element
  auto loss = [&]() {
    fs.rng_offset = restore.rng_offset;  // every forward replays the same dropout mask
    std::vector<float> y = m.forward(xw).to_host_f32();
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += static_cast<double>(y[i]) * r[i];
    return l;
  };

  // Analytic gradients: one forward, one backward with dy = r.
  fs.rng_offset = restore.rng_offset;
  Tensor y = m.forward(xw);
  {
    std::mt19937_64 gen(o.seed);
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    r.resize(static_cast<size_t>(y.numel()));
    for (auto& v : r) v = static_cast<float>(dist(gen));  // exactly representable in f32
  }
  std::vector<float> r32(r.begin(), r.end());
  m.zero_grad();
  Tensor dx = m.backward(Tensor::from_vector(r32, y.shape(), fs.device));
  const std::vector<float> grads = fs.grads.to_host_f32();
  // A layer that computes no input gradient (InputGrad::not_needed, or integer ids) returns
  // none: checked only when the input is.
  const bool input_checked = o.check_input == CheckInput::yes;
  DP_CHECK(dx.defined() || !input_checked,
           "gradcheck: backward of " << m.type_name()
                                     << " returned no input gradient (InputGrad::not_needed, or "
                                        "an integer input): pass CheckInput::no");
  const std::vector<float> dx_host = input_checked ? dx.to_host_f32() : std::vector<float>();
  DP_CHECK(!input_checked || dx.shape() == x.shape(),
           "gradcheck: backward of " << m.type_name() << " returned "
                                     << kernels::shape_str(dx.shape()) << " for input "
                                     << kernels::shape_str(x.shape()));

  // The numeric gradient is only as exact as y: rounding y to f32 moves L by up to about
  // S 2^-24 with S = sum |y_i r_i|, so differences below `noise` are not counted as errors.
  double s_abs = 0;
  {
    const std::vector<float> yh = y.to_host_f32();
    for (size_t i = 0; i < yh.size(); ++i) s_abs += std::fabs(yh[i] * r[i]);
  }
  const double noise = o.noise_scale * s_abs * std::ldexp(1.0, -24) / o.eps;
  const double l0 = loss();

  GradcheckResult res;
  bool any_nonfinite = false;
  double largest = 0;  // the largest analytic gradient checked
  auto rel_error = [&](double a, double n, double slack) {
    return std::max(0.0, std::fabs(a - n) - slack) /
           std::max({std::fabs(a), std::fabs(n), o.abs_floor});
  };
  auto check = [&](Tensor& t, const std::vector<float>& host_values, int64_t base,
                   const float* analytic, int64_t n, const std::string& name, uint64_t salt) {
    int64_t extra = 0;  // the element with the largest analytic gradient is always checked
    for (int64_t i = 1; i < n; ++i)
      if (std::fabs(analytic[i]) > std::fabs(analytic[extra])) extra = i;
    for (int64_t i : detail::sample_indices(n, o.samples_per_tensor, extra,
                                            kernels::philox::mix_key(o.seed, salt))) {
      const float v0 = host_values[static_cast<size_t>(base + i)];
      const float vp = v0 + o.eps, vm = v0 - o.eps;
      detail::set_element(t, base + i, vp);
      const double lp = loss();
      detail::set_element(t, base + i, vm);
      const double lm = loss();
      detail::set_element(t, base + i, v0);
      // Steps as taken in f32, which may differ slightly from eps.
      const double hp = static_cast<double>(vp) - v0, hm = v0 - static_cast<double>(vm);
      DP_CHECK(hp > 0 && hm > 0,
               "gradcheck " << m.type_name() << ": eps " << o.eps << " is below the f32 spacing at "
                            << name << "[" << i << "] = " << v0 << " (" << v0 << " +- " << o.eps
                            << " rounds to " << v0 << " itself): give a larger eps, about "
                            << std::ldexp(std::max(std::fabs(v0), 1e-30f), -10) << " here");
      double numeric = (lp - lm) / (hp + hm);
      const double a = analytic[i];
      double err = rel_error(a, numeric, noise);
      if (err > o.tolerance) {
        // A kink (ReLU at 0, a max changing hands) between v0 - eps and v0 + eps spoils the
        // central difference; then the one-sided difference on the smooth side matches.
        const double fwd = (lp - l0) / hp, bwd = (l0 - lm) / hm;
        const double ef = rel_error(a, fwd, 2 * noise), eb = rel_error(a, bwd, 2 * noise);
        if (std::min(ef, eb) <= o.tolerance) {
          ++res.one_sided;
          err = std::min(ef, eb);
          numeric = ef <= eb ? fwd : bwd;
        }
      }
      ++res.checked;
      if (std::isfinite(a)) largest = std::max(largest, std::fabs(a));
      const bool finite = std::isfinite(a) && std::isfinite(numeric);
      if (!finite) any_nonfinite = true;
      const double e = finite ? err : INFINITY;
      const double raw = rel_error(a, numeric, 0.0);  // breaks ties among errors under the noise
      if (res.worst.empty() || e > res.max_rel_error ||
          (e == res.max_rel_error && raw > res.worst_raw_error)) {
        res.max_rel_error = e;
        res.worst_raw_error = raw;
        res.worst = name + "[" + std::to_string(i) + "]";
        res.worst_analytic = a;
        res.worst_numeric = numeric;
      }
    }
  };

  const std::vector<float> params_host = restore.params.to_host_f32();
  uint64_t salt = 0;
  for (auto& [name, p] : m.named_parameters())
    check(fs.params, params_host, p->offset, grads.data() + p->offset, p->numel(), name, ++salt);
  if (input_checked) {
    const std::vector<float> x_host = x.to_host_f32();
    check(xw, x_host, 0, dx_host.data(), xw.numel(), "input", ++salt);
  }

  // The noise allowance grows as 1/eps: beyond tolerance x the largest gradient, it could hide
  // any error (a 14% wrong gradient passed at eps 1e-6 with "max error 0").
  const bool resolvable = noise <= o.tolerance * std::max(largest, o.abs_floor);
  res.ok = !any_nonfinite && res.max_rel_error <= o.tolerance && resolvable;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "gradcheck %s %s: max error %.3g at %s (analytic %.6g, numeric %.6g: %.3g apart "
                "before the noise allowance); %lld elements checked (%lld one-sided at a kink), "
                "tolerance %.3g, eps %.3g, noise %.2g",
                m.type_name().c_str(), res.ok ? "passed" : "FAILED", res.max_rel_error,
                res.worst.empty() ? "-" : res.worst.c_str(), res.worst_analytic, res.worst_numeric,
                res.worst_raw_error, static_cast<long long>(res.checked),
                static_cast<long long>(res.one_sided), o.tolerance, static_cast<double>(o.eps),
                noise);
  res.message = buf;
  if (!resolvable) {
    std::snprintf(buf, sizeof buf,
                  "; cannot tell: the loss's f32 rounding allows differences of %.3g at eps %.3g, "
                  "more than tolerance x the largest gradient (%.3g): give a larger eps (the "
                  "allowance falls as 1/eps)",
                  noise, static_cast<double>(o.eps), o.tolerance * std::max(largest, o.abs_floor));
    res.message += buf;
  }
  return res;
}

}  // namespace nn
