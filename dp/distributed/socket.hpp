// Small POSIX TCP helpers shared by the store and the launcher (internal to dp/distributed).
// Every blocking call takes a deadline and throws kernels::Error naming the peer and what it
// was doing; send never raises SIGPIPE.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>

namespace dp::dist::net {

using Clock = std::chrono::steady_clock;

// Owns one file descriptor; closes it on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { reset(); }
  Socket(Socket&& o) noexcept : fd_(o.release()) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// A listening TCP socket on host:port (port 0: an ephemeral port), SO_REUSEADDR set.
// requires host resolves to an address of this machine.
Socket listen_tcp(const std::string& host, int port, int backlog = 128);
// The local port a socket is bound to.
int local_port(const Socket& s);
// "ip:port" of the peer of a connected socket ("?" when unknown).
std::string peer_name(int fd);

// Connects to host:port, retrying while the server is not up yet (refused, unreachable)
// until `deadline`. ensures a blocking socket with TCP_NODELAY.
Socket connect_tcp(const std::string& host, int port, Clock::time_point deadline);

// Writes all n bytes before `deadline`. Throws on error, timeout or a closed peer.
void send_all(int fd, const void* data, size_t n, Clock::time_point deadline,
              const std::string& what);
// Reads exactly n bytes before `deadline`. Throws on error, timeout or end of stream.
void recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& what);

void set_nonblocking(int fd);

// The kernel's ephemeral port range [first, last] (/proc/sys/net/ipv4/ip_local_port_range;
// Linux's default when unreadable): where port 0 binds and outgoing connections draw from.
std::pair<int, int> ephemeral_port_range();

// Ports find_free_port draws from: [kFirstChosenPort, the ephemeral range's first).
constexpr int kFirstChosenPort = 20000;

// A port that was free on `host` a moment ago, to pick a rendezvous port for single-node runs:
// drawn at random below the ephemeral range (so that no outgoing connection takes it before
// the store binds it), else port 0's. Another chooser may still take it in between.
int find_free_port(const std::string& host = "127.0.0.1");

// True when `host` names a loopback address (127.0.0.0/8, ::1, "localhost").
bool is_loopback_host(const std::string& host);

// The address of this machine that a packet to `host` (an address or a name) leaves from: the
// source address the kernel's route to it picks (a UDP connect, which sends nothing). Empty
// when `host` does not resolve or no route reaches it.
std::string local_address_towards(const std::string& host);

// Milliseconds left until `deadline` (>= 0), for poll().
int millis_until(Clock::time_point deadline);

}  // namespace dp::dist::net
