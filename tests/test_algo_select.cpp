// runtime.algo_select.*: the choice of a cuDNN convolution algorithm and of cuBLASLt or its
// cublasGemmEx fallback, with fake candidate lists and fake failures (no GPU needed).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/runtime/algo_select.hpp"
#include "tests/test_util.hpp"

using namespace kernels;

namespace {

// A ranked list as cuDNN's heuristic could give it for a stride-1 3x3 convolution.
std::vector<AlgoCandidate> ranked_conv() {
  return {
      {6, "WINOGRAD", 0, kNoteWinograd | kNoteTensorCore, 1},
      {5, "FFT_TILING", 1 << 20, kNoteFft, 0},
      {1, "IMPLICIT_PRECOMP_GEMM", 4096, kNoteTensorCore | kNoteNondeterministic, 1},
      {1, "IMPLICIT_PRECOMP_GEMM", 4096, kNoteDownConvert | kNoteTensorCore, 2},
      {0, "IMPLICIT_GEMM", 0, kNoteTensorCore, 1},
      {2, "GEMM", size_t{1} << 30, 0, 0},
      {3, "DIRECT", 0, 0, 0},
  };
}

std::vector<std::string> names(const std::vector<AlgoCandidate>& c) {
  std::vector<std::string> out;
  for (const auto& x : c) out.push_back(x.name);
  return out;
}

// A run callback whose candidates named in `unsupported` answer NOT_SUPPORTED; records the tries.
struct FakeRun {
  std::vector<std::string> unsupported;
  std::vector<std::string> tried;
  AlgoRun fn() {
    return [this](const AlgoCandidate& c) {
      tried.push_back(c.name);
      for (const auto& u : unsupported)
        if (u == c.name) return AlgoAttempt::unsupported("CUDNN_STATUS_NOT_SUPPORTED");
      return AlgoAttempt::success();
    };
  }
};

using dp_test::capture_stderr;

struct EnvScope {
  std::string name;
  EnvScope(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~EnvScope() { unsetenv(name.c_str()); }
};

}  // namespace

TEST_CASE("runtime.algo_select: 16-bit convolutions never get Winograd, FFT or down-conversion") {
  for (DType t : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(t));
    auto a = admissible(ranked_conv(), numerics_policy(t, false, size_t{256} << 20));
    // deterministic first in the library's order, then the nondeterministic one; GEMM is over
    // the workspace cap
    CHECK(names(a) == std::vector<std::string>{"IMPLICIT_GEMM", "DIRECT", "IMPLICIT_PRECOMP_GEMM"});
    for (const auto& c : a) CHECK((c.notes & (kNoteWinograd | kNoteFft | kNoteDownConvert)) == 0);
  }
}

TEST_CASE("runtime.algo_select: tf32 f32 keeps Winograd and tensor cores but never down-converts") {
  auto a = admissible(ranked_conv(), numerics_policy(DType::f32, false, SIZE_MAX));
  CHECK(names(a) == std::vector<std::string>{"WINOGRAD", "FFT_TILING", "IMPLICIT_GEMM", "GEMM",
                                             "DIRECT", "IMPLICIT_PRECOMP_GEMM"});
  for (const auto& c : a) CHECK((c.notes & kNoteDownConvert) == 0);
  // strict f32: no tensor cores either
  auto strict = admissible(ranked_conv(), numerics_policy(DType::f32, true, SIZE_MAX));
  CHECK(names(strict) == std::vector<std::string>{"FFT_TILING", "GEMM", "DIRECT"});
}

TEST_CASE(
    "runtime.algo_select: NOT_SUPPORTED at run time moves to the next candidate, which stays") {
  auto a = admissible(ranked_conv(), numerics_policy(DType::bf16, false, size_t{256} << 20));
  AlgoChoice choice(a, "conv2d_forward bf16 (8, 1, 28, 28)", ranked_conv().size());
  FakeRun run{{"IMPLICIT_GEMM"}, {}};
  CHECK(choice.run(run.fn()).name == "DIRECT");
  CHECK(run.tried == std::vector<std::string>{"IMPLICIT_GEMM", "DIRECT"});
  // the next call starts at the one that ran: no second failed attempt
  run.tried.clear();
  CHECK(choice.run(run.fn()).name == "DIRECT");
  CHECK(run.tried == std::vector<std::string>{"DIRECT"});
  CHECK(choice.current().name == "DIRECT");
}

