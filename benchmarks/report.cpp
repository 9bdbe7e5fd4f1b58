#include "benchmarks/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "kernels/runtime/error.hpp"

namespace bench {

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  double pos = q * static_cast<double>(v.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(pos));
  size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

std::vector<double> slowest_per_step(const std::vector<float>& all, int ranks, int64_t steps) {
  DP_CHECK(ranks >= 1 && steps >= 0 && all.size() == static_cast<size_t>(ranks * steps),
           "slowest_per_step: " << all.size() << " times for " << ranks << " ranks of " << steps
                                << " steps");
  std::vector<double> out(static_cast<size_t>(steps), 0.0);
  for (int r = 0; r < ranks; ++r)
    for (int64_t s = 0; s < steps; ++s)
      out[s] = std::max<double>(out[s], all[static_cast<size_t>(r * steps + s)]);
  return out;
}

double RunResult::step_ms_median() const {
  return percentile(step_ms, 0.5);
}
double RunResult::step_ms_p90() const {
  return percentile(step_ms, 0.9);
}
double RunResult::samples_per_s() const {
  double m = step_ms_median();
  return m > 0 ? static_cast<double>(batch) * 1000.0 / m : 0;
}

int64_t dp_bytes_theory(int n, int64_t p, int64_t g) {
  return static_cast<int64_t>(n - 1) * (p + (g < 0 ? p : g));
}
int64_t ring_bytes_theory(int n, int64_t p) {
  return n <= 1 ? 0 : 2 * static_cast<int64_t>(n - 1) * p / n;
}

std::vector<Link> default_links() {
  return {{"NVLink4", 450e9, 5e-6}, {"PCIe Gen5", 64e9, 10e-6}};
}

double projected_step_s(const std::string& mode, int n, double compute_s, double optimizer_s,
                        int64_t p, const Link& link) {
  double comm = 0;
  if (n > 1) {
    double messages = 2.0 * (n - 1);
    double bytes_per_message = mode == "dp" ? static_cast<double>(p) : static_cast<double>(p) / n;
    comm = messages * (link.alpha_s + bytes_per_message / link.bandwidth_bytes_per_s);
  }
  return compute_s + optimizer_s + comm;
}

bool oversubscribed(const Header& h) {
  return h.device != "cpu" && h.logical > h.physical;
}

namespace {

const RunResult* baseline_of(const std::vector<RunResult>& runs, const std::string& mode) {
  for (auto& r : runs)
    if (r.mode == mode && r.gpus == 1) return &r;
  return nullptr;
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << static_cast<double>(bytes) / (1 << 20);
  return os.str();
}

double phase(const RunResult& r, const char* name) {
  auto it = r.phases_ms.find(name);
  return it == r.phases_ms.end() ? 0 : it->second;
}

}  // namespace

std::optional<double> overhead_us_per_device(const std::vector<RunResult>& runs,
                                             const RunResult& r) {
  const RunResult* base = baseline_of(runs, r.mode);
  if (!base || r.gpus < 2) return std::nullopt;
  return (r.step_ms_median() - base->step_ms_median()) * 1000.0 / r.gpus;
}

void print_table(std::ostream& os, const Header& h, const std::vector<RunResult>& runs) {
  os << "dp_bench: model " << h.model << " (" << h.params << " parameters, " << mib(h.params * 4)
     << " MiB), dtype " << h.dtype << ", device " << h.device << "\n";
  if (h.device == "cpu") {
    os << "note: " << h.logical << " CPU devices share " << h.physical
       << " cores: figures measure engine overhead on one machine, not multi-GPU scaling\n";
  } else if (oversubscribed(h)) {
    os << "note: " << h.logical << " logical GPUs share " << h.physical
       << " physical GPU(s): figures measure ENGINE OVERHEAD, NOT SCALING\n";
  }
  os << std::fixed;
  os << "\n mode  N   batch  step ms (med / p90)   samples/s   speedup  eff.   final loss\n";
  for (auto& r : runs) {
    const RunResult* base = baseline_of(runs, r.mode);
    os << " " << std::left << std::setw(5) << r.mode << std::right << std::setw(2) << r.gpus
       << std::setw(8) << r.batch << std::setw(11) << std::setprecision(2) << r.step_ms_median()
       << " / " << std::setw(7) << r.step_ms_p90() << std::setw(12) << std::setprecision(0)
       << r.samples_per_s();
    if (base && base->step_ms_median() > 0) {
      double speedup = base->step_ms_median() / r.step_ms_median();
      os << std::setw(9) << std::setprecision(2) << speedup << std::setw(6) << std::setprecision(0)
         << 100 * speedup / r.gpus << "%";
    } else {
      os << std::setw(9) << "-" << std::setw(7) << "-";
    }
    os << std::setw(13) << std::setprecision(6) << r.final_loss << "\n";
  }
  os << "\n phases, median ms:\n";
  for (auto& r : runs) {
    os << " " << std::left << std::setw(5) << r.mode << std::right << std::setw(2) << r.gpus << " ";
    for (auto& [name, ms] : r.phases_ms) os << " " << name << " " << std::setprecision(3) << ms;
    if (r.mode == "ddp" && r.gpus > 1)
      os << "  (buckets " << r.buckets << ", " << r.buckets_overlapped
         << " launched while backward ran on)";
    if (r.mode == "dp" && r.gpus > 1)
      os << "  (" << r.reduce << " reduce, buckets " << r.buckets << ", " << r.buckets_overlapped
         << " pulled while backward ran on)";
    os << "\n";
  }
  bool any_overhead = false;
  for (auto& r : runs) any_overhead = any_overhead || overhead_us_per_device(runs, r).has_value();
  if (any_overhead) {
    os << "\n overhead per added device, (t_N - t_1) / N (us):\n";
    for (auto& r : runs)
      if (auto us = overhead_us_per_device(runs, r))
        os << " " << std::left << std::setw(5) << r.mode << std::right << std::setw(2) << r.gpus
           << "   " << std::setprecision(1) << *us << "\n";
  }
  if (h.dtype == "bf16" || h.dtype == "fp16") {
    os << "\n mixed precision (" << h.dtype << " GEMMs and convolutions, f32 master weights):\n";
    for (auto& r : runs)
      os << " " << std::left << std::setw(5) << r.mode << std::right << std::setw(2) << r.gpus
         << "   loss scale " << std::setprecision(0) << r.loss_scale << ", skipped steps "
         << r.skipped_steps << "\n";
  }
  for (auto& r : runs)
    if (r.comm_dtype != "fp32" && r.gpus > 1 && r.param_bytes > 0)
      os << " " << std::left << std::setw(5) << r.mode << std::right << std::setw(2) << r.gpus
         << "   gradients travel in " << r.comm_dtype << ": half the gradient bytes of f32 ("
         << mib(r.param_bytes / 2) << " MiB saved per " << (r.mode == "dp" ? "replica" : "rank")
         << " per step)\n";
  for (auto& r : runs)
    if (r.mode == "ddp") {
      os << "\n DDP step time is the slowest rank's, per step (a synchronous step ends with its "
            "last rank)\n";
      break;
    }
  os << "\n bytes moved per step (MiB): measured vs theory"
        " [DP through device 0: 2(N-1)P; ring all-reduce: 2(N-1)/N P per device]\n";
  for (auto& r : runs) {
    os << " " << std::left << std::setw(5) << r.mode << std::right << std::setw(2) << r.gpus
       << "   " << std::setw(9) << mib(r.bytes_per_step) << " vs " << std::setw(9)
       << mib(r.bytes_theory) << "   peak MiB per device:";
    for (int64_t b : r.peak_mem_bytes) os << " " << mib(b);
    if (!r.link_bytes.empty() && r.gpus > 1) {
      os << "   link MiB per device (in + out, " << r.reduce << "):";
      for (int64_t b : r.link_bytes) os << " " << mib(b);
    }
    os << "\n";
  }
}

void print_sync_bn(std::ostream& os, const std::vector<RunResult>& runs) {
  for (const auto& r : runs) {
    if (r.sync_bn_values == 0 || r.gpus < 2) continue;
    os << " " << std::left << std::setw(5) << r.mode << std::right << std::setw(2) << r.gpus
       << " SyncBatchNorm: " << r.sync_bn_values << " values (" << r.sync_bn_values * 4
       << " bytes as f32) combined per device per step, one exchange per layer and pass"
       << (r.mode == "dp" ? " (through host memory)" : " (all_reduce)") << "\n";
  }
}

void print_memory_model(std::ostream& os, const std::vector<RunResult>& runs) {
  bool header = false;
  for (const auto& r : runs) {
    if (r.optimizer_state_bytes.empty()) continue;
    if (!header) {
      os << "\n optimizer state (MiB) per " << (r.mode == "dp" ? "device" : "rank")
         << ", and the model per rank: params 4P + grads 4P + state KP (/ N under ZeRO-1)\n";
      header = true;
    }
    int64_t p = r.param_bytes / 4;
    int64_t k = r.optim == "adamw" ? 8 : 4;
    int n = r.gpus;
    int64_t state_model = r.zero == 1 ? (k * p + n - 1) / n : k * p;
    os << " " << std::left << std::setw(5) << r.mode << std::right << std::setw(2) << n << " "
       << r.optim << (r.zero ? " zero-1" : "") << ":";
    for (int64_t b : r.optimizer_state_bytes) os << " " << mib(b);
    os << "   model: 4P + 4P + " << k << "P" << (r.zero ? "/" + std::to_string(n) : "") << " = "
       << mib(8 * p + state_model) << " (state " << mib(state_model) << ")\n";
  }
}

namespace {

// The run a mode's projection starts from: its fewest devices (1 when a baseline ran), where
// the per-device compute is least disturbed by devices sharing hardware.
const RunResult* projection_source(const std::vector<RunResult>& runs, const std::string& mode) {
  const RunResult* best = nullptr;
  for (auto& r : runs)
    if (r.mode == mode && (!best || r.gpus < best->gpus)) best = &r;
  return best;
}

}  // namespace

std::vector<Projection> project(const std::vector<RunResult>& runs) {
  std::vector<Projection> out;
  for (const char* mode : {"dp", "ddp"}) {
    const RunResult* r = projection_source(runs, mode);
    if (!r) continue;
    // Measured forward + backward of one device at batch B / n_meas; at N devices each takes
    // B / N rows: compute(N) = compute_meas * n_meas / N (linear in rows).
    double compute_meas_s = (phase(*r, "forward") + phase(*r, "backward")) / 1000.0;
    double opt_s = phase(*r, "optimizer") / 1000.0;
    for (auto& link : default_links())
      for (int n : {4, 8}) {
        Projection p;
        p.mode = mode;
        p.link = link.name;
        p.gpus = n;
        p.source_gpus = r->gpus;
        p.compute_s = compute_meas_s * r->gpus / n;
        p.optimizer_s = opt_s;
        p.param_bytes = r->param_bytes;
        p.step_s = projected_step_s(mode, n, p.compute_s, opt_s, r->param_bytes, link);
        out.push_back(p);
      }
  }
  return out;
}

ProjectionInput projection_input(const Header& h, const std::vector<RunResult>& runs,
                                 const std::string& project_from) {
  ProjectionInput in;
  if (!project_from.empty()) {
    std::ifstream f(project_from);
    DP_CHECK(f, "--project-from '" << project_from << "': cannot read the file");
    nlohmann::json j;
    try {
      f >> j;
      std::string device = j.at("device").get<std::string>();
      if (device == "cpu") {
        in.why_not = "--project-from '" + project_from +
                     "' holds CPU compute; the projection needs a GPU's results file";
        return in;
      }
      for (auto& r : j.at("runs")) in.runs.push_back(run_from_json(r));
      in.source = project_from + " (" + device + ")";
    } catch (const nlohmann::json::exception& e) {
      DP_THROW("--project-from '" << project_from << "': not a dp_bench JSON report (" << e.what()
                                  << ")");
    }
    return in;
  }
  if (h.device == "cpu") {
    in.why_not =
        "the compute was measured on CPU devices, and CPU compute beside NVLink/PCIe figures "
        "is no GPU prediction; run on a GPU, or pass --project-from GPU_RESULTS.json";
    return in;
  }
  in.runs = runs;
  in.source = "measured on " + h.device;
  return in;
}

void print_projection(std::ostream& os, const ProjectionInput& in) {
  if (in.runs.empty()) {
    os << "\n projection to NVLink/PCIe: left out: " << in.why_not << "\n";
    return;
  }
  os << "\n projection to real interconnects (alpha-beta model), compute " << in.source << ":\n"
     << "   compute(N) = (forward + backward measured on n devices) * n / N\n"
        "   DP : t = compute(N) + opt + 2(N-1)(alpha + P/bw)        [star through device 0]\n"
        "   DDP: t = compute(N) + opt + 2(N-1)(alpha + P/(N bw))    [ring, no overlap assumed]\n"
        "   links: NVLink4 450 GB/s each way, alpha 5 us; PCIe Gen5 64 GB/s each way, alpha 10 "
        "us\n";
  for (auto& p : project(in.runs))
    os << "   " << std::left << std::setw(4) << p.mode << std::right << std::setw(10) << p.link
       << " N=" << p.gpus << ": " << std::setprecision(3) << p.step_s * 1000
       << " ms  (from n=" << p.source_gpus << ": compute " << p.compute_s * 1000 << " ms, opt "
       << p.optimizer_s * 1000 << " ms, P " << mib(p.param_bytes) << " MiB)\n";
}

nlohmann::json run_to_json(const RunResult& r) {
  return {{"mode", r.mode},
          {"gpus", r.gpus},
          {"batch", r.batch},
          {"step_ms", r.step_ms},
          {"step_ms_median", r.step_ms_median()},
          {"step_ms_p90", r.step_ms_p90()},
          {"samples_per_s", r.samples_per_s()},
          {"phases_ms", r.phases_ms},
          {"param_bytes", r.param_bytes},
          {"bytes_per_step", r.bytes_per_step},
          {"bytes_theory", r.bytes_theory},
          {"peak_mem_bytes", r.peak_mem_bytes},
          {"losses", r.losses},
          {"final_loss", r.final_loss},
          {"buckets", r.buckets},
          {"buckets_overlapped", r.buckets_overlapped},
          {"reduce", r.reduce},
          {"link_bytes", r.link_bytes},
          {"optim", r.optim},
          {"zero", r.zero},
          {"optimizer_state_bytes", r.optimizer_state_bytes},
          {"sync_bn_values_per_step", r.sync_bn_values},
          {"sync_bn_bytes_per_step", r.sync_bn_values * 4},
          {"loss_scale", r.loss_scale},
          {"skipped_steps", r.skipped_steps},
          {"comm_dtype", r.comm_dtype}};
}

RunResult run_from_json(const nlohmann::json& j) {
  RunResult r;
  r.mode = j.at("mode").get<std::string>();
  r.gpus = j.at("gpus").get<int>();
  r.batch = j.at("batch").get<int64_t>();
  r.step_ms = j.at("step_ms").get<std::vector<double>>();
  r.phases_ms = j.at("phases_ms").get<std::map<std::string, double>>();
  r.param_bytes = j.at("param_bytes").get<int64_t>();
  r.bytes_per_step = j.at("bytes_per_step").get<int64_t>();
  r.bytes_theory = j.at("bytes_theory").get<int64_t>();
  r.peak_mem_bytes = j.at("peak_mem_bytes").get<std::vector<int64_t>>();
  r.losses = j.at("losses").get<std::vector<float>>();
  r.final_loss = j.at("final_loss").get<float>();
  r.buckets = j.value("buckets", 0);
  r.buckets_overlapped = j.value("buckets_overlapped", 0);
  r.reduce = j.value("reduce", std::string());
  r.link_bytes = j.value("link_bytes", std::vector<int64_t>());
  r.optim = j.value("optim", std::string("sgd"));
  r.zero = j.value("zero", 0);
  r.optimizer_state_bytes = j.value("optimizer_state_bytes", std::vector<int64_t>{});
  r.sync_bn_values = j.value("sync_bn_values_per_step", int64_t{0});
  r.loss_scale = j.value("loss_scale", 1.f);
  r.skipped_steps = j.value("skipped_steps", int64_t{0});
  r.comm_dtype = j.value("comm_dtype", std::string("fp32"));
  return r;
}

nlohmann::json to_json(const Header& h, const std::vector<RunResult>& runs,
                       const ProjectionInput& projection) {
  nlohmann::json j = {{"device", h.device},
                      {"physical_devices", h.physical},
                      {"logical_devices", h.logical},
                      {"oversubscribed", oversubscribed(h)},
                      {"model", h.model},
                      {"params", h.params},
                      {"dtype", h.dtype},
                      {"runs", nlohmann::json::array()},
                      {"projection", nlohmann::json::array()},
                      {"projection_source", projection.source},
                      {"projection_left_out", projection.why_not},
                      {"ddp_step_time", "slowest rank per step"}};
  for (auto& p : project(projection.runs))
    j["projection"].push_back({{"mode", p.mode},
                               {"link", p.link},
                               {"gpus", p.gpus},
                               {"from_gpus", p.source_gpus},
                               {"compute_ms", p.compute_s * 1000},
                               {"optimizer_ms", p.optimizer_s * 1000},
                               {"param_bytes", p.param_bytes},
                               {"step_ms", p.step_s * 1000}});
  for (auto& r : runs) {
    nlohmann::json jr = run_to_json(r);
    const RunResult* base = baseline_of(runs, r.mode);
    if (base && r.step_ms_median() > 0) {
      double s = base->step_ms_median() / r.step_ms_median();
      jr["speedup"] = s;
      jr["efficiency"] = s / r.gpus;
    }
    if (auto us = overhead_us_per_device(runs, r)) jr["overhead_us_per_device"] = *us;
    j["runs"].push_back(jr);
  }
  return j;
}

void write_sweep_csv(std::ostream& os, const std::vector<RunResult>& runs) {
  os << "mode,gpus,batch,step_ms_median,step_ms_p90,samples_per_s,speedup,efficiency,"
        "bytes_per_step,bytes_theory,final_loss,overhead_us_per_device\n";
  for (auto& r : runs) {
    const RunResult* base = baseline_of(runs, r.mode);
    double s = base && r.step_ms_median() > 0 ? base->step_ms_median() / r.step_ms_median() : 0;
    os << r.mode << "," << r.gpus << "," << r.batch << "," << r.step_ms_median() << ","
       << r.step_ms_p90() << "," << r.samples_per_s() << "," << s << "," << s / r.gpus << ","
       << r.bytes_per_step << "," << r.bytes_theory << "," << r.final_loss << ",";
    if (auto us = overhead_us_per_device(runs, r)) os << *us;
    os << "\n";
  }
}

nlohmann::json chrome_trace(
    const std::vector<std::pair<std::string, std::vector<dp::TraceEvent>>>& runs) {
  nlohmann::json events = nlohmann::json::array();
  int pid = 0;
  for (auto& [name, evs] : runs) {
    events.push_back(
        {{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", name}}}});
    std::vector<int> tracks;
    for (auto& e : evs) {
      if (std::find(tracks.begin(), tracks.end(), e.track) == tracks.end()) {
        tracks.push_back(e.track);
        events.push_back({{"name", "thread_name"},
                          {"ph", "M"},
                          {"pid", pid},
                          {"tid", e.track},
                          {"args", {{"name", "device " + std::to_string(e.track)}}}});
      }
      nlohmann::json slice = {{"name", e.name}, {"ph", "X"},        {"pid", pid},
                              {"tid", e.track}, {"ts", e.begin_us}, {"dur", e.duration_us}};
      if (e.step >= 0) slice["args"] = nlohmann::json::object({{"step", e.step}});
      events.push_back(slice);
    }
    ++pid;
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

}  // namespace bench
