// dp::DevicePulls: how DataParallel's replicas' gradients meet on device 0 without a collective
// library (dp/data_parallel.hpp). Each receiving device sums bucket k of its sources into its
// own, weighted by each chunk's share of the batch, in fused kernels that read the sources'
// memory in place (same GPU, peer access, or host) or staged: star (device 0 from 1 .. n-1) or
// tree (pairwise, ceil(log2 n) rounds: 1->0, 3->2, then 2->0, ...). A source publishes a bucket
// (dp/step_signals.hpp) once its own sum of it is final; a receiver pulls each run of sources
// that have published it, in source order, so the sum has the same bits whatever the runs. On a
// GPU the pulls made during backward run on a second stream of the receiver's, beside its
// backward.
//
// Per step, on each device's worker:
//   pulls.begin_step(n, true);                  // the caller, before the workers start
//   pulls.prepare(i);                           // buffers, once
//   ... backward's hooks: pulls.advance(i, own_ready, false, shares, hand_on) ...
//   pulls.advance(i, n_buckets, true, shares, hand_on);  // after backward: every bucket
// Graphed steps sum after backward (sum_all, in the receiver's second segment), or beside it
// (GraphPulls::beside): each device's captured backward records an event as each of its buckets
// becomes final (mark_in_graph, from the hooks), and a receiver, once its graph and its sources'
// were launched, queues its pulls uncaptured on its second stream, each waiting for its bucket's
// events (sum_beside_graph):
//   ... captured backward's hooks: pulls.mark_in_graph(i, own_ready) ...
//   pulls.sum_beside_graph(i, shares);   // after the sources raised their ends (host)
// The pulls are DP's own reducer; research code's reducers (dp::CrossNode per device) take their
// place with begin_step(n, false): then advance only hands each of a device's buckets on, as it
// becomes final, to `hand_on`, as it does a receiver's summed buckets (a hybrid run's sum over
// nodes).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dp/bucket_plan.hpp"
#include "dp/step_signals.hpp"
#include "kernels/runtime/context.hpp"
#include "kernels/runtime/event.hpp"
#include "kernels/runtime/tensor.hpp"
#include "nn/module.hpp"

namespace dp {

// How replica gradients reach device 0: every replica to device 0 (star), or pairwise in
// ceil(log2 N) rounds (tree), where device 2 sums 3's bucket before passing the pair on.
enum class ReduceTopology { star, tree };

// How a receiving device reads a source's gradient bucket: in place where it can (CPU devices,
// logical devices of one GPU, GPUs with peer access: kernels::direct_access), else staged (one
// copy into its own memory first, then the sum); or staged always (off: for links whose peer
// access misbehaves, as NCCL_P2P_DISABLE, and to run the staged path on any machine). Either
// way the sum has the same bits.
enum class PeerReads { automatic, off };

// When a graphed step's receivers sum their sources' buckets: after backward, in the receiver's
// second segment (after), or beside backward on its second stream, uncaptured, each pull waiting
// for its bucket's events recorded inside the devices' captured backward (beside). The same sums,
// bit for bit; on CPU devices, whose kernels have finished when they return, beside runs them
// after backward too.
enum class GraphPulls { after, beside };

class DevicePulls {
 public:
  struct Options {
    ReduceTopology topology = ReduceTopology::star;
    PeerReads peer_reads = PeerReads::automatic;
    // The dtype a source's bucket travels in: f32, or 16-bit (each source rounds its bucket once,
    // into its outbox, and the receiver adds it into its f32 sum).
    kernels::DType comm_dtype = kernels::DType::f32;
    kernels::MathMode math = kernels::MathMode::strict;  // of a GPU receiver's second stream
    kernels::Event::Timing timing = kernels::Event::Timing::on;  // of the pulls' events
  };
  // One fused sum of one bucket from a run of a receiver's sources.
  struct Pull {
    int bucket = 0;
    bool beside = false;  // ran on the receiver's second stream, beside its backward
    kernels::Event begin, end;
  };
  // Bucket k of device i is final there (its own gradient, and its sources' when it receives):
  // called on device i's worker with the context that summed it bound (the current one), so
  // that work queued there follows the sum.
  using HandOn = std::function<void(int i, int k)>;

  // requires plan and signals outlive this (the plan is read from bind on); one device per
  // engine device.
  DevicePulls(std::vector<kernels::Device> devices, const BucketPlan* plan, StepSignals* signals,
              Options options);
  // Before the first step, once the plan is made: device i's module (whose flat gradient the
  // pulls read and write) and its worker's context.
  void bind(int i, nn::Module* module, kernels::DeviceContext* compute);
  // CPU device 0's context with every core, for its sums once the other devices are done; or
  // null.
  void set_wide(kernels::DeviceContext* wide) { wide_ = wide; }

