// dp_bench's language-model workloads (--model gpt, --model llama): nn::Gpt of a preset, or the
// tiny nn::Llama, on synthetic tokens
// (dp::data::synthetic_token_batch), token cross-entropy over (B, T, vocab), and the FLOPs per
// token that tokens/s and MFU are reported with.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "benchmarks/bench_common.hpp"

namespace bench {

// Whether the model's transformer blocks are checkpointed (--recompute: Module::set_recompute).
enum class Blocks { kept, recomputed };

// requires config a GptConfig preset name; 1 <= seq <= its context (throws naming both
// otherwise); 0 <= dropout < 1. ensures a workload named "gpt-<config>" whose batch of step s
// is (ids, targets) (B, seq) i32 from (seed, s), the same for every mode and device count.
// loss_chunk: GptConfig::loss_chunk (>= 0), unset: the preset's; the same for the Llama below.
Workload gpt_workload(const std::string& config, int64_t seq, float dropout, uint64_t seed,
                      Blocks blocks = Blocks::kept,
                      std::optional<int64_t> loss_chunk = std::nullopt);
// The same for the tiny Llama (nn/llama.hpp), named "llama-tiny". requires 1 <= seq <= its
// context (throws naming both otherwise).
Workload llama_workload(int64_t seq, uint64_t seed, Blocks blocks = Blocks::kept,
                        std::optional<int64_t> loss_chunk = std::nullopt);

}  // namespace bench
