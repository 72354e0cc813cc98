// The attention kernel for any CPU: plain loops, vectorised for the baseline ISA.
#include "common.h"

namespace pagedfuse {
namespace portable {
#include "vec_portable.h"
#include "attention_impl.h"
}  // namespace portable

void run_item_portable(const PagedArgs& a, const WorkItem& it, float* ws, const Partials& p) {
  portable::run_item_any(a, it, ws, p);
}
}  // namespace pagedfuse
