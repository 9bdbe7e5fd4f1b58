// kernels.*: convolution (forward, data and filter gradients) and pooling against direct loops
// in double over odd shapes, strides and padding.
#include "tests/test_kernels_util.hpp"

using namespace kernels;
using namespace kt;

namespace {

struct ConvCase {
  int64_t n, c, h, w, k, r, s;
  Conv2dParams p;
  int64_t out_h() const { return conv_out_size(h, r, p.stride_h, p.pad_h); }
  int64_t out_w() const { return conv_out_size(w, s, p.stride_w, p.pad_w); }
  Shape x_shape() const { return {n, c, h, w}; }
  Shape w_shape() const { return {k, c, r, s}; }
  Shape y_shape() const { return {n, k, out_h(), out_w()}; }
};

struct ConvReference {
  std::vector<double> y, dx, dw;
};

// Every (image, filter, output pixel, tap) term of the cross-correlation, visited once:
// y += x w, dx += dy w, dw += dy x.
ConvReference ref_conv(const ConvCase& t, const Tensor& x, const Tensor& w, const Tensor& dy) {
  std::vector<double> X = to_double(x), W = to_double(w), DY = to_double(dy);
  ConvReference out{std::vector<double>(shape_numel(t.y_shape())), std::vector<double>(X.size()),
                    std::vector<double>(W.size())};
  int64_t P = t.out_h(), Q = t.out_w();
  for (int64_t n = 0; n < t.n; ++n)
    for (int64_t k = 0; k < t.k; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          int64_t yi = ((n * t.k + k) * P + p) * Q + q;
          for (int64_t c = 0; c < t.c; ++c)
            for (int64_t r = 0; r < t.r; ++r)
              for (int64_t s = 0; s < t.s; ++s) {
                int64_t h = p * t.p.stride_h - t.p.pad_h + r, v = q * t.p.stride_w - t.p.pad_w + s;
                if (h < 0 || h >= t.h || v < 0 || v >= t.w) continue;
                int64_t xi = ((n * t.c + c) * t.h + h) * t.w + v;
                int64_t wi = ((k * t.c + c) * t.r + r) * t.s + s;
                out.y[yi] += X[xi] * W[wi];
                out.dx[xi] += DY[yi] * W[wi];
                out.dw[wi] += DY[yi] * X[xi];
              }
        }
  return out;
}

Conv2dParams conv_params(int sh, int sw, int ph, int pw) {
  Conv2dParams p;
  p.stride_h = sh;
  p.stride_w = sw;
  p.pad_h = ph;
  p.pad_w = pw;
  return p;
}

Pool2dParams pool_params(int kh, int kw, int sh, int sw, int ph, int pw) {
  Pool2dParams p;
  p.kernel_h = kh;
  p.kernel_w = kw;
  p.stride_h = sh;
  p.stride_w = sw;
  p.pad_h = ph;
  p.pad_w = pw;
  return p;
}

const ConvCase kConvCases[] = {
    {3, 5, 7, 6, 4, 3, 2, conv_params(2, 1, 1, 0)},   // odd everything
    {2, 3, 8, 8, 6, 3, 3, conv_params(1, 1, 1, 1)},   // "same" 3x3
    {10, 4, 5, 3, 3, 1, 1, conv_params(1, 1, 0, 0)},  // pointwise (no im2col); 10 images
    {10, 2, 9, 9, 3, 5, 5, conv_params(3, 2, 2, 1)},  // big window, several image groups
};

}  // namespace

TEST_CASE("kernels.conv2d_forward: odd shapes, strides, padding, 1x1") {
  for (const ConvCase& t : kConvCases) {
    CAPTURE(shape_str(t.x_shape()));
    CAPTURE(shape_str(t.w_shape()));
    Tensor x = random_tensor(t.x_shape(), 100), w = random_tensor(t.w_shape(), 101);
    Tensor y = filled(t.y_shape(), NAN);
    conv2d_forward(y, x, w, t.p);
    CHECK(max_error(y, ref_conv(t, x, w, zeros(t.y_shape())).y) <= 1e-5);
  }
}

