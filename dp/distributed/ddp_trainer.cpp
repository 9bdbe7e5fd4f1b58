#include "dp/distributed/ddp_trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "dp/chunks.hpp"
#include "dp/distributed/mpi_process_group.hpp"
#include "dp/distributed/sync_batch_norm.hpp"
#include "dp/step.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/memory.hpp"

namespace dp::dist {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

std::optional<int> launch_if_parent(const DdpTrainerOptions& o, int argc, char** argv) {
  if (worker_env_from_environment()) return std::nullopt;
  check_launchable(o.backend, argc > 0 ? argv[0] : "this program",
                   o.launch.nproc_per_node * o.launch.nnodes);
  if (!o.device.empty())
    check_backend_devices(o.backend, kernels::choose_device_type(o.device),
                          o.launch.nproc_per_node);
  return launch_workers(o.launch, std::vector<std::string>(argv, argv + argc));
}

DdpTrainer::DdpTrainer(kernels::DeviceType type, const std::string& backend, DdpOptions ddp,
                       std::chrono::milliseconds timeout)
    : ddp_options_(ddp), loss_fn_(std::make_shared<nn::CrossEntropyLoss>()) {
  auto env = worker_env_from_environment();
  DP_CHECK(env,
           "DdpTrainer: this process was not started as a worker (RANK, WORLD_SIZE, "
           "MASTER_ADDR, MASTER_PORT are unset); start it through the launcher or torchrun");
  env_ = *env;
  device_ = {type, env_.local_rank};
  said_graphs_off_ = env_.rank != 0;  // rank 0 says why graphs are off, for the job
  kernels::ContextOptions co;
  int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  co.cpu_threads = std::max(1, hw / std::max(1, env_.local_world_size));
  co.caching = kernels::Caching::on;  // every step repeats the last one's allocations
  context_ = std::make_unique<kernels::DeviceContext>(device_, co);
  scope_ = std::make_unique<kernels::ContextScope>(*context_);
  InitOptions io;
  io.backend = parse_backend(backend);
  io.device = device_;
  io.rank = env_.rank;
  io.world_size = env_.world_size;
  io.timeout = timeout;
  group_ = init_process_group(io);
}

DdpTrainer::~DdpTrainer() {
  // Destructors log, never throw. A lagged step's metrics all-reduce not taken (no
  // finish_metrics) is waited for first, within the group's timeout: the stream waits for it
  // (order_stream), and a peer that died would otherwise leave that wait unbounded.
  for (LaggedSlot& slot : lagged_) {
    try {
      if (slot.extra.work) slot.extra.work->wait();
    } catch (const std::exception& e) {
      DP_LOG_ERROR("DdpTrainer teardown: a lagged step's metrics: " << e.what());
    }
    slot.extra.work.reset();
  }
  // The captured graphs go before the group: a graph may hold NCCL's captured all-reduces,
  // whose communicator must outlive it.
  graphs_.clear();
  ddp_.reset();
  group_.reset();
  try {
    if (context_) context_->synchronize();
  } catch (const std::exception& e) {
    DP_LOG_ERROR("DdpTrainer teardown: " << e.what());
  }
}

void DdpTrainer::set_zero_stage(int stage) {
  DP_CHECK(stage == 0 || stage == 1, "--zero " << stage << ": stages 0 (off) and 1 are supported");
  DP_CHECK(!ddp_, "DdpTrainer::set_zero_stage after wrap()");
  zero_stage_ = stage;
}

void DdpTrainer::set_zero_overlap(bool on) {
  DP_CHECK(!ddp_, "DdpTrainer::set_zero_overlap after wrap()");
  zero_overlap_ = on;
}

void DdpTrainer::set_sync_batch_norm(bool on) {
  DP_CHECK(!ddp_, "DdpTrainer::set_sync_batch_norm after wrap()");
  sync_bn_ = on;
}

void DdpTrainer::set_micro_batches(int k) {
  DP_CHECK(!ddp_, "DdpTrainer::set_micro_batches after wrap(): the ranks verify it there");
  micro_.set(k);
}

void DdpTrainer::set_precision(nn::Precision p, std::optional<nn::GradScalerOptions> scaler) {
  DP_CHECK(!ddp_, "DdpTrainer::set_precision after wrap()");
  precision_ = p;
  scaler_ = nn::GradScaler(scaler ? *scaler : nn::GradScaler::options_for(p));
}

void DdpTrainer::set_loss(nn::LossPtr loss) {
  DP_CHECK(loss != nullptr, "DdpTrainer::set_loss: null loss");
  DP_CHECK(!ddp_, "DdpTrainer::set_loss after wrap(): the ranks verify their loss there");
  loss_fn_ = std::move(loss);
}

void DdpTrainer::set_clip_grad_norm(float max_norm) {
  DP_CHECK(!ddp_, "DdpTrainer::set_clip_grad_norm after wrap()");
  DP_CHECK(max_norm >= 0.f && std::isfinite(max_norm),
           "DdpTrainer::set_clip_grad_norm(" << max_norm << "): must be finite and >= 0");
  clip_grad_norm_ = max_norm;
}

void DdpTrainer::set_run_config(RunConfig fields) {
  DP_CHECK(!ddp_, "DdpTrainer::set_run_config after wrap(): the configuration is verified there");
  for (const auto& kv : fields)
    DP_CHECK(kv.first.rfind("engine.", 0) != 0, "DdpTrainer::set_run_config: field '"
                                                    << kv.first << "': names starting with "
                                                    << "'engine.' are the engine's own");
  run_config_ = std::move(fields);
}

namespace {

// A float in the shortest decimal that reads back as the same float (at most 9 significant
// digits): equal texts are equal values, and a message shows 0.003, not a hex float.
std::string decimal_text(float v) {
  char text[32];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, static_cast<double>(v));
    if (std::strtof(text, nullptr) == v) break;
  }
  return text;
}

