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

#include "benchmarks/stats.hpp"
#include "dp/trace.hpp"

namespace bench {

struct RunResult {
  std::string mode;               // "dp" or "ddp"
  int gpus = 1;                   // devices (DP) or ranks (DDP)
  int64_t batch = 0;              // global batch
  std::vector<double> step_ms;    // one per timed step (--repeat: of the median repeat)
  std::vector<double> repeat_ms;  // --repeat K >= 2: each repeat's median step, in order
  // --repeat K >= 2: the repeat (1-based) whose figures these are, all but the median and its
  // interval: the median repeat (combine_repeats). 0: one run.
  int from_repeat = 0;
  // The phases of the median step (median_step_phases): each timed phase's time in that step,
  // and "other", the rest of it, so that they add up to phases_step_ms.
  std::map<std::string, double> phases_ms;
  double phases_step_ms = 0;  // the step they add up to: the median step of step_ms
  int64_t param_bytes = 0;    // P: one flat parameter copy
  // Measured. DP: what the engine copied; DDP: the payload handed to the process group (every
  // collective's tensors, counted by the group), summed over buckets and buffers.
  int64_t bytes_per_step = 0;
  // A model. DP: the formula through device 0; DDP: the wire bytes per rank of a ring
  // all-reduce of the counted payload.
  int64_t bytes_theory = 0;
  std::vector<int64_t> peak_mem_bytes;  // one per device
  std::vector<float> losses;            // per timed step
  float final_loss = 0;
  int buckets = 0;                    // gradient buckets per step
  int buckets_overlapped = 0;         // DDP: launched while backward still ran; DP: first pulled
                                      // before the last device's backward ended (median over steps)
  int pulls_beside_backward = 0;      // DP on GPUs: pulls on a receiver's comm stream (median)
  std::string reduce;                 // DP: "star" or "tree"
  std::string peer_reads = "auto";    // DP: "auto" (in place where possible) or "off" (staged)
  std::string graph_pulls = "after";  // DP's graphed steps: "after" backward, or "beside" it
  std::vector<int64_t> link_bytes;    // DP: bytes in + out of each device per step
  std::string optim = "sgd";
  int micro_batches = 1;      // per device or rank and step (--micro-batches)
  int micro_batches_run = 1;  // the most a device or rank ran: no more than its chunk's rows
  int zero = 0;               // DDP: ZeRO stage (0 or 1)
  bool zero_overlap = false;  // ZeRO-1 through DDP's buckets (--zero-overlap)
  std::vector<int64_t> optimizer_state_bytes;  // per device (DP: device 0) or rank
  int64_t sync_bn_values = 0;       // --sync-bn: values each device or rank combines per step
  float loss_scale = 1;             // mixed precision: the loss scale after the last step
  int64_t skipped_steps = 0;        // steps skipped for a non-finite gradient (warmup included)
  std::string comm_dtype = "fp32";  // the dtype gradients travelled in
  // Resumed at or past the last step: what to print instead of a report (nn::
  // nothing_left_to_train); empty when the run trained.
  std::string nothing_left;
  // DDP, per gradient bucket in launch order: its bytes (comm dtype) and when it was ready, as a
  // fraction of backward's time (median over the timed steps): the projection's overlap input.
  std::vector<int64_t> bucket_bytes;
  std::vector<double> bucket_ready_frac;
  // Counted by the runtime, median over the timed steps (DP: every device's context; DDP: rank
  // 0's): memory taken from a device, and host waits or reads. A replayed step has 0 and 1.
  double allocations_per_step = 0;
  double host_syncs_per_step = 0;
  // Graphed steps: the nodes of the graphs a step replays (DP: every device's; DDP: rank 0's),
  // median; each is a launch on a GPU, so nodes x the launch cost is the step's floor.
  double graph_nodes_per_step = 0;
  // Dtype conversions (f32/f16/bf16 casts: each a kernel on a GPU) a step performed, median over
  // the timed steps (DP: every device's contexts; DDP: rank 0's). A graphed step counts the casts
  // its graphs replay, so the figure does not depend on --cuda-graphs.
  double casts_per_step = 0;
  int graphed_steps = 0;  // DP, DDP: timed steps that ran as replayed graphs (dp::Graphs)
  // DDP with graphed steps: where the bucket all-reduces ran ("in graph", overlapped with the
  // captured backward, or "between graphs"); empty otherwise.
  std::string graph_collectives;
  // mode "hook": DDP with the workload's communication hook (dp/distributed/comm_hook.hpp) in
  // place of the bucket all-reduce: its name. Empty otherwise.
  std::string comm_hook;
  // The step that captured the graphs (warm-up included; -1: none did): the memory it took from
  // a device (goal 0: a capture finds its blocks cached) and the most memory one device (DDP:
  // rank 0) had in use during it, against the eager step before it (goal: equal, within a
  // block; kernels/runtime/graph.hpp).
  int capture_step = -1;
  int64_t capture_allocations = 0;
  int64_t capture_peak_bytes = 0, eager_peak_bytes = 0;
  // Why graphs went off by themselves ("capture failed on cuda:0: ..."); empty when they did
  // not (graphs ran, or --cuda-graphs off asked for none).
  std::string graphs_fallback;
  // Models with attention: what it ran on ("cuDNN fused SDPA", or the plain kernels and why);
  // empty for the others.
  std::string attention;

