#include "kernels/runtime/graph.hpp"

#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/runtime/block_cache.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/nvtx.hpp"

#if DP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/runtime/cuda_check.hpp"
#endif

namespace kernels {

namespace {
[[noreturn]] void capture_failed_by_test_hook() {
  DP_THROW("the capture was made to fail by DP_TEST_FAIL_CAPTURE (a test hook)");
}
}  // namespace

Graph::~Graph() {
  reset();
}

Graph::Graph(Graph&& other) noexcept {
  *this = std::move(other);
}

Graph& Graph::operator=(Graph&& other) noexcept {
  if (this != &other) {
    reset();
    ctx_ = std::exchange(other.ctx_, nullptr);
    ops_ = std::move(other.ops_);
    exec_ = std::exchange(other.exec_, nullptr);
    nodes_ = std::exchange(other.nodes_, 0);
    casts_ = std::exchange(other.casts_, 0);
    fault_text_ = std::exchange(other.fault_text_, nullptr);
    live_ = std::move(other.live_);
    reservation_ = std::move(other.reservation_);
    observed_ = std::move(other.observed_);
  }
  return *this;
}

void Graph::reset() {
#if DP_HAVE_CUDA
  if (exec_) {
    // An executable graph still running is freed when it completes.
    cudaError_t e = cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    if (e != cudaSuccess && e != cudaErrorCudartUnloading)
      DP_LOG_ERROR("destroying a CUDA graph: " << cudaGetErrorString(e));
  }
#endif
  exec_ = nullptr;
  ops_.clear();
  observed_.reset();
  ctx_ = nullptr;
  nodes_ = 0;
  casts_ = 0;
  fault_text_ = nullptr;
  if (live_) --*live_;  // the context may be gone: only its shared count is touched
  live_.reset();
  reservation_.reset();  // after the ops: the tensors they hold return their blocks to it first
}

void Graph::capture(DeviceContext& ctx, const std::function<void()>& body, const Graph* after) {
  DP_CHECK(!ctx.capturing(),
           "Graph::capture on " << ctx.device() << ": a graph captures there already");
  DP_CHECK(&context(ctx.device()) == &ctx,
           "Graph::capture on " << ctx.device()
                                << ": the context is not the one this thread's ops use there");
  DP_CHECK(!ctx.noting(), "Graph::capture on " << ctx.device() << ": a graph observes there");
  DP_CHECK(after != this, "Graph::capture on " << ctx.device() << ": a graph after itself");
  DP_CHECK(!after || after->ctx_ == &ctx,
           "Graph::capture on " << ctx.device() << ": the graph it follows was "
                                << (after->ctx_ ? "captured on another context" : "not captured"));
  // The step before's ops (observe), which the capture's are compared with.
  const std::shared_ptr<std::vector<DeviceContext::OpNote>> observed = std::move(observed_);
  reset();
  NvtxRange range("runtime/graph_capture");
  std::vector<std::function<void()>> ops;
  std::shared_ptr<BlockReservation> reservation;
  if (ctx.block_cache())  // `after`'s pool, or a new one
    reservation = ctx.block_cache()->begin_reservation(after ? after->reservation_ : nullptr);
  // Ends the capture state whatever happens: the context must stay usable after a failure. The
  // device-side fault check the body arms (a bad label, a bad token id) is the graph's, armed
  // again at each replay, which runs no host code; the body's kernels do not run while it is
  // captured, so the context's check goes back to what it was.
  struct Ending {
    DeviceContext& ctx;
    bool cache;
    DeviceContext::FaultText armed_before;
    DeviceContext* capturing_before;
    ~Ending() {
      ctx.recording_ = nullptr;
      ctx.notes_ = nullptr;
      ctx.fault_text_ = armed_before;
      ctx.graph_borrows_.clear();  // the recording holds the handles it uses
      detail::set_capturing_on_this_thread(capturing_before);
      if (cache) ctx.block_cache()->end_reservation();
    }
  } ending{ctx, reservation != nullptr, ctx.fault_text_, capturing_on_this_thread()};
  RangeNames names;  // a refusal names the layer it happened in
  ctx.recording_ = &ops;
  ctx.notes_ = observed.get();
  ctx.notes_checked_ = 0;
  ctx.captured_casts_ = 0;
  ctx.fault_text_ = nullptr;
  ctx.graph_borrows_.clear();
  detail::set_capturing_on_this_thread(&ctx);
  if (ctx.device().is_cpu()) {
    body();
    nodes_ = static_cast<int64_t>(ops.size());
  } else {
#if DP_HAVE_CUDA
    capture_cuda(ctx, body);
#endif
  }
  if (observed) {  // fewer ops than the step before queued
    try {
      ctx.check_all_noted();
    } catch (...) {
      reset();  // a CUDA graph instantiated already goes
      throw;
    }
  }
  // A test hook: DP_TEST_FAIL_CAPTURE set makes every capture fail once its body has run (its
  // host code changed what it changes), as a capture refused at its end would, so that the
  // engines' fallback is proved where every capture succeeds.
  if (const char* hook = std::getenv("DP_TEST_FAIL_CAPTURE"); hook && *hook) {
    reset();  // a CUDA graph instantiated already goes
    capture_failed_by_test_hook();
  }
  // CPU: the ops a replay runs. CUDA: the captured ops' arguments, held so that the memory the
  // graph's launches address stays the graph's (never run).
  ops_ = std::move(ops);
  casts_ = ctx.captured_casts_;
  fault_text_ = ctx.fault_text_;
  ctx_ = &ctx;
  live_ = ctx.live_graphs_;
  ++*live_;
  reservation_ = std::move(reservation);
}

void Graph::observe(DeviceContext& ctx, const std::function<void()>& body) {
  DP_CHECK(!ctx.capturing(), "Graph::observe on " << ctx.device()
                                                  << ": a graph captures there (observe runs the "
                                                  << "work)");
  DP_CHECK(!ctx.noting(), "Graph::observe on " << ctx.device() << ": a graph observes there");
  DP_CHECK(&context(ctx.device()) == &ctx,
           "Graph::observe on " << ctx.device()
                                << ": the context is not the one this thread's ops use there");
  observed_.reset();
  auto notes = std::make_shared<std::vector<DeviceContext::OpNote>>();
  struct Ending {
    DeviceContext& ctx;
    ~Ending() { ctx.notes_ = nullptr; }
  } ending{ctx};
  RangeNames names;  // a note names the layer its op was queued in
  ctx.notes_ = notes.get();
  body();
  observed_ = std::move(notes);
}

#if DP_HAVE_CUDA
void Graph::capture_cuda(DeviceContext& ctx, const std::function<void()>& body) {
  ctx.make_current();
  auto s = static_cast<cudaStream_t>(ctx.stream());
  // A failed capture call leaves no stale error for the next launch on this thread.
  auto check = [&](cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    cudaGetLastError();
    DP_THROW("capturing a CUDA graph on " << ctx.device() << ": " << what << ": "
                                          << cudaGetErrorString(e)
                                          << " (the step is not capturable: --cuda-graphs off "
                                             "runs it uncaptured)");
  };
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  cudaGraph_t graph = nullptr;
  try {
    body();
  } catch (...) {
    cudaStreamEndCapture(s, &graph);  // ends the (invalidated) capture; the error is body's
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  check(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
  size_t n = 0;
  cudaGraphGetNodes(graph, nullptr, &n);
  cudaGraphExec_t exec = nullptr;
  cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(e, "cudaGraphInstantiate");
  exec_ = exec;
  nodes_ = static_cast<int64_t>(n);
}
#endif

void Graph::replay() {
  DP_CHECK(captured(), "Graph::replay: nothing captured");
  // Into a capture in progress on its context: a graph inside a graph, which this runtime does
  // not nest (a CPU device would run the recorded ops' host reads), refused on every backend.
  ctx_->refuse_in_capture("replaying a graph");
  ctx_->casts_.fetch_add(casts_, std::memory_order_relaxed);
  if (ctx_->device().is_cpu()) {
    ctx_->arena().execute([&] {
      for (auto& op : ops_) op();
    });
    return;
  }
#if DP_HAVE_CUDA
  ctx_->make_current();
  DP_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_),
                                static_cast<cudaStream_t>(ctx_->stream())));
  if (fault_text_) ctx_->arm_fault_check(fault_text_);  // the next host read checks the record
#endif
}

}  // namespace kernels
