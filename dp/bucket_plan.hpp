// The gradient bucket plan, one for threaded DP (reduce to device 0) and DDP (all-reduce).
//
// Buckets are taken in reverse parameter order, because backward produces the last layers'
// gradients first; the first bucket is capped at `first_cap` bytes so that communication starts
// early, the others at `cap` bytes (PyTorch's reducer: 1 MiB and 25 MiB). A bucket is one
// contiguous range of the flat gradient buffer. Its bounds come from parameter offsets and the
// buffer's end, never from summed sizes, so any padding between parameters lies inside a bucket
// and the buckets tile the whole buffer [0, buffer_end).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/runtime/error.hpp"
#include "nn/module.hpp"

namespace dp {

// Elements [offset, offset + numel) of the flat gradient buffer.
struct Bucket {
  int64_t offset = 0;
  int64_t numel = 0;  // gaps between its parameters included
  int n_params = 0;   // parameters with elements in this bucket
};

// Where a parameter lies in the flat buffer, in elements.
struct ParamExtent {
  int64_t offset = 0;
  int64_t numel = 0;
};

struct BucketPlan {
  std::vector<Bucket> buckets;  // bucket 0 holds the last parameters
};

// requires params in registration order with ascending offsets, each inside [0, buffer_end);
// first_cap, cap, elem_bytes > 0.
// ensures buckets tile [0, buffer_end) from the end backwards; a bucket closes as soon as its
// range reaches its cap, so a parameter larger than the cap gets a bucket of its own.
inline BucketPlan make_bucket_plan(const std::vector<ParamExtent>& params, int64_t buffer_end,
                                   int64_t first_cap, int64_t cap, int64_t elem_bytes = 4) {
  DP_CHECK(first_cap > 0 && cap > 0 && elem_bytes > 0,
           "bucket plan: caps " << first_cap << " and " << cap << " bytes must be positive");
  BucketPlan plan;
  int64_t end = buffer_end;  // where the bucket being filled ends: the previous one's start
  Bucket open{end, 0, 0};
  for (size_t k = params.size(); k-- > 0;) {
    const ParamExtent& p = params[k];
    if (p.numel == 0) continue;
    DP_CHECK(p.offset >= 0 && p.offset + p.numel <= end,
             "bucket plan: parameter #" << k << " [" << p.offset << ", " << p.offset + p.numel
                                        << ") is out of order or past " << end);
    open.offset = p.offset;
    open.numel = end - p.offset;
    ++open.n_params;
    if (open.numel * elem_bytes >= (plan.buckets.empty() ? first_cap : cap)) {
      plan.buckets.push_back(open);
      end = open.offset;
      open = Bucket{end, 0, 0};
    }
  }
  if (open.n_params > 0) plan.buckets.push_back(open);
  // Elements before the first parameter (padding) belong to the last bucket.
  if (!plan.buckets.empty()) {
    Bucket& last = plan.buckets.back();
    last.numel += last.offset;
    last.offset = 0;
  }
  return plan;
}

// The plan over a materialised module's flat gradient buffer (named_parameters order).
inline BucketPlan make_bucket_plan(nn::Module& module, int64_t first_cap, int64_t cap) {
  std::vector<ParamExtent> extents;
  for (auto& [name, p] : module.named_parameters()) extents.push_back({p->offset, p->numel()});
  return make_bucket_plan(extents, module.flat_grads().numel(), first_cap, cap,
                          static_cast<int64_t>(kernels::dtype_size(module.flat_grads().dtype())));
}

// How far one backward has come through a plan's buckets, as its hooks report parameters whose
// gradient is final, one by one and in any order: the leading buckets whose every parameter is
// final are the ones an engine may hand on, in bucket order (DP's pulls to device 0, DDP's
// all-reduces), so that every device and rank moves the same buckets in the same order.
// Touched by one thread (the device's worker or the rank's) during a step.
class BucketProgress {
 public:
  BucketProgress() = default;
  // requires *buckets outlives this object. ensures nothing is final.
  explicit BucketProgress(const std::vector<Bucket>* buckets)
      : buckets_(buckets), count_(buckets->size(), 0) {}
  // A parameter at [offset, offset + numel) of the flat gradient is final (nothing for one
  // without elements: its bucket does not wait for it). requires the parameter in the plan.
  void param_ready(int64_t offset, int64_t numel) {
    if (numel == 0) return;
    const std::vector<Bucket>& b = *buckets_;
    // Buckets tile the buffer from its end backwards: the first whose start is at or before it.
    const int k =
        static_cast<int>(std::partition_point(b.begin(), b.end(),
                                              [&](const Bucket& x) { return x.offset > offset; }) -
                         b.begin());
    DP_CHECK(k < static_cast<int>(b.size()) && offset < b[k].offset + b[k].numel,
             "BucketProgress: parameter at " << offset << " lies in no bucket of the plan");
    ++count_[k];
    while (ready_ < static_cast<int>(b.size()) && count_[ready_] >= b[ready_].n_params) ++ready_;
  }
  // Every bucket is final, also those whose parameters got no gradient (unused layers).
  void all_ready() { ready_ = static_cast<int>(count_.size()); }
  // A new backward: nothing final.
  void clear() {
    std::fill(count_.begin(), count_.end(), 0);
    ready_ = 0;
  }
  // Leading buckets whose every parameter is final.
  int ready() const { return ready_; }
  // Nothing reported since the last clear().
  bool untouched() const {
    if (ready_ != 0) return false;
    for (int c : count_)
      if (c != 0) return false;
    return true;
  }

 private:
  const std::vector<Bucket>* buckets_ = nullptr;
  std::vector<int> count_;  // per bucket: its parameters final so far
  int ready_ = 0;
};

}  // namespace dp
