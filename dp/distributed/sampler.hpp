// DistributedSampler: which data set indices rank r visits in an epoch, with PyTorch's
// semantics (torch.utils.data.DistributedSampler):
//   - shuffle: a permutation from (seed, epoch) only, the same on every rank;
//   - drop_last no: pad by repeating from the start to a multiple of the world size;
//     drop_last yes: drop the tail so every rank gets floor(n / world) samples;
//   - rank r takes positions r, r + world, r + 2 world, ... (interleaved shards).
// Feed the result to dp::data::Loader(dataset, indices, ...) with Shuffle::no.
#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

#include "dp/data/loader.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

struct SamplerOptions {
  dp::data::Shuffle shuffle = dp::data::Shuffle::yes;
  uint64_t seed = 0;
  dp::data::DropLast drop_last = dp::data::DropLast::no;
};

class DistributedSampler {
 public:
  // requires dataset_size >= 0, world >= 1, 0 <= rank < world.
  DistributedSampler(int64_t dataset_size, int world, int rank, SamplerOptions options = {})
      : n_(dataset_size), world_(world), rank_(rank), options_(options) {
    DP_CHECK(dataset_size >= 0 && world >= 1 && rank >= 0 && rank < world,
             "DistributedSampler: rank " << rank << " of " << world << " over " << dataset_size
                                         << " samples");
  }

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  // Samples per rank per epoch.
  int64_t num_samples() const {
    if (options_.drop_last == dp::data::DropLast::yes) return n_ / world_;
    return (n_ + world_ - 1) / world_;
  }

  // This rank's indices for the current epoch, in visiting order.
  std::vector<int64_t> indices() const {
    std::vector<int64_t> order;
    if (options_.shuffle == dp::data::Shuffle::yes) {
      order = dp::data::shuffled_order(n_, options_.seed, epoch_);
    } else {
      order.resize(static_cast<size_t>(n_));
      std::iota(order.begin(), order.end(), int64_t{0});
    }
    int64_t total = num_samples() * world_;
    if (total > n_ && n_ > 0) {  // pad by repeating the order from its start
      std::vector<int64_t> padded = order;
      while (static_cast<int64_t>(padded.size()) < total)
        padded.push_back(order[(padded.size() - order.size()) % order.size()]);
      order = std::move(padded);
    }
    order.resize(static_cast<size_t>(total));
    std::vector<int64_t> mine;
    for (int64_t i = rank_; i < total; i += world_) mine.push_back(order[i]);
    return mine;
  }

 private:
  int64_t n_;
  int world_;
  int rank_;
  SamplerOptions options_;
  int64_t epoch_ = 0;
};

}  // namespace dp::dist
