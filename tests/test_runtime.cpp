// Runtime: devices, tensors and views, dtype conversions, errors, contexts.
#include <array>
#include <filesystem>
#include <fstream>
#include <thread>

#include "kernels/runtime/block_cache.hpp"
#include "kernels/runtime/event.hpp"
#include "kernels/runtime/graph.hpp"
#include "kernels/runtime/handle.hpp"
#include "kernels/runtime/memory.hpp"
#include "kernels/runtime/memory_info.hpp"
#include "kernels/runtime/nvtx.hpp"
#include "kernels/runtime/plan_cache.hpp"
#include "tests/test_util.hpp"

using namespace kernels;

TEST_CASE("runtime.device: parse and print") {
  CHECK(Device::parse("cpu") == Device::cpu(0));
  CHECK(Device::parse("cpu:3") == Device::cpu(3));
  CHECK(Device::parse("cuda:1") == Device::cuda(1));
  CHECK(Device::parse("cuda:2").str() == "cuda:2");
  CHECK_THROWS_WITH_AS(Device::parse("tpu:0"), doctest::Contains("tpu:0"), Error);
  CHECK_THROWS_WITH_AS(Device::parse("cpu:x"), doctest::Contains("cpu:x"), Error);
  CHECK(make_devices(DeviceType::cpu, 3).size() == 3);
  CHECK_THROWS_AS(make_devices(DeviceType::cpu, 0), Error);
}

TEST_CASE("runtime.device: CUDA is detected at run time") {
  if (!built_with_cuda()) CHECK(cuda_device_count() == 0);
  if (cuda_device_count() == 0) {
    CHECK(!cuda_unavailable_reason().empty());
    CHECK_THROWS_WITH_AS(Tensor::empty({2}, DType::f32, Device::cuda(0)),
                         doctest::Contains("cuda:0"), Error);
  } else {
    CHECK(physical_gpu(Device::cuda(cuda_device_count())) == 0);  // logical devices wrap
  }
}

TEST_CASE("runtime.device: --device flags choose a type, auto falls back with a reason") {
  std::string why;
  CHECK(choose_device_type("cpu", &why) == DeviceType::cpu);
  CHECK(why.empty());
  CHECK_THROWS_WITH_AS(choose_device_type("tpu"), doctest::Contains("tpu"), Error);
  if (cuda_device_count() == 0) {
    CHECK(choose_device_type("auto", &why) == DeviceType::cpu);
    CHECK(why.find(cuda_unavailable_reason()) != std::string::npos);
    CHECK_THROWS_WITH_AS(choose_device_type("cuda"), doctest::Contains("no usable GPU"), Error);
  } else {
    CHECK(choose_device_type("auto", &why) == DeviceType::cuda);
    CHECK(choose_device_type("cuda") == DeviceType::cuda);
  }
}

TEST_CASE("runtime.fault_word: a CPU device's word says no fault, other bits say one") {
  // CPU ops throw at once: their devices have no fault record, and their word is always clear.
  // (A CUDA context's is tested in kernels.cuda.softmax_cross_entropy.)
  DeviceContext& ctx = context(Device::cpu(1));
  Tensor word = Tensor::zeros({2}, DType::f32, Device::cpu(1));
  queue_fault_word(word, ctx);
  CHECK(!fault_written(word.data<float>()));
  const float written[2] = {0.f, 0.f};
  CHECK(fault_written(written));
  Tensor wide = Tensor::zeros({3}, DType::f32, Device::cpu(1));
  CHECK_THROWS_WITH_AS(queue_fault_word(wide, ctx), doctest::Contains("must be 8 bytes"), Error);
}

TEST_CASE("runtime.tensor: views share memory and check bounds") {
  Tensor t = Tensor::from_vector({0, 1, 2, 3, 4, 5}, {3, 2});
  CHECK(t.numel() == 6);
  CHECK(t.dim(-1) == 2);
  Tensor rows = t.slice(1, 3);
  CHECK(rows.shape() == Shape{2, 2});
  CHECK(rows.to_host_f32() == std::vector<float>{2, 3, 4, 5});
  Tensor v = t.view(1, {4});
  v.data<float>()[0] = 42.f;
  CHECK(t.to_host_f32()[1] == 42.f);
  CHECK(v.same_storage(t));
  CHECK_THROWS_WITH_AS(t.view(3, {4}), doctest::Contains("exceeds"), Error);
  CHECK_THROWS_WITH_AS(t.reshape({4, 2}), doctest::Contains("[4, 2]"), Error);
  CHECK_THROWS_AS(t.slice(2, 4), Error);
  CHECK(t.slice(3, 3).numel() == 0);
  Tensor c = t.clone();
  c.data<float>()[0] = -1.f;
  CHECK(t.to_host_f32()[0] == 0.f);
}

