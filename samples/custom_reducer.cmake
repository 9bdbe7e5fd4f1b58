# custom_reducer: a communication hook (PowerSGD, samples/low_rank_hook.hpp) trained beside DDP's
# built-in bucket all-reduce, across worker processes it launches itself, and then beside DP's
# sums to device 0 in its own process.
if(TARGET dp_distributed AND TARGET dp_data)
  add_executable(custom_reducer ${CMAKE_CURRENT_SOURCE_DIR}/custom_reducer.cpp)
  target_link_libraries(custom_reducer PRIVATE dp_distributed dp_data dp_engine dp_cli)
endif()
