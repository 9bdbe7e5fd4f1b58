// kernels::Graph: a piece of one context's work, captured once and replayed: a CUDA graph on a
// CUDA device, and the same interface on a CPU device, where the op layer records each op with
// its arguments copied and a replay runs the recording. What a replay does is therefore what the
// capture saw: the same kernels, the same tensors (the same memory) and the same scalar
// arguments. A value that changes from one step to the next must live in device memory, written
// outside the graph, for a replay to see it; on CPU devices a value baked in by mistake replays
// stale exactly as it would on the GPU, so CI catches what is not capturable.
//
//     kernels::Graph g;
//     body();                      // once eagerly: the context's BlockCache learns the sizes
//     g.capture(ctx, body);        // recorded, not run
//     g.replay();                  // each step: the captured work, queued on ctx
//
// While a graph captures, what a CUDA capture refuses throws on every backend, with the same
// words, so that CI (CPU devices) fails where a GPU would: a host read or wait on its context (a
// copy to the host, an op that returns a value, synchronize(), Event::synchronize, Tensor::to
// or from_vector to or from the capturing device, and on a CPU device any host access to one
// of its tensors, Tensor::raw), a copy out of it queued on another device (it would run once,
// outside the graph), recording or waiting on an event, replaying a graph into it, pinned host
// memory, and an allocation the context's BlockCache cannot serve (a miss). The message names
// the innermost NVTX range (the nn layer). The work is then not capturable; after a miss alone
// (a CaptureMemoryError) it may be once run uncaptured, whose freed blocks stay cached (the
// engines try again so: dp/graphs.hpp's kCaptureMemoryRetries).
//
// Host values the captured ops were handed (a float scale, a layer's member) are baked in: a
// replay uses them, not later ones. The engines put each step's values in device memory
// (kernels::Scalar) and capture again after Module::host_values_changed(). A graph observed the
// step before its capture (observe) refuses a capture whose ops were handed other host values
// than that step's ops, on every backend: a layer's value that changes each step is named
// before any replay (one that changes only now and then is not seen). Dropout draws at
// the counters nn::FlatState names: a graph of your own that holds dropout calls
// FlatState::begin_rng_step() before each replay and advances rng_offset by what the captured
// body drew (dp/graphs.hpp's run_drawing_segment does both), or every replay draws one mask.
//
// The graph holds the memory its work addresses until it is destroyed, so nothing outside it is
// handed memory a replay writes, and it holds no more than that, so a capture needs no more
// memory than the eager step:
//   - tensors made before the capture (inputs, parameters, metrics, workspaces) that an op uses
//     are held by the graph (a CPU recording copies them; a CUDA capture records them beside the
//     launch), also when their owner lets them go (a layer's buffer replaced for another shape
//     while this shape's graph lives on);
//   - blocks taken while capturing belong to the graph's reservation (the context's BlockCache);
//     the recording only views them (DeviceContext::graph_arg), so a temporary freed inside the
//     capture frees its block for the capture's later temporaries, exactly as eagerly, and a
//     replay reuses it in the same order;
//   - a graph captured `after` another, which it always follows (capture's third argument),
//     shares that one's reservation: its temporaries take the blocks the first one's freed, as
//     the eager step's second half takes the first half's.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kernels/runtime/context.hpp"

namespace kernels {

class BlockReservation;

class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(Graph&& other) noexcept;
  Graph& operator=(Graph&& other) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // requires ctx is the calling thread's context for its device, nothing is capturing on it,
  // and `body` queues work only on ctx, reads nothing back and, on a CUDA device, takes no new
  // memory (run it once first). ensures the work `body` queued is captured (not run) and
  // replaces what this graph held. Throws, leaving the graph empty and ctx usable, when `body`
  // throws or the work is not capturable.
  // `after` (when given): a graph captured on ctx that every replay of this one follows, with
  // nothing between them that reads memory `after` freed inside its capture (an engine's step:
  // forward and backward, then the update). Their work shares one pool, as the eager step's
  // does: a temporary of this graph may take a block a temporary of `after` freed (PyTorch's
  // graphs sharing a memory pool, replayed in the order they were captured). Both graphs hold
  // the pool's blocks until both are destroyed.
  void capture(DeviceContext& ctx, const std::function<void()>& body, const Graph* after = nullptr);
  // requires ctx as capture's, nothing capturing or observing on it. ensures body ran eagerly
  // (as without a graph), each op's host arguments noted (DeviceContext::OpNote: the values, the
  // tensors' dtypes, shapes and offsets), and this graph's next capture compares its ops with
  // those: where one differs (a host value that changed between the two steps, which a replay
  // would keep), the capture throws, naming the op, the argument and both values, and the
  // layer's range. An engine observes the step before each capture (dp/graphs.hpp). Replaces an
  // earlier observation; reset() drops it. (A value that changes only now and then is not seen.)
  // Code that queues other work while a graph captures (DeviceContext::capturing) queues it while
  // one observes too (DeviceContext::noting), or the capture fails.
  void observe(DeviceContext& ctx, const std::function<void()>& body);
  // requires captured(). ensures the captured work is queued on the context (CPU: runs now).
  void replay();
  bool captured() const { return ctx_ != nullptr; }
  // The context it was captured on (null: none).
  DeviceContext* captured_on() const { return ctx_; }
  // Ops recorded (CPU) or kernel and copy nodes (CUDA).
  int64_t nodes() const { return nodes_; }
  // Dtype conversions in the captured work (DeviceContext::casts): each replay adds them to the
  // context's count, as the eager work would.
  int64_t casts() const { return casts_; }
  void reset();

 private:
  // The CUDA half of capture (defined only where the CUDA backend is built).
  void capture_cuda(DeviceContext& ctx, const std::function<void()>& body);

  DeviceContext* ctx_ = nullptr;
  std::vector<std::function<void()>> ops_;  // CPU: the ops; CUDA: what holds their arguments
  void* exec_ = nullptr;                    // CUDA: cudaGraphExec_t
  int64_t nodes_ = 0;
  int64_t casts_ = 0;
  // The device-side fault check the captured work arms (CUDA): armed again by each replay.
  DeviceContext::FaultText fault_text_ = nullptr;
  // The context's count of live graphs (it keeps retired workspaces while any exists).
  std::shared_ptr<std::atomic<int>> live_;
  std::shared_ptr<BlockReservation> reservation_;
  // observe's notes, for the next capture.
  std::shared_ptr<std::vector<DeviceContext::OpNote>> observed_;
};

}  // namespace kernels
