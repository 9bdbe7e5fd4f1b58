#include "dp/distributed/cross_node_group.hpp"

#include "dp/distributed/builtin_hooks.hpp"

namespace dp::dist {

GroupCrossNode::GroupCrossNode(ProcessGroup& group, std::shared_ptr<CommHook> hook, const char* who)
    : group_(group), user_hook_(hook != nullptr), who_(who) {
  hook_ = user_hook_ ? std::move(hook) : std::make_shared<AllReduceHook>();
}

void GroupCrossNode::start_bucket_sum(kernels::Tensor& t, int bucket, int64_t offset, float share) {
  GradBucket b;
  b.index = bucket;
  b.offset = offset;
  b.grad = t;
  b.share = share;
  b.share_at = kernels::Scalar(share);  // reduce() runs on the host each step: a fixed value
  b.group = &group_;
  if (std::shared_ptr<Work> work = run_hook(*hook_, b, who_)) pending_.push_back(std::move(work));
}

void GroupCrossNode::finish() {
  std::vector<std::shared_ptr<Work>> works;
  works.swap(pending_);
  wait_all(works);  // in issue order; throws the first failure (named by the group)
  works.clear();
  pending_.swap(works);  // keeps the capacity for the next step
}

}  // namespace dp::dist
