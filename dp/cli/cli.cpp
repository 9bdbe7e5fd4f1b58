#include "dp/cli/cli.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dp/cli/progress.hpp"
#include "kernels/ops.hpp"
#include "kernels/runtime/error.hpp"
#include "nn/file_io.hpp"
#include "nn/train_state.hpp"

namespace dp::cli {

namespace {

std::string range_text(int64_t lo, int64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

enum class Low { open, closed };  // whether `lo` itself is allowed

// "" when `text` is a finite number in (lo, hi] or [lo, hi] (stored in *value); else what is
// wrong with it, ending with `allowed`.
std::string number_problem(const std::string& text, double lo, Low low, double hi,
                           const std::string& allowed, double* value) {
  char* end = nullptr;
  errno = 0;
  *value = std::strtod(text.c_str(), &end);
  if (text.empty() || !end || *end != '\0') return "'" + text + "' is not a number: " + allowed;
  const bool above_lo = low == Low::open ? *value > lo : *value >= lo;
  if (!std::isfinite(*value) || errno == ERANGE || !above_lo || *value > hi)
    return text + " is not allowed: " + allowed;
  return "";
}

// What is wrong with `text` as a whole number in [lo, hi], or "".
std::string whole_number_problem(const std::string& text, int64_t lo, int64_t hi) {
  const char* b = text.data();
  const char* e = b + text.size();
  if (b != e && *b == '+') ++b;  // from_chars takes '-' but not '+'
  int64_t v = 0;
  auto [end, ec] = std::from_chars(b, e, v);
  if (ec == std::errc::result_out_of_range)
    return text + " is out of range: give a whole number in " + range_text(lo, hi);
  if (ec != std::errc() || end != e || b == e)
    return "'" + text + "' is not a whole number: give one in " + range_text(lo, hi);
  if (v < lo || v > hi)
    return text + " is out of range: give a whole number in " + range_text(lo, hi);
  return "";
}

std::string number_text(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

std::string parent_directory(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Why `path` cannot be written when its directory `dir` could not be read (stat's `error`).
std::string missing_dir_problem(const std::string& path, const std::string& dir, int error) {
  return "cannot write '" + path + "': its directory '" + dir + "' " +
         (error == ENOENT ? std::string("does not exist") : std::strerror(error));
}

// What stops `path` from being written, or "". A missing parent directory is no problem with
// OutputDir::or_checkpoint_dir (check_outside_checkpoints judges it).
std::string output_file_problem(const std::string& path, OutputDir where = OutputDir::exists) {
  if (path.empty()) return "the path is empty: give a file name";
  // An existing file is opened for writing. It may vanish between stat and open (another DDP
  // rank's probe, below, removed again): then look again, and it is checked as a new file.
  for (int attempt = 0; attempt < 8; ++attempt) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) break;
    if (S_ISDIR(st.st_mode))
      return "'" + path + "' is a directory: give a file name inside it, e.g. " + path +
             (path.back() == '/' ? "" : "/") + "out.json";
    // A FIFO is not opened: opening and closing it would end a reader that reads once. Its
    // reader is waited for when the run writes (nn::io::write_output_file, bounded).
    if (S_ISFIFO(st.st_mode))
      return ::access(path.c_str(), W_OK) == 0
                 ? ""
                 : "'" + path + "' cannot be written: " + std::strerror(errno);
    // O_NONBLOCK: a device that needs a reader fails at once instead of blocking.
    int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      ::close(fd);
      return "";
    }
    if (errno != ENOENT) return "'" + path + "' cannot be written: " + std::strerror(errno);
  }
  std::string dir = parent_directory(path);
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0) {
    if (errno == ENOENT && where == OutputDir::or_checkpoint_dir) return "";
    return missing_dir_problem(path, dir, errno);
  }
  if (!S_ISDIR(ds.st_mode)) return "cannot write '" + path + "': '" + dir + "' is not a directory";
  // A probe, created and removed: the run writes the file at its end. DDP ranks parse the same
  // flags at once, so another process may hold the probe right now (EEXIST): then the file is
  // checked as an existing one, and the probe tried again if it went away meanwhile.
  for (int attempt = 0; attempt < 8; ++attempt) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::close(fd);
      ::unlink(path.c_str());
      return "";
    }
    if (errno != EEXIST) return "cannot create '" + path + "': " + std::strerror(errno);
    fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      ::close(fd);
      return "";
    }
    if (errno != ENOENT) return "'" + path + "' cannot be written: " + std::strerror(errno);
  }
  return "cannot create '" + path + "': it keeps appearing and vanishing";
}

}  // namespace

