# The project's layering rules, checked on every source's #include lines (ctest layout.layering):
#   kernels/   includes nothing from nn/, dp/, benchmarks/ or samples/ (the op set stands alone);
#   nn/        nothing from dp/, benchmarks/ or samples/ (models know no engine);
#   dp/data/   nothing from nn/ (data sets know no model; checked file reading is
#              kernels/runtime/file_io.hpp, beneath both);
#   dp/        nothing from benchmarks/ or samples/;
#   samples/   nothing from benchmarks/ but the installed comparison header, compare.hpp
#              (dptrain::compare, a product part): samples use the product's headers only.
# Usage: cmake -DSOURCE_DIR=<repo> -P scripts/check_layering.cmake
cmake_minimum_required(VERSION 3.24)
set(failures "")
function(check_dir dir)
  cmake_parse_arguments(C "" "" "FORBID;EXCEPT;ALLOW" ${ARGN})
  file(GLOB_RECURSE files "${SOURCE_DIR}/${dir}/*.cpp" "${SOURCE_DIR}/${dir}/*.hpp"
       "${SOURCE_DIR}/${dir}/*.cu" "${SOURCE_DIR}/${dir}/*.cuh")
  foreach(f ${files})
    file(RELATIVE_PATH rel ${SOURCE_DIR} ${f})
    if(rel IN_LIST C_EXCEPT)
      continue()
    endif()
    file(STRINGS ${f} lines REGEX "^#include \"")
    foreach(line ${lines})
      if(line MATCHES "^#include \"([^\"]+)\"" AND CMAKE_MATCH_1 IN_LIST C_ALLOW)
        continue()
      endif()
      foreach(forbidden ${C_FORBID})
        if(line MATCHES "^#include \"${forbidden}/")
          list(APPEND failures "${rel}: ${line} (${dir}/ may not include ${forbidden}/)")
        endif()
      endforeach()
    endforeach()
  endforeach()
  set(failures "${failures}" PARENT_SCOPE)
endfunction()

check_dir(kernels FORBID nn dp benchmarks samples)
check_dir(nn FORBID dp benchmarks samples)
check_dir(dp/data FORBID nn)
check_dir(dp FORBID benchmarks samples)
check_dir(samples FORBID benchmarks ALLOW benchmarks/compare.hpp)
if(failures)
  list(JOIN failures "\n  " text)
  message(FATAL_ERROR "layering rules broken:\n  ${text}")
endif()
message(STATUS "layering: every rule holds")
