// libFuzzer target: the safetensors reader of training states (nn/safetensors.hpp over
// nn::io::FileReader). Every input is either refused with a kernels::Error naming the file, or
// accepted with the format's invariants: the header read alone (data_offset + data_size is the
// file's size); every tensor F32 with non-negative dimensions whose product times 4 is its
// byte range; the ranges, sorted, tile the data from 0 to its end without gap or overlap (so
// no two tensors share a byte, and none lies past the file); and each tensor reads back from
// its range alone. The metadata numbers a training state needs parse in range or are refused
// naming the file and the key (never a bare "stoull").
#include <algorithm>
#include <limits>

#include "nn/safetensors.hpp"
#include "tests/fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dp_fuzz::as_file(data, size);
  try {
    nn::io::FileReader r(path, "load_training_state");
    nn::safetensors::File f = nn::safetensors::read(r);
    DP_FUZZ_ASSERT(f.data_offset >= 8 && f.data_offset + f.data_size == size);
    DP_FUZZ_ASSERT(f.data_offset - 8 <= nn::safetensors::kMaxHeaderBytes);
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const auto& [name, t] : f.tensors) {
      DP_FUZZ_ASSERT(t.begin <= t.end && t.end <= f.data_size);
      DP_FUZZ_ASSERT(t.end - t.begin == static_cast<uint64_t>(t.numel) * 4);
      int64_t n = 1;
      for (int64_t d : t.shape) {
        DP_FUZZ_ASSERT(d >= 0);
        n *= d;
      }
      DP_FUZZ_ASSERT(n == t.numel);
      ranges.emplace_back(t.begin, t.end);
      std::vector<float> values(static_cast<size_t>(t.numel));
      nn::safetensors::read_tensor(r, f, t, values.data(), "a tensor");
    }
    std::sort(ranges.begin(), ranges.end());
    uint64_t cursor = 0;
    for (const auto& [b, e] : ranges) {
      DP_FUZZ_ASSERT(b == cursor);  // contiguous: no gap, no overlap
      cursor = e;
    }
    DP_FUZZ_ASSERT(cursor == f.data_size);  // the data ends at the file's end
    // The metadata a training state reads, range-checked.
    for (const char* key : {"step", "epoch", "world_size"}) {
      try {
        const int64_t v =
            nn::safetensors::metadata_count(f, path, key, 1, std::numeric_limits<int32_t>::max());
        DP_FUZZ_ASSERT(v >= 1 && v <= std::numeric_limits<int32_t>::max());
      } catch (const kernels::Error& e) {
        DP_FUZZ_ASSERT(std::string(e.what()).find(path) != std::string::npos);
        DP_FUZZ_ASSERT(std::string(e.what()).find(key) != std::string::npos);
      }
    }
    try {
      nn::safetensors::metadata_u64_list(f, path, "rng_offsets");
    } catch (const kernels::Error& e) {
      DP_FUZZ_ASSERT(std::string(e.what()).find("rng_offsets") != std::string::npos);
    }
  } catch (const kernels::Error& e) {
    DP_FUZZ_ASSERT(std::string(e.what()).find(path) != std::string::npos);
  }
  return 0;
}
