# dp_engine: threaded DataParallel (one process, one worker thread per device).
add_library(dp_engine STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/worker_pool.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/data_parallel.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/parameter_server.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/trace.cpp)
target_link_libraries(dp_engine PUBLIC dp_kernels PRIVATE nlohmann_json::nlohmann_json)
target_compile_options(dp_engine PRIVATE -Wall -Wextra)
