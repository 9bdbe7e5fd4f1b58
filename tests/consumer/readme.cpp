#include <cstdio>

#include "dp/data_parallel.hpp"
#include "nn/nn.hpp"

using nn::Tensor;

// A learned per-feature scale: y = x * s, x (N, D), s (D).
class Scale : public nn::Composed {
 public:
  explicit Scale(int64_t d) : s_(register_parameter("s", {d}, nn::InitSpec::constant(1.f))) {}
  std::string type_name() const override { return "Scale"; }

 protected:
  // The forward only, as ops on Vars; the backward is derived (nn/autograd.hpp).
  Var compose(const Var& x) override { return x * param(s_); }  // s broadcast over the rows
  nn::ModulePtr clone_config() const override { return std::make_shared<Scale>(s_.shape[0]); }

 private:
  nn::Parameter& s_;
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
