// DeviceContext: everything one thread needs to run work on one device: the CUDA stream,
// cuBLASLt and cuDNN handles, a GEMM workspace, the memory counters, and for CPU devices a
// tbb::task_arena sized so that several CPU devices share the cores without oversubscribing.
// A context is owned by one thread for life; no handle is shared across threads.
//
// A worker thread makes its context once and binds it for the thread's life:
//     DeviceContext ctx(Device::cuda(1), {.cpu_threads = 2});
//     ContextScope scope(ctx);   // kernels::relu(y, x) on cuda:1 now runs on ctx's stream
// A thread that calls an op on a device it has not bound gets a default context of its own
// (made on first use, destroyed at thread exit).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <typeindex>
#include <unordered_map>
#include <vector>

#include <tbb/task_arena.h>

#include "kernels/runtime/device.hpp"

namespace kernels {

// Bytes allocated on one logical device through one context, now and at the peak (tensors in
// use: blocks a BlockCache keeps for reuse are not counted), and how many times memory was
// taken from the device (cudaMallocAsync or the host heap; a block reused from a cache is not).
struct MemoryStats {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  // The peak since the last begin_window(): an engine's per-step peak (a captured step's against
  // the eager one's).
  std::atomic<int64_t> window_peak{0};
  std::atomic<int64_t> allocations{0};
  void on_alloc(int64_t bytes);
  void on_free(int64_t bytes) { current.fetch_sub(bytes); }
  void begin_window() { window_peak.store(current.load()); }
};

// How matrix products may round: strict f32, or TF32 tensor cores for f32 inputs (GPU only).
enum class MathMode { strict, tf32 };

// Whether freed tensors' memory is kept for the next request of the same size (BlockCache):
// on for engine workers, whose steps repeat; off for one-off work.
enum class Caching { off, on };

struct ContextOptions {
  int cpu_threads = 0;  // CPU devices: arena concurrency; 0 = all hardware threads
  MathMode math = MathMode::strict;
  Caching caching = Caching::off;
};

class BlockCache;
class Storage;
class Tensor;

class DeviceContext {
 public:
  explicit DeviceContext(Device device, ContextOptions options = {});
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  Device device() const { return device_; }
  // CUDA handles as opaque pointers so that this header needs no CUDA includes;
  // kernels/cuda/cuda_common.cuh casts them back. nullptr on CPU devices.
  void* stream() const { return stream_; }
  void* cublaslt() const { return cublaslt_; }
  void* cudnn() const { return cudnn_; }
  // A device buffer of at least `bytes`, reused between calls (grows, never shrinks). Growing
  // throws while a graph captures (the uncaptured runs before a capture size it).
  void* workspace(size_t bytes);
  size_t workspace_bytes() const { return workspace_bytes_; }

  // CPU devices: the arena every CPU kernel of this device runs in.
  tbb::task_arena& arena();
  int cpu_threads() const { return cpu_threads_; }

  MathMode math() const { return options_.math; }
  void set_math(MathMode m) { options_.math = m; }

  const std::shared_ptr<MemoryStats>& memory() const { return memory_; }
  // The cache tensors allocated through this context draw from (null: Caching::off).
  const std::shared_ptr<BlockCache>& block_cache() const { return block_cache_; }

  // Times the host waited for this context's device work or read a result back: synchronize(),
  // a copy that ends on the host, an op that returns a value (count_correct, all_finite), a
  // host read of one of its tensors (item, to_host_*). Counted on CPU devices too, where
  // the work is done already, so that a step's count is the same on every backend.
  int64_t host_syncs() const { return host_syncs_.load(); }
  // Throws while a graph captures on this context: a host wait cannot be captured.
  void note_host_sync() {
    refuse_in_capture("a host read or wait");
    host_syncs_.fetch_add(1, std::memory_order_relaxed);
  }

  // Dtype conversions (f32/f16/bf16 casts, each one kernel and, where an op widens, an f32
  // temporary) this context's work performed: counted when a cast is queued (kernels::copy
  // between dtypes, and the CUDA attention's own widening), and for captured work at each replay
  // of its graph (Graph::casts), never at the capture, which runs nothing. So a step counts
  // what it converts however it ran: eagerly, captured then replayed, or replayed.
  int64_t casts() const { return casts_.load(); }
  void note_cast() {
    if (capturing())
      ++captured_casts_;
    else
      casts_.fetch_add(1, std::memory_order_relaxed);
  }

  // Capture (kernels/runtime/graph.hpp): whether a Graph is capturing on this context. Then
  // the op layer records CPU ops (record) instead of running them, and CUDA work goes into the
  // stream's capture, each op's arguments recorded beside it.
  bool capturing() const { return recording_ != nullptr; }
  // requires capturing(). ensures the graph keeps `op` (and what it holds) until destroyed; on a
  // CPU device `op` runs at each replay, in order; on a CUDA device it never runs.
  void record(std::function<void()> op) { recording_->push_back(std::move(op)); }
  // requires capturing(). What a recording keeps of a tensor argument: `t` itself when its
  // memory was not taken during this capture (inputs, parameters, metrics: the graph holds
  // them), else a view of the same memory that owns nothing. A block taken while capturing is
  // the graph's (its BlockReservation keeps it), and when the last owner of its tensor lets it
  // go it is free for the capture's later temporaries, as it would be eagerly: so a capture
  // needs no more memory than the eager step. Views of one block share one handle.
  Tensor graph_arg(const Tensor& t);
  // Throws, naming `what`, the device and the innermost named range (an nn layer's), while
  // capturing.
  void refuse_in_capture(const char* what) const;

