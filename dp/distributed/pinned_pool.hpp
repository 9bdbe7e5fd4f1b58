// PinnedPool: pinned host buffers for staging CUDA tensors through host memory (Gloo's
// point-to-point ops, every MPI op), reused instead of a cudaMallocHost per call, which costs
// milliseconds and serialises the driver. Thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "kernels/runtime/tensor.hpp"

namespace dp::dist {

class PinnedPool {
 public:
  explicit PinnedPool(size_t max_kept = 8) : max_kept_(max_kept) {}

  // A pinned buffer of at least `numel` elements of `dtype` (its first numel are used): a kept
  // one when one is large enough, else a new one.
  kernels::Tensor take(int64_t numel, kernels::DType dtype) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < free_.size(); ++i)
        if (free_[i].dtype() == dtype && free_[i].numel() >= numel) {
          kernels::Tensor t = std::move(free_[i]);
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          return t;
        }
    }
    return kernels::Tensor::empty_pinned({std::max<int64_t>(numel, 1)}, dtype);
  }
  // Keeps `buf` for a later take (at most max_kept buffers; the others are freed).
  void give_back(kernels::Tensor buf) {
    if (!buf.defined()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < max_kept_) free_.push_back(std::move(buf));
  }

 private:
  size_t max_kept_;
  std::mutex mu_;
  std::vector<kernels::Tensor> free_;
};

}  // namespace dp::dist
