#include "dp/data_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <set>
#include <thread>

#include "kernels/runtime/memory.hpp"
#include "nn/clip.hpp"

namespace dp {

namespace {

// Entries of a device's metrics buffer: loss, correct count, on device 0 the non-finite verdict
// and the gradient norm (clipping on), and the first word of the device's fault record (two
// f32: kernels::queue_fault_word), read on the host with the rest.
constexpr int64_t kMetrics = 6;
constexpr int64_t kNonFinite = 2, kGradNorm = 3, kFaultWord = 4;

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

int cpu_threads_for(const std::vector<Device>& devices, int requested) {
  if (requested > 0) return requested;
  int n_cpu = 0;
  for (auto& d : devices) n_cpu += d.is_cpu();
  int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, hw / std::max(1, n_cpu));
}

kernels::ContextOptions context_options(const std::vector<Device>& devices,
                                        const DataParallelOptions& o) {
  kernels::ContextOptions c;
  c.cpu_threads = cpu_threads_for(devices, o.cpu_threads_per_device);
  c.math = o.math;
  c.caching = kernels::Caching::on;  // every step repeats the last one's allocations
  return c;
}

}  // namespace

bool warn_if_oversubscribed(const std::vector<Device>& devices) {
  int logical = 0;
  for (auto& d : devices) logical += d.is_cuda();
  int physical = kernels::cuda_device_count();
  if (logical == 0 || logical <= physical) return false;
  std::fprintf(stderr,
               "dp: warning: %d logical CUDA devices share %d physical GPU%s: figures measure "
               "engine overhead, not scaling\n",
               logical, physical, physical == 1 ? "" : "s");
  return true;
}

DataParallel::DataParallel(nn::ModulePtr module, nn::Optimizer& optimizer,
                           std::vector<Device> devices, DataParallelOptions options)
    : devices_(std::move(devices)),
      options_(options),
      optimizer_(optimizer),
      pool_(devices_, context_options(devices_, options)),
      scaler_(options.scaler ? *options.scaler : nn::GradScaler::options_for(options.precision)) {
  DP_CHECK(module && module->materialized(), "DataParallel: the module must be materialised on "
                                                 << devices_[0] << " (call materialize first)");
  DP_CHECK(module->device() == devices_[0], "DataParallel: the module lives on "
                                                << module->device() << " but devices[0] is "
                                                << devices_[0]);
  std::set<Device> seen(devices_.begin(), devices_.end());
  DP_CHECK(seen.size() == devices_.size(), "DataParallel: a device is listed twice");
  DP_CHECK(
      options_.comm_dtype == kernels::DType::f32 || options_.comm_dtype == kernels::DType::bf16,
      "DataParallel: gradients travel in f32 or bf16, not " << options_.comm_dtype);
  DP_CHECK(options_.metrics_lag == 0 || options_.metrics_lag == 1,
           "DataParallel: metrics_lag " << options_.metrics_lag << ": 0 or 1");
  if (options_.metrics_lag == 1) {
    DP_CHECK(graphs_requested(options_.graphs, devices_[0]),
             "DataParallel: metrics_lag 1 needs graphed steps (graphs on, or automatic on CUDA "
             "devices): device 0's metrics gather is then queued with its update");
    DP_CHECK(options_.phase_timing == kernels::Event::Timing::off,
             "DataParallel: metrics_lag 1 with phase_timing on: a step's phase marks are not "
             "reached when it returns; set phase_timing off");
    DP_CHECK(!scaler_.enabled(),
             "DataParallel: metrics_lag 1 with the loss scaler's check (precision "
                 << nn::precision_name(options_.precision)
                 << "): a checked step's verdict decides the next step's count and scale, so it "
                    "is read with its step (metrics_lag 0)");
    DP_CHECK(!options_.cross_node,
             "DataParallel: metrics_lag 1 in a hybrid run: the nodes' sums are read with the step");
  }
  // Replicas inherit the compute dtype from device 0's module (clone_to), and that the input
  // gradient is not needed (the input is data: the first layer skips that product).
  if (!options_.loss)
    options_.loss = std::make_shared<nn::CrossEntropyLoss>(options_.label_smoothing);
  module->set_compute_dtype(nn::compute_dtype(options_.precision));
  module->set_output(nn::output_for(options_.precision, *options_.loss));
  module->set_input_grad(nn::InputGrad::not_needed);
  warn_if_oversubscribed(devices_);
  DP_CHECK(!options_.cross_node || options_.batch_norm == BatchNormStats::per_device,
           "DataParallel: SyncBatchNorm across the nodes of a hybrid run is not supported (each "
           "node's devices would sync among themselves only)");
  if (!options_.reducers.empty()) {
    const int n = n_devices();
    DP_CHECK(static_cast<int>(options_.reducers.size()) == n,
             "DataParallel: " << options_.reducers.size() << " reducers for " << n
                              << " devices: give one per device");
    for (int i = 0; i < n; ++i)
      DP_CHECK(options_.reducers[i] && options_.reducers[i]->nodes() == n &&
                   options_.reducers[i]->node() == i,
               "DataParallel: reducers[" << i << "] must be device " << i << "'s end of a group of "
                                         << n << " (one rank per device, in device order)");
    DP_CHECK(!options_.cross_node,
             "DataParallel: reducers in a hybrid run: the hook of a hybrid run takes the sums "
             "over nodes (dp::dist::GroupCrossNode)");
    DP_CHECK(options_.comm_dtype == kernels::DType::f32,
             "DataParallel: reducers with comm dtype "
                 << options_.comm_dtype
                 << ": a reducer is handed the f32 bucket and chooses what travels");
  }
  // Work the caller queued on device 0 (initialisation, optimizer state) finishes before any
  // worker reads those buffers from its own stream.
  kernels::context(devices_[0]).synchronize();
  if (options_.cross_node) {  // hybrid: every node starts from node 0's weights
    options_.cross_node->broadcast(module->flat_params());
    if (module->flat_buffers().numel() > 0) options_.cross_node->broadcast(module->flat_buffers());
  }

  int n = n_devices();
  replicas_.resize(n);
  per_device_.resize(n);
  replicas_[0] = std::move(module);
  plan_ = make_bucket_plan(*replicas_[0], options_.first_bucket_bytes, options_.bucket_cap_bytes);
  // Replicas are built once, each on its own worker, so their memory is counted there.
  pool_.run("dp/clone", [&](int i) {
    if (i > 0) replicas_[i] = replicas_[0]->clone_to(devices_[i]);
  });
  if (options_.cross_node)  // hybrid: node k's device i draws as device k n + i of one node
    for (int i = 0; i < n; ++i)
      replicas_[i]->set_rng_stream(static_cast<uint64_t>(options_.cross_node->node()) * n + i);
  if (options_.batch_norm == BatchNormStats::synced) {
    stats_sync_ = std::make_unique<ThreadStatsSync>(n);
    for (int i = 0; i < n; ++i) nn::set_batch_norm_sync(*replicas_[i], stats_sync_->participant(i));
  }
  for (int i = 0; i < n; ++i) {
    PerDevice& pd = per_device_[i];
    pd.own_count.assign(plan_.buckets.size(), 0);
    for (size_t k = 0; k < plan_.buckets.size(); ++k)
      pd.bucket_done.emplace_back(kernels::Event::Timing::off);  // ordering only
    for (auto& mark : pd.marks) mark = kernels::Event(options_.phase_timing);
    replicas_[i]->flat().on_grad_ready = [this, i](const nn::Parameter& p) { on_grad_ready(i, p); };
  }
  pool_.run("dp/staging", [&](int i) {
    if (i != 0 || n == 1) return;
    staging_buffers_ =
        Tensor::empty({replicas_[0]->flat_buffers().numel()}, kernels::DType::f32, devices_[0]);
    // The optimizer step runs while the other workers are idle: on a CPU device 0 it gets
    // every core, not device 0's share of them.
    int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (devices_[0].is_cpu() && pool_.context(0).cpu_threads() < hw) {
      kernels::ContextOptions wide;
      wide.cpu_threads = hw;
      wide.math = options_.math;
      wide.caching = kernels::Caching::on;
      wide_context_ = std::make_unique<kernels::DeviceContext>(devices_[0], wide);
    }
  });
}

