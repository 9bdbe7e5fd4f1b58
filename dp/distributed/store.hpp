// Rendezvous key-value stores: the place where ranks meet before they can talk to each other.
// A Store implements gloo::rendezvous::Store (so gloo connects its full mesh through it) plus
// an atomic counter (add) and a presence check. Every blocking call has a timeout and throws
// kernels::Error naming the key(s) and the timeout when it runs out.
//
//   TcpStore   a TCP client; the StoreServer it talks to lives on rank 0 (a poll thread).
//   FileStore  files in a directory on a shared file system (file:///path).
//   PrefixStore  a namespace inside another store (one per process group).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "dp/distributed/socket.hpp"

namespace dp::dist {

using Millis = std::chrono::milliseconds;
constexpr Millis kDefaultTimeout = std::chrono::seconds(300);

// "['a', 'b']": keys as error messages name them.
std::string keys_text(const std::vector<std::string>& keys);

class Store : public gloo::rendezvous::Store {
 public:
  explicit Store(Millis timeout = kDefaultTimeout) : timeout_(timeout.count()) {}
  ~Store() override = default;

  // Default timeout of get/wait and of each request.
  Millis timeout() const { return Millis(timeout_.load()); }
  void set_timeout(Millis t) { timeout_.store(t.count()); }

  // ensures key holds value (replacing any previous one); wakes waiters on key.
  void set(const std::string& key, const std::vector<char>& value) override = 0;
  // Waits up to timeout() for key to exist, then returns its value.
  std::vector<char> get(const std::string& key) override = 0;
  // Waits until every key exists; throws kernels::Error naming the missing keys on timeout.
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout()); }
  void wait(const std::vector<std::string>& keys, const Millis& timeout) override = 0;
  // Atomically adds delta to the integer at key (missing: 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True when every key exists (does not wait).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Removes key; returns whether it existed.
  virtual bool remove(const std::string& key) = 0;
  // Where the store lives, for messages ("tcp://127.0.0.1:29500").
  virtual std::string describe() const = 0;
  // A store of the same keys on a connection of its own, whose requests (and connect) take at
  // most `bound` each: for a failure path, which must neither queue behind another thread's
  // request on this store's connection nor hang on a stopped host. Throws when the store is
  // unreachable; nullptr for a store it cannot open again.
  virtual std::shared_ptr<Store> reconnect(Millis bound) const {
    (void)bound;
    return nullptr;
  }

  void set_string(const std::string& key, const std::string& value) {
    set(key, std::vector<char>(value.begin(), value.end()));
  }
  std::string get_string(const std::string& key) {
    std::vector<char> v = get(key);
    return std::string(v.begin(), v.end());
  }

 private:
  std::atomic<int64_t> timeout_;
};

// Keys of `base` under "prefix/"; shares the base store (and its server).
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
  void set(const std::string& key, const std::vector<char>& value) override;
  std::vector<char> get(const std::string& key) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, const Millis& timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;
  std::string describe() const override;
  std::shared_ptr<Store> reconnect(Millis bound) const override;
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string join(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> join(const std::vector<std::string>& keys) const;
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

// One file per key in `directory` (created if missing), written atomically (rename); add()
// serialises through an flock'ed lock file. For file:// rendezvous on a shared file system.
// Use a fresh directory per run: keys of an earlier run would be seen as present.
class FileStore : public Store {
 public:
  explicit FileStore(std::string directory, Millis timeout = kDefaultTimeout);
  void set(const std::string& key, const std::vector<char>& value) override;
  std::vector<char> get(const std::string& key) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, const Millis& timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;
  std::string describe() const override { return "file://" + dir_; }
  std::shared_ptr<Store> reconnect(Millis bound) const override {
    return std::make_shared<FileStore>(dir_, bound);
  }

 private:
  std::string path_of(const std::string& key) const;
  std::string dir_;
};

// Bounds of one StoreServer (see store_protocol.hpp for the per-frame bounds).
struct StoreServerLimits {
  size_t max_connections = 4096;
  size_t max_pending_waits_per_connection = 64;
  size_t max_output_bytes_per_connection = size_t(256) << 20;  // replies not read yet
  size_t max_total_bytes = size_t(1) << 30;                    // keys + values held
  Millis stall_timeout = std::chrono::seconds(30);             // for a partly received frame
  // A connection whose first frame (the hello) is not in within this is closed: idle
  // connections cannot fill the table.
  Millis hello_timeout = std::chrono::seconds(5);
  // Refused and closed connections are logged once per source address per interval; the next
  // line from that source (or a line at the interval's end) says how many were not logged.
  Millis log_interval = std::chrono::seconds(10);
};

// The TCP store server: one thread polling a listening socket and its clients. Malformed
// frames close that client's connection with a logged error (rate-limited per source address:
// StoreServerLimits::log_interval); other clients are unaffected.
class StoreServer {
 public:
  // Listens on host:port (port 0: an ephemeral port, see port()). Throws if it cannot bind.
  // With a job token, every connection must open with a hello carrying it (store_protocol.hpp):
  // clients of another job are refused and closed without touching the keys.
  StoreServer(const std::string& host, int port, StoreServerLimits limits = {},
              std::string job_token = {});
  ~StoreServer();  // stops the thread and closes every connection
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const;
  const std::string& host() const;
  // Connections closed because of a protocol violation or a bound (for tests and logs).
  int64_t rejected_connections() const;
  int64_t accepted_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

enum class StoreRole { client, server };

// Who a TcpStore client is: the job token it presents at every connect (the server's must
// match when it has one) and its rank, for the server's log.
struct JobIdentity {
  std::string token;
  int rank = -1;
};

// Client of a StoreServer at host:port; with StoreRole::server it first starts that server in
// this process (rank 0). Requests are serialised (one connection, one request at a time);
// a request that fails or times out drops the connection and the next one reconnects.
class TcpStore : public Store {
 public:
  // Connects, retrying until `timeout` while the server is not up yet, and says hello with
  // job.token (a server role gets that token too). Throws naming the store when it is
  // unreachable or belongs to another job.
  TcpStore(std::string host, int port, StoreRole role, Millis timeout = kDefaultTimeout,
           JobIdentity job = {});
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<char>& value) override;
  std::vector<char> get(const std::string& key) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, const Millis& timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool remove(const std::string& key) override;
  std::string describe() const override;
  // A client of the same server, with this store's job identity.
  std::shared_ptr<Store> reconnect(Millis bound) const override;

  const std::string& host() const { return host_; }
  // The server's port (the one picked when constructed with port 0 and StoreRole::server).
  int port() const { return port_; }
  // The server this store owns (nullptr for clients).
  StoreServer* server() const { return server_.get(); }

 private:
  struct Reply {
    uint8_t opcode = 0;
    std::vector<char> payload;
  };
  Reply request(const std::vector<char>& frame, Millis timeout, const std::string& what);
  // (Re)connects and says hello; requires mu_ held.
  void connect_locked(net::Clock::time_point deadline, Millis timeout);

  std::unique_ptr<StoreServer> server_;
  std::string host_;
  int port_ = 0;
  JobIdentity job_;
  std::mutex mu_;
  net::Socket sock_;
};

}  // namespace dp::dist
