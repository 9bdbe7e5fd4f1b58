// SyncBatchNorm for DDP: the ranks combine their BatchNorm statistics with one all_reduce of
// the packed per-channel sums (f32, on the rank's device) per layer and pass.
#pragma once

#include <vector>

#include "dp/distributed/process_group.hpp"
#include "nn/norm.hpp"

namespace dp::dist {

class GroupStatsSync final : public nn::StatsSync {
 public:
  // `group` outlives this object; `device` is the rank's.
  GroupStatsSync(ProcessGroup& group, kernels::Device device) : group_(group), device_(device) {}

  void all_reduce_sum(std::vector<double>& values) override {
    std::vector<float> f(values.begin(), values.end());
    kernels::Tensor t = kernels::Tensor::from_vector(f, {static_cast<int64_t>(f.size())}, device_);
    group_.all_reduce(t, ReduceOp::sum)->wait();
    f = t.to_host_f32();
    values.assign(f.begin(), f.end());
  }

 private:
  ProcessGroup& group_;
  kernels::Device device_;
};

}  // namespace dp::dist
