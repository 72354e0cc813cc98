// The per-item attention kernel, written once over an ISA's primitives (dots_rows,
// dots_rows_i8, pv_tile, scale_row, exp_sub_sum, softcap_row). Included inside namespace
// pagedfuse::<isa> by each attention_<isa>.cpp, so every ISA gets its own copy compiled for
// its target.
//
// One item = some query tokens of one sequence x all query heads x a range of keys. Keys are
// taken kTile at a time, all KV heads of a page together (so pages stream in sequentially);
// the query heads of each GQA group are scored against their KV head's slice while it is
// hot, so each K/V page is read from memory once per item.

inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }
inline int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }
inline float maxf(float x, float y) { return x > y ? x : y; }

// Keys [j0, j0 + n) of one sequence: row pointers and scale offsets of KV head 0 (KV head
// kvh adds kvh times the head stride).
template <class KT, class VT>
struct Tile {
  const KT* k[kTile];
  const VT* v[kTile];
  int64_t k_scale[kTile];
  int64_t v_scale[kTile];
  int64_t n;
};

// One KV head's slice of a tile: what the dot products and the P.V update consume.
template <class KT, class VT>
struct HeadTile {
  const KT* k[kTile];
  const VT* v[kTile];
  float k_scale[kTile];
  float v_scale[kTile];
};

// A prefetch into L2. GCC deletes loops whose only effect is __builtin_prefetch, so x86 gets
// a volatile instruction.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) prefetch_line(c + o);
}

// Walks the block table from key j0; only table entries covering keys < seq_len are read, and
// those were validated to lie in [-num_blocks, num_blocks). A negative id wraps, as
// `cache[block_table]` indexes.
template <class KT, class VT>
inline void gather_tile(const PagedArgs& a, const int64_t* blocks, int64_t j0, int64_t n,
                        Tile<KT, VT>& t) {
  const KT* K = static_cast<const KT*>(a.key);
  const VT* V = static_cast<const VT*>(a.value);
  int64_t bi = j0 / a.block_size, off = j0 % a.block_size;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t blk = blocks[bi] < 0 ? blocks[bi] + a.num_blocks : blocks[bi];
    t.k[j] = K + blk * a.k_stride[0] + off * a.k_stride[1];
    t.v[j] = V + blk * a.v_stride[0] + off * a.v_stride[1];
    t.k_scale[j] = blk * a.ks_stride[0] + off * a.ks_stride[1];
    t.v_scale[j] = blk * a.vs_stride[0] + off * a.vs_stride[1];
    if (++off == a.block_size) { off = 0; ++bi; }
  }
  t.n = n;
}

// A K scale that is not finite becomes NaN: the dequantized key row it scales then holds a
// NaN (0 * Inf for its zero elements), so its dot products are NaN, not the integer dot
// times Inf.
template <class KT, class VT>
inline void head_tile(const PagedArgs& a, const Tile<KT, VT>& t, int64_t kvh,
                      HeadTile<KT, VT>& ht) {
  for (int64_t j = 0; j < t.n; ++j) {
    ht.k[j] = t.k[j] + kvh * a.k_stride[2];
    ht.v[j] = t.v[j] + kvh * a.v_stride[2];
    const float ks = a.key_scale ? a.key_scale[t.k_scale[j] + kvh * a.ks_stride[2]] : 1.0f;
    ht.k_scale[j] = std::isfinite(ks) ? ks : NAN;
    ht.v_scale[j] = a.value_scale ? a.value_scale[t.v_scale[j] + kvh * a.vs_stride[2]] : 1.0f;
  }
}

