#include "kernels/runtime/algo_select.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "kernels/runtime/error.hpp"

namespace kernels {

AlgoPolicy numerics_policy(DType inputs, bool strict_f32, size_t max_workspace) {
  AlgoPolicy p;
  p.excluded_notes = kNoteDownConvert;
  if (inputs == DType::f16 || inputs == DType::bf16) p.excluded_notes |= kNoteWinograd | kNoteFft;
  if (strict_f32) p.excluded_notes |= kNoteTensorCore;
  p.max_workspace_bytes = max_workspace;
  return p;
}

std::vector<AlgoCandidate> admissible(const std::vector<AlgoCandidate>& ranked,
                                      const AlgoPolicy& policy) {
  std::vector<AlgoCandidate> out;
  for (int pass = 0; pass < 2; ++pass)  // deterministic first, then the rest
    for (const AlgoCandidate& c : ranked) {
      if (c.notes & policy.excluded_notes) continue;
      if (c.workspace_bytes > policy.max_workspace_bytes) continue;
      bool deterministic = !(c.notes & kNoteNondeterministic);
      if (deterministic == (pass == 0)) out.push_back(c);
    }
  return out;
}

std::string note_names(uint32_t notes) {
  static const std::pair<uint32_t, const char*> kNames[] = {
      {kNoteWinograd, "winograd"},
      {kNoteFft, "fft"},
      {kNoteDownConvert, "down_convert"},
      {kNoteTensorCore, "tensor_core"},
      {kNoteNondeterministic, "nondeterministic"}};
  std::string s;
  for (const auto& [bit, name] : kNames)
    if (notes & bit) s += (s.empty() ? "" : "|") + std::string(name);
  return s.empty() ? "-" : s;
}

AlgoChoice::AlgoChoice(std::vector<AlgoCandidate> admissible, std::string what, size_t ranked_count)
    : candidates_(std::move(admissible)), what_(std::move(what)) {
  DP_CHECK(!candidates_.empty(), what_ << ": no admissible algorithm (the library offered "
                                       << ranked_count
                                       << "; the numerics policy or the workspace cap "
                                          "excluded every one)");
}

const AlgoCandidate& AlgoChoice::run(const AlgoRun& run) {
  std::string failures;
  for (size_t i = current_; i < candidates_.size(); ++i) {
    const AlgoCandidate& c = candidates_[i];
    AlgoAttempt a = run(c);
    if (a.outcome == AlgoAttempt::Outcome::ok) {
      if (i != current_ || !logged_) {
        if (debug_logging())
          std::fprintf(stderr,
                       "dp: debug: %s: algorithm %s (id %d, notes %s, workspace %zu B)%s%s\n",
                       what_.c_str(), c.name.c_str(), c.id, note_names(c.notes).c_str(),
                       c.workspace_bytes, failures.empty() ? "" : " after ", failures.c_str());
        logged_ = true;
      }
      current_ = i;
      return candidates_[current_];
    }
    failures += (failures.empty() ? "" : "; ") + c.name + " (" + a.detail + ")";
  }
  DP_THROW(what_ << ": every admissible algorithm failed to run: " << failures);
}

std::vector<AlgoCandidate> gemm_candidates(bool lt_fused_found, size_t lt_fused_workspace,
                                           bool lt_found, size_t lt_workspace) {
  std::vector<AlgoCandidate> c;
  if (lt_fused_found)
    c.push_back({kGemmLtFusedBias, "cublasLtMatmul+bias epilogue", lt_fused_workspace, 0, 0});
  if (lt_found) c.push_back({kGemmLt, "cublasLtMatmul", lt_workspace, 0, 0});
  c.push_back({kGemmEx, "cublasGemmEx", 0, 0, 0});
  return c;
}

bool debug_logging() {
  const char* v = std::getenv("DP_LOG");
  return v && std::strcmp(v, "debug") == 0;
}

}  // namespace kernels
