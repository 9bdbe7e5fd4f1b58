#include "dp/distributed/rendezvous.hpp"

#include <cstdio>
#include <map>
#include <random>
#include <sstream>

#include "dp/distributed/launcher.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

namespace {

// Splits "a=1&b=2" into a map; throws on a part without '='.
std::map<std::string, std::string> parse_query(const std::string& query, const std::string& url) {
  std::map<std::string, std::string> out;
  std::istringstream parts(query);
  std::string part;
  while (std::getline(parts, part, '&')) {
    if (part.empty()) continue;
    auto eq = part.find('=');
    DP_CHECK(eq != std::string::npos && eq > 0,
             "init method '" << url << "': query part '" << part << "' is not name=value");
    out[part.substr(0, eq)] = part.substr(eq + 1);
  }
  return out;
}

void take_rank_and_size(RendezvousSpec& spec, const std::map<std::string, std::string>& query,
                        int rank, int world_size, const std::string& url) {
  auto it = query.find("world_size");
  if (world_size >= 0)
    spec.world_size = world_size;
  else if (it != query.end())
    spec.world_size = parse_int(it->second, 1, 1 << 20, "world_size");
  it = query.find("rank");
  if (rank >= 0)
    spec.rank = rank;
  else if (it != query.end())
    spec.rank = parse_int(it->second, 0, 1 << 20, "rank");
  DP_CHECK(spec.world_size >= 1, "init method '" << url << "' needs the world size: pass "
                                                 << "world_size or add ?world_size=N");
  DP_CHECK(spec.rank >= 0, "init method '" << url << "' needs this process's rank: pass rank or "
                                           << "add ?rank=R");
}

}  // namespace

std::string RendezvousSpec::describe() const {
  if (kind == Kind::file) return "file://" + path;
  bool v6 = host.find(':') != std::string::npos;
  return "tcp://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::string job_token_from_env(const EnvLookup& env_in) {
  EnvLookup env = env_or_process(env_in);
  if (auto t = env("DP_JOB_TOKEN"); t && !t->empty()) return *t;
  for (const char* name : {"DP_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PMIX_NAMESPACE"})
    if (auto id = env(name); id && !id->empty()) return "id:" + *id;
  return {};
}

std::string fresh_job_token(const std::string& prefix) {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return prefix + buf;
}

RendezvousSpec parse_init_method(const std::string& init_method, int rank, int world_size,
                                 const EnvLookup& env_in) {
  EnvLookup env = env_or_process(env_in);
  RendezvousSpec spec;
  const std::string& url = init_method;
  auto scheme_end = url.find("://");
  DP_CHECK(scheme_end != std::string::npos,
           "init method '" << url << "' is not env://, tcp://host:port or file:///path");
  std::string scheme = url.substr(0, scheme_end);
  std::string rest = url.substr(scheme_end + 3);
  std::string query;
  auto q = rest.find('?');
  if (q != std::string::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  auto params = parse_query(query, url);

  if (scheme == "env") {
    DP_CHECK(rest.empty(), "init method '" << url << "': env:// takes nothing after '//'");
    std::optional<WorkerEnv> w = worker_env_from_environment(env);
    spec.kind = RendezvousSpec::Kind::tcp;
    std::optional<std::string> addr = env("MASTER_ADDR");
    std::optional<int> port = env_int(env, "MASTER_PORT", 1, 65535);
    const bool port_given = port.has_value();
    if (!addr && w) addr = w->master_addr;
    if (!port && w) port = w->master_port;
    DP_CHECK(addr && !addr->empty(),
             "env:// rendezvous: MASTER_ADDR is not set (the address of rank 0's host)"
                 << (w && w->source == "mpirun"
                         ? ": an mpirun job on several nodes passes it, e.g. mpirun -x "
                           "MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ...; --backend mpi "
                           "needs neither"
                     : w && w->source == "slurm"
                         ? ": a Slurm job on several nodes exports it, e.g. MASTER_ADDR=$(scontrol "
                           "show hostnames $SLURM_JOB_NODELIST | head -n 1)"
                         : ""));
    DP_CHECK(port, "env:// rendezvous: MASTER_PORT is not set (a free TCP port on rank 0's host)");
    spec.host = *addr;
    spec.port = *port;
    spec.world_size = world_size >= 0 ? world_size : (w ? w->world_size : -1);
    spec.rank = rank >= 0 ? rank : (w ? w->rank : -1);
    DP_CHECK(spec.rank >= 0,
             "env:// rendezvous: RANK is not set (nor OMPI_COMM_WORLD_RANK / SLURM_PROCID)");
    DP_CHECK(spec.world_size >= 1,
             "env:// rendezvous: WORLD_SIZE is not set (nor OMPI_COMM_WORLD_SIZE / SLURM_NTASKS)");
    // One rank has no peer to find its store: without MASTER_PORT it takes a free port, so two
    // one-rank jobs on a host do not both claim the default.
    if (spec.world_size == 1 && !port_given) spec.port = 0;
    if (w)
      spec.local_rank = w->local_rank;
    else if (auto lr = env_int(env, "LOCAL_RANK", 0, 1 << 20))
      spec.local_rank = *lr;
  } else if (scheme == "tcp") {
    spec.kind = RendezvousSpec::Kind::tcp;
    std::string port_text;
    if (!rest.empty() && rest[0] == '[') {
      auto close = rest.find(']');
      DP_CHECK(close != std::string::npos, "init method '" << url << "': unclosed '[' in the host");
      spec.host = rest.substr(1, close - 1);
      DP_CHECK(close + 1 < rest.size() && rest[close + 1] == ':',
               "init method '" << url << "' has no port (tcp://host:port)");
      port_text = rest.substr(close + 2);
    } else {
      auto colon = rest.rfind(':');
      DP_CHECK(colon != std::string::npos,
               "init method '" << url << "' has no port (tcp://host:port)");
      spec.host = rest.substr(0, colon);
      port_text = rest.substr(colon + 1);
    }
    while (!port_text.empty() && port_text.back() == '/') port_text.pop_back();
    DP_CHECK(!spec.host.empty(), "init method '" << url << "' has no host (tcp://host:port)");
    spec.port = parse_int(port_text, 1, 65535, "the port of init method '" + url + "'");
    take_rank_and_size(spec, params, rank, world_size, url);
  } else if (scheme == "file") {
    spec.kind = RendezvousSpec::Kind::file;
    DP_CHECK(!rest.empty() && rest[0] == '/',
             "init method '" << url << "': file:// needs an absolute path (file:///path/to/dir)");
    spec.path = rest;
    take_rank_and_size(spec, params, rank, world_size, url);
  } else {
    DP_THROW("unknown init method scheme '"
             << scheme << "' in '" << url << "': expected env://, tcp://host:port or file:///path");
  }
  DP_CHECK(spec.rank < spec.world_size,
           "rank " << spec.rank << " is not in [0, world size " << spec.world_size << ")");
  spec.job_token = job_token_from_env(env);
  DP_CHECK(spec.job_token.size() <= 256, "the job token (DP_JOB_TOKEN, DP_JOB_ID, ...) has "
                                             << spec.job_token.size()
                                             << " bytes; at most 256 are allowed");
  return spec;
}

}  // namespace dp::dist
