// Gloo collectives with ranks as threads of this process (each its own store client and Gloo
// context on 127.0.0.1), checked against closed forms: rank r contributes multiples of r+1.
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "dp/distributed/gloo_process_group.hpp"
#include "kernels/ops.hpp"
#include "kernels/runtime/graph.hpp"
#include "tests/test_dist_util.hpp"

using namespace dp::dist;
using namespace std::chrono_literals;
using kernels::DType;
using kernels::Tensor;

namespace {

// x_i = (r + 1) * (i % 13 + 1): small integers, exact in f32 for every reduction order.
std::vector<float> rank_values(int r, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = float((r + 1) * (i % 13 + 1));
  return v;
}

void check_collectives(int n) {
  const int64_t m = 1000;
  dist_test::run_ranks(n, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, n, store);
    RANK_CHECK(pg->rank() == r && pg->size() == n && pg->backend_name() == "gloo", "identity");
    const float s = n * (n + 1) / 2.f;

    // all_reduce: sum, avg, min, max issued together, waited together.
    Tensor sum = Tensor::from_vector(rank_values(r, m), {m});
    Tensor avg = Tensor::from_vector(rank_values(r, m), {m});
    Tensor mn = Tensor::from_vector(rank_values(r, m), {m});
    Tensor mx = Tensor::from_vector(rank_values(r, m), {m});
    wait_all({pg->all_reduce(sum, ReduceOp::sum), pg->all_reduce(avg, ReduceOp::avg),
              pg->all_reduce(mn, ReduceOp::min), pg->all_reduce(mx, ReduceOp::max)});
    auto hs = sum.to_host_f32(), ha = avg.to_host_f32(), hn = mn.to_host_f32(),
         hx = mx.to_host_f32();
    for (int64_t i = 0; i < m; ++i) {
      float base = float(i % 13 + 1);
      RANK_CHECK(hs[i] == s * base, "sum[" << i << "] = " << hs[i]);
      RANK_CHECK(std::abs(ha[i] - s * base / n) <= 1e-5f * s * base,
                 "avg[" << i << "] = " << ha[i]);
      RANK_CHECK(hn[i] == base, "min[" << i << "] = " << hn[i]);
      RANK_CHECK(hx[i] == n * base, "max[" << i << "] = " << hx[i]);
    }
    // order_stream (Gloo: a wait): a read after it sees the sum; wait() after it returns.
    Tensor again = Tensor::from_vector(rank_values(r, m), {m});
    auto work = pg->all_reduce(again, ReduceOp::sum);
    work->order_stream();
    RANK_CHECK(work->is_completed() && again.to_host_f32() == hs, "order_stream then read");
    work->wait();

    // broadcast from every root in turn.
    for (int root = 0; root < n; ++root) {
      std::vector<float> v(m, -1.f);
      if (r == root)
        for (int64_t i = 0; i < m; ++i) v[i] = float(root * 100 + i % 50);
      Tensor t = Tensor::from_vector(v, {m});
      pg->broadcast(t, root)->wait();
      auto h = t.to_host_f32();
      for (int64_t i = 0; i < m; ++i)
        RANK_CHECK(h[i] == float(root * 100 + i % 50),
                   "broadcast from " << root << " [" << i << "]");
    }

    // reduce to the last rank.
    Tensor red = Tensor::from_vector(rank_values(r, m), {m});
    pg->reduce(red, n - 1, ReduceOp::sum)->wait();
    if (r == n - 1) {
      auto h = red.to_host_f32();
      for (int64_t i = 0; i < m; ++i)
        RANK_CHECK(h[i] == s * float(i % 13 + 1), "reduce[" << i << "]");
    }

    // all_gather: rank q's block holds q * 10 + j.
    const int64_t k = 7;
    std::vector<float> mine(k);
    for (int64_t j = 0; j < k; ++j) mine[j] = float(r * 10 + j);
    Tensor in = Tensor::from_vector(mine, {k});
    Tensor out = Tensor::from_vector(std::vector<float>(n * k, -1.f), {n * k});
    pg->all_gather(out, in)->wait();
    auto ho = out.to_host_f32();
    for (int q = 0; q < n; ++q)
      for (int64_t j = 0; j < k; ++j)
        RANK_CHECK(ho[q * k + j] == float(q * 10 + j), "all_gather[" << q << ", " << j << "]");

    // reduce_scatter: in[c] = (r + 1) * (c + 1); rank r keeps sum_q (q + 1) * (r k + j + 1).
    std::vector<float> full(n * k);
    for (int64_t c = 0; c < n * k; ++c) full[c] = float((r + 1) * (c + 1));
    Tensor rs_in = Tensor::from_vector(full, {n * k});
    Tensor rs_out = Tensor::from_vector(std::vector<float>(k, -1.f), {k});
    Tensor rs_avg = Tensor::from_vector(std::vector<float>(k, -1.f), {k});
    wait_all({pg->reduce_scatter(rs_out, rs_in, ReduceOp::sum),
              pg->reduce_scatter(rs_avg, rs_in, ReduceOp::avg)});
    auto hr = rs_out.to_host_f32(), hra = rs_avg.to_host_f32();
    for (int64_t j = 0; j < k; ++j) {
      RANK_CHECK(hr[j] == s * float(r * k + j + 1), "reduce_scatter[" << j << "] = " << hr[j]);
      RANK_CHECK(std::abs(hra[j] - s * float(r * k + j + 1) / n) < 1e-4f, "reduce_scatter avg");
    }

    // A ring of sends and receives, twice: separate ops, then send_recv.
    int next = (r + 1) % n, prev = (r + n - 1) % n;
    Tensor to_next = Tensor::from_vector(std::vector<float>(m, float(r)), {m});
    Tensor from_prev = Tensor::from_vector(std::vector<float>(m, -1.f), {m});
    auto sw = pg->send(to_next, next, 7);
    auto rw = pg->recv(from_prev, prev, 7);
    rw->wait();
    sw->wait();
    RANK_CHECK(rw->is_completed() && sw->is_completed(), "p2p completion");
    for (float v : from_prev.to_host_f32()) RANK_CHECK(v == float(prev), "recv got " << v);
    Tensor back = Tensor::from_vector(std::vector<float>(m, -1.f), {m});
    pg->send_recv(from_prev, prev, back, next, 8)->wait();  // send it back the other way
    for (float v : back.to_host_f32()) RANK_CHECK(v == float(r), "send_recv got " << v);

    // Integer all_reduce.
    std::vector<int32_t> iv(5, r + 1);
    Tensor it = Tensor::from_ints(iv, {5});
    pg->all_reduce(it, ReduceOp::sum)->wait();
    for (int32_t v : it.to_host_i32()) RANK_CHECK(v == int32_t(s), "i32 sum " << v);

    pg->barrier()->wait();
  });
}

}  // namespace