TEST_CASE("kernels.conv2d_backward_data: adjoint of forward, overwrite and accumulate") {
  for (const ConvCase& t : kConvCases) {
    CAPTURE(shape_str(t.x_shape()));
    CAPTURE(shape_str(t.w_shape()));
    Tensor x = random_tensor(t.x_shape(), 110), w = random_tensor(t.w_shape(), 111);
    Tensor dy = random_tensor(t.y_shape(), 112), dx = filled(t.x_shape(), NAN);
    std::vector<double> want = ref_conv(t, x, w, dy).dx;
    conv2d_backward_data(dx, dy, w, t.p, Accumulate::no);
    CHECK(max_error(dx, want) <= 1e-5);
    conv2d_backward_data(dx, dy, w, t.p, Accumulate::yes);
    for (double& v : want) v *= 2.0;
    CHECK(max_error(dx, want) <= 1e-5);
  }
}

TEST_CASE("kernels.conv2d_backward_filter: sums over the batch, same bits on any thread count") {
  for (const ConvCase& t : kConvCases) {
    CAPTURE(shape_str(t.x_shape()));
    CAPTURE(shape_str(t.w_shape()));
    Tensor x = random_tensor(t.x_shape(), 120), dy = random_tensor(t.y_shape(), 121);
    Tensor dw1 = filled(t.w_shape(), NAN), dw2 = zeros(t.w_shape());
    std::vector<double> want = ref_conv(t, x, zeros(t.w_shape()), dy).dw;
    with_cpu_threads(1, [&] { conv2d_backward_filter(dw1, dy, x, t.p, Accumulate::no); });
    with_cpu_threads(2, [&] { conv2d_backward_filter(dw2, dy, x, t.p, Accumulate::no); });
    CHECK(max_error(dw1, want) <= 1e-5);
    CHECK(bitwise_equal(dw1, dw2));
    conv2d_backward_filter(dw1, dy, x, t.p, Accumulate::yes);
    for (double& v : want) v *= 2.0;
    CHECK(max_error(dw1, want) <= 1e-5);
  }
}

TEST_CASE("kernels.conv2d: empty batch, bad shapes") {
  ConvCase t = kConvCases[0];
  t.n = 0;
  Tensor x = zeros(t.x_shape()), w = random_tensor(t.w_shape(), 130), y = zeros(t.y_shape());
  conv2d_forward(y, x, w, t.p);
  conv2d_backward_data(x, y, w, t.p, Accumulate::no);
  Tensor dw = filled(t.w_shape(), 3.f);
  conv2d_backward_filter(dw, y, x, t.p, Accumulate::no);  // nothing to sum: zero
  CHECK(dw.to_host_f32() == std::vector<float>(dw.numel(), 0.f));

  Tensor x1 = zeros({1, 3, 8, 8}), w1 = zeros({4, 2, 3, 3}), y1 = zeros({1, 4, 6, 6});
  CHECK_THROWS_WITH_AS(conv2d_forward(y1, x1, w1, Conv2dParams{}),
                       doctest::Contains("channels differ: x [1, 3, 8, 8] vs w [4, 2, 3, 3]"),
                       Error);
  Tensor w2 = zeros({4, 3, 3, 3});
  CHECK_THROWS_WITH_AS(conv2d_forward(y1, x1, w2, conv_params(2, 2, 0, 0)),
                       doctest::Contains("y must be [1, 4, 3, 3]"), Error);
  CHECK_THROWS_WITH_AS(conv2d_forward(y1, x1, zeros({4, 3, 9, 9}), Conv2dParams{}),
                       doctest::Contains("exceeds the padded input"), Error);
  CHECK(conv_out_size(8, 3, 2, 1) == 4);
  CHECK(conv_out_size(7, 7, 1, 0) == 1);
}

