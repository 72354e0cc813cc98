// PagedArgs from the Python dict pagedfuse/ops/cpu.py builds: the one reader of that dict, for
// pagedfuse._C (pointers included, per call) and pagedfuse._host (the layout once per
// signature, pointers per call). Raises std::invalid_argument naming a missing or bad field.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"

namespace pagedfuse::args_dict {

namespace py = pybind11;

inline py::object field(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing argument: ") + key);
  return d[key];
}

inline int64_t int_arg(const py::dict& d, const char* key) {
  return field(d, key).cast<int64_t>();
}

template <class T = void>
T* ptr_arg(const py::dict& d, const char* key) {
  return reinterpret_cast<T*>(field(d, key).cast<uintptr_t>());
}

inline void ints_arg(const py::dict& d, const char* key, int64_t* dst, size_t n) {
  const auto v = field(d, key).cast<std::vector<int64_t>>();
  if (v.size() != n) {
    throw std::invalid_argument(std::string(key) + ": expected " + std::to_string(n) +
                                " values, got " + std::to_string(v.size()));
  }
  for (size_t i = 0; i < n; ++i) dst[i] = v[i];
}

inline Dtype dtype_arg(const py::dict& d, const char* key) {
  const int64_t code = int_arg(d, key);
  if (code < 0 || code > 3) throw std::invalid_argument(std::string(key) + ": unknown dtype code");
  return static_cast<Dtype>(code);
}

// Every field of `a` but its pointers and thread count: dtypes, strides, sizes and options.
inline void parse_layout(const py::dict& d, PagedArgs& a) {
  a.q_dtype = dtype_arg(d, "query_dtype");
  ints_arg(d, "query_strides", a.q_stride, 2);
  a.k_dtype = dtype_arg(d, "key_dtype");
  ints_arg(d, "key_strides", a.k_stride, 3);
  a.v_dtype = dtype_arg(d, "value_dtype");
  ints_arg(d, "value_strides", a.v_stride, 3);
  ints_arg(d, "key_scale_strides", a.ks_stride, 3);
  ints_arg(d, "value_scale_strides", a.vs_stride, 3);
  a.max_blocks = int_arg(d, "max_blocks");
  a.num_blocks = d.contains("num_blocks") ? int_arg(d, "num_blocks") : 0;
  a.bias_kind = static_cast<int>(int_arg(d, "bias_kind"));
  ints_arg(d, "bias_strides", a.bias_stride, 4);
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
}

}  // namespace pagedfuse::args_dict