// FNV-1a, 64 bits: a digest of texts every rank builds the same way.
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  Fnv& add(const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;  // a separator, so that ("ab", "c") != ("a", "bc")
    return *this;
  }
  std::string hex() const { return nn::detail::hex64(h); }
};

}  // namespace

RunConfig DdpTrainer::engine_config(nn::Module& model, nn::Optimizer& optimizer) const {
  RunConfig c;
  // What each rank applies to the same all-reduced gradient: ranks that differ here would
  // drift apart without a collective ever failing.
  c["engine.optimizer"] =
      nn::detail::optimizer_name(optimizer) + " lr " + decimal_text(optimizer.lr());
  // Its settings: ranks of another momentum or weight decay drifted apart, while the loss (one
  // all-reduced value) read the same on every rank.
  if (const auto* sgd = dynamic_cast<const nn::SGD*>(&optimizer)) {
    const kernels::SgdConfig& k = sgd->config();
    c["engine.optimizer.settings"] = "momentum " + decimal_text(k.momentum) + ", dampening " +
                                     decimal_text(k.dampening) + ", weight_decay " +
                                     decimal_text(k.weight_decay) +
                                     (k.nesterov == kernels::Nesterov::yes ? ", nesterov" : "");
  } else if (const auto* adamw = dynamic_cast<const nn::AdamW*>(&optimizer)) {
    const kernels::AdamWConfig& k = adamw->config();
    c["engine.optimizer.settings"] = "betas " + decimal_text(k.beta1) + " " +
                                     decimal_text(k.beta2) + ", eps " + decimal_text(k.eps) +
                                     ", weight_decay " + decimal_text(k.weight_decay);
  }
  c["engine.clip_grad_norm"] = decimal_text(clip_grad_norm_);
  c["engine.loss"] = loss_fn_->name();
  c["engine.metrics_lag"] = std::to_string(metrics_lag_);
  c["engine.micro_batches"] = std::to_string(micro_.asked());
  c["engine.graphs"] = graphs_mode_ == Graphs::on    ? "on"
                       : graphs_mode_ == Graphs::off ? "off"
                                                     : "auto";
  c["engine.graph_collectives"] = graph_collectives_ ? "auto" : "off";
  c["engine.world_size"] = std::to_string(world_size());
  c["engine.backend"] = group_->backend_name();
  c["engine.zero"] = std::to_string(zero_stage_);
  c["engine.zero_overlap"] = zero_overlap_ ? "on" : "off";
  c["engine.sync_bn"] = sync_bn_ ? "on" : "off";
  c["engine.precision"] = nn::precision_name(precision_);
  c["engine.comm_dtype"] = kernels::dtype_name(ddp_options_.comm_dtype);
  c["engine.comm_hook"] = ddp_options_.comm_hook ? ddp_options_.comm_hook->name() : "none";
  c["engine.bucket_cap_bytes"] = std::to_string(ddp_options_.bucket_cap_bytes);
  c["engine.first_bucket_bytes"] = std::to_string(ddp_options_.first_bucket_bytes);
  c["engine.buffer_sync"] =
      ddp_options_.buffer_sync == BufferSync::average ? "average" : "broadcast";
  Fnv shapes;
  int64_t count = 0, numel = 0;
  for (auto& [name, p] : model.named_parameters()) {
    std::string shape;
    for (int64_t d : p->shape) shape += std::to_string(d) + "x";
    shapes.add(name).add(shape);
    ++count;
    numel += p->numel();
  }
  c["engine.params.count"] = std::to_string(count);
  c["engine.params.numel"] = std::to_string(numel);
  c["engine.params.shapes"] = shapes.hex();
  c["engine.buffers.numel"] = std::to_string(model.flat_buffers().numel());
  BucketPlan plan =
      make_bucket_plan(model, ddp_options_.first_bucket_bytes, ddp_options_.bucket_cap_bytes);
  Fnv buckets;
  for (const Bucket& b : plan.buckets)
    buckets.add(std::to_string(b.offset) + "+" + std::to_string(b.numel));
  c["engine.buckets"] = std::to_string(plan.buckets.size()) + " (" + buckets.hex() + ")";
  return c;
}

