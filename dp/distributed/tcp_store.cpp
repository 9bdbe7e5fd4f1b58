// StoreServer (a poll loop on its own thread) and its client TcpStore; the wire format is in
// store_protocol.hpp.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "dp/distributed/env.hpp"
#include "dp/distributed/store.hpp"
#include "dp/distributed/store_protocol.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

namespace wire = store_wire;
using net::Clock;

namespace {

// Strict decimal int64 ("-12"); false for anything else.
bool parse_int64(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 20) return false;
  size_t i = (s[0] == '-' || s[0] == '+') ? 1 : 0;
  if (i == s.size()) return false;
  for (size_t j = i; j < s.size(); ++j)
    if (s[j] < '0' || s[j] > '9') return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}

}  // namespace

// ---- StoreServer ----------------------------------------------------------------------------

struct StoreServer::Impl {
  struct Conn {
    net::Socket sock;
    std::string peer;
    std::vector<char> in;
    size_t in_off = 0;
    std::vector<char> out;
    size_t out_off = 0;
    size_t pending_waits = 0;
    bool partial = false;         // part of a frame received
    bool greeted = false;         // sent a hello with the job token
    bool said_something = false;  // a whole frame arrived (the hello, on a tokenless server
                                  // any request): the hello timeout no longer applies
    Clock::time_point opened;
    std::string doom;               // set when the connection must close (a bound was hit)
    std::string close_after_reply;  // set when it must close once its replies are sent
    Clock::time_point partial_since;
  };
  struct Waiter {
    uint64_t conn;
    std::vector<std::string> keys;
  };

  std::string host;
  int port = 0;
  StoreServerLimits limits;
  std::string job_token;
  net::Socket listener;
  int wake[2] = {-1, -1};
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> rejected{0};
  std::atomic<int64_t> accepted{0};

  // Owned by the server thread.
  std::map<uint64_t, Conn> conns;
  uint64_t next_id = 1;
  std::unordered_map<std::string, std::vector<char>> data;
  size_t total_bytes = 0;
  std::list<Waiter> waiters;
  // Log lines per source address (the peer without its port): when the last was written, and
  // how many were not written since.
  struct LogState {
    Clock::time_point last;
    int64_t suppressed = 0;
  };
  std::map<std::string, LogState> log_by_source;

  // Logs `what` about a connection from `peer`, at most once per source per log_interval.
  void log_refusal(const std::string& peer, const std::string& what);
  // Writes the counts of lines not logged for sources whose interval has run out.
  void flush_suppressed(Clock::time_point now);

  void run() noexcept;
  void loop();
  void accept_all();
  // Each returns an empty string to keep the connection, else why it must be closed.
  std::string on_readable(uint64_t id, Conn& c);
  std::string process_frames(uint64_t id, Conn& c);
  std::string handle_frame(uint64_t id, Conn& c, uint8_t opcode, const char* p, size_t n);
  std::string flush(Conn& c);
  std::string queue_reply(Conn& c, std::vector<char> frame);
  void wake_waiters();
  void close_conn(uint64_t id, const std::string& why, bool violation);

  bool has_all(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.count(k)) return false;
    return true;
  }
};

void StoreServer::Impl::run() noexcept {
  try {
    loop();
  } catch (const std::exception& e) {
    DP_LOG_ERROR("store server on " << host << ":" << port << " stopped: " << e.what());
  } catch (...) {
    DP_LOG_ERROR("store server on " << host << ":" << port << " stopped: unknown exception");
  }
}

namespace {
// "10.0.0.2" for "10.0.0.2:5123", "::1" for "[::1]:5123".
std::string source_of(const std::string& peer) {
  auto colon = peer.rfind(':');
  std::string host = colon == std::string::npos ? peer : peer.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return host;
}
}  // namespace