// Asks for the K/V rows (and scales) of keys [j_begin, j_end) of a tile, every KV head, in
// memory order, ahead of their use: pages are scattered, so the hardware prefetcher cannot
// guess them. Callers spread a tile's requests between computations.
template <class KT, class VT>
inline void prefetch_keys(const PagedArgs& a, const Tile<KT, VT>& t, int64_t j_begin,
                          int64_t j_end) {
  for (int64_t j = j_begin; j < j_end; ++j) {
    for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh) {
      prefetch_row(t.k[j] + kvh * a.k_stride[2], a.head_dim * int64_t(sizeof(KT)));
      if (a.key_scale) prefetch_line(a.key_scale + t.k_scale[j] + kvh * a.ks_stride[2]);
    }
    for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh) {
      prefetch_row(t.v[j] + kvh * a.v_stride[2], a.head_dim * int64_t(sizeof(VT)));
      if (a.value_scale) prefetch_line(a.value_scale + t.v_scale[j] + kvh * a.vs_stride[2]);
    }
  }
}

// attn_bias[b, h, i, j0 + j] for j < n, added into the scores; a bool False adds -inf, as
// SDPA applies a bool mask, so a masked key whose score is NaN (or +inf) still gives NaN.
inline void apply_bias(const PagedArgs& a, int64_t b, int64_t h, int64_t i, int64_t j0,
                       int64_t n, float* s) {
  const int64_t base = b * a.bias_stride[0] + h * a.bias_stride[1] + i * a.bias_stride[2];
  const int64_t sj = a.bias_stride[3];
  if (a.bias_kind == 1) {
    const uint8_t* keep = static_cast<const uint8_t*>(a.bias) + base;
    for (int64_t j = 0; j < n; ++j) if (!keep[(j0 + j) * sj]) s[j] += -INFINITY;
  } else {
    const float* add = static_cast<const float*>(a.bias) + base;
    for (int64_t j = 0; j < n; ++j) s[j] += add[(j0 + j) * sj];
  }
}

