// WorkerPool: one persistent host thread per device. Each thread makes its DeviceContext once
// and keeps it bound for life. The caller runs a phase on every worker at once and waits
// for all of them; an exception on any worker is caught there and rethrown to the caller
// with its device named, after every worker has finished the phase, so no worker is left
// waiting on another and the pool stays usable (or destroyable) after a failure.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dp/trace.hpp"
#include "kernels/ops.hpp"

namespace dp {

class WorkerPool {
 public:
  // One worker per device; CPU devices get arenas of `cpu_threads` threads each.
  WorkerPool(const std::vector<kernels::Device>& devices, kernels::ContextOptions options);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }
  kernels::Device device(int i) const { return workers_[i]->device; }
  kernels::DeviceContext& context(int i) { return *workers_[i]->context; }

  // Runs job(i) on workers i in [0, n) (all when n < 0) concurrently, waits for all of them.
  // requires no other run() in flight. ensures every job returned or threw; throws the first
  // failure (lowest worker index) as kernels::Error "<phase> on <device>: <what>".
  void run(const char* phase, const std::function<void(int)>& job, int n = -1);

  // When set, every job is recorded as a slice named by its phase on its worker's track.
  void set_trace(Trace* trace) { trace_ = trace; }

 private:
  struct Worker {
    kernels::Device device;
    std::thread thread;
    std::unique_ptr<kernels::DeviceContext> context;  // made and destroyed on `thread`
    const std::function<void(int)>* job = nullptr;
    const char* phase = "";
    uint64_t posted = 0, done = 0;
    std::exception_ptr error;
    std::condition_variable wake;  // its own, so that run() wakes the workers in index order
  };
  void loop(int index, kernels::ContextOptions options);
  void shutdown() noexcept;  // stops and joins every worker (idempotent)

  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex mutex_;
  std::condition_variable finished_;  // notified by the last job of a run to end, once
  int running_ = 0;                   // jobs of the current run not ended yet
  bool stopping_ = false;
  Trace* trace_ = nullptr;  // set between runs only
};

}  // namespace dp