void StoreServer::Impl::log_refusal(const std::string& peer, const std::string& what) {
  const auto now = Clock::now();
  const std::string source = source_of(peer);
  auto it = log_by_source.find(source);
  if (it != log_by_source.end() && now - it->second.last < limits.log_interval) {
    ++it->second.suppressed;
    return;
  }
  // A flood from many sources: forget the quiet ones first, so the table stays small.
  if (it == log_by_source.end() && log_by_source.size() >= 4096) {
    flush_suppressed(now);
    for (auto s = log_by_source.begin(); s != log_by_source.end();)
      s = now - s->second.last >= limits.log_interval ? log_by_source.erase(s) : std::next(s);
    if (log_by_source.size() >= 4096) return;  // still full: not logged, the counts say enough
  }
  LogState& state = log_by_source[source];
  std::string more;
  if (state.suppressed > 0)
    more = " (" + std::to_string(state.suppressed) + " more from " + source + " not logged)";
  DP_LOG_ERROR("store server " << host << ":" << port << ": " << what << more);
  state.last = now;
  state.suppressed = 0;
}

void StoreServer::Impl::flush_suppressed(Clock::time_point now) {
  for (auto& [source, state] : log_by_source) {
    if (state.suppressed == 0 || now - state.last < limits.log_interval) continue;
    DP_LOG_ERROR("store server " << host << ":" << port << ": " << state.suppressed
                                 << " more connection(s) from " << source
                                 << " refused or closed in the last "
                                 << seconds_text(limits.log_interval)
                                 << " (not logged one by one)");
    state.last = now;
    state.suppressed = 0;
  }
}

void StoreServer::Impl::close_conn(uint64_t id, const std::string& why, bool violation) {
  auto it = conns.find(id);
  if (it == conns.end()) return;
  if (violation) {
    ++rejected;
    log_refusal(it->second.peer, "closing the connection from " + it->second.peer + ": " + why);
  }
  for (auto w = waiters.begin(); w != waiters.end();) {
    if (w->conn == id)
      w = waiters.erase(w);
    else
      ++w;
  }
  conns.erase(it);
}

void StoreServer::Impl::accept_all() {
  while (true) {
    int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        DP_LOG_ERROR("store server " << host << ":" << port
                                     << ": accept failed: " << std::strerror(errno));
      return;
    }
    net::Socket s(fd);
    if (conns.size() >= limits.max_connections) {
      ++rejected;
      const std::string peer = net::peer_name(fd);
      log_refusal(
          peer, "refusing " + peer + ": already " + std::to_string(conns.size()) + " connections");
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ++accepted;
    Conn c;
    c.opened = Clock::now();
    c.peer = net::peer_name(fd);
    c.sock = std::move(s);
    conns.emplace(next_id++, std::move(c));
  }
}

std::string StoreServer::Impl::queue_reply(Conn& c, std::vector<char> frame) {
  if (c.out.size() - c.out_off + frame.size() > limits.max_output_bytes_per_connection)
    return "more than " + std::to_string(limits.max_output_bytes_per_connection) +
           " bytes of replies not read by the client";
  if (c.out_off == c.out.size()) {
    c.out.clear();
    c.out_off = 0;
  }
  c.out.insert(c.out.end(), frame.begin(), frame.end());
  return {};
}

std::string StoreServer::Impl::flush(Conn& c) {
  while (c.out_off < c.out.size()) {
    ssize_t w = ::send(c.sock.fd(), c.out.data() + c.out_off, c.out.size() - c.out_off,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return {};
      return std::string("send failed: ") + std::strerror(errno);
    }
    c.out_off += static_cast<size_t>(w);
  }
  c.out.clear();
  c.out_off = 0;
  return {};
}

void StoreServer::Impl::wake_waiters() {
  // Queues `ready` for every waiter whose keys all exist. Never closes a connection here (the
  // caller may hold a reference to one): a connection over its bound is doomed instead.
  for (auto w = waiters.begin(); w != waiters.end();) {
    if (!has_all(w->keys)) {
      ++w;
      continue;
    }
    auto it = conns.find(w->conn);
    if (it != conns.end()) {
      Conn& c = it->second;
      --c.pending_waits;
      std::string why = queue_reply(c, wire::Writer(wire::kReady).finish());
      if (!why.empty() && c.doom.empty()) c.doom = why;
    }
    w = waiters.erase(w);
  }
}

