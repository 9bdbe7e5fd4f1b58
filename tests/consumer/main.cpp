// A separate project built against an installed dptrain (find_package(dptrain)), as a user
// writes one: its own layer (a low-rank linear map with gradients written by hand), its own
// loss (nn::Loss), a model around them, DataParallel on 4 CPU devices, and an engine-level save
// and load. Exits non-zero when the layer's or the loss's gradients are wrong, the loss does not
// fall, DP with the user's loss leaves one device's curve, or the run resumed from the
// checkpoint differs by a single bit from the run that never stopped. Built with
// find_package(dptrain COMPONENTS cuda) it also says whether it found a GPU (the CUDA backend is
// linked either way and detects one at run time).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dp/data_parallel.hpp"
#include "kernels/runtime/device.hpp"
#include "nn/nn.hpp"

using kernels::Accumulate;
using kernels::Transpose;
using nn::Tensor;

// y = (x U^T) V^T + b, with U (rank, in) and V (out, rank): x (N, in) -> y (N, out).
class LowRank : public nn::Module {
 public:
  LowRank(int64_t in, int64_t out, int64_t rank) : in_(in), out_(out), rank_(rank) {
    u_ = &register_parameter("u", {rank, in}, nn::kaiming_uniform(in, std::sqrt(5.f)));
    v_ = &register_parameter("v", {out, rank}, nn::kaiming_uniform(rank, std::sqrt(5.f)));
    b_ = &register_parameter("bias", {out}, nn::torch_default(rank));
  }
  std::string type_name() const override { return "LowRank"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    x_ = x;
    h_ = Tensor::empty({x.dim(0), rank_}, nn::DType::f32, x.device());  // (N, rank)
    kernels::gemm(h_, x, Transpose::no, u_->value, Transpose::yes);
    Tensor y = Tensor::empty({x.dim(0), out_}, nn::DType::f32, x.device());
    kernels::gemm(y, h_, Transpose::no, v_->value, Transpose::yes, 1.f, 0.f, b_->value);
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {  // adds to the parameter gradients
    kernels::gemm(v_->grad, dy, Transpose::yes, h_, Transpose::no, 1.f, 1.f);
    kernels::bias_backward(b_->grad, dy, Accumulate::yes);
    Tensor dh = Tensor::empty({dy.dim(0), rank_}, nn::DType::f32, dy.device());
    kernels::gemm(dh, dy, Transpose::no, v_->value, Transpose::no);
    kernels::gemm(u_->grad, dh, Transpose::yes, x_, Transpose::no, 1.f, 1.f);
    Tensor dx = Tensor::empty({dy.dim(0), in_}, nn::DType::f32, dy.device());
    kernels::gemm(dx, dh, Transpose::no, u_->value, Transpose::no);
    return dx;
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<LowRank>(in_, out_, rank_);
  }

 private:
  int64_t in_, out_, rank_;
  nn::Parameter *u_, *v_, *b_;
  Tensor x_, h_;
};

// The user's loss: squared error after a sigmoid, for multi-hot targets (B, C) f32:
// L = sum (sigmoid(z) - t)^2 / (B C). Built from public ops on whatever device z is on.
class SigmoidSquaredError : public nn::Loss {
 public:
  std::string name() const override { return "sigmoid_squared_error"; }
  void check_target(const Tensor& t) const override {
    DP_CHECK(t.ndim() == 2 && t.dtype() == nn::DType::f32,
             "sigmoid_squared_error: targets " << t << " must be (B, C) f32");
  }
  int64_t denominator(const Tensor& t) const override { return t.numel(); }
  void compute(Tensor& loss, Tensor& dpred, const Tensor& z, const Tensor& t) const override {
    Tensor s = Tensor::empty(z.shape(), nn::DType::f32, z.device());
    kernels::sigmoid(s, z);
    Tensor d = Tensor::empty(z.shape(), nn::DType::f32, z.device());
    kernels::copy(d, s);
    kernels::axpy(d, -1.f, t);  // d = s - t
    const float n = static_cast<float>(std::max<int64_t>(t.numel(), 1));
    kernels::sum_squares(loss, d);
    kernels::scale(loss, loss, 1.f / n);
    if (!dpred.defined()) return;
    kernels::scale(d, d, 2.f / n);  // dL/ds
    kernels::sigmoid_backward(dpred, d, s, Accumulate::no);
  }
};

nn::ModulePtr make_model() {
  return nn::sequential({std::make_shared<nn::Linear>(8, 32), std::make_shared<nn::ReLU>(),
                         std::make_shared<LowRank>(32, 32, 4), std::make_shared<nn::ReLU>(),
                         std::make_shared<nn::Linear>(32, 3)});
}

// Batch `step`: 64 rows of 8 features; the label is the largest of three fixed sums.
std::pair<Tensor, Tensor> batch(int step) {
  std::vector<float> x(64 * 8);
  std::vector<int32_t> y(64);
  for (int r = 0; r < 64; ++r) {
    float s[3] = {0, 0, 0};
    for (int c = 0; c < 8; ++c) {
      x[r * 8 + c] = std::sin(0.37f * (step * 64 + r) + 1.3f * c);
      s[c % 3] += x[r * 8 + c];
    }
    y[r] = s[0] > s[1] ? (s[0] > s[2] ? 0 : 2) : (s[1] > s[2] ? 1 : 2);
  }
  return {Tensor::from_vector(x, {64, 8}), Tensor::from_ints(y, {64})};
}

// Batch `step` with multi-hot targets: class c is on when feature sum c is positive.
std::pair<Tensor, Tensor> multi_hot_batch(int step, int rows) {
  auto [x, y] = batch(step);
  std::vector<float> xs = x.to_host_f32(), t(rows * 3);
  xs.resize(rows * 8);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < 3; ++c) {
      float sum = 0;
      for (int k = c; k < 8; k += 3) sum += xs[r * 8 + k];
      t[r * 3 + c] = sum > 0 ? 1.f : 0.f;
    }
  return {Tensor::from_vector(xs, {rows, 8}), Tensor::from_vector(t, {rows, 3})};
}