void DdpTrainer::wrap(nn::ModulePtr model, nn::Optimizer& optimizer) {
  DP_CHECK(model && model->materialized(), "DdpTrainer::wrap: the model is not materialised");
  optimizer.require_steps(*model, "DdpTrainer::wrap");
  // Before any collective (the weight broadcast is the first): the ranks prove they agree.
  RunConfig fields = run_config_;
  for (auto& kv : engine_config(*model, optimizer)) fields.insert(kv);
  verify_same_config(*group_, fields, group_->rendezvous_timeout());
  verified_config_ = std::move(fields);

  DP_CHECK(micro_.asked() == 1 || !sync_bn_,
           "DdpTrainer: micro_batches " << micro_.asked()
                                        << " with SyncBatchNorm: its ranks exchange statistics at "
                                           "each forward (micro_batches 1)");
  // Overlapped, ZeRO-1's gradient goes through the buckets: their dtype and hook apply.
  const bool reduce_scatter = zero_stage_ == 1 && !zero_overlap_;
  DP_CHECK(!reduce_scatter || ddp_options_.comm_dtype == kernels::DType::f32,
           "--zero 1 with --comm-dtype "
               << kernels::dtype_name(ddp_options_.comm_dtype)
               << ": ZeRO-1's reduce_scatter and all_gather run in f32 (bf16 communication is for "
                  "the bucketed all-reduce: add --zero-overlap)");
  DP_CHECK(!reduce_scatter || !ddp_options_.comm_hook,
           "--zero 1 with comm hook '"
               << ddp_options_.comm_hook->name()
               << "': ZeRO-1 reduce-scatters the whole gradient after backward, it hands no "
                  "bucket to a hook (add --zero-overlap: the buckets then meet through the hook)");
  model->set_compute_dtype(nn::compute_dtype(precision_));
  model->set_output(nn::output_for(precision_, *loss_fn_));
  model->set_input_grad(nn::InputGrad::not_needed);      // the input is data
  model->set_rng_stream(static_cast<uint64_t>(rank()));  // not the local device's: one per rank
  if (sync_bn_) nn::set_batch_norm_sync(*model, std::make_shared<GroupStatsSync>(*group_, device_));
  ddp_ = std::make_unique<DistributedDataParallel>(std::move(model), *group_, ddp_options_);
  optimizer_ = &optimizer;
  if (zero_stage_ == 1) {
    zero_ = std::make_unique<ZeroStage1>(*group_, ddp_->module(), optimizer);
    zero_->set_clip_grad_norm(clip_grad_norm_);
  }
  // The initial weights were broadcast from rank 0 through this rank's stream.
  context_->synchronize();
}

