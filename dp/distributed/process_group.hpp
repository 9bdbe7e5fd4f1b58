// ProcessGroup: the collectives one rank runs with its peers, asynchronously.
//
// Every op returns a Work at once; ops of one group execute in issue order on every rank
// (which is what collectives need), so a caller can issue several (e.g. one all_reduce per
// gradient bucket, each on a view of one flat buffer) and wait for them later:
//
//   std::vector<std::shared_ptr<Work>> works;
//   for (auto& bucket : buckets) works.push_back(pg.all_reduce(bucket, ReduceOp::avg));
//   wait_all(works);
//
// Tensors are contiguous; every rank passes the same shapes and dtype in the same op order.
// An op that does not complete within the group's timeout fails with kernels::Error naming
// the op, the rank and the timeout; a group whose op failed is broken: later ops fail at once.
// A tensor must stay untouched by the caller until its Work was waited for.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dp/distributed/env.hpp"
#include "kernels/runtime/tensor.hpp"

namespace dp::dist {

class Store;
class Heartbeat;

enum class ReduceOp { sum, avg, min, max };
const char* reduce_op_name(ReduceOp op);

// One asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the op has finished (NCCL: and orders the calling thread's stream after it).
  // Throws kernels::Error naming the op, the rank and the timeout on failure; again on every
  // later call. A recv's data is in its tensor once wait() returned.
  virtual void wait() = 0;
  // Orders the stream the op was launched from (the launching thread's context's) after the
  // op, without blocking the host where the backend allows it (NCCL: a stream wait on the op's
  // event); work queued on that stream afterwards sees its result. wait() is still needed, and
  // reports a failure or a timeout. Other backends: wait().
  virtual void order_stream() { wait(); }
  // True once the op has finished, successfully or not. Send and recv (Gloo) only know it
  // once wait() has returned.
  virtual bool is_completed() const = 0;
};

// Waits for every work (all of them, even after a failure), then rethrows the first failure.
void wait_all(const std::vector<std::shared_ptr<Work>>& works);

class ProcessGroup {
 public:
  ProcessGroup(int rank, int size, std::chrono::milliseconds timeout);
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend_name() const = 0;  // "gloo", "nccl" or "mpi"

