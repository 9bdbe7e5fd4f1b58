# kernels.*: every op of kernels/ops.hpp against plain-loop references (CPU backend).
dp_add_test(test_kernels SOURCES test_kernels.cpp test_kernels_loss.cpp test_kernels_conv.cpp
            test_kernels_norm.cpp test_kernels_pointwise.cpp test_kernels_tensor_ops.cpp)
# kernels.gemm calls OpenBLAS directly to check the pool it ends can start again.
target_include_directories(test_kernels PRIVATE ${OpenBLAS_INCLUDE_DIRS})
target_link_libraries(test_kernels PRIVATE ${OpenBLAS_LIBRARIES})
