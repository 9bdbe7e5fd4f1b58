// libFuzzer target: the store server's frame parser (dp/distributed/store_protocol.hpp). The
// input is a byte stream as a client would send it: frames are checked and decoded in turn, as
// StoreServer does, and every decoded request must encode back to the same frame.
#include <cstring>

#include "dp/distributed/store_protocol.hpp"
#include "tests/fuzz/fuzz_util.hpp"

namespace wire = dp::dist::store_wire;

namespace {

std::vector<char> encode(const wire::Request& q) {
  wire::Writer w(q.opcode);
  switch (q.opcode) {
    case wire::kSet:
      w.str(q.key).str(q.value);
      break;
    case wire::kGet:
    case wire::kRemove:
      w.str(q.key);
      break;
    case wire::kAdd:
      w.str(q.key).i64(q.delta);
      break;
    case wire::kCheck:
    case wire::kWait:
      w.u32(static_cast<uint32_t>(q.keys.size()));
      for (const auto& k : q.keys) w.str(k);
      break;
    case wire::kHello:
      w.str(q.token).i64(q.rank);
      break;
    default:
      DP_FUZZ_ASSERT(false);
  }
  return w.finish();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  size_t left = size;
  while (left >= wire::kHeaderBytes) {
    wire::Header h = wire::parse_header(p);
    if (!wire::check_request_header(h).empty()) break;  // the server closes the connection
    DP_FUZZ_ASSERT(h.length <= wire::max_request_payload(h.opcode));
    if (h.length > left - wire::kHeaderBytes) break;  // waits for the rest
    wire::Request q;
    std::string bad = wire::decode_request(h.opcode, p + wire::kHeaderBytes, h.length, q);
    if (!bad.empty()) break;
    DP_FUZZ_ASSERT(q.key.size() <= wire::kMaxKeyBytes && q.value.size() <= wire::kMaxValueBytes);
    DP_FUZZ_ASSERT(q.keys.size() <= wire::kMaxKeysPerRequest);
    std::vector<char> again = encode(q);
    DP_FUZZ_ASSERT(again.size() == wire::kHeaderBytes + h.length);
    DP_FUZZ_ASSERT(std::memcmp(again.data(), p, again.size()) == 0);
    p += again.size();
    left -= again.size();
  }
  // Any reply payload the client might read: the Reader never overruns.
  wire::Reader r(reinterpret_cast<const char*>(data), size);
  while (r.ok() && !r.at_end()) (void)r.str(wire::kMaxErrorBytes);
  return 0;
}