void add_precision_flags(CLI::App& app, std::string& dtype, std::string& comm_dtype) {
  app.add_option("--dtype", dtype,
                 "fp32 | tf32 (TF32 GEMMs on a GPU) | bf16 | fp16: mixed precision with f32 master "
                 "weights (fp16 with loss scaling)")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}));
  app.add_option("--comm-dtype", comm_dtype,
                 "fp32 | bf16: gradients travel between devices (DP) and ranks (DDP) in bf16, as "
                 "PyTorch's bf16 compress hook")
      ->check(CLI::IsMember({"fp32", "bf16"}));
}

void add_max_skip_fraction_flag(CLI::App& app, std::optional<double>& max_skip_fraction) {
  app.add_option("--max-skip-fraction", max_skip_fraction,
                 "fp16/bf16: fail the run (non-zero exit) when more than this fraction of its "
                 "steps were skipped for non-finite gradients (default: no limit; over 0.05 warns)")
      ->check(CLI::Validator(
          [](std::string& text) {
            double v = 0;
            return number_problem(text, 0, Low::closed, 1, "", &v).empty()
                       ? std::string()
                       : "'" + text + "' is not a fraction: give a number in [0, 1]";
          },
          "[0, 1]"));
}

void check_max_skip_fraction(const std::optional<double>& max_skip_fraction,
                             const std::string& dtype) {
  DP_CHECK(!max_skip_fraction || dtype == "bf16" || dtype == "fp16",
           "--max-skip-fraction " << *max_skip_fraction << " with --dtype " << dtype
                                  << ": fp32 and tf32 runs take every step (no non-finite check), "
                                     "so nothing would be bounded; give --dtype bf16 or fp16, or "
                                     "drop it");
}

void add_launch_flags(CLI::App& app, dp::dist::LaunchOptions& launch) {
  app.add_option("--nnodes", launch.nnodes,
                 "ddp: nodes (run this program on each with its --node-rank)")
      ->check(whole_number(1, kMaxDevices));
  app.add_option("--node-rank", launch.node_rank, "ddp: this node's index in [0, nnodes)")
      ->check(whole_number(0, kMaxDevices - 1));
  app.add_option("--master-addr", launch.master_addr, "ddp: node 0's address (rendezvous store)");
  app.add_option("--master-port", launch.master_port,
                 "ddp: node 0's port (0: a free one, one node)")
      ->check(whole_number(0, 65535));
  app.add_option("--max-local-ranks", launch.max_local_ranks,
                 "ddp: most ranks to start on this node (default: from its cores and memory)")
      ->check(whole_number(1, kMaxDevices));
  app.add_option("--max-restarts", launch.max_restarts,
                 "ddp: start all ranks again after one fails, up to this many times (several "
                 "nodes agree through node 0 at --master-port + 1; workers see "
                 "DP_RESTART_COUNT)")
      ->check(whole_number(0, dp::dist::kMaxRestarts));
}

kernels::DType comm_dtype(const std::string& value) {
  DP_CHECK(value == "fp32" || value == "bf16", "--comm-dtype " << value << ": choose fp32 or bf16");
  return value == "bf16" ? kernels::DType::bf16 : kernels::DType::f32;
}

void add_hybrid_procs_flag(CLI::App& app, int& procs) {
  app.add_option("--hybrid-procs", procs,
                 "--mode hybrid: node processes started here, each a DP engine over --gpus "
                 "devices (0: 2 with --nnodes 1, to try it on one machine; 1 per real node)")
      ->check(whole_number(0, 64));
}