std::string StoreServer::Impl::handle_frame(uint64_t id, Conn& c, uint8_t opcode, const char* p,
                                            size_t n) {
  wire::Request req;
  std::string bad = wire::decode_request(opcode, p, n, req);
  if (!bad.empty()) return bad;
  const std::string& key = req.key;
  if (opcode == wire::kHello) {
    const int64_t rank = req.rank;
    if (job_token.empty() || req.token == job_token) {
      c.greeted = true;
      return queue_reply(c, wire::Writer(wire::kOk).finish());
    }
    std::string who =
        rank >= 0 ? "rank " + std::to_string(rank) + " of another job" : "a client of another job";
    c.close_after_reply = who + " (its job token differs from this job's): refused";
    return queue_reply(c, wire::Writer(wire::kError)
                              .str("the store at " + host + ":" + std::to_string(port) +
                                   " belongs to another job (the job tokens differ)")
                              .finish());
  }
  if (!job_token.empty() && !c.greeted) {
    c.close_after_reply = "a request before the hello with the job token: refused";
    return queue_reply(c,
                       wire::Writer(wire::kError)
                           .str("this store requires a hello with the job token before any request")
                           .finish());
  }
  switch (opcode) {
    case wire::kSet: {
      const std::string& value = req.value;
      auto it = data.find(key);
      size_t old = it == data.end() ? 0 : key.size() + it->second.size();
      if (total_bytes - old + key.size() + value.size() > limits.max_total_bytes)
        return queue_reply(c, wire::Writer(wire::kError)
                                  .str("store is full (" + std::to_string(limits.max_total_bytes) +
                                       " bytes); set('" + key + "') refused")
                                  .finish());
      total_bytes = total_bytes - old + key.size() + value.size();
      data[key] = std::vector<char>(value.begin(), value.end());
      std::string why = queue_reply(c, wire::Writer(wire::kOk).finish());
      wake_waiters();
      return why;
    }
    case wire::kGet: {
      auto it = data.find(key);
      if (it == data.end()) return queue_reply(c, wire::Writer(wire::kNotFound).finish());
      return queue_reply(
          c, wire::Writer(wire::kValue).bytes(it->second.data(), it->second.size()).finish());
    }
    case wire::kAdd: {
      const int64_t delta = req.delta;
      int64_t value = 0;
      auto it = data.find(key);
      if (it != data.end() &&
          !parse_int64(std::string(it->second.begin(), it->second.end()), value))
        return queue_reply(c, wire::Writer(wire::kError)
                                  .str("add('" + key + "'): the value is not an integer")
                                  .finish());
      int64_t sum = 0;
      if (__builtin_add_overflow(value, delta, &sum))
        return queue_reply(
            c, wire::Writer(wire::kError).str("add('" + key + "'): int64 overflow").finish());
      std::string text = std::to_string(sum);
      size_t old = it == data.end() ? 0 : key.size() + it->second.size();
      total_bytes = total_bytes - old + key.size() + text.size();
      data[key] = std::vector<char>(text.begin(), text.end());
      std::string why = queue_reply(c, wire::Writer(wire::kInteger).i64(sum).finish());
      wake_waiters();
      return why;
    }
    case wire::kCheck: {
      return queue_reply(c, wire::Writer(wire::kBoolean).u8(has_all(req.keys) ? 1 : 0).finish());
    }
    case wire::kWait: {
      if (has_all(req.keys)) return queue_reply(c, wire::Writer(wire::kReady).finish());
      if (c.pending_waits >= limits.max_pending_waits_per_connection)
        return "more than " + std::to_string(limits.max_pending_waits_per_connection) +
               " pending wait requests";
      ++c.pending_waits;
      waiters.push_back({id, std::move(req.keys)});
      return {};
    }
    case wire::kRemove: {
      auto it = data.find(key);
      bool existed = it != data.end();
      if (existed) {
        total_bytes -= key.size() + it->second.size();
        data.erase(it);
      }
      return queue_reply(c, wire::Writer(wire::kBoolean).u8(existed ? 1 : 0).finish());
    }
    default:
      return "unknown opcode " + std::to_string(opcode);
  }
}

