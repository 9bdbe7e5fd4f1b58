#include "kernels/runtime/device.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "kernels/runtime/error.hpp"
#include "kernels/runtime/memory_info.hpp"

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
      // Without an NVIDIA kernel driver the runtime says "CUDA driver version is insufficient
      // for CUDA runtime version": say what is missing first, and quote it.
      const bool driver = ::access("/proc/driver/nvidia/version", F_OK) == 0;
      const std::string says = std::string("CUDA says: ") + cudaGetErrorString(e);
      if (!driver && (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice))
        reason = "no NVIDIA GPU or driver on this machine (" + says + ")";
      else if (e == cudaErrorInsufficientDriver)
        reason = "the NVIDIA driver is older than this build's CUDA runtime (" + says + ")";
      else
        reason = says;
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

namespace {
// The first number on the line of `path` that starts with `key` (whole file when key is
// empty); nullopt when the file or the key is missing or the value is not a number.
bool read_number(const std::string& path, const std::string& key, int64_t* out) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) != 0) continue;
    std::istringstream is(line.substr(key.size()));
    long long v = 0;
    if (!(is >> v)) return false;
    *out = v;
    return true;
  }
  return false;
}
}  // namespace

AvailableMemory host_memory_available() {
  AvailableMemory m;
  int64_t kib = 0;
  if (read_number("/proc/meminfo", "MemAvailable:", &kib)) {
    m.bytes = kib * 1024;
    m.source = "MemAvailable in /proc/meminfo";
  } else {
    m.bytes = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
    m.source = "free pages (sysconf)";
  }
  // cgroup v2: "max" (no limit) does not parse as a number and is skipped.
  int64_t limit = 0, used = 0;
  if (read_number("/sys/fs/cgroup/memory.max", "", &limit) &&
      read_number("/sys/fs/cgroup/memory.current", "", &used) && limit - used < m.bytes) {
    m.bytes = std::max<int64_t>(0, limit - used);
    m.source = "the cgroup's memory.max less memory.current";
  }
  return m;
}

AvailableMemory gpu_memory(int physical) {
  DP_CHECK(physical >= 0 && physical < cuda_device_count(),
           "GPU " << physical << " is not usable: " << cuda_device_count() << " GPU(s) visible"
                  << (cuda_device_count() ? "" : " (" + cuda_unavailable_reason() + ")"));
  AvailableMemory m;
#if DP_HAVE_CUDA
  cudaDeviceProp prop{};
  cudaError_t e = cudaGetDeviceProperties(&prop, physical);
  DP_CHECK(e == cudaSuccess,
           "cudaGetDeviceProperties on GPU " << physical << " failed: " << cudaGetErrorString(e));
  m.bytes = static_cast<int64_t>(prop.totalGlobalMem);
  m.source = "the total memory of GPU " + std::to_string(physical) + ", " + prop.name;
#endif
  return m;
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
