// DataParallel's training step on each device (dp/data_parallel.hpp): its stages
// (dp/step_stages.hpp), uncaptured or graphed (dp/graphs.hpp), whether a step runs graphed, and
// a capture's failure settled. Graphed, per device and step shape, forward and backward run in
// one captured segment, and the device's reduction (device 0's with the clip, the update and the
// metrics gather) in another, with the waits between devices outside.
#include "dp/data_parallel.hpp"

#include <string>
#include <vector>

namespace dp {

struct DataParallel::DeviceStages final : StepStages {
  DeviceStages(DataParallel& dp, int i, const Tensor& images, const Tensor& labels,
               const std::vector<int64_t>& sizes, StepSegments* segments)
      : dp(dp),
        i(i),
        n(static_cast<int>(sizes.size())),
        images(images),
        labels(labels),
        sizes(sizes),
        segments(segments),
        pd(dp.per_device_[i]),
        ctx(dp.pool_.context(i)) {}

  void take_chunk() override {
    dp.pulls_.order_after_comm(i);  // a failed step's pulls: this step's writes wait for them
    dp.write_step_values(i);
    if (pd.micro.asked() > 1) pd.micro.write_weights(dp.devices_[i], dp.step_scale_);
    dp.scatter_chunk(i, images, labels, sizes);
  }
  bool has_replicate() const override { return true; }  // device 0's: an empty phase
  void replicate() override {
    if (i > 0) dp.replicate(i);
  }
  void before_forward() override { dp.order_buffers_before_forward(i, n); }
  // Traced and uncaptured: each earlier micro-batch's backward is marked for the trace.
  void forward_and_loss() override {
    dp.forward_and_loss(
        i, nn::Mode::train,
        dp.trace_ != nullptr && segments == nullptr ? MicroMarks::on : MicroMarks::off);
  }
  void before_backward() override { dp.pulls_.prepare(i); }
  void backward() override {
    nn::Module& m = *dp.replicas_[i];
    if (segments && !beside()) {  // captured: the pulls run after it, in the second segment
      m.backward(pd.dlogits);
      return;
    }
    if (segments) {  // captured: each final bucket marked in it, the pulls queued after it
      pd.marking_in_graph = true;
      struct Off {
        bool& marking;
        ~Off() { marking = false; }
      } off{pd.marking_in_graph};
      m.backward(pd.dlogits);
      pd.own.all_ready();
      dp.pulls_.mark_in_graph(i, pd.own.ready());
      return;
    }
    pd.in_step = true;  // from here the hooks hand buckets on as they become ready
    m.backward(pd.dlogits);
    pd.in_step = false;
    if (pd.dlogits_is_output) pd.dlogits = Tensor();  // the output: not held into the next step
  }
  void after_compute(bool) override {  // the buffers this shape's graphs hold
    segments->input = pd.input;
    segments->labels = pd.labels;
    // A warm-up run's output, the loss's gradient written over it, is let go as an uncaptured
    // step's is (it was held into the next run, whose forward made its output beside it: a
    // replica's peak grew by one output from the second step, 60 bytes on cuda:1 in dp.cuda on
    // an H200, the whole bf16 logits for GPT-2). A captured graph's output stays its graph's.
    if (pd.dlogits_is_output && !segments->compute.captured()) pd.dlogits = Tensor();
    segments->dlogits = pd.dlogits;
  }
  // Graphed, a device that sums (device 0, a tree's inner devices) waits for its sources' ends
  // (device 0 for every device's: it gathers the metrics too) outside the graph; then one
  // segment sums every bucket and, on device 0, steps. Beside: the host wait is for the
  // sources' launches (and their own pulls queued), whose graphs recorded each bucket's event;
  // the pulls are queued then, uncaptured, and the second segment holds device 0's update.
  bool beside() const { return dp.options_.graph_pulls == GraphPulls::beside; }
  bool sums() const {
    return i == 0 || (beside() ? !dp.pulls_.sources(i).empty() : dp.pulls_.works(i));
  }
  void finish_reduce() override {
    if (segments) {
      if (!sums()) return;
      std::vector<int>& waits = pd.graph_waits;
      waits.clear();
      if (i == 0)
        for (int r = 1; r < n; ++r) waits.push_back(r);
      else
        waits = dp.pulls_.sources(i);
      dp.signals_.wait_raised(StepSignals::Flag::done, waits);
      if (beside()) dp.pulls_.sum_beside_graph(i, pd.shares);
      for (int r : waits) dp.per_device_[r].marks[kReduced].wait(ctx);
      return;
    }
    dp.finish_own_buckets(i);
    if (i == 0 && n > 1) dp.average_buffers_on_root(sizes);
    if (i == 0 && dp.options_.cross_node) dp.finish_cross_node(n);
  }
  bool reduces_queued() const override { return segments && sums() && (i == 0 || !beside()); }
  // Graphed only (reduces_queued): on the device's own context, as on a GPU (see
  // update_context).
  void reduce_queued() override {
    if (!beside()) dp.pulls_.sum_all(ctx, i, pd.shares);
    if (i == 0 && n > 1) dp.average_buffers_on_root(sizes, true);
  }
  // One decision for every device: device 0 steps.
  nn::Optimizer* stepping() override { return i == 0 ? &dp.optimizer_ : nullptr; }
  // The optimizer's per-step scalars (lr, step count, loss scale) to the device: a replayed
  // update reads them there.
  void prepare_update() override { dp.scaler_.prepare_deferred(dp.optimizer_); }
  void update() override {
    dp.queue_update();
    if (segments && n > 1) dp.gather_metrics_on_root(n);  // read_step_metrics reads them
  }
  // CPU: every other device is done with its part, device 0 gets all the cores. Not in a graphed
  // step: the wide context's own block cache would serve the update's capture from memory the
  // compute segment's capture did not take, where a GPU (one context a device) misses and falls
  // back; on the device's own context a CPU run captures what a GPU would.
  kernels::DeviceContext* update_context() override {
    return segments ? nullptr : dp.wide_context_.get();
  }

