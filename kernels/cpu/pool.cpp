// Max and average pooling (NCHW; f32, f16 and bf16 storage, computed in f32). Planes (n, c) run
// in parallel; within a plane the windows are visited in order, so overlapping windows add their
// gradients deterministically.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

namespace {

// Max pooling's maximum propagates NaN, as PyTorch's does: the window's first NaN wins (a scan of
// std::max kept a NaN only where it came first). The backward's "equal to the maximum" then
// counts a NaN as equal to a NaN, so the first NaN gets the window's gradient.
inline float max_or_nan(float best, float v) {
  return v > best || (std::isnan(v) && !std::isnan(best)) ? v : best;
}
inline bool is_maximum(float v, float best) {
  return v == best || (std::isnan(v) && std::isnan(best));
}

struct Window {
  int64_t h_begin, h_end, w_begin, w_end;  // clipped to the input: padding is never visited
};

struct PoolGeometry {
  int64_t height, width, out_h, out_w;
  Pool2dParams p;

  int64_t in_plane() const { return height * width; }
  // The classic 2x2 pool with stride 2 and no padding: every window whole, two elements of two
  // rows, visited without a window's bounds (the same elements in the same order).
  bool is_2x2() const {
    return p.kernel_h == 2 && p.kernel_w == 2 && p.stride_h == 2 && p.stride_w == 2 &&
           p.pad_h == 0 && p.pad_w == 0;
  }
  int64_t out_plane() const { return out_h * out_w; }
  Window window(int64_t oh, int64_t ow) const {
    int64_t h0 = oh * p.stride_h - p.pad_h, w0 = ow * p.stride_w - p.pad_w;
    return {std::max<int64_t>(h0, 0), std::min(h0 + p.kernel_h, height), std::max<int64_t>(w0, 0),
            std::min(w0 + p.kernel_w, width)};
  }
};

// body(plane, scratch) for every (n, c) plane, in parallel; `scratch` belongs to the task running
// the body (empty until a body sizes it: grad_plane).
template <class Body>
void for_each_plane(int64_t planes, const PoolGeometry& g, Body&& body) {
  int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, g.in_plane()));
  parallel_range(planes, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t plane = begin; plane < end; ++plane) body(plane, scratch);
  });
}

PoolGeometry geometry(const Tensor& x, const Tensor& y, const Pool2dParams& p) {
  return {x.dim(2), x.dim(3), y.dim(2), y.dim(3), p};
}

// The f32 plane of n elements a backward adds its gradients into: dx's own plane `din` when dx is
// f32, else `scratch` holding it widened (Accumulate::yes) or zeros, which store_plane then rounds
// into dx once: the bits of the f32 kernel on a widened dx.
template <class T>
float* grad_plane(T* din, int64_t n, Accumulate acc, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    if (acc == Accumulate::no) std::fill_n(din, n, 0.f);
    return din;
  } else {
    scratch.resize(static_cast<size_t>(n));
    if (acc == Accumulate::yes)
      widen_block(din, n, scratch.data());
    else
      std::fill(scratch.begin(), scratch.end(), 0.f);
    return scratch.data();
  }
}
template <class T>
void store_plane(T* din, const float* plane, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) store_block(din, plane, n);
}

// y[plane, oh, ow] = window(the plane's input, its window oh, ow), rounded once into y's storage
// (any storage: with_storage); window reads the input through load_f32.
template <class WindowValue>
void pool_forward(Tensor& y, const Tensor& x, const PoolGeometry& g, WindowValue window) {
  with_storage(
      [&](auto y_t, auto x_t) {
        const auto* px = x.data<decltype(x_t)>();
        auto* py = y.data<decltype(y_t)>();
        for_each_plane(x.dim(0) * x.dim(1), g, [&](int64_t plane, std::vector<float>&) {
          const auto* in = px + plane * g.in_plane();
          auto* out = py + plane * g.out_plane();
          for (int64_t oh = 0; oh < g.out_h; ++oh)
            for (int64_t ow = 0; ow < g.out_w; ++ow)
              store_rounded(out[oh * g.out_w + ow], window(in, g.window(oh, ow)));
        });
      },
      y.dtype(), x.dtype());
}

}  // namespace

void max_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p) {
  PoolGeometry g = geometry(x, y, p);
  if (g.is_2x2()) {  // the generic window's max below, in its order
    with_storage(
        [&](auto y_t, auto x_t) {
          const auto* px = x.data<decltype(x_t)>();
          auto* py = y.data<decltype(y_t)>();
          for_each_plane(x.dim(0) * x.dim(1), g, [&](int64_t plane, std::vector<float>&) {
            for (int64_t oh = 0; oh < g.out_h; ++oh) {
              const auto* r0 = px + plane * g.in_plane() + 2 * oh * g.width;
              const auto* r1 = r0 + g.width;
              auto* out = py + plane * g.out_plane() + oh * g.out_w;
              for (int64_t ow = 0; ow < g.out_w; ++ow) {
                float best = load_f32(r0[2 * ow]);
                best = max_or_nan(best, load_f32(r0[2 * ow + 1]));
                best = max_or_nan(best, load_f32(r1[2 * ow]));
                best = max_or_nan(best, load_f32(r1[2 * ow + 1]));
                store_rounded(out[ow], best);
              }
            }
          });
        },
        y.dtype(), x.dtype());
    return;
  }
  pool_forward(y, x, g, [&](const auto* in, const Window& win) {
    float best = load_f32(in[win.h_begin * g.width + win.w_begin]);
    for (int64_t h = win.h_begin; h < win.h_end; ++h)
      for (int64_t w = win.w_begin; w < win.w_end; ++w)
        best = max_or_nan(best, load_f32(in[h * g.width + w]));
    return best;
  });
}

