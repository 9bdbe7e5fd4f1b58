// libFuzzer target: the safetensors reader of training states (nn/safetensors.hpp over
// nn::io::FileReader). Every input is read into tensors whose byte ranges lie inside the data
// and hold exactly their float count, or throws kernels::Error naming the file.
#include "nn/safetensors.hpp"
#include "tests/fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dp_fuzz::as_file(data, size);
  try {
    nn::io::FileReader r(path, "load_training_state");
    nn::safetensors::File f = nn::safetensors::read(r);
    DP_FUZZ_ASSERT(f.data.size() <= size);
    for (const auto& [name, t] : f.tensors) {
      DP_FUZZ_ASSERT(t.begin <= t.end && t.end <= f.data.size());
      DP_FUZZ_ASSERT(t.end - t.begin == static_cast<uint64_t>(t.numel) * 4);
      int64_t n = 1;
      for (int64_t d : t.shape) {
        DP_FUZZ_ASSERT(d >= 0);
        n *= d;
      }
      DP_FUZZ_ASSERT(n == t.numel);
    }
  } catch (const kernels::Error& e) {
    DP_FUZZ_ASSERT(std::string(e.what()).find(path) != std::string::npos);
  }
  return 0;
}
