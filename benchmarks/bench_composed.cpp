// bench_composed: what writing a layer with autograd costs. A Llama MLP half-block (RMSNorm then
// SwiGLU) as the fused layers (nn::RMSNorm, nn::SwiGLU: hand-written backward, fused kernels)
// and as the composed ones (nn/composed.hpp: forward only, the tape replayed), forward and
// backward on one device, timed in interleaved repeats; the ratio composed / fused with its 95%
// interval (paired bootstrap).
//
//   bench_composed [--device cpu|cuda] [--rows 2048] [--dim 128] [--hidden 352] [--dtype f32]
//                  [--steps 20] [--repeat 7] [--json PATH]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "benchmarks/stats.hpp"
#include "dp/cli/cli.hpp"
#include "nn/file_io.hpp"
#include "nn/nn.hpp"

using kernels::Device;
using kernels::DType;
using kernels::Tensor;

namespace {

struct Options {
  std::string device = "cpu";
  int64_t rows = 2048, dim = 128, hidden = 352;
  std::string dtype = "f32";
  int steps = 20, repeat = 7;
  std::string json_path;
};

nn::ModulePtr block(bool composed, const Options& o) {
  nn::ModulePtr norm = composed ? nn::ModulePtr(std::make_shared<nn::ComposedRMSNorm>(o.dim))
                                : nn::ModulePtr(std::make_shared<nn::RMSNorm>(o.dim));
  nn::ModulePtr mlp = composed
                          ? nn::ModulePtr(std::make_shared<nn::ComposedSwiGLU>(o.dim, o.hidden))
                          : nn::ModulePtr(std::make_shared<nn::SwiGLU>(o.dim, o.hidden));
  return nn::sequential({norm, mlp});
}

// Milliseconds per forward + backward over `steps`, after the queue drains.
double time_steps(nn::Module& m, const Tensor& x, const Tensor& dy, int steps) {
  kernels::DeviceContext& ctx = kernels::context(x.device());
  ctx.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) {
    m.zero_grad();
    m.forward(x);
    m.backward(dy);
  }
  ctx.synchronize();
  const std::chrono::duration<double, std::milli> dt = std::chrono::steady_clock::now() - t0;
  return dt.count() / steps;
}

// The benchmark after its flags: prints the figures, writes --json. Throws on failure.
int run(const Options& o);

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app("bench_composed: a composed RMSNorm + SwiGLU against the fused layers");
  app.option_defaults()->always_capture_default();
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--rows", o.rows, "rows of the input (batch x sequence)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  app.add_option("--dim", o.dim, "model width")->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  app.add_option("--hidden", o.hidden, "SwiGLU width")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 17));
  app.add_option("--dtype", o.dtype, "f32 or bf16 (compute and activations)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--steps", o.steps, "steps per timed run")->check(CLI::Range(1, 100000));
  app.add_option("--repeat", o.repeat, "interleaved repeats (fused, composed)")
      ->check(CLI::Range(2, 1000));
  app.add_option("--json", o.json_path, "also write the figures as JSON to this file")
      ->check(dp::cli::output_file(dp::cli::Output::report));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return dp::cli::parse_exit(app, e);
  }
  try {
    return run(o);
  } catch (const std::exception& e) {  // no GPU, no memory, a --json that cannot be written
    std::fprintf(stderr, "bench_composed: %s\n", e.what());
    return 1;
  }
}

namespace {

int run(const Options& o) {
  const Device dev = o.device == "cpu" ? Device::cpu(0) : Device::cuda(0);
  std::vector<nn::ModulePtr> models = {block(false, o), block(true, o)};
  Tensor x, dy;
  {
    std::vector<float> xs(static_cast<size_t>(o.rows * o.dim));
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = std::sin(0.37f * static_cast<float>(i));
    x = Tensor::from_vector(xs, {o.rows, o.dim}, dev);
    for (float& v : xs) v *= 1e-3f;
    dy = Tensor::from_vector(xs, {o.rows, o.dim}, dev);
  }
  for (auto& m : models) {
    m->materialize(dev, 1);
    if (o.dtype == "bf16") {
      m->set_compute_dtype(DType::bf16);
      m->set_activations(nn::Activations::compute);
    }
    time_steps(*m, x, dy, 2);  // warm-up: tapes, plans, caches
  }
  std::vector<double> fused, composed;
  for (int r = 0; r < o.repeat; ++r) {
    fused.push_back(time_steps(*models[0], x, dy, o.steps));
    composed.push_back(time_steps(*models[1], x, dy, o.steps));
  }
  const bench::Estimate f = bench::median_ci(fused), c = bench::median_ci(composed);
  const bench::Estimate ratio = bench::ratio_ci(composed, fused, bench::Pairing::paired);
  std::printf(
      "bench_composed: RMSNorm + SwiGLU, %lld x %lld -> %lld, %s on %s, %d steps x %d "
      "interleaved repeats\n",
      static_cast<long long>(o.rows), static_cast<long long>(o.dim),
      static_cast<long long>(o.hidden), o.dtype.c_str(), o.device.c_str(), o.steps, o.repeat);
  std::printf("  fused     %8.3f ms/step (95%% CI %.3f to %.3f)\n", f.value, f.lo, f.hi);
  std::printf("  composed  %8.3f ms/step (95%% CI %.3f to %.3f)\n", c.value, c.lo, c.hi);
  std::printf("  composed / fused: %s\n", bench::format_ci(ratio, 2).c_str());
  if (!o.json_path.empty()) {
    nlohmann::json j = {{"rows", o.rows},       {"dim", o.dim},         {"hidden", o.hidden},
                        {"dtype", o.dtype},     {"device", o.device},   {"steps", o.steps},
                        {"repeat", o.repeat},   {"fused_ms", fused},    {"composed_ms", composed},
                        {"ratio", ratio.value}, {"ratio_lo", ratio.lo}, {"ratio_hi", ratio.hi}};
    j["program"] = "bench_composed";
    nn::io::write_output_file(o.json_path, j.dump(2) + "\n", "--json");
  }
  return 0;
}

}  // namespace
