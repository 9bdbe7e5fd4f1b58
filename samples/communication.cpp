// communication: the collectives of dp::dist, one at a time, across worker processes that
// this program launches itself, then a hand-written ring all-reduce next to the library's.
//
//   bin/communication --nproc 4
//   bin/communication --nproc 2 --elements 1048576 --backend auto --device cuda
//
// Without RANK/WORLD_SIZE in its environment the program is the launcher: it re-runs itself
// --nproc times with those variables set (dp::dist::launch_workers). Each worker joins one
// process group (env:// rendezvous), and every step prints what each rank holds, one line
// per rank, in rank order.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "dp/cli/cli.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/distributed/process_group.hpp"
#include "kernels/ops.hpp"

using dp::dist::ProcessGroup;
using dp::dist::ReduceOp;
using dp::dist::Work;
using kernels::Device;
using kernels::Tensor;

namespace {

struct Flags {
  int nproc = 2;
  std::string backend = "gloo";
  std::string device = "cpu";
  int64_t elements = int64_t(4) << 20;  // 4M floats: 16 MiB per buffer
  int64_t chunk = int64_t(1) << 18;     // ring pipeline chunk (elements)
  int reps = 5;
};

std::string str(const Tensor& t) {
  std::ostringstream os;
  os << "[";
  auto v = t.to_host_f32();
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

// Prints one line per rank, in rank order. The barriers only order the output of processes
// sharing one terminal; nothing else depends on them.
void print_in_rank_order(ProcessGroup& pg, const std::string& line) {
  for (int r = 0; r < pg.size(); ++r) {
    if (r == pg.rank()) {
      std::printf("[rank %d] %s\n", pg.rank(), line.c_str());
      std::fflush(stdout);
    }
    pg.barrier()->wait();
  }
}

// ---- the hand-written ring all-reduce ---------------------------------------------------------

// Segment s of n over N elements: [N s / n, N (s + 1) / n), as balanced as it gets.
int64_t segment_begin(int64_t N, int n, int s) {
  return N * s / n;
}

// Chunk c of segment s, or an empty range past its end. Both neighbours compute the same
// chunking for a segment, so each chunk's send and receive match in size.
std::pair<int64_t, int64_t> chunk_range(int64_t N, int n, int s, int64_t chunk, int64_t c) {
  int64_t b = segment_begin(N, n, s), e = segment_begin(N, n, s + 1);
  int64_t cb = std::min(e, b + c * chunk), ce = std::min(e, cb + chunk);
  return {cb, ce};
}

int64_t n_chunks(int64_t N, int n, int s, int64_t chunk) {
  int64_t len = segment_begin(N, n, s + 1) - segment_begin(N, n, s);
  return (len + chunk - 1) / chunk;
}

// buf = sum over ranks, by the textbook ring: n-1 reduce-scatter steps (at step k rank r sends
// segment r-k to its right neighbour and adds segment r-k-1 coming from its left), then n-1
// all-gather steps (rank r forwards the finished segment r+1-k). Every step moves its segments
// in chunks, all in flight at once; a received chunk is added while later ones still travel.
// Each rank sends 2 (n-1)/n of the buffer: the bandwidth-optimal all-reduce.
void ring_all_reduce(ProcessGroup& pg, Tensor& buf, Tensor& scratch, int64_t chunk) {
  const int n = pg.size(), r = pg.rank();
  if (n == 1) return;
  const int64_t N = buf.numel();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int phase = 0; phase < 2; ++phase) {
    for (int k = 0; k < n - 1; ++k) {
      // reduce-scatter: send r-k, receive r-k-1 (added in); all-gather: send r+1-k, receive r-k.
      int s_send = ((phase == 0 ? r - k : r + 1 - k) % n + n) % n;
      int s_recv = ((phase == 0 ? r - k - 1 : r - k) % n + n) % n;
      int64_t chunks = std::max(n_chunks(N, n, s_send, chunk), n_chunks(N, n, s_recv, chunk));
      std::vector<std::shared_ptr<Work>> works;
      std::vector<Tensor> targets, received;
      for (int64_t c = 0; c < chunks; ++c) {
        auto [sb, se] = chunk_range(N, n, s_send, chunk, c);
        auto [rb, re] = chunk_range(N, n, s_recv, chunk, c);
        uint32_t tag = (uint32_t(phase) << 28) | (uint32_t(k) << 20) | uint32_t(c);
        Tensor out = buf.view(sb, {se - sb});
        // Reduce-scatter receives into scratch (then adds); all-gather straight into buf.
        Tensor in = phase == 0 ? scratch.view(rb - segment_begin(N, n, s_recv), {re - rb})
                               : buf.view(rb, {re - rb});
        if (se > sb && re > rb)
          works.push_back(pg.send_recv(out, next, in, prev, tag));
        else if (se > sb)
          works.push_back(pg.send(out, next, tag));
        else
          works.push_back(pg.recv(in, prev, tag));
        targets.push_back(buf.view(rb, {re - rb}));
        received.push_back(in);
      }
      for (size_t c = 0; c < works.size(); ++c) {
        works[c]->wait();
        if (phase == 0 && targets[c].numel() > 0) kernels::axpy(targets[c], 1.f, received[c]);
      }
    }
  }
}

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run_worker(const Flags& f, const dp::dist::WorkerEnv& env) {
  dp::dist::InitOptions o;
  o.backend = dp::dist::parse_backend(f.backend);
  o.device = f.device == "cuda" ? Device::cuda(env.local_rank) : Device::cpu();
  o.timeout = std::chrono::seconds(60);
  auto pg = dp::dist::init_process_group(o);
  const int r = pg->rank(), n = pg->size();
  const Device dev = o.device;
  if (r == 0)
    std::printf("%d ranks, backend %s, tensors on %s\n", n, pg->backend_name().c_str(),
                f.device.c_str());

  // 1. send/recv along a chain: rank 0 starts with [1, 2, 3, 4]; every other rank receives
  //    from its left neighbour, adds 1 and passes it on to its right.
  Tensor t = Tensor::from_vector(std::vector<float>(4, 0.f), {4}, dev);
  if (r == 0)
    t = Tensor::from_vector({1, 2, 3, 4}, {4}, dev);
  else
    pg->recv(t, r - 1, 0)->wait();
  if (r > 0) {
    Tensor one = Tensor::from_vector(std::vector<float>(4, 1.f), {4}, dev);
    kernels::axpy(t, 1.f, one);
  }
  if (r + 1 < n) pg->send(t, r + 1, 0)->wait();
  print_in_rank_order(*pg, "after send/recv (chain 0 -> 1 -> ..., +1 per hop): " + str(t));

  // 2. broadcast from rank 0: everyone ends up with rank 0's [0, 1, 2, 3].
  std::vector<float> mine(4);
  for (int i = 0; i < 4; ++i) mine[i] = float(r * 10 + i);
  Tensor b = Tensor::from_vector(mine, {4}, dev);
  pg->broadcast(b, 0)->wait();
  print_in_rank_order(*pg, "after broadcast from rank 0 (each held [10r .. 10r+3]): " + str(b));

  // 3. all_reduce(sum) of [r+1, r+1]: everyone holds n(n+1)/2.
  Tensor s = Tensor::from_vector({float(r + 1), float(r + 1)}, {2}, dev);
  pg->all_reduce(s, ReduceOp::sum)->wait();
  print_in_rank_order(*pg, "after all_reduce(sum) of [r+1, r+1]: " + str(s));

  // 4. all_gather of [r, r]: everyone holds [0, 0, 1, 1, ..., n-1, n-1].
  Tensor in = Tensor::from_vector({float(r), float(r)}, {2}, dev);
  Tensor out = Tensor::from_vector(std::vector<float>(2 * n, -1.f), {2 * n}, dev);
  pg->all_gather(out, in)->wait();
  print_in_rank_order(*pg, "after all_gather of [r, r]: " + str(out));

  // 5. The ring by hand against the library, on the same integer-valued data (every
  //    summation order gives the same floats, so the results must agree bit for bit).
  const int64_t N = f.elements;
  std::vector<float> data(N);
  for (int64_t i = 0; i < N; ++i) data[i] = float((r + 1) * (i % 7 - 3));
  Tensor orig = Tensor::from_vector(data, {N}, dev);
  Tensor ring = Tensor::empty({N}, kernels::DType::f32, dev);
  Tensor lib = Tensor::empty({N}, kernels::DType::f32, dev);
  Tensor scratch = Tensor::empty({N / n + 1}, kernels::DType::f32, dev);
  std::vector<double> ring_ms, lib_ms;
  for (int rep = 0; rep < f.reps; ++rep) {
    kernels::copy(ring, orig);
    kernels::copy(lib, orig);
    kernels::context(dev).synchronize();
    // Aligns the ranks' start so that the timings measure the all-reduce, not their skew.
    pg->barrier()->wait();
    auto t0 = std::chrono::steady_clock::now();
    ring_all_reduce(*pg, ring, scratch, f.chunk);
    kernels::context(dev).synchronize();
    auto t1 = std::chrono::steady_clock::now();
    pg->barrier()->wait();  // same reason as above
    auto t2 = std::chrono::steady_clock::now();
    pg->all_reduce(lib, ReduceOp::sum)->wait();
    kernels::context(dev).synchronize();
    auto t3 = std::chrono::steady_clock::now();
    ring_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    lib_ms.push_back(std::chrono::duration<double, std::milli>(t3 - t2).count());
  }
  float diff = kernels::max_abs_diff(ring.to_host_f32(), lib.to_host_f32());
  // Closed form: sum over ranks of (r+1) (i%7 - 3) = n(n+1)/2 (i%7 - 3).
  auto h = lib.to_host_f32();
  float want_err = 0;
  for (int64_t i = 0; i < N; ++i)
    want_err = std::max(want_err, std::abs(h[i] - n * (n + 1) / 2.f * float(i % 7 - 3)));
  double mb = N * 4.0 / 1e6;
  double ring_t = median_ms(ring_ms), lib_t = median_ms(lib_ms);
  std::ostringstream line;
  line.precision(3);
  line << std::fixed << "all-reduce of " << N << " floats (" << mb << " MB): ring by hand "
       << ring_t << " ms (bus " << 2.0 * (n - 1) / n * mb / ring_t << " GB/s), library " << lib_t
       << " ms (bus " << 2.0 * (n - 1) / n * mb / lib_t << " GB/s); max |ring - library| = " << diff
       << ", max |library - closed form| = " << want_err;
  print_in_rank_order(*pg, line.str());
  bool ok = diff == 0.f && want_err == 0.f;
  if (!ok) std::fprintf(stderr, "[rank %d] the ring and the library disagree\n", r);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("communication: dp::dist collectives across processes, and a ring all-reduce");
  app.option_defaults()->always_capture_default();  // --help shows every default
  Flags f;
  using dp::cli::whole_number;
  app.add_option("--nproc", f.nproc, "worker processes")->check(whole_number(2, 4));
  app.add_option("--backend", f.backend, "auto, gloo or nccl")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--device", f.device, "where the tensors live")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--elements", f.elements, "floats in the all-reduce comparison")
      ->check(whole_number(1, int64_t(1) << 28));
  app.add_option("--chunk", f.chunk, "ring pipeline chunk, in floats")
      ->check(whole_number(1, int64_t(1) << 28));
  app.add_option("--reps", f.reps, "timed repetitions (the median is printed)")
      ->check(whole_number(1, 1000));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return dp::cli::parse_exit(app, e);
  }
  try {
    if (auto env = dp::dist::worker_env_from_environment()) return run_worker(f, *env);
    // What every rank would refuse, said once before any starts: no GPU, or NCCL on CPU tensors.
    dp::dist::check_backend_devices(f.backend, kernels::choose_device_type(f.device), f.nproc);
    // Every rank fills a host vector of --elements floats, and on CPU devices holds four more
    // buffers of about that size (the original, the ring's, the library's and the scratch).
    const int host_buffers = f.device == "cpu" ? 5 : 1;
    dp::cli::check_fits("--elements " + std::to_string(f.elements) + " (" +
                            std::to_string(f.nproc) + " ranks x " + std::to_string(host_buffers) +
                            " buffers of that many floats)",
                        f.elements * 4 * host_buffers * f.nproc, "the host",
                        kernels::host_memory_available(), "give fewer --elements");
    dp::dist::LaunchOptions lo;
    lo.nproc_per_node = f.nproc;
    return dp::dist::launch_workers(lo, std::vector<std::string>(argv, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "communication: %s\n", e.what());
    return 1;
  }
}