template <class KT, class VT>
void run_item_typed(const PagedArgs& a, const WorkItem& it, float* ws, const Partials& part) {
  constexpr bool kInt8 = sizeof(KT) == 1;
  // Explicit prefetch pays off for int8 pages (Xeon 4th gen, decode B=8, L=4096, one thread:
  // 11.5 ms with, 18 ms without); float pages stream well enough with the hardware
  // prefetcher, so there it would only cost issue slots.
  constexpr bool kPrefetch = kInt8;
  const int64_t D = a.head_dim, Hq = a.num_q_heads, G = Hq / a.num_kv_heads;
  // Rows are grouped by KV head: row r = kvh * per_head + i * G + g is local token i of the
  // item and query head kvh * G + g.
  const int64_t per_head = it.ntok * G, rows = per_head * a.num_kv_heads;
  float* q = ws;                // [rows, D] fp32 query (float op)
  float* acc = q + rows * D;    // [rows, D]
  float* s = acc + rows * D;    // [rows, kTile] scores, then weights of V
  float* m = s + rows * kTile;  // [rows] running max
  float* l = m + rows;          // [rows] running sum
  float* q_mul = l + rows;      // [rows] factor turning a dot product into a score

  const int64_t seq_start = a.query_start_loc[it.b];
  const int64_t q_len = a.query_start_loc[it.b + 1] - seq_start;
  const int64_t* blocks = a.block_table + it.b * a.max_blocks;
  auto token = [&](int64_t r) { return seq_start + it.tok0 + (r % per_head) / G; };
  auto head = [&](int64_t r) { return (r / per_head) * G + r % G; };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qrow = token(r) * Hq + head(r);
    if constexpr (kInt8) {
      q_mul[r] = a.q_scale[qrow] * a.scale;
    } else {
      const int64_t elem = float_bytes(a.q_dtype);
      const void* src = static_cast<const char*>(a.query) +
                        (token(r) * a.q_stride[0] + head(r) * a.q_stride[1]) * elem;
      for (int64_t d = 0; d < D; ++d) q[r * D + d] = load_scalar(src, a.q_dtype, d);
      q_mul[r] = a.scale;
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.0f;
  }

  // Local token i of the item sits at position first_end - 1 + i (bottom-right aligned, maybe
  // negative: a sequence may have more query tokens than keys). It reads keys < first_end + i
  // under causal, and with a window only keys >= first_end + i - window_left. The item walks
  // keys [begin, end): the union of its rows' ranges within [key0, key1), so a window's keys
  // are the only ones read.
  const int64_t first_end = a.seq_lens[it.b] - q_len + it.tok0 + 1;
  const int64_t end = a.causal ? min64(it.key1, first_end + it.ntok - 1) : it.key1;
  const int64_t begin = a.window_left > 0 ? max64(it.key0, first_end - a.window_left)
                                          : it.key0;
  // Keys [lo, hi) of the tile from j0 that local token i reads (hi <= lo: none). Both bounds
  // grow with i, so the first and last tokens agree only if every token does.
  struct Span { int64_t lo, hi; };
  auto keys_read = [&](int64_t i, int64_t j0, int64_t tile_n) {
    const int64_t row_begin = a.window_left > 0 ? first_end + i - a.window_left : begin;
    const int64_t row_end = a.causal ? min64(end, first_end + i) : end;
    return Span{max64(0, row_begin - j0), min64(tile_n, row_end - j0)};
  };
  // A ring of three tiles: tile n is computed while tile n + 2 is prefetched, a slice per
  // row, so every request has at least one tile of compute to arrive in.
  Tile<KT, VT> tiles[3];
  HeadTile<KT, VT> ht;
  for (int64_t k = 0; k < 2; ++k) {
    const int64_t j = begin + k * kTile;
    if (j >= end) break;
    gather_tile(a, blocks, j, min64(kTile, end - j), tiles[k]);
    if (kPrefetch) prefetch_keys(a, tiles[k], 0, tiles[k].n);
  }
  for (int64_t j0 = begin, cur = 0; j0 < end; j0 += kTile, cur = (cur + 1) % 3) {
    const Tile<KT, VT>& t = tiles[cur];
    Tile<KT, VT>& ahead = tiles[(cur + 2) % 3];
    const bool more = j0 + 2 * kTile < end;
    if (more) gather_tile(a, blocks, j0 + 2 * kTile, min64(kTile, end - j0 - 2 * kTile), ahead);
    for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh) {
      head_tile(a, t, kvh, ht);
      // Scores of the G rows of each token at once, then the online-softmax update row by
      // row; p[lo, hi) ends up holding the weights of V (softmax numerators times the V
      // scale), 0 for masked keys. A NaN or +inf score (after the soft cap, which takes
      // +-inf to +-softcap) makes the row NaN (m = NaN marks it), as in SDPA.
      for (int64_t i = 0; i < it.ntok; ++i) {
        const int64_t r0 = kvh * per_head + i * G;
        const Span rd = keys_read(i, j0, t.n);
        const int64_t lo = rd.lo, n = rd.hi - rd.lo;  // n <= 0: the token reads no key here
        if (n > 0) {
          if constexpr (kInt8) {
            const int64_t qrow = token(r0) * Hq + head(r0);
            dots_rows_i8(a.q_i8 + qrow * D, a.q_sum + qrow, G, ht.k + lo, n, D,
                         s + r0 * kTile + lo);
          } else {
            dots_rows(q + r0 * D, G, ht.k + lo, n, D, s + r0 * kTile + lo);
          }
        }
        for (int64_t r = r0; r < r0 + G; ++r) {
          float* p = s + r * kTile + lo;
          if (kPrefetch && more) {  // a slice of tile n + 2 per row keeps requests spread
            prefetch_keys(a, ahead, r * ahead.n / rows, (r + 1) * ahead.n / rows);
          }
          if (n <= 0) continue;
          bool live = false;  // p holds softmax numerators
          if (!std::isnan(m[r])) {
            for (int64_t j = 0; j < n; ++j) p[j] *= q_mul[r] * ht.k_scale[lo + j];
            if (a.softcap > 0.0f) softcap_row(p, n, a.softcap);
            if (a.bias_kind) apply_bias(a, it.b, head(r), it.tok0 + i, j0 + lo, n, p);
            float tile_max = -INFINITY;
            int bad = 0;  // a NaN or +inf score
#pragma omp simd reduction(max : tile_max) reduction(| : bad)
            for (int64_t j = 0; j < n; ++j) {
              tile_max = p[j] > tile_max ? p[j] : tile_max;
              bad |= !(p[j] < INFINITY);
            }
            if (bad) {
              m[r] = NAN;
            } else if (tile_max != -INFINITY) {  // else every key of the tile is masked
              const float m_new = maxf(m[r], tile_max);
              const float alpha = std::exp(m[r] - m_new);  // 0 on the row's first live tile
              l[r] = l[r] * alpha + exp_sub_sum(p, n, m_new);
              m[r] = m_new;
              if (alpha != 1.0f) scale_row(acc + r * D, alpha, D);
              live = true;
            }
          }
          if (!live) {
            for (int64_t j = 0; j < n; ++j) p[j] = 0.0f;
          }
          // A masked key (weight 0) still multiplies its V: 0 times a NaN or Inf is NaN.
          for (int64_t j = 0; j < n; ++j) p[j] *= ht.v_scale[lo + j];
        }
      }
      // P.V over the keys each row reads: one pass for all rows where every token reads the
      // same keys of the tile, else token by token (the causal diagonal, a window's start),
      // so a key a row does not read never multiplies into it.
      const Span first = keys_read(0, j0, t.n), last = keys_read(it.ntok - 1, j0, t.n);
      if (first.lo == last.lo && first.hi == last.hi) {
        if (last.hi > last.lo) {
          pv_tile(acc + kvh * per_head * D, per_head, D, s + kvh * per_head * kTile + last.lo,
                  ht.v + last.lo, last.hi - last.lo);
        }
      } else {
        for (int64_t i = 0; i < it.ntok; ++i) {
          const int64_t r0 = kvh * per_head + i * G;
          const Span rd = keys_read(i, j0, t.n);
          if (rd.hi > rd.lo) {
            pv_tile(acc + r0 * D, G, D, s + r0 * kTile + rd.lo, ht.v + rd.lo, rd.hi - rd.lo);
          }
        }
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = it.tok0 + (r % per_head) / G, h = head(r);
    if (it.nsplit == 1) {
      void* dst = static_cast<char*>(a.out) +
                  ((seq_start + i) * Hq + h) * D * float_bytes(a.q_dtype);
      store_row(dst, a.q_dtype, acc + r * D, row_factor(m[r], l[r]), D);
    } else {
      const int64_t idx = (it.partial_row + i) * Hq + h;
      part.m[idx] = m[r];
      part.l[idx] = l[r];
      for (int64_t d = 0; d < D; ++d) part.acc[idx * D + d] = acc[r * D + d];
    }
  }
}

inline void run_item_any(const PagedArgs& a, const WorkItem& it, float* ws, const Partials& p) {
  if (a.key_scale) {
    switch (a.v_dtype) {
      case Dtype::i8: return run_item_typed<int8_t, int8_t>(a, it, ws, p);
      case Dtype::f32: return run_item_typed<int8_t, float>(a, it, ws, p);
      case Dtype::bf16: return run_item_typed<int8_t, bf16_t>(a, it, ws, p);
      case Dtype::f16: return run_item_typed<int8_t, f16_t>(a, it, ws, p);
    }
  }
  switch (a.k_dtype) {
    case Dtype::f32: return run_item_typed<float, float>(a, it, ws, p);
    case Dtype::bf16: return run_item_typed<bf16_t, bf16_t>(a, it, ws, p);
    case Dtype::f16: return run_item_typed<f16_t, f16_t>(a, it, ws, p);
    case Dtype::i8: return;  // not a float op: validation never lets it through
  }
}
