// dp::dist::DistributedDataParallel: one process per device (PyTorch's DDP).
//
//   at start:  verify that parameter names and shapes agree on every rank (the error names the
//              first mismatched tensor), then broadcast parameters and buffers from rank 0
//   forward:   BatchNorm buffers broadcast from rank 0 first (PyTorch's default) unless they
//              are averaged after backward (BufferSync::average)
//   backward:  gradients land in the flat gradient buffer layer by layer, in reverse; as soon as
//              every parameter of a bucket (a slice of that buffer, in reverse registration
//              order) has its gradient, the bucket's all-reduce is launched asynchronously, so
//              communication overlaps the rest of backward. Buckets launch in index order,
//              which is the same on every rank.
//   finish:    wait for every bucket; then each rank steps its own optimizer (replicas stay
//              bitwise equal because every rank applies the same reduced gradient)
//
// With one rank nothing is handed to the group after the start: a bucket's sum is itself and
// rank 0's buffers are everyone's (the scaling and the comm dtype's rounding still happen).
//
// Each ready bucket goes to one reducer, a comm hook (dp/distributed/comm_hook.hpp): research
// code's when DdpOptions::comm_hook is set, else the built-in all-reduce for the comm dtype
// (dp/distributed/builtin_hooks.hpp). The bytes in the stats are what that reducer handed to
// the group.
//
// Averaging is defined as in DP: each rank scales its bucket by its share of the global batch
// (B_r / B; 1 / world by default), then the all-reduce sums. With uneven shards the result is
// still the gradient of the global batch's mean loss.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dp/bucket_plan.hpp"
#include "dp/distributed/comm_hook.hpp"
#include "dp/distributed/process_group.hpp"
#include "dp/step.hpp"
#include "dp/trace.hpp"
#include "nn/module.hpp"

