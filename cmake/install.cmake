# `cmake --install build --prefix P` gives, under P:
#   include/dptrain/{kernels,nn,dp}/...          the public headers, at their source paths
#   lib/libdptrain_*.a                           kernels_cpu, distributed_cpu, dp, data (and
#                                                kernels_cuda, distributed_cuda with CUDA)
#   lib/cmake/dptrain/dptrainConfig.cmake        find_package(dptrain [COMPONENTS cuda])
#   lib/pkgconfig/dptrain.pc                     the CPU backend, for pkg-config
# Targets: dptrain::kernels, dptrain::nn (headers), dptrain::dp, dptrain::distributed,
# dptrain::data; with the programs built (the default), dptrain::cli (flags, progress line, step
# log) and dptrain::compare (DP against DDP on one's own model, benchmarks/compare.hpp). They use the CPU backend and link no CUDA library; with COMPONENTS cuda
# (when this build had it) dptrain::kernels and dptrain::distributed are the CUDA ones.
include(CMakePackageConfigHelpers)
set(DP_CONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/dptrain)

set(DP_INSTALL_TARGETS dp_kernels dp_kernels_cpu dp_nn dp_engine dp_data dp_distributed
                       dp_distributed_cpu)
if(DP_HAVE_CUDA)
  list(APPEND DP_INSTALL_TARGETS dp_kernels_cuda dp_distributed_cuda)
endif()
install(TARGETS ${DP_INSTALL_TARGETS} EXPORT dptrainTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dptrain)
install(EXPORT dptrainTargets NAMESPACE dptrain:: DESTINATION ${DP_CONFIG_DIR})

# The headers keep their paths (#include "nn/nn.hpp"); dp/cli/'s go with dptrain::cli, built
# with the programs (dp/cli/CMakeLists.txt), and benchmarks/compare.hpp's with dptrain::compare.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/kernels ${PROJECT_SOURCE_DIR}/nn ${PROJECT_SOURCE_DIR}/dp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dptrain
        FILES_MATCHING PATTERN "*.hpp")

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dptrainConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/dptrainConfig.cmake
                              INSTALL_DESTINATION ${DP_CONFIG_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dptrainConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dptrainConfig.cmake
              ${PROJECT_BINARY_DIR}/dptrainConfigVersion.cmake
        DESTINATION ${DP_CONFIG_DIR})

# pkg-config: the CPU backend, static libraries first, then what they need. The prefix is
# found from the .pc file's own place, so an install moved with --prefix stays right.
string(REGEX REPLACE "[^/]+" ".." DP_PC_UP "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
set(DP_PC_LIBS "-ldptrain_dp -ldptrain_distributed_cpu -ldptrain_data -ldptrain_kernels_cpu -lgloo")
foreach(lib ${OpenBLAS_LIBRARIES} ${MPI_CXX_LIBRARIES})
  string(APPEND DP_PC_LIBS " ${lib}")
endforeach()
if(DP_HAVE_ONEDNN)
  string(APPEND DP_PC_LIBS " -ldnnl")
endif()
string(APPEND DP_PC_LIBS " -ltbb -lz -lpthread")
configure_file(${PROJECT_SOURCE_DIR}/cmake/dptrain.pc.in ${PROJECT_BINARY_DIR}/dptrain.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/dptrain.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