namespace {

// The f32 values a 16-bit tensor holds: x rounded to `t` and widened back (exact).
Tensor rounded_f32(const Tensor& x, DType t) {
  return cast(cast(x, t), DType::f32);
}

float round_to(DType t, float v) {
  return t == DType::bf16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
}

// The contract of a 16-bit pass: out (+)= round_t(result), where `result` is the f32 pass on the
// (exactly widened) 16-bit inputs; a 16-bit out rounds the f32 sum once more.
std::vector<float> expected_16bit(const Tensor& result, DType t, const Tensor& prev,
                                  DType out_dtype, Accumulate acc) {
  std::vector<float> r = result.to_host_f32(), before = prev.to_host_f32(), want(r.size());
  for (size_t i = 0; i < r.size(); ++i) {
    float v = round_to(t, r[i]);
    if (acc == Accumulate::yes) v = before[i] + v;
    want[i] = out_dtype == DType::f32 ? v : round_to(t, v);
  }
  return want;
}

// An output of `dtype` holding `values` (rounded when 16-bit).
Tensor output_like(const Tensor& values, DType dtype) {
  return dtype == DType::f32 ? values.clone() : cast(values, dtype);
}

}  // namespace

// Bitwise by construction: the 16-bit path widens its inputs exactly to the values of the
// pre-rounded f32 inputs used here, runs the same f32 code on the same shapes (whose tiling and
// image groups depend on the shape only, never on the thread count), and the last steps (one
// rounding to the 16-bit type, one f32 add, one more rounding for a 16-bit output) are the same
// IEEE operations in the same order. A double-precision check against the direct loops guards
// the f32 code itself: one 16-bit rounding, u |v| with u = 2^-8 (bf16) or 2^-11 (f16), plus
// the f32 slack of the tests above.
TEST_CASE("kernels.conv2d: f16 and bf16 inputs round the f32 result once (all passes)") {
  for (const ConvCase& t : kConvCases)
    for (DType dt : {DType::bf16, DType::f16})
      for (DType out : {DType::f32, dt}) {
        CAPTURE(shape_str(t.x_shape()));
        CAPTURE(shape_str(t.w_shape()));
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(std::string(dtype_name(out)));
        Tensor x = random_tensor(t.x_shape(), 140), w = random_tensor(t.w_shape(), 141);
        Tensor dy = random_tensor(t.y_shape(), 142);
        Tensor x16 = cast(x, dt), w16 = cast(w, dt), dy16 = cast(dy, dt);
        Tensor xr = rounded_f32(x, dt), wr = rounded_f32(w, dt), dyr = rounded_f32(dy, dt);
        ConvReference ref = ref_conv(t, xr, wr, dyr);
        const double u = dt == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);

        Tensor y_f32 = zeros(t.y_shape()), y = Tensor::empty(t.y_shape(), out, Device::cpu());
        conv2d_forward(y_f32, xr, wr, t.p);
        conv2d_forward(y, x16, w16, t.p);
        CHECK(y.to_host_f32() == expected_16bit(y_f32, dt, y_f32, out, Accumulate::no));
        CHECK(max_error(y, ref.y) <= u + 1e-5);

        Tensor dx_f32 = zeros(t.x_shape());
        conv2d_backward_data(dx_f32, dyr, wr, t.p, Accumulate::no);
        Tensor dw_f32 = zeros(t.w_shape());
        conv2d_backward_filter(dw_f32, dyr, xr, t.p, Accumulate::no);
        for (Accumulate acc : {Accumulate::no, Accumulate::yes}) {
          CAPTURE(acc == Accumulate::yes);
          Tensor dx_prev = output_like(random_tensor(t.x_shape(), 143), out);
          Tensor dx = dx_prev.clone();
          conv2d_backward_data(dx, dy16, w16, t.p, acc);
          CHECK(dx.to_host_f32() == expected_16bit(dx_f32, dt, dx_prev, out, acc));
          Tensor dw_prev = output_like(random_tensor(t.w_shape(), 144), out);
          Tensor dw = dw_prev.clone();
          conv2d_backward_filter(dw, dy16, x16, t.p, acc);
          CHECK(dw.to_host_f32() == expected_16bit(dw_f32, dt, dw_prev, out, acc));
          if (acc == Accumulate::no) {
            CHECK(max_error(dx, ref.dx) <= u + 1e-5);
            CHECK(max_error(dw, ref.dw) <= u + 1e-5);
          }
        }
      }
}

