#include "kernels/runtime/nvtx.hpp"

#include "kernels/runtime/device.hpp"

#if DP_HAVE_CUDA
#include <cuda_profiler_api.h>
#include <nvtx3/nvToolsExt.h>
#endif

namespace kernels {

#if DP_HAVE_CUDA
NvtxRange::NvtxRange(const char* name) {
  nvtxRangePushA(name);
}
NvtxRange::~NvtxRange() {
  nvtxRangePop();
}
void profiler_start() {
  if (cuda_device_count() > 0) cudaProfilerStart();
}
void profiler_stop() {
  if (cuda_device_count() > 0) cudaProfilerStop();
}
#else
NvtxRange::NvtxRange(const char*) {}
NvtxRange::~NvtxRange() {}
void profiler_start() {}
void profiler_stop() {}
#endif

}  // namespace kernels
