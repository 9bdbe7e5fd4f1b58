// The whole training state in the safetensors layout, so that resuming gives the same run, bit
// for bit, and PyTorch users can open the weights (safetensors.torch.load_file):
//
//   8 bytes    N, little-endian: the length of the JSON header
//   N bytes    {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//               "__metadata__": {"<key>": "<string>", ...}}   (padded with spaces)
//   the data   every tensor's raw little-endian bytes, at its offsets
//
// Tensors: "param.<name>" per parameter (its own shape), "buffer.<name>" per buffer, and
// "optim.<state>" per optimizer state tensor (flat, over the module's whole flat parameter
// buffer: a ZeRO-1 run gathers its shards first, so the file does not depend on the world size).
// Metadata: the step, epoch and position in the epoch, the optimizer, the world size and mode
// the run used, each device's or rank's dropout stream offset, the model's signature and an
// FNV-1a hash of the data. Writing is atomic and durable (nn/file_io.hpp); reading bounds every
// field by the file's size before allocating, checks the hash before changing anything, and
// refuses a file whose model, optimizer or run settings (global batch, ...) differ, naming what
// differs. Another mode or world size is accepted (resume_note() says what that changes).
#pragma once

#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nn/amp.hpp"
#include "nn/checkpoint_format.hpp"
#include "nn/file_io.hpp"
#include "nn/module.hpp"
#include "nn/optim.hpp"
#include "nn/safetensors.hpp"

