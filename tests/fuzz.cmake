# fuzz: libFuzzer targets for the IDX reader, the checkpoint and training-state readers, the
# store's frame parser and the rendezvous URL/env parsing (tests/fuzz/). libFuzzer needs clang
# while the main build uses GCC, so a small clang sub-build (ExternalProject, CPU only, just those sources) makes them;
# ctest runs each for DP_FUZZ_SECONDS on seeds that make_seeds writes (fixture fuzz.seeds) and
# fails on a crash, a leak, a timeout or a broken contract. Without clang and libFuzzer
# (clang-14, libclang-rt-14-dev: scripts/setup.sh) the tests are reported as skipped.
option(DP_FUZZ "Build and run the libFuzzer targets when clang with libFuzzer is found" ON)
set(DP_FUZZ_SECONDS 20 CACHE STRING "Seconds each fuzz.* test fuzzes")
set(DP_FUZZ_TARGETS idx checkpoint train_state store_frame rendezvous)

set(dp_fuzz_skip "")
if(NOT DP_FUZZ)
  set(dp_fuzz_skip "DP_FUZZ is OFF")
else()
  find_program(DP_FUZZ_CXX NAMES clang++-14 clang++)
  if(NOT DP_FUZZ_CXX)
    set(dp_fuzz_skip "no clang++ found (apt install clang-14 libclang-rt-14-dev)")
  elseif(NOT DEFINED DP_FUZZ_WORKS OR NOT DP_FUZZ_WORKS_CXX STREQUAL DP_FUZZ_CXX)
    set(probe ${CMAKE_CURRENT_BINARY_DIR}/fuzz_probe)
    file(WRITE ${probe}.cpp "#include <cstddef>\n#include <cstdint>\nextern \"C\" int "
                            "LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
    execute_process(COMMAND ${DP_FUZZ_CXX} -fsanitize=fuzzer,address,undefined ${probe}.cpp
                            -o ${probe} RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
    if(rc EQUAL 0)
      set(DP_FUZZ_WORKS ON CACHE INTERNAL "")
    else()
      set(DP_FUZZ_WORKS OFF CACHE INTERNAL "")
    endif()
    set(DP_FUZZ_WORKS_CXX ${DP_FUZZ_CXX} CACHE INTERNAL "")
  endif()
  if(DP_FUZZ_CXX AND NOT DP_FUZZ_WORKS)
    set(dp_fuzz_skip "${DP_FUZZ_CXX} cannot link -fsanitize=fuzzer (apt install libclang-rt-14-dev)")
  endif()
endif()

if(dp_fuzz_skip)
  message(STATUS "dp: fuzz targets skipped: ${dp_fuzz_skip}")
  foreach(t ${DP_FUZZ_TARGETS})
    add_test(NAME fuzz.${t} COMMAND sh -c "echo 'SKIPPED: ${dp_fuzz_skip}'; exit 77")
    set_tests_properties(fuzz.${t} PROPERTIES SKIP_RETURN_CODE 77)
  endforeach()
  return()
endif()

message(STATUS "dp: fuzz targets ON (${DP_FUZZ_CXX}, ${DP_FUZZ_SECONDS} s each)")
include(ExternalProject)
set(dp_fuzz_bin ${CMAKE_BINARY_DIR}/fuzz)
set(dp_fuzz_work ${CMAKE_BINARY_DIR}/fuzz-work)
set(dp_fuzz_args -DCMAKE_CXX_COMPILER=${DP_FUZZ_CXX} -DCMAKE_BUILD_TYPE=RelWithDebInfo
                 -DDP_SOURCE_DIR=${PROJECT_SOURCE_DIR})
if(CMAKE_CXX_COMPILER_LAUNCHER)
  list(APPEND dp_fuzz_args -DCMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER})
endif()
ExternalProject_Add(dp_fuzz
  SOURCE_DIR ${PROJECT_SOURCE_DIR}/tests/fuzz
  BINARY_DIR ${dp_fuzz_bin}
  CMAKE_ARGS ${dp_fuzz_args}
  INSTALL_COMMAND ""
  BUILD_ALWAYS ON)

add_test(NAME fuzz.seeds COMMAND ${dp_fuzz_bin}/make_seeds ${dp_fuzz_work})
set_tests_properties(fuzz.seeds PROPERTIES FIXTURES_SETUP dp_fuzz_seeds TIMEOUT 60)
foreach(t ${DP_FUZZ_TARGETS})
  # -timeout: one input running longer is a hang; -rss_limit_mb: a bounded reader stays small.
  add_test(NAME fuzz.${t}
           COMMAND ${dp_fuzz_bin}/fuzz_${t} -max_total_time=${DP_FUZZ_SECONDS} -timeout=10
                   -rss_limit_mb=1024 -print_final_stats=1
                   -artifact_prefix=${dp_fuzz_work}/artifacts/${t}-
                   ${dp_fuzz_work}/corpus/${t} ${dp_fuzz_work}/seeds/${t})
  math(EXPR dp_fuzz_limit "${DP_FUZZ_SECONDS} + 120")
  set_tests_properties(fuzz.${t} PROPERTIES FIXTURES_REQUIRED dp_fuzz_seeds
                                            TIMEOUT ${dp_fuzz_limit})
endforeach()
