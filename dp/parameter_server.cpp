#include "dp/parameter_server.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "kernels/ops.hpp"
#include "kernels/runtime/memory.hpp"

namespace dp {

namespace {

using Clock = std::chrono::steady_clock;

int cpu_threads_for(const std::vector<Device>& devices, int requested) {
  if (requested > 0) return requested;
  int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, hw / static_cast<int>(devices.size()));
}

// A gradient waiting for the server.
struct Push {
  int worker = 0;
  int64_t ticket = 0;          // pull order
  int64_t pulled_version = 0;  // server version the gradient was computed on
  int64_t batch_index = 0;
  float loss = 0;
  int64_t samples = 0;
};

// What the workers and the server share, all of it guarded by `mu` (the weights too: a pull
// copies them and an update writes them only while holding it).
struct Shared {
  std::mutex mu;
  std::condition_variable cv;
  int64_t version = 0;      // updates applied
  int64_t next_ticket = 0;  // pulls so far
  int64_t next_apply = 0;   // bounded staleness: the ticket the server applies next
  int64_t outstanding = 0;  // pulled, not yet applied
  std::deque<Push> arrived;
  std::vector<bool> applied;  // per worker: its last push was applied
  int workers_ready = 0;
  int workers_done = 0;
  bool failed = false;
  std::exception_ptr error;
  std::string error_where;

  void fail(std::exception_ptr e, const std::string& where) {
    std::lock_guard<std::mutex> lock(mu);
    if (!failed) {
      failed = true;
      error = e;
      error_where = where;
    }
    cv.notify_all();
  }
};

void trace_phase(Trace* trace, const char* name, int track, double begin_us) {
  if (trace) trace->add({name, track, begin_us, trace->now_us() - begin_us});
}

}  // namespace

ParameterServer::ParameterServer(nn::ModulePtr module, nn::Optimizer& optimizer,
                                 std::vector<Device> devices, PsOptions options)
    : module_(std::move(module)),
      optimizer_(optimizer),
      devices_(std::move(devices)),
      options_(options) {
  DP_CHECK(!devices_.empty(), "ParameterServer: no devices");
  DP_CHECK(module_ && module_->materialized() && module_->device() == devices_[0],
           "ParameterServer: the module must be materialised on " << devices_[0]
                                                                  << ", the server's device");
  std::set<Device> seen(devices_.begin(), devices_.end());
  DP_CHECK(seen.size() == devices_.size(), "ParameterServer: devices must be distinct");
  rng_offsets_.assign(devices_.size(), 0);
}

void ParameterServer::set_rng_offsets(const std::vector<uint64_t>& offsets) {
  DP_CHECK(offsets.size() == devices_.size(),
           "ParameterServer::set_rng_offsets: " << offsets.size() << " offsets for "
                                                << devices_.size() << " workers");
  rng_offsets_ = offsets;
}

