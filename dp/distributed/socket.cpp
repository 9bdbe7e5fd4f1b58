#include "dp/distributed/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <thread>

#include "kernels/runtime/error.hpp"

namespace dp::dist::net {

namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfoPtr resolve(const std::string& host, int port, bool passive) {
  DP_CHECK(port >= 0 && port <= 65535, "bad port " << port << " for host '" << host << "'");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  DP_CHECK(rc == 0, "cannot resolve host '" << host << "': " << gai_strerror(rc));
  return AddrInfoPtr(res);
}

std::string errno_text(int e) {
  return std::string(std::strerror(e));
}

}  // namespace

void Socket::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

int millis_until(Clock::time_point deadline) {
  // Rounded up, so that a poll() that times out returns at or after the deadline.
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  if (us <= 0) return 0;
  auto ms = (us + 999) / 1000;
  return ms > 1000000000 ? 1000000000 : static_cast<int>(ms);
}

void set_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  DP_CHECK(flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0,
           "fcntl(O_NONBLOCK) failed: " << errno_text(errno));
}

Socket listen_tcp(const std::string& host, int port, int backlog) {
  AddrInfoPtr addrs = resolve(host, port, true);
  int last_errno = 0;
  for (addrinfo* a = addrs.get(); a; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!s.valid()) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd(), backlog) != 0) {
      last_errno = errno;
      continue;
    }
    return s;
  }
  DP_THROW("cannot listen on " << host << ":" << port << ": " << errno_text(last_errno));
}

int local_port(const Socket& s) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  DP_CHECK(getsockname(s.fd(), reinterpret_cast<sockaddr*>(&ss), &len) == 0,
           "getsockname failed: " << errno_text(errno));
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
}

std::string peer_name(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char buf[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    port = ntohs(in->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* in = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &in->sin6_addr, buf, sizeof(buf));
    port = ntohs(in->sin6_port);
  }
  return std::string(buf) + ":" + std::to_string(port);
}

namespace {
// One non-blocking connect attempt bounded by `deadline`. Returns 0 or the errno.
int try_connect(const Socket& s, const addrinfo* a, Clock::time_point deadline) {
  set_nonblocking(s.fd());
  if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  pollfd p{s.fd(), POLLOUT, 0};
  int rc;
  do {
    rc = ::poll(&p, 1, millis_until(deadline));
  } while (rc < 0 && errno == EINTR);
  if (rc == 0) return ETIMEDOUT;
  if (rc < 0) return errno;
  int err = 0;
  socklen_t len = sizeof(err);
  getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
  return err;
}
}  // namespace

Socket connect_tcp(const std::string& host, int port, Clock::time_point deadline) {
  AddrInfoPtr addrs = resolve(host, port, false);
  int last_errno = 0;
  auto backoff = std::chrono::milliseconds(10);
  while (true) {
    for (addrinfo* a = addrs.get(); a; a = a->ai_next) {
      Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!s.valid()) {
        last_errno = errno;
        continue;
      }
      int err = try_connect(s, a, deadline);
      if (err == 0) {
        int flags = fcntl(s.fd(), F_GETFL, 0);
        fcntl(s.fd(), F_SETFL, flags & ~O_NONBLOCK);
        int one = 1;
        setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return s;
      }
      last_errno = err;
    }
    if (Clock::now() + backoff >= deadline) break;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(250));
  }
  DP_THROW("could not connect to " << host << ":" << port
                                   << " before the deadline: " << errno_text(last_errno));
}

void send_all(int fd, const void* data, size_t n, Clock::time_point deadline,
              const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    pollfd pf{fd, POLLOUT, 0};
    int rc = ::poll(&pf, 1, millis_until(deadline));
    if (rc < 0 && errno == EINTR) continue;
    DP_CHECK(rc >= 0, what << ": poll failed: " << errno_text(errno));
    DP_CHECK(rc > 0, what << ": timed out sending");
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      DP_THROW(what << ": send failed: " << errno_text(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pf{fd, POLLIN, 0};
    int rc = ::poll(&pf, 1, millis_until(deadline));
    if (rc < 0 && errno == EINTR) continue;
    DP_CHECK(rc >= 0, what << ": poll failed: " << errno_text(errno));
    DP_CHECK(rc > 0, what << ": timed out waiting for the reply");
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      DP_THROW(what << ": recv failed: " << errno_text(errno));
    }
    DP_CHECK(r > 0, what << ": the peer closed the connection");
    p += r;
    n -= static_cast<size_t>(r);
  }
}

std::pair<int, int> ephemeral_port_range() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int lo = 0, hi = 0;
  if (in >> lo >> hi && lo > 0 && lo <= hi && hi <= 65535) return {lo, hi};
  return {32768, 60999};  // Linux's default
}

int find_free_port(const std::string& host) {
  // Not from the ephemeral range, which binding port 0 draws from: the kernel hands those
  // ports to outgoing connections too (a Gloo pair of any job on the machine), and one may take
  // this port before its store binds it. Below the range only another chooser competes, and
  // the random draw keeps concurrent ones apart.
  const int below = ephemeral_port_range().first;
  if (below - kFirstChosenPort >= 1024) {
    std::mt19937 draw(std::random_device{}());
    std::uniform_int_distribution<int> port(kFirstChosenPort, below - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int p = port(draw);
      try {
        listen_tcp(host, p, 1);
        return p;
      } catch (const kernels::Error&) {
        // in use: draw again
      }
    }
  }
  Socket s = listen_tcp(host, 0, 1);
  return local_port(s);
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost") return true;
  in_addr a4{};
  if (inet_pton(AF_INET, host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  in6_addr a6{};
  if (inet_pton(AF_INET6, host.c_str(), &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  return false;
}

std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) return {};
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owned(res, freeaddrinfo);
  for (addrinfo* a = res; a; a = a->ai_next) {
    Socket s(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (s.fd() < 0 || ::connect(s.fd(), a->ai_addr, a->ai_addrlen) != 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    char text[INET6_ADDRSTRLEN] = {0};
    const void* src =
        local.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    if (inet_ntop(local.ss_family, src, text, sizeof(text))) return text;
  }
  return {};
}

}  // namespace dp::dist::net
