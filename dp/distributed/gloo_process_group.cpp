#include "dp/distributed/gloo_process_group.hpp"

#include <pthread.h>
#include <signal.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "dp/distributed/cuda_util.hpp"
#include "dp/distributed/host_reduce.hpp"
#include "dp/distributed/pinned_pool.hpp"
#include "dp/distributed/signalled_work.hpp"
#include "dp/distributed/store.hpp"
#include "kernels/ops.hpp"

namespace dp::dist {

using kernels::DType;
using kernels::Tensor;
using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

namespace {

// Point-to-point slots live apart from the collectives' (gloo::Slot::build puts a small
// prefix in the top byte): user tag t uses slot kP2PSlotBase + t.
constexpr uint64_t kP2PSlotBase = uint64_t(0xD0) << 56;

// Gloo's typed setters only use sizeof(T): pick an unsigned type of the element's size.
template <class Opts>
void set_output(Opts& o, void* p, size_t n, size_t elem) {
  switch (elem) {
    case 1:
      o.template setOutput<uint8_t>(static_cast<uint8_t*>(p), n);
      return;
    case 2:
      o.template setOutput<uint16_t>(static_cast<uint16_t*>(p), n);
      return;
    case 4:
      o.template setOutput<uint32_t>(static_cast<uint32_t*>(p), n);
      return;
    case 8:
      o.template setOutput<uint64_t>(static_cast<uint64_t*>(p), n);
      return;
  }
  DP_THROW("unsupported element size " << elem);
}
template <class Opts>
void set_input(Opts& o, void* p, size_t n, size_t elem) {
  switch (elem) {
    case 1:
      o.template setInput<uint8_t>(static_cast<uint8_t*>(p), n);
      return;
    case 2:
      o.template setInput<uint16_t>(static_cast<uint16_t*>(p), n);
      return;
    case 4:
      o.template setInput<uint32_t>(static_cast<uint32_t*>(p), n);
      return;
    case 8:
      o.template setInput<uint64_t>(static_cast<uint64_t*>(p), n);
      return;
  }
  DP_THROW("unsupported element size " << elem);
}

// Failure notes (record_failure), under the group's keys: the first rank to record one takes
// the count to 1 and leaves its text; each store request of a note is bounded by this.
constexpr Millis kFailureNoteBound = std::chrono::seconds(2);
constexpr size_t kFailureNoteBytes = 4096;  // of the recorded text, which can be long
const char* const kFailureCountKey = "failed/count";
// Peers that read the first note (each adds 1 once); the rank that recorded it waits, when its
// group goes, until all have or this long (its process may host the store: rank 0).
const char* const kFailureReadsKey = "failed/reads";
constexpr Millis kFailureNoteLinger = std::chrono::seconds(2);
const char* const kFirstFailureKey = "failed/first";

// How a rank's note begins: "rank R: ".
std::string note_prefix(int rank) {
  return "rank " + std::to_string(rank) + ": ";
}

// What a rank's op failure says: the op, the rank, the timeout and Gloo's words, then for a
// timeout or a peer gone the first failure a peer recorded (recorded(): "" when none).
std::string failure_message(const std::string& what, int rank, int size, Millis timeout,
                            const std::string& why, const std::function<std::string()>& recorded) {
  std::ostringstream os;
  bool timed_out = why.find("imed out") != std::string::npos;
  if (timed_out)
    os << "gloo " << what << " timed out after " << timeout.count() << " ms on rank " << rank
       << " of " << size << " (a peer never joined the op, or died): " << why;
  else
    os << "gloo " << what << " failed on rank " << rank << " of " << size << " (timeout "
       << timeout.count() << " ms): " << why;
  // Gloo's words for a peer's end of a connection gone (not this rank's: its own abort marks
  // the group broken first). Gloo's address does not say which peer: the note the peer recorded
  // before it went does, where there is one; else its own log, and torchrun, mpirun, srun or
  // launch_workers.
  const bool peer_gone =
      !timed_out && (why.find("Connection closed by peer") != std::string::npos ||
                     why.find("Connection reset by peer") != std::string::npos ||
                     why.find("Broken pipe") != std::string::npos);
  if (!timed_out && !peer_gone) return os.str();
  // The rank whose failure this one follows, where it recorded one (after a timeout it may still
  // be alive, in another op). Not this rank's own note: that says nothing new.
  const std::string note = recorded();
  const std::string mine = note_prefix(rank);
  if (!note.empty() && note.compare(0, mine.size(), mine) != 0) {
    const size_t colon = note.find(": ");
    os << " (" << note.substr(0, colon)
       << " failed first: " << (colon == std::string::npos ? std::string() : note.substr(colon + 2))
       << ")";
  } else if (peer_gone) {
    os << " (a peer rank closed its connection: it failed, exited or was killed first; its log, "
          "or the launcher's, names it and says why)";
  }
  return os.str();
}

enum class TaskKind { collective, point_to_point };

struct Task {
  TaskKind kind;
  std::string what;
  Millis timeout;
  std::shared_ptr<StreamMarker> ready;             // CUDA inputs: their producers' end
  std::function<void(uint32_t tag)> run;           // on the worker
  std::function<void(std::exception_ptr)> finish;  // after run, with its failure if any
};

}  // namespace

// ---- State: the gloo context and the worker ---------------------------------------------------

struct GlooProcessGroup::State {
  int rank = 0;
  int size = 1;
  std::shared_ptr<Store> store;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> ctx;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;
  bool stopping = false;
  std::string broken;  // the first failure; later ops fail at once
  std::thread worker;
  std::atomic<bool> noted_first{false};        // record_failure left the first note
  mutable std::atomic<bool> read_note{false};  // recorded_failure counted its read

