#include "kernels/runtime/error.hpp"

#include <cstdio>

namespace kernels::detail {

namespace {
const char* base_name(const char* path) {
  const char* base = path;
  for (const char* p = path; *p; ++p)
    if (*p == '/') base = p + 1;
  return base;
}
}  // namespace

std::string error_text(const char* file, int line, const char* what, const std::string& msg) {
  std::ostringstream os;
  os << msg;
  if (what)
    os << " [check `" << what << "` failed";
  else
    os << " [";
  os << (what ? " at " : "at ") << base_name(file) << ":" << line << "]";
  return os.str();
}

void throw_error(const char* file, int line, const char* what, const std::string& msg) {
  throw Error(error_text(file, line, what, msg));
}

void log_error(const char* file, int line, const std::string& msg) noexcept {
  std::fprintf(stderr, "dp: error: %s [at %s:%d]\n", msg.c_str(), base_name(file), line);
}

}  // namespace kernels::detail
