// pybind11 module pagedfuse._C: raw pointers, sizes and strides in, nothing of libtorch.
// Callers (pagedfuse/ops/cpu.py) validate every argument before a pointer crosses over.
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "args_dict.h"
#include "common.h"

namespace py = pybind11;
using namespace pagedfuse;
using args_dict::int_arg;
using args_dict::ptr_arg;

namespace {

PagedArgs parse(const py::dict& d) {
  PagedArgs a{};
  args_dict::parse_layout(d, a);
  a.out = ptr_arg(d, "out");
  a.query = ptr_arg(d, "query");
  a.key = ptr_arg(d, "key_cache");
  a.value = ptr_arg(d, "value_cache");
  a.key_scale = ptr_arg<const float>(d, "key_scale");
  a.value_scale = ptr_arg<const float>(d, "value_scale");
  a.block_table = ptr_arg<const int64_t>(d, "block_table");
  a.seq_lens = ptr_arg<const int64_t>(d, "seq_lens");
  a.query_start_loc = ptr_arg<const int64_t>(d, "query_start_loc");
  a.bias = ptr_arg(d, "attn_bias");
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
  m.def(
      "kernel_addresses",
      [] {
        return py::dict(py::arg("paged_attention") = reinterpret_cast<uintptr_t>(&paged_attention),
                        py::arg("quantize_rows") = reinterpret_cast<uintptr_t>(&quantize_rows));
      },
      "The entry points' addresses, which pagedfuse._host calls without Python.");
  m.def("selected_isa", &selected_isa,
        "The ISA PAGEDFUSE_CPU_ISA (auto | portable | avx512) selects on this CPU.");
  m.def("cpu_has_avx512_vnni", &cpu_has_avx512_vnni);
}
