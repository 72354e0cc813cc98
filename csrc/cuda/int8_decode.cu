// INT8 K + INT8 V paged decode on the tensor cores (sm_80+, tuned on sm_90): the CUDA C++
// path of torch.ops.pagedfuse.paged_attention_int8 for q_len = 1 (see pagedfuse/ops/cuda.py
// for when it is chosen; every other case runs the Triton kernel).
//
// Why C++: the 8-bit MMA needs its reduction dim contiguous in each operand. For Q·K^T that
// is head_dim, which K rows already are. For P·V it is the token dim, while V rows are
// head_dim-contiguous and ldmatrix.trans moves 16-bit elements only, so Triton transposes
// the V tile byte by byte through shared memory. Here each thread reads 16-byte rows of V
// into registers and transposes 4x4 byte blocks with __byte_perm (8 PRMT per 16 bytes): V is
// never moved or converted element by element.
//
// Work split: one CTA of 4 warps per (KV head, sequence, split), heads fastest, so the CTAs
// that run together read the neighbouring heads of the same token rows (on the H200 3-8%
// faster for llama3_8b at B=64 than sequences fastest); each warp walks its own 32-token
// tiles with its own online softmax, and the CTA merges the 4 warps at the end.
// Each warp streams its tiles through a cp.async pipeline in shared memory (2-3 tiles in
// flight while it computes one), so the bytes in flight do not cost registers. The
// query heads of the group are the N = 8 columns of both MMAs (mma.m16n8k32.s8):
//   S^T[tok, h] = K[tok, :] . Q[h, :]     M = 16 tokens, N = 8 heads, K = 32 dims
//   O^T[d, h]   = V^T[d, :] . P^T[:, h]   M = 16 dims,   N = 8 heads, K = 32 tokens
// The reduction axes are free to permute, which picks the fragments so every operand is a
// plain vector load from the staged tile: thread (g = lane / 4, t = lane % 4) reads K tokens
// g + 8j, dims [t D/4, (t+1) D/4), and V tokens {4t..4t+3, 16+4t..16+4t+3}, dims
// [g D/8, (g+1) D/8).
// P moves from the S^T layout (heads 2t, 2t+1) to the P^T layout (head g) through 256 bytes
// of shared memory per warp.
//
// INT8 P·V: the per-token V scales are folded into P, P is quantized per head and tile to
// int8 (round half away from zero, like the Triton kernel), and the int32 result is scaled
// back into the fp32 accumulator. Scores are q_scale * k_scale * softmax scale * log2(e)
// times the int32 dot, then an exp2 online softmax.
//
// The online softmax rescales lazily: the running max moves only when a tile's max exceeds it
// by more than kLazyMax (p stays below 2^kLazyMax, harmless in fp32 and for the per-tile P
// quantization), so most tiles skip the O rescale, and the branch is warp-uniform.
//
// Instructions per tile bound this kernel: with 2-3 warps per scheduler there is little else
// to issue while one waits. So per-token addressing is 32-bit: each lane locates its own
// token once per tile (one block-table read) and the row offsets travel by shuffle, in
// 16-byte units (the host checks they fit 32 bits). Nsight Compute on the H200, llama3_8b
// B=64 L=8192, with the heads-first order: 306 -> 283 us, 78% -> 82% of peak DRAM throughput.
//
// Bounds: lengths, starts and block ids are clamped exactly as in the Triton kernel, so bad
// values (unchecked on the GPU) never move a read outside the cache, the table or the query.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int kWarps = 4;
constexpr int kTile = 32;                  // tokens per warp step (the P·V MMA's K)
constexpr int kCtaTokens = kWarps * kTile;  // split chunks are multiples of this
constexpr int kHeads = 8;                  // the MMA's N: query heads per KV head, at most
constexpr float kLazyMax = 8.f;            // log2 units the running max may lag behind

