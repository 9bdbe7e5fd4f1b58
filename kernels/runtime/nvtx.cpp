#include "kernels/runtime/nvtx.hpp"

#include <string>
#include <vector>

#include "kernels/runtime/device.hpp"

#if DP_HAVE_CUDA
#include <cuda_profiler_api.h>
#include <nvtx3/nvToolsExt.h>
#endif

namespace kernels {

namespace {
struct NameStack {
  int keepers = 0;  // live RangeNames on this thread
  std::vector<std::string> names;
};
NameStack& name_stack() {
  thread_local NameStack s;
  return s;
}
// Pushes `name` when a RangeNames lives on this thread; whether it did.
bool push_name(const char* name) {
  NameStack& s = name_stack();
  if (s.keepers == 0) return false;
  try {
    s.names.emplace_back(name);
  } catch (...) {  // no memory for a name: the range goes unnamed
    return false;
  }
  return true;
}
void pop_name(bool named) {
  if (named) name_stack().names.pop_back();
}
}  // namespace

RangeNames::RangeNames() {
  ++name_stack().keepers;
}
RangeNames::~RangeNames() {
  --name_stack().keepers;
}
std::string RangeNames::innermost() {
  const std::vector<std::string>& n = name_stack().names;
  if (n.empty()) return "";
  return n.size() == 1 ? n.back() : n[n.size() - 2] + " > " + n.back();
}

#if DP_HAVE_CUDA
NvtxRange::NvtxRange(const char* name) : named_(push_name(name)) {
  nvtxRangePushA(name);
}
NvtxRange::~NvtxRange() {
  nvtxRangePop();
  pop_name(named_);
}
void profiler_start() {
  if (cuda_device_count() > 0) cudaProfilerStart();
}
void profiler_stop() {
  if (cuda_device_count() > 0) cudaProfilerStop();
}
#else
NvtxRange::NvtxRange(const char* name) : named_(push_name(name)) {}
NvtxRange::~NvtxRange() {
  pop_name(named_);
}
void profiler_start() {}
void profiler_stop() {}
#endif

}  // namespace kernels
