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

from pagedfuse.ops.call import PagedCall, empty_contiguous
from pagedfuse.ops.signature_cache import SignatureCache

LIBRARY = "pagedfuse._cuda_kernels"
# What the caches hold, in the order of csrc/cuda/paged_decode.cu's Kind codes: INT8 K and V,
# INT8 K with a 16-bit V, 16-bit K and V (bf16 or fp16, the query's dtype).
KINDS = ("int8_kv", "int8_k", "half")
CALL_KINDS = {"int8_kv": "int8_kv", "int8_k": "int8_k", "half": "float"}  # PagedCall.kind's
# The launcher's switch builds every kind at each of these head dims, each with CTAs that
# serve each of these counts of KV heads (every count divides every variant's warps).
HEAD_DIMS = (64, 128, 256)
HEADS_PER_CTA = (1, 2, 4)
MAX_GROUP = 8  # query heads per KV head
COLUMNS = 8  # the N of the kernel's MMAs: (query token, query head) columns per n-tile
COLUMN_TILES = (1, 2)  # n-tiles per warp of the short-query kernels (up to
# Variant.max_column_tiles); 0 is the one-token kernel
MAX_QUERY = 8  # query tokens per sequence the kernel serves
BALANCED_MAX_BATCH = 2048  # sequences the balanced grid takes (the kernel's kBalancedMaxBatch)
ALIGN = 16  # bytes: the kernel copies K and V rows in 16-byte chunks
OFFSET_LIMIT = 2**32  # per-token offsets are 32-bit (K/V in ALIGN-byte units)
# How the decode launches (programmatic dependent launch needs sm_90): plainly; as a PDL
# launch that waits for the grid before it ahead of any read; or as one right after
# quantize_int8's grid (which releases it early), reading all but the query before waiting.
PDL_OFF, PDL_WAIT_FIRST, PDL_AFTER_QUANTIZE = 0, 1, 2

LOG2E = math.log2(math.e)  # the kernel's softmax runs in base 2

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class DecodeLaunch(ctypes.Structure):
    """csrc/cuda/paged_decode.cu's DecodeLaunch (its comment at pagedfuse_decode says what
    each field holds): everything a launch needs but data pointers and the stream, built
    once per call signature so that a launch passes one pointer for it."""

    _fields_ = [
        *((name, ctypes.c_int32) for name in ("device", "kind", "out_dtype", "index64", "pdl",
                                              "head_dim", "heads", "quantize", "max_query",
                                              "column_tiles", "column_groups", "causal")),
        *((name, _I64) for name in ("batch", "num_kv_heads", "splits", "ctas")),
        ("sizes", _I64 * 8), ("strides", _I64 * 15), ("q_stride_h", _I64),
        *((name, _I64) for name in ("part_o", "part_lse", "q8", "q_scale")),
        ("scale_log2", ctypes.c_float), ("softcap", ctypes.c_float),
    ]


# record, stream, q, q_scale, k, v, k_scale, v_scale, block_table, seq_lens, query_start, out,
# part_o, part_lse, counters
_DECODE_ARGTYPES = [_P] * 15
# record, stream, query, k, v, k_scale, v_scale, block_table, seq_lens, query_start, out,
# workspace, counters
_FUSED_ARGTYPES = [_P] * 13


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
    lib.pagedfuse_decode_fused.argtypes = _FUSED_ARGTYPES
    lib.pagedfuse_decode_fused.restype = ctypes.c_int
    lib.pagedfuse_quantize.argtypes = [ctypes.c_int, _P, ctypes.c_int, _P, _P, _P, _I64, _I64]
    lib.pagedfuse_quantize.restype = ctypes.c_int
    lib.pagedfuse_decode_probe.argtypes = [ctypes.c_int]
    lib.pagedfuse_decode_variant.argtypes = [ctypes.c_int] * 4 + [ctypes.POINTER(ctypes.c_int)]
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
    """A built (kind, head_dim) decode kernel, one-token or short-query (Columns.tiles), on
    one device: its CTAs per multiprocessor (registers and shared memory), warps per CTA,
    tokens per warp tile, the most KV heads per CTA the op gives it (the kernel's Traits; 1,
    2 and 4 are built for one token, up to this count for short queries), CTAs per
    multiprocessor of the one-token balanced-grid kernel (what sizes that grid:
    cuda.balanced_ctas) and the most n-tiles the short-query kernels have for the kind and
    head_dim (kMaxColumnTiles)."""

    resident: int
    warps: int
    tile: int
    heads: int
    balanced_resident: int
    max_column_tiles: int = 1