// The gradient of each window goes to its first element equal to the forward maximum.
void max_pool2d_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                         const Pool2dParams& p, Accumulate acc) {
  PoolGeometry g = geometry(x, y, p);
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t, auto y_t) {
        const auto* px = x.data<decltype(x_t)>();
        const auto* py = y.data<decltype(y_t)>();
        const auto* pdy = dy.data<decltype(dy_t)>();
        auto* pdx = dx.data<decltype(dx_t)>();
        for_each_plane(x.dim(0) * x.dim(1), g, [&](int64_t plane, std::vector<float>& scratch) {
          const auto* in = px + plane * g.in_plane();
          float* din = grad_plane(pdx + plane * g.in_plane(), g.in_plane(), acc, scratch);
          if (g.is_2x2()) {  // the search below, over the window's 4 elements in its order
            for (int64_t oh = 0; oh < g.out_h; ++oh)
              for (int64_t ow = 0; ow < g.out_w; ++ow) {
                const int64_t o = plane * g.out_plane() + oh * g.out_w + ow;
                const int64_t at = 2 * oh * g.width + 2 * ow;
                const float best = load_f32(py[o]);
                int64_t argmax =
                    is_maximum(load_f32(in[at + g.width + 1]), best) ? at + g.width + 1 : -1;
                argmax = is_maximum(load_f32(in[at + g.width]), best) ? at + g.width : argmax;
                argmax = is_maximum(load_f32(in[at + 1]), best) ? at + 1 : argmax;
                argmax = is_maximum(load_f32(in[at]), best) ? at : argmax;
                if (argmax >= 0) din[argmax] += load_f32(pdy[o]);
              }
          } else {
            for (int64_t oh = 0; oh < g.out_h; ++oh)
              for (int64_t ow = 0; ow < g.out_w; ++ow) {
                int64_t o = plane * g.out_plane() + oh * g.out_w + ow;
                Window win = g.window(oh, ow);
                const float best = load_f32(py[o]);
                // The first element equal to the maximum, found by selects over the whole window:
                // an early exit was a branch on data that the predictor misses about half the time.
                // Visited backwards: the last one seen is the first.
                int64_t argmax = -1;
                for (int64_t h = win.h_end - 1; h >= win.h_begin; --h)
                  for (int64_t w = win.w_end - 1; w >= win.w_begin; --w) {
                    const int64_t at = h * g.width + w;
                    argmax = is_maximum(load_f32(in[at]), best) ? at : argmax;
                  }
                if (argmax >= 0) din[argmax] += load_f32(pdy[o]);
              }
          }
          store_plane(pdx + plane * g.in_plane(), din, g.in_plane());
        });
      },
      dx.dtype(), dy.dtype(), x.dtype(), y.dtype());
}

// Divides by the full window, padding included (count_include_pad=True).
void avg_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p) {
  PoolGeometry g = geometry(x, y, p);
  double inv_area = 1.0 / (p.kernel_h * p.kernel_w);
  pool_forward(y, x, g, [&](const auto* in, const Window& win) {
    double s = 0.0;
    for (int64_t h = win.h_begin; h < win.h_end; ++h)
      for (int64_t w = win.w_begin; w < win.w_end; ++w) s += load_f32(in[h * g.width + w]);
    return static_cast<float>(s * inv_area);
  });
}

void avg_pool2d_backward(Tensor& dx, const Tensor& dy, const Pool2dParams& p, Accumulate acc) {
  PoolGeometry g = geometry(dx, dy, p);
  float inv_area = 1.f / static_cast<float>(p.kernel_h * p.kernel_w);
  with_storage(
      [&](auto dx_t, auto dy_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        auto* pdx = dx.data<decltype(dx_t)>();
        for_each_plane(dx.dim(0) * dx.dim(1), g, [&](int64_t plane, std::vector<float>& scratch) {
          float* din = grad_plane(pdx + plane * g.in_plane(), g.in_plane(), acc, scratch);
          const auto* dout = pdy + plane * g.out_plane();
          for (int64_t oh = 0; oh < g.out_h; ++oh)
            for (int64_t ow = 0; ow < g.out_w; ++ow) {
              Window win = g.window(oh, ow);
              float share = load_f32(dout[oh * g.out_w + ow]) * inv_area;
              for (int64_t h = win.h_begin; h < win.h_end; ++h)
                for (int64_t w = win.w_begin; w < win.w_end; ++w) din[h * g.width + w] += share;
            }
          store_plane(pdx + plane * g.in_plane(), din, g.in_plane());
        });
      },
      dx.dtype(), dy.dtype());
}

}  // namespace kernels::cpu