struct Args {
  const int8_t* q;        // [T, Hq, D] quantized query, row stride q_stride_t
  const float* q_scale;   // [T, Hq] contiguous
  const int8_t* k;
  const int8_t* v;
  const float* k_scale;
  const float* v_scale;
  const void* block_table;
  const void* seq_lens;
  const void* query_start;
  void* out;              // [T, Hq, D] contiguous, query dtype
  float* part_o;          // [splits, T, Hq, D] fp32 (splits > 1)
  float* part_lse;        // [splits, T, Hq] fp32, log2 domain
  float scale_log2;       // softmax scale * log2(e)
  int64_t num_tokens, num_q_heads;
  int group, num_blocks, max_blocks, batch, num_kv_heads;
  int page, page_shift;   // page_shift: log2(page) for a power of two, else -1
  int index64;            // bits 0, 1, 2: block_table, seq_lens, query_start are int64
  int64_t q_stride_t, k_sh, v_sh, ks_sh, vs_sh, bt_sb;  // per-CTA bases: 64-bit
  uint32_t k_sb, k_st, v_sb, v_st;                       // per token: 16-byte units
  uint32_t ks_sb, ks_st, vs_sb, vs_st, bt_sn;            // per token: elements
};

// Where one token's rows are, relative to its CTA's head: K/V in 16-byte units, scales in
// elements.
struct TokenAt {
  uint32_t k, v, ks, vs;
};

__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Words w[0..3] hold 4 bytes (dims e = 0..3) of tokens 0..3; u[e] gets dim e of tokens 0..3.
__device__ __forceinline__ void transpose4x4(const uint32_t (&w)[4], uint32_t (&u)[4]) {
  const uint32_t x0 = __byte_perm(w[0], w[1], 0x5140), x1 = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t y0 = __byte_perm(w[2], w[3], 0x5140), y1 = __byte_perm(w[2], w[3], 0x7362);
  u[0] = __byte_perm(x0, y0, 0x5410);
  u[1] = __byte_perm(x0, y0, 0x7632);
  u[2] = __byte_perm(x1, y1, 0x5410);
  u[3] = __byte_perm(x1, y1, 0x7632);
}

// NB bytes (16-byte multiples, or 8; p aligned to that) into NB / 4 words, from global
// memory through the read-only path (kGlobal) or from shared memory.
template <int NB, bool kGlobal>
__device__ __forceinline__ void load_words(const int8_t* p, uint32_t* w) {
  if constexpr (NB % 16 == 0) {
#pragma unroll
    for (int i = 0; i < NB / 16; ++i) {
      const uint4* src = reinterpret_cast<const uint4*>(p) + i;
      const uint4 x = kGlobal ? __ldg(src) : *src;
      w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
    }
  } else {
    static_assert(NB == 8, "unsupported row chunk");
    const uint2* src = reinterpret_cast<const uint2*>(p);
    const uint2 x = kGlobal ? __ldg(src) : *src;
    w[0] = x.x, w[1] = x.y;
  }
}

