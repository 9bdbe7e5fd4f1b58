// The safetensors layout, read defensively: an 8-byte little-endian header length N, N bytes
// of JSON ({"<tensor>": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {string: string}}), then the tensors' bytes. Only F32 tensors are accepted (what this engine
// writes).
//
// The reader reads the header only; the tensors' bytes are read later, range by range
// (read_tensor), so a file's memory cost is its header plus what the caller asks for. As the
// format requires, the tensors tile the data exactly: sorted by offset, each begins where the
// previous ends, the first at 0 and the last at the file's end (no gaps, overlaps or trailing
// bytes). Duplicate keys at any level of the header are refused. Every error names the file
// and the field.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nn/file_io.hpp"

namespace nn::safetensors {

// The largest header this reader accepts (the reference implementation's limit is 100 MB).
constexpr uint64_t kMaxHeaderBytes = uint64_t{64} << 20;

struct TensorEntry {
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data (after the header)
  int64_t numel = 0;
};

struct File {
  std::map<std::string, std::string> metadata;
  std::map<std::string, TensorEntry> tensors;
  uint64_t data_offset = 0;  // where the data starts in the file: 8 + the header length
  uint64_t data_size = 0;    // the data's bytes: the file's size - data_offset
};

namespace detail {

// Refuses a key that appears twice in one JSON object, at any depth (nlohmann's parser would
// keep the last one silently).
struct DuplicateKeyCheck {
  std::string where;
  std::vector<std::set<std::string>> open;  // the keys of each object being parsed
  bool operator()(int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      open.emplace_back();
    } else if (event == E::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == E::key && !open.empty()) {
      const std::string key = parsed.get<std::string>();
      DP_CHECK(open.back().insert(key).second, where << ": the header has the key '"
                                                     << io::printable(key)
                                                     << "' twice in one object");
    }
    return true;
  }
};

}  // namespace detail

// requires r opened at the start of the file. ensures every tensor is F32 with non-negative
// dimensions whose product times 4 is its byte range; the ranges tile [0, data_size) without
// gap or overlap and data_offset + data_size is the file's size; every metadata value is a
// string; no key is duplicated. Reads the header only. Throws kernels::Error naming the file
// and the field.
inline File read(io::FileReader& r) {
  const std::string where = r.where();
  const uint64_t n = r.get<uint64_t>("the header length");
  // A text file's first 8 bytes read as a length in the quintillions: say what it is.
  DP_CHECK(n <= kMaxHeaderBytes, where << ": header length " << n << " is more than the "
                                       << kMaxHeaderBytes
                                       << " bytes (64 MiB) this reader accepts: not a safetensors "
                                          "file (its first 8 bytes are the header's length)");
  DP_CHECK(n <= r.remaining(), where << ": header length " << n << " exceeds the file (" << r.size()
                                     << " bytes, " << r.remaining() << " after the length)");
  nlohmann::json header;
  try {
    header =
        nlohmann::json::parse(r.bytes(n, "the JSON header"), detail::DuplicateKeyCheck{where, {}});
  } catch (const nlohmann::json::exception& e) {
    DP_THROW(where << ": the header is not valid JSON: " << e.what());
  }
  DP_CHECK(header.is_object(), where << ": the header is not a JSON object");
  File f;
  f.data_offset = r.pos();
  f.data_size = r.remaining();
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string name = it.key();
    const nlohmann::json& e = it.value();
    if (name == "__metadata__") {
      DP_CHECK(e.is_object(), where << ": __metadata__ is not an object");
      for (auto m = e.begin(); m != e.end(); ++m) {
        DP_CHECK(m.value().is_string(),
                 where << ": metadata '" << io::printable(m.key()) << "' is not a string");
        f.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = where + ": tensor '" + io::printable(name) + "'";
    DP_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") &&
                 e.contains("data_offsets") && e["shape"].is_array() &&
                 e["data_offsets"].is_array() && e["data_offsets"].size() == 2,
             what << " has a malformed entry (needs dtype, shape [...] and data_offsets "
                  << "[begin, end])");
    DP_CHECK(e["dtype"] == "F32", what << " has dtype " << e["dtype"].dump() << ", not F32");
    for (int k = 0; k < 2; ++k)
      DP_CHECK(e["data_offsets"][k].is_number_unsigned(),
               what << ": data_offsets[" << k << "] = " << e["data_offsets"][k].dump()
                    << " is not a count in [0, 2^64)");
    DP_CHECK(e["shape"].size() <= 16,
             what << " has " << e["shape"].size() << " dimensions (at most 16)");
    TensorEntry t;
    t.numel = 1;
    for (size_t k = 0; k < e["shape"].size(); ++k) {
      const nlohmann::json& d = e["shape"][k];
      DP_CHECK(d.is_number_unsigned(),
               what << ": shape[" << k << "] = " << d.dump() << " is not a count");
      const int64_t dim = static_cast<int64_t>(std::min<uint64_t>(d.get<uint64_t>(), INT64_MAX));
      DP_CHECK(!__builtin_mul_overflow(t.numel, dim, &t.numel) && t.numel <= INT64_MAX / 4,
               what << ": shape " << e["shape"].dump() << " has too many elements");
      t.shape.push_back(dim);
    }
    t.begin = e["data_offsets"][0].get<uint64_t>();
    t.end = e["data_offsets"][1].get<uint64_t>();
    DP_CHECK(t.begin <= t.end && t.end <= f.data_size,
             what << ": data_offsets [" << t.begin << ", " << t.end << ") lie outside the "
                  << f.data_size << " data bytes"
                  << (t.begin <= t.end ? " (truncated, or corrupt offsets)" : ""));
    DP_CHECK(t.end - t.begin == static_cast<uint64_t>(t.numel) * 4,
             what << ": data_offsets [" << t.begin << ", " << t.end << ") hold " << t.end - t.begin
                  << " bytes, not its " << t.numel << " floats (" << t.numel * 4 << " bytes)");
    f.tensors[name] = std::move(t);
  }
  // The ranges tile the data: sorted by offset, each begins where the previous one ended.
  std::vector<std::pair<const std::string*, const TensorEntry*>> order;
  for (const auto& [name, t] : f.tensors) order.emplace_back(&name, &t);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a.second->begin, a.second->end) <
           std::make_pair(b.second->begin, b.second->end);
  });
  uint64_t cursor = 0;
  const std::string* previous = nullptr;
  for (const auto& [name, t] : order) {
    DP_CHECK(t->begin == cursor,
             where << ": tensor '" << io::printable(*name) << "' has data_offsets [" << t->begin
                   << ", " << t->end << ") "
                   << (t->begin < cursor ? "overlapping" : "leaving a gap after")
                   << (previous ? " tensor '" + io::printable(*previous) + "'"
                                : std::string(" the start of the data"))
                   << ", which ends at " << cursor
                   << " (the data must be covered exactly, without gaps or overlaps)");
    cursor = t->end;
    previous = name;
  }
  DP_CHECK(cursor == f.data_size, where << ": the tensors' data ends at byte " << cursor
                                        << " but the file has " << f.data_size
                                        << " data bytes after the header ("
                                        << (cursor < f.data_size ? "trailing bytes" : "truncated")
                                        << "): the data must end exactly at the file's end");
  return f;
}

