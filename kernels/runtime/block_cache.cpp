#include "kernels/runtime/block_cache.hpp"

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "kernels/runtime/context.hpp"
#include "kernels/runtime/error.hpp"

#if DP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/runtime/cuda_check.hpp"
#endif

namespace kernels {

namespace {
// Whether a graph captures on `stream` (CUDA devices; never on CPU ones).
bool stream_capturing(Device device, void* stream) {
#if DP_HAVE_CUDA
  if (device.is_cuda()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture) == cudaSuccess &&
           capture != cudaStreamCaptureStatusNone;
  }
#endif
  (void)device, (void)stream;
  return false;
}
}  // namespace

void refuse_capture_allocation(Device device, size_t bytes) {
  std::ostringstream os;
  os << "allocating " << bytes << " bytes on " << device
     << " while a graph captures: the work takes memory the cache does not hold (run it once "
        "uncaptured first)";
  throw CaptureMemoryError(detail::error_text(__FILE__, __LINE__, nullptr, os.str()));
}

void* allocate_device_bytes(Device device, size_t bytes, void* stream, MemoryStats& stats) {
  void* p = nullptr;
  if (device.is_cpu()) {
    // 256-byte aligned, as cudaMalloc's blocks are: flat-buffer views keep their alignment.
    size_t rounded = (bytes + 255) / 256 * 256;
    p = std::aligned_alloc(256, rounded);
    DP_CHECK(p != nullptr, "out of host memory allocating " << bytes << " bytes on " << device);
  } else {
#if DP_HAVE_CUDA
    CurrentGpuGuard on(physical_gpu(device));
    // Inside a capture this would become the graph's own allocation, which the cache cannot
    // hand back: a captured step must find its blocks cached (kernels/runtime/graph.hpp).
    if (stream_capturing(device, stream)) refuse_capture_allocation(device, bytes);
    cudaError_t e = cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) {
      cudaGetLastError();  // handled here: the next launch on this thread must not report it
      DP_THROW("out of memory on " << device << " allocating " << bytes
                                   << " bytes: " << cudaGetErrorString(e));
    }
#else
    (void)stream;
    DP_THROW("device " << device << " is not usable: " << cuda_unavailable_reason());
#endif
  }
  stats.allocations.fetch_add(1);
  return p;
}

void free_device_bytes(Device device, void* p, size_t bytes, void* stream) noexcept {
  if (!p) return;
  if (device.is_cpu()) {
    std::free(p);
    return;
  }
#if DP_HAVE_CUDA
  // The caller's current GPU is left as it was (a thread may hold tensors of several GPUs).
  CurrentGpuGuard on(physical_gpu(device));
  // Stream-ordered free on the stream the block was allocated on: work queued there that still
  // reads it finishes first.
  cudaError_t e = cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess && e != cudaErrorCudartUnloading)
    DP_LOG_ERROR("freeing " << bytes << " bytes on " << device << ": " << cudaGetErrorString(e));
#else
  (void)bytes;
  (void)stream;
#endif
}

BlockCache::BlockCache(Device device, std::shared_ptr<void> stream_owner,
                       std::shared_ptr<MemoryStats> stats)
    : device_(device), stream_owner_(std::move(stream_owner)), stats_(std::move(stats)) {}

BlockCache::~BlockCache() {
  for (auto& [bytes, blocks] : free_)
    for (void* p : blocks) free_device_bytes(device_, p, bytes, stream_owner_.get());
}

bool BlockCache::release_idle() noexcept {
  std::map<size_t, std::vector<void*>> idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    idle.swap(free_);  // a reservation's blocks stay: its graph's replays use them
    idle_bytes_ = 0;
    last_take_.clear();
  }
  bool any = false;
  for (auto& [bytes, blocks] : idle)
    for (void* p : blocks) {
      free_device_bytes(device_, p, bytes, stream_owner_.get());
      any = true;
    }
  return any;
}

int64_t BlockCache::idle_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_bytes_;
}

void BlockCache::close() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  release_idle();
}

void BlockCache::release_oldest(int64_t keep) noexcept {
  std::vector<std::pair<size_t, std::vector<void*>>> gone;
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<uint64_t, size_t>> by_age;  // (last take, size) of the idle lists
    for (auto& [bytes, blocks] : free_)
      if (!blocks.empty()) by_age.emplace_back(last_take_[bytes], bytes);
    std::sort(by_age.begin(), by_age.end());
    for (const auto& [tick, bytes] : by_age) {
      if (idle_bytes_ <= keep) break;
      std::vector<void*>& blocks = free_[bytes];
      idle_bytes_ -= static_cast<int64_t>(bytes * blocks.size());
      gone.emplace_back(bytes, std::move(blocks));
      free_.erase(bytes);
      last_take_.erase(bytes);  // bounded by the sizes held
    }
  } catch (...) {  // no memory for the lists: what was taken out still goes back below
  }
  for (auto& [bytes, blocks] : gone)
    for (void* p : blocks) free_device_bytes(device_, p, bytes, stream_owner_.get());
}

