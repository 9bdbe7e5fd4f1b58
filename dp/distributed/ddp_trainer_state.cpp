// DdpTrainer::save and load: the whole training state through nn/train_state.hpp, with what only
// the trainer knows (mode, world size, every rank's dropout offset, the loss scaler, the step,
// ZeRO-1's shards) filled in by the trainer. Both are collectives: every rank calls them.
#include "dp/distributed/ddp_trainer.hpp"

#include <exception>

#include "kernels/runtime/error.hpp"
#include "nn/train_state.hpp"

namespace dp::dist {

namespace {

void check_wrapped(const char* what, bool wrapped) {
  DP_CHECK(wrapped, "DdpTrainer::" << what << ": call wrap(model, optimizer) first");
}

}  // namespace

nn::TrainingProgress DdpTrainer::here(const nn::TrainingProgress& progress) const {
  nn::TrainingProgress out = progress;
  out.mode = "ddp";
  out.world_size = world_size();
  out.optimizer_shards = zero_ ? world_size() : 1;
  return out;
}

void DdpTrainer::save(const std::string& path, const nn::TrainingProgress& position) {
  check_wrapped("save", ddp_ != nullptr);
  nn::Module& m = ddp_->module();
  nn::TrainingProgress state = here(position);
  state.rng_offsets = all_gather(m.flat().rng_offset);  // every rank's, in rank order
  if (state.step == 0) state.step = optimizer_->step_count() + scaler_.skipped_steps();
  if (scaler_.enabled()) state.scaler = scaler_.state();
  // ZeRO-1: every rank's shard gathered into the whole state (a collective), so that the file
  // does not depend on the world size or the sharding.
  const nn::OptimizerState whole = zero_ ? zero_->gather_optimizer_state() : nn::OptimizerState{};
  // Rank 0 writes; every rank learns whether it did, so that they fail together.
  std::exception_ptr failed;
  if (rank() == 0) {
    try {
      nn::save_training_state(path, m, *optimizer_, state, whole);
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
  check_wrapped("load", ddp_ != nullptr);
  // metrics_lag 1: the step pending belongs to the run replaced. Its all-reduce (which every
  // rank issued) is taken and its metrics dropped (a fault it saw still reported): settled
  // later, they would be returned as the loaded run's first step's.
  for (LaggedSlot& slot : lagged_)
    if (slot.pending) take_lagged(slot, Waited::no);
  report_lagged_fault();
  nn::TrainingProgress got;
  std::exception_ptr failed;
  try {
    got = nn::load_training_state(path, ddp_->module(), *optimizer_, here(expected), rank());
  } catch (...) {
    failed = std::current_exception();
  }
  agree_on_loaded_state(path, got.step, failed);
  if (got.scaler) scaler_.set_state(*got.scaler);
  return got;
}

nn::Resumed DdpTrainer::resume(const std::string& resume, const std::string& dir,
                               const nn::TrainingProgress& expected) {
  DP_CHECK(ddp_ != nullptr, "DdpTrainer::resume: call wrap(model, optimizer) first");
  nn::Resumed out;
  if (resume.empty()) return out;
  std::exception_ptr failed;
  try {
    out =
        nn::resume_training_state(resume, dir, ddp_->module(), *optimizer_, here(expected), rank());
  } catch (...) {
    failed = std::current_exception();
  }
  agree_on_loaded_state(out.path, out.progress.step, failed);
  return out;
}

void DdpTrainer::agree_on_loaded_state(const std::string& path, int64_t step,
                                       std::exception_ptr failed) {
  // Whether every rank loaded (its file may be missing on one node only), then whether they all
  // hold the same state: no rank trains on from another's. One collective: each rank's
  // verdict, step and weights digest (a rank whose digest fails still takes part).
  uint64_t digest = 0;
  if (!failed) {
    try {
      const std::vector<float> params = ddp_->module().flat_params().to_host_f32();
      digest = nn::detail::fnv1a(params.data(), params.size() * sizeof(float));
    } catch (...) {
      failed = std::current_exception();
    }
  }
  const std::vector<uint64_t> got =
      all_gather({failed ? uint64_t{0} : uint64_t{1}, static_cast<uint64_t>(step), digest});
  if (failed) std::rethrow_exception(failed);
  auto loaded = [&](int r) { return got[3 * r]; };
  auto steps = [&](int r) { return got[3 * r + 1]; };
  auto weights = [&](int r) { return got[3 * r + 2]; };
  for (int r = 0; r < world_size(); ++r)
    DP_CHECK(loaded(r) == 1, "DdpTrainer: rank " << r
                                                 << " could not load its training state (its "
                                                    "error says why); rank "
                                                 << rank() << " stops with it (it loaded "
                                                 << (path.empty() ? "nothing" : path) << ")");
  for (int r = 1; r < world_size(); ++r)
    DP_CHECK(steps(r) == steps(0) && weights(r) == weights(0),
             "DdpTrainer: rank " << r << " loaded another state than rank 0 (step " << steps(r)
                                 << " against " << steps(0)
                                 << (steps(r) == steps(0) ? ", other weights" : "") << "; rank "
                                 << rank() << " loaded " << (path.empty() ? "nothing" : path)
                                 << "): every rank must read the same checkpoint (a shared "
                                    "folder, or the same files on every node)");
}

}  // namespace dp::dist
