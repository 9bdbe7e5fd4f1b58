// Store base helpers, PrefixStore and FileStore. (TcpStore and StoreServer: tcp_store.cpp.)
#include "dp/distributed/store.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "dp/distributed/rendezvous.hpp"
#include "kernels/runtime/error.hpp"

namespace dp::dist {

std::string keys_text(const std::vector<std::string>& keys) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < keys.size(); ++i) os << (i ? ", " : "") << "'" << keys[i] << "'";
  os << "]";
  return os.str();
}

// ---- PrefixStore ----------------------------------------------------------------------------

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : Store(base ? base->timeout() : kDefaultTimeout),
      prefix_(std::move(prefix)),
      base_(std::move(base)) {
  DP_CHECK(base_ != nullptr, "PrefixStore '" << prefix_ << "' needs a base store");
}

std::vector<std::string> PrefixStore::join(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(join(k));
  return out;
}

void PrefixStore::set(const std::string& key, const std::vector<char>& value) {
  base_->set(join(key), value);
}

std::vector<char> PrefixStore::get(const std::string& key) {
  base_->wait({join(key)}, timeout());
  return base_->get(join(key));
}

void PrefixStore::wait(const std::vector<std::string>& keys, const Millis& timeout) {
  base_->wait(join(keys), timeout);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return base_->add(join(key), delta);
}
bool PrefixStore::check(const std::vector<std::string>& keys) {
  return base_->check(join(keys));
}
bool PrefixStore::remove(const std::string& key) {
  return base_->remove(join(key));
}
std::string PrefixStore::describe() const {
  return base_->describe() + " (prefix '" + prefix_ + "')";
}
std::shared_ptr<Store> PrefixStore::reconnect(Millis bound) const {
  std::shared_ptr<Store> base = base_->reconnect(bound);
  return base ? std::make_shared<PrefixStore>(prefix_, std::move(base)) : nullptr;
}

// ---- FileStore ------------------------------------------------------------------------------

namespace {

void make_directories(const std::string& dir) {
  std::string partial;
  std::istringstream parts(dir);
  std::string part;
  if (!dir.empty() && dir[0] == '/') partial = "/";
  while (std::getline(parts, part, '/')) {
    if (part.empty()) continue;
    partial += part + "/";
    if (::mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST)
      DP_THROW("FileStore: cannot create directory '" << partial << "': " << std::strerror(errno));
  }
  struct stat st {};
  DP_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
           "FileStore: '" << dir << "' is not a directory");
}

bool read_file(const std::string& path, std::vector<char>& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return true;
}

uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Releases an flock'ed file descriptor.
struct FileLock {
  int fd = -1;
  ~FileLock() {
    if (fd >= 0) {
      flock(fd, LOCK_UN);
      ::close(fd);
    }
  }
};

}  // namespace

FileStore::FileStore(std::string directory, Millis timeout)
    : Store(timeout), dir_(std::move(directory)) {
  DP_CHECK(!dir_.empty(), "FileStore needs a directory");
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  make_directories(dir_);
}

std::string FileStore::path_of(const std::string& key) const {
  // Keys become file names: safe characters stay, others are %-escaped; a long name is hashed.
  static const char* hex = "0123456789abcdef";
  std::string name = "k_";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.') {
      name += static_cast<char>(c);
    } else {
      name += '%';
      name += hex[c >> 4];
      name += hex[c & 15];
    }
  }
  if (name.size() > 200) {
    std::ostringstream os;
    os << "h_" << std::hex << fnv1a(key, 1469598103934665603ull) << "_"
       << fnv1a(key, 0x9e3779b97f4a7c15ull) << "_" << key.size();
    name = os.str();
  }
  return dir_ + "/" + name;
}

