// What dp_bench measures and how it reports it: per-run figures, the bytes-moved theory, the
// alpha-beta projection to real interconnects, the terminal table, JSON, CSV and the trace.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dp/trace.hpp"

namespace bench {

struct RunResult {
  std::string mode;                         // "dp" or "ddp"
  int gpus = 1;                             // devices (DP) or ranks (DDP)
  int64_t batch = 0;                        // global batch
  std::vector<double> step_ms;              // one per timed step
  std::map<std::string, double> phases_ms;  // median per phase
  int64_t param_bytes = 0;                  // P: one flat parameter copy
  int64_t bytes_per_step = 0;               // measured: what the engine copied
  int64_t bytes_theory = 0;                 // the formula for this mode
  std::vector<int64_t> peak_mem_bytes;      // one per device
  std::vector<float> losses;                // per timed step
  float final_loss = 0;
  int buckets = 0;                  // gradient buckets per step
  int buckets_overlapped = 0;       // DDP: launched while backward still ran; DP: first pulled
                                    // before the last device's backward ended (median over steps)
  std::string reduce;               // DP: "star" or "tree"
  std::vector<int64_t> link_bytes;  // DP: bytes in + out of each device per step
  std::string optim = "sgd";
  int zero = 0;                                // DDP: ZeRO stage (0 or 1)
  std::vector<int64_t> optimizer_state_bytes;  // per device (DP: device 0) or rank
  int64_t sync_bn_values = 0;       // --sync-bn: values each device or rank combines per step
  float loss_scale = 1;             // mixed precision: the loss scale after the last step
  int64_t skipped_steps = 0;        // steps skipped for a non-finite gradient (warmup included)
  std::string comm_dtype = "fp32";  // the dtype gradients travelled in

  double step_ms_median() const;
  double step_ms_p90() const;
  double samples_per_s() const;
};

// q-quantile (0..1) by linear interpolation; 0 for an empty list.
double percentile(std::vector<double> values, double q);

// Step times of a synchronous run from every rank's: `all` holds rank r's `steps` times at
// [r steps, (r+1) steps). A step ends when its last rank ends: the result is each step's
// slowest time.
std::vector<double> slowest_per_step(const std::vector<float>& all, int ranks, int64_t steps);

// Bytes per step, P = parameter bytes. DP through device 0: the root sends P to and receives
// P from each of the N-1 replicas: 2 (N-1) P; with gradients sent as G bytes (G = P/2 in bf16,
// --comm-dtype), (N-1) (P + G). Ring all-reduce: each device sends (and receives) 2 (N-1)/N P
// (pass G for a bf16 all-reduce).
int64_t dp_bytes_theory(int n, int64_t p, int64_t g = -1);
int64_t ring_bytes_theory(int n, int64_t p);

// Alpha-beta model of one link: a message of b bytes takes alpha + b / bandwidth.
struct Link {
  std::string name;
  double bandwidth_bytes_per_s;  // each way
  double alpha_s;                // per message latency
};
std::vector<Link> default_links();  // NVLink4 450 GB/s, PCIe Gen5 64 GB/s

// Projected step time of `mode` on n devices:
//   DP  (star through device 0, which serialises every transfer on its one link):
//       t = compute + optimizer + 2 (n-1) (alpha + P / bw)
//   DDP (ring all-reduce of P bytes in 2 (n-1) messages of P/n, no overlap assumed):
//       t = compute + optimizer + 2 (n-1) (alpha + P / (n bw))
// compute = forward + backward per device at the per-device batch, in seconds.
double projected_step_s(const std::string& mode, int n, double compute_s, double optimizer_s,
                        int64_t p, const Link& link);

// One projected step time: `mode` on `gpus` devices over `link`, from the measured run of
// `source_gpus` devices.
struct Projection {
  std::string mode, link;
  int gpus = 0, source_gpus = 0;
  double compute_s = 0, optimizer_s = 0, step_s = 0;
  int64_t param_bytes = 0;
};
// For each mode present: N = 4 and 8 on every default link.
std::vector<Projection> project(const std::vector<RunResult>& runs);

struct Header {
  std::string device;  // "cpu" or the GPU's name
  int physical = 0;    // physical devices behind the logical ones
  int logical = 0;
  std::string model;
  int64_t params = 0;
  std::string dtype;
};
bool oversubscribed(const Header& h);

// Engine overhead per added device: (t_N - t_1) / N in microseconds, from the medians of the
// run and of its mode's 1-device run; nullopt without a baseline or for N = 1.
std::optional<double> overhead_us_per_device(const std::vector<RunResult>& runs,
                                             const RunResult& r);

// The compute a projection starts from: measured GPU runs, or the runs of a GPU results file
// (--project-from). CPU compute beside NVLink figures would read like a GPU prediction, so
// then there is none, and `why_not` says so.
struct ProjectionInput {
  std::vector<RunResult> runs;  // empty: no projection
  std::string source;           // "measured on <gpu>" or "<file> (<gpu>)"
  std::string why_not;
};
// requires project_from empty or a dp_bench JSON file (throws naming the file otherwise).
ProjectionInput projection_input(const Header& h, const std::vector<RunResult>& runs,
                                 const std::string& project_from);

void print_table(std::ostream& os, const Header& h, const std::vector<RunResult>& runs);
// Optimizer state per device or rank, beside the ZeRO paper's model of memory per rank in
// f32: parameters 4P + gradients 4P + optimizer state K P (K = 4 bytes for SGD's momentum, 8
// for AdamW's two moments), the last divided by N under ZeRO-1.
void print_memory_model(std::ostream& os, const std::vector<RunResult>& runs);
// --sync-bn: what the BatchNorm layers exchange per step.
void print_sync_bn(std::ostream& os, const std::vector<RunResult>& runs);
void print_projection(std::ostream& os, const ProjectionInput& in);
nlohmann::json to_json(const Header& h, const std::vector<RunResult>& runs,
                       const ProjectionInput& projection);
nlohmann::json run_to_json(const RunResult& r);
RunResult run_from_json(const nlohmann::json& j);
// CSV of a sweep: mode,gpus,step_ms_median,step_ms_p90,samples_per_s,speedup,efficiency,...
void write_sweep_csv(std::ostream& os, const std::vector<RunResult>& runs);
// Chrome/Perfetto trace: one process per run, one thread (track) per device or rank.
nlohmann::json chrome_trace(
    const std::vector<std::pair<std::string, std::vector<dp::TraceEvent>>>& runs);

}  // namespace bench
