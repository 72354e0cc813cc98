// Dispatcher: picks the ISA, quantises the int8 query once, splits the work into items,
// runs them over OpenMP and combines split-KV partials.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"

namespace pagedfuse {

namespace {

constexpr int64_t kMaxRows = 256;        // query rows (tokens x heads) per item
constexpr int64_t kItemsPerThread = 4;   // split the context when there are fewer items
constexpr int64_t kMinSplitKeys = 256;   // ... but never into splits shorter than this

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

struct SplitSeq {
  int64_t b, nsplit, partial_row;
};

struct Plan {
  std::vector<WorkItem> items;
  std::vector<SplitSeq> split;
  int64_t partial_rows = 0;
  int64_t max_rows = 0;
};

// Items over (sequence, chunk of query tokens); sequences with a single chunk are also split
// along the keys they read when the items alone would leave threads idle.
Plan make_plan(const PagedArgs& a) {
  const int64_t chunk = std::max<int64_t>(1, kMaxRows / a.num_q_heads);
  int64_t base = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    base += ceil_div(a.query_start_loc[b + 1] - a.query_start_loc[b], chunk);
  }
  const int64_t want = int64_t(a.threads) * kItemsPerThread;
  const int64_t factor = base > 0 && base < want ? ceil_div(want, base) : 1;
  Plan plan;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t q_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
    const int64_t len = a.seq_lens[b];
    if (q_len == 0) continue;
    const int64_t chunks = ceil_div(q_len, chunk);
    // With a window no token reads a key before the first token's window: splits cover
    // [first, len) only (each item narrows its range further to its own tokens' windows).
    const int64_t first =
        a.window_left > 0 ? std::clamp(len - q_len + 1 - a.window_left, int64_t(0), len) : 0;
    int64_t span = len - first, nsplit = 1;
    if (chunks == 1 && factor > 1) {  // a sequence without keys still has its one item
      span = ceil_div(std::max(kMinSplitKeys, ceil_div(len - first, factor)), kTile) * kTile;
      nsplit = std::max<int64_t>(1, ceil_div(len - first, span));
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t tok0 = c * chunk, ntok = std::min(chunk, q_len - tok0);
      plan.max_rows = std::max(plan.max_rows, ntok * a.num_q_heads);
      for (int64_t s = 0; s < nsplit; ++s) {
        plan.items.push_back({b, tok0, ntok, first + s * span,
                              std::min(len, first + (s + 1) * span), nsplit,
                              plan.partial_rows + s * q_len});
      }
    }
    if (nsplit > 1) {
      plan.split.push_back({b, nsplit, plan.partial_rows});
      plan.partial_rows += nsplit * q_len;
    }
  }
  return plan;
}

// out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max m): the softmax over all keys.
// A split whose keys are all masked (m_s = -inf) enters with weight 0, which keeps a NaN its
// weight-0 keys put in acc_s; a split with m_s NaN makes the row NaN.
void combine(const PagedArgs& a, const Plan& plan, const Partials& p) {
  const int64_t Hq = a.num_q_heads, D = a.head_dim;
  const int64_t elem = float_bytes(a.q_dtype);
  std::vector<int64_t> rows;  // (split sequence, local token) pairs, flattened
  for (int64_t k = 0; k < int64_t(plan.split.size()); ++k) {
    const int64_t b = plan.split[k].b;
    for (int64_t i = 0; i < a.query_start_loc[b + 1] - a.query_start_loc[b]; ++i) {
      rows.push_back(k);
      rows.push_back(i);
    }
  }
  const int64_t n = int64_t(rows.size()) / 2;
#pragma omp parallel num_threads(a.threads)
  {
    std::vector<float> sum(D);
#pragma omp for schedule(static)
    for (int64_t x = 0; x < n * Hq; ++x) {
      const SplitSeq& sp = plan.split[rows[2 * (x / Hq)]];
      const int64_t i = rows[2 * (x / Hq) + 1], h = x % Hq;
      const int64_t q_len = a.query_start_loc[sp.b + 1] - a.query_start_loc[sp.b];
      float mx = -INFINITY;
      for (int64_t s = 0; s < sp.nsplit; ++s) {
        const float m = p.m[(sp.partial_row + s * q_len + i) * Hq + h];
        mx = std::isnan(m) || m > mx ? m : mx;
      }
      float l = 0.0f;
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t s = 0; s < sp.nsplit && !std::isnan(mx); ++s) {
        const int64_t idx = (sp.partial_row + s * q_len + i) * Hq + h;
        const float w = mx == -INFINITY ? 0.0f : std::exp(p.m[idx] - mx);
        l += w * p.l[idx];
        for (int64_t d = 0; d < D; ++d) sum[d] += w * p.acc[idx * D + d];
      }
      void* dst = static_cast<char*>(a.out) +
                  ((a.query_start_loc[sp.b] + i) * Hq + h) * D * elem;
      store_row(dst, a.q_dtype, sum.data(), row_factor(mx, l), D);
    }
  }
}

