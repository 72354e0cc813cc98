// pagedfuse._host: the ops' kernels for the Autograd, CPU and (where torch has CUDA) CUDA
// dispatch keys, so that an eager call whose signature has been seen before runs without
// Python.
//
// A device kernel keys each call by its signature: every argument (a tensor's dtype, device,
// sizes and strides; each scalar as given) and the PAGEDFUSE_* switches the Python path reads;
// the table is cleared on every change of the backend registry (registry.on_change).
// So a hit takes the GIL only for the value checks, where the op runs them. On a miss it calls the op's Python implementation, which
// validates (validate.py, the one place of the rules), picks the backend, runs it, and may hand
// back a launch spec for the signature. On a hit it only matches: a data pointer with bits of
// the spec's alignment masks set is a miss (Python then raises its error), value checks run
// where the spec carries them (Python's check_values), then it launches the kernel itself.
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "args_dict.h"
#include "common.h"

namespace py = pybind11;

namespace pagedfuse::host {
namespace {

using Stack = torch::jit::Stack;

// What each registered op is, for the positions of its arguments.
enum class OpKind : int { paged_attention = 0, paged_attention_int8 = 1, quantize_int8 = 2 };

// csrc/cuda/paged_decode.cu's C entry points, handed over by address (cuda_native.py).
using DecodeFused = int (*)(const void* record, void* stream, const void* query, const void* k,
                            const void* v, const float* k_scale, const float* v_scale,
                            const void* block_table, const void* seq_lens,
                            const void* query_start, void* out, void* workspace, int* counters);
using QuantizeFn = int (*)(int device, void* stream, int dtype, const void* x, int8_t* q,
                           float* scale, int64_t rows, int64_t row_len);
using ErrorString = const char* (*)(int);
// csrc/paged_attention.cpp's and csrc/quantize.cpp's entry points in pagedfuse._C, likewise.
using CpuAttention = void (*)(PagedArgs);
using CpuQuantize = void (*)(const void* x, Dtype dt, int64_t rows, int64_t n, int8_t* q,
                             float* scale, int threads);

enum class Launcher : int { cpu_attention, cpu_quantize, cuda_decode, cuda_quantize };

// One signature's launch, built from the spec Python returned for it.
struct Entry {
  Launcher launcher{};
  uint64_t masks[5] = {};      // query, key_cache, value_cache, key_scale, value_scale
  PyObject* checks = nullptr;  // check_values bound to the geometry; null: no value checks
  PagedArgs args{};            // cpu_attention: all but pointers and the thread count
  std::vector<int64_t> record;  // cuda_decode: the DecodeLaunch's bytes (8-byte aligned)
  int64_t workspace = 0;        // cuda_decode: scratch bytes
  bool copy_query = false;      // cuda_decode: the query's rows are copied first
  int dtype = 0;                // quantize: the kernel's dtype code
  DecodeFused decode = nullptr;
  QuantizeFn quantize = nullptr;
  CpuAttention cpu_attention = nullptr;
  CpuQuantize cpu_quantize = nullptr;
  ErrorString error_string = nullptr;

  Entry() = default;
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  ~Entry() {
    if (checks != nullptr) {  // the last holder may run without the GIL
      py::gil_scoped_acquire gil;
      Py_DECREF(checks);
    }
  }
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (const int64_t v : key) {
      h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
      h ^= h >> 29;
    }
    return static_cast<size_t>(h);
  }
};

// The signature table, bounded: past its limit it starts over (every batch size is a
// signature). Entries are shared so that a clear never frees one a launch is using.
class Table {
 public:
  std::shared_ptr<const Entry> find(const std::vector<int64_t>& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = map_.find(key);
    return it == map_.end() ? nullptr : it->second;
  }
  void install(std::vector<int64_t> key, std::shared_ptr<const Entry> entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (static_cast<int64_t>(map_.size()) >= limit_) map_.clear();
    map_[std::move(key)] = std::move(entry);
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    map_.clear();
  }
  int64_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(map_.size());
  }
  void set_limit(int64_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = limit;
    map_.clear();
  }

  std::atomic<int64_t> hits{0}, misses{0};

 private:
  std::mutex mutex_;
  int64_t limit_ = 4096;
  std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Entry>, KeyHash> map_;
};

