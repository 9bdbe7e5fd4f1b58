#include "dp/data_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <thread>

#include "dp/step.hpp"
#include "kernels/runtime/memory.hpp"

namespace dp {

namespace {

using Clock = std::chrono::steady_clock;

int cpu_threads_for(const std::vector<Device>& devices, int requested) {
  // Checked here, where the engine's first member reads it.
  DP_CHECK(requested >= 0, "DataParallel: cpu_threads_per_device "
                               << requested << ": >= 0 (0: the cores split among CPU devices)");
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

DevicePulls::Options pull_options(const DataParallelOptions& o) {
  DevicePulls::Options p;
  p.topology = o.reduce;
  p.peer_reads = o.peer_reads;
  p.comm_dtype = o.comm_dtype;
  p.math = o.math;
  p.timing = o.phase_timing;
  return p;
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
      pulls_(devices_, &plan_, &signals_, pull_options(options)),
      scaler_(options.scaler ? *options.scaler : nn::GradScaler::options_for(options.precision)) {
  DP_CHECK(module && module->materialized(), "DataParallel: the module must be materialised on "
                                                 << devices_[0] << " (call materialize first)");
  DP_CHECK(module->device() == devices_[0], "DataParallel: the module lives on "
                                                << module->device() << " but devices[0] is "
                                                << devices_[0]);
  std::set<Device> seen(devices_.begin(), devices_.end());
  DP_CHECK(seen.size() == devices_.size(), "DataParallel: a device is listed twice");
  optimizer.require_steps(*module, "DataParallel");
  DP_CHECK(options_.clip_grad_norm >= 0.f && std::isfinite(options_.clip_grad_norm),
           "DataParallel: clip_grad_norm " << options_.clip_grad_norm
                                           << ": finite and >= 0 (0: no clipping)");
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
  DP_CHECK(options_.micro_batches >= 1,
           "DataParallel: micro_batches " << options_.micro_batches << ": 1 or more");
  DP_CHECK(options_.micro_batches == 1 || options_.batch_norm == BatchNormStats::per_device,
           "DataParallel: micro_batches " << options_.micro_batches
                                          << " with SyncBatchNorm: its devices exchange statistics "
                                             "at each forward (micro_batches 1)");
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
    module->parameters_changed();  // a 16-bit copy an earlier step wrote is not node 0's
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
    pd.own = BucketProgress(&plan_.buckets);
    pd.micro.set(options_.micro_batches);
    pulls_.bind(i, replicas_[i].get(), &pool_.context(i));
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
      pulls_.set_wide(wide_context_.get());
    }
  });
  if (options_.cross_node || !options_.reducers.empty())
    hand_on_ = [this](int i, int k) { hand_on(i, k); };
  plan_replicate();  // every f32 weight: no step has written a 16-bit copy yet
}

DataParallel::~DataParallel() {
  // Replicas, staging and events die on their own workers (device memory freed by its owner).
  try {
    if (replicas_[0] && replicas_[0]->materialized()) replicas_[0]->flat().on_grad_ready = nullptr;
    if (replicas_[0] && stats_sync_) nn::set_batch_norm_sync(*replicas_[0], nullptr);
    pool_.run("dp/teardown", [&](int i) {
      pulls_.release(i);  // drains its second stream first: its pulls read the buffers below
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

void DataParallel::write_step_values(int i) {
  PerDevice& pd = per_device_[i];
  const int n = static_cast<int>(step_values_.size());
  if (!pd.step_values.write(step_values_.data(), n, devices_[i])) return;
  const int d = n_devices();  // made now: the views the kernels read
  pd.unscale = pd.step_values.at(0);
  pd.loss_scale = pd.step_values.at(1);
  for (int r = 0; r < d; ++r) {
    pd.shares.push_back(pd.step_values.at(2 + r));
    pd.row_shares.push_back(pd.step_values.at(2 + d + r));
  }
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
  // With research code's reducers each device hands its own buckets on: no device pulls.
  pulls_.begin_step(n, options_.reducers.empty());
  // Read before device 0's forward clears it (its later micro-batches cast nothing either:
  // MicroBatches::queue keeps the copy for them).
  plan_replicate();
  signals_.reset(n_devices());
  for (int i = 0; i < n; ++i) per_device_[i].own.clear();
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

void DataParallel::forward_and_loss(int i, nn::Mode mode, MicroMarks marks) {
  PerDevice& pd = per_device_[i];
  nn::Module& m = *replicas_[i];
  const bool mark_micro = marks == MicroMarks::on;
  if (mode == nn::Mode::train) {
    m.train();
    m.zero_grad();
  } else {
    m.eval();
  }
  kernels::ensure(pd.metrics, {kMetrics}, kernels::DType::f32, devices_[i]);
  Tensor output;  // read by nothing after the loss, and not held past this step
  if (mode == nn::Mode::train && pd.micro.count() > 1) {
    // Every micro-batch but the last runs its backward here, before this device's hooks hand
    // buckets on (pd.in_step is off): its gradient only accumulates.
    const size_t n_marks = 2 * static_cast<size_t>(pd.micro.count() - 1);
    if (mark_micro && pd.micro_marks.size() < n_marks) pd.micro_marks.resize(n_marks);
    kernels::DeviceContext& ctx = pool_.context(i);
    auto backward = [&](const Tensor& dy) {
      if (mark_micro) pd.micro_marks[pd.micro_marks_used++].record(ctx);
      m.backward(dy);
      if (mark_micro) pd.micro_marks[pd.micro_marks_used++].record(ctx);
    };
    output = pd.micro.queue(
        m, [&](const Tensor& x) { return m.forward(x); }, backward, *options_.loss, pd.input,
        pd.labels, pd.metrics.view(kLoss, {1}), &pd.dlogits, pd.metrics.view(kCorrect, {1}),
        !m.backward_reads_output());
  } else {
    output = queue_forward_and_loss(
        m, [&](const Tensor& x) { return m.forward(x); }, *options_.loss, pd.input, pd.labels,
        pd.metrics.view(kLoss, {1}), mode == nn::Mode::train ? &pd.dlogits : nullptr,
        scaler_.loss_grad_factor(pd.loss_scale), pd.metrics.view(kCorrect, {1}),
        !m.backward_reads_output());
  }
  pd.dlogits_is_output =
      mode == nn::Mode::train && output.defined() && pd.dlogits.same_storage(output);
  Tensor fault_word = pd.metrics.view(kFaultWord, {2});
  kernels::queue_fault_word(fault_word, pool_.context(i));  // a bad label or token id
  if (mode != nn::Mode::train) m.train();
}

void DataParallel::queue_update() {
  // One decision for every device: device 0's reduced gradient is checked (under AMP) and
  // clipped there; the host learns the verdict and the norm with the metrics (train_step).
  Tensor& metrics = per_device_[0].metrics;
  dp::queue_update(replicas_[0]->flat_grads(), optimizer_, scaler_, options_.clip_grad_norm,
                   per_device_[0].unscale, metrics.view(kNonFinite, {1}),
                   metrics.view(kGradNorm, {1}));
}

void DataParallel::eval_job(int i, const Tensor& images, const Tensor& labels,
                            const std::vector<int64_t>& sizes) {
  scatter_chunk(i, images, labels, sizes);
  if (i > 0) replicate(i);  // eval reads device 0's buffers but does not change them
  forward_and_loss(i, nn::Mode::eval);
  if (i > 0) {
    per_device_[i].marks[kReduced].record(pool_.context(i));  // its part ends here
    signals_.raise(StepSignals::Flag::done, i);
  } else {
    read_step_metrics(static_cast<int>(sizes.size()));
  }
}

StepStats DataParallel::train_step(const Tensor& batch_images, const Tensor& batch_labels) {
  check_groups_usable("train_step");
  StepStats stats;
  Tensor images = batch_images, labels = batch_labels;  // hybrid: narrowed to the node's chunk
  std::vector<int64_t> sizes = split_batch("train_step", images, labels, stats);
  const int64_t cross_before = options_.cross_node ? options_.cross_node->payload_bytes() : 0;
  reducer_before_.resize(options_.reducers.size());  // sized once: no allocation per step
  for (size_t i = 0; i < options_.reducers.size(); ++i)
    reducer_before_[i] = options_.reducers[i]->payload_bytes();
  cross_wait_ms_ = 0;
  const int n_used = stats.devices_used;
  if (options_.micro_batches > 1)  // each device's micro-batches and their weights
    for (int64_t i = 0, begin = 0; i < n_used; begin += sizes[i++])
      per_device_[i].micro.plan(*options_.loss, labels.slice(begin, begin + sizes[i]));
  auto t_step = Clock::now();
  step_scale_ = scaler_.scale();
  begin_step(sizes);
  if (stats_sync_) stats_sync_->set_participants(n_used);
  graphed_step_ = use_graphs();
  if (graphed_step_) {
    // The step's shape: what a graph bakes in. The chunk shapes select the graphs (the loss
    // scale and the shares are read on the devices); a new one runs uncaptured twice, then is
    // captured.
    uint64_t host_values = 0;  // any replica's change captures every device's steps again
    for (auto& r : replicas_) host_values += r->flat().host_values_version;
    graph_key_.begin(host_values);
    graph_key_.values.insert(graph_key_.values.end(), sizes.begin(), sizes.end());
    graph_key_.add_row_shape(images);
    graph_key_.add_row_shape(labels);
    auto it = per_device_[0].graphs.find(graph_key_);
    stats.graphed = it != per_device_[0].graphs.end() && it->second.runs >= kGraphWarmupRuns;
    stats.captured = stats.graphed && !it->second.all_captured();
  }
  begin_counts();
  try {
    run_step(
        "dp/train_step", n_used, [&](int i) { train_job(i, images, labels, sizes); },
        UsesReducers::yes);
    if (graphed_step_ && settle_capture_failures(n_used)) stats.graphed = stats.captured = false;
    for (int i = 0; stats.graphed && i < n_used; ++i) {
      const StepSegments& seg = per_device_[i].graphs.at(graph_key_);
      stats.graph_nodes += seg.compute.nodes() + seg.finish.nodes();
    }
  } catch (...) {
    for (PerDevice& pd : per_device_) pd.capture_failure.clear();
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
  LaggedSlot* previous = nullptr;
  if (options_.metrics_lag > 0) {
    // The caller may refill the host batch once this returns: wait until every device has
    // taken this step's inputs (on a GPU: until the previous step is done there).
    for (int i = 0; i < n_used; ++i) {
      per_device_[i].marks[kScattered].synchronize();
      pool_.context(i).note_host_sync();
    }
    previous = &lagged_.previous(step_index_);  // its copy is complete by now
    if (previous->pending) previous->ready.synchronize();
  }
  stats.ms.total = ms_since(t_step);
  const StepCounts counts = end_counts();
  stats.allocations = counts.allocations;
  stats.host_syncs = counts.host_syncs;
  stats.casts = counts.casts;
  stats.peak_bytes = counts.peak_bytes;
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
    settled = previous->take(nullptr);  // waited for above
    settled_shares = &previous->extra.shares;
  }
  if (settled) {
    settle_step(settled, *settled_shares, stats);
  } else {  // a run's first step: nothing to report yet
    stats.metrics_lagged = true;
    stats.loss = std::numeric_limits<float>::quiet_NaN();
  }
  collect_step(n_used, stats);
  const int64_t b = replicas_[0]->flat_buffers().nbytes();
  // Parameters (with their 16-bit copy where the replicas took it) and buffers out, gradients in
  // (in the comm dtype, or what the reducers sent).
  stats.bytes_moved =
      (n_used - 1) * (replicate_bytes() + (options_.reducers.empty() ? pulls_.grad_bytes() : 0));
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

StepStats DataParallel::evaluate(const Tensor& batch_images, const Tensor& batch_labels) {
  StepStats stats;
  Tensor images = batch_images, labels = batch_labels;
  if (options_.cross_node) check_groups_usable("evaluate");  // it sums over the nodes
  std::vector<int64_t> sizes = split_batch("evaluate", images, labels, stats);
  begin_step(sizes);
  run_step(
      "dp/evaluate", stats.devices_used, [&](int i) { eval_job(i, images, labels, sizes); },
      UsesReducers::no);
  report_device_faults(host_metrics_.data<float>(), stats.devices_used);
  gather_metrics(host_metrics_.data<float>(), shares_, stats);
  return stats;
}

}  // namespace dp