TEST_CASE("kernels.conv2d: mixed input dtypes and a wrong output dtype name the dtypes") {
  ConvCase t = kConvCases[1];
  Tensor x = zeros(t.x_shape(), DType::bf16), w = zeros(t.w_shape(), DType::f16);
  Tensor y = zeros(t.y_shape()), dy = zeros(t.y_shape(), DType::bf16);
  CHECK_THROWS_WITH_AS(
      conv2d_forward(y, x, w, t.p),
      doctest::Contains("conv2d_forward: x and w must be f32, f16 or bf16 of one dtype, got x "
                        "bf16 and w f16"),
      Error);
  Tensor dx = zeros(t.x_shape());
  CHECK_THROWS_WITH_AS(conv2d_backward_data(dx, zeros(t.y_shape()), w, t.p, Accumulate::no),
                       doctest::Contains("conv2d_backward_data: dy and w must be f32, f16 or bf16 "
                                         "of one dtype, got dy f32 and w f16"),
                       Error);
  Tensor dw = zeros(t.w_shape(), DType::f16);
  CHECK_THROWS_WITH_AS(
      conv2d_backward_filter(dw, dy, x, t.p, Accumulate::no),
      doctest::Contains("conv2d_backward_filter: dw must be f32 or bf16 for dy and x of bf16"),
      Error);
  Tensor xi = zeros(t.x_shape(), DType::i32), wi = zeros(t.w_shape(), DType::i32);
  CHECK_THROWS_WITH_AS(conv2d_forward(y, xi, wi, t.p), doctest::Contains("got x i32 and w i32"),
                       Error);
  // f32 inputs take an f32 output only.
  Tensor y16 = zeros(t.y_shape(), DType::bf16);
  CHECK_THROWS_WITH_AS(conv2d_forward(y16, zeros(t.x_shape()), zeros(t.w_shape()), t.p),
                       doctest::Contains("y must be f32 for x and w of f32, got Tensor(bf16"),
                       Error);
}

namespace {

// Max or average pooling of one plane layout (N, C, H, W) by direct loops in double. Max pooling
// takes the first maximum of each window (padding never wins) and routes dy there; average
// pooling divides by the full window.
struct PoolReference {
  std::vector<double> y, dx;
};
enum class PoolKind { max, avg };

PoolReference ref_pool(PoolKind kind, const Tensor& x, const Pool2dParams& p, const Tensor& dy) {
  std::vector<double> X = to_double(x), DY = to_double(dy);
  int64_t planes = x.dim(0) * x.dim(1), H = x.dim(2), W = x.dim(3);
  int64_t P = conv_out_size(H, p.kernel_h, p.stride_h, p.pad_h);
  int64_t Q = conv_out_size(W, p.kernel_w, p.stride_w, p.pad_w);
  PoolReference out{std::vector<double>(planes * P * Q), std::vector<double>(X.size())};
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t i = 0; i < P; ++i)
      for (int64_t j = 0; j < Q; ++j) {
        int64_t o = (pl * P + i) * Q + j, best = -1;
        double s = 0.0;
        for (int64_t r = 0; r < p.kernel_h; ++r)
          for (int64_t c = 0; c < p.kernel_w; ++c) {
            int64_t h = i * p.stride_h - p.pad_h + r, w = j * p.stride_w - p.pad_w + c;
            if (h < 0 || h >= H || w < 0 || w >= W) continue;
            int64_t xi = (pl * H + h) * W + w;
            s += X[xi];
            if (best < 0 || X[xi] > X[best]) best = xi;
          }
        if (kind == PoolKind::max) {
          out.y[o] = X[best];
          out.dx[best] += DY[o];
        } else {
          double area = p.kernel_h * p.kernel_w;
          out.y[o] = s / area;
          for (int64_t r = 0; r < p.kernel_h; ++r)
            for (int64_t c = 0; c < p.kernel_w; ++c) {
              int64_t h = i * p.stride_h - p.pad_h + r, w = j * p.stride_w - p.pad_w + c;
              if (h >= 0 && h < H && w >= 0 && w < W) out.dx[(pl * H + h) * W + w] += DY[o] / area;
            }
        }
      }
  return out;
}

