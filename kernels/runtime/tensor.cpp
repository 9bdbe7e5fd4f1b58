#include "kernels/runtime/tensor.hpp"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "kernels/runtime/block_cache.hpp"
#include "kernels/runtime/context.hpp"
#include "kernels/runtime/memory.hpp"

#if DP_HAVE_CUDA
#include "kernels/runtime/cuda_check.hpp"
#endif

namespace kernels {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    DP_CHECK(d >= 0, "negative dimension in shape " << shape_str(s));
    if (d == 0) n = 0;  // empty, however large the others
  }
  if (n == 0) return 0;
  for (int64_t d : s)  // a product past int64 (2^63) wrapped, to 0 for [2^32, 2^32]
    DP_CHECK(!__builtin_mul_overflow(n, d, &n),
             "shape " << shape_str(s) << " has more elements than an int64 counts (2^63)");
  return n;
}

// ---- Storage -------------------------------------------------------------------------------

Storage::Storage(Device device, size_t bytes, HostMemory host) : device_(device), bytes_(bytes) {
  DeviceContext& ctx = context(device);
  stats_ = ctx.memory();
  if (bytes == 0) return;
#if DP_HAVE_CUDA
  if (device.is_cpu() && host == HostMemory::pinned && cuda_device_count() > 0) {
    DP_CUDA_CHECK(cudaMallocHost(&data_, bytes));
    stats_->allocations.fetch_add(1);
    pinned_ = true;
  }
#else
  (void)host;
#endif
  if (!pinned_) {
    stream_ = ctx.stream_owner();  // CUDA: the stream it is allocated on, and freed on
    cache_ = ctx.block_cache();
    if (!cache_ && ctx.capturing()) refuse_capture_allocation(device, bytes);
    data_ =
        cache_ ? cache_->take(bytes) : allocate_device_bytes(device, bytes, stream_.get(), *stats_);
  }
  stats_->on_alloc(static_cast<int64_t>(bytes));
}

std::shared_ptr<Storage> Storage::borrow(const Storage& owner) {
  std::shared_ptr<Storage> s(new Storage());
  s->device_ = owner.device_;
  s->bytes_ = owner.bytes_;
  s->data_ = owner.data_;
  s->pinned_ = owner.pinned_;
  s->borrowed_ = true;
  return s;
}

Storage::~Storage() {
  if (!data_ || borrowed_) return;
  stats_->on_free(static_cast<int64_t>(bytes_));
  if (cache_) {
    cache_->give_back(data_, bytes_);
    return;
  }
  if (!pinned_) {
    free_device_bytes(device_, data_, bytes_, stream_.get());
    return;
  }
#if DP_HAVE_CUDA
  cudaError_t e = cudaFreeHost(data_);
  if (e != cudaSuccess && e != cudaErrorCudartUnloading)
    DP_LOG_ERROR("freeing " << bytes_ << " pinned bytes: " << cudaGetErrorString(e));
#endif
}

// ---- Tensor --------------------------------------------------------------------------------

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(device, t.nbytes());
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  fill_bytes(t, 0);  // all-zero bytes are 0 in every dtype
  return t;
}

Tensor Tensor::empty_pinned(const Shape& shape, DType dtype) {
  // cudaMallocHost waits for the device: not while this thread captures, on any backend.
  if (DeviceContext* c = capturing_on_this_thread())
    c->refuse_in_capture("allocating pinned host memory");
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(Device::cpu(), t.nbytes(), Storage::HostMemory::pinned);
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& v, const Shape& shape, Device device,
                           DType dtype) {
  DP_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape),
           "from_vector: " << v.size() << " values for shape " << shape_str(shape));
  DP_CHECK(is_floating(dtype), "from_vector: float data into dtype " << dtype);
  Tensor host = empty(shape, dtype, Device::cpu());
  switch (dtype) {
    case DType::f16:
      for (size_t i = 0; i < v.size(); ++i) host.data<uint16_t>()[i] = f32_to_f16(v[i]);
      break;
    case DType::bf16:
      for (size_t i = 0; i < v.size(); ++i) host.data<uint16_t>()[i] = f32_to_bf16(v[i]);
      break;
    default:
      if (!v.empty()) std::memcpy(host.raw(), v.data(), v.size() * sizeof(float));
  }
  return device == Device::cpu() ? host : host.to(device);
}

Tensor Tensor::from_ints(const std::vector<int32_t>& v, const Shape& shape, Device device) {
  DP_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape),
           "from_vector: " << v.size() << " values for shape " << shape_str(shape));
  Tensor host = empty(shape, DType::i32, Device::cpu());
  if (!v.empty()) std::memcpy(host.raw(), v.data(), v.size() * sizeof(int32_t));
  return device == Device::cpu() ? host : host.to(device);
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  int j = i < 0 ? i + n : i;
  DP_CHECK(j >= 0 && j < n, "dim " << i << " out of range for shape " << shape_str(shape_));
  return shape_[j];
}

