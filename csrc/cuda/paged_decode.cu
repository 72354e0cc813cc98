// Paged decode on the tensor cores (sm_80+, tuned on sm_90): the CUDA C++ path of
// torch.ops.pagedfuse.paged_attention and paged_attention_int8 for q_len = 1, and for short
// queries of up to 8 tokens (kMaxColumnTiles; pagedfuse/ops/backends/cuda_decode.py says
// when it is chosen; every other case runs a prefill kernel).
// One kernel serves three caches (Kind): INT8 K and V, INT8 K with 16-bit V, and 16-bit K
// and V (bf16 or fp16, the query's dtype).
//
// Why C++: the 8-bit MMA needs its reduction dim contiguous in each operand. For Q·K^T that
// is head_dim, which K rows already are. For P·V it is the token dim, while V rows are
// head_dim-contiguous and ldmatrix.trans moves 16-bit elements only, so Triton transposes
// the V tile byte by byte through shared memory. Here ldmatrix.trans moves V's byte pairs
// (two dims of one token), and one PRMT per register of the P·V MMA's A fragment takes one
// dim's two tokens out of a fragment word, already as the fp16 pair it is short of one HSUB2
// (int8_pair_to_half2): V is never moved through registers element by element. 16-bit V
// needs no PRMT at all, and the 16-bit kinds share the INT8 kernel's tuned skeleton
// (block-table reads, pipeline, lazy softmax, merge) instead of Triton's.
//
// Work split: one CTA of 4 or 8 warps per (group of `heads` KV heads, sequence, split),
// heads fastest, so the CTAs that run together read the neighbouring heads of the same
// token rows (on the H200 3-8% faster for llama3_8b at B=64 than sequences fastest); each
// warp serves one of the CTA's heads and walks its own tiles of kTile tokens (Traits) with
// its own online softmax, and the CTA merges each head's warps at the end. The balanced grid
// (PAGEDFUSE_BALANCED=1; see balanced_grid) runs the same CTA pass over equal shares of the
// batch's keys instead, for batches whose lengths differ widely.
// Each warp streams its tiles through a cp.async pipeline of S stages in shared memory: a
// tile moves into registers as it starts, and once Q·K^T has spent its K fragments its
// stage takes the tile S ahead, so S tiles stay in flight through the softmax and P·V. The
// query heads of the group (with several query tokens, their (token, head) pairs) are the
// N = 8 columns of both MMAs (Q·K^T: m16n8k32.s8 for an INT8 K cache, else m16n8k16; P·V:
// m16n8k16 for every cache, fp16 for INT8 V):
//   S^T[tok, h] = K[tok, :] . Q[h, :]     M = 16 tokens, N = 8 heads, K = head dims
//   O^T[d, h]   = V^T[d, :] . P^T[:, h]   M = 16 dims,   N = 8 heads, K = tokens
// The reduction axes and P·V's M are free to permute, which picks the fragments so every
// operand is a plain read of the staged tile: thread (g = lane / 4, t = lane % 4) reads K
// tokens g R..g R + R - 1 (R = kTile / 8, so a thread's P values of one head are adjacent)
// as vector loads of the 16-byte chunks t, t + 4, t + 8, ... of their rows (and of its query
// row). P·V's K steps take tokens 4t..4t+3 of every 16 in thread t's fragments: the
// ldmatrix rows of one 8x8 matrix are tokens {0, 1, 4, 5, 8, 9, 12, 13} (+ 2, + 16), so
// lane t's two rows are tokens 4t, 4t + 1 (the m16n8k16 fragments' k 2t, 2t + 1; tokens 4t
// + 2, 4t + 3 are its k 2t + 8, 2t + 9). Its M rows are dims 2g, 2g + 1 of each 16 (8-bit
// V) or g, g + 8 (16-bit V). The staged rows' chunks are XOR-swizzled (Staged) so that
// each of these reads meets every shared-memory bank once.
// P moves from the S^T layout (heads 2t, 2t+1) to the P^T layout (head g) through 256-512
// bytes of shared memory per warp, one word (8 bytes with 32-token tiles) per head and
// thread.
//
// INT8 P·V: the per-token V scales are folded into P, P' = p * v_scale is rounded to fp16,
// V's int8 values go to fp16 exactly, and the fp16 MMA accumulates into the fp32 O directly.
// Not int8 P (P' quantized per head and tile, step = tile max / 127, for an int8 MMA, as the
// Triton kernel does and this one did), because that rounds every P' below half a step to 0
// while l, summed from the unquantized p, still counts it: on SmolLM2-135M's decode calls
// over real text (3 windows of 1024, all 30 layers), this kernel's 32-key tiles dropped 0.26%
// of the attention mass on average and shrank the output by 0.15% along itself, 0.62%
// relative error beyond the query's quantization (the Triton kernel's 128-key tiles: 0.81%,
// 0.51%, 1.3%; its decode perplexity on the H200 is 0.135% under dequantize-then-attend's).
// P' in fp16: -0.0007%, -0.0003%, 0.014%. As decode perplexity over 16,384 tokens (31
// windows, emulated on the CPU), against dequantize-then-attend's: int8 P -0.059% (paired
// s.e. 0.057%), fp16 P' -0.009% (0.055%) (benchmarks/decode_p_precision.py emulates both
// kernels; its record is benchmarks/results/pv_precision.json). Summing l from the
// dequantized int8 P instead flips the bias (+0.25% along the output) and errs more. fp16
// costs one PRMT and one HSUB2 per A register of V (two per 16 dims and 16 tokens) and two
// k16 MMAs where one k32 int8 MMA was, and saves the P quantization (a max over the warp per
// head and tile, the packing) and the scaling of each tile's int32 result into O. 16-bit
// P·V: P is rounded to V's dtype (as FlashAttention does) and the MMA accumulates into the
// fp32 O directly. Scores are q_scale * k_scale * softmax scale * log2(e) times the dot
// (INT8 K), or softmax scale * log2(e) times it, then an exp2 online softmax
// (ex2.approx.ftz: one instruction; scores are at most kLazyMax above the running max, so
// nothing in range flushes).
//
// Sliding window (window_left W): the query at position p = seq_len - 1 reads keys j > p - W,
// so each sequence's keys start at max(0, seq_len - W). The split chunks and the balanced
// grid's steps divide only those keys, and no warp locates a token (reads a table entry) or
// copies a row before them: a windowed decode reads the window's pages alone. The start is a
// run-time offset (0 without a window), a few integer operations per CTA. Soft cap: the
// scaled score s (scales restored) becomes softcap * tanh(s / softcap) before the softmax,
// in the log2 domain (soft_cap); it is a template flag, so a call without a cap runs no
// instruction of it.
//
// The online softmax rescales lazily: the running max moves only when a tile's max exceeds it
// by more than kLazyMax (p stays below 2^kLazyMax, harmless in fp32, bf16 and fp16; for
// INT8 V it bounds the V scales P' = p * v_scale holds in fp16, see kPMax), so most tiles
// skip the O rescale, and the branch is warp-uniform.
//
// With 2-3 warps per scheduler there is little else to issue while one waits, so each
// warp's instructions per tile count. So per-token addressing is 32-bit: each lane locates its own
// token once per tile (one block-table read) and the row offsets travel by shuffle, in
// 16-byte units (the host checks they fit 32 bits). Nsight Compute on the H200, llama3_8b
// B=64 L=8192, INT8 K+V, with the heads-first order: 306 -> 283 us, 78% -> 82% of peak DRAM
// throughput.
//
// On sm_90 the op launches this kernel as a programmatic dependent launch (PDL): after
// quantize_int8 it locates its tokens and starts its first tile copies before waiting for the
// query, and it lets the split combine launch once its tiles are done. Under CUDA graphs on
// the H200 that took 0.8-1.2 µs off an INT8 call at B=1 (2026-11-30; docs/cuda-decode.md).
//
// Bounds: lengths, starts and block ids are clamped exactly as in the Triton kernel, so bad
// values (unchecked on the GPU) never move a read outside the cache, the table or the query;
// a block id in [-num_blocks, 0) wraps first, as `cache[block_table]` indexes. A window's
// start lies in [0, seq_len] after the length's clamp, so it moves no read either.
//
// Non-finite values, as eager SDPA gives them over a row's keys (the op's reference; keys before a
// window are not the row's): a NaN or +inf score (from the query, K, or a scale) makes the row NaN
// (with a soft cap +-inf scores become +-softcap, so only a NaN does). Such a score turns the
// running sum l into NaN and keeps it so (exp2 of NaN, or of +inf minus the +inf max), so l alone
// marks the row, with no test per tile; the merges pass a NaN l on as a NaN row and log-sum-exp. A
// K scale that is not finite counts as NaN (its dequantized row holds a NaN), and so does an INT8 V
// scale: P' = p * v_scale in fp16 cannot carry an Inf (kPMax), so an infinite V scale makes
// the row NaN where eager SDPA has +-Inf in the dims whose int8 value is not 0. Tokens past a
// split's end read the sequence's last token with weight 0, so an Inf in that token's 16-bit
// V gives NaN in its dims where eager SDPA gives +-Inf.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

// K/V rows are read with a 128-byte L2 prefetch size: a 64-byte row (8-bit head_dim 64) then
// brings in the whole 128-byte line it shares with the neighbouring head's row, which that
// head's CTA (launched next to this one) reads soon after. On the H200 INT8 K+V tinyllama
// at B=64 got 3-4% faster and INT8 K 1-2%; rows of 128 bytes and more are unchanged, and a
// 256-byte size was up to 5% slower (2026-11-30; docs/cuda-decode.md).
#define PF_L2_HINT ".L2::128B"

// What a decode launch needs besides the tensors' data pointers and the stream; the fused
// launch's record is built once per call signature (cuda_native.DecodeLaunch mirrors this
// layout). sizes and strides: as pagedfuse_decode takes them; q_stride_h: the query's head
// stride in elements (read by the quantize); part_o, part_lse, q8, q_scale: byte offsets of
// the scratch in the caller's workspace. Outside the anonymous namespace: the C entry
// points take it, and a type of internal linkage would drop them from the exports.
struct DecodeLaunch {
  int32_t device, kind, out_dtype, index64, pdl, head_dim, heads, quantize;
  int32_t max_query, column_tiles, column_groups, causal;
  int64_t batch, num_kv_heads, splits, ctas;
  int64_t sizes[8];
  int64_t strides[15];
  int64_t q_stride_h;
  int64_t part_o, part_lse, q8, q_scale;
  float scale_log2, softcap;
};

