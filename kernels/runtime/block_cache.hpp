// BlockCache: the memory of a context that runs the same step again and again (an engine's
// worker thread). A freed block goes back to the cache, and the next request of exactly its
// size takes it (the last one freed first). From the second step of a shape on, a step
// therefore allocates nothing, and the same sequence of requests gets the same addresses,
// which is what a captured CUDA graph needs. A new shape makes its blocks once.
//
// CUDA blocks come from cudaMallocAsync on the context's stream and are reused only on that
// stream (stream order makes the reuse safe, as for the driver's own pool); host blocks are
// 256-byte aligned, as cudaMalloc's are. The cache frees its idle blocks when its context goes
// (close()), and each block still held when the tensor holding it does.
//
// Bounded on the host: a GPU's cache gives its idle blocks back when the device is out of
// memory, but the host heap never fails under overcommit, so a CPU device whose step shapes
// keep changing (batches bucketed by length, a sweep) kept every size it ever saw (1.9 GB after
// 300 batch sizes of a 3.7 MB step). On a CPU device a miss outside a capture first gives the
// idle blocks back, the sizes asked for longest ago first, until no more than kHostIdleBytes or
// the bytes in use (the larger) stay: a step of a shape seen before misses nothing, so it is
// never affected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels/runtime/device.hpp"

namespace kernels {

struct MemoryStats;

// One allocation from the device (host heap or cudaMallocAsync on `stream`), counted in
// stats.allocations; throws naming the device and size when it fails.
void* allocate_device_bytes(Device device, size_t bytes, void* stream, MemoryStats& stats);
// Throws the error of an allocation made while a graph captures on `device` (the same words on
// every backend: a CUDA capture cannot take new memory, and CPU devices refuse what it refuses),
// a CaptureMemoryError.
[[noreturn]] void refuse_capture_allocation(Device device, size_t bytes);
// Frees what allocate_device_bytes returned (stream-ordered on `stream` for CUDA). Never throws.
void free_device_bytes(Device device, void* p, size_t bytes, void* stream) noexcept;

class BlockCache;

// The blocks a captured graph (kernels/runtime/graph.hpp) uses: every block taken while the
// reservation is active is its own; freed, the block goes back to the reservation's list (reused
// only by takes during the reservation), so nothing outside the graph is handed memory a replay
// writes. When the reservation dies (with its graph) its blocks return to the cache.
class BlockReservation {
 public:
  ~BlockReservation();

 private:
  friend class BlockCache;
  std::shared_ptr<BlockCache> cache_;
  std::map<size_t, std::vector<void*>> free_;
  std::unordered_set<void*> owned_;
};

class BlockCache : public std::enable_shared_from_this<BlockCache> {
 public:
  // The idle bytes a CPU device's cache keeps past the bytes in use before a miss hands them
  // back (see the top of this file).
  static constexpr int64_t kHostIdleBytes = int64_t{256} << 20;

  // `stream_owner` keeps the CUDA stream alive as long as the cache (empty on CPU devices).
  BlockCache(Device device, std::shared_ptr<void> stream_owner, std::shared_ptr<MemoryStats> stats);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // ensures a block of `bytes` bytes: a cached one of exactly that size, else a new one (when
  // the device is out of memory, after handing the idle cached blocks back to it). While a
  // reservation is active (a graph captures), a miss throws on every backend
  // (refuse_capture_allocation).
  void* take(size_t bytes);
  // requires p came from take(bytes). ensures the next take(bytes) may return it.
  void give_back(void* p, size_t bytes) noexcept;

  // requires no reservation active; `continued` (when given) this cache's. ensures the blocks
  // taken until end_reservation() belong to the returned reservation: `continued`, whose free
  // blocks they may be, or a new one.
  std::shared_ptr<BlockReservation> begin_reservation(
      std::shared_ptr<BlockReservation> continued = nullptr);
  void end_reservation();
  // Whether block p belongs to the active reservation (taken while the graph captures).
  bool reserved_now(void* p);
  // Bytes of the idle blocks it keeps for reuse (not a reservation's).
  int64_t idle_bytes();
  // The context is gone: the idle blocks go back to the device now, and each block given back
  // from here on too (nothing will take it).
  void close() noexcept;

 private:
  friend class BlockReservation;
  // Hands every idle block (not a reservation's) back to the device; whether there was one.
  bool release_idle() noexcept;
  // Hands idle blocks back, the sizes taken longest ago first, until at most `keep` bytes stay.
  void release_oldest(int64_t keep) noexcept;

  Device device_;
  std::shared_ptr<void> stream_owner_;
  std::shared_ptr<MemoryStats> stats_;
  std::mutex mutex_;  // a tensor may die on another thread than the one that made it
  std::map<size_t, std::vector<void*>> free_;
  int64_t idle_bytes_ = 0;  // in free_
  uint64_t takes_ = 0;
  std::map<size_t, uint64_t> last_take_;  // CPU, by size: the take that asked for it last
  bool closed_ = false;
  BlockReservation* active_ = nullptr;
  std::unordered_map<void*, BlockReservation*> owner_;  // blocks of live reservations
};

}  // namespace kernels