TEST_CASE("dist.collectives: every op on 2 ranks") {
  check_collectives(2);
}
TEST_CASE("dist.collectives: every op on 3 ranks") {
  check_collectives(3);
}
TEST_CASE("dist.collectives: every op on 4 ranks") {
  check_collectives(4);
}

TEST_CASE("dist.collectives: bucketed all_reduce(avg) on views of one flat buffer") {
  // What a DDP reducer does: async all_reduce per bucket slice, in a fixed order, then wait.
  const int n = 3;
  const int64_t total = 100003;
  dist_test::run_ranks(n, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, n, store);
    Tensor grads = Tensor::from_vector(rank_values(r, total), {total});
    std::vector<std::pair<int64_t, int64_t>> buckets = {{70000, 30003}, {20000, 50000}, {0, 20000}};
    std::vector<Tensor> views;
    std::vector<std::shared_ptr<Work>> works;
    for (auto [off, len] : buckets) {
      views.push_back(grads.view(off, {len}));
      works.push_back(pg->all_reduce(views.back(), ReduceOp::avg));
    }
    wait_all(works);
    for (auto& w : works) RANK_CHECK(w->is_completed(), "bucket done");
    auto h = grads.to_host_f32();
    const float mean_scale = (n + 1) / 2.f;
    for (int64_t i = 0; i < total; ++i)
      RANK_CHECK(std::abs(h[i] - mean_scale * float(i % 13 + 1)) < 1e-5f,
                 "grad[" << i << "] = " << h[i]);
  });
}

TEST_CASE("dist.collectives: a group of one rank") {
  dist_test::run_ranks(1, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, 1, store);
    Tensor t = Tensor::from_vector({1, 2, 3}, {3});
    wait_all({pg->all_reduce(t, ReduceOp::avg), pg->broadcast(t, 0), pg->barrier()});
    Tensor out = Tensor::from_vector({0, 0, 0}, {3});
    pg->all_gather(out, t)->wait();
    RANK_CHECK(out.to_host_f32() == std::vector<float>({1, 2, 3}), "all_gather of one");
  });
}