// requires f read from r, dst room for t.numel floats. ensures dst holds the tensor's bytes,
// read from the file's range alone.
inline void read_tensor(io::FileReader& r, const File& f, const TensorEntry& t, float* dst,
                        const char* what) {
  r.seek(f.data_offset + t.begin);
  r.read(dst, t.end - t.begin, what);
}

// Metadata `key` as a whole number in [lo, hi]; throws naming the file, the key and the value
// when it is missing, not decimal digits, or out of range (never a bare "stoll").
inline int64_t metadata_count(const File& f, const std::string& where, const std::string& key,
                              int64_t lo, int64_t hi) {
  auto it = f.metadata.find(key);
  DP_CHECK(it != f.metadata.end(), where << ": metadata '" << key << "' is missing");
  const std::string& s = it->second;
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  DP_CHECK(
      !s.empty() && s[0] != '-' && s[0] != '+' && ec != std::errc::invalid_argument &&
          end == s.data() + s.size(),
      where << ": metadata '" << key << "' = '" << io::printable(s) << "' is not a whole number");
  DP_CHECK(ec != std::errc::result_out_of_range && v >= lo && v <= hi,
           where << ": metadata '" << key << "' = '" << io::printable(s) << "' is out of range ["
                 << lo << ", " << hi << "]");
  return v;
}

// Metadata `key` as comma-separated unsigned 64-bit numbers ("" is none).
inline std::vector<uint64_t> metadata_u64_list(const File& f, const std::string& where,
                                               const std::string& key) {
  auto it = f.metadata.find(key);
  DP_CHECK(it != f.metadata.end(), where << ": metadata '" << key << "' is missing");
  const std::string& s = it->second;
  std::vector<uint64_t> out;
  size_t at = 0;
  while (at < s.size()) {
    size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    uint64_t v = 0;
    auto [stop, ec] = std::from_chars(s.data() + at, s.data() + end, v);
    DP_CHECK(
        end > at && s[at] != '-' && s[at] != '+' && ec == std::errc() && stop == s.data() + end,
        where << ": metadata '" << key << "' item " << out.size() << " = '"
              << io::printable(s.substr(at, end - at)) << "' is not a whole number in [0, 2^64)");
    out.push_back(v);
    at = end + 1;
  }
  return out;
}

}  // namespace nn::safetensors
