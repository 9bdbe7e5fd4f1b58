// What DP's (dp/data_parallel.hpp) and DDP's (dp/distributed/ddp_trainer.hpp) steps count and
// read alike, written once: the runtime counts of a step over the engine's contexts, and with
// metrics_lag 1 the two slots through which each step's metrics reach the host one step late.
//
//   StepCounter counter;  counter.begin(each);  ... the step ...  StepCounts n = counter.end(each);
//   lagged.of(step).queue_read(metrics, ctx);
//   ... next step ...  const float* m = lagged.previous(step + 1).take(&ctx);
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/runtime/context.hpp"
#include "kernels/runtime/event.hpp"
#include "kernels/runtime/memory.hpp"
#include "kernels/runtime/tensor.hpp"

namespace dp {

// A step's runtime counts: allocations, host syncs and casts summed over the engine's contexts,
// and the most memory one device had in use (the sum of its contexts' window peaks).
struct StepCounts {
  int64_t allocations = 0, host_syncs = 0, casts = 0, peak_bytes = 0;
};

// Counts one step. each(f) calls f(device, context) for every context of the engine, a device's
// contexts one after another (device 0's, then device 1's, ...), the same contexts each call.
class StepCounter {
 public:
  // ensures the counts so far are kept and every context starts a memory window.
  template <class Each>
  void begin(Each each) {
    before_ = totals(each);
    each([](int, kernels::DeviceContext& c) { c.memory()->begin_window(); });
  }
  // requires begin(each) called. ensures the counts since then.
  template <class Each>
  StepCounts end(Each each) const {
    StepCounts n = totals(each);
    n.allocations -= before_.allocations;
    n.host_syncs -= before_.host_syncs;
    n.casts -= before_.casts;
    int device = -1;
    int64_t on_device = 0;
    each([&](int d, kernels::DeviceContext& c) {
      if (d != device) {
        device = d;
        on_device = 0;
      }
      on_device += c.memory()->window_peak.load();
      n.peak_bytes = std::max(n.peak_bytes, on_device);
    });
    return n;
  }

 private:
  template <class Each>
  static StepCounts totals(Each each) {
    StepCounts n;
    each([&](int, kernels::DeviceContext& c) {
      n.allocations += c.memory()->allocations.load();
      n.host_syncs += c.host_syncs();
      n.casts += c.casts();
    });
    return n;
  }
  StepCounts before_;
};

// metrics_lag 1: a step's metrics reach the host one step late, through two slots taken by the
// step's parity: while step k's copy is on its way, step k - 1's is read. Extra: what else an
// engine keeps with a step's metrics (DP: its devices' shares; DDP: its metrics' device copy and
// their all-reduce).
template <class Extra>
class LaggedSlots {
 public:
  struct Slot {
    kernels::Tensor host;                               // pinned, made by the engine once
    kernels::Event ready{kernels::Event::Timing::off};  // recorded after its read was queued
    bool pending = false;                               // holds a step's metrics not returned
    Extra extra;

    // requires host holds at least from.numel() f32 values. ensures queued on ctx: the copy of
    // `from` into the first of them, then ready; the slot is pending.
    void queue_read(const kernels::Tensor& from, kernels::DeviceContext& ctx) {
      kernels::Tensor to = host.view(0, {from.numel()});
      kernels::queue_read_back(to, from);
      ready.record(ctx);
      pending = true;
    }
    // requires pending. ensures the read is complete: waited for here with `wait_on` (the host
    // sync counted on it), or with null when the host already waited for a later point on the
    // read's stream. The slot is no longer pending; returns its host values.
    const float* take(kernels::DeviceContext* wait_on) {
      if (wait_on) {
        ready.synchronize();
        wait_on->note_host_sync();
      }
      pending = false;
      return host.template data<float>();
    }
  };
  // step: the steps the engine ran before this one. The slot this step writes, and the one the
  // step before it wrote.
  Slot& of(int64_t step) { return slots_[step % 2]; }
  Slot& previous(int64_t step) { return slots_[(step + 1) % 2]; }
  Slot* begin() { return slots_; }
  Slot* end() { return slots_ + 2; }

 private:
  Slot slots_[2];
};

}  // namespace dp
