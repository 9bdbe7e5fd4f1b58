#include "dp/data/synthetic.hpp"

#include <algorithm>
#include <sstream>

#include "kernels/philox.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::data {

namespace philox = kernels::philox;

namespace {

// Independent random streams under one seed.
constexpr uint64_t kLabelStream = 1;
constexpr uint64_t kPrototypeStream = 2;
constexpr uint64_t kNoiseStream = 3;

// Caches the prototypes up to 64 MiB.
constexpr int64_t kMaxCachedPrototypeFloats = int64_t{1} << 24;

constexpr float kSqrt3 = 1.7320508075688772f;

// Uniform with unit variance on (-sqrt 3, sqrt 3), from 24 random bits: exact up to one rounding.
float unit_uniform(uint32_t word) {
  int32_t centred = static_cast<int32_t>(word >> 8) - (1 << 23);  // [-2^23, 2^23)
  return (static_cast<float>(centred) + 0.5f) * (2.f * kSqrt3 / 16777216.f);
}

// Approximately standard normal from one random word: the sum of its four bytes (Irwin-Hall,
// 1021 levels), centred and scaled to unit variance: integer sum, then one rounding.
float unit_noise(uint32_t w) {
  int32_t sum =
      static_cast<int32_t>((w & 0xFFu) + ((w >> 8) & 0xFFu) + ((w >> 16) & 0xFFu) + (w >> 24));
  constexpr float kInvStd = 0.006765875086793228f;  // 1 / sqrt(4 * (256^2 - 1) / 12)
  return static_cast<float>(sum - 510) * kInvStd;
}

float prototype_value(uint64_t seed, int32_t label, int64_t j) {
  uint64_t key = philox::mix_key(seed, kPrototypeStream, static_cast<uint64_t>(label));
  return unit_uniform(philox::random_u32(key, static_cast<uint64_t>(j)));
}

}  // namespace

SyntheticDataset::SyntheticDataset(int64_t size, kernels::Shape sample_shape, int num_classes,
                                   uint64_t seed, SyntheticOptions options)
    : size_(size),
      sample_shape_(std::move(sample_shape)),
      numel_(0),
      num_classes_(num_classes),
      seed_(seed),
      options_(options) {
  DP_CHECK(size >= 0, "SyntheticDataset: size must be >= 0, got " << size);
  DP_CHECK(!sample_shape_.empty(), "SyntheticDataset: empty sample shape");
  for (int64_t d : sample_shape_)
    DP_CHECK(d > 0, "SyntheticDataset: sample shape " << kernels::shape_str(sample_shape_)
                                                      << " has a non-positive dim");
  DP_CHECK(num_classes >= 1, "SyntheticDataset: num_classes must be >= 1, got " << num_classes);
  numel_ = kernels::shape_numel(sample_shape_);
  if (numel_ * num_classes_ <= kMaxCachedPrototypeFloats) {
    prototypes_.resize(static_cast<size_t>(numel_ * num_classes_));
    for (int32_t c = 0; c < num_classes_; ++c)
      for (int64_t j = 0; j < numel_; ++j)
        prototypes_[c * numel_ + j] = options_.signal * prototype_value(seed_, c, j);
  }
}

std::string SyntheticDataset::name() const {
  std::ostringstream os;
  os << "synthetic(" << size_ << " x " << kernels::shape_str(sample_shape_) << ", " << num_classes_
     << " classes, seed " << seed_ << ")";
  return os.str();
}

int32_t SyntheticDataset::label(int64_t index) const {
  uint32_t word = philox::philox4x32(philox::mix_key(seed_, kLabelStream), index).x;
  return static_cast<int32_t>(word % static_cast<uint32_t>(num_classes_));
}

float SyntheticDataset::scaled_prototype(int32_t label, int64_t j) const {
  if (!prototypes_.empty()) return prototypes_[label * numel_ + j];
  return options_.signal * prototype_value(seed_, label, j);
}

void SyntheticDataset::get_unchecked(int64_t index, float* image_out, int32_t* label_out) const {
  const int32_t c = label(index);
  const uint64_t key = philox::mix_key(seed_, kNoiseStream, static_cast<uint64_t>(index));
  const float* cached = prototypes_.empty() ? nullptr : prototypes_.data() + c * numel_;
  // One Philox block gives the noise of four elements.
  for (int64_t j0 = 0; j0 < numel_; j0 += 4) {
    philox::Uint4 r = philox::philox4x32(key, static_cast<uint64_t>(j0 / 4));
    const uint32_t words[4] = {r.x, r.y, r.z, r.w};
    const int64_t m = std::min<int64_t>(4, numel_ - j0);
    for (int64_t k = 0; k < m; ++k) {
      float n = options_.noise * unit_noise(words[k]);
      float p = cached ? cached[j0 + k] : scaled_prototype(c, j0 + k);
      image_out[j0 + k] = p + n;
    }
  }
  *label_out = c;
}

}  // namespace dp::data