__device__ __forceinline__ float warp_max_over_g(float x) {  // lanes with the same t
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

__device__ __forceinline__ float warp_sum_over_g(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

template <typename OutT>
__device__ __forceinline__ OutT to_out(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 to_out(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half to_out(float x) { return __float2half_rn(x); }

// Element i of an int32 or int64 index tensor.
__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(p)[i]
              : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

__device__ __forceinline__ int64_t clamp(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// cp.async: 16 (or 4) bytes global -> shared without registers; groups complete in order.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// One warp's tile in shared memory: 32 rows of K and of V, and their scales.
template <int D>
struct TileBuf {
  int8_t k[kTile][D];
  int8_t v[kTile][D];
  float ks[kTile];
  float vs[kTile];
};

// Dynamic shared memory: the warps' pipelines (S stages each), reused for the merge of the
// warps at the end.
template <int D, int S>
__host__ __device__ constexpr size_t smem_bytes() {
  const size_t pipeline = sizeof(TileBuf<D>) * S * kWarps;
  const size_t merge = sizeof(float) * kWarps * kHeads * D;
  return pipeline > merge ? pipeline : merge;
}

// S: the tiles of a warp's cp.async pipeline (S - 1 in flight while one is computed), or 0:
// no pipeline, each thread loads its fragments of the tile straight from global memory into
// registers at the tile's start (fewer warps fit, each with one tile in flight; loading the
// next tile into the registers the last one freed measured slower on the H200, since the
// registers it holds cost a CTA per SM).
template <int D, int S, typename OutT>
__global__ void __launch_bounds__(kWarps * 32)
    int8_decode_kernel(const Args a) {
  constexpr int KW = D / 16;  // K words per token per thread (dims [t D/4, (t+1) D/4))
  constexpr int VW = D / 32;  // V words per token per thread (dims [g D/8, (g+1) D/8))
  constexpr int VD = D / 8;   // output dims per thread
  constexpr int CH = D / 16;  // 16-byte chunks per row

  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float s_m[kWarps][kHeads], s_l[kWarps][kHeads];
  __shared__ __align__(16) int8_t s_p[kWarps][kHeads][kTile];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int kvh = static_cast<int>(blockIdx.x % a.num_kv_heads);
  const unsigned rest = blockIdx.x / a.num_kv_heads;
  const int b = static_cast<int>(rest % a.batch), split = static_cast<int>(rest / a.batch);
  const int splits = static_cast<int>(gridDim.x / (a.num_kv_heads * a.batch));
  const int group = a.group;
  TileBuf<D>* bufs = reinterpret_cast<TileBuf<D>*>(smem) + warp * (S > 0 ? S : 1);
  const int8_t* k_head = a.k + kvh * a.k_sh;
  const int8_t* v_head = a.v + kvh * a.v_sh;
  const float* ks_head = a.k_scale + kvh * a.ks_sh;
  const float* vs_head = a.v_scale + kvh * a.vs_sh;

  const int64_t seq_len = clamp(load_index(a.seq_lens, b, a.index64 & 2), 0,
                                a.max_blocks * a.page);
  const int64_t q_start = clamp(load_index(a.query_start, b, a.index64 & 4), 0, a.num_tokens);
  const int64_t q_end = clamp(load_index(a.query_start, b + 1, a.index64 & 4), q_start,
                              a.num_tokens);
  if (q_end == q_start) return;  // no query token for this sequence
  const int64_t token = q_start;
  const int64_t chunk = ((seq_len + splits - 1) / splits + kCtaTokens - 1) / kCtaTokens *
                        kCtaTokens;
  const int64_t kv_lo = split * chunk;
  const int64_t kv_hi = kv_lo + chunk < seq_len ? kv_lo + chunk : seq_len;
  const int64_t first = kv_lo + warp * kTile;  // this warp's tiles: first + i * kCtaTokens
  const int num_tiles =
      first < kv_hi ? static_cast<int>((kv_hi - first + kCtaTokens - 1) / kCtaTokens) : 0;

  // Q^T fragments (B operand of Q·K^T) of head g: dims [t D/4, (t+1) D/4) of its row.
  const int64_t head0 = static_cast<int64_t>(kvh) * group;
  uint32_t qf[KW];
  if (g < group) {
    load_words<D / 4, true>(a.q + token * a.q_stride_t + (head0 + g) * D + t * (D / 4), qf);
  } else {
#pragma unroll
    for (int i = 0; i < KW; ++i) qf[i] = 0;
  }
  float qs[2];  // q_scale * softmax scale of heads 2t, 2t+1 (0 for padding heads)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    qs[h] = 2 * t + h < group
                ? a.q_scale[token * a.num_q_heads + head0 + 2 * t + h] * a.scale_log2
                : 0.f;
  }

  const bool table64 = a.index64 & 1;
  const int64_t table_row = static_cast<int64_t>(b) * a.bt_sb;
  const int last = seq_len > 0 ? static_cast<int>(seq_len - 1) : 0;
  // A token's rows: the block id from the table, clamped into the cache; tokens past the
  // sequence read its last token (their scores are masked).
  auto locate = [&](int64_t tok64) -> TokenAt {
    const int tok = tok64 < last ? static_cast<int>(tok64) : last;
    const int page_idx = a.page_shift >= 0 ? tok >> a.page_shift : tok / a.page;
    const uint32_t slot = tok - page_idx * a.page;
    const auto blk = static_cast<uint32_t>(clamp(
        load_index(a.block_table, table_row + page_idx * a.bt_sn, table64), 0,
        a.num_blocks - 1));
    return {blk * a.k_sb + slot * a.k_st, blk * a.v_sb + slot * a.v_st,
            blk * a.ks_sb + slot * a.ks_st, blk * a.vs_sb + slot * a.vs_st};
  };
  auto locate_lane = [&](int i) {  // lane L: token L of tile i
    return locate(first + static_cast<int64_t>(i) * kCtaTokens + lane);
  };
  // Copies tile i into its stage: lane L fetches row L's scales; the K/V chunks go row-major
  // over the warp (consecutive lanes read consecutive 16 bytes of a row), each row's offset
  // shuffled from the lane that located it.
  constexpr int RPC = 32 / CH;  // rows per copy instruction
  const int8_t* k_col = k_head + (lane % CH) * 16;
  const int8_t* v_col = v_head + (lane % CH) * 16;
  auto issue = [&](int i, TokenAt at) {
    TileBuf<D>& buf = bufs[S > 0 ? i % S : 0];
    cp_async4(&buf.ks[lane], ks_head + at.ks);
    cp_async4(&buf.vs[lane], vs_head + at.vs);
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int row = c * RPC + lane / CH, col = (lane % CH) * 16;
      const uint32_t k_row = __shfl_sync(0xffffffffu, at.k, row);
      const uint32_t v_row = __shfl_sync(0xffffffffu, at.v, row);
      cp_async16(&buf.k[row][col], k_col + static_cast<size_t>(k_row) * 16);
      cp_async16(&buf.v[row][col], v_col + static_cast<size_t>(v_row) * 16);
    }
  };

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[2][VD];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < VD; ++i) o[h][i] = 0.f;

  // Prologue: S - 1 tiles in flight, and the block ids of the next one loaded.
  TokenAt next_at{};
  if constexpr (S > 0) {
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      if (i < num_tiles) issue(i, locate_lane(i));
      cp_async_commit();  // empty groups keep the wait count uniform
    }
    if (num_tiles > 0) next_at = locate_lane(S - 1);  // else no table row to read
  }

  int8_t* p_row = &s_p[warp][0][0];
  for (int i = 0; i < num_tiles; ++i) {
    const int64_t tile = first + static_cast<int64_t>(i) * kCtaTokens;
    // K rows of tokens g + 8j, V rows of tokens 4t + s and 16 + 4t + s.
    uint32_t kw[4][KW], vw[8][VW];
    float ks[4], vs[4];
    if constexpr (S > 0) {
      if (i + S - 1 < num_tiles) issue(i + S - 1, next_at);
      cp_async_commit();
      next_at = locate_lane(i + S);  // its latency hides behind this tile's math
      cp_async_wait<S - 1>();   // tile i has landed (this lane's copies) ...
      __syncwarp();             // ... and every lane's
      const TileBuf<D>& buf = bufs[i % S];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        load_words<D / 4, false>(&buf.k[g + 8 * j][t * (D / 4)], kw[j]);
        ks[j] = buf.ks[g + 8 * j];
        vs[j] = buf.vs[g + 8 * j];
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        load_words<D / 8, false>(&buf.v[s < 4 ? 4 * t + s : 12 + 4 * t + s][g * VD], vw[s]);
      }
    } else {  // each lane locates its own token; the rows' offsets and scales are shuffled
      const TokenAt mine = locate_lane(i);
      const float ks_mine = ks_head[mine.ks], vs_mine = vs_head[mine.vs];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int src = g + 8 * j;
        const uint32_t k_row = __shfl_sync(0xffffffffu, mine.k, src);
        load_words<D / 4, true>(k_head + static_cast<size_t>(k_row) * 16 + t * (D / 4), kw[j]);
        ks[j] = __shfl_sync(0xffffffffu, ks_mine, src);
        vs[j] = __shfl_sync(0xffffffffu, vs_mine, src);
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const uint32_t v_row =
            __shfl_sync(0xffffffffu, mine.v, s < 4 ? 4 * t + s : 12 + 4 * t + s);
        load_words<D / 8, true>(v_head + static_cast<size_t>(v_row) * 16 + g * VD, vw[s]);
      }
    }

    // S^T = K Q^T: m-tile mt holds tokens 16 mt + g (c0, c1) and 16 mt + g + 8 (c2, c3).
    float sc[4][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      int acc[4] = {0, 0, 0, 0};
#pragma unroll
      for (int c = 0; c < D / 32; ++c) {
        mma_s8(acc, kw[2 * mt][2 * c], kw[2 * mt + 1][2 * c], kw[2 * mt][2 * c + 1],
               kw[2 * mt + 1][2 * c + 1], qf[2 * c], qf[2 * c + 1]);
      }
      sc[2 * mt][0] = acc[0], sc[2 * mt][1] = acc[1];
      sc[2 * mt + 1][0] = acc[2], sc[2 * mt + 1][1] = acc[3];
    }

    // Online softmax per head (2t + h): the tile's max, a lazy rescale, then
    // P' = p * v_scale quantized per head.
    float tile_max[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool keep = tile + g + 8 * j < kv_hi;
        sc[j][h] = keep ? sc[j][h] * qs[h] * ks[j] : -INFINITY;
        mx = fmaxf(mx, sc[j][h]);
      }
      tile_max[h] = warp_max_over_g(mx);
    }
    const bool grow0 = tile_max[0] > m[0] + kLazyMax, grow1 = tile_max[1] > m[1] + kLazyMax;
    if (__any_sync(0xffffffffu, grow0 || grow1)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool grow = h == 0 ? grow0 : grow1;
        const float alpha = grow ? exp2f(m[h] - tile_max[h]) : 1.f;  // 0 from -inf
        m[h] = grow ? tile_max[h] : m[h];
        l[h] *= alpha;
#pragma unroll
        for (int i = 0; i < VD; ++i) o[h][i] *= alpha;
      }
    }
    float p_step[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_use = m[h] == -INFINITY ? 0.f : m[h];  // then every score is -inf
      float psum = 0.f, pmax = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p = exp2f(sc[j][h] - m_use);
        psum += p;
        sc[j][h] = p > 0.f ? p * vs[j] : 0.f;  // never 0 * a garbage scale
        pmax = fmaxf(pmax, fabsf(sc[j][h]));
      }
      l[h] += psum;  // per-thread partial; summed over g at the end
      pmax = warp_max_over_g(pmax);
      const float inv = pmax > 0.f ? __fdividef(127.f, pmax) : 1.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // |x| <= 127 (to a few ulp), so the int8 cast is safe
        const float x = sc[j][h] * inv;
        p_row[(2 * t + h) * kTile + g + 8 * j] =
            static_cast<int8_t>(static_cast<int>(x + copysignf(0.5f, x)));
      }
      p_step[h] = pmax > 0.f ? pmax * (1.f / 127.f) : 1.f;
    }
    __syncwarp();
    const uint32_t pb0 = *reinterpret_cast<const uint32_t*>(p_row + g * kTile + 4 * t);
    const uint32_t pb1 = *reinterpret_cast<const uint32_t*>(p_row + g * kTile + 16 + 4 * t);
    __syncwarp();  // the next tile rewrites s_p

    // O^T += V^T P^T: m-tile i holds dims g D/8 + 2i (c0, c1) and g D/8 + 2i + 1 (c2, c3).
