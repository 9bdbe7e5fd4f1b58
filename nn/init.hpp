// Seeded initialisation, public face. The init specs (kaiming_uniform/normal, xavier_uniform/
// normal, torch_default, InitSpec::constant/uniform/normal) and init_values() live in
// nn/module.hpp, next to the Parameter they describe; Module::materialize(device, seed) and
// Module::reinitialize(seed) apply them. This header adds helpers to read and write parameter
// values from the host (tests, custom initialisation, loading foreign weights).
#pragma once

#include <string>
#include <vector>

#include "nn/module.hpp"

namespace nn {

// Gain of a nonlinearity for the init formulas, as torch.nn.init.calculate_gain.
// requires name in {"linear", "conv2d", "sigmoid", "tanh", "relu", "leaky_relu"}.
inline float calculate_gain(const std::string& name, float leaky_slope = 0.01f) {
  if (name == "linear" || name == "conv2d" || name == "sigmoid") return 1.f;
  if (name == "tanh") return 5.f / 3.f;
  if (name == "relu") return std::sqrt(2.f);
  if (name == "leaky_relu") return std::sqrt(2.f / (1.f + leaky_slope * leaky_slope));
  DP_THROW("calculate_gain: unknown nonlinearity '" << name << "'");
}

// The parameter or buffer named `name` ("0.weight", "1.running_mean") of a materialised tree.
inline Parameter& find_parameter(Module& m, const std::string& name) {
  for (auto& [n, p] : m.named_parameters())
    if (n == name) return *p;
  DP_THROW(m.type_name() << " has no parameter '" << name << "'");
}
inline Buffer& find_buffer(Module& m, const std::string& name) {
  for (auto& [n, b] : m.named_buffers())
    if (n == name) return *b;
  DP_THROW(m.type_name() << " has no buffer '" << name << "'");
}

// requires values.size() == numel of the parameter. ensures the parameter holds `values`
// (row-major), copied from the host and waited for.
inline void set_values(Tensor& view, const std::vector<float>& values) {
  DP_CHECK(static_cast<int64_t>(values.size()) == view.numel(),
           "set_values: " << values.size() << " values for a tensor of shape "
                          << kernels::shape_str(view.shape()));
  Tensor host = Tensor::from_vector(values, view.shape());
  kernels::copy(view, host);
  kernels::context(view.device()).synchronize();  // `host` dies at return
}
inline void set_values(Parameter& p, const std::vector<float>& values) {
  set_values(p.value, values);
}

// Re-draws one parameter from `spec` under `key` (e.g. a custom init after materialize()).
inline void init_parameter(Parameter& p, const InitSpec& spec, uint64_t key) {
  set_values(p.value, init_values(spec, p.numel(), key));
}

}  // namespace nn