TEST_CASE("runtime.tensor: empty shapes and bad shapes") {
  Tensor e = Tensor::zeros({0, 5}, DType::f32, Device::cpu());
  CHECK(e.numel() == 0);
  CHECK(e.to_host_f32().empty());
  CHECK_THROWS_WITH_AS(Tensor::empty({2, -1}, DType::f32, Device::cpu()),
                       doctest::Contains("negative"), Error);
  CHECK_THROWS_WITH_AS(Tensor::from_vector({1.f, 2.f}, {3}), doctest::Contains("[3]"), Error);
  CHECK_THROWS_AS(Tensor().device(), Error);
}

TEST_CASE("runtime.dtype: f16 and bf16 round trips") {
  for (float x : {0.f, 1.f, -2.5f, 65504.f, 6.1035156e-05f, 5.9604645e-08f, 1e-3f, 3.14159f}) {
    float h = f16_to_f32(f32_to_f16(x));
    CHECK(h == doctest::Approx(x).epsilon(1e-3));
    float b = bf16_to_f32(f32_to_bf16(x));
    CHECK(b == doctest::Approx(x).epsilon(8e-3));
  }
  CHECK(f16_to_f32(f32_to_f16(1e6f)) == INFINITY);  // overflow saturates to inf
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  Tensor t = Tensor::from_vector({1.f, 0.5f, -3.f}, {3}, Device::cpu(), DType::bf16);
  CHECK(t.dtype() == DType::bf16);
  CHECK(t.to_host_f32() == std::vector<float>{1.f, 0.5f, -3.f});
}

TEST_CASE("runtime.errors: messages name the check, file and line") {
  try {
    DP_CHECK(1 + 1 == 3, "arithmetic is broken: " << 42);
    FAIL("no throw");
  } catch (const Error& e) {
    std::string m = e.what();
    CHECK(m.find("arithmetic is broken: 42") != std::string::npos);
    CHECK(m.find("test_runtime.cpp") != std::string::npos);
    CHECK(m.find("1 + 1 == 3") != std::string::npos);
  }
}

TEST_CASE("runtime.context: one per thread and device, with memory counters") {
  DeviceContext* main_ctx = &context(Device::cpu(0));
  CHECK(&context(Device::cpu(0)) == main_ctx);
  DeviceContext* other = nullptr;
  std::thread([&] { other = &context(Device::cpu(0)); }).join();
  CHECK(other != main_ctx);

  DeviceContext mine(Device::cpu(1), {1});
  CHECK(mine.cpu_threads() == 1);
  {
    ContextScope scope(mine);
    CHECK(&context(Device::cpu(1)) == &mine);
    int64_t before = mine.memory()->current.load();
    {
      Tensor t = Tensor::empty({1000}, DType::f32, Device::cpu(1));
      CHECK(mine.memory()->current.load() == before + 4000);
    }
    CHECK(mine.memory()->current.load() == before);
    CHECK(mine.memory()->peak.load() >= before + 4000);
  }
  CHECK(&context(Device::cpu(1)) != &mine);
}

TEST_CASE("runtime.memory: copy_bytes and fill_bytes between CPU devices, overlapping views") {
  Tensor a = Tensor::from_vector(std::vector<float>(600000, 2.5f), {600000}, Device::cpu(0));
  Tensor b = Tensor::empty({600000}, DType::f32, Device::cpu(1));
  copy_bytes(b, a);  // > 1 MiB, disjoint: the parallel path
  CHECK(b.to_host_f32() == a.to_host_f32());
  fill_bytes(b, 0);
  CHECK(b.to_host_f32() == std::vector<float>(600000, 0.f));
  Tensor v = Tensor::from_vector({0, 1, 2, 3, 4, 5}, {6});
  Tensor dst = v.view(1, {4});
  copy_bytes(dst, v.view(0, {4}));  // overlapping: memmove semantics
  CHECK(v.to_host_f32() == std::vector<float>{0, 0, 1, 2, 3, 5});
  Tensor i = Tensor::from_ints({1}, {1});
  CHECK_THROWS_WITH_AS(copy_bytes(i, v.view(0, {1})), doctest::Contains("dtypes differ"), Error);
}

// ---- UniqueHandle and PlanCache, with fake create/destroy functions ------------------------

namespace {

// A fake C library: handles are pointers to its objects; it counts creations and destructions.
struct FakeObject {
  int id = 0;
};
using FakeHandle = FakeObject*;
enum class FakeStatus { ok, bad };
int fake_created = 0, fake_destroyed = 0;
bool fake_destroy_fails = false;

FakeStatus fake_create(FakeHandle* h) {
  *h = new FakeObject{++fake_created};
  return FakeStatus::ok;
}
FakeStatus fake_destroy(FakeHandle h) {
  delete h;
  ++fake_destroyed;
  return fake_destroy_fails ? FakeStatus::bad : FakeStatus::ok;
}
FakeStatus fake_set(FakeHandle, int value) {
  return value < 0 ? FakeStatus::bad : FakeStatus::ok;
}

using FakeUnique = UniqueHandle<FakeHandle, FakeStatus, fake_destroy, FakeStatus::ok>;

// The shape of the cuDNN descriptor owners: create, adopt at once, then "set" calls that may
// throw from inside the constructor.
struct FakeDescriptorPair {
  FakeUnique a, b;
  FakeDescriptorPair(int value_a, int value_b) {
    FakeHandle raw = nullptr;
    fake_create(&raw);
    a = FakeUnique(raw);
    DP_CHECK(fake_set(a.get(), value_a) == FakeStatus::ok, "set a: " << value_a);
    fake_create(&raw);
    b = FakeUnique(raw);
    DP_CHECK(fake_set(b.get(), value_b) == FakeStatus::ok, "set b: " << value_b);
  }
};

void reset_fake() {
  fake_created = fake_destroyed = 0;
  fake_destroy_fails = false;
}

}  // namespace

