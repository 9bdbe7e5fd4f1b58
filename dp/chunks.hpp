// How a global batch is split among devices (DP) or ranks (DDP): balanced, the first
// batch % n chunks one row longer. Both modes split the same way, so they see the same rows.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/runtime/error.hpp"

namespace dp {

// requires n >= 1, batch >= 0. ensures n sizes summing to batch, differing by at most one.
inline std::vector<int64_t> chunk_sizes(int64_t batch, int n) {
  DP_CHECK(n >= 1 && batch >= 0, "chunk_sizes: batch " << batch << " over " << n << " devices");
  std::vector<int64_t> sizes(n, batch / n);
  for (int64_t i = 0; i < batch % n; ++i) ++sizes[i];
  return sizes;
}

// First row of chunk i.
inline int64_t chunk_begin(const std::vector<int64_t>& sizes, int i) {
  int64_t begin = 0;
  for (int j = 0; j < i; ++j) begin += sizes[j];
  return begin;
}

// The weight of a chunk in the global mean: rows / total. Averaging, in DP and DDP alike, is
// "scale each chunk's mean gradient by its share, then sum".
inline float chunk_share(int64_t rows, int64_t total) {
  DP_CHECK(total > 0 && rows >= 0 && rows <= total,
           "chunk_share: " << rows << " rows of " << total);
  return static_cast<float>(rows) / static_cast<float>(total);
}

// Each chunk's weight in the global mean of a loss: its share of the batch's loss denominator
// (rows, kept tokens or elements: nn::Loss::denominator of its targets). All zero when the
// batch's denominator is 0 (every token ignored: a zero loss and gradient).
inline std::vector<float> loss_shares(const std::vector<int64_t>& denominators) {
  int64_t total = 0;
  for (int64_t d : denominators) total += d;
  std::vector<float> shares(denominators.size(), 0.f);
  if (total == 0) return shares;
  for (size_t i = 0; i < shares.size(); ++i) shares[i] = chunk_share(denominators[i], total);
  return shares;
}

// The same against a larger whole: each chunk's share of `total` (the global batch's
// denominator, of which these chunks are one node's part). All zero when total is 0.
inline std::vector<float> loss_shares(const std::vector<int64_t>& denominators, int64_t total) {
  std::vector<float> shares(denominators.size(), 0.f);
  if (total == 0) return shares;
  for (size_t i = 0; i < shares.size(); ++i) shares[i] = chunk_share(denominators[i], total);
  return shares;
}

}  // namespace dp