namespace {

// A timeline of the decode's CTAs, in a profiling build only (-DPF_CTA_CLOCK; read by
// benchmarks/cta_clock.py): per CTA, %globaltimer (ns) at its start, once its warp 0 has
// done its tiles, and at its end, then its SM.
#ifdef PF_CTA_CLOCK
constexpr int kClockCtas = 1 << 16;  // CTAs stamped, the first of the grid
__device__ unsigned long long g_cta_clock[4 * kClockCtas];
__device__ __forceinline__ unsigned long long clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

constexpr int kColumns = 8;      // the MMAs' N: (query token, query head) columns per n-tile
constexpr int kBalancedMaxBatch = 2048;  // sequences the balanced grid takes (cuda_native's)
constexpr float kLazyMax = 8.f;  // log2 units the running max may lag behind
// INT8 V: P' = p * v_scale goes to fp16, and p < 2^kLazyMax, so P' is in fp16's range for V
// scales below 2^(16 - kLazyMax) = 256 (|V| < 32512 before quantization); past that it is
// held at fp16's largest value rather than overflowing to an Inf that a 0 in V makes NaN.
constexpr float kPMax = 65504.f;
constexpr float kLog2e = 1.4426950408889634f;

// What the cache holds; the codes are the C ABI's (cuda_native.KINDS lists them in order).
enum Kind : int { kInt8KV = 0, kInt8K = 1, kHalf = 2 };

// Bytes per K and V element, and the tokens of a warp's tile: 32 for INT8 V (two fp16 P·V
// MMA K steps; tuned when it was one int8 MMA's K), 16 for 16-bit V, 32 for 16-bit V at
// head_dim 64 (two MMA K steps; on the H200 4% faster for bf16 and 10% for INT8 K at B=64
// than 16; for INT8 V 64 measured no faster than 32) and
// for INT8 K at head_dim 128. There the 32-token tile takes 254 registers but halves the
// tiles and their softmax steps: in 4-warp CTAs (2 per SM rather than 3) llama3_8b at B=64
// then filled its waves with 1 split instead of 3, 2.5% faster at L=8192 on the H200, 1%
// slower at L=32768 (2026-11-30; docs/cuda-decode.md).
//
// Warps per CTA, and the most KV heads of one sequence the op has a CTA serve (its warps
// split each head's tiles; 1, 2 and 4 heads are built, and cuda_native.heads_per_cta picks
// the count per call). Serving several heads, a CTA's warps copy the same token rows at the
// same time, and fewer CTAs fill a wave. On the H200 at B=64 (2026-11-30, the native sweep
// of benchmarks/tuning/decode_sweeps.py), 4 heads of 2 warps took INT8 K+V and INT8 K at
// head_dim 128 1-2.5% under 1 head of 4 warps, and 2 heads of 4 warps every kind at
// head_dim 256 0.3-2%; bf16 at head_dim 128 and every kind at head_dim 64 were fastest
// with 1 head of 4 warps.
template <int KIND, int D>
struct Traits {
  static constexpr bool kOneHead = D == 64 || (KIND == kHalf && D == 128);
  static constexpr int warps = kOneHead ? 4 : 8;
  static constexpr int heads = kOneHead ? 1 : D == 128 ? 4 : 2;
  static constexpr int kb = KIND == kHalf ? 2 : 1;
  static constexpr int vb = KIND == kInt8KV ? 1 : 2;
  static constexpr int tile = KIND == kInt8KV || D == 64 || (KIND == kInt8K && D == 128) ? 32
                                                                                       : 16;
  static constexpr int rows = tile / 8;  // K rows per thread
};

// Columns of the MMAs beyond one n-tile of 8: a sequence's q_len query tokens times the
// group's query heads, token-major (column c is token c / group, head c % group), so a
// short query (speculative decoding, multi-token prediction) reads each K/V tile once for
// all its rows, as one token does. A warp of such a kernel carries NT n-tiles (its scores, P
// and O per tile: O takes NT * D / 4 registers), and a launch whose columns need more takes
// column_groups CTAs per KV head group, each on the next NT * 8 columns, reading the same
// K/V again (from L2 at best). NT = 2 is built where it fits the registers: head_dim 64 and
// INT8 K+V at 128 (its 16-bit V and INT8 K kinds there, and every kind at 256, take 190-255
// registers for one n-tile already). Four n-tiles at head_dim 64 (255 registers, 2 CTAs of 4
// warps per SM) took tinyllama's q_len 4 at B=64, L=8192 0.148-0.158 ms, where the Gluon
// prefill took 0.137-0.150 and two n-tiles at q_len 2 0.113-0.141 (2026-12-03). These
// kernels run on the split grid with 1 up to Traits::heads KV heads per CTA, which
// cuda_native.heads_per_cta picks as for one token: at B=64, L=8192 four heads a CTA (one
// wave of 128 CTAs where one head made 3.88 waves) took llama3_8b's INT8 K+V at q_len 4
// 0.301 ms against 0.324 (86% of the byte floor), at q_len 2 0.277 against 0.294, and its
// INT8 K at q_len 2 0.388 against 0.396 (2026-12-03). NT = 0 is the one-token kernel: one
// n-tile of the group's heads, none of the per-column positions, masks and indexing (on the
// H200 these cost the one-token decode 0-1.3% at B=64, L=8192 when it carried them,
// 2026-12-03).
template <int KIND, int D>
constexpr int kMaxColumnTiles = D == 64 || (KIND == kInt8KV && D == 128) ? 2 : 1;

// Column c's query token (from the sequence's first) and its query head within the KV
// head's group, token-major; in the one-token kernel (NT 0) c is the head.
template <int NT>
__device__ __forceinline__ int column_token(int c, int group) {
  return NT > 0 ? c / group : 0;
}
template <int NT>
__device__ __forceinline__ int column_head(int c, int group) {
  return NT > 0 ? c % group : c;
}

struct Args {
  const void* q;          // [T, Hq, D], head-contiguous, row stride q_stride_t: int8 from
                          // quantize_int8 (INT8 K) or the 16-bit query
  const float* q_scale;   // [T, Hq] contiguous (INT8 K)
  const int8_t* k;        // K/V caches, addressed in bytes
  const int8_t* v;
  const float* k_scale;   // INT8 K / INT8 V only
  const float* v_scale;
  const void* block_table;
  const void* seq_lens;
  const void* query_start;
  void* out;              // [T, Hq, D] contiguous, query dtype
  float* part_o;          // [splits, T, Hq, D] fp32 (splits > 1)
  float* part_lse;        // [splits, T, Hq] fp32, log2 domain
  float scale_log2;       // softmax scale * log2(e)
  float cap, cap_k;       // soft cap (kCap): softcap * log2(e) and 2 / softcap (soft_cap)
  int64_t window;         // keys a query reaches back, itself included; 0: unlimited
  int64_t num_tokens, num_q_heads;
  int group, num_blocks, max_blocks, batch, num_kv_heads;
  int page, page_shift;   // page_shift: log2(page) for a power of two, else -1
  int index64;            // bits 0, 1, 2: block_table, seq_lens, query_start are int64
  int max_query;          // query tokens per sequence this launch serves (others: none)
  int column_groups;      // CTAs per (KV head group, sequence, split), each on its columns
  int causal;             // a query token reads no key past its own position
  int query_pending;      // 1: the grid this launch follows (PDL) writes only q and q_scale,
                          // so lengths, table and cache are read before waiting for it
  int* counters;          // balanced grid: one per sequence and head group, zero between
                          // launches (part_o/part_lse then hold 2 pieces per CTA of
                          // H * group rows)
  int64_t q_stride_t, k_sh, v_sh, ks_sh, vs_sh, bt_sb;  // per-CTA bases: 64-bit (K/V bytes)
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

// The 16-bit MMA (fp32 accumulators c0..c3, in the same fragment places as mma_s8's).
template <typename E>
__device__ __forceinline__ void mma_16(float& c0, float& c1, float& c2, float& c3, uint32_t a0,
                                       uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// 16 bytes of the query from global memory, through the read-only path.
__device__ __forceinline__ void load_global16(const int8_t* p, uint32_t* w) {
  asm("ld.global.nc" PF_L2_HINT ".v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
      : "l"(p));
}

// Four 8x8 matrices of 16-bit elements from shared memory, transposed: lane L gives the
// address of row L % 8 of matrix L / 8 (16 bytes), and w[i] of thread (g, t) gets matrix i's
// rows 2t (low half) and 2t + 1 (high half) at column g.
__device__ __forceinline__ void ldmatrix_x4_trans(const void* p, uint32_t (&w)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
}

// Programmatic dependent launch (sm_90): a launch with the PDL attribute may start while the
// grid before it still runs; grid_wait() returns once that grid has finished and its writes
// are visible (at once without the attribute), and grid_release() lets the grid after this
// one start early (it waits the same way before reading what this one wrote).
__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// 2^x in one MUFU op (exp2f adds a denormal range fix around it); 2^-inf = 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two int8 values of a word, given offset by 128 (the word XOR 0x80808080), as an fp16 pair,
// exactly: the PRMT `sel` puts byte sel & 3 under the exponent byte 0x64 in the low half and
// byte (sel >> 8) & 3 in the high half, which reads as 1024 + (x + 128); one HSUB2 of 1152
// leaves x. Two instructions per pair where a conversion instruction per value would be 4.
__device__ __forceinline__ uint32_t int8_pair_to_half2(uint32_t offset_word, uint32_t sel) {
  const uint32_t biased = __byte_perm(offset_word, 0x64646464u, sel);
  const __half2 x = __hsub2(*reinterpret_cast<const __half2*>(&biased),
                            __half2half2(__ushort_as_half(0x6480)));  // 1152
  return *reinterpret_cast<const uint32_t*>(&x);
}

// Two values rounded to E and packed (the first in the low half).
template <typename E>
__device__ __forceinline__ uint32_t pack_16x2(float lo, float hi) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    const __nv_bfloat162 x = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&x);
  } else {
    const __half2 x = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&x);
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

template <typename E>
__device__ __forceinline__ E to_out(float x);
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
  asm volatile("cp.async.cg.shared.global" PF_L2_HINT " [%0], [%1], 16;\n" ::"r"(
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

// Where 16-byte chunk c of row r of a staged K or V tile (rows of W bytes) lies, in bytes
// from the tile's start. The layout lets every fragment read meet each of the 32 banks (4
// bytes wide, 128 bytes around) once, where plain rows met some banks 2-8 times:
//   K (kV false): the 8 lanes of a 16-byte read are the t of a g pair, reading chunks
//     t + 4i of a row of g and one of g + 1: chunk bit 2 flips with g's parity. 64-byte
//     rows (8-bit head_dim 64) lie two to 128 bytes of banks, so every 4 rows are followed by
//     a 64-byte gap: rows 4 apart fall in opposite halves.
//   V (kV true): an ldmatrix phase reads one chunk of 8 rows that differ in row bits 0, 2
//     and 3 (tokens {0, 1, 4, 5, 8, 9, 12, 13} + 2, + 16), which pick the chunk's bank group
//     (bit 0 picks the half of 128 bytes where two 64-byte rows share it).
// The XOR depends on a row's g (K) or on the lane (V) only, so a thread's reads are a few
// bases plus immediate offsets.
template <int W, bool kV, int kRowsPerG>
struct Staged {
  static constexpr int kChunks = W / 16;
  static constexpr bool kGaps = !kV && kChunks == 4;
  static_assert(kChunks >= 8 || kChunks == 4, "rows of 64 bytes or of 128 and more");
  static_assert(kV || kRowsPerG >= 2, "fragment reads this layout serves");
  __host__ __device__ static constexpr int gap(int rows) {
    return kGaps ? (rows + rows / 4) * W : rows * W;
  }
  __host__ __device__ static constexpr int bytes(int rows) { return gap(rows); }
  __device__ __forceinline__ static int at(int r, int c) {
    int f;
    if constexpr (kV) {
      f = kChunks == 4 ? (r >> 2) & 3 : (r & 1) | ((r >> 1) & 6);
    } else {
      f = kGaps ? 0 : ((r / kRowsPerG) & 1) << 2;
    }
    return gap(r) + ((c ^ f) << 4);
  }
};

// Copies a tile's R rows from one head of a cache into `dst`, chunk c of row r at
// Layout::at(r, c): the rows' 16-byte chunks go row-major over the warp, so consecutive lanes
// read consecutive chunks of a row. `at` is this lane's token's row offset in 16-byte units
// (lane L located token L), shuffled to the lanes that copy that row.
template <int R, typename Layout>
__device__ __forceinline__ void cp_async_rows(int8_t* dst, const int8_t* head, uint32_t at,
                                              int lane) {
  constexpr int kChunks = Layout::kChunks;  // per row
  static_assert(32 % kChunks == 0 && R * kChunks % 32 == 0, "row chunks");
  const int8_t* col = head + (lane % kChunks) * 16;
#pragma unroll
  for (int c = 0; c < R * kChunks / 32; ++c) {
    const int row = c * (32 / kChunks) + lane / kChunks;
    const uint32_t src = __shfl_sync(0xffffffffu, at, row);
    cp_async16(dst + Layout::at(row, lane % kChunks), col + static_cast<size_t>(src) * 16);
  }
}

// One warp's tile in shared memory: the tile's rows of K and of V (bytes), and their scales.
template <int D, int KIND>
struct TileBuf {
  using T = Traits<KIND, D>;
  using KAt = Staged<D * T::kb, false, T::rows>;  // where the K and V chunks lie
  using VAt = Staged<D * T::vb, true, T::rows>;
  int8_t k[KAt::bytes(T::tile)];
  int8_t v[VAt::bytes(T::tile)];
  float ks[T::tile];
  float vs[T::tile];
};

// Tiles in flight per warp (the stages of its cp.async pipeline) while it computes one.
// Loading each tile straight into registers as it starts, and 2 stages, measured slower on
// the H200 for every format (2026-11-30; docs/cuda-decode.md); 2 stages of 8 warps at
// head_dim 256 would not fit in shared memory. With two n-tiles of columns (a tile's MMAs
// and softmax twice over) 2 stages took INT8 K+V at head_dim 128 0.99x the time and bf16
// at 64 1.04x (q_len 2-4, B=64, L=8192, 2026-12-03).
constexpr int kStages = 1;

// Dynamic shared memory: the warps' pipelines, reused for the merge of the warps at the end.
template <int D, int KIND>
__host__ __device__ constexpr size_t smem_bytes() {
  constexpr int warps = Traits<KIND, D>::warps;
  const size_t pipeline = sizeof(TileBuf<D, KIND>) * kStages * warps;
  const size_t merge = sizeof(float) * warps * kColumns * D;
  return pipeline > merge ? pipeline : merge;
}

// CTAs per SM that ptxas must leave room for. 1 (rather than no bound) leaves it free with
// registers (head_dim 128 INT8 K+V: about 200, so 1 CTA of 8 warps per SM), which on the
// H200 measured up to 4% faster for the INT8 kinds than 4-warp builds held to 3 CTAs at
// head_dim 128 and 5 at 8-bit head_dim 64, and as fast for 16-bit caches
// (2026-11-30). INT8 K+V at head_dim 64 is held to 4 (128 registers, no spill), where it
// measured fastest; left free, ptxas takes 140-146 and 3 CTAs
// fit. The short-query kernels (NT > 0) are left free: their scores and O need the
// registers.
template <int D, int KIND, int NT>
constexpr int kMinCtas = KIND == kInt8KV && D == 64 && NT == 0 ? 4 : 1;

// The log2-domain log-sum-exp of a row whose scores peak at m and whose exponentials sum to
// l (-inf for a row without keys, NaN for a NaN row).
__device__ __forceinline__ float log_sum_exp2(float m, float l) {
  return l > 0.f ? m + log2f(l) : l == 0.f ? -INFINITY : l;
}

// One sequence's lengths, clamped as the Triton kernel clamps them, and the first key its
// queries read: its q_len query tokens sit at positions len - q_len .. len - 1 (bottom-right
// aligned), so a window reaches back to len - q_len + 1 - window. A sequence of more than
// a.max_query tokens counts as one without any (q_end == q_start): in a batch that mixes
// decode rows with prompt chunks this grid serves the one-token queries and the prefill
// kernel the others (a call's hint or sizes give every sequence at most max_query tokens
// otherwise, so it never meets one).
struct Seq {
  int64_t len, q_start, q_end, first;
};
__device__ __forceinline__ Seq sequence(const Args& a, int b) {
  const int64_t len = clamp(load_index(a.seq_lens, b, a.index64 & 2), 0,
                            static_cast<int64_t>(a.max_blocks) * a.page);
  const int64_t q_start = clamp(load_index(a.query_start, b, a.index64 & 4), 0, a.num_tokens);
  const int64_t q_end =
      clamp(load_index(a.query_start, b + 1, a.index64 & 4), q_start, a.num_tokens);
  const int64_t n = q_end - q_start <= a.max_query ? q_end - q_start : 0;
  const int64_t reach = len - n + 1 - a.window;  // with a window: its earliest key
  return {len, q_start, q_start + n, a.window > 0 && reach > 0 ? reach : 0};
}

// softcap * tanh(score / softcap) in the log2 domain: for s = score * log2(e) and C =
// softcap * log2(e) it is C tanh(s / C) = C - 2C / (1 + 2^(2 s / softcap)). Two MUFU ops;
// the error is that of ex2.approx and the fast division, a few ulp of C (tanh's own
// cancellation near 0 costs nothing here: the score's absolute error is what the softmax
// sees). +-inf give +-C, NaN stays NaN.
__device__ __forceinline__ float soft_cap(float s, float cap, float cap_k) {
  return fmaf(-2.f * cap, __fdividef(1.f, 1.f + exp2_ftz(s * cap_k)), cap);
}

// One CTA's pass over keys [kv_lo, kv_hi) of sequence b (its q_len query tokens from
// q_start, seq_len keys) for KV heads kvh0 .. kvh0 + H - 1 and the NT * 8 columns from col0
// (kMaxColumnTiles): the warps stream their tiles, the CTA merges them, and each row's
// result goes to emit(slot, c, d, value, m, l) (column c: query token q_start + c / group,
// query head c % group of KV head kvh0 + slot; m, l: its max score and sum of
// exponentials, log2 domain). Column c's query sits at key position seq_len - q_len + c /
// group and reads the keys up to it (a.causal; else all of them) and, with a window, none
// a window's length or more before it. It ends with __syncthreads, so the CTA may run
// another span after it. H: KV heads per CTA. NT: n-tiles of columns (0: one query token,
// q_len 1 and col0 0). kCap: scores are soft-capped (soft_cap). E: the output dtype, also
// the query's, and the 16-bit cache's.
template <int D, int KIND, int H, int NT, bool kCap, typename E, typename Emit>
__device__ __forceinline__ void decode_span(const Args& a, int b, int kvh0, int64_t seq_len,
                                            int64_t q_start, int q_len, int col0,
                                            int64_t kv_lo, int64_t kv_hi, Emit emit) {
  constexpr int S = kStages;
  static_assert(S >= 1, "a cp.async pipeline of at least one stage");
  constexpr bool kShort = NT > 0;       // several query tokens per sequence
  constexpr int kNT = kShort ? NT : 1;  // n-tiles of columns
  using T = Traits<KIND, D>;
  constexpr bool kK8 = KIND != kHalf, kV8 = KIND == kInt8KV;
  constexpr int kWarps = T::warps, kTile = T::tile;
  constexpr int KR = D * T::kb / 4;  // K bytes per row per thread (its chunks t + 4i)
  constexpr int KW = KR / 4;         // ... in words
  constexpr int KC = KR / 16;        // K chunks per row per thread
  constexpr int VD = D / 8;          // output dims per thread: 2 of each 16
  constexpr int ROWS = T::rows;      // K rows per thread: tokens g ROWS + j
  // ldmatrix.x4 reads of a V tile: 8-bit V, one per 16 dims (32 tokens); 16-bit V, one per
  // 16 dims and 16 tokens.
  constexpr int VX = kV8 ? D / 16 : D / 16 * (kTile / 16);
  constexpr int PW = kTile * 2 / 16;  // P^T words per thread (16-bit P)
  // P's type: V's for a 16-bit V cache; fp16 for INT8 V, whose int8 values are exact in it
  using P = std::conditional_t<kV8, __half, E>;
  using Buf = TileBuf<D, KIND>;
  using KAt = typename Buf::KAt;
  using VAt = typename Buf::VAt;

  // 128-byte aligned: a staged 128-byte row of K or V then lies in one 128-byte line of
  // shared memory. Behind the balanced grid's static variables the region began 64 or 96
  // bytes past a line (16-byte alignment); on the H200 67% of that kernel's L2 lookups then
  // hit instead of 1%, with the same DRAM bytes (its copies reaching L2 as partial lines, it
  // seems), and it streamed up to 1.6% slower (2026-11-30).
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float s_m[kWarps][kColumns], s_l[kWarps][kColumns];
  // P of one tile per warp, [head][token], 16-bit (P): 256 bytes for 16-token tiles, 512
  // for 32. A thread writes one word per head (two for 32-token tiles).
  __shared__ __align__(16) unsigned char s_p[kWarps][kColumns * kTile * 2];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // KV heads kvh0 .. kvh0 + H - 1, head_warps warps each on their tiles of the span
  static_assert(kWarps % H == 0, "every KV head of a CTA has as many warps");
  constexpr int head_warps = kWarps / H, cta_tokens = head_warps * kTile;
  const int kvh = kvh0 + warp / head_warps, head_warp = warp % head_warps;
  const int group = a.group;
  Buf* bufs = reinterpret_cast<Buf*>(smem) + warp * S;
  const int8_t* k_head = a.k + kvh * a.k_sh;
  const int8_t* v_head = a.v + kvh * a.v_sh;
  const float* ks_head = a.k_scale + kvh * a.ks_sh;
  const float* vs_head = a.v_scale + kvh * a.vs_sh;
  const int64_t first = kv_lo + head_warp * kTile;  // this warp's tiles: first + i * cta_tokens
  const int num_tiles =
      first < kv_hi ? static_cast<int>((kv_hi - first + cta_tokens - 1) / cta_tokens) : 0;

  const bool table64 = a.index64 & 1;
  const int64_t table_row = static_cast<int64_t>(b) * a.bt_sb;
  const int last = seq_len > 0 ? static_cast<int>(seq_len - 1) : 0;
  // A token's rows: the block id from the table, clamped into the cache; tokens past the
  // sequence read its last token (their scores are masked).
  auto locate = [&](int64_t tok64) -> TokenAt {
    const int tok = tok64 < last ? static_cast<int>(tok64) : last;
    const int page_idx = a.page_shift >= 0 ? tok >> a.page_shift : tok / a.page;
    const uint32_t slot = tok - page_idx * a.page;
    const int64_t id = load_index(a.block_table, table_row + page_idx * a.bt_sn, table64);
    const auto blk = static_cast<uint32_t>(clamp(id < 0 ? id + a.num_blocks : id, 0,
                                                 a.num_blocks - 1));
    return {blk * a.k_sb + slot * a.k_st, blk * a.v_sb + slot * a.v_st,
            blk * a.ks_sb + slot * a.ks_st, blk * a.vs_sb + slot * a.vs_st};
  };
  auto locate_lane = [&](int i) {  // lane L: token L of tile i (L mod kTile)
    return locate(first + static_cast<int64_t>(i) * cta_tokens + lane % kTile);
  };
  // Copies tile i into its stage: lane L fetches row L's scales, then the K and V rows.
  auto issue = [&](int i, TokenAt at) {
    Buf& buf = bufs[i % S];
    if constexpr (kK8) {
      if (lane < kTile) cp_async4(&buf.ks[lane], ks_head + at.ks);
    }
    if constexpr (kV8) cp_async4(&buf.vs[lane], vs_head + at.vs);
    cp_async_rows<kTile, KAt>(buf.k, k_head, at.k, lane);
    cp_async_rows<kTile, VAt>(buf.v, v_head, at.v, lane);
  };

  // Per n-tile n: this thread's columns 2t, 2t + 1 (h) of the scores, and its O rows.
  float m[kNT][2], l[kNT][2], o[kNT][2][VD];
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[n][h] = -INFINITY, l[n][h] = 0.f;
#pragma unroll
      for (int i = 0; i < VD; ++i) o[n][h][i] = 0.f;
    }

  // Prologue: the first S tiles in flight, and the rows of the next one located.
  TokenAt next_at{};
#pragma unroll
  for (int i = 0; i < S; ++i) {
    if (i < num_tiles) issue(i, locate_lane(i));
    cp_async_commit();  // empty groups keep the wait count uniform
  }
  if (num_tiles > 0) next_at = locate_lane(S);  // else no table row to read

  // Q^T fragments (B operand of Q·K^T) of column 8n + g: the 16-byte chunks t, t + 4, ... of
  // its row. Read after the first tiles are in flight: with query_pending they are the only
  // inputs the grid before may still be writing.
  if (a.query_pending) grid_wait();
  const int64_t head0 = static_cast<int64_t>(kvh) * group;
  const int columns = kShort ? q_len * group : group;  // the sequence's; this CTA's from col0
  uint32_t qf[kNT][KW];
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    const int c = col0 + kColumns * n + g;
    if (c < columns) {
      const int64_t token = q_start + column_token<NT>(c, group);
      const int8_t* q_row =
          static_cast<const int8_t*>(a.q) +
          (token * a.q_stride_t + (head0 + column_head<NT>(c, group)) * D) * T::kb;
#pragma unroll
      for (int k = 0; k < KC; ++k) load_global16(q_row + (t + 4 * k) * 16, qf[n] + 4 * k);
    } else {
#pragma unroll
      for (int i = 0; i < KW; ++i) qf[n][i] = 0;
    }
  }
  float qs[kNT][2];  // (q_scale *) softmax scale of columns 2t, 2t+1 (0 for padding columns)
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = col0 + kColumns * n + 2 * t + h;
      if constexpr (kK8) {
        const int64_t token = q_start + column_token<NT>(c, group);
        qs[n][h] = c < columns ? a.q_scale[token * a.num_q_heads + head0 +
                                           column_head<NT>(c, group)] * a.scale_log2
                               : 0.f;
      } else {
        qs[n][h] = c < columns ? a.scale_log2 : 0.f;
      }
    }
  // Keys some column must not see: from causal_lo on (past the first token's position), and
  // with a window those before window_hi (before the last token's window starts); tiles
  // that reach either are masked per score. One query token: causal_lo is seq_len.
  const int64_t causal_lo = a.causal ? seq_len - q_len + 1 : seq_len;
  const int64_t window_hi = a.window > 0 && q_len > 1 ? seq_len - a.window : INT64_MIN;

