// dp::DataParallel: one process, one persistent worker thread per device (PyTorch's
// nn.DataParallel, without re-cloning replicas every step).
//
// One train_step, each phase an NVTX range and a timed phase of the returned stats:
//   dp/scatter    split the host batch along dim 0 (uneven chunks allowed), H2D per worker
//   dp/replicate  copy device 0's flat parameters (and buffers) into every replica: one copy
//                 each. This is steps 2 and 6 of the design, done once per step before forward,
//                 so weights the caller changes between steps (a loaded checkpoint) take effect.
//   dp/forward    forward + fused softmax cross-entropy on every device at once
//   dp/backward   backward on every device at once (gradients of each chunk's mean loss)
//   dp/reduce     device 0 pulls each replica's flat gradient and sums it in, weighted by the
//                 chunk's share of the batch: the result equals the single-device gradient of
//                 the same global batch, also for uneven chunks. BatchNorm running statistics
//                 are averaged into device 0 the same way (or left as device 0's, PyTorch's
//                 behaviour, with BufferSync::root_only).
//   dp/step       one optimizer step on device 0's flat buffers
//
// Replicas run BatchNorm on their own chunk ("ghost" batch statistics), as PyTorch DP does; a
// BatchNorm model therefore matches one device that runs the same chunks one after another and
// accumulates their weighted gradients, not one that normalises the whole batch at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dp/chunks.hpp"
#include "dp/worker_pool.hpp"
#include "nn/module.hpp"
#include "nn/optim.hpp"

namespace dp {

using kernels::Device;
using kernels::Tensor;

// What happens to non-parameter buffers (BatchNorm running stats) after a step.
enum class BufferSync { average, root_only };

struct DataParallelOptions {
  BufferSync buffer_sync = BufferSync::average;
  float label_smoothing = 0.f;
  kernels::MathMode math = kernels::MathMode::strict;
  int cpu_threads_per_device = 0;  // 0: the hardware threads split evenly among CPU devices
};

// Milliseconds of each phase of one step, measured on the host around phases that end with
// their devices' work finished (each worker waits for its stream at the end of a phase).
struct PhaseTimes {
  double scatter = 0, replicate = 0, forward = 0, backward = 0, reduce = 0, step = 0, total = 0;
};

struct StepStats {
  float loss = 0;        // mean loss over the global batch
  int64_t correct = 0;   // rows whose argmax equals the label
  int64_t samples = 0;   // global batch size
  int devices_used = 0;  // fewer than n_devices() when the batch is smaller than the count
  PhaseTimes ms;
  int64_t bytes_moved = 0;  // parameter and gradient bytes copied between devices this step
};

class DataParallel {
 public:
  // requires module materialised on devices[0], optimizer built on that module's flat buffers,
  // devices non-empty and distinct. Builds the replicas once (clone_to) on their workers.
  DataParallel(nn::ModulePtr module, nn::Optimizer& optimizer, std::vector<Device> devices,
               DataParallelOptions options = {});
  ~DataParallel();

  // requires images (B, ...) f32 and labels (B) i32 on the host, B >= 1. Pinned memory lets the
  // scatter overlap; pageable works too.
  StepStats train_step(const Tensor& images, const Tensor& labels);
  // Forward in eval mode over the batch, split across devices. Returns loss and correct count.
  StepStats evaluate(const Tensor& images, const Tensor& labels);

  // Device 0's module: the one the optimizer steps, for evaluation and saving.
  nn::Module& module() { return *replicas_[0]; }
  nn::Module& replica(int i) { return *replicas_[i]; }
  int n_devices() const { return pool_.size(); }
  const std::vector<Device>& devices() const { return devices_; }

  // Copies device 0's flat parameters and buffers into replicas 1..n-1 (all when n < 0): the
  // replicate phase of a step, one copy per replica. Public for benchmarks and tests.
  void broadcast_params(int n = -1);
  // Device 0's gradient := sum_i (chunk_sizes[i] / sum) * replica i's gradient. The one place
  // where DP averaging is defined. Public so that tests can drive it directly.
  void reduce_grads_to_root(const std::vector<int64_t>& chunk_sizes);
  // Balanced split of a batch of `batch` rows over `n` devices (dp/chunks.hpp).
  static std::vector<int64_t> chunk_sizes(int64_t batch, int n) {
    return dp::chunk_sizes(batch, n);
  }

  // Peak bytes allocated per device: through each worker's context, plus, on device 0, the
  // module's flat state (made before the workers started).
  std::vector<int64_t> peak_memory_bytes();
  // Records every phase of every worker into `trace` (null: off). Set between steps.
  void set_trace(Trace* trace) { pool_.set_trace(trace); }
  // Bytes of one flat parameter copy (P * 4).
  int64_t parameter_bytes() { return replicas_[0]->flat_params().nbytes(); }

 private:
  // Copies chunk i of (images, labels) to worker i's device.
  void scatter(const Tensor& images, const Tensor& labels, const std::vector<int64_t>& sizes);
  void average_buffers_to_root(const std::vector<int64_t>& chunk_sizes);
  // root's (buffer)() := sum_i share_i * replica i's, pulled through `staging` on device 0.
  void weighted_sum_to_root(Tensor& (nn::Module::*buffer)(), Tensor& staging,
                            const std::vector<int64_t>& chunk_sizes);
  int devices_for(int64_t batch);
  // Checks a host batch, fills stats.samples/devices_used and returns the chunk sizes.
  std::vector<int64_t> split_batch(const char* what, const Tensor& images, const Tensor& labels,
                                   StepStats& stats);
  // On worker i: forward, fused softmax cross-entropy (with dlogits in train mode), metrics.
  void forward_and_loss(int i, nn::Mode mode);
  void gather_metrics(const std::vector<int64_t>& chunk_sizes, StepStats& stats);

  std::vector<Device> devices_;
  DataParallelOptions options_;
  nn::Optimizer& optimizer_;
  WorkerPool pool_;
  std::vector<nn::ModulePtr> replicas_;  // [0] is the caller's module
  struct PerDevice {
    Tensor input, labels;  // this step's chunk on the device
    Tensor output, loss, dlogits;
    float loss_value = 0;
    int64_t correct = 0;
  };
  std::vector<PerDevice> per_device_;
  Tensor staging_grads_, staging_buffers_;  // on device 0: one replica's gradient/buffers
  bool warned_small_batch_ = false;
};

// Prints (once per call) a warning when logical CUDA devices outnumber physical GPUs: figures
// then measure engine overhead, not scaling. Returns true when that is the case.
bool warn_if_oversubscribed(const std::vector<Device>& devices);

}  // namespace dp
