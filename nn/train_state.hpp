// The whole training state in the safetensors layout, so that resuming gives the same run, bit
// for bit, and PyTorch users can open the weights (safetensors.torch.load_file):
//
//   8 bytes    N, little-endian: the length of the JSON header
//   N bytes    {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//               "__metadata__": {"<key>": "<string>", ...}}   (padded with spaces)
//   the data   every tensor's raw little-endian bytes, at its offsets
//
// Tensors: "param.<name>" per parameter (its own shape), "buffer.<name>" per buffer, and
// "optim.<state>" per optimizer state tensor (flat, over the module's flat parameter buffer).
// Metadata: the step, epoch and position in the epoch, the optimizer, the world size and mode
// the run used, each device's or rank's dropout stream offset, and the model's signature.
// Writing is atomic and durable (nn/file_io.hpp); reading bounds every field by the file's
// size before allocating and refuses a file whose model, optimizer or world size differ, naming
// what differs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nn/amp.hpp"
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
};

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

inline std::vector<uint64_t> split_u64(const std::string& s, const std::string& where) {
  std::vector<uint64_t> out;
  size_t at = 0;
  while (at < s.size()) {
    size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(at, end - at);
    DP_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos &&
                 item.size() <= 20,
             where << ": rng_offsets item '" << io::printable(item) << "' is not a number");
    out.push_back(std::stoull(item));
    at = end + 1;
  }
  return out;
}

}  // namespace detail

