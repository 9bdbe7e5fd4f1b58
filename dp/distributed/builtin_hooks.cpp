#include "dp/distributed/builtin_hooks.hpp"

#include "kernels/ops.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

namespace {

// A bf16 bucket's all-reduce, then its sum widened into the f32 gradient, once, by the first
// wait() that sees the all-reduce done (a failed one throws on every call).
class WidenWork final : public Work {
 public:
  WidenWork(std::shared_ptr<Work> sum, kernels::Tensor grad, kernels::Tensor buffer)
      : sum_(std::move(sum)), grad_(std::move(grad)), buffer_(std::move(buffer)) {}
  void wait() override {
    sum_->wait();
    if (widened_) return;
    kernels::copy(grad_, buffer_);
    widened_ = true;
  }
  bool is_completed() const override { return widened_ && sum_->is_completed(); }

 private:
  std::shared_ptr<Work> sum_;
  kernels::Tensor grad_, buffer_;
  bool widened_ = false;
};

}  // namespace

std::shared_ptr<Work> AllReduceHook::reduce(GradBucket& b) {
  if (b.group->size() == 1) return nullptr;
  return b.group->all_reduce(b.grad, ReduceOp::sum);
}

void AllReduceHook::reduce_queued(GradBucket& b) {
  if (b.group->size() > 1) b.group->all_reduce_queued(b.grad, ReduceOp::sum);
}

int64_t AllReduceHook::bytes_for(int64_t numel, int world) const {
  return world > 1 ? numel * static_cast<int64_t>(kernels::dtype_size(kernels::DType::f32)) : 0;
}

kernels::Tensor& Bf16CompressHook::round_into_buffer(const GradBucket& b) {
  DP_CHECK(b.grad.dtype() == kernels::DType::f32, "comm hook 'bf16-allreduce': bucket "
                                                      << b.index << " is " << b.grad.dtype()
                                                      << ", not the f32 gradient");
  if (static_cast<int>(buffers_.size()) <= b.index) buffers_.resize(b.index + 1);
  kernels::Tensor& buffer =
      kernels::ensure(buffers_[b.index], {b.grad.numel()}, kernels::DType::bf16, b.grad.device());
  kernels::copy(buffer, b.grad);  // rounded once
  return buffer;
}

std::shared_ptr<Work> Bf16CompressHook::reduce(GradBucket& b) {
  kernels::Tensor& buffer = round_into_buffer(b);
  if (b.group->size() == 1) {  // the sum of one: the rounded bucket itself
    kernels::copy(b.grad, buffer);
    return nullptr;
  }
  return std::make_shared<WidenWork>(b.group->all_reduce(buffer, ReduceOp::sum), b.grad, buffer);
}

void Bf16CompressHook::reduce_queued(GradBucket& b) {
  kernels::Tensor& buffer = round_into_buffer(b);
  if (b.group->size() > 1) b.group->all_reduce_queued(buffer, ReduceOp::sum);
}

void Bf16CompressHook::complete_queued(GradBucket& b) {
  DP_CHECK(b.index < static_cast<int>(buffers_.size()) && buffers_[b.index].defined(),
           "comm hook 'bf16-allreduce': complete_queued of bucket " << b.index
                                                                    << " before its reduce_queued");
  kernels::copy(b.grad, buffers_[b.index]);
}

int64_t Bf16CompressHook::bytes_for(int64_t numel, int world) const {
  return world > 1 ? numel * static_cast<int64_t>(kernels::dtype_size(kernels::DType::bf16)) : 0;
}

std::shared_ptr<CommHook> builtin_hook(kernels::DType dtype) {
  if (dtype == kernels::DType::f32) return std::make_shared<AllReduceHook>();
  DP_CHECK(dtype == kernels::DType::bf16,
           "DDP: buckets are all-reduced in f32 or bf16, not " << dtype);
  return std::make_shared<Bf16CompressHook>();
}

}  // namespace dp::dist
