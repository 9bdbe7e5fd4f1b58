#include "dp/data/dataset.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "kernels/runtime/error.hpp"

namespace dp::data {

using kernels::DType;
using kernels::Tensor;

void Dataset::get(int64_t index, float* image_out, int32_t* label_out) const {
  DP_CHECK(index >= 0 && index < size(),
           name() << ": sample index " << index << " out of range [0, " << size() << ")");
  get_unchecked(index, image_out, label_out);
}

void fill_batch(const Dataset& dataset, const std::vector<int64_t>& indices, const Tensor& images,
                const Tensor& labels) {
  tbb::task_group_context group;
  fill_batch(dataset, indices, images, labels, group);
}

void fill_batch(const Dataset& dataset, const std::vector<int64_t>& indices, const Tensor& images,
                const Tensor& labels, tbb::task_group_context& group) {
  const int64_t batch = static_cast<int64_t>(indices.size());
  kernels::Shape want{batch};
  for (int64_t d : dataset.sample_shape()) want.push_back(d);
  DP_CHECK(images.shape() == want && images.dtype() == DType::f32 && images.device().is_cpu(),
           "fill_batch: images must be f32 on the host with shape " << kernels::shape_str(want)
                                                                    << ", got " << images);
  DP_CHECK(
      labels.shape() == kernels::Shape{batch} && labels.dtype() == DType::i32 &&
          labels.device().is_cpu(),
      "fill_batch: labels must be i32 on the host with shape [" << batch << "], got " << labels);
  const int64_t per_sample = dataset.sample_numel();
  float* image_data = images.data<float>();
  int32_t* label_data = labels.data<int32_t>();
#ifdef DP_TSAN_ONE_THREAD
  // ThreadSanitizer build: the calling thread alone, as the CPU contexts' arenas there
  // (kernels/runtime/context.cpp): oneTBB is not instrumented, so its hand-offs are invisible.
  for (int64_t b = 0; b < batch && !group.is_group_execution_cancelled(); ++b)
    dataset.get(indices[b], image_data + b * per_sample, label_data + b);
#else
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, batch),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t b = r.begin(); b < r.end(); ++b)
          dataset.get(indices[b], image_data + b * per_sample, label_data + b);
      },
      group);
#endif
}

}  // namespace dp::data
