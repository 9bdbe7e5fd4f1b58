// Init methods: where and how the ranks of a job meet.
//   env://                     MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (LOCAL_RANK), or the
//                              mpirun / Slurm variables (see launcher.hpp)
//   tcp://host:port            rank and world size passed in, or ?rank=R&world_size=N
//   file:///path/to/directory  a FileStore on a shared file system (a fresh directory per run)
// tcp and env stores are TcpStores whose server runs on rank 0 at host:port.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "dp/distributed/env.hpp"

namespace dp::dist {

class Store;

struct RendezvousSpec {
  enum class Kind { tcp, file };
  Kind kind = Kind::tcp;
  std::string host;  // tcp
  int port = 0;      // tcp
  std::string path;  // file: a directory
  int rank = -1;
  int world_size = -1;
  int local_rank = -1;           // -1 when unknown
  std::string job_token;         // tcp: presented at connect (job_token_from_env)
  std::string describe() const;  // "tcp://127.0.0.1:29500" or "file:///tmp/x"
};

// The job token this process presents to the store, so that ranks of two jobs that meet on one
// port never mix: DP_JOB_TOKEN (launch_workers sets a random one for its workers), else
// "id:" + the first of DP_JOB_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, PMIX_NAMESPACE (mpirun's
// job) that is set (external launchers), else empty.
//
// Without a job id (ranks started by hand with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
// torchrun's env:// allows) the ranks share no secret to tell their job from another's on the
// same port, so the job is kept whole by what they must share anyway:
//   - the port: a second job's rank 0 cannot bind it and fails at once;
//   - the rank ids: each is claimed once, atomically (init_process_group); a second claimant is
//     refused at once and publishes the collision, which stops every rank of the job still
//     rendezvousing or exchanging its configuration;
//   - the configuration: the ranks exchange it before any collective (config_check.hpp) and
//     any difference (batch, steps, model, world size, ...) fails them all, naming the field.
// So a rank of another job either is refused, or stops the job, or, where its configuration is
// the same in every field and it took a rank id no one else had claimed yet, trains exactly as
// the missing rank would have. A random token would refuse even that, but ranks started by hand
// cannot agree on one; give each job its own port, or DP_JOB_ID, to rule it out.
std::string job_token_from_env(const EnvLookup& env);
// A token no other job can guess: `prefix` and 128 random bits in hex (std::random_device), for
// a store that only the workers of one launch, or one engine's threads, may open.
std::string fresh_job_token(const std::string& prefix);

// Parses `init_method`; rank / world_size >= 0 override what the method or environment says.
// ensures 0 <= rank < world_size. Throws kernels::Error naming the missing or bad part
// (variable, host, port, path).
RendezvousSpec parse_init_method(const std::string& init_method, int rank = -1, int world_size = -1,
                                 const EnvLookup& env = {});

// The store a spec names: a TcpStore (the server on rank 0) or a FileStore. A tcp client that
// finds no server within `timeout` throws naming rank 0 as the rank that never came up.
std::shared_ptr<Store> make_store(const RendezvousSpec& spec, std::chrono::milliseconds timeout);

}  // namespace dp::dist