TEST_CASE("runtime.handle: a set call that throws in a constructor leaks no descriptor") {
  reset_fake();
  { FakeDescriptorPair ok(1, 2); }
  CHECK(fake_created == 2);
  CHECK(fake_destroyed == 2);
  reset_fake();
  CHECK_THROWS_WITH_AS(FakeDescriptorPair(-1, 2), doctest::Contains("set a: -1"), Error);
  CHECK(fake_created == 1);
  CHECK(fake_destroyed == 1);
  reset_fake();
  CHECK_THROWS_WITH_AS(FakeDescriptorPair(1, -2), doctest::Contains("set b: -2"), Error);
  CHECK(fake_created == 2);
  CHECK(fake_destroyed == 2);
}

TEST_CASE("runtime.handle: moves transfer ownership, destroy runs once, a failure only logs") {
  reset_fake();
  {
    FakeHandle raw = nullptr;
    fake_create(&raw);
    FakeUnique a(raw);
    FakeUnique b(std::move(a));
    CHECK(!a);
    CHECK(b.get() == raw);
    FakeUnique c;
    c = std::move(b);
    CHECK(c.get() == raw);
    fake_create(&raw);
    c = FakeUnique(raw);  // the old one is destroyed at the assignment
    CHECK(fake_destroyed == 1);
    fake_destroy_fails = true;  // logged, not thrown (destructors never throw)
  }
  CHECK(fake_created == 2);
  CHECK(fake_destroyed == 2);
  reset_fake();
}

TEST_CASE("runtime.plan_cache: hits and misses, a throwing build stores nothing, capacity") {
  PlanCache<std::array<int64_t, 2>, FakeUnique> cache(3);
  int built = 0;
  auto make = [&] {
    ++built;
    FakeHandle raw = nullptr;
    fake_create(&raw);
    return FakeUnique(raw);
  };
  reset_fake();
  FakeHandle first = cache.get({1, 2}, make).get();
  CHECK(cache.get({1, 2}, make).get() == first);  // the same plan, not rebuilt
  CHECK(cache.get({2, 1}, make).get() != first);
  CHECK(built == 2);
  CHECK(cache.hits() == 1);
  CHECK(cache.misses() == 2);
  CHECK(cache.size() == 2);
  CHECK_THROWS_WITH_AS(cache.get({9, 9}, []() -> FakeUnique { DP_THROW("no algorithm"); }),
                       doctest::Contains("no algorithm"), Error);
  CHECK(cache.size() == 2);
  CHECK(cache.misses() == 3);
  cache.get({3, 3}, make);  // the third plan fills the cache
  CHECK(cache.size() == 3);
  cache.get({4, 4}, make);  // a miss on a full cache drops the old plans (destroyed) first
  CHECK(cache.size() == 1);
  CHECK(fake_destroyed == 3);
  cache.clear();
  CHECK(fake_destroyed == 4);
  CHECK(fake_created == 4);
  reset_fake();
}

TEST_CASE("runtime.context: state<T> is one object per context, destroyed with it") {
  struct Counted {
    int uses = 0;
  };
  DeviceContext a(Device::cpu(5), {1}), b(Device::cpu(5), {1});
  a.state<Counted>().uses++;
  a.state<Counted>().uses++;
  CHECK(a.state<Counted>().uses == 2);
  CHECK(b.state<Counted>().uses == 0);  // per context, never shared
  CHECK(&a.state<Counted>() != &b.state<Counted>());
}

// ---- graphs (kernels/runtime/graph.hpp) ----------------------------------------------------

namespace {
// A small piece of work on cpu:0: y = alpha (x + b), z = sum of squares of y.
struct GraphWork {
  Tensor x = Tensor::from_vector({1, 2, 3}, {3}, Device::cpu(0));
  Tensor b = Tensor::from_vector({10, 20, 30}, {3}, Device::cpu(0));
  Tensor y = Tensor::zeros({3}, DType::f32, Device::cpu(0));
  Tensor z = Tensor::zeros({1}, DType::f32, Device::cpu(0));
  float alpha = 2.f;
  void operator()() {
    add(y, x, b);
    scale(y, y, alpha);
    sum_squares(z, y);
  }
};
}  // namespace

