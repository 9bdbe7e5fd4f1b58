#include "dp/data/loader.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>
#include <utility>

#include "kernels/philox.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/nvtx.hpp"

namespace dp::data {

using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

namespace {

constexpr uint64_t kShuffleStream = 0x5348554646ull;  // "SHUFF"

Shape batch_shape(const Dataset& dataset, int64_t rows) {
  Shape s{rows};
  for (int64_t d : dataset.sample_shape()) s.push_back(d);
  return s;
}

// One batch's page-locked tensors, exactly `rows` long.
std::pair<Tensor, Tensor> new_buffers(const Dataset& dataset, int64_t rows) {
  return {Tensor::empty_pinned(batch_shape(dataset, rows), DType::f32),
          Tensor::empty_pinned({rows}, DType::i32)};
}

}  // namespace

Batch make_batch(const Dataset& dataset, std::vector<int64_t> indices) {
  const int64_t rows = static_cast<int64_t>(indices.size());
  Batch batch;
  std::tie(batch.images, batch.labels) = new_buffers(dataset, rows);
  fill_batch(dataset, indices, batch.images, batch.labels);
  batch.first_index = indices.empty() ? 0 : indices.front();
  batch.indices = std::move(indices);
  return batch;
}

Batch make_batch(const Dataset& dataset, int64_t first, int64_t count) {
  DP_CHECK(first >= 0 && count >= 0 && first + count <= dataset.size(),
           "make_batch: samples [" << first << ", " << first + count << ") out of range for "
                                   << dataset.name() << " of size " << dataset.size());
  std::vector<int64_t> indices(static_cast<size_t>(count));
  std::iota(indices.begin(), indices.end(), first);
  return make_batch(dataset, std::move(indices));
}

std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch) {
  DP_CHECK(n >= 0, "shuffled_order: n must be >= 0, got " << n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  const uint64_t key = kernels::philox::mix_key(seed, kShuffleStream, static_cast<uint64_t>(epoch));
  for (int64_t i = n - 1; i > 0; --i) {
    kernels::philox::Uint4 r = kernels::philox::philox4x32(key, static_cast<uint64_t>(i));
    uint64_t word = (uint64_t{r.y} << 32) | r.x;
    // The modulo bias is below n / 2^64: immaterial, and the result is exactly reproducible.
    int64_t j = static_cast<int64_t>(word % static_cast<uint64_t>(i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

// ---- buffer pool ----------------------------------------------------------------------------

// Full-size batch buffers, reused once the consumer has dropped every handle to them. Only the
// producer thread of the running pass touches the pool; passes never overlap.
struct Loader::BufferPool {
  std::vector<std::pair<Tensor, Tensor>> buffers;  // (batch_size, ...) images, (batch_size) labels
  size_t capacity = 0;

  std::pair<Tensor, Tensor> take(const Dataset& dataset, int64_t batch_size, int64_t rows) {
    for (auto& [images, labels] : buffers) {
      // use_count 1: the pool holds the only handle, so nobody can make a new one. The fence
      // pairs with the release in the consumer's last shared_ptr decrement, so its reads of the
      // old contents happen before our writes.
      if (images.storage().use_count() == 1 && labels.storage().use_count() == 1) {
        std::atomic_thread_fence(std::memory_order_acquire);
        return {images.slice(0, rows), labels.slice(0, rows)};
      }
    }
    auto fresh = new_buffers(dataset, batch_size);
    // Page-locked memory only: pageable buffers are cheap to allocate and free.
    if (buffers.size() < capacity && fresh.first.storage()->pinned()) buffers.push_back(fresh);
    return {fresh.first.slice(0, rows), fresh.second.slice(0, rows)};
  }
};

// ---- one pass -------------------------------------------------------------------------------

struct Loader::Pass {
  // One slot of the queue: a batch, an error, or (neither) the end of the pass.
  struct Item {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };

  std::mutex mutex;
  std::condition_variable ready;  // the consumer waits for an item
  std::condition_variable space;  // the producer waits for room (or stop)
  std::deque<Item> queue;         // at most `prefetch` batches, plus an end or error marker
  bool stop = false;
  tbb::task_group_context group;  // cancels a fill in progress on stop
  std::thread producer;

  ~Pass() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    group.cancel_group_execution();
    space.notify_all();
    if (producer.joinable()) producer.join();
  }

  bool stopping() {
    std::lock_guard<std::mutex> lock(mutex);
    return stop;
  }

  // Enqueues `item`, waiting for room unless it is a marker. false when the pass was stopped.
  bool push(Item item, size_t capacity) {
    std::unique_lock<std::mutex> lock(mutex);
    if (item.batch) space.wait(lock, [&] { return stop || queue.size() < capacity; });
    if (stop) return false;
    queue.push_back(std::move(item));
    ready.notify_one();
    return true;
  }
};

Loader::Loader(const Dataset& dataset, LoaderOptions options)
    : dataset_(dataset), options_(options), pool_(std::make_unique<BufferPool>()) {
  DP_CHECK(options_.batch_size >= 1,
           "Loader: batch_size must be >= 1, got " << options_.batch_size);
  DP_CHECK(options_.prefetch >= 1, "Loader: prefetch must be >= 1, got " << options_.prefetch);
  DP_CHECK(options_.threads >= 0, "Loader: threads must be >= 0, got " << options_.threads);
  DP_CHECK(options_.pad_last_batch_to >= 1 && options_.pad_last_batch_to <= options_.batch_size,
           "Loader: pad_last_batch_to must be in [1, batch_size "
               << options_.batch_size << "], got " << options_.pad_last_batch_to);
  if (options_.threads > 0) arena_ = std::make_unique<tbb::task_arena>(options_.threads);
  // The queue's batches, the one being filled, and two the caller may still hold.
  pool_->capacity = static_cast<size_t>(options_.prefetch) + 3;
}

Loader::Loader(const Dataset& dataset, std::vector<int64_t> indices, LoaderOptions options)
    : Loader(dataset, options) {
  set_indices(std::move(indices));
}

Loader::~Loader() = default;  // ~Pass stops and joins the producer

void Loader::set_epoch(int64_t epoch) {
  reset();
  epoch_ = epoch;
}

void Loader::set_indices(std::vector<int64_t> indices) {
  for (int64_t i : indices)
    DP_CHECK(i >= 0 && i < dataset_.size(), "Loader: index " << i << " out of range for "
                                                             << dataset_.name() << " of size "
                                                             << dataset_.size());
  reset();
  subset_ = std::move(indices);
}

int64_t Loader::num_samples() const {
  return subset_ ? static_cast<int64_t>(subset_->size()) : dataset_.size();
}

int64_t Loader::num_batches() const {
  const int64_t n = num_samples(), b = options_.batch_size;
  return options_.drop_last == DropLast::yes ? n / b : (n + b - 1) / b;
}

int64_t Loader::padding() const {
  const int64_t n = num_samples(), b = options_.batch_size;
  if (n == 0 || options_.drop_last == DropLast::yes) return 0;
  const int64_t last = n - (num_batches() - 1) * b;
  return std::max<int64_t>(0, options_.pad_last_batch_to - last);
}

std::vector<int64_t> Loader::epoch_order(int64_t epoch) const {
  const int64_t n = num_samples();
  std::vector<int64_t> order;
  if (options_.shuffle == Shuffle::yes) {
    order = shuffled_order(n, options_.seed, epoch);
  } else {
    order.resize(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  if (subset_)
    for (int64_t& k : order) k = (*subset_)[static_cast<size_t>(k)];
  // Wrapping round: the epoch's first samples again (all of them, and more, when the pass is
  // shorter than the padding).
  const int64_t pad = padding();
  for (int64_t i = 0; i < pad; ++i) order.push_back(order[static_cast<size_t>(i % n)]);
  return order;
}

void Loader::reset() {
  pass_.reset();
}

void Loader::start_pass() {
  auto pass = std::make_unique<Pass>();
  Pass* p = pass.get();
  const int64_t epoch = epoch_;
  const int64_t n_batches = num_batches();
  const int64_t batch_size = options_.batch_size;
  const size_t capacity = static_cast<size_t>(options_.prefetch);
  const bool recycle = options_.recycle == RecycleBuffers::yes;
  std::vector<int64_t> order = epoch_order(epoch);

  p->producer = std::thread(
      [this, p, epoch, n_batches, batch_size, capacity, recycle, order = std::move(order)] {
        int64_t b = 0;
        try {
          for (; b < n_batches; ++b) {
            if (p->stopping()) return;
            const int64_t first = b * batch_size;
            const int64_t rows = std::min(batch_size, static_cast<int64_t>(order.size()) - first);
            Batch batch;
            batch.first_index = first;
            batch.indices.assign(order.begin() + first, order.begin() + first + rows);
            std::tie(batch.images, batch.labels) =
                recycle ? pool_->take(dataset_, batch_size, rows) : new_buffers(dataset_, rows);
            {
              kernels::NvtxRange range("data/fill_batch");
              auto fill = [&] {
                fill_batch(dataset_, batch.indices, batch.images, batch.labels, p->group);
              };
              if (arena_)
                arena_->execute(fill);
              else
                fill();
            }
            if (p->group.is_group_execution_cancelled()) return;  // stopped mid-fill
            if (!p->push(Pass::Item{std::move(batch), nullptr}, capacity)) return;
          }
          p->push(Pass::Item{}, capacity);
        } catch (const std::exception& e) {
          std::ostringstream os;
          os << "loader over " << dataset_.name() << ": epoch " << epoch << ", batch " << b
             << " of " << n_batches << ": " << e.what();
          p->push(Pass::Item{std::nullopt, std::make_exception_ptr(kernels::Error(os.str()))},
                  capacity);
        } catch (...) {
          p->push(Pass::Item{std::nullopt, std::current_exception()}, capacity);
        }
      });
  pass_ = std::move(pass);
}

std::optional<Batch> Loader::next() {
  if (!pass_) start_pass();
  Pass::Item item;
  {
    kernels::NvtxRange range("data/wait");
    std::unique_lock<std::mutex> lock(pass_->mutex);
    pass_->ready.wait(lock, [&] { return !pass_->queue.empty(); });
    item = std::move(pass_->queue.front());
    pass_->queue.pop_front();
  }
  pass_->space.notify_one();
  if (item.batch) return std::move(item.batch);
  pass_.reset();  // end or error: the producer has returned, so this joins at once
  if (item.error) std::rethrow_exception(item.error);
  return std::nullopt;
}

Loader::Iterator Loader::begin() {
  reset();
  Iterator it;
  it.loader_ = this;
  it.batch_ = next();
  return it;
}

}  // namespace dp::data
