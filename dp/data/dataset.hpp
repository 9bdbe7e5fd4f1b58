// Dataset: random access to labelled samples by index. A sample is an f32 array of
// sample_shape() ({C, H, W} for images, {D} for vectors) and an i32 class label.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <tbb/task_group.h>

#include "kernels/runtime/tensor.hpp"

namespace dp::data {

class Dataset {
 public:
  virtual ~Dataset() = default;

  virtual int64_t size() const = 0;
  virtual kernels::Shape sample_shape() const = 0;
  virtual int num_classes() const = 0;
  // For messages: "fashion-mnist/train", "synthetic(seed 7)".
  virtual std::string name() const = 0;

  int64_t sample_numel() const { return kernels::shape_numel(sample_shape()); }

  // requires image_out holds sample_numel() floats. Throws unless 0 <= index < size().
  // ensures the sample and its label (in [0, num_classes())) are written. Thread-safe.
  void get(int64_t index, float* image_out, int32_t* label_out) const;

 protected:
  // Same contract as get(), with the index already checked.
  virtual void get_unchecked(int64_t index, float* image_out, int32_t* label_out) const = 0;
};

// requires images (B, *sample_shape) f32 and labels (B) i32, both host tensors, with
// B == indices.size(). ensures row b holds sample indices[b]. Parallel over samples (oneTBB);
// throws on an out-of-range index, or what the data set's get() throws.
void fill_batch(const Dataset& dataset, const std::vector<int64_t>& indices,
                const kernels::Tensor& images, const kernels::Tensor& labels);
// Same, cancellable: cancelling `group` stops the fill early, leaving rows unwritten.
void fill_batch(const Dataset& dataset, const std::vector<int64_t>& indices,
                const kernels::Tensor& images, const kernels::Tensor& labels,
                tbb::task_group_context& group);

}  // namespace dp::data
