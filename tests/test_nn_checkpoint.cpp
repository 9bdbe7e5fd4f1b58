// Checkpoint files as an attacker or an unlucky user meets them: huge and non-regular files,
// concurrent saves, directories, and names that C strings would cut short.
#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <functional>
#include <set>
#include <thread>

#include "tests/nn_test_util.hpp"

using namespace nn_test;

namespace {

// A fresh directory under /tmp, removed with its files at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/nn_ckpt_test_XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string file(const std::string& name) const { return path + "/" + name; }
  std::set<std::string> entries() const {
    std::set<std::string> out;
    DIR* d = ::opendir(path.c_str());
    if (!d) return out;
    while (dirent* e = ::readdir(d))
      if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.insert(e->d_name);
    ::closedir(d);
    return out;
  }
};

using dp_test::error_of;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("nn.checkpoint: a 3 GB non-checkpoint file fails at once with small memory") {
  TempDir dir;
  const std::string big = dir.file("big.bin");
  {
    std::FILE* f = std::fopen(big.c_str(), "wb");
    REQUIRE(f);
    std::fputs("this is no checkpoint", f);
    std::fclose(f);
    REQUIRE(::truncate(big.c_str(), int64_t{3} << 30) == 0);  // sparse: no disk used
  }
  auto m = materialized(nn::mlp({4, 3, 2}), 1);
  const long before = peak_rss_kb();
  std::string e = error_of([&] { nn::load_checkpoint(*m, big); });
  CHECK(contains(e, "bad magic"));
  CHECK(contains(e, big));
  CHECK(peak_rss_kb() - before < 64 * 1024);  // the old reader took 6.4 GB here

  // A file with the right magic and a lying header is bounded by its real size.
  {
    std::FILE* f = std::fopen(big.c_str(), "wb");
    REQUIRE(f);
    const uint32_t version = 1, entries = 4000000000u;
    const uint64_t elements = uint64_t{1} << 62;
    std::fwrite("DPNNCKPT", 1, 8, f);
    std::fwrite(&version, 4, 1, f);
    std::fwrite(&entries, 4, 1, f);
    std::fwrite(&elements, 8, 1, f);
    std::fwrite(&elements, 8, 1, f);
    std::fclose(f);
  }
  e = error_of([&] { nn::load_checkpoint(*m, big); });
  CHECK(contains(e, "corrupt entry count 4000000000"));
  CHECK(peak_rss_kb() - before < 64 * 1024);
}

