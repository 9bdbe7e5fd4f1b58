// Max and average pooling (NCHW). Planes (n, c) run in parallel; within a plane the windows are
// visited in order, so overlapping windows add their gradients deterministically.
#include <algorithm>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

namespace {

struct Window {
  int64_t h_begin, h_end, w_begin, w_end;  // clipped to the input: padding is never visited
};

struct PoolGeometry {
  int64_t height, width, out_h, out_w;
  Pool2dParams p;

  int64_t in_plane() const { return height * width; }
  int64_t out_plane() const { return out_h * out_w; }
  Window window(int64_t oh, int64_t ow) const {
    int64_t h0 = oh * p.stride_h - p.pad_h, w0 = ow * p.stride_w - p.pad_w;
    return {std::max<int64_t>(h0, 0), std::min(h0 + p.kernel_h, height), std::max<int64_t>(w0, 0),
            std::min(w0 + p.kernel_w, width)};
  }
};

// body(x_plane_index) for every (n, c) plane, in parallel.
template <class Body>
void for_each_plane(int64_t planes, const PoolGeometry& g, Body&& body) {
  int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, g.in_plane()));
  parallel_range(planes, grain, [&](int64_t begin, int64_t end) {
    for (int64_t plane = begin; plane < end; ++plane) body(plane);
  });
}

PoolGeometry geometry(const Tensor& x, const Tensor& y, const Pool2dParams& p) {
  return {x.dim(2), x.dim(3), y.dim(2), y.dim(3), p};
}

}  // namespace

void max_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p) {
  PoolGeometry g = geometry(x, y, p);
  const float* px = x.data<float>();
  float* py = y.data<float>();
  for_each_plane(x.dim(0) * x.dim(1), g, [&](int64_t plane) {
    const float* in = px + plane * g.in_plane();
    float* out = py + plane * g.out_plane();
    for (int64_t oh = 0; oh < g.out_h; ++oh)
      for (int64_t ow = 0; ow < g.out_w; ++ow) {
        Window win = g.window(oh, ow);
        float best = in[win.h_begin * g.width + win.w_begin];
        for (int64_t h = win.h_begin; h < win.h_end; ++h)
          for (int64_t w = win.w_begin; w < win.w_end; ++w)
            best = std::max(best, in[h * g.width + w]);
        out[oh * g.out_w + ow] = best;
      }
  });
}

// The gradient of each window goes to its first element equal to the forward maximum.
void max_pool2d_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                         const Pool2dParams& p, Accumulate acc) {
  PoolGeometry g = geometry(x, y, p);
  const float* px = x.data<float>();
  const float* py = y.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  for_each_plane(x.dim(0) * x.dim(1), g, [&](int64_t plane) {
    const float* in = px + plane * g.in_plane();
    float* din = pdx + plane * g.in_plane();
    if (acc == Accumulate::no) std::fill_n(din, g.in_plane(), 0.f);
    for (int64_t oh = 0; oh < g.out_h; ++oh)
      for (int64_t ow = 0; ow < g.out_w; ++ow) {
        int64_t o = plane * g.out_plane() + oh * g.out_w + ow;
        Window win = g.window(oh, ow);
        int64_t argmax = -1;
        for (int64_t h = win.h_begin; h < win.h_end && argmax < 0; ++h)
          for (int64_t w = win.w_begin; w < win.w_end; ++w)
            if (in[h * g.width + w] == py[o]) {
              argmax = h * g.width + w;
              break;
            }
        if (argmax >= 0) din[argmax] += pdy[o];
      }
  });
}

// Divides by the full window, padding included (count_include_pad=True).
void avg_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p) {
  PoolGeometry g = geometry(x, y, p);
  const float* px = x.data<float>();
  float* py = y.data<float>();
  double inv_area = 1.0 / (p.kernel_h * p.kernel_w);
  for_each_plane(x.dim(0) * x.dim(1), g, [&](int64_t plane) {
    const float* in = px + plane * g.in_plane();
    float* out = py + plane * g.out_plane();
    for (int64_t oh = 0; oh < g.out_h; ++oh)
      for (int64_t ow = 0; ow < g.out_w; ++ow) {
        Window win = g.window(oh, ow);
        double s = 0.0;
        for (int64_t h = win.h_begin; h < win.h_end; ++h)
          for (int64_t w = win.w_begin; w < win.w_end; ++w) s += in[h * g.width + w];
        out[oh * g.out_w + ow] = static_cast<float>(s * inv_area);
      }
  });
}

void avg_pool2d_backward(Tensor& dx, const Tensor& dy, const Pool2dParams& p, Accumulate acc) {
  PoolGeometry g = geometry(dx, dy, p);
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  float inv_area = 1.f / static_cast<float>(p.kernel_h * p.kernel_w);
  for_each_plane(dx.dim(0) * dx.dim(1), g, [&](int64_t plane) {
    float* din = pdx + plane * g.in_plane();
    const float* dout = pdy + plane * g.out_plane();
    if (acc == Accumulate::no) std::fill_n(din, g.in_plane(), 0.f);
    for (int64_t oh = 0; oh < g.out_h; ++oh)
      for (int64_t ow = 0; ow < g.out_w; ++ow) {
        Window win = g.window(oh, ow);
        float share = dout[oh * g.out_w + ow] * inv_area;
        for (int64_t h = win.h_begin; h < win.h_end; ++h)
          for (int64_t w = win.w_begin; w < win.w_end; ++w) din[h * g.width + w] += share;
      }
  });
}

}  // namespace kernels::cpu
