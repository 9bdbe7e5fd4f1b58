#include "dp/distributed/device_reducers.hpp"

#include <exception>
#include <string>
#include <thread>

#include "dp/distributed/cross_node_group.hpp"
#include "dp/distributed/gloo_process_group.hpp"
#include "dp/distributed/rendezvous.hpp"
#include "dp/distributed/store.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

namespace {

// What a device's reducer owns, built before the GroupCrossNode that uses it and gone after.
struct Connection {
  std::shared_ptr<Store> store;
  std::unique_ptr<ProcessGroup> group;
};

class DeviceReducer : private Connection, public GroupCrossNode {
 public:
  DeviceReducer(Connection c, std::shared_ptr<CommHook> hook)
      : Connection(std::move(c)), GroupCrossNode(*Connection::group, std::move(hook), "DP") {}
};

}  // namespace

std::vector<std::shared_ptr<CrossNode>> device_reducers(
    int devices, const std::function<std::shared_ptr<CommHook>(int device)>& make_hook,
    std::chrono::milliseconds timeout) {
  DP_CHECK(devices >= 1, "device_reducers: " << devices << " devices");
  DP_CHECK(make_hook, "device_reducers: no hook maker");
  std::vector<std::shared_ptr<CommHook>> hooks(devices);
  for (int i = 0; i < devices; ++i) {
    hooks[i] = make_hook(i);
    DP_CHECK(hooks[i], "device_reducers: the hook maker returned no hook for device " << i);
  }
  const std::string token = fresh_job_token("dp-devices:");
  const std::string host = "127.0.0.1";
  const Millis connect = std::min<Millis>(timeout, std::chrono::seconds(60));
  std::vector<Connection> c(devices);
  c[0].store =
      std::make_shared<TcpStore>(host, 0, StoreRole::server, connect, JobIdentity{token, 0});
  const int port = static_cast<TcpStore&>(*c[0].store).port();
  for (int i = 1; i < devices; ++i)
    c[i].store =
        std::make_shared<TcpStore>(host, port, StoreRole::client, connect, JobIdentity{token, i});
  // Every rank's group connects the full mesh at once: one thread each.
  GlooOptions g;
  g.hostname = host;
  g.timeout = timeout;
  g.connect_timeout = connect;
  std::vector<std::exception_ptr> failed(devices);
  std::vector<std::thread> threads;
  for (int i = 0; i < devices; ++i)
    threads.emplace_back([&, i] {
      try {
        auto store = std::make_shared<PrefixStore>("gloo", c[i].store);
        store->set_timeout(connect);
        c[i].group = std::make_unique<GlooProcessGroup>(store, i, devices, g);
      } catch (...) {
        failed[i] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& f : failed)
    if (f) std::rethrow_exception(f);
  std::vector<std::shared_ptr<CrossNode>> out;
  for (int i = 0; i < devices; ++i)
    out.push_back(std::make_shared<DeviceReducer>(std::move(c[i]), std::move(hooks[i])));
  return out;
}

}  // namespace dp::dist
