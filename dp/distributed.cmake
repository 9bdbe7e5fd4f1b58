# dp_distributed: rendezvous stores, process groups (Gloo always, MPI when found, NCCL with the
# CUDA backend) and the worker launcher. As for the kernels, two libraries differ only in the
# backend: dp_distributed_cpu (no NCCL, no CUDA) and, with the CUDA backend, dp_distributed_cuda.
# Only nccl_process_group.cpp and cuda_util.cpp branch on it; the rest is compiled once.
# dp_distributed is the name other targets link (installed: dptrain::distributed).
file(GLOB DP_DISTRIBUTED_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/distributed/*.cpp)
set(DP_DISTRIBUTED_BACKEND_SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/distributed/nccl_process_group.cpp
                                   ${CMAKE_CURRENT_SOURCE_DIR}/distributed/cuda_util.cpp)
list(REMOVE_ITEM DP_DISTRIBUTED_SOURCES ${DP_DISTRIBUTED_BACKEND_SOURCES})

add_library(dp_distributed_common OBJECT ${DP_DISTRIBUTED_SOURCES})
target_include_directories(dp_distributed_common PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(dp_distributed_common PRIVATE TBB::tbb gloo Threads::Threads)
target_compile_options(dp_distributed_common PRIVATE -Wall -Wextra)
if(DP_HAVE_MPI)
  target_compile_definitions(dp_distributed_common PRIVATE DP_HAVE_MPI=1)
  target_link_libraries(dp_distributed_common PRIVATE MPI::MPI_CXX)
else()
  target_compile_definitions(dp_distributed_common PRIVATE DP_HAVE_MPI=0)
endif()

# dp_distributed_library(<name> <export name> <kernels library> <0|1>)
function(dp_distributed_library name export_name kernels have_cuda)
  add_library(${name} STATIC $<TARGET_OBJECTS:dp_distributed_common>
                             ${DP_DISTRIBUTED_BACKEND_SOURCES})
  set_target_properties(${name} PROPERTIES OUTPUT_NAME dptrain_${export_name}
                        EXPORT_NAME ${export_name})
  target_link_libraries(${name} PUBLIC ${kernels} gloo Threads::Threads)
  if(DP_HAVE_MPI)
    target_link_libraries(${name} PUBLIC MPI::MPI_CXX)
  endif()
  target_compile_definitions(${name} PRIVATE DP_HAVE_NCCL=${have_cuda})
  target_compile_options(${name} PRIVATE -Wall -Wextra)
endfunction()

dp_distributed_library(dp_distributed_cpu distributed_cpu dp_kernels_cpu 0)
set(DP_DISTRIBUTED_IMPL dp_distributed_cpu)
if(DP_HAVE_CUDA)
  dp_distributed_library(dp_distributed_cuda distributed_cuda dp_kernels_cuda 1)
  target_include_directories(dp_distributed_cuda PRIVATE ${NCCL_INCLUDE_DIR})
  # NCCL has no imported target: the installed config finds it again (component cuda).
  target_link_libraries(dp_distributed_cuda PUBLIC $<BUILD_INTERFACE:${NCCL_LIBRARY}>)
  set(DP_DISTRIBUTED_IMPL dp_distributed_cuda)
endif()

add_library(dp_distributed INTERFACE)
set_target_properties(dp_distributed PROPERTIES EXPORT_NAME distributed)
target_link_libraries(dp_distributed INTERFACE $<BUILD_INTERFACE:${DP_DISTRIBUTED_IMPL}>
                      $<INSTALL_INTERFACE:dptrain::distributed_cpu>)
