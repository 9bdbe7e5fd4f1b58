// Tensor: a contiguous, row-major block of one dtype on one device, or a view into one.
// Views share their parent's allocation; flat parameter buffers and their per-layer views
// rest on this. Copying a Tensor copies the handle, not the data.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "kernels/runtime/device.hpp"
#include "kernels/runtime/dtype.hpp"
#include "kernels/runtime/error.hpp"

namespace kernels {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

struct MemoryStats;
class BlockCache;

// One allocation on one device. Freed when the last Tensor viewing it goes away.
// CUDA memory comes from the stream-ordered pool (cudaMallocAsync) on the allocating
// thread's stream; host memory is page-locked when `pinned` (staging for H2D/D2H). When the
// allocating thread's context caches blocks (Caching::on), the block comes from and goes back
// to its BlockCache.
class Storage {
 public:
  enum class HostMemory { pageable, pinned };
  Storage(Device device, size_t bytes, HostMemory host = HostMemory::pageable);
  ~Storage();
  // A handle on `owner`'s memory that owns none of it: freeing it frees nothing, and it counts
  // in no memory statistic. For a graph's recording of a block the graph keeps itself
  // (DeviceContext::graph_arg).
  static std::shared_ptr<Storage> borrow(const Storage& owner);
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool pinned() const { return pinned_; }

 private:
  Storage() = default;  // borrow's

  Device device_;
  size_t bytes_ = 0;
  void* data_ = nullptr;
  bool pinned_ = false;
  bool borrowed_ = false;         // owns nothing (borrow)
  std::shared_ptr<void> stream_;  // CUDA: the stream it was allocated on, freed there too
  std::shared_ptr<MemoryStats> stats_;
  std::shared_ptr<BlockCache> cache_;  // set when the block came from a context's cache
};

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised tensor. Throws on a negative dimension.
  static Tensor empty(const Shape& shape, DType dtype, Device device);
  static Tensor zeros(const Shape& shape, DType dtype, Device device);
  // Pinned host tensor (falls back to pageable memory when no GPU is usable).
  static Tensor empty_pinned(const Shape& shape, DType dtype);
  // Host data -> tensor on `device` (f32 or i32 source, converted to `dtype` when floating).
  static Tensor from_vector(const std::vector<float>& v, const Shape& shape,
                            Device device = Device::cpu(), DType dtype = DType::f32);
  static Tensor from_ints(const std::vector<int32_t>& v, const Shape& shape,
                          Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;  // negative i counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  size_t offset_bytes() const { return offset_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  // The element memory. On a CPU device whose graph this thread captures, throws: a host read
  // or write there would not be replayed (on a GPU the memory is not the host's at all).
  void* raw() const;
  template <class T>
  T* data() const {
    return static_cast<T*>(raw());
  }

  // Views sharing this tensor's memory.
  // requires numel(shape) == numel(). ensures same data, new shape.
  Tensor reshape(const Shape& shape) const;
  // requires 0 <= begin <= end <= dim(0). ensures rows [begin, end) along dim 0.
  Tensor slice(int64_t begin, int64_t end) const;
  // requires offset + numel(shape) <= numel(). ensures a view of elements [offset, offset+n).
  Tensor view(int64_t offset_elems, const Shape& shape) const;

  // A new tensor on `device` with the same contents (waits for the copy to finish).
  Tensor to(Device device) const;
  // (Converting to another dtype is an op of the layer above: kernels::cast(x, dtype).)
  Tensor clone() const;
  // Host copies for tests and reporting; floating types are converted to float.
  std::vector<float> to_host_f32() const;
  std::vector<int32_t> to_host_i32() const;
  // The single value of a one-element tensor.
  float item() const;

  bool same_storage(const Tensor& o) const { return storage_ == o.storage_; }
  // requires `s` holds the memory of storage() (Storage::borrow). ensures this view on `s`.
  Tensor rebased(std::shared_ptr<Storage> s) const;

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes into storage
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::f32;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// For buffers reused from step to step: keeps `t` when it already has this shape, dtype and
// device, else replaces it with a new uninitialised tensor. Returns t.
Tensor& ensure(Tensor& t, const Shape& shape, DType dtype,
               Device device);  // "Tensor(f32, cpu:0, [2, 3])"

}  // namespace kernels
