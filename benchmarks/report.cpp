#include "benchmarks/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include "kernels/runtime/error.hpp"
#include "nn/file_io.hpp"

namespace bench {

void median_step_phases(RunResult& r, const std::map<std::string, std::vector<double>>& phases,
                        const std::vector<std::string>& additive) {
  const size_t steps = r.step_ms.size();
  if (phases.empty() || steps == 0) return;
  std::vector<size_t> order(steps);
  for (size_t i = 0; i < steps; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return r.step_ms[a] < r.step_ms[b] || (r.step_ms[a] == r.step_ms[b] && a < b);
  });
  const size_t k = order[(steps - 1) / 2];
  r.phases_ms.clear();
  double sum = 0;
  for (const auto& [name, v] : phases) {
    if (v.size() != steps) continue;  // not timed at every step: no value for this one
    r.phases_ms[name] = v[k];
    if (std::find(additive.begin(), additive.end(), name) != additive.end()) sum += v[k];
  }
  r.phases_step_ms = r.step_ms[k];
  r.phases_ms["other"] = r.step_ms[k] - sum;
}

RunResult combine_repeats(std::vector<RunResult> repeats) {
  DP_CHECK(!repeats.empty(), "combine_repeats: no repeats");
  if (repeats.size() == 1) {
    RunResult out = std::move(repeats.front());
    out.repeat_ms = {median(out.step_ms)};
    return out;
  }
  std::vector<double> medians;
  std::vector<size_t> order;
  for (size_t k = 0; k < repeats.size(); ++k) {
    const RunResult& r = repeats[k];
    DP_CHECK(r.mode == repeats[0].mode && r.gpus == repeats[0].gpus && !r.step_ms.empty(),
             "combine_repeats: repeat " << k + 1 << " is " << r.mode << " N=" << r.gpus << " with "
                                        << r.step_ms.size() << " steps, repeat 1 "
                                        << repeats[0].mode << " N=" << repeats[0].gpus);
    medians.push_back(median(r.step_ms));
    order.push_back(k);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return medians[a] < medians[b]; });
  const size_t pick = order[(order.size() - 1) / 2];
  RunResult out = std::move(repeats[pick]);
  out.repeat_ms = std::move(medians);
  out.from_repeat = static_cast<int>(pick) + 1;
  return out;
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
  return repeat_ms.size() >= 2 ? median(repeat_ms) : median(step_ms);
}
double RunResult::step_ms_p90() const {
  return percentile(step_ms, 0.9);
}
double RunResult::samples_per_s() const {
  double m = step_ms_median();
  return m > 0 ? static_cast<double>(batch) * 1000.0 / m : 0;
}

int64_t dp_bytes_theory(int n, int64_t p, int64_t g, int64_t c, int64_t s) {
  return static_cast<int64_t>(n - 1) * (p - s + c + (g < 0 ? p : g));
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

double tokens_per_s(const Header& h, const RunResult& r) {
  return r.samples_per_s() * static_cast<double>(h.tokens_per_sample);
}

namespace {
// FLOPs per token at tokens_per_s over the peak of the hardware the run used.
double utilisation(const Header& h, const RunResult& r, double flops_per_token) {
  const int hardware = h.device == "cpu" ? 1 : std::max(1, std::min(r.gpus, h.physical));
  const double peak = h.peak_tflops * 1e12 * hardware;
  return peak > 0 ? flops_per_token * tokens_per_s(h, r) / peak : 0;
}
}  // namespace

double mfu(const Header& h, const RunResult& r) {
  return utilisation(h, r, h.flops_per_token);
}

double hfu(const Header& h, const RunResult& r) {
  return utilisation(h, r, h.flops_per_token + h.recompute_flops_per_token);
}

bool time_sliced(const Header& h, int n) {
  return n > 1 && (h.device == "cpu" || n > h.physical);
}

std::string time_sliced_label(const Header& h, const std::string& mode, int n) {
  if (!time_sliced(h, n)) return "";
  if ((mode == "ddp" || mode == "hook") && h.device != "cpu")
    return "correctness only: ranks time-slice one GPU through host staging";
  return "time-sliced: overhead, not scaling";
}

namespace {

// A run of DDP's ranks: with the built-in all-reduce ("ddp") or a comm hook ("hook").
bool ddp_ranks(const RunResult& r) {
  return r.mode == "ddp" || r.mode == "hook";
}

// The width of the tables' mode column: 5, or the longest mode's ("hybrid-hook").
int mode_width(const std::vector<RunResult>& runs) {
  size_t w = 5;
  for (const RunResult& r : runs) w = std::max(w, r.mode.size());
  return static_cast<int>(w);
}

// A table row's first cells, " mode N", the mode padded to mode_width: os << ModeCell{runs, r}.
struct ModeCell {
  const std::vector<RunResult>& runs;
  const RunResult& r;
};
std::ostream& operator<<(std::ostream& os, const ModeCell& c) {
  return os << " " << std::left << std::setw(mode_width(c.runs)) << c.r.mode << std::right
            << std::setw(2) << c.r.gpus;
}

// A run of DP's device threads: with the sums to device 0 ("dp") or a comm hook ("dp-hook").
bool dp_threads(const RunResult& r) {
  return r.mode == "dp" || r.mode == "dp-hook";
}

// A run of hybrid's node processes: with the built-in sum over nodes or a comm hook.
bool hybrid_nodes(const RunResult& r) {
  return r.mode == "hybrid" || r.mode == "hybrid-hook";
}

// A comm hook's runs: the mode of their rows, the built-in run they stand beside, and what the
// hook replaces there.
struct HookRuns {
  const char* mode;
  const char* baseline;
  const char* engine;
  const char* replaces;
  const char* bytes;  // what the bytes line compares
};
constexpr HookRuns kHookRuns[] = {
    {"dp-hook", "dp", "DP",
     "the sums to device 0, over an in-process group of its devices (the same model, data and "
     "devices)",
     "bytes moved per step (the weights' copies, and the gradients: the hook's or the sums')"},
    {"hook", "ddp", "DDP", "the bucket all-reduce (the same model, data and ranks)",
     "bytes handed to the group per step"},
    {"hybrid-hook", "hybrid", "hybrid", "the sum over nodes (the same model, data and nodes)",
     "bytes handed to the group per step"}};

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

// The phases as printed. A replayed step's marks sit between its captured segments, so most of
// a graphed run's steps time forward and backward as one (its "backward" reads 0), DP's reduce
// with the optimizer step, and DDP's bucket all-reduces held by the graph with backward: those
// are printed merged, their names joined by "+".
std::vector<std::pair<std::string, double>> shown_phases(const RunResult& r) {
  std::map<std::string, double> shown = r.phases_ms;
  auto merge = [&](std::vector<std::string> names, const std::string& as) {
    double sum = 0;
    for (const std::string& name : names) {
      auto it = shown.find(name);
      if (it == shown.end()) return;
      sum += it->second;
    }
    for (const std::string& name : names) shown.erase(name);
    shown[as] = sum;
  };
  if (2 * static_cast<size_t>(r.graphed_steps) > r.step_ms.size()) {
    if (r.graph_collectives == "in graph")
      merge({"forward", "backward", "allreduce_exposed"}, "forward+backward+allreduce");
    merge({"forward", "backward"}, "forward+backward");
    if (r.mode == "dp") merge({"reduce", "optimizer"}, "reduce+optimizer");
  }
  return {shown.begin(), shown.end()};
}

}  // namespace

std::optional<double> overhead_us_per_device(const std::vector<RunResult>& runs,
                                             const RunResult& r) {
  const RunResult* base = baseline_of(runs, r.mode);
  if (!base || r.gpus < 2) return std::nullopt;
  return (r.step_ms_median() - base->step_ms_median()) * 1000.0 / r.gpus;
}

namespace {

// The samples a run's estimates come from: its repeats' medians, else its steps.
const std::vector<double>& samples_of(const RunResult& r) {
  return r.repeat_ms.size() >= 2 ? r.repeat_ms : r.step_ms;
}

// Repeat k of two runs ran back to back: paired. Steps of two runs are not.
Pairing pairing_of(const RunResult& a, const RunResult& b) {
  return a.repeat_ms.size() >= 2 && a.repeat_ms.size() == b.repeat_ms.size() ? Pairing::paired
                                                                             : Pairing::independent;
}

}  // namespace

Estimate step_estimate(const RunResult& r) {
  return median_ci(samples_of(r));
}

namespace {

// The 1-device run `r` is compared with, when both have samples and r has N > 1.
const RunResult* comparable_base(const std::vector<RunResult>& runs, const RunResult& r) {
  const RunResult* base = baseline_of(runs, r.mode);
  return base && r.gpus > 1 && !samples_of(r).empty() && !samples_of(*base).empty() ? base
                                                                                    : nullptr;
}

}  // namespace

std::optional<Estimate> ratio_to_one(const std::vector<RunResult>& runs, const RunResult& r) {
  const RunResult* base = comparable_base(runs, r);
  if (!base) return std::nullopt;
  return ratio_ci(samples_of(r), samples_of(*base), pairing_of(r, *base));
}

// Its value is overhead_us_per_device's: the same medians of the same samples.
std::optional<Estimate> overhead_ci(const std::vector<RunResult>& runs, const RunResult& r) {
  const RunResult* base = comparable_base(runs, r);
  if (!base) return std::nullopt;
  return difference_ci(samples_of(r), samples_of(*base), 1000.0 / r.gpus, pairing_of(r, *base));
}

std::string describe(const Estimate& e, double null_value, int digits) {
  if (e.contains(null_value)) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "within noise (95%% CI %.*f to %.*f)", digits, e.lo, digits,
                  e.hi);
    return buf;
  }
  return format_ci(e, digits);
}

