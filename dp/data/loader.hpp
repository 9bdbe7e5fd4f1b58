// Loader: batches of a Dataset in a per-epoch order, assembled ahead of time on a background
// thread (samples filled in parallel with oneTBB) into page-locked host memory, ready for H2D.
//
//   Loader loader(dataset, {.batch_size = 256, .seed = 1});
//   for (int64_t e = 0; e < epochs; ++e) {
//     loader.set_epoch(e);
//     for (const Batch& b : loader) train_step(b.images, b.labels);
//   }
//
// The order of an epoch depends on (seed, epoch) only: a Fisher-Yates shuffle driven by Philox,
// the same on every machine and thread count. A DistributedSampler feeds a shard through the
// index-list constructor or set_indices(). A Loader has one consumer thread; the data set is
// read concurrently by the loader's workers, so its get() must be thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

#include <tbb/task_arena.h>

#include "dp/data/dataset.hpp"
#include "kernels/runtime/tensor.hpp"

namespace dp::data {

enum class Shuffle { no, yes };
enum class DropLast { no, yes };  // yes: skip a final batch smaller than batch_size
// yes: reuse the page-locked buffers of batches the caller has dropped instead of allocating
// new ones (no cudaMallocHost/cudaFreeHost per batch). requires: every asynchronous copy from a
// batch has finished before the caller drops its last handle to it.
enum class RecycleBuffers { no, yes };

struct LoaderOptions {
  int64_t batch_size = 64;
  Shuffle shuffle = Shuffle::yes;
  uint64_t seed = 0;
  DropLast drop_last = DropLast::no;
  int prefetch = 2;  // batches assembled ahead of the consumer (>= 1)
  int threads = 0;   // oneTBB concurrency for filling a batch; 0 = the default arena
  RecycleBuffers recycle = RecycleBuffers::no;
  // A last batch with fewer rows than this is padded up to it by wrapping round to the start of
  // the epoch's order (as PyTorch's DistributedSampler pads), so that split across this many
  // devices or ranks it gives each a row. 1: never pads. requires 1 <= it <= batch_size;
  // no effect with DropLast::yes (the short batch is dropped instead).
  int64_t pad_last_batch_to = 1;
};

struct Batch {
  kernels::Tensor images;  // (B, *sample_shape), e.g. (B, C, H, W), f32, pinned host memory
  kernels::Tensor labels;  // (B) i32, pinned host memory
  // Loader: position of the batch's first sample in the epoch order (batch number x batch_size).
  // make_batch: the first data set index.
  int64_t first_index = 0;
  std::vector<int64_t> indices;  // the data set index of each row

  int64_t size() const { return static_cast<int64_t>(indices.size()); }
};

// The samples [first, first + count) in order, filled in parallel on the calling thread.
// requires 0 <= first, count >= 0, first + count <= dataset.size().
Batch make_batch(const Dataset& dataset, int64_t first, int64_t count);
// The samples `indices` in that order.
Batch make_batch(const Dataset& dataset, std::vector<int64_t> indices);

// A permutation of [0, n) that depends on (seed, epoch) only (Philox-driven Fisher-Yates).
std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch);

class Loader {
 public:
  // Over the whole data set.
  Loader(const Dataset& dataset, LoaderOptions options);
  // Over a subset: each epoch visits `indices` (data set indices), shuffled when asked.
  Loader(const Dataset& dataset, std::vector<int64_t> indices, LoaderOptions options);
  // Stops the background thread, waiting at most for the batch it is filling. Never throws.
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Selects the epoch whose order the next pass uses; abandons a pass in progress.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  // Replaces the subset (e.g. a sampler's shard for the next epoch); abandons a pass in progress.
  void set_indices(std::vector<int64_t> indices);

  // Samples per pass, and batches per pass (the last may be short unless DropLast::yes).
  int64_t num_samples() const;
  int64_t num_batches() const;
  // Rows the last batch of a pass is padded with (see LoaderOptions::pad_last_batch_to).
  int64_t padding() const;
  // The data set indices of one pass, in visiting order, for `epoch`, padding included.
  std::vector<int64_t> epoch_order(int64_t epoch) const;

  // The next batch of the current pass, starting the pass if none is running; nullopt at its
  // end, after which the next call starts the same epoch again (call set_epoch to move on).
  // An exception thrown while filling a batch is rethrown here, as a kernels::Error naming the
  // epoch and the batch; the pass is then over.
  std::optional<Batch> next();
  // Abandons the pass in progress, if any; the next next() starts the current epoch afresh.
  void reset();

  // Range-for over one pass: begin() restarts the current epoch.
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = Batch*;
    using reference = Batch&;

    Batch& operator*() { return *batch_; }
    Batch* operator->() { return &*batch_; }
    Iterator& operator++() {
      batch_ = loader_->next();
      return *this;
    }
    bool operator==(const Iterator& o) const { return batch_.has_value() == o.batch_.has_value(); }
    bool operator!=(const Iterator& o) const { return !(*this == o); }

   private:
    friend class Loader;
    Loader* loader_ = nullptr;
    std::optional<Batch> batch_;
  };
  Iterator begin();
  Iterator end() { return Iterator{}; }

 private:
  struct Pass;        // one running pass: producer thread and bounded queue
  struct BufferPool;  // page-locked buffers for RecycleBuffers::yes; used by one pass at a time

  void start_pass();

  const Dataset& dataset_;
  LoaderOptions options_;
  std::optional<std::vector<int64_t>> subset_;  // nullopt: the whole data set
  int64_t epoch_ = 0;
  std::unique_ptr<tbb::task_arena> arena_;  // when options_.threads > 0
  std::unique_ptr<BufferPool> pool_;
  std::unique_ptr<Pass> pass_;  // declared last: destroyed (joined) first
};

}  // namespace dp::data