  // Worker-only.
  uint32_t next_tag = 1;
  std::map<std::pair<int, DType>, Tensor> pool;  // grow-only pinned staging buffers

  void enqueue(Task task) {
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(std::move(task));
    cv.notify_all();
  }

  void mark_broken(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (broken.empty()) broken = why;
  }

  std::string broken_reason() {
    std::lock_guard<std::mutex> lock(mu);
    return broken;
  }

  // The first failure a rank of the group recorded ("rank R: text"), or "" (none, or the store
  // unreachable within kFailureNoteBound: its host may be the rank that failed).
  std::string recorded_failure() const noexcept {
    try {
      std::shared_ptr<Store> s = store->reconnect(kFailureNoteBound);
      if (!s || !s->check({kFirstFailureKey})) return "";
      std::string note = s->get_string(kFirstFailureKey);
      // A peer's note, read once: its writer may be waiting for the read.
      const std::string mine = note_prefix(rank);
      if (note.compare(0, mine.size(), mine) != 0 && !read_note.exchange(true))
        s->add(kFailureReadsKey, 1);
      return note;
    } catch (...) {
      return "";
    }
  }

  // The failure message of `task`'s op (failure_message with this group's recorded note).
  std::string failure_of(const std::string& what, Millis timeout, const std::string& why) const {
    return failure_message(what, rank, size, timeout, why, [this] { return recorded_failure(); });
  }

  // The host memory an op works on: the tensor itself on CPU, else a pinned staging buffer
  // (slot 0 or 1), filled from the device when `load`.
  Tensor host_of(int slot, const Tensor& t, bool load) {
    if (t.device().is_cpu()) return t;
    Tensor& buf = pool[{slot, t.dtype()}];
    if (!buf.defined() || buf.numel() < t.numel())
      buf = Tensor::empty_pinned({std::max<int64_t>(t.numel(), 1)}, t.dtype());
    Tensor h = buf.view(0, {t.numel()});
    if (load) kernels::copy(h, t);  // D2H on this thread's stream, waited for
    return h;
  }

  // Pinned staging of point-to-point ops on CUDA tensors. A send or recv stays in flight after
  // the worker moves on, so it cannot share the collectives' two slots: it takes a buffer from
  // this pool and its work gives it back once the transfer is done.
  PinnedPool p2p_staging;

  // Copies a staged result back to its CUDA tensor and waits for the copy.
  static void store_back(Tensor& t, const Tensor& h) {
    if (t.device().is_cpu()) return;
    kernels::copy(t, h);
    kernels::context(t.device()).synchronize();
  }