  // A step on devices 0 .. n-1: who pulls from whom (pulls true), or nobody (false: the buckets
  // go to hand_on only). The caller resets the signals.
  void begin_step(int n, bool pulls);
  // The sources device i sums this step, in sum order.
  const std::vector<int>& sources(int i) const { return sources_[i]; }
  // Device i's buffers for the step (staging where it cannot read a source in place, a 16-bit
  // outbox where it is a source): made once, grown never shrunk. On device i's worker.
  void prepare(int i);
  // On device i's worker: sums, in bucket order, every bucket below `ready` (device i's own
  // final buckets) whose sources have published it, hands each bucket done on (hand_on, then
  // publish when i is a source), and returns. blocking: after backward, on the compute stream,
  // waiting for the sources (throws StepSignals::Abandoned when the step aborts); otherwise
  // (backward's hooks) a bucket no source has published yet ends the pass, and a GPU receiver's
  // pulls go to its second stream. shares: device i's views of the chunks' shares (one per
  // device), the sums' weights.
  void advance(int i, int ready, bool blocking, const std::vector<kernels::Scalar>& shares,
               const HandOn& hand_on);
  // Device i's compute stream waits for the pulls queued on its second stream, if any are.
  void order_after_comm(int i);
  // Graphed steps: every bucket of every source of device i summed on `on`, the caller having
  // ordered it after the sources' work; a 16-bit source's outbox rounded. Waits for nothing.
  void sum_all(kernels::DeviceContext& on, int i, const std::vector<kernels::Scalar>& shares);
  // Graphed steps, beside: called from device i's backward hooks (captured, or its uncaptured
  // runs before the capture) with its own final buckets (below `ready`): records, where its
  // work has reached, each newly final bucket's event, for the pulls queued after the graph
  // (sum_beside_graph): a receiver's own bucket; a leaf source's bucket, rounded into its
  // outbox first where it travels in 16 bits.
  void mark_in_graph(int i, int ready);
  // Graphed steps, beside: requires device i's captured work and its sources' (and their own
  // pulls, for inner devices of the tree) launched, the caller having waited for their ends
  // on the host; no pull of device i queued yet this step. ensures every bucket of every
  // source summed into device i's, in bucket order, each sum after its bucket's events (on the
  // second stream on a GPU), an inner device's summed bucket rounded and published to its
  // receiver, and the compute stream after them all.
  void sum_beside_graph(int i, const std::vector<kernels::Scalar>& shares);
  // Whether device i has work of the pulls in a step: it receives, or rounds for its receiver.
  bool works(int i) const { return !sources_[i].empty() || per_device_[i].outbox.defined(); }

  // This step's pulls on device i, for the phase times and the trace.
  int n_pulls(int i) const { return per_device_[i].n_pulls; }
  const Pull& pull(int i, int j) const { return per_device_[i].pulls[j]; }
  // Device i's second stream (GPU receivers, once made), else null.
  kernels::DeviceContext* comm(int i) const { return per_device_[i].comm.get(); }
  // Bytes of one gradient as it travels from a source.
  int64_t grad_bytes() const;
  // Adds each pull's gradient bytes to its receiver's and its source's count (devices < n).
  void add_link_bytes(std::vector<int64_t>& out) const;
  // Device i's state freed, its second stream drained first. On device i's worker.
  void release(int i);

 private:
  struct PerDevice {
    // Receivers: per source (in sources_ order), its gradient staged here when this device
    // cannot read the source's memory in place (GPUs without peer access); else undefined.
    std::vector<kernels::Tensor> staging;
    kernels::Tensor outbox;  // sources with a 16-bit comm dtype: their gradient, rounded
    // The sources and weights of the fused sum in progress (kept to keep their capacity).
    std::vector<kernels::Tensor> sum_from;
    std::vector<kernels::Scalar> sum_weights;
    int next_bucket = 0;  // the position: bucket, and source within it
    int next_source = 0;
    std::vector<kernels::Event> bucket_done;  // bucket k summed here (own + sources)
    // Graphed steps, beside: a receiver's own bucket k final (recorded in its captured backward).
    std::vector<kernels::Event> own_done;
    int next_marked = 0;  // the buckets marked so far this step (mark_in_graph)
    // GPU receivers: a second stream on which the pulls made during backward run, so that
    // waiting for a source's bucket never stalls this device's backward. It waits for
    // `own_final` (the compute stream as the pull is queued: this bucket's own gradient is
    // final) and each source's bucket_done; after backward the compute stream waits for
    // `comm_done`. Null on CPU devices, whose kernels have finished when they return.
    std::unique_ptr<kernels::DeviceContext> comm;
    kernels::Event own_final{kernels::Event::Timing::off}, comm_done{kernels::Event::Timing::off};
    bool comm_pending = false;  // work queued on `comm` that the compute stream has not waited for
    std::vector<Pull> pulls;
    int n_pulls = 0;
  };
  kernels::Tensor grads(int i) const { return modules_[i]->flat_grads(); }
  // Device i's second stream (GPU: made on first use, its scope entered in `scope`, the pulls
  // queued there pending for the compute stream), else its compute context.
  kernels::DeviceContext& beside_context(int i, std::unique_ptr<kernels::ContextScope>& scope);
  // Bucket k of source i rounded into its outbox (16-bit comm dtypes; else nothing), on `on`.
  void round_outbox(kernels::DeviceContext& on, int i, int k);
  // The next entry of device i's pulls this step, for bucket k, its begin recorded on `on`.
  Pull& begin_pull(kernels::DeviceContext& on, int i, int k, bool beside);
  // Bucket k on device i += the sum of sources j0 .. j0 + count - 1 (in sources_[i] order),
  // weighted, in one fused kernel; the own gradient is weighted by its share when j0 == 0.
  // ordered: the caller ordered device i after those sources' work already; otherwise each
  // source's bucket_done event is waited on first. Runs on `on`.
  void sum_sources(kernels::DeviceContext& on, int i, int k, int j0, int count, bool ordered,
                   const std::vector<kernels::Scalar>& shares);

  std::vector<kernels::Device> devices_;
  const BucketPlan* plan_;
  StepSignals* signals_;
  Options options_;
  std::vector<nn::Module*> modules_;
  std::vector<kernels::DeviceContext*> compute_;
  kernels::DeviceContext* wide_ = nullptr;
  bool pulls_ = true;                      // this step's: pulls (false: hand_on only)
  std::vector<std::vector<int>> sources_;  // this step's, per device used
  std::vector<PerDevice> per_device_;
};

}  // namespace dp
