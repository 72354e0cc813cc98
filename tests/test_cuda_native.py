"""The CUDA C++ library's binding on any machine: when it is missing, and why a call cannot
take it (the checks run before the device is asked; the kernels are tested on the GPU in
test_cuda_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from pagedfuse.ops import cuda_native
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, Geometry, PagedCall

NOT_BUILT = "pagedfuse._cuda_kernels not built for this device"


def _call(dtype=torch.bfloat16, hq=8, hkv=2, d=128, row_pad=0, cache=None, scale=None,
          cache_dtype=torch.int8, batch=3) -> PagedCall:
    """A decode call built by hand: check_metadata would refuse some of these caches (rows
    not 16-byte aligned), whose refusal by the binding itself is under test."""
    query = torch.zeros(batch, hq, d, dtype=dtype)
    if cache is None:
        cache = torch.zeros(4, 16, hkv, d + row_pad, dtype=cache_dtype)[..., :d]
    if scale is None and cache.dtype == torch.int8:
        scale = torch.zeros(cache.shape[:3])
    table = torch.zeros(batch, 5, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    num_blocks, block_size, num_kv_heads, _ = cache.shape
    geometry = Geometry(batch, hq, num_kv_heads, d, num_blocks, block_size, batch, 5)
    return PagedCall(INT8_OP if scale is not None else FLOAT_OP, query, cache, cache, scale,
                     scale, table, table[:, 0], starts, 1.0, False, None, None, 1, geometry)


def _spread(shape, strides, dtype):
    """A tensor whose rows lie far apart, with no memory behind it (meta device)."""
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


def test_a_window_and_a_cap_are_no_reason():
    """The kernel takes window_left and softcap: such calls get as far as the device check."""
    call = _call()._replace(window_left=7, softcap=30.0)
    assert cuda_native.decode_unsupported(call) == NOT_BUILT


def test_cpu_tensors_never_take_the_cuda_library():
    assert not cuda_native.decode_available(torch.device("cpu"))
    assert cuda_native.decode_unsupported(_call()) == NOT_BUILT
    assert cuda_native.decode_unsupported(_call(cache_dtype=torch.bfloat16)) == NOT_BUILT


@pytest.mark.parametrize(("kwargs", "reason"), [
    (dict(dtype=torch.float32), "query dtype torch.float32 (bfloat16 or float16 only)"),
    (dict(hq=32, hkv=2), "16 query heads per KV head (at most 8)"),
    (dict(row_pad=8), "cache rows not 16-byte aligned"),
    (dict(row_pad=4, cache_dtype=torch.bfloat16), "cache rows not 16-byte aligned"),
    # 2^32 16-byte units: the first K/V offset the kernel's 32-bit arithmetic cannot hold
    (dict(cache=_spread((2, 16, 2, 128), (2**36, 256, 128, 1), torch.int8)),
     "cache or table offsets beyond 32 bits"),
    (dict(cache=_spread((2, 16, 2, 128), (2**35, 256, 128, 1), torch.bfloat16)),
     "cache or table offsets beyond 32 bits"),
    (dict(scale=_spread((2, 16, 2), (2**32, 2, 1), torch.float32)),
     "cache or table offsets beyond 32 bits"),
])
def test_unsupported_calls_say_why(kwargs, reason):
    assert cuda_native.decode_unsupported(_call(**kwargs)) == reason


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_the_offset_limit_is_exact(dtype):
    """The last 16-byte unit a 32-bit offset reaches passes the offset check (this machine
    then lacks the library), one more does not: in bytes, whatever the element size."""
    size = torch.empty(0, dtype=dtype).element_size()
    for stride, reason in ((2**36 - 16, NOT_BUILT),
                           (2**36, "cache or table offsets beyond 32 bits")):
        cache = _spread((2, 1, 2, 128), (stride // size, 256, 128, 1), dtype)
        assert cuda_native.decode_unsupported(_call(cache=cache)) == reason


def test_kind_follows_the_cache_dtypes():
    i8, bf16 = torch.zeros(1, dtype=torch.int8), torch.zeros(1, dtype=torch.bfloat16)
    assert cuda_native.kind_of(i8, i8) == "int8_kv"
    assert cuda_native.kind_of(i8, bf16) == "int8_k"
    assert cuda_native.kind_of(bf16, bf16) == "half"


def test_query_rows_read_in_place_only_when_aligned():
    base = torch.zeros(4, 8, 136, dtype=torch.bfloat16)
    assert cuda_native.aligned_rows(torch.zeros(4, 8, 128, dtype=torch.bfloat16))
    assert not cuda_native.aligned_rows(base[..., :128])  # heads not contiguous
    assert not cuda_native.aligned_rows(base.view(-1)[1:1 + 4 * 8 * 128].view(4, 8, 128))
    assert not cuda_native.aligned_rows(torch.zeros(4, 8, 128).transpose(0, 1))


@pytest.mark.parametrize(("tuned", "num_kv_heads", "batch", "heads"), [
    (4, 8, 64, 4),  # llama3_8b at B=64: 128 CTAs of 4 heads fill one wave of 132
    (4, 8, 8, 1),  # B=8: 64 CTAs of 1 head fit, and take half the splits of 2 heads
    (2, 4, 64, 2),  # qwen35
    (2, 4, 8, 1),
    (4, 6, 64, 2),  # 4 heads do not divide 6; no count fits one wave: the largest
    (4, 8, 256, 4),
    (4, 5, 8, 1),
    (1, 8, 64, 1),  # a variant tuned for one head per CTA
])
def test_heads_per_cta_divide_the_kv_heads_and_fill_one_wave(tuned, num_kv_heads, batch,
                                                              heads):
    variant = cuda_native.Variant(resident=1, warps=8, tile=32, heads=tuned,
                                  balanced_resident=1)
    assert cuda_native.heads_per_cta(variant, num_kv_heads, batch, sm_count=132) == heads
    assert cuda_native.cta_tokens(variant, heads) == 8 // heads * 32


@pytest.mark.parametrize(("heads", "num_kv_heads"), [(3, 6), (8, 8), (0, 4), (4, 6)])
def test_decode_into_names_a_bad_heads_per_cta(heads, num_kv_heads):
    """Checked before the library is asked, so on any machine."""
    call = _call(hq=num_kv_heads, hkv=num_kv_heads)
    query = call.query
    match = f"heads={heads}: KV heads per CTA must be one of"
    with pytest.raises(ValueError, match=match):
        cuda_native.decode_into(call, query, 1, heads)
    with pytest.raises(ValueError, match=match):
        cuda_native.kernel_into(call, query, query, None, 1, heads, query, query)


@pytest.mark.parametrize(("batch", "counters", "ctas", "error"), [
    # more sequences than its scan takes
    (cuda_native.BALANCED_MAX_BATCH + 1, 10**5, 132,
     "block_table has 2049 sequences: the balanced grid takes at most 2048"),
    (3, None, 132, r"counters must hold one count per sequence and head group \(6;"),
    (3, 2, 132, r"counters must hold one count per sequence and head group \(6;"),
    (3, 10**5, 131, "ctas=131 must be a multiple of the 2 head groups"),
])
def test_kernel_into_refuses_a_balanced_grid_it_cannot_count(batch, counters, ctas, error):
    """Checked before the library is asked, so on any machine."""
    call = _call(batch=batch)
    query = call.query
    counts = None if counters is None else torch.zeros(counters, dtype=torch.int32)
    with pytest.raises(ValueError, match=error):
        cuda_native.kernel_into(call, query, query, None, 0, 1, query, query,
                                ctas=ctas, counters=counts)
    if not error.startswith("counters"):  # the fused launch takes its counts itself
        with pytest.raises(ValueError, match=error):
            cuda_native.decode_into(call, query, 0, 1, ctas=ctas)


@pytest.mark.parametrize(("max_query", "group", "max_tiles", "columns"), [
    (1, 4, 4, (1, 1, 1)),  # one token: its heads in one n-tile
    (2, 4, 1, (2, 1, 1)),  # llama3_8b's q_len 2: 8 columns
    (4, 4, 2, (4, 2, 1)),  # llama3_8b's q_len 4 where two n-tiles are built
    (4, 4, 1, (4, 1, 2)),  # ... where one is: two column groups
    (2, 8, 2, (2, 2, 1)),  # tinyllama's q_len 2: 16 columns
    (3, 8, 2, (3, 2, 2)),  # 24 columns: two groups of two n-tiles
    (3, 5, 4, (3, 2, 1)),  # 15 columns: two n-tiles (more than built is never asked for)
    (4, 6, 1, (4, 1, 3)),  # qwen35 at head_dim 256
    (8, 8, 2, (8, 2, 4)),  # 64 columns: the most
])
def test_columns_hold_every_query_row(max_query, group, max_tiles, columns):
    got = cuda_native.columns_for(max_query, group, max_tiles)
    assert got == cuda_native.Columns(*columns)
    assert got.groups * got.tiles * cuda_native.COLUMNS >= max_query * group


@pytest.mark.parametrize(("columns", "heads", "ctas", "error"), [
    ((4, 1, 1), 1, 0, "the groups' columns must hold max_query x 4 query heads"),
    ((2, 3, 1), 1, 0, "n-tiles must be one of"),
    ((9, 4, 2), 1, 0, "max_query 1 to 8"),
    ((2, 0, 1), 1, 0, r"the one-token kernel \(tiles 0\) serves one query token"),
    ((2, 1, 1), 1, 132, "the balanced grid serves one query token per sequence"),
])
def test_decode_into_names_bad_columns(columns, heads, ctas, error):
    """Checked before the library is asked, so on any machine (8 query heads, 2 KV heads)."""
    call = _call(hq=8, hkv=2)
    with pytest.raises(ValueError, match=error):
        cuda_native.decode_into(call, call.query, 1, heads, ctas=ctas,
                                columns=cuda_native.Columns(*columns))
