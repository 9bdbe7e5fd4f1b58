#include "dp/data/idx.hpp"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>

#include "kernels/runtime/error.hpp"
#include "kernels/runtime/file_io.hpp"

namespace dp::data {

namespace {

// Closes a gzFile on scope exit; a close error on a read-only file carries no information.
struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};
using GzHandle = std::unique_ptr<gzFile_s, GzCloser>;

std::string hex(uint32_t v, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%0*x", digits, v);
  return buf;
}

const char* idx_dtype_name(uint8_t code) {
  switch (code) {
    case 0x08:
      return "u8";
    case 0x09:
      return "i8";
    case 0x0B:
      return "i16";
    case 0x0C:
      return "i32";
    case 0x0D:
      return "f32";
    case 0x0E:
      return "f64";
    default:
      return nullptr;
  }
}

// gzip's description of the stream state after a short read ("" when it is just the end).
std::string gz_error(gzFile f) {
  int code = Z_OK;
  const char* msg = gzerror(f, &code);
  if (code == Z_OK || code == Z_STREAM_END) return "";
  return msg ? msg : "unknown zlib error";
}

// Reads up to `n` bytes into `dst`; returns how many arrived. Throws on a read error, but not
// on a short read: a truncated gzip stream is reported by the caller, which knows the sizes.
size_t read_some(gzFile f, const std::string& path, uint8_t* dst, size_t n) {
  size_t got = 0;
  while (got < n) {
    unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - got, size_t{1} << 24));
    int r = gzread(f, dst + got, chunk);
    if (r < 0) {
      int code = Z_OK;
      const char* msg = gzerror(f, &code);
      DP_THROW(path << ": " << (code == Z_ERRNO ? std::strerror(errno) : msg)
                    << " (corrupt gzip stream or read error after " << got << " bytes)");
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

std::string with_gz_reason(gzFile f) {
  std::string reason = gz_error(f);
  return reason.empty() ? "" : " (gzip: " + reason + ")";
}

}  // namespace

int64_t IdxArray::item_size() const {
  int64_t n = 1;
  for (size_t i = 1; i < dims.size(); ++i) n *= dims[i];
  return n;
}

namespace {

// What the file on disk is: its size and whether it holds a gzip stream (by its first bytes).
struct RawFile {
  uint64_t size = 0;
  bool gzip = false;
};

RawFile inspect(const std::string& path) {
  kernels::io::require_regular_file(path);
  std::error_code ec;
  RawFile raw;
  raw.size = std::filesystem::file_size(path, ec);
  DP_CHECK(!ec, path << ": cannot read its size: " << ec.message());
  std::FILE* f = std::fopen(path.c_str(), "rb");
  DP_CHECK(f != nullptr, path << ": cannot open: " << std::strerror(errno));
  unsigned char two[2] = {0, 0};
  size_t got = std::fread(two, 1, 2, f);
  std::fclose(f);
  raw.gzip = got == 2 && two[0] == 0x1f && two[1] == 0x8b;
  return raw;
}

std::string dims_text(const std::vector<int64_t>& dims) {
  std::ostringstream os;
  for (size_t k = 0; k < dims.size(); ++k) os << (k ? " x " : "") << dims[k];
  return os.str();
}

// Reads the magic and dims from `f` (at the start of the stream) into out.dims; returns the
// header's size in bytes. Throws on a bad or absurd header.
size_t read_header(gzFile f, const std::string& path, IdxArray& out) {
  uint8_t magic[4];
  size_t got = read_some(f, path, magic, 4);
  DP_CHECK(got == 4, path << ": truncated header: expected a 4-byte magic number, got " << got
                          << " bytes" << with_gz_reason(f));
  uint32_t magic_word = (uint32_t{magic[0]} << 24) | (uint32_t{magic[1]} << 16) |
                        (uint32_t{magic[2]} << 8) | magic[3];
  DP_CHECK(magic[0] == 0 && magic[1] == 0,
           path << ": bad magic " << hex(magic_word, 8)
                << ": an IDX file starts with two zero bytes, a dtype byte and a dim count "
                   "(e.g. 0x00000803 for u8 images)");
  const char* dtype = idx_dtype_name(magic[2]);
  DP_CHECK(dtype != nullptr, path << ": bad magic " << hex(magic_word, 8) << ": unknown dtype byte "
                                  << hex(magic[2], 2));
  DP_CHECK(magic[2] == 0x08, path << ": unsupported dtype byte " << hex(magic[2], 2) << " ("
                                  << dtype << "): only u8 (0x08) IDX files are supported");
  int ndims = magic[3];
  DP_CHECK(ndims >= 1, path << ": bad magic " << hex(magic_word, 8) << ": zero dimensions");

  std::vector<uint8_t> header(4 * static_cast<size_t>(ndims));
  got = read_some(f, path, header.data(), header.size());
  DP_CHECK(got == header.size(), path << ": truncated header: expected " << header.size()
                                      << " bytes of dimensions for " << ndims << " dims, got "
                                      << got << with_gz_reason(f));
  int64_t total = 1;
  for (int d = 0; d < ndims; ++d) {
    const uint8_t* p = header.data() + 4 * d;
    int64_t size = (int64_t{p[0]} << 24) | (int64_t{p[1]} << 16) | (int64_t{p[2]} << 8) | p[3];
    DP_CHECK(size > 0, path << ": dimension " << d << " of " << ndims << " is zero");
    out.dims.push_back(size);
    if (size > kMaxIdxBytes / total) {
      DP_THROW(path << ": absurd dimensions " << dims_text(out.dims)
                    << (d + 1 < ndims ? " x ..." : "") << ": more than " << kMaxIdxBytes
                    << " bytes of data; corrupt header?");
    }
    total *= size;
  }
  return 4 + header.size();
}

// Throws when the data the header declares cannot be in a file of raw.size bytes: more than
// the rest of a plain file, or more than deflate's maximum ratio allows for a gzip file.
void check_plausible(const std::string& path, const RawFile& raw, size_t header_bytes,
                     const IdxArray& a) {
  const uint64_t data = static_cast<uint64_t>(a.count()) * static_cast<uint64_t>(a.item_size());
  if (!raw.gzip) {
    const uint64_t have = raw.size > header_bytes ? raw.size - header_bytes : 0;
    DP_CHECK(data <= have, path << ": truncated: expected " << data << " bytes of data, got "
                                << have << " (dims " << dims_text(a.dims) << ", a " << raw.size
                                << "-byte file)");
    return;
  }
  const uint64_t bound = raw.size * kMaxDeflateRatio + 4096;
  DP_CHECK(header_bytes + data <= bound, path << ": the header declares " << dims_text(a.dims)
                                              << " = " << data << " bytes of data, more than a "
                                              << raw.size << "-byte gzip file can hold (at most "
                                              << bound << " at deflate's maximum ratio of "
                                              << kMaxDeflateRatio << ":1); corrupt header?");
}

// Opens `path` and reads its header into out (path, dims), refusing an implausible one;
// returns the stream positioned at the first data byte.
GzHandle open_with_header(const std::string& path, IdxArray& out) {
  RawFile raw = inspect(path);
  errno = 0;
  GzHandle file(gzopen(path.c_str(), "rb"));
  DP_CHECK(file != nullptr,
           path << ": cannot open: " << (errno ? std::strerror(errno) : "out of memory"));
  // Large buffers pay off on data sets; small files keep zlib's default (8 KiB).
  if (raw.size > (1u << 20)) gzbuffer(file.get(), 1u << 20);
  out.path = path;
  size_t header_bytes = read_header(file.get(), path, out);
  check_plausible(path, raw, header_bytes, out);
  return file;
}

}  // namespace

IdxArray read_idx_header(const std::string& path) {
  IdxArray out;
  open_with_header(path, out);
  return out;
}

IdxArray read_idx(const std::string& path) {
  IdxArray out;
  GzHandle file = open_with_header(path, out);
  gzFile f = file.get();
  const int64_t total = out.count() * out.item_size();

  // Grows the buffer as data arrives, so that a lying header cannot make us allocate 4 GiB.
  size_t expected = static_cast<size_t>(total);
  size_t have = 0;
  while (have < expected) {
    size_t step = std::min(expected - have, size_t{1} << 24);
    out.bytes.resize(have + step);
    size_t n = read_some(f, path, out.bytes.data() + have, step);
    have += n;
    if (n < step) break;
  }
  DP_CHECK(have == expected, path << ": truncated: expected " << expected << " bytes of data, got "
                                  << have << with_gz_reason(f));

  uint8_t extra[4096];
  size_t trailing = 0;
  for (size_t n; (n = read_some(f, path, extra, sizeof(extra))) > 0;) trailing += n;
  DP_CHECK(trailing == 0, path << ": trailing garbage: " << trailing << " bytes after the "
                               << expected << " bytes of data that the dims promise");
  return out;
}

}  // namespace dp::data