std::pair<kernels::Tensor, kernels::Tensor> DdpTrainer::slice_chunk(const kernels::Tensor& images,
                                                                    const kernels::Tensor& labels,
                                                                    float* share) {
  DP_CHECK(
      images.defined() && labels.defined() && labels.ndim() >= 1 && images.dim(0) == labels.dim(0),
      "DdpTrainer: images " << images << " and labels " << labels
                            << " must share their first dimension");
  loss_fn_->check_target(labels);
  int64_t batch = images.dim(0);
  auto sizes = chunk_sizes(batch, world_size());
  int64_t begin = chunk_begin(sizes, rank());
  if (share) {  // this rank's share of the batch's loss denominator (rows or kept tokens)
    std::vector<int64_t> denominators(sizes.size());
    for (int r = 0; r < world_size(); ++r) {
      int64_t b = chunk_begin(sizes, r);
      denominators[r] = loss_fn_->denominator(labels.slice(b, b + sizes[r]));
    }
    *share = loss_shares(denominators)[rank()];
    my_denominator_ = denominators[rank()];
    total_denominator_ = 0;
    for (int64_t d : denominators) total_denominator_ += d;
  }
  return {images.slice(begin, begin + sizes[rank()]), labels.slice(begin, begin + sizes[rank()])};
}

void DdpTrainer::copy_in(const kernels::Tensor& x, const kernels::Tensor& y) {
  // Input buffers persist between steps; they are remade only when the shape changes. The
  // caller may reuse the host batch once the step returns: the step ends with a host read on
  // this stream, after the copy (with metrics_lag 1: a wait for this copy itself, in
  // report_loss_lagged). A copy from pageable memory is staged before it returns anyway.
  kernels::copy(kernels::ensure(input_, x.shape(), x.dtype(), device_), x);
  kernels::copy(kernels::ensure(labels_, y.shape(), y.dtype(), device_), y);
}

std::pair<kernels::Tensor, kernels::Tensor> DdpTrainer::my_chunk(const kernels::Tensor& images,
                                                                 const kernels::Tensor& labels,
                                                                 float* share) {
  auto [x, y] = slice_chunk(images, labels, share);
  copy_in(x, y);
  return {input_, labels_};
}

void DdpTrainer::set_phase_timing(kernels::Event::Timing timing) {
  DP_CHECK(!ddp_, "DdpTrainer::set_phase_timing after wrap()");
  phase_timing_ = timing;
  for (auto& mark : marks_) mark = kernels::Event(timing);
}

void DdpTrainer::set_metrics_lag(int lag) {
  DP_CHECK(!ddp_, "DdpTrainer::set_metrics_lag after wrap()");
  DP_CHECK(lag == 0 || lag == 1, "DdpTrainer::set_metrics_lag(" << lag << "): 0 or 1");
  metrics_lag_ = lag;
}

