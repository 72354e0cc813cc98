// AVX-512 (F, BW, VL, VNNI) vector primitives. Included inside namespace pagedfuse::avx512,
// after `#pragma GCC target` (see attention_avx512.cpp). head_dim is a multiple of 16.

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

template <class T>
inline float dot(const float* q, const T* k, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    a0 = _mm512_fmadd_ps(load16(q + d), load16(k + d), a0);
    a1 = _mm512_fmadd_ps(load16(q + d + 16), load16(k + d + 16), a1);
  }
  if (d < n) a0 = _mm512_fmadd_ps(load16(q + d), load16(k + d), a0);
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// One integer dot product, with the unsigned-K trick of dots_block_i8 below.
inline int32_t dot_i8(const int8_t* q, const int8_t* k, int64_t n, int32_t q_sum) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc = _mm512_setzero_si512();
  for (int64_t d = 0; d < n; d += 64) {
    const __mmask64 m = n - d >= 64 ? ~0ULL : (1ULL << (n - d)) - 1;
    const __m512i ku = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, k + d), flip);
    acc = _mm512_dpbusd_epi32(acc, ku, _mm512_maskz_loadu_epi8(m, q + d));
  }
  return _mm512_reduce_add_epi32(acc) - 128 * q_sum;
}

// The horizontal sums of four vectors, in order, with one shuffle tree.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of R query rows (row stride n_dim) against keys j..j+3: each K chunk is loaded (and
// converted) once for all R rows, and each row's four sums are reduced together.
template <int R, class KT>
inline void dots_block(const float* q, const KT* const* k, int64_t j, int64_t n_dim, float* s) {
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < n_dim; d += 16) {
    __m512 kc[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) kc[c] = load16(k[j + c] + d);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_loadu_ps(q + r * n_dim + d);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(x, kc[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm_storeu_ps(s + r * kTile + j, hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
}

// vpdpbusd multiplies unsigned by signed bytes, so K is shifted to unsigned (k + 128, an xor
// of the sign bit) and the surplus 128 * sum(q) is subtracted after the reduction. Sums are
// exact in float: every partial sum stays below 2^24 for head_dim <= 256.
template <int R>
inline void dots_block_i8(const int8_t* q, const int32_t* q_sum, const int8_t* const* k,
                          int64_t j, int64_t n_dim, float* s) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
  }
  for (int64_t d = 0; d < n_dim; d += 64) {
    const __mmask64 m = n_dim - d >= 64 ? ~0ULL : (1ULL << (n_dim - d)) - 1;
    __m512i kc[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      kc[c] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, k[j + c] + d), flip);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_maskz_loadu_epi8(m, q + r * n_dim + d);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], kc[c], x);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m128 sums = hsum4(_mm512_cvtepi32_ps(acc[r][0]), _mm512_cvtepi32_ps(acc[r][1]),
                              _mm512_cvtepi32_ps(acc[r][2]), _mm512_cvtepi32_ps(acc[r][3]));
    const __m128 surplus = _mm_set1_ps(128.0f * static_cast<float>(q_sum[r]));
    _mm_storeu_ps(s + r * kTile + j, _mm_sub_ps(sums, surplus));
  }
}

template <int R, class KT>
inline void dots_rows_of(const float* q, const KT* const* k, int64_t n, int64_t n_dim,
                         float* s) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) dots_block<R>(q, k, j, n_dim, s);
  for (; j < n; ++j) {
    for (int r = 0; r < R; ++r) s[r * kTile + j] = dot(q + r * n_dim, k[j], n_dim);
  }
}

template <int R>
inline void dots_rows_of(const int8_t* q, const int32_t* q_sum, const int8_t* const* k,
                         int64_t n, int64_t n_dim, float* s) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) dots_block_i8<R>(q, q_sum, k, j, n_dim, s);
  for (; j < n; ++j) {
    for (int r = 0; r < R; ++r) {
      s[r * kTile + j] = static_cast<float>(dot_i8(q + r * n_dim, k[j], n_dim, q_sum[r]));
    }
  }
}

// s[r][j] = q_r . k[j] for `rows` query rows (row stride n_dim) and the n keys of a tile
// (s is [rows, kTile]), up to 6 rows x 4 keys per pass (24 accumulators): a GQA group of up
// to 6 loads each K chunk once.
template <class KT>
inline void dots_rows(const float* q, int64_t rows, const KT* const* k, int64_t n,
                      int64_t n_dim, float* s) {
  int64_t r = 0;
  for (; rows - r > 6; r += 4) dots_rows_of<4>(q + r * n_dim, k, n, n_dim, s + r * kTile);
  const float* q_r = q + r * n_dim;
  float* s_r = s + r * kTile;
  switch (rows - r) {
    case 6: return dots_rows_of<6>(q_r, k, n, n_dim, s_r);
    case 5: return dots_rows_of<5>(q_r, k, n, n_dim, s_r);
    case 4: return dots_rows_of<4>(q_r, k, n, n_dim, s_r);
    case 3: return dots_rows_of<3>(q_r, k, n, n_dim, s_r);
    case 2: return dots_rows_of<2>(q_r, k, n, n_dim, s_r);
    case 1: return dots_rows_of<1>(q_r, k, n, n_dim, s_r);
    default: return;
  }
}