TEST_CASE(
    "runtime.graph: a CPU capture records without running, and replays read current contents") {
  DeviceContext ctx(Device::cpu(0), {.cpu_threads = 2, .caching = Caching::on});
  ContextScope scope(ctx);
  GraphWork work;
  Tensor &x = work.x, &y = work.y, &z = work.z;
  Graph g;
  CHECK(!g.captured());
  g.capture(ctx, [&] { work(); });
  CHECK(g.captured());
  CHECK(g.nodes() == 3);
  CHECK(y.to_host_f32() == std::vector<float>{0, 0, 0});  // recorded, not run
  g.replay();
  CHECK(y.to_host_f32() == std::vector<float>{22, 44, 66});
  CHECK(z.item() == 22.f * 22 + 44.f * 44 + 66.f * 66);
  // The recording holds the tensors, not their values: new contents of x give a new result,
  // while the scalar argument (2) stays what it was when captured.
  fill(x, 0.f);
  g.replay();
  CHECK(y.to_host_f32() == std::vector<float>{20, 40, 60});
  g.reset();
  CHECK(!g.captured());
  CHECK_THROWS_WITH_AS(g.replay(), doctest::Contains("nothing captured"), Error);
}

// Last stop's hostile pass: a host value handed to an op that changed every step (a layer's
// rising temperature) was replayed as captured, with no word, on a GPU as on CPU devices. A
// graph that observed the step before its capture now compares the capture's ops with it.
TEST_CASE("runtime.graph: a capture after observe names the host value, op or count that changed") {
  DeviceContext ctx(Device::cpu(0), {.cpu_threads = 1, .caching = Caching::on});
  ContextScope scope(ctx);
  GraphWork work;
  Tensor &x = work.x, &b = work.b, &y = work.y;
  float& alpha = work.alpha;
  auto body = [&] { work(); };
  Graph g;
  g.observe(ctx, body);  // runs the work
  CHECK(y.to_host_f32() == std::vector<float>{22, 44, 66});
  CHECK(!g.captured());
  g.capture(ctx, body);  // the same values: captured
  CHECK(g.captured());
  CHECK(g.nodes() == 3);

  g.observe(ctx, body);
  alpha = 3.f;
  CHECK_THROWS_WITH_AS(g.capture(ctx, body),
                       doctest::Contains("a host value changed between steps on cpu:0: scale's "
                                         "argument `alpha` was 2 at the step before the capture "
                                         "and is 3 now, and a replay would repeat what the "
                                         "capture saw"),
                       Error);
  CHECK(!g.captured());
  CHECK(!ctx.capturing());
  CHECK(!ctx.noting());
  // A view at an offset the host chose (a window that moves each step).
  Tensor buf = Tensor::zeros({6}, DType::f32, Device::cpu(0));
  int64_t at = 0;
  auto window = [&] {
    Tensor v = buf.view(at, {3});
    add(v, x, b);
  };
  g.observe(ctx, window);
  at = 3;
  CHECK_THROWS_WITH_AS(g.capture(ctx, window),
                       doctest::Contains("add's argument `y` was f32 [3] at the step before the "
                                         "capture and is f32 [3] at byte 12 now"),
                       Error);
  // Another op chosen on the host.
  bool relu_it = false;
  auto chosen = [&] {
    if (relu_it)
      relu(y, x);
    else
      scale(y, x, 1.f);
  };
  g.observe(ctx, chosen);
  relu_it = true;
  CHECK_THROWS_WITH_AS(g.capture(ctx, chosen),
                       doctest::Contains("the work changed between steps on cpu:0: op 1 of the "
                                         "capture is relu where the step before it queued scale"),
                       Error);
  // Fewer ops, and more.
  int n = 2;
  auto some = [&] {
    for (int i = 0; i < n; ++i) scale(y, y, 1.f);
  };
  g.observe(ctx, some);
  n = 1;
  CHECK_THROWS_WITH_AS(g.capture(ctx, some),
                       doctest::Contains("the capture queued 1 op where the step before it queued "
                                         "2 (the first missing: scale)"),
                       Error);
  n = 2;
  g.observe(ctx, some);
  n = 3;
  CHECK_THROWS_WITH_AS(g.capture(ctx, some),
                       doctest::Contains("the capture queues op scale after the 2 ops the step "
                                         "before it queued"),
                       Error);
  CHECK(!g.captured());
  // A failed capture used its observation up, and reset() drops one: nothing to compare with.
  g.capture(ctx, some);
  CHECK(g.captured());
  g.observe(ctx, body);
  alpha = 4.f;
  g.reset();
  g.capture(ctx, body);
  CHECK(g.captured());
  // Not inside a capture, nor inside another observation.
  Graph other;
  CHECK_THROWS_WITH_AS(other.capture(ctx, [&] { g.observe(ctx, body); }),
                       doctest::Contains("a graph captures there"), Error);
  CHECK_THROWS_WITH_AS(other.observe(ctx, [&] { g.observe(ctx, body); }),
                       doctest::Contains("a graph observes there"), Error);
  CHECK_THROWS_WITH_AS(other.observe(ctx, [&] { g.capture(ctx, body); }),
                       doctest::Contains("a graph observes there"), Error);
  CHECK(!ctx.noting());
}