namespace dp::dist {

using kernels::Device;
using kernels::Tensor;

enum class BufferSync { broadcast, average };

struct DdpOptions {
  int64_t bucket_cap_bytes = 25ll << 20;   // PyTorch's bucket_cap_mb = 25
  int64_t first_bucket_bytes = 1ll << 20;  // a small first bucket starts communication early
  BufferSync buffer_sync = BufferSync::broadcast;
  // The dtype buckets are all-reduced in, without a comm_hook: f32 (AllReduceHook), or bf16
  // (Bf16CompressHook, as PyTorch's bf16_compress_hook: each rank rounds its scaled bucket once,
  // the sum runs in the backend, the result is widened back into the f32 gradient): half the
  // bytes on the wire. dp/distributed/builtin_hooks.hpp.
  kernels::DType comm_dtype = kernels::DType::f32;
  // Research code's reducer (dp/distributed/comm_hook.hpp): each ready bucket is handed to it
  // instead of the built-in one, at any world size (one rank too, so that a lossy hook behaves
  // the same). requires comm_dtype f32 (the hook chooses what travels); not with
  // backward_queued unless the hook is capturable (CommHook::capturable), nor ZeRO-1 (which
  // reduce-scatters instead).
  std::shared_ptr<CommHook> comm_hook;
};

// A slice [offset, offset + numel) of the flat gradient buffer (dp/bucket_plan.hpp).
using dp::Bucket;

// Counters of the last backward, to see the overlap.
struct DdpStats {
  int buckets = 0;
  int launched_before_backward_end = 0;  // all-reduces started while layers were left to run
  double allreduce_wait_ms = 0;          // time finish() waited: communication not hidden
  // Bytes of the buckets all-reduced (in the comm dtype); with a comm hook, what the hook
  // handed to the group.
  int64_t comm_bytes = 0;
  // Per bucket (DistributedDataParallel::bucket_bytes' order): when its all-reduce was issued,
  // in ms after backward began (host time: on CUDA, when the work was enqueued). What the
  // projection's overlap bound starts from; -1 for a bucket not issued this step (under
  // no_sync, or ZeRO-1, which communicates after backward). Sized once: no allocation per step.
  std::vector<double> bucket_ready_ms;
  double backward_ms = 0;  // backward's host time, the ready times' scale
};

class DistributedDataParallel {
 public:
  // requires module materialised on this rank's device; `group` outlives this object.
  DistributedDataParallel(nn::ModulePtr module, ProcessGroup& group, DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // This rank's share of the next step's global batch: its gradient is scaled by
  // local / global before the sum. Default: 1 / world size (equal shards). The one rank of a
  // world of 1 holding the whole batch (share 1, always so under DdpTrainer) skips that pass:
  // a graph captured then holds no scaling.
  void set_batch_share(int64_t local_rows, int64_t global_rows);
  // The share set_batch_share set (1 / world size before it): GradBucket::share's value.
  float batch_share() const { return share_; }
  // The host share (GradBucket::share) research code's hook read while a graph captured this
  // rank's buckets (CommHook::reduce_queued and complete_queued), since the last call, which
  // forgets it; nullopt when none was read. Replays of that graph work with that value: they are
  // right only at steps of the same share (DdpTrainer replays them only then).
  std::optional<float> take_share_read_in_capture();

  Tensor forward(const Tensor& x);
  // forward() without its buffer broadcast (broadcast_buffers()): capturable.
  Tensor forward_local(const Tensor& x);
  // Runs backward; launches bucket all-reduces as gradients become ready (unless in no_sync).
  Tensor backward(const Tensor& dy);
  // Waits for every bucket (and averages buffers when asked). Call before optimizer.step().
  void finish_gradient_sync();

  // A graphed step (dp/graphs.hpp) all-reduces after backward instead of from its hooks, so
  // that backward and the update stay free of collectives and can be captured:
  //   captured:  ddp.backward_local(dy); ddp.stage_buckets();
  //   between:   ddp.all_reduce_staged();
  //   captured:  ... clip, optimizer step
  // Bitwise the gradient of backward() + finish_gradient_sync(): the same scale, rounding and
  // sums, bucket by bucket in the same order; only the overlap with backward is given up.
  // ensures dy's backward ran with no bucket launched (forward's buffer broadcast is the
  // caller's: broadcast_buffers(), outside the capture).
  Tensor backward_local(const Tensor& dy);
  // ensures every bucket is scaled by this rank's share.
  void stage_buckets();
  // requires stage_buckets() queued. ensures every bucket was handed to the reducer (in order)
  // and its result waited for (a 16-bit comm dtype's sums widened back into the gradient), and
  // the buffers averaged when asked; the stats say so (no bucket overlapped).
  void all_reduce_staged();

  // A graphed step whose group can hold collectives in a capture (ProcessGroup::
  // collectives_capturable: NCCL on its GPU, every backend on CPU devices) and whose reducer is
  // capturable (the built-in ones) keeps the overlap:
  //   captured:  ddp.backward_queued(dy);  ... clip, optimizer step
  // Backward hands each bucket to the reducer from its hooks as backward() does, but queued on
  // the group (CommHook::reduce_queued: no Work, no host wait), joins them at its end and lets
  // the reducer finish (complete_queued: a 16-bit comm dtype's sums widened back): bitwise
  // backward() + finish_gradient_sync(), without the buffers' averaging (average_buffers(),
  // outside the capture). Under no_sync: backward alone.
  Tensor backward_queued(const Tensor& dy);
  // A replayed backward_queued runs no host code: sets the stats it had (the buckets' bytes
  // and overlap as its last run; no ready times, no host wait).
  void replayed_queued_sync();
  // BufferSync::broadcast with buffers, in training: rank 0's buffers on every rank, as
  // forward() does first. Otherwise nothing.
  void broadcast_buffers();
  // BufferSync::average with buffers: every rank's buffers become their mean, as
  // finish_gradient_sync() does last. Otherwise nothing.
  void average_buffers();

  // While a NoSync is alive, backward only accumulates local gradients (gradient accumulation);
  // the first backward after it reduces everything accumulated. Its end restores what was in
  // force before it: a nested one leaves the outer one's no_sync on.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp) : ddp_(ddp), before_(ddp.sync_enabled_) {
      ddp_.sync_enabled_ = false;
    }
    ~NoSync() { ddp_.sync_enabled_ = before_; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool before_;
  };
  NoSync no_sync() { return NoSync(*this); }

