"""The one builder of paged-attention op inputs for the op and kernel tests.

Every case is fresh random data (never zeros) in a random block table that reuses blocks
across sequences; the table's columns past what a sequence uses hold ids outside the cache,
so a kernel that read past seq_len would read garbage or fault. INT8 cases keep the float
caches they were quantized from, for comparisons with unquantized attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from pagedfuse.ops.backends import Backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, OPTIONS, PagedCall
from pagedfuse.ops.reference import paged_attention_reference, quantize_int8_reference
from pagedfuse.ops.validate import build_call

Tensor = torch.Tensor
KINDS = ("float", "int8_k", "int8_kv")  # PagedCall.kind
BIAS_SHAPES = ("full", "per_batch", "per_head_row", "3d", "2d")
OUTSIDE = 1000  # unused table entries point this far past the cache's last block


@dataclass
class Case:
    """One call's inputs, named as the op's schema names them."""

    query: Tensor
    key_cache: Tensor
    value_cache: Tensor
    key_scale: Tensor | None
    value_scale: Tensor | None
    block_table: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    scale: float
    causal: bool
    attn_bias: Tensor | None
    key_float: Tensor  # the caches before quantization (the caches themselves if float)
    value_float: Tensor
    window_left: int | None = None
    softcap: float | None = None

    @property
    def op(self) -> str:
        return FLOAT_OP if self.key_scale is None else INT8_OP

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def longest(self) -> int:
        return int(self.seq_lens.max())

    @property
    def longest_query(self) -> int:
        starts = self.query_start_loc.tolist()
        return max(b - a for a, b in zip(starts, starts[1:], strict=False))

    def to(self, device: str | torch.device) -> Case:
        """The same case on ``device``, every tensor with its strides."""
        moved = {f.name: _move(getattr(self, f.name), torch.device(device)) for f in fields(self)}
        return Case(**moved)

    def with_(self, **changes) -> Case:
        return replace(self, **changes)

    def op_args(self) -> dict:
        """Keyword arguments of torch.ops.pagedfuse.<op>."""
        args = dict(query=self.query, key_cache=self.key_cache, value_cache=self.value_cache,
                    block_table=self.block_table, seq_lens=self.seq_lens,
                    query_start_loc=self.query_start_loc, scale=self.scale,
                    causal=self.causal, attn_bias=self.attn_bias)
        if self.op == INT8_OP:
            args.update(key_scale=self.key_scale, value_scale=self.value_scale)
        args.update({name: getattr(self, name) for name in OPTIONS
                     if getattr(self, name) is not None})
        return args

    def run_op(self, max_seq_len: int | None = None,
               max_query_len: int | None = None) -> Tensor:
        """Through torch.ops.pagedfuse (validation, the registry's choice)."""
        op = getattr(torch.ops.pagedfuse, self.op)
        return op(**self.op_args(), max_seq_len=max_seq_len, max_query_len=max_query_len)

    def call(self, max_seq_len: int | None = None, max_query_len: int | None = None,
             capability: bool = True) -> PagedCall:
        """The validated record a backend receives (``capability``: see check_metadata)."""
        return build_call(self.op, self.query, self.key_cache, self.value_cache,
                          self.key_scale, self.value_scale, self.block_table, self.seq_lens,
                          self.query_start_loc, self.scale, self.causal, self.attn_bias,
                          max_seq_len, max_query_len, capability=capability,
                          window_left=self.window_left, softcap=self.softcap)

    def run_backend(self, backend: Backend, plan: object = None,
                    max_seq_len: int | None = None,
                    max_query_len: int | None = None) -> Tensor:
        """``backend.run`` straight into a NaN-filled output (an element it never writes
        stays NaN and fails any error measure)."""
        out = torch.full(self.query.shape, float("nan"), dtype=self.query.dtype,
                         device=self.device)
        # capability=False: the head_dim check asks whether any backend of the device serves
        # it, and a backend runs its own cases (the reference on CUDA at head_dim 96)
        backend.run(self.call(max_seq_len, max_query_len, capability=False), out, plan)
        return out

    def reference(self, unquantized: bool = False,
                  dtype: torch.dtype = torch.float64) -> Tensor:
        """The pure-torch reference on the CPU in ``dtype``; ``unquantized``: float attention
        over the caches before quantization."""
        c = self.to("cpu")
        key, value, key_scale, value_scale = c.key_cache, c.value_cache, c.key_scale, \
            c.value_scale
        if unquantized:
            key, value = c.key_float.to(c.query.dtype), c.value_float.to(c.query.dtype)
            key_scale = value_scale = None
        return paged_attention_reference(
            c.query, key, value, c.block_table, c.seq_lens, c.query_start_loc, c.scale,
            c.causal, c.attn_bias, key_scale, value_scale, compute_dtype=dtype,
            window_left=c.window_left, softcap=c.softcap)


def poison_kv(case: object, which: str, block: int, slot: int, value: float) -> None:
    """``value`` into one key ("k") or value ("v") of the cache at (block, slot): an element
    of the float cache, or the token's scale of an INT8 one (head 0 of K, head 1 of V).
    ``case``: any record with the op's cache fields (key_cache, key_scale, ...)."""
    if which == "k":
        if case.key_scale is None:
            case.key_cache[block, slot, 0, 3] = value
        else:
            case.key_scale[block, slot, 0] = value
    elif case.value_scale is None:
        case.value_cache[block, slot, 1, 11] = value
    else:
        case.value_scale[block, slot, 1] = value


def _move(t: object, device: torch.device) -> object:
    """``t`` on ``device`` with its strides (``Tensor.to`` makes a non-dense view dense)."""
    if not isinstance(t, Tensor) or t.device == device:
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


def _cache(shape: tuple[int, int, int, int], layout: str, gen: torch.Generator) -> Tensor:
    """Random float32 [num_blocks, block_size, Hkv, D]; HND storage passed as its view."""
    nb, bs, hkv, d = shape
    if layout == "HND":
        return torch.randn(nb, hkv, bs, d, generator=gen).transpose(1, 2)
    return torch.randn(nb, bs, hkv, d, generator=gen)


def quantized(cache: Tensor) -> tuple[Tensor, Tensor]:
    """int8 cache and its per-(token, head) scales, both in the cache's layout."""
    q, s = quantize_int8_reference(cache)
    if cache.is_contiguous():
        return q, s
    return (q.transpose(1, 2).contiguous().transpose(1, 2),
            s.transpose(1, 2).contiguous().transpose(1, 2))


def make_bias(kind: str | None, shape: tuple[int, ...], gen: torch.Generator) -> Tensor | None:
    """A bool mask (a quarter of the keys masked) or a float bias, random."""
    if kind is None:
        return None
    if kind == "bool":
        return torch.rand(shape, generator=gen) > 0.25
    return torch.randn(shape, generator=gen) * 2


def random_lengths(batch: int, longest: int, seed: int = 0) -> list[int]:
    """``batch`` sequence lengths drawn uniformly from [1, longest]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, longest + 1, (batch,), generator=gen).tolist()


def make_case(seq_lens: tuple[int, ...] | list[int] = (37, 20, 5),
              q_lens: tuple[int, ...] | list[int] | None = None, num_q_heads: int = 8,
              num_kv_heads: int = 2, head_dim: int = 64, block_size: int = 16,
              dtype: torch.dtype = torch.float32, layout: str = "NHD",
              index_dtype: torch.dtype = torch.int32, kind: str = "float",
              causal: bool = False, bias: str | None = None, bias_shape: str = "full",
              strided_query: bool = False, num_blocks: int | None = None,
              spare_blocks: int = 1, seed: int = 0, device: str = "cpu",
              window_left: int | None = None, softcap: float | None = None) -> Case:
    """``q_lens`` default one token each (decode); each must be <= its seq_len. ``kind``:
    see KINDS (int8_k keeps V in ``dtype``). ``num_blocks`` default: fewer than the
    sequences use, so blocks repeat. ``spare_blocks``: table columns past the longest
    sequence's blocks (ids outside the cache). ``window_left``/``softcap``: the op's
    options (None: off)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} not in {KINDS}")
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    q_lens = list(q_lens) if q_lens is not None else [1] * batch
    used = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(used, default=0) + spare_blocks
    if num_blocks is None:
        num_blocks = max(2, sum(used) // 2 + 1)
    table = torch.randint(0, num_blocks, (batch, max_blocks), generator=gen)
    for b, n in enumerate(used):
        table[b, n:] = num_blocks + OUTSIDE
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_float, value_float = _cache(shape, layout, gen), _cache(shape, layout, gen)
    key, value, key_scale, value_scale = key_float.to(dtype), value_float.to(dtype), None, None
    if kind != "float":
        key, key_scale = quantized(key_float)
    if kind == "int8_kv":
        value, value_scale = quantized(value_float)
    total = sum(q_lens)
    if strided_query:  # every other head of a wider tensor: strides, not a copy
        query = torch.randn(total, 2 * num_q_heads, head_dim, generator=gen).to(dtype)[:, ::2]
    else:
        query = torch.randn(total, num_q_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()])
    max_q, max_k = max(q_lens, default=1), max(seq_lens, default=1)
    bias_shapes = {
        "full": (batch, num_q_heads, max_q, max_k + 3),
        "per_batch": (batch, 1, max_q, max_k),
        "per_head_row": (1, num_q_heads, 1, max_k),
        "3d": (num_q_heads, max_q, max_k),
        "2d": (max_q, max_k),
    }
    case = Case(query, key, value, key_scale, value_scale, table.to(index_dtype),
                torch.tensor(seq_lens, dtype=index_dtype), starts.to(index_dtype),
                head_dim**-0.5, causal, make_bias(bias, bias_shapes[bias_shape], gen),
                key_float, value_float, window_left, softcap)
    return case.to(device)
