"""ctypes binding of the CUDA C++ kernels in csrc/cuda (the library pagedfuse._cuda_kernels).

setup.py builds the library where nvcc and a CUDA build of torch are present; it has a C
ABI and no libtorch link, so it is loaded with ctypes rather than imported. Launches go on
the caller's current torch stream, take only pointers, sizes and strides, and never
synchronize, so they capture in CUDA graphs like the Triton kernels.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math

import torch

LIBRARY = "pagedfuse._cuda_kernels"
# head_dim -> the pipeline depths built in csrc/cuda/int8_decode.cu (0: no pipeline, loads
# straight to registers); the launcher's switch lists the same pairs.
INT8_DECODE_STAGES = {64: (0, 2), 128: (0, 2, 3), 256: (0, 2)}
INT8_DECODE_MAX_GROUP = 8  # query heads per KV head: the N of the kernel's MMAs
ALIGN = 16  # bytes: the kernel reads 16-byte rows of K and V (8 for head_dim 64 V)
OFFSET_LIMIT = 2**32  # per-token offsets are 32-bit (K/V in ALIGN-byte units)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT8_DECODE_ARGTYPES = [
    ctypes.c_int, _P, ctypes.c_int, ctypes.c_int,  # device, stream, dtype codes
    ctypes.c_int, ctypes.c_int,  # head_dim, stages
    _I64, _I64, _I64,  # batch, KV heads, splits
    _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P,  # tensors
    ctypes.c_float, ctypes.POINTER(_I64), ctypes.POINTER(_I64),
]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None where setup.py did not build it (no nvcc / CPU torch)."""
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.pagedfuse_int8_decode.argtypes = _INT8_DECODE_ARGTYPES
    lib.pagedfuse_int8_decode.restype = ctypes.c_int
    lib.pagedfuse_int8_decode_probe.argtypes = [ctypes.c_int]
    lib.pagedfuse_int8_decode_occupancy.argtypes = [ctypes.c_int] * 3 + [
        ctypes.POINTER(ctypes.c_int)]
    lib.pagedfuse_cuda_error_string.argtypes = [ctypes.c_int]
    lib.pagedfuse_cuda_error_string.restype = ctypes.c_char_p
    return lib


@functools.cache
def int8_decode_available(device: torch.device) -> bool:
    """Whether the library is built with code this device runs (sm_80 or newer)."""
    lib = library()
    if lib is None or device.type != "cuda":
        return False
    return lib.pagedfuse_int8_decode_probe(_index(device)) == 0


@functools.cache
def int8_decode_resident(device: torch.device, head_dim: int, stages: int) -> int:
    """CTAs of that kernel variant that fit on one multiprocessor at once."""
    lib = library()
    resident = ctypes.c_int(0)
    err = lib.pagedfuse_int8_decode_occupancy(_index(device), head_dim, stages,
                                              ctypes.byref(resident))
    if err:
        raise RuntimeError(f"pagedfuse int8 decode occupancy query failed: "
                           f"{lib.pagedfuse_cuda_error_string(err).decode()}")
    return resident.value


def _token_span(t: torch.Tensor) -> int:
    """Elements from a tensor's start to its last (block, token) row: the largest per-token
    offset the kernel computes (the head's offset is added in 64 bits)."""
    return sum((n - 1) * st for n, st in zip(t.shape[:2], t.stride()[:2], strict=True))


def int8_decode_unsupported(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, key_scale: torch.Tensor,
                            value_scale: torch.Tensor, block_table: torch.Tensor,
                            group: int) -> str | None:
    """Why the CUDA C++ INT8 decode cannot take this call (None: it can). The caller has
    already checked decode (q_len <= 1), no bias and an int8 value cache."""
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"query dtype {query.dtype} (bfloat16 or float16 only)"
    if query.shape[-1] not in INT8_DECODE_STAGES:
        return f"head_dim {query.shape[-1]}"
    if group > INT8_DECODE_MAX_GROUP:
        return f"{group} query heads per KV head (at most {INT8_DECODE_MAX_GROUP})"
    for cache in (key_cache, value_cache):
        if cache.stride(3) != 1 or cache.data_ptr() % ALIGN or any(
                s % ALIGN for s in cache.stride()[:3]):
            return "cache rows not 16-byte aligned"
    # Per-token offsets are 32-bit in the kernel: K/V rows in 16-byte units (64 GiB), scales
    # and table entries in elements.
    if max(_token_span(key_cache), _token_span(value_cache)) >= OFFSET_LIMIT * ALIGN or max(
            _token_span(key_scale), _token_span(value_scale),
            (block_table.shape[1] - 1) * block_table.stride(1)) >= OFFSET_LIMIT:
        return "cache or table offsets beyond 32 bits"
    if not int8_decode_available(query.device):
        return "pagedfuse._cuda_kernels not built for this device"
    return None


def int8_decode_into(out: torch.Tensor, q: torch.Tensor, q_scale: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                     key_scale: torch.Tensor, value_scale: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale_log2: float, splits: int,
                     stages: int, part_o: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Launch the INT8 K+V decode: ``q``/``q_scale`` from quantize_int8 (contiguous), ``out``
    contiguous; with ``splits`` > 1 it writes ``part_o``/``part_lse`` for the combine kernel.
    ``stages``: one of INT8_DECODE_STAGES[head_dim]."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = key_cache.shape
    batch, max_blocks = block_table.shape
    shift = int(math.log2(page)) if page & (page - 1) == 0 else -1
    sizes = (_I64 * 7)(num_tokens, num_q_heads, num_q_heads // num_kv_heads, num_blocks,
                       max_blocks, page, shift)
    strides = (_I64 * 15)(q.stride(0), *key_cache.stride()[:3], *value_cache.stride()[:3],
                          *key_scale.stride(), *value_scale.stride(), *block_table.stride())
    lib = library()
    err = lib.pagedfuse_int8_decode(
        _index(out.device), torch.cuda.current_stream(out.device).cuda_stream,
        0 if out.dtype == torch.bfloat16 else 1,
        sum(1 << i for i, t in enumerate((block_table, seq_lens, query_start_loc))
            if t.dtype == torch.int64),
        head_dim, stages,
        batch, num_kv_heads, splits,
        *(t.data_ptr() for t in (q, q_scale, key_cache, value_cache, key_scale, value_scale,
                                 block_table, seq_lens, query_start_loc, out, part_o,
                                 part_lse)),
        scale_log2, sizes, strides)
    if err:
        raise RuntimeError(f"pagedfuse int8 decode launch failed: "
                           f"{lib.pagedfuse_cuda_error_string(err).decode()}")
