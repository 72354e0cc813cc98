// Shared by every translation unit: dtypes, scalar conversions, the argument block.
//
// This header must be included before any `#pragma GCC target`: its inline functions are then
// compiled for the baseline ISA, so the linker can never pick an AVX-512 copy of them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedfuse {

enum class Dtype : int { f32 = 0, bf16 = 1, f16 = 2, i8 = 3 };

// Bytes per element of a float dtype (query, out, quantize input).
inline int64_t float_bytes(Dtype dt) { return dt == Dtype::f32 ? 4 : 2; }

// Distinct types for the two 16-bit floats so templates can tell them apart.
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(bf16_t x) { return bits_to_float(uint32_t(x.bits) << 16); }
inline float to_float(f16_t x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1f, mant = x.bits & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    return bits_to_float(sign | float_to_bits(std::ldexp(static_cast<float>(mant), -24)));
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round to nearest even, as torch's .to(bfloat16) / .to(float16).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000;
  uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00);  // NaN
  if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00);  // rounds to inf
  if (mag < 0x38800000u) {  // half subnormal: count units of 2^-24, ties to even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(
        std::nearbyint(bits_to_float(mag) * 16777216.0f)));
  }
  mag += 0xfffu + ((mag >> 13) & 1);
  return static_cast<uint16_t>(sign | ((mag - (112u << 23)) >> 13));
}

inline float load_scalar(const void* p, Dtype dt, int64_t i) {
  switch (dt) {
    case Dtype::f32: return static_cast<const float*>(p)[i];
    case Dtype::bf16: return to_float(static_cast<const bf16_t*>(p)[i]);
    case Dtype::f16: return to_float(static_cast<const f16_t*>(p)[i]);
    case Dtype::i8: return to_float(static_cast<const int8_t*>(p)[i]);
  }
  return 0.0f;
}

// dst[0:n] = src[0:n] * mul, converted to dt (a float dtype).
inline void store_row(void* dst, Dtype dt, const float* src, float mul, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = src[i] * mul;
    if (dt == Dtype::f32) static_cast<float*>(dst)[i] = x;
    else if (dt == Dtype::bf16) static_cast<uint16_t*>(dst)[i] = float_to_bf16(x);
    else static_cast<uint16_t*>(dst)[i] = float_to_f16(x);
  }
}

// The factor a row's accumulated sum_j p_j v_j is stored with: 1 / l; 0 where every weight
// is 0 (which keeps a NaN that a weight-0 key's NaN or Inf in V put there); NaN for a row
// whose running max m is NaN, the mark of a NaN or +inf score.
inline float row_factor(float m, float l) {
  return std::isnan(m) ? NAN : l > 0.0f ? 1.0f / l : 0.0f;
}

// Symmetric int8 of one row: scale = max|x| / 127, q = round_half_even(x / scale) clamped to
// +-127 (a zero row gives scale 0 and zeros; a NaN in the row gives scale NaN, and an element
// whose quotient is NaN gives 0). Bit-identical to quantize_int8_reference.
float quantize_row(const void* src, Dtype dt, int64_t n, int8_t* dst);

// Everything one paged-attention call needs, in elements (not bytes). Filled from Python after
// validation: block ids in use are in [-num_blocks, num_blocks), seq_lens <= capacity,
// strides in bounds.
struct PagedArgs {
  void* out;  // contiguous [T, Hq, D] in q_dtype
  const void* query;
  Dtype q_dtype;
  int64_t q_stride[2];  // token, head
  const void* key;
  Dtype k_dtype;
  int64_t k_stride[3];  // block, slot, kv head
  const void* value;
  Dtype v_dtype;
  int64_t v_stride[3];
  const float* key_scale;  // null: the float op
  int64_t ks_stride[3];
  const float* value_scale;  // null: V is float (or the float op)
  int64_t vs_stride[3];
  const int64_t* block_table;  // contiguous [B, max_blocks]
  int64_t max_blocks;
  int64_t num_blocks;  // the cache's: a negative block id wraps by it (0: not given)
  const int64_t* seq_lens;         // [B]
  const int64_t* query_start_loc;  // [B + 1]
  const void* bias;  // uint8 (bool) or float32; strides already 0 on broadcast dims
  int bias_kind;     // 0 none, 1 bool, 2 float
  int64_t bias_stride[4];
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, batch, block_size;
  float scale;
  bool causal;
  int64_t window_left;  // > 0: a query at position p reads keys j > p - window_left; 0: all
  float softcap;        // > 0: scores become softcap * tanh(score / softcap); 0: off
  int threads;
  // INT8 only, filled by the dispatcher: the query quantized once per token and head.
  const int8_t* q_i8;      // [T, Hq, D]
  const float* q_scale;    // [T, Hq]
  const int32_t* q_sum;    // [T, Hq] sum of q_i8 over D (the VNNI path's offset correction)
};

// One unit of parallel work: query tokens [tok0, tok0 + ntok) of sequence b, all heads,
// against its keys [key0, key1).
struct WorkItem {
  int64_t b, tok0, ntok, key0, key1;
  int64_t nsplit;       // 1: write `out`; else write partial row `partial_row + i` of split
  int64_t partial_row;  // (in units of [Hq] rows)
};

// Unnormalised per-split results, combined after all splits finish.
struct Partials {
  float* m;    // running max per (row, head)
  float* l;    // running sum of exp
  float* acc;  // [.., D]
};

constexpr int64_t kTile = 64;  // keys scored together per online-softmax step

// Floats of scratch one thread needs for items of up to `rows` query rows.
inline int64_t workspace_floats(int64_t rows, int64_t head_dim) {
  return rows * (2 * head_dim + kTile + 3);
}

using ItemKernel = void (*)(const PagedArgs&, const WorkItem&, float* workspace,
                            const Partials&);

void run_item_portable(const PagedArgs&, const WorkItem&, float*, const Partials&);
#if defined(__x86_64__)
void run_item_avx512(const PagedArgs&, const WorkItem&, float*, const Partials&);
#endif

// Entry points bound in bindings.cpp.
void paged_attention(PagedArgs a);
void quantize_rows(const void* x, Dtype dt, int64_t rows, int64_t n, int8_t* q, float* scale,
                   int threads);
// The instruction set PAGEDFUSE_CPU_ISA (auto | portable | avx512) selects on this CPU.
const char* selected_isa();
bool cpu_has_avx512_vnni();

}  // namespace pagedfuse
