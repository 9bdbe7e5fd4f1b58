// Byte-level text corpus and token batches (dp/data/text.hpp).
#include "dp/data/text.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "kernels/philox.hpp"
#include "kernels/runtime/error.hpp"
#include "kernels/runtime/file_io.hpp"

namespace dp::data {

namespace fs = std::filesystem;

std::vector<uint8_t> read_text_file(const std::string& path, int64_t max_bytes) {
  kernels::io::require_regular_file(path);
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  DP_CHECK(!ec, path << ": cannot read its size: " << ec.message());
  DP_CHECK(size <= static_cast<uint64_t>(max_bytes), path << ": " << size
                                                          << " bytes, more than the " << max_bytes
                                                          << " a text file may hold");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  DP_CHECK(f != nullptr, path << ": cannot open: " << std::strerror(errno));
  const size_t got = bytes.empty() ? 0 : std::fread(bytes.data(), 1, bytes.size(), f);
  const bool read_error = std::ferror(f) != 0;
  // One byte more would mean the file grew since its size was read.
  unsigned char extra;
  const bool longer = std::fread(&extra, 1, 1, f) == 1;
  std::fclose(f);
  DP_CHECK(!read_error && got == bytes.size(),
           path << ": short read: " << got << " of " << size << " bytes");
  DP_CHECK(!longer, path << ": the file grew while it was read (more than " << size << " bytes)");
  return bytes;
}

TextCorpus read_text_corpus(const std::string& path, double val_fraction, int64_t min_bytes,
                            int64_t max_bytes) {
  DP_CHECK(val_fraction > 0 && val_fraction < 1,
           "read_text_corpus: val_fraction " << val_fraction << " must be in (0, 1)");
  TextCorpus c;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::vector<fs::path> entries;
    for (const auto& e : fs::directory_iterator(path, ec)) entries.push_back(e.path());
    DP_CHECK(!ec, path << ": cannot list: " << ec.message());
    std::sort(entries.begin(), entries.end());
    std::vector<fs::path> seen;  // the files read, resolved: a link to one is not read twice
    for (const fs::path& p : entries) {
      if (p.extension() == ".dat") continue;  // fortune's index files
      std::error_code e2;
      const bool link = fs::is_symlink(p, e2);
      if (!fs::is_regular_file(p, e2)) {  // follows links
        c.skipped.push_back(p.string() +
                            (link ? " (a link to no regular file)" : " (not a regular file)"));
        continue;
      }
      const fs::path real = fs::weakly_canonical(p, e2);
      // A second name of a file read already (fortune's ".u8" links): nothing is lost.
      if (std::find(seen.begin(), seen.end(), real) != seen.end()) continue;
      seen.push_back(real);
      c.files.push_back(p.string());
    }
    std::string skipped;  // what was there, and why it was not read
    for (const std::string& e : c.skipped) skipped += (skipped.empty() ? "; not read: " : ", ") + e;
    DP_CHECK(!c.files.empty(),
             path << ": no text files (install fortunes-min: scripts/setup.sh)" << skipped);
  } else {
    c.files.push_back(path);
  }
  // The corpus's size before any byte is read: the cap is on the whole concatenation.
  uint64_t total = 0;
  for (const std::string& f : c.files) {
    kernels::io::require_regular_file(f);
    const uint64_t size = fs::file_size(f, ec);
    DP_CHECK(!ec, f << ": cannot read its size: " << ec.message());
    total += size;
  }
  DP_CHECK(total <= static_cast<uint64_t>(max_bytes),
           path << ": " << c.files.size() << " file(s) of " << total << " bytes in all, more than "
                << "the " << max_bytes << " a text corpus may hold");
  std::vector<uint8_t> all;
  for (const std::string& f : c.files) {
    std::vector<uint8_t> b = read_text_file(f, max_bytes);
    // Text holds no NUL byte (UTF-8's included); a program, an image or UTF-16 text does, and
    // would train on as bytes without a word.
    const auto nul = std::find(b.begin(), b.end(), uint8_t{0});
    DP_CHECK(nul == b.end(), f << ": a NUL byte at offset " << nul - b.begin()
                               << ": not a text file (a binary file, or UTF-16 text: convert it "
                                  "to UTF-8); give text files");
    all.insert(all.end(), b.begin(), b.end());
    DP_CHECK(static_cast<int64_t>(all.size()) <= max_bytes,
             path << ": the files grew while they were read: " << all.size() << " bytes by " << f
                  << ", more than the " << max_bytes << " a text corpus may hold");
  }
  const auto n = static_cast<int64_t>(all.size());
  const auto n_val = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
  DP_CHECK(n - n_val > min_bytes && n_val > min_bytes,
           path << ": " << n << " bytes of text split " << n - n_val << " / " << n_val
                << " (train / validation); each needs more than " << min_bytes);
  c.train.assign(all.begin(), all.end() - n_val);
  c.val.assign(all.end() - n_val, all.end());
  return c;
}

