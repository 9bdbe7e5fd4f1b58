// What long runs show and write as they go, shared by the programs:
//
// ProgressLine: on a terminal, one line redrawn in place (at most 10 times a second) with the
// count, the rate and the time left; otherwise (a log file, CI) a plain line every `every`
// (10 s by default), and one at the end when there was one before, so that logs stay readable
// and short runs quiet:
//   train_mnist epoch 1  412/938 steps  61.3 steps/s  ETA 8s  loss 0.5121
//
// SlowNotice: what a silent phase before the first step is doing (a model's build, a memory
// probe step), said once it has run for 5 s, with its time when it ends; a quicker phase says
// nothing:
//   dp_bench: measuring a step's memory on cpu:0 (probe steps of 1 and 2 rows) ...
//   dp_bench: measuring a step's memory on cpu:0 (probe steps of 1 and 2 rows): 31s
//
// StepLog (--log FILE.jsonl): one JSON object per step, flushed as written, so that a run that
// dies leaves every step it took:
//   {"step":12,"loss":0.4312,"lr":0.01,"grad_norm":null,"samples_per_s":5123.4,"loss_scale":1}
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace dp::cli {

// "45s", "3m05s", "2h07m" (rounded down to the second); "?" for a negative or non-finite time.
std::string duration_text(double seconds);

class ProgressLine {
 public:
  enum class Style { automatic, redrawn, plain };  // automatic: redrawn when `out` is a terminal
  // `total` units (steps, batches) to do; `unit` names them in the line.
  ProgressLine(std::string label, int64_t total, std::string unit = "steps",
               Style style = Style::automatic, std::FILE* out = stderr,
               std::chrono::milliseconds every = std::chrono::seconds(10));
  ~ProgressLine();  // ends a redrawn line
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Starts the clock before the first unit, at `done` units (a resumed run's first step): a
  // first unit slower than the period is then reported when it ends (without this, the first
  // update only starts the clock, and a run of minutes a step is silent for two steps), and a
  // redrawn line shows its count at once. Optional; a later call does nothing.
  void start(int64_t done = 0);
  // `done` units so far (of total); `detail` follows the rate ("loss 0.5121"). Prints when due
  // (redrawn: at most every 0.1 s, and at done == total; plain: see above). Rate and ETA count from
  // start() or the first call, so that a resumed run's skipped units do not inflate the rate.
  void update(int64_t done, const std::string& detail = "");
  // Ends the line (a newline after a redrawn one); later updates start a new one.
  void finish();
  bool redrawn() const { return redrawn_; }

 private:
  using Clock = std::chrono::steady_clock;
  std::string text(int64_t done, const std::string& detail, double elapsed) const;

  std::string label_, unit_;
  int64_t total_;
  bool redrawn_;
  std::FILE* out_;
  std::chrono::milliseconds every_;
  std::optional<Clock::time_point> start_;
  int64_t start_done_ = 0;
  Clock::time_point last_print_{};
  bool open_line_ = false;  // a redrawn line is on the terminal without its newline
  bool printed_ = false;    // a line was printed: the last one is printed too
};

// Prints `text` + " ..." on `out` when the phase it spans (construction to destruction) is still
// running after `after`, and `text` + ": " + its time when it ends; nothing for a quicker phase,
// or with `out` null (a rank that is not rank 0). The first line comes from a watcher thread,
// joined by the destructor; a phase left by an exception prints no end.
class SlowNotice {
 public:
  explicit SlowNotice(std::string text, std::FILE* out = stderr,
                      std::chrono::milliseconds after = std::chrono::seconds(5));
  ~SlowNotice();
  SlowNotice(const SlowNotice&) = delete;
  SlowNotice& operator=(const SlowNotice&) = delete;

 private:
  std::string text_;
  std::FILE* out_;
  std::chrono::steady_clock::time_point begin_;
  int exceptions_;  // std::uncaught_exceptions() at construction
  std::mutex mutex_;
  std::condition_variable ended_cv_;
  bool ended_ = false;
  bool printed_ = false;  // written by the watcher, read after it is joined
  std::thread watcher_;
};

// One step's record for StepLog. Absent values are written as null.
struct StepRecord {
  int64_t step = 0;
  double loss = 0;
  std::optional<double> lr, grad_norm;
  double rate = 0;  // samples (or tokens) per second
  double loss_scale = 1;
};

class StepLog {
 public:
  StepLog() = default;  // off: write() does nothing
  // Creates or truncates `path` (a FIFO or a device is written in place, a FIFO's reader
  // waited for at most 10 s); throws naming `flag` and the file when it cannot. `rate_key`
  // names the rate ("samples_per_s" or "tokens_per_s").
  StepLog(const std::string& flag, const std::string& path, std::string rate_key = "samples_per_s");
  ~StepLog();  // closes; an error there is logged (close() reports it)
  StepLog(const StepLog&) = delete;
  StepLog& operator=(const StepLog&) = delete;

  bool enabled() const { return file_ != nullptr; }
  // Appends the record as one line and flushes it; throws naming the flag and the file when the
  // write or the flush fails (a full disk), a regular file cut back to the lines written whole.
  void write(const StepRecord& r);
  // Closes the file, checking that everything reached it. Idempotent.
  void close();

 private:
  std::string flag_, path_, rate_key_;
  std::FILE* file_ = nullptr;
  bool regular_ = false;  // a regular file (write cuts a partial line off), not a FIFO or device
};

}  // namespace dp::cli
