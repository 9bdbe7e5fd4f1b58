// The checked file I/O of kernels/runtime/file_io.hpp under the nn namespace, where the
// checkpoint formats and their users have always called it (nn::io::FileReader, ...).
#pragma once

#include "kernels/runtime/file_io.hpp"

namespace nn {
namespace io = kernels::io;
}  // namespace nn