std::string StoreServer::Impl::process_frames(uint64_t id, Conn& c) {
  if (!c.close_after_reply.empty()) {  // refused: whatever else it sends is dropped unread
    c.in.clear();
    c.in_off = 0;
    return {};
  }
  while (c.in.size() - c.in_off >= wire::kHeaderBytes) {
    const char* base = c.in.data() + c.in_off;
    wire::Header h = wire::parse_header(base);
    std::string bad = wire::check_request_header(h);
    if (!bad.empty()) return bad;
    size_t frame = wire::kHeaderBytes + h.length;
    if (c.in.size() - c.in_off < frame) {
      c.in.reserve(c.in_off + frame);
      break;
    }
    std::string why = handle_frame(id, c, h.opcode, base + wire::kHeaderBytes, h.length);
    c.said_something = true;
    if (!why.empty()) return why;
    if (!c.doom.empty()) return c.doom;
    c.in_off += frame;
    c.partial = false;
    if (!c.close_after_reply.empty()) return process_frames(id, c);  // drops the rest
  }
  if (c.in_off == c.in.size()) {
    c.in.clear();
    c.in_off = 0;
  } else if (c.in_off > (1u << 20)) {
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(c.in_off));
    c.in_off = 0;
  }
  if (c.in.size() > c.in_off && !c.partial) {
    c.partial = true;
    c.partial_since = Clock::now();
  }
  return {};
}

std::string StoreServer::Impl::on_readable(uint64_t id, Conn& c) {
  // Read what is there, bounded per pass so that one busy client cannot starve the others.
  // Frames are checked as their headers arrive: a bad header closes the connection before
  // anything more of that frame is read.
  constexpr size_t kChunk = 64 << 10;
  constexpr size_t kMaxPerPass = 4 << 20;
  size_t got = 0;
  while (got < kMaxPerPass) {
    size_t old = c.in.size();
    c.in.resize(old + kChunk);
    ssize_t r = ::recv(c.sock.fd(), c.in.data() + old, kChunk, MSG_DONTWAIT);
    if (r < 0) {
      c.in.resize(old);
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return std::string("recv failed: ") + std::strerror(errno);
    }
    c.in.resize(old + static_cast<size_t>(r));
    if (r == 0) {
      std::string why = flush(c);
      if (c.in.size() > c.in_off)
        return "truncated frame: the client closed the connection after " +
               std::to_string(c.in.size() - c.in_off) + " bytes of an incomplete frame";
      return why.empty() ? "eof" : why;
    }
    got += static_cast<size_t>(r);
    std::string why = process_frames(id, c);
    if (!why.empty()) return why;
  }
  return flush(c);
}

