#include "dp/distributed/mpi_process_group.hpp"

#include <algorithm>

#include "kernels/runtime/error.hpp"

#if DP_HAVE_MPI
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "dp/distributed/cuda_util.hpp"
#include "dp/distributed/host_reduce.hpp"
#include "dp/distributed/pinned_pool.hpp"
#include "dp/distributed/signalled_work.hpp"
#include "kernels/ops.hpp"
#endif

namespace dp::dist {

bool mpi_available() {
  return DP_HAVE_MPI != 0;
}

bool started_by_mpirun(const EnvLookup& env_in) {
  EnvLookup env = env_or_process(env_in);
  return env("OMPI_COMM_WORLD_SIZE").has_value() || env("PMIX_RANK").has_value();
}

void check_launchable(const std::string& backend, const std::string& program, int nproc) {
  DP_CHECK(backend != "mpi", "--backend mpi: MPI ranks are started by mpirun, not by "
                                 << program << " itself; run: mpirun -np " << std::max(1, nproc)
                                 << " " << program
                                 << " ... --backend mpi (as root add --allow-run-as-root; with "
                                 << "more ranks than cores add --oversubscribe)");
}

#if !DP_HAVE_MPI

std::unique_ptr<ProcessGroup> make_mpi_process_group(const kernels::Device&,
                                                     std::chrono::milliseconds) {
  DP_THROW(
      "backend mpi: this build has no MPI; install Open MPI (libopenmpi-dev, openmpi-bin: "
      "scripts/setup.sh does) and rebuild");
}

#else

using kernels::DType;
using kernels::Tensor;
using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

namespace {

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  DP_THROW(call << " failed: " << std::string(text, static_cast<size_t>(len)));
}
#define DP_MPI_CHECK(call) mpi_check((call), #call)

// Set once a rank is failing (a broken group, or a group destroyed while an exception
// unwinds): MPI_Finalize would then wait in its closing fence for peers that are themselves
// waiting for this rank, so the exit handler aborts the job instead. Process-wide, as MPI's
// own state is.
std::atomic<bool> g_rank_failed{false};

[[noreturn]] void abort_job(int rank, int size, const std::string& why) {
  std::fprintf(stderr, "dp: rank %d of %d: %s; ending the MPI job (MPI_Abort)\n", rank, size,
               why.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return; this satisfies [[noreturn]]
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (g_rank_failed.load()) {
    int rank = -1, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    abort_job(rank, size, "this rank failed (its error is above)");
  }
  MPI_Finalize();
}

// MPI is initialised at most once per process (the standard allows no second MPI_Init), and
// finalised at exit: process-wide state by MPI's own definition, kept to this one function.
void ensure_initialized() {
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = 0;
    if (initialized) {
      MPI_Query_thread(&provided);
    } else {
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) {
        failure = "MPI_Init_thread failed (error " + std::to_string(rc) + ")";
        return;
      }
      std::atexit(finalize_at_exit);
    }
    if (provided < MPI_THREAD_MULTIPLE)
      failure = "backend mpi: the MPI library gives thread level " + std::to_string(provided) +
                ", and each group's progress thread needs MPI_THREAD_MULTIPLE (" +
                std::to_string(MPI_THREAD_MULTIPLE) + ")";
  });
  DP_CHECK(failure.empty(), failure);
}

MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f16:
    case DType::bf16:
      return MPI_UINT16_T;  // reduced by the user-defined ops below
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
  }
  DP_THROW("backend mpi: no MPI type for dtype " << dt);
}

// f16/bf16: MPI has no such types, so they travel as 16-bit words and reduce through user
// ops in f32 (MPI's contract: inout = in op inout; every op here is commutative).
template <DType D, ReduceOp Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  static const host::ReduceFn fn = host::reduce_fn(D, Op);
  fn(inout, inout, in, static_cast<size_t>(*len));
}

std::string describe(const std::string& op, const Tensor& t) {
  std::ostringstream os;
  os << op << " of " << t.numel() << " x " << t.dtype() << " on " << t.device();
  return os.str();
}