namespace {
// The last block of `bytes` in `lists`, taken out; nullptr when there is none.
void* pop_block(std::map<size_t, std::vector<void*>>& lists, size_t bytes) {
  auto it = lists.find(bytes);
  if (it == lists.end() || it->second.empty()) return nullptr;
  void* p = it->second.back();
  it->second.pop_back();
  return p;
}
}  // namespace

void* BlockCache::take(size_t bytes) {
  bool bounded = false;
  int64_t keep = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (device_.is_cpu()) last_take_[bytes] = ++takes_;  // only the host's bound reads it
    void* p = active_ ? pop_block(active_->free_, bytes) : nullptr;
    if (p) return p;  // already the reservation's
    p = pop_block(free_, bytes);
    if (p) {
      idle_bytes_ -= static_cast<int64_t>(bytes);
      if (active_) {
        active_->owned_.insert(p);
        owner_[p] = active_;
      }
      return p;
    }
    // A capture's work must find its memory here (Graph::capture), on CPU devices as on CUDA.
    if (active_) refuse_capture_allocation(device_, bytes);
    // The host heap does not run out as a GPU does: the idle blocks go back past a bound.
    keep = std::max(kHostIdleBytes, stats_->current.load());
    bounded = device_.is_cpu() && idle_bytes_ > keep;
  }
  if (bounded) release_oldest(keep);
  void* p = nullptr;
  try {
    p = allocate_device_bytes(device_, bytes, stream_owner_.get(), *stats_);
  } catch (const Error&) {
    // Out of memory (or capturing, where nothing may be freed either): the idle blocks of
    // other sizes go back to the device, then the allocation is tried once more.
    if (stream_capturing(device_, stream_owner_.get()) || !release_idle()) throw;
    p = allocate_device_bytes(device_, bytes, stream_owner_.get(), *stats_);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (active_) {
    active_->owned_.insert(p);
    owner_[p] = active_;
  }
  return p;
}

void BlockCache::give_back(void* p, size_t bytes) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    auto it = owner_.find(p);
    if (it != owner_.end()) {
      it->second->free_[bytes].push_back(p);
    } else if (closed_) {
      free_device_bytes(device_, p, bytes, stream_owner_.get());
    } else {
      free_[bytes].push_back(p);
      idle_bytes_ += static_cast<int64_t>(bytes);
    }
  } catch (...) {  // no memory for the list: the block goes back to the device instead
    if (auto it = owner_.find(p); it != owner_.end()) {
      it->second->owned_.erase(p);
      owner_.erase(it);
    }
    free_device_bytes(device_, p, bytes, stream_owner_.get());
  }
}

std::shared_ptr<BlockReservation> BlockCache::begin_reservation(
    std::shared_ptr<BlockReservation> continued) {
  DP_CHECK(!continued || continued->cache_.get() == this,
           "BlockCache on " << device_ << ": a reservation of another cache continued");
  std::shared_ptr<BlockReservation> r = std::move(continued);
  if (!r) {
    r = std::make_shared<BlockReservation>();
    r->cache_ = shared_from_this();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  DP_CHECK(active_ == nullptr, "BlockCache on " << device_ << ": a reservation is active already");
  active_ = r.get();
  return r;
}

bool BlockCache::reserved_now(void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!active_) return false;
  auto it = owner_.find(p);
  return it != owner_.end() && it->second == active_;
}

void BlockCache::end_reservation() {
  std::lock_guard<std::mutex> lock(mutex_);
  active_ = nullptr;
}

BlockReservation::~BlockReservation() {
  BlockCache& cache = *cache_;
  std::lock_guard<std::mutex> lock(cache.mutex_);
  if (cache.active_ == this) cache.active_ = nullptr;
  for (void* p : owned_) cache.owner_.erase(p);  // live blocks go to the cache when freed
  for (auto& [bytes, blocks] : free_)
    for (void* p : blocks) try {
        if (cache.closed_) {
          free_device_bytes(cache.device_, p, bytes, cache.stream_owner_.get());
          continue;
        }
        cache.free_[bytes].push_back(p);
        cache.idle_bytes_ += static_cast<int64_t>(bytes);
      } catch (...) {  // no memory for the list: the block goes back to the device
        free_device_bytes(cache.device_, p, bytes, cache.stream_owner_.get());
      }
}

}  // namespace kernels
