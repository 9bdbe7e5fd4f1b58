// Hybrid data parallelism: the threaded DataParallel inside a node, and its device 0 joined to
// the other nodes' device 0 (one process per node) through a collective library, as Horovod's
// hierarchical all-reduce and NCCL's intra/inter-node split do. The engine sees only this
// interface; dp/distributed implements it on a ProcessGroup (dp::dist::GroupCrossNode: Gloo,
// MPI or NCCL).
//
// In a hybrid step every node is handed the same global batch. Node r takes its chunk
// (dp::chunk_sizes over the nodes), splits it over its devices, and weights each device's
// gradient by its share of the GLOBAL loss denominator; device 0 sums its devices' buckets as
// usual, and each bucket, once summed, is summed over the nodes while backward goes on. Every
// node then holds the global batch's mean gradient and takes the same optimizer step.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/runtime/tensor.hpp"

namespace dp {

class CrossNode {
 public:
  virtual ~CrossNode() = default;
  virtual int nodes() const = 0;  // >= 1
  virtual int node() const = 0;   // in [0, nodes())
  // Collectives: every node calls them in the same order, from one thread at a time; t lives on
  // this node's device 0.
  // ensures t = node 0's t on every node (waits).
  virtual void broadcast(kernels::Tensor& t) = 0;
  // Starts t = the sum over nodes of t. The caller leaves t alone until finish().
  virtual void start_sum(kernels::Tensor& t) = 0;
  // Starts gradient bucket `bucket`'s sum over nodes: t is device 0's bucket (elements
  // [offset, offset + numel) of the flat gradient), the node's gradient weighted by its share of
  // the global batch (`share`: the nodes' shares add to 1). Buckets come in bucket order, the same
  // on every node. Default: start_sum(t); an implementation may reduce it otherwise (a comm
  // hook: dp::dist::GroupCrossNode), leaving in t by finish() what every node steps with.
  virtual void start_bucket_sum(kernels::Tensor& t, int bucket, int64_t offset, float share) {
    (void)bucket, (void)offset, (void)share;
    start_sum(t);
  }
  // Waits for every start_sum and start_bucket_sum since the last finish(), in the order they
  // started; throws naming the node and the op on a failure or a timeout (a dead node stops the
  // run, it does not hang it).
  virtual void finish() = 0;
  // Leaves the link for good, as a node that died would: this node's later collectives fail
  // naming `why`, and the other nodes' collectives that wait for it fail promptly rather than
  // at their timeout (dp::dist::ProcessGroup::abort). Thread-safe.
  virtual void abort(const std::string& why) = 0;
  // The bytes handed to the collectives so far (what crosses between nodes, before the
  // library's algorithm).
  virtual int64_t payload_bytes() const = 0;
};

}  // namespace dp