  // An op's host arguments as Graph::observe notes them (kernels/dispatch.hpp): what a captured
  // launch keeps besides memory. The op, its arguments' names as written at the dispatch
  // ("y, x, alpha"), each argument as text (a value; a tensor's dtype, shape and offset; a device
  // scalar as such, whatever it holds) and the innermost named range (an nn layer's).
  struct OpNote {
    const char* op = nullptr;
    const char* names = nullptr;
    std::vector<std::string> args;
    std::string where;
  };
  // Whether the ops queued on this context note their host arguments now: a Graph observes, or
  // captures after an observation.
  bool noting() const { return notes_ != nullptr; }
  // requires noting(). While a graph observes: appends `n`. While it captures: compares `n` with
  // the observed op at the same place and throws when they differ (Graph::observe).
  void note_op(OpNote n);
  // Shares ownership of the CUDA stream: memory allocated on it keeps it alive until freed,
  // so a tensor may outlive the context that made it. Empty on CPU devices.
  const std::shared_ptr<void>& stream_owner() const { return stream_owner_; }

  // Per-context state of the op layer (the cuBLASLt and cuDNN plan caches), one T per context:
  // made on first use, destroyed with the context before its library handles. T is default
  // constructible; only the context's own thread uses it, like the handles.
  template <class T>
  T& state() {
    std::shared_ptr<void>& slot = states_[std::type_index(typeid(T))];
    if (!slot) slot = std::make_shared<T>();
    return *static_cast<T*>(slot.get());
  }

  // Deferred device-side errors, for kernels that must not __trap() (a trap ends the CUDA
  // context that every logical device on the GPU shares). A kernel writes a record of
  // kFaultWords words into fault_record() (all bits set: no fault); the op arms the check with a
  // function that turns a record into the error text; the next host read on this context (a
  // copy to the host, synchronize()) reads the record and, when a fault was written, resets it
  // and throws that text. CUDA contexts only.
  static constexpr int kFaultWords = 4;
  using FaultText = std::string (*)(const uint64_t* record);
  uint64_t* fault_record();
  void arm_fault_check(FaultText text) { fault_text_ = text; }
  // requires the stream's work is finished. ensures no armed fault is pending (throws its text).
  void check_faults();

  // Waits until all work queued on this context's stream has finished (no-op on CPU), then
  // reports an armed device-side fault (check_faults).
  void synchronize();
  // CUDA: makes this context's physical GPU the calling thread's current device (its stream and
  // handles belong to it). No-op on CPU devices.
  void make_current() const;

 private:
  Device device_;
  ContextOptions options_;
  int cpu_threads_ = 1;
  void* stream_ = nullptr;
  std::shared_ptr<void> stream_owner_;
  void* cublaslt_ = nullptr;
  void* cudnn_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  uint64_t* fault_record_ = nullptr;
  FaultText fault_text_ = nullptr;
  std::unique_ptr<tbb::task_arena> arena_;
  std::shared_ptr<MemoryStats> memory_;
  std::shared_ptr<BlockCache> block_cache_;
  std::atomic<int64_t> host_syncs_{0};
  std::atomic<int64_t> casts_{0};
  int64_t captured_casts_ = 0;  // casts queued into the capture in progress (Graph::capture)
  std::map<std::type_index, std::shared_ptr<void>> states_;
  // The capture in progress (Graph::capture): CPU ops go here; non-null on CUDA too, as the flag.
  std::vector<std::function<void()>>* recording_ = nullptr;
  // Graph::observe's notes, being written (observing) or compared (capturing; notes_checked_
  // compared so far); null while neither.
  std::vector<OpNote>* notes_ = nullptr;
  size_t notes_checked_ = 0;
  // Throws when a capture that compares its ops with notes_ queued fewer of them.
  void check_all_noted() const;
  // The capture's non-owning handles on blocks it took (graph_arg), by the storage they view.
  std::unordered_map<const Storage*, std::shared_ptr<Storage>> graph_borrows_;
  // Graphs captured on this context and not reset (shared: a graph may outlive the context).
  // While any lives, a workspace that grows keeps its old buffer (retired_workspaces_): a
  // captured kernel holds its address. Freed once none lives, or with the context.
  std::shared_ptr<std::atomic<int>> live_graphs_ = std::make_shared<std::atomic<int>>(0);
  std::vector<void*> retired_workspaces_;
  friend class Graph;
};

// Binds `ctx` as this thread's context for ctx.device() until the scope ends.
class ContextScope {
 public:
  explicit ContextScope(DeviceContext& ctx);
  ~ContextScope();
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  DeviceContext* previous_;
  Device device_;
};

// Whether a kernel running on `reader` can read memory of `owner` in place: both CPU devices,
// two logical devices of one GPU, or two GPUs with peer access (enabled by the runtime where
// cudaDeviceCanAccessPeer allows it).
bool direct_access(Device reader, Device owner);

// The context a graph captures on from this thread (Graph::capture), else nullptr. A CPU
// device's tensor read on the host while it captures is refused (Tensor::raw): a replay would
// skip that host code, as a CUDA graph does.
DeviceContext* capturing_on_this_thread();
namespace detail {
void set_capturing_on_this_thread(DeviceContext* ctx);  // Graph::capture's
}  // namespace detail

// This thread's context for `device`: the bound one, else a default one made on first use.
DeviceContext& context(Device device);
// This thread's context for `device` if it has one (bound or made earlier), else nullptr.
DeviceContext* existing_context(Device device);

}  // namespace kernels
