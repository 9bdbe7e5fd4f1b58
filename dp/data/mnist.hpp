// MNIST-format data sets (Fashion-MNIST by default): 28x28 grey images in 10 classes, read from
// {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]. Pixels are kept as u8 and normalised on
// get(): (x / 255 - mean) / std.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "dp/data/dataset.hpp"

namespace dp::data {

// Where Debian's dataset-fashion-mnist package installs the files.
constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

enum class Split { train, test };  // train-* (60000 images) or t10k-* (10000 images)

struct MnistOptions {
  // Fashion-MNIST training-set statistics; use {0.1307, 0.3081} for MNIST digits,
  // {0, 1} for plain x / 255.
  float mean = 0.2860f;
  float std = 0.3530f;
};

class MnistDataset : public Dataset {
 public:
  // Loads `dir`/{train,t10k}-images-idx3-ubyte and -labels-idx1-ubyte, plain or .gz (whichever
  // exists). Throws kernels::Error naming the path when the directory or a file is missing
  // (with how to get it), a file is malformed, the counts differ or a label is >= 10.
  explicit MnistDataset(const std::string& dir = kDefaultFashionMnistDir,
                        Split split = Split::train, MnistOptions options = {});

  int64_t size() const override { return count_; }
  kernels::Shape sample_shape() const override { return {1, rows_, cols_}; }  // {1, 28, 28}
  int num_classes() const override { return 10; }
  std::string name() const override;

  Split split() const { return split_; }
  const std::string& images_path() const { return images_path_; }
  const std::string& labels_path() const { return labels_path_; }
  // Raw data: size() * rows * cols pixels, size() labels.
  const std::vector<uint8_t>& pixels() const { return pixels_; }
  const std::vector<uint8_t>& labels() const { return labels_; }

 protected:
  void get_unchecked(int64_t index, float* image_out, int32_t* label_out) const override;

 private:
  std::string dir_;
  Split split_;
  std::string images_path_, labels_path_;
  int64_t count_ = 0, rows_ = 0, cols_ = 0;
  std::vector<uint8_t> pixels_;
  std::vector<uint8_t> labels_;
  std::array<float, 256> normalised_{};  // pixel value -> normalised float
};

}  // namespace dp::data
