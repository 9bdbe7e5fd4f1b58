# pkg.consumer: `cmake --install` into a prefix under the build folder, then tests/consumer/ (a
# project of its own) built against it with find_package(dptrain) and run; see consumer/run.cmake.
# A sanitizer build installs instrumented libraries: the consumer links the same runtime.
set(dp_consumer_sanitize "")
if(DP_ASAN)
  set(dp_consumer_sanitize -fsanitize=address,undefined)
elseif(DP_TSAN)
  set(dp_consumer_sanitize -fsanitize=thread)
endif()
add_test(NAME pkg.consumer
         COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR} -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
                 -DCXX=${CMAKE_CXX_COMPILER} "-DLAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}"
                 "-DSANITIZE=${dp_consumer_sanitize}"
                 -P ${CMAKE_CURRENT_SOURCE_DIR}/consumer/run.cmake)
set_tests_properties(pkg.consumer PROPERTIES TIMEOUT 600 RUN_SERIAL ON)