void StoreServer::Impl::loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  int tick = static_cast<int>(std::clamp<int64_t>(
      std::min(limits.stall_timeout, limits.hello_timeout).count() / 4, 10, 1000));
  while (!stop.load()) {
    fds.clear();
    ids.clear();
    fds.push_back({wake[0], POLLIN, 0});
    fds.push_back({listener.fd(), POLLIN, 0});
    for (auto& [id, c] : conns) {
      short ev = POLLIN;
      if (c.out_off < c.out.size()) ev |= POLLOUT;
      fds.push_back({c.sock.fd(), ev, 0});
      ids.push_back(id);
    }
    int rc = ::poll(fds.data(), fds.size(), tick);
    if (rc < 0) {
      if (errno == EINTR) continue;
      DP_THROW("poll failed: " << std::strerror(errno));
    }
    if (fds[0].revents & POLLIN) {
      char buf[64];
      while (::read(wake[0], buf, sizeof(buf)) > 0) {
      }
    }
    if (stop.load()) break;
    if (fds[1].revents & POLLIN) accept_all();
    for (size_t i = 0; i < ids.size(); ++i) {
      short re = fds[i + 2].revents;
      if (!re) continue;
      auto it = conns.find(ids[i]);
      if (it == conns.end()) continue;  // closed while handling another connection
      std::string why;
      if (re & (POLLIN | POLLHUP | POLLERR)) why = on_readable(ids[i], it->second);
      if (why.empty() && (re & POLLOUT)) why = flush(it->second);
      if (!why.empty()) close_conn(ids[i], why, why != "eof");
    }
    // Replies queued for other connections (woken waiters), and stalled frames.
    auto now = Clock::now();
    std::vector<std::pair<uint64_t, std::string>> to_close;
    for (auto& [id, c] : conns) {
      std::string why = c.doom.empty() ? flush(c) : c.doom;
      if (why.empty() && !c.close_after_reply.empty() && c.out_off == c.out.size())
        why = c.close_after_reply;
      if (why.empty() && !c.said_something && now - c.opened > limits.hello_timeout)
        why = "no hello within " + std::to_string(limits.hello_timeout.count()) +
              " ms of connecting (" + std::to_string(c.in.size() - c.in_off) + " bytes received)";
      if (why.empty() && c.partial && now - c.partial_since > limits.stall_timeout)
        why = "truncated frame: " + std::to_string(c.in.size() - c.in_off) +
              " bytes of an incomplete frame and nothing more for " +
              std::to_string(limits.stall_timeout.count()) + " ms";
      if (!why.empty()) to_close.emplace_back(id, why);
    }
    for (auto& [id, why] : to_close) close_conn(id, why, true);
    flush_suppressed(now);
  }
}

StoreServer::StoreServer(const std::string& host, int port, StoreServerLimits limits,
                         std::string job_token)
    : impl_(std::make_unique<Impl>()) {
  DP_CHECK(job_token.size() <= wire::kMaxTokenBytes, "store server: a job token of "
                                                         << job_token.size() << " bytes exceeds "
                                                         << wire::kMaxTokenBytes);
  impl_->host = host;
  impl_->limits = limits;
  impl_->job_token = std::move(job_token);
  impl_->listener = net::listen_tcp(host, port);
  net::set_nonblocking(impl_->listener.fd());
  impl_->port = net::local_port(impl_->listener);
  DP_CHECK(::pipe2(impl_->wake, O_CLOEXEC | O_NONBLOCK) == 0,
           "store server: pipe2 failed: " << std::strerror(errno));
  Impl* impl = impl_.get();
  impl_->thread = std::thread([impl] { impl->run(); });
}

