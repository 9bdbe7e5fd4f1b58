#include "dp/worker_pool.hpp"

namespace dp {

WorkerPool::WorkerPool(const std::vector<kernels::Device>& devices,
                       kernels::ContextOptions options) {
  DP_CHECK(!devices.empty(), "WorkerPool: no devices");
  for (auto& d : devices) {
    workers_.push_back(std::make_unique<Worker>());
    workers_.back()->device = d;
  }
  for (int i = 0; i < size(); ++i)
    workers_[i]->thread = std::thread([this, i, options] { loop(i, options); });
  // Contexts are made on their threads; a failure there (no GPU, ...) surfaces here.
  try {
    run("dp/init", [](int) {});
  } catch (...) {
    shutdown();
    throw;
  }
}

WorkerPool::~WorkerPool() {
  shutdown();
}

void WorkerPool::shutdown() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  for (auto& w : workers_) w->wake.notify_all();
  for (auto& w : workers_)
    if (w->thread.joinable()) w->thread.join();
}

void WorkerPool::loop(int index, kernels::ContextOptions options) {
  Worker& w = *workers_[index];
  std::exception_ptr init_error;
  try {
    w.context = std::make_unique<kernels::DeviceContext>(w.device, options);
  } catch (...) {
    init_error = std::current_exception();
  }
  std::unique_ptr<kernels::ContextScope> scope;
  if (w.context) scope = std::make_unique<kernels::ContextScope>(*w.context);
  for (;;) {
    const std::function<void(int)>* job = nullptr;
    const char* phase = "";
    Trace* trace = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      w.wake.wait(lock, [&] { return stopping_ || w.posted > w.done; });
      if (w.posted == w.done) break;  // stopping with nothing left to run
      job = w.job;
      phase = w.phase;
      trace = trace_;
    }
    std::exception_ptr error = init_error;
    if (!error) {
      try {
        kernels::NvtxRange range(phase);
        TraceScope slice(trace, phase, index);
        (*job)(index);
      } catch (...) {
        error = std::current_exception();
      }
    }
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      w.error = std::move(error);  // no reference stays behind on this thread
      ++w.done;
      last = --running_ == 0;
    }
    // Only the last job wakes the caller: a wake per job would take a core from the devices
    // still working (device 0 sums and steps after the replicas end).
    if (last) finished_.notify_all();
  }
  scope.reset();
  w.context.reset();  // on its own thread: streams and handles die where they were made
}

void WorkerPool::run(const char* phase, const std::function<void(int)>& job, int n) {
  if (n < 0 || n > size()) n = size();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = n;
    for (int i = 0; i < n; ++i) {
      workers_[i]->job = &job;
      workers_[i]->phase = phase;
      workers_[i]->error = nullptr;
      ++workers_[i]->posted;
    }
  }
  // Worker 0 first: in DP it has the longest part of the step (it reduces and steps).
  for (int i = 0; i < n; ++i) workers_[i]->wake.notify_one();
  std::vector<std::exception_ptr> errors(n);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] {
      for (int i = 0; i < n; ++i)
        if (workers_[i]->done != workers_[i]->posted) return false;
      return true;
    });
    for (int i = 0; i < n; ++i) errors[i] = workers_[i]->error;
  }
  for (int i = 0; i < n; ++i) {
    if (!errors[i]) continue;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const std::exception& e) {
      DP_THROW(phase << " on " << workers_[i]->device << ": " << e.what());
    } catch (...) {
      DP_THROW(phase << " on " << workers_[i]->device << ": unknown exception");
    }
  }
}

}  // namespace dp
