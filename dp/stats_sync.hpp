// SyncBatchNorm for threaded DP: the replicas of one step (one thread each) combine their
// BatchNorm statistics through host memory. Each replica's layers hold a ThreadStatsSync
// participant; a layer's all_reduce_sum waits until every participating replica reached the
// same layer, then each gets the sum, added in device order (the same bits on every run).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/runtime/error.hpp"
#include "nn/norm.hpp"

namespace dp {

class ThreadStatsSync {
 public:
  explicit ThreadStatsSync(int n_replicas) : slots_(static_cast<size_t>(n_replicas)) {
    DP_CHECK(n_replicas >= 1, "ThreadStatsSync: " << n_replicas << " replicas");
    participants_ = n_replicas;
  }

  // The sync replica i's BatchNorm layers use.
  std::shared_ptr<nn::StatsSync> participant(int i) {
    DP_CHECK(i >= 0 && i < static_cast<int>(slots_.size()), "ThreadStatsSync: replica " << i);
    return std::make_shared<Participant>(*this, i);
  }

  // Replicas 0..n-1 take part in the next steps (a batch smaller than the device count uses
  // fewer). Clears an earlier abort. Call between steps.
  void set_participants(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    DP_CHECK(n >= 1 && n <= static_cast<int>(slots_.size()),
             "ThreadStatsSync: " << n << " participants of " << slots_.size());
    participants_ = n;
    arrived_ = 0;
    aborted_.clear();
  }
  // Releases every replica waiting in all_reduce_sum, which then throws `why` (a replica
  // failed before reaching the same layer). Lasts until set_participants.
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = why;
    cv_.notify_all();
  }

 private:
  class Participant final : public nn::StatsSync {
   public:
    Participant(ThreadStatsSync& owner, int index) : owner_(owner), index_(index) {}
    void all_reduce_sum(std::vector<double>& values) override { owner_.reduce(index_, values); }

   private:
    ThreadStatsSync& owner_;
    int index_;
  };

  void reduce(int i, std::vector<double>& values) {
    std::unique_lock<std::mutex> lock(mu_);
    DP_CHECK(i < participants_, "SyncBatchNorm: replica " << i << " is not in this step's "
                                                          << participants_ << " replicas");
    if (!aborted_.empty()) DP_THROW("SyncBatchNorm: " << aborted_);
    slots_[i] = values;
    const uint64_t generation = generation_;
    if (++arrived_ == participants_) {
      result_.assign(values.size(), 0.0);
      for (int r = 0; r < participants_; ++r) {
        DP_CHECK(slots_[r].size() == values.size(),
                 "SyncBatchNorm: replica " << r << " passed " << slots_[r].size()
                                           << " values, replica " << i << " " << values.size());
        for (size_t k = 0; k < values.size(); ++k) result_[k] += slots_[r][k];
      }
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation || !aborted_.empty(); });
      if (generation_ == generation) DP_THROW("SyncBatchNorm: " << aborted_);
    }
    values = result_;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<double>> slots_;
  std::vector<double> result_;
  int participants_ = 1;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::string aborted_;
};

}  // namespace dp
