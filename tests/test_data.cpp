// dp::data: IDX reader (good, truncated, corrupt files), MNIST-format and synthetic data sets,
// and the prefetching loader (determinism, coverage, drop_last, shutdown, error propagation).
#include <sys/resource.h>
#include <zlib.h>

#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dp/data/idx.hpp"
#include "dp/data/loader.hpp"
#include "dp/data/mnist.hpp"
#include "dp/data/synthetic.hpp"
#include "dp/data/text.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using namespace dp::data;

namespace {

// A fresh directory under the system temp dir, removed with its contents at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("dp_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

enum class Compression { none, gzip };

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes, Compression c) {
  if (c == Compression::gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    REQUIRE(f != nullptr);
    if (!bytes.empty())
      REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
              static_cast<int>(bytes.size()));
    REQUIRE(gzclose(f) == Z_OK);
  } else {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out.good());
  }
}

// An IDX image: magic 0 0 `dtype` ndims, big-endian dims, then `data`.
std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data,
                               uint8_t dtype = 0x08) {
  std::vector<uint8_t> out{0, 0, dtype, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims)
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(d >> shift));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<uint8_t> ramp(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 7 + 3);
  return v;
}

// The message of the exception that `f` throws ("" when it throws none); kernels::Error
// messages are prefixed with "kernels::Error: " so that tests can tell the type.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kernels::Error& e) {
    return std::string("kernels::Error: ") + e.what();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Checks that `msg` (evaluated once) contains `part`.
#define CHECK_ERROR_HAS(msg, part)                                              \
  do {                                                                          \
    const std::string dp_msg_ = (msg);                                          \
    CHECK_MESSAGE(contains(dp_msg_, part),                                      \
                  "message: \"" << dp_msg_ << "\" lacks \"" << (part) << "\""); \
  } while (0)

// Writes a small MNIST-format directory: n images of rows x cols, labels i % 10.
void write_fake_mnist(const TempDir& dir, const std::string& prefix, uint32_t n_images,
                      uint32_t n_labels, Compression c, uint32_t rows = 4, uint32_t cols = 3) {
  std::vector<uint8_t> labels(n_labels);
  for (uint32_t i = 0; i < n_labels; ++i) labels[i] = static_cast<uint8_t>(i % 10);
  std::string ext = c == Compression::gzip ? ".gz" : "";
  write_bytes(dir.file(prefix + "-images-idx3-ubyte" + ext),
              idx_bytes({n_images, rows, cols}, ramp(size_t{n_images} * rows * cols)), c);
  write_bytes(dir.file(prefix + "-labels-idx1-ubyte" + ext), idx_bytes({n_labels}, labels), c);
}

// A data set whose sample i is filled with the value i and labelled i % 3; optionally slow,
// optionally throwing at one index.
class CountingDataset : public Dataset {
 public:
  explicit CountingDataset(int64_t n, std::chrono::microseconds delay = {}, int64_t throw_at = -1)
      : n_(n), delay_(delay), throw_at_(throw_at) {}
  int64_t size() const override { return n_; }
  kernels::Shape sample_shape() const override { return {1, 2, 2}; }
  int num_classes() const override { return 3; }
  std::string name() const override { return "counting"; }
  mutable std::atomic<int64_t> calls{0};

 protected:
  void get_unchecked(int64_t index, float* image, int32_t* label) const override {
    ++calls;
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
    if (index == throw_at_)
      throw std::runtime_error("disk on fire at sample " + std::to_string(index));
    for (int j = 0; j < 4; ++j) image[j] = static_cast<float>(index);
    *label = static_cast<int32_t>(index % 3);
  }

 private:
  int64_t n_;
  std::chrono::microseconds delay_;
  int64_t throw_at_;
};

// Every batch of one pass, in order.
std::vector<Batch> drain(Loader& loader) {
  std::vector<Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

std::vector<int64_t> concat_indices(const std::vector<Batch>& batches) {
  std::vector<int64_t> all;
  for (const Batch& b : batches) all.insert(all.end(), b.indices.begin(), b.indices.end());
  return all;
}

}  // namespace

