// ProcessGroup over NCCL (one GPU per rank). Plain C++ header: the NCCL code is compiled only
// in CUDA builds (DP_HAVE_NCCL in nccl_process_group.cpp).
//
// Ops are queued on a dedicated communication stream that first waits (cudaEvent) for the
// calling thread's stream, so the caller keeps computing while NCCL runs. Work::wait() polls
// the op's completion event and NCCL's asynchronous error until the deadline (then aborts the
// communicator and throws), and orders the calling thread's stream after the op.
#pragma once

#include <string>

#include <chrono>
#include <memory>

#include "dp/distributed/process_group.hpp"

namespace dp::dist {

class Store;

// True when this build has NCCL.
bool nccl_available();
// The NCCL library's version as it reports it at run time ("2.28.9"); "" without NCCL.
std::string nccl_version();

// requires device is a CUDA device no other rank of the group uses. Rank 0 makes the NCCL
// unique id and shares it through `store`; blocks until every rank joined or the timeout.
// Throws kernels::Error when this build has no NCCL.
std::unique_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store> store, int rank,
                                                      int size, const kernels::Device& device,
                                                      std::chrono::milliseconds timeout);

}  // namespace dp::dist
