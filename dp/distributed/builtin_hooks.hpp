// DDP's own reducers, written as comm hooks (dp/distributed/comm_hook.hpp) like research code's:
// what DistributedDataParallel hands each ready bucket to when DdpOptions::comm_hook is unset
// (builtin_hook(DdpOptions::comm_dtype)), and what GroupCrossNode sums a hybrid run's buckets
// over nodes with. PyTorch's default allreduce_hook and its bf16_compress_hook.
//
// Both are capturable (a graphed DDP step holds their collectives where the group can) and know
// their bytes before they run. With one rank nothing is handed to the group: the sum of one
// bucket is itself (the bf16 hook still rounds, so one rank steps as its peers would).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dp/distributed/comm_hook.hpp"

namespace dp::dist {

// The bucket all-reduced (sum) in f32, in place.
class AllReduceHook final : public CommHook {
 public:
  std::string name() const override { return "allreduce"; }
  std::shared_ptr<Work> reduce(GradBucket& b) override;
  bool capturable() const override { return true; }
  void reduce_queued(GradBucket& b) override;
  int64_t bytes_for(int64_t numel, int world) const override;
};

// The bucket rounded once into bf16, all-reduced (sum) in bf16 by the backend, and widened back
// into the f32 gradient when its Work is waited for (complete_queued in a graphed step): half
// the bytes on the wire. Keeps one bf16 buffer per bucket index, made at its first use.
class Bf16CompressHook final : public CommHook {
 public:
  std::string name() const override { return "bf16-allreduce"; }
  std::shared_ptr<Work> reduce(GradBucket& b) override;
  bool capturable() const override { return true; }
  void reduce_queued(GradBucket& b) override;
  void complete_queued(GradBucket& b) override;
  int64_t bytes_for(int64_t numel, int world) const override;

 private:
  // requires b.grad f32. ensures bucket b.index's buffer holds b.grad rounded into bf16.
  kernels::Tensor& round_into_buffer(const GradBucket& b);
  std::vector<kernels::Tensor> buffers_;  // by bucket index
};

// requires dtype f32 or bf16 (throws naming it otherwise). ensures the built-in hook whose
// buckets travel in `dtype`.
std::shared_ptr<CommHook> builtin_hook(kernels::DType dtype);

}  // namespace dp::dist