// ---- IDX ------------------------------------------------------------------------------------

TEST_CASE("data.idx: reads plain and gzipped u8 files") {
  TempDir dir;
  auto data = ramp(5 * 4 * 3);
  for (Compression c : {Compression::none, Compression::gzip}) {
    std::string path = dir.file(c == Compression::gzip ? "a.gz" : "a");
    write_bytes(path, idx_bytes({5, 4, 3}, data), c);
    IdxArray a = read_idx(path);
    CHECK(a.path == path);
    CHECK(a.dims == std::vector<int64_t>{5, 4, 3});
    CHECK(a.count() == 5);
    CHECK(a.item_size() == 12);
    CHECK(a.bytes == data);
  }
  // Compression is detected from the content, not the name.
  write_bytes(dir.file("gz_without_suffix"), idx_bytes({7}, ramp(7)), Compression::gzip);
  CHECK(read_idx(dir.file("gz_without_suffix")).bytes == ramp(7));
}

TEST_CASE("data.idx: truncated data and headers name the file and the sizes") {
  TempDir dir;
  auto full = idx_bytes({10, 28, 28}, ramp(7840));
  for (Compression c : {Compression::none, Compression::gzip}) {
    std::string path = dir.file(c == Compression::gzip ? "short.gz" : "short");
    write_bytes(path, std::vector<uint8_t>(full.begin(), full.begin() + 16 + 1000), c);
    std::string msg = error_of([&] { read_idx(path); });
    CHECK_ERROR_HAS(msg, path);
    CHECK_ERROR_HAS(msg, "truncated: expected 7840 bytes of data, got 1000");
  }
  std::string header = dir.file("header");
  write_bytes(header, std::vector<uint8_t>(full.begin(), full.begin() + 10), Compression::none);
  std::string msg = error_of([&] { read_idx(header); });
  CHECK_ERROR_HAS(msg, header);
  CHECK_ERROR_HAS(msg, "truncated header");

  std::string tiny = dir.file("tiny");
  write_bytes(tiny, {0, 0}, Compression::none);
  CHECK_ERROR_HAS(error_of([&] { read_idx(tiny); }), "truncated header");

  // A gzip stream cut in the middle of its compressed bytes.
  std::string gz = dir.file("full.gz");
  write_bytes(gz, full, Compression::gzip);
  std::ifstream packed_in(gz, std::ios::binary);
  std::vector<char> packed((std::istreambuf_iterator<char>(packed_in)),
                           std::istreambuf_iterator<char>());
  std::string cut = dir.file("cut.gz");
  std::ofstream(cut, std::ios::binary)
      .write(packed.data(), static_cast<std::streamsize>(packed.size() / 2));
  msg = error_of([&] { read_idx(cut); });
  CHECK_ERROR_HAS(msg, cut);
  CHECK_ERROR_HAS(msg, "truncated");
}