  // This thread's reads of a staged tile: K chunks t + 4c of row g ROWS (then + gap(j)), and
  // as lane L of an ldmatrix.x4, row L % 8 of matrix L / 8. 8-bit V: matrices 0-3 are
  // tokens {0, 1, 4, 5, 8, 9, 12, 13} + {0, 2, 16, 18} of one 16-dim chunk. 16-bit V: tokens
  // that + {0, 0, 2, 2} of 8-dim chunks {0, 1, 0, 1} of 16 dims (the m16n8k16 A fragment).
  int k_frag[KC];
#pragma unroll
  for (int c = 0; c < KC; ++c) k_frag[c] = KAt::at(g * ROWS, t + 4 * c);
  const int mat = lane >> 3, mrow = lane & 7;
  const int v_row = (kV8 ? 16 * (mat >> 1) + 2 * (mat & 1) : 2 * (mat >> 1)) +
                    4 * (mrow >> 1) + (mrow & 1);
  auto v_at = [&](int x) {  // ldmatrix x: 16 dims (and, 16-bit V, 16 tokens) of the tile
    constexpr int kDimChunks = D / 16;
    if constexpr (kV8) return VAt::at(v_row, x);
    return VAt::at(v_row + 16 * (x / kDimChunks), 2 * (x % kDimChunks) + (mat & 1));
  };

