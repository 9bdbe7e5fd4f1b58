// Test helper for the launcher tests: a launcher (no worker variables set) or one of its
// workers. Workers write <pid-dir>/rank_<r>.pid and, for each attempt of a restarted job,
// <pid-dir>/attempt_<DP_RESTART_COUNT>.rank_<r> (both hold the pid), then act out --mode:
//   collectives  env:// Gloo group; all_reduce/broadcast/all_gather/send_recv checks; exit 0/1
//   sleep        sleep (until killed)
//   die          rank 1 kills itself with SIGKILL after 300 ms; the others sleep
//   exit3        rank 1 exits with status 3 after 200 ms; the others sleep
//   stubborn     everyone ignores SIGTERM; rank 1 exits with status 5 after 200 ms
//   fail-once    DP_RESTART_COUNT 0: rank 1 exits with status 3 once every rank has written its
//                attempt file, the others sleep; DP_RESTART_COUNT >= 1: every rank exits 0
//   hang         env:// Gloo group; rank --hang-rank (1) stops itself (SIGSTOP), the others wait
//                in a barrier
//   ddp          a DdpTrainer (--backend gloo|mpi, CPU) whose run config is {batch: --batch,
//                steps: --steps};
//                wrap() verifies it across ranks, then --steps steps on a fixed batch; prints
//                "[rank r] ddp ok loss L", then holds its group --hold-ms (started by hand:
//                RANK, WORLD_SIZE, MASTER_* set). With --save FILE --save-at K it saves the
//                training state (DdpTrainer::save) after step K; with --load FILE it starts from
//                it (DdpTrainer::load); either way it prints "weights H", a hash of its weights
//                With --clip-grad C the gradient is clipped to norm C; it then prints the last
//                step's "norm N syncs S allocations A" (DdpStepTimes), clipping on or off,
//                and "graphed G": the steps that replayed graphs (--cuda-graphs auto|on|off),
//                with the loss scale, whether a graph holds the bucket all-reduces
//                (--graph-collectives auto|off: DdpTrainer::set_graph_collectives), and the
//                last step's payload bytes and buckets launched while backward ran.
//                --bucket-cap-bytes B: every gradient bucket capped at B bytes;
//                --short-every K: every K-th step (the 2nd, 4th, ... for K = 2) trains on the
//                batch's first --batch - 3 rows only, a second step shape
//                --moving-shares K: tokens ignored at moving places, under fp16 (see DdpRun);
//                --micro-batches K: gradient accumulation (DdpTrainer::set_micro_batches);
//                --metrics-lag 1: lagged metrics (DdpTrainer::set_metrics_lag). It prints
//                "losses ...": what each step returned (then finish_metrics() with the lag),
//                and "peaks ...": each step's most memory in use (DdpStepTimes::peak_bytes).
//                --zero 1: ZeRO-1 (DdpTrainer::set_zero_stage; --zero-overlap: through
//                DDP's buckets, set_zero_overlap). The optimizer is SGD with
//                momentum 0.9 when --momentum is given (state to save), else plain SGD.
//                --scratch-update: a temporary in backward and one in the optimizer's step
//                (tests/scratch_layers.hpp).
//                --host-share-hook: research code's capturable comm hook that reads the host
//                share (GradBucket::share) in its queued ops (HostShareHook).
//                --scratch-grows-until N: a backward temporary that grows up to its N-th call
//                (tests/scratch_layers.hpp).
// --hold-ms T: collectives wait T ms after joining the group (a job that stays up a while).
// --max-restarts K: the launcher's LaunchOptions::max_restarts.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>
#include <thread>

#include "dp/distributed/ddp_trainer.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/distributed/process_group.hpp"
#include "nn/nn.hpp"
#include "tests/scratch_layers.hpp"

using namespace dp::dist;
using kernels::Tensor;