namespace {

// Rows (ids, targets) from windows of seq + 1 bytes starting at starts[b].
std::pair<kernels::Tensor, kernels::Tensor> windows_at(const std::vector<uint8_t>& bytes,
                                                       const std::vector<int64_t>& starts,
                                                       int64_t seq) {
  const auto batch = static_cast<int64_t>(starts.size());
  std::vector<int32_t> ids(static_cast<size_t>(batch * seq)), tg(ids.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      ids[b * seq + t] = bytes[starts[b] + t];
      tg[b * seq + t] = bytes[starts[b] + t + 1];
    }
  return {kernels::Tensor::from_ints(ids, {batch, seq}),
          kernels::Tensor::from_ints(tg, {batch, seq})};
}

}  // namespace

std::pair<kernels::Tensor, kernels::Tensor> text_batch(const std::vector<uint8_t>& bytes,
                                                       int64_t batch, int64_t seq, uint64_t key,
                                                       int64_t step) {
  DP_CHECK(
      batch >= 1 && seq >= 1 && static_cast<int64_t>(bytes.size()) > seq,
      "text_batch: batch " << batch << ", seq " << seq << " from " << bytes.size() << " bytes");
  const auto span = static_cast<uint64_t>(bytes.size()) - static_cast<uint64_t>(seq);
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  const uint64_t k = kernels::philox::mix_key(key, static_cast<uint64_t>(step));
  for (int64_t b = 0; b < batch; ++b)
    starts[b] = static_cast<int64_t>(
        std::min<double>(kernels::philox::uniform(k, static_cast<uint64_t>(b)) * span, span - 1));
  return windows_at(bytes, starts, seq);
}

int64_t text_window_count(const std::vector<uint8_t>& bytes, int64_t seq) {
  return bytes.size() > static_cast<size_t>(seq) ? (static_cast<int64_t>(bytes.size()) - 1) / seq
                                                 : 0;
}

std::pair<kernels::Tensor, kernels::Tensor> text_windows(const std::vector<uint8_t>& bytes,
                                                         int64_t first, int64_t batch,
                                                         int64_t seq) {
  const int64_t n = std::max<int64_t>(0, std::min(batch, text_window_count(bytes, seq) - first));
  std::vector<int64_t> starts(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) starts[b] = (first + b) * seq;
  return windows_at(bytes, starts, seq);
}

std::pair<kernels::Tensor, kernels::Tensor> synthetic_token_batch(int64_t batch, int64_t seq,
                                                                  int64_t vocab, uint64_t seed,
                                                                  int64_t step) {
  DP_CHECK(batch >= 1 && seq >= 1 && vocab >= 2 && vocab <= (int64_t{1} << 31) - 1,
           "synthetic_token_batch: batch " << batch << ", seq " << seq << ", vocab " << vocab);
  const uint64_t k = kernels::philox::mix_key(seed, static_cast<uint64_t>(step));
  std::vector<int32_t> stream(static_cast<size_t>(batch * (seq + 1)));
  for (size_t i = 0; i < stream.size(); ++i)
    stream[i] = static_cast<int32_t>(
        std::min<double>(kernels::philox::uniform(k, i) * static_cast<double>(vocab),
                         static_cast<double>(vocab - 1)));
  std::vector<int32_t> ids(static_cast<size_t>(batch * seq)), tg(ids.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      ids[b * seq + t] = stream[b * (seq + 1) + t];
      tg[b * seq + t] = stream[b * (seq + 1) + t + 1];
    }
  return {kernels::Tensor::from_ints(ids, {batch, seq}),
          kernels::Tensor::from_ints(tg, {batch, seq})};
}

}  // namespace dp::data