  unsigned char* p_row = s_p[warp];
  for (int i = 0; i < num_tiles; ++i) {
    const int64_t tile = first + static_cast<int64_t>(i) * cta_tokens;
    cp_async_wait<S - 1>();  // tile i has landed (this lane's copies) ...
    __syncwarp();            // ... and every lane's
    const Buf& buf = bufs[i % S];
    // K rows of tokens g ROWS + j with their scales (1 where the cache has none), and V.
    uint32_t kw[ROWS][KW], vm[VX][4];
    float ks[ROWS], vs[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        const uint4 x = *reinterpret_cast<const uint4*>(buf.k + k_frag[c] + KAt::gap(j));
        kw[j][4 * c] = x.x, kw[j][4 * c + 1] = x.y, kw[j][4 * c + 2] = x.z;
        kw[j][4 * c + 3] = x.w;
      }
      ks[j] = kK8 ? buf.ks[g * ROWS + j] : 1.f;  // adjacent: vector loads
      vs[j] = kV8 ? buf.vs[g * ROWS + j] : 1.f;
      // a scale that is not finite: NaN scores for the token (tokens past the end are masked)
      if (kK8 && !(fabsf(ks[j]) < INFINITY && fabsf(vs[j]) < INFINITY)) ks[j] = NAN;
    }
#pragma unroll
    for (int x = 0; x < VX; ++x) ldmatrix_x4_trans(buf.v + v_at(x), vm[x]);

    // S^T = K Q^T per n-tile n: m-tile mt holds tokens g ROWS + 2 mt (c0, c1) and g ROWS +
    // 2 mt + 1 (c2, c3).
    float sc[kNT][ROWS][2];
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int mt = 0; mt < ROWS / 2; ++mt) {
        const uint32_t(&k0)[KW] = kw[2 * mt];
        const uint32_t(&k1)[KW] = kw[2 * mt + 1];
        if constexpr (kK8) {
          int acc[4] = {0, 0, 0, 0};
#pragma unroll
          for (int c = 0; c < KW / 2; ++c) {
            mma_s8(acc, k0[2 * c], k1[2 * c], k0[2 * c + 1], k1[2 * c + 1], qf[n][2 * c],
                   qf[n][2 * c + 1]);
          }
          sc[n][2 * mt][0] = acc[0], sc[n][2 * mt][1] = acc[1];
          sc[n][2 * mt + 1][0] = acc[2], sc[n][2 * mt + 1][1] = acc[3];
        } else {
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int c = 0; c < KW / 2; ++c) {
            mma_16<E>(acc[0], acc[1], acc[2], acc[3], k0[2 * c], k1[2 * c], k0[2 * c + 1],
                      k1[2 * c + 1], qf[n][2 * c], qf[n][2 * c + 1]);
          }
          sc[n][2 * mt][0] = acc[0], sc[n][2 * mt][1] = acc[1];
          sc[n][2 * mt + 1][0] = acc[2], sc[n][2 * mt + 1][1] = acc[3];
        }
      }

    // Tile i is in registers, and its K fragments are spent: its stage takes tile i + S,
    // whose latency then hides behind the rest of this tile's math.
    __syncwarp();  // every lane has read its part of the stage
    if (i + S < num_tiles) issue(i + S, next_at);
    cp_async_commit();
    next_at = locate_lane(i + S + 1);

    // Online softmax per column (2t + h of each n-tile): the scores (soft-capped), the
    // tile's max, a lazy rescale, then P. Only tiles at a span's end or a causal or window
    // edge of the columns have keys to mask (a warp-uniform branch); a span never starts
    // before its sequence's window.
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        sc[n][j][0] *= qs[n][0] * ks[j];
        sc[n][j][1] *= qs[n][1] * ks[j];
        if constexpr (kCap) {
          sc[n][j][0] = soft_cap(sc[n][j][0], a.cap, a.cap_k);
          sc[n][j][1] = soft_cap(sc[n][j][1], a.cap, a.cap_k);
        }
      }
    if (tile + kTile > kv_hi || (kShort && (tile + kTile > causal_lo || tile < window_hi))) {
      const int64_t row0 = tile + g * ROWS;  // this thread's first token
      const int rest = static_cast<int>(kv_hi - row0);  // its tokens kept by the span
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // the column's query position (a padding column's lies past the keys): one token's
          // span ends before any key it must not see
          const int64_t pos =
              seq_len - q_len + column_token<NT>(col0 + kColumns * n + 2 * t + h, group);
          const int64_t keep_hi = kShort && a.causal ? pos - row0 : kTile;  // rows kept
          const int64_t drop_lo = kShort && a.window > 0 ? pos - a.window - row0 : -1;
#pragma unroll
          for (int j = 0; j < ROWS; ++j) {
            if (j >= rest || j > keep_hi || j <= drop_lo) sc[n][j][h] = -INFINITY;
          }
        }
    }
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      float tile_max[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < ROWS; ++j) mx = fmaxf(mx, sc[n][j][h]);
        tile_max[h] = warp_max_over_g(mx);
      }
      const bool grow0 = tile_max[0] > m[n][0] + kLazyMax;
      const bool grow1 = tile_max[1] > m[n][1] + kLazyMax;
      if (__any_sync(0xffffffffu, grow0 || grow1)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool grow = h == 0 ? grow0 : grow1;
          const float alpha = grow ? exp2_ftz(m[n][h] - tile_max[h]) : 1.f;  // 0 from -inf
          m[n][h] = grow ? tile_max[h] : m[n][h];
          l[n][h] *= alpha;
#pragma unroll
          for (int i = 0; i < VD; ++i) o[n][h][i] *= alpha;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_use = m[n][h] == -INFINITY ? 0.f : m[n][h];  // then every score is -inf
        float psum = 0.f;
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
          sc[n][j][h] = exp2_ftz(sc[n][j][h] - m_use);
          psum += sc[n][j][h];
        }
        l[n][h] += psum;  // per-thread partial; summed over g at the end
        if constexpr (kV8) {  // P' = p * v_scale (kept in fp16's range; kPMax)
#pragma unroll
          for (int j = 0; j < ROWS; ++j) {  // never 0 * a garbage scale
            sc[n][j][h] = sc[n][j][h] > 0.f ? fminf(sc[n][j][h] * vs[j], kPMax) : 0.f;
          }
        }
        uint32_t* dst =
            reinterpret_cast<uint32_t*>(p_row) + ((2 * t + h) * kTile + g * ROWS) / 2;
        if constexpr (ROWS == 4) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(pack_16x2<P>(sc[n][0][h], sc[n][1][h]),
                                                      pack_16x2<P>(sc[n][2][h], sc[n][3][h]));
        } else {
          static_assert(ROWS == 2, "16-bit P: tiles of 16 or 32 tokens");
          *dst = pack_16x2<P>(sc[n][0][h], sc[n][1][h]);
        }
      }
      __syncwarp();
      // P^T fragments of column 8n + g: tokens 4t..4t+3 of each 16, the V fragments' K order
      // (the m16n8k16 B fragment's k 2t, 2t + 1 are tokens 4t, 4t + 1 and its k 2t + 8,
      // 2t + 9 are tokens 4t + 2, 4t + 3).
      uint32_t pb[PW];