TEST_CASE("dist.collectives: a collective one rank never joins times out naming the op") {
  const int n = 3;
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::vector<std::string> errors(n);
  dist_test::run_ranks(n, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, n, store);
    if (r == 2) {
      // Never joins; stays alive (connected) until the others gave up.
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return finished == 2; });
      return;
    }
    pg->set_timeout(2s);
    Tensor t = Tensor::from_vector(std::vector<float>(64, 1.f), {64});
    auto start = std::chrono::steady_clock::now();
    auto work = pg->all_reduce(t, ReduceOp::sum);
    try {
      work->wait();
    } catch (const kernels::Error& e) {
      errors[r] = e.what();
    }
    auto took = std::chrono::steady_clock::now() - start;
    RANK_CHECK(took >= 1900ms && took < 10s,
               "timed out after " << std::chrono::duration<double>(took).count() << " s");
    RANK_CHECK(work->is_completed(), "a failed work is completed");
    // The group is broken now: the next op fails at once, naming the first failure.
    Tensor u = t;
    std::string again;
    try {
      pg->barrier()->wait();
    } catch (const kernels::Error& e) {
      again = e.what();
    }
    RANK_CHECK(again.find("broken") != std::string::npos, "second op: " << again);
    std::lock_guard<std::mutex> lock(mu);
    ++finished;
    cv.notify_all();
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK(errors[r].find("all_reduce") != std::string::npos);
    CHECK(errors[r].find("2000 ms") != std::string::npos);
    CHECK(errors[r].find("rank " + std::to_string(r) + " of 3") != std::string::npos);
  }
}

TEST_CASE("dist.collectives: a rank that leaves names its recorded failure in its peer's error") {
  // Rank 1 leaves while rank 0 needs it in an all-reduce: first without a word (its group
  // destroyed, as in a process that died), then after recording why (record_failure; abort
  // records too, but only the first note stays). Rank 0's error says what it can, whether its op
  // was waiting when rank 1 closed or starts after (`late`: Gloo then finds its end closed).
  auto peer_error = [&](bool record, bool late) {
    std::string error;
    dist_test::run_ranks(2, [&](int r, std::shared_ptr<Store> store) {
      auto pg = dist_test::gloo_group(r, 2, store, 20s);
      if (r == 1) {
        if (record) {
          pg->record_failure("DdpTrainer step 3: the batch of shard 7 is empty");
          pg->abort("leaving");
        }
        pg.reset();  // closes its connections
        store->set_string("test/closed", "1");
        return;
      }
      if (late) {
        store->wait({"test/closed"});
        std::this_thread::sleep_for(200ms);  // Gloo's loop sees the close before the op
      }
      Tensor t = Tensor::from_vector(std::vector<float>(64, 1.f), {64});
      try {
        pg->all_reduce(t, ReduceOp::sum)->wait();
      } catch (const kernels::Error& e) {
        error = e.what();
      }
      // A rank whose own op failed records nothing: the first note stays rank 1's.
      pg->record_failure("a later failure");
      if (record)
        RANK_CHECK(store->add("dp/default/gloo/failed/count", 0) == 2,
                   "only rank 1 counted (its note and its abort's)");
    });
    return error;
  };
  for (bool late : {false, true}) {
    const std::string silent = peer_error(false, late), said = peer_error(true, late);
    CAPTURE(late);
    CAPTURE(silent);
    CAPTURE(said);
    CHECK(silent.find("all_reduce") != std::string::npos);
    CHECK(silent.find("rank 0 of 2") != std::string::npos);
    CHECK(silent.find("a peer rank closed its connection") != std::string::npos);
    CHECK(said.find("rank 0 of 2") != std::string::npos);
    CHECK(said.find("(rank 1 failed first: DdpTrainer step 3: the batch of shard 7 is empty)") !=
          std::string::npos);
    CHECK(said.find("a peer rank closed its connection") == std::string::npos);
  }
}

