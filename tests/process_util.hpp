// Helpers for tests that start programs and watch their processes: spawn with extra variables,
// wait with a deadline, find a process's children and name, tell when a process is gone.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace dp_test {

// Starts `argv` (argv[0] is the program) with this process's environment plus `env`
// ("NAME=value", replacing a variable of that name). Returns the pid, or -1.
inline pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env = {}) {
  std::vector<std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    std::string entry(*e);
    bool replaced = false;
    for (const auto& v : env)
      if (entry.rfind(v.substr(0, v.find('=') + 1), 0) == 0) replaced = true;
    if (!replaced) vars.push_back(entry);
  }
  vars.insert(vars.end(), env.begin(), env.end());
  std::vector<char*> args, envp;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (auto& v : vars) envp.push_back(const_cast<char*>(v.c_str()));
  envp.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0].c_str(), nullptr, nullptr, args.data(), envp.data()) != 0)
    return -1;
  return pid;
}

// Starts `argv` (argv[0] is the program) with exactly the environment `env` ("NAME=value"
// each), its stdout and stderr into the file `log` (created or truncated). Returns the pid, or
// -1.
inline pid_t spawn_logged(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                          const std::string& log) {
  std::vector<char*> args, envp;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  return rc == 0 ? pid : -1;
}

// Waits for a child up to `within`; returns its status, or -1 on timeout (then kills it).
inline int wait_child(pid_t pid, std::chrono::milliseconds within) {
  auto deadline = std::chrono::steady_clock::now() + within;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

// Ranks (or hybrid nodes) started by hand as torchrun starts them: RANK, WORLD_SIZE, LOCAL_RANK
// 0, LOCAL_WORLD_SIZE 1, MASTER_ADDR 127.0.0.1 and MASTER_PORT `port` (no job id), rank r running
// `program` with args[r], its output into log_prefix + r (read into outputs, then removed). Waits
// up to `within` for all of them (a rank still running then is killed: its code is -1).
struct HandRanks {
  std::vector<int> statuses;  // waitpid statuses, -1: killed at the deadline
  std::vector<std::string> outputs;
  double seconds = 0;  // until the last one ended
};
inline HandRanks run_hand_ranks(const std::string& program,
                                const std::vector<std::vector<std::string>>& args, int port,
                                const std::string& log_prefix, std::chrono::milliseconds within) {
  std::vector<std::string> base;
  for (char** e = environ; e && *e; ++e) {
    std::string entry(*e);
    bool ours = false;
    for (const char* name : {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=",
                             "MASTER_ADDR=", "MASTER_PORT=", "DP_JOB_ID=", "DP_JOB_TOKEN=",
                             "TORCHELASTIC_RUN_ID=", "SLURM_JOB_ID=", "OMPI_COMM_WORLD_RANK="})
      ours = ours || entry.rfind(name, 0) == 0;
    if (!ours) base.push_back(entry);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<pid_t> pids;
  for (size_t r = 0; r < args.size(); ++r) {
    std::vector<std::string> env = base;
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(args.size()));
    env.push_back("LOCAL_RANK=0");
    env.push_back("LOCAL_WORLD_SIZE=1");
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    std::vector<std::string> argv = {program};
    argv.insert(argv.end(), args[r].begin(), args[r].end());
    pids.push_back(spawn_logged(argv, env, log_prefix + std::to_string(r)));
  }
  HandRanks out;
  for (pid_t pid : pids) {
    const auto left = within - std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now() - t0);
    out.statuses.push_back(pid < 0 ? -1
                                   : wait_child(pid, std::max(left, std::chrono::milliseconds(1))));
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t r = 0; r < args.size(); ++r) {
    const std::string log = log_prefix + std::to_string(r);
    {
      std::ifstream f(log);
      out.outputs.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    std::remove(log.c_str());  // temp_path removes log_prefix at exit, not these
  }
  return out;
}

// The fields of /proc/<pid>/stat after the command: state, ppid, ... ("" when gone).
inline std::string stat_tail(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  auto close = text.rfind(')');
  return close == std::string::npos || close + 2 >= text.size() ? "" : text.substr(close + 2);
}

// Gone: no such process, or a zombie whose parent died (waiting for init to reap it).
inline bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::string tail = stat_tail(pid);
  return !tail.empty() && tail[0] == 'Z';
}

inline bool all_gone_within(const std::vector<pid_t>& pids, std::chrono::milliseconds within) {
  auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    bool all = true;
    for (pid_t p : pids) all = all && process_gone(p);
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// The live children of `parent` (a scan of /proc).
inline std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  DIR* proc = ::opendir("/proc");
  if (!proc) return out;
  while (dirent* e = ::readdir(proc)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (!end || *end != '\0' || pid <= 0) continue;
    std::string tail = stat_tail(static_cast<pid_t>(pid));
    long ppid = 0;
    char state = 0;
    if (tail.empty() || std::sscanf(tail.c_str(), "%c %ld", &state, &ppid) != 2) continue;
    if (ppid == parent && state != 'Z') out.push_back(static_cast<pid_t>(pid));
  }
  ::closedir(proc);
  return out;
}

// Whether `pid` has `entry` ("NAME=" or "NAME=value") in its environment: after a fork, tells
// the child that has exec'd with its own variables from one that has not yet.
inline bool has_env(pid_t pid, const std::string& entry) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/environ");
  std::string var;
  while (std::getline(f, var, '\0'))
    if (var.rfind(entry, 0) == 0) return true;
  return false;
}

// Waits up to `within` for `parent` to have `n` children whose environment holds `entry`.
inline std::vector<pid_t> wait_for_workers(pid_t parent, size_t n, const std::string& entry,
                                           std::chrono::milliseconds within) {
  auto deadline = std::chrono::steady_clock::now() + within;
  std::vector<pid_t> ready;
  while (std::chrono::steady_clock::now() < deadline) {
    ready.clear();
    for (pid_t p : children_of(parent))
      if (has_env(p, entry)) ready.push_back(p);
    if (ready.size() >= n) return ready;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ready;
}

// The name `ps` shows for a process (/proc/<pid>/comm), "" when gone.
inline std::string process_name(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/comm");
  std::string name;
  std::getline(f, name);
  return name;
}

// The exit code as a shell reports it: the status, or 128 + the signal that killed it.
inline int shell_code(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace dp_test
