// DataParallel::save and load: the whole training state through nn/train_state.hpp, with the
// parts only the engine knows (mode, device count, every replica's dropout offset, the loss
// scaler, the step) filled in by the engine rather than by the caller.
#include "dp/data_parallel.hpp"
#include "nn/train_state.hpp"

namespace dp {

void DataParallel::save(const std::string& path, const nn::TrainingProgress& position) {
  if (options_.metrics_lag > 0) drain();  // the last step's update may still be running
  nn::TrainingProgress state = position;
  state.mode = "dp";
  state.world_size = n_devices();
  state.rng_offsets = rng_offsets();
  if (state.step == 0) state.step = step_index_;
  if (scaler_.enabled()) state.scaler = scaler_.state();
  nn::save_training_state(path, module(), optimizer_, state);
}

nn::TrainingProgress DataParallel::load(const std::string& path,
                                        const nn::TrainingProgress& expected) {
  if (options_.metrics_lag > 0) drain();  // nothing may still read or write what is loaded
  nn::TrainingProgress want = expected;
  want.mode = "dp";
  want.world_size = n_devices();
  nn::TrainingProgress got = nn::load_training_state(path, module(), optimizer_, want);
  set_rng_offsets(got.rng_offsets);
  if (got.scaler) scaler_.set_state(*got.scaler);
  step_index_ = got.step;
  // A pending step's metrics describe the run replaced: settled after this, they would be
  // returned as the loaded run's, and their verdict would move the loaded loss scale.
  for (auto& slot : lagged_) slot.pending = false;
  return got;
}

}  // namespace dp