void FileStore::set(const std::string& key, const std::vector<char>& value) {
  static std::atomic<uint64_t> counter{0};
  std::ostringstream tmp;
  tmp << dir_ << "/.tmp_" << ::getpid() << "_"
      << std::hash<std::thread::id>()(std::this_thread::get_id()) << "_" << counter.fetch_add(1);
  {
    // Created here, exclusively: never through a link or into a file someone placed there.
    struct Closer {
      int fd = -1;
      ~Closer() {
        if (fd >= 0) ::close(fd);
      }
    } f;
    f.fd = ::open(tmp.str().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    DP_CHECK(f.fd >= 0, "FileStore set('" << key << "'): cannot create '" << tmp.str()
                                          << "': " << std::strerror(errno));
    size_t done = 0;
    while (done < value.size()) {
      const ssize_t w = ::write(f.fd, value.data() + done, value.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const int e = w < 0 ? errno : EIO;
        ::unlink(tmp.str().c_str());
        DP_THROW("FileStore set('" << key << "'): write to '" << tmp.str()
                                   << "' failed: " << std::strerror(e));
      }
      done += static_cast<size_t>(w);
    }
  }
  std::string path = path_of(key);
  if (::rename(tmp.str().c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.str().c_str());
    DP_THROW("FileStore set('" << key << "'): rename to '" << path
                               << "' failed: " << std::strerror(e));
  }
}

std::vector<char> FileStore::get(const std::string& key) {
  wait({key}, timeout());
  std::vector<char> out;
  DP_CHECK(read_file(path_of(key), out),
           "FileStore get('" << key << "'): the key vanished while reading it in " << describe());
  return out;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  for (const auto& k : keys)
    if (::access(path_of(k).c_str(), F_OK) != 0) return false;
  return true;
}

void FileStore::wait(const std::vector<std::string>& keys, const Millis& timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  auto backoff = std::chrono::milliseconds(1);
  while (!check(keys)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      std::vector<std::string> missing;
      for (const auto& k : keys)
        if (::access(path_of(k).c_str(), F_OK) != 0) missing.push_back(k);
      DP_THROW("store wait for " << keys_text(keys) << " timed out after " << timeout.count()
                                 << " ms; still missing " << keys_text(missing) << " in "
                                 << describe());
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
  }
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  FileLock lock;
  std::string lock_path = dir_ + "/.lock";
  lock.fd = ::open(lock_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600);
  DP_CHECK(lock.fd >= 0, "FileStore add('" << key << "'): cannot open '" << lock_path
                                           << "': " << std::strerror(errno));
  int rc;
  do {
    rc = flock(lock.fd, LOCK_EX);
  } while (rc != 0 && errno == EINTR);
  DP_CHECK(rc == 0, "FileStore add('" << key << "'): flock failed: " << std::strerror(errno));
  int64_t value = 0;
  std::vector<char> old;
  if (read_file(path_of(key), old) && !old.empty()) {
    std::string text(old.begin(), old.end());
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(text.c_str(), &end, 10);
    DP_CHECK(errno == 0 && end && *end == '\0',
             "FileStore add('" << key << "'): the value '" << text << "' is not an integer");
    value = v;
  }
  value += delta;
  std::string text = std::to_string(value);
  set(key, std::vector<char>(text.begin(), text.end()));
  return value;
}

bool FileStore::remove(const std::string& key) {
  return ::unlink(path_of(key).c_str()) == 0;
}

// ---- make_store (rendezvous.hpp) ------------------------------------------------------------

std::shared_ptr<Store> make_store(const RendezvousSpec& spec, std::chrono::milliseconds timeout) {
  if (spec.kind == RendezvousSpec::Kind::file)
    return std::make_shared<FileStore>(spec.path, timeout);
  StoreRole role = spec.rank == 0 ? StoreRole::server : StoreRole::client;
  const JobIdentity job{spec.job_token, spec.rank};
  if (role == StoreRole::server)
    return std::make_shared<TcpStore>(spec.host, spec.port, role, timeout, job);
  // A client tries in slices of 10 s (a third of the timeout when that is shorter), and says
  // after each that it is still waiting, so a rank 0 that is slow to come up is visible.
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  const auto start = Clock::now();
  const auto slice =
      std::max(milliseconds(1), std::min<milliseconds>(std::chrono::seconds(10), timeout / 3));
  auto next_progress = slice;
  while (true) {
    const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
    const auto attempt = std::max(milliseconds(1), std::min(next_progress, timeout) - waited);
    try {
      auto store = std::make_shared<TcpStore>(spec.host, spec.port, role, attempt, job);
      store->set_timeout(timeout);
      return store;
    } catch (const kernels::Error& e) {
      if (std::string(e.what()).find("no store server") == std::string::npos) throw;
      const auto now = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
      if (now >= timeout) {
        // The last slice's own bound ("within 1 ms") says nothing of the whole wait: keep only
        // what its connect answered.
        std::string last = e.what();
        const size_t cut = last.find(" ms: ");
        if (last.rfind("TcpStore: no store server reachable", 0) == 0 && cut != std::string::npos)
          last = last.substr(cut + 5);
        DP_THROW("rank 0 of " << spec.world_size << " never joined within " << seconds_text(timeout)
                              << ": no store server answered at " << spec.describe()
                              << " (rank 0 hosts it; set the timeout with "
                              << "--timeout or DP_TIMEOUT=seconds); the last try: " << last);
      }
      if (now >= next_progress) {
        std::fprintf(stderr,
                     "dp: rank %d: waiting for the store at %s:%d (rank 0 hosts it): %s of %s\n",
                     spec.rank, spec.host.c_str(), spec.port, seconds_text(now).c_str(),
                     seconds_text(timeout).c_str());
        next_progress += slice;
      }
    }
  }
}

}  // namespace dp::dist
