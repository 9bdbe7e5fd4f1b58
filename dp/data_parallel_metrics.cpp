// DataParallel's metrics and measures (dp/data_parallel.hpp): every device's loss, correct count
// and fault word gathered on device 0 and read to the host once per step (or one step late with
// metrics_lag 1), the loss scaler settled on the verdict, and the phase times, memory and runtime
// counts and trace slices taken from the workers' events.
#include "dp/data_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <string>

#include "kernels/runtime/memory.hpp"

namespace dp {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

void DataParallel::gather_metrics_on_root(int n) {
  CrossNode* cross = options_.cross_node.get();
  // Hybrid: two more slots, the node's weighted loss and correct count, summed over the nodes.
  // Made once, for every device: graphs of steps with fewer devices write the same tensor (a
  // tensor made again for another count would leave the other graphs writing the old one).
  if (!gathered_metrics_.defined())
    gathered_metrics_ =
        Tensor::empty({metric_slots(n_devices())}, kernels::DType::f32, devices_[0]);
  for (int r = 0; r < n; ++r) {
    Tensor slot = gathered_metrics_.view(kMetrics * r, {kMetrics});
    kernels::copy(slot, per_device_[r].metrics);
  }
  if (!cross) return;
  Tensor node = gathered_metrics_.view(kMetrics * n, {2});
  std::vector<Tensor>& from = metric_from_;
  std::vector<kernels::Scalar>& weights = metric_weights_;
  kernels::fill(node, 0.f);
  Tensor loss = node.view(0, {1}), correct = node.view(1, {1});
  from.clear();
  for (int r = 0; r < n; ++r) from.push_back(gathered_metrics_.view(kMetrics * r + kLoss, {1}));
  const std::vector<kernels::Scalar>& shares = per_device_[0].shares;
  weights.assign(shares.begin(), shares.begin() + n);  // one per device used
  kernels::weighted_sum(loss, 1.f, from, weights);
  from.clear();
  for (int r = 0; r < n; ++r) from.push_back(gathered_metrics_.view(kMetrics * r + kCorrect, {1}));
  weights.assign(n, kernels::Scalar(1.f));
  kernels::weighted_sum(correct, 1.f, from, weights);
  cross->start_sum(node);
  cross->finish();
}

int64_t DataParallel::metric_slots(int n) const {
  return kMetrics * n + (options_.cross_node ? 2 : 0);
}

void DataParallel::read_step_metrics(int n, bool gathered_in_graph, Read read) {
  kernels::DeviceContext& ctx = pool_.context(0);
  const bool gathered = n > 1 || options_.cross_node;
  if (gathered) {
    // Every device's metrics are final once its part of the step is: wait for each one's end.
    signals_.wait_raised(StepSignals::Flag::done, n);
    if (!gathered_in_graph) {
      for (int r = 1; r < n; ++r) per_device_[r].marks[kReduced].wait(ctx);
      gather_metrics_on_root(n);
    }
  }
  const Tensor all =
      gathered ? gathered_metrics_.view(0, {metric_slots(n)}) : per_device_[0].metrics;
  // The host copies hold every device's slots: made once, read through a view of this step's.
  auto host_view = [&](Tensor& host) {
    if (!host.defined())
      host = Tensor::empty_pinned({metric_slots(n_devices())}, kernels::DType::f32);
    return host.view(0, {all.numel()});
  };
  if (read == Read::lagged) {
    LaggedSlot& slot = lagged_.of(step_index_);
    host_view(slot.host);  // made once, for every device's slots
    slot.queue_read(all, ctx);
    slot.extra.shares = shares_;
    updated_.record(ctx);  // device 0's update and gather are queued before it
    return;
  }
  // The step's one host wait: a copy to the host waits for device 0's stream, which waited
  // for every other device's last event.
  Tensor host = host_view(host_metrics_);
  kernels::read_back(host, all);
}

void DataParallel::gather_metrics(const float* m, const std::vector<float>& shares,
                                  StepStats& stats) const {
  if (options_.cross_node) {  // summed over the nodes on the device
    const size_t at = kMetrics * shares.size();
    stats.loss = m[at];
    stats.correct = static_cast<int64_t>(m[at + 1]);
    return;
  }
  for (size_t i = 0; i < shares.size(); ++i) {
    stats.loss += m[kMetrics * i + kLoss] * shares[i];
    stats.correct += static_cast<int64_t>(m[kMetrics * i + kCorrect]);
  }
}

void DataParallel::settle_step(const float* m, const std::vector<float>& shares, StepStats& stats) {
  step_taken_ = scaler_.settle(optimizer_, m[kNonFinite] == 0.f);
  if (options_.clip_grad_norm > 0.f) stats.grad_norm = m[kGradNorm];
  stats.skipped = !step_taken_;
  stats.skipped_steps = scaler_.skipped_steps();
  gather_metrics(m, shares, stats);
}

void DataParallel::report_device_faults(const float* m, int n) {
  for (int r = 0; r < n; ++r) {
    if (!kernels::fault_written(m + kMetrics * r + kFaultWord)) continue;
    // The faulting device's own worker reports the fault's text, naming the device, and clears
    // its record (DeviceContext::check_faults: any wait on that device reports a fault its
    // record holds). When the wait finds nothing, the word is a copy taken before an earlier
    // read reported that fault (metrics_lag 1: step k + 1's word is copied before step k's
    // report clears the record): the fault was reported once already.
    drain();
  }
}

StepStats DataParallel::finish_metrics() {
  DP_CHECK(options_.metrics_lag > 0,
           "finish_metrics: metrics_lag is 0: every step returned its own metrics");
  LaggedSlot& last = lagged_.previous(step_index_);
  DP_CHECK(last.pending,
           "finish_metrics: no step's metrics are pending (none ran since the "
           "last were returned)");
  drain();
  StepStats stats;
  stats.metrics_lagged = true;
  settle_step(last.take(nullptr), last.extra.shares, stats);
  return stats;
}

template <class F>
void DataParallel::for_each_context(int i, F f) {
  f(pool_.context(i));
  if (kernels::DeviceContext* comm = pulls_.comm(i)) f(*comm);
  if (i == 0 && wide_context_) f(*wide_context_);
}

template <class F>
void DataParallel::each_context(F f) {
  for (int i = 0; i < n_devices(); ++i)
    for_each_context(i, [&](kernels::DeviceContext& c) { f(i, c); });
}

void DataParallel::begin_counts() {
  counter_.begin([this](auto f) { each_context(f); });
}

StepCounts DataParallel::end_counts() {
  return counter_.end([this](auto f) { each_context(f); });
}

void DataParallel::set_trace(Trace* trace) {
  DP_CHECK(!trace || options_.phase_timing == kernels::Event::Timing::on,
           "DataParallel::set_trace: phase timing is off (DataParallelOptions::phase_timing): "
           "a trace is made of the timed phases");
  trace_ = trace;
}

void DataParallel::collect_step(int n, StepStats& stats) {
  using kernels::Event;
  const int n_buckets = static_cast<int>(plan_.buckets.size());
  stats.buckets = n > 1 ? n_buckets : 0;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < pulls_.n_pulls(i); ++j)
      stats.pulls_beside_backward += pulls_.pull(i, j).beside;
  if (options_.phase_timing == Event::Timing::off) return;  // the marks only ordered the work
  // A device's event as a host time point: its step's first mark plus the device time since.
  auto at = [&](int i, const Event& e) {
    const Event& begin = per_device_[i].marks[kBegin];
    return begin.host_time() +
           std::chrono::duration_cast<Clock::duration>(
               std::chrono::duration<double, std::milli>(Event::elapsed_ms(begin, e)));
  };
  PhaseTimes& t = stats.ms;
  Clock::time_point last_backward_end{};
  // The phases are device 0's: the step's critical path (device 0 scatters, replicates, runs its
  // chunk, then reduces, waiting there for the slowest device, and steps), so they follow one
  // another and add up to the step with what is left ("other") never negative. What the other
  // devices take is seen where device 0 waits for them: in reduce.
  const MarkTimes root = mark_times(per_device_[0].marks);
  t.scatter = root.scatter;
  t.replicate = root.replicate;
  t.forward = root.forward;
  t.reduce = root.reduce;
  t.step = root.step;
  for (int i = 0; i < n; ++i) {
    const PerDevice& pd = per_device_[i];
    // Pulls done inside backward (from the hooks) are reduction, not backward; those on a
    // communication stream ran beside it and took none of its stream's time.
    double pulled = 0, pulled_inline = 0;
    for (int j = 0; j < pulls_.n_pulls(i); ++j) {
      const DevicePulls::Pull& pull = pulls_.pull(i, j);
      if (Event::elapsed_ms(pull.begin, pd.marks[kBackwarded]) > 0) {
        const double ms = Event::elapsed_ms(pull.begin, pull.end);
        pulled += ms;
        if (!pull.beside) pulled_inline += ms;
      }
    }
    if (i == 0) {
      t.backward = root.backward - pulled_inline;
      t.reduce_in_backward = pulled;
    }
    last_backward_end = std::max(last_backward_end, at(i, pd.marks[kBackwarded]));
  }