TEST_CASE("data.idx: bad magic and dtype byte and dims are reported") {
  TempDir dir;
  struct Case {
    std::vector<uint8_t> bytes;
    std::string expect;
  };
  std::vector<Case> cases = {
      {{0x12, 0x34, 0x08, 0x01, 0, 0, 0, 1, 9}, "bad magic 0x12340801"},
      {{0x00, 0x00, 0x01, 0x23}, "bad magic 0x00000123: unknown dtype byte 0x01"},
      {idx_bytes({4}, std::vector<uint8_t>(16), 0x0D), "unsupported dtype byte 0x0d (f32)"},
      {{0x00, 0x00, 0x08, 0x00}, "zero dimensions"},
      {idx_bytes({3, 0, 2}, {}), "dimension 1 of 3 is zero"},
      {idx_bytes({0xFFFFFFFFu, 0xFFFFFFFFu}, {}), "absurd dimensions"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string path = dir.file("bad" + std::to_string(i));
    write_bytes(path, cases[i].bytes, Compression::none);
    std::string msg = error_of([&] { read_idx(path); });
    CHECK_ERROR_HAS(msg, path);
    CHECK_ERROR_HAS(msg, cases[i].expect);
  }
}

TEST_CASE("data.idx: trailing garbage and missing files are reported") {
  TempDir dir;
  auto bytes = idx_bytes({6}, ramp(6));
  bytes.insert(bytes.end(), {1, 2, 3});
  for (Compression c : {Compression::none, Compression::gzip}) {
    std::string path = dir.file(c == Compression::gzip ? "long.gz" : "long");
    write_bytes(path, bytes, c);
    std::string msg = error_of([&] { read_idx(path); });
    CHECK_ERROR_HAS(msg, path);
    CHECK_ERROR_HAS(msg, "trailing garbage: 3 bytes after the 6 bytes of data");
  }
  std::string missing = dir.file("nope");
  std::string msg = error_of([&] { read_idx(missing); });
  CHECK_ERROR_HAS(msg, missing);
  CHECK_ERROR_HAS(msg, "no such file");
  // A file that exists but cannot be looked at (here a link loop; a folder without search
  // permission alike) is not called missing: the reason is given, for every reader.
  std::string loop = dir.file("loop");
  std::filesystem::create_symlink(loop, loop);
  for (const std::string& e :
       {error_of([&] { read_idx(loop); }), error_of([&] { read_idx_header(loop); }),
        error_of([&] { dp::data::read_text_file(loop, 1 << 20); })}) {
    CHECK_ERROR_HAS(e, loop + ": cannot stat it: Too many levels of symbolic links");
  }
}

// ---- MNIST format ---------------------------------------------------------------------------

TEST_CASE("data.mnist: loads a small MNIST-format directory plain or gzipped") {
  for (Compression c : {Compression::none, Compression::gzip}) {
    TempDir dir;
    write_fake_mnist(dir, "train", 12, 12, c);
    write_fake_mnist(dir, "t10k", 5, 5, c);
    MnistDataset train(dir.path.string(), Split::train, MnistOptions{0.5f, 0.25f});
    MnistDataset test(dir.path.string(), Split::test);
    CHECK(train.size() == 12);
    CHECK(test.size() == 5);
    CHECK(train.sample_shape() == kernels::Shape{1, 4, 3});
    CHECK(train.num_classes() == 10);
    CHECK(contains(train.images_path(), c == Compression::gzip ? "idx3-ubyte.gz" : "idx3-ubyte"));

    std::vector<float> image(12);
    int32_t label = -1;
    train.get(11, image.data(), &label);
    CHECK(label == 1);
    auto pixels = ramp(12 * 12);
    for (int j = 0; j < 12; ++j) {
      float expected = (pixels[11 * 12 + j] / 255.f - 0.5f) / 0.25f;
      CHECK(image[j] == doctest::Approx(expected).epsilon(1e-6));
    }
    CHECK_ERROR_HAS(error_of([&] { train.get(12, image.data(), &label); }), "out of range");
  }
}

TEST_CASE("data.mnist: count mismatch and bad labels and missing files name the path") {
  TempDir dir;
  write_fake_mnist(dir, "train", 12, 11, Compression::none);
  std::string msg = error_of([&] { MnistDataset(dir.path.string(), Split::train); });
  CHECK_ERROR_HAS(msg, "image/label count mismatch");
  CHECK_ERROR_HAS(msg, dir.file("train-images-idx3-ubyte"));
  CHECK_ERROR_HAS(msg, dir.file("train-labels-idx1-ubyte"));
  CHECK_ERROR_HAS(msg, "12 images");
  CHECK_ERROR_HAS(msg, "11 labels");

  write_bytes(dir.file("train-labels-idx1-ubyte"), idx_bytes({12}, std::vector<uint8_t>(12, 10)),
              Compression::none);
  msg = error_of([&] { MnistDataset(dir.path.string(), Split::train); });
  CHECK_ERROR_HAS(msg, dir.file("train-labels-idx1-ubyte"));
  CHECK_ERROR_HAS(msg, "label 10 at index 0 out of range");

  // The test split is missing.
  msg = error_of([&] { MnistDataset(dir.path.string(), Split::test); });
  CHECK_ERROR_HAS(msg, dir.file("t10k-images-idx3-ubyte"));
  CHECK_ERROR_HAS(msg, "dataset-fashion-mnist");
  CHECK_ERROR_HAS(msg, "--data DIR");

  std::string nowhere = dir.file("no/such/dir");
  msg = error_of([&] { MnistDataset(nowhere, Split::train); });
  CHECK_ERROR_HAS(msg, nowhere);
  CHECK_ERROR_HAS(msg, "dataset-fashion-mnist");
  CHECK_ERROR_HAS(msg, "--data DIR");

  // An images file that cannot be looked at is named with the reason, not reported missing.
  const std::string images = dir.file("t10k-images-idx3-ubyte");
  std::filesystem::create_symlink(images, images);
  msg = error_of([&] { MnistDataset(dir.path.string(), Split::test); });
  CHECK_ERROR_HAS(msg, images + ": cannot stat it: Too many levels of symbolic links");
  const std::string loop_dir = dir.file("loop_dir");
  std::filesystem::create_symlink(loop_dir, loop_dir);
  msg = error_of([&] { MnistDataset(loop_dir, Split::train); });
  CHECK_ERROR_HAS(msg, "directory " + loop_dir + ": cannot stat it: Too many levels");
}

TEST_CASE("data.idx: a header declaring more than the file can hold fails before the body") {
  TempDir dir;
  // 60000 x 28 x 28 declared, 1000 bytes given: a plain file says so from its size, a gzip
  // file from deflate's maximum ratio (a 1 KB stream cannot expand to 47 MB).
  auto bytes = idx_bytes({60000, 28, 28}, ramp(1000));
  std::string plain = dir.file("liar"), gz = dir.file("liar.gz");
  write_bytes(plain, bytes, Compression::none);
  write_bytes(gz, bytes, Compression::gzip);
  std::string msg = error_of([&] { read_idx(plain); });
  CHECK_ERROR_HAS(msg, plain);
  CHECK_ERROR_HAS(msg, "truncated: expected 47040000 bytes of data, got 1000");
  for (auto* read : {&read_idx, &read_idx_header}) {
    msg = error_of([&] { (*read)(gz); });
    CHECK_ERROR_HAS(msg, gz);
    CHECK_ERROR_HAS(msg, "declares 60000 x 28 x 28 = 47040000 bytes of data, more than a");
    CHECK_ERROR_HAS(msg, "deflate's maximum ratio of 1032:1");
  }
  CHECK_ERROR_HAS(error_of([&] { read_idx("/dev/zero"); }), "not a regular file");
  // A consistent file's header reads without its body.
  write_bytes(plain, idx_bytes({10, 2}, ramp(20)), Compression::gzip);
  IdxArray h = read_idx_header(plain);
  CHECK(h.dims == std::vector<int64_t>{10, 2});
  CHECK(h.bytes.empty());
}

TEST_CASE("data.mnist: a 4 MB .gz whose header claims 5.4 M images fails at once") {
  TempDir dir;
  // 4 MB of incompressible pixels behind a header claiming 5,400,000 images; 60000 labels.
  std::vector<uint8_t> noise(4u << 20);
  std::mt19937 gen(7);
  for (auto& b : noise) b = static_cast<uint8_t>(gen());
  write_bytes(dir.file("train-images-idx3-ubyte.gz"), idx_bytes({5400000, 28, 28}, noise),
              Compression::gzip);
  std::vector<uint8_t> labels(60000);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<uint8_t>(i % 10);
  write_bytes(dir.file("train-labels-idx1-ubyte.gz"), idx_bytes({60000}, labels),
              Compression::gzip);
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  std::string msg = error_of([&] { MnistDataset(dir.path.string(), Split::train); });
  getrusage(RUSAGE_SELF, &after);
  CHECK_ERROR_HAS(msg, "image/label count mismatch");
  CHECK_ERROR_HAS(msg, "5400000 images");
  CHECK_ERROR_HAS(msg, "60000 labels");
  // The old reader decompressed the body first: 4.4 GB and 17 s.
  CHECK(after.ru_maxrss - before.ru_maxrss < 64 * 1024);
}

TEST_CASE("data.mnist: the installed Fashion-MNIST loads with the right sizes") {
  if (!fs::exists(kDefaultFashionMnistDir)) {
    std::printf("SKIPPED (%s missing: install dataset-fashion-mnist): %s\n",
                kDefaultFashionMnistDir, doctest::getContextOptions()->currentTest->m_name);
    ++dp_test::skipped_cases();
    return;
  }
  MnistDataset train(kDefaultFashionMnistDir, Split::train);
  MnistDataset test(kDefaultFashionMnistDir, Split::test);
  CHECK(train.size() == 60000);
  CHECK(test.size() == 10000);
  CHECK(train.sample_shape() == kernels::Shape{1, 28, 28});
  CHECK(test.sample_shape() == kernels::Shape{1, 28, 28});
  std::vector<int64_t> per_class(10, 0);
  for (uint8_t l : train.labels()) {
    REQUIRE(l < 10);
    ++per_class[l];
  }
  for (int64_t n : per_class) CHECK(n == 6000);  // Fashion-MNIST is balanced
  for (uint8_t l : test.labels()) REQUIRE(l < 10);

  // Normalised with the training-set statistics: mean ~0, std ~1 over a slice of the data.
  Batch b = make_batch(train, 0, 2000);
  auto v = b.images.to_host_f32();
  double sum = 0, sq = 0;
  for (float x : v) sum += x, sq += double(x) * x;
  double mean = sum / v.size(), var = sq / v.size() - mean * mean;
  CHECK(std::abs(mean) < 0.05);
  CHECK(std::abs(var - 1.0) < 0.1);
}

// ---- synthetic ------------------------------------------------------------------------------

TEST_CASE("data.synthetic: samples depend on seed and index only with labels in range") {
  SyntheticDataset a(1000, {1, 8, 8}, 7, 42);
  SyntheticDataset b(5000, {1, 8, 8}, 7, 42);  // a different size does not change sample i
  SyntheticDataset other(1000, {1, 8, 8}, 7, 43);
  CHECK(a.sample_numel() == 64);
  CHECK(a.name().find("seed 42") != std::string::npos);
  std::vector<float> x(64), y(64), z(64);
  std::set<int32_t> seen;
  int differing_labels = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    int32_t la, lb, lo;
    a.get(i, x.data(), &la);
    b.get(i, y.data(), &lb);
    other.get(i, z.data(), &lo);
    REQUIRE(x == y);
    REQUIRE(la == lb);
    REQUIRE(la == a.label(i));
    REQUIRE(x != z);
    REQUIRE((la >= 0 && la < 7));
    differing_labels += la != lo;
    seen.insert(la);
  }
  CHECK(seen.size() == 7);
  CHECK(differing_labels > 700);  // ~6/7 of them

  // Repeated and concurrent reads give the same bits.
  Batch first = make_batch(a, 0, 1000);
  Batch again = make_batch(a, 0, 1000);
  CHECK(first.images.to_host_f32() == again.images.to_host_f32());
  CHECK(first.labels.to_host_i32() == again.labels.to_host_i32());

  // Vector-shaped samples work too.
  SyntheticDataset flat(10, {33}, 2, 1);
  Batch fb = make_batch(flat, 0, 10);
  CHECK(fb.images.shape() == kernels::Shape{10, 33});

  CHECK_ERROR_HAS(error_of([&] { a.get(1000, x.data(), nullptr); }), "out of range");
  CHECK_ERROR_HAS(error_of([] { SyntheticDataset(1, {0, 2}, 2, 0); }), "non-positive");
  CHECK_ERROR_HAS(error_of([] { SyntheticDataset(1, {2}, 0, 0); }), "num_classes");
}