TEST_CASE("nn.checkpoint: /dev/zero, a directory and a FIFO are refused with the reason") {
  TempDir dir;
  auto m = materialized(nn::mlp({4, 3, 2}), 1);
  std::string e = error_of([&] { nn::load_checkpoint(*m, "/dev/zero"); });
  CHECK(contains(e, "load_checkpoint(/dev/zero): is a character device, not a regular file"));
  e = error_of([&] { nn::load_checkpoint(*m, dir.path); });
  CHECK(contains(e, dir.path + "): is a directory, not a regular file"));
  const std::string fifo = dir.file("fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  e = error_of([&] { nn::load_checkpoint(*m, fifo); });  // must not block on the open
  CHECK(contains(e, "is a FIFO (named pipe), not a regular file"));
  e = error_of([&] { nn::load_checkpoint(*m, dir.file("missing")); });
  CHECK(contains(e, "cannot open the file: No such file or directory"));
}

TEST_CASE("nn.checkpoint: concurrent saves to one path all succeed and readers see whole files") {
  TempDir dir;
  const std::string path = dir.file("shared.ckpt");
  constexpr int kWriters = 4, kSaves = 40;
  // Each writer saves its own model (different sizes and values), so a mix or a cut shows.
  std::vector<nn::ModulePtr> models;
  std::vector<std::string> content;
  for (int w = 0; w < kWriters; ++w) {
    models.push_back(materialized(nn::mlp({4, 3 + w, 2}), 10 + w));
    nn::save_checkpoint(*models.back(), dir.file("one.ckpt"));
    content.push_back(read_all(dir.file("one.ckpt")));
  }
  std::remove(dir.file("one.ckpt").c_str());
  std::atomic<int> failures{0}, partial{0}, reads{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w)
    threads.emplace_back([&, w] {
      for (int i = 0; i < kSaves; ++i) try {
          nn::save_checkpoint(*models[w], path);
        } catch (const kernels::Error& e) {
          ++failures;
          MESSAGE(e.what());
        }
    });
  std::thread reader([&] {
    while (!done.load()) {
      std::ifstream f(path, std::ios::binary);
      if (!f) continue;  // not written yet
      std::string got((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      ++reads;
      bool whole = false;
      for (int w = 0; w < kWriters; ++w) whole |= got == content[w];
      if (!whole) ++partial;
    }
  });
  for (auto& t : threads) t.join();
  done = true;
  reader.join();
  CHECK(failures.load() == 0);
  CHECK(partial.load() == 0);
  CHECK(reads.load() > 0);
  CHECK(dir.entries() == std::set<std::string>{"shared.ckpt"});  // no temporary file left

  // The same through the checkpoint API: the file loads, and has the mode a new file gets.
  auto a = materialized(nn::mlp({4, 3, 2}), 1);
  nn::save_checkpoint(*a, path);
  auto b = materialized(nn::mlp({4, 3, 2}), 2);
  nn::load_checkpoint(*b, path);
  CHECK(host(a->flat_params()) == host(b->flat_params()));
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) != 0600);  // not mkstemp's private mode
}

TEST_CASE("nn.checkpoint: saving onto a directory or into a missing one fails with the reason") {
  TempDir dir;
  auto m = materialized(nn::mlp({4, 3, 2}), 1);
  const std::string isdir = dir.file("isdir");
  REQUIRE(::mkdir(isdir.c_str(), 0700) == 0);
  std::string e = error_of([&] { nn::save_checkpoint(*m, isdir); });
  CHECK(contains(e, "save_checkpoint(" + isdir + "): is a directory"));
  e = error_of([&] { nn::save_checkpoint(*m, dir.file("nope/x.ckpt")); });
  CHECK(contains(e, "cannot create a temporary file in " + dir.file("nope")));
  CHECK(contains(e, "No such file or directory"));
  CHECK(dir.entries() == std::set<std::string>{"isdir"});  // no isdir.tmp or other leftovers
}

TEST_CASE("nn.checkpoint: errors name long files in full and escape a NUL instead of stopping") {
  TempDir dir;
  auto m = materialized(nn::mlp({4, 3, 2}), 1);
  const std::string tail(300, 'x');
  const std::string with_nul = dir.file("a") + std::string(1, '\0') + tail + ".ckpt";
  std::string e = error_of([&] { nn::load_checkpoint(*m, with_nul); });
  CHECK(contains(e, "has a NUL byte"));
  CHECK(contains(e, "/a\\x00" + tail + ".ckpt)"));  // the full name, after the NUL too
  e = error_of([&] { nn::save_checkpoint(*m, with_nul); });
  CHECK(contains(e, "/a\\x00" + tail + ".ckpt)"));
  CHECK(::access(dir.file("a").c_str(), F_OK) != 0);  // nothing written under the cut name

  // A tensor name in the file holding a NUL is printed in full.
  const std::string path = dir.file(std::string(200, 'n') + ".ckpt");
  nn::save_checkpoint(*m, path);
  std::string bytes = read_all(path);
  auto at = bytes.find("weight");  // the first tensor's name ends with it
  REQUIRE(at != std::string::npos);
  bytes[at + 1] = '\0';  // "...w\0ight"
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  e = error_of([&] { nn::load_checkpoint(*m, path); });
  CHECK(contains(e, "w\\x00ight' in the file but parameter '"));
  CHECK(contains(e, "weight' in "));
  CHECK(contains(e, path));
}

// Every writer that replaces a file whole (checkpoints, training state: write_file_atomically)
// replaces only a regular file: a FIFO, a socket or a device there is refused by name and left
// as it was (a character device is made only where the test may mknod, i.e. as root). A
// symbolic link is followed: its target gets the new bytes and the link stays a link. The
// folder is left with no temporary file.
TEST_CASE("nn.checkpoint: a save never replaces a FIFO, a socket or a device, and follows a link") {
  TempDir dir;
  auto m = materialized(nn::mlp({4, 3, 2}), 1);
  const std::string fifo = dir.file("fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::string e = error_of([&] { nn::save_checkpoint(*m, fifo); });
  CHECK(contains(e, "save_checkpoint(" + fifo + "): is a FIFO (named pipe), not a regular file"));
  CHECK(contains(e, "would replace the FIFO; give the name of a regular file"));
  struct stat st {};
  REQUIRE(::lstat(fifo.c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));
  // A link to the FIFO: refused the same way, the link and the FIFO kept.
  const std::string to_fifo = dir.file("to_fifo");
  REQUIRE(::symlink(fifo.c_str(), to_fifo.c_str()) == 0);
  e = error_of([&] { nn::save_checkpoint(*m, to_fifo); });
  CHECK(contains(e, "is a FIFO (named pipe), not a regular file"));
  REQUIRE(::lstat(to_fifo.c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
  if (::geteuid() == 0) {
    const std::string dev = dir.file("null");
    REQUIRE(::mknod(dev.c_str(), S_IFCHR | 0600, ::makedev(1, 3)) == 0);
    e = error_of([&] { nn::save_checkpoint(*m, dev); });
    CHECK(contains(e, "is a character device, not a regular file"));
    REQUIRE(::lstat(dev.c_str(), &st) == 0);
    CHECK(S_ISCHR(st.st_mode));
  } else {
    MESSAGE("the character-device case needs root (mknod): FIFO and link cases only");
  }
  // A link to a regular file in another folder: the target is replaced, the link kept.
  TempDir other;
  const std::string target = other.file("real.ckpt"), link = dir.file("link.ckpt");
  { std::ofstream(target) << "old"; }
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  nn::save_checkpoint(*m, link);
  REQUIRE(::lstat(link.c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
  nn::save_checkpoint(*m, dir.file("plain.ckpt"));
  CHECK(read_all(target) == read_all(dir.file("plain.ckpt")));
  std::set<std::string> want{"fifo", "to_fifo", "link.ckpt", "plain.ckpt"};
  if (::geteuid() == 0) want.insert("null");
  CHECK(dir.entries() == want);  // no temporary file left
  CHECK(other.entries() == std::set<std::string>{"real.ckpt"});
}
