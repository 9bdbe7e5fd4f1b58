#include "dp/data/mnist.hpp"

#include <sys/stat.h>

#include <tbb/parallel_invoke.h>

#include <cerrno>
#include <filesystem>

#include "dp/data/idx.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/file_io.hpp"

namespace dp::data {

namespace {

constexpr const char* kHowToGetIt =
    "install the Debian package dataset-fashion-mnist (apt install dataset-fashion-mnist) or "
    "pass --data DIR with the four MNIST-format files";

// `dir`/`stem`, or `dir`/`stem`.gz, whichever exists (the plain one first). Refuses, before
// anything is read, one that exists but is not a regular file (a FIFO, a symbolic link to
// /dev/zero), saying what it is.
std::string find_file(const std::string& dir, const std::string& stem) {
  namespace fs = std::filesystem;
  const std::string plain = (fs::path(dir) / stem).string();
  const std::string gz = (fs::path(dir) / (stem + ".gz")).string();
  for (const std::string& path : {plain, gz}) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      const int e = errno;  // only a missing file sends us on to the other name
      DP_CHECK(e == ENOENT,
               "MNIST data set: " << path << ": cannot stat it: " << kernels::io::errno_text(e));
      struct stat lst {};
      DP_CHECK(::lstat(path.c_str(), &lst) != 0,
               "MNIST data set: " << path << " is a symbolic link to nothing (dangling)");
      continue;
    }
    struct stat lst {};
    const bool link = ::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode);
    DP_CHECK(S_ISREG(st.st_mode),
             "MNIST data set: " << path << " is " << (link ? "a symbolic link to " : "")
                                << kernels::io::file_kind(st.st_mode) << ", not a regular file");
    return path;
  }
  DP_THROW("MNIST data set: neither " << plain << " nor " << gz << " exists; " << kHowToGetIt);
}

}  // namespace

MnistDataset::MnistDataset(const std::string& dir, Split split, MnistOptions options)
    : dir_(dir), split_(split) {
  std::error_code ec;
  const bool is_dir = std::filesystem::is_directory(dir, ec);
  DP_CHECK(is_dir || !ec || ec == std::errc::no_such_file_or_directory,
           "MNIST data set: directory " << dir << ": cannot stat it: " << ec.message());
  DP_CHECK(is_dir, "MNIST data set: directory " << dir << " not found; " << kHowToGetIt);
  DP_CHECK(options.std > 0.f, "MnistOptions: std must be > 0, got " << options.std);
  const std::string prefix = split == Split::train ? "train" : "t10k";
  images_path_ = find_file(dir, prefix + "-images-idx3-ubyte");
  labels_path_ = find_file(dir, prefix + "-labels-idx1-ubyte");

  // The headers first: files that disagree are refused before either body is read.
  IdxArray images = read_idx_header(images_path_);
  IdxArray labels = read_idx_header(labels_path_);
  DP_CHECK(images.dims.size() == 3, images_path_ << ": expected 3 dims (count, rows, cols) for "
                                                 << "images, got " << images.dims.size());
  DP_CHECK(labels.dims.size() == 1,
           labels_path_ << ": expected 1 dim (count) for labels, got " << labels.dims.size());
  DP_CHECK(images.count() == labels.count(),
           "image/label count mismatch: " << images_path_ << " has " << images.count()
                                          << " images, " << labels_path_ << " has "
                                          << labels.count() << " labels");
#ifdef DP_TSAN_ONE_THREAD  // one thread, as fill_batch there (dp/data/dataset.cpp says why)
  images = read_idx(images_path_);
  labels = read_idx(labels_path_);
#else
  tbb::parallel_invoke([&] { images = read_idx(images_path_); },
                       [&] { labels = read_idx(labels_path_); });
#endif
  // The files may have changed between the two reads.
  DP_CHECK(images.dims.size() == 3 && labels.dims.size() == 1 && images.count() == labels.count(),
           images_path_ << " or " << labels_path_ << " changed while being read");
  for (size_t i = 0; i < labels.bytes.size(); ++i)
    DP_CHECK(labels.bytes[i] < num_classes(),
             labels_path_ << ": label " << int{labels.bytes[i]} << " at index " << i
                          << " out of range [0, " << num_classes() << ")");
  count_ = images.count();
  rows_ = images.dims[1];
  cols_ = images.dims[2];
  pixels_ = std::move(images.bytes);
  labels_ = std::move(labels.bytes);
  for (int v = 0; v < 256; ++v)
    normalised_[v] = (static_cast<float>(v) / 255.f - options.mean) / options.std;
}

std::string MnistDataset::name() const {
  return dir_ + (split_ == Split::train ? " (train)" : " (test)");
}

void MnistDataset::get_unchecked(int64_t index, float* image_out, int32_t* label_out) const {
  const int64_t n = rows_ * cols_;
  const uint8_t* src = pixels_.data() + index * n;
  for (int64_t j = 0; j < n; ++j) image_out[j] = normalised_[src[j]];
  *label_out = labels_[index];
}

}  // namespace dp::data
