#include "dp/distributed/config_check.hpp"

#include <algorithm>
#include <charconv>
#include <set>
#include <sstream>

#include "dp/distributed/process_group.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

namespace {

void put(std::string& out, const std::string& s) {
  out += std::to_string(s.size());
  out += ':';
  out += s;
}

// Reads "<length>:<bytes>" at pos; false when the text is not that.
bool take(const std::string& text, size_t& pos, std::string& out) {
  size_t colon = text.find(':', pos);
  if (colon == std::string::npos || colon == pos || colon - pos > 9) return false;
  size_t n = 0;
  for (size_t i = pos; i < colon; ++i) {
    if (text[i] < '0' || text[i] > '9') return false;
    n = n * 10 + static_cast<size_t>(text[i] - '0');
  }
  if (n > text.size() - colon - 1) return false;
  out = text.substr(colon + 1, n);
  pos = colon + 1 + n;
  return true;
}

// A value as a message shows it: at most 80 bytes, control bytes as \xNN (a value is any bytes).
std::string shown(const std::string& v) {
  std::string out;
  for (unsigned char c : v.size() <= 80 ? v : v.substr(0, 77)) {
    if (c >= 0x20 && c != 0x7f) {
      out += static_cast<char>(c);
      continue;
    }
    static const char* hex = "0123456789abcdef";
    out += "\\x";
    out += hex[c >> 4];
    out += hex[c & 15];
  }
  return v.size() <= 80 ? out : out + "...";
}

// A program's flag ("--batch", as the user typed it) is named as it is; a derived field
// ("engine.buckets") in quotes, after the flags.
bool is_flag(const std::string& name) {
  return name.rfind("--", 0) == 0;
}
std::string field_label(const std::string& name) {
  return is_flag(name) ? shown(name) : "field \"" + shown(name) + "\"";
}

}  // namespace

std::string encode_config(const RunConfig& fields) {
  std::string out;
  for (const auto& [name, value] : fields) {
    put(out, name);
    put(out, value);
  }
  return out;
}

RunConfig decode_config(const std::string& text, int rank) {
  RunConfig fields;
  for (size_t pos = 0; pos < text.size();) {
    std::string name, value;
    DP_CHECK(take(text, pos, name) && take(text, pos, value),
             "the configuration rank " << rank << " sent is malformed at byte " << pos
                                       << " (a different build of this program?)");
    fields[name] = value;
  }
  return fields;
}

std::string describe_config_mismatch(const std::vector<RunConfig>& per_rank) {
  std::set<std::string> names;
  for (const auto& c : per_rank)
    for (const auto& kv : c) names.insert(kv.first);
  const std::string unset = "(unset)";
  auto value_of = [&](size_t r, const std::string& name) -> const std::string& {
    auto it = per_rank[r].find(name);
    return it == per_rank[r].end() ? unset : it->second;
  };
  std::vector<std::string> differing;
  for (const auto& name : names)
    for (size_t r = 1; r < per_rank.size(); ++r)
      if (value_of(r, name) != value_of(0, name)) {
        differing.push_back(name);
        break;
      }
  if (differing.empty()) return {};
  // A bucket plan differs because the parameters do: those first (it read "engine.buckets:
  // rank 0 has 1 (...), rank 1 has 1 (...)" for two models).
  std::stable_partition(differing.begin(), differing.end(), [](const std::string& n) {
    return n.find("buckets") == std::string::npos;
  });
  // The user's flags first: a derived field that differs (the bucket plan, a data set's size)
  // usually differs because a flag does, and the flag is what to fix.
  std::stable_partition(differing.begin(), differing.end(), is_flag);
  // And before them the program: two programs differ in most flags, and the program is the
  // mistake.
  std::stable_partition(differing.begin(), differing.end(),
                        [](const std::string& n) { return n == "program"; });
  const std::string& name = differing.front();
  // Ranks grouped by value, in order of each value's first rank.
  std::vector<std::pair<std::string, std::vector<size_t>>> groups;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const std::string& v = value_of(r, name);
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == v; });
    if (it == groups.end())
      groups.push_back({v, {r}});
    else
      it->second.push_back(r);
  }
  std::ostringstream os;
  os << "config mismatch: " << field_label(name) << ": ";
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& ranks = groups[g].second;
    os << (g ? ", " : "") << (ranks.size() == 1 ? "rank " : "ranks ");
    for (size_t i = 0; i < ranks.size() && i < 8; ++i) os << (i ? ", " : "") << ranks[i];
    if (ranks.size() > 8) os << " (and " << ranks.size() - 8 << " more)";
    os << (ranks.size() == 1 ? " has " : " have ") << shown(groups[g].first);
  }
  if (differing.size() > 1) {
    os << " (also differ:";
    for (size_t i = 1; i < differing.size() && i <= 8; ++i)
      os << " "
         << (is_flag(differing[i]) ? shown(differing[i]) : "\"" + shown(differing[i]) + "\"");
    if (differing.size() > 9) os << " and " << differing.size() - 9 << " more";
    os << ")";
  }
  return os.str();
}

namespace {
template <class T>
std::string shortest(T v) {
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
}  // namespace

std::string config_number(float v) {
  return shortest(v);
}

std::string config_number(double v) {
  return shortest(v);
}

void verify_same_config(ProcessGroup& group, const RunConfig& mine,
                        std::chrono::milliseconds timeout) {
  std::vector<std::string> texts = group.exchange_text("config", encode_config(mine), timeout);
  std::vector<RunConfig> per_rank;
  for (size_t r = 0; r < texts.size(); ++r)
    per_rank.push_back(decode_config(texts[r], static_cast<int>(r)));
  std::string mismatch = describe_config_mismatch(per_rank);
  DP_CHECK(mismatch.empty(), "rank " << group.rank() << " of " << group.size() << ": " << mismatch
                                     << "; every rank must run the same configuration");
}

}  // namespace dp::dist
