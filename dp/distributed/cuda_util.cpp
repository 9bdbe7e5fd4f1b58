#include "dp/distributed/cuda_util.hpp"

#include <unistd.h>

#include <cstdio>

#include "kernels/runtime/context.hpp"
#include "kernels/runtime/error.hpp"

#if DP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/runtime/cuda_check.hpp"
#endif

namespace dp::dist {

std::shared_ptr<StreamMarker> StreamMarker::record(const kernels::Device& device) {
  std::shared_ptr<StreamMarker> m(new StreamMarker());
  if (!device.is_cuda()) return m;
#if DP_HAVE_CUDA
  m->gpu_ = kernels::physical_gpu(device);
  DP_CUDA_CHECK(cudaSetDevice(m->gpu_));
  cudaEvent_t ev = nullptr;
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  m->event_ = ev;
  DP_CUDA_CHECK(cudaEventRecord(ev, static_cast<cudaStream_t>(kernels::context(device).stream())));
#else
  DP_THROW("device " << device << " is not usable: " << kernels::cuda_unavailable_reason());
#endif
  return m;
}

StreamMarker::~StreamMarker() {
#if DP_HAVE_CUDA
  if (event_) {
    cudaError_t e = cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    if (e != cudaSuccess && e != cudaErrorCudartUnloading)
      DP_LOG_ERROR("cudaEventDestroy: " << cudaGetErrorString(e));
  }
#endif
}

void StreamMarker::wait_host() const {
#if DP_HAVE_CUDA
  if (event_) DP_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
#endif
}

std::string physical_device_id(const kernels::Device& device) {
  if (!device.is_cuda()) return "cpu";
#if DP_HAVE_CUDA
  int gpu = kernels::physical_gpu(device);
  cudaDeviceProp prop{};
  DP_CUDA_CHECK(cudaGetDeviceProperties(&prop, gpu));
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string id = std::string("cuda:") + host + ":";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    id += hex;
  }
  return id;
#else
  DP_THROW("device " << device << " is not usable: " << kernels::cuda_unavailable_reason());
#endif
}

}  // namespace dp::dist
