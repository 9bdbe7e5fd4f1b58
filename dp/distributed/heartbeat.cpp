#include "dp/distributed/heartbeat.hpp"

#include <algorithm>
#include <cstdio>

#include "dp/distributed/store.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

std::string heartbeat_key(int rank) {
  return "dp/heartbeat/" + std::to_string(rank);
}

std::string heartbeat_watch_key(int node_rank) {
  return "dp/heartbeat_watch/" + std::to_string(node_rank);
}

std::string heartbeat_end_key(int node_rank) {
  return "dp/heartbeat_end/" + std::to_string(node_rank);
}

// ---- Periodic -------------------------------------------------------------------------------

Periodic::Periodic(std::chrono::milliseconds interval, std::function<void()> fn) {
  DP_CHECK(interval.count() > 0,
           "Periodic: the interval must be positive, got " << interval.count() << " ms");
  thread_ = std::thread([this, interval, fn = std::move(fn)] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      fn();
      lock.lock();
      cv_.wait_for(lock, interval, [this] { return stop_; });
    }
  });
}

Periodic::~Periodic() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

// ---- Heartbeat ------------------------------------------------------------------------------

Heartbeat::Heartbeat(std::shared_ptr<Store> connection, std::shared_ptr<Store> keep_alive, int rank,
                     std::chrono::milliseconds interval)
    : connection_(std::move(connection)),
      keep_alive_(std::move(keep_alive)),
      rank_(rank),
      interval_(interval) {
  DP_CHECK(connection_ != nullptr, "Heartbeat: needs a store");
  connection_->set_timeout(request_bound(interval_));
  thread_ = std::make_unique<Periodic>(interval, [this] {
    try {
      connection_->set_string(heartbeat_key(rank_), std::to_string(++beats_));
    } catch (const std::exception&) {
      // The store may be busy; the watcher judges the silence, not us.
    }
  });
}

void Heartbeat::confirm_end_to(std::vector<int> nodes) {
  confirm_nodes_ = std::move(nodes);
}

std::chrono::milliseconds Heartbeat::request_bound(std::chrono::milliseconds interval) {
  return std::max<std::chrono::milliseconds>(2 * interval, std::chrono::seconds(1));
}

std::chrono::milliseconds Heartbeat::confirm_bound(std::chrono::milliseconds interval) {
  return std::min<std::chrono::milliseconds>(5 * interval, std::chrono::seconds(5)) +
         std::chrono::seconds(2);
}

Heartbeat::~Heartbeat() {
  thread_.reset();
  if (!confirm_nodes_.empty()) {
    end_confirmed();
    return;
  }
  try {
    connection_->set_string(heartbeat_key(rank_), "done");
  } catch (const std::exception&) {
    // The store is gone already (rank 0 finished first): nobody is watching.
  }
}

void Heartbeat::end_confirmed() {
  std::vector<std::string> keys;
  for (int n : confirm_nodes_) keys.push_back(heartbeat_end_key(n));
  const auto bound = confirm_bound(interval_);
  const auto deadline = HeartbeatClock::now() + bound;
  const auto tick = std::clamp<std::chrono::milliseconds>(
      interval_ / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(100));
  // The store is this process's own: a request that fails is a slow reply (a loaded host), asked
  // again until the deadline, never taken for a store that went.
  bool said_done = false;
  while (true) {
    try {
      if (!said_done) {
        connection_->set_string(heartbeat_key(rank_), "done");
        said_done = true;
      }
      if (connection_->check(keys)) return;
    } catch (const std::exception&) {
    }
    if (HeartbeatClock::now() >= deadline) break;
    std::this_thread::sleep_for(tick);
  }
  std::vector<int> missing;
  for (int n : confirm_nodes_) {
    bool confirmed = false;
    try {
      confirmed = said_done && connection_->check({heartbeat_end_key(n)});
    } catch (const std::exception&) {
    }
    if (!confirmed) missing.push_back(n);
  }
  if (missing.empty()) return;
  std::string nodes;
  for (int n : missing) nodes += (nodes.empty() ? "" : ", ") + std::to_string(n);
  const bool one = missing.size() == 1;
  std::fprintf(stderr,
               "dp: rank %d: %s %s did not confirm within %.1f s that %s this rank end%s; the "
               "store this rank hosts goes now, and %s may take it for a lost node 0 (or, on "
               "node 0, a hung rank 0)\n",
               rank_, one ? "the launcher of node" : "the launchers of nodes", nodes.c_str(),
               bound.count() / 1000.0, one ? "it saw" : "they saw",
               said_done ? "" : " (its own store did not take its \"done\")",
               one ? "that node" : "those nodes");
  std::fflush(stderr);
}

// ---- HeartbeatWatch -------------------------------------------------------------------------

