# dp_dist: rendezvous stores, process groups (Gloo always, NCCL with the CUDA backend) and the
# worker launcher. The NCCL code is compiled only when DP_HAVE_CUDA (DP_HAVE_NCCL=1); the
# headers stay plain C++ either way.
file(GLOB DP_DIST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/dist/*.cpp)
add_library(dp_dist STATIC ${DP_DIST_SOURCES})
target_include_directories(dp_dist PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(dp_dist PUBLIC dp_kernels gloo Threads::Threads)
target_compile_options(dp_dist PRIVATE -Wall -Wextra)
if(DP_HAVE_CUDA)
  target_compile_definitions(dp_dist PRIVATE DP_HAVE_NCCL=1)
  target_include_directories(dp_dist PRIVATE ${NCCL_INCLUDE_DIR})
  target_link_libraries(dp_dist PUBLIC ${NCCL_LIBRARY})
else()
  target_compile_definitions(dp_dist PRIVATE DP_HAVE_NCCL=0)
endif()
