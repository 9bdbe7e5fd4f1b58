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
// watcher stops watching. Each request on `connection` is bounded by request_bound(interval): a
// rank that outlives the store (rank 0 finished first) leaves within two such bounds (the beat
// in flight, then "done") instead of the store's connect timeout. `keep_alive` (the rank's main
// store, which may host the server) is released only after that last write. Never throws from its
// thread: a failed beat is retried.
//
// Rank 0 hosts the store, and a node's watch judges a store that stops answering before rank 0
// said "done" as node 0 lost (another node) or rank 0 hung (its own). So rank 0, once its
// rendezvous is complete, is told the job's nodes (confirm_end_to), and at its end, after its
// "done", waits until the watch of each has seen it (heartbeat_end_key), at most
// confirm_bound(interval): a healthy job whose rank 0 ends first, or drops its group and works
// on, is taken neither for a partition nor for a hang. Its own store's slow replies are asked
// again until then.
class Heartbeat {
 public:
  Heartbeat(std::shared_ptr<Store> connection, std::shared_ptr<Store> keep_alive, int rank,
            std::chrono::milliseconds interval);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // requires this rank hosts the store (rank 0) and its rendezvous is complete (before, a failed
  // start would wait for watches that never came). The nodes whose watch must see its end.
  void confirm_end_to(std::vector<int> nodes);

  // The bound of each request on the beat's connection: two intervals, at least 1 s.
  static std::chrono::milliseconds request_bound(std::chrono::milliseconds interval);
  // How long rank 0 waits for the other nodes' watches to see its "done": five intervals (a
  // watch polls every interval), at most 5 s, plus 2 s.
  static std::chrono::milliseconds confirm_bound(std::chrono::milliseconds interval);

 private:
  void end_confirmed();  // "done", then the wait for confirm_nodes_' watches

  std::shared_ptr<Store> connection_, keep_alive_;
  int rank_;
  std::chrono::milliseconds interval_;
  std::vector<int> confirm_nodes_;
  int64_t beats_ = 0;
  std::unique_ptr<Periodic> thread_;
};

// The key the launcher of node `node_rank` sets once its watch has seen every rank of the job
// beat (HeartbeatWatch's ready_key). A launched worker (DP_HEARTBEAT_WATCH=<node_rank>) waits for
// it before its rendezvous ends, so that no rank trains before each node's launcher can judge
// every rank's silence and the store's: a network partition in a job's first second is named
// as one later is, not left to the collective timeout.
std::string heartbeat_watch_key(int node_rank);

// The key the launcher of node `node_rank` sets once its watch has seen rank 0's "done", or
// when it stops watching (HeartbeatWatch's end_key): from then on that node does not need the
// store, and rank 0 may let it go (Heartbeat::confirm_end_to).
std::string heartbeat_end_key(int node_rank);

// A rank that fell silent, and for how long (as of the watcher's latest look at the store).
struct SilentRank {
  int rank = -1;
  std::chrono::milliseconds silent_for{0};
  bool store_down = false;  // the store (hosted by rank 0) stopped answering
};

// Polls the heartbeat keys of `ranks` on the TCP store at host:port every `interval`, from a
// thread of its own. Until it has seen each of them beat, it also asks every kFirstLookTick
// (one request) whether they all have; it then polls at once and sets `ready_key` (when not
// empty) on the store. Once it has seen rank 0's "done", or when destroyed after its first
// complete poll, it sets `end_key` (when not empty). A rank is judged only after its first beat
// and until it wrote "done"; the store, only after it answered once.
class HeartbeatWatch {
 public:
  static constexpr std::chrono::milliseconds kFirstLookTick{50};
  // How soon the watch sees rank 0's "done" (and sets end_key): at its next poll; or, where
  // rank 0 runs on this node (its store on this host), within a kFirstLookTick, for one request
  // a tick while the store answers, so that rank 0's end waits a tick rather than a poll.
  enum class EndLook { each_poll, each_tick };
  HeartbeatWatch(std::string host, int port, std::string job_token, std::vector<int> ranks,
                 std::chrono::milliseconds interval, std::string ready_key = "",
                 std::string end_key = "", EndLook end_look = EndLook::each_poll);
  ~HeartbeatWatch();  // stops the thread; sets end_key (one request) when not set yet
  HeartbeatWatch(const HeartbeatWatch&) = delete;
  HeartbeatWatch& operator=(const HeartbeatWatch&) = delete;

  // The rank silent the longest, when longer than `timeout`. When the store itself stopped
  // answering for longer than `timeout`, rank 0 (which hosts it) if watched and not done.
  std::optional<SilentRank> silent(std::chrono::milliseconds timeout) const;
  // How long `rank`'s key has kept one value, as of the watcher's latest look (0 before its
  // first beat).
  std::chrono::milliseconds silent_for(int rank) const;

 private:
  struct Seen {
    std::string value;
    HeartbeatClock::time_point changed;
    bool done = false;
  };
  void connect();          // store_, made when there is none
  bool every_rank_beat();  // whether each watched rank's key is on the store (one request)
  void poll();             // every key's value, and ready_key once each rank beat
  bool rank0_said_done();  // whether rank 0's key reads "done" (one request)

  std::string host_;
  int port_;
  std::string token_;
  std::vector<int> ranks_;
  std::chrono::milliseconds interval_;
  std::string ready_key_, end_key_;
  EndLook end_look_;
  // Used by the thread (and the destructor, after it): the connection, whether ready_key and
  // end_key are set, the next poll's time.
  std::unique_ptr<TcpStore> store_;
  bool announced_ = false, ended_ = false;
  HeartbeatClock::time_point next_poll_;
  mutable std::mutex mu_;
  std::map<int, Seen> seen_;                      // ranks that beat at least once
  std::optional<HeartbeatClock::time_point> ok_;  // last complete poll
  std::unique_ptr<Periodic> thread_;              // last: stopped before the rest goes
};

}  // namespace dp::dist
