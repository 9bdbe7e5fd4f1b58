// DDP ranks as threads of one process: each with its own device cpu:r, context and Gloo
// process group over a TCP store on loopback (test_ddp.cpp, test_gpt_engines.cpp).
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dp/distributed/launcher.hpp"
#include "dp/distributed/process_group.hpp"

namespace ddp_test {

// Runs fn(rank, group) on `world` threads; rethrows the first failure after all joined. Rank r's
// group lives on device_of(r) (cpu:r by default).
inline void run_ranks(int world, const std::function<void(int, dp::dist::ProcessGroup&)>& fn,
                      const std::function<kernels::Device(int)>& device_of = {}) {
  int port = dp::dist::find_free_port();
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        dp::dist::InitOptions io;
        io.backend = dp::dist::Backend::gloo;
        io.init_method = "tcp://127.0.0.1:" + std::to_string(port);
        io.rank = r;
        io.world_size = world;
        io.device = device_of ? device_of(r) : kernels::Device::cpu(r);
        io.timeout = std::chrono::seconds(60);
        auto pg = dp::dist::init_process_group(io);
        fn(r, *pg);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  std::string failures;
  for (int r = 0; r < world; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      failures += "rank " + std::to_string(r) + ": " + e.what() + "\n";
    }
  }
  if (!failures.empty()) throw kernels::Error(failures);
}

}  // namespace ddp_test
