// SignalledWork: a Work that another thread (a group's worker or progress thread) finishes.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "dp/distributed/process_group.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

// requires finish() called exactly once. ensures wait() returns after it, throwing its error.
// The error crosses threads as its text: wait() throws a kernels::Error of its own, so no
// exception object is shared between the finishing thread and the waiting ones (several may
// wait on one work, and its last owner may be either).
class SignalledWork final : public Work {
 public:
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    if (failed_) throw kernels::Error(error_);
  }
  bool is_completed() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void finish(std::exception_ptr error) {
    std::string text;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        text = e.what();
      } catch (...) {
        text = "unknown error";
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    failed_ = error != nullptr;
    error_ = std::move(text);
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool failed_ = false;
  std::string error_;
};

}  // namespace dp::dist