  void run() noexcept {
    while (true) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      std::exception_ptr error;
      std::string earlier = broken_reason();
      uint32_t tag = task.kind == TaskKind::collective ? next_tag++ : 0;
      if (!earlier.empty()) {
        error = std::make_exception_ptr(
            kernels::Error("gloo " + task.what + " on rank " + std::to_string(rank) + " of " +
                           std::to_string(size) +
                           " not run: the group is broken by an earlier failure: " + earlier));
      } else {
        try {
          if (task.ready) task.ready->wait_host();
          task.run(tag);
        } catch (const std::exception& e) {
          std::string msg = failure_of(task.what, task.timeout, e.what());
          mark_broken(msg);
          error = std::make_exception_ptr(kernels::Error(msg));
        } catch (...) {
          std::string msg = failure_of(task.what, task.timeout, "unknown exception");
          mark_broken(msg);
          error = std::make_exception_ptr(kernels::Error(msg));
        }
      }
      // The op's tensors (held by run and ready) go back before the waiter wakes: a waiter
      // that asks for a block of the same size then reuses theirs (no new allocation).
      task.run = nullptr;
      task.ready.reset();
      try {
        task.finish(error);
      } catch (...) {
        DP_LOG_ERROR("gloo worker of rank " << rank << ": finishing " << task.what << " threw");
      }
    }
  }
};

namespace {

// Send or recv: the worker posts it in issue order, wait() completes it on the caller.
class GlooP2PWork final : public Work {
 public:
  GlooP2PWork(std::shared_ptr<GlooProcessGroup::State> state, std::string what, Millis timeout,
              bool is_send, Tensor user)
      : state_(std::move(state)),
        what_(std::move(what)),
        timeout_(timeout),
        is_send_(is_send),
        user_(std::move(user)) {}

  // Worker: the buffer is posted (or there was nothing to move). `staging` is the pooled
  // pinned buffer `host` views (undefined for CPU tensors); wait() gives it back when done.
  void posted(std::unique_ptr<gloo::transport::UnboundBuffer> buf, Tensor host, Tensor staging,
              std::shared_ptr<gloo::Context> ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    buf_ = std::move(buf);
    host_ = std::move(host);
    staging_ = std::move(staging);
    ctx_ = std::move(ctx);
    deadline_ = Clock::now() + timeout_;
    posted_ = true;
    cv_.notify_all();
  }
  void failed(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = e;
    done_ = true;
    cv_.notify_all();
  }

  void wait() override {
    std::lock_guard<std::mutex> one_waiter(wait_mu_);
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return posted_ || done_; });
      if (done_) {
        if (error_) std::rethrow_exception(error_);
        return;
      }
    }
    try {
      if (buf_) {
        auto left = std::chrono::duration_cast<Millis>(deadline_ - Clock::now());
        if (left < Millis(1)) left = Millis(1);
        bool ok = is_send_ ? buf_->waitSend(left) : buf_->waitRecv(left);
        if (!ok) throw std::runtime_error("aborted");
        if (!is_send_ && user_.device().is_cuda()) {
          kernels::copy(user_, host_);
          kernels::context(user_.device()).synchronize();
        }
        buf_.reset();  // the transfer is over: the staging buffer is free again
        host_ = Tensor();
        state_->p2p_staging.give_back(std::move(staging_));
      }
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    } catch (const std::exception& e) {
      std::string msg = state_->failure_of(what_, timeout_, e.what());
      state_->mark_broken(msg);
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::make_exception_ptr(kernels::Error(msg));
      done_ = true;
      std::rethrow_exception(error_);
    }
  }

  bool is_completed() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  std::shared_ptr<GlooProcessGroup::State> state_;
  std::string what_;
  Millis timeout_;
  bool is_send_;
  Tensor user_;
  Tensor host_;
  Tensor staging_;
  std::shared_ptr<gloo::Context> ctx_;  // keeps the transport alive while buf_ is
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
  Clock::time_point deadline_;
  std::mutex wait_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool posted_ = false;
  bool done_ = false;
  std::exception_ptr error_;
};

void check_reducible(const char* op, const Tensor& t, ReduceOp rop) {
  DP_CHECK(t.defined(), op << ": undefined tensor");
  DType dt = t.dtype();
  DP_CHECK(dt == DType::f32 || dt == DType::f16 || dt == DType::bf16 || dt == DType::i32 ||
               dt == DType::i64 || dt == DType::u8,
           op << ": unsupported dtype " << dt);
  DP_CHECK(rop != ReduceOp::avg || kernels::is_floating(dt),
           op << "(avg) needs a floating tensor, not " << dt);
}

