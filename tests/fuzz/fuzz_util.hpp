// Shared by the fuzz targets: the input as a file (a memfd, named /proc/self/fd/N), for readers
// that take a path, and a hard stop when a documented postcondition fails.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace dp_fuzz {

// One memfd per process, rewritten with each input.
inline std::string as_file(const uint8_t* data, size_t size) {
  static const int fd = ::memfd_create("dp_fuzz_input", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, 0) != 0) std::abort();
  size_t done = 0;
  while (done < size) {
    ssize_t w = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (w <= 0) std::abort();
    done += static_cast<size_t>(w);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

// A broken contract: abort, so that libFuzzer keeps the input.
#define DP_FUZZ_ASSERT(cond)                                                           \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: contract broken: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

}  // namespace dp_fuzz