HeartbeatWatch::HeartbeatWatch(std::string host, int port, std::string job_token,
                               std::vector<int> ranks, std::chrono::milliseconds interval,
                               std::string ready_key, std::string end_key, EndLook end_look)
    : host_(std::move(host)),
      port_(port),
      token_(std::move(job_token)),
      ranks_(std::move(ranks)),
      interval_(interval),
      ready_key_(std::move(ready_key)),
      end_key_(std::move(end_key)),
      end_look_(end_look) {
  // A poll every interval. Until every rank was seen, each tick in between asks the store
  // once whether every rank's key is there, and polls at once when they are.
  thread_ = std::make_unique<Periodic>(std::min(interval_, kFirstLookTick), [this] {
    const auto now = HeartbeatClock::now();
    if (announced_ && now < next_poll_) {
      // Between polls, rank 0's end is looked for (EndLook::each_tick) while the store answers.
      if (end_look_ != EndLook::each_tick || ended_ || !store_) return;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!ok_ || now - *ok_ > 2 * interval_) return;
      }
      try {
        if (rank0_said_done()) poll();
      } catch (const std::exception&) {
        store_.reset();
      }
      return;
    }
    try {
      if (now < next_poll_ && !every_rank_beat()) return;
      next_poll_ = now + interval_;
      poll();
    } catch (const std::exception&) {
      store_.reset();  // not up yet, or gone: reconnect on the next round
    }
  });
}

HeartbeatWatch::~HeartbeatWatch() {
  thread_.reset();
  // This node stops watching (its workers ended, or were stopped): rank 0 need not wait for it.
  // Only while the store still answered of late: a gone store would hold the launcher's end.
  std::optional<HeartbeatClock::time_point> ok;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ok = ok_;
  }
  if (end_key_.empty() || ended_ || !store_ || !ok || HeartbeatClock::now() - *ok > 2 * interval_)
    return;
  try {
    // One request, short: a healthy store answers at once, and a launcher's end is not held.
    store_->set_timeout(
        std::max<std::chrono::milliseconds>(interval_, std::chrono::milliseconds(500)));
    store_->set_string(end_key_, "1");
  } catch (const std::exception&) {
    // Rank 0 stops waiting at its bound.
  }
}

void HeartbeatWatch::connect() {
  // Each request waits at most two intervals, so that the thread stops soon when asked.
  if (!store_)
    store_ = std::make_unique<TcpStore>(host_, port_, StoreRole::client, 2 * interval_,
                                        JobIdentity{token_, -1});
}

bool HeartbeatWatch::every_rank_beat() {
  connect();
  std::vector<std::string> keys;
  for (int r : ranks_) keys.push_back(heartbeat_key(r));
  return store_->check(keys);
}

bool HeartbeatWatch::rank0_said_done() {
  connect();
  return store_->check({heartbeat_key(0)}) && store_->get_string(heartbeat_key(0)) == "done";
}

void HeartbeatWatch::poll() {
  connect();
  std::vector<std::pair<int, std::string>> values;
  for (int r : ranks_) {
    const std::string key = heartbeat_key(r);
    if (store_->check({key})) values.emplace_back(r, store_->get_string(key));
  }
  auto now = HeartbeatClock::now();
  bool all_seen, rank0_done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [r, v] : values) {
      auto it = seen_.find(r);
      if (it == seen_.end() || it->second.value != v) seen_[r] = {v, now, v == "done"};
    }
    ok_ = now;
    all_seen = seen_.size() == ranks_.size();
    auto zero = seen_.find(0);
    rank0_done = zero != seen_.end() && zero->second.done;
  }
  if (all_seen && !announced_) {
    // The launched ranks wait for this before they train (init_process_group).
    if (!ready_key_.empty()) store_->set_string(ready_key_, "1");
    announced_ = true;
  }
  if (rank0_done && !ended_) {
    // Rank 0 waits for this before its store goes (Heartbeat's confirm_nodes).
    if (!end_key_.empty()) store_->set_string(end_key_, "1");
    ended_ = true;
  }
}

std::chrono::milliseconds HeartbeatWatch::silent_for(int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seen_.find(rank);
  if (it == seen_.end() || !ok_) return std::chrono::milliseconds(0);
  return std::chrono::duration_cast<std::chrono::milliseconds>(*ok_ - it->second.changed);
}

std::optional<SilentRank> HeartbeatWatch::silent(std::chrono::milliseconds timeout) const {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  std::lock_guard<std::mutex> lock(mu_);
  if (!ok_) return std::nullopt;  // the store never answered: the rendezvous timeout rules
  auto now = HeartbeatClock::now();
  if (now - *ok_ > timeout) {
    // The store stopped answering. Rank 0 hosts it: name it, unless it is done or not ours.
    auto it = seen_.find(0);
    if (it == seen_.end() || it->second.done) return std::nullopt;
    return SilentRank{0, duration_cast<milliseconds>(now - it->second.changed), true};
  }
  std::optional<SilentRank> worst;
  for (const auto& [r, s] : seen_) {
    if (s.done) continue;
    // Silence as of the latest poll: a watcher that was itself starved sees no silence.
    auto quiet = duration_cast<milliseconds>(*ok_ - s.changed);
    if (quiet > timeout && (!worst || quiet > worst->silent_for))
      worst = SilentRank{r, quiet, false};
  }
  return worst;
}

}  // namespace dp::dist
