// doctest main shared by every suite. A case that calls DP_REQUIRE_GPU() on a machine without
// a usable GPU prints why and counts as skipped; a ctest entry whose cases were all skipped
// exits with 77, which ctest reports as "Skipped" (SKIP_RETURN_CODE).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "tests/test_util.hpp"

namespace dp_test {
int& skipped_cases() {
  static int n = 0;
  return n;
}
}  // namespace dp_test

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  int rc = context.run();
  if (context.shouldExit()) return rc;
  if (rc == 0 && dp_test::skipped_cases() > 0) {
    for (int i = 1; i < argc; ++i)
      if (std::string(argv[i]).rfind("--test-case=", 0) == 0) return 77;
  }
  return rc;
}
