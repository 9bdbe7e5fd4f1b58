// A rank of an mpirun job over the MPI process group (tests/mpi.cmake runs it):
//   mpirun -np N mpi_worker                 every collective against its closed form
//   mpirun -np N mpi_worker --fail-rank R   rank R throws after joining; the job must end
//   mpirun -np N mpi_worker --hang-rank R --timeout-ms T
//                                           rank R never joins an all_reduce; the others'
//                                           op must time out naming itself, and the job end
// Rank r contributes (r + 1) * (i % 13 + 1): small integers, exact in every dtype and order.
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

#include "dp/distributed/mpi_process_group.hpp"
#include "kernels/ops.hpp"

using dp::dist::ReduceOp;
using kernels::DType;
using kernels::Tensor;

namespace {

int g_checks = 0, g_failed = 0, g_rank = -1;

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  ++g_failed;
  if (g_failed <= 20) std::fprintf(stderr, "rank %d: FAILED: %s\n", g_rank, what.c_str());
}

std::vector<float> rank_values(int r, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = float((r + 1) * (i % 13 + 1));
  return v;
}

Tensor values(int r, int64_t n, DType dt) {
  if (dt == DType::i32 || dt == DType::i64 || dt == DType::u8) {
    Tensor f = Tensor::from_vector(rank_values(r, n), {n});
    std::vector<int32_t> ints(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ints[i] = static_cast<int32_t>((r + 1) * (i % 13 + 1));
    Tensor t = Tensor::empty({n}, dt, kernels::Device::cpu());
    for (int64_t i = 0; i < n; ++i) {
      if (dt == DType::i32) t.data<int32_t>()[i] = ints[i];
      if (dt == DType::i64) t.data<int64_t>()[i] = ints[i];
      if (dt == DType::u8) t.data<uint8_t>()[i] = static_cast<uint8_t>(ints[i]);
    }
    return t;
  }
  return Tensor::from_vector(rank_values(r, n), {n}, kernels::Device::cpu(), dt);
}

std::string name(const char* op, DType dt, int64_t i, float got, float want) {
  std::ostringstream os;
  os << op << " " << dt << " [" << i << "] = " << got << ", want " << want;
  return os.str();
}

void check_all_reduce(dp::dist::ProcessGroup& pg, DType dt, int64_t m) {
  int r = pg.rank(), n = pg.size();
  const float s = n * (n + 1) / 2.f;
  Tensor sum = values(r, m, dt), mn = values(r, m, dt), mx = values(r, m, dt);
  std::vector<std::shared_ptr<dp::dist::Work>> works = {pg.all_reduce(sum, ReduceOp::sum),
                                                        pg.all_reduce(mn, ReduceOp::min),
                                                        pg.all_reduce(mx, ReduceOp::max)};
  Tensor avg;
  if (kernels::is_floating(dt)) {
    avg = values(r, m, dt);
    works.push_back(pg.all_reduce(avg, ReduceOp::avg));
  }
  dp::dist::wait_all(works);
  auto hs = sum.to_host_f32(), hn = mn.to_host_f32(), hx = mx.to_host_f32();
  for (int64_t i = 0; i < m; ++i) {
    float base = float(i % 13 + 1);
    check(hs[i] == s * base, name("all_reduce(sum)", dt, i, hs[i], s * base));
    check(hn[i] == base, name("all_reduce(min)", dt, i, hn[i], base));
    check(hx[i] == n * base, name("all_reduce(max)", dt, i, hx[i], n * base));
  }
  if (avg.defined()) {
    auto ha = avg.to_host_f32();
    float tol = dt == DType::f32 ? 1e-6f : 1e-2f;  // 16-bit types round the mean
    for (int64_t i = 0; i < m; ++i) {
      float want = s * float(i % 13 + 1) / n;
      check(std::abs(ha[i] - want) <= tol * want, name("all_reduce(avg)", dt, i, ha[i], want));
    }
  }
}

int run_checks(dp::dist::ProcessGroup& pg) {
  int r = pg.rank(), n = pg.size();
  const int64_t m = 1000;
  const float s = n * (n + 1) / 2.f;
  check(pg.backend_name() == "mpi", "backend_name");
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::i32, DType::i64})
    check_all_reduce(pg, dt, m);
  check_all_reduce(pg, DType::u8, 7);  // 4 ranks x 13 x 4 would overflow u8's sum otherwise

  for (int root = 0; root < n; ++root) {  // broadcast from every root
    std::vector<float> v(m, -1.f);
    if (r == root)
      for (int64_t i = 0; i < m; ++i) v[i] = float(root * 100 + i % 50);
    Tensor t = Tensor::from_vector(v, {m});
    pg.broadcast(t, root)->wait();
    auto h = t.to_host_f32();
    for (int64_t i = 0; i < m; ++i)
      check(h[i] == float(root * 100 + i % 50), name("broadcast", DType::f32, i, h[i], 0));
  }

  for (int root = 0; root < n; ++root) {  // reduce(sum) and reduce(avg) to every root
    Tensor t = values(r, m, DType::f32), a = values(r, m, DType::f32);
    dp::dist::wait_all({pg.reduce(t, root, ReduceOp::sum), pg.reduce(a, root, ReduceOp::avg)});
    if (r != root) continue;
    auto h = t.to_host_f32(), ha = a.to_host_f32();
    for (int64_t i = 0; i < m; ++i) {
      float want = s * float(i % 13 + 1);
      check(h[i] == want, name("reduce(sum)", DType::f32, i, h[i], want));
      check(std::abs(ha[i] - want / n) <= 1e-6f * want,
            name("reduce(avg)", DType::f32, i, ha[i], want / n));
    }
  }

  {  // all_gather: rank q's block holds q's values
    Tensor in = values(r, m, DType::f32);
    Tensor out = Tensor::zeros({n * m}, DType::f32, kernels::Device::cpu());
    pg.all_gather(out, in)->wait();
    auto h = out.to_host_f32();
    for (int q = 0; q < n; ++q)
      for (int64_t i = 0; i < m; ++i) {
        float want = float((q + 1) * (i % 13 + 1));
        check(h[q * m + i] == want, name("all_gather", DType::f32, q * m + i, h[q * m + i], want));
      }
  }

  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {  // reduce_scatter: my block of the sum
    Tensor in = values(r, n * m, DType::f32);
    Tensor out = Tensor::zeros({m}, DType::f32, kernels::Device::cpu());
    pg.reduce_scatter(out, in, op)->wait();
    auto h = out.to_host_f32();
    for (int64_t i = 0; i < m; ++i) {
      float want = s * float((r * m + i) % 13 + 1) / (op == ReduceOp::avg ? n : 1);
      check(std::abs(h[i] - want) <= 1e-6f * want,
            name("reduce_scatter", DType::f32, i, h[i], want));
    }
  }

  {  // a ring of send/recv with two tags, issued before any is waited for
    int next = (r + 1) % n, prev = (r + n - 1) % n;
    Tensor a = Tensor::from_vector(std::vector<float>(m, float(r)), {m});
    Tensor b = Tensor::from_vector(std::vector<float>(m, float(r + 100)), {m});
    Tensor ra = Tensor::zeros({m}, DType::f32, kernels::Device::cpu());
    Tensor rb = Tensor::zeros({m}, DType::f32, kernels::Device::cpu());
    if (n > 1) {
      dp::dist::wait_all(
          {pg.recv(rb, prev, 7), pg.send(a, next, 3), pg.send(b, next, 7), pg.recv(ra, prev, 3)});
      check(ra.to_host_f32() == std::vector<float>(m, float(prev)), "recv tag 3");
      check(rb.to_host_f32() == std::vector<float>(m, float(prev + 100)), "recv tag 7");
      Tensor got = Tensor::zeros({m}, DType::f32, kernels::Device::cpu());
      pg.send_recv(a, next, got, prev, 9)->wait();
      check(got.to_host_f32() == std::vector<float>(m, float(prev)), "send_recv");
    }
  }

  {  // many buckets in flight at once, as DDP issues them from backward
    std::vector<Tensor> buckets;
    std::vector<std::shared_ptr<dp::dist::Work>> works;
    for (int k = 0; k < 16; ++k) {
      buckets.push_back(values(r, 100 + k, DType::f32));
      works.push_back(pg.all_reduce(buckets.back(), ReduceOp::sum));
    }
    pg.barrier()->wait();
    dp::dist::wait_all(works);
    for (int k = 0; k < 16; ++k) {
      auto h = buckets[k].to_host_f32();
      check(h[0] == s && h.back() == s * float((99 + k) % 13 + 1), "bucket " + std::to_string(k));
    }
  }

  {  // bad arguments are refused with their reason
    Tensor t = values(r, 4, DType::f32);
    bool threw = false;
    try {
      pg.broadcast(t, n);
    } catch (const std::exception& e) {
      threw = std::string(e.what()).find("root " + std::to_string(n)) != std::string::npos;
    }
    check(threw, "broadcast to a root out of range names it");
  }
  std::printf("rank %d of %d: %d checks, %d failed\n", r, n, g_checks, g_failed);
  return g_failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int fail_rank = -1, hang_rank = -1, timeout_ms = 60000;
  CLI::App app{"mpi_worker: one rank of an mpirun test job"};
  app.add_option("--fail-rank", fail_rank, "this rank throws after joining");
  app.add_option("--hang-rank", hang_rank, "this rank skips an all_reduce");
  app.add_option("--timeout-ms", timeout_ms)->check(CLI::PositiveNumber);
  std::string job_tag;
  app.add_option("--job-tag", job_tag, "ignored: lets a test find this job's processes");
  CLI11_PARSE(app, argc, argv);
  try {
    auto pg = dp::dist::make_mpi_process_group(kernels::Device::cpu(),
                                               std::chrono::milliseconds(timeout_ms));
    g_rank = pg->rank();
    if (pg->rank() == fail_rank) throw std::runtime_error("injected failure on this rank");
    Tensor t = values(pg->rank(), 8, DType::f32);
    if (hang_rank >= 0) {
      if (pg->rank() == hang_rank) {
        // Stays alive past the others' timeout without joining the op.
        std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms * 20));
        return 0;
      }
      pg->all_reduce(t, ReduceOp::sum)->wait();
      return 0;
    }
    if (fail_rank >= 0) {
      pg->all_reduce(t, ReduceOp::sum)->wait();  // never completes: the failing rank is gone
      return 0;
    }
    return run_checks(*pg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_worker: rank %d: error: %s\n", g_rank, e.what());
    return 1;
  }
}
