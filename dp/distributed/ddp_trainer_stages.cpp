// DdpTrainer's step stages (dp/distributed/ddp_trainer.hpp, dp/step_stages.hpp) and graphs
// (dp/graphs.hpp): whether a step runs graphed, the capturable parts of a step (forward with the
// loss, the update) and the rank's stages, uncaptured or through one shape's two captured
// segments, with the buckets' reducer inside the first where the group and the reducer allow
// (CommHook::capturable), else between the two.
#include "dp/distributed/ddp_trainer.hpp"

#include <cstdio>
#include <sstream>
#include <string>

namespace dp::dist {

void DdpTrainer::set_graphs(Graphs mode) {
  DP_CHECK(!ddp_, "DdpTrainer::set_graphs after wrap()");
  graphs_mode_ = mode;
}

void DdpTrainer::set_graph_collectives(bool allowed) {
  DP_CHECK(!ddp_, "DdpTrainer::set_graph_collectives after wrap()");
  graph_collectives_ = allowed;
}

bool DdpTrainer::collectives_in_graph() const {
  // A hook that runs host code (CommHook::capturable false): a graphed step calls it between its
  // two segments.
  const bool capturable = !ddp_options_.comm_hook || ddp_options_.comm_hook->capturable();
  return graph_collectives_ && capturable && group_->collectives_capturable(device_);
}

std::string DdpTrainer::graphs_blocked() const {
  if (zero_reduce_scatters())
    return "ZeRO-1's reduce-scatter and all-gather are not in the graphed step (--zero-overlap "
           "graphs it)";
  if (sync_bn_) return "SyncBatchNorm exchanges statistics between ranks inside forward";
  return "";
}

bool DdpTrainer::use_graphs() {
  return graphs_wanted(graphs_mode_, device_, graphs_fallback_, graphs_blocked(), "ddp",
                       said_graphs_off_);
}

void DdpTrainer::refuse_replay_of_other_share() {
  auto it = graphs_.find(graph_key_);
  if (it == graphs_.end() || !it->second.compute.captured() || !it->second.host_share) return;
  const float baked = *it->second.host_share, now = ddp_->batch_share();
  if (baked == now) return;
  const CommHook* hook = ddp_->comm_hook();
  std::ostringstream os;
  os << "rank " << rank() << " (" << device_.str() << "): the comm hook '"
     << (hook ? hook->name() : std::string("?"))
     << "' read GradBucket::share on the host while the step was captured (" << baked
     << "), and this step's share is " << now
     << ": a replay would work with the captured one (its queued ops read b.share_at)";
  graphs_fallback_ = os.str();
  std::fprintf(stderr, "ddp: graphs off: %s\n", graphs_fallback_.c_str());
  graphs_.clear();  // no later step replays them
}

void DdpTrainer::forward_and_loss(nn::Module& m, const kernels::Tensor& x,
                                  const kernels::Tensor& y) {
  m.zero_grad();
  if (micro_.count() > 1) {
    // Every micro-batch but the last runs its backward here, under no_sync: it only accumulates.
    const kernels::Tensor out = micro_.queue(
        m, [&](const kernels::Tensor& xj) { return ddp_->forward_local(xj); },
        [&](const kernels::Tensor& dy) { ddp_->backward_local(dy); }, *loss_fn_, x, y,
        metrics_.view(0, {1}), &dlogits_, kernels::Tensor(), !m.backward_reads_output());
    dlogits_is_output_ = out.defined() && dlogits_.same_storage(out);
    return;
  }
  const kernels::Tensor out = queue_forward_and_loss(
      m, [&](const kernels::Tensor& xj) { return ddp_->forward_local(xj); }, *loss_fn_, x, y,
      metrics_.view(0, {1}), &dlogits_, scaler_.loss_grad_factor(loss_scale_), kernels::Tensor(),
      !m.backward_reads_output());
  dlogits_is_output_ = out.defined() && dlogits_.same_storage(out);
}

void DdpTrainer::queue_update(nn::Module& m) {
  // The all-reduced gradient is the same on every rank: so are its norm and the verdict, made on
  // the device and learnt with the loss in the step's one read.
  dp::queue_update(m.flat_grads(), *optimizer_, scaler_, clip_grad_norm_, unscale_,
                   metrics_.view(1, {1}), metrics_.view(3, {1}));
}

struct DdpTrainer::RankStages final : StepStages {
  RankStages(DdpTrainer& t, const kernels::Tensor& x, const kernels::Tensor& y, float share,
             StepSegments* segments)
      : t(t),
        x(x),
        y(y),
        share(share),
        segments(segments),
        in_graph(segments && t.collectives_in_graph()) {}

