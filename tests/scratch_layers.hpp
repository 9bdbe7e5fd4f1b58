// Research code that takes a temporary in backward and another in the optimizer's step, the
// same size and one no other tensor of the step has (kScratchFloats): eagerly the step's
// reuses the block backward freed, which a graphed step's first graph keeps, and its second
// graph takes from the pool the two share (kernels::Graph::capture's `after`); and a layer
// whose temporary grows, whose capture lacks cached memory (dp/graphs.hpp's
// kCaptureMemoryRetries). For test_dp and dist_worker.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "nn/nn.hpp"

namespace dp_test {

constexpr int64_t kScratchFloats = 777;

// Passes x on; its backward fills a temporary of kScratchFloats and lets it go.
class ScratchInBackward : public nn::Module {
 public:
  std::string type_name() const override { return "ScratchInBackward"; }

 protected:
  kernels::Tensor forward_impl(const kernels::Tensor& x) override { return x; }
  kernels::Tensor backward_impl(const kernels::Tensor& dy) override {
    kernels::Tensor scratch =
        kernels::Tensor::empty({kScratchFloats}, kernels::DType::f32, dy.device());
    kernels::fill(scratch, 1.f);
    return dy;
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<ScratchInBackward>();
  }
};

// SGD whose step first fills a temporary of kScratchFloats (as a LARS-like norm would).
class NormFirstSGD : public nn::SGD {
 public:
  using nn::SGD::SGD;
  void apply_step() override {
    kernels::Tensor scratch =
        kernels::Tensor::empty({kScratchFloats}, kernels::DType::f32, module().device());
    kernels::fill(scratch, 2.f);
    nn::SGD::apply_step();
  }
};

// Grows its backward's temporary by 4 KiB each call up to its `last_growth`-th (0: for ever): a
// capture then asks for a size no earlier run cached.
class GrowingScratch : public nn::Module {
 public:
  explicit GrowingScratch(int64_t last_growth = 0) : last_growth_(last_growth) {}
  std::string type_name() const override { return "GrowingScratch"; }

 protected:
  kernels::Tensor forward_impl(const kernels::Tensor& x) override { return x; }
  kernels::Tensor backward_impl(const kernels::Tensor& dy) override {
    const int64_t growths = last_growth_ > 0 ? std::min(calls_++, last_growth_) : calls_++;
    kernels::Tensor stat =
        kernels::Tensor::empty({1024 * (1 + growths)}, kernels::DType::f32, dy.device());
    kernels::fill(stat, 0.f);
    return dy;
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<GrowingScratch>(last_growth_);
  }

 private:
  int64_t last_growth_;
  int64_t calls_ = 0;
};

}  // namespace dp_test
