// pybind11 module pagedfuse._C: raw pointers, sizes and strides in, nothing of libtorch.
// Callers (pagedfuse/ops/cpu.py) validate every argument before a pointer crosses over.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"

namespace py = pybind11;
using namespace pagedfuse;

namespace {

py::object field(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing argument: ") + key);
  return d[key];
}

int64_t int_arg(const py::dict& d, const char* key) { return field(d, key).cast<int64_t>(); }

template <class T = void>
T* ptr_arg(const py::dict& d, const char* key) {
  return reinterpret_cast<T*>(field(d, key).cast<uintptr_t>());
}

void strides_arg(const py::dict& d, const char* key, int64_t* dst, size_t n) {
  const auto v = field(d, key).cast<std::vector<int64_t>>();
  if (v.size() != n) {
    throw std::invalid_argument(std::string(key) + ": expected " + std::to_string(n) +
                                " strides, got " + std::to_string(v.size()));
  }
  for (size_t i = 0; i < n; ++i) dst[i] = v[i];
}

Dtype dtype_arg(const py::dict& d, const char* key) {
  const int64_t code = int_arg(d, key);
  if (code < 0 || code > 3) throw std::invalid_argument(std::string(key) + ": unknown dtype code");
  return static_cast<Dtype>(code);
}

PagedArgs parse(const py::dict& d) {
  PagedArgs a{};
  a.out = ptr_arg(d, "out");
  a.query = ptr_arg(d, "query");
  a.q_dtype = dtype_arg(d, "query_dtype");
  strides_arg(d, "query_strides", a.q_stride, 2);
  a.key = ptr_arg(d, "key_cache");
  a.k_dtype = dtype_arg(d, "key_dtype");
  strides_arg(d, "key_strides", a.k_stride, 3);
  a.value = ptr_arg(d, "value_cache");
  a.v_dtype = dtype_arg(d, "value_dtype");
  strides_arg(d, "value_strides", a.v_stride, 3);
  a.key_scale = ptr_arg<const float>(d, "key_scale");
  strides_arg(d, "key_scale_strides", a.ks_stride, 3);
  a.value_scale = ptr_arg<const float>(d, "value_scale");
  strides_arg(d, "value_scale_strides", a.vs_stride, 3);
  a.block_table = ptr_arg<const int64_t>(d, "block_table");
  a.max_blocks = int_arg(d, "max_blocks");
  a.num_blocks = d.contains("num_blocks") ? int_arg(d, "num_blocks") : 0;
  a.seq_lens = ptr_arg<const int64_t>(d, "seq_lens");
  a.query_start_loc = ptr_arg<const int64_t>(d, "query_start_loc");
  a.bias = ptr_arg(d, "attn_bias");
  a.bias_kind = static_cast<int>(int_arg(d, "bias_kind"));
  strides_arg(d, "bias_strides", a.bias_stride, 4);
  a.num_tokens = int_arg(d, "num_tokens");
  a.num_q_heads = int_arg(d, "num_q_heads");
  a.num_kv_heads = int_arg(d, "num_kv_heads");
  a.head_dim = int_arg(d, "head_dim");
  a.batch = int_arg(d, "batch");
  a.block_size = int_arg(d, "block_size");
  a.scale = field(d, "scale").cast<float>();
  a.causal = field(d, "causal").cast<bool>();
  a.window_left = int_arg(d, "window_left");
  a.softcap = field(d, "softcap").cast<float>();
  if (a.window_left < 0 || !(a.softcap >= 0.0f) || std::isinf(a.softcap)) {
    throw std::invalid_argument("window_left must be >= 0 and softcap finite and >= 0 "
                                "(0: off)");
  }
  a.threads = static_cast<int>(int_arg(d, "threads"));
  return a;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedfuse CPU kernels (raw pointers + strides; validated by the Python caller)";
  m.def(
      "paged_attention",
      [](const py::dict& args) {
        const PagedArgs a = parse(args);
        py::gil_scoped_release nogil;
        paged_attention(a);
      },
      "Fill out [T, Hq, D] with paged attention (int8 when key_scale != 0).");
  m.def(
      "quantize_int8",
      [](uintptr_t x, int64_t dtype, int64_t rows, int64_t n, uintptr_t q, uintptr_t scale,
         int threads) {
        if (dtype < 0 || dtype > 2) throw std::invalid_argument("x: dtype must be a float");
        py::gil_scoped_release nogil;
        quantize_rows(reinterpret_cast<const void*>(x), static_cast<Dtype>(dtype), rows, n,
                      reinterpret_cast<int8_t*>(q), reinterpret_cast<float*>(scale), threads);
      },
      "Quantise `rows` contiguous rows of n elements to int8 + float32 scale.");
  m.def("selected_isa", &selected_isa,
        "The ISA PAGEDFUSE_CPU_ISA (auto | portable | avx512) selects on this CPU.");
  m.def("cpu_has_avx512_vnni", &cpu_has_avx512_vnni);
}
