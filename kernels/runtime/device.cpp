#include "kernels/runtime/device.hpp"

#include <cstdlib>

#include "kernels/runtime/error.hpp"

#if DP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kernels {

Device Device::parse(const std::string& text) {
  std::string type = text, index;
  auto colon = text.find(':');
  if (colon != std::string::npos) {
    type = text.substr(0, colon);
    index = text.substr(colon + 1);
  }
  int i = 0;
  if (!index.empty()) {
    char* end = nullptr;
    long v = std::strtol(index.c_str(), &end, 10);
    DP_CHECK(end && *end == '\0' && v >= 0 && v < 4096,
             "bad device '" << text << "': the index must be a number in [0, 4096)");
    i = static_cast<int>(v);
  }
  if (type == "cpu") return Device::cpu(i);
  if (type == "cuda" || type == "gpu") return Device::cuda(i);
  DP_THROW("bad device '" << text << "': expected cpu[:i] or cuda[:i]");
}

std::string Device::str() const {
  return std::string(is_cpu() ? "cpu:" : "cuda:") + std::to_string(index);
}

namespace {
struct CudaProbe {
  int count = 0;
  std::string reason;
  CudaProbe() {
#if DP_HAVE_CUDA
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      count = 0;
      reason = cudaGetErrorString(e);
      cudaGetLastError();  // clear the sticky-free error so later calls start clean
    } else if (count == 0) {
      reason = "no CUDA GPU is visible";
    }
#else
    reason = "this build has no CUDA backend";
#endif
  }
};
const CudaProbe& probe() {
  static const CudaProbe p;  // immutable after the first call
  return p;
}
}  // namespace

int cuda_device_count() {
  return probe().count;
}
std::string cuda_unavailable_reason() {
  return probe().reason;
}
bool built_with_cuda() {
#if DP_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::string gpu_name(int physical) {
#if DP_HAVE_CUDA
  if (physical >= 0 && physical < cuda_device_count()) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, physical) == cudaSuccess) return prop.name;
  }
#else
  (void)physical;
#endif
  return "none";
}

DeviceType choose_device_type(const std::string& flag, std::string* fallback) {
  bool gpu = cuda_device_count() > 0;
  if (flag == "cpu") return DeviceType::cpu;
  if (flag == "cuda") {
    DP_CHECK(gpu, "--device cuda: no usable GPU: " << cuda_unavailable_reason());
    return DeviceType::cuda;
  }
  DP_CHECK(flag == "auto", "--device '" << flag << "': expected auto, cuda or cpu");
  if (gpu) return DeviceType::cuda;
  if (fallback) *fallback = "no usable GPU (" + cuda_unavailable_reason() + "): running on the CPU";
  return DeviceType::cpu;
}

int physical_gpu(const Device& d) {
  DP_CHECK(d.is_cuda(), "physical_gpu: " << d << " is not a CUDA device");
  int n = cuda_device_count();
  DP_CHECK(n > 0, "device " << d << " is not usable: " << cuda_unavailable_reason());
  return d.index % n;
}

std::vector<Device> make_devices(DeviceType type, int n) {
  DP_CHECK(n >= 1, "need at least one device, got " << n);
  std::vector<Device> out;
  for (int i = 0; i < n; ++i) out.push_back({type, i});
  return out;
}

}  // namespace kernels
