// libFuzzer target: dp::data::read_idx and read_idx_header on arbitrary files, plain or gzip.
// Every input either parses into dims whose product is the data size, or throws kernels::Error;
// nothing crashes, leaks, hangs or allocates more than the file can hold.
#include "dp/data/idx.hpp"
#include "kernels/runtime/error.hpp"
#include "tests/fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dp_fuzz::as_file(data, size);
  try {
    dp::data::IdxArray h = dp::data::read_idx_header(path);
    DP_FUZZ_ASSERT(!h.dims.empty() && h.bytes.empty());
  } catch (const kernels::Error&) {
  }
  try {
    dp::data::IdxArray a = dp::data::read_idx(path);
    int64_t n = 1;
    for (int64_t d : a.dims) {
      DP_FUZZ_ASSERT(d > 0);
      n *= d;
    }
    DP_FUZZ_ASSERT(static_cast<int64_t>(a.bytes.size()) == n);
    DP_FUZZ_ASSERT(a.count() * a.item_size() == n);
    // A plain file holds its data; a gzip one at most deflate's ratio of its size.
    DP_FUZZ_ASSERT(static_cast<uint64_t>(n) <= size * dp::data::kMaxDeflateRatio + 4096);
  } catch (const kernels::Error&) {
  }
  return 0;
}
