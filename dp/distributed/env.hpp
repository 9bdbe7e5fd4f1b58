// Environment lookups behind a function, so that rendezvous and launcher code can be tested
// with per-rank variables while ranks run as threads of one process.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>

namespace dp::dist {

// Returns the value of a variable, or nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The process environment (getenv).
EnvLookup process_env();
// A fixed map (tests).
EnvLookup map_env(std::map<std::string, std::string> vars);
// `env` when it is set, else process_env().
inline EnvLookup env_or_process(const EnvLookup& env) {
  return env ? env : process_env();
}

// The integer value of variable `name`, nullopt when unset. Throws kernels::Error naming the
// variable and its text when it is not an integer in [lo, hi].
std::optional<int> env_int(const EnvLookup& env, const std::string& name, int lo, int hi);
// Parses a whole decimal integer in [lo, hi]; throws naming `what` and the text otherwise.
int parse_int(const std::string& text, int lo, int hi, const std::string& what);

// The longest timeout accepted anywhere (a week).
constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 7);
// Parses seconds ("10", "0.5") in (0, kMaxTimeout]; throws naming `what` and the text otherwise.
std::chrono::milliseconds parse_seconds(const std::string& text, const std::string& what);
// Variable `name` as seconds (parse_seconds), nullopt when unset.
std::optional<std::chrono::milliseconds> env_seconds(const EnvLookup& env, const std::string& name);
// "10 s", "0.5 s": a duration as messages print it.
std::string seconds_text(std::chrono::milliseconds d);

}  // namespace dp::dist