TEST_CASE("runtime.algo_select: every candidate failing throws naming the plan and each failure") {
  auto a = admissible(ranked_conv(), numerics_policy(DType::f16, false, size_t{256} << 20));
  AlgoChoice choice(a, "conv2d_backward_data f16 (4, 6, 12, 12)", 7);
  FakeRun run{{"IMPLICIT_GEMM", "DIRECT", "IMPLICIT_PRECOMP_GEMM"}, {}};
  std::string msg = dp_test::error_of([&] { choice.run(run.fn()); });
  CHECK(msg.find("conv2d_backward_data f16 (4, 6, 12, 12)") != std::string::npos);
  CHECK(msg.find("DIRECT (CUDNN_STATUS_NOT_SUPPORTED)") != std::string::npos);
  CHECK(run.tried.size() == 3);
  // a throwing run (another failure than NOT_SUPPORTED) propagates unchanged, nothing more tried
  run.tried.clear();
  AlgoChoice fresh(a, "conv", 7);
  CHECK(dp_test::error_of([&] {
          fresh.run([&](const AlgoCandidate& c) -> AlgoAttempt {
            run.tried.push_back(c.name);
            DP_THROW("cudnnConvolutionForward failed: CUDNN_STATUS_EXECUTION_FAILED");
          });
        }).find("EXECUTION_FAILED") != std::string::npos);
  CHECK(run.tried.size() == 1);
}

TEST_CASE("runtime.algo_select: no admissible candidate is an error naming the plan") {
  std::vector<AlgoCandidate> only_fast = {{6, "WINOGRAD", 0, kNoteWinograd, 1},
                                          {4, "FFT", 0, kNoteFft, 0}};
  auto a = admissible(only_fast, numerics_policy(DType::bf16, false, SIZE_MAX));
  CHECK(a.empty());
  std::string msg =
      dp_test::error_of([&] { AlgoChoice(a, "conv2d_forward bf16 (1, 1, 5, 5)", 2); });
  CHECK(msg.find("conv2d_forward bf16 (1, 1, 5, 5)") != std::string::npos);
  CHECK(msg.find("offered 2") != std::string::npos);
}

TEST_CASE("runtime.algo_select: GEMM falls back to cublasGemmEx when cuBLASLt has no algorithm") {
  // the heuristic found nothing (a dimension of 1, or INVALID_VALUE): cublasGemmEx alone
  auto none = gemm_candidates(false, 0, false, 0);
  REQUIRE(none.size() == 1);
  CHECK(none[0].id == kGemmEx);
  AlgoChoice c0(none, "gemm (1, 47) x (47, 10)", 3);
  FakeRun run0;
  CHECK(c0.run(run0.fn()).id == kGemmEx);

  // both cuBLASLt entries found, but they answer NOT_SUPPORTED at run time: GemmEx runs
  auto all = gemm_candidates(true, 1024, true, 0);
  CHECK(names(all) ==
        std::vector<std::string>{"cublasLtMatmul+bias epilogue", "cublasLtMatmul", "cublasGemmEx"});
  AlgoChoice c1(all, "gemm (8, 84) x (84, 1)", 3);
  FakeRun run1{{"cublasLtMatmul+bias epilogue", "cublasLtMatmul"}, {}};
  CHECK(c1.run(run1.fn()).id == kGemmEx);
  CHECK(run1.tried.size() == 3);

  // only the fused epilogue fails: plain cuBLASLt (the bias then goes in a separate kernel)
  AlgoChoice c2(all, "gemm", 3);
  FakeRun run2{{"cublasLtMatmul+bias epilogue"}, {}};
  CHECK(c2.run(run2.fn()).id == kGemmLt);
}

TEST_CASE("runtime.algo_select: DP_LOG=debug logs the algorithm chosen, once per plan") {
  EnvScope env("DP_LOG", "debug");
  CHECK(debug_logging());
  auto a = admissible(ranked_conv(), numerics_policy(DType::bf16, false, size_t{256} << 20));
  AlgoChoice choice(a, "conv2d_forward bf16 (8, 1, 28, 28)", 7);
  FakeRun run{{"IMPLICIT_GEMM"}, {}};
  std::string err = capture_stderr([&] {
    choice.run(run.fn());
    choice.run(run.fn());
  });
  CHECK(err.find("conv2d_forward bf16 (8, 1, 28, 28): algorithm DIRECT") != std::string::npos);
  CHECK(err.find("after IMPLICIT_GEMM") != std::string::npos);
  CHECK(err.find("algorithm", err.find("algorithm") + 1) == std::string::npos);  // once
  unsetenv("DP_LOG");
  CHECK_FALSE(debug_logging());
  CHECK(note_names(kNoteWinograd | kNoteTensorCore) == "winograd|tensor_core");
}
