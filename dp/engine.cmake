# dp_engine (installed: dptrain::dp): threaded DataParallel (one process, one worker thread per
# device) and the asynchronous parameter server.
add_library(dp_engine STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/worker_pool.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/data_parallel.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/data_parallel_stages.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/data_parallel_metrics.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/data_parallel_reduce.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/data_parallel_workers.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/device_pulls.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/parameter_server.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/trace.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/engine_state.cpp)
set_target_properties(dp_engine PROPERTIES OUTPUT_NAME dptrain_dp EXPORT_NAME dp)
target_link_libraries(dp_engine PUBLIC dp_nn dp_kernels)
target_compile_options(dp_engine PRIVATE -Wall -Wextra)
