// DataParallel's workers (dp/data_parallel.hpp): how the per-device threads run a step's jobs
// and hand each other progress (dp/step_signals.hpp, and the failure that ends a step for all of
// them), and the copies between device 0 and the replicas (scatter, replicate).
#include "dp/data_parallel.hpp"

#include <algorithm>
#include <exception>
#include <limits>
#include <string>

namespace dp {

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
  nn::FlatState& mine = replicas_[i]->flat();
  const nn::FlatState& root = replicas_[0]->flat();
  // Mixed precision: device 0's 16-bit weights are its f32 ones rounded (its optimizer wrote
  // both): the replica takes them as they are, a copy of half the bytes in place of its
  // forward's cast (which reads the f32 weights and writes the same bits). Its forward then
  // casts nothing, as device 0's does, and reads no f32 value of a weight read only through the
  // copy (Linear's, Conv2d's): those are not copied (f32_runs_). Otherwise every f32 weight is
  // copied and its forward casts (a flag left from a step whose forward did not run must not
  // stand).
  const bool take =
      replicas_take_compute_ && mine.compute_params.defined() && root.compute_params.defined();
  if (take) {
    for (const auto& [begin, end] : f32_runs_) {
      Tensor run = mine.params.view(begin, {end - begin});
      kernels::copy(run, root.params.view(begin, {end - begin}));
    }
    kernels::copy(mine.compute_params, root.compute_params);
    if (nn::weight_copy_check())  // a read of a stale weight shows as NaN
      for (const auto& [begin, end] : stale_runs_) {
        Tensor stale = mine.params.view(begin, {end - begin});
        kernels::fill(stale, std::numeric_limits<float>::quiet_NaN());
      }
  } else {
    kernels::copy(mine.params, root.params);
  }
  if (mine.buffers.numel() > 0) kernels::copy(mine.buffers, root.buffers);
  mine.compute_written = take;
  if (take)
    mine.stale_runs = stale_runs_;  // the same size each step: no allocation
  else
    mine.stale_runs.clear();
}

void DataParallel::plan_replicate() {
  replicas_take_compute_ = device0_compute_fresh();
  const nn::FlatState& root = replicas_[0]->flat();
  const std::pair<uint64_t, uint64_t> version{root.host_values_version, root.copy_reads_version};
  if (planned_ && planned_take_ == replicas_take_compute_ && planned_version_ == version) return;
  planned_ = true;
  planned_take_ = replicas_take_compute_;
  planned_version_ = version;
  f32_runs_.clear();
  stale_runs_.clear();
  const int64_t total = replicas_[0]->flat_params().numel();
  if (!replicas_take_compute_) {
    f32_runs_.emplace_back(0, total);
    return;
  }
  // Runs between the weights read through the copy: each from the first parameter after one
  // that is not to the start of the next one that is (or the end), padding behind it included;
  // none between two of them (their padding is not copied).
  int64_t at = 0;      // the end of the last parameter
  int64_t first = -1;  // the start of the run since the last weight read through the copy
  for (const auto& [name, p] : replicas_[0]->named_parameters()) {
    if (p->numel() == 0) continue;
    DP_CHECK(p->offset >= at, "replicate: parameter " << name << " at flat element " << p->offset
                                                      << " comes before the one ending at " << at
                                                      << " (the flat layout is in order)");
    at = p->offset + p->numel();
    if (!p->read_through_copy) {
      if (first < 0) first = p->offset;
      continue;
    }
    if (first >= 0) f32_runs_.emplace_back(first, p->offset);
    first = -1;
    stale_runs_.emplace_back(p->offset, at);
  }
  if (first >= 0) f32_runs_.emplace_back(first, total);
}

bool DataParallel::device0_compute_fresh() const {
  return replicas_[0]->flat().compute_params.defined() && replicas_[0]->flat().compute_written;
}

int64_t DataParallel::replicate_bytes() const {
  const nn::FlatState& root = replicas_[0]->flat();
  int64_t f32 = 0;
  for (const auto& [begin, end] : f32_runs_) f32 += end - begin;
  return f32 * static_cast<int64_t>(sizeof(float)) + root.buffers.nbytes() +
         (replicas_take_compute_ ? root.compute_params.nbytes() : 0);
}

void DataParallel::broadcast_params(int n_used) {
  if (n_used < 0) n_used = n_devices();
  kernels::NvtxRange range("dp/replicate");
  plan_replicate();
  pool_.run(
      "dp/replicate",
      [&](int i) {
        if (i == 0) return;
        replicate(i);
        pool_.context(i).synchronize();
      },
      n_used);
}

namespace {

// The message of the exception being handled (inside a catch block).
std::string current_error_text() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

void DataParallel::check_groups_usable(const char* op) const {
  DP_CHECK(left_group_.empty(),
           op << ": " << (options_.reducers.empty() ? "this node" : "research code's reducers")
              << " left their collectives' group in an earlier step, when " << left_group_
              << "; the group cannot be used again: make it and the engine anew");
}

void DataParallel::run_step(const char* phase, int n, const std::function<void(int)>& job,
                            UsesReducers uses_reducers) {
  pool_.run(
      phase,
      [&](int i) {
        try {
          job(i);
        } catch (const StepSignals::Abandoned&) {
          // Another worker failed and ended the step: its error is the one reported.
        } catch (...) {
          per_device_[i].in_step = false;
          const bool first = signals_.abort();
          // A replica waiting for this one in a SyncBatchNorm layer is released too.
          if (stats_sync_) stats_sync_->abort("device " + devices_[i].str() + " failed");
          // So is a device, or another node, waiting in a collective for this one (research
          // code's reducers; a hybrid run's link between nodes): this device, or this node,
          // leaves the group as a dead rank would, so their ops fail now, not at the group's
          // timeout. The group is gone for good: later steps are refused, naming this failure.
          // (An evaluation does not use the reducers: they stay.)
          const bool reducers = uses_reducers == UsesReducers::yes && !options_.reducers.empty();
          if (reducers || (first && options_.cross_node)) {
            const std::string why =
                "device " + devices_[i].str() + " failed: " + current_error_text();
            if (reducers) options_.reducers[i]->abort(why);
            if (first && options_.cross_node) options_.cross_node->abort(why);
            if (first) left_group_ = why;  // read once the pool joined
          }
          // Released by another worker's failure: that error is the one reported.
          if (!first) return;
          throw;
        }
      },
      n);
}

void DataParallel::drain() {
  // Every device's work done, a device-side fault reported (each context by its owner).
  pool_.run("dp/drain", [&](int i) { pool_.context(i).synchronize(); });
}

void DataParallel::order_buffers_before_forward(int i, int n) {
  if (replicas_[i]->flat_buffers().numel() == 0) return;
  if (i > 0) return signals_.raise(StepSignals::Flag::replicated, i);
  if (n == 1) return;
  // Device 0's forward updates its running statistics in place: every replica takes its copy of
  // them first (the one dependency before forward, and only for models with buffers).
  signals_.wait_raised(StepSignals::Flag::replicated, n);
  for (int r = 1; r < n; ++r) per_device_[r].marks[kReplicated].wait(pool_.context(0));
}

kernels::AttentionReport DataParallel::attention_report() {
  kernels::AttentionReport report;
  // On device 0's worker: the context's state is its thread's.
  pool_.run(
      "dp/attention_report", [&](int) { report = kernels::attention_report(pool_.context(0)); }, 1);
  return report;
}

}  // namespace dp