inline void dots_rows_i8(const int8_t* q, const int32_t* q_sum, int64_t rows,
                         const int8_t* const* k, int64_t n, int64_t n_dim, float* s) {
  int64_t r = 0;
  for (; rows - r > 6; r += 4) {
    dots_rows_of<4>(q + r * n_dim, q_sum + r, k, n, n_dim, s + r * kTile);
  }
  const int8_t* q_r = q + r * n_dim;
  const int32_t* sum_r = q_sum + r;
  float* s_r = s + r * kTile;
  switch (rows - r) {
    case 6: return dots_rows_of<6>(q_r, sum_r, k, n, n_dim, s_r);
    case 5: return dots_rows_of<5>(q_r, sum_r, k, n, n_dim, s_r);
    case 4: return dots_rows_of<4>(q_r, sum_r, k, n, n_dim, s_r);
    case 3: return dots_rows_of<3>(q_r, sum_r, k, n, n_dim, s_r);
    case 2: return dots_rows_of<2>(q_r, sum_r, k, n, n_dim, s_r);
    case 1: return dots_rows_of<1>(q_r, sum_r, k, n, n_dim, s_r);
    default: return;
  }
}

// acc[r] += sum_j p[r][j] * v[j] for NR rows and 16 * NC dims from d0: each V chunk is
// loaded and converted once per key for all NR rows, and the accumulators stay in registers
// for the whole tile.
template <int NR, int NC, class VT>
inline void pv_block(float* acc, int64_t n_dim, const float* p, const VT* const* v, int64_t n,
                     int64_t d0) {
  __m512 a[NR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * n_dim + d0 + 16 * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 x[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) x[c] = load16(v[j] + d0 + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * kTile + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_fmadd_ps(w, x[c], a[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * n_dim + d0 + 16 * c, a[r][c]);
  }
}

// Up to 6 rows take 64 dims per pass, 7 or 8 rows 48 dims: at most 24 accumulators.
template <int NR, class VT>
inline void pv_rows(float* acc, int64_t n_dim, const float* p, const VT* const* v, int64_t n) {
  constexpr int kChunks = NR <= 6 ? 4 : 3;
  int64_t d0 = 0;
  for (; d0 + 16 * kChunks <= n_dim; d0 += 16 * kChunks) {
    pv_block<NR, kChunks>(acc, n_dim, p, v, n, d0);
  }
  for (; d0 < n_dim; d0 += 16) pv_block<NR, 1>(acc, n_dim, p, v, n, d0);
}

// acc[r] += sum_j p[r][j] * v[j] over the rows of a tile (p is [rows, kTile]), up to 8 rows
// (a whole GQA group of up to 8) per pass over V.
template <class VT>
inline void pv_tile(float* acc, int64_t rows, int64_t n_dim, const float* p,
                    const VT* const* v, int64_t n) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) pv_rows<8>(acc + r * n_dim, n_dim, p + r * kTile, v, n);
  float* acc_r = acc + r * n_dim;
  const float* p_r = p + r * kTile;
  switch (rows - r) {
    case 7: return pv_rows<7>(acc_r, n_dim, p_r, v, n);
    case 6: return pv_rows<6>(acc_r, n_dim, p_r, v, n);
    case 5: return pv_rows<5>(acc_r, n_dim, p_r, v, n);
    case 4: return pv_rows<4>(acc_r, n_dim, p_r, v, n);
    case 3: return pv_rows<3>(acc_r, n_dim, p_r, v, n);
    case 2: return pv_rows<2>(acc_r, n_dim, p_r, v, n);
    case 1: return pv_rows<1>(acc_r, n_dim, p_r, v, n);
    default: return;
  }
}

inline void scale_row(float* acc, float a, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t d = 0; d < n; d += 16) {
    _mm512_storeu_ps(acc + d, _mm512_mul_ps(av, _mm512_loadu_ps(acc + d)));
  }
}

// exp for x <= 0 (scores minus their running max): 2^k * p(r), r = x - k ln2, |r| <= ln2/2,
// degree-7 Taylor polynomial (relative error ~1e-8); below -87.3 (incl. -inf) it is 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, k));
}

inline float exp_sub_sum(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), mv));
    _mm512_mask_storeu_ps(s + j, lanes, e);
    sum = _mm512_mask_add_ps(sum, lanes, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// tanh of any x: below |x| = 0.25 its odd Taylor polynomial to x^9 (relative error < 1e-8),
// from there (1 - e) / (1 + e) with e = exp(-2|x|), which loses at most two bits to the
// subtraction; the sign of x is put back, so +-inf give +-1, and a NaN stays NaN.
inline __m512 tanh16(__m512 x) {
  const __m512 sign = _mm512_set1_ps(-0.0f), one = _mm512_set1_ps(1.0f);
  const __m512 ax = _mm512_andnot_ps(sign, x);
  const __m512 e = exp16(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
  const __m512 far = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 x2 = _mm512_mul_ps(ax, ax);
  __m512 p = _mm512_set1_ps(62.0f / 2835);
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-17.0f / 315));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.0f / 15));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.0f / 3));
  p = _mm512_fmadd_ps(p, x2, one);
  const __mmask16 near = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.25f), _CMP_LT_OQ);
  const __m512 r = _mm512_mask_mul_ps(far, near, ax, p);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_or_ps(r, _mm512_and_ps(x, sign)), nan, x);
}

// s[j] = cap * tanh(s[j] / cap) for j < n: +-inf become +-cap, a NaN stays NaN.
inline void softcap_row(float* s, int64_t n, float cap) {
  const __m512 c = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.0f / cap);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, s + j);
    _mm512_mask_storeu_ps(s + j, lanes, _mm512_mul_ps(c, tanh16(_mm512_mul_ps(x, inv))));
  }
}