TEST_CASE(
    "runtime.graph: host reads, events and a second capture are refused, the context stays "
    "usable") {
  DeviceContext ctx(Device::cpu(0), {.cpu_threads = 1, .caching = Caching::on});
  ContextScope scope(ctx);
  Tensor x = Tensor::from_vector({1, 2}, {2}, Device::cpu(0));
  Tensor y = Tensor::zeros({2}, DType::f32, Device::cpu(0));
  Graph g;
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { (void)all_finite(x); }),
                       doctest::Contains("not capturable"), Error);
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { ctx.synchronize(); }),
                       doctest::Contains("host read or wait on cpu:0"), Error);
  Event e(Event::Timing::off);
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { e.record(ctx); }),
                       doctest::Contains("recording an event"), Error);
  Graph other;
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { other.capture(ctx, [] {}); }),
                       doctest::Contains("captures there already"), Error);
  CHECK(!g.captured());
  CHECK(!ctx.capturing());
  // Not this thread's context for the device: its ops would go elsewhere.
  DeviceContext stray(Device::cpu(0), {.cpu_threads = 1});
  CHECK_THROWS_WITH_AS(g.capture(stray, [] {}), doctest::Contains("not the one this thread"),
                       Error);
  scale(y, x, 3.f);  // the context runs work again
  CHECK(y.to_host_f32() == std::vector<float>{3, 6});
  CHECK(all_finite(y));
}

// A hostile pass: a CPU device's cache kept every size it ever saw (1.9 GB after 300 batch
// sizes of a 3.7 MB step: the host heap never runs out as a GPU does), and a model kept past
// its engine held every block its workers had cached.
TEST_CASE(
    "runtime.block_cache: a CPU cache stays bounded as sizes change, and frees with its context") {
  const Device dev = Device::cpu(0);
  const int64_t mib = int64_t{1} << 20;
  auto ctx = std::make_unique<DeviceContext>(
      dev, ContextOptions{.cpu_threads = 1, .caching = Caching::on});
  const std::shared_ptr<BlockCache> cache = ctx->block_cache();
  Tensor kept;
  {
    ContextScope scope(*ctx);
    // A size taken every round (a step's), and a new 8 MiB size each round: 320 MiB of them.
    for (int k = 0; k < 40; ++k) {
      Tensor steady = Tensor::empty({mib}, DType::f32, dev);
      Tensor once = Tensor::empty({2 * mib + 64 * k}, DType::f32, dev);
    }
    CHECK(cache->idle_bytes() > 4 * mib);
    CHECK(cache->idle_bytes() <= BlockCache::kHostIdleBytes + 16 * mib);
    // The size asked for every round stayed: taking it again allocates nothing.
    const int64_t allocations = ctx->memory()->allocations.load();
    { Tensor steady = Tensor::empty({mib}, DType::f32, dev); }
    CHECK(ctx->memory()->allocations.load() == allocations);
    kept = Tensor::empty({mib}, DType::f32, dev);
  }
  // The context goes while a tensor of its cache lives: the idle blocks go at once, and that
  // tensor's block when it does.
  ctx.reset();
  CHECK(cache->idle_bytes() == 0);
  kept = Tensor();
  CHECK(cache->idle_bytes() == 0);
}

TEST_CASE("runtime.graph: blocks taken while capturing stay the graph's until it is destroyed") {
  DeviceContext ctx(Device::cpu(0), {.cpu_threads = 1, .caching = Caching::on});
  ContextScope scope(ctx);
  const Shape s{1000};
  Tensor x = Tensor::from_vector(std::vector<float>(1000, 1.f), s, Device::cpu(0));
  Tensor out = Tensor::zeros({1}, DType::f32, Device::cpu(0));
  const void* warm = nullptr;
  {
    Tensor t = Tensor::empty(s, DType::f32, Device::cpu(0));
    warm = t.raw();
  }  // cached
  const int64_t allocations = ctx.memory()->allocations.load();
  Graph g;
  const void* temp_block = nullptr;
  g.capture(ctx, [&] {
    Tensor temp = Tensor::empty(s, DType::f32, Device::cpu(0));  // the cached block
    temp_block = temp.storage()->data();  // (temp.raw() is a host access: refused here)
    scale(temp, x, 2.f);
    sum_squares(out, temp);
  });
  CHECK(temp_block == warm);
  CHECK(ctx.memory()->allocations.load() == allocations);  // a warm cache: nothing new
  {
    // The graph's block is not handed out while the graph lives: a replay writes it.
    Tensor other = Tensor::empty(s, DType::f32, Device::cpu(0));
    CHECK(other.raw() != temp_block);
  }
  g.replay();
  CHECK(out.item() == 4000.f);
  g.reset();
  Tensor again = Tensor::empty(s, DType::f32, Device::cpu(0));
  CHECK(again.raw() == temp_block);  // back in the cache with the graph gone
}

