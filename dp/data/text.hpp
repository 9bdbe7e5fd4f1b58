// Byte-level text for language models: a corpus of English text (Debian's fortunes-min, read
// from /usr/share/games/fortunes) as bytes, a fixed held-out split, and (ids, targets) batches
// of next-byte prediction; plus a synthetic token set for benchmarks.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/runtime/tensor.hpp"

namespace dp::data {

// Where scripts/setup.sh's fortunes-min puts its text.
constexpr const char* kDefaultTextDir = "/usr/share/games/fortunes";
// The largest text file or corpus read (a larger one is refused as not a text corpus).
constexpr int64_t kMaxTextBytes = int64_t{1} << 30;

struct TextCorpus {
  std::vector<std::string> files;    // read, in this (name) order
  std::vector<std::string> skipped;  // a directory's entries not read, each with its reason
  std::vector<uint8_t> train;        // the first bytes of the concatenation
  std::vector<uint8_t> val;          // the last val_fraction of it: the held-out split
};

// Reads one regular file of at most max_bytes. Throws naming the file and the fault (missing,
// not a regular file, too large, unreadable, short read).
std::vector<uint8_t> read_text_file(const std::string& path, int64_t max_bytes = kMaxTextBytes);

// Reads `path`: one file, or every regular file of a directory in name order (links followed,
// a file reached by two names read once), skipping fortune's ".dat" indexes; the other entries
// not read (not regular files, links to none) are listed in `skipped` with their reason, for the
// caller to say. requires 0 < val_fraction
// < 1. ensures train and val each hold more than `min_bytes` bytes, and the files at most
// `max_bytes` in all, checked before any is read (throws otherwise, naming the path and the
// sizes).
TextCorpus read_text_corpus(const std::string& path, double val_fraction = 0.1,
                            int64_t min_bytes = 1024, int64_t max_bytes = kMaxTextBytes);

// Batch `step` of next-byte prediction from `bytes`: batch windows of seq + 1 bytes at
// positions drawn from (key, step) (the same on every device and rank).
// requires bytes.size() > seq. ensures ids (batch, seq) i32 and targets (batch, seq) i32,
// targets[b, t] = ids[b, t + 1] of the window.
std::pair<kernels::Tensor, kernels::Tensor> text_batch(const std::vector<uint8_t>& bytes,
                                                       int64_t batch, int64_t seq, uint64_t key,
                                                       int64_t step);

// The windows of `bytes` at stride seq, in order, from window `first` (for validation):
// min(batch, windows left) rows; empty tensors when none is left.
std::pair<kernels::Tensor, kernels::Tensor> text_windows(const std::vector<uint8_t>& bytes,
                                                         int64_t first, int64_t batch, int64_t seq);
int64_t text_window_count(const std::vector<uint8_t>& bytes, int64_t seq);

// Synthetic tokens in [0, vocab) from (seed, step): ids (batch, seq) and targets (batch, seq)
// i32 (the next token of the same stream), for benchmarks.
std::pair<kernels::Tensor, kernels::Tensor> synthetic_token_batch(int64_t batch, int64_t seq,
                                                                  int64_t vocab, uint64_t seed,
                                                                  int64_t step);

}  // namespace dp::data
