// A file in memory with no name, shared with worker processes through its inherited descriptor
// (dp_bench's DDP and hybrid runs): rank 0 writes the figures, each rank its trace.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/runtime/error.hpp"

namespace bench {
// A file in memory with no name (memfd), shared with the workers through its inherited
// descriptor: rank 0 writes the figures, each rank its trace. Nothing lands on disk, so nothing
// is left behind however the launcher or the workers end (kill -9 included): the file goes when
// the last process holding it does.
class SharedFile {
 public:
  explicit SharedFile(const char* name) : fd_(::memfd_create(name, 0)) {  // no CLOEXEC: inherited
    DP_CHECK(fd_ >= 0, "dp_bench: memfd_create failed: " << std::strerror(errno));
  }
  ~SharedFile() { ::close(fd_); }
  SharedFile(const SharedFile&) = delete;
  SharedFile& operator=(const SharedFile&) = delete;
  int fd() const { return fd_; }
  std::string read() const { return read_fd(fd_); }

  static std::string read_fd(int fd) {
    std::string text;
    char buf[1 << 16];
    for (off_t at = 0;;) {
      ssize_t n = ::pread(fd, buf, sizeof(buf), at);
      if (n < 0 && errno == EINTR) continue;
      DP_CHECK(n >= 0, "dp_bench: reading a worker's result failed: " << std::strerror(errno));
      if (n == 0) return text;
      text.append(buf, static_cast<size_t>(n));
      at += n;
    }
  }
  static void write_fd(int fd, const std::string& text) {
    DP_CHECK(::ftruncate(fd, 0) == 0, "dp_bench worker: ftruncate: " << std::strerror(errno));
    for (size_t at = 0; at < text.size();) {
      ssize_t n = ::pwrite(fd, text.data() + at, text.size() - at, static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      DP_CHECK(n > 0, "dp_bench worker: writing the result failed: " << std::strerror(errno));
      at += static_cast<size_t>(n);
    }
  }

 private:
  int fd_;
};

// The descriptor a variable names, checked: it must be one the launcher passed down.
inline int fd_from_env(const char* text, const char* what) {
  char* end = nullptr;
  long fd = std::strtol(text, &end, 10);
  DP_CHECK(end && *end == '\0' && fd >= 0 && ::fcntl(static_cast<int>(fd), F_GETFD) != -1,
           "dp_bench worker: " << what << " '" << text << "' is not an open descriptor");
  return static_cast<int>(fd);
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace bench
