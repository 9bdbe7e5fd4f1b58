// DdpTrainer's graphed steps (dp/distributed/ddp_trainer.hpp, dp/graphs.hpp): whether a step
// runs graphed, the capturable parts of a step (forward with the loss, the update) and the step
// through one shape's two captured segments, with the buckets' reducer inside the first where
// the group and the reducer allow (CommHook::capturable), else between the two.
#include "dp/distributed/ddp_trainer.hpp"

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

void DdpTrainer::forward_and_loss(nn::Module& m, const kernels::Tensor& x,
                                  const kernels::Tensor& y) {
  m.zero_grad();
  queue_loss(*loss_fn_, ddp_->forward_local(x), y, metrics_.view(0, {1}), &dlogits_, scaler_,
             loss_scale_, kernels::Tensor(), !m.backward_reads_output());
}

void DdpTrainer::queue_update(nn::Module& m) {
  // The all-reduced gradient is the same on every rank: so are its norm and the verdict, made on
  // the device and learnt with the loss in the step's one read.
  dp::queue_update(m.flat_grads(), *optimizer_, scaler_, clip_grad_norm_, unscale_,
                   metrics_.view(1, {1}), metrics_.view(2, {1}));
}

int64_t DdpTrainer::graphed_step(StepGraphs& g) {
  kernels::DeviceContext& ctx = *context_;
  nn::Module& m = ddp_->module();
  const int runs = g.runs++;
  times_.graphed = runs >= kGraphWarmupRuns;
  times_.captured = times_.graphed && !g.compute.captured();
  const bool in_graph = collectives_in_graph();
  int64_t replayed = 0;
  ddp_->broadcast_buffers();
  {
    kernels::NvtxRange range("ddp/forward_backward");
    const bool ran = run_drawing_segment(
        ctx, g.compute, runs, m.flat(), g.drawn,
        [&] {
          forward_and_loss(m, input_, labels_);
          if (in_graph) {
            ddp_->backward_queued(dlogits_);  // the buckets' all-reduces from its hooks, joined
          } else {
            ddp_->backward_local(dlogits_);
            ddp_->stage_buckets();
          }
        },
        &capture_failure_);
    if (in_graph && !ran) {
      ddp_->replayed_queued_sync();
      replayed = ddp_->stats().comm_bytes;
    }
    g.input = input_;
    g.labels = labels_;
    g.dlogits = dlogits_;
  }
  marks_[kForwarded].record(ctx);
  marks_[kBackwarded].record(ctx);
  if (in_graph)
    ddp_->average_buffers();
  else
    ddp_->all_reduce_staged();
  marks_[kReduced].record(ctx);
  kernels::NvtxRange range("ddp/step");
  TraceScope slice(ddp_->trace(), "ddp/step", rank());
  scaler_.prepare_deferred(*optimizer_);  // the host scalars the replayed update reads
  run_graph_segment(
      ctx, g.update, runs, [&] { queue_update(m); }, &capture_failure_);
  times_.graph_nodes = times_.graphed ? g.compute.nodes() + g.update.nodes() : 0;
  // Both segments ran uncaptured where their capture failed: this step is an uncaptured one.
  // Graphs go off for good (the caller drops the graphs captured so far with their memory).
  if (!capture_failure_.reason.empty() &&
      take_capture_failure(capture_failure_,
                           "rank " + std::to_string(rank()) + " (" + device_.str() + ")", "ddp",
                           graphs_fallback_)) {
    times_.graphed = times_.captured = false;
    times_.graph_nodes = 0;
  }
  return replayed;
}

}  // namespace dp::dist
