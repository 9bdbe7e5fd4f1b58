// UniqueHandle: the one owner of a C library handle (a cuDNN descriptor, a cuBLASLt layout...).
// Plain C++ with no CUDA types, so the ownership rules are unit-tested on the CPU with fake
// create/destroy functions.
//
// The rule it enforces: a handle is adopted by a UniqueHandle the moment its create call
// succeeds, before any call that may throw (a cudnnSet* that rejects a shape). A constructor
// that throws after that point still destroys the handle, because the member that owns it was
// fully constructed. Destroy failures are logged, never thrown.
//
//     using TensorDescHandle = UniqueHandle<cudnnTensorDescriptor_t, cudnnStatus_t,
//                                           cudnnDestroyTensorDescriptor, CUDNN_STATUS_SUCCESS>;
//     cudnnTensorDescriptor_t raw;
//     DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&raw));
//     TensorDescHandle d(raw);                     // owned from here on
//     DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d.get(), ...));   // may throw: d is destroyed
#pragma once

#include <utility>

#include "kernels/runtime/error.hpp"

namespace kernels {

template <class H, class Status, Status (*Destroy)(H), Status kOk>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  // requires h came from the library's create call (or is null). ensures h is destroyed once.
  explicit UniqueHandle(H h) noexcept : h_(h) {}
  ~UniqueHandle() { reset(); }
  UniqueHandle(UniqueHandle&& o) noexcept : h_(std::exchange(o.h_, H{})) {}
  UniqueHandle& operator=(UniqueHandle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, H{});
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;

  H get() const { return h_; }
  explicit operator bool() const { return h_ != H{}; }

  // Destroys the handle now (logged on failure; never throws).
  void reset() noexcept {
    if (h_ == H{}) return;
    Status s = Destroy(h_);
    h_ = H{};
    if (s != kOk)
      DP_LOG_ERROR("destroying a library handle failed: status " << static_cast<int>(s));
  }

 private:
  H h_{};
};

}  // namespace kernels
