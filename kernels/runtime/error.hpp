// One throwing error type for the whole engine, and the checked-call macros that raise it.
// Every message names the failed check or call, the file and the line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kernels {

// Thrown on bad input (shape, dtype, device), failed library calls and engine faults.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A graph's capture took memory its context's block cache does not hold (kernels/runtime/
// graph.hpp): the work is capturable once that memory is cached, which running it uncaptured
// once does (its blocks go back to the cache when freed).
class CaptureMemoryError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const char* what, const std::string& msg);
// The text throw_error gives: `msg` with the failed check (`what`, or none) and the place.
std::string error_text(const char* file, int line, const char* what, const std::string& msg);
// Logs from destructors and other places that must not throw.
void log_error(const char* file, int line, const std::string& msg) noexcept;
}  // namespace detail

}  // namespace kernels

// DP_CHECK(cond, "shapes differ: " << a << " vs " << b): throws kernels::Error when cond is false.
#define DP_CHECK(cond, msg)                                                          \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream dp_check_os_;                                               \
      dp_check_os_ << msg;                                                           \
      ::kernels::detail::throw_error(__FILE__, __LINE__, #cond, dp_check_os_.str()); \
    }                                                                                \
  } while (0)

// DP_THROW("unknown device '" << s << "'"): throws unconditionally.
#define DP_THROW(msg)                                                                \
  do {                                                                               \
    std::ostringstream dp_check_os_;                                                 \
    dp_check_os_ << msg;                                                             \
    ::kernels::detail::throw_error(__FILE__, __LINE__, nullptr, dp_check_os_.str()); \
  } while (0)

#define DP_LOG_ERROR(msg)                                                 \
  do {                                                                    \
    std::ostringstream dp_check_os_;                                      \
    dp_check_os_ << msg;                                                  \
    ::kernels::detail::log_error(__FILE__, __LINE__, dp_check_os_.str()); \
  } while (0)
