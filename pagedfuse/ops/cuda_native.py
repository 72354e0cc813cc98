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
from typing import NamedTuple

import torch

from pagedfuse.ops.call import PagedCall

LIBRARY = "pagedfuse._cuda_kernels"
# What the caches hold, in the order of csrc/cuda/paged_decode.cu's Kind codes: INT8 K and V,
# INT8 K with a 16-bit V, 16-bit K and V (bf16 or fp16, the query's dtype).
KINDS = ("int8_kv", "int8_k", "half")
# The launcher's switch builds every kind at each of these head dims, each with CTAs that
# serve each of these counts of KV heads (every count divides every variant's warps).
HEAD_DIMS = (64, 128, 256)
HEADS_PER_CTA = (1, 2, 4)
MAX_GROUP = 8  # query heads per KV head: the N of the kernel's MMAs
BALANCED_MAX_BATCH = 2048  # sequences the balanced grid takes (the kernel's kBalancedMaxBatch)
ALIGN = 16  # bytes: the kernel copies K and V rows in 16-byte chunks
OFFSET_LIMIT = 2**32  # per-token offsets are 32-bit (K/V in ALIGN-byte units)
# How the decode launches (programmatic dependent launch needs sm_90): plainly; as a PDL
# launch that waits for the grid before it ahead of any read; or as one right after
# quantize_int8's grid (which releases it early), reading all but the query before waiting.
PDL_OFF, PDL_WAIT_FIRST, PDL_AFTER_QUANTIZE = 0, 1, 2

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_DECODE_ARGTYPES = [
    # device, stream, kind, out_dtype, index64, pdl
    ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ctypes.c_int, ctypes.c_int,  # head_dim, KV heads per CTA
    _I64, _I64, _I64, _I64, _P,  # batch, KV heads, splits, balanced CTAs, counters
    _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P,  # tensors
    ctypes.c_float, ctypes.c_float,  # scale * log2(e), softcap (0: none)
    ctypes.POINTER(_I64), ctypes.POINTER(_I64),  # sizes, strides
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
    lib.pagedfuse_decode.argtypes = _DECODE_ARGTYPES
    lib.pagedfuse_decode.restype = ctypes.c_int
    lib.pagedfuse_decode_probe.argtypes = [ctypes.c_int]
    lib.pagedfuse_decode_variant.argtypes = [ctypes.c_int] * 3 + [ctypes.POINTER(ctypes.c_int)]
    lib.pagedfuse_cuda_error_string.argtypes = [ctypes.c_int]
    lib.pagedfuse_cuda_error_string.restype = ctypes.c_char_p
    return lib


def kind_of(key_cache: torch.Tensor, value_cache: torch.Tensor) -> str:
    """The KINDS entry of a (key, value) cache pair."""
    if key_cache.dtype != torch.int8:
        return "half"
    return "int8_kv" if value_cache.dtype == torch.int8 else "int8_k"


@functools.cache
def decode_available(device: torch.device) -> bool:
    """Whether the library is built with code this device runs (sm_80 or newer)."""
    lib = library()
    if lib is None or device.type != "cuda":
        return False
    return lib.pagedfuse_decode_probe(_index(device)) == 0


class Variant(NamedTuple):
    """A built (kind, head_dim) decode kernel on one device: its CTAs per multiprocessor
    (registers and shared memory), warps per CTA, tokens per warp tile, the most KV heads
    per CTA the op gives it (the kernel's Traits; 1, 2 and 4 are built), and CTAs per
    multiprocessor of its balanced-grid kernel (what sizes that grid: cuda.balanced_ctas)."""

    resident: int
    warps: int
    tile: int
    heads: int
    balanced_resident: int


@functools.cache
def decode_variant(device: torch.device, kind: str, head_dim: int) -> Variant:
    """What the library says about that kernel variant on ``device``."""
    lib = library()
    info = (ctypes.c_int * len(Variant._fields))()
    err = lib.pagedfuse_decode_variant(_index(device), KINDS.index(kind), head_dim, info)
    if err:
        raise RuntimeError(f"pagedfuse decode variant query failed: "
                           f"{lib.pagedfuse_cuda_error_string(err).decode()}")
    return Variant(*info)


def heads_per_cta(variant: Variant, num_kv_heads: int, batch: int, sm_count: int) -> int:
    """KV heads one CTA serves: a power of two up to the variant's tuned count that divides
    ``num_kv_heads`` (every CTA has whole heads, each with the same number of warps); the
    smallest whose CTAs of one split fit in one wave, else the largest. At the same CTA
    count fewer heads per CTA take fewer splits: on the H200 at B=8, qwen35 with 1 head and
    4 splits was 1-6% faster than with 2 heads and 8, while at B=64 llama3_8b's INT8 caches
    with 4 heads per CTA fit one wave and beat 1 and 2 heads by 1.5-6% (2026-11-30, the
    native sweep of benchmarks/tuning/decode_sweeps.py)."""
    fits = [h for h in HEADS_PER_CTA if h <= variant.heads and num_kv_heads % h == 0]
    slots = variant.resident * sm_count
    return next((h for h in fits if batch * num_kv_heads // h <= slots), fits[-1])


def cta_tokens(variant: Variant, heads: int) -> int:
    """Keys a CTA steps over per head at a time (each head's warps' tiles): split chunks
    are multiples of it."""
    return variant.warps // heads * variant.tile


# The balanced grid's arrival counts (one per sequence and head group), per (device,
# stream): every launch leaves them at zero, so one buffer serves all launches on its
# stream, and decodes running at once on two streams never share counts. A buffer first
# made during a CUDA graph capture is zeroed by a memset recorded in that graph (and in each
# graph captured on its stream until an eager call zeroes it), so it is zero whichever runs
# first. Replaced buffers stay alive: graphs captured with them still use them.
_counters: dict[tuple[int, int], torch.Tensor] = {}
_zeroed_in_graphs_only: set[tuple[int, int]] = set()
_replaced: list[torch.Tensor] = []


def balanced_counters(device: torch.device, items: int) -> torch.Tensor:
    """The current stream's zeroed int32 counts for a balanced grid of ``items``
    (sequence, head group) pairs."""
    key = (_index(device), torch.cuda.current_stream(device).cuda_stream)
    capturing = torch.cuda.is_current_stream_capturing()
    counters = _counters.get(key)
    if counters is None or counters.numel() < items:
        if counters is not None:
            _replaced.append(counters)
        counters = _counters[key] = torch.zeros(max(items, 4096), dtype=torch.int32,
                                                device=device)
        if capturing:
            _zeroed_in_graphs_only.add(key)
    elif key in _zeroed_in_graphs_only:
        counters.zero_()
        if not capturing:
            _zeroed_in_graphs_only.discard(key)
    return counters


def _token_span(t: torch.Tensor) -> int:
    """Bytes from a tensor's start to its last (block, token) row: the largest per-token
    offset the kernel computes (the head's offset is added in 64 bits)."""
    return t.element_size() * sum(
        (n - 1) * st for n, st in zip(t.shape[:2], t.stride()[:2], strict=True))


def _static(values) -> bool:
    return all(isinstance(v, int) for v in values)


def decode_unsupported(call: PagedCall) -> str | None:
    """Why the decode kernel cannot take this call (None: it can), beyond the q_len, bias
    and head_dim rules the backend checks first. check_metadata has checked that the dtypes
    pair up (a 16-bit cache has the query's dtype, a scale goes with each int8 cache) and
    that the caches' data pointers are 16-byte aligned; strides and sizes are read only where
    they are plain ints (a fake trace's SymInts would add guards)."""
    query, key_cache, value_cache = call.query, call.key_cache, call.value_cache
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"query dtype {query.dtype} (bfloat16 or float16 only)"
    group = call.geometry.group
    if not isinstance(group, int):
        return "dynamic head counts"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head (at most {MAX_GROUP})"
    scales = [s for s in (call.key_scale, call.value_scale) if s is not None]
    tensors = (key_cache, value_cache, *scales, call.block_table)
    if not _static([n for t in tensors for n in (*t.shape, *t.stride())]):
        return "dynamic cache or table sizes"
    for cache in (key_cache, value_cache):
        size = cache.element_size()
        if cache.stride(3) != 1 or any(s * size % ALIGN for s in cache.stride()[:3]):
            return "cache rows not 16-byte aligned"
    # Per-token offsets are 32-bit in the kernel: K/V rows in 16-byte units (64 GiB), scales
    # and table entries in elements.
    table = call.block_table
    if max(_token_span(key_cache), _token_span(value_cache)) >= OFFSET_LIMIT * ALIGN or max(
            [_token_span(s) // s.element_size() for s in scales]
            + [(table.shape[1] - 1) * table.stride(1)]) >= OFFSET_LIMIT:
        return "cache or table offsets beyond 32 bits"
    if not decode_available(query.device):
        return "pagedfuse._cuda_kernels not built for this device"
    return None


def aligned_rows(q: torch.Tensor) -> bool:
    """Whether the kernel can read ``q`` [T, H, D] in place: head-contiguous 16-byte rows."""
    size = q.element_size()
    return (q.stride(2) == 1 and q.stride(1) == q.shape[2] and q.data_ptr() % ALIGN == 0
            and q.stride(0) * size % ALIGN == 0)


class _Constants(NamedTuple):
    """The launch arguments that depend only on a call's signature (its Geometry), the
    query's row stride and the window: built once per signature, since building the ctypes
    arrays cost more than the rest of the launch."""

    kind: int
    out_dtype: int
    index64: int
    sizes: ctypes.Array
    strides: ctypes.Array


_CONSTANTS: dict[tuple, _Constants] = {}
_CONSTANTS_LIMIT = 4096


def _launch_constants(call: PagedCall, q: torch.Tensor) -> _Constants:
    key = (call.geometry, q.stride(0), call.window_left)
    found = _CONSTANTS.get(key)
    if found is not None:
        return found
    g = call.geometry
    key_cache, value_cache = call.key_cache, call.value_cache
    key_scale, value_scale, block_table = call.key_scale, call.value_scale, call.block_table
    page = g.block_size
    shift = int(math.log2(page)) if page & (page - 1) == 0 else -1
    window = 0 if call.window_left is None else min(call.window_left, g.max_blocks * page)
    sizes = (_I64 * 8)(g.num_tokens, g.num_q_heads, g.group, g.num_blocks, g.max_blocks, page,
                       shift, window)
    no_scale = (0, 0, 0)
    strides = (_I64 * 15)(
        q.stride(0), *(s * key_cache.element_size() for s in key_cache.stride()[:3]),
        *(s * value_cache.element_size() for s in value_cache.stride()[:3]),
        *(key_scale.stride() if key_scale is not None else no_scale),
        *(value_scale.stride() if value_scale is not None else no_scale),
        *block_table.stride())
    found = _Constants(
        KINDS.index(kind_of(key_cache, value_cache)),
        0 if call.query.dtype == torch.bfloat16 else 1,
        sum(1 << i for i, t in enumerate((block_table, call.seq_lens, call.query_start_loc))
            if t.dtype == torch.int64),
        sizes, strides)
    if len(_CONSTANTS) >= _CONSTANTS_LIMIT:
        _CONSTANTS.clear()
    _CONSTANTS[key] = found
    return found


def decode_into(call: PagedCall, out: torch.Tensor, q: torch.Tensor,
                q_scale: torch.Tensor | None, scale_log2: float, splits: int, heads: int,
                part_o: torch.Tensor, part_lse: torch.Tensor, pdl: int = PDL_OFF,
                ctas: int = 0, counters: torch.Tensor | None = None) -> None:
    """Launch the decode of ``call``: with an INT8 key cache ``q``/``q_scale`` come from
    quantize_int8, else ``q`` is the query itself or an aligned copy (aligned_rows);
    ``scale_log2``: the softmax scale times log2(e); ``out`` contiguous; with ``splits`` > 1
    it writes ``part_o``/``part_lse`` for the combine kernel. ``heads``: KV heads per CTA,
    one of HEADS_PER_CTA dividing the KV heads (heads_per_cta). ``pdl``: one of PDL_OFF,
    PDL_WAIT_FIRST, PDL_AFTER_QUANTIZE (sm_90 only). ``ctas`` > 0: the balanced grid of
    that many CTAs instead (cuda_decode.balanced_ctas; ``splits`` unused), which merges its
    own pieces: ``part_o``/``part_lse`` hold 2 * ctas pieces of heads * group rows, and
    ``counters`` comes from balanced_counters. The call's window_left and softcap go to the
    kernel as they are, a window longer than the table's capacity clamped to it (it then
    hides no key either)."""
    g = call.geometry
    key_cache, value_cache = call.key_cache, call.value_cache
    key_scale, value_scale, block_table = call.key_scale, call.value_scale, call.block_table
    num_kv_heads, batch = g.num_kv_heads, g.batch
    if heads not in HEADS_PER_CTA or num_kv_heads % heads:
        raise ValueError(f"heads={heads}: KV heads per CTA must be one of {HEADS_PER_CTA} "
                         f"and divide the {num_kv_heads} KV heads")
    if ctas:
        groups = num_kv_heads // heads
        if batch > BALANCED_MAX_BATCH:
            raise ValueError(f"block_table has {batch} sequences: the balanced grid takes at "
                             f"most {BALANCED_MAX_BATCH}")
        if counters is None or counters.numel() < batch * groups:
            raise ValueError(f"counters must hold one count per sequence and head group "
                             f"({batch * groups}; balanced_counters)")
        if ctas % groups:
            raise ValueError(f"ctas={ctas} must be a multiple of the {groups} head groups")
    constants = _launch_constants(call, q)
    # Pointer slots the kind does not read get any tensor's.
    tensors = (q, q_scale, key_cache, value_cache, key_scale, value_scale, block_table,
               call.seq_lens, call.query_start_loc, out, part_o, part_lse)
    lib = library()
    index = _index(out.device)
    err = lib.pagedfuse_decode(
        index, torch._C._cuda_getCurrentRawStream(index), constants.kind, constants.out_dtype,
        constants.index64, pdl, g.head_dim, heads,
        batch, num_kv_heads, splits, ctas, counters.data_ptr() if ctas else None,
        *((t if t is not None else out).data_ptr() for t in tensors),
        scale_log2, call.softcap or 0.0, constants.sizes, constants.strides)
    if err:
        raise RuntimeError(f"pagedfuse decode launch failed: "
                           f"{lib.pagedfuse_cuda_error_string(err).decode()}")
