// Checked file I/O: reads bounded by the file's real size, and durable atomic writes. Beneath
// every layer that reads or writes files (the data sets, the checkpoint formats, the programs'
// outputs), so that none of them includes another's headers for it.
//
//   kernels::io::FileReader r(path, "load_checkpoint");   // refuses a missing or non-regular file
//   auto magic = r.bytes(8, "the magic");                 // throws "truncated" past the end
//   kernels::io::write_file_atomically(path, bytes, "save_checkpoint");
//
// Every error is a kernels::Error "<context>(<path>): <reason>", the path printed in full with
// control bytes escaped (a NUL in a name never cuts the message short).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "kernels/runtime/error.hpp"

namespace kernels::io {

// s with bytes below 0x20, 0x7f and above (non-ASCII) escaped as \xNN, and '\' as "\\": safe to
// print in full and to pass through C strings.
inline std::string printable(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c >= 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

// "load_checkpoint(/path/x.ckpt)": how errors name the call and the file.
inline std::string where(const std::string& context, const std::string& path) {
  return context + "(" + printable(path) + ")";
}

// strerror(e) as a std::string.
inline std::string errno_text(int e) {
  return std::strerror(e);
}

// requires nothing. ensures path names a file the OS can open: throws when it has a NUL byte
// (the OS would silently open the name cut at it) or is empty.
inline void check_path(const std::string& path, const std::string& context) {
  DP_CHECK(!path.empty(), context << "(): the file name is empty");
  auto nul = path.find('\0');
  DP_CHECK(nul == std::string::npos, where(context, path)
                                         << ": the file name has a NUL byte at "
                                         << "offset " << nul << "; no file can have that name");
}

// What a non-regular file is, for messages ("a directory").
inline const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// requires nothing. ensures returns when `path` is, after symbolic links, a regular file.
// Throws "<path>: no such file" only when it is missing: "<path>: cannot stat it: <reason>" when
// it cannot be looked at (a folder on the way not searchable, a link loop), and "<path>: is
// <kind>, not a regular file" for a directory, device, FIFO or socket.
inline void require_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    DP_CHECK(e != ENOENT, path << ": no such file");
    DP_THROW(path << ": cannot stat it: " << errno_text(e));
  }
  DP_CHECK(S_ISREG(st.st_mode), path << ": is " << file_kind(st.st_mode) << ", not a regular file");
}

// A regular file opened for reading, with its size fixed at open. Every read is checked
// against that size before anything is allocated or read.
class FileReader {
 public:
  // Throws naming the file when it is missing, unreadable or not a regular file (a directory,
  // /dev/zero, a FIFO: opened without blocking, then refused).
  FileReader(const std::string& path, std::string context)
      : path_(path), context_(std::move(context)) {
    check_path(path_, context_);
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    DP_CHECK(fd_ >= 0, where() << ": cannot open the file: " << errno_text(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      int e = errno;
      ::close(fd_);
      DP_THROW(where() << ": cannot stat the file: " << errno_text(e));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      DP_THROW(where() << ": is " << file_kind(st.st_mode) << ", not a regular file");
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~FileReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  uint64_t size() const { return size_; }
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  const std::string& path() const { return path_; }
  // "<context>(<path>)", for callers' messages.
  std::string where() const { return io::where(context_, path_); }

  // requires nothing. ensures n bytes at pos() are in dst and pos() advanced; throws
  // "truncated" naming `what` when fewer than n bytes remain (nothing is read then).
  void read(void* dst, uint64_t n, const char* what) {
    require(n, what);
    auto* out = static_cast<char*>(dst);
    uint64_t done = 0;
    while (done < n) {
      size_t chunk = static_cast<size_t>(std::min<uint64_t>(n - done, uint64_t{1} << 30));
      ssize_t r = ::pread(fd_, out + done, chunk, static_cast<off_t>(pos_ + done));
      if (r < 0 && errno == EINTR) continue;
      DP_CHECK(r >= 0, where() << ": reading " << what << " at offset " << pos_ + done
                               << " failed: " << errno_text(errno));
      DP_CHECK(r > 0, where() << ": the file shrank while reading " << what << " (offset "
                              << pos_ + done << ", size at open " << size_ << ")");
      done += static_cast<uint64_t>(r);
    }
    pos_ += n;
  }
  template <class T>
  T get(const char* what) {
    T v{};
    read(&v, sizeof v, what);
    return v;
  }
  // n bytes as a string; n is checked against the file before the string is allocated.
  std::string bytes(uint64_t n, const char* what) {
    require(n, what);
    std::string s(static_cast<size_t>(n), '\0');
    read(s.data(), n, what);
    return s;
  }
  // requires nothing. ensures pos() == offset; throws "truncated" when offset is past the end.
  void seek(uint64_t offset) {
    DP_CHECK(offset <= size_, where() << ": offset " << offset << " is past the end of the file ("
                                      << size_ << " bytes)");
    pos_ = offset;
  }
  // Throws "truncated" unless n more bytes exist.
  void require(uint64_t n, const char* what) const {
    DP_CHECK(n <= remaining(), where() << ": file truncated while reading " << what << ": " << n
                                       << " bytes needed at offset " << pos_ << ", the file has "
                                       << size_ << " bytes");
  }

 private:
  std::string path_;
  std::string context_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint64_t pos_ = 0;
};

namespace detail {

// The process's file-creation mask, read without changing it (umask(2) would, for every
// thread); 022 when /proc is not mounted.
inline mode_t current_umask() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("Umask:", 0) == 0)
      return static_cast<mode_t>(std::strtoul(line.c_str() + 6, nullptr, 8));
  return 022;
}

inline std::string parent_dir(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

inline std::string base_name(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Closes and unlinks the temporary file unless released.
struct TempFile {
  std::string name;
  int fd = -1;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!name.empty()) ::unlink(name.c_str());
  }
};

}  // namespace detail

// requires nothing. ensures the first `limit` bytes of the file at `path` (all of them when it
// is shorter), or "" when it cannot be opened: for telling a file's kind by its start.
inline std::string read_head(const std::string& path, size_t limit) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return "";
  std::string head(limit, '\0');
  head.resize(std::fread(head.data(), 1, limit, f));
  std::fclose(f);
  return head;
}

