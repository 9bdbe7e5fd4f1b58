# kernels.cuda.*: the CUDA backend against the CPU backend (each case skips without a GPU).
dp_add_test(test_kernels_cuda SOURCES test_kernels_cuda.cpp test_kernels_cuda_pointwise.cpp)