// A step's second graph (the update) captured `after` its first (backward) shares its pool: its
// temporary takes the block the first one's temporary freed inside its capture, as the eager
// step's second half does, where a graph of its own finds none (the block is the first graph's)
// and a GPU's capture, which cannot take new memory, fails.
TEST_CASE("runtime.graph: a graph captured after another takes the blocks that one freed") {
  DeviceContext ctx(Device::cpu(0), {.cpu_threads = 1, .caching = Caching::on});
  ContextScope scope(ctx);
  const Shape s{500};
  Tensor x = Tensor::from_vector(std::vector<float>(500, 1.f), s, Device::cpu(0));
  Tensor first_out = Tensor::zeros({1}, DType::f32, Device::cpu(0));
  Tensor second_out = Tensor::zeros({1}, DType::f32, Device::cpu(0));
  const void* first_block = nullptr;
  const void* second_block = nullptr;
  auto first = [&] {
    Tensor temp = Tensor::empty(s, DType::f32, Device::cpu(0));
    first_block = temp.storage()->data();
    scale(temp, x, 2.f);
    sum_squares(first_out, temp);  // 500 * 4
  };
  auto second = [&] {
    Tensor temp = Tensor::empty(s, DType::f32, Device::cpu(0));
    second_block = temp.storage()->data();
    scale(temp, x, 3.f);
    sum_squares(second_out, temp);  // 500 * 9
  };
  first();
  second();  // eagerly: one block of 500 floats serves both
  CHECK(second_block == first_block);
  const int64_t allocations = ctx.memory()->allocations.load();

  // Each graph its own pool: the second capture misses.
  {
    Graph g1, g2;
    g1.capture(ctx, first);
    CHECK_THROWS_AS(g2.capture(ctx, second), CaptureMemoryError);
    CHECK_FALSE(g2.captured());
  }
  // The second captured after the first: the same block, nothing allocated, and replays in
  // that order compute what the eager step does.
  Graph g1, g2;
  g1.capture(ctx, first);
  g2.capture(ctx, second, &g1);
  CHECK(second_block == first_block);
  CHECK(ctx.memory()->allocations.load() == allocations);
  for (int k = 0; k < 2; ++k) {
    fill(first_out, 0.f);
    fill(second_out, 0.f);
    g1.replay();
    g2.replay();
    CHECK(first_out.item() == 2000.f);
    CHECK(second_out.item() == 4500.f);
  }
  {
    // The pool's block is handed to nothing else while either graph lives.
    Tensor other = Tensor::empty(s, DType::f32, Device::cpu(0));
    CHECK(other.raw() != first_block);
  }
  g1.reset();  // the second graph holds the pool still
  {
    Tensor other = Tensor::empty(s, DType::f32, Device::cpu(0));
    CHECK(other.raw() != first_block);
  }
  fill(second_out, 0.f);
  g2.replay();
  CHECK(second_out.item() == 4500.f);
  g2.reset();
  Tensor again = Tensor::empty(s, DType::f32, Device::cpu(0));
  CHECK(again.raw() == first_block);  // back in the cache with both graphs gone

  // What it may follow: a captured graph of this context, not itself.
  Graph empty, g3;
  CHECK_THROWS_WITH_AS(g3.capture(ctx, second, &empty),
                       doctest::Contains("the graph it follows was not captured"), Error);
  CHECK_THROWS_WITH_AS(g3.capture(ctx, second, &g3), doctest::Contains("a graph after itself"),
                       Error);
  DeviceContext other_ctx(Device::cpu(1), {.cpu_threads = 1, .caching = Caching::on});
  Graph elsewhere;
  {
    ContextScope other_scope(other_ctx);
    Tensor y = Tensor::zeros({1}, DType::f32, Device::cpu(1));
    elsewhere.capture(other_ctx, [&] { fill(y, 1.f); });
  }
  CHECK_THROWS_WITH_AS(g3.capture(ctx, second, &elsewhere),
                       doctest::Contains("the graph it follows was captured on another context"),
                       Error);
}

TEST_CASE(
    "runtime.graph: a capture's temporaries reuse each other's blocks as eagerly, and replay "
    "right") {
  // Eagerly, a temporary freed early gives its block to the next one of its size: the capture
  // must fit in the same blocks, or a GPU refuses it (its cache cannot grow while capturing).
  DeviceContext ctx(Device::cpu(0), {.cpu_threads = 1, .caching = Caching::on});
  ContextScope scope(ctx);
  const Shape s{64};
  Tensor x = Tensor::from_vector(std::vector<float>(64, 1.f), s, Device::cpu(0));
  Tensor out = Tensor::zeros({1}, DType::f32, Device::cpu(0));
  auto body = [&] {
    for (int k = 1; k <= 3; ++k) {
      Tensor t = Tensor::empty(s, DType::f32, Device::cpu(0));  // one block, three times
      scale(t, x, static_cast<float>(k));
      axpy(x, 1.f, t);  // x += k x: x = 2, 6, 24
    }
    sum_squares(out, x);
  };
  body();  // eager: x = 24, the cache holds one block of 64 floats
  const int64_t allocations = ctx.memory()->allocations.load();
  ctx.memory()->begin_window();
  const int64_t before = ctx.memory()->current.load();
  Graph g;
  g.capture(ctx, body);
  CHECK(ctx.memory()->allocations.load() == allocations);
  // Never more than one temporary in use at once: the eager step's peak.
  CHECK(ctx.memory()->window_peak.load() == before + 64 * 4);
  fill(x, 1.f);
  g.replay();
  CHECK(x.to_host_f32() == std::vector<float>(64, 24.f));
  CHECK(out.item() == 64.f * 24 * 24);
  g.replay();  // each replay from what the last left: 24 * 24
  CHECK(x.to_host_f32() == std::vector<float>(64, 576.f));
}

