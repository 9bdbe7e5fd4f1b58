// doctest main shared by every suite.
// - A case that calls DP_REQUIRE_GPU() on a machine without a usable GPU prints why and counts
//   as skipped; a ctest entry whose cases were all skipped exits with 77, which ctest reports
//   as "Skipped" (SKIP_RETURN_CODE).
// - A ctest entry (--test-case=NAME) that selects no case at all fails instead of passing
//   silently (a name the filter cannot match, for instance).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>

#include "tests/test_util.hpp"

namespace dp_test {
int& skipped_cases() {
  static int n = 0;
  return n;
}

namespace {
int started_cases = 0;

// Paths to remove when the test program ends (the suites run their cases on one thread; the
// lock is for helpers called from rank threads).
class RemoveAtExit {
 public:
  ~RemoveAtExit() {
    for (const auto& p : paths_) {
      std::error_code ignored;  // never throws
      std::filesystem::remove_all(p, ignored);
    }
  }
  void add(const std::string& p) {
    std::lock_guard<std::mutex> lock(mu_);
    paths_.insert(p);
  }

 private:
  std::mutex mu_;
  std::set<std::string> paths_;
};
RemoveAtExit remove_at_exit_paths;
}  // namespace

void remove_at_exit(const std::string& path) {
  remove_at_exit_paths.add(path);
}

std::string temp_path(const std::string& suite, const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  std::string path = std::string(dir && *dir ? dir : "/tmp") + "/dp_test_" + suite + "_" +
                     std::to_string(::getpid()) + "_" + name;
  remove_at_exit(path);
  return path;
}

namespace {

struct CountCases : doctest::IReporter {
  explicit CountCases(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override { ++started_cases; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("count_cases", 1, CountCases);
}  // namespace
}  // namespace dp_test

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  int rc = context.run();
  if (context.shouldExit()) return rc;
  bool filtered = false;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]).rfind("--test-case=", 0) == 0) filtered = true;
  if (filtered && dp_test::started_cases == 0) {
    std::fprintf(stderr, "error: the --test-case filter selected no test case\n");
    return 1;
  }
  if (rc == 0 && filtered && dp_test::skipped_cases() > 0) return 77;
  return rc;
}