void add_micro_batches_flag(CLI::App& app, int& micro_batches, const std::string& modes) {
  app.add_option("--micro-batches", micro_batches,
                 modes +
                     ": gradient accumulation. Each device or rank runs its chunk of a step as "
                     "this many micro-batches, one after another, their gradients summed before "
                     "the one reduction and update: one micro-batch's activations in memory at a "
                     "time, the same global batch and loss curve")
      ->check(whole_number(1, 1 << 20));
}

int hybrid_procs(int flag, int nnodes) {
  return flag > 0 ? flag : nnodes == 1 ? 2 : 1;
}

void add_activations_flag(CLI::App& app, std::string& activations) {
  app.add_option(
         "--activations", activations,
         "f32 | bf16: with --dtype bf16, Linear, Conv, the activations, pooling, dropout, "
         "bias-add, LayerNorm and the GPT's residual stream keep bf16 between layers "
         "(the cross-entropies read bf16 logits and write their gradient in bf16; BatchNorm, "
         "other losses and the optimizer stay f32)")
      ->check(CLI::IsMember({"f32", "bf16"}));
}

kernels::DType activations_dtype(const std::string& activations, const std::string& dtype) {
  DP_CHECK(activations == "f32" || activations == "bf16",
           "--activations " << activations << ": choose f32 or bf16");
  DP_CHECK(activations == "f32" || dtype == "bf16",
           "--activations bf16 with --dtype " << dtype
                                              << ": bf16 activations need --dtype bf16 (they take "
                                                 "the compute dtype)");
  return activations == "bf16" ? kernels::DType::bf16 : kernels::DType::f32;
}

int parse_exit(const CLI::App& app, const CLI::ParseError& e) {
  const int code = app.exit(e);  // prints help to stdout, an error to stderr
  return code == static_cast<int>(CLI::ExitCodes::Success) ? 0 : kUsageExit;
}

CLI::Validator whole_number(int64_t lo, int64_t hi) {
  return CLI::Validator([lo, hi](std::string& text) { return whole_number_problem(text, lo, hi); },
                        range_text(lo, hi));
}

CLI::Validator positive_number(double hi) {
  return CLI::Validator(
      [hi](std::string& text) {
        double v = 0;
        return number_problem(text, 0, Low::open, hi, "give a number > 0 and <= " + number_text(hi),
                              &v);
      },
      "(0, " + number_text(hi) + "]");
}

bool first_rank_or_alone() {
  try {
    const std::optional<dist::WorkerEnv> w = dist::worker_env_from_environment();
    return !w || w->rank == 0;
  } catch (const std::exception&) {
    return true;
  }
}

void warn_if_generic_gemm(const char* program, kernels::DeviceType type) {
  if (type != kernels::DeviceType::cpu || !first_rank_or_alone()) return;
  const kernels::BlasKernels k = kernels::cpu_blas_kernels();
  if (!k.warning.empty()) std::fprintf(stderr, "%s: warning: %s\n", program, k.warning.c_str());
}

CLI::Validator number_in(double lo, double hi) {
  const std::string range = "[" + number_text(lo) + ", " + number_text(hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& text) {
        double v = 0;
        return number_problem(text, lo, Low::closed, hi, "give a number in " + range, &v);
      },
      range);
}

CLI::Validator timeout_seconds(double hi) {
  return CLI::Validator(
      [hi](std::string& text) -> std::string {
        const std::string allowed = "give seconds in [0.001, " + number_text(hi) + "]";
        double v = 0;
        if (std::string problem = number_problem(text, 0, Low::open, hi, allowed, &v);
            !problem.empty())
          return problem;
        if (v * 1000.0 < 1.0)
          return text + " is below the resolution of 0.001 s (it would round to 0, the " +
                 "default): " + allowed;
        return "";
      },
      "[0.001, " + number_text(hi) + "]");
}