TEST_CASE("runtime.graph: a CPU capture refuses what a CUDA capture refuses, in its words") {
  DeviceContext ctx(Device::cpu(0), {.cpu_threads = 1, .caching = Caching::on});
  ContextScope scope(ctx);
  Tensor x = Tensor::from_vector({1, 2}, {2}, Device::cpu(0));
  Graph g;
  // A block the cache does not hold: a GPU cannot take memory while capturing.
  CHECK_THROWS_WITH_AS(
      g.capture(ctx, [&] { (void)Tensor::empty({777}, DType::f32, Device::cpu(0)); }),
      doctest::Contains("allocating 3108 bytes on cpu:0 while a graph captures"), Error);
  // A host loop over a device tensor, named by the range it runs in (an nn layer's).
  CHECK_THROWS_WITH_AS(g.capture(ctx,
                                 [&] {
                                   NvtxRange layer("MyLayer");
                                   float* p = x.data<float>();  // a replay would skip this
                                   p[0] = 0.f;
                                 }),
                       doctest::Contains("host read or write of Tensor(f32, cpu:0, [2]) on cpu:0 "
                                         "while a graph captures there (in MyLayer)"),
                       Error);
  CHECK(x.to_host_f32() == std::vector<float>{1, 2});  // the refused write did not happen
  // Another device's tensors are not this capture's: the host may use them.
  Tensor other = Tensor::from_vector({5}, {1}, Device::cpu(1));
  g.capture(ctx, [&] { CHECK(other.data<float>()[0] == 5.f); });
  CHECK(g.captured());
  // A context that caches nothing cannot serve a capture's allocation either.
  DeviceContext plain(Device::cpu(2), {.cpu_threads = 1});
  ContextScope plain_scope(plain);
  Graph h;
  CHECK_THROWS_WITH_AS(
      h.capture(plain, [&] { (void)Tensor::empty({4}, DType::f32, Device::cpu(2)); }),
      doctest::Contains("allocating 16 bytes on cpu:2 while a graph captures"), Error);
  CHECK(!plain.capturing());
  CHECK(capturing_on_this_thread() == nullptr);
}

// A hostile pass found five ways past the capture rules on CPU devices, each of which a GPU
// refuses or leaves out of the graph: Tensor::to and from_vector onto or off a capturing device
// other than cpu:0 (recorded and replayed on the CPU; a GPU waits for the copy), a copy out of
// the capturing device queued on another's stream (runs once on a GPU, missing from replays),
// Event::synchronize, a graph replayed into a capture, and pinned host memory.
TEST_CASE("runtime.graph: copies to and from a capturing device and waits on it are refused") {
  const Device dev = Device::cpu(1);
  DeviceContext ctx(dev, {.cpu_threads = 1, .caching = Caching::on});
  ContextScope scope(ctx);
  Tensor x = Tensor::from_vector({1, 2}, {2}, dev);
  Tensor host = Tensor::from_vector({7, 8}, {2}, Device::cpu(0));
  Tensor out = Tensor::empty({2}, DType::f32, Device::cpu(0));
  Event recorded;
  recorded.record(ctx);
  Graph before;
  before.capture(ctx, [&] { kernels::fill(x, 3.f); });
  const char* const wait = "a host read or wait on cpu:1 while a graph captures there";
  Graph g;
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { (void)Tensor::from_vector({1}, {1}, dev); }),
                       doctest::Contains(wait), Error);
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { (void)host.to(dev); }), doctest::Contains(wait), Error);
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { (void)x.to(Device::cpu(0)); }), doctest::Contains(wait),
                       Error);
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { recorded.synchronize(); }), doctest::Contains(wait),
                       Error);
  CHECK_THROWS_WITH_AS(
      g.capture(ctx, [&] { kernels::copy(out, x); }),
      doctest::Contains("a copy out to cpu:0 on cpu:1 while a graph captures there"), Error);
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { before.replay(); }),
                       doctest::Contains("replaying a graph on cpu:1 while a graph captures"),
                       Error);
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { (void)Tensor::empty_pinned({4}, DType::f32); }),
                       doctest::Contains("allocating pinned host memory on cpu:1"), Error);
  CHECK(!g.captured());
  CHECK(!ctx.capturing());
  // Nothing refused ran, and all of it works outside a capture.
  CHECK(x.to_host_f32() == std::vector<float>{1, 2});
  before.replay();
  kernels::copy(out, x);
  CHECK(out.to_host_f32() == std::vector<float>{3, 3});
  recorded.synchronize();
}

