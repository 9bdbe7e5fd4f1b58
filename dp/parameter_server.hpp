// dp::ParameterServer: asynchronous data parallelism on the same logical devices as
// dp::DataParallel, to set beside its synchronous, star-shaped step (`--mode ps`).
//
// The server holds the master weights and the optimizer: the caller's module on devices[0],
// stepped by a server thread that owns its own context there. Each worker (one thread and one
// replica per device) loops on its own, with no barrier:
//   ps/pull     copy the server's current flat parameters (and buffers) into its replica
//   ps/compute  take the next global batch index from a shared counter, forward, loss, backward
//   ps/push     copy its flat gradient to the server, then wait until the server applied it
// The server applies the pushed gradients one at a time (ps/apply, one optimizer step each),
// in arrival order, and counts each update's staleness: how many updates it applied between
// the worker's pull and this push.
//
// Bounded staleness (max_staleness = S >= 0): a worker waits before its pull while S + 1
// gradients are outstanding, and the server applies gradients in pull order, so no update is
// more than S versions stale. The batch index is drawn with the pull's ticket: update k of a
// run() trains batch first + k. S = 0 is synchronous per update: each gradient is computed on
// the weights it is applied to, as on one device, and the workers take the pulls in turn
// (worker i trains the batches b = i mod n, however the batches are split into run() calls),
// so the whole run, dropout masks included, is reproducible.
//
// What is reproducible, and so what a checkpoint between run() calls restores (the server's
// weights, optimizer state and update count, the batch position, each worker's dropout stream
// offset, rng_offsets()):
//   S = 0      everything: resuming gives the uninterrupted run's weights, bit for bit.
//   S > 0      which batch each update applies (k -> first + k) and the order of application;
//              not the version each gradient was computed on (its staleness races), so a
//              resumed run, like any two runs, follows the same curve only statistically.
//   S < 0      the set of batches applied, each once; not their order, nor their staleness.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "dp/trace.hpp"
#include "nn/loss.hpp"
#include "nn/module.hpp"
#include "nn/optim.hpp"

namespace dp {

using kernels::Device;
using kernels::Tensor;

struct PsOptions {
  int max_staleness = -1;  // < 0: unbounded (fully asynchronous)
  // Each update's learning rate is lr / (1 + staleness) when on.
  enum class StalenessLr { constant, scaled } lr = StalenessLr::constant;
  int cpu_threads_per_device = 0;  // 0: the hardware threads split evenly among CPU workers
  // Each worker's loss (nn/loss.hpp); null: row cross-entropy. Every push is one whole batch.
  nn::LossPtr loss;
};

// One applied update, in application order.
struct PsUpdate {
  int worker = 0;
  int64_t batch_index = 0;
  int64_t staleness = 0;  // server versions between this worker's pull and this update
  float loss = 0;         // the batch's mean loss, on the weights the worker pulled
  int64_t samples = 0;    // rows in the batch
  double end_ms = 0;      // when the server finished applying it, since run() began
};

struct PsReport {
  std::vector<PsUpdate> updates;             // every applied gradient, in order
  std::vector<int64_t> staleness_histogram;  // [s]: updates applied with staleness s
  std::vector<int64_t> pushes_per_worker;    // gradients each worker pushed
  int64_t pushes = 0;                        // gradients pushed, all workers
  double seconds = 0;                        // wall time of run()
};

// Global batch `index` as host tensors (images f32 (B, ...), labels i32 (B)). Called from the
// worker threads at once: must be thread-safe, and give the same rows for the same index.
using PsBatchFn = std::function<std::pair<Tensor, Tensor>(int64_t index)>;

class ParameterServer {
 public:
  // requires module materialised on devices[0], optimizer built on it, devices non-empty and
  // distinct.
  ParameterServer(nn::ModulePtr module, nn::Optimizer& optimizer, std::vector<Device> devices,
                  PsOptions options = {});

  // Trains on batch indices first, first + 1, ..., first + n_batches - 1 (each drawn by exactly
  // one worker), and returns once every drawn batch's gradient has been applied. A worker's
  // failure stops the others and is rethrown naming its device. Records each phase into
  // `trace` when given: tracks 0..n-1 for the workers, n for the server.
  PsReport run(const PsBatchFn& batches, int64_t first, int64_t n_batches, Trace* trace = nullptr);

  // The server's module: the master weights, for evaluation and saving.
  nn::Module& module() { return *module_; }
  int n_workers() const { return static_cast<int>(devices_.size()); }
  // Each worker's dropout stream offset, index = worker: kept from one run() to the next (a
  // worker's replica goes on where the last run left it), for checkpoints.
  const std::vector<uint64_t>& rng_offsets() const { return rng_offsets_; }
  // requires offsets.size() == n_workers().
  void set_rng_offsets(const std::vector<uint64_t>& offsets);

 private:
  nn::ModulePtr module_;
  nn::Optimizer& optimizer_;
  std::vector<Device> devices_;
  PsOptions options_;
  std::vector<uint64_t> rng_offsets_;  // per worker
};

}  // namespace dp
