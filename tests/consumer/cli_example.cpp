// A program of one's own on the installed helpers (dptrain::cli): flags checked by dp::cli's
// validators, one JSON line per step in a --log file (dp::cli::StepLog), a small model trained
// on one CPU device.
#include <cstdio>
#include <optional>

#include <CLI/CLI.hpp>

#include "dp/cli/cli.hpp"
#include "dp/cli/progress.hpp"
#include "nn/nn.hpp"

int main(int argc, char** argv) {
  int64_t steps = 5;
  std::string log;
  CLI::App app{"cli_example: a tiny regression with dptrain's program helpers"};
  app.add_option("--steps", steps, "optimizer steps")->check(dp::cli::whole_number(1, 1000));
  app.add_option("--log", log, "one JSON object per step (JSONL)");
  CLI11_PARSE(app, argc, argv);

  auto model = nn::sequential({std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(),
                               std::make_shared<nn::Linear>(8, 1)});
  model->materialize(kernels::Device::cpu(0), 3);
  nn::SGD opt(*model, kernels::SgdConfig{});
  nn::MSELoss loss_fn;
  std::vector<float> x(16 * 4), y(16);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) / 7.f - 0.5f;
  for (size_t i = 0; i < y.size(); ++i) y[i] = x[i * 4] - x[i * 4 + 1];
  const kernels::Tensor xs = kernels::Tensor::from_vector(x, {16, 4});
  const kernels::Tensor ys = kernels::Tensor::from_vector(y, {16, 1});
  std::optional<dp::cli::StepLog> step_log;
  if (!log.empty()) step_log.emplace("--log", log);
  for (int64_t s = 0; s < steps; ++s) {
    model->zero_grad();
    kernels::Tensor out = model->forward(xs);
    kernels::Tensor loss =
        kernels::Tensor::empty({1}, kernels::DType::f32, kernels::Device::cpu(0));
    kernels::Tensor dl = kernels::Tensor::empty(out.shape(), kernels::DType::f32, out.device());
    loss_fn.compute(loss, dl, out, ys);
    model->backward(dl);
    opt.step();
    dp::cli::StepRecord r;
    r.step = s + 1;
    r.loss = loss.item();
    if (step_log) step_log->write(r);
    std::printf("step %lld loss %.5f\n", static_cast<long long>(s + 1), r.loss);
  }
  if (step_log) step_log->close();  // a log that did not reach the disk is an error
  return 0;
}