namespace {

// Writes this process's pid to `dir`/`name`, whole or not at all.
void write_pid_file(const std::string& dir, const std::string& name) {
  std::string tmp = dir + "/." + name + ".tmp";
  {
    std::ofstream f(tmp);
    f << ::getpid() << "\n";
  }
  std::rename(tmp.c_str(), (dir + "/" + name).c_str());
}

std::string attempt_file(int restart_count, int rank) {
  return "attempt_" + std::to_string(restart_count) + ".rank_" + std::to_string(rank);
}

void write_pid(const std::string& dir, const WorkerEnv& w) {
  if (dir.empty()) return;
  write_pid_file(dir, "rank_" + std::to_string(w.rank) + ".pid");
  write_pid_file(dir, attempt_file(w.restart_count, w.rank));
}

// Waits (10 s at most) until every rank of this attempt has written its attempt file, so that
// a failure comes while all of them run.
void wait_for_attempt(const std::string& dir, const WorkerEnv& w) {
  for (int i = 0; i < 1000; ++i) {
    int there = 0;
    for (int r = 0; r < w.world_size; ++r)
      there += std::ifstream(dir + "/" + attempt_file(w.restart_count, r)).good();
    if (there == w.world_size) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void sleep_forever() {
  for (int i = 0; i < 600; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

int run_hang(const WorkerEnv& w, int hang_rank, int wait_s) {
  InitOptions o;
  o.backend = Backend::gloo;
  o.timeout = std::chrono::seconds(wait_s);
  auto pg = init_process_group(o);
  // The launcher's watch tells a store that stopped answering (rank 0 hung) from one not up
  // yet only after one answered poll: hang once it has had a few poll intervals for that.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  if (w.rank == hang_rank) ::raise(SIGSTOP);
  pg->barrier()->wait();
  return 0;
}

int run_collectives(const WorkerEnv& w, int hold_ms) {
  InitOptions o;
  o.backend = Backend::gloo;
  o.timeout = std::chrono::seconds(30);
  auto pg = init_process_group(o);
  std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
  const int n = pg->size(), r = pg->rank();
  if (n != w.world_size || r != w.rank) return 1;
  Tensor t = Tensor::from_vector(std::vector<float>(1000, float(r + 1)), {1000});
  pg->all_reduce(t, ReduceOp::sum)->wait();
  for (float v : t.to_host_f32())
    if (v != n * (n + 1) / 2.f) {
      std::fprintf(stderr, "[rank %d] all_reduce gave %f\n", r, v);
      return 1;
    }
  Tensor b = Tensor::from_vector(std::vector<float>(10, float(r)), {10});
  pg->broadcast(b, n - 1)->wait();
  for (float v : b.to_host_f32())
    if (v != float(n - 1)) return 1;
  Tensor in = Tensor::from_vector({float(r)}, {1});
  Tensor out = Tensor::from_vector(std::vector<float>(n, -1.f), {n});
  pg->all_gather(out, in)->wait();
  auto h = out.to_host_f32();
  for (int q = 0; q < n; ++q)
    if (h[q] != float(q)) return 1;
  Tensor to_next = Tensor::from_vector({float(r)}, {1});
  Tensor from_prev = Tensor::from_vector({-1.f}, {1});
  pg->send_recv(to_next, (r + 1) % n, from_prev, (r + n - 1) % n, 1)->wait();
  if (from_prev.item() != float((r + n - 1) % n)) return 1;
  pg->barrier()->wait();
  std::printf("[rank %d] collectives ok (world %d, local rank %d, node %d)\n", r, n, w.local_rank,
              w.node_rank);
  std::fflush(stdout);
  return 0;
}

// A healthy job whose rank 0 ends first, which must end with exit 0 on every node: one
// all-reduce, then every other rank keeps its group and works on (sleeps) for `work_ms` while
// rank 0, which hosts the store, returns at once (rank0-first); or every rank drops its group
// (rank 0's store with it) and then works for `work_ms`, rank 0 too (group-first).
enum class GroupEnd { rank0_first, group_first };
int run_group_end(int work_ms, GroupEnd end) {
  InitOptions o;
  o.backend = Backend::gloo;
  o.timeout = std::chrono::seconds(30);
  auto pg = init_process_group(o);
  Tensor t = Tensor::from_vector({1.f}, {1});
  pg->all_reduce(t, ReduceOp::sum)->wait();
  if (t.item() != float(pg->size())) return 1;
  const int rank = pg->rank();
  if (end == GroupEnd::group_first) pg.reset();
  if (rank != 0 || end == GroupEnd::group_first)
    std::this_thread::sleep_for(std::chrono::milliseconds(work_ms));
  std::printf("[rank %d] done\n", rank);
  std::fflush(stdout);
  return 0;
}

// FNV-1a over the bytes of the weights: equal hashes, equal bits.
uint64_t weights_hash(nn::Module& m) {
  std::vector<float> w = m.flat_params().to_host_f32();
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(w.data());
  for (size_t i = 0; i < w.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::string number(float v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", v);  // every float's own digits
  return text;
}

struct DdpRun {
  int64_t batch = 8;
  int steps = 2, hold_ms = 0, save_at = 0, short_every = 0;
  // > 0: rows of 2 tokens and a token loss that ignores the tokens (j + step) % K == 0 (each
  // rank's share of the kept tokens changes from step to step), under fp16 with a scale that
  // grows every step.
  int moving_shares = 0;
  int metrics_lag = 0;        // DdpTrainer::set_metrics_lag (with phase timing off)
  int micro_batches = 1;      // DdpTrainer::set_micro_batches
  int train_before_load = 0;  // steps taken (and dropped) before the load
  int zero = 0;               // DdpTrainer::set_zero_stage
  bool zero_overlap = false;  // DdpTrainer::set_zero_overlap
  bool momentum = false;      // SGD with momentum 0.9 (optimizer state)
  std::string resume_dir;     // DdpTrainer::resume("latest", resume_dir)
  std::string backend = "gloo", save, load, graphs = "auto";
  std::string graph_collectives = "auto";  // DdpTrainer::set_graph_collectives (auto: true)
  int64_t bucket_cap_bytes = 0;            // > 0: DdpOptions' caps (small: several buckets)
  float clip_grad = 0.f;
  int64_t rank1_rows = 0;  // > 0: rank 1 passes this many rows of the global batch each step
  // > 0: at this step (1-based) rank 1's last label is out of range; the step's error is caught
  // and printed, and the loop goes on (research code that catches and continues)
  int bad_label_at = 0;
  // > 0: after catching that error, rank 1 waits this many ms before it goes on (research code
  // that logs or saves first): its peers must not wait for it until their timeout.
  int linger_after_catch_ms = 0;
  // The model takes a temporary in backward and the optimizer another in its step
  // (tests/scratch_layers.hpp): a graphed step's update takes backward's block from the pool its
  // two graphs share.
  bool scratch_update = false;
  // > 0: the model's backward takes a temporary that grows up to its N-th call
  // (tests/scratch_layers.hpp's GrowingScratch): with 2, the capture at step 3 lacks memory.
  int64_t scratch_grows_until = 0;
  bool host_share_hook = false;  // DdpOptions::comm_hook: a HostShareHook
};

// Research code's capturable hook whose queued ops take the rank's share as the host value
// (GradBucket::share): each bucket scaled by 1 / share, then by the device's share (share_at),
// then summed. Eagerly the built-in sum's gradient, rounding aside, at every step; a replay of
// its capture divides by the captured share (dp::dist::HostShare: DdpTrainer replays it only
// at steps of that share).
class HostShareHook : public CommHook {
 public:
  std::string name() const override { return "host-share"; }
  std::shared_ptr<Work> reduce(GradBucket& b) override {
    rescale(b);
    return b.group->all_reduce(b.grad);
  }
  bool capturable() const override { return true; }
  void reduce_queued(GradBucket& b) override {
    rescale(b);
    b.group->all_reduce_queued(b.grad);
  }

 private:
  static void rescale(GradBucket& b) {
    kernels::scale(b.grad, b.grad, kernels::Scalar(1.f / b.share));
    kernels::scale(b.grad, b.grad, b.share_at);
  }
};

int run_ddp(const DdpRun& o) {
  const int64_t batch = o.batch;
  if (o.rank1_rows > batch) {
    std::fprintf(stderr, "dist_worker: --rank1-rows %lld exceeds --batch %lld\n",
                 static_cast<long long>(o.rank1_rows), static_cast<long long>(batch));
    return 2;
  }
  if (o.bad_label_at > 0 && o.moving_shares > 0) {
    std::fprintf(stderr,
                 "dist_worker: --bad-label-at takes class labels, not --moving-shares' tokens\n");
    return 2;
  }
  if (o.scratch_update && o.scratch_grows_until > 0) {
    std::fprintf(stderr,
                 "dist_worker: --scratch-update and --scratch-grows-until are two models: give "
                 "one\n");
    return 2;
  }
  if ((o.scratch_update || o.scratch_grows_until > 0) && o.moving_shares > 0) {
    std::fprintf(stderr,
                 "dist_worker: --scratch-update and --scratch-grows-until take class "
                 "labels, not tokens\n");
    return 2;
  }
  const int steps = o.steps;
  DdpOptions ddp_options;
  if (o.bucket_cap_bytes > 0)
    ddp_options.bucket_cap_bytes = ddp_options.first_bucket_bytes = o.bucket_cap_bytes;
  if (o.host_share_hook) ddp_options.comm_hook = std::make_shared<HostShareHook>();
  DdpTrainer trainer(kernels::DeviceType::cpu, o.backend, ddp_options);
  trainer.set_clip_grad_norm(o.clip_grad);
  trainer.set_zero_stage(o.zero);
  trainer.set_zero_overlap(o.zero_overlap);
  trainer.set_micro_batches(o.micro_batches);
  if (o.metrics_lag > 0) {
    trainer.set_metrics_lag(o.metrics_lag);
    trainer.set_phase_timing(kernels::Event::Timing::off);
  }
  if (o.moving_shares > 0) {
    trainer.set_loss(std::make_shared<nn::TokenCrossEntropyLoss>(-1));
    nn::GradScalerOptions so = nn::GradScaler::options_for(nn::Precision::fp16);
    so.init_scale = 1024.f;
    so.growth_interval = 1;
    trainer.set_precision(nn::Precision::fp16, so);
  }
  trainer.set_graphs(o.graphs == "on"    ? dp::Graphs::on
                     : o.graphs == "off" ? dp::Graphs::off
                                         : dp::Graphs::automatic);
  trainer.set_graph_collectives(o.graph_collectives == "auto");
  trainer.set_run_config({{"program", "dist_worker"},
                          {"batch", std::to_string(batch)},
                          {"steps", std::to_string(steps)}});
  auto model = nn::mlp({4, 8, 3});
  if (o.moving_shares > 0) {  // per token: the MLP without its Flatten
    model = std::make_shared<nn::Sequential>();
    model->add(std::make_shared<nn::Linear>(4, 8));
    model->add(std::make_shared<nn::ReLU>());
    model->add(std::make_shared<nn::Linear>(8, 3));
  }
  // The scratch models: the MLP with a layer of temporaries in place of its ReLU.
  nn::ModulePtr scratch;
  if (o.scratch_update) scratch = std::make_shared<dp_test::ScratchInBackward>();
  if (o.scratch_grows_until > 0)
    scratch = std::make_shared<dp_test::GrowingScratch>(o.scratch_grows_until);
  if (scratch) {
    model = std::make_shared<nn::Sequential>();
    model->add(std::make_shared<nn::Flatten>());
    model->add(std::make_shared<nn::Linear>(4, 8));
    model->add(scratch);
    model->add(std::make_shared<nn::Linear>(8, 3));
  }
  model->materialize(trainer.device(), 1);
  kernels::SgdConfig cfg;
  cfg.lr = 0.1f;
  if (o.momentum) cfg.momentum = 0.9f;
  std::unique_ptr<nn::SGD> opt = o.scratch_update
                                     ? std::make_unique<dp_test::NormFirstSGD>(*model, cfg)
                                     : std::make_unique<nn::SGD>(*model, cfg);
  trainer.wrap(model, *opt);
  const int64_t tokens = o.moving_shares > 0 ? 2 : 1;  // per row
  std::vector<float> x(static_cast<size_t>(batch * tokens * 4));
  std::vector<int32_t> y(static_cast<size_t>(batch * tokens));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7) % 11) / 11.f;
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>(i % 3);
  const kernels::Shape rows_of = tokens > 1 ? kernels::Shape{batch, tokens} : kernels::Shape{batch};
  kernels::Shape image_shape = rows_of;
  image_shape.push_back(4);
  Tensor images = Tensor::from_vector(x, image_shape);
  Tensor labels = Tensor::empty(rows_of, kernels::DType::i32, kernels::Device::cpu());
  std::copy(y.begin(), y.end(), labels.data<int32_t>());
  float loss = 0;
  int first = 0, graphed = 0;
  std::string losses;  // every step's, as train_step returned it
  std::string peaks;   // every step's most memory in use (DdpStepTimes::peak_bytes)
  if (!o.load.empty()) {
    for (int s = 0; s < o.train_before_load; ++s) trainer.train_step(images, labels);
    first = static_cast<int>(trainer.load(o.load).step);
  }
  if (!o.resume_dir.empty())
    first = static_cast<int>(trainer.resume("latest", o.resume_dir, {}).progress.step);
  for (int s = first; s < steps; ++s) {
    const bool short_step = o.short_every > 0 && (s + 1) % o.short_every == 0;
    const int64_t rows = short_step ? std::max<int64_t>(batch - 3, 1) : batch;
    for (int64_t j = 0; o.moving_shares > 0 && j < batch * tokens; ++j)
      labels.data<int32_t>()[j] = (j + s) % o.moving_shares == 0 ? -1 : y[j];
    const int64_t mine = o.rank1_rows > 0 && trainer.rank() == 1 ? o.rank1_rows : rows;
    const bool bad = o.bad_label_at == s + 1 && trainer.rank() == 1;
    const int32_t kept = bad ? labels.data<int32_t>()[mine - 1] : 0;
    if (bad) labels.data<int32_t>()[mine - 1] = 99;
    try {
      loss = trainer.train_step(images.slice(0, mine), labels.slice(0, mine));
    } catch (const std::exception& e) {
      if (!bad) throw;
      std::printf("[rank %d] caught: %s\n", trainer.rank(), e.what());
      std::fflush(stdout);
      labels.data<int32_t>()[mine - 1] = kept;
      std::this_thread::sleep_for(std::chrono::milliseconds(o.linger_after_catch_ms));
      continue;
    }
    graphed += trainer.last_times().graphed;
    losses += " " + number(loss);
    peaks += " " + std::to_string(trainer.last_times().peak_bytes);
    if (!o.save.empty() && s + 1 == o.save_at) trainer.save(o.save);
  }
  if (o.metrics_lag > 0) {
    loss = trainer.finish_metrics();
    losses += " " + number(loss);
  }
  std::printf("[rank %d] losses%s\n", trainer.rank(), losses.c_str());
  std::printf("[rank %d] peaks%s\n", trainer.rank(), peaks.c_str());
  std::printf("[rank %d] ddp ok loss %.6f weights %016llx\n", trainer.rank(), loss,
              static_cast<unsigned long long>(weights_hash(*model)));
  std::printf("[rank %d] norm %.9g syncs %lld allocations %lld\n", trainer.rank(),
              trainer.last_grad_norm(), static_cast<long long>(trainer.last_times().host_syncs),
              static_cast<long long>(trainer.last_times().allocations));
  std::printf("[rank %d] graphed %d scale %g in_graph %d payload %lld overlapped %d\n",
              trainer.rank(), graphed, trainer.scaler().scale(),
              trainer.collectives_in_graph() ? 1 : 0,
              static_cast<long long>(trainer.last_payload_bytes()),
              trainer.ddp().stats().launched_before_backward_end);
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::milliseconds(o.hold_ms));  // a job that stays up
  trainer.group().barrier()->wait();  // rank 0 hosts the store: the others leave first
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("dist_worker: launcher test helper");
  std::string mode = "collectives", pid_dir;
  LaunchOptions lo;
  int grace_ms = 3000, hang_rank = 1, wait_s = 60;
  DdpRun ddp;
  std::string job_tag;
  app.add_option("--mode", mode);
  app.add_option("--pid-dir", pid_dir);
  app.add_option("--nproc", lo.nproc_per_node);
  app.add_option("--nnodes", lo.nnodes);
  app.add_option("--node-rank", lo.node_rank);
  app.add_option("--master-addr", lo.master_addr);
  app.add_option("--master-port", lo.master_port);
  app.add_option("--grace-ms", grace_ms);
  app.add_option("--max-local-ranks", lo.max_local_ranks);
  app.add_option("--hold-ms", ddp.hold_ms);
  app.add_option("--hang-rank", hang_rank);
  app.add_option("--wait-s", wait_s, "hang: how long the others wait in the barrier, s")
      ->check(CLI::Range(1, 3600));
  app.add_option("--max-restarts", lo.max_restarts);
  app.add_option("--batch", ddp.batch);
  app.add_option("--steps", ddp.steps);
  app.add_option("--backend", ddp.backend);
  app.add_option("--save", ddp.save);
  app.add_option("--save-at", ddp.save_at);
  app.add_option("--load", ddp.load);
  app.add_option("--train-before-load", ddp.train_before_load)->check(CLI::Range(0, 10000));
  app.add_option("--resume-latest", ddp.resume_dir)->check(CLI::ExistingDirectory);
  app.add_option("--clip-grad", ddp.clip_grad)->check(CLI::NonNegativeNumber);
  app.add_option("--cuda-graphs", ddp.graphs)->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--bucket-cap-bytes", ddp.bucket_cap_bytes)->check(CLI::PositiveNumber);
  app.add_option("--graph-collectives", ddp.graph_collectives)
      ->check(CLI::IsMember({"auto", "off"}));
  app.add_option("--short-every", ddp.short_every)->check(CLI::NonNegativeNumber);
  app.add_option("--moving-shares", ddp.moving_shares)->check(CLI::NonNegativeNumber);
  app.add_option("--metrics-lag", ddp.metrics_lag)->check(CLI::Range(0, 1));
  app.add_option("--micro-batches", ddp.micro_batches)->check(CLI::Range(1, 64));
  app.add_option("--zero", ddp.zero)->check(CLI::Range(0, 1));
  app.add_flag("--zero-overlap", ddp.zero_overlap);
  app.add_flag("--momentum", ddp.momentum);
  app.add_option("--rank1-rows", ddp.rank1_rows)->check(CLI::PositiveNumber);
  app.add_option("--bad-label-at", ddp.bad_label_at)->check(CLI::PositiveNumber);
  app.add_option("--linger-after-catch", ddp.linger_after_catch_ms)
      ->check(CLI::Range(0, 600000))
      ->needs("--bad-label-at");
  app.add_flag("--scratch-update", ddp.scratch_update);
  app.add_flag("--host-share-hook", ddp.host_share_hook);
  app.add_option("--scratch-grows-until", ddp.scratch_grows_until)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--job-tag", job_tag, "ignored: lets a test find this job's processes");
  CLI11_PARSE(app, argc, argv);
  lo.grace_period = std::chrono::milliseconds(grace_ms);

  try {
    std::optional<WorkerEnv> w = worker_env_from_environment();
    if (!w) return launch_workers(lo, std::vector<std::string>(argv, argv + argc));
    write_pid(pid_dir, *w);
    if (mode == "fail-once") {
      if (w->restart_count >= 1) return 0;
      if (w->rank == 1) {
        wait_for_attempt(pid_dir, *w);
        return 3;
      }
      sleep_forever();
      return 0;
    }
    if (mode == "collectives") return run_collectives(*w, ddp.hold_ms);
    if (mode == "rank0-first") return run_group_end(ddp.hold_ms, GroupEnd::rank0_first);
    if (mode == "group-first") return run_group_end(ddp.hold_ms, GroupEnd::group_first);
    if (mode == "ddp") return run_ddp(ddp);
    if (mode == "hang") return run_hang(*w, hang_rank, wait_s);
    if (mode == "stubborn") ::signal(SIGTERM, SIG_IGN);
    if (w->rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(mode == "die" ? 300 : 200));
      if (mode == "die") ::raise(SIGKILL);
      if (mode == "exit3") return 3;
      if (mode == "stubborn") return 5;
    }
    sleep_forever();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_worker: %s\n", e.what());
    return 1;
  }
}