namespace nn {

// Where a run stands, besides its tensors.
struct TrainingProgress {
  int64_t step = 0;          // optimizer steps taken (the global step)
  int64_t epoch = 0;         // the epoch in progress
  int64_t batches_done = 0;  // batches of that epoch already trained (the sampler's position)
  std::string mode;          // "single", "dp" or "ddp"
  int world_size = 1;        // devices (DP) or ranks (DDP)
  // Each device's (DP) or rank's (DDP) dropout stream offset, index = device or rank.
  std::vector<uint64_t> rng_offsets;
  std::map<std::string, std::string> config;  // what must match on resume (model, batch, ...)
  // Mixed precision: the loss scaler's state (saved when set; absent in older files).
  std::optional<GradScalerState> scaler;
  // ZeRO-1: the shards the optimizer state is split into while training (1: kept whole). The
  // file holds the whole state either way.
  int optimizer_shards = 1;
};

// Optimizer state tensors by name ("momentum", "exp_avg", ...), each over the whole flat
// parameter buffer.
using OptimizerState = std::vector<std::pair<std::string, Tensor>>;

namespace detail {

inline std::string optimizer_name(Optimizer& opt) {
  if (dynamic_cast<SGD*>(&opt)) return "sgd";
  if (dynamic_cast<AdamW*>(&opt)) return "adamw";
  return "unknown";
}

inline std::string join_u64(const std::vector<uint64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ull;  // FNV-1a's start (fnv1a's default)

// 16 lower-case hex digits.
inline std::string hex64(uint64_t v) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
  return text;
}

// v as a hexadecimal float, as printf's "%a" in the C locale ("0x1.8p+0"): exact, and the same
// text whatever locale the program set (std::to_chars reads none).
inline std::string exact_text(double v) {
  char text[48];
  char* p = text;
  if (std::signbit(v)) {
    *p++ = '-';
    v = -v;
  }
  if (std::isfinite(v)) {
    *p++ = '0';
    *p++ = 'x';
  }
  p = std::to_chars(p, text + sizeof text, v, std::chars_format::hex).ptr;
  return std::string(text, p);
}

// exact_text's inverse for a non-negative finite value ("0x" then hex digits); nullopt for
// anything else. Reads no locale.
inline std::optional<double> parse_exact(const std::string& text) {
  if (text.size() < 3 || text.compare(0, 2, "0x") != 0) return std::nullopt;
  double v = 0;
  const char* end = text.data() + text.size();
  const auto r = std::from_chars(text.data() + 2, end, v, std::chars_format::hex);
  if (r.ec != std::errc() || r.ptr != end || !std::isfinite(v)) return std::nullopt;
  return v;
}

// The metadata's own hash: every key and value but "meta_fnv1a64", in key order, each ended by
// a NUL (a step, scale or offset changed by a flipped bit reads as corrupt, not as a position).
inline std::string metadata_hash(const std::map<std::string, std::string>& metadata) {
  uint64_t hash = kFnvOffsetBasis;
  for (const auto& [k, v] : metadata) {
    if (k == "meta_fnv1a64") continue;
    hash = fnv1a(k.c_str(), k.size() + 1, hash);
    hash = fnv1a(v.c_str(), v.size() + 1, hash);
  }
  return hex64(hash);
}

}  // namespace detail

// How much of a file's start tells whether it is a training state: its safetensors header's
// __metadata__, which names the format, lies within it.
constexpr size_t kTrainingStateHeadBytes = size_t{1} << 20;
// requires `head` a file's first kTrainingStateHeadBytes bytes (or all of a shorter file).
// ensures true when they name a dptrain format: a file a save of this project wrote, even a
// damaged one, and so a file a save may replace.
inline bool is_training_state_head(const std::string& head) {
  return head.size() > 8 && head.find("\"format\":\"dptrain-", 8) != std::string::npos;
}

// requires m materialised, optimizer built on m, every rank's model equal (the caller saves
// from one device or rank). `whole_state`: the optimizer state to write when opt holds a ZeRO-1
// shard only (gathered from every rank, dp::dist::ZeroStage1::gather_optimizer_state); empty:
// opt.state(), which must then be whole. ensures `path` holds the whole state, atomically and
// durably; its folder is created first, with its parents, as --checkpoint-dir's is (a path on
// the way that is a file is refused by name).
inline void save_training_state(const std::string& path, Module& m, Optimizer& opt,
                                const TrainingProgress& progress,
                                const OptimizerState& whole_state = {}) {
  m.require_root("save_training_state");
  io::check_path(path, "save_training_state");
  if (const std::string dir = io::detail::parent_dir(path); !std::filesystem::is_directory(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    DP_CHECK(std::filesystem::is_directory(dir),
             "save_training_state("
                 << io::printable(path) << "): cannot create its folder " << io::printable(dir)
                 << ": " << (ec ? ec.message() : std::string("something on the way is a file")));
  }
  // A file there that no save wrote is not ours to replace: a checkpoint of ours, even a
  // damaged one, is.
  if (std::error_code ec;
      std::filesystem::is_regular_file(path, ec) && std::filesystem::file_size(path, ec) > 0 && !ec)
    DP_CHECK(is_training_state_head(io::read_head(path, kTrainingStateHeadBytes)),
             "save_training_state(" << io::printable(path)
                                    << "): the file there is not a training state (it has no "
                                       "__metadata__ format dptrain-...): it is never replaced; "
                                       "remove it yourself, or give another path");
  // One device needs no offsets from the caller: they are the module's. More must be given.
  std::vector<uint64_t> rng_offsets = progress.rng_offsets;
  if (rng_offsets.empty() && progress.world_size == 1) rng_offsets = {m.flat().rng_offset};
  DP_CHECK(static_cast<int64_t>(rng_offsets.size()) == progress.world_size,
           "save_training_state(" << io::printable(path) << "): progress.rng_offsets has "
                                  << rng_offsets.size() << " dropout offsets for world size "
                                  << progress.world_size << ": give one per device or rank "
                                  << "(DataParallel::rng_offsets()), or save with "
                                  << "DataParallel::save / DdpTrainer::save");
  struct Entry {
    std::string name;
    Shape shape;
    std::vector<float> values;
  };
  std::vector<Entry> entries;
  for (auto& [name, p] : m.named_parameters())
    entries.push_back({"param." + name, p->shape, p->value.to_host_f32()});
  for (auto& [name, b] : m.named_buffers())
    entries.push_back({"buffer." + name, b->shape, b->value.to_host_f32()});
  const int64_t n_params = m.flat_params().numel();
  for (auto& [name, t] : whole_state.empty() ? opt.state() : whole_state) {
    DP_CHECK(t.numel() == n_params,
             io::where("save_training_state", path)
                 << ": optimizer state '" << name << "' holds " << t.numel() << " of the "
                 << n_params << " parameters' values (a ZeRO-1 shard?): gather the whole state "
                 << "first (ZeroStage1::gather_optimizer_state)");
    entries.push_back({"optim." + name, t.shape(), t.to_host_f32()});
  }

  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0, hash = detail::kFnvOffsetBasis;
  for (const auto& e : entries) {
    const uint64_t bytes = e.values.size() * sizeof(float);
    header[e.name] = {
        {"dtype", "F32"}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    hash = detail::fnv1a(e.values.data(), bytes, hash);
  }
  nlohmann::json meta = {{"format", "dptrain-training-state-1"},
                         {"step", std::to_string(progress.step)},
                         {"epoch", std::to_string(progress.epoch)},
                         {"batches_done", std::to_string(progress.batches_done)},
                         {"mode", progress.mode},
                         {"world_size", std::to_string(progress.world_size)},
                         {"optimizer_shards", std::to_string(progress.optimizer_shards)},
                         {"rng_offsets", detail::join_u64(rng_offsets)},
                         {"optimizer", detail::optimizer_name(opt)},
                         {"optimizer_steps", std::to_string(opt.step_count())},
                         {"lr", std::to_string(opt.lr())},
                         {"parameters", std::to_string(n_params)},
                         {"data_fnv1a64", detail::hex64(hash)}};
  for (const auto& [k, v] : progress.config) meta["config." + k] = v;
  if (progress.scaler) {
    meta["scaler.scale"] = detail::exact_text(progress.scaler->scale);
    meta["scaler.growth_tracker"] = std::to_string(progress.scaler->growth_tracker);
    meta["scaler.skipped_steps"] = std::to_string(progress.scaler->skipped_steps);
  }
  meta["meta_fnv1a64"] = detail::metadata_hash(meta.get<std::map<std::string, std::string>>());
  header["__metadata__"] = meta;
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';  // the data starts 8-byte aligned

  std::string out;
  out.reserve(8 + text.size() + offset);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);  // little-endian
  out += text;
  for (const auto& e : entries)
    out.append(reinterpret_cast<const char*>(e.values.data()), e.values.size() * sizeof(float));
  io::write_file_atomically(path, out, "save_training_state");
}

namespace detail {

// "4 ranks", "1 device": how many of what a run of `mode` spreads over.
inline std::string world_text(const std::string& mode, int world) {
  const char* unit = mode == "ddp" ? " rank" : mode == "ps" ? " worker" : " device";
  return std::to_string(world) + unit + (world == 1 ? "" : "s");
}

// requires `file` read from the file `where` names.
// ensures it is a training state whose metadata matches its hash and whose saved settings are
// `config`'s (the program and model compared first, so a file of another program or model is
// named as such); throws naming the key, the saved value and this run's.
inline void check_saved_settings(const safetensors::File& file, const std::string& where,
                                 const std::map<std::string, std::string>& config) {
  auto it = file.metadata.find("format");
  DP_CHECK(it != file.metadata.end() && it->second == "dptrain-training-state-1",
           where << ": not a training state (no __metadata__ format dptrain-training-state-1)");
  if (auto h = file.metadata.find("meta_fnv1a64"); h != file.metadata.end()) {
    // files of older versions have none
    const std::string want = metadata_hash(file.metadata);
    DP_CHECK(h->second == want, where << ": the metadata does not match its hash (meta_fnv1a64 "
                                      << io::printable(h->second) << ", the metadata gives " << want
                                      << "): the file is corrupt");
  }
  auto same = [&](const std::string& k, const std::string& v) {
    auto saved = file.metadata.find("config." + k);
    DP_CHECK(saved != file.metadata.end() && saved->second == v,
             where << ": saved with " << k << " "
                   << (saved != file.metadata.end() ? io::printable(saved->second)
                                                    : std::string("(none)"))
                   << ", this run has " << v << ": resume with the run's own settings");
  };
  for (const char* k : {"program", "model"})
    if (auto c = config.find(k); c != config.end()) same(k, c->second);
  for (const auto& [k, v] : config) same(k, v);
}

}  // namespace detail

// Reads only the header of the training state at `path` (no tensor) and checks what needs no
// model: that it is a training state, that its metadata matches its hash, and that each of
// `config`'s settings (a subset of the run's TrainingProgress::config) is the saved one. Lets a
// program refuse a file of another program, model or batch before it builds the model or starts
// its ranks; load_training_state checks all of this again, and the rest.
// Throws as load_training_state does, with its messages.
inline void check_training_state_settings(const std::string& path,
                                          const std::map<std::string, std::string>& config) {
  io::FileReader r(path, "load_training_state");
  detail::check_saved_settings(safetensors::read(r), r.where(), config);
}

// requires m and opt built like the saving run's (same model, optimizer, shapes); `expected`
// holds this run's mode, world size, optimizer shards and config; index < expected.world_size.
// ensures m's parameters and buffers and opt's state (its ZeRO-1 shard of the file's whole
// state when opt holds a shard) and step count are the saved ones, and returns the saved
// progress with rng_offsets for this run's world: the saved ones when the world size is the
// same, else re-derived (every device or rank goes on from the largest saved offset, past every
// mask drawn before); m's dropout offset is rng_offsets[index]. The mode and world size may
// differ from the saving run's (resume_note() says what changes); the config may not.
// Reads the header, checks everything, including the data's hash, before changing anything,
// then reads each tensor's byte range alone (a file's memory cost is its header and one
// tensor). Throws naming the file and what differs or is malformed: a tensor missing, of
// another shape (a transposed weight too) or unknown to this model and optimizer; metadata out
// of range; a config key (model, global batch, program, data set size, ...) that differs; data
// that does not match its hash (a corrupt file).
inline TrainingProgress load_training_state(const std::string& path, Module& m, Optimizer& opt,
                                            const TrainingProgress& expected, int index = 0) {
  m.require_root("load_training_state");
  io::FileReader r(path, "load_training_state");
  const std::string where = r.where();
  const safetensors::File file = safetensors::read(r);
  auto text = [&](const std::string& key) -> std::string {
    auto it = file.metadata.find(key);
    DP_CHECK(it != file.metadata.end(), where << ": metadata '" << key << "' is missing");
    return it->second;
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
  // Step counts: a run adds steps to them (and Adam raises beta to them), so a crafted count
  // near INT64_MAX would overflow; 2^53 steps is beyond any run and exact in a double.
  constexpr int64_t kMaxSteps = int64_t{1} << 53;
  auto number = [&](const std::string& key, int64_t lo, int64_t hi) {
    return safetensors::metadata_count(file, where, key, lo, hi);
  };
  // The run's settings must be the file's (the mode and world size may differ: the state does
  // not depend on them).
  detail::check_saved_settings(file, where, expected.config);
  TrainingProgress got;
  got.step = number("step", 0, kMaxSteps);
  got.epoch = number("epoch", 0, kMaxInt);
  got.batches_done = number("batches_done", 0, kMaxSteps);
  got.mode = text("mode");
  // The mode is the saving program's word ("single", "dp", "ddp", ...; empty from the minimal
  // save): printed in notes, so only printable ASCII.
  DP_CHECK(io::printable(got.mode) == got.mode,
           where << ": metadata 'mode' = '" << io::printable(got.mode)
                 << "' holds a control byte or a byte outside printable ASCII");
  got.world_size = static_cast<int>(number("world_size", 1, kMaxInt));
  got.optimizer_shards = file.metadata.count("optimizer_shards")
                             ? static_cast<int>(number("optimizer_shards", 1, kMaxInt))
                             : 1;
  got.rng_offsets = safetensors::metadata_u64_list(file, where, "rng_offsets");
  // What must match beside the settings: the model's size and the optimizer.
  const int64_t n_params = m.flat_params().numel();
  const int64_t parameters = number("parameters", 0, kMax);
  DP_CHECK(parameters == n_params, where << ": saved from a model with " << parameters
                                         << " parameters (flat), this model has " << n_params);
  DP_CHECK(text("optimizer") == detail::optimizer_name(opt),
           where << ": saved with optimizer " << text("optimizer") << ", this run uses "
                 << detail::optimizer_name(opt));
  DP_CHECK(static_cast<int64_t>(got.rng_offsets.size()) == got.world_size,
           where << ": " << got.rng_offsets.size() << " dropout offsets for world size "
                 << got.world_size);
  got.config = expected.config;
  if (file.metadata.count("scaler.scale")) {
    GradScalerState st;
    const std::string scale = text("scaler.scale");
    const double v = detail::parse_exact(scale).value_or(0.0);
    DP_CHECK(v > 0 && v <= 3.4e38, where << ": metadata 'scaler.scale' = '" << io::printable(scale)
                                         << "' is not a positive float");
    st.scale = static_cast<float>(v);
    st.growth_tracker = number("scaler.growth_tracker", 0, kMaxSteps);
    st.skipped_steps = number("scaler.skipped_steps", 0, kMaxSteps);
    got.scaler = st;
  }
  const int64_t optimizer_steps = number("optimizer_steps", 0, kMaxSteps);
  DP_CHECK(index >= 0 && index < expected.world_size,
           where << ": device/rank " << index << " of a world of " << expected.world_size);

  // Every tensor of the file goes somewhere, with the shape it has here. Optimizer state is
  // whole in the file; a ZeRO-1 shard here takes its range [shard_begin, shard_end) of it.
  struct Target {
    std::string name;
    Tensor* dst;
    Shape file_shape;
    int64_t first = 0;  // the element of the file's tensor that dst[0] takes
  };
  std::vector<Target> targets;
  for (auto& [name, p] : m.named_parameters())
    targets.push_back({"param." + name, &p->value, p->value.shape()});
  for (auto& [name, b] : m.named_buffers())
    targets.push_back({"buffer." + name, &b->value, b->value.shape()});
  auto state = opt.state();
  const int64_t shard_begin = opt.shard_begin();
  const bool sharded = opt.shard_end() - shard_begin != n_params;
  for (auto& [name, t] : state)
    targets.push_back(
        {"optim." + name, &t, sharded ? Shape{n_params} : t.shape(), sharded ? shard_begin : 0});
  // Unknown tensors, missing ones and shapes first, before anything is changed.
  for (const auto& [name, t] : file.tensors) {
    bool known = false;
    for (const auto& target : targets) known = known || target.name == name;
    DP_CHECK(known, where << ": tensor '" << io::printable(name)
                          << "' is not a parameter, buffer or optimizer state of this model ("
                          << m.type_name() << ") and optimizer (" << detail::optimizer_name(opt)
                          << ")");
  }
  for (const auto& target : targets) {
    auto it = file.tensors.find(target.name);
    DP_CHECK(it != file.tensors.end(), where << ": tensor '" << target.name << "' is missing");
    DP_CHECK(it->second.shape == target.file_shape,
             where << ": tensor '" << target.name << "' is " << kernels::shape_str(it->second.shape)
                   << " in the file, " << kernels::shape_str(target.file_shape) << " here");
  }
  // The data's hash (files of older versions have none), read in bounded chunks.
  if (file.metadata.count("data_fnv1a64")) {
    uint64_t hash = detail::kFnvOffsetBasis;
    std::vector<char> chunk(std::min<uint64_t>(file.data_size, uint64_t{1} << 20));
    r.seek(file.data_offset);
    for (uint64_t left = file.data_size; left > 0;) {
      const uint64_t n = std::min<uint64_t>(left, chunk.size());
      r.read(chunk.data(), n, "the data");
      hash = detail::fnv1a(chunk.data(), n, hash);
      left -= n;
    }
    DP_CHECK(detail::hex64(hash) == text("data_fnv1a64"),
             where << ": the data does not match its hash (data_fnv1a64 "
                   << io::printable(text("data_fnv1a64")) << ", the bytes give "
                   << detail::hex64(hash) << "): the file is corrupt");
  }
  for (const auto& target : targets) {
    const safetensors::TensorEntry& e = file.tensors.at(target.name);
    std::vector<float> host(static_cast<size_t>(e.numel));
    safetensors::read_tensor(r, file, e, host.data(), "a tensor");
    Tensor& dst = *target.dst;
    std::vector<float> mine(host.begin() + target.first, host.begin() + target.first + dst.numel());
    kernels::copy(dst, Tensor::from_vector(mine, dst.shape(), dst.device()));
  }
  // The copies are queued on this thread's stream: done before another's (an engine's worker)
  // reads what was loaded.
  if (!targets.empty()) kernels::context(targets.front().dst->device()).synchronize();
  m.parameters_changed();
  opt.set_step_count(optimizer_steps);
  // Dropout streams: each device's or rank's own when the world is the same; else every one
  // goes on past the furthest any saved stream reached (a device's key is its index's).
  const std::vector<uint64_t> saved_offsets = got.rng_offsets;
  if (got.world_size != expected.world_size) {
    const uint64_t furthest = *std::max_element(saved_offsets.begin(), saved_offsets.end());
    got.rng_offsets.assign(static_cast<size_t>(expected.world_size), furthest);
  }
  m.flat().rng_offset = got.rng_offsets[index];
  return got;
}

// What a resume onto `now` (this run) changes of `saved` (load_training_state's result), for
// the log; "" when the mode, world size and optimizer shards are the saving run's. E.g.
// "re-sharded a ddp checkpoint of 4 ranks onto dp on 3 devices: the parameters and the
// optimizer state are whole in the file; the optimizer state was split into 4 ZeRO-1 shards
// there and is whole here; the sampler goes on at global step 6 with the same global batch;
// dropout streams are re-derived per device (each from offset 480) and the batch's gradient is
// summed in another order, so the continuation is not bit-exact".
inline std::string resume_note(const TrainingProgress& saved, const TrainingProgress& now) {
  if (saved.mode == now.mode && saved.world_size == now.world_size &&
      saved.optimizer_shards == now.optimizer_shards)
    return "";
  auto shards = [](int n) {
    return n > 1 ? "split into " + std::to_string(n) + " ZeRO-1 shards" : std::string("whole");
  };
  std::string note = "re-sharded a " + saved.mode + " checkpoint of " +
                     detail::world_text(saved.mode, saved.world_size) + " onto " + now.mode +
                     " on " + detail::world_text(now.mode, now.world_size) +
                     ": the parameters and the optimizer state are whole in the file";
  if (saved.optimizer_shards > 1 || now.optimizer_shards > 1)
    note += "; the optimizer state was " + shards(saved.optimizer_shards) + " there and is " +
            shards(now.optimizer_shards) + " here";
  note += "; the sampler goes on at global step " + std::to_string(saved.step) +
          " with the same global batch; ";
  if (saved.world_size != now.world_size)
    note += "dropout streams are re-derived per " +
            std::string(now.mode == "ddp" ? "rank" : "device") + " (each from offset " +
            std::to_string(saved.rng_offsets.empty() ? 0 : saved.rng_offsets[0]) +
            ") and the batch's gradient is summed in another order, so the continuation is not "
            "bit-exact";
  else
    note +=
        "the dropout streams go on per device, but the batch's gradient is summed in "
        "another order, so the continuation is not bit-exact";
  return note;
}

// When a resumed run has nothing left to train (its checkpoint is at or past the last step),
// the line to print instead of training: "nothing left to train: checkpoint at step 39 of 39
// (PATH); give more --epochs (or --steps) to train further". Returns nullopt when steps remain.
inline std::optional<std::string> nothing_left_to_train(int64_t saved_step, int64_t total_steps,
                                                        const std::string& path,
                                                        const std::string& how_to_go_on) {
  if (saved_step < total_steps) return std::nullopt;
  return "nothing left to train: checkpoint at step " + std::to_string(saved_step) + " of " +
         std::to_string(total_steps) + " (" + io::printable(path) + "); " + how_to_go_on;
}

// ---- a folder of checkpoints ------------------------------------------------------------

// "<dir>/step_00000042.safetensors": at least 8 digits, more from step 10^8 on.
inline std::string checkpoint_file(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "step_%08lld.safetensors", static_cast<long long>(step));
  return dir + "/" + name;
}

namespace detail {

// The step of a file name "step_<digits>.safetensors" (any number of digits up to int64), or -1.
inline int64_t checkpoint_step(const std::string& name) {
  const std::string prefix = "step_", suffix = ".safetensors";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const char* b = name.data() + prefix.size();
  const char* e = name.data() + name.size() - suffix.size();
  if (*b == '+' || *b == '-') return -1;
  int64_t step = 0;
  auto [end, ec] = std::from_chars(b, e, step);
  return ec == std::errc() && end == e ? step : -1;
}

// Whether `name` is a temporary file that write_file_atomically makes for a checkpoint:
// ".step_<digits>.safetensors.tmp.XXXXXX" (mkstemp's six letters and digits).
inline bool is_checkpoint_temporary(const std::string& name) {
  const std::string marker = ".tmp.";
  auto at = name.rfind(marker);
  if (name.empty() || name[0] != '.' || at == std::string::npos) return false;
  const std::string tail = name.substr(at + marker.size());
  if (tail.size() != 6) return false;
  for (char c : tail)
    if (!std::isalnum(static_cast<unsigned char>(c))) return false;
  return checkpoint_step(name.substr(1, at - 1)) >= 0;
}

}  // namespace detail

// The checkpoints in `dir` (step_<N>.safetensors, N of any width), oldest step first; empty
// when there are none.
inline std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec), end;
  // A folder not made yet holds none; one that cannot be read is an error, not "none" (a resume
  // would start over and the next save prune what it could not see).
  for (; !ec && it != end; it.increment(ec)) {
    const int64_t step = detail::checkpoint_step(it->path().filename().string());
    if (step >= 0) found.emplace_back(step, it->path().string());
  }
  DP_CHECK(!ec || ec == std::errc::no_such_file_or_directory,
           "checkpoint folder " << io::printable(dir) << ": cannot list it: " << ec.message());
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

// requires keep >= 1 and `written` the step of the checkpoint just written in `dir`. ensures
// the newest `keep` checkpoints of steps up to `written` stay (that one among them) and older
// ones are removed. A checkpoint of a later step belongs to a run this one superseded (it
// resumed from an earlier checkpoint, or skipped a damaged newer one): it is moved aside to
// <name>.superseded (.superseded.2, .3 ... when that name is taken: an earlier supersede's file
// is never replaced), and said so on stderr, so that "latest" never picks it over this run's
// work, and nothing of it is deleted (nor counted in `keep`: such files stay until removed).
inline void prune_checkpoints(const std::string& dir, int keep, int64_t written) {
  DP_CHECK(keep >= 1, "prune_checkpoints: keep " << keep << " would remove the new checkpoint");
  std::vector<std::string> mine;
  for (const std::string& path : list_checkpoints(dir)) {
    const int64_t step = detail::checkpoint_step(std::filesystem::path(path).filename().string());
    if (step <= written) {
      mine.push_back(path);
      continue;
    }
    std::error_code ec;
    std::string aside = path + ".superseded";
    // exists() is false on an error, which ec keeps: then nothing is moved (said below).
    for (int n = 2; std::filesystem::exists(aside, ec); ++n)
      aside = path + ".superseded." + std::to_string(n);
    if (!ec) std::filesystem::rename(path, aside, ec);
    const std::string outcome = ec ? "not moved aside: " + ec.message()
                                   : "moved aside to " + aside + " (kept until removed by hand)";
    std::fprintf(stderr, "checkpoint %s: %s: this run wrote step %lld from an earlier point\n",
                 path.c_str(), outcome.c_str(), static_cast<long long>(written));
  }
  for (size_t i = 0; i + static_cast<size_t>(keep) < mine.size(); ++i) {
    std::error_code ec;
    std::filesystem::remove(mine[i], ec);
  }
}

// `resume` as a file to load: "latest" is the newest checkpoint in `dir`, or "" when there is
// none yet (a first attempt, or one restarted before its first save); anything else is itself.
inline std::string resolve_resume(const std::string& resume, const std::string& dir) {
  if (resume != "latest") return resume;
  auto all = list_checkpoints(dir);
  return all.empty() ? "" : all.back();
}

// The outcome of a --resume: the file loaded ("" when `latest` found no checkpoint yet), what
// it held (load_training_state's result), and the newer checkpoints skipped on the way, each
// "PATH: reason".
struct Resumed {
  std::string path;
  TrainingProgress progress;
  std::vector<std::string> skipped;
  std::string searched;  // `latest`: the folder searched
};

// `resume` naming a file: loads it (load_training_state); any fault is an error, since the user
// named that file. `resume` "latest": loads the newest checkpoint in `dir` that passes every
// check of load_training_state, skipping (and recording, with the reason) each newer one that
// fails: truncated, corrupt (its data does not match its hash), a wrong shape, another model,
// optimizer or global batch. Throws naming every one when none loads; returns an empty path
// when `dir` has none. A failure cut short by an I/O error may have changed part of m and
// opt; the load that then succeeds sets all of it. Every DDP rank reading the same folder
// comes to the same choice.
inline Resumed resume_training_state(const std::string& resume, const std::string& dir, Module& m,
                                     Optimizer& opt, const TrainingProgress& expected,
                                     int index = 0) {
  Resumed out;
  if (resume.empty()) return out;
  if (resume != "latest") {
    out.path = resume;
    out.progress = load_training_state(resume, m, opt, expected, index);
    return out;
  }
  out.searched = dir;
  const std::vector<std::string> all = list_checkpoints(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      out.progress = load_training_state(*it, m, opt, expected, index);
      out.path = *it;
      return out;
    } catch (const kernels::Error& e) {
      out.skipped.push_back(io::printable(*it) + ": " + e.what());
    }
  }
  if (all.empty()) return out;
  std::string reasons;
  for (const auto& s : out.skipped) reasons += "\n  skipped " + s;
  DP_THROW("--resume latest: none of the " << all.size() << " checkpoint(s) in "
                                           << io::printable(dir) << " loads:" << reasons);
}

