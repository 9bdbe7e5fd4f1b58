// nn::LayerProfiler: where a model's step goes, layer by layer, on any device.
//
//   nn::LayerProfiler prof(model);        // from here on each forward and backward is timed
//   for (...) { model.forward(x); ...; model.backward(dy); }
//   std::printf("%s", prof.table().c_str());
//
// Each module's forward and backward in training mode (evaluation is not counted) wait for the
// device before and after and add their wall time (inclusive of their children) to a table; a
// layer's own ("self") time is its time less its children's. The waits make a GPU layer's time its
// kernels' and cost a little on every layer, so figures are for finding where time goes, not for
// the step's speed; graphs must be off (a replayed step calls no forward). One profiler per module
// tree (a DP replica, a DDP rank's model), used on the thread that runs it. Ends when the profiler
// is destroyed.
#pragma once

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "nn/module.hpp"

namespace nn {

class LayerProfiler {
 public:
  struct Row {
    std::string path;  // "layers.0.attn" ("" for the root)
    std::string type;
    int64_t forwards = 0, backwards = 0;
    double forward_ms = 0, backward_ms = 0;            // inclusive, summed over the calls
    double self_forward_ms = 0, self_backward_ms = 0;  // less the children's
  };

  explicit LayerProfiler(Module& root)
      : root_(root), times_(std::make_shared<std::unordered_map<const void*, LayerTime>>()) {
    DP_CHECK(!root.flat().layer_times,
             "LayerProfiler: " << root.type_name() << " is already being profiled");
    root.flat().layer_times = times_;
  }
  ~LayerProfiler() {
    if (root_.materialized() && root_.flat().layer_times == times_)
      root_.flat().layer_times.reset();
  }
  LayerProfiler(const LayerProfiler&) = delete;
  LayerProfiler& operator=(const LayerProfiler&) = delete;

  // Every module of the tree, depth first in registration order.
  std::vector<Row> rows() const {
    std::vector<Row> out;
    // Appends m's row and its subtree's; m's own time is its time less its children's. A
    // container whose forward (or backward) its parent bypassed, calling the children itself
    // without Module::forward_by_parts, takes its children's time as its own inclusive time,
    // with none of its own: so the parent's own time is still only what the parent did.
    std::function<void(Module&, const std::string&)> walk = [&](Module& m,
                                                                const std::string& path) {
      const size_t at = out.size();
      out.push_back(row_of(m, path));
      double children_fwd = 0, children_bwd = 0;
      for (auto& [name, child] : m.children()) {
        const size_t c = out.size();
        walk(*child, path.empty() ? name : path + "." + name);
        children_fwd += out[c].forward_ms;
        children_bwd += out[c].backward_ms;
      }
      Row& r = out[at];
      if (r.forwards == 0) r.forward_ms = r.self_forward_ms = children_fwd;
      if (r.backwards == 0) r.backward_ms = r.self_backward_ms = children_bwd;
      r.self_forward_ms -= children_fwd;
      r.self_backward_ms -= children_bwd;
    };
    walk(root_, "");
    return out;
  }

  // The `top` layers by own time per step (forward + backward), with their share of the step
  // (the root's forward + backward), as a fixed-width table; then every layer type's share.
  std::string table(size_t top = 15) const {
    std::vector<Row> rs = rows();
    if (rs.empty() || rs[0].forwards == 0) return "layer profile: no forward was timed\n";
    const double steps = static_cast<double>(rs[0].forwards);
    const double step_ms = (rs[0].forward_ms + rs[0].backward_ms) / steps;
    std::stable_sort(rs.begin(), rs.end(), [](const Row& a, const Row& b) {
      return a.self_forward_ms + a.self_backward_ms > b.self_forward_ms + b.self_backward_ms;
    });
    std::string out;
    char line[256];
    std::snprintf(line, sizeof line,
                  "layer profile: %.3f ms per step (forward + backward, %lld steps; each layer's "
                  "own time, less its children's)\n",
                  step_ms, static_cast<long long>(rs[0].forwards));
    out += line;
    std::snprintf(line, sizeof line, "  %-32s %-22s %10s %10s %7s\n", "layer", "type", "fwd ms",
                  "bwd ms", "share");
    out += line;
    for (size_t i = 0; i < rs.size() && i < top; ++i) {
      const Row& r = rs[i];
      const double own = (r.self_forward_ms + r.self_backward_ms) / steps;
      std::snprintf(line, sizeof line, "  %-32s %-22s %10.3f %10.3f %6.1f%%\n",
                    r.path.empty() ? "(model)" : r.path.c_str(), r.type.c_str(),
                    r.self_forward_ms / steps, r.self_backward_ms / steps,
                    step_ms > 0 ? 100.0 * own / step_ms : 0.0);
      out += line;
    }
    // The same own times summed by layer type (every row, not only the top ones).
    std::vector<std::pair<std::string, double>> by_type;
    for (const Row& r : rs) {
      auto it = std::find_if(by_type.begin(), by_type.end(),
                             [&](const auto& t) { return t.first == r.type; });
      if (it == by_type.end()) it = by_type.insert(by_type.end(), {r.type, 0.0});
      it->second += (r.self_forward_ms + r.self_backward_ms) / steps;
    }
    std::stable_sort(by_type.begin(), by_type.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
    out += "  by type:";
    for (const auto& [type, ms] : by_type) {
      std::snprintf(line, sizeof line, " %s %.1f%%;", type.c_str(),
                    step_ms > 0 ? 100.0 * ms / step_ms : 0.0);
      out += line;
    }
    out.back() = '\n';
    return out;
  }

 private:
  Row row_of(Module& m, const std::string& path) const {
    Row r;
    r.path = path;
    r.type = m.type_name();
    auto it = times_->find(&m);
    if (it != times_->end()) {
      r.forwards = it->second.forwards, r.backwards = it->second.backwards;
      r.forward_ms = r.self_forward_ms = it->second.forward_ms;
      r.backward_ms = r.self_backward_ms = it->second.backward_ms;
    }
    return r;
  }

  Module& root_;
  std::shared_ptr<std::unordered_map<const void*, LayerTime>> times_;
};

}  // namespace nn