#pragma unroll
      for (int w = 0; w < PW; w += 2) {
        const uint2 x =
            *reinterpret_cast<const uint2*>(p_row + (g * kTile + 8 * w + 4 * t) * 2);
        pb[w] = x.x, pb[w + 1] = x.y;
      }
      __syncwarp();  // the next n-tile or tile rewrites s_p

      if constexpr (kV8) {
        // O^T += V^T P'^T per 16 dims x, in two k16 steps of 16 tokens: ldmatrix gave tokens
        // 4t, 4t + 1 (word 0) and 4t + 2, 4t + 3 (word 1) of dims 2g, 2g + 1, the next 16
        // tokens in words 2, 3; each A register is one dim's two tokens of one word, as
        // fp16 (int8_pair_to_half2). m-tile rows g, g + 8 are dims 16x + 2g (c0, c1) and
        // 16x + 2g + 1 (c2, c3).
        static_assert(kTile == 32, "INT8 V: two P·V MMA K steps per tile");
#pragma unroll
        for (int x = 0; x < VX; ++x) {
          const uint32_t(&w)[4] = vm[x];
#pragma unroll
          for (int kk = 0; kk < 2; ++kk) {
            const uint32_t lo = w[2 * kk] ^ 0x80808080u, hi = w[2 * kk + 1] ^ 0x80808080u;
            mma_16<__half>(o[n][0][2 * x], o[n][1][2 * x], o[n][0][2 * x + 1],
                           o[n][1][2 * x + 1], int8_pair_to_half2(lo, 0x4240),
                           int8_pair_to_half2(lo, 0x4341), int8_pair_to_half2(hi, 0x4240),
                           int8_pair_to_half2(hi, 0x4341), pb[2 * kk], pb[2 * kk + 1]);
          }
        }
      } else {
        // O^T += V^T P^T per 16 dims and 16 tokens: ldmatrix gave the A fragment as it is.
        // m-tile rows g, g + 8 are dims 16c + g (c0, c1) and 16c + g + 8 (c2, c3).
#pragma unroll
        for (int x = 0; x < VX; ++x) {
          const int c = x % (D / 16), kk = x / (D / 16);
          mma_16<E>(o[n][0][2 * c], o[n][1][2 * c], o[n][0][2 * c + 1], o[n][1][2 * c + 1],
                    vm[x][0], vm[x][1], vm[x][2], vm[x][3], pb[2 * kk], pb[2 * kk + 1]);
        }
      }
    }
  }

  grid_release();  // a split combine after this grid may start; it waits for these writes
#ifdef PF_CTA_CLOCK
  if (threadIdx.x == 0 && blockIdx.x < kClockCtas) g_cta_clock[4 * blockIdx.x + 1] = clock_ns();
#endif

  // Merge the warps, one n-tile at a time: each publishes its (m, l, O) per column; the CTA
  // combines them. O goes where the pipelines were, so every warp must be done with its
  // tiles first.
  cp_async_wait<0>();
  auto s_o = reinterpret_cast<float(*)[kColumns][D]>(smem);
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    const int first_col = col0 + kColumns * n;
    const int cols = columns - first_col < kColumns ? columns - first_col : kColumns;
    if (cols <= 0) break;  // the same for the whole CTA
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float lsum = warp_sum_over_g(l[n][h]);
      if (g == 0) s_m[warp][2 * t + h] = m[n][h], s_l[warp][2 * t + h] = lsum;
#pragma unroll
      for (int i = 0; i < VD; ++i) {  // o[h][2c + e]: dim 16c + 2g + e (8-bit V), 16c + g + 8e
        const int dim = 16 * (i / 2) + (kV8 ? 2 * g + i % 2 : g + 8 * (i % 2));
        s_o[warp][2 * t + h][dim] = o[n][h][i];
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < H * cols * D; idx += kWarps * 32) {
      const int r = idx / D, d = idx % D;
      const int slot = r / cols, c = r % cols;  // KV head kvh0 + slot, column first_col + c
      const int w0 = slot * head_warps;         // its warps
      float mx = -INFINITY;
#pragma unroll
      for (int w = w0; w < w0 + head_warps; ++w) mx = fmaxf(mx, s_m[w][c]);
      const float m_use = mx == -INFINITY ? 0.f : mx;
      float lsum = 0.f, acc = 0.f;
#pragma unroll
      for (int w = w0; w < w0 + head_warps; ++w) {
        const float e = exp2f(s_m[w][c] - m_use);
        lsum += e * s_l[w][c];
        acc += e * s_o[w][c][d];
      }
      emit(slot, first_col + c, d, lsum != lsum ? NAN : acc / (lsum > 0.f ? lsum : 1.f), m_use,
           lsum);
    }
  }
  __syncthreads();  // the next span reuses the shared memory
}

// The split grid: one CTA per (column group, group of H KV heads, sequence, split), column
// groups then heads fastest, each on its split's chunk of the keys the queries read (from
// their window's start); with more than one split a combine kernel merges them.
template <int D, int KIND, int H, int NT, bool kCap, typename E>
__device__ __forceinline__ void split_grid(const Args& a) {
  using T = Traits<KIND, D>;
  constexpr int cta_tokens = T::warps / H * T::tile;  // split chunks are multiples of it
  const int head_groups = a.num_kv_heads / H, col_groups = a.column_groups;
  const int col0 = static_cast<int>(blockIdx.x % col_groups) * NT * kColumns;  // 0 for NT 0
  const unsigned cell = blockIdx.x / col_groups;
  const int kvh0 = static_cast<int>(cell % head_groups) * H;
  const unsigned rest = cell / head_groups;
  const int b = static_cast<int>(rest % a.batch), split = static_cast<int>(rest / a.batch);
  const int splits = static_cast<int>(gridDim.x / (col_groups * head_groups * a.batch));

  if (!a.query_pending) grid_wait();  // everything may come from the grid before
  const Seq s = sequence(a, b);
  const int q_len = static_cast<int>(s.q_end - s.q_start);
  if (col0 >= q_len * a.group) return;  // no query token, or no column of this group
  const int64_t chunk = ((s.len - s.first + splits - 1) / splits + cta_tokens - 1) /
                        cta_tokens * cta_tokens;
  const int64_t kv_lo = s.first + split * chunk;
  const int64_t kv_hi = kv_lo + chunk < s.len ? kv_lo + chunk : s.len;
  const int64_t rows = a.num_tokens * a.num_q_heads;
  E* out = static_cast<E*>(a.out);
  decode_span<D, KIND, H, NT, kCap, E>(a, b, kvh0, s.len, s.q_start, q_len, col0, kv_lo, kv_hi,
                                       [&](int slot, int c, int d, float val, float m, float l) {
    const int64_t row = (s.q_start + column_token<NT>(c, a.group)) * a.num_q_heads +
                        static_cast<int64_t>(kvh0 + slot) * a.group + column_head<NT>(c, a.group);
    if (splits == 1) {
      out[row * D + d] = to_out<E>(val);
    } else {
      a.part_o[(split * rows + row) * D + d] = val;
      if (d == 0) a.part_lse[split * rows + row] = log_sum_exp2(m, l);
    }
  });
}

// Four floats from global memory through L2 only: the balanced grid's merge reads pieces
// other CTAs wrote during this launch.
__device__ __forceinline__ float4 load_l2(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));
}

// The balanced grid: as many CTAs as the split grid would launch (cuda.balanced_ctas; a multiple of
// the head groups), CTA c serving head group c % groups, each with an equal share of all the
// launch's key steps (cta_tokens keys of one sequence, from its window's start), in (sequence,
// keys) order: CTAs c and c + 1 stream the same token rows of neighbouring heads at the same time,
// as the split grid's heads-first order does (on the H200 a (sequence, head group, keys) order was
// 20% slower at B=64). A share is a run of steps: whole items (sequence, head group) in the middle,
// written straight to the output, and at most two pieces of items shared with the CTAs before and
// after it, written to its two partial slots. The CTA whose piece completes an item's steps (an
// atomic count per item, which it resets to 0 for the next launch) merges the pieces in CTA order,
// so the result does not depend on which CTA that is. With equal lengths the shares are the split
// grid's chunks; with unequal ones a long sequence is spread over many CTAs, where the split grid
// gives it as many as a short one; and no combine kernel runs.
template <int D, int KIND, int H, bool kCap, typename E>
__device__ __forceinline__ void balanced_grid(const Args& a) {
  using T = Traits<KIND, D>;
  constexpr int kWarps = T::warps, kThreads = kWarps * 32;
  constexpr int cta_tokens = kWarps / H * T::tile;
  constexpr int kRounds = kBalancedMaxBatch / kThreads;  // sequences per thread in the scan
  static_assert(kBalancedMaxBatch % kThreads == 0, "whole rounds of sequences");
  static_assert(D % 4 == 0, "the merge reads 4 dims at a time");
  __shared__ int64_t s_warp_steps[kWarps];
  __shared__ int64_t s_base;  // the first step of sequence s_seq, where the share starts
  __shared__ int64_t s_steps, s_lo, s_hi;  // all steps; the share: steps lo .. hi - 1
  __shared__ int s_seq, s_merge;
  // The piece loop's state, in shared memory (iteration k's in [k & 1], written by thread 0
  // before its span) rather than in registers live across the span's tile loop: held in
  // registers it took the balanced kernel 16 registers over the split grid's and made its
  // tile loop 19% slower on the H200 (2026-11-30).
  struct Piece {
    int64_t pos, taken;  // its first step and step count
    int64_t base, n;     // its sequence's first step and step count
    int64_t row0, slot;  // its first output row, and its partial slot (unless whole)
    int b, whole;        // its sequence; whether it is the sequence's whole item
  };
  __shared__ Piece s_piece[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int groups = a.num_kv_heads / H, rows = H * a.group;
  const int hg = static_cast<int>(blockIdx.x % groups);
  const int64_t ctas = gridDim.x / groups, cta = blockIdx.x / groups;  // within head group hg
  E* out = static_cast<E*>(a.out);

  if (!a.query_pending) grid_wait();  // everything may come from the grid before
  // Steps of a sequence: none without a query token, one for a query without keys (its
  // output is still written).
  const auto steps_of = [](const Seq& s) -> int64_t {
    if (s.q_end == s.q_start) return 0;
    return s.len == 0 ? 1 : (s.len - s.first + cta_tokens - 1) / cta_tokens;
  };
  // An exclusive scan of the sequences' steps to find where this CTA's share starts: sequence
  // j kThreads + t is thread t's in round j, all rounds' lengths loaded at once, then one
  // block scan per round the batch reaches (a batch of up to kThreads takes one load per
  // thread, where runs of kRounds sequences per thread left a few threads loading them all).
  int64_t n_of[kRounds], before_of[kRounds], steps = 0;
#pragma unroll
  for (int j = 0; j < kRounds; ++j) {
    const int seq = j * kThreads + threadIdx.x;
    n_of[j] = seq < a.batch ? steps_of(sequence(a, seq)) : 0;
  }
#pragma unroll
  for (int j = 0; j < kRounds; ++j) {
    before_of[j] = steps;
    if (j * kThreads >= a.batch) continue;  // the same for every thread: no barrier skipped
    int64_t upto = n_of[j];  // this warp's sequences of the round up to this thread's
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t x = __shfl_up_sync(0xffffffffu, upto, o);
      if (lane >= o) upto += x;
    }
    if (lane == 31) s_warp_steps[warp] = upto;
    __syncthreads();
    before_of[j] += upto - n_of[j];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      before_of[j] += w < warp ? s_warp_steps[w] : 0;
      steps += s_warp_steps[w];
    }
    __syncthreads();  // the next round rewrites s_warp_steps
  }
  // Where CTA c's share of `total` steps starts (the merge passes the total from shared
  // memory, so no register holds it through the spans).
  const auto share_start = [ctas](int64_t c, int64_t total) { return c * total / ctas; };
  const int64_t lo = share_start(cta, steps), hi = share_start(cta + 1, steps);