#pragma unroll
    for (int w = 0; w < VW; ++w) {
      uint32_t lo[4], hi[4];
      transpose4x4({vw[0][w], vw[1][w], vw[2][w], vw[3][w]}, lo);
      transpose4x4({vw[4][w], vw[5][w], vw[6][w], vw[7][w]}, hi);
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        int acc[4] = {0, 0, 0, 0};
        mma_s8(acc, lo[e], lo[e + 1], hi[e], hi[e + 1], pb0, pb1);
        const int d = 4 * w + e;
        o[0][d] += static_cast<float>(acc[0]) * p_step[0];
        o[1][d] += static_cast<float>(acc[1]) * p_step[1];
        o[0][d + 1] += static_cast<float>(acc[2]) * p_step[0];
        o[1][d + 1] += static_cast<float>(acc[3]) * p_step[1];
      }
    }
  }

  // Merge the warps: each publishes its (m, l, O) per head; the CTA combines them. O goes
  // where the pipelines were, so every warp must be done with its tiles first.
  if constexpr (S > 0) cp_async_wait<0>();
  __syncthreads();
  auto s_o = reinterpret_cast<float(*)[kHeads][D]>(smem);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float lsum = warp_sum_over_g(l[h]);
    if (g == 0) s_m[warp][2 * t + h] = m[h], s_l[warp][2 * t + h] = lsum;