const Pool2dParams kPoolCases[] = {
    pool_params(2, 2, 2, 2, 0, 0),  // the classic, on odd sizes (floor)
    pool_params(3, 3, 2, 2, 1, 1),  // overlapping windows with padding
    pool_params(3, 2, 1, 2, 1, 0),  // rectangular
};

}  // namespace

TEST_CASE("kernels.max_pool2d: forward and backward, padding never wins") {
  Shape shape{2, 3, 7, 5};
  for (const Pool2dParams& p : kPoolCases) {
    // All inputs negative: a padded zero would win if padding took part.
    Tensor x = random_tensor(shape, 140, -2.f, -0.5f);
    Shape out{2, 3, conv_out_size(7, p.kernel_h, p.stride_h, p.pad_h),
              conv_out_size(5, p.kernel_w, p.stride_w, p.pad_w)};
    Tensor y = zeros(out), dy = random_tensor(out, 141), dx = filled(shape, NAN);
    PoolReference want = ref_pool(PoolKind::max, x, p, dy);
    max_pool2d_forward(y, x, p);
    CHECK(max_error(y, want.y) == 0.0);
    max_pool2d_backward(dx, dy, x, y, p, Accumulate::no);
    CHECK(max_error(dx, want.dx) <= 1e-6);
    max_pool2d_backward(dx, dy, x, y, p, Accumulate::yes);
    for (double& v : want.dx) v *= 2.0;
    CHECK(max_error(dx, want.dx) <= 1e-6);
  }
  // Ties: the whole gradient goes to the first maximum of the window.
  Tensor x = filled({1, 1, 2, 2}, 1.f), y = zeros({1, 1, 1, 1}), dx = zeros({1, 1, 2, 2});
  max_pool2d_forward(y, x, Pool2dParams{});
  max_pool2d_backward(dx, filled({1, 1, 1, 1}, 5.f), x, y, Pool2dParams{}, Accumulate::no);
  CHECK(dx.to_host_f32() == std::vector<float>{5.f, 0.f, 0.f, 0.f});
  // A NaN anywhere in a window is its max (PyTorch's rule; a scan of std::max kept it only as
  // the first element), and its first NaN gets the gradient; of +0 and -0 the first is kept (the
  // 2x2 path visits the generic window's elements in the same order).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor xs = tensor({1.f, nan, 0.f, 2.f, nan, 3.f, -0.f, 0.f,  //
                      1.f, 1.f, -0.f, 0.f, 0.f, -0.f, 0.f, -0.f},
                     {1, 1, 2, 8});
  Tensor ys = zeros({1, 1, 1, 4}), dxs = zeros({1, 1, 2, 8});
  max_pool2d_forward(ys, xs, Pool2dParams{});
  std::vector<float> got = ys.to_host_f32();
  CHECK(std::isnan(got[0]));
  CHECK(got[1] == 2.f);
  CHECK(std::isnan(got[2]));
  CHECK((got[3] == 0.f && std::signbit(got[3])));
  max_pool2d_backward(dxs, filled({1, 1, 1, 4}, 5.f), xs, ys, Pool2dParams{}, Accumulate::no);
  CHECK(dxs.to_host_f32() == std::vector<float>{0.f, 5.f, 0.f, 5.f, 5.f, 0.f, 5.f, 0.f,  //
                                                0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f});
  // The generic window (3x3, stride 1) alike: two NaNs, the first takes the gradient.
  Tensor xg = tensor({4.f, 1.f, 2.f, 3.f, nan, 9.f, 0.f, nan, 5.f}, {1, 1, 3, 3});
  Tensor yg = zeros({1, 1, 1, 1}), dxg = zeros({1, 1, 3, 3});
  max_pool2d_forward(yg, xg, pool_params(3, 3, 1, 1, 0, 0));
  CHECK(std::isnan(yg.to_host_f32()[0]));
  max_pool2d_backward(dxg, filled({1, 1, 1, 1}, 5.f), xg, yg, pool_params(3, 3, 1, 1, 0, 0),
                      Accumulate::no);
  CHECK(dxg.to_host_f32() == std::vector<float>{0.f, 0.f, 0.f, 0.f, 5.f, 0.f, 0.f, 0.f, 0.f});
}

