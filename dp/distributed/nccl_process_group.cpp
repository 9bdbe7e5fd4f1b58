#include "dp/distributed/nccl_process_group.hpp"

#include "dp/distributed/store.hpp"
#include "kernels/runtime/error.hpp"

#if DP_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "kernels/runtime/context.hpp"
#include "kernels/runtime/cuda_check.hpp"
#include "kernels/runtime/nccl_check.hpp"
#endif

namespace dp::dist {

#if DP_HAVE_NCCL

bool nccl_available() {
  return true;
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL >= 2.9: 10000 major + 100 minor + patch (2.28.9 -> 22809); before, 1000 major + 100 minor.
  const int major = v >= 20900 ? v / 10000 : v / 1000,
            minor = v >= 20900 ? v % 10000 / 100 : v % 1000 / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100);
}

namespace {

using kernels::DType;
using kernels::Tensor;
using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::f32:
      return ncclFloat32;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  DP_THROW("no NCCL type for dtype " << dt);
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::min:
      return ncclMin;
    case ReduceOp::max:
      return ncclMax;
  }
  DP_THROW("unknown reduce op");
}

// Short sleeps while polling: the first checks spin, later ones back off to 1 ms.
void poll_pause(int& round) {
  if (round < 64)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(round < 256 ? 50 : 1000));
  ++round;
}

// The communicator, its stream and its health, shared by the group and its works. The
// communicator is non-blocking: every NCCL call may return ncclInProgress and must then be
// polled to completion (settle) before the next call; that is what lets init, enqueue and
// completion all respect the group's timeout.
struct Comm {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, gpu = 0;
  kernels::Device device;
  cudaStream_t stream = nullptr;  // the communication stream
  void* scratch = nullptr;        // one float for barrier()
  // Queued all-reduces (all_reduce_queued): the caller's stream forks to `stream` at `fork` and
  // joins back at `join`; `queued` (under mu) says ops were queued since the last join.
  cudaEvent_t fork = nullptr, join = nullptr;
  bool queued = false;
  std::mutex mu;         // serialises NCCL calls on `comm`
  bool aborted = false;  // under mu
  std::string broken;    // under mu: why the communicator was aborted

  std::string where() const {
    return "rank " + std::to_string(rank) + " of " + std::to_string(size) + " (" + device.str() +
           ")";
  }

  // requires mu held. Aborts the communicator; later ops fail with `why`.
  void abort_locked(const std::string& why) {
    if (aborted) return;
    aborted = true;
    broken = why;
    ncclCommAbort(comm);  // frees the communicator; its result is of no further use
    comm = nullptr;
  }

  // requires mu held. Waits until a non-blocking call's effect settled; on error or at the
  // deadline aborts the communicator and throws naming `what`.
  void settle_locked(ncclResult_t r, const std::string& what, Millis timeout,
                     Clock::time_point deadline) {
    if (r != ncclSuccess && r != ncclInProgress) {
      std::string msg = "nccl " + what + " failed on " + where() + ": " + ncclGetErrorString(r) +
                        " (" + ncclGetLastError(comm) + ")";
      abort_locked(msg);
      throw kernels::Error(msg);
    }
    int round = 0;
    while (true) {
      ncclResult_t st = ncclSuccess;
      ncclResult_t q = ncclCommGetAsyncError(comm, &st);
      if (q != ncclSuccess) st = q;
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) {
        std::string msg = "nccl " + what + " failed on " + where() + ": " + ncclGetErrorString(st) +
                          " (" + ncclGetLastError(comm) + ")";
        abort_locked(msg);
        throw kernels::Error(msg);
      }
      if (Clock::now() >= deadline) {
        std::string msg = "nccl " + what + " timed out after " + std::to_string(timeout.count()) +
                          " ms on " + where() + " (a peer never joined, or died)";
        abort_locked(msg);
        throw kernels::Error(msg);
      }
      poll_pause(round);
    }
  }

  ~Comm() {
    // Destructors log, never throw. A healthy communicator drains its stream (bounded), then
    // finalizes and is destroyed; a stuck one is aborted.
    std::lock_guard<std::mutex> lock(mu);
    cudaSetDevice(gpu);
    if (comm && !aborted) {
      auto deadline = Clock::now() + std::chrono::seconds(30);
      int round = 0;
      cudaError_t q;
      while ((q = cudaStreamQuery(stream)) == cudaErrorNotReady && Clock::now() < deadline) {
        cudaGetLastError();  // NotReady is an answer, not a failure: clear it, as PyTorch does
        poll_pause(round);
      }
      if (q == cudaErrorNotReady) cudaGetLastError();
      bool drained = q == cudaSuccess;
      if (drained) {
        try {  // a deadline of its own: the drain may have used most of the first
          const Millis finalize_timeout(30000);
          settle_locked(ncclCommFinalize(comm), "finalize", finalize_timeout,
                        Clock::now() + finalize_timeout);
        } catch (const std::exception& e) {
          DP_LOG_ERROR(e.what());
        }
      }
      if (comm) {
        if (drained)
          ncclCommDestroy(comm);
        else {
          DP_LOG_ERROR("nccl group on " << where()
                                        << ": work still running at destruction; aborting");
          ncclCommAbort(comm);
        }
      }
    }
    if (scratch) cudaFree(scratch);
    for (cudaEvent_t e : {fork, join})
      if (e) cudaEventDestroy(e);
    if (stream) {
      cudaError_t e = cudaStreamDestroy(stream);
      if (e != cudaSuccess && e != cudaErrorCudartUnloading)
        DP_LOG_ERROR("destroying the NCCL stream: " << cudaGetErrorString(e));
    }
  }
};

