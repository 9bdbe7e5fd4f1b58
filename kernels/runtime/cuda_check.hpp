// Checked-call macros for the CUDA libraries. Include only from code built with the CUDA
// backend (kernels/runtime/*.cpp under DP_HAVE_CUDA, kernels/cuda/*.cu, dp/distributed NCCL code).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "kernels/runtime/error.hpp"

#define DP_CUDA_CHECK(call)                                                                       \
  do {                                                                                            \
    cudaError_t dp_e_ = (call);                                                                   \
    if (dp_e_ != cudaSuccess)                                                                     \
      ::kernels::detail::throw_error(__FILE__, __LINE__, nullptr,                                 \
                                     std::string(#call) + " failed: " + cudaGetErrorName(dp_e_) + \
                                         ": " + cudaGetErrorString(dp_e_));                       \
  } while (0)

// After every kernel launch: reports bad launch configurations at the launch site.
#define DP_CUDA_CHECK_LAUNCH() DP_CUDA_CHECK(cudaGetLastError())

#define DP_CUBLAS_CHECK(call)                                                         \
  do {                                                                                \
    cublasStatus_t dp_s_ = (call);                                                    \
    if (dp_s_ != CUBLAS_STATUS_SUCCESS)                                               \
      ::kernels::detail::throw_error(__FILE__, __LINE__, nullptr,                     \
                                     std::string(#call) + " failed: cublas status " + \
                                         std::to_string(static_cast<int>(dp_s_)));    \
  } while (0)

#define DP_CUDNN_CHECK(call)                                              \
  do {                                                                    \
    cudnnStatus_t dp_s_ = (call);                                         \
    if (dp_s_ != CUDNN_STATUS_SUCCESS)                                    \
      ::kernels::detail::throw_error(                                     \
          __FILE__, __LINE__, nullptr,                                    \
          std::string(#call) + " failed: " + cudnnGetErrorString(dp_s_)); \
  } while (0)

namespace kernels {

// Makes `gpu` the calling thread's current device for the guard's scope and restores the
// previous one at its end (for destructors and other code that must not change the caller's
// device). Never throws: failures are ignored, as a destructor must.
class CurrentGpuGuard {
 public:
  explicit CurrentGpuGuard(int gpu) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != gpu) cudaSetDevice(gpu);
  }
  ~CurrentGpuGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  CurrentGpuGuard(const CurrentGpuGuard&) = delete;
  CurrentGpuGuard& operator=(const CurrentGpuGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace kernels
