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

 private:
  bool named_ = false;  // pushed on this thread's RangeNames stack
};

// While one lives on a thread (a graph capture), the names of the NvtxRanges opened there are
// kept, so that a refusal can say where it happened ("in Linear/backward"); otherwise ranges
// cost no copy. Nests.
class RangeNames {
 public:
  RangeNames();
  ~RangeNames();
  RangeNames(const RangeNames&) = delete;
  RangeNames& operator=(const RangeNames&) = delete;
  // The innermost open range's name while a RangeNames lives on this thread (else empty), as
  // "outer > inner" for the two innermost.
  static std::string innermost();
};

// Brackets profiled steps for `nsys profile --capture-range=cudaProfilerApi` (no-op w/o CUDA).
void profiler_start();
void profiler_stop();

}  // namespace kernels