namespace {

// Exposed communication of a run (ms): DP's scatter, replicate and the reduce not hidden by
// backward; DDP's all-reduce wait.
double communication_ms(const RunResult& r) {
  if (ddp_ranks(r)) return phase(r, "allreduce_exposed");
  return phase(r, "scatter") + phase(r, "replicate") + phase(r, "reduce");
}

const RunResult* largest_of(const std::vector<RunResult>& runs, const std::string& mode, int n) {
  for (auto& r : runs)
    if (r.mode == mode && r.gpus == n) return &r;
  return nullptr;
}

}  // namespace

std::string verdict(const Header& h, const std::vector<RunResult>& runs) {
  int n = 0;
  for (auto& r : runs)
    if (r.mode == "dp" && largest_of(runs, "ddp", r.gpus)) n = std::max(n, r.gpus);
  if (n == 0) return "";
  const RunResult& dp = *largest_of(runs, "dp", n);
  const RunResult& ddp = *largest_of(runs, "ddp", n);
  if (samples_of(dp).empty() || samples_of(ddp).empty()) return "";
  std::ostringstream os;
  os << std::fixed << h.model << ", batch " << dp.batch << ", " << n
     << (n == 1 ? " device" : " devices") << " here";
  if (time_sliced(h, n)) os << " (time-sliced)";
  os << ": ";
  // t_DP / t_DDP: above 1, DDP is faster.
  Estimate e = ratio_ci(samples_of(dp), samples_of(ddp), pairing_of(dp, ddp));
  if (e.contains(1.0)) {
    os << "DP and DDP are within noise of each other (t_DP / t_DDP " << describe(e, 1.0, 2) << ")";
    return os.str();
  }
  const bool ddp_wins = e.value > 1;
  const RunResult& slow = ddp_wins ? dp : ddp;
  const RunResult& fast = ddp_wins ? ddp : dp;
  Estimate speed = ddp_wins ? e : Estimate{1 / e.value, 1 / e.hi, 1 / e.lo, e.samples};
  os << std::setprecision(2) << (ddp_wins ? "DDP" : "DP") << " is " << speed.value
     << "x faster than " << (ddp_wins ? "DP" : "DDP");
  if (speed.has_interval())
    os << " (95% CI " << speed.lo << " to " << speed.hi << ")";
  else
    os << " (95% CI n/a: one step; give --steps 2 or more)";
  // Where the slower one loses: the phase group with the largest gap in the phases of the two
  // median steps, and its share of their whole gap.
  if (slow.phases_ms.empty() || fast.phases_ms.empty()) return os.str();
  const double compute_gap = (phase(slow, "forward") + phase(slow, "backward")) -
                             (phase(fast, "forward") + phase(fast, "backward"));
  const double comm_gap = communication_ms(slow) - communication_ms(fast);
  const double opt_gap = phase(slow, "optimizer") - phase(fast, "optimizer");
  const double other_gap = phase(slow, "other") - phase(fast, "other");
  const double whole = slow.phases_step_ms - fast.phases_step_ms;
  const double largest = std::max({compute_gap, comm_gap, opt_gap, other_gap});
  const char* loser = ddp_wins ? "DP" : "DDP";
  os << "; " << loser << " loses most in ";
  std::string next;  // what to try, where the figures point at something
  if (largest == comm_gap) {
    os << "communication (" << communication_ms(slow) << " ms exposed";
    next = ddp_wins ? "--dp-reduce tree, --comm-dtype bf16, or DDP"
                    : "a larger --bucket-cap-mb or --first-bucket-mb, or --comm-dtype bf16";
  } else if (largest == compute_gap) {
    os << "forward + backward"
       << (slow.graph_collectives == "in graph" ? " with its bucket all-reduces (one graph)" : "")
       << " (+" << compute_gap << " ms";
    if (time_sliced(h, n)) next = "fewer --gpus: the devices share the hardware";
  } else if (largest == opt_gap) {
    os << "the optimizer step (+" << opt_gap << " ms";
    if (!ddp_wins) next = "--zero 1 (each rank steps a shard)";
  } else {
    os << "the rest of the step: waiting for the slowest device or rank, and host work (+"
       << other_gap << " ms";
    next = time_sliced(h, n) ? "fewer --gpus: the devices share the hardware"
                             : "--cuda-graphs on (GPUs), or a larger batch";
  }
  os << " of the " << whole << " ms between the median steps)";
  if (!next.empty()) os << "; try " << next;
  return os.str();
}

