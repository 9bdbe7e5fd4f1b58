// DP against DDP on your own model: a small residual MLP on its own data, trained with its own
// recipe (AdamW with weight decay on the matrices only, the gradient clipped to norm 1), measured
// by the same machinery as dp_bench (benchmarks/compare.hpp). DDP also runs with a reducer of
// your own, a communication hook (here PowerSGD, samples/low_rank_hook.hpp): the "hook" rows,
// with its bytes and step time beside the built-in all-reduce's. Every dp_bench flag works but
// --model and --optim, which the workload replaces:
//   build/bin/compare_my_model --device cpu --gpus 4 --mode both --repeat 5 --steps 50
#include <memory>

#include "benchmarks/compare.hpp"
#include "dp/data/synthetic.hpp"
#include "low_rank_hook.hpp"  // beside this file: the sample builds from an install too
#include "nn/nn.hpp"

namespace {

constexpr int64_t kFeatures = 48, kWidth = 96, kClasses = 6;

// x (N, 48) -> Linear 96 -> ReLU -> [x + Linear(ReLU(Linear x))] -> ReLU -> Linear 6.
nn::ModulePtr residual_mlp() {
  auto block =
      nn::sequential({std::make_shared<nn::Linear>(kWidth, kWidth), std::make_shared<nn::ReLU>(),
                      std::make_shared<nn::Linear>(kWidth, kWidth)});
  return nn::sequential(
      {std::make_shared<nn::Linear>(kFeatures, kWidth), std::make_shared<nn::ReLU>(),
       std::make_shared<nn::Residual>(block, nullptr), std::make_shared<nn::ReLU>(),
       std::make_shared<nn::Linear>(kWidth, kClasses)});
}

// Labelled vectors of 48 features: each class has its own prototype, plus noise.
std::unique_ptr<dp::data::Dataset> vectors(int64_t samples) {
  dp::data::SyntheticOptions options;
  options.signal = 0.3f;
  return std::make_unique<dp::data::SyntheticDataset>(samples, kernels::Shape{kFeatures}, kClasses,
                                                      /*seed=*/11, options);
}

// The run's optimizer, made on each mode's model: AdamW, decay by parameter (nanoGPT's rule).
std::unique_ptr<nn::Optimizer> adamw(nn::Module& model) {
  kernels::AdamWConfig c;
  c.lr = 2e-3f;
  return std::make_unique<nn::GroupedAdamW>(model, c, nn::decay_by_parameter(model, 0.1f));
}

}  // namespace

int main(int argc, char** argv) {
  bench::Workload w{"residual_mlp", residual_mlp, vectors};
  w.make_optimizer = adamw;
  w.optimizer_name = "adamw+groups";
  w.clip_grad_norm = 1.f;
  w.make_comm_hook = [] {
    samples::LowRankOptions o;
    o.start_step = 2;  // compress early: short runs show it (PyTorch suggests ~1,000 steps whole)
    return std::make_shared<samples::LowRankHook>(o);
  };
  return bench::compare(w, argc, argv);
}