PsReport ParameterServer::run(const PsBatchFn& batches, int64_t first, int64_t n_batches,
                              Trace* trace) {
  DP_CHECK(n_batches >= 0 && first >= 0, "ParameterServer::run: first "
                                             << first << " and n_batches " << n_batches
                                             << " must be >= 0");
  const int n = n_workers();
  const auto t0 = Clock::now();
  // The caller's work on the master weights is finished before other threads read them.
  kernels::context(devices_[0]).synchronize();

  Shared sh;
  sh.applied.assign(static_cast<size_t>(n), true);
  std::atomic<int64_t> next_batch{first};
  const int64_t end_batch = first + n_batches;
  const int threads = cpu_threads_for(devices_, options_.cpu_threads_per_device);
  const float base_lr = optimizer_.lr();
  const int64_t bound = options_.max_staleness;
  const nn::LossPtr loss_ptr =
      options_.loss ? options_.loss : std::make_shared<nn::CrossEntropyLoss>();
  const nn::Loss& loss_fn = *loss_ptr;

  PsReport report;
  report.pushes_per_worker.assign(static_cast<size_t>(n), 0);
  // The server's copy of each worker's pushed gradient (and buffers: BatchNorm running
  // statistics, which the last applied push sets), on the server device.
  std::vector<Tensor> pushed(static_cast<size_t>(n)), pushed_buffers(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    pushed[i] = Tensor::empty(module_->flat_grads().shape(), kernels::DType::f32, devices_[0]);
    pushed_buffers[i] = Tensor::empty(module_->flat_buffers().shape(),
                                      module_->flat_buffers().dtype(), devices_[0]);
  }

  auto worker = [&](int i) {
    try {
      Device dev = devices_[i];
      kernels::ContextOptions co;
      co.cpu_threads = threads;
      kernels::DeviceContext ctx(dev, co);
      kernels::ContextScope scope(ctx);
      nn::ModulePtr replica = module_->clone_to(dev);
      replica->train();
      replica->flat().rng_offset = rng_offsets_[i];  // its dropout stream goes on
      {  // every replica is made before the server may write the weights it was cloned from
        std::unique_lock<std::mutex> lock(sh.mu);
        ++sh.workers_ready;
        sh.cv.notify_all();
        sh.cv.wait(lock, [&] { return sh.workers_ready == n || sh.failed; });
      }
      Tensor input, labels, loss, dlogits;
      while (true) {
        // Unbounded: the next batch, first come first served. Bounded: drawn with the ticket.
        int64_t b = bound < 0 ? next_batch.fetch_add(1) : first;
        if (b >= end_batch) break;
        Push push;
        push.worker = i;
        double begin = trace ? trace->now_us() : 0;
        {
          std::unique_lock<std::mutex> lock(sh.mu);
          // Bounded staleness: at most S + 1 gradients outstanding, this one included; at S = 0
          // the workers pull in turn (batch b is worker b mod n's, however run() is split), or
          // leave once every batch is drawn.
          sh.cv.wait(lock, [&] {
            return sh.failed || bound < 0 ||
                   (sh.outstanding <= bound && (bound > 0 || (first + sh.next_ticket) % n == i ||
                                                sh.next_ticket >= n_batches));
          });
          if (sh.failed) break;
          if (bound >= 0) {
            if (sh.next_ticket >= n_batches) break;
            b = first + sh.next_ticket;
          }
          push.batch_index = b;
          push.ticket = sh.next_ticket++;
          push.pulled_version = sh.version;
          ++sh.outstanding;
          kernels::NvtxRange range("ps/pull");
          kernels::copy_bytes(replica->flat_params(), module_->flat_params());
          kernels::copy_bytes(replica->flat_buffers(), module_->flat_buffers());
          ctx.synchronize();  // the server may write its weights once the lock is released
        }
        trace_phase(trace, "ps/pull", i, begin);

        begin = trace ? trace->now_us() : 0;
        {
          kernels::NvtxRange range("ps/compute");
          auto [x, y] = batches(b);
          push.samples = x.dim(0);
          kernels::copy(kernels::ensure(input, x.shape(), x.dtype(), dev), x);
          kernels::copy(kernels::ensure(labels, y.shape(), y.dtype(), dev), y);
          replica->zero_grad();
          Tensor out = replica->forward(input);
          kernels::ensure(loss, {1}, kernels::DType::f32, dev);
          kernels::ensure(dlogits, out.shape(), out.dtype(), dev);  // f32 unless set_output
          loss_fn.compute(loss, dlogits, out, labels);
          replica->backward(dlogits);
          push.loss = loss.item();  // waits for this device's stream
        }
        trace_phase(trace, "ps/compute", i, begin);

        begin = trace ? trace->now_us() : 0;
        {
          kernels::NvtxRange range("ps/push");
          // pushed[i] is this worker's alone until the server applies it, and the server reads
          // it only after the push below: the copy needs no lock.
          kernels::copy_bytes(pushed[i], replica->flat_grads());
          kernels::copy_bytes(pushed_buffers[i], replica->flat_buffers());
          ctx.synchronize();
          std::unique_lock<std::mutex> lock(sh.mu);
          sh.applied[i] = false;
          sh.arrived.push_back(push);
          sh.cv.notify_all();
          sh.cv.wait(lock, [&] { return sh.applied[i] || sh.failed; });
          if (sh.failed) break;
        }
        trace_phase(trace, "ps/push", i, begin);
      }
      rng_offsets_[i] = replica->flat().rng_offset;  // this worker's slot; read after the join
    } catch (...) {
      std::ostringstream where;
      where << devices_[i];
      sh.fail(std::current_exception(), where.str());
    }
    std::lock_guard<std::mutex> lock(sh.mu);
    ++sh.workers_done;
    sh.cv.notify_all();
  };

  auto server = [&] {
    try {
      kernels::ContextOptions co;
      co.cpu_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      kernels::DeviceContext ctx(devices_[0], co);
      kernels::ContextScope scope(ctx);
      std::unique_lock<std::mutex> lock(sh.mu);
      while (true) {
        // The next gradient to apply: the first to arrive, or, with bounded staleness, the one
        // with the next pull ticket.
        auto pick = [&]() -> std::deque<Push>::iterator {
          if (bound < 0) return sh.arrived.begin();
          return std::find_if(sh.arrived.begin(), sh.arrived.end(),
                              [&](const Push& p) { return p.ticket == sh.next_apply; });
        };
        sh.cv.wait(lock, [&] {
          return sh.failed || pick() != sh.arrived.end() ||
                 (sh.workers_done == n && sh.arrived.empty());
        });
        if (sh.failed || (sh.workers_done == n && sh.arrived.empty())) break;
        auto it = pick();
        Push p = *it;
        sh.arrived.erase(it);
        double begin = trace ? trace->now_us() : 0;
        int64_t staleness = sh.version - p.pulled_version;
        {
          kernels::NvtxRange range("ps/apply");
          kernels::copy_bytes(module_->flat_grads(), pushed[p.worker]);
          kernels::copy_bytes(module_->flat_buffers(), pushed_buffers[p.worker]);
          if (options_.lr == PsOptions::StalenessLr::scaled)
            optimizer_.set_lr(base_lr / static_cast<float>(1 + staleness));
          optimizer_.step();
          optimizer_.set_lr(base_lr);
          ctx.synchronize();  // workers read the weights next
        }
        ++sh.version;
        ++sh.next_apply;
        --sh.outstanding;
        sh.applied[p.worker] = true;
        ++report.pushes_per_worker[p.worker];
        ++report.pushes;
        if (report.staleness_histogram.size() <= static_cast<size_t>(staleness))
          report.staleness_histogram.resize(static_cast<size_t>(staleness) + 1, 0);
        ++report.staleness_histogram[staleness];
        double end_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        report.updates.push_back({p.worker, p.batch_index, staleness, p.loss, p.samples, end_ms});
        trace_phase(trace, "ps/apply", n, begin);
        sh.cv.notify_all();
      }
    } catch (...) {
      std::ostringstream where;
      where << "the server on " << devices_[0];
      sh.fail(std::current_exception(), where.str());
    }
  };

  std::vector<std::thread> threads_;
  threads_.emplace_back(server);
  for (int i = 0; i < n; ++i) threads_.emplace_back(worker, i);
  for (auto& t : threads_) t.join();
  optimizer_.set_lr(base_lr);
  if (sh.failed) {
    try {
      std::rethrow_exception(sh.error);
    } catch (const std::exception& e) {
      DP_THROW("parameter server: " << sh.error_where << ": " << e.what());
    }
  }
  report.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return report;
}

}  // namespace dp
