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

#include <algorithm>
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
// short one); past this, a new shape's set replaces the one used longest ago.
constexpr size_t kMaxGraphShapes = 8;

// What a step's graphs bake in: the model's host values (values[0]: nn::FlatState's
// host_values_version, see Module::host_values_changed) and sizes and dtypes.
struct GraphKey {
  std::vector<int64_t> values;

  // Starts the key: the host values' version of the model (the sum of the replicas' under DP).
  void begin(uint64_t host_values_version) {
    values.assign(1, static_cast<int64_t>(host_values_version));  // the storage is reused
  }

  // The dtype and every dimension but the first (the rows, keyed on their own).
  void add_row_shape(const kernels::Tensor& t) {
    values.push_back(static_cast<int64_t>(t.dtype()));
    values.insert(values.end(), t.shape().begin() + 1, t.shape().end());
  }
  bool operator<(const GraphKey& o) const { return values < o.values; }
};

// Captures an engine's device or rank tries again after one that lacked memory (a layer that
// asks, at the capture, for a size no earlier step did). The uncaptured run of the failed
// segment leaves a block of that size cached, so its capture at the next step of the shape finds
// it; a segment that asks for new memory every time stops after these tries. (A step's second
// segment shares the first one's pool: run_graph_segment's `after`.)
constexpr int kCaptureMemoryRetries = 3;

// An engine's device's or rank's captures: where the step's failed, and why (the first
// failure's text, empty while none has), and the tries it has left. An engine that sees a
// reason turns graphs off for itself (one "graphs off: capture failed" line, the reports'
// graphs_fallback) and goes on uncaptured, unless the capture only lacked memory (see
// take_capture_failure).
struct CaptureFailure {
  std::string reason;
  // The capture took memory the cache did not hold (kernels::CaptureMemoryError).
  bool memory = false;
  // Failures that only lacked memory this device or rank may still retry, for the run.
  int retries = kCaptureMemoryRetries;
  // Forgets the step's failure (its tries stay spent).
  void clear() {
    reason.clear();
    memory = false;
  }
};

// What take_capture_failure made of a step's failure.
enum class CaptureVerdict {
  none,   // no capture failed
  again,  // one lacked memory: the step ran it uncaptured, the shape's next step captures again
  off,    // graphs are off for good
};

// After a step: when `failed` holds a reason, the engine's graphs go off for good: `fallback`
// (empty until then) becomes "capture failed on WHERE: reason", `engine` prints it in one line
// ("dp: graphs off: capture failed on cpu:0: ..."), and `failed` is cleared. Later failures of
// the same step leave the first reason. A failure that only lacked memory, while the device
// or rank has failed.retries left, takes one of them instead and leaves the graphs on (again).
inline CaptureVerdict take_capture_failure(CaptureFailure& failed, const std::string& where,
                                           const char* engine, std::string& fallback) {
  if (failed.reason.empty()) return CaptureVerdict::none;
  if (failed.memory && failed.retries > 0 && fallback.empty()) {
    --failed.retries;
    failed.clear();
    return CaptureVerdict::again;
  }
  if (fallback.empty()) {
    // The reason without the error's source location (" [at context.cpp:287]"): a line for
    // users, the same on every backend.
    std::string reason = failed.reason;
    const size_t at = reason.rfind(" [");
    if (at != std::string::npos && reason.back() == ']' &&
        (reason.compare(at, 5, " [at ") == 0 || reason.compare(at, 9, " [check `") == 0))
      reason.erase(at);
    fallback = "capture failed on " + where + ": " + reason;
    if (failed.memory)
      fallback += " (and " + std::to_string(kCaptureMemoryRetries) +
                  " more captures, each after an uncaptured run: it asks for new memory)";
    std::fprintf(stderr, "%s: graphs off: %s\n", engine, fallback.c_str());
  }
  failed.clear();
  return CaptureVerdict::off;
}