  nn::Module& module() { return *module_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const DdpStats& stats() const { return stats_; }
  // Each gradient bucket's bytes as its reducer hands them to a group of several ranks
  // (CommHook::bytes_for: the built-in ones', in the comm dtype), in launch order; the f32
  // bucket's where the hook knows its bytes only once it ran (DdpStats::comm_bytes).
  std::vector<int64_t> bucket_bytes() const;
  // Research code's comm hook in use (DdpOptions::comm_hook), or null.
  CommHook* comm_hook() const { return options_.comm_hook.get(); }
  // The reducer every bucket goes to: that hook, or the built-in one for the comm dtype.
  CommHook& reducer() const { return *hook_; }
  void set_trace(Trace* trace) { trace_ = trace; }
  Trace* trace() const { return trace_; }

  // The shared bucket plan (dp/bucket_plan.hpp) over contiguous parameters of `numels`
  // (registration order): reverse order, the first bucket capped at first_cap bytes, the
  // others at cap bytes. Exposed for tests.
  static std::vector<Bucket> make_buckets(const std::vector<int64_t>& numels, int64_t first_cap,
                                          int64_t cap);

 private:
  void verify_same_model();
  void on_grad_ready(const nn::Parameter& p);
  void launch_ready_buckets();
  // A new step's counters (the per-bucket times keep their storage); backward begins now.
  void reset_stats();
  Tensor grad_slice(int k);
  void stage_bucket(int k);  // scale by the share
  // Bucket k as the reducer is handed it.
  GradBucket bucket_for_hook(int k);
  // Bucket k handed to the reducer (its Work kept in pending_[k]; queued on the group in
  // backward_queued), counted in the stats. Returns whether it launched communication (the
  // built-in reducers with one rank launch none).
  bool issue_bucket(int k);
  // Every bucket not launched yet, in order (also those whose parameters got no gradient).
  void launch_remaining_buckets();
  // After a step's sync: no bucket counted ready, none launched.
  void clear_ready();
  // Queues share_ into device_share_ (nothing when it holds share_ already).
  void write_share();
  // Inside a capture: b's host share counts its reads (take_share_read_in_capture).
  void count_share_reads_in_capture(GradBucket& b);
  // Whether no bucket is counted ready or in flight (between steps).
  bool sync_idle() const;
  // After a failed backward or sync: waits for the works in flight (errors logged) and forgets
  // what was counted, so the next step's buckets launch as on every other rank.
  void abandon_sync();

  nn::ModulePtr module_;
  ProcessGroup& group_;
  DdpOptions options_;
  std::shared_ptr<CommHook> hook_;  // options_.comm_hook, or builtin_hook(options_.comm_dtype)
  std::vector<Bucket> buckets_;
  BucketProgress progress_;  // this step's backward through buckets_
  std::vector<std::shared_ptr<Work>> pending_;
  int next_to_launch_ = 0;
  bool sync_enabled_ = true;
  bool in_backward_ = false;
  bool queued_ = false;        // inside backward_queued: buckets go to all_reduce_queued
  int queued_overlapped_ = 0;  // backward_queued's last launched_before_backward_end
  std::chrono::steady_clock::time_point backward_begin_;  // of the current step's backward
  float share_ = 1.f;
  // share_ on the device, where stage_bucket's scaling reads it (a replayed step uses the
  // current share): (1) f32, made once, written by write_share.
  StepScalars share_values_;
  kernels::Scalar device_share_;
  // Reads of GradBucket::share in captured hooks (HostShare::count_reads), and the share read.
  int share_reads_in_capture_ = 0;
  float share_in_capture_ = 1.f;
  DdpStats stats_;
  Trace* trace_ = nullptr;
};

}  // namespace dp::dist
