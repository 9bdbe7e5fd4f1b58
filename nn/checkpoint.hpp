// Checkpoints: a module's flat parameter and buffer storage with a header naming every tensor.
//
// The format is in nn/checkpoint_format.hpp, the file I/O in nn/file_io.hpp.
// Loading refuses non-regular files, bounds every field by the file's real size before
// allocating, checks the magic, version, every name and shape against the module, the data
// size and the hash; each failure throws kernels::Error naming the file (and the tensor).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nn/checkpoint_format.hpp"
#include "nn/file_io.hpp"
#include "nn/module.hpp"

namespace nn {

namespace detail {

inline std::vector<CheckpointEntry> checkpoint_entries(Module& m) {
  std::vector<CheckpointEntry> out;
  for (auto& [name, p] : m.named_parameters()) out.push_back({0, name, p->shape});
  for (auto& [name, b] : m.named_buffers()) out.push_back({1, name, b->shape});
  return out;
}

class Writer {
 public:
  explicit Writer(std::string& out) : out_(out) {}
  template <class T>
  void put(const T& v) {
    out_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void put_bytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }

 private:
  std::string& out_;
};

}  // namespace detail

// requires m materialised. ensures `path` holds m's parameters and buffers, written atomically
// and durably (nn/file_io.hpp): concurrent saves to one path all succeed, a reader never sees a
// partial file, and a crash leaves the old file or the new one. Throws naming the file and the
// reason (a directory, an unwritable folder, a full disk).
inline void save_checkpoint(Module& m, const std::string& path) {
  m.require_root("save_checkpoint");
  const std::vector<float> params = m.flat_params().to_host_f32();  // waits for the device
  const std::vector<float> buffers =
      m.flat_buffers().numel() > 0 ? m.flat_buffers().to_host_f32() : std::vector<float>();
  const auto entries = detail::checkpoint_entries(m);

  std::string out;
  detail::Writer w(out);
  w.put_bytes(detail::kCheckpointMagic, sizeof detail::kCheckpointMagic);
  w.put(detail::kCheckpointVersion);
  w.put(static_cast<uint32_t>(entries.size()));
  w.put(static_cast<uint64_t>(params.size()));
  w.put(static_cast<uint64_t>(buffers.size()));
  for (const auto& e : entries) {
    w.put(e.kind);
    w.put(static_cast<uint32_t>(e.name.size()));
    w.put_bytes(e.name.data(), e.name.size());
    w.put(static_cast<uint32_t>(e.shape.size()));
    for (int64_t d : e.shape) w.put(d);
  }
  uint64_t hash = detail::fnv1a(params.data(), params.size() * sizeof(float));
  hash = detail::fnv1a(buffers.data(), buffers.size() * sizeof(float), hash);
  w.put(hash);
  w.put_bytes(params.data(), params.size() * sizeof(float));
  w.put_bytes(buffers.data(), buffers.size() * sizeof(float));

  io::write_file_atomically(path, out, "save_checkpoint");
}

// requires m materialised with the structure that saved `path` (same names and shapes, in the
// same order). ensures m's parameters and buffers hold the saved values (gradients untouched).
inline void load_checkpoint(Module& m, const std::string& path) {
  m.require_root("load_checkpoint");
  io::FileReader r(path, "load_checkpoint");
  const detail::CheckpointHeader h = detail::read_checkpoint_header(r);
  const auto want = detail::checkpoint_entries(m);
  DP_CHECK(h.entries.size() == want.size(), r.where() << ": the file has " << h.entries.size()
                                                      << " tensors, " << m.type_name() << " has "
                                                      << want.size());
  auto kind_text = [](uint8_t kind) { return kind == 0 ? "parameter '" : "buffer '"; };
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& e = h.entries[i];
    const auto& w = want[i];
    DP_CHECK(e.kind == w.kind && e.name == w.name,
             r.where() << ": tensor " << i << " is " << kind_text(e.kind) << io::printable(e.name)
                       << "' in the file but " << kind_text(w.kind) << io::printable(w.name)
                       << "' in " << m.type_name());
    DP_CHECK(e.shape == w.shape, r.where()
                                     << ": tensor '" << io::printable(e.name) << "' has shape "
                                     << kernels::shape_str(e.shape) << " in the file but "
                                     << kernels::shape_str(w.shape) << " in the module");
  }
  DP_CHECK(static_cast<int64_t>(h.n_params) == m.flat_params().numel() &&
               static_cast<int64_t>(h.n_buffers) == m.flat_buffers().numel(),
           r.where() << ": the file holds " << h.n_params << " parameter and " << h.n_buffers
                     << " buffer elements, the module " << m.flat_params().numel() << " and "
                     << m.flat_buffers().numel()
                     << " (flat buffers, alignment gaps included: every tensor's name and shape "
                        "match, so the file's layout differs; it was written by another "
                        "version, or is damaged)");
  std::vector<float> params, buffers;
  detail::read_checkpoint_data(r, h, params, buffers);
  const uint64_t n_buffers = h.n_buffers;

  Tensor hp = Tensor::from_vector(params, {static_cast<int64_t>(params.size())});
  kernels::copy(m.flat_params(), hp);
  m.parameters_changed();
  if (n_buffers > 0) {
    Tensor hb = Tensor::from_vector(buffers, {static_cast<int64_t>(buffers.size())});
    kernels::copy(m.flat_buffers(), hb);
  }
  kernels::context(m.device()).synchronize();  // the host copies die at return
}

}  // namespace nn
