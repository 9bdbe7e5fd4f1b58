// Graphed steps, as DP (dp/data_parallel.hpp) and DDP (dp/distributed/ddp_trainer.hpp) run them:
// the step's device work in a few captured segments (kernels/runtime/graph.hpp), selected by the
// step's shape, with what a replay cannot do (host copies, collectives, the metrics read) between
// them. The step's host scalars (the loss scale, the shares, the optimizer's) are written to
// device memory before the segments, whose kernels read them there (kernels::Scalar): they are
// not part of the key, and a replay uses the current step's.
//
//   GraphKey key;  key.add_row_shape(x);               // what the graphs bake in
//   StepSegments& s = graph_set_for(sets, key);        // a shape's segments (dp/step_stages.hpp)
//   run_graph_segment(ctx, s.compute, s.runs, body);   // uncaptured, captured, replayed
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernels/runtime/graph.hpp"
#include "nn/module.hpp"

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

// Whether an engine's step runs graphed: `mode` asks for it on `device`, no capture failed
// (`fallback` empty: see take_capture_failure) and nothing blocks it (`blocked`: why not, empty
// when nothing does). When blocked, says so ("ENGINE: graphs off: BLOCKED") unless `said` (set
// then: once per engine; a job's other ranks start with it set, so that one rank says it).
inline bool graphs_wanted(Graphs mode, const kernels::Device& device, const std::string& fallback,
                          const std::string& blocked, const char* engine, bool& said) {
  if (!graphs_requested(mode, device) || !fallback.empty()) return false;
  if (blocked.empty()) return true;
  if (!said) std::fprintf(stderr, "%s: graphs off: %s\n", engine, blocked.c_str());
  said = true;
  return false;
}

// A shape's steps that run uncaptured before its capture: two, because layers hold the last
// step's activations until their next forward replaces them, so the caches learn the sizes of
// both generations.
constexpr int kGraphWarmupRuns = 2;
// Step shapes whose graphs an engine keeps (a run has one or two: the full batch and the last
// short one); past this, shapes keep changing and the sets start over.
constexpr size_t kMaxGraphShapes = 8;

// What a step's graphs bake in: sizes and dtypes.
struct GraphKey {
  std::vector<int64_t> values;

  // The dtype and every dimension but the first (the rows, keyed on their own).
  void add_row_shape(const kernels::Tensor& t) {
    values.push_back(static_cast<int64_t>(t.dtype()));
    values.insert(values.end(), t.shape().begin() + 1, t.shape().end());
  }
  bool operator<(const GraphKey& o) const { return values < o.values; }
};

// Where a segment's capture failed, and why: the first failure's text, empty while none has.
// An engine that sees it set turns graphs off for itself (one "graphs off: capture failed"
// line, the reports' graphs_fallback) and goes on uncaptured.
struct CaptureFailure {
  std::string reason;
};

// After a step: when `failed` holds a reason, the engine's graphs go off for good: `fallback`
// (empty until then) becomes "capture failed on WHERE: reason", `engine` prints it in one line
// ("dp: graphs off: capture failed on cpu:0: ..."), and `failed` is cleared. Later failures of
// the same step leave the first reason. Returns whether `failed` held one.
inline bool take_capture_failure(CaptureFailure& failed, const std::string& where,
                                 const char* engine, std::string& fallback) {
  if (failed.reason.empty()) return false;
  if (fallback.empty()) {
    fallback = "capture failed on " + where + ": " + failed.reason;
    std::fprintf(stderr, "%s: graphs off: %s\n", engine, fallback.c_str());
  }
  failed.reason.clear();
  return true;
}

// requires `runs` = how often this segment ran before for this shape; body queues only work on
// ctx that reads nothing back. ensures body's work is queued on ctx: run eagerly for the first
// kGraphWarmupRuns runs, captured on the next and replayed from then on (also that time).
// A capture that fails (the work is not capturable: kernels::Error) captures nothing and ran
// nothing: with `failed`, its text goes there (the first one kept), `undo` puts back what the
// body's host code changed, and the body runs eagerly instead, so the step is the uncaptured
// one; without `failed` the error is thrown. Returns whether body ran (its host side too:
// eagerly, or for the capture).
inline bool run_graph_segment(kernels::DeviceContext& ctx, kernels::Graph& g, int runs,
                              const std::function<void()>& body, CaptureFailure* failed = nullptr,
                              const std::function<void()>& undo = nullptr) {
  if (runs < kGraphWarmupRuns) {
    body();
    return true;
  }
  const bool capture = !g.captured();
  if (capture) {
    try {
      g.capture(ctx, body);
    } catch (const kernels::Error& e) {
      if (!failed) throw;
      if (failed->reason.empty()) failed->reason = e.what();
      if (undo) undo();
      body();
      return true;
    }
  }
  g.replay();
  return capture;
}

// run_graph_segment for a segment that may draw random numbers (dropout) from `flat`, the
// replica's stream: its draws are placed on the device (nn::FlatState::begin_rng_step), so a
// replay draws this step's masks; a replay runs no host code, so the host offset is advanced by
// what the segment drew when it last ran (`drawn`, the segment's own: the same every run).
// A failed capture's draws are undone before the body runs eagerly. Returns whether body ran
// (as run_graph_segment).
inline bool run_drawing_segment(kernels::DeviceContext& ctx, kernels::Graph& g, int runs,
                                nn::FlatState& flat, uint64_t& drawn,
                                const std::function<void()>& body,
                                CaptureFailure* failed = nullptr) {
  flat.begin_rng_step();
  const uint64_t before = flat.rng_offset;
  const bool ran = run_graph_segment(ctx, g, runs, body, failed, [&] { flat.rng_offset = before; });
  if (ran)
    drawn = flat.rng_offset - before;
  else
    flat.rng_offset += drawn;
  return ran;
}

// The segments of one step shape, by key, dropped all at once when shapes keep changing.
template <typename Set>
Set& graph_set_for(std::map<GraphKey, Set>& sets, const GraphKey& key) {
  if (sets.size() >= kMaxGraphShapes && !sets.count(key)) sets.clear();
  return sets[key];
}

}  // namespace dp