namespace {

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

const char* output_what(Output kind) {
  switch (kind) {
    case Output::report:
      return "a report of dp_bench, train_mnist, bench_kernels or bench_composed";
    case Output::trace:
      return "a trace of dp_bench";
    case Output::step_log:
      return "a step log of train_text or train_mnist";
    case Output::sweep_table:
      return "a sweep table of dp_bench";
    case Output::sweep_chart:
      return "a sweep chart of dp_bench";
    case Output::gnuplot_script:
      return "a chart script of dp_bench";
    case Output::training_state:
      return "a training state of this project's programs";
  }
  return "an output of this program";
}

// Why `head` (the file's first bytes; `size` its whole size) is not a `kind` output, or "".
std::string not_ours(Output kind, const std::string& head, uint64_t size) {
  switch (kind) {
    case Output::report: {
      if (size > head.size()) return "it is larger than any report";
      auto j = nlohmann::json::parse(head, nullptr, false);
      if (j.is_discarded()) return "it is not JSON";
      if (!j.is_object()) return "it is not a JSON object";
      auto program = j.find("program");
      if (program != j.end())
        return program->is_string() && (*program == "dp_bench" || *program == "train_mnist" ||
                                        *program == "bench_kernels" || *program == "bench_composed")
                   ? ""
                   : "its \"program\" is not one of this project's";
      // Reports written before they named their program.
      if (j.contains("ddp_step_time") && j.contains("runs")) return "";           // dp_bench
      if (j.value("mode", "") == "ps" && j.contains("max_staleness")) return "";  // dp_bench ps
      if (j.contains("test_accuracy") && j.contains("train_loss")) return "";     // train_mnist
      return "it names no \"program\"";
    }
    case Output::trace:
      if (head.find("\"otherData\":{\"program\":\"dptrain\"") != std::string::npos) return "";
      // Traces written before they carried the mark: nlohmann's sorted keys, as written.
      if (starts_with(head, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")) return "";
      return "it has no \"otherData\": {\"program\": \"dptrain\"}";
    case Output::step_log: {
      // The first line, or its start while a DDP rank that logs is writing it.
      if (!starts_with(head, "{\"step\":")) return "it does not start with {\"step\":";
      const auto eol = head.find('\n');
      if (eol == std::string::npos) return size > head.size() ? "its first line is too long" : "";
      auto j = nlohmann::json::parse(head.substr(0, eol), nullptr, false);
      for (const char* key : {"loss", "lr", "grad_norm", "loss_scale"})
        if (j.is_discarded() || !j.is_object() || !j.contains(key))
          return std::string("its first line has no \"") + key + "\"";
      return "";
    }
    case Output::sweep_table:
      return starts_with(head, "mode,gpus,batch,step_ms_median,") ? ""
                                                                  : "its header is not the sweep's";
    case Output::sweep_chart:
      if (starts_with(head, "\x89PNG\r\n\x1a\n")) return "";  // pngcairo's, unmarked
      return head.find("Produced by GNUPLOT") != std::string::npos
                 ? ""
                 : "it is neither a PNG nor an SVG drawn by gnuplot";
    case Output::gnuplot_script:
      return starts_with(head, "set terminal ") ? "" : "it is not a gnuplot script";
    case Output::training_state:
      return nn::is_training_state_head(head) ? "" : "it has no __metadata__ format dptrain-...";
  }
  return "";
}

}  // namespace

std::string existing_output_problem(const std::string& path, Output kind) {
  struct stat st {};
  if (path.empty() || ::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0)
    return "";
  // A report is read whole (they are kilobytes); the others by their start.
  constexpr size_t kReportLimit = size_t{256} << 20, kHeadLimit = size_t{1} << 20;
  static_assert(kHeadLimit == nn::kTrainingStateHeadBytes, "save_training_state's bytes");
  const std::string head =
      kernels::io::read_head(path, kind == Output::report ? kReportLimit : kHeadLimit);
  if (head.empty()) return "'" + path + "' exists and cannot be read: it is never replaced unread";
  const std::string why = not_ours(kind, head, static_cast<uint64_t>(st.st_size));
  if (why.empty()) return "";
  return "'" + path + "' exists and is not " + output_what(kind) + " (" + why +
         "): it is never replaced; remove it yourself, or give another path";
}

namespace {

// The first of output_file_problem's and existing_output_problem's answers that is a problem.
std::string output_problem(const std::string& path, Output kind,
                           OutputDir where = OutputDir::exists) {
  const std::string problem = output_file_problem(path, where);
  return problem.empty() ? existing_output_problem(path, kind) : problem;
}

}  // namespace

CLI::Validator output_file(Output kind, OutputDir where) {
  return CLI::Validator(
      [kind, where](std::string& path) { return output_problem(path, kind, where); }, "FILE");
}

void check_output_file(const std::string& flag, const std::string& path, Output kind) {
  const std::string problem = output_problem(path, kind);
  DP_CHECK(problem.empty(), flag << ": " << problem);
}

CLI::Validator replaceable_file() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        const std::string problem = nn::io::replace_problem(path);
        if (!problem.empty()) return "'" + path + "' " + problem;
        return output_problem(path, Output::training_state);
      },
      "FILE");
}

