// init_process_group: the rendezvous (claim a rank, wait for all, seal), the backend choice and
// the making of the Gloo, NCCL or MPI group. Apart from process_group.cpp so that the
// ProcessGroup base knows none of its subclasses.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <thread>

#include "dp/distributed/cuda_util.hpp"
#include "dp/distributed/env.hpp"
#include "dp/distributed/gloo_process_group.hpp"
#include "dp/distributed/heartbeat.hpp"
#include "dp/distributed/mpi_process_group.hpp"
#include "dp/distributed/nccl_process_group.hpp"
#include "dp/distributed/process_group.hpp"
#include "dp/distributed/rendezvous.hpp"
#include "dp/distributed/socket.hpp"
#include "dp/distributed/store.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

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

std::unique_ptr<ProcessGroup> make_gloo_group(const InitOptions& o, const Timeouts& timeouts,
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

// Throws the collision a second claimant of a rank published (claim_rank), if any.
void throw_if_rank_claimed_twice(Store& group) {
  if (!group.check({"duplicate"})) return;
  DP_THROW(group.get_string("duplicate") << ": this job stops; give each job its own "
                                         << "MASTER_PORT / --master-port, or a job id "
                                         << "(DP_JOB_ID)");
}

// Each rank id is claimed once per job, atomically: the first process to add 1 to claim/<r>
// owns rank r. A second claimant (a rank of another job on the same port, or RANK given twice)
// is refused at once, and publishes the collision under "duplicate". Ranks poll it while they
// rendezvous, and rank 0 seals the rendezvous with one verdict every rank reads (seal_rendezvous):
// a collision before the seal stops the whole job, rather than let it train with a stranger; a
// claimant after it is refused alone, and the job, whole, goes on.
void claim_rank(Store& group, int rank, const std::string& where) {
  const int64_t claims = group.add("claim/" + std::to_string(rank), 1);
  if (claims == 1) return;
  std::ostringstream why;
  why << "rank " << rank << " was claimed by " << claims << " processes at " << where
      << " (two jobs on one port, or the same RANK given to two processes)";
  try {
    group.set_string("duplicate", why.str());
  } catch (const kernels::Error&) {  // the store is going away: this rank's error says it all
  }
  DP_THROW("rank " << rank << " is already taken: another process registered as rank " << rank
                   << " at " << where << " first (two jobs on one port, or the same RANK "
                   << "given to two processes?); give each job its own MASTER_PORT / "
                   << "--master-port, or a job id (DP_JOB_ID)");
}

// A reason to stop that every rank has just read: a rank other than 0 counts itself in
// `read_key`; rank 0 hosts the store, so it stays up until the ranks that arrived (at most
// `size` of them; -1: no bound) have read it, 2 s at most, so that they stop with the reason
// rather than with a closed connection.
void read_before_stopping(Store& group, int rank, const std::string& read_key, int size) {
  if (rank != 0) {
    try {
      group.add(read_key, 1);
    } catch (const kernels::Error&) {  // rank 0 stopped waiting: the reason is read anyway
    }
    return;
  }
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + std::chrono::seconds(2);
  auto arrived = [&] {
    const int64_t n = group.add("arrived", 0);
    return size < 0 ? n : std::min<int64_t>(n, size);
  };
  while (Clock::now() < until && group.add(read_key, 0) < arrived() - 1)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

// Rank 0 decides, once every rank arrived (or once it saw a collision), whether a rank id was
// claimed twice, and every rank reads that one verdict: they all stop, or all go on.
void seal_rendezvous(Store& group, int rank) {
  if (rank == 0) {
    std::string verdict = "ok";
    if (group.check({"duplicate"})) verdict = group.get_string("duplicate");
    group.set_string("verdict", verdict);
  }
  std::string verdict = group.get_string("verdict");  // bounded by the rendezvous timeout
  if (verdict != "ok") read_before_stopping(group, rank, "verdict_read", -1);
  DP_CHECK(verdict == "ok", verdict << ": this job stops; give each job its own MASTER_PORT / "
                                    << "--master-port, or a job id (DP_JOB_ID)");
}

[[noreturn]] void throw_world_sizes_differ(const std::string& why) {
  DP_THROW(why << ": every rank of a job is started with the same WORLD_SIZE (or "
                  "OMPI_COMM_WORLD_SIZE, SLURM_NTASKS, init_process_group's world_size)");
}

// Ranks started with another WORLD_SIZE: the rank that sees it (each compares with rank 0's)
// writes why, and every rank throws it, rank 0 once the ranks that arrived have read it (2 s
// at most: it hosts the store). Before, rank 0 waited for a rank its world has not, or the
// others for one that never comes, each naming a timeout.
void throw_if_world_sizes_differ(Store& group, int rank, int size) {
  if (!group.check({"world_size_differs"})) return;
  const std::string why = group.get_string("world_size_differs");
  read_before_stopping(group, rank, "world_size_read", size);
  throw_world_sizes_differ(why);
}

void check_world_size(Store& group, int rank, int size) {
  if (rank == 0) {
    group.set_string("world_size", std::to_string(size));
    return;
  }
  const std::string rank0 = group.get_string("world_size");  // bounded by the rendezvous timeout
  if (rank0 == std::to_string(size)) return;
  const std::string why = "world sizes differ: rank 0 has " + rank0 + ", rank " +
                          std::to_string(rank) + " has " + std::to_string(size);
  try {
    group.set_string("world_size_differs", why);
  } catch (const kernels::Error&) {  // the store is going away: this rank's error says it all
  }
  // Not read back: this rank has not arrived, so rank 0 (the store's host) may stop as soon as
  // the key is set, and a read would then fail with a closed connection instead of the reason.
  throw_world_sizes_differ(why);
}

// Every rank marks its arrival, then waits until all `size` have arrived. Rank 0 prints a
// progress line every 10 s (or timeout / 3); after `timeout` every waiting rank throws naming the
// missing ranks. Rank 0 hosts a tcp store, so it gives up a little later than the others: they can
// still read which ranks are missing when their own time runs out.
void wait_for_all_ranks(Store& group, int rank, int size, std::chrono::milliseconds timeout,
                        const std::string& where) {
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  check_world_size(group, rank, size);
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
    if (rank == 0 && group.check({"duplicate"})) seal_rendezvous(group, rank);  // throws
    throw_if_rank_claimed_twice(group);
    throw_if_world_sizes_differ(group, rank, size);
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

// Waits until the launcher of node `node` (launch_workers, which set DP_HEARTBEAT_WATCH) has
// seen every rank of the job beat: from then on it judges each one's silence and the store's.
void wait_for_watch(Store& store, int node, int rank, std::chrono::milliseconds timeout) {
  try {
    store.wait({heartbeat_watch_key(node)}, timeout);
  } catch (const kernels::Error& e) {
    DP_THROW("rank " << rank << ": the launcher of node " << node << " did not see every rank's "
                     << "heartbeat on " << store.describe() << " within " << seconds_text(timeout)
                     << ", though every rank joined (can that node's launcher reach MASTER_ADDR? "
                     << "set the timeout with --timeout or DP_TIMEOUT=seconds): " << e.what());
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
    pg->set_rendezvous(nullptr, timeouts.rendezvous);  // bounds exchange_text (MPI_Allgather)
    return pg;
  }
  std::shared_ptr<Store> store = o.store;
  int rank = o.rank, size = o.world_size;
  std::string master_host;
  std::shared_ptr<Heartbeat> heartbeat;
  std::optional<int> watching_node;  // the node whose launcher watches this rank's heartbeat
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
    if (beat_ms && spec.kind == RendezvousSpec::Kind::tcp && spec.port > 0) {
      auto connection =
          std::make_shared<TcpStore>(spec.host, spec.port, StoreRole::client, timeouts.rendezvous,
                                     JobIdentity{spec.job_token, spec.rank});
      heartbeat =
          std::make_shared<Heartbeat>(connection, store, rank, std::chrono::milliseconds(*beat_ms));
      watching_node = env_int(env, "DP_HEARTBEAT_WATCH", 0, size - 1);
    }
  }
  auto group = std::make_shared<PrefixStore>("dp/" + o.group_name, store);
  group->set_timeout(timeouts.rendezvous);
  claim_rank(*group, rank, store->describe());
  wait_for_all_ranks(*group, rank, size, timeouts.rendezvous, store->describe());
  seal_rendezvous(*group, rank);

  Backend backend = o.backend;
  if (backend != Backend::gloo) backend = choose_backend(backend, *group, rank, size, o.device);
  std::unique_ptr<ProcessGroup> pg;
  if (backend == Backend::nccl)
    pg = make_nccl_process_group(std::make_shared<PrefixStore>("nccl", group), rank, size, o.device,
                                 timeouts.ops);
  else
    pg = make_gloo_group(o, timeouts, env, group, rank, size, master_host);
  if (watching_node) wait_for_watch(*store, *watching_node, rank, timeouts.rendezvous);
  // Every rank has finished its rendezvous reads before any returns: rank 0 hosts the store
  // and may exit as soon as it is done, which would strand a rank still reading addresses.
  group->set_string("joined/" + std::to_string(rank), "1");
  std::vector<std::string> joined;
  for (int r = 0; r < size; ++r) joined.push_back("joined/" + std::to_string(r));
  group->wait(joined);
  if (heartbeat && rank == 0 && watching_node) {
    // Rank 0 hosts the store: before it goes, every node's launcher sees rank 0 end (its own
    // node's too: a rank 0 that drops its group and works on is not hung). Told only now: a
    // start that failed before here waits for no node.
    std::vector<int> nodes;
    if (std::optional<int> count = env_int(env, "DP_HEARTBEAT_NODES", 1, size))
      for (int n = 0; n < *count; ++n) nodes.push_back(n);
    heartbeat->confirm_end_to(std::move(nodes));
  }
  if (heartbeat) pg->attach_heartbeat(std::move(heartbeat));
  pg->set_rendezvous(group, timeouts.rendezvous);
  return pg;
}

namespace {

std::unique_ptr<ProcessGroup> make_gloo_group(const InitOptions& o, const Timeouts& timeouts,
                                              const EnvLookup& env,
                                              const std::shared_ptr<Store>& group, int rank,
                                              int size, const std::string& master_host) {
  const std::chrono::milliseconds timeout = timeouts.ops;
  GlooOptions g;
  g.timeout = timeout;
  g.connect_timeout = timeouts.rendezvous;
  std::optional<std::string> ifname = env("DP_SOCKET_IFNAME");
  if (!ifname || ifname->empty()) ifname = env("GLOO_SOCKET_IFNAME");
  std::string towards_master;  // this host's address on the route to the master
  if (!o.gloo_interface.empty())
    g.interface = o.gloo_interface;
  else if (!o.gloo_hostname.empty())
    g.hostname = o.gloo_hostname;
  else if (ifname && !ifname->empty())
    g.interface = *ifname;
  else if (!master_host.empty() && net::is_loopback_host(master_host))
    g.hostname = "127.0.0.1";
  else if (!master_host.empty() &&
           !(towards_master = net::local_address_towards(master_host)).empty())
    g.hostname = towards_master;
  else
    g.hostname = this_host_name();
  auto gloo_store = std::make_shared<PrefixStore>("gloo", group);
  gloo_store->set_timeout(timeout);
  return std::make_unique<GlooProcessGroup>(gloo_store, rank, size, g);
}

}  // namespace

void check_backend_devices(const std::string& backend, kernels::DeviceType type, int local_ranks) {
  if (backend != "nccl") return;
  DP_CHECK(nccl_available(),
           "--backend nccl: this build has no NCCL (CPU-only build); use "
           "--backend gloo or auto");
  const int gpus = kernels::cuda_device_count();
  DP_CHECK(type == kernels::DeviceType::cuda,
           "--backend nccl: NCCL needs a CUDA device on every rank, and these ranks' tensors are "
           "on the CPU"
               << (gpus == 0 ? " (" + kernels::cuda_unavailable_reason() + ")" : std::string())
               << "; use --backend gloo or auto");
  DP_CHECK(local_ranks <= gpus,
           "--backend nccl with " << local_ranks << " ranks on this node and " << gpus
                                  << " GPU(s): NCCL needs a distinct GPU per rank; use --backend "
                                     "gloo or auto, which stage CUDA tensors through host memory");
}

}  // namespace dp::dist