TEST_CASE(
    "dist.collectives: a failed rank 0 keeps the store it hosts until its peer read its note") {
  // Rank 0 hosts the store (init_method tcp://, as under torchrun, mpirun or Slurm), records its
  // failure, leaves and destroys its group at once; rank 1's all-reduce starts 300 ms later.
  // Its error still names rank 0's note: rank 0's group waited for the read (at most 2 s)
  // before the store went with it.
  const int port = net::find_free_port();
  std::string error, failures[2];
  double teardown_ms = -1;
  auto run = [&](int r) {
    InitOptions o;
    o.backend = Backend::gloo;
    o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    o.rank = r;
    o.world_size = 2;
    o.timeout = 20s;
    o.gloo_hostname = "127.0.0.1";
    std::unique_ptr<ProcessGroup> pg = init_process_group(o);
    if (r == 0) {
      pg->abort("DdpTrainer step 3: out of memory");
      const auto t0 = std::chrono::steady_clock::now();
      pg.reset();
      teardown_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      return;
    }
    std::this_thread::sleep_for(300ms);
    Tensor t = Tensor::from_vector(std::vector<float>(64, 1.f), {64});
    try {
      pg->all_reduce(t, ReduceOp::sum)->wait();
    } catch (const kernels::Error& e) {
      error = e.what();
    }
  };
  auto rank = [&](int r) {
    try {
      run(r);
    } catch (const std::exception& e) {
      failures[r] = e.what();
    }
  };
  std::thread r0(rank, 0), r1(rank, 1);
  r0.join();
  r1.join();
  CHECK(failures[0].empty());
  CHECK(failures[1].empty());
  CAPTURE(error);
  CHECK(error.find("rank 1 of 2") != std::string::npos);
  CHECK(error.find("(rank 0 failed first: DdpTrainer step 3: out of memory)") != std::string::npos);
  CHECK(teardown_ms >= 200);  // it waited for the read
  CHECK(teardown_ms < 2500);  // and no longer than its bound
}

TEST_CASE("dist.collectives: rendezvous times out when a rank never arrives") {
  StoreServer server("127.0.0.1", 0);
  auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), StoreRole::client, 5s);
  std::string err;
  auto start = std::chrono::steady_clock::now();
  try {
    dist_test::gloo_group(0, 2, store, 1s);  // rank 1 never comes
  } catch (const kernels::Error& e) {
    err = e.what();
  }
  INFO(err);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  CHECK(err.find("rank 1 of 2 never joined within 1 s") != std::string::npos);
}

TEST_CASE("dist.collectives: bad arguments throw at issue, naming the op") {
  dist_test::run_ranks(2, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, 2, store);
    Tensor a = Tensor::from_vector({1, 2, 3}, {3});
    Tensor b = Tensor::from_vector({1, 2, 3, 4, 5}, {5});
    auto throws = [](auto&& f, const char* needle) {
      try {
        f();
      } catch (const kernels::Error& e) {
        return std::string(e.what()).find(needle) != std::string::npos;
      }
      return false;
    };
    RANK_CHECK(throws([&] { pg->all_gather(b, a); }, "all_gather"), "all_gather shape");
    RANK_CHECK(throws([&] { pg->reduce_scatter(a, b); }, "reduce_scatter"), "reduce_scatter shape");
    RANK_CHECK(throws([&] { pg->broadcast(a, 2); }, "root 2"), "broadcast root");
    RANK_CHECK(throws([&] { pg->send(a, r); }, "send"), "send to self");
    Tensor i = Tensor::from_ints({1, 2}, {2});
    RANK_CHECK(throws([&] { pg->all_reduce(i, ReduceOp::avg); }, "avg"), "avg of ints");
    RANK_CHECK(throws([&] { pg->set_timeout(0ms); }, "timeout"), "zero timeout");
    // The group still works after refused calls.
    pg->all_reduce(a)->wait();
    RANK_CHECK(a.to_host_f32() == std::vector<float>({2, 4, 6}), "after errors");
  });
}

TEST_CASE("dist.collectives: backend auto picks gloo for CPU tensors, nccl on CPU is refused") {
  dist_test::run_ranks(2, [&](int r, std::shared_ptr<Store> store) {
    InitOptions o;
    o.backend = Backend::auto_select;
    o.rank = r;
    o.world_size = 2;
    o.store = store;
    o.group_name = "auto";
    o.gloo_hostname = "127.0.0.1";
    auto pg = init_process_group(o);
    RANK_CHECK(pg->backend_name() == "gloo", "auto chose " << pg->backend_name());
    o.backend = Backend::nccl;
    o.group_name = "nccl";
    std::string err;
    try {
      init_process_group(o);
    } catch (const kernels::Error& e) {
      err = e.what();
    }
    RANK_CHECK(err.find("nccl") != std::string::npos, "nccl on CPU: " << err);
  });
}

