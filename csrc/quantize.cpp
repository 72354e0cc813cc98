// Symmetric per-row int8 quantisation (the quantize_int8 op, and the int8 attention's query).
#include <omp.h>

#include "common.h"

namespace pagedfuse {

template <class T>
static float quantize_typed(const T* x, int64_t n, int8_t* dst) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(to_float(x[i]));
    amax = a > amax || std::isnan(a) ? a : amax;  // a NaN stays: max|x| of the row is NaN
  }
  const float scale = amax / 127.0f;
  const float div = scale > 0.0f ? scale : 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    // A true division (not a multiply by 1/scale) and ties-to-even, as the reference does.
    const float v = std::nearbyint(to_float(x[i]) / div);
    dst[i] = std::isnan(v) ? 0
                           : static_cast<int8_t>(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
  }
  return scale;
}

float quantize_row(const void* src, Dtype dt, int64_t n, int8_t* dst) {
  switch (dt) {
    case Dtype::f32: return quantize_typed(static_cast<const float*>(src), n, dst);
    case Dtype::bf16: return quantize_typed(static_cast<const bf16_t*>(src), n, dst);
    case Dtype::f16: return quantize_typed(static_cast<const f16_t*>(src), n, dst);
    case Dtype::i8: break;
  }
  return 0.0f;
}

void quantize_rows(const void* x, Dtype dt, int64_t rows, int64_t n, int8_t* q, float* scale,
                   int threads) {
  const int64_t elem = float_bytes(dt);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    scale[r] = quantize_row(static_cast<const char*>(x) + r * n * elem, dt, n, q + r * n);
  }
}

}  // namespace pagedfuse