#pragma unroll
  for (int j = 0; j < kRounds; ++j) {  // the sequence of step lo
    if (before_of[j] <= lo && lo < before_of[j] + n_of[j]) {
      s_seq = j * kThreads + threadIdx.x, s_base = before_of[j];
    }
  }
  if (threadIdx.x == 0) s_steps = steps, s_lo = lo, s_hi = hi;
  __syncthreads();
  if (cta >= ctas || lo >= hi) return;  // more CTAs than steps

  for (int k = 0;; ++k) {
    int64_t pos = s_lo, base = s_base;
    int b = s_seq;
    if (k > 0) {
      const Piece& p = s_piece[(k - 1) & 1];
      pos = p.pos + p.taken, base = p.base, b = p.b;
    }
    const int64_t end = s_hi;
    if (pos >= end) break;
    Seq s = sequence(a, b);
    int64_t n = steps_of(s);
    while (pos >= base + n) {  // past this sequence's steps (or it has none)
      base += n, ++b;
      s = sequence(a, b);
      n = steps_of(s);
    }
    const int64_t s0 = pos - base, s1 = s0 + (end - pos) < n ? s0 + (end - pos) : n;
    if (threadIdx.x == 0) {
      // Slot 0 for the share's first piece, 1 for its last (the merge below finds them so).
      s_piece[k & 1] = {pos, s1 - s0, base, n,
                        s.q_start * a.num_q_heads + static_cast<int64_t>(hg) * rows,
                        2 * static_cast<int64_t>(blockIdx.x) + (pos == s_lo ? 0 : 1), b,
                        s0 == 0 && s1 == n};
    }
    const int64_t kv_lo = s.first + s0 * cta_tokens, kv_end = s.first + s1 * cta_tokens;
    const int64_t kv_hi = kv_end < s.len ? kv_end : s.len;
    decode_span<D, KIND, H, 0, kCap, E>(a, b, hg * H, s.len, s.q_start, 1, 0, kv_lo, kv_hi,
                                        [&](int slot, int c, int d, float val, float m,
                                            float l) {
      const int r = slot * a.group + c;  // one query token: column c is head c
      const Piece& p = s_piece[k & 1];
      if (p.whole) {
        out[(p.row0 + r) * D + d] = to_out<E>(val);
      } else {
        a.part_o[(p.slot * rows + r) * D + d] = val;
        if (d == 0) a.part_lse[p.slot * rows + r] = log_sum_exp2(m, l);
      }
    });
    const Piece& p = s_piece[k & 1];
    if (p.whole) continue;

    // Publish the piece; the one that completes the item's steps merges.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const int item = p.b * groups + hg, taken = static_cast<int>(p.taken);
      const bool last = atomicAdd(a.counters + item, taken) + taken == p.n;
      if (last) a.counters[item] = 0;  // every piece has counted: ready for the next launch
      s_merge = last;
    }
    __syncthreads();
    if (!s_merge) continue;
    __threadfence();
    // The item's pieces: those of the head group's CTAs c_lo .. c_hi that have a share (with
    // more CTAs than steps some have none); c_lo's is its slot 1 where the item starts after
    // its share does. Each thread merges 4 dims of a row, kBatch pieces' loads in flight at
    // once, with a running max. The shares' starts are stepped along the CTAs (start(c) =
    // c q + (c rem) / ctas), as a 64-bit division per piece and thread made the merge of
    // many pieces slow.
    const auto owner = [&](int64_t step) { return ((step + 1) * ctas - 1) / s_steps; };
    const int64_t c_lo = owner(p.base), c_hi = owner(p.base + p.n - 1);
    const int64_t q = s_steps / ctas, rem = s_steps % ctas;
    const int64_t start_lo = share_start(c_lo, s_steps), frac_lo = c_lo * rem % ctas;
    constexpr int kBatch = 4;
    for (int idx = threadIdx.x; idx < rows * D / 4; idx += kThreads) {
      const int r = idx / (D / 4), d = idx % (D / 4) * 4;
      float m = -INFINITY, l = 0.f;
      bool nan_row = false;  // a piece's log-sum-exp is NaN
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      int64_t start = start_lo, frac = frac_lo;  // CTA c's share start, (c rem) % ctas
      for (int64_t c0 = c_lo; c0 <= c_hi; c0 += kBatch) {
        float lse[kBatch];
        float4 o[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int64_t c = c0 + j;
          frac += rem;
          const int64_t next = start + q + (frac >= ctas ? 1 : 0);
          frac -= frac >= ctas ? ctas : 0;
          lse[j] = -INFINITY, o[j] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (c <= c_hi && start < next) {
            const int64_t at =
                (2 * (c * groups + hg) + (c == c_lo && start < p.base ? 1 : 0)) * rows + r;
            lse[j] = __ldcg(a.part_lse + at);
            o[j] = load_l2(a.part_o + at * D + d);
          }
          start = next;
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          nan_row |= lse[j] != lse[j];
          const float m_new = fmaxf(m, lse[j]);
          if (m_new == -INFINITY) continue;  // no keys so far
          const float keep = exp2f(m - m_new), w = exp2f(lse[j] - m_new);
          l = l * keep + w;
          acc.x = acc.x * keep + w * o[j].x, acc.y = acc.y * keep + w * o[j].y;
          acc.z = acc.z * keep + w * o[j].z, acc.w = acc.w * keep + w * o[j].w;
          m = m_new;
        }
      }
      const float inv = nan_row ? NAN : 1.f / (l > 0.f ? l : 1.f);
      E* dst = out + (p.row0 + r) * D + d;
      dst[0] = to_out<E>(acc.x * inv), dst[1] = to_out<E>(acc.y * inv);
      dst[2] = to_out<E>(acc.z * inv), dst[3] = to_out<E>(acc.w * inv);
    }
  }
}

// kBalanced: the balanced grid, else the split grid (two kernels: the balanced grid's loop
// over pieces takes the split grid's 4-warp variants up to 40 more registers, 2 CTAs per SM
// instead of 3); it serves one query token per sequence (NT 0). kCap: soft-capped scores, a
// kernel of its own, so that a call without a cap runs none of its instructions.
template <int D, int KIND, int H, int NT, bool kBalanced, bool kCap, typename E>
__global__ void __launch_bounds__(Traits<KIND, D>::warps * 32, kMinCtas<D, KIND, NT>)
    paged_decode_kernel(const Args a) {
  static_assert(!kBalanced || NT == 0, "the balanced grid: one query token per sequence");
#ifdef PF_CTA_CLOCK
  const unsigned long long clock_start = clock_ns();
  if (threadIdx.x == 0 && blockIdx.x < kClockCtas) g_cta_clock[4 * blockIdx.x + 1] = clock_start;
#endif
  if constexpr (kBalanced) {
    balanced_grid<D, KIND, H, kCap, E>(a);
  } else {
    split_grid<D, KIND, H, NT, kCap, E>(a);
  }
#ifdef PF_CTA_CLOCK
  __syncthreads();
  if (threadIdx.x == 0 && blockIdx.x < kClockCtas) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    unsigned long long* stamp = g_cta_clock + 4 * blockIdx.x;
    stamp[0] = clock_start, stamp[2] = clock_ns(), stamp[3] = sm;
  }
#endif
}

// How one call launches: the grid's splits (or, balanced, its CTAs), KV heads per CTA and
// n-tiles of columns per warp, as a programmatic dependent launch or not, on which stream of
// which device.
struct Launch {
  int splits, ctas, heads, tiles;
  bool pdl;
  cudaStream_t stream;
  int device;
};

// A kernel of the (D, KIND) variant with its shared memory opted in beyond the 48 KB
// default (a per-device setting).
template <int D, int KIND, typename Kernel>
cudaError_t opt_in(Kernel kernel) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem_bytes<D, KIND>()));
}

// opt_in once per kernel and device (of the first 64): the attribute call costs host time
// on every eager launch otherwise. `done` is the kernel's own set of devices opted in; a bit
// is set only after a successful opt-in, so a failure is returned again on the next launch;
// two threads may both opt in, which is harmless.
template <int D, int KIND, typename Kernel>
cudaError_t opt_in_once(Kernel kernel, int device, std::atomic<uint64_t>& done) {
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  const cudaError_t opted = opt_in<D, KIND>(kernel);
  if (opted == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_relaxed);
  return opted;
}

// One variant: launch it on a grid of (column groups, groups of H KV heads, sequences,
// splits), or of l.ctas CTAs (the balanced grid).
template <int D, int KIND, int H, int NT, bool kBalanced, bool kCap, typename E>
cudaError_t launch(const Args& a, const Launch& l) {
  using T = Traits<KIND, D>;
  const auto kernel = paged_decode_kernel<D, KIND, H, NT, kBalanced, kCap, E>;
  static std::atomic<uint64_t> opted_in{0};  // this instantiation's: one per kernel
  const cudaError_t opted = opt_in_once<D, KIND>(kernel, l.device, opted_in);
  if (opted != cudaSuccess) return opted;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(
      kBalanced ? l.ctas : a.column_groups * (a.num_kv_heads / H) * a.batch * l.splits));
  config.blockDim = dim3(T::warps * 32);
  config.dynamicSmemBytes = smem_bytes<D, KIND>(), config.stream = l.stream;
  config.attrs = &attr, config.numAttrs = l.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, a);
}

