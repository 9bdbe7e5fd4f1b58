#include "dp/distributed/process_group.hpp"

#include <algorithm>
#include <functional>
#include <sstream>
#include <thread>

#include "dp/distributed/store.hpp"
#include "kernels/runtime/context.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
  }
  return "?";
}

void wait_all(const std::vector<std::shared_ptr<Work>>& works) {
  std::exception_ptr first;
  for (const auto& w : works) {
    if (!w) continue;
    try {
      w->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

namespace {
// Several works as one: done when all are.
class WorkList final : public Work {
 public:
  explicit WorkList(std::vector<std::shared_ptr<Work>> works) : works_(std::move(works)) {}
  void wait() override { wait_all(works_); }
  bool is_completed() const override {
    for (const auto& w : works_)
      if (!w->is_completed()) return false;
    return true;
  }

 private:
  std::vector<std::shared_ptr<Work>> works_;
};
}  // namespace

std::shared_ptr<Work> ProcessGroup::do_send_recv(const kernels::Tensor& to_send, int dst,
                                                 kernels::Tensor& to_recv, int src, uint32_t tag) {
  std::vector<std::shared_ptr<Work>> works;
  works.push_back(do_send(to_send, dst, tag));
  works.push_back(do_recv(to_recv, src, tag));
  return std::make_shared<WorkList>(std::move(works));
}

void ProcessGroup::do_all_reduce_queued(kernels::Tensor& t, ReduceOp op) {
  run_or_record(t.device(), "all_reduce of " + describe_tensor(t), [this, t, op]() mutable {
    std::shared_ptr<Work> work = do_all_reduce(t, op);
    std::lock_guard<std::mutex> lock(queued_mu_);
    queued_.push_back(std::move(work));
  });
}

void ProcessGroup::join_queued(const kernels::Device& device) {
  run_or_record(device, "join_queued", [this] {
    std::vector<std::shared_ptr<Work>> works;
    {
      std::lock_guard<std::mutex> lock(queued_mu_);
      works.swap(queued_);
    }
    wait_all(works);
  });
}

void ProcessGroup::run_or_record(const kernels::Device& device, const std::string& what,
                                 std::function<void()> op) {
  kernels::DeviceContext& ctx = kernels::context(device);
  if (!ctx.capturing()) return op();
  DP_CHECK(collectives_capturable(device),
           backend_name() << " " << what << " on " << device
                          << ": a captured graph cannot hold this backend's collectives there");
  ctx.record(std::move(op));
}

ProcessGroup::ProcessGroup(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_ms_(timeout.count()) {
  DP_CHECK(size >= 1 && rank >= 0 && rank < size,
           "process group: rank " << rank << " is not in [0, size " << size << ")");
  DP_CHECK(timeout.count() > 0,
           "process group: timeout must be positive, got " << timeout.count() << " ms");
}

void ProcessGroup::set_rendezvous(std::shared_ptr<Store> store, std::chrono::milliseconds timeout) {
  DP_CHECK(timeout.count() > 0,
           "set_rendezvous: timeout must be positive, got " << timeout.count() << " ms");
  rendezvous_store_ = std::move(store);
  rendezvous_timeout_ = timeout;
}

std::vector<std::string> ProcessGroup::exchange_text(const std::string& name,
                                                     const std::string& mine,
                                                     std::chrono::milliseconds timeout) {
  DP_CHECK(rendezvous_store_, "exchange_text('" << name << "'): this " << backend_name()
                                                << " group has no rendezvous store (make it with "
                                                << "init_process_group)");
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  Store& store = *rendezvous_store_;
  const std::string prefix = "exchange/" + name + "/";
  store.set_string(prefix + std::to_string(rank()), mine);
  // One wait for every key (in requests of at most 1024), then one read each; a timeout names
  // the ranks whose key is missing.
  const auto start = Clock::now();
  const auto poll = std::clamp<milliseconds>(timeout / 50, milliseconds(5), milliseconds(100));
  std::vector<std::string> keys;
  for (int r = 0; r < size(); ++r) keys.push_back(prefix + std::to_string(r));
  try {
    for (size_t at = 0; at < keys.size(); at += 1024) {
      auto left = std::chrono::duration_cast<milliseconds>(timeout - (Clock::now() - start));
      store.wait(std::vector<std::string>(keys.begin() + at,
                                          keys.begin() + std::min(keys.size(), at + 1024)),
                 std::max(left, milliseconds(1)));
    }
  } catch (const kernels::Error& e) {
    std::ostringstream who;
    int missing = 0;
    for (int r = 0; r < size(); ++r)
      if (!store.check({keys[r]}) && missing++ < 8) who << (missing > 1 ? ", " : "") << r;
    if (missing == 0) throw;  // the store failed, not a rank
    DP_THROW("rank " << rank() << " of " << size() << ": " << (missing == 1 ? "rank " : "ranks ")
                     << who.str() << (missing > 8 ? " (and more)" : "") << " sent no " << name
                     << " within " << seconds_text(timeout) << " through " << store.describe()
                     << " (do all ranks run the same program? set the timeout with --timeout "
                     << "or DP_TIMEOUT=seconds)");
  }
  std::vector<std::string> out;
  for (const auto& key : keys) out.push_back(store.get_string(key));
  // Rank 0 hosts a tcp store: it stays until every rank has read, so that a rank about to fail
  // on what it read (a config mismatch, say) cannot take the store from under a slower one.
  store.add(prefix + "read", 1);
  if (rank() == 0)
    while (store.add(prefix + "read", 0) < size() && Clock::now() - start < timeout)
      std::this_thread::sleep_for(poll);
  return out;
}

std::chrono::milliseconds ProcessGroup::timeout() const {
  return std::chrono::milliseconds(timeout_ms_.load());
}

void ProcessGroup::set_timeout(std::chrono::milliseconds timeout) {
  DP_CHECK(timeout.count() > 0,
           "set_timeout: timeout must be positive, got " << timeout.count() << " ms");
  timeout_ms_.store(timeout.count());
}

std::string ProcessGroup::describe_tensor(const kernels::Tensor& t) {
  std::ostringstream os;
  os << t.numel() << " x " << t.dtype() << " on " << t.device();
  return os.str();
}

Backend parse_backend(const std::string& text) {
  if (text == "auto") return Backend::auto_select;
  if (text == "nccl") return Backend::nccl;
  if (text == "gloo") return Backend::gloo;
  if (text == "mpi") return Backend::mpi;
  DP_THROW("unknown backend '" << text << "': expected auto, nccl, gloo or mpi");
}

const char* backend_text(Backend b) {
  switch (b) {
    case Backend::auto_select:
      return "auto";
    case Backend::nccl:
      return "nccl";
    case Backend::gloo:
      return "gloo";
    case Backend::mpi:
      return "mpi";
  }
  return "?";
}

}  // namespace dp::dist
