// IDX reader: the MNIST file format (http://yann.lecun.com/exdb/mnist/), plain or gzipped.
// Layout: magic 0x00 0x00 <dtype> <ndims>, then ndims big-endian u32 sizes, then exactly
// prod(sizes) elements. Only u8 data (dtype 0x08) is supported, which is what MNIST and
// Fashion-MNIST use.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dp::data {

// One IDX file in memory.
struct IdxArray {
  std::string path;            // where it was read from, for error messages
  std::vector<int64_t> dims;   // e.g. {60000, 28, 28} for images, {60000} for labels
  std::vector<uint8_t> bytes;  // prod(dims) elements, row-major

  int64_t count() const { return dims.empty() ? 0 : dims[0]; }  // items along dim 0
  int64_t item_size() const;                                    // prod(dims[1:])
};

// The largest payload read_idx accepts; larger dims are treated as a corrupt header.
constexpr int64_t kMaxIdxBytes = int64_t{1} << 32;

// The most bytes deflate can expand one compressed byte into (zlib's technical note: 1032:1).
constexpr uint64_t kMaxDeflateRatio = 1032;

// Reads `path`, gzip-compressed or not (detected from the content, not the name).
// ensures: dims all > 0, bytes.size() == prod(dims).
// Throws kernels::Error naming the file and the fault: missing/unreadable/not a regular file,
// bad magic, unknown or unsupported dtype byte, zero or absurd dims, data the file cannot hold
// (more than a plain file's remaining bytes, or than deflate's maximum ratio allows for the
// compressed size: refused before any of the body is read), truncated header or data, trailing
// garbage, corrupt gzip stream.
IdxArray read_idx(const std::string& path);

// The header only (dims; bytes stays empty), with the same checks as read_idx short of reading
// the body: cheap, so that files can be checked against each other before their bodies load.
IdxArray read_idx_header(const std::string& path);

}  // namespace dp::data