void print_environment(std::ostream& os, const Header& h) {
  if (!h.libraries.empty()) {
    os << "libraries:";
    for (size_t i = 0; i < h.libraries.size(); ++i)
      os << (i ? ";" : "") << " " << h.libraries[i].first << " " << h.libraries[i].second;
    os << "\n";
  }
  if (!h.cpu_gemm_warning.empty()) os << "warning: " << h.cpu_gemm_warning << "\n";
  if (h.cuda_dgelu == "epilogue")
    os << "note: DP_CUDA_DGELU=epilogue: the GELU backward GEMMs run cuBLASLt's DGELU_BGRAD "
          "epilogue where it has an algorithm, not the GEMM, gelu_tanh_backward and "
          "bias_backward\n";
}

nlohmann::json environment_json(const Header& h) {
  nlohmann::json env = {{"libraries", nlohmann::json::object()}};
  for (auto& [name, version] : h.libraries) env["libraries"][name] = version;
  if (!h.cpu_gemm_kernels.empty())
    env["cpu_gemm"] = {{"kernels", h.cpu_gemm_kernels},
                       {"chosen_over", h.cpu_gemm_chosen_over},
                       {"generic", h.cpu_gemm_generic},
                       {"warning", h.cpu_gemm_warning},
                       {"bf16", h.cpu_gemm_bf16}};
  if (!h.cuda_dgelu.empty()) env["cuda_dgelu"] = h.cuda_dgelu;
  return env;
}