  // The median over repeats of each repeat's median step (--repeat K >= 2), else over steps.
  double step_ms_median() const;
  double step_ms_p90() const;  // of the steps (--repeat: the median repeat's)
  double samples_per_s() const;
};

// One run's K >= 1 interleaved repeats (in order, each a whole run) as one result: the median
// repeat's figures (the repeat at the lower median of the repeats' median steps, equal medians
// in repeat order), so that its p90, phases, losses, bytes and memory all describe one real run
// whose median step is the reported median (odd K; between the middle two for even K), and
// repeat_ms, each repeat's median step in order, for the median and its interval. Throws for no
// repeats or repeats of different runs.
RunResult combine_repeats(std::vector<RunResult> repeats);

// Step times of a synchronous run from every rank's: `all` holds rank r's `steps` times at
// [r steps, (r+1) steps). A step ends when its last rank ends: the result is each step's
// slowest time.
std::vector<double> slowest_per_step(const std::vector<float>& all, int ranks, int64_t steps);

// Sets r.phases_ms to the phases of r's median step (the step at the lower median of
// r.step_ms, its final per-step times) and "other" to that step's time less the phases that
// follow one another within it (`additive`; a phase inside another, such as DP's
// reduce_in_backward, is shown but not subtracted); r.phases_step_ms to that step's time.
// requires each of `phases` one value per step of r.step_ms (none: nothing is set).
void median_step_phases(RunResult& r, const std::map<std::string, std::vector<double>>& phases,
                        const std::vector<std::string>& additive);

// Bytes per step, P = parameter bytes. DP through device 0: the root sends P to and receives
// P from each of the N-1 replicas: 2 (N-1) P; with gradients sent as G bytes (G = P/2 in bf16,
// --comm-dtype), (N-1) (P + G). Ring all-reduce: each device sends (and receives) 2 (N-1)/N P
// (pass G for a bf16 all-reduce). Under mixed precision each replica also takes the root's
// 16-bit weights (C = P/2 bytes) in place of casting them, and then not the f32 bytes S of the
// weights read only through them (Linear's, Conv2d's): (N-1) (P - S + C + G).
int64_t dp_bytes_theory(int n, int64_t p, int64_t g = -1, int64_t c = 0, int64_t s = 0);
int64_t ring_bytes_theory(int n, int64_t p);

// Alpha-beta model of one link: a message of b bytes takes alpha + b / bandwidth.
struct Link {
  std::string name;
  double bandwidth_bytes_per_s;  // each way
  double alpha_s;                // per message latency
};
std::vector<Link> default_links();  // NVLink4 450 GB/s, PCIe Gen5 64 GB/s

// Projected step time of `mode` on n devices, with no overlap and the whole of P as one message:
//   DP  (star through device 0, which serialises every transfer on its one link):
//       t = compute + optimizer + 2 (n-1) (alpha + P / bw)
//   DDP (ring all-reduce of P bytes in 2 (n-1) messages of P/n):
//       t = compute + optimizer + 2 (n-1) (alpha + P / (n bw))
// compute = forward + backward per device at the per-device batch, in seconds.
double projected_step_s(const std::string& mode, int n, double compute_s, double optimizer_s,
                        int64_t p, const Link& link);

// One projected step time: `mode` on `gpus` devices over `link`, as a range from full overlap
// of the gradient communication with backward (`overlap_s`) to none (`step_s`).
//   per bucket i of b_i bytes:  DP c_i = (N-1)(alpha + b_i/bw)      [into device 0]
//                               DDP c_i = 2(N-1)(alpha + b_i/(N bw)) [ring]
//   DP also replicates P to the N-1 replicas before forward: r = (N-1)(alpha + P/bw).
//   no overlap:   t = compute + optimizer + r + sum c_i
//   full overlap: bucket i starts at max(its ready time, the previous bucket's end), ready
//                 time = its measured fraction of backward x backward(N); t = compute +
//                 optimizer + r + max(0, last end - backward(N))
// compute(N) comes from a 1-device run at the per-rank batch ceil(B/N) (its whole step less
// the optimizer: host time included) when one ran, else the source run's forward + backward
// scaled linearly in rows (`compute_from` says which).
struct Projection {
  std::string mode, link;
  int gpus = 0, source_gpus = 0;
  double compute_s = 0, optimizer_s = 0, step_s = 0, overlap_s = 0;
  int64_t param_bytes = 0;
  int buckets = 0;
  std::string compute_from;
};
// For each mode present: N = 4 and 8 on every default link. `compute_runs`: 1-device DP runs
// at per-rank batches; buckets come from the DDP run (else one bucket of P, ready at the end).
std::vector<Projection> project(const std::vector<RunResult>& runs,
                                const std::vector<RunResult>& compute_runs = {});

struct Header {
  std::string device;  // "cpu" or the GPU's name
  int physical = 0;    // physical devices behind the logical ones
  int logical = 0;
  std::string model;
  int64_t params = 0;
  std::string dtype;
  // Language-model workloads (--model gpt): tokens per sample (the sequence length) and
  // training FLOPs per token, 6 P + 12 L T D (nanoGPT's and llm.c's count); 0 otherwise.
  int64_t tokens_per_sample = 0;
  double flops_per_token = 0;
  // Checkpointed blocks' second forward (--recompute), per token: HFU adds it; 0 otherwise.
  double recompute_flops_per_token = 0;
  // The peak MFU divides by, in TFLOP/s per physical device (a GPU, or the whole CPU), and
  // where it came from: --peak-tflops, the GPU's data sheet, or a GEMM measured here.
  double peak_tflops = 0;
  std::string peak_source;
  // The libraries the run computes with, as found at run time (kernels::library_versions, and
  // NCCL): name and version.
  std::vector<std::pair<std::string, std::string>> libraries;
  // CPU runs: the GEMM kernels (kernels::cpu_blas_kernels), and the warning line when they are
  // narrower than the CPU's vector instructions.
  std::string cpu_gemm_kernels, cpu_gemm_chosen_over, cpu_gemm_warning, cpu_gemm_bf16;
  // CUDA devices: how the MLP's GELU backward GEMM runs (kernels::cuda_dgelu_epilogue):
  // "ops" (the default) or "epilogue" (DP_CUDA_DGELU=epilogue: cuBLASLt's DGELU_BGRAD where it
  // has an algorithm).
  std::string cuda_dgelu;
  bool cpu_gemm_generic = false;
};
bool oversubscribed(const Header& h);
// Tokens per second of a run (0 unless the workload has tokens).
double tokens_per_s(const Header& h, const RunResult& r);
// Model FLOPs utilisation: flops_per_token x tokens/s over the peak of the hardware the run
// used (min(N, physical) GPUs; CPU devices share one CPU, so its one peak). 0 without a peak.
double mfu(const Header& h, const RunResult& r);
// Hardware FLOPs utilisation: MFU with the recompute's FLOPs counted (Megatron's HFU); equal to
// MFU without --recompute.
double hfu(const Header& h, const RunResult& r);
// Devices or ranks that share hardware take turns on it: every CPU device runs on all cores, so
// any N > 1 on CPU devices, and more logical than physical GPUs. Their times measure overhead,
// not scaling: the report then leaves speedup and efficiency out.
bool time_sliced(const Header& h, int n);
// The line the report prints for such a run, or "" when it is not time-sliced.
std::string time_sliced_label(const Header& h, const std::string& mode, int n);

// The run's step time with its 95% CI: over the repeats' medians (--repeat K >= 2), else over
// the steps of its one run.
Estimate step_estimate(const RunResult& r);
// t_N / t_1 against its mode's 1-device run, and the overhead per added device
// (t_N - t_1) / N in microseconds, each with its CI; nullopt without a baseline or for N = 1.
// Repeats are paired (the N=1 and N runs of repeat k ran one after the other).
std::optional<Estimate> ratio_to_one(const std::vector<RunResult>& runs, const RunResult& r);
std::optional<Estimate> overhead_ci(const std::vector<RunResult>& runs, const RunResult& r);
// "1.83 (95% CI 1.62 to 2.05)", or "within noise (95% CI 0.97 to 1.04)" when the interval holds
// `null_value` (1 for a ratio, 0 for an overhead).
std::string describe(const Estimate& e, double null_value, int digits);

// One line comparing DP and DDP at the largest device count both ran, e.g. "mlp, batch 256, 4
// devices here: DDP is 1.80x faster than DP (95% CI 1.62 to 2.01); DP loses in communication
// (0.44 ms exposed)", or that they are within noise of each other; "" unless both modes ran.
std::string verdict(const Header& h, const std::vector<RunResult>& runs);

// Engine overhead per added device: (t_N - t_1) / N in microseconds, from the medians of the
// run and of its mode's 1-device run; nullopt without a baseline or for N = 1.
std::optional<double> overhead_us_per_device(const std::vector<RunResult>& runs,
                                             const RunResult& r);

// The compute a projection starts from: measured GPU runs, or the runs of a GPU results file
// (--project-from). CPU compute beside NVLink figures would read like a GPU prediction, so
// then there is none, and `why_not` says so.
struct ProjectionInput {
  std::vector<RunResult> runs;          // empty: no projection
  std::vector<RunResult> compute_runs;  // 1-device runs at the per-rank batches
  std::string source;                   // "measured on <gpu>" or "<file> (<gpu>, <model> <dtype>)"
  std::string why_not;
  std::string model;  // a results file's: the model its runs trained, and its parameters
  int64_t params = 0;
};
// requires a dp_bench JSON report's path. ensures its runs; throws naming the file when it is
// missing, not a regular file (a FIFO is not waited on), not such a report, a report of CPU
// devices, of no runs, or of runs whose figures no GPU run writes (untimed or negative phases
// among them). dp_bench calls it before any work (validate) and again for the projection.
ProjectionInput read_projection_file(const std::string& project_from);
// Throws unless the file's runs trained `model` with `params` parameters in `micro_batches`
// micro-batches per device or rank and step: a projection of another model, or of another
// step's compute, would read as this one's.
void check_projection_model(const ProjectionInput& in, const std::string& project_from,
                            const std::string& model, int64_t params, int micro_batches);
// Where --project-from takes the projection's compute from: this machine's runs (the flag
// empty), nowhere ("off": no projection, no compute runs), or a results file (its path).
enum class ProjectionFrom { this_machine, off, file };
ProjectionFrom projection_from(const std::string& project_from);
// requires project_from empty, off, or a dp_bench JSON file (throws naming the file otherwise).
ProjectionInput projection_input(const Header& h, const std::vector<RunResult>& runs,
                                 const std::string& project_from,
                                 const std::vector<RunResult>& compute_runs = {});

// What a figure rests on, as every report says it: the `libraries:` line and the CPU GEMM
// kernels' `warning:` line when narrower ones run, and the JSON's "environment".
void print_environment(std::ostream& os, const Header& h);
nlohmann::json environment_json(const Header& h);
void print_table(std::ostream& os, const Header& h, const std::vector<RunResult>& runs);
// Optimizer state per device or rank, beside the ZeRO paper's model of memory per rank in
// f32: parameters 4P + gradients 4P + optimizer state K P (K = 4 bytes for SGD's momentum, 8
// for AdamW's two moments), the last divided by N under ZeRO-1.
void print_memory_model(std::ostream& os, const std::vector<RunResult>& runs);
// --sync-bn: what the BatchNorm layers exchange per step.
void print_sync_bn(std::ostream& os, const std::vector<RunResult>& runs);
void print_projection(std::ostream& os, const ProjectionInput& in);

// What crosses between nodes per step, per node and direction, and its time on a link of
// `gbps` Gbit/s of payload (measured: bench_collectives across the nodes). DDP of N ranks in
// `nodes` nodes of N / nodes ranks each: one ring, whose edge out of each node carries
// 2 (N-1)/N x the payload; hybrid of `nodes` node processes: 2 (nodes-1)/nodes x the payload
// (the gradient once summed in the node). DP runs cross nothing and are left out.
struct LinkTime {
  std::string mode;
  int gpus = 0;
  int64_t bytes = 0;   // per node per step, out of the node
  double ms = 0;       // bytes at the link's rate
  double step_ms = 0;  // the run's measured median step, beside it
};
std::vector<LinkTime> link_times(const std::vector<RunResult>& runs, int nodes, double gbps);
void print_link_times(std::ostream& os, const std::vector<LinkTime>& times, int nodes, double gbps);
nlohmann::json link_times_json(const std::vector<LinkTime>& times, int nodes, double gbps);
nlohmann::json to_json(const Header& h, const std::vector<RunResult>& runs,
                       const ProjectionInput& projection);
nlohmann::json run_to_json(const RunResult& r);
RunResult run_from_json(const nlohmann::json& j);
// CSV of a sweep: mode,gpus,step_ms_median,step_ms_p90,samples_per_s,speedup,efficiency,...
// (speedup and efficiency empty for time-sliced runs, as in the report).
void write_sweep_csv(std::ostream& os, const Header& h, const std::vector<RunResult>& runs);

}  // namespace bench