std::string state_owner_problem(const std::string& path, const std::string& program,
                                const std::string& model) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return "";
  std::map<std::string, std::string> metadata;
  try {
    nn::io::FileReader r(path, "--save");
    metadata = nn::safetensors::read(r).metadata;
  } catch (const std::exception&) {
    return "";  // a damaged state (replaceable_file took it for one): a save may replace it
  }
  auto saved = [&](const std::string& key) {
    auto it = metadata.find("config." + key);
    return it == metadata.end() ? std::string() : it->second;
  };
  if (saved("program") == program && saved("model") == model) return "";
  auto named = [](const std::string& v) { return v.empty() ? std::string("(none)") : v; };
  return "'" + path + "' holds a training state of " + named(nn::io::printable(saved("program"))) +
         "'s model " + named(nn::io::printable(saved("model"))) + ", not of this run's " + program +
         " " + model + ": it is never replaced; remove it yourself, or give another path";
}

void check_free_space(const std::string& flag, const std::string& path, uint64_t bytes) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return;  // the write will say what is wrong
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  auto mb = [](uint64_t b) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f MB", static_cast<double>(b) / 1e6);
    return std::string(text);
  };
  DP_CHECK(free_bytes >= bytes, flag << ": writing '" << path << "' needs about " << mb(bytes)
                                     << ", but its file system (" << dir.string() << ") has "
                                     << mb(free_bytes)
                                     << " free: free some space, or give another path");
}

namespace {

// Whether `a` and `b` name one file or folder (one inode), or would once written.
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  const bool has_a = ::stat(a.c_str(), &sa) == 0, has_b = ::stat(b.c_str(), &sb) == 0;
  if (has_a && has_b) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  if (has_a != has_b) return false;  // one exists and the other does not: two names
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(std::filesystem::absolute(a, ea), ea);
  const auto cb = std::filesystem::weakly_canonical(std::filesystem::absolute(b, eb), eb);
  return !ea && !eb ? ca == cb : a == b;
}

// Whether `path` is a regular file or nothing yet (a file the run would create).
bool regular_or_missing(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode);
}

}  // namespace

void check_distinct_files(const std::vector<FlagPath>& files) {
  for (size_t i = 0; i < files.size(); ++i)
    for (size_t k = i + 1; k < files.size(); ++k) {
      const FlagPath &a = files[i], &b = files[k];
      if (a.path.empty() || b.path.empty() || !regular_or_missing(a.path) ||
          !same_file(a.path, b.path))
        continue;
      DP_THROW(a.flag << " " << a.path << " and " << b.flag << " " << b.path
                      << " name one file: one would replace the other; give each its own path");
    }
}