struct Task {
  std::string what;
  std::shared_ptr<StreamMarker> ready;      // CUDA inputs: their producers' end
  std::function<void(MPI_Request*)> issue;  // progress thread: stage in, post the MPI_I* call
  std::function<void()> complete;           // progress thread, after it finished
  std::shared_ptr<SignalledWork> work;
  std::vector<Tensor> staging;  // pooled pinned buffers the op stages through (CUDA tensors)
};

struct InFlight {
  Task task;
  MPI_Request request;
  Clock::time_point deadline;
  Millis timeout;
};

// An op that failed or was abandoned before MPI completed it: MPI may still write its buffers
// (a late peer's data, at any later MPI call of the process), so they are never freed. Kept for
// the process's life (the job is ending: a broken group aborts it).
void keep_for_mpi(InFlight&& op) {
  static std::mutex mu;
  static auto* kept = new std::vector<InFlight>();
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(op));
}

class MpiProcessGroup final : public ProcessGroup {
 public:
  MpiProcessGroup(int rank, int size, MPI_Comm comm, std::chrono::milliseconds timeout)
      : ProcessGroup(rank, size, timeout), comm_(comm) {
    DP_MPI_CHECK(MPI_Op_create(&half_op<DType::f16, ReduceOp::sum>, 1, &half_ops_[0][0]));
    DP_MPI_CHECK(MPI_Op_create(&half_op<DType::f16, ReduceOp::min>, 1, &half_ops_[0][1]));
    DP_MPI_CHECK(MPI_Op_create(&half_op<DType::f16, ReduceOp::max>, 1, &half_ops_[0][2]));
    DP_MPI_CHECK(MPI_Op_create(&half_op<DType::bf16, ReduceOp::sum>, 1, &half_ops_[1][0]));
    DP_MPI_CHECK(MPI_Op_create(&half_op<DType::bf16, ReduceOp::min>, 1, &half_ops_[1][1]));
    DP_MPI_CHECK(MPI_Op_create(&half_op<DType::bf16, ReduceOp::max>, 1, &half_ops_[1][2]));
    int flag = 0;
    void* ub = nullptr;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    tag_ub_ = flag && ub ? *static_cast<int*>(ub) : 32767;
    worker_ = std::thread([this] { progress_loop(); });
  }