  void take_chunk() override { t.copy_in(x, y); }
  void before_forward() override { t.ddp_->broadcast_buffers(); }
  void forward_and_loss() override { t.forward_and_loss(t.ddp_->module(), t.input_, t.labels_); }
  void backward() override {
    DistributedDataParallel& ddp = *t.ddp_;
    if (segments) {
      if (in_graph) {
        ddp.backward_queued(t.dlogits_);  // the buckets' all-reduces from its hooks, joined
      } else {
        ddp.backward_local(t.dlogits_);
        ddp.stage_buckets();
      }
    } else if (t.zero_reduce_scatters()) {
      // ZeRO-1 communicates after backward (reduce_scatter, shard step, all_gather).
      auto local_only = ddp.no_sync();
      ddp.backward(t.dlogits_);
    } else {
      ddp.backward(t.dlogits_);
    }
    // Uncaptured, the output written over by its gradient is not held into the next step.
    if (!segments && t.dlogits_is_output_) t.dlogits_ = kernels::Tensor();
  }
  void after_compute(bool ran) override {
    if (in_graph && !ran) {
      t.ddp_->replayed_queued_sync();
      replayed = t.ddp_->stats().comm_bytes;
    }
    segments->input = t.input_;  // the buffers this shape's graphs hold
    segments->labels = t.labels_;
    // A warm-up run's output, written over by its gradient, is let go as an uncaptured step's
    // (DataParallel's after_compute); a captured graph's output stays its graph's.
    if (t.dlogits_is_output_ && !segments->compute.captured()) t.dlogits_ = kernels::Tensor();
    segments->dlogits = t.dlogits_;
  }
  void finish_reduce() override {
    DistributedDataParallel& ddp = *t.ddp_;
    if (segments) {
      if (in_graph)
        ddp.average_buffers();
      else
        ddp.all_reduce_staged();
    } else if (!t.zero_reduce_scatters()) {
      ddp.finish_gradient_sync();
    }
  }
  nn::Optimizer* stepping() override { return t.optimizer_; }  // every rank steps
  // The host scalars the (replayed) update reads.
  void prepare_update() override { t.scaler_.prepare_deferred(*t.optimizer_); }
  void update() override {
    if (t.zero_reduce_scatters()) {
      // ZeRO-1's decisions (every rank's shard, combined) stay on the device too: the verdict and
      // the norm come back with the loss.
      t.zero_->queue_step(share, &t.scaler_, t.metrics_.view(1, {1}), t.metrics_.view(3, {1}));
      t.ddp_->average_buffers();
      return;
    }
    t.queue_update(t.ddp_->module());  // overlapped ZeRO-1: the optimizer steps its shard
  }

  DdpTrainer& t;
  const kernels::Tensor& x;  // this rank's rows of the host batch
  const kernels::Tensor& y;
  const float share;
  StepSegments* segments;  // graphed: this shape's (null: uncaptured)
  const bool in_graph;     // graphed with the buckets' collectives inside the first segment
  // The bucket bytes a replayed graph all-reduced (the group never saw them).
  int64_t replayed = 0;
};

int64_t DdpTrainer::run_stages(const kernels::Tensor& x, const kernels::Tensor& y, float share,
                               StepSegments* segments) {
  kernels::DeviceContext& ctx = *context_;
  StageNames names;
  names.scatter = "ddp/scatter";
  names.forward_backward = "ddp/forward_backward";  // the others: DDP's own (ddp.cpp)
  names.step = "ddp/step";
  names.step_trace = ddp_->trace();
  names.track = rank();
  RankStages stages(*this, x, y, share, segments);
  if (!segments) {
    run_step_stages(stages, marks_, ctx, names);
    return 0;
  }
  times_.graphed = segments->runs >= kGraphWarmupRuns;
  times_.captured = times_.graphed && !segments->all_captured();
  capture_failure_.clear();  // not a failed step's before (its tries stay spent)
  run_graphed_stages(stages, *segments, ddp_->module().flat(), capture_failure_, marks_, ctx,
                     names);
  times_.graph_nodes = times_.graphed ? segments->compute.nodes() + segments->finish.nodes() : 0;
  // A segment whose capture failed ran uncaptured: this step is an uncaptured one. Graphs go
  // off for good (the caller drops the graphs captured so far with their memory), unless the
  // capture lacked memory only: that segment is captured again at the shape's next step.
  if (!capture_failure_.reason.empty() &&
      take_capture_failure(capture_failure_,
                           "rank " + std::to_string(rank()) + " (" + device_.str() + ")", "ddp",
                           graphs_fallback_) != CaptureVerdict::none) {
    times_.graphed = times_.captured = false;
    times_.graph_nodes = 0;
  }
  return stages.replayed;
}

}  // namespace dp::dist