void check_outside_checkpoints(const std::vector<FlagPath>& outputs,
                               const std::string& checkpoint_dir) {
  // An output whose folder is missing (output_file's OutputDir::or_checkpoint_dir let it by):
  // fine in the checkpoint folder, which the run creates before any work; refused elsewhere.
  auto no_trailing_slash = [](std::string path) {  // "ck/" and "ck//x" name the folder "ck"
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    return path;
  };
  const std::string folder = no_trailing_slash(checkpoint_dir);
  for (const FlagPath& o : outputs) {
    if (o.path.empty()) continue;
    const std::string dir = parent_directory(o.path);
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      const int error = errno;
      DP_CHECK(error == ENOENT && !folder.empty() && same_file(no_trailing_slash(dir), folder),
               o.flag << ": " << missing_dir_problem(o.path, dir, error));
    }
  }
  if (checkpoint_dir.empty()) return;
  for (const FlagPath& o : outputs) {
    if (o.path.empty()) continue;
    const std::filesystem::path p(o.path);
    if (nn::detail::checkpoint_step(p.filename().string()) < 0) continue;
    const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
    DP_CHECK(!same_file(dir, checkpoint_dir),
             o.flag << " " << o.path << " is a checkpoint's name in --checkpoint-dir "
                    << checkpoint_dir << ", where the run writes its checkpoints and --keep "
                    << "removes old ones: give the file another name or folder");
  }
}

CLI::Validator checkpoint_dir() {
  return CLI::Validator(
      [](std::string& dir) -> std::string {
        if (dir.empty()) return "the path is empty: give a folder";
        struct stat st {};
        if (::stat(dir.c_str(), &st) == 0)
          return S_ISDIR(st.st_mode) ? "" : "'" + dir + "' exists and is not a folder";
        // Missing: created at the start of the run, unless something on its way is a file.
        std::string up = dir;
        while (true) {
          std::string parent = parent_directory(up);
          if (parent == up) break;
          if (::stat(parent.c_str(), &st) == 0) {
            if (!S_ISDIR(st.st_mode))
              return "cannot create '" + dir + "': '" + parent + "' is not a folder";
            break;
          }
          up = parent;
          if (up == "." || up == "/") break;
        }
        return "";
      },
      "DIR");
}

CLI::Option* add_checkpoint_dir_flag(CLI::App& app, std::string& dir, const std::string& help) {
  return app.add_option("--checkpoint-dir", dir, help)->check(checkpoint_dir());
}

void write_output(const std::string& flag, const std::string& path, const std::string& text) {
  nn::io::write_output_file(path, text, flag);
}

void check_stdout(const std::string& program) {
  errno = 0;
  const bool ok = std::fflush(stdout) == 0 && !std::ferror(stdout);
  const int e = errno;
  DP_CHECK(ok, program << ": writing to stdout failed: "
                       << (e ? std::strerror(e) : "the stream is in error"));
}

int64_t checked_product(int64_t a, const std::string& a_name, int64_t b, const std::string& b_name,
                        int64_t hi) {
  DP_CHECK(a >= 0 && b >= 0 && hi > 0,
           "checked_product: " << a_name << " " << a << " x " << b_name << " " << b);
  int64_t p = 0;
  bool overflow = __builtin_mul_overflow(a, b, &p);
  DP_CHECK(!overflow && p <= hi,
           a_name << " " << a << " x " << b_name << " " << b << " = "
                  << (overflow ? std::string("more than 2^63") : std::to_string(p))
                  << " is more than the " << hi << " allowed");
  return p;
}

std::string human_bytes(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(v) >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  std::ostringstream os;
  os.precision(u == 0 ? 0 : 1);
  os << std::fixed << v << " " << kUnits[u];
  return os.str();
}

void check_fits(const std::string& what, int64_t need, const std::string& where,
                const kernels::AvailableMemory& available, const std::string& hint) {
  DP_CHECK(need <= available.bytes, what << " needs at least " << human_bytes(need) << ", but "
                                         << where << " has " << human_bytes(available.bytes) << " ("
                                         << available.source << ")" << (hint.empty() ? "" : "; ")
                                         << hint);
}

