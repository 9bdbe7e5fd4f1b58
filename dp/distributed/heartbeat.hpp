// Heartbeats through the rendezvous store: a worker proves it is alive (not stopped, not
// swapped out for good) by bumping "dp/heartbeat/<rank>" every interval on its own connection;
// the launcher watches the keys of its ranks and names a rank that falls silent.
//
//   worker:   started by init_process_group when DP_HEARTBEAT_MS is set (launch_workers sets it)
//   launcher: HeartbeatWatch watch(addr, port, token, local_ranks, interval);
//             if (auto s = watch.silent(timeout)) ... "rank 1 sent no heartbeat for 5 s: hung"
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dp::dist {

class Store;
class TcpStore;

using HeartbeatClock = std::chrono::steady_clock;

// The key a rank beats on.
std::string heartbeat_key(int rank);

// Runs fn() on a thread of its own at once and then every `interval` until destroyed; the
// destructor waits for the call in progress. fn must not throw.
class Periodic {
 public:
  Periodic(std::chrono::milliseconds interval, std::function<void()> fn);
  ~Periodic();
  Periodic(const Periodic&) = delete;
  Periodic& operator=(const Periodic&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// Beats on `connection` (a store client of its own, so that a long wait of the rank's main
// store never delays a beat) every `interval` until destroyed, then writes "done" so that the
// watcher stops watching. `keep_alive` (the rank's main store, which may host the server) is
// released only after that last write. Never throws from its thread: a failed beat is retried.
class Heartbeat {
 public:
  Heartbeat(std::shared_ptr<Store> connection, std::shared_ptr<Store> keep_alive, int rank,
            std::chrono::milliseconds interval);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  std::shared_ptr<Store> connection_, keep_alive_;
  int rank_;
  int64_t beats_ = 0;
  std::unique_ptr<Periodic> thread_;
};

// A rank that fell silent, and for how long (as of the watcher's latest look at the store).
struct SilentRank {
  int rank = -1;
  std::chrono::milliseconds silent_for{0};
  bool store_down = false;  // the store (hosted by rank 0) stopped answering
};

// Polls the heartbeat keys of `ranks` on the TCP store at host:port every `interval`, from a
// thread of its own. A rank is judged only after its first beat and until it wrote "done".
class HeartbeatWatch {
 public:
  HeartbeatWatch(std::string host, int port, std::string job_token, std::vector<int> ranks,
                 std::chrono::milliseconds interval);
  ~HeartbeatWatch();  // stops the thread
  HeartbeatWatch(const HeartbeatWatch&) = delete;
  HeartbeatWatch& operator=(const HeartbeatWatch&) = delete;

  // The rank silent the longest, when longer than `timeout`. When the store itself stopped
  // answering for longer than `timeout`, rank 0 (which hosts it) if watched and not done.
  std::optional<SilentRank> silent(std::chrono::milliseconds timeout) const;

 private:
  struct Seen {
    std::string value;
    HeartbeatClock::time_point changed;
    bool done = false;
  };
  void poll();

  std::string host_;
  int port_;
  std::string token_;
  std::vector<int> ranks_;
  std::chrono::milliseconds interval_;
  std::unique_ptr<TcpStore> store_;  // used by the thread only
  mutable std::mutex mu_;
  std::map<int, Seen> seen_;                      // ranks that beat at least once
  std::optional<HeartbeatClock::time_point> ok_;  // last complete poll
  std::unique_ptr<Periodic> thread_;              // last: stopped before the rest goes
};

}  // namespace dp::dist
