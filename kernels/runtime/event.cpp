#include "kernels/runtime/event.hpp"

#include <utility>

#include "kernels/runtime/context.hpp"
#include "kernels/runtime/error.hpp"

#if DP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/runtime/cuda_check.hpp"
#endif

namespace kernels {

Event::~Event() {
  release();
}

Event::Event(Event&& other) noexcept
    : device_(other.device_),
      timing_(other.timing_),
      event_(std::exchange(other.event_, nullptr)),
      gpu_(other.gpu_),
      recorded_(std::exchange(other.recorded_, false)),
      host_(other.host_),
      in_graph_(std::move(other.in_graph_)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    timing_ = other.timing_;
    event_ = std::exchange(other.event_, nullptr);
    gpu_ = other.gpu_;
    recorded_ = std::exchange(other.recorded_, false);
    host_ = other.host_;
    in_graph_ = std::move(other.in_graph_);
  }
  return *this;
}

void Event::release() noexcept {
#if DP_HAVE_CUDA
  if (event_) {
    cudaSetDevice(gpu_);
    cudaError_t e = cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    if (e != cudaSuccess && e != cudaErrorCudartUnloading)
      DP_LOG_ERROR("destroying a CUDA event: " << cudaGetErrorString(e));
  }
#endif
  event_ = nullptr;
  recorded_ = false;
  in_graph_.reset();  // a graph that records it finds it gone
}

void Event::record(DeviceContext& ctx) {
  ctx.refuse_in_capture("recording an event");  // a replay would not record it
  host_slot() = Clock::now();
  if (ctx.device().is_cpu()) {
    if (event_) release();  // was a CUDA event
    device_ = ctx.device();
    recorded_ = true;
    return;
  }
#if DP_HAVE_CUDA
  ctx.make_current();
  int gpu = physical_gpu(ctx.device());
  if (event_ && gpu != gpu_) release();  // an event belongs to one GPU
  if (!event_) {
    cudaEvent_t e = nullptr;
    DP_CUDA_CHECK(cudaEventCreateWithFlags(
        &e, timing_ == Timing::on ? cudaEventDefault : cudaEventDisableTiming));
    event_ = e;
    gpu_ = gpu;
  }
  device_ = ctx.device();
  DP_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(ctx.stream())));
  recorded_ = true;
#else
  DP_THROW("Event::record on " << ctx.device()
                               << ": no CUDA backend: " << cuda_unavailable_reason());
#endif
}

void Event::record_in_graph(DeviceContext& ctx) {
  if (!ctx.capturing()) {
    record(ctx);
    return;
  }
  // CUDA makes no event inside a capture here (and a replay records the one the node names):
  // the uncaptured run before the capture makes it. Refused alike on CPU devices.
  DP_CHECK(recorded_ && device_ == ctx.device(),
           "Event::record_in_graph on " << ctx.device()
                                        << " while a graph captures: the event was never recorded "
                                           "there before (record it in the step's uncaptured run "
                                           "first)");
  if (!in_graph_) in_graph_ = std::make_shared<InGraph>(InGraph{host_});  // from here its slot
  std::weak_ptr<InGraph> alive = in_graph_;
  const Device device = device_;
  auto replayed = [alive, device] {
    std::shared_ptr<InGraph> state = alive.lock();
    DP_CHECK(state, "replaying a graph on "
                        << device
                        << ": an event it records (Event::record_in_graph) was destroyed or "
                           "recorded elsewhere since the capture (it must outlive the graph)");
    state->host = Clock::now();
  };
  if (ctx.device().is_cpu()) {
    ctx.record(replayed);
    return;
  }
#if DP_HAVE_CUDA
  ctx.make_current();
  DP_CUDA_CHECK(cudaEventRecordWithFlags(static_cast<cudaEvent_t>(event_),
                                         static_cast<cudaStream_t>(ctx.stream()),
                                         cudaEventRecordExternal));
#endif
}

void Event::wait(DeviceContext& ctx) const {
  DP_CHECK(recorded_, "Event::wait on " << ctx.device() << ": the event was never recorded");
  ctx.refuse_in_capture("waiting on an event");  // order a graph's launch from outside it
  if (!event_ || ctx.device().is_cpu()) {
    // A CPU event's work is done. A CPU context waiting on a GPU event must block the host.
    if (event_) synchronize();
    return;
  }
#if DP_HAVE_CUDA
  ctx.make_current();
  DP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(ctx.stream()),
                                    static_cast<cudaEvent_t>(event_), 0));
#endif
}

void Event::synchronize() const {
  DP_CHECK(recorded_, "Event::synchronize: the event was never recorded");
  if (DeviceContext* c = capturing_on_this_thread()) c->refuse_in_capture("a host read or wait");
#if DP_HAVE_CUDA
  if (event_) DP_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
#endif
}

double Event::elapsed_ms(const Event& a, const Event& b) {
  DP_CHECK(a.recorded_ && b.recorded_, "Event::elapsed_ms: an event was never recorded");
  DP_CHECK(a.timing_ == Timing::on && b.timing_ == Timing::on,
           "Event::elapsed_ms: an event was made with Timing::off (ordering only)");
  DP_CHECK(a.device_ == b.device_, "Event::elapsed_ms: events on " << a.device_ << " and "
                                                                   << b.device_
                                                                   << " (one device required)");
#if DP_HAVE_CUDA
  if (a.event_ && b.event_) {
    float ms = 0;
    DP_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a.event_),
                                       static_cast<cudaEvent_t>(b.event_)));
    return ms;
  }
#endif
  return std::chrono::duration<double, std::milli>(b.host_time() - a.host_time()).count();
}

}  // namespace kernels