// The grid (balanced or split; NT > 0: split) with or without the soft cap (a.cap > 0).
template <int D, int KIND, int H, int NT, typename E>
cudaError_t launch_grid(const Args& a, const Launch& l) {
  if constexpr (NT > 0) {
    if (l.ctas > 0) return cudaErrorInvalidValue;
    return a.cap > 0.f ? launch<D, KIND, H, NT, false, true, E>(a, l)
                       : launch<D, KIND, H, NT, false, false, E>(a, l);
  } else {
    if (a.cap > 0.f) {
      return l.ctas > 0 ? launch<D, KIND, H, 0, true, true, E>(a, l)
                        : launch<D, KIND, H, 0, false, true, E>(a, l);
    }
    return l.ctas > 0 ? launch<D, KIND, H, 0, true, false, E>(a, l)
                      : launch<D, KIND, H, 0, false, false, E>(a, l);
  }
}

// CTAs of a kernel that fit on one multiprocessor at once (registers and shared memory).
template <int D, int KIND, typename Kernel>
cudaError_t resident(Kernel kernel, int* ctas) {
  const cudaError_t opted = opt_in<D, KIND>(kernel);
  if (opted != cudaSuccess) return opted;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      ctas, kernel, Traits<KIND, D>::warps * 32, smem_bytes<D, KIND>());
}

// The short-query kernels of NT n-tiles (1 up to kMaxColumnTiles) on the split grid, with
// l.heads KV heads per CTA: 1, 2 or 4 up to the kind's Traits::heads (only those are built).
template <int D, int KIND, int NT, typename E>
cudaError_t launch_short(const Args& a, const Launch& l) {
  constexpr int kHeads = Traits<KIND, D>::heads;
  switch (l.heads) {
    case 1: return launch_grid<D, KIND, 1, NT, E>(a, l);
    case 2: if constexpr (kHeads >= 2) return launch_grid<D, KIND, 2, NT, E>(a, l);
      return cudaErrorInvalidValue;
    case 4: if constexpr (kHeads >= 4) return launch_grid<D, KIND, 4, NT, E>(a, l);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

// The (D, KIND) variants: launch the one-token kernel (l.tiles 0) of l.heads KV heads per CTA
// (1, 2 or 4) or a short-query kernel of l.tiles n-tiles (launch_short), or with info set (no
// launch) write, for l.tiles, that kernel's CTAs per multiprocessor on the split grid (with
// the tuned KV heads per CTA, Traits::heads), warps per CTA, tokens per warp tile, those KV
// heads per CTA, the one-token kernel's CTAs per multiprocessor on the balanced grid and
// kMaxColumnTiles to info[0..5].
template <int D, int KIND, typename E>
cudaError_t run_variant(const Args& a, const Launch& l, int* info) {
  using T = Traits<KIND, D>;
  constexpr int kMaxNT = kMaxColumnTiles<KIND, D>;
  if (info != nullptr) {
    info[1] = T::warps, info[2] = T::tile, info[3] = T::heads;
    info[5] = kMaxNT;
    const cudaError_t balanced = resident<D, KIND>(
        paged_decode_kernel<D, KIND, T::heads, 0, true, false, E>, info + 4);
    if (balanced != cudaSuccess) return balanced;
    switch (l.tiles) {
      case 0: return resident<D, KIND>(
          paged_decode_kernel<D, KIND, T::heads, 0, false, false, E>, info);
      case 1: return resident<D, KIND>(
          paged_decode_kernel<D, KIND, T::heads, 1, false, false, E>, info);
      case 2: if constexpr (kMaxNT >= 2) return resident<D, KIND>(
          paged_decode_kernel<D, KIND, T::heads, 2, false, false, E>, info);
        return cudaErrorInvalidValue;
      default: return cudaErrorInvalidValue;
    }
  }
  if (l.heads < 1 || a.num_kv_heads % l.heads != 0) return cudaErrorInvalidValue;
  if (l.ctas > 0 && (a.batch > kBalancedMaxBatch || a.counters == nullptr ||
                     l.ctas % (a.num_kv_heads / l.heads) != 0 || l.tiles != 0)) {
    return cudaErrorInvalidValue;
  }
  switch (l.tiles) {
    case 0: break;
    case 1: return launch_short<D, KIND, 1, E>(a, l);
    case 2: if constexpr (kMaxNT >= 2) return launch_short<D, KIND, 2, E>(a, l);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
  switch (l.heads) {
    case 1: return launch_grid<D, KIND, 1, 0, E>(a, l);
    case 2: return launch_grid<D, KIND, 2, 0, E>(a, l);
    case 4: return launch_grid<D, KIND, 4, 0, E>(a, l);
    default: return cudaErrorInvalidValue;
  }
}

// The built head_dim variants of one kind (cuda_native.HEAD_DIMS lists the same).
template <int KIND, typename E>
cudaError_t dispatch_dims(const Args& a, int head_dim, const Launch& l, int* info) {
  switch (head_dim) {
    case 64: return run_variant<64, KIND, E>(a, l, info);
    case 128: return run_variant<128, KIND, E>(a, l, info);
    case 256: return run_variant<256, KIND, E>(a, l, info);
    default: return cudaErrorInvalidValue;
  }
}

template <typename E>
cudaError_t dispatch(const Args& a, int kind, int head_dim, const Launch& l, int* info) {
  switch (kind) {
    case kInt8KV: return dispatch_dims<kInt8KV, E>(a, head_dim, l, info);
    case kInt8K: return dispatch_dims<kInt8K, E>(a, head_dim, l, info);
    case kHalf: return dispatch_dims<kHalf, E>(a, head_dim, l, info);
    default: return cudaErrorInvalidValue;
  }
}

// ---- The fused launch's other grids: quantize_int8 of the query before an INT8 K decode,
// and the split combine after it. They replace two Triton launches, whose host cost (about
// 40 µs each on the H200 box) was most of an eager decode call's.

constexpr int kQuantizeWarps = 4;  // rows per CTA of the quantize grid: one warp each

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// quantize_int8, bit for bit as pagedfuse/ops/reference.quantize_int8_reference: per row,
// scale = max|x| / 127 and q = x / scale rounded to nearest, ties to even, both IEEE
// divisions (a NaN in the row makes its scale NaN, an Inf makes it Inf; a quotient that is
// NaN is stored as 0; a zero scale divides by 1). Row r of `rows` sits at x + (r / heads) *
// stride_outer + (r % heads) * stride_inner (elements), its row_len elements contiguous;
// q [rows, row_len] and scale [rows] are contiguous. Each CTA lets a programmatic dependent
// launch after this grid start once its rows are written (the decode waits for the whole
// grid before reading q).
template <typename X>
__global__ void __launch_bounds__(kQuantizeWarps * 32)
    quantize_rows_kernel(const X* x, int8_t* q, float* scale, int64_t rows, int64_t heads,
                         int64_t stride_outer, int64_t stride_inner, int64_t row_len) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row < rows) {
    const X* src = x + row / heads * stride_outer + row % heads * stride_inner;
    float amax = 0.f;
    bool nan = false;
    for (int64_t i = lane; i < row_len; i += 32) {
      const float v = to_float(src[i]);
      nan |= v != v;
      amax = fmaxf(amax, fabsf(v));  // fmaxf drops a NaN: `nan` carries it
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = __any_sync(0xffffffffu, nan) ? NAN : __fdiv_rn(amax, 127.f);
    const float safe = s > 0.f ? s : 1.f;
    int8_t* dst = q + row * row_len;
    for (int64_t i = lane; i < row_len; i += 32) {
      const float r = rintf(__fdiv_rn(to_float(src[i]), safe));
      dst[i] = static_cast<int8_t>(r != r ? 0.f : fminf(fmaxf(r, -127.f), 127.f));
    }
    if (lane == 0) scale[row] = s;
  }
  grid_release();
}

// The split combine, as the Triton combine_splits_kernel (triton_paged.py) computes it: row
// `row` (a token's head) of out from its `splits` partial rows and log2-domain log-sum-exps
// (part_o [splits, rows, D], part_lse [splits, rows]). A split enters with weight 0 where
// its lse is -inf (its partial row counts, so a NaN there shows), and one NaN lse makes the
// row NaN. Launched after the decode grid, as a programmatic dependent launch where that
// one was: it waits for the grid before reading.
template <typename E>
__global__ void combine_kernel(const float* part_o, const float* part_lse, E* out,
                               int64_t rows, int splits, int head_dim) {
  grid_wait();
  const int64_t row = blockIdx.x;
  float m = -INFINITY;
  bool bad = false;
  for (int s = 0; s < splits; ++s) {
    const float lse = part_lse[s * rows + row];
    bad |= lse != lse;
    m = fmaxf(m, lse);  // a NaN lse is left out of the max
  }
  const float shift = m == -INFINITY ? 0.f : m;
  for (int d = static_cast<int>(threadIdx.x); d < head_dim; d += static_cast<int>(blockDim.x)) {
    float total = 0.f, acc = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float w = exp2f(part_lse[s * rows + row] - shift);
      total += w;
      acc += w * part_o[(s * rows + row) * head_dim + d];
    }
    out[row * head_dim + d] = to_out<E>(bad ? NAN : acc / (total > 0.f ? total : 1.f));
  }
}

// A grid of `blocks` CTAs of `threads`, as a programmatic dependent launch with `pdl`.
template <typename Kernel, typename... Args>
cudaError_t launch_simple(Kernel kernel, unsigned blocks, unsigned threads, bool pdl,
                          cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks), config.blockDim = dim3(threads), config.stream = stream;
  config.attrs = &attr, config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <typename X>
cudaError_t launch_quantize(const void* x, int8_t* q, float* scale, int64_t rows,
                            int64_t heads, int64_t stride_outer, int64_t stride_inner,
                            int64_t row_len, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kQuantizeWarps - 1) / kQuantizeWarps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return launch_simple(quantize_rows_kernel<X>, static_cast<unsigned>(blocks),
                       kQuantizeWarps * 32, false, stream, static_cast<const X*>(x), q, scale,
                       rows, heads, stride_outer, stride_inner, row_len);
}

// The pointers of one decode launch (q, q_scale: the kernel's query, int8 and its scales
// with INT8 K).
struct Tensors {
  const void* q;
  const float* q_scale;
  const void *k, *v;
  const float *k_scale, *v_scale;
  const void *block_table, *seq_lens, *query_start;
  void* out;
  float *part_o, *part_lse;
  int* counters;
};

