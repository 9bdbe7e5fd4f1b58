#include "benchmarks/gpt_workload.hpp"

#include <memory>

#include "dp/data/text.hpp"
#include "nn/gpt.hpp"
#include "nn/llama.hpp"
#include "nn/loss.hpp"

namespace bench {

namespace {
// A language model's batches: synthetic tokens of `vocab` from (seed, step), the token loss.
void token_batches(Workload& w, int64_t vocab, int64_t seq, uint64_t seed) {
  w.make_batch = [vocab, seq, seed](int64_t step, int64_t batch) {
    auto [ids, targets] = dp::data::synthetic_token_batch(batch, seq, vocab, seed, step);
    dp::data::Batch b;
    b.images = std::move(ids);
    b.labels = std::move(targets);
    b.first_index = step * batch;
    return b;
  };
  w.loss = std::make_shared<nn::TokenCrossEntropyLoss>();
  w.tokens_per_sample = seq;
}
}  // namespace

Workload gpt_workload(const std::string& config, int64_t seq, float dropout, uint64_t seed,
                      Blocks blocks, std::optional<int64_t> loss_chunk) {
  nn::GptConfig c = nn::GptConfig::preset(config);
  c.dropout = dropout;
  c.recompute = blocks == Blocks::recomputed;
  if (loss_chunk) c.loss_chunk = *loss_chunk;
  DP_CHECK(seq >= 1 && seq <= c.context, "--seq " << seq << " with --gpt-config " << config
                                                  << ": give 1 to the context, " << c.context);
  Workload w;
  w.name = "gpt-" + config;
  w.make_model = [c] { return std::make_shared<nn::Gpt>(c); };
  token_batches(w, c.vocab, seq, seed);
  w.flops_per_token = c.flops_per_token(seq);
  if (c.recompute) w.recompute_flops_per_token = c.block_forward_flops_per_token(seq);
  return w;
}

Workload llama_workload(int64_t seq, uint64_t seed, Blocks blocks,
                        std::optional<int64_t> loss_chunk) {
  nn::LlamaConfig c = nn::LlamaConfig::preset("tiny");
  c.recompute = blocks == Blocks::recomputed;
  if (loss_chunk) c.loss_chunk = *loss_chunk;
  DP_CHECK(seq >= 1 && seq <= c.context,
           "--seq " << seq << " with --model llama: give 1 to the context, " << c.context);
  Workload w;
  w.name = "llama-tiny";
  w.make_model = [c] { return std::make_shared<nn::Llama>(c); };
  token_batches(w, c.vocab, seq, seed);
  w.flops_per_token = c.flops_per_token(seq);
  if (c.recompute) w.recompute_flops_per_token = c.block_forward_flops_per_token(seq);
  return w;
}

}  // namespace bench