DataParallel::~DataParallel() {
  // Replicas, staging and events die on their own workers (device memory freed by its owner).
  try {
    if (replicas_[0] && replicas_[0]->materialized()) replicas_[0]->flat().on_grad_ready = nullptr;
    if (replicas_[0] && stats_sync_) nn::set_batch_norm_sync(*replicas_[0], nullptr);
    pool_.run("dp/teardown", [&](int i) {
      per_device_[i].comm.reset();  // drains its stream first: its pulls read the buffers below
      per_device_[i] = PerDevice{};
      if (i > 0) replicas_[i].reset();
      if (i == 0) {
        staging_buffers_ = Tensor();
        wide_context_.reset();
      }
      pool_.context(i).synchronize();
    });
  } catch (const std::exception& e) {
    DP_LOG_ERROR("DataParallel teardown: " << e.what());
  }
}

std::vector<uint64_t> DataParallel::rng_offsets() {
  std::vector<uint64_t> out;
  for (auto& r : replicas_) out.push_back(r->flat().rng_offset);
  return out;
}

void DataParallel::set_rng_offsets(const std::vector<uint64_t>& offsets) {
  DP_CHECK(
      offsets.size() == replicas_.size(),
      "set_rng_offsets: " << offsets.size() << " offsets for " << replicas_.size() << " devices");
  for (size_t i = 0; i < replicas_.size(); ++i) replicas_[i]->flat().rng_offset = offsets[i];
}

int DataParallel::devices_for(int64_t batch) {
  int n = n_devices();
  if (batch >= n) return n;
  if (!warned_small_batch_) {
    std::fprintf(stderr, "dp: note: a batch of %lld rows uses %lld of %d devices\n",
                 static_cast<long long>(batch), static_cast<long long>(batch), n);
    warned_small_batch_ = true;
  }
  return static_cast<int>(batch);
}

