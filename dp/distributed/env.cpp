#include "dp/distributed/env.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <utility>

#include "kernels/runtime/error.hpp"

namespace dp::dist {

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

EnvLookup map_env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

int parse_int(const std::string& text, int lo, int hi, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  // strtoll also takes leading spaces and a '+': a variable is a plain decimal number.
  const bool plain = !text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) ||
                                       (text[0] == '-' && text.size() > 1));
  DP_CHECK(plain && end && *end == '\0' && errno == 0,
           what << "='" << text << "' is not an integer");
  DP_CHECK(v >= lo && v <= hi, what << "=" << v << " is not in [" << lo << ", " << hi << "]");
  return static_cast<int>(v);
}

std::chrono::milliseconds parse_seconds(const std::string& text, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  const double max_s = static_cast<double>(kMaxTimeout.count()) / 1000.0;
  DP_CHECK(!text.empty() && end && *end == '\0' && errno == 0 && std::isfinite(v),
           what << "='" << text << "' is not a number of seconds");
  DP_CHECK(v * 1000.0 >= 1.0 && v <= max_s,
           what << "=" << text << " s is not in [0.001, " << max_s << "] seconds");
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(v * 1000.0)));
}

std::optional<std::chrono::milliseconds> env_seconds(const EnvLookup& env,
                                                     const std::string& name) {
  std::optional<std::string> v = env(name);
  if (!v) return std::nullopt;
  return parse_seconds(*v, name);
}

std::string seconds_text(std::chrono::milliseconds d) {
  std::ostringstream os;
  os << static_cast<double>(d.count()) / 1000.0 << " s";
  return os.str();
}

std::optional<int> env_int(const EnvLookup& env, const std::string& name, int lo, int hi) {
  std::optional<std::string> v = env(name);
  if (!v) return std::nullopt;
  return parse_int(*v, lo, hi, name);
}

}  // namespace dp::dist
