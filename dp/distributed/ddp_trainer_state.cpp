// DdpTrainer::save and load: the whole training state through nn/train_state.hpp, with what only
// the trainer knows (mode, world size, every rank's dropout offset, the loss scaler, the step)
// filled in by the trainer. Both are collectives: every rank calls them.
#include "dp/distributed/ddp_trainer.hpp"

#include <exception>

#include "kernels/runtime/error.hpp"
#include "nn/train_state.hpp"

namespace dp::dist {

namespace {

void check_can_save(const char* what, bool wrapped, int zero_stage) {
  DP_CHECK(wrapped, "DdpTrainer::" << what << ": call wrap(model, optimizer) first");
  DP_CHECK(zero_stage == 0, "DdpTrainer::" << what << ": ZeRO-1 shards the optimizer state over "
                                           << "the ranks; this call saves unsharded state only "
                                           << "(set_zero_stage(0))");
}

}  // namespace

void DdpTrainer::save(const std::string& path, const nn::TrainingProgress& position) {
  check_can_save("save", ddp_ != nullptr, zero_stage_);
  nn::Module& m = ddp_->module();
  nn::TrainingProgress state = position;
  state.mode = "ddp";
  state.world_size = world_size();
  state.rng_offsets = all_gather(m.flat().rng_offset);  // every rank's, in rank order
  if (state.step == 0) state.step = optimizer_->step_count() + scaler_.skipped_steps();
  if (scaler_.enabled()) state.scaler = scaler_.state();
  // Rank 0 writes; every rank learns whether it did, so that they fail together.
  std::exception_ptr failed;
  if (rank() == 0) {
    try {
      nn::save_training_state(path, m, *optimizer_, state);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  const std::vector<uint64_t> written = all_gather(failed ? 0 : 1);
  if (failed) std::rethrow_exception(failed);
  DP_CHECK(written[0] == 1, "DdpTrainer::save: rank 0 could not write "
                                << path << " (rank 0's error says why); rank " << rank()
                                << " stops with it");
}

nn::TrainingProgress DdpTrainer::load(const std::string& path,
                                      const nn::TrainingProgress& expected) {
  check_can_save("load", ddp_ != nullptr, zero_stage_);
  // metrics_lag 1: the step pending belongs to the run replaced. Its all-reduce (which every
  // rank issued) is taken and its metrics dropped: settled later, they would be returned as the
  // loaded run's first step's.
  for (LaggedMetrics& slot : lagged_) {
    if (!slot.pending) continue;
    if (slot.work) slot.work->wait();
    slot.work.reset();
    slot.ready.synchronize();
    slot.pending = false;
  }
  nn::TrainingProgress want = expected;
  want.mode = "ddp";
  want.world_size = world_size();
  nn::Module& m = ddp_->module();
  nn::TrainingProgress got;
  std::exception_ptr failed;
  try {
    got = nn::load_training_state(path, m, *optimizer_, want, rank());
  } catch (...) {
    failed = std::current_exception();
  }
  // Every rank learns whether every other loaded (its file may be missing on one node only),
  // then whether they all hold the same state: no rank trains on from another's.
  const std::vector<uint64_t> loaded = all_gather(failed ? 0 : 1);
  if (failed) std::rethrow_exception(failed);
  for (int r = 0; r < world_size(); ++r)
    DP_CHECK(loaded[r] == 1, "DdpTrainer::load: rank "
                                 << r << " could not load " << path << " (rank " << r
                                 << "'s error says why); rank " << rank() << " stops with it");
  const std::vector<float> params = m.flat_params().to_host_f32();
  const uint64_t mine = nn::detail::fnv1a(params.data(), params.size() * sizeof(float),
                                          nn::detail::fnv1a(&got.step, sizeof got.step));
  const std::vector<uint64_t> states = all_gather(mine);
  for (int r = 1; r < world_size(); ++r)
    DP_CHECK(states[r] == states[0], "DdpTrainer::load: rank "
                                         << r << " loaded another state than rank 0 from " << path
                                         << " (its step or weights differ): every rank must read "
                                            "the same checkpoint (a shared path, or one copy "
                                            "per node)");
  if (got.scaler) scaler_.set_state(*got.scaler);
  return got;
}

}  // namespace dp::dist