// The user's loss trained on `n` CPU devices, on batches of 61 rows (uneven chunks): the losses.
std::vector<float> user_loss_curve(int n) {
  nn::ModulePtr model = make_model();
  model->materialize(kernels::Device::cpu(0), 11);
  kernels::SgdConfig c;
  c.lr = 0.5f;
  nn::SGD opt(*model, c);
  std::vector<kernels::Device> devices;
  for (int i = 0; i < n; ++i) devices.push_back(kernels::Device::cpu(i));
  dp::DataParallelOptions o;
  o.loss = std::make_shared<SigmoidSquaredError>();
  dp::DataParallel engine(model, opt, devices, o);
  std::vector<float> losses;
  for (int s = 0; s < 40; ++s) {
    auto [x, t] = multi_hot_batch(s, 61);
    losses.push_back(engine.train_step(x, t).loss);
  }
  return losses;
}

struct Run {
  nn::ModulePtr model = make_model();
  std::unique_ptr<nn::SGD> opt;
  std::unique_ptr<dp::DataParallel> engine;
  Run() {
    model->materialize(kernels::Device::cpu(0), 7);
    kernels::SgdConfig c;
    c.lr = 0.1f;
    c.momentum = 0.9f;
    opt = std::make_unique<nn::SGD>(*model, c);
    std::vector<kernels::Device> devices;
    for (int i = 0; i < 4; ++i) devices.push_back(kernels::Device::cpu(i));
    engine = std::make_unique<dp::DataParallel>(model, *opt, devices);
  }
  float train(int from, int to) {
    float loss = 0;
    for (int s = from; s < to; ++s) {
      auto [x, y] = batch(s);
      loss = engine->train_step(x, y).loss;
    }
    return loss;
  }
  std::vector<float> weights() { return model->flat_params().to_host_f32(); }
};

