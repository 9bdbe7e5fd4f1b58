// ProcessGroup over Gloo's TCP transport. Ops run on one worker thread per group, in issue
// order; CPU tensors are used in place, CUDA tensors travel through pinned host memory
// (D2H, Gloo op, H2D on the worker), which is how several ranks share one GPU.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "dp/distributed/process_group.hpp"

namespace dp::dist {

class Store;

struct GlooOptions {
  std::string hostname = "127.0.0.1";  // address peers connect to (ignored with interface)
  std::string interface;               // network interface name, e.g. "eth0"
  std::chrono::milliseconds timeout = std::chrono::seconds(300);  // each op
  // Connecting the full mesh: reading every peer's address and connecting every pair. A peer
  // that publishes no address, or never connects, fails the set-up within about this long.
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(60);
};

class GlooProcessGroup final : public ProcessGroup {
 public:
  // requires 0 <= rank < size; `store` private to this group (a PrefixStore).
  // Connects the full mesh through the store; blocks until every rank connected, or throws
  // after options.connect_timeout.
  GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size, const GlooOptions& options);
  // Runs the ops still queued (each bounded by its timeout), then closes the connections.
  ~GlooProcessGroup() override;

  std::string backend_name() const override { return "gloo"; }
  std::shared_ptr<Work> do_all_reduce(kernels::Tensor& t, ReduceOp op = ReduceOp::sum) override;
  std::shared_ptr<Work> do_broadcast(kernels::Tensor& t, int root) override;
  std::shared_ptr<Work> do_reduce(kernels::Tensor& t, int root,
                                  ReduceOp op = ReduceOp::sum) override;
  std::shared_ptr<Work> do_all_gather(kernels::Tensor& out, const kernels::Tensor& in) override;
  std::shared_ptr<Work> do_reduce_scatter(kernels::Tensor& out, const kernels::Tensor& in,
                                          ReduceOp op = ReduceOp::sum) override;
  std::shared_ptr<Work> do_send(const kernels::Tensor& t, int dst, uint32_t tag = 0) override;
  std::shared_ptr<Work> do_recv(kernels::Tensor& t, int src, uint32_t tag = 0) override;
  std::shared_ptr<Work> do_barrier() override;
  // ProcessGroup::abort: records `why` as this rank's failure (record_failure), marks the group
  // broken, then closes this rank's connections (a peer reading from this rank sees the
  // connection end).
  void abort(const std::string& why) override;
  // ProcessGroup::record_failure: the first rank's note, under this group's keys of the store.
  // The group of the rank that left it, when destroyed, waits until every peer has read it
  // (their ops' failure messages read it) or for 2 s: its process may host the store (rank 0),
  // whose note would go with it.
  void record_failure(const std::string& why) noexcept override;

  struct State;  // the gloo context and the worker queue (shared with pending works)

 private:
  // send (is_send) or recv of `t` with `peer`; `t` is only read when sending.
  std::shared_ptr<Work> point_to_point(const kernels::Tensor& t, int peer, uint32_t tag,
                                       bool is_send);

  std::shared_ptr<State> state_;
};

}  // namespace dp::dist
