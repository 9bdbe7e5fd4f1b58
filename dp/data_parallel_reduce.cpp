// DataParallel's reduction (dp/data_parallel.hpp): how the replicas' gradients meet on device 0.
// Star or tree pulls (dp/device_pulls.hpp), bucket by bucket, from backward's hooks; what a final
// bucket is handed on to (a hybrid run's sums over nodes, research code's reducers: one per
// device); the buffers' average; and the bytes each device moves.
#include "dp/data_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <string>

namespace dp {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

void DataParallel::on_grad_ready(int i, const nn::Parameter& p) {
  PerDevice& pd = per_device_[i];
  if (!(pd.in_step || pd.marking_in_graph) || p.numel() == 0) return;
  pd.own.param_ready(p.offset, p.numel());
  if (pd.marking_in_graph)
    pulls_.mark_in_graph(i, pd.own.ready());
  else
    advance_reduction(i, false);
}

void DataParallel::advance_reduction(int i, bool blocking) {
  PerDevice& pd = per_device_[i];
  pulls_.advance(i, pd.own.ready(), blocking, pd.shares, hand_on_);
}

void DataParallel::finish_own_buckets(int i) {
  per_device_[i].own.all_ready();
  advance_reduction(i, true);
  if (!options_.reducers.empty()) options_.reducers[i]->finish();  // its buckets' collectives
}

void DataParallel::hand_on(int i, int k) {
  const Bucket& b = plan_.buckets[k];
  if (i == 0 && options_.cross_node) {  // hybrid: the node's sum, summed over the nodes
    Tensor mine = replicas_[0]->flat_grads().view(b.offset, {b.numel});
    if (pulls_.sources(0).empty() && shares_[0] != 1.f) kernels::scale(mine, mine, shares_[0]);
    double node_share = 0;  // this node's share of the global batch
    for (float s : shares_) node_share += s;
    // Ordered after the stream the sum ran on.
    options_.cross_node->start_bucket_sum(mine, k, b.offset, static_cast<float>(node_share));
  }
  if (!options_.reducers.empty()) {  // this device's own bucket, weighted, to its group
    Tensor mine = replicas_[i]->flat_grads().view(b.offset, {b.numel});
    if (shares_[i] != 1.f) kernels::scale(mine, mine, shares_[i]);
    kernels::NvtxRange range("dp/reducer[bucket " + std::to_string(k) + "]");
    options_.reducers[i]->start_bucket_sum(mine, k, b.offset, shares_[i]);
  }
}

void DataParallel::reduce_grads_to_root(const std::vector<int64_t>& sizes) {
  DP_CHECK(
      !sizes.empty() && static_cast<int>(sizes.size()) <= n_devices(),
      "reduce_grads_to_root: " << sizes.size() << " chunk sizes for " << n_devices() << " devices");
  DP_CHECK(!options_.cross_node,
           "reduce_grads_to_root: drives one node's reduction alone; not in a hybrid run");
  check_groups_usable("reduce_grads_to_root");
  kernels::NvtxRange range("dp/reduce");
  denominators_ = sizes;  // the chunks' rows: shares B_i / B
  begin_step(sizes);
  run_step(
      "dp/reduce", static_cast<int>(sizes.size()),
      [&](int i) {
        write_step_values(i);
        pulls_.prepare(i);
        finish_own_buckets(i);           // every gradient is final
        pool_.context(i).synchronize();  // the caller reads the result next
      },
      UsesReducers::yes);
}

void DataParallel::average_buffers_on_root(const std::vector<int64_t>& sizes, bool ordered) {
  Tensor& root = replicas_[0]->flat_buffers();
  if (options_.buffer_sync == BufferSync::root_only || root.numel() == 0) return;
  const int n = static_cast<int>(sizes.size());
  kernels::DeviceContext& ctx = pool_.context(0);
  // Each replica's statistics are final once its forward ran: wait for every device's end.
  if (!ordered) signals_.wait_raised(StepSignals::Flag::done, n);
  // Each replica holds its chunk's mean statistic; weighting chunk i by its rows B_i / B gives
  // the global batch's (not by its loss share: a chunk whose tokens are all ignored has rows).
  const std::vector<kernels::Scalar>& shares = per_device_[0].row_shares;
  kernels::scale(root, root, shares[0]);
  for (int r = 1; r < n; ++r) {
    if (!ordered) per_device_[r].marks[kReduced].wait(ctx);
    kernels::copy(staging_buffers_, replicas_[r]->flat_buffers());
    kernels::axpy(root, shares[r], staging_buffers_);
  }
}

void DataParallel::finish_cross_node(int n) {
  kernels::NvtxRange range("dp/cross_node");
  auto t0 = Clock::now();
  CrossNode& cross = *options_.cross_node;
  cross.finish();  // every bucket summed over the nodes
  Tensor& buffers = replicas_[0]->flat_buffers();
  if (buffers.numel() > 0) {
    if (options_.buffer_sync == BufferSync::average) {
      // Device 0 holds the node's share of the global statistics (its own chunk's, weighted,
      // when it is the node's only device): the sum over nodes is the global batch's.
      if (n == 1) kernels::scale(buffers, buffers, row_shares_[0]);
      cross.start_sum(buffers);
      cross.finish();
    } else {
      cross.broadcast(buffers);  // root_only: node 0's device 0's, everywhere
    }
  }
  cross_wait_ms_ = ms_since(t0);
}

std::vector<int64_t> DataParallel::link_bytes(int n) const {
  std::vector<int64_t> out(n, 0);
  const int64_t b = replicas_[0]->flat_buffers().nbytes();
  const int64_t sent = replicate_bytes() + (options_.buffer_sync == BufferSync::average ? b : 0);
  for (int r = 1; r < n; ++r) {  // replicate: device 0 sends its parameters and buffers
    out[0] += sent;
    out[r] += sent;
  }
  pulls_.add_link_bytes(out);  // each pull moves one gradient from its source to its receiver
  return out;
}

}  // namespace dp
