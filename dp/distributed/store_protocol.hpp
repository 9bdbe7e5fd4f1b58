// Wire protocol of the TCP key-value store (dp/distributed/store.hpp: StoreServer, TcpStore).
//
// Every message, both ways, is one frame:
//   header  8 bytes: magic 0xD7, version 1, opcode, flags 0, payload length (u32 big-endian)
//   payload `length` bytes of fields: u32 (big-endian), i64 (big-endian, two's complement),
//           bytes = u32 length + that many bytes.
// Requests and their payloads, and the reply each gets:
//   set     key, value                       -> ok | error
//   get     key                              -> value(bytes) | not_found
//   add     key, i64 delta                   -> integer(i64) | error (value is not an integer)
//   check   u32 n, n keys                    -> boolean(u8)
//   wait    u32 n, n keys                    -> ready, sent once every key exists (no timeout on
//                                               the server: the client gives up and reconnects)
//   remove  key                              -> boolean(u8): whether it existed
//   hello   token, i64 rank (-1: unknown)    -> ok | error (another job: the token differs)
// A server with a job token refuses every connection whose first frame is not a hello with
// that token: it replies error and closes, so a rank of another job that reaches it (two jobs
// on one port) never touches its keys. A server without a token accepts any connection.
// Every connection's first frame (the hello) must arrive within the server's hello timeout
// (5 s by default), or the connection is closed: idle connections cannot fill its table.
// A counter made by `add` holds its value as decimal text, readable with `get`.
// The server closes a connection on any malformed frame (bad magic or version, unknown opcode,
// non-zero flags, a length over the opcode's bound, fields overrunning or not filling the
// payload, end of stream inside a frame, a frame stalled for longer than the stall timeout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace dp::dist::store_wire {

constexpr uint8_t kMagic = 0xD7;
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 8;

enum Opcode : uint8_t {
  kSet = 0x01,
  kGet = 0x02,
  kAdd = 0x03,
  kCheck = 0x04,
  kWait = 0x05,
  kRemove = 0x06,
  kHello = 0x07,
  // replies
  kOk = 0x81,
  kValue = 0x82,
  kNotFound = 0x83,
  kInteger = 0x84,
  kBoolean = 0x85,
  kReady = 0x86,
  kError = 0x87,
};

// Bounds every server enforces (a frame over them closes the connection).
constexpr size_t kMaxKeyBytes = 4096;
constexpr size_t kMaxValueBytes = size_t(64) << 20;  // 64 MiB
constexpr size_t kMaxKeysPerRequest = 1024;
constexpr size_t kMaxErrorBytes = 4096;
constexpr size_t kMaxTokenBytes = 256;

// Largest payload a request with `opcode` may carry; 0 for an unknown opcode.
inline size_t max_request_payload(uint8_t opcode) {
  switch (opcode) {
    case kSet:
      return 8 + kMaxKeyBytes + kMaxValueBytes;
    case kGet:
    case kRemove:
      return 4 + kMaxKeyBytes;
    case kAdd:
      return 4 + kMaxKeyBytes + 8;
    case kCheck:
    case kWait:
      return 4 + kMaxKeysPerRequest * (4 + kMaxKeyBytes);
    case kHello:
      return 4 + kMaxTokenBytes + 8;
    default:
      return 0;
  }
}

// Largest payload a reply may carry (checked by clients).
constexpr size_t kMaxReplyPayload = 4 + kMaxValueBytes;

// ---- encoding -------------------------------------------------------------------------------

class Writer {
 public:
  explicit Writer(uint8_t opcode) : buf_(kHeaderBytes, 0) {
    buf_[0] = static_cast<char>(kMagic);
    buf_[1] = static_cast<char>(kVersion);
    buf_[2] = static_cast<char>(opcode);
  }
  Writer& u32(uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) buf_.push_back(static_cast<char>((v >> s) & 0xff));
    return *this;
  }
  Writer& i64(int64_t v) {
    uint64_t u = static_cast<uint64_t>(v);
    for (int s = 56; s >= 0; s -= 8) buf_.push_back(static_cast<char>((u >> s) & 0xff));
    return *this;
  }
  Writer& u8(uint8_t v) {
    buf_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& bytes(const void* p, size_t n) {
    u32(static_cast<uint32_t>(n));
    const char* c = static_cast<const char*>(p);
    buf_.insert(buf_.end(), c, c + n);
    return *this;
  }
  Writer& str(const std::string& s) { return bytes(s.data(), s.size()); }
  // The finished frame (the header's length is filled in).
  std::vector<char> finish() {
    uint32_t n = static_cast<uint32_t>(buf_.size() - kHeaderBytes);
    for (int i = 0; i < 4; ++i) buf_[4 + i] = static_cast<char>((n >> (24 - 8 * i)) & 0xff);
    return std::move(buf_);
  }

 private:
  std::vector<char> buf_;
};

struct Header {
  uint8_t magic = 0, version = 0, opcode = 0, flags = 0;
  uint32_t length = 0;
};

