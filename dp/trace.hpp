// Timeline of phases per device (DP) or per rank (DDP), written as a Chrome/Perfetto trace:
// one track per device, each phase a slice. Thread-safe; microseconds since the trace began.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dp {

// Tracks from here on are second streams: comm_track(i) is device i's communication stream
// (DP's pulls beside backward on a GPU), shown apart from device i's compute stream.
constexpr int kCommTrackBase = 1000;
constexpr int comm_track(int device) {
  return kCommTrackBase + device;
}

// Host milliseconds from t0 to now (steady clock): the engines' wall times of a step or a wait.
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct TraceEvent {
  std::string name;  // "dp/forward"
  int track = 0;     // device index or rank, or comm_track(device)
  double begin_us = 0;
  double duration_us = 0;
  int64_t step = -1;  // the training step it belongs to (-1: not tagged)
};

class Trace {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Trace(Clock::time_point origin = Clock::now()) : origin_(origin) {}

  double now_us() const { return to_us(Clock::now()); }
  // Microseconds from the trace's origin to t.
  double to_us(Clock::time_point t) const {
    return std::chrono::duration<double, std::micro>(t - origin_).count();
  }
  void add(TraceEvent e) {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(std::move(e));
  }
  std::vector<TraceEvent> events() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_;
  }

 private:
  Clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<TraceEvent> events_;
};

// One named run's events, e.g. {"dp N=4", trace.events()}.
struct TracedRun {
  std::string name;
  std::vector<TraceEvent> events;
  // default: "device <track>", "device <i> comm stream" for comm_track(i)
  std::map<int, std::string> track_names;
};
// The Chrome/Perfetto trace JSON of `runs`: one process per run, one thread (track) per device
// or rank, each event a complete slice ("ph": "X") tagged with its step when it has one. Open
// it in ui.perfetto.dev or chrome://tracing.
std::string chrome_trace(const std::vector<TracedRun>& runs);
// Writes chrome_trace(runs) to `path` (nn::io::write_output_file: atomic for a regular file,
// every write, flush and close checked). Throws kernels::Error naming the file and the reason,
// after `what` (a program passes the flag that named the file, "--trace").
void write_chrome_trace(const std::string& path, const std::vector<TracedRun>& runs,
                        const std::string& what = "trace");

// Records one slice on `track` from construction to destruction (no-op for a null trace).
class TraceScope {
 public:
  TraceScope(Trace* trace, std::string name, int track)
      : trace_(trace), name_(std::move(name)), track_(track), begin_(trace ? trace->now_us() : 0) {}
  ~TraceScope() {
    if (trace_) trace_->add({name_, track_, begin_, trace_->now_us() - begin_});
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Trace* trace_;
  std::string name_;
  int track_;
  double begin_;
};

}  // namespace dp
