// PlanCache: key -> plan, made once and then looked up, with hit and miss counters. Plain C++
// with no CUDA types: the cuBLASLt GEMM plans and the cuDNN convolution plans are values of
// caches owned by a DeviceContext (DeviceContext::state<T>()), one per context, never global.
// Keys are small ordered tuples (shapes, strides, dtypes, flags) packed in a std::vector or
// std::array; std::map needs only operator<.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>

namespace kernels {

template <class Key, class Plan>
class PlanCache {
 public:
  // At most `capacity` plans; a miss on a full cache drops every plan first (shapes in training
  // repeat, so a full cache means a shape-changing workload, where old plans are stale anyway).
  explicit PlanCache(size_t capacity = 1024) : capacity_(capacity > 0 ? capacity : 1) {}

  // The plan for `key`: the cached one (a hit), else `make()` stored and returned (a miss).
  // If make() throws, nothing is stored and the miss still counts. References stay valid until
  // the next miss that finds the cache full, or clear().
  template <class Make>
  Plan& get(const Key& key, Make&& make) {
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      ++hits_;
      return it->second;
    }
    ++misses_;
    Plan plan = make();
    if (plans_.size() >= capacity_) plans_.clear();
    return plans_.emplace(key, std::move(plan)).first->second;
  }

  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }
  size_t size() const { return plans_.size(); }
  void clear() { plans_.clear(); }

 private:
  size_t capacity_;
  std::map<Key, Plan> plans_;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

}  // namespace kernels