TEST_CASE("kernels.avg_pool2d: forward and backward count the padding") {
  Shape shape{2, 3, 7, 5};
  for (const Pool2dParams& p : kPoolCases) {
    Tensor x = random_tensor(shape, 150);
    Shape out{2, 3, conv_out_size(7, p.kernel_h, p.stride_h, p.pad_h),
              conv_out_size(5, p.kernel_w, p.stride_w, p.pad_w)};
    Tensor y = zeros(out), dy = random_tensor(out, 151), dx = filled(shape, NAN);
    PoolReference want = ref_pool(PoolKind::avg, x, p, dy);
    avg_pool2d_forward(y, x, p);
    CHECK(max_error(y, want.y) <= 1e-6);
    avg_pool2d_backward(dx, dy, p, Accumulate::no);
    CHECK(max_error(dx, want.dx) <= 1e-6);
    avg_pool2d_backward(dx, dy, p, Accumulate::yes);
    for (double& v : want.dx) v *= 2.0;
    CHECK(max_error(dx, want.dx) <= 1e-6);
  }
  // A corner window of a padded 3x3 pool holds 4 real ones out of 9.
  Tensor ones = filled({1, 1, 2, 2}, 1.f), y = zeros({1, 1, 1, 1});
  avg_pool2d_forward(y, ones, pool_params(3, 3, 2, 2, 1, 1));
  CHECK(y.item() == doctest::Approx(4.0 / 9.0));
}

TEST_CASE("kernels.pool2d: empty batch and bad arguments") {
  Tensor x = zeros({0, 3, 4, 4}), y = zeros({0, 3, 2, 2});
  max_pool2d_forward(y, x, Pool2dParams{});
  avg_pool2d_backward(x, y, Pool2dParams{}, Accumulate::no);
  CHECK(y.numel() == 0);
  Tensor x1 = zeros({1, 3, 4, 4}), bad = zeros({1, 3, 3, 3});
  CHECK_THROWS_WITH_AS(
      max_pool2d_forward(bad, x1, Pool2dParams{}),
      doctest::Contains("y must be [1, 3, 2, 2] for x [1, 3, 4, 4], got [1, 3, 3, 3]"), Error);
  CHECK_THROWS_WITH_AS(avg_pool2d_forward(bad, x1, pool_params(2, 2, 1, 1, 2, 0)),
                       doctest::Contains("exceeds half the window"), Error);
  Tensor y1 = zeros({1, 3, 2, 2});
  CHECK_THROWS_WITH_AS(
      max_pool2d_backward(x1, zeros({1, 3, 2, 3}), x1, y1, Pool2dParams{}, Accumulate::no),
      doctest::Contains("y [1, 3, 2, 2] vs dy [1, 3, 2, 3]"), Error);
}
