// Scoped NVTX ranges: `NvtxRange r("dp/forward");` shows up in Nsight Systems as a range on
// this thread. Free when no profiler is attached; a no-op in builds without CUDA.
// Naming scheme: "<mode>/<phase>[detail]", e.g. "dp/scatter", "ddp/allreduce[bucket 3]".
#pragma once

#include <string>

namespace kernels {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name);
  explicit NvtxRange(const std::string& name) : NvtxRange(name.c_str()) {}
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

// Brackets profiled steps for `nsys profile --capture-range=cudaProfilerApi` (no-op w/o CUDA).
void profiler_start();
void profiler_stop();

}  // namespace kernels