// requires nothing. ensures "" when `path` may be replaced by a new regular file (it does not
// exist, or it is a regular file, or a symbolic link to one), else why not: a directory, a
// device, a FIFO or a socket is not the program's to replace.
inline std::string replace_problem(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return "";
  if (S_ISDIR(st.st_mode)) return "is a directory; give the name of a file to write";
  return std::string("is ") + file_kind(st.st_mode) +
         ", not a regular file: this file is written whole to a new file that then replaces the "
         "old one, which would replace the " +
         (S_ISFIFO(st.st_mode)   ? "FIFO"
          : S_ISSOCK(st.st_mode) ? "socket"
                                 : "device") +
         "; give the name of a regular file";
}

// requires nothing. ensures `path` holds exactly `bytes`, durably: written to a unique
// temporary file in the same directory (mkstemp: created exclusively, never through a link),
// fsync'ed, renamed over `path`, and the directory fsync'ed. Concurrent writers of one path
// never collide, and a reader sees the old or a new file whole, never a partial one. The file
// gets mode 0666 & ~umask. A symbolic link is followed: its target is replaced and the link
// kept. Only a regular file (or none) is replaced: a directory, a device, a FIFO or a socket is
// refused (replace_problem). Throws naming the file and the reason (no temporary file is left
// behind).
inline void write_file_atomically(const std::string& given, const std::string& bytes,
                                  const std::string& context) {
  check_path(given, context);
  const std::string name = where(context, given);
  const std::string problem = replace_problem(given);
  DP_CHECK(problem.empty(), name << ": " << problem);
  std::string path = given;
  struct stat lst {};
  if (::lstat(given.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode)) {
    char* real = ::realpath(given.c_str(), nullptr);  // null: a dangling link, replaced itself
    if (real) {
      path = real;
      std::free(real);
    }
  }
  const std::string dir = detail::parent_dir(path);
  detail::TempFile tmp;
  tmp.name = dir + "/." + detail::base_name(path) + ".tmp.XXXXXX";
  tmp.fd = ::mkostemp(tmp.name.data(), O_CLOEXEC);
  if (tmp.fd < 0) {
    int e = errno;
    tmp.name.clear();  // nothing was created
    DP_THROW(name << ": cannot create a temporary file in " << printable(dir) << ": "
                  << errno_text(e));
  }
  DP_CHECK(::fchmod(tmp.fd, 0666 & ~detail::current_umask()) == 0,
           name << ": cannot set the mode of " << printable(tmp.name) << ": " << errno_text(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(tmp.fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    DP_CHECK(w > 0, name << ": writing " << printable(tmp.name) << " failed after " << done
                         << " of " << bytes.size() << " bytes: " << errno_text(errno));
    done += static_cast<size_t>(w);
  }
  DP_CHECK(::fsync(tmp.fd) == 0,
           name << ": fsync of " << printable(tmp.name) << " failed: " << errno_text(errno));
  int fd = tmp.fd;
  tmp.fd = -1;
  DP_CHECK(::close(fd) == 0,
           name << ": closing " << printable(tmp.name) << " failed: " << errno_text(errno));
  // What was checked above may have changed since (another process): look once more, as near the
  // rename as can be.
  const std::string late = replace_problem(path);
  DP_CHECK(late.empty(), name << ": " << late);
  DP_CHECK(::rename(tmp.name.c_str(), path.c_str()) == 0,
           name << ": cannot rename " << printable(tmp.name) << " to it: " << errno_text(errno));
  tmp.name.clear();  // renamed: nothing to remove
  // The rename is durable once the directory entry is on disk.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DP_CHECK(dfd >= 0, name << ": cannot open its directory " << printable(dir)
                          << " to fsync it: " << errno_text(errno));
  int rc = ::fsync(dfd);
  int e = errno;
  ::close(dfd);
  // Some file systems cannot fsync a directory (EINVAL); the rename happened all the same.
  DP_CHECK(rc == 0 || e == EINVAL || e == EROFS,
           name << ": fsync of the directory " << printable(dir) << " failed: " << errno_text(e));
}

// How long write_output_file waits for a FIFO's reader to open it.
constexpr int kFifoReaderWaitMs = 10000;

// requires `path` exists and is not a regular file or a directory (a FIFO, /dev/stdout, a
// character device). ensures a descriptor open for blocking writes to it, in place; a FIFO with
// no reader is waited for at most kFifoReaderWaitMs, then an error naming `name`, never a hang.
inline int open_in_place(const std::string& path, const std::string& name) {
  // O_NONBLOCK: a FIFO without a reader fails (ENXIO) instead of blocking; wait for one, bounded.
  int fd = -1, e = 0;
  for (int waited = 0;; waited += 10) {
    fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    e = errno;
    if (fd >= 0 || e != ENXIO || waited >= kFifoReaderWaitMs) break;
    ::usleep(10000);
  }
  DP_CHECK(fd >= 0, name << ": cannot open it for writing: " << errno_text(e)
                         << (e == ENXIO ? " (no process opened the FIFO for reading within " +
                                              std::to_string(kFifoReaderWaitMs / 1000) + " s)"
                                        : std::string()));
  const int flags = ::fcntl(fd, F_GETFL);  // blocking writes from here: a full pipe waits
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

// requires nothing. ensures a descriptor for an output written as it goes (a step log): a
// regular or new file truncated and written in place, anything else opened as open_in_place
// does. Throws naming `context` and the file.
inline int open_output_stream(const std::string& path, const std::string& context) {
  check_path(path, context);
  const std::string name = where(context, path);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    DP_CHECK(!S_ISDIR(st.st_mode), name << ": is a directory; give the name of a file to write");
    return open_in_place(path, name);
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOCTTY, 0666);
  DP_CHECK(fd >= 0, name << ": cannot open it for writing: " << errno_text(errno));
  return fd;
}

// requires nothing. ensures `path` holds exactly `bytes`, or throws naming `context`, the file
// and the system's reason (a full disk, /dev/full, a closed pipe): every write, the flush to
// disk and the close are checked. A regular file (or a new one) is written atomically
// (write_file_atomically: a failure leaves the old file, or none, never a partial one; a
// symbolic link is followed and its target replaced); anything else that can be opened for
// writing (a FIFO, /dev/stdout, a character device) is written in place, never replaced. A FIFO
// nobody reads is an error after kFifoReaderWaitMs, not a hang.
inline void write_output_file(const std::string& path, const std::string& bytes,
                              const std::string& context) {
  check_path(path, context);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode))
    return write_file_atomically(path, bytes, context);
  const std::string name = where(context, path);
  const int fd = open_output_stream(path, context);  // in place: not a regular file
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int e = w < 0 ? errno : EIO;
      ::close(fd);
      DP_THROW(name << ": writing failed after " << done << " of " << bytes.size()
                    << " bytes: " << errno_text(e));
    }
    done += static_cast<size_t>(w);
  }
  // A pipe or a terminal cannot be fsync'ed (EINVAL); what was written has been accepted.
  if (::fsync(fd) != 0 && errno != EINVAL && errno != EROFS) {
    int e = errno;
    ::close(fd);
    DP_THROW(name << ": flushing failed: " << errno_text(e));
  }
  DP_CHECK(::close(fd) == 0, name << ": closing failed: " << errno_text(errno));
}

}  // namespace kernels::io