void print_table(std::ostream& os, const Header& h, const std::vector<RunResult>& runs) {
  os << "dp_bench: model " << h.model << " (" << h.params << " parameters, " << mib(h.params * 4)
     << " MiB), dtype " << h.dtype << ", device " << h.device << "\n";
  print_environment(os, h);
  if (h.device == "cpu") {
    os << "note: " << h.logical << " CPU devices share " << h.physical
       << " cores: figures measure engine overhead on one machine, not multi-GPU scaling\n";
  } else if (oversubscribed(h)) {
    os << "note: " << h.logical << " logical GPUs share " << h.physical
       << " physical GPU(s): figures measure ENGINE OVERHEAD, NOT SCALING\n";
  }
  const int repeats = runs.empty() ? 1 : std::max<int>(1, runs[0].repeat_ms.size());
  os << "step times: "
     << (repeats >= 2 ? "median of " + std::to_string(repeats) +
                            " interleaved repeats' medians, 95% bootstrap CI "
                            "over the repeats; p90, phases, losses and bytes are the median "
                            "repeat's"
                      : std::string("one run, 95% bootstrap CI over its steps "
                                    "(run-to-run noise is larger: --repeat 5)"))
     << "\n";
  os << std::fixed;
  os << "\n " << std::left << std::setw(mode_width(runs)) << "mode" << std::right
     << " N   batch  step ms median (95% CI)       p90   samples/s  speedup  eff.   final loss\n";
  for (auto& r : runs) {
    const RunResult* base = baseline_of(runs, r.mode);
    Estimate e = step_estimate(r);
    std::ostringstream ci;
    ci << std::fixed << std::setprecision(3) << e.value;
    if (e.has_interval())
      ci << " (" << e.lo << "-" << e.hi << ")";
    else
      ci << " (n/a: 1 step)";
    os << ModeCell{runs, r} << std::setw(8) << r.batch << "  " << std::left << std::setw(27)
       << ci.str() << std::right << std::setw(8) << std::setprecision(3) << r.step_ms_p90()
       << std::setw(12) << std::setprecision(0) << r.samples_per_s();
    if (base && base->step_ms_median() > 0 && !time_sliced(h, r.gpus)) {
      double speedup = base->step_ms_median() / r.step_ms_median();
      os << std::setw(9) << std::setprecision(2) << speedup << std::setw(6) << std::setprecision(0)
         << 100 * speedup / r.gpus << "%";
    } else {
      os << std::setw(9) << "-" << std::setw(7) << "-";
    }
    os << std::setw(13) << std::setprecision(6) << r.final_loss;
    if (noisy(r.step_ms)) os << "  NOISY (p90 > 1.5x median)";
    if (std::string label = time_sliced_label(h, r.mode, r.gpus); !label.empty())
      os << "  [" << label << "]";
    os << "\n";
  }
  os << "\n phases of the median step, ms (other: the rest of it, so that they add up to the "
        "step; DP's are device 0's, the critical path: its reduce includes waiting for the "
        "slowest device)";
  if (std::any_of(runs.begin(), runs.end(), [](const RunResult& r) { return r.graphed_steps > 0; }))
    os << " (graphed steps time a captured segment's phases together, printed joined by +)";
  os << ":\n";
  for (auto& r : runs) {
    os << ModeCell{runs, r} << " ";
    for (auto& [name, ms] : shown_phases(r))
      if (name != "other" && name != "reduce_in_backward")
        os << " " << name << " " << std::setprecision(3) << ms;
    if (r.phases_ms.count("reduce_in_backward"))  // a part of backward, not added
      os << " (of which reduce_in_backward " << std::setprecision(3)
         << r.phases_ms.at("reduce_in_backward") << ")";
    if (r.phases_ms.count("other"))
      os << " other " << std::setprecision(3) << r.phases_ms.at("other") << " = step "
         << r.phases_step_ms;
    if (r.phases_ms.empty()) os << " not timed (--phase-times off)";
    if (ddp_ranks(r) && r.gpus > 1)
      os << "  (buckets " << r.buckets << ", " << r.buckets_overlapped
         << " launched while backward ran on)";
    if (r.mode == "dp-hook" && r.gpus > 1)
      os << "  (comm hook " << r.comm_hook << ", buckets " << r.buckets << ")";
    if (r.mode == "dp" && r.gpus > 1)
      os << "  (" << r.reduce << " reduce"
         << (r.peer_reads == "off" ? ", staged (--dp-peer-reads off)" : "") << ", buckets "
         << r.buckets << ", " << r.buckets_overlapped << " pulled while backward ran on"
         << (r.pulls_beside_backward > 0
                 ? ", " + std::to_string(r.pulls_beside_backward) + " pulls on a comm stream"
                 : std::string())
         << (r.graphed_steps > 0 && r.buckets_overlapped == 0
                 ? "; graphed: summed after backward, --cuda-graphs off overlaps them" +
                       std::string(r.graph_pulls == "after" ? " (GPUs: --dp-graph-pulls beside too)"
                                                            : "")
                 : "")
         << ")";
    os << "\n";
  }
  if (h.tokens_per_sample > 0) {
    os << "\n tokens/s and MFU (" << std::setprecision(3) << h.flops_per_token / 1e6
       << " MFLOP per token = 6 P + 12 L T D; peak " << std::setprecision(2) << h.peak_tflops
       << " TFLOP/s per " << (h.device == "cpu" ? "CPU" : "GPU") << ", " << h.peak_source << "):\n";
    if (h.recompute_flops_per_token > 0)
      os << " (--recompute runs the blocks' forward again: " << std::setprecision(3)
         << h.recompute_flops_per_token / 1e6
         << " MFLOP per token more, 2 P_blocks + 4 L T D, which HFU counts and MFU does not)\n";
    for (auto& r : runs) {
      os << ModeCell{runs, r} << "   " << std::setprecision(0) << tokens_per_s(h, r)
         << " tokens/s, MFU " << std::setprecision(2) << 100 * mfu(h, r) << "%";
      if (h.recompute_flops_per_token > 0) os << ", HFU " << 100 * hfu(h, r) << "%";
      os << (r.attention.empty() ? "" : ", attention: " + r.attention) << "\n";
    }
  }
  bool any_overhead = false;
  for (auto& r : runs) any_overhead = any_overhead || overhead_ci(runs, r).has_value();
  if (any_overhead) {
    os << "\n against 1 device: t_N / t_1, and the overhead per device (t_N - t_1) / N (not / (N - "
          "1)) in us:\n";
    for (auto& r : runs)
      if (auto us = overhead_ci(runs, r)) {
        os << ModeCell{runs, r} << "   t_N / t_1 " << describe(*ratio_to_one(runs, r), 1.0, 2)
           << ";  overhead " << describe(*us, 0.0, 1) << " us\n";
      }
  }
  os << "\n replay, per step after warm-up (median): allocations and host syncs (goal 0 and 1), "
        "dtype casts\n";
  for (auto& r : runs)
    os << ModeCell{runs, r} << "   allocations " << std::setprecision(0) << r.allocations_per_step
       << ", host syncs " << r.host_syncs_per_step << ", casts " << r.casts_per_step
       << (r.graphed_steps > 0
               ? ", graphed steps " + std::to_string(r.graphed_steps) + ", graph nodes per step " +
                     std::to_string(std::lround(r.graph_nodes_per_step))
               : "")
       << (r.graph_collectives.empty() ? "" : ", all-reduces " + r.graph_collectives) << "\n";
  for (auto& r : runs) {
    if (r.capture_step >= 0)
      os << ModeCell{runs, r} << "   capture (step " << r.capture_step << "): allocations "
         << r.capture_allocations << ", peak " << std::setprecision(3)
         << r.capture_peak_bytes / 1048576.0 << " MiB against the eager step's "
         << r.eager_peak_bytes / 1048576.0 << " MiB\n";
    if (!r.graphs_fallback.empty())
      os << ModeCell{runs, r} << "   graphs off: " << r.graphs_fallback
         << " (the run went on uncaptured)\n";
  }
  if (h.dtype == "bf16" || h.dtype == "fp16") {
    os << "\n mixed precision (" << h.dtype << " GEMMs and convolutions, f32 master weights):\n";
    for (auto& r : runs)
      os << ModeCell{runs, r} << "   loss scale " << std::setprecision(0) << r.loss_scale
         << ", skipped steps " << r.skipped_steps << "\n";
  }
  for (auto& r : runs)
    if (r.micro_batches > 1) {
      const char* holder = ddp_ranks(r) ? "rank" : "device";
      os << ModeCell{runs, r} << "   " << r.micro_batches_run << " micro-batches per " << holder
         << " and step: their gradients summed before one reduction and update";
      if (r.micro_batches_run < r.micro_batches)
        os << " (" << r.micro_batches << " asked: a " << holder << "'s chunk has at most "
           << r.micro_batches_run << (r.micro_batches_run == 1 ? " row)" : " rows)");
      os << "\n";
    }
  for (auto& r : runs)
    if (r.comm_dtype != "fp32" && r.gpus > 1 && r.param_bytes > 0)
      os << ModeCell{runs, r} << "   gradients travel in " << r.comm_dtype
         << ": half the gradient bytes of f32 (" << mib(r.param_bytes / 2) << " MiB saved per "
         << (r.mode == "dp" ? "replica" : "rank") << " per step)\n";
  for (const HookRuns& k : kHookRuns) {  // per kind of hook run: what it is, then its rows
    bool said = false;
    for (auto& r : runs) {
      if (r.mode != k.mode) continue;
      if (!said) {
        os << "\n " << k.mode << ": " << k.engine << " with the workload's comm hook "
           << r.comm_hook << " in place of " << k.replaces << "; against " << k.engine
           << " at the same N:\n";
        said = true;
      }
      const RunResult* d = largest_of(runs, k.baseline, r.gpus);
      if (!d) continue;
      os << " " << r.mode << " " << std::setw(2) << r.gpus << "   " << k.bytes << " "
         << r.bytes_per_step << " against " << d->bytes_per_step;
      if (r.bytes_per_step > 0 && d->bytes_per_step > 0)
        os << " (" << std::setprecision(1)
           << static_cast<double>(d->bytes_per_step) / static_cast<double>(r.bytes_per_step)
           << "x fewer)";
      if (!samples_of(r).empty() && !samples_of(*d).empty())
        os << ", step time x "
           << describe(ratio_ci(samples_of(r), samples_of(*d), pairing_of(r, *d)), 1.0, 2);
      os << ", final loss " << std::setprecision(6) << r.final_loss << " against " << d->final_loss
         << "\n";
    }
  }
  for (auto& r : runs)
    if (ddp_ranks(r)) {
      os << "\n DDP step time is the slowest rank's, per step (a synchronous step ends with its "
            "last rank)\n";
      break;
    }
  os << "\n bytes per step (MiB). DP: counted copies vs the model 2(N-1)P through device 0 "
        "(mixed precision: (N-1)(P - S + P/2 + G), the 16-bit weights sent and not the f32 S of "
        "those read through them alone; G the gradients in the comm dtype). DDP: "
        "payload counted by the process group vs the ring model's wire bytes per rank, "
        "2(N-1)/N x payload (ZeRO-1: 2(N-1)/N P, or overlapped the buckets' 2(N-1)/N and the "
        "all-gather's (N-1)/N P)\n";
  for (auto& r : runs) {
    os << ModeCell{runs, r} << "   " << (dp_threads(r) ? "copied " : "payload ") << std::setw(9)
       << mib(r.bytes_per_step) << " (counted" << (hybrid_nodes(r) ? ", across nodes)" : ")")
       << "   model " << std::setw(9) << mib(r.bytes_theory)
       << (ddp_ranks(r)          ? " (ring, per rank)"
           : hybrid_nodes(r)     ? " (ring over nodes, per node)"
           : r.mode == "dp-hook" ? " (star, the weights: the hook's bytes are its own)"
                                 : " (star)")
       << "   peak MiB per device:";
    for (int64_t b : r.peak_mem_bytes) os << " " << mib(b);
    if (!r.link_bytes.empty() && r.gpus > 1) {
      os << "   " << (hybrid_nodes(r) ? "in-node " : "") << "link MiB per device (in + out, "
         << r.reduce << "):";
      for (int64_t b : r.link_bytes) os << " " << mib(b);
    }
    os << "\n";
  }
  if (std::string v = verdict(h, runs); !v.empty()) os << "\n verdict: " << v << "\n";
}

void print_sync_bn(std::ostream& os, const std::vector<RunResult>& runs) {
  for (const auto& r : runs) {
    if (r.sync_bn_values == 0 || r.gpus < 2) continue;
    os << ModeCell{runs, r} << " SyncBatchNorm: " << r.sync_bn_values << " values ("
       << r.sync_bn_values * 4
       << " bytes as f32) combined per device per step, one exchange per layer and pass"
       << (dp_threads(r) ? " (through host memory)" : " (all_reduce)") << "\n";
  }
}

