// Byte movement at the runtime's own level: copy between any two devices and fill with a byte.
// These are what the runtime needs for Tensor::to(Device), zeroed tensors and host copies;
// dtype casts are ops (kernels::cast, in the op layer), not runtime.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/runtime/device.hpp"

namespace kernels {

class DeviceContext;
class Tensor;

// requires dst and src each hold `bytes` bytes on their devices.
// ensures the bytes are copied, queued on `ctx`'s stream when either side is a GPU (a plain
// device-to-device copy on one GPU, a peer copy across GPUs, H2D or D2H otherwise); a copy that
// ends on the host is waited for, because the caller reads it next. CPU to CPU copies run in
// `ctx`'s arena, in parallel chunks when the buffers are large and disjoint (memmove semantics
// otherwise). `ctx` is the context of the GPU side (either side's for CPU to CPU).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                DeviceContext& ctx);
// requires y holds `bytes` bytes on `device`. ensures every byte is `value` (memset), queued on
// ctx's stream for a GPU.
void fill_bytes(void* y, Device device, uint8_t value, size_t bytes, DeviceContext& ctx);

// Tensor forms. requires same numel and dtype (copy), defined tensors. The context is this
// thread's for the GPU side (or dst's device when both are CPU).
void copy_bytes(Tensor& dst, const Tensor& src);
void fill_bytes(Tensor& y, uint8_t value);

// A step's read of its results: requires host a host tensor of src's numel and dtype. ensures
// host = src, and one host sync counted on src's context on every backend (from a GPU the copy
// waits for the stream; on a CPU device the work is done, and the read counts alike).
void read_back(Tensor& host, const Tensor& src);
// read_back without the wait: requires host pinned (from a GPU) and of src's numel and dtype,
// nothing capturing. ensures the copy is queued on src's context; host = src once an event
// recorded there after this call is reached (Event::synchronize). Counts no host sync, and
// reports no device-side fault (the next waiting read does). From a CPU device: copied now.
void queue_read_back(Tensor& host, const Tensor& src);

// A device-side fault record that travels with a step's metrics, for reads that do not go
// through the faulting context (another device's metrics gathered on device 0; a lagged read):
// requires `word` 2 f32 on the device of ctx, this thread's context there. ensures the first
// word of ctx's fault record (DeviceContext::fault_record) is copied into `word`, queued and
// capturable on a CUDA device; on a CPU device (whose ops throw at once) `word` says no fault.
void queue_fault_word(Tensor& word, DeviceContext& ctx);
// requires `word` the host copy of a queue_fault_word result. ensures whether it says a fault was
// written (the context's synchronize() then reports it, with its text).
bool fault_written(const float* word);

}  // namespace kernels
