#include "dp/distributed/comm_hook.hpp"

#include "kernels/runtime/error.hpp"

namespace dp::dist {

std::shared_ptr<Work> run_hook(CommHook& hook, GradBucket& b, const char* who) {
  const kernels::Tensor given = b.grad;
  std::shared_ptr<Work> work;
  try {
    work = hook.reduce(b);
  } catch (const std::exception& e) {
    // Research code's error, named where it came from (the peers' errors quote this line).
    DP_THROW(who << ": comm hook '" << hook.name() << "' (bucket " << b.index
                 << ") threw: " << e.what());
  }
  DP_CHECK(b.grad.storage() == given.storage() && b.grad.offset_bytes() == given.offset_bytes() &&
               b.grad.shape() == given.shape() && b.grad.dtype() == given.dtype(),
           who << ": comm hook '" << hook.name() << "' replaced bucket " << b.index
               << "'s tensor: write the result into b.grad, do not reassign it");
  return work;
}

void CommHook::reduce_queued(GradBucket& b) {
  DP_THROW("comm hook '" << name() << "' (bucket " << b.index
                         << ") is not capturable: a graph cannot hold its host code (call reduce "
                            "between the captured segments)");
}

}  // namespace dp::dist
