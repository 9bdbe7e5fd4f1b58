// CUDA helpers of dp/distributed with a plain C++ interface (no CUDA types; no-ops without CUDA).
#pragma once

#include <memory>
#include <string>

#include "kernels/runtime/device.hpp"

namespace dp::dist {

// A point in the calling thread's stream for a device: work queued there before record()
// has finished once wait_host() returns. On CPU devices both are no-ops.
class StreamMarker {
 public:
  static std::shared_ptr<StreamMarker> record(const kernels::Device& device);
  ~StreamMarker();  // logs, never throws
  StreamMarker(const StreamMarker&) = delete;
  StreamMarker& operator=(const StreamMarker&) = delete;
  void wait_host() const;

 private:
  StreamMarker() = default;
  void* event_ = nullptr;  // cudaEvent_t
  int gpu_ = -1;
};

// Identifies the physical device a rank's tensors live on, comparable across ranks and
// hosts: "cpu" or "cuda:<hostname>:<GPU UUID>".
std::string physical_device_id(const kernels::Device& device);

}  // namespace dp::dist
