// nn::Embedding: a lookup table, ids (...) i32 -> rows (..., dim).
#pragma once

#include <memory>
#include <string>

#include "nn/module.hpp"

namespace nn {

// weight (num, dim) ~ N(0, 1) as PyTorch (GPT-2 sets 0.02). ids are not differentiable:
// backward adds dy into the looked-up rows of the weight gradient and returns zeros shaped
// like ids (f32), so the module keeps the forward/backward contract.
class Embedding : public Module {
 public:
  // requires num, dim > 0.
  Embedding(int64_t num_embeddings, int64_t dim) : num_(num_embeddings), dim_(dim) {
    DP_CHECK(num_ > 0 && dim_ > 0, "Embedding(" << num_ << ", " << dim_ << "): sizes must be > 0");
    weight_ = &register_parameter("weight", {num_, dim_}, InitSpec::normal(1.f));
  }
  std::string type_name() const override { return "Embedding"; }
  int64_t num_embeddings() const { return num_; }
  int64_t dim() const { return dim_; }
  Parameter& weight() { return *weight_; }

 protected:
  Tensor forward_impl(const Tensor& ids) override {
    DP_CHECK(ids.dtype() == DType::i32 && ids.ndim() >= 1,
             "Embedding(" << num_ << ", " << dim_ << "): ids " << ids << " must be i32 (...)");
    ids_ = ids;
    Shape y_shape = ids.shape();
    y_shape.push_back(dim_);
    Tensor y = Tensor::empty(y_shape, DType::f32, ids.device());  // (..., dim)
    kernels::embedding_forward(y, ids, weight_->value);
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(ids_.defined(), "Embedding::backward called before forward");
    kernels::embedding_backward(weight_->grad, dy, ids_);
    return Tensor::zeros(ids_.shape(), DType::f32, dy.device());
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<Embedding>(num_, dim_);
  }

 private:
  int64_t num_, dim_;
  Parameter* weight_ = nullptr;
  Tensor ids_;
  void release_saved() override { ids_ = Tensor(); }
};

}  // namespace nn
