#include "dp/distributed/ddp.hpp"

#include <algorithm>
#include <functional>

#include <string>
#include "dp/distributed/builtin_hooks.hpp"

namespace dp::dist {

namespace {

using Clock = std::chrono::steady_clock;

// 64-bit FNV-1a of a parameter's name and shape.
uint64_t describe(const std::string& name, const kernels::Shape& shape) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  for (char c : name) mix(static_cast<unsigned char>(c));
  mix(shape.size());
  for (int64_t d : shape) mix(static_cast<uint64_t>(d));
  return h;
}

// The hash as four exact f32 values of 16 bits each.
void put_hash(float* out, uint64_t h) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<float>((h >> (16 * i)) & 0xffff);
}

}  // namespace

std::vector<Bucket> DistributedDataParallel::make_buckets(const std::vector<int64_t>& numels,
                                                          int64_t first_cap, int64_t cap) {
  std::vector<ParamExtent> extents;
  int64_t end = 0;
  for (int64_t n : numels) {
    extents.push_back({end, n});
    end += n;
  }
  return make_bucket_plan(extents, end, first_cap, cap).buckets;
}

DistributedDataParallel::DistributedDataParallel(nn::ModulePtr module, ProcessGroup& group,
                                                 DdpOptions options)
    : module_(std::move(module)), group_(group), options_(options) {
  DP_CHECK(module_ && module_->materialized(),
           "DistributedDataParallel: the module must be materialised on this rank's device "
           "(call materialize first)");
  share_ = 1.f / static_cast<float>(group_.size());
  write_share();
  DP_CHECK(!options_.comm_hook || options_.comm_dtype == kernels::DType::f32,
           "DDP: comm hook '" << options_.comm_hook->name() << "' with comm dtype "
                              << options_.comm_dtype
                              << ": a hook is handed the f32 bucket and chooses what travels "
                                 "(leave comm_dtype f32)");
  // Every bucket goes to one reducer: research code's, or the built-in one for the comm dtype.
  hook_ = options_.comm_hook ? options_.comm_hook : builtin_hook(options_.comm_dtype);
  verify_same_model();
  {
    kernels::NvtxRange range("ddp/broadcast_params");
    group_.broadcast(module_->flat_params(), 0)->wait();
    if (module_->flat_buffers().numel() > 0) group_.broadcast(module_->flat_buffers(), 0)->wait();
    module_->parameters_changed();  // a 16-bit copy an earlier step wrote is not rank 0's
  }
  buckets_ =
      make_bucket_plan(*module_, options_.first_bucket_bytes, options_.bucket_cap_bytes).buckets;
  progress_ = BucketProgress(&buckets_);
  pending_.resize(buckets_.size());
  module_->flat().on_grad_ready = [this](const nn::Parameter& p) { on_grad_ready(p); };
}

DistributedDataParallel::~DistributedDataParallel() {
  if (module_ && module_->materialized()) module_->flat().on_grad_ready = nullptr;
  for (auto& w : pending_) {
    if (!w) continue;
    try {
      w->wait();
    } catch (const std::exception& e) {
      DP_LOG_ERROR("DistributedDataParallel: a bucket all-reduce failed at teardown: " << e.what());
    }
  }
}

