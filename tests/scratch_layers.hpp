// Research code that takes a temporary in backward and another in the optimizer's step, the
// same size and one no other tensor of the step has (kScratchFloats): eagerly the step's
// reuses the block backward freed, which a graphed step's first graph keeps (dp/graphs.hpp's
// kCaptureMemoryRetries). For test_dp and dist_worker.
#pragma once

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

}  // namespace dp_test
