#include "kernels/runtime/memory.hpp"

#include <algorithm>
#include <cstring>

#include <tbb/parallel_for.h>

#include "kernels/runtime/context.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/nvtx.hpp"
#include "kernels/runtime/tensor.hpp"

#if DP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/runtime/cuda_check.hpp"
#endif

namespace kernels {

namespace {

// Host to host. Disjoint buffers (the usual case: replicas, staging) copy in parallel 1 MiB
// chunks inside the device's arena; overlapping views keep memmove's semantics.
void copy_host(char* d, const char* s, size_t bytes, DeviceContext& ctx) {
  auto da = reinterpret_cast<uintptr_t>(d), sa = reinterpret_cast<uintptr_t>(s);
  bool overlap = da < sa + bytes && sa < da + bytes;
  constexpr size_t kChunk = size_t(1) << 20;
  if (overlap || bytes <= kChunk) {
    std::memmove(d, s, bytes);
    return;
  }
  ctx.arena().execute([&] {
    tbb::parallel_for(size_t(0), (bytes + kChunk - 1) / kChunk, [&](size_t c) {
      size_t begin = c * kChunk;
      std::memcpy(d + begin, s + begin, std::min(kChunk, bytes - begin));
    });
  });
}

}  // namespace

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                DeviceContext& ctx) {
  if (bytes == 0 || dst == src) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    // A capture records the Tensor overload's copy, which keeps both buffers alive.
    ctx.refuse_in_capture("a copy between raw host pointers");
    return copy_host(static_cast<char*>(dst), static_cast<const char*>(src), bytes, ctx);
  }
#if DP_HAVE_CUDA
  NvtxRange range("runtime/copy_bytes");
  ctx.make_current();
  auto s = static_cast<cudaStream_t>(ctx.stream());
  if (dst_device.is_cuda() && src_device.is_cuda()) {
    int dg = physical_gpu(dst_device), sg = physical_gpu(src_device);
    if (dg == sg)  // logical devices on one GPU: a plain device-to-device copy
      DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    else  // peer copy (staged through the host by the driver when peer access is off)
      DP_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dg, src, sg, bytes, s));
    return;
  }
  cudaMemcpyKind kind = dst_device.is_cuda() ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  if (dst_device.is_cpu()) ctx.refuse_in_capture("a copy to the host");
  DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s));
  // A copy that ends on the host is waited for: the caller reads the data next.
  // An armed device-side fault (a bad label in the loss) is reported at this read.
  if (dst_device.is_cpu()) {
    ctx.note_host_sync();
    DP_CUDA_CHECK(cudaStreamSynchronize(s));
    ctx.check_faults();
  }
#else
  (void)ctx;
  DP_THROW("copy between " << src_device << " and " << dst_device
                           << ": no CUDA backend: " << cuda_unavailable_reason());
#endif
}

void fill_bytes(void* y, Device device, uint8_t value, size_t bytes, DeviceContext& ctx) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    ctx.refuse_in_capture("a fill of a raw host pointer");
    std::memset(y, value, bytes);
    return;
  }
#if DP_HAVE_CUDA
  ctx.make_current();
  DP_CUDA_CHECK(cudaMemsetAsync(y, value, bytes, static_cast<cudaStream_t>(ctx.stream())));
#else
  (void)ctx;
  DP_THROW("fill on " << device << ": no CUDA backend: " << cuda_unavailable_reason());
#endif
}

