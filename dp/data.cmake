# dp_data (installed: dptrain::data): IDX reader, MNIST-format and synthetic data sets, and the
# prefetching loader.
add_library(dp_data STATIC
  data/idx.cpp data/dataset.cpp data/mnist.cpp data/synthetic.cpp data/loader.cpp
  data/text.cpp)
set_target_properties(dp_data PROPERTIES OUTPUT_NAME dptrain_data EXPORT_NAME data)
target_link_libraries(dp_data PUBLIC dp_kernels ZLIB::ZLIB TBB::tbb)
target_compile_options(dp_data PRIVATE -Wall -Wextra)
