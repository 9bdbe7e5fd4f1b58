#include "dp/cli/progress.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>

#include <nlohmann/json.hpp>

#include "kernels/runtime/error.hpp"
#include "nn/file_io.hpp"

namespace dp::cli {

std::string duration_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds);
  char buf[48];
  if (s < 60)
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  else if (s < 3600)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  return buf;
}

ProgressLine::ProgressLine(std::string label, int64_t total, std::string unit, Style style,
                           std::FILE* out, std::chrono::milliseconds every)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      redrawn_(style == Style::redrawn ||
               (style == Style::automatic && out && isatty(fileno(out)))),
      out_(out),
      every_(every) {}

ProgressLine::~ProgressLine() {
  finish();
}

std::string ProgressLine::text(int64_t done, const std::string& detail, double elapsed) const {
  const double rate = elapsed > 0 ? (done - start_done_) / elapsed : 0;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s  %lld/%lld %s  %.1f %s/s  ETA %s", label_.c_str(),
                static_cast<long long>(done), static_cast<long long>(total_), unit_.c_str(), rate,
                unit_.c_str(), rate > 0 ? duration_text((total_ - done) / rate).c_str() : "?");
  std::string line = buf;
  if (!detail.empty()) line += "  " + detail;
  return line;
}

void ProgressLine::start(int64_t done) {
  if (!out_ || start_) return;
  start_ = Clock::now();
  start_done_ = done;
  last_print_ = *start_;
  if (!redrawn_) return;  // plain lines come when due
  std::fprintf(out_, "\r%s\033[K", text(done, "", 0).c_str());
  open_line_ = printed_ = true;
  std::fflush(out_);
}

void ProgressLine::update(int64_t done, const std::string& detail) {
  if (!out_) return;
  const auto now = Clock::now();
  if (!start_) {
    start_ = now;
    start_done_ = done > 0 ? done - 1 : 0;  // the unit just done counts towards the rate
    // A redrawn line shows at once; plain lines come every `every_`, so a short run in a log
    // stays silent.
    last_print_ = redrawn_ ? now - std::chrono::seconds(1) : now;
  }
  const bool last = done >= total_;
  const auto due = redrawn_ ? std::chrono::milliseconds(100) : every_;
  const bool on_schedule = now - last_print_ >= due;
  if (!(on_schedule || (last && (redrawn_ || printed_)))) return;
  last_print_ = now;
  printed_ = true;
  const double elapsed = std::chrono::duration<double>(now - *start_).count();
  const std::string line = text(done, detail, elapsed);
  if (redrawn_) {
    // \r and clear to the end of the line: a shorter line leaves nothing of the longer one.
    std::fprintf(out_, "\r%s\033[K", line.c_str());
    open_line_ = true;
    if (last) finish();
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void ProgressLine::finish() {
  if (open_line_ && out_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
  open_line_ = false;
}

SlowNotice::SlowNotice(std::string text, std::FILE* out, std::chrono::milliseconds after)
    : text_(std::move(text)),
      out_(out),
      begin_(std::chrono::steady_clock::now()),
      exceptions_(std::uncaught_exceptions()) {
  if (!out_) return;
  watcher_ = std::thread([this, after] {
    std::unique_lock<std::mutex> lock(mutex_);
    if (ended_cv_.wait_for(lock, after, [this] { return ended_; })) return;
    std::fprintf(out_, "%s ...\n", text_.c_str());
    std::fflush(out_);
    printed_ = true;
  });
}

SlowNotice::~SlowNotice() {
  if (!watcher_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ended_ = true;
  }
  ended_cv_.notify_one();
  watcher_.join();
  if (!printed_ || std::uncaught_exceptions() > exceptions_) return;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin_).count();
  std::fprintf(out_, "%s: %s\n", text_.c_str(), duration_text(seconds).c_str());
  std::fflush(out_);
}

StepLog::StepLog(const std::string& flag, const std::string& path, std::string rate_key)
    : flag_(flag), path_(path), rate_key_(std::move(rate_key)) {
  // A FIFO is waited on for a reader (bounded), never blocked on; a regular file is truncated.
  const int fd = nn::io::open_output_stream(path, flag_);
  file_ = ::fdopen(fd, "w");
  if (!file_) {
    const int e = errno;
    ::close(fd);
    DP_THROW(flag_ << "(" << path_ << "): cannot open it for writing: " << std::strerror(e));
  }
  // Unbuffered: each line goes out in write(), so a write that fails leaves nothing behind in
  // the stream for close() to write later.
  std::setvbuf(file_, nullptr, _IONBF, 0);
  struct stat st {};
  regular_ = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
}

StepLog::~StepLog() {
  try {
    close();
  } catch (const std::exception& e) {
    DP_LOG_ERROR(e.what());
  }
}

void StepLog::write(const StepRecord& r) {
  if (!file_) return;
  nlohmann::ordered_json o;  // keys in the order written
  o["step"] = r.step;
  o["loss"] = r.loss;
  o["lr"] = r.lr ? nlohmann::ordered_json(*r.lr) : nlohmann::ordered_json(nullptr);
  o["grad_norm"] =
      r.grad_norm ? nlohmann::ordered_json(*r.grad_norm) : nlohmann::ordered_json(nullptr);
  o[rate_key_] = r.rate;
  o["loss_scale"] = r.loss_scale;
  const std::string line = o.dump() + "\n";
  const long start = regular_ ? std::ftell(file_) : -1;
  errno = 0;
  const bool ok =
      std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0;
  if (ok) return;
  const int e = errno;
  // A regular file that filled up midway (a full disk, a size limit) is cut back to the steps
  // written whole: a reader of the log finds no partial line.
  bool cut = false;
  if (start >= 0) {
    std::clearerr(file_);
    cut = ::ftruncate(::fileno(file_), start) == 0 && std::fseek(file_, start, SEEK_SET) == 0;
  }
  DP_THROW(flag_ << "(" << path_ << "): writing step " << r.step
                 << " failed: " << (e ? std::strerror(e) : "short write")
                 << (cut ? " (the file ends at the last step written whole)" : ""));
}

void StepLog::close() {
  if (!file_) return;
  std::FILE* f = file_;
  file_ = nullptr;
  errno = 0;
  const bool flushed = std::fflush(f) == 0;
  const bool closed = std::fclose(f) == 0;
  DP_CHECK(flushed && closed, flag_ << "(" << path_ << "): closing it failed: "
                                    << (errno ? std::strerror(errno) : "unknown error"));
}

}  // namespace dp::cli