class NcclWork final : public Work {
 public:
  // `caller` is the stream the op was launched from (kept alive by `caller_owner`): wait() and
  // an un-waited destruction order that stream after the op, whichever thread runs them.
  NcclWork(std::shared_ptr<Comm> comm, std::string what, cudaEvent_t done,
           std::shared_ptr<void> caller_owner, Millis timeout, Clock::time_point deadline,
           std::vector<Tensor> keep)
      : comm_(std::move(comm)),
        what_(std::move(what)),
        done_(done),
        caller_owner_(std::move(caller_owner)),
        timeout_(timeout),
        deadline_(deadline),
        keep_(std::move(keep)) {}

  ~NcclWork() override {
    // Not waited for: order the caller's stream after the op anyway, so that memory the kept
    // tensors free (stream-ordered, on that stream) is not reused while NCCL still uses it.
    if (!waited_) {
      kernels::CurrentGpuGuard on(comm_->gpu);
      cudaError_t e = cudaStreamWaitEvent(caller(), done_, 0);
      if (e != cudaSuccess) {
        cudaGetLastError();
        if (e != cudaErrorCudartUnloading)
          DP_LOG_ERROR("nccl " << what_ << ": ordering the caller's stream at destruction: "
                               << cudaGetErrorString(e));
      }
    }
    cudaError_t e = cudaEventDestroy(done_);
    if (e != cudaSuccess && e != cudaErrorCudartUnloading)
      DP_LOG_ERROR("cudaEventDestroy: " << cudaGetErrorString(e));
  }

  void wait() override {
    std::lock_guard<std::mutex> lock(wait_mu_);
    if (error_) std::rethrow_exception(error_);
    DP_CUDA_CHECK(cudaSetDevice(comm_->gpu));
    if (!finished_) {
      try {
        poll_until_done();
      } catch (...) {
        error_ = std::current_exception();
        throw;
      }
      finished_ = true;
    }
    // Later work on the launching stream runs after the op.
    DP_CUDA_CHECK(cudaStreamWaitEvent(caller(), done_, 0));
    waited_ = true;
  }

  void order_stream() override {
    std::lock_guard<std::mutex> lock(wait_mu_);
    if (error_) std::rethrow_exception(error_);
    DP_CUDA_CHECK(cudaSetDevice(comm_->gpu));
    DP_CUDA_CHECK(cudaStreamWaitEvent(caller(), done_, 0));
    waited_ = true;  // the caller's stream is ordered: the destructor need not do it again
  }

  bool is_completed() const override {
    std::lock_guard<std::mutex> lock(wait_mu_);
    if (finished_ || error_) return true;
    cudaError_t q = cudaEventQuery(done_);
    if (q != cudaSuccess) cudaGetLastError();  // NotReady (or an error wait() reports): clear
    return q == cudaSuccess;
  }