// Process-lifetime state, leaked on purpose: Python objects must not be released after the
// interpreter is gone.
struct State {
  Table table;
  std::vector<std::string> switches;  // PAGEDFUSE_* variables the Python path reads per call
  std::vector<std::unique_ptr<torch::Library>> libraries;
};

State& state() {
  static State* s = new State();
  return *s;
}

// Appends a string (or its absence) to a key, eight bytes per element.
void append_text(std::vector<int64_t>& key, const char* text) {
  if (text == nullptr) {
    key.push_back(-1);
    return;
  }
  const size_t n = std::strlen(text);
  key.push_back(static_cast<int64_t>(n));
  for (size_t i = 0; i < n; i += 8) {
    int64_t word = 0;
    std::memcpy(&word, text + i, std::min<size_t>(8, n - i));
    key.push_back(word);
  }
}

// The call's signature; false for an argument that has none here (a symbolic size, a layout
// other than strided), which then always goes to Python.
bool make_key(int op, c10::ArrayRef<c10::IValue> args, std::vector<int64_t>& key) {
  key.clear();
  key.push_back(op);
  for (const std::string& name : state().switches) append_text(key, std::getenv(name.c_str()));
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().defined()) {
      const at::Tensor& t = v.toTensor();
      if (t.layout() != at::kStrided || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
        return false;
      }
      key.push_back(1);
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(static_cast<int64_t>(t.device().type()));
      key.push_back(t.device().index());
      key.push_back(t.dim());
      for (const int64_t s : t.sizes()) key.push_back(s);
      for (const int64_t s : t.strides()) key.push_back(s);
    } else if (v.isNone() || v.isTensor()) {  // an undefined tensor is an absent one
      key.push_back(0);
    } else if (v.isDouble()) {
      const double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(2);
      key.push_back(bits);
    } else if (v.isBool()) {
      key.push_back(3);
      key.push_back(v.toBool());
    } else if (v.isInt()) {
      key.push_back(4);
      key.push_back(v.toInt());
    } else {
      return false;
    }
  }
  return true;
}

// The attention ops' argument positions (the float op has no key_scale / value_scale).
struct Positions {
  int key_scale, value_scale, block_table, seq_lens, query_start_loc, attn_bias, max_seq_len;
};

Positions positions(OpKind kind) {
  return kind == OpKind::paged_attention_int8 ? Positions{3, 4, 5, 6, 7, 10, 11}
                                              : Positions{-1, -1, 3, 4, 5, 8, 9};
}

const at::Tensor* optional_tensor(c10::ArrayRef<c10::IValue> args, int at) {
  return at >= 0 && args[at].isTensor() && args[at].toTensor().defined() ? &args[at].toTensor()
                                                                         : nullptr;
}

uintptr_t address(const at::Tensor* t) {
  return t == nullptr ? 0 : reinterpret_cast<uintptr_t>(t->data_ptr());
}

// An int32 or int64 index tensor of rank 1 or 2 as a contiguous int64 array: in place when it
// is one, else copied into `buffer`.
const int64_t* int64_rows(const at::Tensor& t, std::vector<int64_t>& buffer) {
  if (t.scalar_type() == at::kLong && t.is_contiguous()) return t.const_data_ptr<int64_t>();
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1, cols = t.size(t.dim() - 1);
  const int64_t row_stride = t.dim() == 2 ? t.stride(0) : 0, col_stride = t.stride(-1);
  buffer.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t at = r * row_stride + c * col_stride;
      buffer[r * cols + c] = t.scalar_type() == at::kLong ? t.const_data_ptr<int64_t>()[at]
                                                          : t.const_data_ptr<int32_t>()[at];
    }
  }
  return buffer.data();
}

at::Tensor attention_output(const at::Tensor& query) {
  return at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
}

