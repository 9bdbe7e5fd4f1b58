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
  grad_shard_ = Tensor::zeros({plan_.shard}, DType::f32, dev);
  mine_ = Tensor::zeros({plan_.shard}, DType::f32, dev);
}

bool ZeroStage1::step(float share, nn::GradScaler* scaler) {
  const int r = group_.rank(), last = plan_.world - 1;
  const int64_t s = plan_.shard, body = s * plan_.world, tail = plan_.numel - body;
  Tensor& params = module_.flat_params();
  Tensor& grads = module_.flat_grads();
  const float unscale = scaler && scaler->enabled() ? 1.f / scaler->scale() : 1.f;
  if (plan_.world == 1) {
    times_ = {};
    auto t0 = Clock::now();
    if (clip_ > 0.f) grad_norm_ = nn::clip_grad_norm(grads, clip_, unscale);
    const bool taken = scaler ? scaler->step(optimizer_, grads) : (optimizer_.step(), true);
    times_.step = ms_since(t0);
    return taken;
  }
  auto t0 = Clock::now();
  {
    kernels::NvtxRange range("zero/reduce_scatter");
    kernels::scale(grads, grads, share);  // the sum over ranks is then the global mean's
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
  if (clip_ > 0.f) {
    // The global norm from every rank's shard: one float all-reduced, one factor for all.
    kernels::NvtxRange range("zero/clip");
    const int64_t begin = optimizer_.shard_begin(), end = optimizer_.shard_end();
    Tensor shard = grads.view(begin, {end - begin});
    Tensor sq = Tensor::empty({1}, DType::f32, params.device());
    kernels::sum_squares(sq, shard);
    group_.all_reduce(sq, ReduceOp::sum)->wait();
    const double norm = std::sqrt(static_cast<double>(sq.item())) * unscale;
    grad_norm_ = static_cast<float>(norm);
    const float factor = nn::clip_factor(norm, clip_);
    if (factor != 1.f) kernels::scale(shard, shard, factor);
  }
  bool finite = true;
  if (scaler && scaler->enabled()) {
    // This rank sees only its shard's reduced gradient: the verdict is combined, one float.
    kernels::NvtxRange range("zero/check");
    const int64_t begin = optimizer_.shard_begin(), end = optimizer_.shard_end();
    Tensor verdict = Tensor::from_vector(
        {kernels::all_finite(grads.view(begin, {end - begin})) ? 1.f : 0.f}, {1}, params.device());
    group_.all_reduce(verdict, ReduceOp::min)->wait();
    finite = verdict.item() == 1.f;
  }
  {
    kernels::NvtxRange range("zero/step");
    // [r S, (r + 1) S), and the tail on the last rank
    const bool taken = scaler ? scaler->step_if(optimizer_, finite) : (optimizer_.step(), true);
    if (!taken) {  // every rank skips: the parameters stay as they are, nothing to gather
      times_.step = ms_since(t0);
      times_.all_gather = 0;
      return false;
    }
    if (s > 0) kernels::copy(mine_, params.view(r * s, {s}));
  }
  times_.step = ms_since(t0);
  t0 = Clock::now();
  {
    kernels::NvtxRange range("zero/all_gather");
    std::vector<std::shared_ptr<Work>> works;
    Tensor gathered = params.view(0, {body});
    if (s > 0) works.push_back(group_.all_gather(gathered, mine_));
    Tensor tail_params = params.view(body, {tail});
    if (tail > 0) works.push_back(group_.broadcast(tail_params, last));
    wait_all(works);
    kernels::context(module_.device()).synchronize();
  }
  times_.all_gather = ms_since(t0);
  return true;
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
