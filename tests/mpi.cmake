# mpi: the MPI process group under a real mpirun (loopback only): every collective on 2, 3 and
# 4 ranks against closed forms (tests/mpi_worker.cpp), and, from tests/test_mpi.cpp, a failing
# and a hung rank ending the job, and dp_bench's DDP over MPI against DP and DDP over Gloo.
# Skipped visibly when the build has no MPI.
if(DP_HAVE_MPI)
  add_executable(mpi_worker mpi_worker.cpp)
  target_link_libraries(mpi_worker PRIVATE dp_distributed CLI11::CLI11)
  # As root mpirun needs --allow-run-as-root; on 2 cores 4 ranks need --oversubscribe. The
  # shared-memory transport's single-copy mode needs ptrace rights containers often lack.
  set(DP_MPIRUN ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe --bind-to none
      --mca btl self,vader,tcp --mca btl_vader_single_copy_mechanism none
      --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
  foreach(n 2 3 4)
    add_test(NAME "dist.mpi: collectives on ${n} ranks"
             COMMAND ${DP_MPIRUN} -np ${n} $<TARGET_FILE:mpi_worker>)
    set_tests_properties("dist.mpi: collectives on ${n} ranks" PROPERTIES TIMEOUT 120)
  endforeach()
  string(REPLACE ";" " " DP_MPIRUN_TEXT "${DP_MPIRUN}")
  dp_add_test(test_mpi SOURCES test_mpi.cpp LIBS dp_distributed)
  target_compile_definitions(test_mpi PRIVATE DP_MPIRUN="${DP_MPIRUN_TEXT}"
                             DP_MPI_WORKER_PATH="$<TARGET_FILE:mpi_worker>"
                             DP_DIST_WORKER_PATH="$<TARGET_FILE:dist_worker>"
                             $<$<TARGET_EXISTS:dp_bench>:DP_BENCH_PATH="$<TARGET_FILE:dp_bench>">)
  add_dependencies(test_mpi mpi_worker dist_worker)
  if(TARGET dp_bench)
    add_dependencies(test_mpi dp_bench)
  endif()
else()
  add_test(NAME "dist.mpi: skipped, this build has no MPI (install libopenmpi-dev)"
           COMMAND ${CMAKE_COMMAND} -E echo "no MPI: install libopenmpi-dev and openmpi-bin")
  set_tests_properties("dist.mpi: skipped, this build has no MPI (install libopenmpi-dev)"
                       PROPERTIES SKIP_REGULAR_EXPRESSION "no MPI")
endif()