  ~MpiProcessGroup() override {
    // A rank failing while it holds a group (an exception unwinding through its owner, or an
    // op that failed) must not leave its peers inside a collective: its ops are abandoned here,
    // and the exit handler ends the job with MPI_Abort once the caller has reported the error.
    if (std::uncaught_exceptions() > 0) mark_broken("an error is ending this rank");
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
    }
    worker_.join();  // queued ops run (each bounded by its timeout), or fail at once if broken
    if (!broken_reason().empty()) {
      g_rank_failed = true;
      return;  // the job is ending: freeing a communicator with abandoned ops is pointless
    }
    for (auto& per_type : half_ops_)
      for (MPI_Op& op : per_type) MPI_Op_free(&op);
    MPI_Comm_free(&comm_);
  }

  std::string backend_name() const override { return "mpi"; }
  void abort(const std::string& why) override {
    mark_broken("rank " + std::to_string(rank()) + " left the group: " + why);
  }

  std::shared_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op) override {
    check_reducible("all_reduce", t, op);
    auto host = std::make_shared<Tensor>();
    Tensor user = t;
    Task task;
    task.what = describe(std::string("all_reduce(") + reduce_op_name(op) + ")", t);
    task.issue = [this, user, host, op](MPI_Request* req) {
      *host = stage_in(user);
      DP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, host->raw(), count_of(*host),
                                  mpi_type(host->dtype()), mpi_op(host->dtype(), op), comm_, req));
    };
    task.complete = [this, user, host, op]() mutable {
      if (op == ReduceOp::avg)
        host::scale_host(host->raw(), host->dtype(), host->numel(), 1.f / size());
      stage_out(user, *host);
    };
    return enqueue(std::move(task), {t});
  }

  std::shared_ptr<Work> do_broadcast(Tensor& t, int root) override {
    check_root("broadcast", root);
    auto host = std::make_shared<Tensor>();
    Tensor user = t;
    bool is_root = root == rank();
    Task task;
    task.what = describe("broadcast(root " + std::to_string(root) + ")", t);
    task.issue = [this, user, host, root, is_root](MPI_Request* req) {
      *host = stage_in(user, is_root);
      DP_MPI_CHECK(
          MPI_Ibcast(host->raw(), count_of(*host), mpi_type(host->dtype()), root, comm_, req));
    };
    task.complete = [user, host, is_root]() mutable {
      if (!is_root) stage_out(user, *host);
    };
    return enqueue(std::move(task), {t});
  }

  std::shared_ptr<Work> do_reduce(Tensor& t, int root, ReduceOp op) override {
    check_reducible("reduce", t, op);
    check_root("reduce", root);
    auto host = std::make_shared<Tensor>();
    Tensor user = t;
    bool is_root = root == rank();
    Task task;
    task.what = describe(
        std::string("reduce(") + reduce_op_name(op) + ", root " + std::to_string(root) + ")", t);
    task.issue = [this, user, host, op, root, is_root](MPI_Request* req) {
      *host = stage_in(user);
      void* buf = host->raw();
      DP_MPI_CHECK(MPI_Ireduce(is_root ? MPI_IN_PLACE : buf, buf, count_of(*host),
                               mpi_type(host->dtype()), mpi_op(host->dtype(), op), root, comm_,
                               req));
    };
    task.complete = [this, user, host, op, is_root]() mutable {
      if (!is_root) return;
      if (op == ReduceOp::avg)
        host::scale_host(host->raw(), host->dtype(), host->numel(), 1.f / size());
      stage_out(user, *host);
    };
    return enqueue(std::move(task), {t});
  }

  std::shared_ptr<Work> do_all_gather(Tensor& out, const Tensor& in) override {
    check_pair("all_gather", out, in, out.numel() == in.numel() * size(),
               "out must hold size x in's elements");
    auto hin = std::make_shared<Tensor>(), hout = std::make_shared<Tensor>();
    Tensor uin = in, uout = out;
    Task task;
    task.what = describe("all_gather", in);
    task.issue = [this, uin, uout, hin, hout](MPI_Request* req) {
      *hin = stage_in(uin);
      *hout = stage_in(uout, false);
      MPI_Datatype type = mpi_type(hin->dtype());
      DP_MPI_CHECK(MPI_Iallgather(hin->raw(), count_of(*hin), type, hout->raw(), count_of(*hin),
                                  type, comm_, req));
    };
    task.complete = [uout, hout, hin]() mutable { stage_out(uout, *hout); };
    return enqueue(std::move(task), {in, out});
  }

  std::shared_ptr<Work> do_reduce_scatter(Tensor& out, const Tensor& in, ReduceOp op) override {
    check_reducible("reduce_scatter", in, op);
    check_pair("reduce_scatter", out, in, in.numel() == out.numel() * size(),
               "in must hold size x out's elements");
    auto hin = std::make_shared<Tensor>(), hout = std::make_shared<Tensor>();
    Tensor uin = in, uout = out;
    Task task;
    task.what = describe(std::string("reduce_scatter(") + reduce_op_name(op) + ")", in);
    task.issue = [this, uin, uout, hin, hout, op](MPI_Request* req) {
      *hin = stage_in(uin);
      *hout = stage_in(uout, false);
      DP_MPI_CHECK(MPI_Ireduce_scatter_block(hin->raw(), hout->raw(), count_of(*hout),
                                             mpi_type(hin->dtype()), mpi_op(hin->dtype(), op),
                                             comm_, req));
    };
    task.complete = [this, uout, hout, hin, op]() mutable {
      if (op == ReduceOp::avg)
        host::scale_host(hout->raw(), hout->dtype(), hout->numel(), 1.f / size());
      stage_out(uout, *hout);
    };
    return enqueue(std::move(task), {in, out});
  }

  std::shared_ptr<Work> do_send(const Tensor& t, int dst, uint32_t tag) override {
    check_peer("send", dst, tag);
    auto host = std::make_shared<Tensor>();
    Tensor user = t;
    Task task;
    task.what =
        describe("send(to rank " + std::to_string(dst) + ", tag " + std::to_string(tag) + ")", t);
    task.issue = [this, user, host, dst, tag](MPI_Request* req) {
      *host = stage_in(user);
      DP_MPI_CHECK(MPI_Isend(host->raw(), count_of(*host), mpi_type(host->dtype()), dst,
                             static_cast<int>(tag), comm_, req));
    };
    task.complete = [host] {};
    return enqueue(std::move(task), {t});
  }

  std::shared_ptr<Work> do_recv(Tensor& t, int src, uint32_t tag) override {
    check_peer("recv", src, tag);
    auto host = std::make_shared<Tensor>();
    Tensor user = t;
    Task task;
    task.what =
        describe("recv(from rank " + std::to_string(src) + ", tag " + std::to_string(tag) + ")", t);
    task.issue = [this, user, host, src, tag](MPI_Request* req) {
      *host = stage_in(user, false);
      DP_MPI_CHECK(MPI_Irecv(host->raw(), count_of(*host), mpi_type(host->dtype()), src,
                             static_cast<int>(tag), comm_, req));
    };
    task.complete = [user, host]() mutable { stage_out(user, *host); };
    return enqueue(std::move(task), {t});
  }

  std::shared_ptr<Work> do_barrier() override {
    Task task;
    task.what = "barrier";
    task.issue = [this](MPI_Request* req) { DP_MPI_CHECK(MPI_Ibarrier(comm_, req)); };
    task.complete = [] {};
    return enqueue(std::move(task), {});
  }

  // MPI_Init was the rendezvous, so there is no store: the texts travel in two MPI_Iallgather
  // on this group's communicator (their lengths, then the texts padded to the longest), each
  // bounded by `timeout`. Every rank calls this first, before any other op.
  std::vector<std::string> exchange_text(const std::string& name, const std::string& mine,
                                         Millis timeout) override {
    const Millis ops_timeout = this->timeout();
    set_timeout(timeout);  // read by the progress thread as it posts the two ops below
    try {
      const kernels::Device cpu = kernels::Device::cpu();
      Tensor len = Tensor::empty({1}, DType::i64, cpu);
      len.data<int64_t>()[0] = static_cast<int64_t>(mine.size());
      Tensor lens = Tensor::empty({size()}, DType::i64, cpu);
      all_gather(lens, len)->wait();
      int64_t longest = 1;
      for (int r = 0; r < size(); ++r) longest = std::max(longest, lens.data<int64_t>()[r]);
      DP_CHECK(longest <= (int64_t(64) << 20),
               "exchange of " << name << ": a rank sent " << longest << " bytes (at most 64 MiB)");
      Tensor padded = Tensor::zeros({longest}, DType::u8, cpu);
      std::copy(mine.begin(), mine.end(), padded.data<char>());
      Tensor all = Tensor::empty({longest * size()}, DType::u8, cpu);
      all_gather(all, padded)->wait();
      std::vector<std::string> out;
      for (int r = 0; r < size(); ++r)
        out.emplace_back(all.data<char>() + r * longest,
                         static_cast<size_t>(lens.data<int64_t>()[r]));
      set_timeout(ops_timeout);
      return out;
    } catch (const kernels::Error& e) {
      set_timeout(ops_timeout);
      DP_THROW("rank " << rank() << " of " << size() << ": the exchange of " << name
                       << " through MPI_Allgather failed (do all ranks run the same program?): "
                       << e.what());
    }
  }

 private:
  // The host memory an op works on: the tensor itself on the CPU, else a pooled pinned buffer
  // (filled from the device when `load`), recorded in the op being issued so that it goes back
  // to the pool when the op completes. Runs on the progress thread, inside Task::issue.
  Tensor stage_in(const Tensor& t, bool load = true) {
    if (t.device().is_cpu()) return t;
    Tensor buf = staging_.take(t.numel(), t.dtype());
    issuing_->push_back(buf);
    Tensor h = buf.view(0, {t.numel()});
    if (load) kernels::copy(h, t);  // D2H, waited for
    return h;
  }
  // Copies a staged result back to its CUDA tensor and waits for the copy.
  static void stage_out(Tensor& t, const Tensor& h) {
    if (t.device().is_cpu()) return;
    kernels::copy(t, h);
    kernels::context(t.device()).synchronize();
  }

  static int count_of(const Tensor& t) {
    DP_CHECK(t.numel() <= INT_MAX, "backend mpi: " << t.numel()
                                                   << " elements exceed MPI's int count ("
                                                   << INT_MAX << "); split the tensor");
    return static_cast<int>(t.numel());
  }

  MPI_Op mpi_op(DType dt, ReduceOp op) const {
    int k = op == ReduceOp::min ? 1 : op == ReduceOp::max ? 2 : 0;  // avg sums, then scales
    if (dt == DType::f16) return half_ops_[0][k];
    if (dt == DType::bf16) return half_ops_[1][k];
    return k == 1 ? MPI_MIN : k == 2 ? MPI_MAX : MPI_SUM;
  }

  static void check_reducible(const char* op, const Tensor& t, ReduceOp rop) {
    DP_CHECK(t.defined(), "mpi " << op << ": undefined tensor");
    DP_CHECK(rop != ReduceOp::avg || kernels::is_floating(t.dtype()),
             "mpi " << op << "(avg) needs a floating tensor, not " << t.dtype());
  }
  void check_root(const char* op, int root) const {
    DP_CHECK(root >= 0 && root < size(),
             "mpi " << op << ": root " << root << " is not a rank of a group of " << size());
  }
  void check_peer(const char* op, int peer, uint32_t tag) const {
    DP_CHECK(peer >= 0 && peer < size() && peer != rank(),
             "mpi " << op << ": peer " << peer << " is not another rank of a group of " << size()
                    << " (this is rank " << rank() << ")");
    DP_CHECK(tag <= static_cast<uint32_t>(tag_ub_),
             "mpi " << op << ": tag " << tag << " exceeds MPI_TAG_UB " << tag_ub_);
  }
  static void check_pair(const char* op, const Tensor& out, const Tensor& in, bool sizes_ok,
                         const char* rule) {
    DP_CHECK(out.defined() && in.defined(), "mpi " << op << ": undefined tensor");
    DP_CHECK(out.dtype() == in.dtype() && out.device() == in.device(),
             "mpi " << op << ": out " << out << " and in " << in << " differ in dtype or device");
    DP_CHECK(sizes_ok, "mpi " << op << ": " << rule << ": out " << out << ", in " << in);
  }

  std::shared_ptr<Work> enqueue(Task task, std::initializer_list<Tensor> tensors) {
    task.work = std::make_shared<SignalledWork>();
    for (const Tensor& t : tensors)
      if (t.device().is_cuda()) {
        task.ready = StreamMarker::record(t.device());
        break;
      }
    std::shared_ptr<Work> work = task.work;
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    cv_.notify_all();
    return work;
  }

  std::string failure_message(const std::string& what, Millis timeout,
                              const std::string& why) const {
    std::ostringstream os;
    os << "mpi " << what << " failed on rank " << rank() << " of " << size() << " (timeout "
       << timeout.count() << " ms): " << why;
    return os.str();
  }

  void mark_broken(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = why;
  }
  std::string broken_reason() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }

  void fail(Task& task, const std::string& msg) {
    mark_broken(msg);
    task.work->finish(std::make_exception_ptr(kernels::Error(msg)));
  }

  // The progress thread: posts queued ops in issue order, then drives every op in flight to
  // completion with MPI_Test. Open MPI moves a large message only inside MPI calls, a fragment
  // at a time, so the thread polls back to back, yielding the core between polls to any
  // runnable compute thread; once nothing has completed for half a second (a late peer) ops
  // are polled every 200 us instead, so a long wait does not burn a core.
  void progress_loop() noexcept {
    std::vector<InFlight> in_flight;
    Clock::time_point last_progress = Clock::now();
    while (true) {
      std::deque<Task> fresh;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (in_flight.empty()) cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty() && in_flight.empty() && stopping_) return;
        fresh.swap(queue_);
      }
      Millis timeout = this->timeout();
      for (Task& task : fresh) {
        std::string earlier = broken_reason();
        if (!earlier.empty()) {
          task.work->finish(std::make_exception_ptr(
              kernels::Error("mpi " + task.what + " on rank " + std::to_string(rank()) + " of " +
                             std::to_string(size()) +
                             " not run: the group is broken by an earlier failure: " + earlier)));
          continue;
        }
        try {
          if (task.ready) task.ready->wait_host();
          MPI_Request req = MPI_REQUEST_NULL;
          issuing_ = &task.staging;
          task.issue(&req);
          in_flight.push_back({std::move(task), req, Clock::now() + timeout, timeout});
        } catch (const std::exception& e) {
          fail(task, failure_message(task.what, timeout, e.what()));
        }
      }
      bool progressed = false;
      for (size_t i = 0; i < in_flight.size();) {
        InFlight& op = in_flight[i];
        int done = 0;
        int rc = MPI_Test(&op.request, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) done = 0;
        std::string earlier = broken_reason();
        bool finished = true;
        if (rc != MPI_SUCCESS) {
          char text[MPI_MAX_ERROR_STRING] = {0};
          int len = 0;
          MPI_Error_string(rc, text, &len);
          fail(op.task, failure_message(op.task.what, op.timeout, std::string(text, len)));
        } else if (done) {
          try {
            op.task.complete();
            // Done with its staging (a failed or abandoned op keeps it: MPI may still write).
            for (Tensor& buf : op.task.staging) staging_.give_back(std::move(buf));
            op.task.work->finish(nullptr);
          } catch (const std::exception& e) {
            fail(op.task, failure_message(op.task.what, op.timeout, e.what()));
          }
        } else if (!earlier.empty()) {
          // Collectives cannot be cancelled: the job ends when the group is destroyed.
          op.task.work->finish(std::make_exception_ptr(
              kernels::Error("mpi " + op.task.what + " on rank " + std::to_string(rank()) +
                             " abandoned: the group is broken by an earlier failure: " + earlier)));
        } else if (Clock::now() > op.deadline) {
          std::ostringstream os;
          os << "mpi " << op.task.what << " did not complete within " << op.timeout.count()
             << " ms on rank " << rank() << " of " << size()
             << " (a peer never joined the op, or died)";
          fail(op.task, os.str());
        } else {
          finished = false;
        }
        if (finished) {
          if (!done) keep_for_mpi(std::move(op));
          in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(i));
          progressed = true;
        } else {
          ++i;
        }
      }
      if (progressed || !fresh.empty()) last_progress = Clock::now();
      if (in_flight.empty()) continue;
      // MPI reports no partial progress, only completion: a large op that is moving looks idle
      // until it ends, so polls stay back to back for half a second (a 16 MiB all-reduce takes
      // tens of ms here; sleeping between its fragments made it ten times slower).
      if (Clock::now() - last_progress < std::chrono::milliseconds(500))
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  MPI_Comm comm_;
  MPI_Op half_ops_[2][3] = {};
  int tag_ub_ = 32767;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::string broken_;
  PinnedPool staging_;
  std::vector<Tensor>* issuing_ = nullptr;  // progress thread only: the op being issued
  std::thread worker_;
};

}  // namespace

std::unique_ptr<ProcessGroup> make_mpi_process_group(const kernels::Device& device,
                                                     std::chrono::milliseconds timeout) {
  (void)device;
  DP_CHECK(started_by_mpirun(),
           "backend mpi needs ranks started by mpirun (e.g. mpirun -np 4 build/bin/dp_bench "
           "--mode ddp --backend mpi); this process was not (OMPI_COMM_WORLD_SIZE is unset)");
  ensure_initialized();
  MPI_Comm comm = MPI_COMM_NULL;
  DP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  // Errors come back as codes (and then kernels::Error), not as MPI's default abort.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::make_unique<MpiProcessGroup>(rank, size, comm, timeout);
}

#endif  // DP_HAVE_MPI

}  // namespace dp::dist
