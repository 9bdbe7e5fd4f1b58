// Writes the seed corpora of the fuzz targets: make_seeds OUT writes OUT/seeds/<target>/* (valid
// inputs of each format, made here by the same encoders the code uses) and makes the empty
// OUT/corpus/<target>/ where libFuzzer keeps what it finds. Run by the ctest fixture fuzz.seeds.
#include <sys/stat.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dp/distributed/store_protocol.hpp"
#include "nn/checkpoint_format.hpp"

namespace {

namespace wire = dp::dist::store_wire;

void mkdirs(const std::string& path) {
  std::string part;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!part.empty()) ::mkdir(part.c_str(), 0755);
    }
    if (i < path.size()) part += path[i];
  }
}

void write(const std::string& path, const std::string& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f) != 0) {
    std::fprintf(stderr, "make_seeds: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

std::string gzip(const std::string& raw) {
  uLongf n = compressBound(raw.size()) + 32;
  std::vector<Bytef> out(n);
  z_stream z{};
  deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);  // gzip
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  std::string s(reinterpret_cast<char*>(out.data()), z.total_out);
  deflateEnd(&z);
  return s;
}

std::string idx(const std::vector<uint32_t>& dims) {
  std::string s = {0, 0, 8, static_cast<char>(dims.size())};
  size_t n = 1;
  for (uint32_t d : dims) {
    for (int sh = 24; sh >= 0; sh -= 8) s += static_cast<char>((d >> sh) & 0xff);
    n *= d;
  }
  for (size_t i = 0; i < n; ++i) s += static_cast<char>(i * 7 % 251);
  return s;
}

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// A checkpoint of a Linear(3 -> 2): "weight" [2, 3] and "bias" [2], and one buffer "count" [1].
std::string checkpoint() {
  std::string s(nn::detail::kCheckpointMagic, 8);
  put<uint32_t>(s, nn::detail::kCheckpointVersion);
  put<uint32_t>(s, 3);
  put<uint64_t>(s, 8);
  put<uint64_t>(s, 1);
  auto entry = [&](uint8_t kind, const std::string& name, std::vector<int64_t> shape) {
    put<uint8_t>(s, kind);
    put<uint32_t>(s, static_cast<uint32_t>(name.size()));
    s += name;
    put<uint32_t>(s, static_cast<uint32_t>(shape.size()));
    for (int64_t d : shape) put<int64_t>(s, d);
  };
  entry(0, "weight", {2, 3});
  entry(0, "bias", {2});
  entry(1, "count", {1});
  std::vector<float> values = {1, -2, 3, -4, 5, -6, 0.5f, 0.25f, 7};
  put<uint64_t>(s, nn::detail::fnv1a(values.data(), values.size() * sizeof(float)));
  s.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return s;
}

// A training state in safetensors layout: one tensor "param.w" [2] and its metadata.
std::string train_state() {
  const std::string header = R"({"param.w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("__metadata__":{"format":"dptrain-training-state-1","step":"3"}})";
  std::string s;
  put<uint64_t>(s, header.size());
  s += header;
  const float values[2] = {1.5f, -2.f};
  s.append(reinterpret_cast<const char*>(values), sizeof values);
  return s;
}

std::string frames() {
  std::string s;
  auto add = [&](std::vector<char> f) { s.append(f.begin(), f.end()); };
  add(wire::Writer(wire::kHello).str("launch:0123abcd").i64(1).finish());
  add(wire::Writer(wire::kSet).str("dp/default/arrived/1").str("1").finish());
  add(wire::Writer(wire::kGet).str("dp/heartbeat/0").finish());
  add(wire::Writer(wire::kAdd).str("arrived").i64(1).finish());
  add(wire::Writer(wire::kCheck).u32(2).str("a").str("b").finish());
  add(wire::Writer(wire::kWait).u32(1).str("joined/0").finish());
  add(wire::Writer(wire::kRemove).str("a").finish());
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUT_DIR\n");
    return 2;
  }
  const std::string out = argv[1];
  for (const char* t : {"idx", "checkpoint", "train_state", "store_frame", "rendezvous"}) {
    mkdirs(out + "/seeds/" + t);
    mkdirs(out + "/corpus/" + t);
    mkdirs(out + "/artifacts");
  }
  const std::string images = idx({3, 4, 4}), labels = idx({3});
  write(out + "/seeds/idx/images", images);
  write(out + "/seeds/idx/labels", labels);
  write(out + "/seeds/idx/images.gz", gzip(images));
  write(out + "/seeds/idx/labels.gz", gzip(labels));
  write(out + "/seeds/checkpoint/linear.ckpt", checkpoint());
  write(out + "/seeds/train_state/step_3.safetensors", train_state());
  write(out + "/seeds/store_frame/session", frames());
  const char* rendezvous[] = {
      "tcp://127.0.0.1:29500?rank=1&world_size=4\nDP_TIMEOUT=1.5\nDP_JOB_ID=7\n",
      "tcp://[::1]:29500/?world_size=2&rank=0\n",
      "file:///tmp/rdzv?world_size=2&rank=1\n",
      "env://\nMASTER_ADDR=node0\nMASTER_PORT=29500\nRANK=3\nWORLD_SIZE=4\nLOCAL_RANK=1\n"
      "LOCAL_WORLD_SIZE=2\nGROUP_RANK=1\nDP_JOB_TOKEN=abc\n",
      "env://\nOMPI_COMM_WORLD_RANK=1\nOMPI_COMM_WORLD_SIZE=2\nOMPI_COMM_WORLD_LOCAL_RANK=1\n",
      "env://\nSLURM_PROCID=5\nSLURM_NTASKS=8\nSLURM_LOCALID=1\nSLURM_NNODES=2\n"
      "SLURM_NODEID=1\nSLURM_NTASKS_PER_NODE=4\nMASTER_ADDR=n0\nSLURM_JOB_ID=99\n",
  };
  int i = 0;
  for (const char* r : rendezvous) write(out + "/seeds/rendezvous/" + std::to_string(i++), r);
  return 0;
}
