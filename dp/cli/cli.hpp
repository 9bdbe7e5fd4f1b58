// Checks for what a user types, shared by dp_bench, train_mnist, bench_collectives and the
// samples: CLI11 validators with readable messages, output paths opened before the run,
// overflow-checked products and memory sanity checks. All of it runs where input enters,
// before any work; the code behind it then assumes valid input.
//
//   app.add_option("--batch", o.batch)->check(dp::cli::whole_number(1, dp::cli::kMaxRows));
//   app.add_option("--json", o.json)->check(dp::cli::output_file());
//   int64_t rows = dp::cli::checked_product(per_device, "--batch-per-device", gpus, "--gpus",
//                                           dp::cli::kMaxRows);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "dp/distributed/launcher.hpp"
#include "kernels/runtime/device.hpp"
#include "kernels/runtime/dtype.hpp"
#include "kernels/runtime/memory_info.hpp"

namespace dp::cli {

class SlowNotice;  // progress.hpp

// The most rows a batch may have (2^31): far past any memory, and small enough that products
// with a row's size and a step count stay well inside int64.
constexpr int64_t kMaxRows = int64_t(1) << 31;
// The most devices (DP), ranks or nodes (DDP) a flag may ask for.
constexpr int kMaxDevices = 1024;

// A whole number in [lo, hi]. Refuses text, fractions and out-of-range values (negative ones
// included) by saying what was given and what is allowed:
//   "--batch: 0 is out of range: give a whole number in [1, 2147483648]"
//   "--epochs: 'abc' is not a whole number: give one in [1, 100000]"
CLI::Validator whole_number(int64_t lo, int64_t hi);

// The exit status of a command line CLI11 refused (an unknown flag, a value a validator
// refused, a missing argument): its message printed by app.exit, then 2, the usage error of
// getopt and argparse, for every program here (CLI11's own codes, 105-114, told nothing more);
// 0 for --help. A refusal after parsing (flags that contradict each other, a file that is not
// there) exits 1 with its message, as any error at run time does.
//   try { app.parse(argc, argv); } catch (const CLI::ParseError& e) { return parse_exit(app, e); }
int parse_exit(const CLI::App& app, const CLI::ParseError& e);
constexpr int kUsageExit = 2;

// On CPU devices, where the GEMM library runs kernels narrower than the CPU's vector
// instructions (kernels::cpu_blas_kernels), prints one line to stderr, "<program>: warning: ...",
// saying what to do; in a multi-process run only rank 0 prints it (first_rank_or_alone).
void warn_if_generic_gemm(const char* program, kernels::DeviceType type);

// Whether this process says what every rank would (notices, warnings, skipped files): it is in
// no torchrun, mpirun or Slurm job, or it is rank 0 of one (dp::dist::worker_env_from_environment,
// so OMPI_COMM_WORLD_RANK and SLURM_PROCID count as RANK does). Variables that do not parse
// count as rank 0: the rendezvous then names them.
bool first_rank_or_alone();

// A finite number in (0, hi]: "--lr: -0.1 is not allowed: give a number > 0 and <= 10".
CLI::Validator positive_number(double hi);
// A finite number in [lo, hi] (CLI::Range lets NaN through): "--clip-grad: nan is not allowed:
// give a number in [0, 1000000]".
CLI::Validator number_in(double lo, double hi);

// A timeout in seconds, in [0.001, hi]: the engine counts milliseconds, so a value below one
// (which would round to 0, "use the default") is refused, as DP_TIMEOUT refuses it:
//   "0.0001 is below the resolution of 0.001 s: give seconds in [0.001, 604800]"
CLI::Validator timeout_seconds(double hi);

// Mixed precision (nn/amp.hpp), one spelling for every program: --dtype fp32|tf32|bf16|fp16
// into `dtype` and --comm-dtype fp32|bf16 into `comm_dtype`, refused at parse time otherwise.
void add_precision_flags(CLI::App& app, std::string& dtype, std::string& comm_dtype);
// --max-skip-fraction F in [0, 1], into `max_skip_fraction` (unset: no limit). A run whose share
// of skipped steps (non-finite gradients, nn::check_skipped_steps) exceeds it ends with an error
// naming both fractions; over 5% is a warning either way. Beside the precision flags, for every
// program that trains.
void add_max_skip_fraction_flag(CLI::App& app, std::optional<double>& max_skip_fraction);
// Refuses --max-skip-fraction where no step is ever skipped: --dtype fp32 and tf32 take every
// step (no non-finite check), so the bound could not fail.
void check_max_skip_fraction(const std::optional<double>& max_skip_fraction,
                             const std::string& dtype);
// Where DDP workers run, one spelling for every program that launches them: --nnodes,
// --node-rank, --master-addr, --master-port, --max-local-ranks and --max-restarts, bound into
// `launch` and bounded at parse time (nodes and ranks by kMaxDevices).
void add_launch_flags(CLI::App& app, dp::dist::LaunchOptions& launch);
// The dtype gradients travel in for a --comm-dtype value: f32 or bf16.
kernels::DType comm_dtype(const std::string& value);
// --activations f32|bf16 into `activations`, refused at parse time otherwise: bf16 keeps the
// activations between layers in bf16 (nn::Activations::compute), as PyTorch's autocast.
void add_activations_flag(CLI::App& app, std::string& activations);
// --hybrid-procs K: node processes --mode hybrid starts on this machine (0: automatic).
void add_hybrid_procs_flag(CLI::App& app, int& procs);
// --micro-batches K in [1, 2^20]: gradient accumulation (DataParallelOptions::micro_batches,
// DdpTrainer::set_micro_batches), one help text for every program that trains through them;
// `modes` says which of the program's modes take it ("DP, DDP and hybrid").
void add_micro_batches_flag(CLI::App& app, int& micro_batches, const std::string& modes);
// The node processes to start here: the flag's K, else 2 with one node (hybrid tried on one
// machine) and 1 per real node.
int hybrid_procs(int flag, int nnodes);
// The dtype activations travel in for an --activations value with a --dtype value: f32, or
// bf16 (which needs --dtype bf16: the activations take the compute dtype). Throws naming both.
kernels::DType activations_dtype(const std::string& activations, const std::string& dtype);

// What an output flag writes. A file already at the path is replaced only when it is empty or
// one of the project's programs wrote it, told by its content: the programs' mark where the
// format has room for one ("program" in a report, "otherData" in a trace, the training state's
// "format"), else the exact shape they write (the sweep table's header, the step log's keys).
// Any other file is refused, never replaced:
//   "'notes.txt' exists and is not a report of dp_bench or train_mnist (it is not JSON): it is
//    never replaced; remove it yourself, or give another path"
enum class Output {
  report,          // --json: dp_bench's or train_mnist's JSON report
  trace,           // --trace: a Chrome/Perfetto trace (dp::write_chrome_trace)
  step_log,        // --log: one JSON object per step (StepLog)
  sweep_table,     // --csv: dp_bench's sweep table
  sweep_chart,     // --chart: the sweep chart drawn by gnuplot (SVG or PNG)
  gnuplot_script,  // the chart's script, written beside it and removed after gnuplot ran
  training_state,  // --save: nn::save_training_state's safetensors file
};
// What stops an existing file at `path` from being replaced by a `kind` output, or "" (no file,
// an empty one, one that is not regular, or one the programs wrote).
std::string existing_output_problem(const std::string& path, Output kind);
// Where an output's folder may be: one that exists, or (or_checkpoint_dir) also the run's
// --checkpoint-dir, which the run creates with its parents before any work (--log DIR/log.jsonl
// beside its checkpoints). A program that uses or_checkpoint_dir calls check_outside_checkpoints
// after parsing, which refuses a missing folder that is not the checkpoint folder.
enum class OutputDir { exists, or_checkpoint_dir };
// An output file that can be written: refuses an empty path, a directory, a missing parent
// directory (see OutputDir), a path that cannot be opened for writing (with the system's reason)
// and an existing file that is not a `kind` output (existing_output_problem). The check opens
// the file without truncating it; a file that did not exist is created and removed again.
CLI::Validator output_file(Output kind, OutputDir where = OutputDir::exists);
// The same check for a path that is not a flag's text (a default name, say); throws
// kernels::Error naming `flag`.
void check_output_file(const std::string& flag, const std::string& path, Output kind);
// A file written whole and renamed over the old one (training state, checkpoints: --save): the
// output_file(Output::training_state) checks, and only a regular file (or a symbolic link to
// one, or none) may be there; a device, a FIFO or a socket is refused
// (nn::io::replace_problem), never replaced.
CLI::Validator replaceable_file();
// What stops a save of `program`'s `model` from replacing the training state at `path`, or ""
// (no file, a state of the same program and model, or one whose header cannot be read: a
// damaged save). A state of another program or model is another run's, which a mistyped path
// would wipe. A file that is no training state is replaceable_file's to refuse.
std::string state_owner_problem(const std::string& path, const std::string& program,
                                const std::string& model);
// Throws, naming `flag`, the file and both sizes, when the file system that would hold `path`
// has fewer than `bytes` free for an unprivileged writer: a save found at the end of a run not
// to fit loses the run. (The file is written whole beside the old one, then renamed over it.)
void check_free_space(const std::string& flag, const std::string& path, uint64_t bytes);
// A flag and the path it was given.
struct FlagPath {
  std::string flag, path;
};
// Throws kernels::Error when two of `files` name one regular file (the same path, or two names
// of one file), naming both flags: one output would replace the other, or the file a run reads.
// Empty paths and files that are not regular (/dev/null, a FIFO) are left out.
void check_distinct_files(const std::vector<FlagPath>& files);
// Throws kernels::Error, naming the flag, when one of `outputs` has a missing folder other than
// `checkpoint_dir` (which the run creates), or would be a checkpoint of `checkpoint_dir`
// (step_N.safetensors in it, which the run writes, and --keep removes). "" dir: no checkpoints.
void check_outside_checkpoints(const std::vector<FlagPath>& outputs,
                               const std::string& checkpoint_dir);

// The folder checkpoints go to, one spelling for every program: --checkpoint-dir DIR, with a
// validator that refuses an empty path, a path that is a file, and one under a file; a missing
// folder is accepted (nn::CheckpointDirLock creates it with its parents, proves it writable and
// locks it for the job before any work). Returns the option, for ->excludes() and the like.
CLI::Option* add_checkpoint_dir_flag(CLI::App& app, std::string& dir, const std::string& help);
// That validator alone.
CLI::Validator checkpoint_dir();

// The one way a program writes an output file (--json, --trace, --csv, a chart, a log):
// writes `text` to `path`, checking every write, the flush and the close; a regular file is
// replaced atomically (a failure leaves no partial file). Throws kernels::Error naming `flag`,
// the file and the system's reason ("--json(/dev/full): writing failed after 0 of 812 bytes:
// No space left on device"). Print "json: PATH" only after it returned.
void write_output(const std::string& flag, const std::string& path, const std::string& text);
// Flushes stdout and throws kernels::Error naming `program` when anything printed to it was
// lost (stdout redirected to a full disk or /dev/full, a closed pipe): call before exiting 0.
void check_stdout(const std::string& program);

// a x b, refused when it exceeds `hi` (or int64): "--batch-per-device 1073741824 x --gpus 4 =
// 4294967296 rows is more than 2147483648". requires a, b >= 0, hi > 0.
int64_t checked_product(int64_t a, const std::string& a_name, int64_t b, const std::string& b_name,
                        int64_t hi);

// "1.5 GiB", "640 KiB", "12 B".
std::string human_bytes(int64_t bytes);

// Throws kernels::Error when `need` bytes are more than `available` holds:
//   "<what> needs at least 2.8 TiB, but the host has 19.3 GiB (MemAvailable in /proc/meminfo);
//    <hint>"
// `where` names the memory: "the host", "GPU 0".
void check_fits(const std::string& what, int64_t need, const std::string& where,
                const kernels::AvailableMemory& available, const std::string& hint);

// The memory one CPU device takes for a step, measured: `peak_of(rows)` runs one step of `rows`
// rows on a fresh one-device engine and returns the peak bytes the caller counts (the engine's,
// with or without its optimizer's state). A row's cost is the difference between 2 rows and 1;
// the rest is fixed.
struct StepMemory {
  int64_t fixed = 0, per_row = 0;
};
StepMemory measure_step_memory(const std::function<int64_t(int64_t rows)>& peak_of);
// What a memory probe says when it takes 5 s or more (progress.hpp's SlowNotice), by rank 0
// alone (first_rank_or_alone): "<program>: measuring a step's memory on <device> (probe steps of 1
// and 2 rows) to check the run fits". Held while the probe runs.
std::unique_ptr<SlowNotice> probe_notice(const std::string& program, const std::string& device);
// The rows a device holds of a `chunk`-row chunk run in `micro_batches` micro-batches, as the
// memory checks say them: "C rows", or "R rows (one micro-batch of a C-row chunk)".
std::string held_rows_text(int64_t chunk, int micro_batches);
// The memory checks' advice: a smaller batch, and more micro-batches while one holds more than
// a row (`rows`, as held_rows_text counts them).
std::string fits_advice(int64_t rows);
// Throws check_fits's message, naming the figures, when `devices` devices each holding the
// activations of one of `micro_batches` micro-batches of a `chunk`-row chunk exceed `memory` (of
// `where`: "the host", "GPU 0"): "<what> (N x (fixed + rows x per_row), measured on a probe step)
// needs at least ...", the rows "R rows (one micro-batch of a C-row chunk)" under
// accumulation, and the advice more micro-batches too while one holds more than a row.
void check_step_fits(const std::string& what, const StepMemory& m, int devices, int64_t chunk,
                     int micro_batches, const std::string& where,
                     const kernels::AvailableMemory& memory);
// The logical devices GPU 0 holds of `devices` shared round-robin by `physical` GPUs (the most
// any GPU holds).
int logical_on_gpu0(int devices, int physical);
// A step's memory measured on GPU 0 (peak_of as measure_step_memory's), or nothing when the
// probe fails: that is said in one line on stderr, "<program>: the memory probe step on GPU 0
// failed (<why>): <instead>", and the caller checks without it (the run meets the same failure
// and names it).
std::optional<StepMemory> probe_gpu0(const std::string& program, const std::string& instead,
                                     const std::function<int64_t(int64_t rows)>& peak_of);
// A training program's check before it trains: `devices` devices of `type`, each with a
// `chunk`-row chunk in `micro_batches` micro-batches (check_step_fits), against the memory that
// holds them. peak_of(device, rows) runs one step of `rows` rows on a fresh one-device engine on
// `device` and returns the peak bytes it counts.
// The message names "<what> (<mode> on N CPU device(s))", or "... N CUDA device(s), K on GPU 0)".
// - CPU devices: measured on cpu:0, against the host (what a run past it meets is the OOM
//   killer, rc 137 and no message).
// - CUDA devices: measured on GPU 0, which holds ceil(devices / physical GPUs) of them (logical
//   devices share the GPUs round-robin), against its memory. Only for a process that holds the
//   run's devices itself (not a DDP launcher, which creates no CUDA context). A probe that fails
//   is said in one line on stderr under `program`'s name and the check is skipped: the run
//   meets the same failure and names it.
void check_run_fits(const std::string& program, const std::string& what, const std::string& mode,
                    kernels::DeviceType type, int devices, int64_t chunk, int micro_batches,
                    const std::function<int64_t(kernels::Device, int64_t rows)>& peak_of);

}  // namespace dp::cli
