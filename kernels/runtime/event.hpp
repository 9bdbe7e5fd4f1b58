// Event: a point in one device's queue of work, for ordering across streams and for timing.
//
//   ready.record(ctx_a);   // after the work queued so far on a's stream
//   ready.wait(ctx_b);     // work queued on b from here on runs after that point
//
// On a GPU that is cudaEventRecord / cudaStreamWaitEvent: the host does not wait. CPU kernels
// have finished when they return, so on a CPU device record() only notes the host time and
// wait() has nothing to do. Handing a recorded event to another thread needs the usual
// happens-before (a mutex or an atomic), as for any other data.
//
// Inside a graph's capture an event is recorded with record_in_graph alone: each replay then
// records it (CUDA: an external event record node), so work queued outside the graph, after the
// replay was launched, can wait for part of it.
//
//   ready.record_in_graph(ctx);      // eagerly once (the warm-up step), then in the capture
//   graph.replay();  ready.wait(other);   // other waits for that point of this replay
#pragma once

#include <chrono>
#include <memory>

#include "kernels/runtime/device.hpp"

namespace kernels {

class DeviceContext;

class Event {
 public:
  using Clock = std::chrono::steady_clock;
  // Whether the event can time (elapsed_ms). An event used only for ordering skips the GPU
  // timestamp (cudaEventDisableTiming), which makes recording and waiting cheaper.
  enum class Timing { on, off };
  Event() = default;
  explicit Event(Timing timing) : timing_(timing) {}
  ~Event();  // never throws
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // ensures the event marks the end of the work queued so far on ctx (re-recording moves it).
  void record(DeviceContext& ctx);
  // As record, also while a graph captures on ctx (kernels/runtime/graph.hpp): then each
  // replay of that graph records the event where the capture reached (a CUDA graph's external
  // event record node; a CPU recording's op), and the host time is the replay's. requires, when
  // capturing, that the event was recorded eagerly before (the step's uncaptured run), and that
  // it lives as long as the graph may replay (moved is fine; not destroyed, nor recorded on
  // another GPU): on a CPU device a replay whose event is gone throws, so that CI sees what a GPU
  // would do silently (record a destroyed event). A wait for such a record must be queued after
  // the replay was launched: it waits for the last record launched before it.
  void record_in_graph(DeviceContext& ctx);
  // requires record() was called. ensures work queued on ctx after this call starts once the
  // recorded point is reached (no host wait).
  void wait(DeviceContext& ctx) const;
  // requires record() was called. Blocks the host until the recorded point is reached.
  void synchronize() const;
  bool recorded() const { return recorded_; }
  Device device() const { return device_; }
  // Host time of the last record() call.
  Clock::time_point host_time() const { return in_graph_ ? in_graph_->host : host_; }

  // Milliseconds from a to b. requires both recorded on the same device with Timing::on, and
  // (CUDA) both reached. CPU devices: the host times of the two record() calls.
  static double elapsed_ms(const Event& a, const Event& b);

 private:
  void release() noexcept;

  Device device_;
  Timing timing_ = Timing::on;
  void* event_ = nullptr;  // cudaEvent_t on CUDA devices, made on first record()
  int gpu_ = -1;           // the physical GPU the CUDA event belongs to
  bool recorded_ = false;
  Clock::time_point host_{};  // the host time while no graph records the event
  // Once a graph records this event (record_in_graph): what its recording checks and writes, the
  // host time of the last record, replayed or not (host_ is then unused). Released with the
  // event, so that a replay finds it gone.
  struct InGraph {
    Clock::time_point host{};
  };
  std::shared_ptr<InGraph> in_graph_;
  // Where the host time of the last record lives: one place at a time.
  Clock::time_point& host_slot() { return in_graph_ ? in_graph_->host : host_; }
};

}  // namespace kernels
