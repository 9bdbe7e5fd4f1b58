#include "kernels/runtime/context.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/runtime/block_cache.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/nvtx.hpp"
#include "kernels/runtime/tensor.hpp"

#if DP_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "kernels/runtime/cuda_check.hpp"
#endif

namespace kernels {

#if DP_HAVE_CUDA
namespace {

// What prepare_gpu opened, per ordered pair of physical GPUs: a kernel on `reader` may read
// memory of `owner`'s pool in place only when the reader's peer access to the owner is on and
// the owner's pool is open to the reader. cudaDeviceCanAccessPeer may say yes where enabling
// then fails (too many peers, say): such a pair is read through a copy instead of faulting.
// GPU g's entries (g reading the others; the others reading g's pool) are written by
// prepare_gpu(g), under g's once-flag, and read after it.
class PeerOpen {
 public:
  explicit PeerOpen(int n)
      : n_(n > 0 ? n : 1),
        enabled_(new std::atomic<bool>[n_ * n_]()),
        pool_open_(new std::atomic<bool>[n_ * n_]()) {}
  std::atomic<bool>& enabled(int reader, int owner) { return enabled_[reader * n_ + owner]; }
  std::atomic<bool>& pool_open(int owner, int reader) { return pool_open_[owner * n_ + reader]; }

 private:
  int n_;
  std::unique_ptr<std::atomic<bool>[]> enabled_, pool_open_;
};
PeerOpen& peer_open() {
  static PeerOpen table(cuda_device_count());
  return table;
}

// Per-process driver state of one physical GPU, set once however many logical devices and
// contexts use it:
//   - the default memory pool keeps what it has mapped (release threshold UINT64_MAX): with the
//     default threshold 0 every synchronize() would unmap the step's activations and the next
//     step would map them again;
//   - peer access to every GPU that cudaDeviceCanAccessPeer allows, for the device and for its
//     pool (cudaMallocAsync memory needs cudaMemPoolSetAccess as well), so copies between two
//     GPUs go directly instead of through host memory.
// The once-flags are function-local statics: the driver state they guard is itself per process,
// so this and the peer table above are the one place the runtime keeps process-wide state.
void prepare_gpu(int gpu) {
  int n = cuda_device_count();
  CurrentGpuGuard restore(gpu);       // the caller's current GPU is its own again at the end
  DP_CUDA_CHECK(cudaSetDevice(gpu));  // checked: peer access is enabled from the current GPU
  cudaMemPool_t pool = nullptr;
  DP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, gpu));
  uint64_t keep_all = UINT64_MAX;
  DP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
  for (int peer = 0; peer < n; ++peer) {
    if (peer == gpu) continue;
    int can = 0;
    DP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, gpu, peer));
    if (!can) continue;
    // Peer access only speeds copies up: a failure is logged (and the per-thread error
    // cleared, so the next launch does not report it), never fatal.
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (e != cudaErrorPeerAccessAlreadyEnabled)
        DP_LOG_ERROR("GPU " << gpu << ": peer access to GPU " << peer
                            << " not enabled (its memory is read through copies): "
                            << cudaGetErrorString(e));
    }
    if (e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled)
      peer_open().enabled(gpu, peer) = true;
    // `peer` may read and write memory that `gpu`'s pool hands out.
    int back = 0;
    DP_CUDA_CHECK(cudaDeviceCanAccessPeer(&back, peer, gpu));
    if (back) {
      cudaMemAccessDesc access{};
      access.location.type = cudaMemLocationTypeDevice;
      access.location.id = peer;
      access.flags = cudaMemAccessFlagsProtReadWrite;
      e = cudaMemPoolSetAccess(pool, &access, 1);
      if (e != cudaSuccess) {
        cudaGetLastError();
        DP_LOG_ERROR("GPU " << gpu << ": its memory pool is not accessible from GPU " << peer
                            << " (read through copies): " << cudaGetErrorString(e));
      } else {
        peer_open().pool_open(gpu, peer) = true;
      }
    }
  }
}

void prepare_gpu_once(int gpu) {
  static const int n = cuda_device_count();
  static std::unique_ptr<std::once_flag[]> flags(new std::once_flag[n > 0 ? n : 1]);
  std::call_once(flags[gpu], prepare_gpu, gpu);  // a throw leaves the flag unset: retried
}

}  // namespace
#endif

void MemoryStats::on_alloc(int64_t bytes) {
  int64_t now = current.fetch_add(bytes) + bytes;
  int64_t p = peak.load();
  while (now > p && !peak.compare_exchange_weak(p, now)) {
  }
  int64_t w = window_peak.load();
  while (now > w && !window_peak.compare_exchange_weak(w, now)) {
  }
}