#pragma unroll
    for (int i = 0; i < VD; ++i) s_o[warp][2 * t + h][g * VD + i] = o[h][i];
  }
  __syncthreads();
  const bool direct = splits == 1;
  for (int idx = threadIdx.x; idx < group * D; idx += kWarps * 32) {
    const int h = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][h]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float lsum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float e = exp2f(s_m[w][h] - m_use);
      lsum += e * s_l[w][h];
      acc += e * s_o[w][h][d];
    }
    const float val = acc / (lsum > 0.f ? lsum : 1.f);
    const int64_t row = token * a.num_q_heads + head0 + h;
    if (direct) {
      static_cast<OutT*>(a.out)[row * D + d] = to_out<OutT>(val);
    } else {
      const int64_t rows = a.num_tokens * a.num_q_heads;
      a.part_o[(split * rows + row) * D + d] = val;
      if (d == 0) a.part_lse[split * rows + row] = lsum > 0.f ? m_use + log2f(lsum) : -INFINITY;
    }
  }
}

// One variant: launch it (grid.x > 0), or with grid.x == 0 write how many of its CTAs fit
// on one multiprocessor to *resident.
template <int D, int S, typename OutT>
cudaError_t run_variant(const Args& a, dim3 grid, cudaStream_t stream, int* resident) {
  constexpr int bytes = static_cast<int>(smem_bytes<D, S>());
  const auto kernel = int8_decode_kernel<D, S, OutT>;
  const cudaError_t opt_in = cudaFuncSetAttribute(  // beyond the 48 KB default, per device
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (opt_in != cudaSuccess) return opt_in;
  if (grid.x == 0) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, kWarps * 32, bytes);
  }
  kernel<<<grid, kWarps * 32, bytes, stream>>>(a);
  return cudaGetLastError();
}

