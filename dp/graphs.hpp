// Graphed steps, as DP (dp/data_parallel.hpp) and DDP (dp/distributed/ddp_trainer.hpp) run them:
// the step's device work in a few captured segments (kernels/runtime/graph.hpp), selected by the
// step's shape, with what a replay cannot do (host copies, collectives, host scalars, the metrics
// read) between them.
//
//   GraphKey key;  key.add_shape(x);  key.add_bits(loss_scale);    // what the graphs bake in
//   StepGraphs& s = sets.at(key);                                  // a shape's segments
//   run_graph_segment(ctx, s.compute, s.runs, body);               // uncaptured, captured,
//   replayed
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <vector>

#include "kernels/runtime/graph.hpp"

namespace dp {

// Whether steps replay captured graphs: automatic is on for CUDA devices where the step is
// capturable and off for CPU devices (where the same interface runs the work: `on` there proves
// every path of the graphed step in CI).
enum class Graphs { automatic, on, off };

// requires nothing. ensures whether `mode` asks for graphs on `device` (before what may block
// them).
inline bool graphs_requested(Graphs mode, const kernels::Device& device) {
  return mode == Graphs::on || (mode == Graphs::automatic && !device.is_cpu());
}

// A shape's steps that run uncaptured before its capture: two, because layers hold the last
// step's activations until their next forward replaces them, so the caches learn the sizes of
// both generations.
constexpr int kGraphWarmupRuns = 2;
// Step shapes whose graphs an engine keeps (a run has one or two: the full batch and the last
// short one); past this, shapes keep changing and the sets start over.
constexpr size_t kMaxGraphShapes = 8;

// What a step's graphs bake in: sizes, dtypes and the bits of host scalars.
struct GraphKey {
  std::vector<int64_t> values;

  void add(int64_t v) { values.push_back(v); }
  void add_bits(float v) {
    uint32_t bits = 0;
    std::memcpy(&bits, &v, sizeof bits);
    values.push_back(bits);
  }
  // The dtype and every dimension but the first (the rows, keyed on their own).
  void add_row_shape(const kernels::Tensor& t) {
    values.push_back(static_cast<int64_t>(t.dtype()));
    values.insert(values.end(), t.shape().begin() + 1, t.shape().end());
  }
  bool operator<(const GraphKey& o) const { return values < o.values; }
};

// requires `runs` = how often this segment ran before for this shape; body queues only work on
// ctx that reads nothing back. ensures body's work is queued on ctx: run eagerly for the first
// kGraphWarmupRuns runs, captured on the next and replayed from then on (also that time).
inline void run_graph_segment(kernels::DeviceContext& ctx, kernels::Graph& g, int runs,
                              const std::function<void()>& body) {
  if (runs < kGraphWarmupRuns) return body();
  if (!g.captured()) g.capture(ctx, body);
  g.replay();
}

// The segments of one step shape, by key, dropped all at once when shapes keep changing.
template <typename Set>
Set& graph_set_for(std::map<GraphKey, Set>& sets, const GraphKey& key) {
  if (sets.size() >= kMaxGraphShapes && !sets.count(key)) sets.clear();
  return sets[key];
}

}  // namespace dp
