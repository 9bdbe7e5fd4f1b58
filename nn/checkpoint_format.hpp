// The checkpoint file format, version 1 (little-endian), and its bounded reader. It needs no
// Module, so the fuzz target (tests/fuzz/fuzz_checkpoint.cpp) reaches all of it.
//   "DPNNCKPT"                               8 bytes magic
//   u32 version, u32 entry count
//   u64 parameter elements (P), u64 buffer elements (B)
//   per entry: u8 kind (0 parameter, 1 buffer), u32 name length, name, u32 ndim, i64 dims[ndim]
//   u64 FNV-1a hash of the data that follows
//   f32 params[P], f32 buffers[B]           the flat buffers, in the module's layout
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "nn/file_io.hpp"

namespace nn::detail {

constexpr char kCheckpointMagic[8] = {'D', 'P', 'N', 'N', 'C', 'K', 'P', 'T'};
constexpr uint32_t kCheckpointVersion = 1;

struct CheckpointEntry {
  uint8_t kind = 0;  // 0 parameter, 1 buffer
  std::string name;
  std::vector<int64_t> shape;
};

inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// The header of a checkpoint file: everything before the data.
struct CheckpointHeader {
  std::vector<CheckpointEntry> entries;
  uint64_t n_params = 0, n_buffers = 0;  // f32 elements of each flat buffer
  uint64_t hash = 0;                     // FNV-1a of the data
};

// requires r at offset 0. ensures the magic, version and every field were read and bounded by
// the file's size (counts, name lengths, ranks, and a data section of exactly the size the
// counts promise), r at the first data byte. Throws naming the file and the fault.
inline CheckpointHeader read_checkpoint_header(io::FileReader& r) {
  const std::string magic = r.bytes(sizeof kCheckpointMagic, "the magic");
  DP_CHECK(std::memcmp(magic.data(), kCheckpointMagic, sizeof kCheckpointMagic) == 0,
           r.where() << ": not a checkpoint (bad magic: the first 8 bytes are not DPNNCKPT)");
  const auto version = r.get<uint32_t>("the version");
  DP_CHECK(version == kCheckpointVersion,
           r.where() << ": version " << version << ", expected " << kCheckpointVersion);
  CheckpointHeader h;
  const auto n_entries = r.get<uint32_t>("the entry count");
  h.n_params = r.get<uint64_t>("the parameter count");
  h.n_buffers = r.get<uint64_t>("the buffer count");
  // Each entry takes at least 9 bytes (kind, name length, rank); the data 4 per element.
  constexpr uint64_t kMinEntryBytes = 9;
  DP_CHECK(n_entries <= r.remaining() / kMinEntryBytes,
           r.where() << ": corrupt entry count " << n_entries << ": the " << r.remaining()
                     << " bytes left cannot hold them");
  DP_CHECK(h.n_params <= r.remaining() / 4 && h.n_buffers <= r.remaining() / 4 - h.n_params,
           r.where() << ": corrupt element counts (" << h.n_params << " parameter, " << h.n_buffers
                     << " buffer elements): the " << r.remaining()
                     << " bytes left cannot hold them");
  h.entries.reserve(n_entries);
  for (uint32_t i = 0; i < n_entries; ++i) {
    CheckpointEntry e;
    e.kind = r.get<uint8_t>("an entry kind");
    DP_CHECK(e.kind <= 1, r.where() << ": entry " << i << " has a corrupt kind " << int{e.kind}
                                    << " (0 parameter, 1 buffer)");
    const auto len = r.get<uint32_t>("a name length");
    DP_CHECK(len <= 4096,
             r.where() << ": entry " << i << " has a corrupt name length " << len << " (> 4096)");
    e.name = r.bytes(len, "a name");
    const auto ndim = r.get<uint32_t>("a rank");
    DP_CHECK(ndim <= 16, r.where() << ": tensor '" << io::printable(e.name)
                                   << "' has a corrupt rank " << ndim << " (> 16)");
    r.require(uint64_t{ndim} * sizeof(int64_t), "a shape");
    for (uint32_t d = 0; d < ndim; ++d) e.shape.push_back(r.get<int64_t>("a dimension"));
    h.entries.push_back(std::move(e));
  }
  h.hash = r.get<uint64_t>("the data hash");
  const uint64_t data_bytes = (h.n_params + h.n_buffers) * sizeof(float);
  DP_CHECK(r.remaining() == data_bytes,
           r.where() << ": expected " << data_bytes << " bytes of data after the header, found "
                     << r.remaining() << " ("
                     << (r.remaining() < data_bytes ? "truncated" : "trailing bytes") << ")");
  return h;
}

// requires r just past a header h. ensures params, buffers hold the data, checked against
// the hash (throws "corrupt" naming the file otherwise).
inline void read_checkpoint_data(io::FileReader& r, const CheckpointHeader& h,
                                 std::vector<float>& params, std::vector<float>& buffers) {
  r.require((h.n_params + h.n_buffers) * sizeof(float), "the data");
  params.resize(h.n_params);
  buffers.resize(h.n_buffers);
  r.read(params.data(), h.n_params * sizeof(float), "the parameters");
  r.read(buffers.data(), h.n_buffers * sizeof(float), "the buffers");
  uint64_t hash = fnv1a(params.data(), params.size() * sizeof(float));
  hash = fnv1a(buffers.data(), buffers.size() * sizeof(float), hash);
  DP_CHECK(hash == h.hash, r.where() << ": the data does not match its hash (the file is corrupt)");
}

}  // namespace nn::detail