void launch_cpu_attention(const Entry& e, c10::ArrayRef<c10::IValue> args, const Positions& p,
                          const at::Tensor& out) {
  PagedArgs a = e.args;
  std::vector<int64_t> table, lens, starts;
  a.out = out.data_ptr();
  a.query = args[0].toTensor().const_data_ptr();
  a.key = args[1].toTensor().const_data_ptr();
  a.value = args[2].toTensor().const_data_ptr();
  a.key_scale = reinterpret_cast<const float*>(address(optional_tensor(args, p.key_scale)));
  a.value_scale = reinterpret_cast<const float*>(address(optional_tensor(args, p.value_scale)));
  a.block_table = int64_rows(args[p.block_table].toTensor(), table);
  a.seq_lens = int64_rows(args[p.seq_lens].toTensor(), lens);
  a.query_start_loc = int64_rows(args[p.query_start_loc].toTensor(), starts);
  a.bias = reinterpret_cast<const void*>(address(optional_tensor(args, p.attn_bias)));
  a.threads = at::get_num_threads();
  e.cpu_attention(a);
}

[[noreturn]] void launch_failed(const Entry& e, int err) {
  TORCH_CHECK(false, "pagedfuse decode launch failed: ", e.error_string(err));
}

void* current_stream(const at::Device& device) {
  const c10::impl::VirtualGuardImpl guard(device.type());
  return guard.getStream(device).native_handle();
}

void launch_cuda_decode(const Entry& e, c10::ArrayRef<c10::IValue> args, const Positions& p,
                        const at::Tensor& out) {
  const at::Tensor& given = args[0].toTensor();
  const at::Tensor query = e.copy_query ? given.clone(at::MemoryFormat::Contiguous) : given;
  at::Tensor workspace;
  if (e.workspace > 0) workspace = at::empty({e.workspace}, given.options().dtype(at::kByte));
  const int err = e.decode(
      e.record.data(), current_stream(given.device()), query.const_data_ptr(),
      args[1].toTensor().const_data_ptr(), args[2].toTensor().const_data_ptr(),
      reinterpret_cast<const float*>(address(optional_tensor(args, p.key_scale))),
      reinterpret_cast<const float*>(address(optional_tensor(args, p.value_scale))),
      args[p.block_table].toTensor().const_data_ptr(),
      args[p.seq_lens].toTensor().const_data_ptr(),
      args[p.query_start_loc].toTensor().const_data_ptr(), out.data_ptr(),
      workspace.defined() ? workspace.data_ptr() : nullptr, nullptr);
  if (err != 0) launch_failed(e, err);
}

// quantize_int8's outputs (x_int8, scale) filled by the entry's kernel.
std::pair<at::Tensor, at::Tensor> launch_quantize(const Entry& e, const at::Tensor& x) {
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scale = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const at::Tensor src = x.contiguous();
  const int64_t rows = scale.numel(), n = x.size(-1);
  if (e.launcher == Launcher::cpu_quantize) {
    if (rows > 0) {  // rows of length 0 get scale 0
      e.cpu_quantize(src.const_data_ptr(), static_cast<Dtype>(e.dtype), rows, n,
                    q.data_ptr<int8_t>(), scale.data_ptr<float>(), at::get_num_threads());
    }
  } else if (q.numel() == 0) {
    scale.zero_();  // no rows, or empty rows whose max|x| is taken as 0
  } else {
    const int err = e.quantize(static_cast<int>(x.device().index()), current_stream(x.device()),
                               e.dtype, src.const_data_ptr(), q.data_ptr<int8_t>(),
                               scale.data_ptr<float>(), rows, n);
    if (err != 0) launch_failed(e, err);
  }
  return {std::move(q), std::move(scale)};
}

using args_dict::int_arg;
using args_dict::ints_arg;

template <class Fn>
Fn function_at(const py::dict& d, const char* name) {
  return reinterpret_cast<Fn>(d[name].cast<uintptr_t>());
}