// The built (head_dim, stages) variants; the Python side picks the stages per head_dim.
template <typename OutT>
cudaError_t dispatch(const Args& a, int head_dim, int stages, dim3 grid, cudaStream_t stream,
                     int* resident) {
  switch (head_dim * 16 + stages) {
    case 64 * 16 + 0: return run_variant<64, 0, OutT>(a, grid, stream, resident);
    case 64 * 16 + 2: return run_variant<64, 2, OutT>(a, grid, stream, resident);
    case 128 * 16 + 0: return run_variant<128, 0, OutT>(a, grid, stream, resident);
    case 128 * 16 + 2: return run_variant<128, 2, OutT>(a, grid, stream, resident);
    case 128 * 16 + 3: return run_variant<128, 3, OutT>(a, grid, stream, resident);
    case 256 * 16 + 0: return run_variant<256, 0, OutT>(a, grid, stream, resident);
    case 256 * 16 + 2: return run_variant<256, 2, OutT>(a, grid, stream, resident);
    default: return cudaErrorInvalidValue;
  }
}

// Makes `device` current for this library's runtime and restores the previous one on exit,
// so a call for a tensor on another GPU leaves the caller's current device as it was.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && previous_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  cudaError_t status_;
};

}  // namespace

extern "C" {

// Launches on `stream` (the caller's current torch stream); returns a cudaError_t code.
// out_dtype: 0 bfloat16, 1 float16; index64: bits 0, 1, 2 set where block_table, seq_lens,
// query_start_loc are int64. sizes: num_tokens, num_q_heads, group, num_blocks,
// max_blocks, page, page_shift (-1 unless a power of two); strides (elements): query token,
// then (block, token, head) of K, V, K scales, V scales, then the table's (row, column).
// The caller guarantees what cuda_native.int8_decode_unsupported checks (alignment, 32-bit
// per-token offsets) and num_kv_heads * batch * splits < 2^31.
int pagedfuse_int8_decode(int device, void* stream, int out_dtype, int index64, int head_dim,
                          int stages,
                          int64_t batch, int64_t num_kv_heads, int64_t splits,
                          const int8_t* q, const float* q_scale, const int8_t* k,
                          const int8_t* v, const float* k_scale, const float* v_scale,
                          const void* block_table, const void* seq_lens,
                          const void* query_start, void* out, float* part_o, float* part_lse,
                          float scale_log2, const int64_t* sizes, const int64_t* strides) {
  const DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return guard.status();
  Args a{};
  a.q = q, a.q_scale = q_scale, a.k = k, a.v = v, a.k_scale = k_scale, a.v_scale = v_scale;
  a.block_table = block_table, a.seq_lens = seq_lens, a.query_start = query_start;
  a.out = out, a.part_o = part_o, a.part_lse = part_lse, a.scale_log2 = scale_log2;
  a.num_tokens = sizes[0], a.num_q_heads = sizes[1];
  a.group = static_cast<int>(sizes[2]), a.num_blocks = static_cast<int>(sizes[3]);
  a.max_blocks = static_cast<int>(sizes[4]), a.page = static_cast<int>(sizes[5]);
  a.page_shift = static_cast<int>(sizes[6]), a.index64 = index64;
  a.batch = static_cast<int>(batch), a.num_kv_heads = static_cast<int>(num_kv_heads);
  // The caller checked: K/V strides are 16-byte multiples and every per-token offset fits
  // 32 bits (K/V in 16-byte units, scales and the table in elements).
  const auto u32 = [](int64_t x) { return static_cast<uint32_t>(x); };
  a.q_stride_t = strides[0];
  a.k_sb = u32(strides[1] / 16), a.k_st = u32(strides[2] / 16), a.k_sh = strides[3];
  a.v_sb = u32(strides[4] / 16), a.v_st = u32(strides[5] / 16), a.v_sh = strides[6];
  a.ks_sb = u32(strides[7]), a.ks_st = u32(strides[8]), a.ks_sh = strides[9];
  a.vs_sb = u32(strides[10]), a.vs_st = u32(strides[11]), a.vs_sh = strides[12];
  a.bt_sb = strides[13], a.bt_sn = u32(strides[14]);
  const dim3 grid(static_cast<unsigned>(num_kv_heads * batch * splits));  // heads fastest
  const auto s = static_cast<cudaStream_t>(stream);
  return out_dtype == 0 ? dispatch<__nv_bfloat16>(a, head_dim, stages, grid, s, nullptr)
                        : dispatch<__half>(a, head_dim, stages, grid, s, nullptr);
}

// CTAs of the (head_dim, stages) variant that fit on one multiprocessor (registers and
// shared memory), into *resident; returns a cudaError_t code.
int pagedfuse_int8_decode_occupancy(int device, int head_dim, int stages, int* resident) {
  const DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return guard.status();
  return dispatch<__nv_bfloat16>(Args{}, head_dim, stages, dim3(0, 1, 1), nullptr, resident);
}

// 0 when this build has machine code or PTX the device can run, else a cudaError_t code.
int pagedfuse_int8_decode_probe(int device) {
  const DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return guard.status();
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, int8_decode_kernel<128, 0, __nv_bfloat16>);
}

const char* pagedfuse_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