 private:
  cudaStream_t caller() const { return static_cast<cudaStream_t>(caller_owner_.get()); }

  void poll_until_done() {
    int round = 0;
    while (true) {
      cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return;
      cudaGetLastError();  // NotReady is an answer: clear it so the next launch starts clean
      if (q != cudaErrorNotReady)
        DP_THROW("nccl " << what_ << " on " << comm_->where() << ": " << cudaGetErrorString(q));
      {
        std::lock_guard<std::mutex> lock(comm_->mu);
        if (comm_->aborted)
          DP_THROW("nccl " << what_ << " on " << comm_->where()
                           << " did not complete: the communicator was aborted: " << comm_->broken);
        ncclResult_t st = ncclSuccess;
        ncclCommGetAsyncError(comm_->comm, &st);
        if (st != ncclSuccess && st != ncclInProgress) {
          std::string msg = "nccl " + what_ + " failed on " + comm_->where() + ": " +
                            ncclGetErrorString(st) + " (" + ncclGetLastError(comm_->comm) + ")";
          comm_->abort_locked(msg);
          throw kernels::Error(msg);
        }
        if (Clock::now() >= deadline_) {
          std::string msg = "nccl " + what_ + " timed out after " +
                            std::to_string(timeout_.count()) + " ms on " + comm_->where() +
                            " (a peer never joined the op, or died)";
          comm_->abort_locked(msg);
          throw kernels::Error(msg);
        }
      }
      poll_pause(round);
    }
  }

  std::shared_ptr<Comm> comm_;
  std::string what_;
  cudaEvent_t done_;
  std::shared_ptr<void> caller_owner_;  // the launching stream, alive while this work is
  Millis timeout_;
  Clock::time_point deadline_;
  std::vector<Tensor> keep_;  // alive until the op is done
  mutable std::mutex wait_mu_;
  bool finished_ = false;
  bool waited_ = false;
  std::exception_ptr error_;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(std::shared_ptr<Store> store, int rank, int size, const kernels::Device& device,
                   Millis timeout)
      : ProcessGroup(rank, size, timeout),
        store_(std::move(store)),
        comm_(std::make_shared<Comm>()) {
    DP_CHECK(device.is_cuda(), "nccl process group: " << device << " is not a CUDA device");
    Comm& c = *comm_;
    c.rank = rank;
    c.size = size;
    c.device = device;
    c.gpu = kernels::physical_gpu(device);
    DP_CUDA_CHECK(cudaSetDevice(c.gpu));
    // The unique id travels through the store: rank 0 makes it, the others wait for it.
    ncclUniqueId id;
    if (rank == 0) {
      DP_NCCL_CHECK(ncclGetUniqueId(&id));
      store_->set("unique_id", std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      std::vector<char> bytes = store_->get("unique_id");
      DP_CHECK(bytes.size() == sizeof(id.internal),
               "nccl rendezvous: the unique id in " << store_->describe() << " has " << bytes.size()
                                                    << " bytes, expected " << sizeof(id.internal));
      std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
    }
    int least = 0, greatest = 0;
    DP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    DP_CUDA_CHECK(cudaStreamCreateWithPriority(&c.stream, cudaStreamNonBlocking, greatest));
    DP_CUDA_CHECK(cudaMalloc(&c.scratch, sizeof(float)));
    DP_CUDA_CHECK(cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming));
    DP_CUDA_CHECK(cudaEventCreateWithFlags(&c.join, cudaEventDisableTiming));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init and calls return at once; settle_locked() bounds them
    std::lock_guard<std::mutex> lock(c.mu);
    auto deadline = Clock::now() + timeout;
    ncclResult_t r = ncclCommInitRankConfig(&c.comm, size, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      std::string msg = std::string("ncclCommInitRankConfig failed on ") + c.where() + ": " +
                        ncclGetErrorString(r);
      if (c.comm) c.abort_locked(msg);
      DP_THROW(msg);
    }
    c.settle_locked(ncclSuccess, "init (ncclCommInitRankConfig)", timeout, deadline);
  }

  std::string backend_name() const override { return "nccl"; }
  void abort(const std::string& why) override {
    std::lock_guard<std::mutex> lock(comm_->mu);
    comm_->abort_locked(comm_->where() + " left the group: " + why);
  }

