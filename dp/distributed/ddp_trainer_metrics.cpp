// DdpTrainer's metrics (dp/distributed/ddp_trainer.hpp): the loss scale on the device, the
// rank's loss weighted by its share and summed over the ranks with the scaler's verdict, and the
// step's one read of them (or, with metrics_lag 1, the previous step's, its copy queued with the
// step and taken one step late).
#include "dp/distributed/ddp_trainer.hpp"

#include <limits>

#include "kernels/runtime/memory.hpp"

namespace dp::dist {

void DdpTrainer::write_scale() {
  const float values[2] = {1.f / scaler_.scale(), scaler_.scale()};
  if (!scale_values_.write(values, 2, device_)) return;
  unscale_ = scale_values_.at(0);  // made now: the views the kernels read
  loss_scale_ = scale_values_.at(1);
}

std::shared_ptr<Work> DdpTrainer::reduce_metrics(kernels::Tensor& metrics, float share,
                                                 int64_t rows) {
  // Alone, the rank's loss and verdict are the global ones (its share is 1) and its batch is the
  // global batch: no launch, no check (check_same_batch passes a lone rank).
  if (world_size() == 1) return nullptr;
  // The global mean loss, the verdict (the same on every rank; summed, still 0 or not) and the
  // global batch sizes (summed: world_size() x rows when the ranks agree). The gradient norm is
  // the same on every rank already: it is read, not reduced.
  kernels::Tensor loss = metrics.view(0, {1}), batch = metrics.view(2, {1}),
                  summed = metrics.view(0, {3});
  kernels::scale(loss, loss, share);
  kernels::fill(batch, static_cast<float>(rows));
  return group_->all_reduce(summed, ReduceOp::sum);
}

void DdpTrainer::check_same_batch(float summed_rows, int64_t rows) const {
  if (world_size() == 1) return;  // reduce_metrics wrote no sum
  // Exact in f32 below 2^24 rows in all.
  DP_CHECK(static_cast<double>(summed_rows) == static_cast<double>(rows) * world_size(),
           "DdpTrainer: rank " << rank() << " passed a global batch of " << rows
                               << " rows, but the " << world_size()
                               << " ranks' global batches sum to " << summed_rows
                               << " rows: every rank passes the same global batch (and "
                                  "trains on its own chunk of it)");
}

float DdpTrainer::report_loss(float share, int64_t rows) {
  if (auto work = reduce_metrics(metrics_, share, rows)) work->wait();
  if (!host_metrics_.defined())
    host_metrics_ = kernels::Tensor::empty_pinned({4}, kernels::DType::f32);
  kernels::read_back(host_metrics_, metrics_);  // the step's one host wait
  check_same_batch(host_metrics_.data<float>()[2], rows);
  return host_metrics_.data<float>()[0];
}

float DdpTrainer::report_loss_lagged(float share, int64_t rows) {
  kernels::DeviceContext& ctx = *context_;
  LaggedSlot& slot = lagged_.of(steps_);
  if (!slot.host.defined()) {
    slot.extra.device = kernels::Tensor::empty({6}, kernels::DType::f32, device_);
    slot.host = kernels::Tensor::empty_pinned({6}, kernels::DType::f32);
  }
  slot.extra.rows = rows;
  // The step's metrics in a slot of their own (the next step writes metrics_ again), with the
  // context's fault word (its read checks no fault), then what report_loss does with them, its
  // read queued.
  kernels::Tensor& device = slot.extra.device;
  kernels::Tensor metrics = device.view(0, {4}), fault_word = device.view(4, {2});
  kernels::copy(metrics, metrics_);
  kernels::queue_fault_word(fault_word, ctx);
  slot.extra.work = reduce_metrics(metrics, share, rows);
  if (slot.extra.work) slot.extra.work->order_stream();  // NCCL: the read waits on the stream
  slot.queue_read(device, ctx);
  // The step's one host wait: for this step's input copy, so that the caller may refill the
  // host batch (a pinned one is copied asynchronously). It follows the previous step's metrics
  // read on this stream, so that read is done too. That read waits on the stream for the
  // previous step's all-reduce (NCCL's order_stream), which a dead or hung peer never ends:
  // the host first waits for that op, bounded by the group's timeout (which aborts the
  // communicator and throws), so that the event wait below never hangs. The op is done by the
  // time the input copy is, so this adds no wait to a healthy step.
  LaggedSlot& previous = lagged_.previous(steps_);
  if (previous.pending && previous.extra.work) previous.extra.work->wait();
  marks_[kScattered].synchronize();
  context_->note_host_sync();
  if (!previous.pending) return std::numeric_limits<float>::quiet_NaN();  // the first step
  return take_lagged(previous, Waited::yes);
}

float DdpTrainer::take_lagged(LaggedSlot& slot, Waited waited) {
  if (slot.extra.work) slot.extra.work->wait();  // done by now (NCCL: its failure or timeout)
  slot.extra.work.reset();
  // The host wait for the step's read, unless the caller's covered it.
  const float* m = slot.take(waited == Waited::no ? context_.get() : nullptr);
  lagged_fault_ = kernels::fault_written(m + 4);
  check_same_batch(m[2], slot.extra.rows);
  if (clip_grad_norm_ > 0.f) grad_norm_ = m[3];
  return m[0];
}

void DdpTrainer::report_lagged_fault() {
  if (!lagged_fault_) return;
  lagged_fault_ = false;
  context_->synchronize();  // reports the fault's text (and clears the record)
  DP_THROW("rank " << rank() << " (" << device_ << ") reported a device-side fault in a step");
}

float DdpTrainer::finish_metrics() {
  LaggedSlot& last = lagged_.previous(steps_);
  DP_CHECK(metrics_lag_ > 0 && last.pending,
           "DdpTrainer::finish_metrics: no lagged step since the last call (metrics_lag "
               << metrics_lag_ << ")");
  const float loss = take_lagged(last, Waited::no);
  report_lagged_fault();
  return loss;
}

}  // namespace dp::dist