void DistributedDataParallel::verify_same_model() {
  auto params = module_->named_parameters();
  const int64_t n = static_cast<int64_t>(params.size());
  Device dev = module_->device();
  // 1. The same number of parameters everywhere.
  Tensor count = Tensor::from_vector({static_cast<float>(n)}, {1}, dev);
  Tensor counts = Tensor::empty({group_.size()}, kernels::DType::f32, dev);
  group_.all_gather(counts, count)->wait();
  auto all = counts.to_host_f32();
  for (int r = 0; r < group_.size(); ++r)
    DP_CHECK(static_cast<int64_t>(all[r]) == n, "DDP: the models differ: rank "
                                                    << r << " has " << static_cast<int64_t>(all[r])
                                                    << " parameter tensors, rank " << group_.rank()
                                                    << " has " << n);
  // 2. Rank 0's (name, shape) hashes against ours; every rank learns the first mismatch.
  std::vector<float> mine(static_cast<size_t>(4 * n));
  for (int64_t i = 0; i < n; ++i)
    put_hash(&mine[4 * i], describe(params[i].first, params[i].second->shape));
  Tensor table = Tensor::from_vector(mine, {4 * n}, dev);
  if (n > 0) group_.broadcast(table, 0)->wait();
  auto root = table.to_host_f32();
  float first_bad = static_cast<float>(n);  // n: no mismatch
  for (int64_t i = 0; i < n && first_bad == n; ++i)
    for (int j = 0; j < 4; ++j)
      if (root[4 * i + j] != mine[4 * i + j]) first_bad = static_cast<float>(i);
  Tensor bad = Tensor::from_vector({first_bad}, {1}, dev);
  group_.all_reduce(bad, ReduceOp::min)->wait();
  int64_t index = static_cast<int64_t>(bad.item());
  DP_CHECK(index >= n, "DDP: the models differ across ranks: the first mismatched tensor is #"
                           << index << " '" << params[index].first << "' "
                           << kernels::shape_str(params[index].second->shape) << " on rank "
                           << group_.rank() << ", whose name or shape differs on some rank");
}

void DistributedDataParallel::set_batch_share(int64_t local_rows, int64_t global_rows) {
  DP_CHECK(global_rows > 0 && local_rows >= 0 && local_rows <= global_rows,
           "set_batch_share: " << local_rows << " of " << global_rows << " rows");
  share_ = static_cast<float>(local_rows) / static_cast<float>(global_rows);
  write_share();
}

void DistributedDataParallel::write_share() {
  if (share_values_.write(&share_, 1, module_->flat_params().device()))
    device_share_ = share_values_.at(0);  // made now: the view stage_bucket reads
}

void DistributedDataParallel::broadcast_buffers() {
  if (options_.buffer_sync != BufferSync::broadcast || module_->flat_buffers().numel() == 0 ||
      !module_->is_training() || group_.size() == 1)
    return;
  kernels::NvtxRange range("ddp/broadcast_buffers");
  group_.broadcast(module_->flat_buffers(), 0)->wait();
}

void DistributedDataParallel::average_buffers() {
  if (options_.buffer_sync == BufferSync::average && module_->flat_buffers().numel() > 0 &&
      group_.size() > 1)
    group_.all_reduce(module_->flat_buffers(), ReduceOp::avg)->wait();
}

Tensor DistributedDataParallel::forward(const Tensor& x) {
  broadcast_buffers();
  return forward_local(x);
}

Tensor DistributedDataParallel::forward_local(const Tensor& x) {
  kernels::NvtxRange range("ddp/forward");
  TraceScope slice(trace_, "ddp/forward", group_.rank());
  return module_->forward(x);
}

void DistributedDataParallel::reset_stats() {
  std::vector<double> ready = std::move(stats_.bucket_ready_ms);
  stats_ = DdpStats{};
  ready.assign(buckets_.size(), -1.0);
  stats_.bucket_ready_ms = std::move(ready);
  stats_.buckets = static_cast<int>(buckets_.size());
  backward_begin_ = Clock::now();
}

Tensor DistributedDataParallel::backward(const Tensor& dy) {
  // A bucket counted or launched by an earlier backward would launch early here, or never: its
  // collectives would no longer match the peers' (PyTorch refuses this too).
  DP_CHECK(!sync_enabled_ || sync_idle(),
           "DistributedDataParallel::backward on rank "
               << group_.rank()
               << ": the previous backward's gradients were not synchronised "
                  "(call finish_gradient_sync() first; accumulate micro-batches under no_sync())");
  reset_stats();
  Tensor dx;
  {
    kernels::NvtxRange range("ddp/backward");
    TraceScope slice(trace_, "ddp/backward", group_.rank());
    in_backward_ = true;
    try {
      dx = module_->backward(dy);
    } catch (...) {
      in_backward_ = false;
      abandon_sync();  // the next step starts from no bucket counted or in flight
      throw;
    }
    in_backward_ = false;
  }
  stats_.backward_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - backward_begin_).count();
  return dx;
}

Tensor DistributedDataParallel::backward_local(const Tensor& dy) {
  kernels::NvtxRange range("ddp/backward");
  TraceScope slice(trace_, "ddp/backward", group_.rank());  // a micro-batch's, between forwards
  NoSync local(*this);
  return module_->backward(dy);
}