@functools.cache
def decode_variant(device: torch.device, kind: str, head_dim: int,
                   column_tiles: int = 0) -> Variant:
    """What the library says about that kernel variant on ``device``."""
    lib = library()
    info = (ctypes.c_int * len(Variant._fields))()
    err = lib.pagedfuse_decode_variant(_index(device), KINDS.index(kind), head_dim,
                                       column_tiles, info)
    if err:
        raise RuntimeError(f"pagedfuse decode variant query failed for {column_tiles} "
                           f"n-tiles: {lib.pagedfuse_cuda_error_string(err).decode()}")
    return Variant(*info)


class Columns(NamedTuple):
    """The MMA columns of a launch: (query token, query head) pairs of a KV head, 8 per
    n-tile. ``max_query``: query tokens per sequence it serves (sequences with more get no
    CTA: the prefill kernel's); ``tiles``: n-tiles per warp of the short-query kernel (0:
    the one-token kernel, the group's heads in one n-tile); ``groups``: CTAs per KV head
    group, each on the next tiles x 8 columns (reading the same K/V again)."""

    max_query: int = 1
    tiles: int = 0
    groups: int = 1


ONE_TOKEN = Columns()


def columns_for(max_query: int, group: int, max_tiles: int) -> Columns:
    """The fewest n-tiles (of the COLUMN_TILES up to ``max_tiles``) that hold a sequence's
    max_query x group columns, else the most and as many column groups as it takes: a warp
    then reads each K/V tile once for all of them."""
    need = -(-max_query * group // COLUMNS)
    tiles = next((n for n in COLUMN_TILES if n >= need and n <= max_tiles),
                 max(n for n in COLUMN_TILES if n <= max_tiles))
    return Columns(max_query, tiles, -(-need // tiles))


def heads_counts(variant: Variant, num_kv_heads: int) -> list[int]:
    """The counts of KV heads per CTA the op may give ``variant``: those of HEADS_PER_CTA up
    to its tuned count that divide ``num_kv_heads`` (every CTA has whole heads)."""
    return [h for h in HEADS_PER_CTA if h <= variant.heads and num_kv_heads % h == 0]


def heads_per_cta(variant: Variant, num_kv_heads: int, batch: int, sm_count: int) -> int:
    """KV heads one CTA serves, of heads_counts (each head with the same number of warps): the
    smallest whose CTAs of one split fit in one wave, else the largest. At the same CTA
    count fewer heads per CTA take fewer splits: on the H200 at B=8, qwen35 with 1 head and
    4 splits was 1-6% faster than with 2 heads and 8, while at B=64 llama3_8b's INT8 caches
    with 4 heads per CTA fit one wave and beat 1 and 2 heads by 1.5-6% (2026-11-30, the
    native sweep of benchmarks/tuning/decode_sweeps.py)."""
    fits = heads_counts(variant, num_kv_heads)
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


# Where a launch's scratch lives in its workspace: sections start at ALIGN-byte offsets.
def _sections(nbytes: list[int]) -> tuple[list[int], int]:
    """Offsets of consecutive sections of these sizes, and the bytes of all of them."""
    offsets, end = [], 0
    for size in nbytes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


class _Record(NamedTuple):
    """A call signature's launch: the C record (``launch``, kept alive here) and its
    address, the workspace bytes its scratch takes (0: none), whether the query is copied
    first (rows the kernel cannot read in place: aligned_rows), the device index, and the
    balanced grid's (sequence, head group) counts (0: the split grid)."""

    launch: DecodeLaunch
    address: int
    workspace: int
    copy_query: bool
    index: int
    counts: int


_RECORDS: SignatureCache[tuple, _Record] = SignatureCache()


def _record(call: PagedCall, splits: int, heads: int, pdl: int, ctas: int,
            columns: Columns, q_stride: int | None = None) -> _Record:
    """The launch record of ``call`` (see decode_into), cached per call signature (the
    Geometry stands for it: shapes, strides, dtypes, devices, scale, window and softcap) and
    launch choice. ``q_stride``: the token stride of a query the caller quantized or copied
    itself (kernel_into); None: decode_into's fused launch."""
    key = (call.geometry, splits, heads, pdl, ctas, columns, q_stride)
    found = _RECORDS.get(key)
    if found is not None:
        return found
    g = call.geometry
    num_kv_heads, batch = g.num_kv_heads, g.batch
    if heads not in HEADS_PER_CTA or num_kv_heads % heads:
        raise ValueError(f"heads={heads}: KV heads per CTA must be one of {HEADS_PER_CTA} "
                         f"and divide the {num_kv_heads} KV heads")
    if columns.tiles == 0 and columns != ONE_TOKEN:
        raise ValueError(f"columns={columns}: the one-token kernel (tiles 0) serves one query "
                         "token in one column group")
    if columns.tiles and (columns.tiles not in COLUMN_TILES or columns.groups < 1 or not (
            1 <= columns.max_query <= MAX_QUERY) or (
            columns.groups * columns.tiles * COLUMNS < columns.max_query * g.group)):
        raise ValueError(f"columns={columns}: n-tiles must be one of {COLUMN_TILES}, max_query "
                         f"1 to {MAX_QUERY}, and the groups' columns must hold max_query x "
                         f"{g.group} query heads")
    if ctas and columns != ONE_TOKEN:
        raise ValueError("the balanced grid serves one query token per sequence")
    kind = kind_of(call.key_cache, call.value_cache)
    # the short-query kernels are built for 1 up to their Traits' heads per CTA, which only
    # the library knows (without it nothing launches anyway)
    if columns.tiles and library() is not None and heads > (most := decode_variant(
            call.device, kind, g.head_dim, columns.tiles).heads):
        raise ValueError(f"heads={heads}: the short-query kernels at head_dim {g.head_dim} "
                         f"serve at most {most} KV heads per CTA")
    counts = 0
    if ctas:
        groups = num_kv_heads // heads
        if batch > BALANCED_MAX_BATCH:
            raise ValueError(f"block_table has {batch} sequences: the balanced grid takes at "
                             f"most {BALANCED_MAX_BATCH}")
        if ctas % groups:
            raise ValueError(f"ctas={ctas} must be a multiple of the {groups} head groups")
        counts = batch * groups
    query, key_cache, value_cache = call.query, call.key_cache, call.value_cache
    key_scale, value_scale, block_table = call.key_scale, call.value_scale, call.block_table
    rows = g.num_tokens * g.num_q_heads
    quantize = q_stride is None and call.int8_k
    copy_query = q_stride is None and not quantize and not aligned_rows(query)
    if q_stride is None:
        q_stride = g.num_q_heads * g.head_dim if copy_query else query.stride(0)
    parts = 2 * ctas * heads * g.group if ctas else splits * rows if splits > 1 else 0
    fused = [parts * g.head_dim * 4, parts * 4, rows * g.head_dim if quantize else 0,
             rows * 4 if quantize else 0]
    (part_o, part_lse, q8, q_scale), nbytes = _sections(fused)
    page = g.block_size
    window = 0 if call.window_left is None else min(call.window_left, g.max_blocks * page)
    no_scale = (0, 0, 0)
    launch = DecodeLaunch(
        _index(query.device), KINDS.index(kind),
        0 if query.dtype == torch.bfloat16 else 1,
        sum(1 << i for i, t in enumerate((block_table, call.seq_lens, call.query_start_loc))
            if t.dtype == torch.int64),
        pdl, g.head_dim, heads, int(quantize), *columns, int(call.causal), batch, num_kv_heads,
        splits, ctas,
        (_I64 * 8)(g.num_tokens, g.num_q_heads, g.group, g.num_blocks, g.max_blocks, page,
                   int(math.log2(page)) if page & (page - 1) == 0 else -1, window),
        (_I64 * 15)(
            q_stride, *(s * key_cache.element_size() for s in key_cache.stride()[:3]),
            *(s * value_cache.element_size() for s in value_cache.stride()[:3]),
            *(key_scale.stride() if key_scale is not None else no_scale),
            *(value_scale.stride() if value_scale is not None else no_scale),
            *block_table.stride()),
        query.stride(1), part_o, part_lse, q8, q_scale, call.scale * LOG2E, call.softcap or 0.0)
    return _RECORDS.put(key, _Record(launch, ctypes.addressof(launch), nbytes, copy_query,
                                     launch.device, counts))


# The fused launch's scratch per (device, stream), grown as needed: launches on one stream
# run in order, so one buffer serves them all, and a replaced buffer goes back to the
# caching allocator, which gives it again only to work ordered after them on that stream.
# A launch captured in a CUDA graph takes fresh memory of the graph's own pool instead, which
# lives as long as the graph and no eager call or other graph shares.
_workspaces: dict[tuple[int, int], torch.Tensor] = {}


def _workspace(index: int, stream: int, nbytes: int) -> torch.Tensor:
    if torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
    key = (index, stream)
    buffer = _workspaces.get(key)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _workspaces[key] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8,
                                                device=torch.device("cuda", index))
    return buffer


def _check(err: int) -> None:
    if err:
        raise RuntimeError(f"pagedfuse decode launch failed: "
                           f"{library().pagedfuse_cuda_error_string(err).decode()}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode_into(call: PagedCall, out: torch.Tensor, splits: int, heads: int,
                pdl: int = PDL_OFF, ctas: int = 0, columns: Columns = ONE_TOKEN) -> None:
    """Fill the contiguous ``out`` with the decode of ``call`` in one host call: with an INT8
    key cache the query's quantization first, then the decode grid, then with ``splits`` > 1
    the split combine, all on the current stream, their scratch from the stream's workspace.
    ``heads``: KV heads per CTA, one of HEADS_PER_CTA dividing the KV heads (heads_per_cta).
    ``pdl``: PDL_OFF, or (sm_90) PDL_WAIT_FIRST for a 16-bit cache and PDL_AFTER_QUANTIZE
    for an INT8 K cache (the combine then goes as a dependent launch too). ``ctas`` > 0: the
    balanced grid of that many CTAs instead (cuda_decode.balanced_ctas; ``splits`` unused),
    which merges its own pieces. ``columns``: the query tokens per sequence served and how
    their columns are tiled (columns_for; sequences with more tokens are left to the caller).
    The call's window_left and softcap go to the kernel as they are, a window longer than
    the table's capacity clamped to it (it then hides no key either)."""
    record = _record(call, splits, heads, pdl, ctas, columns)
    index = record.index
    stream = torch._C._cuda_getCurrentRawStream(index)
    query = call.query
    if record.copy_query:
        query = query.clone(memory_format=torch.contiguous_format)  # fresh, so aligned
    workspace = _workspace(index, stream, record.workspace) if record.workspace else None
    counters = balanced_counters(query.device, record.counts) if record.counts else None
    _check(library().pagedfuse_decode_fused(
        record.address, stream, query.data_ptr(), call.key_cache.data_ptr(),
        call.value_cache.data_ptr(), _ptr(call.key_scale), _ptr(call.value_scale),
        call.block_table.data_ptr(), call.seq_lens.data_ptr(), call.query_start_loc.data_ptr(),
        out.data_ptr(), _ptr(workspace), _ptr(counters)))


def host_launch(call: PagedCall, splits: int, heads: int, pdl: int, ctas: int,
                columns: Columns = ONE_TOKEN) -> dict | None:
    """What the C++ host path (csrc/host/host.cpp) keeps for decode_into's launch of this
    call signature: the record's bytes, the scratch bytes, whether the query is copied, and
    the library's entry points by address. None for the balanced grid, whose counters
    (balanced_counters: per stream, zeroed inside CUDA graphs) stay in Python."""
    record = _record(call, splits, heads, pdl, ctas, columns)
    if record.counts:
        return None
    lib = library()
    return {"launcher": "cuda_decode", "record": bytes(record.launch),
            "workspace": record.workspace, "copy_query": record.copy_query,
            "launch": _address(lib.pagedfuse_decode_fused),
            "error_string": _address(lib.pagedfuse_cuda_error_string)}


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def kernel_into(call: PagedCall, out: torch.Tensor, q: torch.Tensor,
                q_scale: torch.Tensor | None, splits: int, heads: int,
                part_o: torch.Tensor, part_lse: torch.Tensor, pdl: int = PDL_OFF,
                ctas: int = 0, counters: torch.Tensor | None = None,
                columns: Columns = ONE_TOKEN) -> None:
    """The decode grid of ``call`` alone (what the tuning sweeps time): ``q``/``q_scale``
    from quantize_int8 with an INT8 key cache, else the query itself or an aligned copy
    (aligned_rows); with ``splits`` > 1 it writes ``part_o``/``part_lse`` [splits, T, Hq,
    D] and [splits, T, Hq] and leaves the combine to the caller. ``ctas``: as decode_into,
    with ``part_o``/``part_lse`` holding 2 * ctas pieces of heads * group rows and
    ``counters`` from balanced_counters; ``columns`` as decode_into."""
    if ctas and (counters is None or counters.numel() < call.geometry.batch *
                 call.geometry.num_kv_heads // max(heads, 1)):
        raise ValueError(f"counters must hold one count per sequence and head group "
                         f"({call.geometry.batch * call.geometry.num_kv_heads // max(heads, 1)}"
                         "; balanced_counters)")
    record = _record(call, splits, heads, pdl, ctas, columns, q_stride=q.stride(0))
    _check(library().pagedfuse_decode(
        record.address, torch._C._cuda_getCurrentRawStream(record.index), q.data_ptr(),
        _ptr(q_scale), call.key_cache.data_ptr(), call.value_cache.data_ptr(),
        _ptr(call.key_scale), _ptr(call.value_scale), call.block_table.data_ptr(),
        call.seq_lens.data_ptr(), call.query_start_loc.data_ptr(), out.data_ptr(),
        part_o.data_ptr(), part_lse.data_ptr(), _ptr(counters)))


_QUANTIZE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the C codes


def host_quantize(x: torch.Tensor) -> dict:
    """What the C++ host path keeps for quantize_int8's launch of x's signature (on a device
    decode_available): the dtype code and the library's entry points by address."""
    lib = library()
    return {"launcher": "cuda_quantize", "dtype": _QUANTIZE_DTYPES[x.dtype],
            "launch": _address(lib.pagedfuse_quantize),
            "error_string": _address(lib.pagedfuse_cuda_error_string)}


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8 of a float tensor on a device decode_available: (x_int8, scale = max|x|
    / 127 as float32) over the last dim, bit for bit as the reference, in one launch."""
    shape = tuple(x.shape)
    q = empty_contiguous(x, shape, torch.int8)
    scale = empty_contiguous(x, shape[:-1], torch.float32)
    if q.numel() == 0:
        return q, scale.zero_()  # no rows, or empty rows whose max|x| is taken as 0
    index = _index(x.device)
    x = x.contiguous()
    _check(library().pagedfuse_quantize(
        index, torch._C._cuda_getCurrentRawStream(index), _QUANTIZE_DTYPES[x.dtype],
        x.data_ptr(), q.data_ptr(), scale.data_ptr(), scale.numel(), x.shape[-1]))
    return q, scale
