# bench_kernels: GEMM GFLOP/s and memory bandwidth of the op set on one device; on CPU it also
# calls OpenBLAS directly for reference (hence its own OpenBLAS include and link).
add_executable(bench_kernels ${CMAKE_CURRENT_SOURCE_DIR}/bench_kernels.cpp)
target_include_directories(bench_kernels PRIVATE ${OpenBLAS_INCLUDE_DIRS})
target_link_libraries(bench_kernels PRIVATE dp_bench_report dp_cli CLI11::CLI11
                      nlohmann_json::nlohmann_json ${OpenBLAS_LIBRARIES})

# bench_composed: a layer written with autograd (nn/composed.hpp) against the fused layers.
add_executable(bench_composed ${CMAKE_CURRENT_SOURCE_DIR}/bench_composed.cpp)
target_link_libraries(bench_composed PRIVATE dp_bench_report dp_cli CLI11::CLI11)
