// kernels.cuda.tensor_ops: the CUDA backend of the broadcasting op set (kernels/tensor_ops.hpp:
// unary, binary, where, reductions, softmax, strided copies and their gradients) against the CPU
// backend on the same random inputs, in f32 and bf16; skips without a GPU.
#include <cstring>
#include <string>
#include <vector>

#include "kernels/tensor_ops.hpp"
#include "tests/test_util.hpp"

using namespace kernels;

namespace {

using Results = std::vector<std::vector<float>>;

Tensor rnd(Device d, const Shape& s, uint32_t seed, float lo = -1.f, float hi = 1.f,
           DType dtype = DType::f32) {
  return Tensor::from_vector(
      dp_test::random_vector(static_cast<size_t>(shape_numel(s)), seed, lo, hi), s, d, dtype);
}

// 0 or 1, about half each.
Tensor mask_of(Device d, const Shape& s, uint32_t seed) {
  std::vector<float> v = dp_test::random_vector(static_cast<size_t>(shape_numel(s)), seed);
  for (float& x : v) x = x > 0.f ? 1.f : 0.f;
  return Tensor::from_vector(v, s, d);
}

// A view of `shape` with explicit strides (elements).
Layout view(const Shape& shape, const Shape& stride, int64_t offset = 0) {
  Layout l;
  l.ndim = static_cast<int>(shape.size());
  for (int k = 0; k < l.ndim; ++k) {
    l.shape[k] = shape[k];
    l.stride[k] = stride[k];
  }
  l.offset = offset;
  return l;
}

// Each result of the GPU's run within `tol` of the CPU's, relative to the CPU's largest value.
void check_match(const Results& gpu, const Results& cpu, float tol) {
  REQUIRE(gpu.size() == cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i) {
    CAPTURE(i);
    REQUIRE(gpu[i].size() == cpu[i].size());
    CHECK(dp_test::rel_diff(gpu[i], cpu[i]) <= tol);
  }
}

const Device kGpu = Device::cuda(0);
const Device kCpu = Device::cpu(0);
constexpr float kTolF32 = 1e-5f;

bool positive_domain(UnaryOp op) {
  return op == UnaryOp::log || op == UnaryOp::sqrt || op == UnaryOp::rsqrt ||
         op == UnaryOp::reciprocal || op == UnaryOp::pow;
}

// y = op(x); dx = dy op'(x) (fresh) and dx (+)= dy op'(x) (onto random values).
Results run_unary(Device d, UnaryOp op) {
  const Shape s{7, 45};
  const bool pos = positive_domain(op);
  Tensor x = rnd(d, s, 11, pos ? 0.25f : -3.f, pos ? 2.f : 3.f), dy = rnd(d, s, 12);
  Tensor y = Tensor::empty(s, DType::f32, d), dx = Tensor::empty(s, DType::f32, d);
  Tensor dx_acc = rnd(d, s, 13);
  const UnaryParams p{op == UnaryOp::pow ? 2.5f : 1.5f, -0.25f};
  unary(y, x, op, p);
  unary_backward(dx, dy, x, y, op, p, Accumulate::no);
  unary_backward(dx_acc, dy, x, y, op, p, Accumulate::yes);
  return {y.to_host_f32(), dx.to_host_f32(), dx_acc.to_host_f32()};
}

// y = a op b for a (4, 1, 5) and b (3, 1) -> y (4, 3, 5), and both gradients (a's fresh, b's
// accumulated); then a (1200, 7) and b (7), whose gradient sums 1200 rows (a block each on CUDA).
Results run_binary(Device d, BinaryOp op, DType t = DType::f32) {
  Results out;
  Tensor a = rnd(d, {4, 1, 5}, 21, -2.f, 2.f, t), b = rnd(d, {3, 1}, 22, 0.5f, 2.f, t);
  Tensor dy = rnd(d, {4, 3, 5}, 23, -1.f, 1.f, t);
  Tensor y = Tensor::empty({4, 3, 5}, t, d);
  Tensor da = Tensor::empty({4, 1, 5}, t, d), db = rnd(d, {3, 1}, 24, -1.f, 1.f, t);
  binary(y, a, b, op);
  binary_backward(da, Operand::a, dy, a, b, op, Accumulate::no);
  binary_backward(db, Operand::b, dy, a, b, op, Accumulate::yes);
  for (const Tensor* r : {&y, &da, &db}) out.push_back(r->to_host_f32());

  Tensor a2 = rnd(d, {1200, 7}, 25, -2.f, 2.f, t), b2 = rnd(d, {7}, 26, 0.5f, 2.f, t);
  Tensor dy2 = rnd(d, {1200, 7}, 27, -1.f, 1.f, t);
  Tensor y2 = Tensor::empty({1200, 7}, t, d);
  Tensor da2 = Tensor::empty({1200, 7}, t, d), db2 = Tensor::empty({7}, t, d);
  binary(y2, a2, b2, op);
  binary_backward(da2, Operand::a, dy2, a2, b2, op, Accumulate::no);
  binary_backward(db2, Operand::b, dy2, a2, b2, op, Accumulate::no);
  for (const Tensor* r : {&y2, &da2, &db2}) out.push_back(r->to_host_f32());
  return out;
}

// sum, mean and max over dim 1 of x (6, 37, 5) -> y (6, 5) and over the last dim of x (3, 300)
// (a block per row on CUDA), with the gradients accumulated onto random values.
Results run_reduce(Device d, ReduceOp op, DType t = DType::f32) {
  Results out;
  for (const Shape& s : {Shape{6, 37, 5}, Shape{3, 300}}) {
    const Shape ys = s.size() == 3 ? Shape{6, 5} : Shape{3};
    Tensor x = rnd(d, s, 31, -2.f, 2.f, t), dy = rnd(d, ys, 32, -1.f, 1.f, t);
    Tensor y = Tensor::empty(ys, t, d), dx = rnd(d, s, 33, -1.f, 1.f, t);
    reduce(y, x, 1, op);
    reduce_backward(dx, dy, x, y, 1, op, Accumulate::yes);
    out.push_back(y.to_host_f32());
    out.push_back(dx.to_host_f32());
  }
  return out;
}

// softmax or log-softmax over dim 1 of x (6, 37, 5) and of x (4, 300) (a block per row on
// CUDA), with the gradient fresh and accumulated.
Results run_softmax(Device d, Softmax kind, DType t = DType::f32) {
  Results out;
  for (const Shape& s : {Shape{6, 37, 5}, Shape{4, 300}}) {
    Tensor x = rnd(d, s, 41, -4.f, 4.f, t), dy = rnd(d, s, 42, -1.f, 1.f, t);
    Tensor y = Tensor::empty(s, t, d), dx = Tensor::empty(s, t, d);
    Tensor dx_acc = rnd(d, s, 43, -1.f, 1.f, t);
    softmax(y, x, 1, kind);
    softmax_backward(dx, dy, y, 1, kind, Accumulate::no);
    softmax_backward(dx_acc, dy, y, 1, kind, Accumulate::yes);
    for (const Tensor* r : {&y, &dx, &dx_acc}) out.push_back(r->to_host_f32());
  }
  return out;
}

}  // namespace