// requires m materialised, optimizer built on m, every rank's model equal (the caller saves
// from one device or rank). ensures `path` holds the whole state, atomically and durably.
inline void save_training_state(const std::string& path, Module& m, Optimizer& opt,
                                const TrainingProgress& progress) {
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
  for (auto& [name, t] : opt.state())
    entries.push_back({"optim." + name, t.shape(), t.to_host_f32()});

  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& e : entries) {
    const uint64_t bytes = e.values.size() * sizeof(float);
    header[e.name] = {
        {"dtype", "F32"}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  nlohmann::json meta = {{"format", "dptrain-training-state-1"},
                         {"step", std::to_string(progress.step)},
                         {"epoch", std::to_string(progress.epoch)},
                         {"batches_done", std::to_string(progress.batches_done)},
                         {"mode", progress.mode},
                         {"world_size", std::to_string(progress.world_size)},
                         {"rng_offsets", detail::join_u64(progress.rng_offsets)},
                         {"optimizer", detail::optimizer_name(opt)},
                         {"optimizer_steps", std::to_string(opt.step_count())},
                         {"lr", std::to_string(opt.lr())},
                         {"parameters", std::to_string(m.flat_params().numel())}};
  for (const auto& [k, v] : progress.config) meta["config." + k] = v;
  if (progress.scaler) {
    char scale[32];
    std::snprintf(scale, sizeof scale, "%a", static_cast<double>(progress.scaler->scale));  // exact
    meta["scaler.scale"] = scale;
    meta["scaler.growth_tracker"] = std::to_string(progress.scaler->growth_tracker);
    meta["scaler.skipped_steps"] = std::to_string(progress.scaler->skipped_steps);
  }
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

// requires m and opt built like the saving run's (same model, optimizer, shapes); `expected`
// holds the mode, world size and config of this run. ensures m's parameters and buffers and
// opt's state and step count are the saved ones, m's dropout offset is rng_offsets[index],
// and returns the saved progress. Throws naming the file and what differs or is malformed.
inline TrainingProgress load_training_state(const std::string& path, Module& m, Optimizer& opt,
                                            const TrainingProgress& expected, int index = 0) {
  io::FileReader r(path, "load_training_state");
  const std::string where = r.where();
  const safetensors::File file = safetensors::read(r);
  auto text = [&](const std::string& key) -> std::string {
    auto it = file.metadata.find(key);
    DP_CHECK(it != file.metadata.end(), where << ": metadata '" << key << "' is missing");
    return it->second;
  };
  auto number = [&](const std::string& key) -> int64_t {
    const std::string s = text(key);
    DP_CHECK(!s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos,
             where << ": metadata '" << key << "' = '" << io::printable(s) << "' is not a count");
    return std::stoll(s);
  };
  DP_CHECK(file.metadata.count("format") && text("format") == "dptrain-training-state-1",
           where << ": not a training state (no __metadata__ format dptrain-training-state-1)");
  TrainingProgress got;
  got.step = number("step");
  got.epoch = number("epoch");
  got.batches_done = number("batches_done");
  got.mode = text("mode");
  got.world_size = static_cast<int>(number("world_size"));
  got.rng_offsets = detail::split_u64(text("rng_offsets"), where);
  // What must match: the model, the optimizer, the mode and the world size.
  DP_CHECK(number("parameters") == m.flat_params().numel(),
           where << ": saved from a model with " << number("parameters")
                 << " parameters (flat), this model has " << m.flat_params().numel());
  DP_CHECK(text("optimizer") == detail::optimizer_name(opt),
           where << ": saved with optimizer " << text("optimizer") << ", this run uses "
                 << detail::optimizer_name(opt));
  DP_CHECK(got.mode == expected.mode && got.world_size == expected.world_size,
           where << ": saved by a " << got.mode << " run on " << got.world_size
                 << " device(s)/rank(s); this is a " << expected.mode << " run on "
                 << expected.world_size << ": resume with the same mode and --gpus");
  DP_CHECK(static_cast<int>(got.rng_offsets.size()) == got.world_size,
           where << ": " << got.rng_offsets.size() << " dropout offsets for world size "
                 << got.world_size);
  for (const auto& [k, v] : expected.config) {
    auto it = file.metadata.find("config." + k);
    DP_CHECK(it != file.metadata.end() && it->second == v,
             where << ": saved with " << k << " "
                   << (it != file.metadata.end() ? it->second : std::string("(none)"))
                   << ", this run has " << v);
    got.config[k] = v;
  }
  if (file.metadata.count("scaler.scale")) {
    GradScalerState st;
    const std::string scale = text("scaler.scale");
    char* end = nullptr;
    const double v = std::strtod(scale.c_str(), &end);
    DP_CHECK(!scale.empty() && end && *end == '\0' && v > 0 && v <= 3.4e38,
             where << ": metadata 'scaler.scale' = '" << io::printable(scale)
                   << "' is not a positive float");
    st.scale = static_cast<float>(v);
    st.growth_tracker = number("scaler.growth_tracker");
    st.skipped_steps = number("scaler.skipped_steps");
    got.scaler = st;
  }

  auto load_into = [&](const std::string& name, Tensor& dst) {
    auto it = file.tensors.find(name);
    DP_CHECK(it != file.tensors.end(), where << ": tensor '" << name << "' is missing");
    const safetensors::TensorEntry& e = it->second;
    DP_CHECK(e.numel == dst.numel(), where << ": tensor '" << name << "' is "
                                           << kernels::shape_str(e.shape) << ", expected "
                                           << kernels::shape_str(dst.shape()));
    std::vector<float> host(static_cast<size_t>(dst.numel()));
    if (!host.empty()) std::memcpy(host.data(), file.data.data() + e.begin, e.end - e.begin);
    kernels::copy(dst, Tensor::from_vector(host, dst.shape(), dst.device()));
  };
  for (auto& [name, p] : m.named_parameters()) load_into("param." + name, p->value);
  for (auto& [name, b] : m.named_buffers()) load_into("buffer." + name, b->value);
  for (auto& [name, t] : opt.state()) load_into("optim." + name, t);
  opt.set_step_count(number("optimizer_steps"));
  DP_CHECK(index >= 0 && index < got.world_size,
           where << ": device/rank " << index << " of a world of " << got.world_size);
  m.flat().rng_offset = got.rng_offsets[index];
  return got;
}

// ---- a folder of checkpoints ------------------------------------------------------------

// "<dir>/step_00000042.safetensors".
inline std::string checkpoint_file(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "step_%08lld.safetensors", static_cast<long long>(step));
  return dir + "/" + name;
}

// The checkpoints in `dir` (step_*.safetensors), oldest step first; empty when there are none.
inline std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != 25 || name.rfind("step_", 0) != 0 || name.substr(13) != ".safetensors" ||
        name.substr(5, 8).find_first_not_of("0123456789") != std::string::npos)
      continue;
    found.emplace_back(std::stoll(name.substr(5, 8)), e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

// Keeps the newest `keep` checkpoints of `dir` and removes the others.
inline void prune_checkpoints(const std::string& dir, int keep) {
  auto all = list_checkpoints(dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    std::error_code ec;
    std::filesystem::remove(all[i], ec);
  }
}

// `resume` as a file to load: "latest" is the newest checkpoint in `dir`, or "" when there is
// none yet (a first attempt, or one restarted before its first save); anything else is itself.
inline std::string resolve_resume(const std::string& resume, const std::string& dir) {
  if (resume != "latest") return resume;
  auto all = list_checkpoints(dir);
  return all.empty() ? "" : all.back();
}

// Writes the state as <dir>/step_<step>.safetensors and keeps the newest `keep` checkpoints.
// Returns the file's name.
inline std::string save_checkpoint_in(const std::string& dir, int keep, Module& m, Optimizer& opt,
                                      const TrainingProgress& progress) {
  const std::string path = checkpoint_file(dir, progress.step);
  save_training_state(path, m, opt, progress);
  prune_checkpoints(dir, keep);
  return path;
}

}  // namespace nn
