// DataParallel's graphed step (dp/data_parallel.hpp, dp/graphs.hpp): per device and step shape,
// forward and backward in one captured segment, and the device's reduction (device 0's with the
// clip, the update and the metrics gather) in another, with the waits between devices outside.
#include "dp/data_parallel.hpp"

#include <memory>
#include <string>

namespace dp {

void DataParallel::graph_job(int i, const Tensor& images, const Tensor& labels,
                             const std::vector<int64_t>& sizes) {
  PerDevice& pd = per_device_[i];
  kernels::DeviceContext& ctx = pool_.context(i);
  nn::Module& m = *replicas_[i];
  const int n = static_cast<int>(sizes.size());
  GraphSet& gs = graph_set_for(pd.graphs, graph_key_);
  const int runs = gs.runs++;
  // This shape's chunk buffers: the ones its graphs were captured with.
  pd.input = gs.input;
  pd.labels = gs.labels;
  pd.dlogits = gs.dlogits;
  begin_job(i, images, labels, sizes);
  gs.input = pd.input;
  gs.labels = pd.labels;
  pulls_.prepare(i);
  {
    kernels::NvtxRange range("dp/forward_backward");
    run_drawing_segment(
        ctx, gs.compute, runs, m.flat(), gs.drawn,
        [&] {
          forward_and_loss(i, nn::Mode::train);
          m.backward(pd.dlogits);
        },
        &pd.capture_failure);
    gs.dlogits = pd.dlogits;
  }
  pd.marks[kForwarded].record(ctx);
  pd.marks[kBackwarded].record(ctx);
  // Receivers wait for their sources' ends (device 0 for every device's: it gathers the metrics
  // too), outside the graph; then one graph sums every bucket and, on device 0, steps.
  if (i == 0 || pulls_.works(i)) {
    kernels::NvtxRange range("dp/reduce");
    std::vector<int>& waits = pd.graph_waits;
    waits.clear();
    if (i == 0)
      for (int r = 1; r < n; ++r) waits.push_back(r);
    else
      waits = pulls_.sources(i);
    signals_.wait_raised(StepSignals::Flag::done, waits);
    for (int r : waits) per_device_[r].marks[kReduced].wait(ctx);
    std::unique_ptr<kernels::ContextScope> wide;
    kernels::DeviceContext* on = &ctx;
    const int64_t steps_before = optimizer_.step_count();
    if (i == 0) {
      // The optimizer's per-step scalars (lr, step count, loss scale) go to the device here,
      // outside the graph: the replayed update reads them there.
      scaler_.prepare_deferred(optimizer_);
      if (wide_context_) {  // CPU: every other device is done, device 0 gets all the cores
        wide = std::make_unique<kernels::ContextScope>(*wide_context_);
        on = wide_context_.get();
      }
    }
    try {
      run_graph_segment(
          *on, gs.reduce, runs,
          [&] {
            pulls_.sum_all(*on, i, pd.shares);
            if (i == 0) {
              if (n > 1) average_buffers_on_root(sizes, true);
              queue_update();
              if (n > 1) gather_metrics_on_root(n);
            }
          },
          &pd.capture_failure);
    } catch (...) {
      // A capture that failed ran nothing: no update was taken, so the step is not counted.
      if (i == 0 && runs >= kGraphWarmupRuns && !gs.reduce.captured())
        optimizer_.set_step_count(steps_before);
      throw;
    }
  }
  pd.marks[kReduced].record(ctx);
  if (i > 0) {
    signals_.raise(StepSignals::Flag::done, i);
    return;
  }
  pd.marks[kStepped].record(ctx);
  read_step_metrics(n, true, step_read());  // gathered inside device 0's reduce graph
}

std::string DataParallel::graphs_blocked() const {
  if (options_.cross_node) return "a hybrid run's collectives between nodes are not captured";
  if (stats_sync_) return "SyncBatchNorm exchanges statistics through the host";
  if (!options_.reducers.empty()) return "a reducer (comm hook) runs host code between buckets";
  return "";
}

bool DataParallel::settle_capture_failures(int n_used) {
  bool failed = false;
  for (int i = 0; i < n_used; ++i)  // (checked first: no device name is built per step)
    if (!per_device_[i].capture_failure.reason.empty())
      failed |= take_capture_failure(per_device_[i].capture_failure, devices_[i].str(), "dp",
                                     graphs_fallback_);
  if (!failed) return false;
  // The captured graphs (and the blocks they reserve) go: no later step replays them.
  for (PerDevice& pd : per_device_) pd.graphs.clear();
  return true;
}

bool DataParallel::use_graphs() {
  return graphs_wanted(options_.graphs, devices_[0], graphs_fallback_, graphs_blocked(), "dp",
                       said_graphs_off_);
}

}  // namespace dp
