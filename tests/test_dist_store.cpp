// Stores: TcpStore against its StoreServer (including hostile clients), FileStore, PrefixStore.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <random>

#include "dp/distributed/socket.hpp"
#include "dp/distributed/store.hpp"
#include "dp/distributed/store_protocol.hpp"
#include "tests/test_dist_util.hpp"

using namespace dp::dist;
using namespace std::chrono_literals;
namespace wire = dp::dist::store_wire;

namespace {

std::vector<char> bytes(const std::string& s) {
  return std::vector<char>(s.begin(), s.end());
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const kernels::Error& e) {
    return e.what();
  }
  return "";
}

void check_basic_api(Store& s) {
  s.set("a", bytes("hello"));
  CHECK(s.get_string("a") == "hello");
  s.set("a", bytes("again"));  // replaces
  CHECK(s.get_string("a") == "again");
  s.set("empty", {});
  CHECK(s.get("empty").empty());
  CHECK(s.check({"a", "empty"}));
  CHECK_FALSE(s.check({"a", "nope"}));
  CHECK(s.add("counter", 5) == 5);
  CHECK(s.add("counter", -2) == 3);
  CHECK(s.get_string("counter") == "3");
  CHECK(s.remove("a"));
  CHECK_FALSE(s.remove("a"));
  CHECK_FALSE(s.check({"a"}));
  std::string binary("\0\x01\xff/key with spaces", 20);
  s.set(binary, bytes(binary));
  CHECK(s.get_string(binary) == binary);
}

// True when the server closes `fd` (end of stream or reset) within `within`.
bool closed_by_peer(int fd, std::chrono::milliseconds within) {
  auto deadline = net::Clock::now() + within;
  char buf[256];
  while (net::Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, net::millis_until(deadline)) <= 0) continue;
    ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
    if (r == 0 || (r < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

std::vector<char> header(uint8_t magic, uint8_t version, uint8_t opcode, uint32_t length) {
  std::vector<char> h(8);
  h[0] = static_cast<char>(magic);
  h[1] = static_cast<char>(version);
  h[2] = static_cast<char>(opcode);
  h[3] = 0;
  for (int i = 0; i < 4; ++i) h[4 + i] = static_cast<char>((length >> (24 - 8 * i)) & 0xff);
  return h;
}

}  // namespace

TEST_CASE("dist.socket: the local address towards a host is the source its route picks") {
  CHECK(net::local_address_towards("127.0.0.1") == "127.0.0.1");
  CHECK(net::local_address_towards("127.0.0.5") == "127.0.0.1");  // 127/8 leaves from lo's
  CHECK(net::local_address_towards("no-such-host.invalid").empty());
}

TEST_CASE("dist.socket: a free port is drawn below the ephemeral range and can be listened on") {
  const auto [first, last] = net::ephemeral_port_range();
  CHECK(first <= last);
  for (int i = 0; i < 5; ++i) {
    const int port = net::find_free_port();
    CAPTURE(port);
    if (first - net::kFirstChosenPort >= 1024) {
      CHECK(port >= net::kFirstChosenPort);
      CHECK(port < first);  // never one an outgoing connection may be given
    }
    CHECK_NOTHROW(net::listen_tcp("127.0.0.1", port, 1));
  }
}

TEST_CASE("dist.store: TcpStore set, get, add, check and remove") {
  TcpStore server_side("127.0.0.1", 0, StoreRole::server, 5s);
  REQUIRE(server_side.port() > 0);
  check_basic_api(server_side);
  TcpStore client("127.0.0.1", server_side.port(), StoreRole::client, 5s);
  CHECK(client.get_string("counter") == "3");  // one server, shared by its clients
  client.set("from_client", bytes("x"));
  CHECK(server_side.get_string("from_client") == "x");
  // add on a value that is not an integer is refused, and the connection stays usable.
  client.set("text", bytes("abc"));
  std::string err = error_of([&] { client.add("text", 1); });
  CHECK(err.find("not an integer") != std::string::npos);
  CHECK(client.add("counter", 1) == 4);
}

TEST_CASE("dist.store: get and wait time out naming the key and the timeout") {
  TcpStore store("127.0.0.1", 0, StoreRole::server, 300ms);
  auto start = std::chrono::steady_clock::now();
  std::string err = error_of([&] { store.get("never_set"); });
  auto took = std::chrono::steady_clock::now() - start;
  CHECK(err.find("never_set") != std::string::npos);
  CHECK(err.find("300 ms") != std::string::npos);
  CHECK(took >= 290ms);
  CHECK(took < 3s);
  err = error_of([&] { store.wait({"k1", "k2"}, 200ms); });
  CHECK(err.find("'k1'") != std::string::npos);
  CHECK(err.find("200 ms") != std::string::npos);
  // The client reconnects after a timed-out request.
  store.set("k1", bytes("1"));
  CHECK(store.get_string("k1") == "1");
  // A client with no server: the error names the address.
  int port = net::find_free_port();
  err = error_of([&] { TcpStore("127.0.0.1", port, StoreRole::client, 200ms); });
  CHECK(err.find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
  // A port that takes the connection and never answers (a stopped rank 0's store: its kernel
  // still accepts): the error says so and points at the store's host, within the timeout.
  net::Socket silent = net::listen_tcp("127.0.0.1", 0);
  const int silent_port = net::local_port(silent);
  start = std::chrono::steady_clock::now();
  err = error_of([&] { TcpStore("127.0.0.1", silent_port, StoreRole::client, 300ms); });
  CHECK(err.find("took the connection but did not answer this rank's hello within 300 ms") !=
        std::string::npos);
  CHECK(err.find("the process that hosts it (rank 0, or the launcher) may be stopped") !=
        std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < 3s);
}

TEST_CASE("dist.store: wait returns once another client sets the keys") {
  TcpStore a("127.0.0.1", 0, StoreRole::server, 5s);
  TcpStore b("127.0.0.1", a.port(), StoreRole::client, 5s);
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    b.set("x", bytes("1"));
    std::this_thread::sleep_for(50ms);
    b.add("y", 7);
  });
  auto start = std::chrono::steady_clock::now();
  a.wait({"x", "y"});
  CHECK(std::chrono::steady_clock::now() - start >= 140ms);
  CHECK(a.get_string("y") == "7");
  setter.join();
}