Device Tensor::device() const {
  DP_CHECK(storage_, "device() of an undefined tensor");
  return storage_->device();
}

void* Tensor::raw() const {
  if (!storage_ || !storage_->data()) return nullptr;
  if (DeviceContext* capturing = capturing_on_this_thread())
    if (storage_->device().is_cpu() && storage_->device() == capturing->device()) {
      std::ostringstream what;
      what << "a host read or write of " << *this;
      capturing->refuse_in_capture(what.str().c_str());
    }
  return static_cast<char*>(storage_->data()) + offset_;
}

Tensor Tensor::rebased(std::shared_ptr<Storage> s) const {
  Tensor t = *this;
  t.storage_ = std::move(s);
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  DP_CHECK(shape_numel(shape) == numel_, "reshape: " << shape_str(shape_) << " has " << numel_
                                                     << " elements, " << shape_str(shape) << " has "
                                                     << shape_numel(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  DP_CHECK(ndim() >= 1, "slice of a 0-d tensor");
  DP_CHECK(0 <= begin && begin <= end && end <= shape_[0],
           "slice [" << begin << ", " << end << ") out of range for shape " << shape_str(shape_));
  int64_t row = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.numel_ = row * (end - begin);
  t.offset_ = offset_ + static_cast<size_t>(begin * row) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::view(int64_t offset_elems, const Shape& shape) const {
  int64_t n = shape_numel(shape);
  DP_CHECK(offset_elems >= 0 && offset_elems + n <= numel_,
           "view of " << n << " elements at " << offset_elems << " exceeds " << numel_
                      << " elements of " << shape_str(shape_));
  Tensor t = *this;
  t.shape_ = shape;
  t.numel_ = n;
  t.offset_ = offset_ + static_cast<size_t>(offset_elems) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::to(Device device) const {
  // A GPU waits for the copy (below): refused on every backend alike while this thread captures
  // on either side, where a CPU device would record it and a GPU's capture would fail.
  if (DeviceContext* c = capturing_on_this_thread())
    if (c->device() == device || c->device() == this->device())
      c->refuse_in_capture("a host read or wait");
  Tensor t = empty(shape_, dtype_, device);
  copy_bytes(t, *this);
  if (device.is_cuda()) context(device).synchronize();
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  copy_bytes(t, *this);
  return t;
}

namespace {
// A host read of a CPU tensor counts as a host sync of its device's context, as a copy from a
// GPU does (when this thread has a context for it; a read made where none exists is no step's).
void note_cpu_read(const Tensor& t) {
  if (DeviceContext* ctx = existing_context(t.device())) ctx->note_host_sync();
}
}  // namespace

std::vector<float> Tensor::to_host_f32() const {
  if (device().is_cpu()) note_cpu_read(*this);
  Tensor h = device().is_cpu() ? *this : to(Device::cpu());
  std::vector<float> out(static_cast<size_t>(numel_));
  switch (dtype_) {
    case DType::f32:
      if (numel_) std::memcpy(out.data(), h.raw(), nbytes());  // empty: both may be null
      break;
    case DType::f16:
      for (int64_t i = 0; i < numel_; ++i) out[i] = f16_to_f32(h.data<uint16_t>()[i]);
      break;
    case DType::bf16:
      for (int64_t i = 0; i < numel_; ++i) out[i] = bf16_to_f32(h.data<uint16_t>()[i]);
      break;
    case DType::i32:
      for (int64_t i = 0; i < numel_; ++i) out[i] = static_cast<float>(h.data<int32_t>()[i]);
      break;
    case DType::i64:
      for (int64_t i = 0; i < numel_; ++i) out[i] = static_cast<float>(h.data<int64_t>()[i]);
      break;
    case DType::u8:
      for (int64_t i = 0; i < numel_; ++i) out[i] = h.data<uint8_t>()[i];
      break;
  }
  return out;
}

std::vector<int32_t> Tensor::to_host_i32() const {
  if (device().is_cpu()) note_cpu_read(*this);
  DP_CHECK(dtype_ == DType::i32, "to_host_i32 of a " << dtype_ << " tensor");
  Tensor h = device().is_cpu() ? *this : to(Device::cpu());
  std::vector<int32_t> out(static_cast<size_t>(numel_));
  if (numel_) std::memcpy(out.data(), h.raw(), nbytes());
  return out;
}

float Tensor::item() const {
  DP_CHECK(numel_ == 1, "item() of a tensor with " << numel_ << " elements " << shape_str(shape_));
  return to_host_f32()[0];
}

Tensor& ensure(Tensor& t, const Shape& shape, DType dtype, Device device) {
  if (!t.defined() || t.shape() != shape || t.dtype() != dtype || t.device() != device)
    t = Tensor::empty(shape, dtype, device);
  return t;
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "Tensor(undefined)";
  return os << "Tensor(" << t.dtype() << ", " << t.device() << ", " << shape_str(t.shape()) << ")";
}

}  // namespace kernels