  std::vector<Clock::time_point> first_pull(n_buckets, Clock::time_point::max());
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < pulls_.n_pulls(i); ++j) {
      const DevicePulls::Pull& pull = pulls_.pull(i, j);
      first_pull[pull.bucket] = std::min(first_pull[pull.bucket], at(i, pull.begin));
    }
  for (int k = 0; k < stats.buckets; ++k)
    stats.buckets_overlapped += first_pull[k] < last_backward_end;

  if (!trace_) return;
  // Device i's events a to b, on device i's track unless another is given.
  auto slice = [&](const std::string& name, int i, const Event& a, const Event& b, int track = -1) {
    double begin = trace_->to_us(at(i, a));
    trace_->add({name, track < 0 ? i : track, begin, trace_->to_us(at(i, b)) - begin, step_index_});
  };
  for (int i = 0; i < n; ++i) {
    const PerDevice& pd = per_device_[i];
    slice("dp/scatter", i, pd.marks[kBegin], pd.marks[kScattered]);
    if (i > 0) slice("dp/replicate", i, pd.marks[kScattered], pd.marks[kReplicated]);
    // Several micro-batches: a forward, then each earlier micro-batch's backward between the
    // forwards, as they ran.
    const Event* forward_from = &pd.marks[kReplicated];
    for (int j = 0; j + 1 < pd.micro_marks_used; j += 2) {
      slice("dp/forward", i, *forward_from, pd.micro_marks[j]);
      slice("dp/backward", i, pd.micro_marks[j], pd.micro_marks[j + 1]);
      forward_from = &pd.micro_marks[j + 1];
    }
    slice("dp/forward", i, *forward_from, pd.marks[kForwarded]);
    slice("dp/backward", i, pd.marks[kForwarded], pd.marks[kBackwarded]);
    if (!pulls_.sources(i).empty())
      slice("dp/reduce", i, pd.marks[kBackwarded], pd.marks[kReduced]);
    for (int j = 0; j < pulls_.n_pulls(i); ++j) {  // beside backward: on the comm stream's track
      const DevicePulls::Pull& pull = pulls_.pull(i, j);
      slice("dp/reduce[bucket " + std::to_string(pull.bucket) + "]", i, pull.begin, pull.end,
            pull.beside ? comm_track(i) : i);
    }
    if (i == 0) slice("dp/step", i, pd.marks[kReduced], pd.marks[kStepped]);
  }
}

std::vector<int64_t> DataParallel::peak_memory_bytes() {
  std::vector<int64_t> out(n_devices());
  for (int i = 0; i < n_devices(); ++i) out[i] = pool_.context(i).memory()->peak.load();
  nn::Module& root = *replicas_[0];
  out[0] += root.flat_params().nbytes() + root.flat_grads().nbytes() + root.flat_buffers().nbytes();
  return out;
}

}  // namespace dp