TEST_CASE("dist.store: concurrent clients add atomically") {
  TcpStore server("127.0.0.1", 0, StoreRole::server, 5s);
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t)
    threads.emplace_back([&] {
      TcpStore c("127.0.0.1", server.port(), StoreRole::client, 5s);
      for (int i = 0; i < 100; ++i) c.add("n", 1);
    });
  for (auto& t : threads) t.join();
  CHECK(server.add("n", 0) == 600);
}

TEST_CASE("dist.store: the server rejects malformed frames and keeps serving") {
  StoreServerLimits limits;
  limits.stall_timeout = 300ms;
  limits.max_pending_waits_per_connection = 4;
  StoreServer server("127.0.0.1", 0, limits);
  TcpStore good("127.0.0.1", server.port(), StoreRole::client, 5s);
  good.set("before", bytes("ok"));
  auto deadline = [] { return net::Clock::now() + 2s; };
  auto raw = [&] { return net::connect_tcp("127.0.0.1", server.port(), deadline()); };
  int rejected = 0;

  SUBCASE("random bytes") {
    std::mt19937 gen(7);
    std::vector<char> junk(4096);
    for (auto& c : junk) c = static_cast<char>(gen());
    junk[0] = 0x13;  // not the magic byte
    net::Socket s = raw();
    net::send_all(s.fd(), junk.data(), junk.size(), deadline(), "junk");
    CHECK(closed_by_peer(s.fd(), 2s));
    rejected = 1;
  }
  SUBCASE("a huge length prefix") {
    net::Socket s = raw();
    auto h = header(wire::kMagic, wire::kVersion, wire::kSet, 0xFFFFFFF0u);
    net::send_all(s.fd(), h.data(), h.size(), deadline(), "huge");
    CHECK(closed_by_peer(s.fd(), 2s));  // at once: no payload is awaited
    rejected = 1;
  }
  SUBCASE("a frame truncated by the end of the stream") {
    net::Socket s = raw();
    auto h = header(wire::kMagic, wire::kVersion, wire::kSet, 100);
    h.resize(h.size() + 10, 'x');
    net::send_all(s.fd(), h.data(), h.size(), deadline(), "truncated");
    ::shutdown(s.fd(), SHUT_WR);
    CHECK(closed_by_peer(s.fd(), 2s));
    rejected = 1;
  }
  SUBCASE("a frame that stalls") {
    net::Socket s = raw();
    auto h = header(wire::kMagic, wire::kVersion, wire::kGet, 100);
    h.resize(h.size() + 10, 'x');
    net::send_all(s.fd(), h.data(), h.size(), deadline(), "stalled");
    CHECK(good.get_string("before") == "ok");  // served while the other frame hangs
    CHECK(closed_by_peer(s.fd(), 3s));
    rejected = 1;
  }
  SUBCASE("bad version, unknown opcode, non-zero flags") {
    std::vector<std::vector<char>> frames = {header(wire::kMagic, 9, wire::kGet, 0),
                                             header(wire::kMagic, wire::kVersion, 0x42, 0),
                                             header(wire::kMagic, wire::kVersion, wire::kGet, 0)};
    frames[2][3] = 1;
    for (auto& f : frames) {
      net::Socket s = raw();
      net::send_all(s.fd(), f.data(), f.size(), deadline(), "bad header");
      CHECK(closed_by_peer(s.fd(), 2s));
    }
    rejected = 3;
  }
  SUBCASE("fields that overrun the payload") {
    // set: key length 1000 inside a 10-byte payload.
    auto f = header(wire::kMagic, wire::kVersion, wire::kSet, 10);
    const char body[10] = {0, 0, 0x03, static_cast<char>(0xe8), 'a', 'b', 'c', 'd', 'e', 'f'};
    f.insert(f.end(), body, body + 10);
    net::Socket s = raw();
    net::send_all(s.fd(), f.data(), f.size(), deadline(), "overrun");
    CHECK(closed_by_peer(s.fd(), 2s));
    rejected = 1;
  }
  SUBCASE("too many pending waits on one connection") {
    net::Socket s = raw();
    for (int i = 0; i < 5; ++i) {
      auto f = wire::Writer(wire::kWait).u32(1).str("missing" + std::to_string(i)).finish();
      net::send_all(s.fd(), f.data(), f.size(), deadline(), "waits");
    }
    CHECK(closed_by_peer(s.fd(), 2s));
    rejected = 1;
  }

  CHECK(server.rejected_connections() == rejected);
  // Old and new well-behaved clients still work.
  CHECK(good.get_string("before") == "ok");
  good.set("after", bytes("fine"));
  TcpStore fresh("127.0.0.1", server.port(), StoreRole::client, 5s);
  CHECK(fresh.get_string("after") == "fine");
  CHECK(fresh.add("c", 2) == 2);
}

