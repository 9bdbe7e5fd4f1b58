#include "dp/data_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <thread>

namespace dp {

namespace {

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
      pool_(devices_, context_options(devices_, options)) {
  DP_CHECK(module && module->materialized(), "DataParallel: the module must be materialised on "
                                                 << devices_[0] << " (call materialize first)");
  DP_CHECK(module->device() == devices_[0], "DataParallel: the module lives on "
                                                << module->device() << " but devices[0] is "
                                                << devices_[0]);
  std::set<Device> seen(devices_.begin(), devices_.end());
  DP_CHECK(seen.size() == devices_.size(), "DataParallel: a device is listed twice");
  warn_if_oversubscribed(devices_);
  // Work the caller queued on device 0 (initialisation, optimizer state) finishes before any
  // worker reads those buffers from its own stream.
  kernels::context(devices_[0]).synchronize();

  int n = n_devices();
  replicas_.resize(n);
  per_device_.resize(n);
  replicas_[0] = std::move(module);
  // Replicas are built once, each on its own worker, so their memory is counted there.
  pool_.run("dp/clone", [&](int i) {
    if (i > 0) replicas_[i] = replicas_[0]->clone_to(devices_[i]);
  });
  pool_.run("dp/staging", [&](int i) {
    if (i != 0 || n == 1) return;
    staging_grads_ =
        Tensor::empty({replicas_[0]->flat_grads().numel()}, kernels::DType::f32, devices_[0]);
    staging_buffers_ =
        Tensor::empty({replicas_[0]->flat_buffers().numel()}, kernels::DType::f32, devices_[0]);
  });
}

DataParallel::~DataParallel() {
  // Replicas and staging die on their own workers (device memory freed by its owner).
  try {
    pool_.run("dp/teardown", [&](int i) {
      per_device_[i] = PerDevice{};
      if (i > 0) replicas_[i].reset();
      if (i == 0) staging_grads_ = staging_buffers_ = Tensor();
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

void DataParallel::scatter(const Tensor& images, const Tensor& labels,
                           const std::vector<int64_t>& sizes) {
  kernels::NvtxRange range("dp/scatter");
  pool_.run(
      "dp/scatter",
      [&](int i) {
        int64_t begin = chunk_begin(sizes, i);
        Tensor x = images.slice(begin, begin + sizes[i]);
        Tensor y = labels.slice(begin, begin + sizes[i]);
        PerDevice& pd = per_device_[i];
        // Chunk buffers persist between steps; they are remade only when the shape changes.
        kernels::copy(kernels::ensure(pd.input, x.shape(), x.dtype(), devices_[i]), x);
        kernels::copy(kernels::ensure(pd.labels, y.shape(), y.dtype(), devices_[i]), y);
        pool_.context(i).synchronize();  // the caller may reuse the host batch after the step
      },
      static_cast<int>(sizes.size()));
}

void DataParallel::broadcast_params(int n_used) {
  if (n_used < 0) n_used = n_devices();
  kernels::NvtxRange range("dp/replicate");
  pool_.run(
      "dp/replicate",
      [&](int i) {
        if (i == 0) return;
        // One copy per buffer: device 0's parameters (final since the last step) to replica i.
        kernels::copy(replicas_[i]->flat_params(), replicas_[0]->flat_params());
        if (replicas_[i]->flat_buffers().numel() > 0)
          kernels::copy(replicas_[i]->flat_buffers(), replicas_[0]->flat_buffers());
        pool_.context(i).synchronize();
      },
      n_used);
}

void DataParallel::weighted_sum_to_root(Tensor& (nn::Module::*buffer)(), Tensor& staging,
                                        const std::vector<int64_t>& sizes) {
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  DP_CHECK(total > 0, "weighted_sum_to_root: empty batch");
  pool_.run(
      "dp/reduce",
      [&](int i) {
        if (i != 0) return;
        Tensor& root = (replicas_[0].get()->*buffer)();
        // Each replica holds its chunk's MEAN (gradient or statistic); weighting chunk i by
        // B_i / B turns the sum into the global batch's mean.
        kernels::scale(root, root, chunk_share(sizes[0], total));
        for (size_t r = 1; r < sizes.size(); ++r) {
          kernels::copy(staging, (replicas_[r].get()->*buffer)());
          kernels::axpy(root, chunk_share(sizes[r], total), staging);
        }
        pool_.context(0).synchronize();
      },
      1);
}

void DataParallel::reduce_grads_to_root(const std::vector<int64_t>& sizes) {
  DP_CHECK(
      !sizes.empty() && static_cast<int>(sizes.size()) <= n_devices(),
      "reduce_grads_to_root: " << sizes.size() << " chunk sizes for " << n_devices() << " devices");
  kernels::NvtxRange range("dp/reduce");
  weighted_sum_to_root(&nn::Module::flat_grads, staging_grads_, sizes);
}

void DataParallel::average_buffers_to_root(const std::vector<int64_t>& sizes) {
  if (sizes.size() < 2 || replicas_[0]->flat_buffers().numel() == 0) return;
  if (options_.buffer_sync == BufferSync::root_only) return;
  weighted_sum_to_root(&nn::Module::flat_buffers, staging_buffers_, sizes);
}

std::vector<int64_t> DataParallel::split_batch(const char* what, const Tensor& images,
                                               const Tensor& labels, StepStats& stats) {
  DP_CHECK(
      images.defined() && labels.defined() && images.device().is_cpu() && labels.device().is_cpu(),
      what << ": images and labels must be host tensors, got " << images << " and " << labels);
  DP_CHECK(images.ndim() >= 1 && labels.ndim() == 1 && labels.dim(0) == images.dim(0),
           what << ": images " << kernels::shape_str(images.shape()) << " and labels "
                << kernels::shape_str(labels.shape()) << " must share their first dimension");
  DP_CHECK(labels.dtype() == kernels::DType::i32,
           what << ": labels must be i32, got " << labels.dtype());
  DP_CHECK(images.dim(0) >= 1, what << ": empty batch");
  stats.samples = images.dim(0);
  stats.devices_used = devices_for(stats.samples);
  return chunk_sizes(stats.samples, stats.devices_used);
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
  kernels::ensure(pd.loss, {1}, kernels::DType::f32, devices_[i]);
  Tensor dlogits;  // undefined: forward only
  if (mode == nn::Mode::train)
    dlogits = kernels::ensure(pd.dlogits, pd.output.shape(), kernels::DType::f32, devices_[i]);
  kernels::softmax_cross_entropy(pd.loss, dlogits, pd.output, pd.labels, Tensor(),
                                 options_.label_smoothing);
  pd.correct = kernels::count_correct(pd.output, pd.labels);
  pd.loss_value = pd.loss.item();  // waits for the device: ends the phase
  if (mode != nn::Mode::train) m.train();
}

void DataParallel::gather_metrics(const std::vector<int64_t>& sizes, StepStats& stats) {
  for (size_t i = 0; i < sizes.size(); ++i) {
    stats.loss += per_device_[i].loss_value * chunk_share(sizes[i], stats.samples);
    stats.correct += per_device_[i].correct;
  }
}

StepStats DataParallel::train_step(const Tensor& images, const Tensor& labels) {
  StepStats stats;
  std::vector<int64_t> sizes = split_batch("train_step", images, labels, stats);
  const int n_used = stats.devices_used;
  auto t_step = Clock::now();

  auto t0 = Clock::now();
  scatter(images, labels, sizes);
  stats.ms.scatter = ms_since(t0);

  t0 = Clock::now();
  broadcast_params(n_used);
  stats.ms.replicate = ms_since(t0);

  t0 = Clock::now();
  {
    kernels::NvtxRange range("dp/forward");
    pool_.run(
        "dp/forward", [&](int i) { forward_and_loss(i, nn::Mode::train); }, n_used);
  }
  stats.ms.forward = ms_since(t0);

  t0 = Clock::now();
  {
    kernels::NvtxRange range("dp/backward");
    pool_.run(
        "dp/backward",
        [&](int i) {
          replicas_[i]->backward(per_device_[i].dlogits);
          pool_.context(i).synchronize();
        },
        n_used);
  }
  stats.ms.backward = ms_since(t0);

  t0 = Clock::now();
  if (n_used > 1) reduce_grads_to_root(sizes);
  average_buffers_to_root(sizes);
  stats.ms.reduce = ms_since(t0);

  t0 = Clock::now();
  {
    kernels::NvtxRange range("dp/step");
    pool_.run(
        "dp/step",
        [&](int i) {
          optimizer_.step();
          pool_.context(i).synchronize();
        },
        1);
  }
  stats.ms.step = ms_since(t0);

  gather_metrics(sizes, stats);
  int64_t p = parameter_bytes(), b = replicas_[0]->flat_buffers().nbytes();
  stats.bytes_moved = (n_used - 1) * (2 * p + b);  // params out, grads in, buffers out
  if (options_.buffer_sync == BufferSync::average) stats.bytes_moved += (n_used - 1) * b;
  stats.ms.total = ms_since(t_step);
  return stats;
}

StepStats DataParallel::evaluate(const Tensor& images, const Tensor& labels) {
  StepStats stats;
  std::vector<int64_t> sizes = split_batch("evaluate", images, labels, stats);
  scatter(images, labels, sizes);
  broadcast_params(stats.devices_used);
  pool_.run(
      "dp/evaluate", [&](int i) { forward_and_loss(i, nn::Mode::eval); }, stats.devices_used);
  gather_metrics(sizes, stats);
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
