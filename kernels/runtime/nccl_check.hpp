// Checked-call macro for NCCL. Include only from code built with the CUDA backend.
#pragma once

#include <nccl.h>

#include "kernels/runtime/error.hpp"

#define DP_NCCL_CHECK(call)                                              \
  do {                                                                   \
    ncclResult_t dp_r_ = (call);                                         \
    if (dp_r_ != ncclSuccess)                                            \
      ::kernels::detail::throw_error(                                    \
          __FILE__, __LINE__, nullptr,                                   \
          std::string(#call) + " failed: " + ncclGetErrorString(dp_r_)); \
  } while (0)