TEST_CASE("kernels.cuda.tensor_ops: unary ops and their gradients match CPU") {
  DP_REQUIRE_GPU();
  for (int i = 0; i <= static_cast<int>(UnaryOp::relu); ++i) {
    const UnaryOp op = static_cast<UnaryOp>(i);
    CAPTURE(std::string(unary_name(op)));
    check_match(run_unary(kGpu, op), run_unary(kCpu, op), kTolF32);
  }
}

TEST_CASE("kernels.cuda.tensor_ops: broadcast binary ops and both gradients match CPU") {
  DP_REQUIRE_GPU();
  for (BinaryOp op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div, BinaryOp::maximum,
                      BinaryOp::minimum}) {
    CAPTURE(std::string(binary_name(op)));
    const Results gpu = run_binary(kGpu, op);
    check_match(gpu, run_binary(kCpu, op), kTolF32);
    // The block sums (b's gradient over 1200 rows) add in one order: the same bits again.
    const Results again = run_binary(kGpu, op);
    CHECK(std::memcmp(gpu[5].data(), again[5].data(), gpu[5].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("kernels.cuda.tensor_ops: where over broadcast operands and its gradients match CPU") {
  DP_REQUIRE_GPU();
  auto run = [](Device d) {
    // mask (4, 1, 5), a (3, 1), b (5) -> y (4, 3, 5).
    Tensor mask = mask_of(d, {4, 1, 5}, 51), a = rnd(d, {3, 1}, 52), b = rnd(d, {5}, 53);
    Tensor dy = rnd(d, {4, 3, 5}, 54), y = Tensor::empty({4, 3, 5}, DType::f32, d);
    Tensor da = Tensor::empty({3, 1}, DType::f32, d), db = rnd(d, {5}, 55);
    where(y, mask, a, b);
    where_backward(da, Operand::a, dy, mask, Accumulate::no);
    where_backward(db, Operand::b, dy, mask, Accumulate::yes);
    return Results{y.to_host_f32(), da.to_host_f32(), db.to_host_f32()};
  };
  check_match(run(kGpu), run(kCpu), kTolF32);
}

TEST_CASE("kernels.cuda.tensor_ops: sum, mean and max over a dim and their gradients match CPU") {
  DP_REQUIRE_GPU();
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::mean, ReduceOp::max}) {
    CAPTURE(std::string(reduce_name(op)));
    check_match(run_reduce(kGpu, op), run_reduce(kCpu, op), kTolF32);
  }
}

TEST_CASE("kernels.cuda.tensor_ops: softmax and log-softmax and their gradients match CPU") {
  DP_REQUIRE_GPU();
  for (Softmax kind : {Softmax::softmax, Softmax::log_softmax}) {
    CAPTURE(kind == Softmax::softmax ? "softmax" : "log_softmax");
    check_match(run_softmax(kGpu, kind), run_softmax(kCpu, kind), kTolF32);
  }
}

TEST_CASE("kernels.cuda.tensor_ops: strided_copy of a transpose and of an expand matches CPU") {
  DP_REQUIRE_GPU();
  auto run = [](Device d) {
    // src (5, 7) into dst (7, 5) transposed: dst's view of (5, 7) steps 1 along rows.
    Tensor src = rnd(d, {5, 7}, 61), t = Tensor::zeros({7, 5}, DType::f32, d);
    Tensor t_acc = rnd(d, {7, 5}, 62);
    const Layout src_view = view({5, 7}, {7, 1}), t_view = view({5, 7}, {1, 5});
    strided_copy(t, t_view, src, src_view, Accumulate::no);
    strided_copy(t_acc, t_view, src, src_view, Accumulate::yes);
    // Row 2 of src (7) expanded over 3 rows, added into the middle of a (4, 9) dst.
    Tensor e = rnd(d, {4, 9}, 63);
    strided_copy(e, view({3, 7}, {9, 1}, 10), src, view({3, 7}, {0, 1}, 14), Accumulate::yes);
    return Results{t.to_host_f32(), t_acc.to_host_f32(), e.to_host_f32()};
  };
  const Results gpu = run(kGpu), cpu = run(kCpu);
  check_match(gpu, cpu, kTolF32);
  // A copy rounds nothing: the same bits.
  CHECK(std::memcmp(gpu[0].data(), cpu[0].data(), gpu[0].size() * sizeof(float)) == 0);
}

TEST_CASE("kernels.cuda.tensor_ops: bf16 binary, reduce and softmax match CPU") {
  DP_REQUIRE_GPU();
  // One rounding of each stored value to bf16 (2^-8 relative) on either side.
  constexpr float kTolBf16 = 1e-2f;
  for (BinaryOp op : {BinaryOp::add, BinaryOp::mul, BinaryOp::div, BinaryOp::maximum}) {
    CAPTURE(std::string(binary_name(op)));
    check_match(run_binary(kGpu, op, DType::bf16), run_binary(kCpu, op, DType::bf16), kTolBf16);
  }
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    CAPTURE(std::string(reduce_name(op)));
    check_match(run_reduce(kGpu, op, DType::bf16), run_reduce(kCpu, op, DType::bf16), kTolBf16);
  }
  check_match(run_softmax(kGpu, Softmax::log_softmax, DType::bf16),
              run_softmax(kCpu, Softmax::log_softmax, DType::bf16), kTolBf16);
}
