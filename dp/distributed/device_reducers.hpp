// The threaded engine's devices as the ranks of one group in this process, so that research
// code's reducer (a CommHook, dp/distributed/comm_hook.hpp) runs under DP as it does under DDP
// (DataParallelOptions::reducers):
//
//   dp::DataParallelOptions o;
//   o.reducers = dp::dist::device_reducers(devices.size(), [](int) {
//     return std::make_shared<samples::LowRankHook>();
//   });
//
// Rank i is device i's worker thread. The group is Gloo over loopback TCP, met through a store
// server of this process on an ephemeral port that only this group's token opens; CUDA tensors
// travel through pinned host memory (GlooProcessGroup), so logical devices of one GPU work too.
// Each device gets its own hook from make_hook(i): a hook keeps per-rank state (error feedback,
// a warm start), as each DDP rank's does. A device whose step fails leaves the group
// (ProcessGroup::abort), as a dead process's rank would: the others' ops fail at once instead of
// at the timeout, and the reducers cannot be used again.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "dp/cross_node.hpp"
#include "dp/distributed/comm_hook.hpp"

namespace dp::dist {

// requires devices >= 1, make_hook returns a hook for each device. ensures one reducer per
// device, in device order, each the device's end of the group (node() == i), its collectives
// bounded by `timeout` each. Blocks until every rank connected; throws, naming the store, when
// they cannot (no loopback, no port).
std::vector<std::shared_ptr<CrossNode>> device_reducers(
    int devices, const std::function<std::shared_ptr<CommHook>(int device)>& make_hook,
    std::chrono::milliseconds timeout = std::chrono::seconds(300));

}  // namespace dp::dist