// The Entry of a spec dict (library.py's _host_spec; the fields each launcher reads).
std::shared_ptr<const Entry> make_entry(const py::dict& spec) {
  auto e = std::make_shared<Entry>();
  const auto launcher = spec["launcher"].cast<std::string>();
  if (spec.contains("masks")) ints_arg(spec, "masks", reinterpret_cast<int64_t*>(e->masks), 5);
  if (spec.contains("checks") && !spec["checks"].is_none()) {
    e->checks = spec["checks"].ptr();
    Py_INCREF(e->checks);
  }
  if (launcher == "cpu") {
    e->launcher = Launcher::cpu_attention;
    args_dict::parse_layout(spec["args"].cast<py::dict>(), e->args);
    e->cpu_attention = function_at<CpuAttention>(spec, "launch");
  } else if (launcher == "cuda_decode") {
    e->launcher = Launcher::cuda_decode;
    const auto bytes = spec["record"].cast<std::string>();
    e->record.resize((bytes.size() + 7) / 8);
    std::memcpy(e->record.data(), bytes.data(), bytes.size());
    e->workspace = int_arg(spec, "workspace");
    e->copy_query = spec["copy_query"].cast<bool>();
    e->decode = function_at<DecodeFused>(spec, "launch");
    e->error_string = function_at<ErrorString>(spec, "error_string");
  } else if (launcher == "cpu_quantize" || launcher == "cuda_quantize") {
    e->launcher = launcher == "cpu_quantize" ? Launcher::cpu_quantize : Launcher::cuda_quantize;
    e->dtype = static_cast<int>(int_arg(spec, "dtype"));
    if (e->launcher == Launcher::cuda_quantize) {
      e->quantize = function_at<QuantizeFn>(spec, "launch");
      e->error_string = function_at<ErrorString>(spec, "error_string");
    } else {
      e->cpu_quantize = function_at<CpuQuantize>(spec, "launch");
    }
  } else {
    TORCH_CHECK(false, "host spec: unknown launcher ", launcher);
  }
  return e;
}

bool misaligned(const Entry& e, c10::ArrayRef<c10::IValue> args, const Positions& p) {
  const uintptr_t pointers[5] = {
      address(&args[0].toTensor()), address(&args[1].toTensor()), address(&args[2].toTensor()),
      address(optional_tensor(args, p.key_scale)), address(optional_tensor(args, p.value_scale))};
  for (int i = 0; i < 5; ++i) {
    if (pointers[i] & e.masks[i]) return true;
  }
  return false;
}

// Python's value checks of a hit: check_values(geometry, block_table, seq_lens,
// query_start_loc, attn_bias, max_seq_len, max_query_len) with the geometry bound.
void run_checks(const Entry& e, c10::ArrayRef<c10::IValue> args, const Positions& p) {
  py::gil_scoped_acquire gil;
  py::tuple values(6);
  for (int i = 0; i < 6; ++i) {
    const int at = i < 3 ? p.block_table + i : p.attn_bias + (i - 3);
    values[i] = torch::jit::toPyObject(args[at]);
  }
  py::handle(e.checks)(*values);
}

// One op's kernels: `fill` runs a call in Python and returns (result, spec or None); `grad`
// runs a call whose inputs require grad (its output's backward raises).
class Op {
 public:
  Op(OpKind kind, py::object fill, py::object grad)
      : kind_(kind), fill_(std::move(fill)), grad_(std::move(grad)) {}
  // The dispatcher may drop its kernels after the interpreter has gone: the functions are
  // kept for the life of the process instead of released then.
  ~Op() {
    fill_.release();
    grad_.release();
  }
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;

  void device_kernel(const c10::OperatorHandle& handle, Stack* stack) const {
    const size_t n = handle.schema().arguments().size();
    const auto args = torch::jit::last(*stack, n);
    thread_local std::vector<int64_t> key;
    const bool keyed = make_key(static_cast<int>(kind_), args, key);
    std::shared_ptr<const Entry> entry = keyed ? state().table.find(key) : nullptr;
    if (entry != nullptr && kind_ == OpKind::quantize_int8) {
      auto [q, scale] = launch_quantize(*entry, args[0].toTensor());
      ++state().table.hits;
      torch::jit::drop(*stack, n);
      torch::jit::push(*stack, std::move(q), std::move(scale));
      return;
    }
    const Positions p = positions(kind_);
    if (entry != nullptr && !misaligned(*entry, args, p)) {
      if (entry->checks != nullptr) run_checks(*entry, args, p);
      at::Tensor out = attention_output(args[0].toTensor());
      if (entry->launcher == Launcher::cpu_attention) {
        launch_cpu_attention(*entry, args, p, out);
      } else {
        launch_cuda_decode(*entry, args, p, out);
      }
      ++state().table.hits;
      torch::jit::drop(*stack, n);
      torch::jit::push(*stack, std::move(out));
      return;
    }
    ++state().table.misses;
    std::vector<int64_t> saved = keyed ? key : std::vector<int64_t>{};  // fill may re-enter
    py::gil_scoped_acquire gil;
    const auto result = call_python(fill_, args).cast<py::tuple>();
    if (keyed && !result[1].is_none()) {
      state().table.install(std::move(saved), make_entry(result[1].cast<py::dict>()));
    }
    push_result(stack, n, result[0]);
  }