TEST_CASE("dist.store: FileStore set, get, add, wait with timeout") {
  std::string dir = dist_test::make_temp_dir("filestore") + "/nested/store";
  FileStore s(dir, 2s);
  check_basic_api(s);
  FileStore other(dir, 2s);  // a second handle on the same directory sees the same keys
  CHECK(other.get_string("counter") == "3");
  std::string long_key(600, 'k');
  s.set(long_key, bytes("long"));
  CHECK(other.get_string(long_key) == "long");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      FileStore f(dir, 2s);
      for (int i = 0; i < 25; ++i) f.add("shared", 1);
    });
  for (auto& t : threads) t.join();
  CHECK(s.add("shared", 0) == 100);
  auto start = std::chrono::steady_clock::now();
  std::string err = error_of([&] { s.wait({"nope"}, 150ms); });
  CHECK(err.find("'nope'") != std::string::npos);
  CHECK(err.find("150 ms") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start >= 140ms);
}

TEST_CASE("dist.store: PrefixStore keeps namespaces apart") {
  auto base = std::make_shared<TcpStore>("127.0.0.1", 0, StoreRole::server, 2s);
  PrefixStore a("a", base), b("b", base);
  a.set("k", bytes("1"));
  b.set("k", bytes("2"));
  CHECK(a.get_string("k") == "1");
  CHECK(b.get_string("k") == "2");
  CHECK(base->get_string("a/k") == "1");
  CHECK(a.add("n", 3) == 3);
  CHECK_FALSE(b.check({"n"}));
  CHECK(a.check({"k", "n"}));
  a.set_timeout(100ms);
  std::string err = error_of([&] { a.get("missing"); });
  CHECK(err.find("a/missing") != std::string::npos);
}

TEST_CASE("dist.store: a client of another job is refused and the job's keys stay untouched") {
  TcpStore ours("127.0.0.1", 0, StoreRole::server, 5s, JobIdentity{"job-a", 0});
  ours.set("weights", bytes("A"));
  TcpStore peer("127.0.0.1", ours.port(), StoreRole::client, 5s, JobIdentity{"job-a", 1});
  CHECK(peer.get_string("weights") == "A");

  // A rank of job B, with its own token: refused at connect, before any request.
  std::string e = error_of([&] {
    TcpStore("127.0.0.1", ours.port(), StoreRole::client, 5s, JobIdentity{"job-b", 1});
  });
  CHECK_MESSAGE(e.find("belongs to another job") != std::string::npos, e);
  CHECK_MESSAGE(e.find("MASTER_PORT") != std::string::npos, e);
  // A client without the token's hello (an old or foreign client): its set never lands.
  auto deadline = [] { return net::Clock::now() + 2s; };
  net::Socket s = net::connect_tcp("127.0.0.1", ours.port(), deadline());
  auto frame = wire::Writer(wire::kSet).str("weights").str("B").finish();
  net::send_all(s.fd(), frame.data(), frame.size(), deadline(), "set");
  char h[wire::kHeaderBytes];
  net::recv_all(s.fd(), h, sizeof h, deadline(), "reply");
  CHECK(wire::parse_header(h).opcode == wire::kError);
  CHECK(closed_by_peer(s.fd(), 2s));

  CHECK(ours.get_string("weights") == "A");  // the running job is undisturbed
  CHECK(peer.add("step", 1) == 1);
  CHECK(ours.server()->rejected_connections() == 2);
  // An empty token on our side cannot pass either.
  e = error_of([&] { TcpStore("127.0.0.1", ours.port(), StoreRole::client, 5s); });
  CHECK_MESSAGE(e.find("belongs to another job") != std::string::npos, e);
}
