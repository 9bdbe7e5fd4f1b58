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

namespace {

// The headroom of one cgroup and of each ancestor up to `top` (limit less usage, the smallest),
// read from `limit_file` and `usage_file` in each folder; a level without a numeric limit
// ("max" in v2, a v1 limit of 2^62 or more, or no file) sets none. Returns whether one did.
bool cgroup_headroom(const std::string& top, std::string rel, const char* limit_file,
                     const char* usage_file, int64_t* headroom, std::string* where) {
  bool found = false;
  while (true) {
    const std::string dir = top + rel;
    int64_t limit = 0, used = 0;
    if (read_number(dir + "/" + limit_file, "", &limit) && limit < (int64_t{1} << 62) &&
        read_number(dir + "/" + usage_file, "", &used)) {
      const int64_t room = std::max<int64_t>(0, limit - used);
      if (!found || room < *headroom) {
        *headroom = room;
        *where = dir;
      }
      found = true;
    }
    if (rel.empty() || rel == "/") break;
    const size_t slash = rel.find_last_of('/');
    rel = slash == std::string::npos ? "" : rel.substr(0, slash);
  }
  return found;
}

}  // namespace

AvailableMemory host_memory_available_under(const std::string& root) {
  AvailableMemory m;
  int64_t kib = 0;
  if (read_number(root + "/proc/meminfo", "MemAvailable:", &kib)) {
    m.bytes = kib * 1024;
    m.source = "MemAvailable in /proc/meminfo";
  } else {
    m.bytes = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
    m.source = "free pages (sysconf)";
  }
  // This process's cgroups (/proc/self/cgroup): "0::/path" under cgroup v2, "N:memory:/path"
  // (the memory controller, maybe among others) under v1. Each level up to the mount's root
  // may set a limit: the least headroom wins. A container with its own cgroup namespace sees
  // "/" and its limits at the root; a Slurm job or a systemd unit sees its path.
  std::ifstream self(root + "/proc/self/cgroup");
  std::string line;
  while (std::getline(self, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    int64_t room = 0;
    std::string where;
    bool found = false;
    const char* what = "";
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      found = cgroup_headroom(root + "/sys/fs/cgroup", path, "memory.max", "memory.current", &room,
                              &where);
      what = "memory.max less memory.current";
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      found = cgroup_headroom(root + "/sys/fs/cgroup/memory", path, "memory.limit_in_bytes",
                              "memory.usage_in_bytes", &room, &where);
      what = "memory.limit_in_bytes less memory.usage_in_bytes";
    }
    if (found && room < m.bytes) {
      m.bytes = room;
      m.source = std::string("the cgroup's ") + what + " in " + where.substr(root.size());
    }
  }
  return m;
}

AvailableMemory host_memory_available() {
  return host_memory_available_under("");
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
