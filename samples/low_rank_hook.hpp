// LowRankHook: PowerSGD (Vogels, Karimireddy and Jaggi, 2019) written as a DDP communication
// hook (dp/distributed/comm_hook.hpp) with the public API only: what a researcher writes to try
// a new way for gradients to meet. PyTorch ships the same algorithm as
// torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook (its batched variant: one matrix
// per bucket).
//
// Each bucket of n gradient elements is seen as a matrix M (rows x cols, cols = ceil(sqrt(n)),
// zero padded) plus this rank's error from earlier steps (error feedback). One power iteration
// with a warm-started Q (cols x r) finds a rank-r approximation of the ranks' summed M:
//   P = M Q; all-reduce P; orthonormalise P's columns; Q = M^T P; all-reduce Q; M' = P Q^T
// The optimizer steps with M' (the same on every rank), and each rank keeps M less its share
// of M' as its error (PyTorch keeps M - M' with unscaled gradients and an averaged M': the same).
// Two all-reduces of (rows + cols) r floats replace one of n: about sqrt(n) / (2 r) times fewer
// bytes. The first `start_step` steps all-reduce the buckets whole (PyTorch's
// start_powerSGD_iter), and buckets that compression would not shrink `min_compression` times
// always are.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dp/distributed/comm_hook.hpp"
#include "kernels/ops.hpp"

namespace samples {

struct LowRankOptions {
  int rank = 4;                // r: columns of P and Q
  int start_step = 10;         // steps (per bucket) all-reduced whole before compression starts
  double min_compression = 2;  // compress a bucket only when it cuts its bytes this many times
  uint64_t seed = 0;           // Q's start, the same on every rank
};

class LowRankHook : public dp::dist::CommHook {
 public:
  explicit LowRankHook(LowRankOptions options = {}) : o_(options) {}

  std::string name() const override { return "powersgd-r" + std::to_string(o_.rank); }

  // Starts P's all-reduce and returns: the rest of backward runs while it travels. DDP waits for
  // the buckets' Works in bucket order, so every rank issues the Q all-reduces (in wait) in the
  // same order too.
  std::shared_ptr<dp::dist::Work> reduce(dp::dist::GradBucket& b) override {
    using kernels::Transpose;
    Bucket& s = bucket(b);
    if (s.calls++ < o_.start_step || !s.compress) return b.group->all_reduce(b.grad);
    const int64_t n = b.grad.numel();
    kernels::Tensor m_flat = s.m.view(0, {n});
    kernels::copy(m_flat, b.grad);        // M = this rank's gradient ...
    kernels::axpy(m_flat, 1.f, s.error);  // ... plus what earlier steps left out
    kernels::gemm(s.p, s.m.reshape({s.rows, s.cols}), Transpose::no, s.q,
                  Transpose::no);  // P = M Q
    return std::make_shared<Finish>(s, b, b.group->all_reduce(s.p));
  }

 private:
  struct Bucket;

  // The second half of a bucket's power iteration, run by DDP's wait(): P orthonormalised,
  // Q = M^T P all-reduced, M' = P Q^T into the gradient, and this rank's error.
  class Finish : public dp::dist::Work {
   public:
    Finish(Bucket& s, const dp::dist::GradBucket& b, std::shared_ptr<dp::dist::Work> p_sum)
        : s_(s), grad_(b.grad), share_(b.share), group_(*b.group), p_sum_(std::move(p_sum)) {}
    void wait() override {
      if (failure_) std::rethrow_exception(failure_);
      if (done_) return;
      try {
        run();
      } catch (...) {
        failure_ = std::current_exception();
        throw;
      }
      done_ = true;
    }
    bool is_completed() const override { return done_ || failure_ != nullptr; }

   private:
    void run() {
      using kernels::Transpose;
      const int64_t n = grad_.numel();
      kernels::Tensor m = s_.m.reshape({s_.rows, s_.cols});
      kernels::Tensor approx = s_.approx.reshape({s_.rows, s_.cols});
      kernels::Tensor m_flat = s_.m.view(0, {n}), approx_flat = s_.approx.view(0, {n});
      p_sum_->wait();
      orthonormalise(s_);
      kernels::gemm(s_.q, m, Transpose::yes, s_.p, Transpose::no);  // Q = M^T P
      group_.all_reduce(s_.q)->wait();
      kernels::gemm(approx, s_.p, Transpose::no, s_.q, Transpose::yes);  // M' = P Q^T
      // This rank's error: its M less its share of M' (the ranks' errors add up to sum M - M').
      kernels::copy(s_.error, m_flat);
      kernels::axpy(s_.error, -share_, approx_flat);
      kernels::copy(grad_, approx_flat);
    }

