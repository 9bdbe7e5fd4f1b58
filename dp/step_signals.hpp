// dp::StepSignals: what the workers of one DataParallel step (dp/data_parallel.hpp) tell each
// other, and their waits for it: how many leading gradient buckets each device has made final
// for its receiver, whether each has taken its copy of device 0's state, whether each has queued
// its part of the step; and the step's abort, which ends every wait once a worker fails, so that
// no worker waits for one that is gone.
//
//   signals.reset(n);                          // the caller, before the workers start
//   signals.publish(i, buckets);               // worker i
//   signals.wait_for([&] { return signals.published(s) > k; });  // worker j
//   signals.raise(StepSignals::Flag::done, i);
//   if (signals.abort()) throw;                // a worker that failed (first: its error)
#pragma once

#include <condition_variable>
#include <mutex>
#include <vector>

namespace dp {

class StepSignals {
 public:
  // What a device says once per step.
  enum class Flag {
    replicated,  // its copy of device 0's state (parameters, buffers) is taken
    done,        // its forward, backward and its reductions are queued
  };
  // Thrown from a wait that another worker's failure ended: that worker's error is the step's.
  struct Abandoned {};

  // requires no worker of a step waits. ensures a step on up to n devices, with nothing published
  // or raised and no abort.
  void reset(int n) {
    std::lock_guard<std::mutex> lock(mutex_);
    published_.assign(n, 0);
    for (std::vector<char>& f : raised_) f.assign(n, 0);
    abort_ = false;
  }
  // Device i's first `buckets` gradient buckets are final where its receiver reads them.
  void publish(int i, int buckets) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      published_[i] = buckets;
    }
    cv_.notify_all();
  }
  void raise(Flag f, int i) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      flags(f)[i] = 1;
    }
    cv_.notify_all();
  }
  // Ends every wait of the step (each throws Abandoned). Returns whether this call did (the
  // step's first failure), not an earlier one.
  bool abort() {
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      first = !abort_;
      abort_ = true;
    }
    cv_.notify_all();
    return first;
  }
  // Blocks until pred() holds; throws Abandoned when the step aborts first. pred runs under the
  // signals' lock: it reads published() and raised().
  template <class Pred>
  void wait_for(Pred pred) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return abort_ || pred(); });
    if (!pred()) throw Abandoned{};
  }
  // Blocks until each of `devices` has raised f (throws Abandoned on abort).
  void wait_raised(Flag f, const std::vector<int>& devices) {
    wait_for([&] { return all_raised(f, devices); });
  }
  // Blocks until devices 1 .. n - 1 have each raised f (throws Abandoned on abort).
  void wait_raised(Flag f, int n) {
    wait_for([&] { return all_raised(f, 1, n); });
  }
  // Runs f() under the signals' lock (f reads published() and raised()) and returns its result.
  template <class F>
  auto locked(F f) -> decltype(f()) {
    std::lock_guard<std::mutex> lock(mutex_);
    return f();
  }
  // Under the lock only (in wait_for's pred or locked's f):
  int published(int i) const { return published_[i]; }
  bool all_raised(Flag f, int from, int to) const {
    for (int r = from; r < to; ++r)
      if (!flags(f)[r]) return false;
    return true;
  }
  bool all_raised(Flag f, const std::vector<int>& devices) const {
    for (int r : devices)
      if (!flags(f)[r]) return false;
    return true;
  }

 private:
  std::vector<char>& flags(Flag f) { return raised_[static_cast<int>(f)]; }
  const std::vector<char>& flags(Flag f) const { return raised_[static_cast<int>(f)]; }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<int> published_;   // per device: its leading buckets published
  std::vector<char> raised_[2];  // per Flag, per device
  bool abort_ = false;           // a worker failed: the others stop waiting
};

}  // namespace dp