void print_memory_model(std::ostream& os, const std::vector<RunResult>& runs) {
  bool header = false;
  for (const auto& r : runs) {
    if (r.optimizer_state_bytes.empty()) continue;
    if (!header) {
      os << "\n optimizer state (MiB) per " << (dp_threads(r) ? "device" : "rank")
         << ", and the model per rank: params 4P + grads 4P + state KP (/ N under ZeRO-1)\n";
      header = true;
    }
    int64_t p = r.param_bytes / 4;
    int n = r.gpus;
    // State bytes per parameter: AdamW's two moments (adamw, and a workload's adamw+groups),
    // SGD's momentum; another optimizer's from what its ranks hold together.
    int64_t k = r.optim.rfind("adamw", 0) == 0 ? 8 : r.optim.rfind("sgd", 0) == 0 ? 4 : 0;
    if (k == 0 && p > 0) {
      int64_t held = 0;
      for (int64_t b : r.optimizer_state_bytes) held += b;
      k = (r.zero ? held : r.optimizer_state_bytes[0]) / p;
    }
    int64_t state_model = r.zero == 1 ? (k * p + n - 1) / n : k * p;
    os << ModeCell{runs, r} << " " << r.optim
       << (r.zero ? (r.zero_overlap ? " zero-1 overlapped" : " zero-1") : "") << ":";
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

namespace {

// The bucket plan the projection communicates: the DDP run's, else one bucket of P ready when
// backward ends.
void bucket_plan(const std::vector<RunResult>& runs, int64_t p, std::vector<int64_t>* bytes,
                 std::vector<double>* ready) {
  for (auto& r : runs)
    if (r.mode == "ddp" && !r.bucket_bytes.empty() &&
        r.bucket_bytes.size() == r.bucket_ready_frac.size()) {
      *bytes = r.bucket_bytes;
      *ready = r.bucket_ready_frac;
      return;
    }
  *bytes = {p};
  *ready = {1.0};
}

const RunResult* compute_run(const std::vector<RunResult>& compute_runs, int64_t batch) {
  for (auto& c : compute_runs)
    if (c.gpus == 1 && c.batch == batch) return &c;
  return nullptr;
}

}  // namespace

std::vector<Projection> project(const std::vector<RunResult>& runs,
                                const std::vector<RunResult>& compute_runs) {
  std::vector<Projection> out;
  for (const char* mode : {"dp", "ddp"}) {
    const RunResult* r = projection_source(runs, mode);
    if (!r) continue;
    std::vector<int64_t> bytes;
    std::vector<double> ready;
    bucket_plan(runs, r->param_bytes, &bytes, &ready);
    for (auto& link : default_links())
      for (int n : {4, 8}) {
        Projection p;
        p.mode = mode;
        p.link = link.name;
        p.gpus = n;
        p.source_gpus = r->gpus;
        p.param_bytes = r->param_bytes;
        p.buckets = static_cast<int>(bytes.size());
        double backward_s = 0;
        const int64_t per_rank = (r->batch + n - 1) / n;
        if (const RunResult* c = compute_run(compute_runs, per_rank)) {
          p.optimizer_s = phase(*c, "optimizer") / 1000.0;
          p.compute_s = c->step_ms_median() / 1000.0 - p.optimizer_s;
          backward_s = phase(*c, "backward") / 1000.0;
          p.compute_from = "1-device run at batch " + std::to_string(per_rank);
        } else {
          // Forward + backward of one device at batch B / n_meas; at N devices each takes
          // B / N rows: compute(N) = compute_meas * n_meas / N (linear in rows).
          p.compute_s = (phase(*r, "forward") + phase(*r, "backward")) / 1000.0 * r->gpus / n;
          p.optimizer_s = phase(*r, "optimizer") / 1000.0;
          backward_s = phase(*r, "backward") / 1000.0 * r->gpus / n;
          p.compute_from = "scaled linearly from n=" + std::to_string(r->gpus);
        }
        const bool dp = p.mode == "dp";
        const double replicate =
            dp ? (n - 1) * (link.alpha_s + r->param_bytes / link.bandwidth_bytes_per_s) : 0;
        double sum = 0, end = 0;
        for (size_t i = 0; i < bytes.size(); ++i) {
          const double b = static_cast<double>(bytes[i]);
          const double c =
              dp ? (n - 1) * (link.alpha_s + b / link.bandwidth_bytes_per_s)
                 : 2.0 * (n - 1) * (link.alpha_s + b / (n * link.bandwidth_bytes_per_s));
          sum += c;
          end = std::max(end, ready[i] * backward_s) + c;
        }
        const double base = p.compute_s + p.optimizer_s + replicate;
        p.step_s = base + sum;
        p.overlap_s = base + std::max(0.0, end - backward_s);
        out.push_back(p);
      }
  }
  return out;
}

namespace {

// Throws naming `where` (a run of a --project-from file) and the field when a value the
// projection computes with is out of what any dp_bench run writes: a count below 1, a time or a
// size not finite, negative or past 1e9 ms or 2^50 bytes, a ready fraction outside [0, 1].
void check_projection_run(const RunResult& r, const std::string& where) {
  constexpr double kMaxMs = 1e9, kMaxBytes = 1125899906842624.0;  // 2^50
  auto check = [&](const std::string& field, double v, double lo, bool lo_open, double hi) {
    const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi;
    DP_CHECK(ok, where << "." << field << " is " << v << ": a dp_bench report holds "
                       << (lo_open ? "(" : "[") << lo << ", " << hi << "] there");
  };
  check("gpus", r.gpus, 1, false, 1024);
  check("batch", static_cast<double>(r.batch), 1, false, kMaxBytes);
  check("micro_batches", r.micro_batches, 1, false, 1 << 20);
  check("micro_batches_run", r.micro_batches_run, 1, false, r.micro_batches);
  DP_CHECK(!r.step_ms.empty(), where << ".step_ms is empty: a dp_bench report holds its steps");
  for (size_t i = 0; i < r.step_ms.size(); ++i)
    check("step_ms[" + std::to_string(i) + "]", r.step_ms[i], 0, true, kMaxMs);
  // The projection's compute is the run's forward and backward (a graphed step times them
  // together, its backward 0) and its optimizer: timed phases, none negative. "other", the step
  // less the timed phases, is not used and may fall a little below 0.
  DP_CHECK(!r.phases_ms.empty(), where << ".phases_ms is empty: the run's phases were not timed "
                                          "(--phase-times off), and the projection starts from "
                                          "them; give a report of a run that timed them");
  for (const auto& [name, ms] : r.phases_ms)
    check("phases_ms." + name, ms, name == "other" ? -kMaxMs : 0, false, kMaxMs);
  const double compute = (r.phases_ms.count("forward") ? r.phases_ms.at("forward") : 0) +
                         (r.phases_ms.count("backward") ? r.phases_ms.at("backward") : 0);
  DP_CHECK(compute > 0, where << ".phases_ms: forward + backward is " << compute
                              << " ms: a run that timed its phases computed for some time");
  check("param_bytes", static_cast<double>(r.param_bytes), 0, true, kMaxBytes);
  check("bytes_per_step", static_cast<double>(r.bytes_per_step), 0, false, kMaxBytes);
  check("bytes_theory", static_cast<double>(r.bytes_theory), 0, false, kMaxBytes);
  DP_CHECK(r.bucket_ready_frac.empty() || r.bucket_ready_frac.size() == r.bucket_bytes.size(),
           where << ": " << r.bucket_bytes.size() << " bucket_bytes and "
                 << r.bucket_ready_frac.size() << " bucket_ready_frac; a report gives one each");
  for (size_t i = 0; i < r.bucket_bytes.size(); ++i)
    check("bucket_bytes[" + std::to_string(i) + "]", static_cast<double>(r.bucket_bytes[i]), 0,
          true, kMaxBytes);
  for (size_t i = 0; i < r.bucket_ready_frac.size(); ++i)
    check("bucket_ready_frac[" + std::to_string(i) + "]", r.bucket_ready_frac[i], 0, false, 1);
}

}  // namespace

ProjectionInput read_projection_file(const std::string& project_from) {
  ProjectionInput in;
  nn::io::FileReader reader(project_from, "--project-from");  // refuses a FIFO, a device
  const std::string text = reader.bytes(reader.size(), "the JSON report");
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    std::string device = j.at("device").get<std::string>();
    DP_CHECK(device != "cpu", "--project-from '"
                                  << project_from
                                  << "' holds CPU compute; the projection needs a GPU's results "
                                     "file (a dp_bench --json of a run on a GPU)");
    in.model = j.at("model").get<std::string>();
    in.params = j.at("params").get<int64_t>();
    // Each run read and bounded, named by its place in the file.
    auto read_runs = [&](const char* key, std::vector<RunResult>& out) {
      const nlohmann::json none = nlohmann::json::array();
      const nlohmann::json& list = j.contains(key) ? j.at(key) : none;
      DP_CHECK(list.is_array(),
               "--project-from '" << project_from << "': " << key << " is not a list of runs");
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string where =
            "--project-from '" + project_from + "': " + key + "[" + std::to_string(i) + "]";
        try {
          // The count as written: get<int>() would wrap a huge one into range.
          const nlohmann::json& gpus = list[i].at("gpus");
          DP_CHECK(
              gpus.is_number_integer() && gpus.get<int64_t>() >= 1 && gpus.get<int64_t>() <= 1024,
              where << ".gpus is " << gpus.dump()
                    << ": a dp_bench report holds a device count in [1, 1024] there");
          for (const char* count : {"micro_batches", "micro_batches_run"})  // whole, if there
            DP_CHECK(!list[i].contains(count) || list[i].at(count).is_number_integer(),
                     where << "." << count << " is " << list[i].at(count).dump()
                           << ": a dp_bench report holds a whole number there");
          out.push_back(run_from_json(list[i]));
        } catch (const nlohmann::json::exception& e) {
          DP_THROW(where << ": " << e.what());
        }
        check_projection_run(out.back(), where);
      }
    };
    DP_CHECK(j.contains("runs"), "--project-from '" << project_from << "': no \"runs\"");
    read_runs("runs", in.runs);
    read_runs("compute_runs", in.compute_runs);
    DP_CHECK(!in.runs.empty(),
             "--project-from '" << project_from << "' holds no runs to project from");
    in.source = project_from + " (" + device + ", " + in.model + " " +
                j.value("dtype", std::string("fp32")) + ")";
  } catch (const nlohmann::json::exception& e) {
    DP_THROW("--project-from '" << project_from << "': not a dp_bench JSON report (" << e.what()
                                << ")");
  }
  return in;
}

