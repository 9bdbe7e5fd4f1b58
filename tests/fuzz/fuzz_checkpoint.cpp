// libFuzzer target: the checkpoint reader (nn/checkpoint_format.hpp over nn::io::FileReader).
// Every input is a valid checkpoint whose data size and hash match its header, or throws
// kernels::Error; no allocation exceeds what the file holds.
#include "nn/checkpoint_format.hpp"
#include "tests/fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dp_fuzz::as_file(data, size);
  try {
    nn::io::FileReader r(path, "load_checkpoint");
    DP_FUZZ_ASSERT(r.size() == size);
    nn::detail::CheckpointHeader h = nn::detail::read_checkpoint_header(r);
    DP_FUZZ_ASSERT((h.n_params + h.n_buffers) * sizeof(float) == r.remaining());
    for (const auto& e : h.entries) {
      DP_FUZZ_ASSERT(e.kind <= 1 && e.name.size() <= 4096 && e.shape.size() <= 16);
      DP_FUZZ_ASSERT(nn::io::printable(e.name).find('\0') == std::string::npos);
    }
    std::vector<float> params, buffers;
    nn::detail::read_checkpoint_data(r, h, params, buffers);
    DP_FUZZ_ASSERT(params.size() == h.n_params && buffers.size() == h.n_buffers);
    DP_FUZZ_ASSERT(r.remaining() == 0);
  } catch (const kernels::Error& e) {
    // Messages name the file in full, never cut at a NUL.
    DP_FUZZ_ASSERT(std::string(e.what()).find(path) != std::string::npos);
  }
  return 0;
}