// The lines a program prints about a resume (each after its "program: " prefix): every
// checkpoint skipped and why, the file loaded, and what was re-sharded (resume_note).
inline std::vector<std::string> resume_report(const Resumed& r, const TrainingProgress& now) {
  std::vector<std::string> lines;
  for (const auto& s : r.skipped) lines.push_back("--resume latest: skipped " + s);
  if (r.path.empty() && !r.searched.empty())
    lines.push_back("--resume latest: no checkpoint in " + io::printable(r.searched) +
                    " yet: starting from step 0");
  if (r.path.empty()) return lines;
  if (!r.skipped.empty())
    lines.push_back("--resume latest: resuming from " + io::printable(r.path) +
                    ", the newest "
                    "whole checkpoint (step " +
                    std::to_string(r.progress.step) + ")");
  if (std::string note = resume_note(r.progress, now); !note.empty()) lines.push_back(note);
  return lines;
}

// One job's hold on a checkpoint folder, so that two jobs never write, prune or clean up each
// other's checkpoints (as two runs given one --checkpoint-dir would). Taken before any work:
// creates the folder with its parents when missing, proves it writable (a probe file created
// and removed), then takes an advisory lock, flock(2) on <dir>/.lock, whose contents name the
// holder ("pid 1234 host node7 program train_mnist"). A second job is refused at once, naming
// the holder. The kernel drops the lock when the holder exits however it ends (SIGKILL too);
// the file stays, and a later job takes it over.
//
// A DDP job: the launcher (node 0) takes the lock for the job's life, restarts included; its
// workers see it held by their parent process, which counts as held by the job
// (held_by_parent()). Ranks started by another launcher (torchrun, mpirun): rank 0 takes it.
class CheckpointDirLock {
 public:
  // Throws kernels::Error naming the folder and the reason (cannot create it, not writable, a
  // file, held by another job: "pid 1234 host node7 program dp_bench").
  CheckpointDirLock(const std::string& dir, const std::string& program) : dir_(dir) {
    io::check_path(dir, "--checkpoint-dir");
    const std::string name = "--checkpoint-dir " + io::printable(dir);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    DP_CHECK(std::filesystem::is_directory(dir),
             name << ": cannot create the folder: "
                  << (ec ? ec.message() : std::string("it exists and is not a folder")));
    std::string probe = dir + "/.probe.XXXXXX";
    int pfd = ::mkostemp(probe.data(), O_CLOEXEC);
    DP_CHECK(pfd >= 0, name << ": cannot write in the folder: " << io::errno_text(errno));
    ::close(pfd);
    ::unlink(probe.c_str());

    // The lock is the folder's own regular file: never opened through a link (ELOOP), and
    // refused when something else sits there (it is truncated below).
    const std::string lock_path = dir + "/.lock";
    fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NOFOLLOW, 0644);
    const int open_errno = errno;
    DP_CHECK(
        fd_ >= 0 || open_errno != ELOOP,
        name << ": the lock file " << io::printable(lock_path)
             << " is a symbolic link; the lock must be the folder's own file: remove the link");
    DP_CHECK(fd_ >= 0, name << ": cannot open the lock file " << io::printable(lock_path) << ": "
                            << io::errno_text(open_errno));
    struct stat lock_st {};
    if (::fstat(fd_, &lock_st) != 0 || !S_ISREG(lock_st.st_mode)) {
      const mode_t mode = lock_st.st_mode;
      ::close(fd_);
      fd_ = -1;
      DP_THROW(name << ": the lock file " << io::printable(lock_path) << " is "
                    << io::file_kind(mode) << ", not a regular file: remove it");
    }
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      const std::string holder = read_holder();
      ::close(fd_);
      fd_ = -1;
      DP_CHECK(e == EWOULDBLOCK,
               name << ": cannot lock " << io::printable(lock_path) << ": " << io::errno_text(e));
      if (holder_is_parent(holder)) {
        parent_holds_ = true;
        return;
      }
      DP_THROW(name << ": in use by another job ("
                    << (holder.empty() ? std::string("holder unknown") : io::printable(holder))
                    << ", which holds " << io::printable(lock_path)
                    << "): give each job its own --checkpoint-dir");
    }
    const std::string me =
        "pid " + std::to_string(::getpid()) + " host " + host_name() + " program " + program + "\n";
    if (::ftruncate(fd_, 0) != 0 ||
        ::pwrite(fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
      const int e = errno;
      ::close(fd_);
      fd_ = -1;
      DP_THROW(name << ": cannot write the lock file " << io::printable(lock_path) << ": "
                    << io::errno_text(e));
    }
  }
  ~CheckpointDirLock() {
    if (fd_ >= 0) ::close(fd_);  // drops the lock
  }
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;

  const std::string& dir() const { return dir_; }
  // True when this process's parent (the DDP launcher) holds the lock for the job.
  bool held_by_parent() const { return parent_holds_; }

 private:
  static std::string host_name() {
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) return "?";
    return host;
  }
  // The lock file's first line ("pid 1234 host node7 program train_mnist"), or "".
  std::string read_holder() const {
    char buf[512] = {};
    ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    std::string s = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
    auto nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  }
  static bool holder_is_parent(const std::string& holder) {
    const std::string mine = "pid " + std::to_string(::getppid()) + " host " + host_name() + " ";
    return holder.rfind(mine, 0) == 0;
  }

  std::string dir_;
  int fd_ = -1;
  bool parent_holds_ = false;
};