// The stream point CUDA inputs are ready at (nullptr when every tensor is on the CPU).
std::shared_ptr<StreamMarker> ready_marker(const char* op,
                                           std::initializer_list<const Tensor*> ts) {
  const Tensor* cuda = nullptr;
  for (const Tensor* t : ts) {
    if (!t->device().is_cuda()) continue;
    DP_CHECK(!cuda || cuda->device() == t->device(),
             op << ": CUDA tensors on " << cuda->device() << " and " << t->device());
    cuda = t;
  }
  return cuda ? StreamMarker::record(cuda->device()) : nullptr;
}

}  // namespace

// ---- connecting the full mesh ---------------------------------------------------------------

// The store connectFullMesh reads the peers' addresses through: every wait runs to one deadline
// (the connect timeout from the start of the set-up), whatever timeout gloo passes.
namespace {
class DeadlineStore final : public gloo::rendezvous::Store {
 public:
  DeadlineStore(dp::dist::Store& base, Clock::time_point deadline)
      : base_(base), deadline_(deadline) {}
  void set(const std::string& key, const std::vector<char>& value) override {
    base_.set(key, value);
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    return base_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override { base_.wait(keys, left()); }
  void wait(const std::vector<std::string>& keys, const Millis&) override {
    base_.wait(keys, left());
  }

 private:
  Millis left() const {
    auto d = std::chrono::duration_cast<Millis>(deadline_ - Clock::now());
    return std::max(d, Millis(1));
  }
  dp::dist::Store& base_;
  Clock::time_point deadline_;
};
}  // namespace

// ---- GlooProcessGroup -----------------------------------------------------------------------

namespace {

// SIGPIPE blocked on this thread while alive (and in the threads it starts meanwhile).
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &old_);
  }
  ~SigpipeBlocked() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t old_;
};

}  // namespace

GlooProcessGroup::GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                                   const GlooOptions& options)
    : ProcessGroup(rank, size, options.timeout), state_(std::make_shared<State>()) {
  DP_CHECK(store != nullptr, "GlooProcessGroup needs a store");
  state_->rank = rank;
  state_->size = size;
  state_->store = std::move(store);
  // Gloo writes its sockets with writev, which raises SIGPIPE on a connection its peer closed:
  // a rank that failed killed its peers silently (exit 141) instead of failing their op with
  // "Connection reset". The threads that write them (the device's event loop, made by
  // CreateDevice, and the worker) are started with SIGPIPE blocked, inheriting this thread's
  // mask, which is restored after: a write there returns EPIPE. The process's own disposition
  // stays the caller's (Python ignores SIGPIPE; a C++ program need not).
  SigpipeBlocked blocked;
  try {
    gloo::transport::tcp::attr attr;
    if (!options.interface.empty())
      attr.iface = options.interface;
    else
      attr.hostname = options.hostname;
    state_->device = gloo::transport::tcp::CreateDevice(attr);
    state_->ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    // This gloo's tcp pairs wait 5 x the context's timeout for their connection (pair.h,
    // waitUntil): pairs are made with a fifth of the connect timeout, so that a peer that never
    // connects fails the set-up within it, and the address reads run to the same deadline.
    // Ops then get the op timeout (each passes its own as well).
    DeadlineStore store(*state_->store, Clock::now() + options.connect_timeout);
    state_->ctx->setTimeout(std::max(Millis(1), options.connect_timeout / 5));
    state_->ctx->connectFullMesh(store, state_->device);
    state_->ctx->setTimeout(options.timeout);
  } catch (const std::exception& e) {
    DP_THROW("gloo rendezvous of rank "
             << rank << " of " << size << " through " << state_->store->describe()
             << " failed (connect timeout " << seconds_text(options.connect_timeout)
             << ", transport address '"
             << (options.interface.empty() ? options.hostname : "iface " + options.interface)
             << "'): " << e.what());
  }
  State* s = state_.get();
  state_->worker = std::thread([s] { s->run(); });
}

