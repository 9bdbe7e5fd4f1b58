// ProcessGroup over MPI (Open MPI from Debian), for ranks started by a real `mpirun`.
//
//   mpirun -np 4 build/bin/dp_bench --mode ddp --backend mpi --device cpu
//
// MPI_Init is the rendezvous: no store is needed, and rank and size come from MPI itself.
// Every op is a non-blocking MPI call (MPI_Iallreduce, MPI_Ibcast, ...), issued in issue order
// by one progress thread per group, which also drives it to completion (Open MPI makes no
// progress on its own), so a bucket launched from backward moves while backward goes on.
// Each op has the group's timeout: a late op fails with kernels::Error naming it, the rank and
// the timeout, and the group is broken. A broken group, or one destroyed while an exception
// unwinds the stack, ends the whole job with MPI_Abort when it is destroyed: a rank that failed
// must not leave its peers waiting inside a collective.
//
// CUDA tensors are staged through pinned host memory: Debian's Open MPI is not CUDA-aware.
// f16 and bf16 reduce through user-defined MPI ops (in f32, rounded back).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "dp/distributed/env.hpp"
#include "dp/distributed/process_group.hpp"

namespace dp::dist {

// True when this build has the MPI backend.
bool mpi_available();
// True when this process was started by mpirun (OMPI_COMM_WORLD_SIZE or PMIX_RANK is set).
bool started_by_mpirun(const EnvLookup& env = {});

// Initialises MPI once per process (MPI_THREAD_MULTIPLE; MPI_Finalize runs at exit) and makes
// a group over a duplicate of MPI_COMM_WORLD. `device` is where this rank's tensors live.
// Throws kernels::Error when the build has no MPI, the process was not started by mpirun, or
// the MPI library cannot give MPI_THREAD_MULTIPLE.
// For a program about to launch its own ranks: throws, with the mpirun line to use instead
// (`mpirun -np <nproc> <program> ...`), when `backend` is "mpi" (MPI ranks are started by
// mpirun, never by our launcher). `nproc`: the ranks the program was asked for.
void check_launchable(const std::string& backend, const std::string& program, int nproc = 4);

std::unique_ptr<ProcessGroup> make_mpi_process_group(const kernels::Device& device,
                                                     std::chrono::milliseconds timeout);

}  // namespace dp::dist