StoreServer::~StoreServer() {
  impl_->stop.store(true);
  char c = 1;
  if (::write(impl_->wake[1], &c, 1) < 0) {
    // The loop also wakes on its tick; nothing else to do.
  }
  if (impl_->thread.joinable()) impl_->thread.join();
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

int StoreServer::port() const {
  return impl_->port;
}
const std::string& StoreServer::host() const {
  return impl_->host;
}
int64_t StoreServer::rejected_connections() const {
  return impl_->rejected.load();
}
int64_t StoreServer::accepted_connections() const {
  return impl_->accepted.load();
}

// ---- TcpStore -------------------------------------------------------------------------------

TcpStore::TcpStore(std::string host, int port, StoreRole role, Millis timeout, JobIdentity job)
    : Store(timeout), host_(std::move(host)), port_(port), job_(std::move(job)) {
  DP_CHECK(job_.token.size() <= wire::kMaxTokenBytes, "TcpStore: a job token of "
                                                          << job_.token.size() << " bytes exceeds "
                                                          << wire::kMaxTokenBytes);
  if (role == StoreRole::server) {
    try {
      server_ = std::make_unique<StoreServer>(host_, port_, StoreServerLimits{}, job_.token);
    } catch (const kernels::Error& e) {
      // The hint only where the port is taken (not for an address that is not this host's).
      const bool in_use =
          std::string(e.what()).find(std::strerror(EADDRINUSE)) != std::string::npos;
      DP_THROW("TcpStore: cannot start the store server: "
               << e.what()
               << (in_use ? " (is another job using port " + std::to_string(port_) +
                                "? give each job its own MASTER_PORT / --master-port)"
                          : std::string()));
    }
    port_ = server_->port();
  }
  DP_CHECK(port_ > 0 && port_ <= 65535,
           "TcpStore: bad port " << port_ << " for host '" << host_ << "'");
  std::lock_guard<std::mutex> lock(mu_);
  connect_locked(Clock::now() + timeout, timeout);
}

void TcpStore::connect_locked(net::Clock::time_point deadline, Millis timeout) {
  try {
    sock_ = net::connect_tcp(host_, port_, deadline);
  } catch (const kernels::Error& e) {
    DP_THROW("TcpStore: no store server reachable at " << host_ << ":" << port_ << " within "
                                                       << timeout.count() << " ms: " << e.what());
  }
  const std::string what = "store hello to " + describe();
  auto frame = wire::Writer(wire::kHello).str(job_.token).i64(job_.rank).finish();
  char header[wire::kHeaderBytes];
  std::vector<char> payload;
  try {
    try {
      net::send_all(sock_.fd(), frame.data(), frame.size(), deadline, what);
      net::recv_all(sock_.fd(), header, sizeof(header), deadline, what);
    } catch (const kernels::Error& e) {
      // The port took the connection (a listening socket's kernel does that by itself) but no
      // one answered: the process that hosts the store is the one to look at, not this rank.
      DP_THROW("TcpStore: the store server at "
               << describe() << " took the connection but did not answer this rank's hello within "
               << timeout.count()
               << " ms: the process that hosts it (rank 0, or the launcher) may be stopped, "
                  "hung or overloaded; look there first ("
               << e.what() << ")");
    }
    wire::Header h = wire::parse_header(header);
    DP_CHECK(h.magic == wire::kMagic && h.version == wire::kVersion &&
                 h.length <= wire::kMaxErrorBytes + 4,
             what << ": the server sent a malformed reply (not a dptrain store?)");
    payload.resize(h.length);
    if (h.length) net::recv_all(sock_.fd(), payload.data(), h.length, deadline, what);
    if (h.opcode == wire::kError) {
      wire::Reader r(payload.data(), payload.size());
      DP_THROW("TcpStore: refused by " << describe() << ": " << r.str(wire::kMaxErrorBytes)
                                       << ". Is another job using port " << port_
                                       << "? Give each job its own MASTER_PORT / --master-port "
                                          "(this rank's job token comes from DP_JOB_TOKEN, "
                                          "DP_JOB_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID or "
                                          "PMIX_NAMESPACE)");
    }
    DP_CHECK(h.opcode == wire::kOk, what << ": unexpected reply " << int(h.opcode));
  } catch (...) {
    sock_.reset();
    throw;
  }
}

TcpStore::~TcpStore() = default;

std::string TcpStore::describe() const {
  return "tcp://" + host_ + ":" + std::to_string(port_);
}

std::shared_ptr<Store> TcpStore::reconnect(Millis bound) const {
  return std::make_shared<TcpStore>(host_, port_, StoreRole::client, bound, job_);
}

TcpStore::Reply TcpStore::request(const std::vector<char>& frame, Millis timeout,
                                  const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  auto deadline = Clock::now() + timeout;
  Reply reply;
  try {
    if (!sock_.valid()) connect_locked(deadline, timeout);
    net::send_all(sock_.fd(), frame.data(), frame.size(), deadline, what);
    char header[wire::kHeaderBytes];
    net::recv_all(sock_.fd(), header, sizeof(header), deadline, what);
    wire::Header h = wire::parse_header(header);
    DP_CHECK(h.magic == wire::kMagic && h.version == wire::kVersion,
             what << ": the server at " << describe() << " sent a malformed reply");
    DP_CHECK(h.length <= wire::kMaxReplyPayload,
             what << ": reply of " << h.length << " bytes exceeds the bound");
    reply.opcode = h.opcode;
    reply.payload.resize(h.length);
    if (h.length) net::recv_all(sock_.fd(), reply.payload.data(), h.length, deadline, what);
  } catch (...) {
    sock_.reset();  // the stream may be mid-reply: reconnect on the next request
    throw;
  }
  if (reply.opcode == wire::kError) {
    wire::Reader r(reply.payload.data(), reply.payload.size());
    std::string msg = r.str(wire::kMaxErrorBytes);
    DP_THROW(what << ": the store refused: " << msg);
  }
  return reply;
}

void TcpStore::set(const std::string& key, const std::vector<char>& value) {
  DP_CHECK(key.size() <= wire::kMaxKeyBytes,
           "store set: key of " << key.size() << " bytes exceeds " << wire::kMaxKeyBytes);
  DP_CHECK(value.size() <= wire::kMaxValueBytes, "store set('" << key << "'): value of "
                                                               << value.size() << " bytes exceeds "
                                                               << wire::kMaxValueBytes);
  auto frame = wire::Writer(wire::kSet).str(key).bytes(value.data(), value.size()).finish();
  Reply r = request(frame, timeout(), "store set('" + key + "') on " + describe());
  DP_CHECK(r.opcode == wire::kOk, "store set('" << key << "'): unexpected reply " << int(r.opcode));
}

std::vector<char> TcpStore::get(const std::string& key) {
  wait({key}, timeout());
  auto frame = wire::Writer(wire::kGet).str(key).finish();
  Reply r = request(frame, timeout(), "store get('" + key + "') on " + describe());
  DP_CHECK(
      r.opcode != wire::kNotFound,
      "store get('" << key << "'): the key was removed while waiting for it on " << describe());
  DP_CHECK(r.opcode == wire::kValue,
           "store get('" << key << "'): unexpected reply " << int(r.opcode));
  wire::Reader rd(r.payload.data(), r.payload.size());
  std::string v = rd.str(wire::kMaxValueBytes);
  DP_CHECK(rd.ok() && rd.at_end(), "store get('" << key << "'): malformed reply");
  return std::vector<char>(v.begin(), v.end());
}

void TcpStore::wait(const std::vector<std::string>& keys, const Millis& timeout) {
  if (keys.empty()) return;
  DP_CHECK(keys.size() <= wire::kMaxKeysPerRequest,
           "store wait: " << keys.size() << " keys exceed " << wire::kMaxKeysPerRequest);
  wire::Writer w(wire::kWait);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  auto start = Clock::now();
  Reply r;
  try {
    r = request(w.finish(), timeout, "store wait for " + keys_text(keys) + " on " + describe());
  } catch (const kernels::Error& e) {
    if (Clock::now() - start >= timeout)
      DP_THROW("store wait for " << keys_text(keys) << " timed out after " << timeout.count()
                                 << " ms on " << describe() << " (a rank never set them)");
    throw;
  }
  DP_CHECK(r.opcode == wire::kReady, "store wait: unexpected reply " << int(r.opcode));
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  auto frame = wire::Writer(wire::kAdd).str(key).i64(delta).finish();
  Reply r = request(frame, timeout(), "store add('" + key + "') on " + describe());
  DP_CHECK(r.opcode == wire::kInteger,
           "store add('" << key << "'): unexpected reply " << int(r.opcode));
  wire::Reader rd(r.payload.data(), r.payload.size());
  int64_t v = rd.i64();
  DP_CHECK(rd.ok() && rd.at_end(), "store add('" << key << "'): malformed reply");
  return v;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  DP_CHECK(keys.size() <= wire::kMaxKeysPerRequest,
           "store check: " << keys.size() << " keys exceed " << wire::kMaxKeysPerRequest);
  wire::Writer w(wire::kCheck);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  Reply r = request(w.finish(), timeout(), "store check " + keys_text(keys) + " on " + describe());
  DP_CHECK(r.opcode == wire::kBoolean && r.payload.size() == 1, "store check: unexpected reply");
  return r.payload[0] != 0;
}

bool TcpStore::remove(const std::string& key) {
  auto frame = wire::Writer(wire::kRemove).str(key).finish();
  Reply r = request(frame, timeout(), "store remove('" + key + "') on " + describe());
  DP_CHECK(r.opcode == wire::kBoolean && r.payload.size() == 1, "store remove: unexpected reply");
  return r.payload[0] != 0;
}

}  // namespace dp::dist
