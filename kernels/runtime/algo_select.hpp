// Choosing a library algorithm (a cuDNN convolution algorithm, a cuBLASLt matmul or its
// cublasGemmEx fallback) from the library's ranked candidates. Host-only and library-free, so
// the CPU-only build compiles it and CI tests it with fake candidate lists and fake failures;
// kernels/cuda/conv_pool.cu and gemm.cu describe their candidates in these terms.
//
// Two steps, as PyTorch's cuDNN convolutions do them:
//   1. admissible(): drop the candidates whose numerics break the caller's bound (Winograd and
//      FFT in 16-bit, FP32 -> FP16 down-conversion always, tensor cores under strict f32) or
//      whose workspace is too large; deterministic ones first, each group in library order.
//   2. AlgoChoice::run(): run the current candidate; when it reports `unsupported` (cuDNN's
//      NOT_SUPPORTED, cuBLAS's NOT_SUPPORTED or INVALID_VALUE at execution), go on to the next.
//      The first that runs stays chosen, and is logged under DP_LOG=debug.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/runtime/dtype.hpp"

namespace kernels {

// Numerical and behaviour notes of a candidate, after cuDNN's CUDNN_NUMERICAL_NOTE_* and
// CUDNN_BEHAVIOR_NOTE_*: bits of AlgoCandidate::notes.
enum AlgoNote : uint32_t {
  kNoteWinograd = 1u << 0,          // Winograd transform: error grows past the 16-bit bound
  kNoteFft = 1u << 1,               // FFT (or FFT tiling): likewise
  kNoteDownConvert = 1u << 2,       // may convert FP32 inputs to FP16 (tensor-op conversion)
  kNoteTensorCore = 1u << 3,        // tensor-op math (TF32 for f32 inputs)
  kNoteNondeterministic = 1u << 4,  // atomics: bits may differ between runs
};

// One candidate as the library ranked it.
struct AlgoCandidate {
  int id = 0;        // the library's algorithm id (or the caller's path id)
  std::string name;  // for logs and errors: "IMPLICIT_PRECOMP_GEMM", "cublasGemmEx"
  size_t workspace_bytes = 0;
  uint32_t notes = 0;  // AlgoNote bits
  int math = 0;        // the library's math type to run it with (opaque here)
};

// What the caller admits.
struct AlgoPolicy {
  uint32_t excluded_notes = 0;  // a candidate with any of these notes is dropped
  size_t max_workspace_bytes = SIZE_MAX;
};

// The policy of a convolution (or any f32-accumulating product) on `inputs` operands: never
// down-conversion; in 16-bit no Winograd or FFT (their error exceeds the per-element bound the
// 16-bit tests derive); under strict f32 math no tensor cores. ensures max_workspace_bytes =
// `max_workspace`.
AlgoPolicy numerics_policy(DType inputs, bool strict_f32, size_t max_workspace);

// requires nothing. ensures the candidates `policy` admits, deterministic ones first, each
// group in `ranked`'s order (the library's, fastest first).
std::vector<AlgoCandidate> admissible(const std::vector<AlgoCandidate>& ranked,
                                      const AlgoPolicy& policy);

// "winograd|fft" for the notes set in `notes` ("-" for none).
std::string note_names(uint32_t notes);

// What running one candidate did: `ok`, or `unsupported` (try the next one) with the library's
// words. Any other failure is thrown by the run callback and ends the choice.
struct AlgoAttempt {
  enum class Outcome { ok, unsupported };
  Outcome outcome = Outcome::ok;
  std::string detail;
  static AlgoAttempt success() { return {}; }
  static AlgoAttempt unsupported(std::string why) { return {Outcome::unsupported, std::move(why)}; }
};

using AlgoRun = std::function<AlgoAttempt(const AlgoCandidate&)>;

// The chosen algorithm of one plan (one shape, dtype and math mode), with the admissible
// candidates left to fall back on.
class AlgoChoice {
 public:
  AlgoChoice() = default;
  // requires `admissible` from admissible(); `what` names the operation, shape and dtype for
  // logs and errors. Throws when `admissible` is empty, naming `what` and `ranked_count` (how
  // many the library offered before the policy).
  AlgoChoice(std::vector<AlgoCandidate> admissible, std::string what, size_t ranked_count);

  // The candidate the next run starts with.
  const AlgoCandidate& current() const { return candidates_[current_]; }
  const std::vector<AlgoCandidate>& candidates() const { return candidates_; }

  // Runs the current candidate and, while one reports unsupported, the next ones. ensures the
  // one that ran is current (later calls start there) and is returned; the first success is
  // logged under DP_LOG=debug. Throws when every remaining candidate is unsupported, naming
  // `what` and each failure; exceptions from `run` propagate unchanged.
  const AlgoCandidate& run(const AlgoRun& run);

 private:
  std::vector<AlgoCandidate> candidates_;
  std::string what_;
  size_t current_ = 0;
  bool logged_ = false;
};

// cuBLASLt or its fallback, for one GEMM shape. ids of the candidates gemm_candidates() makes.
enum GemmPath : int { kGemmLtFusedBias = 0, kGemmLt = 1, kGemmEx = 2 };

// The GEMM candidates in order: cuBLASLt with the bias epilogue (when its heuristic found an
// algorithm), plain cuBLASLt (likewise), and always cublasGemmEx with the same operand and
// compute types, so a shape the heuristic has nothing for (a dimension of 1, leading
// dimensions that are not 16-byte multiples) still runs.
std::vector<AlgoCandidate> gemm_candidates(bool lt_fused_found, size_t lt_fused_workspace,
                                           bool lt_found, size_t lt_workspace);

// Whether DP_LOG asks for debug logs ("debug"; read on every call, so tests may set it).
bool debug_logging();

}  // namespace kernels