TEST_CASE("data.synthetic: values are pinned bit for bit on every machine") {
  SyntheticDataset d(100, {4}, 10, 2024);
  std::vector<float> x(4);
  int32_t label = -1;
  d.get(17, x.data(), &label);
  // Golden values: a change here changes every benchmark's data.
  std::printf("synthetic golden: label %d values %.9g %.9g %.9g %.9g\n", label, x[0], x[1], x[2],
              x[3]);
  CHECK(label == 8);
  CHECK(x == std::vector<float>{1.75116444f, 1.33911228f, -1.50850832f, 0.83328706f});
}

TEST_CASE("data.synthetic: classes are learnable by nearest class mean") {
  SyntheticDataset d(4000, {1, 28, 28}, 10, 7);
  const int64_t n = d.sample_numel();
  Batch train = make_batch(d, 0, 2000), test = make_batch(d, 2000, 2000);
  auto xs = train.images.to_host_f32();
  auto ys = train.labels.to_host_i32();
  std::vector<double> means(10 * n, 0.0);
  std::vector<int> counts(10, 0);
  for (int64_t i = 0; i < 2000; ++i) {
    ++counts[ys[i]];
    for (int64_t j = 0; j < n; ++j) means[ys[i] * n + j] += xs[i * n + j];
  }
  for (int c = 0; c < 10; ++c)
    for (int64_t j = 0; j < n; ++j) means[c * n + j] /= std::max(1, counts[c]);
  auto xt = test.images.to_host_f32();
  auto yt = test.labels.to_host_i32();
  int correct = 0;
  for (int64_t i = 0; i < 2000; ++i) {
    int best = 0;
    double best_d = 1e300;
    for (int c = 0; c < 10; ++c) {
      double dist = 0;
      for (int64_t j = 0; j < n; ++j) {
        double diff = xt[i * n + j] - means[c * n + j];
        dist += diff * diff;
      }
      if (dist < best_d) best_d = dist, best = c;
    }
    correct += best == yt[i];
  }
  CHECK(correct > 1800);
}

