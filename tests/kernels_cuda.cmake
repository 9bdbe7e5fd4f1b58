# kernels.cuda.*: the CUDA backend against the CPU backend (each case skips without a GPU).
dp_add_test(test_kernels_cuda SOURCES test_kernels_cuda.cpp test_kernels_cuda_pointwise.cpp
            test_kernels_cuda_tensor_ops.cpp)
# A build without the CUDA backend (-DDP_CUDA=OFF) compiles this file with DP_HAVE_CUDA=0. This
# build compiles it that way too (objects only, never linked or run), so that path cannot rot
# unseen while CI builds with CUDA.
if(TARGET dp_kernels_cuda)
  add_library(test_kernels_cuda_cpu_only OBJECT test_kernels_cuda.cpp)
  target_link_libraries(test_kernels_cuda_cpu_only PRIVATE doctest::doctest dp_kernels_cpu)
  target_include_directories(test_kernels_cuda_cpu_only PRIVATE ${PROJECT_SOURCE_DIR})
endif()