TEST_CASE("dist.collectives: queued all-reduces overlap later work, and a CPU graph replays them") {
  // all_reduce_queued returns at once; the work queued after it runs while the op is in
  // flight; join_queued ends them all. While a CPU device's graph captures, both are recorded
  // (run nothing) and each replay runs them again: after two replays of x -> 2 * sum, 2 ranks
  // hold 2 * (2 * (2 * (r0 + r1))).
  dist_test::run_ranks(2, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, 2, store);
    const kernels::Device cpu = kernels::Device::cpu();
    RANK_CHECK(pg->collectives_capturable(cpu), "CPU graphs hold any backend's collectives");
    RANK_CHECK(!pg->collectives_capturable(kernels::Device::cuda(0)), "Gloo on a GPU: no");
    Tensor a = Tensor::from_vector(rank_values(r, 100), {100});
    Tensor b = Tensor::from_vector(std::vector<float>(7, float(r + 1)), {7});
    Tensor c = Tensor::from_vector(std::vector<float>(5, 1.f), {5});
    pg->all_reduce_queued(a, ReduceOp::sum);
    pg->all_reduce_queued(b, ReduceOp::max);
    kernels::fill(c, 4.f);  // work between: the ops are in flight
    pg->join_queued(cpu);
    std::vector<float> want = rank_values(0, 100), other = rank_values(1, 100);
    for (size_t i = 0; i < want.size(); ++i) want[i] += other[i];
    RANK_CHECK(a.to_host_f32() == want, "queued sum");
    RANK_CHECK(b.to_host_f32() == std::vector<float>(7, 2.f), "queued max");
    RANK_CHECK(c.to_host_f32() == std::vector<float>(5, 4.f), "the work between");

    kernels::DeviceContext& ctx = kernels::context(cpu);
    Tensor x = Tensor::from_vector({float(r + 1)}, {1});
    kernels::Graph graph;
    graph.capture(ctx, [&] {
      pg->all_reduce_queued(x, ReduceOp::sum);
      pg->join_queued(cpu);
      kernels::scale(x, x, 2.f);
    });
    RANK_CHECK(x.to_host_f32()[0] == float(r + 1), "a capture runs nothing");
    graph.replay();
    RANK_CHECK(x.to_host_f32()[0] == 6.f, "one replay: 2 * (1 + 2)");
    graph.replay();
    RANK_CHECK(x.to_host_f32()[0] == 24.f, "two replays: 2 * (6 + 6)");
  });
}

// NCCL needs one GPU per rank; at one rank it runs anywhere a GPU is, and proves the build's
// NCCL loads, initialises and runs a collective and a broadcast on the rank's stream.
TEST_CASE("dist.collectives: CUDA tensors through NCCL at one rank, queued ops in a CUDA graph") {
  DP_REQUIRE_GPU();
  dist_test::run_ranks(1, [&](int r, std::shared_ptr<Store> store) {
    InitOptions o;
    o.backend = Backend::nccl;
    o.rank = r;
    o.world_size = 1;
    o.store = store;
    o.group_name = "nccl1";
    o.device = kernels::Device::cuda(0);
    auto pg = init_process_group(o);
    RANK_CHECK(pg->backend_name() == "nccl", "backend " << pg->backend_name());
    Tensor t = Tensor::from_vector(rank_values(r, 1000), {1000}, o.device);
    pg->all_reduce(t, ReduceOp::sum)->wait();
    std::vector<float> want = rank_values(r, 1000), got = t.to_host_f32();
    RANK_CHECK(got == want, "nccl sum at one rank is the identity");
    // order_stream: the stream waits for the op (not the host); a read queued after it sees it.
    auto work = pg->all_reduce(t, ReduceOp::sum);
    work->order_stream();
    RANK_CHECK(t.to_host_f32() == want, "a read after order_stream");
    work->wait();
    RANK_CHECK(work->is_completed(), "completed once waited");
    pg->broadcast(t, 0)->wait();
    RANK_CHECK(t.to_host_f32() == want, "nccl broadcast at one rank");

    // Queued all-reduces in a CUDA graph (what DDP's graphed backward does): NCCL's op on the
    // group's stream, forked from the rank's stream after the work before it and joined back
    // before the work after it; captured, not run, then replayed. At one rank avg divides by 1,
    // so the values tell the order: x2 before the op, +1 after it.
    RANK_CHECK(pg->collectives_capturable(o.device), "nccl holds its collectives in a graph");
    RANK_CHECK(!pg->collectives_capturable(kernels::Device::cpu()), "not on another device");
    kernels::DeviceContext& ctx = kernels::context(o.device);
    Tensor q = Tensor::from_vector(std::vector<float>(1000, 1.f), {1000}, o.device);
    Tensor ones = Tensor::from_vector(std::vector<float>(1000, 1.f), {1000}, o.device);
    auto body = [&] {
      kernels::scale(q, q, 2.f);
      pg->all_reduce_queued(q, ReduceOp::avg);
      pg->join_queued(o.device);
      kernels::axpy(q, 1.f, ones);
    };
    body();  // uncaptured: 3
    kernels::Graph graph;
    graph.capture(ctx, body);
    RANK_CHECK(q.to_host_f32() == std::vector<float>(1000, 3.f), "a capture runs nothing");
    graph.replay();
    graph.replay();
    RANK_CHECK(q.to_host_f32() == std::vector<float>(1000, 15.f), "two replays: 7, then 15");
    pg->all_reduce(q, ReduceOp::sum)->wait();  // the group goes on after its captured ops
    RANK_CHECK(q.to_host_f32() == std::vector<float>(1000, 15.f), "an op after the replays");
  });
}

