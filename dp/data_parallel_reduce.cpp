// DataParallel's reduction (dp/data_parallel.hpp): how the replicas' gradients meet on device 0.
// Star or tree pulls, bucket by bucket, from backward's hooks (on a GPU beside backward, on a
// second stream); a hybrid run's sums over nodes; research code's reducers (one per device); the
// buffers' average; and the bytes each device moves.
#include "dp/data_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>

namespace dp {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

void DataParallel::publish(int i, int complete_buckets) {
  {
    std::lock_guard<std::mutex> lock(signal_mutex_);
    signals_.complete[i] = complete_buckets;
  }
  signal_cv_.notify_all();
}

void DataParallel::on_grad_ready(int i, const nn::Parameter& p) {
  PerDevice& pd = per_device_[i];
  if (!pd.in_step || p.numel() == 0) return;
  pd.own.param_ready(p.offset, p.numel());
  advance_reduction(i, false);
}

void DataParallel::advance_reduction(int i, bool blocking) {
  PerDevice& pd = per_device_[i];
  kernels::DeviceContext& ctx = pool_.context(i);
  const std::vector<int>& sources = sources_[i];
  if (blocking) order_after_comm(i);  // backward is queued: what follows waits for the pulls
  // A GPU receiver's pulls from a hook go to its communication stream, from the first one
  // queued: the compute stream goes on with backward while they wait for their sources.
  kernels::DeviceContext* on = &ctx;
  std::unique_ptr<kernels::ContextScope> comm_scope;
  auto pull_beside = [&] {
    if (blocking || !devices_[i].is_cuda() || comm_scope) return;
    if (!pd.comm) {
      kernels::ContextOptions comm;
      comm.math = options_.math;
      comm.caching = kernels::Caching::on;
      pd.comm = std::make_unique<kernels::DeviceContext>(devices_[i], comm);
    }
    pd.own_final.record(ctx);  // every bucket's own gradient up to own.ready() is queued
    pd.own_final.wait(*pd.comm);
    pd.comm_pending = true;  // from here, even if a pull throws
    comm_scope = std::make_unique<kernels::ContextScope>(*pd.comm);
    on = pd.comm.get();
  };
  // Once every other device has finished its part of the step, device 0's remaining sums
  // have the whole CPU to themselves: they run with all the cores.
  std::unique_ptr<kernels::ContextScope> wide;
  auto others_done = [&] {
    for (int r = 1; r < static_cast<int>(sources_.size()); ++r)
      if (!signals_.done[r]) return false;
    return true;
  };
  bool stalled = false;  // a hook's pass reached a bucket no source has published yet
  while (pd.next_bucket < pd.own.ready()) {
    const int k = pd.next_bucket;
    const Bucket& b = plan_.buckets[k];
    const int n_sources = static_cast<int>(sources.size());
    while (pd.next_source < n_sources) {
      // The run of sources, from the next one on, that have published bucket k: summed in one
      // fused kernel as soon as there is one, so a source that ends early is not held up by
      // the last. The terms are added in source order whatever the runs, so the sum has the
      // same bits as one kernel over every source.
      int ready = 0;
      auto count_ready = [&] {
        ready = 0;
        while (pd.next_source + ready < n_sources &&
               signals_.complete[sources[pd.next_source + ready]] > k)
          ++ready;
        return ready > 0;
      };
      // CPU device 0 goes wide once every other device has ended its part, from a hook too:
      // its thread is the busiest, so it often ends its backward last, and its sums then had
      // one core while the others idled.
      const bool may_widen = i == 0 && wide_context_ && !wide;
      bool alone = false;
      if (blocking) {
        wait_for(count_ready);
        if (may_widen) {
          std::lock_guard<std::mutex> lock(signal_mutex_);
          alone = others_done();
        }
      } else {
        std::lock_guard<std::mutex> lock(signal_mutex_);
        stalled = !count_ready();  // not there yet: backward goes on
        alone = may_widen && others_done();
      }
      if (stalled) break;
      if (alone) wide = std::make_unique<kernels::ContextScope>(*wide_context_);
      pull_beside();
      if (pd.n_pulls == static_cast<int>(pd.pulls.size()))
        pd.pulls.push_back({0, false, kernels::Event(options_.phase_timing),
                            kernels::Event(options_.phase_timing)});
      Pull& pull = pd.pulls[pd.n_pulls++];
      pull.bucket = k;
      pull.beside = comm_scope != nullptr;
      pull.begin.record(*on);
      sum_sources(*on, i, k, pd.next_source, ready, false);
      pull.end.record(*on);
      pd.next_source += ready;
    }
    if (stalled) break;
    pd.next_source = 0;
    ++pd.next_bucket;
    if (i == 0 && options_.cross_node) {  // hybrid: the node's sum, summed over the nodes
      Tensor mine = replicas_[0]->flat_grads().view(b.offset, {b.numel});
      if (sources.empty() && shares_[0] != 1.f) kernels::scale(mine, mine, shares_[0]);
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
    } else if (i != 0) {
      if (pd.outbox.defined()) {  // rounded once, here, where the sum is final
        Tensor out = pd.outbox.view(b.offset, {b.numel});
        kernels::copy(out, replicas_[i]->flat_grads().view(b.offset, {b.numel}));
      }
      pd.bucket_done[k].record(*on);
      publish(i, pd.next_bucket);
    }
  }
}

void DataParallel::order_after_comm(int i) {
  PerDevice& pd = per_device_[i];
  if (!pd.comm_pending) return;
  pd.comm_done.record(*pd.comm);  // after every pull queued there
  pd.comm_done.wait(pool_.context(i));
  pd.comm_pending = false;
}

void DataParallel::sum_sources(kernels::DeviceContext& on, int i, int k, int j0, int count,
                               bool ordered) {
  PerDevice& pd = per_device_[i];
  const std::vector<int>& sources = sources_[i];
  const Bucket& b = plan_.buckets[k];
  std::vector<Tensor>& from = pd.sum_from;
  std::vector<kernels::Scalar>& weights = pd.sum_weights;
  from.clear();
  weights.clear();
  for (int j = j0; j < j0 + count; ++j) {
    const int s = sources[j];
    if (!ordered) per_device_[s].bucket_done[k].wait(on);  // s's bucket k is final on s's stream
    const PerDevice& src = per_device_[s];
    Tensor theirs = src.outbox.defined() ? src.outbox.view(b.offset, {b.numel})
                                         : replicas_[s]->flat_grads().view(b.offset, {b.numel});
    if (pd.staging[j].defined()) {  // no direct access: one copy over the link first
      Tensor staged = pd.staging[j].view(b.offset, {b.numel});
      kernels::copy(staged, theirs);
      theirs = staged;
    }
    from.push_back(theirs);
    // A leaf holds its chunk's plain mean: weight it here. An inner device of the tree has
    // weighted its own part and summed its sources: weight 1.
    weights.push_back(sources_[s].empty() ? pd.shares[s] : kernels::Scalar(1.f));
  }
  // Each chunk's mean gradient is weighted by its share B_i / B (this device's own, once, with
  // the first run); the sum of the weighted gradients is the global batch's mean.
  Tensor mine = replicas_[i]->flat_grads().view(b.offset, {b.numel});
  kernels::weighted_sum(mine, j0 == 0 ? pd.shares[i] : kernels::Scalar(1.f), from, weights);
}

void DataParallel::reduce_grads_to_root(const std::vector<int64_t>& sizes) {
  DP_CHECK(
      !sizes.empty() && static_cast<int>(sizes.size()) <= n_devices(),
      "reduce_grads_to_root: " << sizes.size() << " chunk sizes for " << n_devices() << " devices");
  DP_CHECK(!options_.cross_node,
           "reduce_grads_to_root: drives one node's reduction alone; not in a hybrid run");
  kernels::NvtxRange range("dp/reduce");
  denominators_ = sizes;  // the chunks' rows: shares B_i / B
  begin_step(sizes);
  run_step("dp/reduce", static_cast<int>(sizes.size()), [&](int i) {
    PerDevice& pd = per_device_[i];
    write_step_values(i);
    prepare_reduction(i);
    pd.own.all_ready();  // every gradient is final
    advance_reduction(i, true);
    if (!options_.reducers.empty()) options_.reducers[i]->finish();
    pool_.context(i).synchronize();  // the caller reads the result next
  });
}

void DataParallel::prepare_reduction(int i) {
  PerDevice& pd = per_device_[i];
  const int64_t p = replicas_[i]->flat_grads().numel();
  // Grown, never shrunk: a graph of a step on more devices holds the staging buffers it was
  // captured with (an extra one staged where it is not needed still sums correctly).
  if (pd.staging.size() < sources_[i].size()) pd.staging.resize(sources_[i].size());
  for (size_t j = 0; j < sources_[i].size(); ++j)
    if (options_.peer_reads == PeerReads::off ||
        !kernels::direct_access(devices_[i], devices_[sources_[i][j]]))
      kernels::ensure(pd.staging[j], {p}, options_.comm_dtype, devices_[i]);
  if (i != 0 && options_.comm_dtype != kernels::DType::f32)
    kernels::ensure(pd.outbox, {p}, options_.comm_dtype, devices_[i]);
}

int64_t DataParallel::comm_grad_bytes() const {
  return replicas_[0]->flat_grads().numel() *
         static_cast<int64_t>(kernels::dtype_size(options_.comm_dtype));
}

void DataParallel::average_buffers_on_root(const std::vector<int64_t>& sizes, bool ordered) {
  Tensor& root = replicas_[0]->flat_buffers();
  if (options_.buffer_sync == BufferSync::root_only || root.numel() == 0) return;
  const int n = static_cast<int>(sizes.size());
  kernels::DeviceContext& ctx = pool_.context(0);
  // Each replica's statistics are final once its forward ran: wait for every device's end.
  if (!ordered) wait_for_raised(&Signals::done, n);
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
  nn::Module& root = *replicas_[0];
  const int64_t p = root.flat_params().nbytes(), g = comm_grad_bytes(),
                b = root.flat_buffers().nbytes();
  const bool average = options_.buffer_sync == BufferSync::average && b > 0;
  for (int r = 1; r < n; ++r) {  // replicate: device 0 sends its parameters and buffers
    out[0] += p + b + (average ? b : 0);
    out[r] += p + b + (average ? b : 0);
  }
  for (int i = 0; i < n; ++i)
    for (int s : sources_[i]) {  // each pull moves one gradient from s to i
      out[i] += g;
      out[s] += g;
    }
  return out;
}

}  // namespace dp
