// dp::CrossNode on a ProcessGroup (Gloo, MPI or NCCL): the hybrid mode's link between nodes.
// One rank per node: the group's rank is the node's index, its size the node count.
#pragma once

#include <memory>
#include <vector>

#include "dp/cross_node.hpp"
#include "dp/distributed/process_group.hpp"

namespace dp::dist {

class GroupCrossNode : public CrossNode {
 public:
  // requires group outlives this object.
  explicit GroupCrossNode(ProcessGroup& group) : group_(group) {}
  int nodes() const override { return group_.size(); }
  int node() const override { return group_.rank(); }
  void broadcast(kernels::Tensor& t) override { group_.broadcast(t, 0)->wait(); }
  void start_sum(kernels::Tensor& t) override {
    pending_.push_back(group_.all_reduce(t, ReduceOp::sum));
  }
  void finish() override {
    std::vector<std::shared_ptr<Work>> works;
    works.swap(pending_);
    wait_all(works);  // in issue order; throws the first failure (named by the group)
    works.clear();
    pending_.swap(works);  // keeps the capacity for the next step
  }
  int64_t payload_bytes() const override { return group_.payload_bytes(); }

 private:
  ProcessGroup& group_;
  std::vector<std::shared_ptr<Work>> pending_;
};

}  // namespace dp::dist