float DdpTrainer::train_step(const kernels::Tensor& images, const kernels::Tensor& labels) {
  DP_CHECK(ddp_, "DdpTrainer::train_step before wrap()");
  DP_CHECK(failed_.empty(), "DdpTrainer: rank "
                                << rank() << ": an earlier step failed midway (" << failed_
                                << "): its peers may be inside that step's collectives, and this "
                                   "rank's next step would pair with them; start again (resume "
                                   "from a checkpoint)");
  if (metrics_lag_ > 0) {
    DP_CHECK(!scaler_.enabled(), "DdpTrainer: metrics_lag 1 with the loss scaler's check ("
                                     << nn::precision_name(precision_)
                                     << "): its verdict on a step decides the next one");
    DP_CHECK(phase_timing_ == kernels::Event::Timing::off,
             "DdpTrainer: metrics_lag 1 with timed phases: a step's marks are not reached when "
             "it returns (set_phase_timing(off))");
  }
  auto t_step = Clock::now();
  const int64_t payload_before = group_->payload_bytes();
  auto each_context = [&](auto f) { f(0, *context_); };
  StepCounter counter;
  counter.begin(each_context);
  float share = 0;
  auto [hx, hy] = slice_chunk(images, labels, &share);
  // Checked on the global batch, which every rank holds: all ranks refuse it together (a rank
  // going on alone would wait in collectives its peers never enter).
  DP_CHECK(images.dim(0) >= world_size(),
           "DdpTrainer: a global batch of "
               << images.dim(0) << " rows leaves " << world_size() - images.dim(0) << " of "
               << world_size() << " ranks without rows: pad a short last batch to " << world_size()
               << " rows (LoaderOptions::pad_last_batch_to) or drop it");
  // From here on a failure may leave this rank's peers inside the step's collectives: the
  // trainer is failed (later steps are refused) rather than a step behind them.
  float global_loss = 0;
  try {
    ddp_->set_batch_share(total_denominator_ > 0 ? my_denominator_ : 0,
                          std::max<int64_t>(total_denominator_, 1));
    write_scale();
    if (micro_.asked() > 1) {  // this rank's micro-batches and their weights
      micro_.plan(*loss_fn_, hy);
      micro_.write_weights(device_, scaler_.scale());
    }
    StepSegments* segments = nullptr;
    if (use_graphs()) {
      // What the graphs bake in: the chunk's shape (the loss scale and this rank's share are read
      // on the device).
      graph_key_.begin(ddp_->module().flat().host_values_version);
      graph_key_.values.push_back(hx.dim(0));
      graph_key_.add_row_shape(hx);
      graph_key_.add_row_shape(hy);
      refuse_replay_of_other_share();
    }
    if (use_graphs()) {
      segments =
          &graph_set_for(graphs_, graph_key_, rank() == 0 ? "ddp" : nullptr, &said_graph_shapes_);
      input_ = segments->input;  // the buffers this shape's graphs read and write
      labels_ = segments->labels;
      dlogits_ = segments->dlogits;
    }
    // Zeros once: the norm's slot is read back every step, written only with clipping on.
    if (!metrics_.defined()) metrics_ = kernels::Tensor::zeros({4}, kernels::DType::f32, device_);
    times_.graphed = times_.captured = false;
    times_.graph_nodes = 0;
    ddp_->take_share_read_in_capture();  // not a failed step's
    const int64_t replayed_payload = run_stages(hx, hy, share, segments);
    const std::optional<float> share_read = ddp_->take_share_read_in_capture();
    if (segments && share_read && segments->compute.captured()) segments->host_share = share_read;
    if (segments && !graphs_fallback_.empty()) graphs_.clear();  // no later step replays them
    if (zero_overlapped()) zero_->gather_params();
    // The loss's all-reduce is not in it; a replayed graph's all-reduces are.
    last_payload_bytes_ = group_->payload_bytes() - payload_before + replayed_payload;
    global_loss = metrics_lag_ > 0 ? report_loss_lagged(share, images.dim(0))
                                   : report_loss(share, images.dim(0));
  } catch (const std::exception& e) {
    failed_ = e.what();
    // For the peers left in this step's collectives: abort records why (their errors name this
    // rank and it) and ends their ops now, not at their timeout, even while this process goes
    // on (research code that catches the error to log or save). No later op of this trainer
    // would pair with theirs anyway.
    group_->abort("DdpTrainer step " + std::to_string(steps_ + 1) + ": " + failed_);
    throw;
  }
  times_.metrics_lagged = metrics_lag_ > 0;
  ++steps_;
  report_lagged_fault();  // once the step is complete: the trainer stays usable
  if (metrics_lag_ == 0) {
    scaler_.settle(*optimizer_, host_metrics_.data<float>()[1] == 0.f);
    if (clip_grad_norm_ > 0.f) grad_norm_ = host_metrics_.data<float>()[3];
  }

  // Phase times from the events (device time on a GPU; every event is reached by now).
  using kernels::Event;
  times_.total = ms_since(t_step);
  const StepCounts counts = counter.end(each_context);
  times_.allocations = counts.allocations;
  times_.peak_bytes = counts.peak_bytes;
  times_.host_syncs = counts.host_syncs;
  times_.casts = counts.casts;
  if (phase_timing_ == Event::Timing::off) return global_loss;  // the marks only ordered
  const MarkTimes t = mark_times(marks_);
  if (zero_reduce_scatters()) {
    times_.allreduce_wait = zero_->last_times().reduce_scatter + zero_->last_times().all_gather;
    times_.optimizer = zero_->last_times().step;
  } else {
    times_.allreduce_wait = t.reduce;
    if (zero_) times_.allreduce_wait += zero_->last_times().all_gather;
    times_.optimizer = t.step;
  }
  times_.forward = t.forward;
  times_.backward = t.backward;
  return global_loss;
}

