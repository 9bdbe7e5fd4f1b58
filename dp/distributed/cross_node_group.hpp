// dp::CrossNode on a ProcessGroup (Gloo, MPI or NCCL): the hybrid mode's link between nodes.
// One rank per node: the group's rank is the node's index, its size the node count.
#pragma once

#include <memory>
#include <vector>

#include "dp/cross_node.hpp"
#include "dp/distributed/comm_hook.hpp"
#include "dp/distributed/process_group.hpp"

namespace dp::dist {

class GroupCrossNode : public CrossNode {
 public:
  // requires group outlives this object. hook (optional): research code's reducer
  // (dp/distributed/comm_hook.hpp) for the gradient buckets' sums over nodes, in place of the
  // built-in all-reduce (AllReduceHook, dp/distributed/builtin_hooks.hpp: with one node, nothing
  // to hand over); the loss, counts and buffers are still summed. Its GradBucket holds device
  // 0's bucket, the node's share of the global batch and this group. `who` names the engine in
  // a refusal ("hybrid"; "DP" for dp::dist::device_reducers).
  explicit GroupCrossNode(ProcessGroup& group, std::shared_ptr<CommHook> hook = nullptr,
                          const char* who = "hybrid");
  int nodes() const override { return group_.size(); }
  int node() const override { return group_.rank(); }
  void broadcast(kernels::Tensor& t) override { group_.broadcast(t, 0)->wait(); }
  void start_sum(kernels::Tensor& t) override {
    pending_.push_back(group_.all_reduce(t, ReduceOp::sum));
  }
  void start_bucket_sum(kernels::Tensor& t, int bucket, int64_t offset, float share) override;
  void finish() override;
  void abort(const std::string& why) override { group_.abort(why); }
  int64_t payload_bytes() const override { return group_.payload_bytes(); }
  // Research code's hook, or null (the built-in all-reduce).
  CommHook* hook() const { return user_hook_ ? hook_.get() : nullptr; }

 private:
  ProcessGroup& group_;
  std::shared_ptr<CommHook> hook_;  // the buckets' reducer: the user's or the built-in one
  bool user_hook_;
  const char* who_;
  std::vector<std::shared_ptr<Work>> pending_;
};

}  // namespace dp::dist
