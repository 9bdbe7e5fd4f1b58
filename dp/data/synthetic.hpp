// SyntheticDataset: an endless supply of learnable samples computed from (seed, index) alone,
// with no files and no state, so every thread, device and rank sees the same sample i.
//   label(i)  = philox(seed, i) mod num_classes
//   sample(i) = signal * prototype[label(i)] + noise * n(seed, i)
// The prototypes are fixed per (seed, class), uniform with unit variance; the noise has unit
// variance too (a sum of four uniform bytes). Only integer arithmetic and single roundings are
// used, so the values are bit-identical on every machine. With the defaults an MLP separates the
// classes within a few dozen steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dp/data/dataset.hpp"

namespace dp::data {

struct SyntheticOptions {
  float signal = 1.0f;  // prototype scale: higher is easier
  float noise = 1.0f;   // per-element noise scale
};

class SyntheticDataset : public Dataset {
 public:
  // requires size >= 0, sample_shape non-empty with all dims > 0 ({C, H, W} or {D}),
  // num_classes >= 1.
  SyntheticDataset(int64_t size, kernels::Shape sample_shape, int num_classes, uint64_t seed,
                   SyntheticOptions options = {});

  int64_t size() const override { return size_; }
  kernels::Shape sample_shape() const override { return sample_shape_; }
  int num_classes() const override { return num_classes_; }
  std::string name() const override;

  uint64_t seed() const { return seed_; }
  // The label of sample `index` without generating the sample.
  int32_t label(int64_t index) const;

 protected:
  void get_unchecked(int64_t index, float* image_out, int32_t* label_out) const override;

 private:
  float scaled_prototype(int32_t label, int64_t j) const;  // signal * prototype[label][j]

  int64_t size_;
  kernels::Shape sample_shape_;
  int64_t numel_;
  int num_classes_;
  uint64_t seed_;
  SyntheticOptions options_;
  // signal * prototype, (num_classes, numel); empty when too large to cache (then computed).
  std::vector<float> prototypes_;
};

}  // namespace dp::data