namespace {

// The group of the rank that left the first failure note, going: the peers whose ops failed on
// its closed connections read the note from the store, which this process may host (rank 0). It
// stays up until each has read it, or for kFailureNoteLinger (a peer busy elsewhere reads later,
// or never).
void linger_for_note_readers(const GlooProcessGroup::State& st) noexcept {
  if (!st.noted_first.load() || st.size < 2) return;
  try {
    const auto end = std::chrono::steady_clock::now() + kFailureNoteLinger;
    std::shared_ptr<Store> s = st.store->reconnect(kFailureNoteBound);
    while (s && s->add(kFailureReadsKey, 0) < st.size - 1 && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } catch (...) {  // best effort: the store's host may be gone
  }
}

}  // namespace

GlooProcessGroup::~GlooProcessGroup() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
  }
  state_->cv.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
  linger_for_note_readers(*state_);
}

void GlooProcessGroup::record_failure(const std::string& why) noexcept {
  // After this group's own failure (an op, or abort) the cause is another's, or recorded.
  if (!state_->broken_reason().empty()) return;
  try {
    std::shared_ptr<Store> s = state_->store->reconnect(kFailureNoteBound);
    if (!s || s->add(kFailureCountKey, 1) != 1) return;  // another rank's note is the first
    s->set_string(kFirstFailureKey, note_prefix(state_->rank) + why.substr(0, kFailureNoteBytes));
    state_->noted_first = true;
  } catch (...) {
    // Best effort: the store's host may be gone; the peers then say what they saw.
  }
}

void GlooProcessGroup::abort(const std::string& why) {
  record_failure(why);
  state_->mark_broken("rank " + std::to_string(state_->rank) + " left the group: " + why);
  if (state_->ctx) state_->ctx->closeConnections();
}

std::shared_ptr<Work> GlooProcessGroup::do_all_reduce(Tensor& t, ReduceOp op) {
  check_reducible("all_reduce", t, op);
  auto work = std::make_shared<SignalledWork>();
  State* s = state_.get();
  std::string what = std::string("all_reduce(") + reduce_op_name(op) + ") of " + describe_tensor(t);
  Millis to = timeout();
  Task task{TaskKind::collective,
            what,
            to,
            ready_marker("all_reduce", {&t}),
            nullptr,
            [work](std::exception_ptr e) { work->finish(e); }};
  task.run = [s, t, op, to](uint32_t tag) mutable {
    if (t.numel() == 0) return;
    Tensor h = s->host_of(0, t, true);
    if (s->size > 1) {
      gloo::AllreduceOptions o(s->ctx);
      set_output(o, h.raw(), static_cast<size_t>(h.numel()), kernels::dtype_size(h.dtype()));
      o.setReduceFunction(host::reduce_fn(h.dtype(), op));
      o.setTag(tag);
      o.setTimeout(to);
      gloo::allreduce(o);
    }
    if (op == ReduceOp::avg && s->size > 1)
      host::scale_host(h.raw(), h.dtype(), h.numel(), 1.f / s->size);
    State::store_back(t, h);
  };
  state_->enqueue(std::move(task));
  return work;
}

std::shared_ptr<Work> GlooProcessGroup::do_broadcast(Tensor& t, int root) {
  DP_CHECK(t.defined(), "broadcast: undefined tensor");
  DP_CHECK(root >= 0 && root < size(),
           "broadcast: root " << root << " not in [0, " << size() << ")");
  auto work = std::make_shared<SignalledWork>();
  State* s = state_.get();
  Millis to = timeout();
  std::string what = "broadcast(root " + std::to_string(root) + ") of " + describe_tensor(t);
  Task task{TaskKind::collective,
            what,
            to,
            ready_marker("broadcast", {&t}),
            nullptr,
            [work](std::exception_ptr e) { work->finish(e); }};
  task.run = [s, t, root, to](uint32_t tag) mutable {
    if (t.numel() == 0 || s->size == 1) return;
    bool is_root = s->rank == root;
    Tensor h = s->host_of(0, t, is_root);
    gloo::BroadcastOptions o(s->ctx);
    set_output(o, h.raw(), static_cast<size_t>(h.numel()), kernels::dtype_size(h.dtype()));
    o.setRoot(root);
    o.setTag(tag);
    o.setTimeout(to);
    gloo::broadcast(o);
    if (!is_root) State::store_back(t, h);
  };
  state_->enqueue(std::move(task));
  return work;
}