std::vector<uint64_t> DdpTrainer::all_gather(uint64_t value) {
  return all_gather(std::vector<uint64_t>{value});
}

std::vector<uint64_t> DdpTrainer::all_gather(const std::vector<uint64_t>& values) {
  const int64_t k = static_cast<int64_t>(values.size());
  DP_CHECK(k > 0, "DdpTrainer::all_gather: no values");
  kernels::Tensor mine_host =
      kernels::Tensor::empty({k}, kernels::DType::i64, kernels::Device::cpu());
  for (int64_t j = 0; j < k; ++j) mine_host.data<int64_t>()[j] = static_cast<int64_t>(values[j]);
  kernels::Tensor mine = mine_host.to(device_);
  kernels::Tensor all = kernels::Tensor::empty({world_size() * k}, kernels::DType::i64, device_);
  group_->all_gather(all, mine)->wait();
  kernels::Tensor host = all.to(kernels::Device::cpu());
  return std::vector<uint64_t>(host.data<int64_t>(), host.data<int64_t>() + world_size() * k);
}

int64_t DdpTrainer::count_correct(const kernels::Tensor& images, const kernels::Tensor& labels) {
  DP_CHECK(ddp_, "DdpTrainer::count_correct before wrap()");
  auto [x, y] = my_chunk(images, labels, nullptr);
  nn::Module& m = ddp_->module();
  m.eval();
  float mine = x.dim(0) > 0 ? static_cast<float>(loss_fn_->count_correct(m.forward(x), y)) : 0.f;
  m.train();
  kernels::Tensor c = kernels::Tensor::from_vector({mine}, {1}, device_);
  group_->all_reduce(c, ReduceOp::sum)->wait();
  return static_cast<int64_t>(c.item());
}

}  // namespace dp::dist
