// dp_bench --mode ps: the asynchronous parameter server beside synchronous DP, on the same
// devices, model, data and samples. DP trains global batches of B rows (chunks of B/N per
// device); each PS worker trains batches of B/N rows, so both see the same rows per device
// and the same samples in all, and differ in how updates are made: one synchronous update per
// B rows (DP) against one update per B/N rows, applied as they arrive (PS).
#include "benchmarks/ps_run.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dp/cli/cli.hpp"
#include "dp/data/loader.hpp"
#include "dp/data_parallel.hpp"
#include "dp/parameter_server.hpp"
#include "nn/nn.hpp"

namespace bench {

namespace {

using Clock = std::chrono::steady_clock;

struct CurvePoint {
  double t_ms = 0;
  int64_t samples = 0;
  float loss = 0;
};

// The loss at the first point that has seen at least `samples`, averaged over `window` points
// ending there (PS losses are per small batch: the window smooths them to DP's batch).
float loss_at(const std::vector<CurvePoint>& c, int64_t samples, int window) {
  size_t i = 0;
  while (i + 1 < c.size() && c[i].samples < samples) ++i;
  size_t lo = i + 1 >= static_cast<size_t>(window) ? i + 1 - window : 0;
  double sum = 0;
  for (size_t k = lo; k <= i; ++k) sum += c[k].loss;
  return static_cast<float>(sum / static_cast<double>(i - lo + 1));
}

nlohmann::json curve_json(const std::vector<CurvePoint>& c) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& p : c) j.push_back({{"t_ms", p.t_ms}, {"samples", p.samples}, {"loss", p.loss}});
  return j;
}

}  // namespace