  std::shared_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op) override {
    check_all_reduce(t, op);
    void* p = t.raw();
    size_t n = static_cast<size_t>(t.numel());
    ncclDataType_t ty = nccl_type(t.dtype());
    return launch(std::string("all_reduce(") + reduce_op_name(op) + ") of " + describe_tensor(t),
                  {t}, [=](ncclComm_t comm, cudaStream_t s) {
                    return ncclAllReduce(p, p, n, ty, nccl_op(op), comm, s);
                  });
  }

  std::shared_ptr<Work> do_broadcast(Tensor& t, int root) override {
    check(t, "broadcast");
    check_rank(root, "broadcast root");
    void* p = t.raw();
    size_t n = static_cast<size_t>(t.numel());
    ncclDataType_t ty = nccl_type(t.dtype());
    return launch(
        "broadcast(root " + std::to_string(root) + ") of " + describe_tensor(t), {t},
        [=](ncclComm_t comm, cudaStream_t s) { return ncclBroadcast(p, p, n, ty, root, comm, s); });
  }

  std::shared_ptr<Work> do_reduce(Tensor& t, int root, ReduceOp op) override {
    check(t, "reduce");
    check_rank(root, "reduce root");
    DP_CHECK(op != ReduceOp::avg || kernels::is_floating(t.dtype()),
             "reduce(avg) needs a floating tensor, not " << t.dtype());
    void* p = t.raw();
    size_t n = static_cast<size_t>(t.numel());
    ncclDataType_t ty = nccl_type(t.dtype());
    return launch(std::string("reduce(") + reduce_op_name(op) + ", root " + std::to_string(root) +
                      ") of " + describe_tensor(t),
                  {t}, [=](ncclComm_t comm, cudaStream_t s) {
                    return ncclReduce(p, p, n, ty, nccl_op(op), root, comm, s);
                  });
  }

  std::shared_ptr<Work> do_all_gather(Tensor& out, const Tensor& in) override {
    check(out, "all_gather");
    check(in, "all_gather");
    DP_CHECK(out.dtype() == in.dtype(),
             "all_gather: out is " << out.dtype() << ", in is " << in.dtype());
    DP_CHECK(out.numel() == in.numel() * size(), "all_gather: out has "
                                                     << out.numel() << " elements, needs " << size()
                                                     << " x " << in.numel());
    const void* src = in.raw();
    void* dst = out.raw();
    size_t n = static_cast<size_t>(in.numel());
    ncclDataType_t ty = nccl_type(in.dtype());
    return launch(
        "all_gather of " + describe_tensor(in), {out, in},
        [=](ncclComm_t comm, cudaStream_t s) { return ncclAllGather(src, dst, n, ty, comm, s); });
  }

  std::shared_ptr<Work> do_reduce_scatter(Tensor& out, const Tensor& in, ReduceOp op) override {
    check(out, "reduce_scatter");
    check(in, "reduce_scatter");
    DP_CHECK(out.dtype() == in.dtype(),
             "reduce_scatter: out is " << out.dtype() << ", in is " << in.dtype());
    DP_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: in has "
                                                     << in.numel() << " elements, needs " << size()
                                                     << " x " << out.numel());
    DP_CHECK(op != ReduceOp::avg || kernels::is_floating(in.dtype()),
             "reduce_scatter(avg) needs a floating tensor, not " << in.dtype());
    const void* src = in.raw();
    void* dst = out.raw();
    size_t n = static_cast<size_t>(out.numel());
    ncclDataType_t ty = nccl_type(in.dtype());
    return launch(
        std::string("reduce_scatter(") + reduce_op_name(op) + ") of " + describe_tensor(in),
        {out, in}, [=](ncclComm_t comm, cudaStream_t s) {
          return ncclReduceScatter(src, dst, n, ty, nccl_op(op), comm, s);
        });
  }

  std::shared_ptr<Work> do_send(const Tensor& t, int dst, uint32_t tag) override {
    check(t, "send");
    check_peer(dst, "send destination");
    const void* p = t.raw();
    size_t n = static_cast<size_t>(t.numel());
    ncclDataType_t ty = nccl_type(t.dtype());
    return launch(
        "send(to rank " + std::to_string(dst) + ", tag " + std::to_string(tag) + ") of " +
            describe_tensor(t),
        {t}, [=](ncclComm_t comm, cudaStream_t s) { return ncclSend(p, n, ty, dst, comm, s); });
  }

  std::shared_ptr<Work> do_recv(Tensor& t, int src, uint32_t tag) override {
    check(t, "recv");
    check_peer(src, "recv source");
    void* p = t.raw();
    size_t n = static_cast<size_t>(t.numel());
    ncclDataType_t ty = nccl_type(t.dtype());
    return launch(
        "recv(from rank " + std::to_string(src) + ", tag " + std::to_string(tag) + ") of " +
            describe_tensor(t),
        {t}, [=](ncclComm_t comm, cudaStream_t s) { return ncclRecv(p, n, ty, src, comm, s); });
  }

  // One NCCL group: both transfers progress together, so a ring step cannot deadlock.
  std::shared_ptr<Work> do_send_recv(const Tensor& to_send, int dst, Tensor& to_recv, int src,
                                     uint32_t tag) override {
    check(to_send, "send_recv");
    check(to_recv, "send_recv");
    check_peer(dst, "send_recv destination");
    check_peer(src, "send_recv source");
    const void* sp = to_send.raw();
    void* rp = to_recv.raw();
    size_t sn = static_cast<size_t>(to_send.numel());
    size_t rn = static_cast<size_t>(to_recv.numel());
    ncclDataType_t st = nccl_type(to_send.dtype());
    ncclDataType_t rt = nccl_type(to_recv.dtype());
    return launch("send_recv(to rank " + std::to_string(dst) + ", from rank " +
                      std::to_string(src) + ", tag " + std::to_string(tag) + ") of " +
                      describe_tensor(to_send),
                  {to_send, to_recv}, [=](ncclComm_t comm, cudaStream_t s) {
                    ncclResult_t r = ncclGroupStart();
                    if (r != ncclSuccess) return r;
                    ncclResult_t a = ncclSend(sp, sn, st, dst, comm, s);
                    ncclResult_t b = ncclRecv(rp, rn, rt, src, comm, s);
                    ncclResult_t e = ncclGroupEnd();
                    if (a != ncclSuccess && a != ncclInProgress) return a;
                    if (b != ncclSuccess && b != ncclInProgress) return b;
                    return e;
                  });
  }

  bool collectives_capturable(const kernels::Device& device) const override {
    return device == comm_->device;
  }

  // On the group's stream, forked from the caller's (inside a capture the fork and the join
  // are the graph's edges): no event to poll, no Work.
  void do_all_reduce_queued(Tensor& t, ReduceOp op) override {
    check_all_reduce(t, op);
    const std::string what =
        std::string("queued all_reduce(") + reduce_op_name(op) + ") of " + describe_tensor(t);
    Comm& c = *comm_;
    Millis to = timeout();
    std::lock_guard<std::mutex> lock(c.mu);
    auto caller = static_cast<cudaStream_t>(healthy_caller_locked(what).stream());
    DP_CUDA_CHECK(cudaEventRecord(c.fork, caller));
    DP_CUDA_CHECK(cudaStreamWaitEvent(c.stream, c.fork, 0));
    c.queued = true;  // forked: the join must follow, also when the call below fails
    c.settle_locked(ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()),
                                  nccl_type(t.dtype()), nccl_op(op), c.comm, c.stream),
                    what, to, Clock::now() + to);
  }

  void join_queued(const kernels::Device& device) override {
    DP_CHECK(device == comm_->device,
             "nccl join_queued on " << device << ": this group runs on " << comm_->device);
    Comm& c = *comm_;
    std::lock_guard<std::mutex> lock(c.mu);
    if (!c.queued) return;
    c.queued = false;
    DP_CUDA_CHECK(cudaSetDevice(c.gpu));
    auto caller = static_cast<cudaStream_t>(kernels::context(c.device).stream());
    DP_CUDA_CHECK(cudaEventRecord(c.join, c.stream));
    DP_CUDA_CHECK(cudaStreamWaitEvent(caller, c.join, 0));
    DP_CHECK(!c.aborted, "nccl queued all_reduce on "
                             << c.where() << ": the communicator was aborted: " << c.broken);
  }

  // NCCL has no barrier: an all-reduce of one float; wait() returns once every rank joined.
  std::shared_ptr<Work> do_barrier() override {
    void* p = comm_->scratch;
    return launch("barrier", {}, [=](ncclComm_t comm, cudaStream_t s) {
      return ncclAllReduce(p, p, 1, ncclFloat32, ncclSum, comm, s);
    });
  }

 private:
  void check(const Tensor& t, const char* op) const {
    DP_CHECK(t.defined(), op << ": undefined tensor");
    DP_CHECK(t.device() == comm_->device, op << ": tensor on " << t.device()
                                             << ", but this NCCL group runs on " << comm_->device);
  }
  void check_all_reduce(const Tensor& t, ReduceOp op) const {
    check(t, "all_reduce");
    DP_CHECK(op != ReduceOp::avg || kernels::is_floating(t.dtype()),
             "all_reduce(avg) needs a floating tensor, not " << t.dtype());
  }
  void check_rank(int r, const char* what) const {
    DP_CHECK(r >= 0 && r < size(), what << " " << r << " is not in [0, " << size() << ")");
  }
  void check_peer(int r, const char* what) const {
    DP_CHECK(r >= 0 && r < size() && r != rank(),
             what << " " << r << " must be another rank in [0, " << size() << ")");
  }

  // requires comm_->mu held. The calling thread's context on the group's GPU (current), once
  // the communicator is known not aborted (else throws: `what` not run, and why).
  kernels::DeviceContext& healthy_caller_locked(const std::string& what) {
    Comm& c = *comm_;
    DP_CHECK(!c.aborted, "nccl " << what << " on " << c.where()
                                 << " not run: the communicator was aborted: " << c.broken);
    DP_CUDA_CHECK(cudaSetDevice(c.gpu));
    return kernels::context(c.device);
  }

  // Orders the comm stream after the caller's stream, enqueues the NCCL call there and
  // records its completion event.
  template <class Call>
  std::shared_ptr<Work> launch(const std::string& what, std::vector<Tensor> keep, Call call) {
    Comm& c = *comm_;
    Millis to = timeout();
    std::lock_guard<std::mutex> lock(c.mu);
    kernels::DeviceContext& caller_ctx = healthy_caller_locked(what);
    auto caller = static_cast<cudaStream_t>(caller_ctx.stream());
    cudaEvent_t ready = nullptr, done = nullptr;
    DP_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    cudaError_t e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      cudaEventDestroy(ready);
      DP_CUDA_CHECK(e);
    }
    try {
      DP_CUDA_CHECK(cudaEventRecord(ready, caller));
      DP_CUDA_CHECK(cudaStreamWaitEvent(c.stream, ready, 0));
      auto deadline = Clock::now() + to;
      c.settle_locked(call(c.comm, c.stream), what, to, deadline);
      DP_CUDA_CHECK(cudaEventRecord(done, c.stream));
      cudaEventDestroy(ready);  // released once the wait above is satisfied
      return std::make_shared<NcclWork>(comm_, what, done, caller_ctx.stream_owner(), to, deadline,
                                        std::move(keep));
    } catch (...) {
      cudaEventDestroy(ready);
      cudaEventDestroy(done);
      throw;
    }
  }

  std::shared_ptr<Store> store_;
  std::shared_ptr<Comm> comm_;
};

}  // namespace

std::unique_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store> store, int rank,
                                                      int size, const kernels::Device& device,
                                                      std::chrono::milliseconds timeout) {
  DP_CHECK(store != nullptr, "make_nccl_process_group needs a store");
  return std::make_unique<NcclProcessGroup>(std::move(store), rank, size, device, timeout);
}

#else  // !DP_HAVE_NCCL

bool nccl_available() {
  return false;
}

std::string nccl_version() {
  return "";
}

std::unique_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store>, int, int,
                                                      const kernels::Device& device,
                                                      std::chrono::milliseconds) {
  DP_THROW("NCCL process group on " << device << ": this build has no NCCL (configure with "
                                    << "the CUDA backend); use backend gloo");
}

#endif

}  // namespace dp::dist