// The decode grid of `d` on `stream` (the device is current).
cudaError_t launch_decode(const DecodeLaunch& d, const Tensors& t, cudaStream_t stream) {
  Args a{};
  a.q = t.q, a.q_scale = t.q_scale, a.k_scale = t.k_scale, a.v_scale = t.v_scale;
  a.k = static_cast<const int8_t*>(t.k), a.v = static_cast<const int8_t*>(t.v);
  a.block_table = t.block_table, a.seq_lens = t.seq_lens, a.query_start = t.query_start;
  a.out = t.out, a.part_o = t.part_o, a.part_lse = t.part_lse, a.scale_log2 = d.scale_log2;
  if (d.softcap > 0.f) a.cap = d.softcap * kLog2e, a.cap_k = 2.f / d.softcap;  // else no cap
  const int64_t* sizes = d.sizes;
  a.num_tokens = sizes[0], a.num_q_heads = sizes[1];
  a.group = static_cast<int>(sizes[2]), a.num_blocks = static_cast<int>(sizes[3]);
  a.max_blocks = static_cast<int>(sizes[4]), a.page = static_cast<int>(sizes[5]);
  a.page_shift = static_cast<int>(sizes[6]), a.window = sizes[7];
  a.index64 = d.index64, a.query_pending = d.pdl == 2;
  a.max_query = d.max_query, a.column_groups = d.column_groups, a.causal = d.causal;
  // the one-token kernel serves one token of the group's heads; a short-query kernel's
  // column groups hold every column of a sequence of max_query tokens
  if (d.column_tiles == 0 ? d.max_query != 1 || d.column_groups != 1
                          : d.max_query < 1 || d.column_groups < 1 ||
                                static_cast<int64_t>(d.column_groups) * d.column_tiles *
                                        kColumns < static_cast<int64_t>(d.max_query) * sizes[2]) {
    return cudaErrorInvalidValue;
  }
  a.batch = static_cast<int>(d.batch), a.num_kv_heads = static_cast<int>(d.num_kv_heads);
  a.counters = t.counters;
  // The caller checked: K/V strides are 16-byte multiples and every per-token offset fits
  // 32 bits (K/V in 16-byte units, scales and the table in elements).
  const auto u32 = [](int64_t x) { return static_cast<uint32_t>(x); };
  const int64_t* strides = d.strides;
  a.q_stride_t = strides[0];
  a.k_sb = u32(strides[1] / 16), a.k_st = u32(strides[2] / 16), a.k_sh = strides[3];
  a.v_sb = u32(strides[4] / 16), a.v_st = u32(strides[5] / 16), a.v_sh = strides[6];
  a.ks_sb = u32(strides[7]), a.ks_st = u32(strides[8]), a.ks_sh = strides[9];
  a.vs_sb = u32(strides[10]), a.vs_st = u32(strides[11]), a.vs_sh = strides[12];
  a.bt_sb = strides[13], a.bt_sn = u32(strides[14]);
  const Launch l{static_cast<int>(d.splits), static_cast<int>(d.ctas), d.heads,
                 d.column_tiles, d.pdl > 0, stream, d.device};
  return d.out_dtype == 0 ? dispatch<__nv_bfloat16>(a, d.kind, d.head_dim, l, nullptr)
                          : dispatch<__half>(a, d.kind, d.head_dim, l, nullptr);
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

// The decode grid of `d` alone on `stream` (the caller's current torch stream), with the
// kernel's query q (int8 from quantize_int8 with INT8 K, its scales in q_scale, else the
// 16-bit query; token stride d->strides[0]) and the partial buffers given; d->quantize is
// not read. Returns a cudaError_t code.
// DecodeLaunch's fields: kind: a Kind; out_dtype: 0 bfloat16, 1 float16 (also the query's,
// and a 16-bit cache's); index64: bits 0, 1, 2 set where block_table, seq_lens,
// query_start_loc are int64. pdl (sm_90 only): 0 a plain launch; 1 a programmatic dependent
// launch that waits for the grid before it ahead of its first read; 2 the same after a grid
// that writes only q and q_scale (quantize_int8, launched plainly), so everything else is
// read before the wait. softcap: scores become softcap * tanh(score / softcap) (0: no cap).
// sizes: num_tokens, num_q_heads, group, num_blocks, max_blocks, page, page_shift (-1
// unless a power of two), window (keys a query reaches back, itself included, at most
// max_blocks * page; 0: unlimited); strides: the query's token stride (elements), then
// (block, token, head) of K and of V in bytes, of K scales and V scales in elements, then
// the table's (row, column). heads: KV heads per CTA, 1, 2 or 4, dividing num_kv_heads (the
// op's choice: cuda_native.heads_per_cta). ctas > 0: the balanced grid of that many CTAs, a
// multiple of num_kv_heads / heads (splits unused; batch at most kBalancedMaxBatch;
// part_o/part_lse hold 2 * ctas pieces of heads * group rows; counters: batch *
// num_kv_heads / heads ints, zero, and zero again after the grid). max_query, column_tiles,
// column_groups: the query tokens per sequence served (sequences with more get no CTA) and
// the short-query kernel's n-tiles and column groups (kMaxColumnTiles), or 1, 0, 1 for the
// one-token kernel; causal: a query token reads no key past its position. The caller guarantees
// what cuda_native.decode_unsupported checks (alignment, 32-bit per-token offsets) and
// column_groups * num_kv_heads * batch * splits < 2^31.
int pagedfuse_decode(const DecodeLaunch* d, void* stream, const void* q, const float* q_scale,
                     const void* k, const void* v, const float* k_scale, const float* v_scale,
                     const void* block_table, const void* seq_lens, const void* query_start,
                     void* out, float* part_o, float* part_lse, int* counters) {
  const DeviceGuard guard(d->device);
  if (guard.status() != cudaSuccess) return guard.status();
  const Tensors t{q,        q_scale,     k,   v,      k_scale,  v_scale, block_table,
                  seq_lens, query_start, out, part_o, part_lse, counters};
  return launch_decode(*d, t, static_cast<cudaStream_t>(stream));
}

// One eager decode call in one host call, on `stream`: with d->quantize (INT8 K) the query
// quantized into the workspace (a plain launch), the decode grid (d->pdl: 0 plain, 1 a
// programmatic dependent launch that waits first, 2 one after the quantize that reads all
// but the query first), then with d->splits > 1 (and no balanced grid) the split combine
// into `out`, as a programmatic dependent launch where d->pdl is set. The scratch lives at
// d's byte offsets in `workspace` (16-byte aligned); counters: the balanced grid's, else
// unused. query: [T, Hq, D] of the out dtype, with token stride d->strides[0] (or, with
// quantize, the query's own token stride there and head stride d->q_stride_h; the decode
// then reads the contiguous int8 copy). Returns a cudaError_t code.
int pagedfuse_decode_fused(const DecodeLaunch* d, void* stream, const void* query,
                           const void* k, const void* v, const float* k_scale,
                           const float* v_scale, const void* block_table, const void* seq_lens,
                           const void* query_start, void* out, void* workspace,
                           int* counters) {
  const DeviceGuard guard(d->device);
  if (guard.status() != cudaSuccess) return guard.status();
  const auto s = static_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  const auto part_o = reinterpret_cast<float*>(ws + d->part_o);
  const auto part_lse = reinterpret_cast<float*>(ws + d->part_lse);
  const int64_t rows = d->sizes[0] * d->sizes[1];  // query rows: tokens x query heads
  DecodeLaunch dl = *d;
  Tensors t{query,    nullptr,     k,   v,      k_scale,  v_scale, block_table,
            seq_lens, query_start, out, part_o, part_lse, counters};
  if (d->quantize) {
    const auto q8 = reinterpret_cast<int8_t*>(ws + d->q8);
    const auto q_scale = reinterpret_cast<float*>(ws + d->q_scale);
    const cudaError_t quantized =
        d->out_dtype == 0
            ? launch_quantize<__nv_bfloat16>(query, q8, q_scale, rows, d->sizes[1],
                                             d->strides[0], d->q_stride_h, d->head_dim, s)
            : launch_quantize<__half>(query, q8, q_scale, rows, d->sizes[1], d->strides[0],
                                      d->q_stride_h, d->head_dim, s);
    if (quantized != cudaSuccess) return quantized;
    t.q = q8, t.q_scale = q_scale;
    dl.strides[0] = d->sizes[1] * d->head_dim;  // the int8 copy's token stride
  }
  if (d->splits == 1 && d->ctas == 0) t.part_o = t.part_lse = nullptr;  // unused
  const cudaError_t decoded = launch_decode(dl, t, s);
  if (decoded != cudaSuccess || d->splits <= 1 || d->ctas > 0) return decoded;
  if (rows > 0x7fffffff || d->splits > 0x7fffffff) return cudaErrorInvalidValue;
  const auto blocks = static_cast<unsigned>(rows);
  const int splits = static_cast<int>(d->splits);
  return d->out_dtype == 0
             ? launch_simple(combine_kernel<__nv_bfloat16>, blocks, d->head_dim, d->pdl > 0, s,
                             static_cast<const float*>(part_o),
                             static_cast<const float*>(part_lse),
                             static_cast<__nv_bfloat16*>(out), rows, splits, d->head_dim)
             : launch_simple(combine_kernel<__half>, blocks, d->head_dim, d->pdl > 0, s,
                             static_cast<const float*>(part_o),
                             static_cast<const float*>(part_lse), static_cast<__half*>(out),
                             rows, splits, d->head_dim);
}

// quantize_int8 of the contiguous [rows, row_len] x (dtype 0 bfloat16, 1 float16, 2 float32)
// into the contiguous q and scale, on `stream`; returns a cudaError_t code.
int pagedfuse_quantize(int device, void* stream, int dtype, const void* x, int8_t* q,
                       float* scale, int64_t rows, int64_t row_len) {
  const DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return guard.status();
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_quantize<__nv_bfloat16>(x, q, scale, rows, 1, row_len, 0, row_len, s);
    case 1: return launch_quantize<__half>(x, q, scale, rows, 1, row_len, 0, row_len, s);
    case 2: return launch_quantize<float>(x, q, scale, rows, 1, row_len, 0, row_len, s);
    default: return cudaErrorInvalidValue;
  }
}

// The (kind, head_dim) variant on `device` with `column_tiles` n-tiles of columns (0: the
// one-token kernel): CTAs per multiprocessor, warps per CTA, tokens per warp tile, default KV
// heads per CTA, the one-token kernel's CTAs per multiprocessor in the balanced grid and the
// most n-tiles built, into info[0..5]; returns a cudaError_t code (invalid value: no such
// build).
int pagedfuse_decode_variant(int device, int kind, int head_dim, int column_tiles, int* info) {
  const DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return guard.status();
  Launch l{};
  l.tiles = column_tiles;
  return dispatch<__nv_bfloat16>(Args{}, kind, head_dim, l, info);
}

// 0 when this build has machine code or PTX the device can run, else a cudaError_t code.
int pagedfuse_decode_probe(int device) {
  const DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return guard.status();
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr,
                               paged_decode_kernel<128, kInt8KV, 4, 0, false, false,
                                                   __nv_bfloat16>);
}

#ifdef PF_CTA_CLOCK
// The profiling build's stamps of the last decode's first n CTAs (4 per CTA) into out, from
// the current device; returns a cudaError_t code.
int pagedfuse_cta_clock(unsigned long long* out, int n) {
  return cudaMemcpyFromSymbol(out, g_cta_clock, sizeof(unsigned long long) * 4 *
                                                    (n < kClockCtas ? n : kClockCtas));
}
#endif

const char* pagedfuse_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
