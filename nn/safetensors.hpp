// The safetensors layout, read defensively: an 8-byte little-endian header length N, N bytes
// of JSON ({"<tensor>": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {string: string}}), then the tensors' bytes. Only F32 tensors are accepted (what this engine
// writes). Every field is checked against the file's real size before anything is allocated.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nn/file_io.hpp"

namespace nn::safetensors {

struct TensorEntry {
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into File::data
  int64_t numel = 0;
};

struct File {
  std::map<std::string, std::string> metadata;
  std::map<std::string, TensorEntry> tensors;
  std::string data;  // the bytes after the header
};

// requires r opened at the start of the file. ensures every tensor is F32 with non-negative
// dimensions whose product times 4 is its byte range, which lies inside the data; every
// metadata value is a string. Throws kernels::Error naming the file and what is wrong.
inline File read(io::FileReader& r) {
  const std::string where = r.where();
  const uint64_t n = r.get<uint64_t>("the header length");
  DP_CHECK(n <= r.remaining() && n <= (uint64_t{64} << 20),
           where << ": header length " << n << " exceeds the file (" << r.size() << " bytes)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(r.bytes(n, "the JSON header"));
  } catch (const nlohmann::json::exception& e) {
    DP_THROW(where << ": the header is not valid JSON: " << e.what());
  }
  DP_CHECK(header.is_object(), where << ": the header is not a JSON object");
  File f;
  f.data = r.bytes(r.remaining(), "the tensor data");  // bounded by the file's size
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
             what << " has a malformed entry");
    DP_CHECK(e["dtype"] == "F32", what << " has dtype " << e["dtype"].dump() << ", not F32");
    DP_CHECK(e["data_offsets"][0].is_number_unsigned() && e["data_offsets"][1].is_number_unsigned(),
             what << " has data offsets that are not counts");
    TensorEntry t;
    t.numel = 1;
    for (const auto& d : e["shape"]) {
      DP_CHECK(d.is_number_unsigned(), what << " has a dimension that is not a count");
      const int64_t dim = static_cast<int64_t>(std::min<uint64_t>(d.get<uint64_t>(), INT64_MAX));
      DP_CHECK(!__builtin_mul_overflow(t.numel, dim, &t.numel) && t.numel <= INT64_MAX / 4,
               what << " has too many elements");
      t.shape.push_back(dim);
    }
    t.begin = e["data_offsets"][0].get<uint64_t>();
    t.end = e["data_offsets"][1].get<uint64_t>();
    DP_CHECK(t.begin <= t.end && t.end <= f.data.size() &&
                 t.end - t.begin == static_cast<uint64_t>(t.numel) * 4,
             what << " has data offsets [" << t.begin << ", " << t.end << ") outside the "
                  << f.data.size() << " data bytes, or not its " << t.numel << " floats");
    f.tensors[name] = std::move(t);
  }
  return f;
}

}  // namespace nn::safetensors
