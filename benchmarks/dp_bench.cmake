# dp_bench: the main command. Its report/projection code is a library so tests can check it;
# the runs behind it (dp_bench_lib) are a library so any program can compare DP and DDP on its
# own model (benchmarks/compare.hpp, samples/compare_my_model.cpp).
add_library(dp_bench_report STATIC ${CMAKE_CURRENT_SOURCE_DIR}/report.cpp
                                   ${CMAKE_CURRENT_SOURCE_DIR}/stats.cpp)
target_link_libraries(dp_bench_report PUBLIC dp_kernels nlohmann_json::nlohmann_json)
set_target_properties(dp_bench_report PROPERTIES OUTPUT_NAME dptrain_compare_report
                      EXPORT_NAME compare_report)

if(TARGET dp_distributed AND TARGET dp_data)
  add_library(dp_bench_lib STATIC
    ${CMAKE_CURRENT_SOURCE_DIR}/compare.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/bench_common.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/ddp_run.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/hybrid_run.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/gpt_workload.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/ps_run.cpp)
  target_link_libraries(dp_bench_lib PUBLIC dp_bench_report dp_engine dp_distributed dp_data
                                             dp_cli)
  # Installed as dptrain::compare (with dptrain::compare_report and dptrain::cli): compare DP
  # and DDP on one's own model from an installed dptrain (benchmarks/compare.hpp).
  set_target_properties(dp_bench_lib PROPERTIES OUTPUT_NAME dptrain_compare EXPORT_NAME compare)
  install(TARGETS dp_bench_report dp_bench_lib EXPORT dptrainTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dptrain)
  install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/compare.hpp ${CMAKE_CURRENT_SOURCE_DIR}/bench_common.hpp
                ${CMAKE_CURRENT_SOURCE_DIR}/report.hpp ${CMAKE_CURRENT_SOURCE_DIR}/stats.hpp
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dptrain/benchmarks)
  add_executable(dp_bench ${CMAKE_CURRENT_SOURCE_DIR}/dp_bench.cpp)
  target_link_libraries(dp_bench PRIVATE dp_bench_lib)
endif()

if(TARGET dp_distributed)
  add_executable(bench_collectives ${CMAKE_CURRENT_SOURCE_DIR}/bench_collectives.cpp)
  target_link_libraries(bench_collectives PRIVATE dp_bench_report dp_engine dp_distributed dp_cli)
endif()