std::shared_ptr<Work> GlooProcessGroup::do_reduce(Tensor& t, int root, ReduceOp op) {
  check_reducible("reduce", t, op);
  DP_CHECK(root >= 0 && root < size(), "reduce: root " << root << " not in [0, " << size() << ")");
  auto work = std::make_shared<SignalledWork>();
  State* s = state_.get();
  Millis to = timeout();
  std::string what = std::string("reduce(") + reduce_op_name(op) + ", root " +
                     std::to_string(root) + ") of " + describe_tensor(t);
  Task task{
      TaskKind::collective,         what,    to,
      ready_marker("reduce", {&t}), nullptr, [work](std::exception_ptr e) { work->finish(e); }};
  task.run = [s, t, root, op, to](uint32_t tag) mutable {
    if (t.numel() == 0) return;
    Tensor h = s->host_of(0, t, true);
    if (s->size > 1) {
      gloo::ReduceOptions o(s->ctx);
      set_output(o, h.raw(), static_cast<size_t>(h.numel()), kernels::dtype_size(h.dtype()));
      o.setRoot(root);
      o.setReduceFunction(host::reduce_fn(h.dtype(), op));
      o.setTag(tag);
      o.setTimeout(to);
      gloo::reduce(o);
    }
    if (s->rank == root) {
      if (op == ReduceOp::avg && s->size > 1)
        host::scale_host(h.raw(), h.dtype(), h.numel(), 1.f / s->size);
      State::store_back(t, h);
    }
  };
  state_->enqueue(std::move(task));
  return work;
}

std::shared_ptr<Work> GlooProcessGroup::do_all_gather(Tensor& out, const Tensor& in) {
  DP_CHECK(out.defined() && in.defined(), "all_gather: undefined tensor");
  DP_CHECK(out.dtype() == in.dtype(),
           "all_gather: out is " << out.dtype() << ", in is " << in.dtype());
  DP_CHECK(out.numel() == in.numel() * size(), "all_gather: out has "
                                                   << out.numel() << " elements, needs " << size()
                                                   << " x " << in.numel());
  auto work = std::make_shared<SignalledWork>();
  State* s = state_.get();
  Millis to = timeout();
  std::string what = "all_gather of " + describe_tensor(in);
  Task task{TaskKind::collective,
            what,
            to,
            ready_marker("all_gather", {&out, &in}),
            nullptr,
            [work](std::exception_ptr e) { work->finish(e); }};
  task.run = [s, out, in, to](uint32_t tag) mutable {
    if (in.numel() == 0) return;
    Tensor hin = s->host_of(0, in, true);
    Tensor hout = s->host_of(1, out, false);
    size_t elem = kernels::dtype_size(in.dtype());
    if (s->size > 1) {
      gloo::AllgatherOptions o(s->ctx);
      set_input(o, hin.raw(), static_cast<size_t>(hin.numel()), elem);
      set_output(o, hout.raw(), static_cast<size_t>(hout.numel()), elem);
      o.setTag(tag);
      o.setTimeout(to);
      gloo::allgather(o);
    } else {
      std::memcpy(hout.raw(), hin.raw(), hin.nbytes());
    }
    State::store_back(out, hout);
  };
  state_->enqueue(std::move(task));
  return work;
}

