// dp::dist::CommHook: how this rank's gradient buckets meet the other ranks' under DDP, written
// by research code (PyTorch's DistributedDataParallel.register_comm_hook). The hybrid mode takes
// one too, for its sums over nodes (dp::dist::GroupCrossNode: each node is a rank there), and so
// does the threaded engine, in place of its sums to device 0 (dp::dist::device_reducers: each
// device is a rank of an in-process group, and device 0 steps with what its hook leaves).
//
//   class MyHook : public dp::dist::CommHook {
//     std::string name() const override { return "my-hook"; }
//     std::shared_ptr<dp::dist::Work> reduce(dp::dist::GradBucket& b) override {
//       return b.group->all_reduce(b.grad);  // what DDP does without a hook
//     }
//   };
//   dp::dist::DdpOptions o;  o.comm_hook = std::make_shared<MyHook>();
//
// DDP's built-in all-reduces are hooks too (dp/distributed/builtin_hooks.hpp: AllReduceHook for
// f32, Bf16CompressHook for a bf16 comm dtype): every bucket goes through this interface.
//
// DDP hands the hook each bucket of the flat gradient as soon as the bucket's gradient is final,
// from backward's hooks, in bucket order on every rank (the same order everywhere, so that the
// hook's collectives match), already scaled by this rank's share of the global batch: the sum of
// the ranks' buckets is the global batch's gradient. What the hook leaves in the bucket when its
// Work is done is what the optimizer steps with, on this rank. Compression with error feedback
// (samples/low_rank_hook.hpp, PowerSGD) keeps its residuals in the hook, per bucket index.
//
// Rules:
//  - collectives only through b.group, none issued from another thread; every rank's hook issues
//    the same collectives in the same order for a bucket (they are matched by order);
//  - the bucket's memory is the gradient's: write the result there; keep no view of it past the
//    step (zero_grad and the next backward write it);
//  - the bytes the hook hands to the group, in reduce() and in its Work's wait(), are the step's
//    communication bytes (DdpStats::comm_bytes, ProcessGroup::payload_bytes), whatever their
//    dtype; a Work's wait() may issue collectives of its own (a second round), as DDP waits for
//    the buckets in bucket order on every rank;
//  - a hook runs host code: a graphed step (dp/graphs.hpp) calls it between its two captured
//    segments, after backward, instead of from the captured backward's hooks, unless it is
//    capturable() (below); a capturable hook's queued ops read the share through b.share_at
//    (a graph that baked the host value b.share in is replayed only at steps of that share:
//    HostShare).
#pragma once

#include <memory>
#include <string>

#include "dp/distributed/process_group.hpp"
#include "kernels/ops.hpp"
#include "kernels/runtime/tensor.hpp"

namespace dp::dist {

// GradBucket::share: a float to the hook (it converts to float, and to a fixed kernels::Scalar).
// While a graph captures a bucket's queued ops (a capturable hook's reduce_queued and
// complete_queued), DDP counts the hook's reads of it: the value read is the one every replay of
// that graph works with, so DdpTrainer replays such a graph only at steps of that same share (a
// step of another share turns its graphs off, saying why). Queued ops read b.share_at instead.
class HostShare {
 public:
  HostShare(float v = 1.f) : value_(v) {}  // NOLINT(google-explicit-constructor): a value
  // A copy reads the value (counted) and counts none of its own reads.
  HostShare(const HostShare& o) : value_(o.get()) {}
  HostShare& operator=(const HostShare& o) {
    value_ = o.get();
    return *this;
  }
  HostShare& operator=(float v) {
    value_ = v;
    return *this;
  }
  operator float() const { return get(); }  // NOLINT(google-explicit-constructor)
  operator kernels::Scalar() const {        // NOLINT(google-explicit-constructor)
    return kernels::Scalar(get());
  }
  // From now on each read adds 1 to *reads (null: none counted). DDP's.
  void count_reads(int* reads) { reads_ = reads; }

 private:
  float get() const {
    if (reads_) ++*reads_;
    return value_;
  }
  float value_;
  int* reads_ = nullptr;
};

// One gradient bucket, as handed to a hook.
struct GradBucket {
  int index = 0;         // 0 .. buckets - 1: the launch order, the same on every rank
  int64_t offset = 0;    // where it starts in the flat gradient (elements)
  kernels::Tensor grad;  // (numel) f32 view of this rank's flat gradient, share-scaled
  // This rank's share of the global batch, which grad was scaled by: the ranks' shares add to
  // 1 (an error-feedback hook keeps grad - share * result, whose sum over ranks is the sum's
  // error).
  HostShare share = 1.f;
  // The same share where an op reads it when it runs (DDP's device copy, written each step): a
  // capturable hook's queued ops take this one (kernels::scale(y, x, b.share_at)), since a
  // captured step replays with the value its ops were queued with, and `share` changes from step
  // to step where the batch's rows or kept tokens do (a token loss's ignore_index).
  kernels::Scalar share_at;
  ProcessGroup* group = nullptr;  // the DDP's group
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // A short name for reports ("powersgd-r4").
  virtual std::string name() const = 0;
  // Starts (or does) bucket b's communication. Returns the Work whose wait() leaves in b.grad
  // what the optimizer steps with (the sum over ranks of their b.grad, or the hook's
  // approximation of it), or null when that is there already on return. DDP waits for the
  // Works in bucket order before the optimizer step.
  virtual std::shared_ptr<Work> reduce(GradBucket& b) = 0;

  // A hook a captured step can hold runs no host code per bucket once captured: reduce_queued
  // queues b's collectives on b.group (ProcessGroup::all_reduce_queued: no Work, no host wait),
  // and complete_queued(b), after the group's join_queued, queues what leaves the result in
  // b.grad. DDP's graphed steps keep the buckets' overlap with backward only with such a hook;
  // with any other, a graphed step calls reduce() between its two captured segments.
  // Default: not capturable (reduce_queued refuses, naming the hook).
  virtual bool capturable() const { return false; }
  virtual void reduce_queued(GradBucket& b);
  virtual void complete_queued(GradBucket& b) { (void)b; }

  // The bytes reduce() hands to a group of `world` ranks for a bucket of `numel` elements, where
  // the hook knows them before it runs (the built-in ones); -1 where only running it tells
  // (DdpStats::comm_bytes then counts what it handed over).
  virtual int64_t bytes_for(int64_t numel, int world) const {
    (void)numel, (void)world;
    return -1;
  }
};

// What DDP and GroupCrossNode call: hook.reduce(b), then a check that the hook wrote into the
// bucket rather than reassigning b.grad (refused naming `who`, the hook and the bucket).
std::shared_ptr<Work> run_hook(CommHook& hook, GradBucket& b, const char* who);

}  // namespace dp::dist
