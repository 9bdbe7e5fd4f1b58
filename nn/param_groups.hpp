// Parameter groups for AdamW as ranges of the flat buffer: weight decay by parameter (each
// parameter says whether it decays: by default when it has 2 or more dimensions, nanoGPT's
// rule, so a custom layer's matrix decays without naming its type), or on the weights of Linear
// and Conv2d layers only; and a learning-rate scale per group. The fused step stays one pass: each
// flat element carries its group's index (one byte), and kernels::adamw_update_grouped reads the
// group's scalars (kernels::adamw_scalars, in the optimizer's step_scalars()).
//
//   nn::GroupedAdamW opt(*model, cfg, nn::decay_by_parameter(*model, cfg.weight_decay));
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "nn/conv.hpp"
#include "nn/linear.hpp"
#include "nn/optim.hpp"

namespace nn {

struct ParamGroup {
  std::string name;
  float lr_scale = 1.f;
  float weight_decay = 0.f;
};

// The groups of a model, and each parameter's group (in named_parameters() order).
struct ParamGroups {
  std::vector<ParamGroup> groups;
  std::vector<int> group_of_param;
};

// Group 0 "decay" (weight_decay): the parameters whose decays() is true (Decay: 2 or more
// dimensions unless registered otherwise: Linear and Conv2d weights, embeddings, GPT's position
// table, a custom layer's matrices); group 1 "no_decay" (0): the others (biases, norm scales and
// shifts, and what a layer registered with Decay::no). nanoGPT's configure_optimizers.
inline ParamGroups decay_by_parameter(Module& m, float weight_decay) {
  ParamGroups g;
  g.groups = {{"decay", 1.f, weight_decay}, {"no_decay", 1.f, 0.f}};
  for (auto& [name, p] : m.named_parameters()) g.group_of_param.push_back(p->decays() ? 0 : 1);
  return g;
}

// By layer type: group 0 "decay" (weight_decay): the weights of Linear and Conv2d layers; group
// 1 "no_decay" (0): everything else (biases, LayerNorm and BatchNorm, embeddings, GPT's position
// table, and any custom layer's parameters: prefer decay_by_parameter for models with custom
// layers).
inline ParamGroups decay_matrices_only(Module& m, float weight_decay) {
  ParamGroups g;
  g.groups = {{"decay", 1.f, weight_decay}, {"no_decay", 1.f, 0.f}};
  std::vector<const Parameter*> matrices;
  m.for_each_module([&](Module& mod) {
    if (auto* lin = dynamic_cast<Linear*>(&mod)) matrices.push_back(&lin->weight());
    if (auto* conv = dynamic_cast<Conv2d*>(&mod)) matrices.push_back(&conv->weight());
  });
  for (auto& [name, p] : m.named_parameters()) {
    const bool matrix = std::find(matrices.begin(), matrices.end(), p) != matrices.end();
    g.group_of_param.push_back(matrix ? 0 : 1);
  }
  return g;
}

// AdamW (kernels::adamw_update_grouped) over parameter groups; AdamWConfig::weight_decay is
// replaced by the groups' own. State, checkpoints and ZeRO-1 shards are AdamW's.
class GroupedAdamW : public AdamW {
 public:
  // requires m materialised; groups.group_of_param has one entry per parameter, each a valid
  // group index; 1 to kernels::kMaxAdamWGroups groups with lr_scale >= 0, weight_decay >= 0.
  GroupedAdamW(Module& m, kernels::AdamWConfig config, const ParamGroups& groups)
      : AdamW(m, config), groups_(groups.groups) {
    const int n = static_cast<int>(groups_.size());
    DP_CHECK(n >= 1 && n <= kernels::kMaxAdamWGroups, "GroupedAdamW: " << n << " groups; 1 to "
                                                                       << kernels::kMaxAdamWGroups
                                                                       << " are supported");
    auto params = m.named_parameters();
    DP_CHECK(groups.group_of_param.size() == params.size(),
             "GroupedAdamW: " << groups.group_of_param.size() << " group indices for "
                              << params.size() << " parameters");
    for (int k = 0; k < n; ++k) {
      DP_CHECK(std::isfinite(groups_[k].lr_scale) && std::isfinite(groups_[k].weight_decay) &&
                   groups_[k].lr_scale >= 0.f && groups_[k].weight_decay >= 0.f,
               "GroupedAdamW: group " << groups_[k].name << " has lr_scale " << groups_[k].lr_scale
                                      << ", weight_decay " << groups_[k].weight_decay
                                      << "; both must be finite and >= 0");
      groups_table_.lr_scale[k] = groups_[k].lr_scale;
      groups_table_.weight_decay[k] = groups_[k].weight_decay;
    }
    groups_table_.count = n;
    // Alignment gaps hold zeros that any group leaves at zero: they take group 0.
    Tensor host = Tensor::zeros({m.flat_params().numel()}, DType::u8, Device::cpu());
    uint8_t* h = host.data<uint8_t>();
    for (size_t i = 0; i < params.size(); ++i) {
      const int k = groups.group_of_param[i];
      DP_CHECK(k >= 0 && k < n, "GroupedAdamW: parameter " << params[i].first << " is in group "
                                                           << k << " of " << n);
      std::fill_n(h + params[i].second->offset, params[i].second->numel(), static_cast<uint8_t>(k));
    }
    group_of_ = host.to(m.device());
  }

  void apply_step() override {
    config_.skip_if = skip_if_;
    config_.compute_copy = compute_copy_to_write();
    Tensor p = params_to_update(), g = grads_to_update();
    if (p.numel() == 0) return;
    Tensor groups = group_of_.view(shard_begin(), {p.numel()});
    kernels::adamw_update_grouped(p, g, m_, v_, groups, config_, scalars_);
    copy_written(config_.compute_copy);
  }
  const std::vector<ParamGroup>& groups() const { return groups_; }

 private:
  std::vector<ParamGroup> groups_;
  Tensor group_of_;  // (P) u8, each element's group
};

}  // namespace nn