inline uint32_t load_u32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t(u[0]) << 24) | (uint32_t(u[1]) << 16) | (uint32_t(u[2]) << 8) | uint32_t(u[3]);
}

inline Header parse_header(const char* p) {
  Header h;
  h.magic = static_cast<uint8_t>(p[0]);
  h.version = static_cast<uint8_t>(p[1]);
  h.opcode = static_cast<uint8_t>(p[2]);
  h.flags = static_cast<uint8_t>(p[3]);
  h.length = load_u32(p + 4);
  return h;
}

// Reads fields from a payload; any overrun sets ok() to false and yields empty values.
class Reader {
 public:
  Reader(const char* p, size_t n) : p_(p), n_(n) {}
  bool ok() const { return ok_; }
  bool at_end() const { return n_ == 0; }
  uint32_t u32() {
    if (!take(4)) return 0;
    return load_u32(p_ - 4);
  }
  int64_t i64() {
    if (!take(8)) return 0;
    uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u = (u << 8) | static_cast<unsigned char>(p_[i - 8]);
    return static_cast<int64_t>(u);
  }
  uint8_t u8() {
    if (!take(1)) return 0;
    return static_cast<uint8_t>(p_[-1]);
  }
  // A bytes field of at most `max_len` bytes.
  std::string str(size_t max_len) {
    uint32_t len = u32();
    if (!ok_ || len > max_len) {
      ok_ = false;
      return {};
    }
    if (!take(len)) return {};
    return std::string(p_ - len, len);
  }

 private:
  bool take(size_t k) {
    if (!ok_ || k > n_) {
      ok_ = false;
      return false;
    }
    p_ += k;
    n_ -= k;
    return true;
  }
  const char* p_;
  size_t n_;
  bool ok_ = true;
};

// ---- decoding requests (the server's parser; tests/fuzz/fuzz_store_frame.cpp fuzzes it) -----

// Why a request with header h must be refused ("" when its payload may be read): bad magic or
// version, non-zero flags, an unknown opcode, a length over the opcode's bound.
inline std::string check_request_header(const Header& h) {
  static const char kHex[] = "0123456789abcdef";
  if (h.magic != kMagic)
    return std::string("bad magic byte 0x") + kHex[h.magic >> 4] + kHex[h.magic & 15] +
           " (expected 0xd7)";
  if (h.version != kVersion) return "unsupported protocol version " + std::to_string(h.version);
  if (h.flags != 0) return "non-zero flags " + std::to_string(h.flags);
  size_t bound = max_request_payload(h.opcode);
  if (bound == 0) return "unknown opcode " + std::to_string(h.opcode);
  if (h.length > bound)
    return "frame of " + std::to_string(h.length) + " bytes exceeds the bound of " +
           std::to_string(bound) + " for opcode " + std::to_string(h.opcode);
  return {};
}

// One decoded request: the fields its opcode carries.
struct Request {
  uint8_t opcode = 0;
  std::string key;                // set, get, add, remove
  std::string value;              // set
  std::vector<std::string> keys;  // check, wait
  int64_t delta = 0;              // add
  std::string token;              // hello
  int64_t rank = -1;              // hello
};

// requires check_request_header passed for (opcode, n). ensures out holds the fields; returns
// "" or why the payload is malformed (fields overrunning it, over a bound, or bytes left over).
inline std::string decode_request(uint8_t opcode, const char* p, size_t n, Request& out) {
  Reader r(p, n);
  out.opcode = opcode;
  const char* name = "?";
  switch (opcode) {
    case kSet:
      name = "set";
      out.key = r.str(kMaxKeyBytes);
      out.value = r.str(kMaxValueBytes);
      break;
    case kGet:
    case kRemove:
      name = opcode == kGet ? "get" : "remove";
      out.key = r.str(kMaxKeyBytes);
      break;
    case kAdd:
      name = "add";
      out.key = r.str(kMaxKeyBytes);
      out.delta = r.i64();
      break;
    case kCheck:
    case kWait: {
      name = opcode == kCheck ? "check" : "wait";
      uint32_t count = r.u32();
      // Each key takes at least its 4-byte length: a count the payload cannot hold is refused
      // before anything is reserved.
      if (!r.ok() || count > kMaxKeysPerRequest || count > n / 4)
        return std::string("malformed ") + name + " request (a count of " + std::to_string(count) +
               " keys in a " + std::to_string(n) + "-byte payload, at most " +
               std::to_string(kMaxKeysPerRequest) + ")";
      out.keys.reserve(count);
      for (uint32_t i = 0; i < count && r.ok(); ++i) out.keys.push_back(r.str(kMaxKeyBytes));
      break;
    }
    case kHello:
      name = "hello";
      out.token = r.str(kMaxTokenBytes);
      out.rank = r.i64();
      break;
    default:
      return "unknown opcode " + std::to_string(opcode);
  }
  if (!r.ok() || !r.at_end())
    return std::string("malformed ") + name + " request (" + std::to_string(n) +
           "-byte payload whose fields overrun it, exceed a bound or leave bytes over)";
  return {};
}

}  // namespace dp::dist::store_wire
