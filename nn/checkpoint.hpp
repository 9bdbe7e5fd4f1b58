// Checkpoints: a module's flat parameter and buffer storage with a header naming every tensor.
//
// Format (little-endian, version 1):
//   "DPNNCKPT"                               8 bytes magic
//   u32 version, u32 entry count
//   u64 parameter elements (P), u64 buffer elements (B)
//   per entry: u8 kind (0 parameter, 1 buffer), u32 name length, name, u32 ndim, i64 dims[ndim]
//   u64 FNV-1a hash of the data that follows
//   f32 params[P], f32 buffers[B]           the flat buffers, in the module's layout
// Loading checks the magic, version, every name and shape against the module, the file size
// and the hash; each failure throws kernels::Error naming the file (and the tensor).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "nn/module.hpp"

namespace nn {

namespace detail {

constexpr char kCheckpointMagic[8] = {'D', 'P', 'N', 'N', 'C', 'K', 'P', 'T'};
constexpr uint32_t kCheckpointVersion = 1;

struct CheckpointEntry {
  uint8_t kind = 0;  // 0 parameter, 1 buffer
  std::string name;
  Shape shape;
};

inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

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

class Reader {
 public:
  Reader(const std::string& data, const std::string& path) : data_(data), path_(path) {}
  template <class T>
  T get(const char* what) {
    T v;
    get_bytes(&v, sizeof v, what);
    return v;
  }
  void get_bytes(void* p, size_t n, const char* what) {
    DP_CHECK(pos_ + n <= data_.size(), "load_checkpoint(" << path_ << "): file truncated while "
                                                          << "reading " << what << " (offset "
                                                          << pos_ << ", size " << data_.size()
                                                          << ")");
    std::memcpy(p, data_.data() + pos_, n);
    pos_ += n;
  }
  size_t pos() const { return pos_; }

 private:
  const std::string& data_;
  const std::string& path_;
  size_t pos_ = 0;
};

}  // namespace detail

// requires m materialised. ensures `path` holds m's parameters and buffers (written to
// path + ".tmp", then renamed, so a crash never leaves a half-written checkpoint).
inline void save_checkpoint(Module& m, const std::string& path) {
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

  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    DP_CHECK(f.good(), "save_checkpoint(" << path << "): cannot open " << tmp << " for writing");
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    f.close();
    DP_CHECK(f.good(), "save_checkpoint(" << path << "): writing " << tmp << " failed");
  }
  DP_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0,
           "save_checkpoint(" << path << "): cannot rename " << tmp << " to " << path);
}

// requires m materialised with the structure that saved `path` (same names and shapes, in the
// same order). ensures m's parameters and buffers hold the saved values (gradients untouched).
inline void load_checkpoint(Module& m, const std::string& path) {
  std::string data;
  {
    std::ifstream f(path, std::ios::binary);
    DP_CHECK(f.good(), "load_checkpoint(" << path << "): cannot open the file");
    data.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  detail::Reader r(data, path);
  char magic[8];
  r.get_bytes(magic, sizeof magic, "the magic");
  DP_CHECK(std::memcmp(magic, detail::kCheckpointMagic, sizeof magic) == 0,
           "load_checkpoint(" << path << "): not a checkpoint (bad magic)");
  const auto version = r.get<uint32_t>("the version");
  DP_CHECK(version == detail::kCheckpointVersion, "load_checkpoint(" << path << "): version "
                                                                     << version << ", expected "
                                                                     << detail::kCheckpointVersion);
  const auto n_entries = r.get<uint32_t>("the entry count");
  const auto n_params = r.get<uint64_t>("the parameter count");
  const auto n_buffers = r.get<uint64_t>("the buffer count");

  const auto want = detail::checkpoint_entries(m);
  DP_CHECK(n_entries == want.size(), "load_checkpoint(" << path << "): the file has " << n_entries
                                                        << " tensors, " << m.type_name() << " has "
                                                        << want.size());
  for (uint32_t i = 0; i < n_entries; ++i) {
    detail::CheckpointEntry e;
    e.kind = r.get<uint8_t>("an entry kind");
    const auto len = r.get<uint32_t>("a name length");
    DP_CHECK(len <= 4096, "load_checkpoint(" << path << "): entry " << i << " has a corrupt name"
                                             << " length " << len);
    e.name.resize(len);
    r.get_bytes(e.name.data(), len, "a name");
    const auto ndim = r.get<uint32_t>("a rank");
    DP_CHECK(ndim <= 16, "load_checkpoint(" << path << "): tensor '" << e.name
                                            << "' has a corrupt rank " << ndim);
    for (uint32_t d = 0; d < ndim; ++d) e.shape.push_back(r.get<int64_t>("a dimension"));
    const auto& w = want[i];
    DP_CHECK(e.kind == w.kind && e.name == w.name, "load_checkpoint("
                                                       << path << "): tensor " << i << " is "
                                                       << (e.kind == 0 ? "parameter '" : "buffer '")
                                                       << e.name << "' in the file but "
                                                       << (w.kind == 0 ? "parameter '" : "buffer '")
                                                       << w.name << "' in " << m.type_name());
    DP_CHECK(e.shape == w.shape, "load_checkpoint("
                                     << path << "): tensor '" << e.name << "' has shape "
                                     << kernels::shape_str(e.shape) << " in the file but "
                                     << kernels::shape_str(w.shape) << " in the module");
  }
  DP_CHECK(static_cast<int64_t>(n_params) == m.flat_params().numel() &&
               static_cast<int64_t>(n_buffers) == m.flat_buffers().numel(),
           "load_checkpoint(" << path << "): the file holds " << n_params << " parameter and "
                              << n_buffers << " buffer elements, the module "
                              << m.flat_params().numel() << " and " << m.flat_buffers().numel());
  const auto hash = r.get<uint64_t>("the data hash");
  const size_t data_bytes = (n_params + n_buffers) * sizeof(float);
  DP_CHECK(data.size() - r.pos() == data_bytes,
           "load_checkpoint(" << path << "): expected " << data_bytes << " bytes of data after "
                              << "the header, found " << data.size() - r.pos()
                              << " (truncated or trailing bytes)");
  std::vector<float> params(n_params), buffers(n_buffers);
  r.get_bytes(params.data(), n_params * sizeof(float), "the parameters");
  r.get_bytes(buffers.data(), n_buffers * sizeof(float), "the buffers");
  uint64_t h = detail::fnv1a(params.data(), params.size() * sizeof(float));
  h = detail::fnv1a(buffers.data(), buffers.size() * sizeof(float), h);
  DP_CHECK(h == hash, "load_checkpoint(" << path << "): the data does not match its hash (the "
                                         << "file is corrupt)");

  Tensor hp = Tensor::from_vector(params, {static_cast<int64_t>(params.size())});
  kernels::copy(m.flat_params(), hp);
  if (n_buffers > 0) {
    Tensor hb = Tensor::from_vector(buffers, {static_cast<int64_t>(buffers.size())});
    kernels::copy(m.flat_buffers(), hb);
  }
  kernels::context(m.device()).synchronize();  // the host copies die at return
}

}  // namespace nn