// Event::record_in_graph: each replay records the event (CUDA: an external event record node),
// so work outside the graph can follow part of it (DP's pulls beside a captured backward). What
// CUDA cannot do is refused on CPU devices too: a capture of an event never recorded before
// (CUDA makes no event there), and a replay whose event is gone (it would record a destroyed
// one).
TEST_CASE("runtime.graph: an event recorded in a graph is recorded by each replay, or refused") {
  const Device dev = Device::cpu(1);
  DeviceContext ctx(dev, {.cpu_threads = 1, .caching = Caching::on});
  ContextScope scope(ctx);
  Tensor x = Tensor::from_vector({1, 2}, {2}, dev);
  Event fresh(Event::Timing::off);
  Graph g;
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { fresh.record_in_graph(ctx); }),
                       doctest::Contains("Event::record_in_graph on cpu:1 while a graph captures: "
                                         "the event was never recorded there before"),
                       Error);
  CHECK(!g.captured());
  // Eagerly it is record(); plain record() stays refused inside a capture.
  Event ready;
  ready.record_in_graph(ctx);
  CHECK(ready.recorded());
  CHECK_THROWS_WITH_AS(g.capture(ctx, [&] { ready.record(ctx); }),
                       doctest::Contains("recording an event on cpu:1 while a graph captures"),
                       Error);
  Event start;
  start.record(ctx);
  g.capture(ctx, [&] {
    kernels::scale(x, x, 2.f);
    ready.record_in_graph(ctx);
  });
  REQUIRE(g.captured());
  const Event::Clock::time_point captured_at = ready.host_time();
  CHECK(x.to_host_f32() == std::vector<float>{1, 2});  // captured, not run
  g.replay();
  CHECK(x.to_host_f32() == std::vector<float>{2, 4});
  CHECK(ready.host_time() > captured_at);  // the replay recorded it
  CHECK(Event::elapsed_ms(start, ready) >= 0.0);
  // Moved, the event is the same one: the graph records it where it went.
  Event moved = std::move(ready);
  g.replay();
  CHECK(x.to_host_f32() == std::vector<float>{4, 8});
  const Event::Clock::time_point before = moved.host_time();
  g.replay();
  CHECK(moved.host_time() > before);
  // Gone: the next replay throws where it would record it.
  moved = Event();
  CHECK_THROWS_WITH_AS(g.replay(),
                       doctest::Contains("an event it records "
                                         "(Event::record_in_graph) was destroyed"),
                       Error);
}

namespace {
// Writes `text` to root + path, making its folders.
void put(const std::string& root, const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(root + path).parent_path());
  std::ofstream(root + path) << text;
}
}  // namespace

// The host's memory as the checks before a run read it: MemAvailable, capped by the headroom of
// the process's cgroup at every level of its path (a Slurm job's, a systemd unit's), under v2
// and v1; no limit ("max", v1's 2^63 - 4096) leaves MemAvailable.
TEST_CASE("runtime.memory: host memory is capped by every level of the cgroup, v2 and v1") {
  const std::string root = dp_test::temp_path("runtime", "fake_root");
  std::filesystem::remove_all(root);
  put(root, "/proc/meminfo", "MemTotal: 20000000 kB\nMemAvailable: 10000 kB\n");
  // No cgroup file: MemAvailable.
  kernels::AvailableMemory m = kernels::host_memory_available_under(root);
  CHECK(m.bytes == 10000 * 1024);
  CHECK(m.source == "MemAvailable in /proc/meminfo");
  // v2: the job's level limits (the step's says max); 4 MB limit less 1 MB used.
  put(root, "/proc/self/cgroup", "0::/job/step\n");
  put(root, "/sys/fs/cgroup/job/step/memory.max", "max\n");
  put(root, "/sys/fs/cgroup/job/step/memory.current", "500000\n");
  put(root, "/sys/fs/cgroup/job/memory.max", "4000000\n");
  put(root, "/sys/fs/cgroup/job/memory.current", "1000000\n");
  m = kernels::host_memory_available_under(root);
  CHECK(m.bytes == 3000000);
  CHECK(m.source == "the cgroup's memory.max less memory.current in /sys/fs/cgroup/job");
  // v1 (Slurm's cgroup plugin on older systems): the memory controller's line, among others.
  std::filesystem::remove_all(root + "/sys");
  put(root, "/proc/self/cgroup", "5:cpu,cpuacct:/slurm/job_1\n4:memory:/slurm/job_1\n");
  put(root, "/sys/fs/cgroup/memory/slurm/job_1/memory.limit_in_bytes", "2000000\n");
  put(root, "/sys/fs/cgroup/memory/slurm/job_1/memory.usage_in_bytes", "500000\n");
  m = kernels::host_memory_available_under(root);
  CHECK(m.bytes == 1500000);
  CHECK(m.source ==
        "the cgroup's memory.limit_in_bytes less memory.usage_in_bytes in "
        "/sys/fs/cgroup/memory/slurm/job_1");
  // v1 without a limit: 2^63 - 4096 means none.
  put(root, "/sys/fs/cgroup/memory/slurm/job_1/memory.limit_in_bytes", "9223372036854771712\n");
  m = kernels::host_memory_available_under(root);
  CHECK(m.bytes == 10000 * 1024);
  std::filesystem::remove_all(root);
}
