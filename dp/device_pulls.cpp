// DataParallel's star and tree pulls (dp/device_pulls.hpp).
#include "dp/device_pulls.hpp"

#include <string>
#include <utility>

#include "kernels/ops.hpp"

namespace dp {

DevicePulls::DevicePulls(std::vector<kernels::Device> devices, const BucketPlan* plan,
                         StepSignals* signals, Options options)
    : devices_(std::move(devices)),
      plan_(plan),
      signals_(signals),
      options_(options),
      modules_(devices_.size(), nullptr),
      compute_(devices_.size(), nullptr),
      per_device_(devices_.size()) {}

void DevicePulls::bind(int i, nn::Module* module, kernels::DeviceContext* compute) {
  modules_[i] = module;
  compute_[i] = compute;
  PerDevice& pd = per_device_[i];
  pd.bucket_done.clear();
  pd.own_done.clear();
  for (size_t k = 0; k < plan_->buckets.size(); ++k) {  // ordering only
    pd.bucket_done.emplace_back(kernels::Event::Timing::off);
    pd.own_done.emplace_back(kernels::Event::Timing::off);
  }
}

void DevicePulls::begin_step(int n, bool pulls) {
  pulls_ = pulls;
  // Who pulls from whom, in order. Star: 0 <- 1, 2, ..., n-1. Tree: in round s = 1, 2, 4, ...
  // device i (a multiple of 2s) pulls from i + s: 0 <- 1, 2 <- 3, then 0 <- 2.
  sources_.assign(n, {});
  if (!pulls) {
    // Each device hands its own buckets on: no device pulls from another.
  } else if (options_.topology == ReduceTopology::star) {
    for (int r = 1; r < n; ++r) sources_[0].push_back(r);
  } else {
    for (int s = 1; s < n; s *= 2)
      for (int i = 0; i + s < n; i += 2 * s) sources_[i].push_back(i + s);
  }
  for (int i = 0; i < n; ++i) {
    PerDevice& pd = per_device_[i];
    pd.next_bucket = 0;
    pd.next_source = 0;
    pd.next_marked = 0;
    pd.n_pulls = 0;
  }
}

void DevicePulls::prepare(int i) {
  PerDevice& pd = per_device_[i];
  const int64_t p = grads(i).numel();
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

void DevicePulls::advance(int i, int ready, bool blocking,
                          const std::vector<kernels::Scalar>& shares, const HandOn& hand_on) {
  PerDevice& pd = per_device_[i];
  kernels::DeviceContext& ctx = *compute_[i];
  const std::vector<int>& sources = sources_[i];
  if (blocking) order_after_comm(i);  // backward is queued: what follows waits for the pulls
  // A GPU receiver's pulls from a hook go to its communication stream, from the first one
  // queued: the compute stream goes on with backward while they wait for their sources.
  kernels::DeviceContext* on = &ctx;
  std::unique_ptr<kernels::ContextScope> comm_scope;
  auto pull_beside = [&] {
    if (blocking || !devices_[i].is_cuda() || comm_scope) return;
    pd.own_final.record(ctx);  // every bucket's own gradient up to `ready` is queued
    on = &beside_context(i, comm_scope);
    pd.own_final.wait(*on);
  };
  // Once every other device has finished its part of the step, device 0's remaining sums
  // have the whole CPU to themselves: they run with all the cores.
  std::unique_ptr<kernels::ContextScope> wide;
  auto others_done = [&] {
    return signals_->all_raised(StepSignals::Flag::done, 1, static_cast<int>(sources_.size()));
  };
  bool stalled = false;  // a hook's pass reached a bucket no source has published yet
  while (pd.next_bucket < ready) {
    const int k = pd.next_bucket;
    const int n_sources = static_cast<int>(sources.size());
    while (pd.next_source < n_sources) {
      // The run of sources, from the next one on, that have published bucket k: summed in one
      // fused kernel as soon as there is one, so a source that ends early is not held up by
      // the last. The terms are added in source order whatever the runs, so the sum has the
      // same bits as one kernel over every source.
      int n_ready = 0;
      auto count_ready = [&] {
        n_ready = 0;
        while (pd.next_source + n_ready < n_sources &&
               signals_->published(sources[pd.next_source + n_ready]) > k)
          ++n_ready;
        return n_ready > 0;
      };
      // CPU device 0 goes wide once every other device has ended its part, from a hook too:
      // its thread is the busiest, so it often ends its backward last, and its sums then had
      // one core while the others idled.
      const bool may_widen = i == 0 && wide_ && !wide;
      bool alone = false;
      if (blocking) {
        signals_->wait_for(count_ready);
        if (may_widen) alone = signals_->locked(others_done);
      } else {
        signals_->locked([&] {
          stalled = !count_ready();  // not there yet: backward goes on
          alone = may_widen && others_done();
        });
      }
      if (stalled) break;
      if (alone) wide = std::make_unique<kernels::ContextScope>(*wide_);
      pull_beside();
      Pull& pull = begin_pull(*on, i, k, comm_scope != nullptr);
      sum_sources(*on, i, k, pd.next_source, n_ready, false, shares);
      pull.end.record(*on);
      pd.next_source += n_ready;
    }
    if (stalled) break;
    pd.next_source = 0;
    ++pd.next_bucket;
    if (hand_on) hand_on(i, k);
    if (pulls_ && i != 0) {  // a source: its receiver may pull bucket k now
      round_outbox(*on, i, k);
      pd.bucket_done[k].record(*on);
      signals_->publish(i, pd.next_bucket);
    }
  }
}

kernels::DeviceContext& DevicePulls::beside_context(int i,
                                                    std::unique_ptr<kernels::ContextScope>& scope) {
  PerDevice& pd = per_device_[i];
  if (!devices_[i].is_cuda()) return *compute_[i];
  if (!pd.comm) {
    kernels::ContextOptions comm;
    comm.math = options_.math;
    comm.caching = kernels::Caching::on;
    pd.comm = std::make_unique<kernels::DeviceContext>(devices_[i], comm);
  }
  pd.comm_pending = true;  // from here, even if a pull throws
  scope = std::make_unique<kernels::ContextScope>(*pd.comm);
  return *pd.comm;
}

void DevicePulls::round_outbox(kernels::DeviceContext& on, int i, int k) {
  const PerDevice& pd = per_device_[i];
  if (!pd.outbox.defined()) return;
  const Bucket& b = plan_->buckets[k];
  kernels::ContextScope scope(on);
  kernels::Tensor out = pd.outbox.view(b.offset, {b.numel});
  kernels::copy(out, grads(i).view(b.offset, {b.numel}));  // rounded once, where it is final
}

DevicePulls::Pull& DevicePulls::begin_pull(kernels::DeviceContext& on, int i, int k, bool beside) {
  PerDevice& pd = per_device_[i];
  if (pd.n_pulls == static_cast<int>(pd.pulls.size()))
    pd.pulls.push_back(
        {0, false, kernels::Event(options_.timing), kernels::Event(options_.timing)});
  Pull& pull = pd.pulls[pd.n_pulls++];
  pull.bucket = k;
  pull.beside = beside;
  pull.begin.record(on);
  return pull;
}

void DevicePulls::mark_in_graph(int i, int ready) {
  PerDevice& pd = per_device_[i];
  kernels::DeviceContext& ctx = *compute_[i];
  const bool receives = !sources_[i].empty();
  for (; pd.next_marked < ready; ++pd.next_marked) {
    const int k = pd.next_marked;
    if (receives) {
      pd.own_done[k].record_in_graph(ctx);  // its pulls of bucket k wait for it
    } else if (i != 0) {                    // a leaf source: its receiver pulls bucket k
      round_outbox(ctx, i, k);
      pd.bucket_done[k].record_in_graph(ctx);
    }
  }
}

void DevicePulls::sum_beside_graph(int i, const std::vector<kernels::Scalar>& shares) {
  PerDevice& pd = per_device_[i];
  const int n_sources = static_cast<int>(sources_[i].size());
  if (n_sources == 0) return;
  std::unique_ptr<kernels::ContextScope> scope;
  kernels::DeviceContext& on = beside_context(i, scope);
  const bool beside = &on != compute_[i];
  for (int k = 0; k < static_cast<int>(plan_->buckets.size()); ++k) {
    pd.own_done[k].wait(on);  // recorded by the graph launched before: this step's
    Pull& pull = begin_pull(on, i, k, beside);
    sum_sources(on, i, k, 0, n_sources, false, shares);  // after each source's bucket_done[k]
    pull.end.record(on);
    if (i != 0) {  // an inner device of the tree: its receiver pulls bucket k next
      round_outbox(on, i, k);
      pd.bucket_done[k].record(on);
    }
  }
  scope.reset();
  order_after_comm(i);
}

void DevicePulls::order_after_comm(int i) {
  PerDevice& pd = per_device_[i];
  if (!pd.comm_pending) return;
  pd.comm_done.record(*pd.comm);  // after every pull queued there
  pd.comm_done.wait(*compute_[i]);
  pd.comm_pending = false;
}

void DevicePulls::sum_all(kernels::DeviceContext& on, int i,
                          const std::vector<kernels::Scalar>& shares) {
  const int n_sources = static_cast<int>(sources_[i].size());
  if (n_sources > 0)
    for (int k = 0; k < static_cast<int>(plan_->buckets.size()); ++k)
      sum_sources(on, i, k, 0, n_sources, true, shares);
  const PerDevice& pd = per_device_[i];
  if (pd.outbox.defined()) {  // rounded once
    kernels::Tensor out = pd.outbox;
    kernels::copy(out, grads(i));
  }
}

void DevicePulls::sum_sources(kernels::DeviceContext& on, int i, int k, int j0, int count,
                              bool ordered, const std::vector<kernels::Scalar>& shares) {
  PerDevice& pd = per_device_[i];
  const std::vector<int>& sources = sources_[i];
  const Bucket& b = plan_->buckets[k];
  std::vector<kernels::Tensor>& from = pd.sum_from;
  std::vector<kernels::Scalar>& weights = pd.sum_weights;
  from.clear();
  weights.clear();
  for (int j = j0; j < j0 + count; ++j) {
    const int s = sources[j];
    if (!ordered) per_device_[s].bucket_done[k].wait(on);  // s's bucket k is final on s's stream
    const PerDevice& src = per_device_[s];
    kernels::Tensor theirs = src.outbox.defined() ? src.outbox.view(b.offset, {b.numel})
                                                  : grads(s).view(b.offset, {b.numel});
    if (pd.staging[j].defined()) {  // no direct access: one copy over the link first
      kernels::Tensor staged = pd.staging[j].view(b.offset, {b.numel});
      kernels::copy(staged, theirs);
      theirs = staged;
    }
    from.push_back(theirs);
    // A leaf holds its chunk's plain mean: weight it here. An inner device of the tree has
    // weighted its own part and summed its sources: weight 1.
    weights.push_back(sources_[s].empty() ? shares[s] : kernels::Scalar(1.f));
  }
  // Each chunk's mean gradient is weighted by its share B_i / B (this device's own, once, with
  // the first run); the sum of the weighted gradients is the global batch's mean.
  kernels::Tensor mine = grads(i).view(b.offset, {b.numel});
  kernels::weighted_sum(mine, j0 == 0 ? shares[i] : kernels::Scalar(1.f), from, weights);
}

int64_t DevicePulls::grad_bytes() const {
  return modules_[0]->flat_grads().numel() *
         static_cast<int64_t>(kernels::dtype_size(options_.comm_dtype));
}

void DevicePulls::add_link_bytes(std::vector<int64_t>& out) const {
  const int64_t g = grad_bytes();
  for (size_t i = 0; i < sources_.size() && i < out.size(); ++i)
    for (int s : sources_[i]) {  // each pull moves one gradient from s to i
      out[i] += g;
      out[s] += g;
    }
}

void DevicePulls::release(int i) {
  per_device_[i].comm.reset();  // drains its stream first: its pulls read the buffers below
  per_device_[i] = PerDevice{};
}

}  // namespace dp
