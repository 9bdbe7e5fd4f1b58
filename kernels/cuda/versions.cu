// The CUDA libraries this process runs on, as the libraries themselves report them at run time
// (the build's headers may be older or newer than what the loader found).
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/sdpa.hpp"

namespace kernels::cuda {

namespace {
// 12080 -> "12.8" (CUDA's encoding: 1000 major + 10 minor).
std::string cuda_version_text(int v) {
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}
// cuDNN 9: 91900 -> "9.19.0" (10000 major + 100 minor + patch).
std::string cudnn_version_text(size_t v) {
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." +
         std::to_string(v % 100);
}
}  // namespace

std::vector<std::pair<std::string, std::string>> library_versions() {
  std::vector<std::pair<std::string, std::string>> out;
  int runtime = 0, driver = 0;
  out.emplace_back("cuda_runtime", cudaRuntimeGetVersion(&runtime) == cudaSuccess
                                       ? cuda_version_text(runtime)
                                       : "unknown");
  // 0 (or an error) when no driver is installed: the GPU part of the build cannot run.
  cudaError_t e = cudaDriverGetVersion(&driver);
  out.emplace_back("cuda_driver", e == cudaSuccess && driver > 0 ? cuda_version_text(driver)
                                                                 : "none (no NVIDIA driver)");
  cudaGetLastError();                      // a missing driver leaves no error for the next launch
  const size_t lt = cublasLtGetVersion();  // 10000 major + 100 minor + patch
  out.emplace_back("cublasLt", std::to_string(lt / 10000) + "." + std::to_string(lt % 10000 / 100) +
                                   "." + std::to_string(lt % 100));
  out.emplace_back("cudnn", cudnn_version_text(cudnnGetVersion()));
  const std::string frontend = sdpa_frontend_version();
  out.emplace_back("cudnn_frontend", frontend.empty() ? "none (built without it)" : frontend);
  return out;
}

}  // namespace kernels::cuda