int run_ps_mode(const Options& o, const Setup& s) {
  const int n = s.gpus;
  const int64_t batch = global_batch(o, n);
  const int64_t per_worker = batch / n;
  DP_CHECK(per_worker >= 1, "--mode ps: the global batch " << batch << " gives " << n
                                                           << " workers no rows; use at least "
                                                           << n);
  const int steps = o.steps + o.warmup;
  const auto data = bench_dataset(o, batch);
  auto devices = kernels::make_devices(s.type, n);

  // Synchronous DP: `steps` global batches.
  std::vector<CurvePoint> dp_curve;
  double dp_seconds = 0;
  {
    auto model = make_model(o.model);
    model->materialize(devices[0], o.seed);
    nn::SGD opt(*model, optimizer_config());
    dp::DataParallelOptions dopt;
    dopt.math = s.math;
    dp::DataParallel engine(model, opt, devices, dopt);
    auto t0 = Clock::now();
    auto bar = progress_line("dp N=" + std::to_string(n), steps);
    for (int step = 0; step < steps; ++step) {
      auto b = dp::data::make_batch(data, step * batch, batch);
      float loss = engine.train_step(b.images, b.labels).loss;
      double t = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      dp_curve.push_back({t, (step + 1) * batch, loss});
      bar->update(step + 1);
    }
    dp_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // Asynchronous PS: the same rows, in batches of B/N.
  auto model = make_model(o.model);
  model->materialize(devices[0], o.seed);
  nn::SGD opt(*model, optimizer_config());
  dp::PsOptions popt;
  popt.max_staleness = o.max_staleness;
  popt.lr = o.scale_lr ? dp::PsOptions::StalenessLr::scaled : dp::PsOptions::StalenessLr::constant;
  dp::ParameterServer server(model, opt, devices, popt);
  const int64_t n_batches = steps * batch / per_worker;
  auto batch_fn = [&](int64_t k) {
    auto b = dp::data::make_batch(data, k * per_worker, per_worker);
    return std::make_pair(b.images, b.labels);
  };
  dp::Trace trace;
  dp::PsReport r = server.run(batch_fn, 0, n_batches, o.trace_path.empty() ? nullptr : &trace);
  std::vector<CurvePoint> ps_curve;
  int64_t seen = 0;
  for (const auto& u : r.updates) {
    seen += u.samples;
    ps_curve.push_back({u.end_ms, seen, u.loss});
  }

  // Report.
  int64_t total = steps * batch;
  double ps_rate = total / r.seconds, dp_rate = total / dp_seconds;
  double mean_stale = 0;
  int64_t max_stale = static_cast<int64_t>(r.staleness_histogram.size()) - 1;
  for (size_t k = 0; k < r.staleness_histogram.size(); ++k)
    mean_stale += static_cast<double>(k) * r.staleness_histogram[k];
  mean_stale /= std::max<int64_t>(1, r.pushes);
  std::printf(
      "dp_bench --mode ps: %s, %d x %s, %lld samples (DP: %d steps of %lld; PS: %lld "
      "updates of %lld), max staleness %s%s\n",
      o.model.c_str(), n, s.type == kernels::DeviceType::cuda ? "cuda" : "cpu",
      static_cast<long long>(total), steps, static_cast<long long>(batch),
      static_cast<long long>(r.pushes), static_cast<long long>(per_worker),
      o.max_staleness < 0 ? "unbounded" : std::to_string(o.max_staleness).c_str(),
      o.scale_lr ? ", lr / (1 + staleness)" : "");
  const Header header = make_header(o, s, n);
  {
    std::ostringstream env;  // what the figures rest on, as every report says it
    print_environment(env, header);
    std::fputs(env.str().c_str(), stdout);
  }
  if (s.type == kernels::DeviceType::cpu)
    std::printf(
        "note: CPU devices share this machine's cores: figures measure the engines' "
        "overhead and update pattern, not scaling\n");
  std::printf("%-4s %12s %12s %12s %14s\n", "mode", "seconds", "samples/s", "updates/s",
              "final loss");
  int window = static_cast<int>(batch / per_worker);
  std::printf("%-4s %12.3f %12.0f %12.1f %14.5f\n", "dp", dp_seconds, dp_rate, steps / dp_seconds,
              dp_curve.back().loss);
  std::printf("%-4s %12.3f %12.0f %12.1f %14.5f  (mean of the last %d updates)\n", "ps", r.seconds,
              ps_rate, r.pushes / r.seconds, loss_at(ps_curve, total, window), window);
  std::printf("ps staleness: mean %.2f, max %lld; histogram", mean_stale,
              static_cast<long long>(max_stale));
  for (size_t k = 0; k < r.staleness_histogram.size(); ++k)
    if (r.staleness_histogram[k])
      std::printf(" %zu:%lld", k, static_cast<long long>(r.staleness_histogram[k]));
  std::printf("\nloss against samples seen (PS: mean of %d updates):\n%12s %10s %10s\n", window,
              "samples", "dp", "ps");
  for (int q = 1; q <= 4; ++q) {
    int64_t at = total * q / 4;
    std::printf("%12lld %10.5f %10.5f\n", static_cast<long long>(at), loss_at(dp_curve, at, 1),
                loss_at(ps_curve, at, window));
  }
  std::printf("pushes per worker:");
  for (int64_t c : r.pushes_per_worker) std::printf(" %lld", static_cast<long long>(c));
  std::printf("\n");

  if (!o.json_path.empty()) {
    nlohmann::json j = {{"program", "dp_bench"},
                        {"mode", "ps"},
                        {"model", o.model},
                        {"devices", n},
                        {"device", s.type == kernels::DeviceType::cuda ? "cuda" : "cpu"},
                        {"samples", total},
                        {"max_staleness", o.max_staleness},
                        {"environment", environment_json(header)},
                        {"dp",
                         {{"seconds", dp_seconds},
                          {"samples_per_s", dp_rate},
                          {"updates", steps},
                          {"final_loss", dp_curve.back().loss},
                          {"curve", curve_json(dp_curve)}}},
                        {"ps",
                         {{"seconds", r.seconds},
                          {"samples_per_s", ps_rate},
                          {"updates_per_s", r.pushes / r.seconds},
                          {"updates", r.pushes},
                          {"final_loss", loss_at(ps_curve, total, window)},
                          {"staleness_histogram", r.staleness_histogram},
                          {"staleness_mean", mean_stale},
                          {"pushes_per_worker", r.pushes_per_worker},
                          {"curve", curve_json(ps_curve)}}}};
    dp::cli::write_output("--json", o.json_path, j.dump(2) + "\n");
  }
  if (!o.trace_path.empty()) {
    dp::TracedRun run{"ps N=" + std::to_string(n), trace.events(), {}};
    for (int w = 0; w <= n; ++w)
      run.track_names[w] = w < n ? "worker " + std::to_string(w) : "server";
    dp::write_chrome_trace(o.trace_path, {run}, "--trace");
  }
  return 0;
}

}  // namespace bench
