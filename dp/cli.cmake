# dp_cli: the checks every command line shares (readable validators, output paths, overflow and
# memory sanity), used by dp_bench, train_mnist, bench_collectives and the samples.
add_library(dp_cli STATIC ${CMAKE_CURRENT_SOURCE_DIR}/cli.cpp)
target_link_libraries(dp_cli PUBLIC dp_kernels CLI11::CLI11)
target_compile_options(dp_cli PRIVATE -Wall -Wextra)