  // Timeout of each op issued from now on (default 300 s).
  std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds timeout);

  // ensures t = op over every rank's t (avg: sum then scale by 1/size; floating types only).
  std::shared_ptr<Work> all_reduce(kernels::Tensor& t, ReduceOp op = ReduceOp::sum) {
    count_payload(t);
    return do_all_reduce(t, op);
  }
  // requires 0 <= root < size. ensures t = root's t on every rank.
  std::shared_ptr<Work> broadcast(kernels::Tensor& t, int root) {
    count_payload(t);
    return do_broadcast(t, root);
  }
  // ensures root's t = op over every rank's t; other ranks' t is unspecified afterwards.
  std::shared_ptr<Work> reduce(kernels::Tensor& t, int root, ReduceOp op = ReduceOp::sum) {
    count_payload(t);
    return do_reduce(t, root, op);
  }
  // requires out (size * n), in (n) elements, same dtype.
  // ensures out[r*n, (r+1)*n) = rank r's in.
  std::shared_ptr<Work> all_gather(kernels::Tensor& out, const kernels::Tensor& in) {
    count_payload(in);
    return do_all_gather(out, in);
  }
  // requires out (n), in (size * n) elements, same dtype.
  // ensures out = op over every rank's in[rank*n, (rank+1)*n).
  std::shared_ptr<Work> reduce_scatter(kernels::Tensor& out, const kernels::Tensor& in,
                                       ReduceOp op = ReduceOp::sum) {
    count_payload(in);
    return do_reduce_scatter(out, in, op);
  }
  // Point to point: a send matches the recv of the same (src, dst, tag) with the same byte
  // count (NCCL matches by issue order and ignores tag). t must not change until wait().
  std::shared_ptr<Work> send(const kernels::Tensor& t, int dst, uint32_t tag = 0) {
    count_payload(t);
    return do_send(t, dst, tag);
  }
  std::shared_ptr<Work> recv(kernels::Tensor& t, int src, uint32_t tag = 0) {
    return do_recv(t, src, tag);
  }
  // A send to dst and a recv from src issued together (one ring step). NCCL runs them as one
  // group, so a ring where every rank sends before it receives cannot deadlock.
  std::shared_ptr<Work> send_recv(const kernels::Tensor& to_send, int dst, kernels::Tensor& to_recv,
                                  int src, uint32_t tag = 0) {
    count_payload(to_send);
    return do_send_recv(to_send, dst, to_recv, src, tag);
  }
  // ensures every rank has issued barrier() before any rank's barrier completes.
  std::shared_ptr<Work> barrier() { return do_barrier(); }

  // Queued all-reduces, for collectives inside a captured step (kernels/runtime/graph.hpp):
  // all_reduce_queued starts `op` over t after the work queued so far on the calling thread's
  // context for t's device, and returns no Work; join_queued(device) orders that context's later
  // work after every all-reduce queued before it, and throws the first failure among them.
  // Between the two the caller may queue more work (the rest of backward): the all-reduces
  // overlap it. While a graph captures on the context, the pair is part of the capture, and
  // each replay runs the all-reduces again, where collectives_capturable(device):
  //  - NCCL (CUDA devices): the graph holds NCCL's kernels, on the group's stream forked from
  //    and joined back to the context's; a replayed op's failure or hang surfaces at the group's
  //    next waited op (its poll is bounded by the timeout and aborts the communicator);
  //  - every backend on CPU devices: the graph records the launch and the join as ops.
  // Elsewhere (Gloo or MPI on a CUDA device) a graph cannot hold them: call them uncaptured.
  void all_reduce_queued(kernels::Tensor& t, ReduceOp op = ReduceOp::sum) {
    count_payload(t);
    do_all_reduce_queued(t, op);
  }
  virtual void join_queued(const kernels::Device& device);
  virtual bool collectives_capturable(const kernels::Device& device) const {
    return device.is_cpu();
  }

  // Leaves the group for good, as a rank that died would, so that no peer waits for this rank
  // until its timeout: this rank's queued and later ops fail naming `why`, and a peer's op that
  // needs this rank fails promptly. Gloo closes this rank's connections (the peer's op fails with
  // the closed connection: tested). NCCL aborts the communicator (after an op in progress on
  // another thread settles); NCCL tells no peer, which fails at once only where its transport
  // sees the connections close, else at its own timeout. MPI cannot end a peer's wait short of
  // ending the job: this rank's later ops fail, and the job ends with MPI_Abort when the group is
  // destroyed. Thread-safe; the first reason is kept.
  virtual void abort(const std::string& why) = 0;

  // Leaves `why` (this rank's failure: a check, a bad input, a fault) for the peers whose ops
  // then fail because this rank is gone: their error names the first rank of the group that
  // recorded one and what it said ("rank 2 failed first: ..."), where the launcher's log or the
  // rank's own might be far away. Call it before the rank stops (its failure closes the
  // connections the peers' ops then fail on). A group whose own op failed, or that abort() left,
  // records nothing: its failure follows another's. Gloo records through the store the group
  // met in, on a connection of its own bounded by seconds: nothing when that store is gone (its
  // host, rank 0, failed and exited first; the group that recorded the note, when destroyed,
  // waits up to 2 s for its peers to read it). Other backends record nothing. Never throws.
  virtual void record_failure(const std::string& why) noexcept { (void)why; }

  // The bytes of every tensor this rank handed to the group so far: each collective's input
  // (all_reduce, broadcast and reduce: t; all_gather and reduce_scatter: in) and each sent
  // tensor. What the caller asked to communicate, not what crossed a wire (that depends on
  // the backend's algorithm). Thread-safe; the difference of two reads is what was handed over
  // between them.
  int64_t payload_bytes() const { return payload_bytes_.load(std::memory_order_relaxed); }

 protected:
  // The backends' implementations of the ops above, same contracts.
  virtual std::shared_ptr<Work> do_all_reduce(kernels::Tensor& t, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_broadcast(kernels::Tensor& t, int root) = 0;
  virtual std::shared_ptr<Work> do_reduce(kernels::Tensor& t, int root, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_all_gather(kernels::Tensor& out, const kernels::Tensor& in) = 0;
  virtual std::shared_ptr<Work> do_reduce_scatter(kernels::Tensor& out, const kernels::Tensor& in,
                                                  ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_send(const kernels::Tensor& t, int dst, uint32_t tag) = 0;
  virtual std::shared_ptr<Work> do_recv(kernels::Tensor& t, int src, uint32_t tag) = 0;
  // Default: do_send then do_recv, waited for together.
  virtual std::shared_ptr<Work> do_send_recv(const kernels::Tensor& to_send, int dst,
                                             kernels::Tensor& to_recv, int src, uint32_t tag);
  virtual std::shared_ptr<Work> do_barrier() = 0;
  // Default: do_all_reduce, its Work kept until join_queued waits for it (recorded as an op
  // while a CPU device's graph captures).
  virtual void do_all_reduce_queued(kernels::Tensor& t, ReduceOp op);

 public:
  // Every rank's `mine`, in rank order, exchanged outside the group's ops: through the store the
  // group met in (Gloo, NCCL), or MPI_Allgather (MPI). Safe before the first collective, and
  // when ranks disagree on what their collectives will be. `name` keys the exchange (each name
  // once per group). Throws naming the ranks that sent nothing within `timeout`.
  virtual std::vector<std::string> exchange_text(const std::string& name, const std::string& mine,
                                                 std::chrono::milliseconds timeout);
  // The store the group met in (init_process_group sets it) and the rendezvous timeout, which
  // bounds the start-up exchanges (exchange_text) of programs built on the group.
  void set_rendezvous(std::shared_ptr<Store> store, std::chrono::milliseconds timeout);
  std::chrono::milliseconds rendezvous_timeout() const { return rendezvous_timeout_; }

 protected:
  // "all_reduce(avg) of 1024 x f32" style description for messages.
  static std::string describe_tensor(const kernels::Tensor& t);

 public:
  // Keeps this rank's heartbeat beating for the group's life (init_process_group).
  void attach_heartbeat(std::shared_ptr<Heartbeat> h) { heartbeat_ = std::move(h); }

 private:
  void count_payload(const kernels::Tensor& t) {
    payload_bytes_.fetch_add(static_cast<int64_t>(t.nbytes()), std::memory_order_relaxed);
  }

  // Runs op now, or records it while a CPU device's graph captures on `device` (refuses, naming
  // `what`, where collectives_capturable(device) is false).
  void run_or_record(const kernels::Device& device, const std::string& what,
                     std::function<void()> op);
  // The default queued all-reduces' works, until join_queued.
  std::mutex queued_mu_;
  std::vector<std::shared_ptr<Work>> queued_;
  std::shared_ptr<Heartbeat> heartbeat_;  // destroyed last: the group's stores are gone first
  std::atomic<int64_t> payload_bytes_{0};
  std::shared_ptr<Store> rendezvous_store_;
  std::chrono::milliseconds rendezvous_timeout_{std::chrono::seconds(60)};
  int rank_;
  int size_;
  std::atomic<int64_t> timeout_ms_;
};

// ---- creating a group -----------------------------------------------------------------------

enum class Backend { auto_select, nccl, gloo, mpi };
// "auto", "nccl", "gloo", "mpi" (throws naming the text otherwise).
Backend parse_backend(const std::string& text);
const char* backend_text(Backend b);

struct InitOptions {
  // auto: NCCL when `device` is CUDA on every rank and every rank owns a distinct physical
  // GPU, else Gloo (CUDA tensors then travel through pinned host memory). mpi: ranks started
  // by mpirun; MPI_Init is the rendezvous (init_method, store and group_name are unused).
  Backend backend = Backend::auto_select;
  // env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; or mpirun/Slurm variables),
  // tcp://host:port or file:///path. Ignored when `store` is set.
  std::string init_method = "env://";
  int rank = -1;        // -1: from the init method / environment
  int world_size = -1;  // -1: from the init method / environment
  // The device this rank's tensors live on (cpu:i or cuda:i).
  kernels::Device device = kernels::Device::cpu();
  // The rendezvous (every rank arrives) and every op. 0: DP_TIMEOUT (seconds) when set, else
  // kDefaultRendezvousTimeout for the rendezvous and kDefaultOpTimeout for ops.
  std::chrono::milliseconds timeout{0};
  // A store to meet in instead of init_method (rank and world_size are then required).
  std::shared_ptr<Store> store;
  // Groups sharing one store need distinct names.
  std::string group_name = "default";
  // Gloo transport: the address other ranks reach this one at. Empty: DP_SOCKET_IFNAME's (else
  // GLOO_SOCKET_IFNAME's) interface when set, 127.0.0.1 when the master address is loopback,
  // else the address this host reaches the master from (its route), else this host's name.
  std::string gloo_hostname;
  std::string gloo_interface;
  // Where environment variables come from (empty: the process environment).
  EnvLookup env;
};

constexpr std::chrono::milliseconds kDefaultRendezvousTimeout = std::chrono::seconds(60);
constexpr std::chrono::milliseconds kDefaultOpTimeout = std::chrono::seconds(300);

// The timeouts a group made from `options` uses: options.timeout for both when set (> 0), else
// DP_TIMEOUT (seconds) from options.env, else the two defaults. Throws naming a bad DP_TIMEOUT.
struct Timeouts {
  std::chrono::milliseconds rendezvous, ops;
};
Timeouts resolve_timeouts(const InitOptions& options);

// Meets the other ranks and connects them. Blocks until every rank arrived or the rendezvous
// timeout ran out: then throws naming the ranks that never joined ("rank 2 of 3 never joined
// within 10 s"); rank 0 prints a progress line every 10 s (timeout / 3 when shorter) while
// it waits. With DP_HEARTBEAT_MS set (by launch_workers) and a tcp store, the rank beats its
// heartbeat for the group's life. An explicit nccl request on a CPU device or on ranks sharing
// a GPU throws with the reason.
std::unique_ptr<ProcessGroup> init_process_group(const InitOptions& options);

// For a program about to launch `local_ranks` ranks on this node with their tensors on `type`:
// throws, before any rank starts, what init_process_group would throw on every rank for an
// explicit "nccl" (a CPU-only build, CPU tensors, fewer GPUs than ranks), naming --backend and
// what to use instead. Other backends: nothing.
void check_backend_devices(const std::string& backend, kernels::DeviceType type, int local_ranks);

}  // namespace dp::dist
