#include "dp/distributed/heartbeat.hpp"

#include <algorithm>

#include "dp/distributed/store.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

std::string heartbeat_key(int rank) {
  return "dp/heartbeat/" + std::to_string(rank);
}

std::string heartbeat_watch_key(int node_rank) {
  return "dp/heartbeat_watch/" + std::to_string(node_rank);
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
    : connection_(std::move(connection)), keep_alive_(std::move(keep_alive)), rank_(rank) {
  DP_CHECK(connection_ != nullptr, "Heartbeat: needs a store");
  thread_ = std::make_unique<Periodic>(interval, [this] {
    try {
      connection_->set_string(heartbeat_key(rank_), std::to_string(++beats_));
    } catch (const std::exception&) {
      // The store may be busy; the watcher judges the silence, not us.
    }
  });
}

Heartbeat::~Heartbeat() {
  thread_.reset();
  try {
    connection_->set_string(heartbeat_key(rank_), "done");
  } catch (const std::exception&) {
    // The store is gone already (rank 0 finished first): nobody is watching.
  }
}

// ---- HeartbeatWatch -------------------------------------------------------------------------

HeartbeatWatch::HeartbeatWatch(std::string host, int port, std::string job_token,
                               std::vector<int> ranks, std::chrono::milliseconds interval,
                               std::string ready_key)
    : host_(std::move(host)),
      port_(port),
      token_(std::move(job_token)),
      ranks_(std::move(ranks)),
      interval_(interval),
      ready_key_(std::move(ready_key)) {
  // A poll every interval. Until every rank was seen, each tick in between asks the store
  // once whether every rank's key is there, and polls at once when they are.
  thread_ = std::make_unique<Periodic>(std::min(interval_, kFirstLookTick), [this] {
    const auto now = HeartbeatClock::now();
    if (announced_ && now < next_poll_) return;
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

void HeartbeatWatch::poll() {
  connect();
  std::vector<std::pair<int, std::string>> values;
  for (int r : ranks_) {
    const std::string key = heartbeat_key(r);
    if (store_->check({key})) values.emplace_back(r, store_->get_string(key));
  }
  auto now = HeartbeatClock::now();
  bool all_seen;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [r, v] : values) {
      auto it = seen_.find(r);
      if (it == seen_.end() || it->second.value != v) seen_[r] = {v, now, v == "done"};
    }
    ok_ = now;
    all_seen = seen_.size() == ranks_.size();
  }
  if (all_seen && !announced_) {
    // The launched ranks wait for this before they train (init_process_group).
    if (!ready_key_.empty()) store_->set_string(ready_key_, "1");
    announced_ = true;
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
