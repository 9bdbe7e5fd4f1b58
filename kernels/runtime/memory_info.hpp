// How much memory a new allocation could take now: for sanity checks before allocating (a batch
// too large for the device, more processes than the host holds), with where the figure comes
// from so that an error can say it.
#pragma once

#include <cstdint>
#include <string>

namespace kernels {

struct AvailableMemory {
  int64_t bytes = 0;
  std::string source;  // "MemAvailable in /proc/meminfo", "cudaMemGetInfo on GPU 0", ...
};

// The host: /proc/meminfo's MemAvailable (sysconf's free pages without it), capped by the
// headroom of this process's cgroup and of each of its ancestors (v2: memory.max less
// memory.current; v1: memory.limit_in_bytes less memory.usage_in_bytes), as a container, a
// Slurm job or a systemd unit sets them.
AvailableMemory host_memory_available();
// The same read under `root` ("/proc/...", "/sys/fs/cgroup/..." below it): for tests.
AvailableMemory host_memory_available_under(const std::string& root);
// The memory of physical GPU `physical`: its total (cudaGetDeviceProperties), because asking
// for the free memory (cudaMemGetInfo) would create a CUDA context in the calling process, a
// cost a DDP launcher should not pay. Throws without a usable GPU.
AvailableMemory gpu_memory(int physical);

}  // namespace kernels
