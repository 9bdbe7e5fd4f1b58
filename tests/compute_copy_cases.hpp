// The fused optimizer steps' 16-bit copy (SgdConfig::compute_copy, AdamWConfig::compute_copy),
// on any device: SGD (momentum, Nesterov, weight decay), AdamW and grouped AdamW, into bf16 and
// f16, over a bulk and a tail of every width, with the copy aligned and one value off (the GPU's
// four-wide and one-wide kernels). Each step must leave the parameters and the optimizer state
// with the bits of the same step without a copy, and the copy with the bits cast() gives the
// updated parameters; a skipped step (skip_if) writes neither. kernels.compute_copy (CPU) and
// kernels.cuda.compute_copy run them.
#pragma once

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/ops.hpp"
#include "tests/optim_test_util.hpp"
#include "tests/test_util.hpp"

namespace compute_copy {

using kernels::Device;
using kernels::DType;
using kernels::Tensor;

inline bool same_bits(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(Device::cpu()), y = b.to(Device::cpu());
  return x.dtype() == y.dtype() && x.nbytes() == y.nbytes() &&
         std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

// A view of n values of dtype t on d, `offset` values into a buffer of its own, filled with
// `fill`.
inline Tensor view_at(int64_t n, DType t, Device d, int64_t offset, float fill) {
  Tensor big = Tensor::zeros({n + offset}, t, d);
  kernels::fill(big, fill);
  return big.view(offset, {n});
}

// One optimizer under test: its state (a momentum buffer, or AdamW's moments) and a step of it
// with or without a copy.
struct Optimizer {
  std::string name;
  std::function<void(Tensor& p, const Tensor& g, std::vector<Tensor>& state, const Tensor& copy,
                     const Tensor& skip, int64_t step)>
      step;
  int states;
};

inline std::vector<Optimizer> optimizers(Device d, int64_t n) {
  kernels::SgdConfig sgd;
  sgd.lr = 0.05f, sgd.momentum = 0.9f, sgd.weight_decay = 1e-2f;
  sgd.nesterov = kernels::Nesterov::yes;
  kernels::AdamWConfig adam;
  adam.lr = 1e-2f, adam.weight_decay = 0.1f;
  kernels::AdamWGroups groups;
  groups.count = 2;
  groups.lr_scale[1] = 0.5f;
  groups.weight_decay[1] = 0.f;
  std::vector<uint8_t> which(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) which[i] = static_cast<uint8_t>((i / 37) % 2);
  Tensor group_of = Tensor::zeros({n}, DType::u8, Device::cpu());
  std::memcpy(group_of.raw(), which.data(), which.size());
  group_of = group_of.to(d);
  return {
      {"sgd",
       [sgd](Tensor& p, const Tensor& g, std::vector<Tensor>& st, const Tensor& copy,
             const Tensor& skip, int64_t step) {
         kernels::SgdConfig c = sgd;
         c.compute_copy = copy, c.skip_if = skip;
         dp_test::sgd_step(p, g, st[0], c, step);
       },
       1},
      {"adamw",
       [adam](Tensor& p, const Tensor& g, std::vector<Tensor>& st, const Tensor& copy,
              const Tensor& skip, int64_t step) {
         kernels::AdamWConfig c = adam;
         c.compute_copy = copy, c.skip_if = skip;
         dp_test::adamw_step(p, g, st[0], st[1], c, step);
       },
       2},
      {"adamw grouped",
       [adam, groups, group_of](Tensor& p, const Tensor& g, std::vector<Tensor>& st,
                                const Tensor& copy, const Tensor& skip, int64_t step) {
         kernels::AdamWConfig c = adam;
         c.compute_copy = copy, c.skip_if = skip;
         const auto s = kernels::adamw_scalars(c, groups, step);
         kernels::adamw_update_grouped(
             p, g, st[0], st[1], group_of, c,
             dp_test::scalars_tensor(s.data(), static_cast<int>(s.size()), p.device()));
       },
       2},
  };
}

// Calls check(what, ok) for each comparison, 3 optimizers x 2 dtypes x 2 alignments x 11: 3 steps
// x 3 (the parameters and the state as without a copy, the copy as cast), then a skipped step x
// 2 (the parameters and the copy kept).
inline void run(Device d, const std::function<void(const std::string&, bool)>& check) {
  const int64_t n = 4099;  // a bulk and a tail of every width
  for (const Optimizer& opt : optimizers(d, n)) {
    for (DType t : {DType::bf16, DType::f16}) {
      for (int64_t offset : {0, 1}) {
        const std::string what = opt.name + " into " + kernels::dtype_name(t) +
                                 (offset ? ", the copy one value off" : ", aligned");
        Tensor p = Tensor::from_vector(dp_test::random_vector(n, 301, -2.f, 2.f), {n}, d);
        Tensor q = p.clone();
        std::vector<Tensor> sp, sq;
        for (int k = 0; k < opt.states; ++k) {
          sp.push_back(Tensor::zeros({n}, DType::f32, d));
          sq.push_back(Tensor::zeros({n}, DType::f32, d));
        }
        Tensor copy = view_at(n, t, d, offset, 7.f);
        for (int64_t step = 1; step <= 3; ++step) {
          Tensor g = Tensor::from_vector(
              dp_test::random_vector(n, 310 + static_cast<uint32_t>(step), -4.f, 4.f), {n}, d);
          opt.step(p, g, sp, Tensor(), Tensor(), step);
          opt.step(q, g, sq, copy, Tensor(), step);
          bool state_same = true;
          for (int k = 0; k < opt.states; ++k) state_same = state_same && same_bits(sp[k], sq[k]);
          const std::string at = what + ", step " + std::to_string(step);
          check(at + ": the parameters' bits", same_bits(p, q));
          check(at + ": the state's bits", state_same);
          check(at + ": the copy is cast(params)", same_bits(copy, kernels::cast(q, t)));
        }
        // A skipped step writes neither the parameters nor the copy.
        Tensor skip = Tensor::zeros({1}, DType::f32, d);
        kernels::fill(skip, 1.f);
        const Tensor before = q.clone();
        kernels::fill(copy, 5.f);
        const Tensor copy_before = copy.clone();
        Tensor g = Tensor::from_vector(dp_test::random_vector(n, 320, -4.f, 4.f), {n}, d);
        opt.step(q, g, sq, copy, skip, 4);
        check(what + ", skipped: the parameters kept", same_bits(q, before));
        check(what + ", skipped: the copy kept", same_bits(copy, copy_before));
      }
    }
  }
}

}  // namespace compute_copy
