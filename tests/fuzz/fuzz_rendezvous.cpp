// libFuzzer target: init method URLs and the launcher variables (rendezvous.hpp, env.hpp,
// launcher.hpp's worker_env_from_environment). Input: the URL on the first line, then
// NAME=VALUE lines as the environment. Parses succeed with a consistent result or throw
// kernels::Error.
#include <map>
#include <sstream>

#include "dp/distributed/launcher.hpp"
#include "dp/distributed/rendezvous.hpp"
#include "kernels/runtime/error.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace dp::dist;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::string url, line;
  std::getline(in, url);
  std::map<std::string, std::string> vars;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq != std::string::npos) vars[line.substr(0, eq)] = line.substr(eq + 1);
  }
  EnvLookup env = map_env(vars);
  try {
    RendezvousSpec s = parse_init_method(url, -1, -1, env);
    DP_FUZZ_ASSERT(s.world_size >= 1 && s.rank >= 0 && s.rank < s.world_size);
    if (s.kind == RendezvousSpec::Kind::tcp)
      // Port 0 (any free one) only for a job of one rank without MASTER_PORT.
      DP_FUZZ_ASSERT(!s.host.empty() && s.port >= (s.world_size == 1 ? 0 : 1) && s.port <= 65535);
    else
      DP_FUZZ_ASSERT(!s.path.empty() && s.path[0] == '/');
    DP_FUZZ_ASSERT(s.job_token.size() <= 256);
    (void)s.describe();
  } catch (const kernels::Error&) {
  }
  try {
    if (auto w = worker_env_from_environment(env)) {
      DP_FUZZ_ASSERT(w->rank >= 0 && w->rank < w->world_size);
      DP_FUZZ_ASSERT(w->local_rank >= 0 && w->local_rank < w->local_world_size);
      DP_FUZZ_ASSERT(w->local_world_size <= w->world_size);
      DP_FUZZ_ASSERT(w->master_port >= 1 && w->master_port <= 65535);
    }
  } catch (const kernels::Error&) {
  }
  try {
    if (auto t = env_seconds(env, "DP_TIMEOUT"))
      DP_FUZZ_ASSERT(t->count() >= 1 && *t <= kMaxTimeout);
  } catch (const kernels::Error&) {
  }
  (void)job_token_from_env(env);
  return 0;
}