void DataParallel::scatter_chunk(int i, const Tensor& images, const Tensor& labels,
                                 const std::vector<int64_t>& sizes) {
  int64_t begin = chunk_begin(sizes, i);
  Tensor x = images.slice(begin, begin + sizes[i]);
  Tensor y = labels.slice(begin, begin + sizes[i]);
  PerDevice& pd = per_device_[i];
  // Chunk buffers persist between steps; they are remade only when the shape changes.
  kernels::copy(kernels::ensure(pd.input, x.shape(), x.dtype(), devices_[i]), x);
  kernels::copy(kernels::ensure(pd.labels, y.shape(), y.dtype(), devices_[i]), y);
}

void DataParallel::replicate(int i) {
  // One copy per buffer: device 0's parameters (final since the last step, whose job ended
  // with device 0's stream drained, or with metrics_lag 1 once updated_ is reached) to replica
  // i, on replica i's stream.
  if (options_.metrics_lag > 0 && updated_.recorded()) updated_.wait(pool_.context(i));
  kernels::copy(replicas_[i]->flat_params(), replicas_[0]->flat_params());
  if (replicas_[i]->flat_buffers().numel() > 0)
    kernels::copy(replicas_[i]->flat_buffers(), replicas_[0]->flat_buffers());
}

void DataParallel::broadcast_params(int n_used) {
  if (n_used < 0) n_used = n_devices();
  kernels::NvtxRange range("dp/replicate");
  pool_.run(
      "dp/replicate",
      [&](int i) {
        if (i == 0) return;
        replicate(i);
        pool_.context(i).synchronize();
      },
      n_used);
}

template <class Pred>
void DataParallel::wait_for(Pred pred) {
  std::unique_lock<std::mutex> lock(signal_mutex_);
  signal_cv_.wait(lock, [&] { return signals_.abort || pred(); });
  if (!pred()) throw Abandoned{};
}

void DataParallel::publish(int i, int complete_buckets) {
  {
    std::lock_guard<std::mutex> lock(signal_mutex_);
    signals_.complete[i] = complete_buckets;
  }
  signal_cv_.notify_all();
}

void DataParallel::write_step_values(int i) {
  PerDevice& pd = per_device_[i];
  if (!pd.step_values.defined()) {
    const int d = n_devices();
    pd.step_values = Tensor::empty({2 + 2 * d}, kernels::DType::f32, devices_[i]);
    pd.unscale = kernels::Scalar(pd.step_values.view(0, {1}));
    pd.loss_scale = kernels::Scalar(pd.step_values.view(1, {1}));
    for (int r = 0; r < d; ++r) {
      pd.shares.emplace_back(pd.step_values.view(2 + r, {1}));
      pd.row_shares.emplace_back(pd.step_values.view(2 + d + r, {1}));
    }
  } else if (pd.written_values == step_values_) {
    return;  // the device holds them already
  }
  const int n = static_cast<int>(step_values_.size());
  for (int at = 0; at < n; at += kernels::kMaxValues) {
    Tensor part = pd.step_values.view(at, {std::min(kernels::kMaxValues, n - at)});
    kernels::set_values(part, step_values_.data() + at, static_cast<int>(part.numel()));
  }
  pd.written_values = step_values_;  // once the writes are queued (its storage is reused)
}

void DataParallel::begin_step(const std::vector<int64_t>& sizes) {
  const int n = static_cast<int>(sizes.size());
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  DP_CHECK(denominators_.size() == sizes.size() && total > 0,
           "begin_step: the loss denominators do not match the split batch");
  // Hybrid: each chunk's share of the global batch's denominator (this node's chunks hold part
  // of it); the sum over nodes then makes the global mean.
  shares_ = options_.cross_node ? loss_shares(denominators_, global_denominator_)
                                : loss_shares(denominators_);
  row_shares_ = loss_shares(sizes, options_.cross_node ? global_rows_ : total);
  step_values_.assign(2 + 2 * static_cast<size_t>(n_devices()), 0.f);
  step_values_[0] = 1.f / step_scale_;
  step_values_[1] = step_scale_;
  std::copy(shares_.begin(), shares_.end(), step_values_.begin() + 2);
  std::copy(row_shares_.begin(), row_shares_.end(), step_values_.begin() + 2 + n_devices());
  // Who pulls from whom, in order. Star: 0 <- 1, 2, ..., n-1. Tree: in round s = 1, 2, 4, ...
  // device i (a multiple of 2s) pulls from i + s: 0 <- 1, 2 <- 3, then 0 <- 2.
  sources_.assign(n, {});
  if (!options_.reducers.empty()) {
    // Each device hands its own buckets to its reducer: no device pulls from another.
  } else if (options_.reduce == ReduceTopology::star) {
    for (int r = 1; r < n; ++r) sources_[0].push_back(r);
  } else {
    for (int s = 1; s < n; s *= 2)
      for (int i = 0; i + s < n; i += 2 * s) sources_[i].push_back(i + s);
  }
  signals_.complete.assign(n_devices(), 0);
  signals_.replicated.assign(n_devices(), 0);
  signals_.done.assign(n_devices(), 0);
  signals_.abort = false;
  for (int i = 0; i < n; ++i) {
    PerDevice& pd = per_device_[i];
    std::fill(pd.own_count.begin(), pd.own_count.end(), 0);
    pd.own_ready = 0;
    pd.next_bucket = 0;
    pd.next_source = 0;
    pd.n_pulls = 0;
  }
}

