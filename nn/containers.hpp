// Shape and structure: Flatten, Sequential, Residual.
#pragma once

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.hpp"

namespace nn {

// (N, d1, d2, ...) -> (N, d1 d2 ...): a view, no copy.
class Flatten : public Module {
 public:
  std::string type_name() const override { return "Flatten"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK(x.ndim() >= 1,
             "Flatten: input " << kernels::shape_str(x.shape()) << " has no batch dim");
    x_shape_ = x.shape();
    const int64_t n = x.dim(0);
    return x.reshape({n, n > 0 ? x.numel() / n : 0});
  }
  Tensor backward_impl(const Tensor& dy) override { return dy.reshape(x_shape_); }
  std::shared_ptr<Module> clone_config() const override { return std::make_shared<Flatten>(); }

 private:
  Shape x_shape_;
};

// Children named "0", "1", ...: forward in order, backward in reverse.
class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<ModulePtr> layers) {
    for (const auto& m : layers) add(m);
  }
  explicit Sequential(const std::vector<ModulePtr>& layers) {
    for (const auto& m : layers) add(m);
  }

  // requires not materialised. ensures m is the last child, named by its index.
  template <class M>
  std::shared_ptr<M> add(std::shared_ptr<M> m) {
    return register_module(std::to_string(children().size()), std::move(m));
  }
  size_t size() const { return children().size(); }
  const ModulePtr& operator[](size_t i) const {
    DP_CHECK(i < size(), "Sequential[" << i << "]: only " << size() << " children");
    return children()[i].second;
  }
  std::string type_name() const override { return "Sequential"; }
  // The output is the last child's.
  bool backward_reads_output() const override {
    return children().empty() || children().back().second->backward_reads_output();
  }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    Tensor h = x;
    for (const auto& [name, m] : children()) h = m->forward(h);
    return h;
  }
  Tensor backward_impl(const Tensor& dy) override {
    Tensor g = dy;
    // Without an input gradient, backward ends at the first layer with parameters: the
    // parameterless layers before it (Flatten, a first activation) would only feed it.
    const size_t stop = input_grad_needed() ? 0 : first_with_parameters();
    for (size_t i = children().size(); i-- > stop;) g = children()[i].second->backward(g);
    return input_grad_needed() ? g : Tensor();
  }
  void on_input_grad(InputGrad g) override {
    const size_t first = first_with_parameters();
    for (size_t i = 0; i < children().size(); ++i)
      children()[i].second->set_input_grad(i <= first ? g : InputGrad::needed);
  }
  // Empty: clone_structure() clones and registers the children in order.
  std::shared_ptr<Module> clone_config() const override { return std::make_shared<Sequential>(); }

 private:
  // Index of the first child holding parameters (size() when none does).
  size_t first_with_parameters() const {
    for (size_t i = 0; i < children().size(); ++i)
      if (!children()[i].second->named_parameters().empty()) return i;
    return children().size();
  }
};

inline std::shared_ptr<Sequential> sequential(std::initializer_list<ModulePtr> layers) {
  return std::make_shared<Sequential>(layers);
}

// y = block(x) + shortcut(x), with shortcut the identity when none is given (then block must
// keep the shape). Children "block" and, when present, "shortcut".
class Residual : public Module {
 public:
  explicit Residual(ModulePtr block, ModulePtr shortcut = nullptr)
      : block_(register_module("block", std::move(block))) {
    if (shortcut) shortcut_ = register_module("shortcut", std::move(shortcut));
  }
  std::string type_name() const override { return "Residual"; }
  Module& block() { return *block_; }
  Module* shortcut() { return shortcut_.get(); }  // null for the identity

 protected:
  Tensor forward_impl(const Tensor& x) override {
    Tensor a = block_->forward(x);
    Tensor b = shortcut_ ? shortcut_->forward(x) : x;
    DP_CHECK(a.shape() == b.shape(), "Residual: block output " << kernels::shape_str(a.shape())
                                                               << " and shortcut "
                                                               << kernels::shape_str(b.shape())
                                                               << " differ; give a projection");
    Tensor y = Tensor::empty(a.shape(), DType::f32, a.device());
    kernels::add(y, a, b);
    return y;
  }
  // Reverse of forward: the shortcut's gradients first, then the block's.
  Tensor backward_impl(const Tensor& dy) override {
    Tensor ds = shortcut_ ? shortcut_->backward(dy) : dy;
    Tensor db = block_->backward(dy);
    Tensor dx = Tensor::empty(db.shape(), DType::f32, dy.device());
    kernels::add(dx, db, ds);
    return dx;
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<Residual>(block_->clone_structure(),
                                      shortcut_ ? shortcut_->clone_structure() : nullptr);
  }

 private:
  ModulePtr block_;
  ModulePtr shortcut_;
};

}  // namespace nn