void check_projection_model(const ProjectionInput& in, const std::string& project_from,
                            const std::string& model, int64_t params, int micro_batches) {
  DP_CHECK(in.model == model && in.params == params,
           "--project-from '" << project_from << "' holds runs of " << in.model << " (" << in.params
                              << " parameters), and this run trains " << model << " (" << params
                              << "): its projection would describe the other model; give a "
                                 "report of this model, or --project-from off");
  auto passes = [](int k) {
    return k == 1 ? std::string("one pass") : std::to_string(k) + " micro-batches";
  };
  for (const std::vector<RunResult>* list : {&in.runs, &in.compute_runs})
    for (const RunResult& r : *list)
      DP_CHECK(r.micro_batches == micro_batches,
               "--project-from '" << project_from << "' holds runs of " << passes(r.micro_batches)
                                  << " a step, and this run takes " << passes(micro_batches)
                                  << ": its projection would use the other step's compute; give "
                                     "a report of the same --micro-batches, or --project-from off");
}

ProjectionFrom projection_from(const std::string& project_from) {
  if (project_from.empty()) return ProjectionFrom::this_machine;
  return project_from == "off" ? ProjectionFrom::off : ProjectionFrom::file;
}

ProjectionInput projection_input(const Header& h, const std::vector<RunResult>& runs,
                                 const std::string& project_from,
                                 const std::vector<RunResult>& compute_runs) {
  ProjectionInput in;
  switch (projection_from(project_from)) {
    case ProjectionFrom::off:
      in.why_not = "--project-from off";
      return in;
    case ProjectionFrom::file:
      in = read_projection_file(project_from);
      check_projection_model(in, project_from, h.model, h.params,
                             runs.empty() ? 1 : runs.front().micro_batches);
      return in;
    case ProjectionFrom::this_machine:
      break;
  }
  if (h.device == "cpu") {
    in.why_not =
        "the compute was measured on CPU devices, and CPU compute beside NVLink/PCIe figures "
        "is no GPU prediction; run on a GPU, or pass --project-from GPU_RESULTS.json";
    return in;
  }
  for (const RunResult& r : runs)
    if (r.phases_ms.empty()) {
      in.why_not = "the phases were not timed (--phase-times off)";
      return in;
    }
  in.runs = runs;
  in.compute_runs = compute_runs;
  in.source = "measured on " + h.device;
  return in;
}

void print_projection(std::ostream& os, const ProjectionInput& in) {
  if (in.runs.empty()) {
    os << "\n projection to NVLink/PCIe: left out: " << in.why_not << "\n";
    return;
  }
  os << std::fixed
     << "\n projection to real interconnects (alpha-beta model per gradient bucket), compute "
     << in.source << ":\n"
     << "   compute(N): a 1-device run at batch ceil(B/N), host time included (else the measured\n"
        "   forward + backward scaled by rows); per bucket of b bytes: DP (N-1)(alpha + b/bw) "
        "into\n"
        "   device 0 plus (N-1)(alpha + P/bw) to replicate; DDP ring 2(N-1)(alpha + b/(N bw)).\n"
        "   Range: full overlap (each bucket sent from its measured ready time in backward) to\n"
        "   none (t = compute + opt + all communication). Links: NVLink4 450 GB/s each way,\n"
        "   alpha 5 us; PCIe Gen5 64 GB/s each way, alpha 10 us\n";
  for (auto& p : project(in.runs, in.compute_runs))
    os << "   " << std::left << std::setw(4) << p.mode << std::right << std::setw(10) << p.link
       << " N=" << p.gpus << ": " << std::setprecision(3) << p.overlap_s * 1000 << "-"
       << p.step_s * 1000 << " ms  (compute " << p.compute_s * 1000 << " ms from " << p.compute_from
       << ", opt " << p.optimizer_s * 1000 << " ms, " << p.buckets
       << (p.buckets == 1 ? " bucket" : " buckets") << ", P " << mib(p.param_bytes) << " MiB)\n";
}

