// worker_env_from_environment (launcher.hpp): the worker variables of torchrun, mpirun and
// Slurm. Apart from the launcher so that the rendezvous fuzz target links without it.
#include <optional>
#include <string>

#include "dp/distributed/launcher.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

namespace {

constexpr int kMaxRanks = 1 << 20;

struct VarNames {
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;
};

void check_consistent(const WorkerEnv& w, const VarNames& n) {
  DP_CHECK(w.rank < w.world_size,
           n.rank << "=" << w.rank << " is not in [0, " << n.world << "=" << w.world_size << ")");
  DP_CHECK(w.local_world_size <= w.world_size, n.local_world << "=" << w.local_world_size
                                                             << " exceeds " << n.world << "="
                                                             << w.world_size);
  DP_CHECK(w.local_rank < w.local_world_size, n.local_rank << "=" << w.local_rank
                                                           << " is not in [0, " << n.local_world
                                                           << "=" << w.local_world_size << ")");
}

// The rank and the world size, both required (either one set names the launcher).
void read_rank_world(WorkerEnv& w, const EnvLookup& env, const VarNames& n) {
  std::optional<int> rank = env_int(env, n.rank, 0, kMaxRanks);
  std::optional<int> world = env_int(env, n.world, 1, kMaxRanks);
  DP_CHECK(rank, n.world << " is set but " << n.rank << " is not");
  DP_CHECK(world, n.rank << " is set but " << n.world << " is not");
  w.rank = *rank;
  w.world_size = *world;
}

// MASTER_ADDR / MASTER_PORT: required where `required` (torchrun's contract); else defaults on
// one node, and on several an empty master_addr: unknown here. Only a store needs it (the
// env:// rendezvous then says what to pass); MPI's own backend meets the ranks without one.
void read_master(WorkerEnv& w, const EnvLookup& env, bool multi_node, bool required) {
  std::optional<std::string> addr = env("MASTER_ADDR");
  std::optional<int> port = env_int(env, "MASTER_PORT", 1, 65535);
  if (addr && !addr->empty())
    w.master_addr = *addr;
  else if (multi_node && !required)
    w.master_addr.clear();
  else
    DP_CHECK(!required, "MASTER_ADDR is not set (" << w.source << " job with " << w.world_size
                                                   << " ranks"
                                                   << (multi_node ? " on several nodes" : "")
                                                   << "): set it to rank 0's host");
  if (port)
    w.master_port = *port;
  else
    DP_CHECK(!required, "MASTER_PORT is not set ("
                            << w.source << " job with " << w.world_size
                            << " ranks): set it to a free port on rank 0's host");
}

// The worker variables of whichever launcher started this process, restart count aside.
std::optional<WorkerEnv> worker_env_of(const EnvLookup& env) {
  WorkerEnv w;
  if (env("RANK") || env("WORLD_SIZE")) {
    VarNames n{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
    w.source = "torchrun";
    read_rank_world(w, env, n);
    std::optional<int> local_rank = env_int(env, "LOCAL_RANK", 0, kMaxRanks);
    std::optional<int> local_world = env_int(env, "LOCAL_WORLD_SIZE", 1, kMaxRanks);
    // Without LOCAL_* the job is taken as one node.
    w.local_world_size = local_world ? *local_world : w.world_size;
    w.local_rank = local_rank ? *local_rank : w.rank % w.local_world_size;
    std::optional<int> group = env_int(env, "GROUP_RANK", 0, kMaxRanks);
    if (!group) group = env_int(env, "NODE_RANK", 0, kMaxRanks);
    w.node_rank = group ? *group : w.rank / w.local_world_size;
    check_consistent(w, n);
    const bool multi_node = w.local_world_size < w.world_size;
    read_master(w, env, multi_node, w.world_size > 1);
    return w;
  }
  if (env("OMPI_COMM_WORLD_RANK")) {
    VarNames n{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"};
    w.source = "mpirun";
    read_rank_world(w, env, n);
    std::optional<int> local_rank = env_int(env, n.local_rank, 0, kMaxRanks);
    std::optional<int> local_world = env_int(env, n.local_world, 1, kMaxRanks);
    w.local_rank = local_rank ? *local_rank : w.rank;
    w.local_world_size = local_world ? *local_world : w.world_size;
    w.node_rank = w.rank / w.local_world_size;  // mpirun's default by-slot placement
    check_consistent(w, n);
    read_master(w, env, w.local_world_size < w.world_size, false);
    return w;
  }
  if (env("SLURM_PROCID")) {
    VarNames n{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"};
    w.source = "slurm";
    read_rank_world(w, env, n);
    std::optional<int> local_rank = env_int(env, n.local_rank, 0, kMaxRanks);
    w.local_rank = local_rank ? *local_rank : 0;
    int nnodes = env_int(env, "SLURM_NNODES", 1, kMaxRanks).value_or(1);
    // SLURM_NTASKS_PER_NODE is a plain number only with --ntasks-per-node.
    std::optional<std::string> per_node = env("SLURM_NTASKS_PER_NODE");
    bool plain = per_node && !per_node->empty() &&
                 per_node->find_first_not_of("0123456789") == std::string::npos;
    w.local_world_size = plain ? parse_int(*per_node, 1, kMaxRanks, "SLURM_NTASKS_PER_NODE")
                               : (w.world_size + nnodes - 1) / nnodes;
    w.node_rank = env_int(env, "SLURM_NODEID", 0, kMaxRanks).value_or(0);
    DP_CHECK(w.node_rank < nnodes,
             "SLURM_NODEID=" << w.node_rank << " is not in [0, SLURM_NNODES=" << nnodes << ")");
    check_consistent(w, n);
    read_master(w, env, nnodes > 1, false);
    // Without MASTER_PORT, a port of this job's own (15000 + SLURM_JOB_ID % 20000, as Lightning
    // picks it): two Slurm jobs sharing a node then do not both claim 29500.
    std::optional<std::string> job = env("SLURM_JOB_ID");
    if (!env("MASTER_PORT") && job && !job->empty() && job->size() <= 18 &&
        job->find_first_not_of("0123456789") == std::string::npos)
      w.master_port = 15000 + static_cast<int>(std::stoll(*job) % 20000);
    return w;
  }
  return std::nullopt;
}

}  // namespace

std::optional<WorkerEnv> worker_env_from_environment(const EnvLookup& env_in) {
  EnvLookup env = env_or_process(env_in);
  std::optional<WorkerEnv> w = worker_env_of(env);
  if (!w) return w;
  std::optional<int> restarts = env_int(env, "DP_RESTART_COUNT", 0, kMaxRanks);
  if (!restarts) restarts = env_int(env, "TORCHELASTIC_RESTART_COUNT", 0, kMaxRanks);
  w->restart_count = restarts.value_or(0);
  return w;
}

}  // namespace dp::dist