// ---- loader ---------------------------------------------------------------------------------

TEST_CASE("data.loader: shuffled_order is a reproducible permutation") {
  auto a = shuffled_order(1000, 5, 0), b = shuffled_order(1000, 5, 0);
  auto c = shuffled_order(1000, 5, 1), d = shuffled_order(1000, 6, 0);
  CHECK(a == b);
  CHECK(a != c);
  CHECK(a != d);
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) REQUIRE(sorted[i] == i);
  CHECK(shuffled_order(0, 1, 1).empty());
  CHECK(shuffled_order(1, 1, 1) == std::vector<int64_t>{0});
  // Golden: the same order on every machine.
  auto g = shuffled_order(10, 42, 3);
  std::printf("shuffle golden:");
  for (int64_t v : g) std::printf(" %lld", static_cast<long long>(v));
  std::printf("\n");
  CHECK(g == std::vector<int64_t>{8, 1, 7, 3, 5, 9, 6, 0, 2, 4});
}

TEST_CASE("data.loader: same seed and epoch give the same batches and epochs differ") {
  SyntheticDataset data(1000, {1, 4, 4}, 5, 3);
  LoaderOptions opt;
  opt.batch_size = 64;
  opt.seed = 11;
  Loader l1(data, opt), l2(data, opt);
  l1.set_epoch(4);
  l2.set_epoch(4);
  auto b1 = drain(l1), b2 = drain(l2);
  REQUIRE(b1.size() == 16);  // 15 full + a remainder of 40
  REQUIRE(b2.size() == 16);
  for (size_t i = 0; i < b1.size(); ++i) {
    CHECK(b1[i].indices == b2[i].indices);
    CHECK(b1[i].first_index == static_cast<int64_t>(i) * 64);
    CHECK(b1[i].images.to_host_f32() == b2[i].images.to_host_f32());
    CHECK(b1[i].labels.to_host_i32() == b2[i].labels.to_host_i32());
  }
  CHECK(b1.back().size() == 40);
  CHECK(b1.back().images.shape() == kernels::Shape{40, 1, 4, 4});
  CHECK(concat_indices(b1) == l1.epoch_order(4));

  // Each epoch is a permutation, and epochs differ.
  std::vector<std::vector<int64_t>> orders;
  for (int64_t e = 0; e < 3; ++e) {
    l1.set_epoch(e);
    auto all = concat_indices(drain(l1));
    auto sorted = all;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < 1000; ++i) REQUIRE(sorted[i] == i);
    orders.push_back(all);
  }
  CHECK(orders[0] != orders[1]);
  CHECK(orders[1] != orders[2]);
  // A second pass over the same epoch repeats it.
  l1.set_epoch(1);
  CHECK(concat_indices(drain(l1)) == orders[1]);
  CHECK(concat_indices(drain(l1)) == orders[1]);

  // Batch contents match the data set's samples, row by row.
  std::vector<float> x(16);
  int32_t label;
  const Batch& b = b1[3];
  auto images = b.images.to_host_f32();
  auto labels = b.labels.to_host_i32();
  for (int64_t r = 0; r < b.size(); ++r) {
    data.get(b.indices[r], x.data(), &label);
    REQUIRE(std::equal(x.begin(), x.end(), images.begin() + r * 16));
    REQUIRE(labels[r] == label);
  }
}