DeviceContext::DeviceContext(Device device, ContextOptions options)
    : device_(device), options_(options), memory_(std::make_shared<MemoryStats>()) {
  if (device.is_cpu()) {
#ifdef DP_TSAN_ONE_THREAD
    // ThreadSanitizer build: each CPU context runs its parallel loops on the calling thread
    // alone. Debian's oneTBB is not instrumented, so TSAN cannot see its task hand-offs and
    // reports every reused task object as a race; what this build checks is the engine's own
    // threads (workers, process groups, launcher), which stay as many as without it.
    const int hw = 1;
#else
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
    cpu_threads_ = options.cpu_threads > 0 ? std::min(options.cpu_threads, hw) : hw;
    arena_ = std::make_unique<tbb::task_arena>(cpu_threads_);
    if (options.caching == Caching::on)
      block_cache_ = std::make_shared<BlockCache>(device, nullptr, memory_);
    return;
  }
#if DP_HAVE_CUDA
  prepare_gpu_once(physical_gpu(device));
  DP_CUDA_CHECK(cudaSetDevice(physical_gpu(device)));
  cudaStream_t s = nullptr;
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
  int gpu = physical_gpu(device);
  stream_owner_ = std::shared_ptr<void>(s, [gpu](void* p) {
    // Destructors log, never throw. At process exit the runtime may already be unloading.
    cudaSetDevice(gpu);
    cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(p));
    if (e == cudaSuccess) e = cudaStreamDestroy(static_cast<cudaStream_t>(p));
    if (e != cudaSuccess && e != cudaErrorCudartUnloading)
      DP_LOG_ERROR("destroying a CUDA stream: " << cudaGetErrorString(e));
  });
  cublasLtHandle_t lt = nullptr;
  DP_CUBLAS_CHECK(cublasLtCreate(&lt));
  cublaslt_ = lt;
  cudnnHandle_t dnn = nullptr;
  DP_CUDNN_CHECK(cudnnCreate(&dnn));
  DP_CUDNN_CHECK(cudnnSetStream(dnn, s));
  cudnn_ = dnn;
  if (options.caching == Caching::on)
    block_cache_ = std::make_shared<BlockCache>(device, stream_owner_, memory_);
#else
  DP_THROW("device " << device << " is not usable: " << cuda_unavailable_reason());
#endif
}