void DistributedDataParallel::stage_buckets() {
  for (int k = 0; k < static_cast<int>(buckets_.size()); ++k) stage_bucket(k);
}

void DistributedDataParallel::all_reduce_staged() {
  reset_stats();
  auto t0 = Clock::now();
  for (int k = 0; k < static_cast<int>(buckets_.size()); ++k) issue_bucket(k);
  {
    kernels::NvtxRange range("ddp/allreduce_wait");
    TraceScope slice(trace_, "ddp/allreduce_wait", group_.rank());
    std::vector<std::shared_ptr<Work>> works;
    for (auto& w : pending_)
      if (w) works.push_back(std::move(w));
    const int64_t before = group_.payload_bytes();
    wait_all(works);
    stats_.comm_bytes += group_.payload_bytes() - before;  // what a hook's waits handed over
  }
  average_buffers();
  stats_.allreduce_wait_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

Tensor DistributedDataParallel::backward_queued(const Tensor& dy) {
  if (!sync_enabled_) return backward_local(dy);
  DP_CHECK(hook_->capturable(), "DDP: backward_queued with comm hook '"
                                    << hook_->name()
                                    << "', whose host code a graph cannot hold (use "
                                       "backward_local, stage_buckets and all_reduce_staged)");
  queued_ = true;
  Tensor dx;
  try {
    dx = backward(dy);  // its hooks queue the buckets that fill
    launch_remaining_buckets();
    group_.join_queued(module_->device());
  } catch (...) {
    queued_ = false;
    try {  // what was queued ends before the next step's buckets (uncaptured; a capture drops it)
      group_.join_queued(module_->device());
    } catch (const std::exception& e) {
      DP_LOG_ERROR("ddp: an abandoned step's queued bucket all-reduces: " << e.what());
    }
    clear_ready();
    throw;
  }
  queued_ = false;
  for (int k = 0; k < static_cast<int>(buckets_.size()); ++k) {
    GradBucket b = bucket_for_hook(k);
    count_share_reads_in_capture(b);
    hook_->complete_queued(b);  // after the join: the sums are there
  }
  clear_ready();
  queued_overlapped_ = stats_.launched_before_backward_end;
  return dx;
}

void DistributedDataParallel::replayed_queued_sync() {
  reset_stats();
  if (group_.size() > 1)
    for (const int64_t bytes : bucket_bytes()) stats_.comm_bytes += bytes;
  stats_.launched_before_backward_end = queued_overlapped_;
}

void DistributedDataParallel::launch_remaining_buckets() {
  // Buckets whose parameters got no gradient this step (unused layers) still take part.
  progress_.all_ready();
  launch_ready_buckets();
}

void DistributedDataParallel::clear_ready() {
  progress_.clear();
  next_to_launch_ = 0;
}

std::vector<int64_t> DistributedDataParallel::bucket_bytes() const {
  std::vector<int64_t> out;
  for (const Bucket& b : buckets_) {
    // Measured on several ranks' groups: the one rank's reducer hands nothing over.
    const int64_t bytes = hook_->bytes_for(b.numel, std::max(group_.size(), 2));
    out.push_back(bytes >= 0 ? bytes : b.numel * static_cast<int64_t>(sizeof(float)));
  }
  return out;
}

void DistributedDataParallel::on_grad_ready(const nn::Parameter& p) {
  if (!sync_enabled_) return;
  progress_.param_ready(p.offset, p.numel());
  launch_ready_buckets();
}

Tensor DistributedDataParallel::grad_slice(int k) {
  return module_->flat_grads().view(buckets_[k].offset, {buckets_[k].numel});
}

void DistributedDataParallel::stage_bucket(int k) {
  Tensor slice = grad_slice(k);
  // Alone with the whole batch the gradient is the mean already: no pass over it (x * 1 == x).
  // A captured step always scales by the device's share: a replay runs no host branch, and a
  // later step's share is read there. So does the step before a capture, which the capture's
  // ops are compared with (kernels::Graph::observe).
  const kernels::DeviceContext& ctx = kernels::context(slice.device());
  const bool graphed = ctx.capturing() || ctx.noting();
  if (group_.size() > 1 || share_ != 1.f || graphed) kernels::scale(slice, slice, device_share_);
}

GradBucket DistributedDataParallel::bucket_for_hook(int k) {
  GradBucket b;
  b.index = k;
  b.offset = buckets_[k].offset;
  b.grad = grad_slice(k);
  b.share = share_;
  b.share_at = device_share_;
  b.group = &group_;
  return b;
}

void DistributedDataParallel::count_share_reads_in_capture(GradBucket& b) {
  if (!kernels::capturing_on_this_thread()) return;
  b.share.count_reads(&share_reads_in_capture_);
  share_in_capture_ = share_;
}

std::optional<float> DistributedDataParallel::take_share_read_in_capture() {
  if (share_reads_in_capture_ == 0) return std::nullopt;
  share_reads_in_capture_ = 0;
  return share_in_capture_;
}

bool DistributedDataParallel::issue_bucket(int k) {
  const std::string what = std::string(options_.comm_hook ? "ddp/comm_hook" : "ddp/allreduce") +
                           "[bucket " + std::to_string(k) + "]";
  kernels::NvtxRange range(what);
  GradBucket b = bucket_for_hook(k);
  const int64_t before = group_.payload_bytes();
  count_share_reads_in_capture(b);
  if (queued_)
    hook_->reduce_queued(b);
  else
    pending_[k] = run_hook(*hook_, b, "DDP");
  const int64_t handed = group_.payload_bytes() - before;
  stats_.comm_bytes += handed;
  // Nothing handed over and nothing to wait for (the built-in reducers with one rank): no
  // communication was launched.
  if (handed == 0 && !pending_[k]) return false;
  stats_.bucket_ready_ms[k] =
      std::chrono::duration<double, std::milli>(Clock::now() - backward_begin_).count();
  if (trace_) trace_->add({what + " launch", group_.rank(), trace_->now_us(), 1.0});
  return true;
}

void DistributedDataParallel::launch_ready_buckets() {
  // In index order only: bucket k goes after k-1 on every rank, so the collectives match.
  while (next_to_launch_ < progress_.ready()) {
    int k = next_to_launch_++;
    stage_bucket(k);
    // The last bucket (the first layers) lands with backward's final layer: nothing is left
    // to hide it behind. Every other bucket launched from backward overlaps what remains.
    if (issue_bucket(k) && in_backward_ && k + 1 < static_cast<int>(buckets_.size()))
      ++stats_.launched_before_backward_end;
  }
}

bool DistributedDataParallel::sync_idle() const {
  if (next_to_launch_ != 0 || !progress_.untouched()) return false;
  for (const auto& w : pending_)
    if (w) return false;
  return true;
}

void DistributedDataParallel::abandon_sync() {
  // One line for the buckets a failed group ended alike (it printed one per bucket).
  std::string first_error;
  int failed = 0;
  for (auto& w : pending_) {
    if (!w) continue;
    try {
      w->wait();  // its tensors stay untouched once this returns (or the group failed)
    } catch (const std::exception& e) {
      if (failed++ == 0) first_error = e.what();
    }
    w.reset();
  }
  if (failed > 0)
    DP_LOG_ERROR("ddp: an abandoned step's bucket all-reduce: "
                 << first_error
                 << (failed > 1 ? " (" + std::to_string(failed - 1) + " more failed alike)" : ""));
  clear_ready();
}

void DistributedDataParallel::finish_gradient_sync() {
  if (!sync_enabled_) return;
  auto t0 = Clock::now();
  try {
    launch_remaining_buckets();
    kernels::NvtxRange range("ddp/allreduce_wait");
    TraceScope slice(trace_, "ddp/allreduce_wait", group_.rank());
    for (size_t k = 0; k < pending_.size(); ++k) {  // every bucket was issued by now
      if (pending_[k]) {
        const int64_t before = group_.payload_bytes();
        pending_[k]->wait();
        stats_.comm_bytes += group_.payload_bytes() - before;  // what a hook's wait handed over
        pending_[k].reset();
      }
    }
  } catch (...) {
    abandon_sync();
    throw;
  }
  average_buffers();
  stats_.allreduce_wait_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  clear_ready();
}

}  // namespace dp::dist