StepMemory measure_step_memory(const std::function<int64_t(int64_t rows)>& peak_of) {
  const int64_t one = peak_of(1), two = peak_of(2);
  StepMemory m;
  m.per_row = std::max<int64_t>(0, two - one);
  m.fixed = std::max<int64_t>(0, one - m.per_row);
  return m;
}

std::unique_ptr<SlowNotice> probe_notice(const std::string& program, const std::string& device) {
  return std::make_unique<SlowNotice>(program + ": measuring a step's memory on " + device +
                                          " (probe steps of 1 and 2 rows) to check the run fits",
                                      first_rank_or_alone() ? stderr : nullptr);
}

std::string held_rows_text(int64_t chunk, int micro_batches) {
  if (micro_batches <= 1) return std::to_string(chunk) + " rows";
  return std::to_string((chunk + micro_batches - 1) / micro_batches) +
         " rows (one micro-batch of a " + std::to_string(chunk) + "-row chunk)";
}

std::string fits_advice(int64_t rows) {
  return rows > 1 ? "give a smaller batch, or more --micro-batches (a device holds one "
                    "micro-batch's activations at a time)"
                  : "give a smaller batch";
}

void check_step_fits(const std::string& what, const StepMemory& m, int devices, int64_t chunk,
                     int micro_batches, const std::string& where,
                     const kernels::AvailableMemory& memory) {
  const int64_t rows = (chunk + micro_batches - 1) / micro_batches;  // one micro-batch's
  const int64_t rows_bytes =
      checked_product(rows, "rows per device", m.per_row, "bytes per row",
                      std::numeric_limits<int64_t>::max() / (2 * int64_t{devices} + 2));
  check_fits(what + " (" + std::to_string(devices) + " x (" + human_bytes(m.fixed) +
                 " for the model and optimizer + " + held_rows_text(chunk, micro_batches) + " x " +
                 human_bytes(m.per_row) + "), measured on a probe step)",
             devices * (m.fixed + rows_bytes), where, memory, fits_advice(rows));
}

void check_run_fits(const std::string& program, const std::string& what, const std::string& mode,
                    kernels::DeviceType type, int devices, int64_t chunk, int micro_batches,
                    const std::function<int64_t(kernels::Device, int64_t rows)>& peak_of) {
  if (type == kernels::DeviceType::cpu) {
    const auto notice = probe_notice(program, "cpu:0");
    const StepMemory step =
        measure_step_memory([&](int64_t r) { return peak_of(kernels::Device::cpu(0), r); });
    return check_step_fits(
        what + " (" + mode + " on " + std::to_string(devices) + " CPU device(s))", step, devices,
        chunk, micro_batches, "the host", kernels::host_memory_available());
  }
  const int physical = kernels::cuda_device_count();
  if (physical < 1) return;  // the run says why it has no GPU
  const int on_gpu0 = logical_on_gpu0(devices, physical);
  const std::optional<StepMemory> step = probe_gpu0(program, "training without it", [&](int64_t r) {
    return peak_of(kernels::Device::cuda(0), r);
  });
  if (!step) return;
  check_step_fits(what + " (" + mode + " on " + std::to_string(devices) + " CUDA device(s), " +
                      std::to_string(on_gpu0) + " on GPU 0)",
                  *step, on_gpu0, chunk, micro_batches, "GPU 0", kernels::gpu_memory(0));
}

int logical_on_gpu0(int devices, int physical) {
  DP_CHECK(devices >= 0 && physical > 0,
           "logical_on_gpu0: " << devices << " device(s) on " << physical << " GPU(s)");
  return (devices + physical - 1) / physical;
}

std::optional<StepMemory> probe_gpu0(const std::string& program, const std::string& instead,
                                     const std::function<int64_t(int64_t rows)>& peak_of) {
  try {
    const auto notice = probe_notice(program, "cuda:0");
    return measure_step_memory(peak_of);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: the memory probe step on GPU 0 failed (%s): %s\n", program.c_str(),
                 e.what(), instead.c_str());
    return std::nullopt;
  }
}

}  // namespace dp::cli