TEST_CASE("data.loader: drop_last and no shuffle and subsets and range-for") {
  CountingDataset data(10);
  LoaderOptions opt;
  opt.batch_size = 4;
  opt.shuffle = Shuffle::no;

  Loader keep(data, opt);
  CHECK(keep.num_batches() == 3);
  auto kept = drain(keep);
  REQUIRE(kept.size() == 3);
  CHECK(kept[2].size() == 2);
  CHECK(kept[2].indices == std::vector<int64_t>{8, 9});
  CHECK(kept[2].images.to_host_f32() == std::vector<float>{8, 8, 8, 8, 9, 9, 9, 9});
  CHECK(kept[2].labels.to_host_i32() == std::vector<int32_t>{2, 0});
  CHECK(concat_indices(kept) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});

  opt.drop_last = DropLast::yes;
  Loader drop(data, opt);
  CHECK(drop.num_batches() == 2);
  auto dropped = drain(drop);
  REQUIRE(dropped.size() == 2);
  CHECK(concat_indices(dropped) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7});

  // A subset, e.g. a sampler's shard, shuffled per epoch within itself.
  opt.drop_last = DropLast::no;
  opt.shuffle = Shuffle::yes;
  std::vector<int64_t> shard{1, 3, 5, 7, 9};
  Loader sub(data, shard, opt);
  CHECK(sub.num_samples() == 5);
  CHECK(sub.num_batches() == 2);
  int64_t rows = 0;
  std::vector<int64_t> seen;
  for (const Batch& b : sub) {
    rows += b.size();
    seen.insert(seen.end(), b.indices.begin(), b.indices.end());
    auto images = b.images.to_host_f32();
    for (int64_t r = 0; r < b.size(); ++r) CHECK(images[r * 4] == float(b.indices[r]));
  }
  CHECK(rows == 5);
  std::sort(seen.begin(), seen.end());
  CHECK(seen == shard);
  sub.set_indices({0, 2});
  CHECK(concat_indices(drain(sub)).size() == 2);
  CHECK_ERROR_HAS(error_of([&] { sub.set_indices({10}); }), "index 10 out of range");
  CHECK_ERROR_HAS(error_of([&] { Loader(data, LoaderOptions{0}); }), "batch_size");
}

