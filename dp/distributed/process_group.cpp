#include "dp/distributed/process_group.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <sstream>
#include <thread>

#include "dp/distributed/cuda_util.hpp"
#include "dp/distributed/gloo_process_group.hpp"
#include "dp/distributed/heartbeat.hpp"
#include "dp/distributed/mpi_process_group.hpp"
#include "dp/distributed/nccl_process_group.hpp"
#include "dp/distributed/rendezvous.hpp"
#include "dp/distributed/socket.hpp"
#include "dp/distributed/store.hpp"
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

ProcessGroup::ProcessGroup(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_ms_(timeout.count()) {
  DP_CHECK(size >= 1 && rank >= 0 && rank < size,
           "process group: rank " << rank << " is not in [0, size " << size << ")");
  DP_CHECK(timeout.count() > 0,
           "process group: timeout must be positive, got " << timeout.count() << " ms");
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

namespace {

// The backend every rank agrees on: each publishes its physical device and reads the others'.
Backend choose_backend(Backend requested, Store& store, int rank, int size,
                       const kernels::Device& device) {
  store.set_string("device/" + std::to_string(rank), physical_device_id(device));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back("device/" + std::to_string(r));
  store.wait(keys);
  std::vector<std::string> ids;
  for (const auto& k : keys) ids.push_back(store.get_string(k));
  int cpu_rank = -1, shared_a = -1, shared_b = -1;
  for (int r = 0; r < size; ++r) {
    if (ids[r].rfind("cuda:", 0) != 0 && cpu_rank < 0) cpu_rank = r;
    for (int q = 0; q < r && shared_a < 0; ++q)
      if (ids[q] == ids[r] && ids[r].rfind("cuda:", 0) == 0) {
        shared_a = q;
        shared_b = r;
      }
  }
  if (requested == Backend::nccl) {
    DP_CHECK(nccl_available(),
             "backend nccl requested, but this build has no NCCL (CPU-only "
             "build); use backend gloo or auto");
    DP_CHECK(cpu_rank < 0, "backend nccl requested, but rank " << cpu_rank << " has its tensors on "
                                                               << "the CPU; NCCL needs a CUDA "
                                                               << "device on every rank");
    DP_CHECK(shared_a < 0, "backend nccl requested, but ranks "
                               << shared_a << " and " << shared_b << " share one GPU ("
                               << ids[shared_a]
                               << "); NCCL needs a distinct GPU per rank: use backend gloo or "
                               << "auto, which stage CUDA tensors through host memory");
    return Backend::nccl;
  }
  if (nccl_available() && cpu_rank < 0 && shared_a < 0) return Backend::nccl;
  if (cpu_rank < 0 && shared_a >= 0 && rank == 0)
    std::fprintf(stderr,
                 "dp: warning: ranks %d and %d share one GPU; using gloo with CUDA tensors staged "
                 "through pinned host memory (NCCL needs one GPU per rank)\n",
                 shared_a, shared_b);
  return Backend::gloo;
}

std::unique_ptr<ProcessGroup> make_gloo_group(const InitOptions& o,
                                              std::chrono::milliseconds timeout,
                                              const EnvLookup& env,
                                              const std::shared_ptr<Store>& group, int rank,
                                              int size, const std::string& master_host);

// "rank 2" or "ranks 2, 5, 7 (and 3 more)": the ranks of `size` without an arrived/<r> key.
std::string missing_ranks(Store& group, int size) {
  std::vector<int> missing;
  for (int r = 0; r < size && r < 4096; ++r)
    if (!group.check({"arrived/" + std::to_string(r)})) missing.push_back(r);
  std::ostringstream os;
  os << (missing.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < missing.size() && i < 8; ++i) os << (i ? ", " : "") << missing[i];
  if (missing.size() > 8) os << " (and " << missing.size() - 8 << " more)";
  return os.str();
}

// Every rank marks its arrival, then waits until all `size` have arrived. Rank 0 prints a
// progress line every 10 s (or timeout / 3); after `timeout` every waiting rank throws naming the
// missing ranks. Rank 0 hosts a tcp store, so it gives up a little later than the others: they can
// still read which ranks are missing when their own time runs out.
void wait_for_all_ranks(Store& group, int rank, int size, std::chrono::milliseconds timeout,
                        const std::string& where) {
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  group.set_string("arrived/" + std::to_string(rank), "1");
  group.add("arrived", 1);
  const auto start = Clock::now();
  // A progress line every 10 s (a third of the timeout when that is shorter).
  const auto progress_every = std::min<milliseconds>(std::chrono::seconds(10), timeout / 3);
  auto next_progress = start + progress_every;
  const auto poll = std::clamp<milliseconds>(timeout / 50, milliseconds(10), milliseconds(200));
  const auto linger = rank == 0
                          ? std::min<milliseconds>(timeout / 4 + 2 * poll, std::chrono::seconds(2))
                          : milliseconds(0);
  for (int64_t arrived; (arrived = group.add("arrived", 0)) < size;) {
    auto now = Clock::now();
    if (now - start >= timeout + linger) {
      std::string who;
      try {
        who = missing_ranks(group, size);
      } catch (const kernels::Error&) {  // the store's host (rank 0) gave up first
        who = std::to_string(size - arrived) + " rank(s)";
      }
      DP_THROW(who << " of " << size << " never joined within " << seconds_text(timeout) << " ("
                   << arrived << " of " << size << " arrived at " << where << "; set the "
                   << "timeout with --timeout or DP_TIMEOUT=seconds)");
    }
    if (rank == 0 && now >= next_progress) {
      auto waited = std::chrono::duration_cast<milliseconds>(now - start);
      std::fprintf(
          stderr, "dp: rendezvous at %s: %lld of %d ranks joined; waiting for %s (%s of %s)\n",
          where.c_str(), static_cast<long long>(arrived), size, missing_ranks(group, size).c_str(),
          seconds_text(waited).c_str(), seconds_text(timeout).c_str());
      next_progress += progress_every;
    }
    std::this_thread::sleep_for(poll);
  }
}

std::string this_host_name() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') return "127.0.0.1";
  return host;
}

}  // namespace

Timeouts resolve_timeouts(const InitOptions& o) {
  if (o.timeout.count() > 0) return {o.timeout, o.timeout};
  if (auto t = env_seconds(env_or_process(o.env), "DP_TIMEOUT")) return {*t, *t};
  return {kDefaultRendezvousTimeout, kDefaultOpTimeout};
}

std::unique_ptr<ProcessGroup> init_process_group(const InitOptions& o) {
  EnvLookup env = env_or_process(o.env);
  DP_CHECK(o.timeout.count() >= 0, "init_process_group: timeout " << o.timeout.count()
                                                                  << " ms is negative (0: "
                                                                  << "DP_TIMEOUT or the defaults)");
  DP_CHECK(!o.group_name.empty(), "init_process_group: group_name is empty");
  const Timeouts timeouts = resolve_timeouts(o);
  if (o.backend == Backend::mpi) {
    // mpirun started the ranks and MPI_Init meets them: no store, no rendezvous.
    std::unique_ptr<ProcessGroup> pg = make_mpi_process_group(o.device, timeouts.ops);
    DP_CHECK(
        (o.rank < 0 || o.rank == pg->rank()) && (o.world_size < 0 || o.world_size == pg->size()),
        "backend mpi: MPI says rank " << pg->rank() << " of " << pg->size()
                                      << ", but the caller asked for rank " << o.rank << " of "
                                      << o.world_size);
    return pg;
  }
  std::shared_ptr<Store> store = o.store;
  int rank = o.rank, size = o.world_size;
  std::string master_host;
  std::shared_ptr<Heartbeat> heartbeat;
  if (store) {
    DP_CHECK(size >= 1 && rank >= 0 && rank < size,
             "init_process_group with a store needs rank in [0, world_size): got rank "
                 << rank << ", world_size " << size);
    if (auto* tcp = dynamic_cast<TcpStore*>(store.get())) master_host = tcp->host();
  } else {
    RendezvousSpec spec = parse_init_method(o.init_method, o.rank, o.world_size, env);
    rank = spec.rank;
    size = spec.world_size;
    if (spec.kind == RendezvousSpec::Kind::tcp) master_host = spec.host;
    store = make_store(spec, timeouts.rendezvous);
    std::optional<int> beat_ms = env_int(env, "DP_HEARTBEAT_MS", 1, 3600 * 1000);
    if (beat_ms && spec.kind == RendezvousSpec::Kind::tcp) {
      auto connection =
          std::make_shared<TcpStore>(spec.host, spec.port, StoreRole::client, timeouts.rendezvous,
                                     JobIdentity{spec.job_token, spec.rank});
      heartbeat =
          std::make_shared<Heartbeat>(connection, store, rank, std::chrono::milliseconds(*beat_ms));
    }
  }
  auto group = std::make_shared<PrefixStore>("dp/" + o.group_name, store);
  group->set_timeout(timeouts.rendezvous);
  wait_for_all_ranks(*group, rank, size, timeouts.rendezvous, store->describe());

  Backend backend = o.backend;
  if (backend != Backend::gloo) backend = choose_backend(backend, *group, rank, size, o.device);
  std::unique_ptr<ProcessGroup> pg;
  if (backend == Backend::nccl)
    pg = make_nccl_process_group(std::make_shared<PrefixStore>("nccl", group), rank, size, o.device,
                                 timeouts.ops);
  else
    pg = make_gloo_group(o, timeouts.ops, env, group, rank, size, master_host);
  // Every rank has finished its rendezvous reads before any returns: rank 0 hosts the store
  // and may exit as soon as it is done, which would strand a rank still reading addresses.
  group->set_string("joined/" + std::to_string(rank), "1");
  std::vector<std::string> joined;
  for (int r = 0; r < size; ++r) joined.push_back("joined/" + std::to_string(r));
  group->wait(joined);
  if (heartbeat) pg->attach_heartbeat(std::move(heartbeat));
  return pg;
}

namespace {

std::unique_ptr<ProcessGroup> make_gloo_group(const InitOptions& o,
                                              std::chrono::milliseconds timeout,
                                              const EnvLookup& env,
                                              const std::shared_ptr<Store>& group, int rank,
                                              int size, const std::string& master_host) {
  GlooOptions g;
  g.timeout = timeout;
  std::optional<std::string> ifname = env("GLOO_SOCKET_IFNAME");
  if (!o.gloo_interface.empty())
    g.interface = o.gloo_interface;
  else if (!o.gloo_hostname.empty())
    g.hostname = o.gloo_hostname;
  else if (ifname && !ifname->empty())
    g.interface = *ifname;
  else if (!master_host.empty() && net::is_loopback_host(master_host))
    g.hostname = "127.0.0.1";
  else
    g.hostname = this_host_name();
  auto gloo_store = std::make_shared<PrefixStore>("gloo", group);
  gloo_store->set_timeout(timeout);
  return std::make_unique<GlooProcessGroup>(gloo_store, rank, size, g);
}

}  // namespace

}  // namespace dp::dist
