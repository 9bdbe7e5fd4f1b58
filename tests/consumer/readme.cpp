#include <cstdio>

#include "dp/data_parallel.hpp"
#include "nn/nn.hpp"

using nn::Tensor;

// A learned per-feature scale: y = x * s, x (N, D), s (D).
class Scale : public nn::Module {
 public:
  explicit Scale(int64_t d) { s_ = &register_parameter("s", {d}, nn::InitSpec::constant(1.f)); }
  std::string type_name() const override { return "Scale"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    Tensor y = Tensor::empty(x.shape(), nn::DType::f32, x.device());
    kernels::mul(y, x_ = x, s_->value);  // s broadcast over the rows
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {
    Tensor t = Tensor::empty(dy.shape(), nn::DType::f32, dy.device());
    kernels::mul(t, dy, x_);
    kernels::sum_leading(s_->grad, t, kernels::Accumulate::yes);  // ds += sum over rows
    kernels::mul(t, dy, s_->value);
    return t;
  }
  nn::ModulePtr clone_config() const override { return std::make_shared<Scale>(s_->shape[0]); }

 private:
  nn::Parameter* s_;
  Tensor x_;
};

int main() {
  auto model = nn::sequential({std::make_shared<nn::Linear>(8, 32), std::make_shared<Scale>(32),
                               std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(32, 2)});
  model->materialize(kernels::Device::cpu(0), /*seed=*/1);
  nn::SGD opt(*model, kernels::SgdConfig{});
  dp::DataParallel engine(model, opt, kernels::make_devices(kernels::DeviceType::cpu, 4));
  std::vector<float> x(64 * 8);
  std::vector<int32_t> y(64);
  for (int i = 0; i < 64 * 8; ++i) x[i] = (i * 37 % 17) / 17.f - 0.5f;
  for (int i = 0; i < 64; ++i) y[i] = x[i * 8] > 0 ? 1 : 0;
  for (int step = 0; step < 50; ++step) {
    dp::StepStats st =
        engine.train_step(Tensor::from_vector(x, {64, 8}), Tensor::from_ints(y, {64}));
    if (step % 10 == 0) std::printf("step %d loss %.4f\n", step, st.loss);
  }
  engine.save("my_model.safetensors");  // weights, optimizer, step, RNG: the whole state
  engine.load("my_model.safetensors");  // the same call resumes a new run
}