void copy_bytes(Tensor& dst, const Tensor& src) {
  DP_CHECK(dst.defined() && src.defined(), "copy_bytes: undefined tensor");
  DP_CHECK(dst.numel() == src.numel() && dst.dtype() == src.dtype(),
           "copy_bytes: " << src << " into " << dst << ": element counts or dtypes differ");
  Device d = dst.device(), s = src.device();
  // The GPU side's context orders the copy; dst's when both sides are alike.
  DeviceContext& ctx = context(s.is_cuda() && d.is_cpu() ? s : d);
  // A copy out of the capturing device queued on another's stream would run once, now, and be
  // missing from every replay (CUDA), or read the capturing device's memory on the host (CPU).
  if (DeviceContext* c = capturing_on_this_thread(); c && c != &ctx && c->device() == s) {
    std::ostringstream what;
    what << "a copy out to " << d;
    c->refuse_in_capture(what.str().c_str());
  }
  if (ctx.capturing() && d.is_cpu() && s.is_cpu()) {
    DeviceContext* c = &ctx;
    return ctx.record([dst = ctx.graph_arg(dst), src = ctx.graph_arg(src), c]() mutable {
      copy_host(static_cast<char*>(dst.raw()), static_cast<const char*>(src.raw()), dst.nbytes(),
                *c);
    });
  }
  // A captured CUDA copy keeps both addresses: the graph holds both tensors (never run).
  if (ctx.capturing()) ctx.record([dst = ctx.graph_arg(dst), src = ctx.graph_arg(src)] {});
  copy_bytes(dst.raw(), d, src.raw(), s, dst.nbytes(), ctx);
}

void read_back(Tensor& host, const Tensor& src) {
  DP_CHECK(host.defined() && host.device().is_cpu(),
           "read_back: " << host << " is not on the host");
  copy_bytes(host, src);
  if (src.device().is_cpu())
    if (DeviceContext* ctx = existing_context(src.device())) ctx->note_host_sync();
}

void queue_read_back(Tensor& host, const Tensor& src) {
  DP_CHECK(host.defined() && src.defined() && host.device().is_cpu(),
           "queue_read_back: " << host << " is not on the host");
  DP_CHECK(host.numel() == src.numel() && host.dtype() == src.dtype(),
           "queue_read_back: " << src << " into " << host << ": element counts or dtypes differ");
  if (src.device().is_cpu()) return copy_bytes(host, src);
  DP_CHECK(host.storage()->pinned(), "queue_read_back: " << host
                                                         << " is pageable: a copy into it "
                                                            "cannot be queued (use pinned memory)");
#if DP_HAVE_CUDA
  DeviceContext& ctx = context(src.device());
  ctx.refuse_in_capture("a copy to the host");
  ctx.make_current();
  DP_CUDA_CHECK(cudaMemcpyAsync(host.raw(), src.raw(), host.nbytes(), cudaMemcpyDeviceToHost,
                                static_cast<cudaStream_t>(ctx.stream())));
#endif
}

void fill_bytes(Tensor& y, uint8_t value) {
  DP_CHECK(y.defined(), "fill_bytes: undefined tensor");
  DeviceContext& ctx = context(y.device());
  if (ctx.capturing() && y.device().is_cpu())
    return ctx.record(
        [y = ctx.graph_arg(y), value]() mutable { std::memset(y.raw(), value, y.nbytes()); });
  if (ctx.capturing()) ctx.record([y = ctx.graph_arg(y)] {});  // held by the CUDA graph
  fill_bytes(y.raw(), y.device(), value, y.nbytes(), ctx);
}

void queue_fault_word(Tensor& word, DeviceContext& ctx) {
  DP_CHECK(word.defined() && word.nbytes() == sizeof(uint64_t) && word.device() == ctx.device(),
           "queue_fault_word: " << word << " must be 8 bytes on " << ctx.device());
  if (ctx.device().is_cpu()) return fill_bytes(word, 0xff);
  if (ctx.capturing()) ctx.record([word = ctx.graph_arg(word)] {});  // held by the CUDA graph
  copy_bytes(word.raw(), word.device(), ctx.fault_record(), ctx.device(), sizeof(uint64_t), ctx);
}

bool fault_written(const float* word) {
  uint64_t bits = 0;
  std::memcpy(&bits, word, sizeof bits);
  return bits != ~uint64_t{0};
}

}  // namespace kernels