// Removes the temporary files (.step_N.safetensors.tmp.XXXXXX) that a save killed mid-write
// (SIGKILL, a power cut) left in the locked folder: the lock proves no other process of another
// job is writing there, and this job writes from one process at a time. Only names of that
// pattern are touched. Returns how many were removed.
inline int remove_stale_temporaries(const CheckpointDirLock& lock) {
  int removed = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(lock.dir(), ec)) {
    if (!detail::is_checkpoint_temporary(e.path().filename().string())) continue;
    std::error_code rm;
    if (std::filesystem::remove(e.path(), rm)) ++removed;
  }
  return removed;
}

// Writes the state as <dir>/step_<step>.safetensors and keeps the newest `keep` checkpoints.
// Returns the file's name. Prefer the overload below, which also cleans up after killed saves.
// `whole_state`: as save_training_state's.
inline std::string save_checkpoint_in(const std::string& dir, int keep, Module& m, Optimizer& opt,
                                      const TrainingProgress& progress,
                                      const OptimizerState& whole_state = {}) {
  const std::string path = checkpoint_file(dir, progress.step);
  save_training_state(path, m, opt, progress, whole_state);
  prune_checkpoints(dir, keep, progress.step);
  return path;
}

// The same in the folder this job has locked: first removes the temporary files a killed save
// left (remove_stale_temporaries), then saves and prunes.
inline std::string save_checkpoint_in(const CheckpointDirLock& lock, int keep, Module& m,
                                      Optimizer& opt, const TrainingProgress& progress,
                                      const OptimizerState& whole_state = {}) {
  remove_stale_temporaries(lock);
  return save_checkpoint_in(lock.dir(), keep, m, opt, progress, whole_state);
}

}  // namespace nn