    Bucket& s_;
    kernels::Tensor grad_;
    float share_;
    dp::dist::ProcessGroup& group_;
    std::shared_ptr<dp::dist::Work> p_sum_;
    bool done_ = false;
    std::exception_ptr failure_;
  };

  struct Bucket {
    int64_t calls = 0;
    bool compress = false;
    int64_t rows = 0, cols = 0, r = 0;
    kernels::Tensor m, approx, error, p, q;  // on the gradient's device
    kernels::Tensor host_p;                  // pinned: P orthonormalised on the host
  };

  Bucket& bucket(const dp::dist::GradBucket& b) {
    auto it = buckets_.find(b.index);
    if (it != buckets_.end()) return it->second;
    Bucket& s = buckets_[b.index];
    const int64_t n = b.grad.numel();
    s.cols = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n))));
    s.rows = (n + s.cols - 1) / s.cols;
    s.r = std::min<int64_t>({o_.rank, s.rows, s.cols});
    s.compress =
        static_cast<double>((s.rows + s.cols) * s.r) * o_.min_compression <= static_cast<double>(n);
    if (!s.compress) return s;
    const kernels::Device d = b.grad.device();
    const kernels::DType f32 = kernels::DType::f32;
    s.m = kernels::Tensor::zeros({s.rows * s.cols}, f32, d);  // the padding stays zero
    s.approx = kernels::Tensor::zeros({s.rows * s.cols}, f32, d);
    s.error = kernels::Tensor::zeros({n}, f32, d);
    s.p = kernels::Tensor::empty({s.rows, s.r}, f32, d);
    s.host_p = kernels::Tensor::empty_pinned({s.rows, s.r}, f32);
    // Q's start: the same pseudo-random values on every rank (splitmix64 of seed and bucket).
    std::vector<float> q(static_cast<size_t>(s.cols * s.r));
    uint64_t x = o_.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(b.index) + 1;
    for (float& v : q) {
      uint64_t z = (x += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      v = static_cast<float>(static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
    s.q = kernels::Tensor::from_vector(q, {s.cols, s.r}, d);
    return s;
  }

  // P's columns made orthonormal (Gram-Schmidt in double), on the host: P is small (rows x r),
  // and every rank holds the same all-reduced P, so every rank gets the same bits.
  static void orthonormalise(Bucket& s) {
    const std::vector<float> p = s.p.to_host_f32();
    const int64_t rows = s.rows, r = s.r;
    std::vector<double> col(static_cast<size_t>(rows * r));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < r; ++j) col[j * rows + i] = p[i * r + j];
    for (int64_t j = 0; j < r; ++j) {
      double* c = &col[j * rows];
      double before = 0;
      for (int64_t i = 0; i < rows; ++i) before += c[i] * c[i];
      for (int64_t k = 0; k < j; ++k) {
        const double* e = &col[k * rows];
        double dot = 0;
        for (int64_t i = 0; i < rows; ++i) dot += e[i] * c[i];
        for (int64_t i = 0; i < rows; ++i) c[i] -= dot * e[i];
      }
      double norm = 0;
      for (int64_t i = 0; i < rows; ++i) norm += c[i] * c[i];
      // A column the others span (a gradient of lower rank) becomes zero, not rounding noise.
      const double inv = norm > 1e-20 * before && norm > 0 ? 1.0 / std::sqrt(norm) : 0.0;
      for (int64_t i = 0; i < rows; ++i) c[i] *= inv;
    }
    float* h = s.host_p.data<float>();
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < r; ++j) h[i * r + j] = static_cast<float>(col[j * rows + i]);
    kernels::copy(s.p, s.host_p);
  }

  LowRankOptions o_;
  std::map<int, Bucket> buckets_;
};

}  // namespace samples