void DataParallel::run_step(const char* phase, int n, const std::function<void(int)>& job) {
  pool_.run(
      phase,
      [&](int i) {
        try {
          job(i);
        } catch (const Abandoned&) {
          // Another worker failed and ended the step: its error is the one reported.
        } catch (...) {
          per_device_[i].in_step = false;
          bool first = false;
          {
            std::lock_guard<std::mutex> lock(signal_mutex_);
            first = !signals_.abort;
            signals_.abort = true;
          }
          signal_cv_.notify_all();
          // A replica waiting for this one in a SyncBatchNorm layer is released too.
          if (stats_sync_) stats_sync_->abort("device " + devices_[i].str() + " failed");
          // Released by another worker's failure: that error is the one reported.
          if (!first) return;
          throw;
        }
      },
      n);
}

void DataParallel::on_grad_ready(int i, const nn::Parameter& p) {
  PerDevice& pd = per_device_[i];
  if (!pd.in_step || p.numel() == 0) return;
  const auto& buckets = plan_.buckets;
  const int n_buckets = static_cast<int>(buckets.size());
  for (int k = 0; k < n_buckets; ++k)
    if (p.offset >= buckets[k].offset && p.offset < buckets[k].offset + buckets[k].numel) {
      ++pd.own_count[k];
      break;
    }
  while (pd.own_ready < n_buckets && pd.own_count[pd.own_ready] >= buckets[pd.own_ready].n_params)
    ++pd.own_ready;
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
    pd.own_final.record(ctx);  // every bucket's own gradient up to own_ready is queued
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
  while (pd.next_bucket < pd.own_ready) {
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
    pd.own_ready = static_cast<int>(plan_.buckets.size());  // every gradient is final
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

std::vector<int64_t> DataParallel::split_batch(const char* what, Tensor& images, Tensor& labels,
                                               StepStats& stats) {
  DP_CHECK(
      images.defined() && labels.defined() && images.device().is_cpu() && labels.device().is_cpu(),
      what << ": images and labels must be host tensors, got " << images << " and " << labels);
  DP_CHECK(images.ndim() >= 1 && labels.ndim() >= 1 && labels.dim(0) == images.dim(0),
           what << ": images " << kernels::shape_str(images.shape()) << " and labels "
                << kernels::shape_str(labels.shape()) << " must share their first dimension");
  options_.loss->check_target(labels);
  DP_CHECK(images.dim(0) >= 1, what << ": empty batch");
  stats.samples = images.dim(0);
  if (const CrossNode* cross = options_.cross_node.get()) {  // hybrid: this node's chunk
    // Checked alike on every node (each knows the batch and the node count), so no node goes on
    // into a collective that another one left.
    DP_CHECK(stats.samples >= cross->nodes(),
             what << ": a global batch of " << stats.samples << " rows leaves "
                  << cross->nodes() - stats.samples << " of " << cross->nodes()
                  << " nodes without rows: give at least one row per node");
    const std::vector<int64_t> nodes = chunk_sizes(stats.samples, cross->nodes());
    const int64_t rows = nodes[cross->node()], begin = chunk_begin(nodes, cross->node());
    global_denominator_ = options_.loss->denominator(labels);
    global_rows_ = stats.samples;
    images = images.slice(begin, begin + rows);
    labels = labels.slice(begin, begin + rows);
  }
  stats.node_samples = images.dim(0);
  // A reducer's group has a rank per device: every one of them takes part in each step.
  DP_CHECK(options_.reducers.empty() || stats.node_samples >= n_devices(),
           what << ": a batch of " << stats.node_samples << " rows leaves "
                << n_devices() - stats.node_samples << " of " << n_devices()
                << " devices without rows, and a reducer's group needs all of them: give at "
                   "least one row per device");
  stats.devices_used = devices_for(stats.node_samples);
  std::vector<int64_t> sizes = chunk_sizes(stats.node_samples, stats.devices_used);
  denominators_.assign(sizes.size(), 0);
  for (size_t i = 0, begin = 0; i < sizes.size(); begin += sizes[i++])
    denominators_[i] = options_.loss->denominator(labels.slice(begin, begin + sizes[i]));
  return sizes;
}

void DataParallel::forward_and_loss(int i, nn::Mode mode) {
  PerDevice& pd = per_device_[i];
  nn::Module& m = *replicas_[i];
  if (mode == nn::Mode::train) {
    m.train();
    m.zero_grad();
  } else {
    m.eval();
  }
  pd.output = m.forward(pd.input);
  kernels::ensure(pd.metrics, {kMetrics}, kernels::DType::f32, devices_[i]);
  Tensor loss = pd.metrics.view(0, {1}), correct = pd.metrics.view(1, {1});
  Tensor dlogits;  // undefined: forward only
  if (mode == nn::Mode::train)
    dlogits = kernels::ensure(pd.dlogits, pd.output.shape(), pd.output.dtype(), devices_[i]);
  options_.loss->compute(loss, dlogits, pd.output, pd.labels);
  options_.loss->count_correct_into(correct, pd.output, pd.labels);
  Tensor fault_word = pd.metrics.view(kFaultWord, {2});
  kernels::queue_fault_word(fault_word, pool_.context(i));  // a bad label or token id
  // fp16: the loss gradient carries the step's scale (read on the device: nothing to do
  // otherwise).
  if (dlogits.defined()) scaler_.scale_loss_grad(dlogits, pd.loss_scale);
  if (mode != nn::Mode::train) m.train();
}

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
  // Device 0's source and weight lists, idle once its reductions are done: no vectors per step.
  std::vector<Tensor>& from = per_device_[0].sum_from;
  std::vector<kernels::Scalar>& weights = per_device_[0].sum_weights;
  kernels::fill(node, 0.f);
  Tensor loss = node.view(0, {1}), correct = node.view(1, {1});
  from.clear();
  for (int r = 0; r < n; ++r) from.push_back(gathered_metrics_.view(kMetrics * r, {1}));
  const std::vector<kernels::Scalar>& shares = per_device_[0].shares;
  weights.assign(shares.begin(), shares.begin() + n);  // one per device used
  kernels::weighted_sum(loss, 1.f, from, weights);
  from.clear();
  for (int r = 0; r < n; ++r) from.push_back(gathered_metrics_.view(kMetrics * r + 1, {1}));
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
    wait_for_raised(&Signals::done, n);
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
    LaggedMetrics& slot = lagged_[step_index_ % 2];
    Tensor host = host_view(slot.host);
    kernels::queue_read_back(host, all);
    slot.ready.record(ctx);
    slot.shares = shares_;
    slot.pending = true;
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
    stats.loss += m[kMetrics * i] * shares[i];
    stats.correct += static_cast<int64_t>(m[kMetrics * i + 1]);
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

void DataParallel::drain() {
  // Every device's work done, a device-side fault reported (each context by its owner).
  pool_.run("dp/drain", [&](int i) { pool_.context(i).synchronize(); });
}

StepStats DataParallel::finish_metrics() {
  DP_CHECK(options_.metrics_lag > 0,
           "finish_metrics: metrics_lag is 0: every step returned its own metrics");
  LaggedMetrics& last = lagged_[(step_index_ + 1) % 2];
  DP_CHECK(last.pending,
           "finish_metrics: no step's metrics are pending (none ran since the "
           "last were returned)");
  drain();
  StepStats stats;
  stats.metrics_lagged = true;
  last.pending = false;
  settle_step(last.host.data<float>(), last.shares, stats);
  return stats;
}

template <class F>
void DataParallel::for_each_context(int i, F f) {
  f(pool_.context(i));
  if (per_device_[i].comm) f(*per_device_[i].comm);
  if (i == 0 && wide_context_) f(*wide_context_);
}

DataParallel::RuntimeCounts DataParallel::runtime_counts() {
  RuntimeCounts n;
  for (int i = 0; i < n_devices(); ++i)
    for_each_context(i, [&](kernels::DeviceContext& c) {
      n.allocations += c.memory()->allocations.load();
      n.host_syncs += c.host_syncs();
      n.casts += c.casts();
    });
  return n;
}

void DataParallel::begin_memory_window() {
  for (int i = 0; i < n_devices(); ++i)
    for_each_context(i, [](kernels::DeviceContext& c) { c.memory()->begin_window(); });
}

int64_t DataParallel::window_peak_bytes() {
  int64_t most = 0;
  for (int i = 0; i < n_devices(); ++i) {
    int64_t device = 0;
    for_each_context(i,
                     [&](kernels::DeviceContext& c) { device += c.memory()->window_peak.load(); });
    most = std::max(most, device);
  }
  return most;
}

void DataParallel::train_job(int i, const Tensor& images, const Tensor& labels,
                             const std::vector<int64_t>& sizes) {
  PerDevice& pd = per_device_[i];
  kernels::DeviceContext& ctx = pool_.context(i);
  nn::Module& m = *replicas_[i];
  const int n = static_cast<int>(sizes.size());
  begin_job(i, images, labels, sizes);
  {
    kernels::NvtxRange range("dp/forward");
    forward_and_loss(i, nn::Mode::train);
  }
  pd.marks[kForwarded].record(ctx);
  prepare_reduction(i);
  {
    kernels::NvtxRange range("dp/backward");
    pd.in_step = true;  // from here the hooks hand buckets on as they become ready
    m.backward(pd.dlogits);
    pd.in_step = false;
  }
  pd.marks[kBackwarded].record(ctx);
  {
    kernels::NvtxRange range("dp/reduce");
    pd.own_ready = static_cast<int>(plan_.buckets.size());  // also buckets of unused layers
    advance_reduction(i, true);
    if (!options_.reducers.empty()) options_.reducers[i]->finish();  // its buckets' collectives
    if (i == 0 && n > 1) average_buffers_on_root(sizes);
    if (i == 0 && options_.cross_node) finish_cross_node(n);
  }
  pd.marks[kReduced].record(ctx);
  if (i > 0) {
    raise_signal(&Signals::done, i);
  } else {
    kernels::NvtxRange range("dp/step");
    std::unique_ptr<kernels::ContextScope> wide;
    if (wide_context_) wide = std::make_unique<kernels::ContextScope>(*wide_context_);
    scaler_.prepare_deferred(optimizer_);  // the optimizer's per-step scalars, to the device
    queue_update();
    wide.reset();
    pd.marks[kStepped].record(ctx);
    // The one host wait of the step: the caller may reuse the host batch, and read device 0's
    // module from its own stream, once train_step returns.
    read_step_metrics(n, false, step_read());
  }
}

void DataParallel::begin_job(int i, const Tensor& images, const Tensor& labels,
                             const std::vector<int64_t>& sizes) {
  PerDevice& pd = per_device_[i];
  kernels::DeviceContext& ctx = pool_.context(i);
  pd.marks[kBegin].record(ctx);
  order_after_comm(i);  // a failed step's pulls: this step's writes wait for them
  write_step_values(i);
  {
    kernels::NvtxRange range("dp/scatter");
    scatter_chunk(i, images, labels, sizes);
  }
  pd.marks[kScattered].record(ctx);
  if (i > 0) {
    kernels::NvtxRange range("dp/replicate");
    replicate(i);
  }
  pd.marks[kReplicated].record(ctx);
  order_buffers_before_forward(i, static_cast<int>(sizes.size()));
}

void DataParallel::raise_signal(std::vector<char> Signals::*flags, int i) {
  {
    std::lock_guard<std::mutex> lock(signal_mutex_);
    (signals_.*flags)[i] = 1;
  }
  signal_cv_.notify_all();
}

void DataParallel::wait_for_raised(std::vector<char> Signals::*flags, int n) {
  wait_for([&] {
    for (int r = 1; r < n; ++r)
      if (!(signals_.*flags)[r]) return false;
    return true;
  });
}

void DataParallel::order_buffers_before_forward(int i, int n) {
  if (replicas_[i]->flat_buffers().numel() == 0) return;
  if (i > 0) return raise_signal(&Signals::replicated, i);
  if (n == 1) return;
  // Device 0's forward updates its running statistics in place: every replica takes its copy of
  // them first (the one dependency before forward, and only for models with buffers).
  wait_for_raised(&Signals::replicated, n);
  for (int r = 1; r < n; ++r) per_device_[r].marks[kReplicated].wait(pool_.context(0));
}

void DataParallel::queue_update() {
  nn::Module& m = *replicas_[0];
  // One decision for every device: device 0's reduced gradient is checked (under AMP), on the
  // device; the update skips itself when it is not finite, and the host learns the verdict with
  // the metrics (settled in train_step). Clipping too stays on the device: the norm is read
  // with the metrics.
  Tensor& metrics = per_device_[0].metrics;
  if (options_.clip_grad_norm > 0.f) {
    Tensor norm = metrics.view(kGradNorm, {1});
    nn::clip_grad_norm_into(m.flat_grads(), options_.clip_grad_norm, per_device_[0].unscale, norm);
  }
  Tensor non_finite = metrics.view(kNonFinite, {1});
  scaler_.apply_deferred(optimizer_, m.flat_grads(), non_finite);
}

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
  prepare_reduction(i);
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
  if (i == 0 || !sources_[i].empty() || pd.outbox.defined()) {
    kernels::NvtxRange range("dp/reduce");
    std::vector<int>& waits = pd.graph_waits;
    waits.clear();
    if (i == 0)
      for (int r = 1; r < n; ++r) waits.push_back(r);
    else
      waits = sources_[i];
    wait_for([&] {
      for (int r : waits)
        if (!signals_.done[r]) return false;
      return true;
    });
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
            const int n_sources = static_cast<int>(sources_[i].size());
            if (n_sources > 0)
              for (int k = 0; k < static_cast<int>(plan_.buckets.size()); ++k)
                sum_sources(*on, i, k, 0, n_sources, true);
            if (pd.outbox.defined()) kernels::copy(pd.outbox, m.flat_grads());  // rounded once
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
    raise_signal(&Signals::done, i);
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

kernels::AttentionReport DataParallel::attention_report() {
  kernels::AttentionReport report;
  // On device 0's worker: the context's state is its thread's.
  pool_.run(
      "dp/attention_report", [&](int) { report = kernels::attention_report(pool_.context(0)); }, 1);
  return report;
}

bool DataParallel::use_graphs() {
  if (!graphs_requested(options_.graphs, devices_[0]) || !graphs_fallback_.empty()) return false;
  const std::string why = graphs_blocked();
  if (why.empty()) return true;
  if (!said_graphs_off_) {
    std::fprintf(stderr, "dp: graphs off: %s\n", why.c_str());
    said_graphs_off_ = true;
  }
  return false;
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

void DataParallel::eval_job(int i, const Tensor& images, const Tensor& labels,
                            const std::vector<int64_t>& sizes) {
  scatter_chunk(i, images, labels, sizes);
  if (i > 0) replicate(i);  // eval reads device 0's buffers but does not change them
  forward_and_loss(i, nn::Mode::eval);
  if (i > 0) {
    per_device_[i].marks[kReduced].record(pool_.context(i));  // its part ends here
    raise_signal(&Signals::done, i);
  } else {
    read_step_metrics(static_cast<int>(sizes.size()));
  }
}

StepStats DataParallel::train_step(const Tensor& batch_images, const Tensor& batch_labels) {
  StepStats stats;
  Tensor images = batch_images, labels = batch_labels;  // hybrid: narrowed to the node's chunk
  std::vector<int64_t> sizes = split_batch("train_step", images, labels, stats);
  const int64_t cross_before = options_.cross_node ? options_.cross_node->payload_bytes() : 0;
  reducer_before_.resize(options_.reducers.size());  // sized once: no allocation per step
  for (size_t i = 0; i < options_.reducers.size(); ++i)
    reducer_before_[i] = options_.reducers[i]->payload_bytes();
  cross_wait_ms_ = 0;
  const int n_used = stats.devices_used;
  auto t_step = Clock::now();
  step_scale_ = scaler_.scale();
  begin_step(sizes);
  if (stats_sync_) stats_sync_->set_participants(n_used);
  graphed_step_ = use_graphs();
  if (graphed_step_) {
    // The step's shape: what a graph bakes in. The chunk shapes select the graphs (the loss
    // scale and the shares are read on the devices); a new one runs uncaptured twice, then is
    // captured.
    graph_key_.values.assign(sizes.begin(), sizes.end());  // its storage is reused
    graph_key_.add_row_shape(images);
    graph_key_.add_row_shape(labels);
    auto it = per_device_[0].graphs.find(graph_key_);
    stats.graphed = it != per_device_[0].graphs.end() && it->second.runs >= kGraphWarmupRuns;
    stats.captured = stats.graphed && !it->second.compute.captured();
  }
  const auto before = runtime_counts();
  begin_memory_window();
  try {
    run_step("dp/train_step", n_used, [&](int i) {
      if (graphed_step_)
        graph_job(i, images, labels, sizes);
      else
        train_job(i, images, labels, sizes);
    });
    if (graphed_step_ && settle_capture_failures(n_used)) stats.graphed = stats.captured = false;
    for (int i = 0; stats.graphed && i < n_used; ++i) {
      const GraphSet& gs = per_device_[i].graphs.at(graph_key_);
      stats.graph_nodes += gs.compute.nodes() + gs.reduce.nodes();
    }
  } catch (...) {
    for (PerDevice& pd : per_device_) pd.capture_failure.reason.clear();
    // A failed step is no warm-up run of its shape: the shape runs uncaptured twice again
    // before a capture (which needs the sizes both runs leave in the caches), whatever was
    // captured of it already staying.
    if (graphed_step_)
      for (int i = 0; i < n_used; ++i) {
        auto it = per_device_[i].graphs.find(graph_key_);
        if (it != per_device_[i].graphs.end()) it->second.runs = 0;
      }
    throw;
  }
  LaggedMetrics* previous = nullptr;
  if (options_.metrics_lag > 0) {
    // The caller may refill the host batch once this returns: wait until every device has
    // taken this step's inputs (on a GPU: until the previous step is done there).
    for (int i = 0; i < n_used; ++i) {
      per_device_[i].marks[kScattered].synchronize();
      pool_.context(i).note_host_sync();
    }
    previous = &lagged_[(step_index_ + 1) % 2];  // its copy is complete by now
    if (previous->pending) previous->ready.synchronize();
  }
  stats.ms.total = ms_since(t_step);
  const auto after = runtime_counts();
  stats.allocations = after.allocations - before.allocations;
  stats.host_syncs = after.host_syncs - before.host_syncs;
  stats.casts = after.casts - before.casts;
  stats.peak_bytes = window_peak_bytes();
  stats.loss_scale = step_scale_;
  if (options_.cross_node) {
    stats.ms.cross_node = cross_wait_ms_;
    stats.cross_node_bytes = options_.cross_node->payload_bytes() - cross_before;
  }
  const float* settled = nullptr;  // the host metrics returned, and their step's shares
  const std::vector<float>* settled_shares = nullptr;
  if (!previous) {
    settled = host_metrics_.data<float>();
    settled_shares = &shares_;
  } else if (previous->pending) {
    stats.metrics_lagged = true;
    previous->pending = false;
    settled = previous->host.data<float>();
    settled_shares = &previous->shares;
  }
  if (settled) {
    settle_step(settled, *settled_shares, stats);
  } else {  // a run's first step: nothing to report yet
    stats.metrics_lagged = true;
    stats.loss = std::numeric_limits<float>::quiet_NaN();
  }
  collect_step(n_used, stats);
  int64_t p = parameter_bytes(), b = replicas_[0]->flat_buffers().nbytes();
  // Parameters out, gradients in (in the comm dtype, or what the reducers sent), buffers out.
  stats.bytes_moved = (n_used - 1) * (p + (options_.reducers.empty() ? comm_grad_bytes() : 0) + b);
  if (options_.buffer_sync == BufferSync::average) stats.bytes_moved += (n_used - 1) * b;
  stats.link_bytes = link_bytes(n_used);
  for (size_t i = 0; i < options_.reducers.size(); ++i) {
    const int64_t sent = options_.reducers[i]->payload_bytes() - reducer_before_[i];
    stats.reducer_bytes += sent;
    stats.link_bytes[i] += sent;
  }
  stats.bytes_moved += stats.reducer_bytes;
  ++step_index_;
  if (settled) report_device_faults(settled, static_cast<int>(settled_shares->size()));
  return stats;
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
    for (int j = 0; j < per_device_[i].n_pulls; ++j)
      stats.pulls_beside_backward += per_device_[i].pulls[j].beside;
  if (options_.phase_timing == Event::Timing::off) return;  // the marks only ordered the work
  auto between = [&](int i, Mark a, Mark b) {
    return Event::elapsed_ms(per_device_[i].marks[a], per_device_[i].marks[b]);
  };
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
  for (int i = 0; i < n; ++i) {
    const PerDevice& pd = per_device_[i];
    if (i == 0) {
      t.scatter = between(0, kBegin, kScattered);
      t.replicate = between(0, kScattered, kReplicated);
      t.forward = between(0, kReplicated, kForwarded);
    }
    // Pulls done inside backward (from the hooks) are reduction, not backward; those on a
    // communication stream ran beside it and took none of its stream's time.
    double pulled = 0, pulled_inline = 0;
    for (int j = 0; j < pd.n_pulls; ++j)
      if (Event::elapsed_ms(pd.pulls[j].begin, pd.marks[kBackwarded]) > 0) {
        const double ms = Event::elapsed_ms(pd.pulls[j].begin, pd.pulls[j].end);
        pulled += ms;
        if (!pd.pulls[j].beside) pulled_inline += ms;
      }
    if (i == 0) {
      t.backward = between(0, kForwarded, kBackwarded) - pulled_inline;
      t.reduce_in_backward = pulled;
    }
    last_backward_end = std::max(last_backward_end, at(i, pd.marks[kBackwarded]));
  }
  t.reduce = between(0, kBackwarded, kReduced);
  t.step = between(0, kReduced, kStepped);

  std::vector<Clock::time_point> first_pull(n_buckets, Clock::time_point::max());
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < per_device_[i].n_pulls; ++j) {
      const Pull& pull = per_device_[i].pulls[j];
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
    slice("dp/forward", i, pd.marks[kReplicated], pd.marks[kForwarded]);
    slice("dp/backward", i, pd.marks[kForwarded], pd.marks[kBackwarded]);
    if (!sources_[i].empty()) slice("dp/reduce", i, pd.marks[kBackwarded], pd.marks[kReduced]);
    for (int j = 0; j < pd.n_pulls; ++j)  // beside backward: on the comm stream's own track
      slice("dp/reduce[bucket " + std::to_string(pd.pulls[j].bucket) + "]", i, pd.pulls[j].begin,
            pd.pulls[j].end, pd.pulls[j].beside ? comm_track(i) : i);
    if (i == 0) slice("dp/step", i, pd.marks[kReduced], pd.marks[kStepped]);
  }
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

StepStats DataParallel::evaluate(const Tensor& batch_images, const Tensor& batch_labels) {
  StepStats stats;
  Tensor images = batch_images, labels = batch_labels;
  std::vector<int64_t> sizes = split_batch("evaluate", images, labels, stats);
  begin_step(sizes);
  run_step("dp/evaluate", stats.devices_used, [&](int i) { eval_job(i, images, labels, sizes); });
  report_device_faults(host_metrics_.data<float>(), stats.devices_used);
  gather_metrics(host_metrics_.data<float>(), shares_, stats);
  return stats;
}

std::vector<int64_t> DataParallel::peak_memory_bytes() {
  std::vector<int64_t> out(n_devices());
  for (int i = 0; i < n_devices(); ++i) out[i] = pool_.context(i).memory()->peak.load();
  nn::Module& root = *replicas_[0];
  out[0] += root.flat_params().nbytes() + root.flat_grads().nbytes() + root.flat_buffers().nbytes();
  return out;
}

}  // namespace dp
