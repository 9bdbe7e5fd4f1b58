# nn samples: small programs built on the public headers only.
add_executable(custom_layer ${CMAKE_CURRENT_LIST_DIR}/custom_layer.cpp)
target_link_libraries(custom_layer PRIVATE dp_kernels)