TEST_CASE("data.loader: prefetching keeps batches in order under a slow consumer") {
  CountingDataset data(257);
  for (int prefetch : {1, 2, 5}) {
    for (RecycleBuffers recycle : {RecycleBuffers::no, RecycleBuffers::yes}) {
      LoaderOptions opt;
      opt.batch_size = 16;
      opt.seed = 9;
      opt.prefetch = prefetch;
      opt.threads = 2;
      opt.recycle = recycle;
      Loader loader(data, opt);
      loader.set_epoch(2);
      auto order = loader.epoch_order(2);
      int64_t k = 0, pos = 0;
      while (auto b = loader.next()) {
        REQUIRE(b->first_index == pos);
        auto images = b->images.to_host_f32();
        for (int64_t r = 0; r < b->size(); ++r) {
          REQUIRE(b->indices[r] == order[pos + r]);
          REQUIRE(images[r * 4 + 3] == float(order[pos + r]));
        }
        if (dp_test::gpu_available()) CHECK(b->images.storage()->pinned());
        pos += b->size();
        if (++k % 5 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      CHECK(pos == 257);
      CHECK(k == 17);
    }
  }
}

TEST_CASE("data.loader: destroying a loader mid-epoch does not hang") {
  using clock = std::chrono::steady_clock;
  CountingDataset slow(100000, std::chrono::microseconds(200));
  LoaderOptions opt;
  opt.batch_size = 32;
  opt.prefetch = 3;
  auto start = clock::now();
  {
    Loader never_started(slow, opt);  // no pass, nothing to stop
  }
  {
    Loader loader(slow, opt);
    auto b = loader.next();
    REQUIRE(b.has_value());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the queue fills up
  }
  {
    Loader loader(slow, opt);
    loader.next();
    loader.set_epoch(1);  // abandons the pass in progress
    CHECK(loader.next().has_value());
  }
  double seconds = std::chrono::duration<double>(clock::now() - start).count();
  CHECK(seconds < 5.0);
  CHECK(slow.calls.load() < 20000);  // the producers stopped long before the 100000 samples
}

TEST_CASE("data.loader: an exception in get surfaces at next") {
  CountingDataset data(100, {}, /*throw_at=*/50);
  LoaderOptions opt;
  opt.batch_size = 8;
  opt.shuffle = Shuffle::no;
  Loader loader(data, opt);
  int batches = 0;
  std::string msg;
  try {
    while (loader.next()) ++batches;
  } catch (const kernels::Error& e) {
    msg = e.what();
  }
  CHECK(batches == 6);  // batches 0..5 hold samples 0..47; batch 6 holds sample 50
  CHECK_ERROR_HAS(msg, "disk on fire at sample 50");
  CHECK_ERROR_HAS(msg, "epoch 0, batch 6");
  CHECK_ERROR_HAS(msg, "counting");
  // The pass is over; the next call starts it again and meets the same fault.
  CHECK_ERROR_HAS(error_of([&] { drain(loader); }), "kernels::Error: loader over counting");
  // make_batch passes the data set's exception through as it is.
  CHECK(error_of([&] { make_batch(data, 48, 4); }) == "disk on fire at sample 50");
}

TEST_CASE("data.make_batch: a contiguous range equals per-sample reads") {
  SyntheticDataset data(300, {3, 4, 5}, 4, 8);
  Batch b = make_batch(data, 100, 50);
  CHECK(b.first_index == 100);
  CHECK(b.size() == 50);
  CHECK(b.images.shape() == kernels::Shape{50, 3, 4, 5});
  CHECK(b.labels.shape() == kernels::Shape{50});
  CHECK(b.images.dtype() == kernels::DType::f32);
  CHECK(b.labels.dtype() == kernels::DType::i32);
  auto images = b.images.to_host_f32();
  auto labels = b.labels.to_host_i32();
  std::vector<float> x(60);
  int32_t label;
  for (int64_t r = 0; r < 50; ++r) {
    data.get(100 + r, x.data(), &label);
    REQUIRE(std::equal(x.begin(), x.end(), images.begin() + r * 60));
    REQUIRE(labels[r] == label);
    REQUIRE(b.indices[r] == 100 + r);
  }
  CHECK(make_batch(data, 300, 0).size() == 0);
  CHECK_ERROR_HAS(error_of([&] { make_batch(data, 290, 20); }), "out of range");
}