  void autograd_kernel(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                       Stack* stack) const {
    const size_t n = handle.schema().arguments().size();
    const auto args = torch::jit::last(*stack, n);
    bool needs_grad = false;
    if (c10::GradMode::is_enabled()) {
      for (const c10::IValue& v : args) {
        needs_grad = needs_grad || (v.isTensor() && v.toTensor().requires_grad());
      }
    }
    if (!needs_grad) {
      const at::AutoDispatchBelowAutograd below;
      handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
      return;
    }
    py::gil_scoped_acquire gil;
    push_result(stack, n, call_python(grad_, args));
  }

 private:
  static py::object call_python(const py::object& fn, c10::ArrayRef<c10::IValue> args) {
    py::tuple values(args.size());
    for (size_t i = 0; i < args.size(); ++i) values[i] = torch::jit::toPyObject(args[i]);
    return fn(*values);
  }

  void push_result(Stack* stack, size_t n, const py::handle& result) const {
    torch::jit::drop(*stack, n);
    if (kind_ == OpKind::quantize_int8) {
      const auto pair = result.cast<py::tuple>();
      torch::jit::push(*stack, pair[0].cast<at::Tensor>(), pair[1].cast<at::Tensor>());
    } else {
      torch::jit::push(*stack, result.cast<at::Tensor>());
    }
  }

  OpKind kind_;
  py::object fill_, grad_;
};

template <bool kAutograd>
class Kernel final : public c10::OperatorKernel {
 public:
  explicit Kernel(std::shared_ptr<const Op> op) : op_(std::move(op)) {}
  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, Stack* stack) {
    if constexpr (kAutograd) {
      op_->autograd_kernel(handle, keys, stack);
    } else {
      op_->device_kernel(handle, stack);
    }
  }

 private:
  std::shared_ptr<const Op> op_;
};

template <bool kAutograd>
void register_kernel(const std::string& name, const std::shared_ptr<const Op>& op,
                     c10::DispatchKey key) {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "pagedfuse", key,
                                              __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                              std::make_unique<Kernel<kAutograd>>(op)));
  state().libraries.push_back(std::move(lib));
}

#ifdef PAGEDFUSE_HOST_CUDA
constexpr bool kCuda = true;
#else
constexpr bool kCuda = false;
#endif

}  // namespace
}  // namespace pagedfuse::host

PYBIND11_MODULE(_host, m) {
  using namespace pagedfuse::host;
  m.doc() = "pagedfuse ops' dispatcher kernels: a per-signature launch table over Python";
  m.attr("CUDA") = kCuda;
  m.def(
      "configure",
      [](const std::vector<std::string>& switches) {
        state().switches = switches;
        state().table.clear();
      },
      "The switches read per call, which join every signature.");
  m.def(
      "register_op",
      [](const std::string& name, int kind, py::object fill, py::object grad) {
        const auto op = std::make_shared<const Op>(static_cast<OpKind>(kind), std::move(fill),
                                                   std::move(grad));
        register_kernel<true>(name, op, c10::DispatchKey::Autograd);
        register_kernel<false>(name, op, c10::DispatchKey::CPU);
        if (kCuda) register_kernel<false>(name, op, c10::DispatchKey::CUDA);
      },
      "Register the op's Autograd, CPU (and CUDA) kernels.");
  m.def("stats", [] {
    State& s = state();
    return py::dict(py::arg("hits") = s.table.hits.load(), py::arg("misses") = s.table.misses.load(),
                    py::arg("entries") = s.table.size());
  }, "Hits and misses of the signature table since the process started, and its entries.");
  m.def("clear", [] { state().table.clear(); }, "Forget every signature.");
  m.def("set_limit", [](int64_t limit) { state().table.set_limit(limit); },
        "Signatures kept before the table starts over (and forget the present ones).");
}
