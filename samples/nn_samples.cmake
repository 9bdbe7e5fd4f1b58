# nn samples: small programs built on the public headers only.
add_executable(custom_layer ${CMAKE_CURRENT_LIST_DIR}/custom_layer.cpp)
target_link_libraries(custom_layer PRIVATE dp_kernels)

# compare_my_model: DP against DDP on a user-defined model, through dp_bench's library.
if(TARGET dp_bench_lib)
  add_executable(compare_my_model ${CMAKE_CURRENT_LIST_DIR}/compare_my_model.cpp)
  target_link_libraries(compare_my_model PRIVATE dp_bench_lib)
endif()