std::shared_ptr<Work> GlooProcessGroup::do_reduce_scatter(Tensor& out, const Tensor& in,
                                                          ReduceOp op) {
  check_reducible("reduce_scatter", in, op);
  DP_CHECK(out.defined() && out.dtype() == in.dtype(),
           "reduce_scatter: out must be a " << in.dtype() << " tensor");
  DP_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: in has "
                                                   << in.numel() << " elements, needs " << size()
                                                   << " x " << out.numel());
  auto work = std::make_shared<SignalledWork>();
  State* s = state_.get();
  Millis to = timeout();
  std::string what =
      std::string("reduce_scatter(") + reduce_op_name(op) + ") of " + describe_tensor(in);
  Task task{TaskKind::collective,
            what,
            to,
            ready_marker("reduce_scatter", {&out, &in}),
            nullptr,
            [work](std::exception_ptr e) { work->finish(e); }};
  // This Gloo has no reduce-scatter in its options API: all-reduce a scratch copy of `in` and
  // keep this rank's slice (twice the optimal traffic; correct for every size).
  task.run = [s, out, in, op, to](uint32_t tag) mutable {
    if (out.numel() == 0) return;
    Tensor scratch = Tensor::empty({in.numel()}, in.dtype(), kernels::Device::cpu());
    if (in.device().is_cpu())
      std::memcpy(scratch.raw(), in.raw(), in.nbytes());
    else
      kernels::copy(scratch, in);
    if (s->size > 1) {
      gloo::AllreduceOptions o(s->ctx);
      set_output(o, scratch.raw(), static_cast<size_t>(scratch.numel()),
                 kernels::dtype_size(in.dtype()));
      o.setReduceFunction(host::reduce_fn(in.dtype(), op));
      o.setTag(tag);
      o.setTimeout(to);
      gloo::allreduce(o);
    }
    Tensor mine = scratch.view(s->rank * out.numel(), {out.numel()});
    if (op == ReduceOp::avg && s->size > 1)
      host::scale_host(mine.raw(), mine.dtype(), mine.numel(), 1.f / s->size);
    if (out.device().is_cpu()) {
      std::memcpy(out.raw(), mine.raw(), out.nbytes());
    } else {
      kernels::copy(out, mine);
      kernels::context(out.device()).synchronize();
    }
  };
  state_->enqueue(std::move(task));
  return work;
}

std::shared_ptr<Work> GlooProcessGroup::do_send(const Tensor& t, int dst, uint32_t tag) {
  return point_to_point(t, dst, tag, true);
}

std::shared_ptr<Work> GlooProcessGroup::do_recv(Tensor& t, int src, uint32_t tag) {
  return point_to_point(t, src, tag, false);
}

std::shared_ptr<Work> GlooProcessGroup::point_to_point(const Tensor& t, int peer, uint32_t tag,
                                                       bool is_send) {
  const char* op = is_send ? "send" : "recv";
  DP_CHECK(t.defined(), op << ": undefined tensor");
  DP_CHECK(peer >= 0 && peer < size() && peer != rank(),
           op << ": " << (is_send ? "destination " : "source ") << peer
              << " must be another rank in [0, " << size() << ")");
  Millis to = timeout();
  std::string what = std::string(op) + (is_send ? "(to rank " : "(from rank ") +
                     std::to_string(peer) + ", tag " + std::to_string(tag) + ") of " +
                     describe_tensor(t);
  auto work = std::make_shared<GlooP2PWork>(state_, what, to, is_send, t);
  State* s = state_.get();
  Task task{TaskKind::point_to_point,
            what,
            to,
            ready_marker(op, {&t}),
            nullptr,
            [work](std::exception_ptr e) {
              if (e) work->failed(e);
            }};
  task.run = [s, t, peer, tag, is_send, work](uint32_t) {
    if (t.nbytes() == 0) {
      work->posted(nullptr, Tensor(), Tensor(), nullptr);
      return;
    }
    // A send stays in flight after the worker moves on, and a receive lands after it: a CUDA
    // tensor travels through a pooled pinned buffer of its own until its work completes.
    Tensor h = t, staging;
    if (t.device().is_cuda()) {
      staging = s->p2p_staging.take(t.numel(), t.dtype());
      h = staging.view(0, {t.numel()});
      if (is_send) kernels::copy(h, t);  // D2H on this thread's stream, waited for
    }
    auto buf = s->ctx->createUnboundBuffer(h.raw(), h.nbytes());
    if (is_send)
      buf->send(peer, kP2PSlotBase + tag);
    else
      buf->recv(peer, kP2PSlotBase + tag);
    work->posted(std::move(buf), h, std::move(staging), s->ctx);
  };
  state_->enqueue(std::move(task));
  return work;
}

std::shared_ptr<Work> GlooProcessGroup::do_barrier() {
  auto work = std::make_shared<SignalledWork>();
  State* s = state_.get();
  Millis to = timeout();
  Task task{TaskKind::collective, "barrier", to, nullptr, nullptr, [work](std::exception_ptr e) {
              work->finish(e);
            }};
  task.run = [s, to](uint32_t tag) {
    if (s->size == 1) return;
    gloo::BarrierOptions o(s->ctx);
    o.setTag(tag);
    o.setTimeout(to);
    gloo::barrier(o);
  };
  state_->enqueue(std::move(task));
  return work;
}

}  // namespace dp::dist