DeviceContext::~DeviceContext() {
  // Nothing takes from the cache any more: its idle blocks go now, the rest as their tensors do
  // (a model kept past its engine held every block its workers had cached).
  if (block_cache_) block_cache_->close();
#if DP_HAVE_CUDA
  if (device_.is_cuda()) {
    // Destructors log, never throw. At process exit the runtime may already be unloading.
    auto quiet = [](cudaError_t e, const char* what) {
      if (e != cudaSuccess && e != cudaErrorCudartUnloading)
        DP_LOG_ERROR(what << ": " << cudaGetErrorString(e));
    };
    cudaSetDevice(physical_gpu(device_));
    states_.clear();  // the plan caches' descriptors go before the handles
    if (fault_record_)
      quiet(cudaFreeAsync(fault_record_, static_cast<cudaStream_t>(stream_)),
            "cudaFreeAsync(fault record)");
    if (workspace_)
      quiet(cudaFreeAsync(workspace_, static_cast<cudaStream_t>(stream_)),
            "cudaFreeAsync(workspace)");
    for (void* p : retired_workspaces_)
      quiet(cudaFreeAsync(p, static_cast<cudaStream_t>(stream_)), "cudaFreeAsync(workspace)");
    if (stream_)
      quiet(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize");
    if (cudnn_) cudnnDestroy(static_cast<cudnnHandle_t>(cudnn_));
    if (cublaslt_) cublasLtDestroy(static_cast<cublasLtHandle_t>(cublaslt_));
    // The stream itself goes when the last tensor allocated on it does (stream_owner_).
  }
#endif
}

void* DeviceContext::workspace(size_t bytes) {
  DP_CHECK(device_.is_cuda(), "workspace: only CUDA contexts have one, not " << device_);
#if DP_HAVE_CUDA
  if (bytes > workspace_bytes_) {
    refuse_in_capture("growing the workspace");
    auto s = static_cast<cudaStream_t>(stream_);
    // A live graph's kernels may hold the old buffer's address: kept until none lives (freed in
    // stream order after every replay queued so far).
    if (workspace_) retired_workspaces_.push_back(workspace_);
    if (live_graphs_->load() == 0) {
      for (void* p : retired_workspaces_) DP_CUDA_CHECK(cudaFreeAsync(p, s));
      retired_workspaces_.clear();
    }
    workspace_ = nullptr;
    workspace_bytes_ = 0;
    cudaError_t e = cudaMallocAsync(&workspace_, bytes, s);
    if (e != cudaSuccess) {
      workspace_ = nullptr;
      cudaGetLastError();  // handled here: the next launch on this thread must not report it
      DP_THROW("out of memory on " << device_ << " allocating a workspace of " << bytes
                                   << " bytes: " << cudaGetErrorString(e));
    }
    workspace_bytes_ = bytes;
  }
#else
  (void)bytes;
#endif
  return workspace_;
}

uint64_t* DeviceContext::fault_record() {
  DP_CHECK(device_.is_cuda(), "fault_record: only CUDA contexts have one, not " << device_);
#if DP_HAVE_CUDA
  if (!fault_record_) {
    refuse_in_capture("making the fault record");
    auto s = static_cast<cudaStream_t>(stream_);
    make_current();
    void* p = nullptr;
    DP_CUDA_CHECK(cudaMallocAsync(&p, sizeof(uint64_t) * kFaultWords, s));
    fault_record_ = static_cast<uint64_t*>(p);
    DP_CUDA_CHECK(cudaMemsetAsync(fault_record_, 0xff, sizeof(uint64_t) * kFaultWords, s));
  }
#endif
  return fault_record_;
}

void DeviceContext::check_faults() {
#if DP_HAVE_CUDA
  if (!fault_text_ || !fault_record_) return;
  FaultText text = fault_text_;
  fault_text_ = nullptr;  // disarmed: reads until the next armed op cost nothing
  auto s = static_cast<cudaStream_t>(stream_);
  uint64_t record[kFaultWords];
  DP_CUDA_CHECK(cudaMemcpyAsync(record, fault_record_, sizeof record, cudaMemcpyDeviceToHost, s));
  DP_CUDA_CHECK(cudaStreamSynchronize(s));
  if (record[0] == ~uint64_t{0}) return;
  DP_CUDA_CHECK(cudaMemsetAsync(fault_record_, 0xff, sizeof record, s));  // usable again
  throw Error(text(record));
#endif
}

tbb::task_arena& DeviceContext::arena() {
  DP_CHECK(arena_ != nullptr, "arena: " << device_ << " is not a CPU device");
  return *arena_;
}

void DeviceContext::make_current() const {
#if DP_HAVE_CUDA
  if (device_.is_cuda()) DP_CUDA_CHECK(cudaSetDevice(physical_gpu(device_)));
#endif
}

void DeviceContext::synchronize() {
  note_host_sync();
#if DP_HAVE_CUDA
  if (stream_) {
    make_current();
    DP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
    check_faults();
  }
#endif
}

void DeviceContext::refuse_in_capture(const char* what) const {
  if (!capturing()) return;
  const std::string where = RangeNames::innermost();
  DP_THROW(what << " on " << device_ << " while a graph captures there"
                << (where.empty() ? "" : " (in " + where + ")") << ": the work is not capturable");
}

namespace {
std::string in_range(const std::string& where) {
  return where.empty() ? std::string() : " (in " + where + ")";
}
// Argument k's name in a dispatch's argument list ("y, x, s.outer": split at the commas outside
// brackets).
std::string argument_name(const char* names, size_t k) {
  std::vector<std::string> split(1);
  int depth = 0;
  for (const char* c = names ? names : ""; *c; ++c) {
    if (*c == '(' || *c == '[' || *c == '{' || *c == '<') ++depth;
    if (*c == ')' || *c == ']' || *c == '}' || *c == '>') --depth;
    if (*c == ',' && depth == 0) {
      split.emplace_back();
    } else if (*c != ' ' || !split.back().empty()) {
      split.back() += *c;
    }
  }
  return k < split.size() ? split[k] : "#" + std::to_string(k + 1);
}
const char* const kReplayKeepsWhatCaptureSaw =
    ", and a replay would repeat what the capture saw: a value that changes from step to step "
    "belongs in a device kernels::Scalar, or its layer calls Module::host_values_changed() when "
    "it changes (docs/dp-bench.md)";
}  // namespace

void DeviceContext::note_op(OpNote n) {
  if (!capturing()) {
    notes_->push_back(std::move(n));
    return;
  }
  const size_t i = notes_checked_++;
  if (i >= notes_->size())
    DP_THROW("the work changed between steps on "
             << device_ << ": the capture queues op " << n.op << in_range(n.where) << " after the "
             << notes_->size() << (notes_->size() == 1 ? " op" : " ops")
             << " the step before it queued" << kReplayKeepsWhatCaptureSaw);
  const OpNote& was = (*notes_)[i];
  if (std::strcmp(was.op, n.op) != 0 || was.args.size() != n.args.size())
    DP_THROW("the work changed between steps on "
             << device_ << ": op " << i + 1 << " of the capture is " << n.op << in_range(n.where)
             << " where the step before it queued " << was.op << in_range(was.where)
             << kReplayKeepsWhatCaptureSaw);
  for (size_t k = 0; k < n.args.size(); ++k)
    if (n.args[k] != was.args[k])
      DP_THROW("a host value changed between steps on "
               << device_ << in_range(n.where) << ": " << n.op << "'s argument `"
               << argument_name(n.names, k) << "` was " << was.args[k]
               << " at the step before the capture and is " << n.args[k] << " now"
               << kReplayKeepsWhatCaptureSaw);
}

void DeviceContext::check_all_noted() const {
  if (!notes_ || notes_checked_ >= notes_->size()) return;
  const OpNote& missing = (*notes_)[notes_checked_];
  DP_THROW("the work changed between steps on "
           << device_ << ": the capture queued " << notes_checked_
           << (notes_checked_ == 1 ? " op" : " ops") << " where the step before it queued "
           << notes_->size() << " (the first missing: " << missing.op << in_range(missing.where)
           << ")" << kReplayKeepsWhatCaptureSaw);
}

Tensor DeviceContext::graph_arg(const Tensor& t) {
  if (!t.defined() || !t.storage()->data()) return t;
  const Storage& s = *t.storage();
  if (!block_cache_ || !block_cache_->reserved_now(s.data())) return t;
  std::shared_ptr<Storage>& borrowed = graph_borrows_[&s];
  // A handle made for an earlier storage at this address (freed since) that views another
  // block is replaced; one that views this block is the same memory.
  if (!borrowed || borrowed->data() != s.data() || borrowed->bytes() != s.bytes())
    borrowed = Storage::borrow(s);
  return t.rebased(borrowed);
}

bool direct_access(Device reader, Device owner) {
  if (reader.is_cpu() || owner.is_cpu()) return reader.is_cpu() && owner.is_cpu();
#if DP_HAVE_CUDA
  const int r = physical_gpu(reader), o = physical_gpu(owner);
  if (r == o) return true;
  prepare_gpu_once(r);  // the reader's peer access and the owner's pool access: what this
  prepare_gpu_once(o);  // answer relies on
  return peer_open().enabled(r, o) && peer_open().pool_open(o, r);
#else
  return false;
#endif
}

namespace {
// This thread's contexts: the ones bound by a ContextScope, and the defaults it made.
struct ThreadContexts {
  std::map<Device, DeviceContext*> bound;
  std::map<Device, std::unique_ptr<DeviceContext>> defaults;
};
ThreadContexts& thread_contexts() {
  thread_local ThreadContexts t;
  return t;
}
}  // namespace

ContextScope::ContextScope(DeviceContext& ctx) : device_(ctx.device()) {
  auto& bound = thread_contexts().bound;
  auto it = bound.find(device_);
  previous_ = it == bound.end() ? nullptr : it->second;
  bound[device_] = &ctx;
}

ContextScope::~ContextScope() {
  auto& bound = thread_contexts().bound;
  if (previous_)
    bound[device_] = previous_;
  else
    bound.erase(device_);
}

namespace {
thread_local DeviceContext* capturing_here = nullptr;
}  // namespace

DeviceContext* capturing_on_this_thread() {
  return capturing_here;
}

namespace detail {
void set_capturing_on_this_thread(DeviceContext* ctx) {
  capturing_here = ctx;
}
}  // namespace detail

DeviceContext* existing_context(Device device) {
  auto& t = thread_contexts();
  auto it = t.bound.find(device);
  if (it != t.bound.end()) return it->second;
  auto d = t.defaults.find(device);
  return d == t.defaults.end() ? nullptr : d->second.get();
}

DeviceContext& context(Device device) {
  auto& t = thread_contexts();
  auto it = t.bound.find(device);
  if (it != t.bound.end()) return *it->second;
  auto& d = t.defaults[device];
  if (!d) {
    try {
      d = std::make_unique<DeviceContext>(device);
    } catch (...) {
      t.defaults.erase(device);
      throw;
    }
  }
  return *d;
}

}  // namespace kernels