enum class Isa { portable, avx512 };

Isa choose_isa() {
  const char* env = std::getenv("PAGEDFUSE_CPU_ISA");
  const std::string want = env ? env : "";
  if (want == "portable") return Isa::portable;
  if (want == "avx512") {
    if (!cpu_has_avx512_vnni()) {
      throw std::invalid_argument("PAGEDFUSE_CPU_ISA=avx512, but this CPU lacks AVX-512 VNNI");
    }
    return Isa::avx512;
  }
  if (!want.empty() && want != "auto") {
    throw std::invalid_argument("PAGEDFUSE_CPU_ISA: expected auto, portable or avx512, got '" +
                                want + "'");
  }
  return cpu_has_avx512_vnni() ? Isa::avx512 : Isa::portable;
}

ItemKernel item_kernel(Isa isa, int64_t head_dim) {
#if defined(__x86_64__)
  if (isa == Isa::avx512 && head_dim % 16 == 0) return run_item_avx512;
#endif
  (void)isa;
  (void)head_dim;
  return run_item_portable;
}

// Without the cache's block count a negative block id cannot wrap: refuse one in use rather
// than read before the cache.
void require_block_count_for_negative_ids(const PagedArgs& a) {
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t* row = a.block_table + b * a.max_blocks;
    for (int64_t i = 0; i < ceil_div(a.seq_lens[b], a.block_size); ++i) {
      if (row[i] < 0) {
        throw std::invalid_argument(
            "block_table: negative block id " + std::to_string(row[i]) + " in use, but the "
            "caller passed no num_blocks to wrap it by");
      }
    }
  }
}

}  // namespace

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

const char* selected_isa() { return choose_isa() == Isa::avx512 ? "avx512" : "portable"; }

void paged_attention(PagedArgs a) {
  if (a.num_blocks <= 0) require_block_count_for_negative_ids(a);
  const ItemKernel kernel = item_kernel(choose_isa(), a.head_dim);
  a.threads = std::max(1, a.threads);
  const int64_t Hq = a.num_q_heads, D = a.head_dim;

  std::vector<int8_t> q_i8;
  std::vector<float> q_scale;
  std::vector<int32_t> q_sum;
  if (a.key_scale) {  // quantise the query once per token and head, before any split
    const int64_t rows = a.num_tokens * Hq;
    const int64_t elem = float_bytes(a.q_dtype);
    q_i8.resize(rows * D);
    q_scale.resize(rows);
    q_sum.resize(rows);
#pragma omp parallel for num_threads(a.threads) schedule(static) if (rows * D > 65536)
    for (int64_t r = 0; r < rows; ++r) {
      const void* src = static_cast<const char*>(a.query) +
                        ((r / Hq) * a.q_stride[0] + (r % Hq) * a.q_stride[1]) * elem;
      q_scale[r] = quantize_row(src, a.q_dtype, D, q_i8.data() + r * D);
      int32_t sum = 0;
      for (int64_t d = 0; d < D; ++d) sum += q_i8[r * D + d];
      q_sum[r] = sum;
    }
    a.q_i8 = q_i8.data();
    a.q_scale = q_scale.data();
    a.q_sum = q_sum.data();
  }

  const Plan plan = make_plan(a);
  std::vector<float> partial(plan.partial_rows * Hq * (D + 2));
  const Partials parts{partial.data(), partial.data() + plan.partial_rows * Hq,
                       partial.data() + 2 * plan.partial_rows * Hq};
  const int64_t per_thread = workspace_floats(plan.max_rows, D);
  std::vector<float> workspace(per_thread * a.threads);
  const int64_t n_items = int64_t(plan.items.size());
#pragma omp parallel num_threads(a.threads)
  {
    float* ws = workspace.data() + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < n_items; ++k) kernel(a, plan.items[k], ws, parts);
  }
  if (!plan.split.empty()) combine(a, plan, parts);
}

}  // namespace pagedfuse