  DataParallel& dp;
  const int i, n;
  const Tensor& images;
  const Tensor& labels;
  const std::vector<int64_t>& sizes;
  StepSegments* segments;  // graphed: this shape's (null: uncaptured)
  PerDevice& pd;
  kernels::DeviceContext& ctx;
};

void DataParallel::train_job(int i, const Tensor& images, const Tensor& labels,
                             const std::vector<int64_t>& sizes) {
  PerDevice& pd = per_device_[i];
  pd.micro_marks_used = 0;  // this step's, if it marks any (forward_and_loss)
  kernels::DeviceContext& ctx = pool_.context(i);
  StageNames names;
  names.scatter = "dp/scatter";
  names.replicate = i > 0 ? "dp/replicate" : nullptr;
  names.forward = "dp/forward";
  names.backward = "dp/backward";
  names.forward_backward = "dp/forward_backward";
  names.reduce = "dp/reduce";
  names.step = "dp/step";
  if (graphed_step_) {
    StepSegments& seg = graph_set_for(pd.graphs, graph_key_, i == 0 ? "dp" : nullptr,
                                      i == 0 ? &said_graph_shapes_ : nullptr);
    pd.input = seg.input;  // this shape's chunk buffers: the ones its graphs were captured with
    pd.labels = seg.labels;
    pd.dlogits = seg.dlogits;
    DeviceStages stages(*this, i, images, labels, sizes, &seg);
    run_graphed_stages(stages, seg, replicas_[i]->flat(), pd.capture_failure, pd.marks, ctx, names);
  } else {
    DeviceStages stages(*this, i, images, labels, sizes, nullptr);
    run_step_stages(stages, pd.marks, ctx, names);
  }
  if (i > 0) {
    signals_.raise(StepSignals::Flag::done, i);
    return;
  }
  // The one host wait of the step: the caller may reuse the host batch, and read device 0's
  // module from its own stream, once train_step returns. Graphed, device 0's second segment
  // gathered the metrics.
  read_step_metrics(static_cast<int>(sizes.size()), graphed_step_, step_read());
}

std::string DataParallel::graphs_blocked() const {
  if (options_.cross_node) return "a hybrid run's collectives between nodes are not captured";
  if (stats_sync_) return "SyncBatchNorm exchanges statistics through the host";
  if (!options_.reducers.empty()) return "a reducer (comm hook) runs host code between buckets";
  return "";
}

bool DataParallel::settle_capture_failures(int n_used) {
  bool failed = false, off = false;
  for (int i = 0; i < n_used; ++i) {  // (checked first: no device name is built per step)
    PerDevice& pd = per_device_[i];
    if (pd.capture_failure.reason.empty()) continue;
    failed = true;
    off |= take_capture_failure(pd.capture_failure, devices_[i].str(), "dp", graphs_fallback_) ==
           CaptureVerdict::off;
  }
  // The captured graphs (and the blocks they reserve) go: no later step replays them. A
  // capture that lacked memory is tried again at the shape's next step, its graphs kept.
  if (off)
    for (PerDevice& pd : per_device_) pd.graphs.clear();
  return failed;
}

bool DataParallel::use_graphs() {
  return graphs_wanted(options_.graphs, devices_[0], graphs_fallback_, graphs_blocked(), "dp",
                       said_graphs_off_);
}

}  // namespace dp