nlohmann::json run_to_json(const RunResult& r) {
  return {
      {"mode", r.mode},
      {"gpus", r.gpus},
      {"batch", r.batch},
      {"step_ms", r.step_ms},
      {"repeat_ms", r.repeat_ms},
      {"from_repeat", r.from_repeat},
      {"step_ms_median", r.step_ms_median()},
      {"step_ms_p90", r.step_ms_p90()},
      {"samples_per_s", r.samples_per_s()},
      {"phases_ms", r.phases_ms},
      {"phases_step_ms", r.phases_step_ms},
      {"param_bytes", r.param_bytes},
      {"bytes_per_step", r.bytes_per_step},
      {"bytes_theory", r.bytes_theory},
      {"peak_mem_bytes", r.peak_mem_bytes},
      {"losses", r.losses},
      {"final_loss", r.final_loss},
      {"buckets", r.buckets},
      {"buckets_overlapped", r.buckets_overlapped},
      {"pulls_beside_backward", r.pulls_beside_backward},
      {"reduce", r.reduce},
      {"peer_reads", r.peer_reads},
      {"graph_pulls", r.graph_pulls},
      {"link_bytes", r.link_bytes},
      {"optim", r.optim},
      {"micro_batches", r.micro_batches},
      {"micro_batches_run", r.micro_batches_run},
      {"zero", r.zero},
      {"zero_overlap", r.zero_overlap},
      {"optimizer_state_bytes", r.optimizer_state_bytes},
      {"sync_bn_values_per_step", r.sync_bn_values},
      {"sync_bn_bytes_per_step", r.sync_bn_values * 4},
      {"loss_scale", r.loss_scale},
      {"skipped_steps", r.skipped_steps},
      {"comm_dtype", r.comm_dtype},
      {"bucket_bytes", r.bucket_bytes},
      {"bucket_ready_frac", r.bucket_ready_frac},
      {"allocations_per_step", r.allocations_per_step},
      {"host_syncs_per_step", r.host_syncs_per_step},
      {"graph_nodes_per_step", r.graph_nodes_per_step},
      {"casts_per_step", r.casts_per_step},
      {"graphed_steps", r.graphed_steps},
      {"graph_collectives", r.graph_collectives},
      {"comm_hook", r.comm_hook},
      {"capture", r.capture_step < 0 ? nlohmann::json(nullptr)
                                     : nlohmann::json{{"step", r.capture_step},
                                                      {"allocations", r.capture_allocations},
                                                      {"peak_bytes", r.capture_peak_bytes},
                                                      {"eager_peak_bytes", r.eager_peak_bytes}}},
      {"graphs_fallback", r.graphs_fallback},
      {"attention", r.attention},
      {"nothing_left", r.nothing_left}};
}

RunResult run_from_json(const nlohmann::json& j) {
  RunResult r;
  r.mode = j.at("mode").get<std::string>();
  r.gpus = j.at("gpus").get<int>();
  r.batch = j.at("batch").get<int64_t>();
  r.step_ms = j.at("step_ms").get<std::vector<double>>();
  r.repeat_ms = j.value("repeat_ms", std::vector<double>{});
  r.from_repeat = j.value("from_repeat", 0);
  r.phases_ms = j.at("phases_ms").get<std::map<std::string, double>>();
  r.phases_step_ms = j.value("phases_step_ms", 0.0);
  r.param_bytes = j.at("param_bytes").get<int64_t>();
  r.bytes_per_step = j.at("bytes_per_step").get<int64_t>();
  r.bytes_theory = j.at("bytes_theory").get<int64_t>();
  r.peak_mem_bytes = j.at("peak_mem_bytes").get<std::vector<int64_t>>();
  r.losses = j.at("losses").get<std::vector<float>>();
  r.final_loss = j.at("final_loss").get<float>();
  r.buckets = j.value("buckets", 0);
  r.buckets_overlapped = j.value("buckets_overlapped", 0);
  r.pulls_beside_backward = j.value("pulls_beside_backward", 0);
  r.reduce = j.value("reduce", std::string());
  r.peer_reads = j.value("peer_reads", std::string("auto"));
  r.graph_pulls = j.value("graph_pulls", std::string("after"));
  r.link_bytes = j.value("link_bytes", std::vector<int64_t>());
  r.optim = j.value("optim", std::string("sgd"));
  r.zero = j.value("zero", 0);
  r.micro_batches = j.value("micro_batches", 1);
  r.micro_batches_run = j.value("micro_batches_run", r.micro_batches);
  r.zero_overlap = j.value("zero_overlap", false);
  r.optimizer_state_bytes = j.value("optimizer_state_bytes", std::vector<int64_t>{});
  r.sync_bn_values = j.value("sync_bn_values_per_step", int64_t{0});
  r.loss_scale = j.value("loss_scale", 1.f);
  r.skipped_steps = j.value("skipped_steps", int64_t{0});
  r.comm_dtype = j.value("comm_dtype", std::string("fp32"));
  r.bucket_bytes = j.value("bucket_bytes", std::vector<int64_t>{});
  r.bucket_ready_frac = j.value("bucket_ready_frac", std::vector<double>{});
  r.allocations_per_step = j.value("allocations_per_step", 0.0);
  r.host_syncs_per_step = j.value("host_syncs_per_step", 0.0);
  r.graph_nodes_per_step = j.value("graph_nodes_per_step", 0.0);
  r.casts_per_step = j.value("casts_per_step", 0.0);
  r.graphed_steps = j.value("graphed_steps", 0);
  r.graph_collectives = j.value("graph_collectives", std::string());
  r.comm_hook = j.value("comm_hook", std::string());
  if (auto c = j.find("capture"); c != j.end() && c->is_object()) {
    r.capture_step = c->at("step").get<int>();
    r.capture_allocations = c->at("allocations").get<int64_t>();
    r.capture_peak_bytes = c->at("peak_bytes").get<int64_t>();
    r.eager_peak_bytes = c->at("eager_peak_bytes").get<int64_t>();
  }
  r.graphs_fallback = j.value("graphs_fallback", std::string());
  r.attention = j.value("attention", std::string());
  r.nothing_left = j.value("nothing_left", std::string());
  return r;
}