// requires `runs` = how often this segment ran before for this shape; body queues only work on
// ctx that reads nothing back. ensures body's work is queued on ctx: run eagerly for the first
// kGraphWarmupRuns runs, captured on the next and replayed from then on (also that time).
// The eager run before a capture is observed (kernels::Graph::observe), so a capture whose ops
// were handed other host values (a layer's value that changes each step, which the replays
// would keep) fails, naming the op and the value.
// A capture that fails (the work is not capturable: kernels::Error) captures nothing and ran
// nothing: with `failed`, its text goes there (the first one kept), `undo` puts back what the
// body's host code changed, and the body runs eagerly instead, so the step is the uncaptured
// one; without `failed` the error is thrown. `after`: the step's segment g always follows, whose
// memory pool g's capture shares (kernels::Graph::capture). Returns whether body ran (its host
// side too: eagerly, or for the capture).
inline bool run_graph_segment(kernels::DeviceContext& ctx, kernels::Graph& g, int runs,
                              const std::function<void()>& body, CaptureFailure* failed = nullptr,
                              const std::function<void()>& undo = nullptr,
                              const kernels::Graph* after = nullptr) {
  if (runs < kGraphWarmupRuns) {
    if (runs == kGraphWarmupRuns - 1)
      g.observe(ctx, body);
    else
      body();
    return true;
  }
  const bool capture = !g.captured();
  if (capture) {
    try {
      g.capture(ctx, body, after);
    } catch (const kernels::Error& e) {
      if (!failed) throw;
      if (failed->reason.empty()) {
        failed->reason = e.what();
        failed->memory = dynamic_cast<const kernels::CaptureMemoryError*>(&e) != nullptr;
      }
      if (undo) undo();
      g.observe(ctx, body);  // what the next capture (after one that lacked memory) compares with
      return true;
    }
  }
  g.replay();
  return capture;
}

// run_graph_segment for a segment that may draw random numbers (dropout) from `flat`, the
// replica's stream: its draws are placed on the device (nn::FlatState::begin_rng_step), so a
// replay draws this step's masks; a replay runs no host code, so the host offset is advanced by
// what the segment drew when it last ran (`drawn`, the segment's own: the same every run),
// before the replay, so that a replay that throws (a CPU device's bad label) has taken its
// draws as the eager step that throws has. A failed capture's draws are undone before the body
// runs eagerly. Returns whether body ran (as run_graph_segment).
inline bool run_drawing_segment(kernels::DeviceContext& ctx, kernels::Graph& g, int runs,
                                nn::FlatState& flat, uint64_t& drawn,
                                const std::function<void()>& body,
                                CaptureFailure* failed = nullptr) {
  flat.begin_rng_step();
  const uint64_t before = flat.rng_offset;
  if (runs >= kGraphWarmupRuns && g.captured()) {  // a replay alone: no host code runs
    flat.rng_offset += drawn;
    return run_graph_segment(ctx, g, runs, body, failed);
  }
  const bool ran = run_graph_segment(ctx, g, runs, body, failed, [&] { flat.rng_offset = before; });
  drawn = flat.rng_offset - before;
  return ran;
}

// The segments of one step shape, by key (a Set has `uint64_t last_use`). Sets of another host
// values' version (the key's first value) are dropped: their graphs replay values that changed.
// Past kMaxGraphShapes shapes, the set used longest ago makes room, and `engine` (when given)
// says so once (`said`): steps of more shapes than that in turn never replay.
template <typename Set>
Set& graph_set_for(std::map<GraphKey, Set>& sets, const GraphKey& key, const char* engine = nullptr,
                   bool* said = nullptr) {
  uint64_t newest = 0;
  for (auto it = sets.begin(); it != sets.end();) {
    if (it->first.values.at(0) != key.values.at(0)) {
      it = sets.erase(it);
      continue;
    }
    newest = std::max(newest, it->second.last_use);
    ++it;
  }
  auto it = sets.find(key);
  if (it == sets.end()) {
    if (sets.size() >= kMaxGraphShapes) {
      if (engine && said && !*said) {
        std::fprintf(stderr,
                     "%s: graphs: more than %zu step shapes: the one used longest ago gives its "
                     "graphs up (a shape runs %d steps uncaptured before its capture: more than "
                     "%zu shapes in turn never replay)\n",
                     engine, kMaxGraphShapes, kGraphWarmupRuns, kMaxGraphShapes);
        *said = true;
      }
      auto oldest = sets.begin();
      for (auto o = sets.begin(); o != sets.end(); ++o)
        if (o->second.last_use < oldest->second.last_use) oldest = o;
      sets.erase(oldest);
    }
    it = sets.emplace(key, Set{}).first;
  }
  it->second.last_use = newest + 1;
  return it->second;
}

}  // namespace dp
