// The attention kernel compiled for AVX-512 (F/BW/VL/DQ/VNNI); only called after a run-time
// CPU check (paged_attention.cpp). Everything shared is included before the target pragma so
// no inline function of another translation unit is ever emitted with AVX-512 code.
#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

namespace pagedfuse {
namespace avx512 {
#include "vec_avx512.h"
#include "attention_impl.h"
}  // namespace avx512

void run_item_avx512(const PagedArgs& a, const WorkItem& it, float* ws, const Partials& p) {
  avx512::run_item_any(a, it, ws, p);
}
}  // namespace pagedfuse
#endif
