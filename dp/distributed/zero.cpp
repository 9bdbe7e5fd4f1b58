#include "dp/distributed/zero.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "dp/trace.hpp"
#include "kernels/ops.hpp"
#include "nn/clip.hpp"

namespace dp::dist {

using kernels::DType;
using kernels::Tensor;

namespace {
using Clock = std::chrono::steady_clock;
constexpr int64_t kShardAlign = 64;  // elements: 256 bytes of f32
}  // namespace

ZeroShardPlan make_zero_plan(int64_t numel, int world) {
  DP_CHECK(numel >= 0 && world >= 1,
           "ZeRO plan: " << numel << " parameters over " << world << " ranks");
  ZeroShardPlan p;
  p.numel = numel;
  p.world = world;
  p.shard = numel / world / kShardAlign * kShardAlign;
  return p;
}

ZeroStage1::ZeroStage1(ProcessGroup& group, nn::Module& module, nn::Optimizer& optimizer)
    : group_(group),
      module_(module),
      optimizer_(optimizer),
      plan_(make_zero_plan(module.flat_params().numel(), group.size())) {
  DP_CHECK(&optimizer.module() == &module, "ZeroStage1: the optimizer is not built on the module");
  kernels::Device dev = module.device();
  // Every rank's plan, side by side: (P, N, S) as f32 would round; send them as i64.
  Tensor mine = Tensor::empty({3}, DType::i64, kernels::Device::cpu());
  mine.data<int64_t>()[0] = plan_.numel;
  mine.data<int64_t>()[1] = plan_.world;
  mine.data<int64_t>()[2] = plan_.shard;
  Tensor mine_dev = mine.to(dev);
  Tensor all = Tensor::empty({3 * group.size()}, DType::i64, dev);
  group.all_gather(all, mine_dev)->wait();
  Tensor host = all.to(kernels::Device::cpu());
  for (int r = 0; r < group.size(); ++r) {
    const int64_t* p = host.data<int64_t>() + 3 * r;
    DP_CHECK(p[0] == plan_.numel && p[1] == plan_.world && p[2] == plan_.shard,
             "ZeRO-1: rank " << r << " has a different shard plan (" << p[0] << " parameters, "
                             << p[1] << " ranks, shard " << p[2] << ") from rank " << group.rank()
                             << " (" << plan_.numel << ", " << plan_.world << ", " << plan_.shard
                             << "): every rank must wrap the same model");
  }
  int r = group.rank();
  optimizer.set_shard(plan_.begin(r), plan_.end(r));
  if (plan_.world == 1) return;  // one rank: its shard is everything, nothing to exchange
  mine_ = Tensor::zeros({plan_.shard}, DType::f32, dev);  // grad_shard_: at the first queue_step
}

bool ZeroStage1::step(float share, nn::GradScaler* scaler) {
  if (!flags_.defined()) flags_ = Tensor::zeros({2}, DType::f32, module_.device());
  Tensor non_finite = flags_.view(0, {1}), norm = flags_.view(1, {1});
  if (scaler)
    scaler->prepare_deferred(optimizer_);
  else
    optimizer_.prepare_step();
  queue_step(share, scaler, non_finite, norm);
  const std::vector<float> read = flags_.to_host_f32();  // the step's one wait for the device
  if (clip_ > 0.f) grad_norm_ = read[1];
  return scaler ? scaler->settle(optimizer_, read[0] == 0.f) : true;
}

void ZeroStage1::queue_step(float share, nn::GradScaler* scaler, Tensor non_finite,
                            Tensor grad_norm) {
  const int r = group_.rank();
  const int64_t s = plan_.shard, body = s * plan_.world, tail = plan_.numel - body;
  Tensor& grads = module_.flat_grads();
  const bool check = scaler && scaler->enabled();
  const float unscale = check ? 1.f / scaler->scale() : 1.f;
  times_ = {};
  if (plan_.world == 1) {  // the whole gradient is this rank's: DDP's update
    auto t0 = Clock::now();
    if (clip_ > 0.f) nn::clip_grad_norm_into(grads, clip_, unscale, grad_norm);
    if (scaler)
      scaler->apply_deferred(optimizer_, grads, non_finite);
    else
      optimizer_.apply_step();
    times_.step = ms_since(t0);
    return;
  }
  auto t0 = Clock::now();
  {
    kernels::NvtxRange range("zero/reduce_scatter");
    kernels::scale(grads, grads, share);  // the sum over ranks is then the global mean's
    // Made once, by the first step: an overlapped run (gather_params alone) never needs it.
    if (!grad_shard_.defined()) grad_shard_ = Tensor::zeros({s}, DType::f32, grads.device());
    std::vector<std::shared_ptr<Work>> works;
    if (s > 0) works.push_back(group_.reduce_scatter(grad_shard_, grads.view(0, {body})));
    Tensor tail_grads = grads.view(body, {tail});
    if (tail > 0) works.push_back(group_.all_reduce(tail_grads));
    wait_all(works);
    if (s > 0) {
      Tensor mine = grads.view(r * s, {s});
      kernels::copy(mine, grad_shard_);
    }
  }
  times_.reduce_scatter = ms_since(t0);
  t0 = Clock::now();
  const int64_t begin = optimizer_.shard_begin(), end = optimizer_.shard_end();
  Tensor shard = grads.view(begin, {end - begin});
  if (clip_ > 0.f) {
    // The global norm from every rank's shard: one float all-reduced, the same factor for all,
    // computed on the device with the host's arithmetic (kernels/clip_norm.hpp).
    kernels::NvtxRange range("zero/clip");
    kernels::sum_squares(grad_norm, shard);
    group_.all_reduce(grad_norm, ReduceOp::sum)->wait();
    kernels::clip_by_norm(shard, grad_norm, grad_norm, clip_, unscale);
  }
  {
    kernels::NvtxRange range("zero/step");
    if (check) {
      // This rank sees only its shard's reduced gradient: the verdict is combined, one float,
      // and the update reads it on the device.
      kernels::non_finite_into(non_finite, shard);
      group_.all_reduce(non_finite, ReduceOp::max)->wait();
      optimizer_.set_skip_if(non_finite);
      optimizer_.apply_step();  // [r S, (r + 1) S), and the tail on the last rank
      optimizer_.set_skip_if(Tensor());
    } else {
      optimizer_.apply_step();
    }
  }
  times_.step = ms_since(t0);
  gather_params();
}

void ZeroStage1::gather_params() {
  const int r = group_.rank(), last = plan_.world - 1;
  const int64_t s = plan_.shard, body = s * plan_.world, tail = plan_.numel - body;
  if (plan_.world == 1) return;  // the whole buffer is this rank's
  auto t0 = Clock::now();
  kernels::NvtxRange range("zero/all_gather");
  Tensor& params = module_.flat_params();
  if (s > 0) kernels::copy(mine_, params.view(r * s, {s}));  // the all-gather's own input
  std::vector<std::shared_ptr<Work>> works;
  Tensor gathered = params.view(0, {body});
  if (s > 0) works.push_back(group_.all_gather(gathered, mine_));
  Tensor tail_params = params.view(body, {tail});
  if (tail > 0) works.push_back(group_.broadcast(tail_params, last));
  wait_all(works);
  times_.all_gather = ms_since(t0);
}

std::vector<std::pair<std::string, Tensor>> ZeroStage1::gather_optimizer_state() const {
  kernels::NvtxRange range("zero/gather_state");
  const int r = group_.rank(), last = plan_.world - 1;
  const int64_t s = plan_.shard, body = s * plan_.world, tail = plan_.numel - body;
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, mine] : optimizer_.state()) {
    DP_CHECK(mine.numel() == plan_.end(r) - plan_.begin(r),
             "ZeRO-1: optimizer state '" << name << "' holds " << mine.numel() << " values, rank "
                                         << r << "'s shard " << plan_.end(r) - plan_.begin(r));
    Tensor whole = Tensor::zeros({plan_.numel}, DType::f32, mine.device());
    if (plan_.world == 1) {
      kernels::copy(whole, mine);
    } else {
      std::vector<std::shared_ptr<Work>> works;
      Tensor gathered = whole.view(0, {body});
      if (s > 0) works.push_back(group_.all_gather(gathered, mine.view(0, {s})));
      Tensor whole_tail = whole.view(body, {tail});
      if (r == last && tail > 0) kernels::copy(whole_tail, mine.view(s, {tail}));
      if (tail > 0) works.push_back(group_.broadcast(whole_tail, last));
      wait_all(works);
    }
    out.emplace_back(name, whole);
  }
  kernels::context(module_.device()).synchronize();
  return out;
}

}  // namespace dp::dist
