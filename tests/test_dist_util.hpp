// Helpers shared by the dist test suites: ranks as threads, temporary directories.
#pragma once

#include <stdlib.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dp/distributed/process_group.hpp"
#include "dp/distributed/store.hpp"
#include "tests/test_util.hpp"

namespace dist_test {

// Thrown by RANK_CHECK inside rank threads; the main thread reports it.
struct RankFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define RANK_CHECK(cond, msg)                                                  \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::ostringstream rank_check_os_;                                       \
      rank_check_os_ << __FILE__ << ":" << __LINE__ << ": " #cond ": " << msg; \
      throw dist_test::RankFailure(rank_check_os_.str());                      \
    }                                                                          \
  } while (0)

// Runs fn(rank, store) on n threads; each rank gets its own TcpStore client of one server on
// 127.0.0.1 (a free port). Failures of every rank are reported with the rank named.
inline void run_ranks(int n, const std::function<void(int, std::shared_ptr<dp::dist::Store>)>& fn,
                      std::chrono::milliseconds store_timeout = std::chrono::seconds(30)) {
  dp::dist::StoreServer server("127.0.0.1", 0);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = std::make_shared<dp::dist::TcpStore>(
            "127.0.0.1", server.port(), dp::dist::StoreRole::client, store_timeout);
        fn(r, store);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      FAIL_CHECK("rank " << r << " of " << n << ": " << std::string(e.what()));
    }
  }
}

// A Gloo group for `rank` over `store` (ranks as threads, loopback transport).
inline std::unique_ptr<dp::dist::ProcessGroup> gloo_group(
    int rank, int n, std::shared_ptr<dp::dist::Store> store,
    std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  dp::dist::InitOptions o;
  o.backend = dp::dist::Backend::gloo;
  o.rank = rank;
  o.world_size = n;
  o.store = std::move(store);
  o.timeout = timeout;
  o.gloo_hostname = "127.0.0.1";
  return dp::dist::init_process_group(o);
}

// A fresh directory under /tmp, removed when the test program exits.
inline std::string make_temp_dir(const char* tag) {
  std::string pattern = std::string("/tmp/dp_dist_") + tag + "_XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  char* dir = mkdtemp(buf.data());
  if (!dir) throw std::runtime_error("mkdtemp failed");
  dp_test::remove_at_exit(dir);
  return dir;
}

}  // namespace dist_test
