// SignalledWork: a Work that another thread (a group's worker or progress thread) finishes.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

#include "dp/distributed/process_group.hpp"

namespace dp::dist {

// requires finish() called exactly once. ensures wait() returns after it, rethrowing its error.
class SignalledWork final : public Work {
 public:
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = error;
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace dp::dist
