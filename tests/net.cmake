# net: jobs across network namespaces (scripts/cluster.sh: one namespace per node, each with
# its own address on a rate-limited link through a bridge), driven by tests/net_test.sh. Each
# case skips visibly (exit 77, with the reason) when not root or without `ip netns`.
set(DP_NET_ENV "CLUSTER=${PROJECT_SOURCE_DIR}/scripts/cluster.sh")
set(DP_NET_CASES cluster_up_down)
if(TARGET dp_bench)
  list(APPEND DP_NET_CASES ddp_gloo hybrid restart partition stopped)
  list(APPEND DP_NET_ENV "DP_BENCH=$<TARGET_FILE:dp_bench>")
  list(APPEND DP_NET_CASES ddp_mpi)  # skips without MPI
  if(DP_HAVE_MPI)
    list(APPEND DP_NET_ENV "MPIRUN=${MPIEXEC_EXECUTABLE}")
  endif()
endif()
foreach(c ${DP_NET_CASES})
  add_test(NAME "net.${c}" COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/net_test.sh ${c})
  # partition cuts 4 runs and stopped stops 2, each named about 5 s after (here, under 3 busy
  # loops on 2 cores: partition 47 s, stopped 24 s).
  set(timeout 60)
  if(c STREQUAL "partition" OR c STREQUAL "stopped")
    set(timeout 120)
  endif()
  set_tests_properties("net.${c}" PROPERTIES TIMEOUT ${timeout} SKIP_RETURN_CODE 77
                       ENVIRONMENT "${DP_NET_ENV}")
endforeach()