std::string num(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", v);
  return text;
}

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "consumer_state.safetensors";
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::printf("%s: %s\n", ok ? "ok" : "FAILED", what.c_str());
    failures += ok ? 0 : 1;
  };

  auto layer = std::make_shared<LowRank>(6, 5, 2);
  layer->materialize(kernels::Device::cpu(), 1);
  auto [x, y] = batch(0);
  std::vector<float> xs = x.to_host_f32();
  xs.resize(4 * 6);
  nn::GradcheckResult check = nn::gradcheck(*layer, Tensor::from_vector(xs, {4, 6}));
  expect(check.ok, "LowRank gradients: " + check.message);

  {  // the user's loss: its gradient, and DP on 4 devices on one device's curve
    auto [x5, t] = multi_hot_batch(3, 5);
    std::vector<float> z15 = x5.to_host_f32();
    z15.resize(15);
    Tensor z = Tensor::from_vector(z15, {5, 3});  // (5, 3) logits
    Tensor loss = Tensor::empty({1}, nn::DType::f32, z.device());
    Tensor dz = Tensor::empty(z.shape(), nn::DType::f32, z.device());
    SigmoidSquaredError user;
    user.compute(loss, dz, z, t);
    std::vector<float> zs = z.to_host_f32(), g = dz.to_host_f32(), ts = t.to_host_f32();
    double worst = 0;
    for (size_t k = 0; k < zs.size(); ++k) {  // central differences in double
      auto value = [&](double zk) {
        double sum = 0;
        for (size_t j = 0; j < zs.size(); ++j) {
          double s = 1 / (1 + std::exp(-(j == k ? zk : double{zs[j]})));
          sum += (s - ts[j]) * (s - ts[j]);
        }
        return sum / static_cast<double>(zs.size());
      };
      double h = 1e-4, numeric = (value(zs[k] + h) - value(zs[k] - h)) / (2 * h);
      worst = std::max(worst, std::abs(numeric - double{g[k]}));
    }
    expect(worst < 1e-5,
           "the user's loss gradient matches central differences (worst " + num(worst) + ")");
    std::vector<float> one = user_loss_curve(1), four = user_loss_curve(4);
    float gap = 0;
    for (size_t s = 0; s < one.size(); ++s) gap = std::max(gap, std::abs(one[s] - four[s]));
    expect(four.back() < 0.6f * four.front() && gap < 1e-5f,
           "the user's loss trains through DP on 4 devices (" + std::to_string(four.front()) +
               " -> " + std::to_string(four.back()) + "), on one device's curve (gap " + num(gap) +
               ")");
  }

  // run.cmake reads this line: the backend the link pulled in, and what it found here.
  const std::string why = kernels::cuda_unavailable_reason();
  std::printf("backend: %s; CUDA devices: %d%s\n", kernels::built_with_cuda() ? "cuda" : "cpu",
              kernels::cuda_device_count(), why.empty() ? "" : (" (" + why + ")").c_str());

  Run a;
  const float first = a.train(0, 1);
  a.train(1, 30);
  a.engine->save(path);  // the whole state: weights, momentum, step, dropout offsets
  const float last = a.train(30, 60);
  expect(last < 0.5f * first, "DP on 4 CPU devices learns: loss " + std::to_string(first) + " -> " +
                                  std::to_string(last));

  Run b;
  nn::TrainingProgress at = b.engine->load(path);
  expect(at.step == 30, "the checkpoint is at step " + std::to_string(at.step) + " (30)");
  b.train(30, 60);
  const std::vector<float> wa = a.weights(), wb = b.weights();
  expect(wa.size() == wb.size() && std::memcmp(wa.data(), wb.data(), wa.size() * 4) == 0,
         "resumed from the checkpoint = never stopped, bit for bit");
  return failures == 0 ? 0 : 1;
}