nlohmann::json to_json(const Header& h, const std::vector<RunResult>& runs,
                       const ProjectionInput& projection) {
  nlohmann::json j = {{"program", "dp_bench"},  // lets a later --json replace this file
                      {"device", h.device},
                      {"physical_devices", h.physical},
                      {"logical_devices", h.logical},
                      {"oversubscribed", oversubscribed(h)},
                      {"model", h.model},
                      {"params", h.params},
                      {"dtype", h.dtype},
                      {"tokens_per_sample", h.tokens_per_sample},
                      {"flops_per_token", h.flops_per_token},
                      {"recompute_flops_per_token", h.recompute_flops_per_token},
                      {"peak_tflops", h.peak_tflops},
                      {"peak_source", h.peak_source},
                      {"environment", environment_json(h)},
                      {"runs", nlohmann::json::array()},
                      {"projection", nlohmann::json::array()},
                      {"projection_source", projection.source},
                      {"projection_left_out", projection.why_not},
                      {"ddp_step_time", "slowest rank per step"},
                      {"repeats", runs.empty() ? 1 : std::max<size_t>(1, runs[0].repeat_ms.size())},
                      {"verdict", verdict(h, runs)}};
  for (auto& p : project(projection.runs, projection.compute_runs))
    j["projection"].push_back({{"mode", p.mode},
                               {"link", p.link},
                               {"gpus", p.gpus},
                               {"from_gpus", p.source_gpus},
                               {"compute_ms", p.compute_s * 1000},
                               {"compute_from", p.compute_from},
                               {"optimizer_ms", p.optimizer_s * 1000},
                               {"param_bytes", p.param_bytes},
                               {"buckets", p.buckets},
                               {"step_ms", p.step_s * 1000},
                               {"step_ms_full_overlap", p.overlap_s * 1000}});
  j["compute_runs"] = nlohmann::json::array();
  for (auto& c : projection.compute_runs) j["compute_runs"].push_back(run_to_json(c));
  for (auto& r : runs) {
    nlohmann::json jr = run_to_json(r);
    const RunResult* base = baseline_of(runs, r.mode);
    const Estimate step = step_estimate(r);
    jr["step_ms_ci95"] = {step.lo, step.hi};
    jr["noisy"] = noisy(r.step_ms);
    jr["time_sliced"] = time_sliced(h, r.gpus);
    if (h.tokens_per_sample > 0) {
      jr["tokens_per_s"] = tokens_per_s(h, r);
      jr["mfu"] = mfu(h, r);
      jr["hfu"] = hfu(h, r);
    }
    if (std::string label = time_sliced_label(h, r.mode, r.gpus); !label.empty())
      jr["time_sliced_note"] = label;
    if (base && r.step_ms_median() > 0 && !time_sliced(h, r.gpus)) {
      double s = base->step_ms_median() / r.step_ms_median();
      jr["speedup"] = s;
      jr["efficiency"] = s / r.gpus;
    }
    if (auto ratio = ratio_to_one(runs, r))
      jr["ratio_to_one"] = {{"value", ratio->value},
                            {"ci95", {ratio->lo, ratio->hi}},
                            {"within_noise", ratio->contains(1.0)}};
    if (auto us = overhead_ci(runs, r)) {
      jr["overhead_us_per_device"] = us->value;
      jr["overhead_us_per_device_ci95"] = {us->lo, us->hi};
      jr["overhead_within_noise"] = us->contains(0.0);
    }
    j["runs"].push_back(jr);
  }
  return j;
}

void write_sweep_csv(std::ostream& os, const Header& h, const std::vector<RunResult>& runs) {
  os << "mode,gpus,batch,step_ms_median,step_ms_p90,samples_per_s,speedup,efficiency,"
        "bytes_per_step,bytes_theory,final_loss,overhead_us_per_device,step_ms_ci_lo,"
        "step_ms_ci_hi,ratio_to_one,ratio_ci_lo,ratio_ci_hi,overhead_ci_lo,overhead_ci_hi,"
        "repeats,noisy\n";
  for (auto& r : runs) {
    const RunResult* base = baseline_of(runs, r.mode);
    os << r.mode << "," << r.gpus << "," << r.batch << "," << r.step_ms_median() << ","
       << r.step_ms_p90() << "," << r.samples_per_s() << ",";
    // Empty where devices share the hardware: overhead, not scaling (as the report and JSON).
    if (base && r.step_ms_median() > 0 && !time_sliced(h, r.gpus)) {
      const double s = base->step_ms_median() / r.step_ms_median();
      os << s << "," << s / r.gpus;
    } else {
      os << ",";
    }
    os << "," << r.bytes_per_step << "," << r.bytes_theory << "," << r.final_loss << ",";
    std::optional<Estimate> us = overhead_ci(runs, r), ratio = ratio_to_one(runs, r);
    if (us) os << us->value;
    const Estimate step = step_estimate(r);
    os << "," << step.lo << "," << step.hi << ",";
    if (ratio)
      os << ratio->value << "," << ratio->lo << "," << ratio->hi;
    else
      os << ",,";
    os << ",";
    if (us)
      os << us->lo << "," << us->hi;
    else
      os << ",";
    os << "," << std::max<size_t>(1, r.repeat_ms.size()) << "," << (noisy(r.step_ms) ? 1 : 0)
       << "\n";
  }
}

std::vector<LinkTime> link_times(const std::vector<RunResult>& runs, int nodes, double gbps) {
  std::vector<LinkTime> out;
  if (nodes < 2 || gbps <= 0) return out;
  for (const RunResult& r : runs) {
    // A hook's runs too: their payload (what the hook handed to the group) as all-reduces.
    if (!ddp_ranks(r) && !hybrid_nodes(r)) continue;
    const int ring = ddp_ranks(r) ? r.gpus : nodes;  // the ring that crosses the link
    LinkTime t;
    t.mode = r.mode;
    t.gpus = r.gpus;
    t.bytes = static_cast<int64_t>(2.0 * (ring - 1) / ring * static_cast<double>(r.bytes_per_step));
    t.ms = static_cast<double>(t.bytes) / (gbps * 1e9 / 8) * 1e3;
    t.step_ms = r.step_ms_median();
    out.push_back(t);
  }
  return out;
}

void print_link_times(std::ostream& os, const std::vector<LinkTime>& times, int nodes,
                      double gbps) {
  if (times.empty()) return;
  os << "\n over the link between " << nodes << " nodes at " << std::setprecision(3) << gbps
     << " Gbit/s (--link-gbps): bytes out of each node per step, and their time\n";
  for (const LinkTime& t : times)
    os << " " << std::left << std::setw(11) << t.mode << std::right << std::setw(2) << t.gpus
       << "   " << std::fixed << std::setprecision(2) << static_cast<double>(t.bytes) / 1e6
       << " MB -> " << std::setprecision(2) << t.ms
       << (t.ms > t.step_ms ? " ms, more than the whole measured " : " ms of the measured ")
       << t.step_ms << " ms step"
       << (t.ms > t.step_ms ? ": the nodes' link is faster than --link-gbps says" : "")
       << (t.mode == "ddp" || t.mode == "hook" ? " (ring of all ranks: 2(N-1)/N x payload)"
                                               : " (ring of the nodes: 2(M-1)/M x payload)")
       << "\n"
       << std::defaultfloat;
}

nlohmann::json link_times_json(const std::vector<LinkTime>& times, int nodes, double gbps) {
  nlohmann::json runs = nlohmann::json::array();
  for (const LinkTime& t : times)
    runs.push_back({{"mode", t.mode},
                    {"gpus", t.gpus},
                    {"bytes_per_node", t.bytes},
                    {"link_ms", t.ms},
                    {"step_ms_median", t.step_ms}});
  return {{"nodes", nodes}, {"gbps", gbps}, {"runs", runs}};
}

}  // namespace bench
