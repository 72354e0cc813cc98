// Portable vector primitives: plain loops the compiler vectorises for the baseline ISA.
// Included inside namespace pagedfuse::portable (see attention_portable.cpp).

template <class T>
inline float dot(const float* q, const T* k, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += q[d] * to_float(k[d]);
  return s;
}

inline int32_t dot_i8(const int8_t* q, const int8_t* k, int64_t n) {
  int32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += int32_t(q[d]) * int32_t(k[d]);
  return s;
}

// s[r][j] = q_r . k[j] for `rows` query rows (row stride n_dim) and the n keys of a tile
// (s is [rows, kTile]).
template <class KT>
inline void dots_rows(const float* q, int64_t rows, const KT* const* k, int64_t n,
                      int64_t n_dim, float* s) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) s[r * kTile + j] = dot(q + r * n_dim, k[j], n_dim);
  }
}

inline void dots_rows_i8(const int8_t* q, const int32_t* /*q_sum*/, int64_t rows,
                         const int8_t* const* k, int64_t n, int64_t n_dim, float* s) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      s[r * kTile + j] = static_cast<float>(dot_i8(q + r * n_dim, k[j], n_dim));
    }
  }
}

// acc[r] += sum_j p[r][j] * v[j] over the rows of a tile (p is [rows, kTile]). A weight of 0
// is multiplied too: 0 times a NaN or Inf in V is NaN, as in SDPA.
template <class VT>
inline void pv_tile(float* acc, int64_t rows, int64_t n_dim, const float* p,
                    const VT* const* v, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      const float w = p[r * kTile + j];
      float* acc_r = acc + r * n_dim;
#pragma omp simd
      for (int64_t d = 0; d < n_dim; ++d) acc_r[d] += w * to_float(v[j][d]);
    }
  }
}

inline void scale_row(float* acc, float a, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] *= a;
}

// s[j] = exp(s[j] - m) for j < n; returns the sum.
inline float exp_sub_sum(float* s, int64_t n, float m) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// s[j] = cap * tanh(s[j] / cap) for j < n: +-inf become +-cap, a NaN stays NaN.
inline void softcap_row(float* s, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] * inv);
}