TEST_CASE(
    "dist.collectives: CUDA tensors through Gloo (ranks sharing one GPU), refused in a CUDA "
    "graph") {
  DP_REQUIRE_GPU();
  dist_test::run_ranks(2, [&](int r, std::shared_ptr<Store> store) {
    auto pg = dist_test::gloo_group(r, 2, store);
    kernels::Device dev = kernels::Device::cuda(0);
    Tensor t = Tensor::from_vector(rank_values(r, 1000), {1000}, dev);
    pg->all_reduce(t, ReduceOp::sum)->wait();
    auto h = t.to_host_f32();
    for (int64_t i = 0; i < 1000; ++i) RANK_CHECK(h[i] == 3.f * float(i % 13 + 1), "cuda sum");
    Tensor b = Tensor::from_vector(std::vector<float>(10, float(r)), {10}, dev);
    pg->broadcast(b, 1)->wait();
    for (float v : b.to_host_f32()) RANK_CHECK(v == 1.f, "cuda broadcast");
    Tensor x = Tensor::from_vector(std::vector<float>(10, float(r + 5)), {10}, dev);
    Tensor y = Tensor::from_vector(std::vector<float>(10, -1.f), {10}, dev);
    pg->send_recv(x, 1 - r, y, 1 - r, 3)->wait();
    for (float v : y.to_host_f32()) RANK_CHECK(v == float(1 - r + 5), "cuda send_recv");
    // Pooled pinned staging reused across sizes (a small message in a larger buffer, then a
    // larger one than any before): the data stays right.
    for (int64_t n : {int64_t{4096}, int64_t{7}, int64_t{5000}, int64_t{4096}}) {
      Tensor xs = Tensor::from_vector(std::vector<float>(n, float(10 * r + n % 9)), {n}, dev);
      Tensor ys = Tensor::from_vector(std::vector<float>(n, -1.f), {n}, dev);
      pg->send_recv(xs, 1 - r, ys, 1 - r, 4)->wait();
      for (float v : ys.to_host_f32())
        RANK_CHECK(v == float(10 * (1 - r) + n % 9), "cuda send_recv through the staging pool");
    }
    // A CUDA graph cannot hold Gloo's collectives: a queued one is refused while it captures,
    // naming the backend, and the context and the group stay usable.
    RANK_CHECK(!pg->collectives_capturable(dev), "gloo on a GPU holds no collective in a graph");
    std::string refused;
    kernels::Graph graph;
    try {
      graph.capture(kernels::context(dev), [&] { pg->all_reduce_queued(t, ReduceOp::sum); });
    } catch (const kernels::Error& e) {
      refused = e.what();
    }
    RANK_CHECK(refused.find("gloo all_reduce") != std::string::npos &&
                   refused.find("cannot hold") != std::string::npos,
               "refused: " << refused);
    RANK_CHECK(!graph.captured(), "nothing captured");
    pg->all_reduce_queued(t, ReduceOp::sum);  // uncaptured: fine
    pg->join_queued(dev);
    for (float v : t.to_host_f32()) RANK_CHECK(v > 0.f, "a queued op after the refusal");
  });
}
