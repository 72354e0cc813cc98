"""A seeded differential fuzzer for the rewrite: random programs around the paged-SDPA pattern,
each run eagerly and through pagedfuse, with one oracle (helpers.differential): where eager
runs, the compiled program runs too, and either the site is kept with a reason or the outputs,
every input written in place and the gradients equal eager's (NaN == NaN).

A program draws a spelling from the forms the pattern's tables accept (gathers, cache layouts,
views, GQA expansions, dequant orders, mask forms among them sliding windows, scales, dtypes,
SDPA or the explicit matmul-softmax-matmul with or without a soft cap; programs using a window
or a cap run with helpers.backends.OPTIONS_STAND_IN half the time, so their rewrite is held
to eager before the kernels exist), random small shapes, and
hazards from the classes of issue 20: writes in every form (in-place method, ``operator.i*``,
``out=``, setitem, copy_, through narrow/select/unbind/as_strided views or the stacked base, a
``mutates_args`` custom op) to the caches, table, lengths or scales at every point of the
program; look-alike table reads on either side of a write; dtype views; gradients (query,
learnable bias, ``enable_grad`` inside ``no_grad``); padding (K/V batch 1 broadcast, a sliced
table under longer lengths, finfo.min masks, and, where the op's contract takes them, empty
sequences, more queries than keys and -1 block ids).

``PAGEDFUSE_FUZZ_PROGRAMS`` programs (default 300) from ``PAGEDFUSE_FUZZ_SEED`` (default 0);
program i depends on (seed, i) alone, and ``PAGEDFUSE_FUZZ_ONLY=i`` reruns just that one.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.nn.functional as F
from helpers.backends import OPTIONS_STAND_IN, registered
from helpers.differential import INT8_TOLERANCE, differential
from helpers.programs import (
    Spec,
    dequant,
    expand_heads,
    explicit_attention,
    gather_pages,
    to_bhld,
)

from pagedfuse.patterns.paged_sdpa.kv_trace import GATHERS
from pagedfuse.patterns.paged_sdpa.masks import ADDITIVE, COMPARES, POSITIONS

PROGRAMS = int(os.environ.get("PAGEDFUSE_FUZZ_PROGRAMS", "300"))
SEED = int(os.environ.get("PAGEDFUSE_FUZZ_SEED", "0"))
ONLY = os.environ.get("PAGEDFUSE_FUZZ_ONLY")


def _op_runs(seq_len: int, block_id: int) -> bool:
    """Whether the op takes one query over ``seq_len`` keys in block ``block_id``: what the
    op contract allows (the semantics branch widens it)."""
    q, cache = torch.randn(1, 1, 64), torch.randn(2, 1, 1, 64)
    try:
        torch.ops.pagedfuse.paged_attention(
            q, cache, cache, torch.tensor([[block_id]]), torch.tensor([seq_len]),
            torch.tensor([0, 1]), 1.0, False)
    except ValueError:
        return False
    return True


SHORT_SEQUENCES = _op_runs(0, 0)  # a sequence with more query tokens than keys
NEGATIVE_IDS = _op_runs(1, -1)  # block ids that wrap like Python indexing


@torch.library.custom_op("pagedfuse_fuzz::bump_", mutates_args=("x",))
def bump_(x: torch.Tensor) -> None:
    """A write declared the way serving code declares one (mutates_args)."""
    x.copy_(_bumped(x))


@bump_.register_fake
def _bump_fake(x: torch.Tensor) -> None:
    return None


def _bumped(t: torch.Tensor) -> torch.Tensor:
    """Another valid value: halved floats, negated int8, ids/lengths with the low bit
    flipped (block ids stay below an even block count; lengths stay above q_len)."""
    if t.dtype.is_floating_point:
        return t * 0.5
    return -t if t.dtype == torch.int8 else t ^ 1


def _bump_in_place(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.mul_(0.5)
    elif t.dtype == torch.int8:
        t.neg_()
    else:
        t.bitwise_xor_(1)


def _operator(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t *= 0.5
    elif t.dtype == torch.int8:
        t *= -1
    else:
        t ^= 1


def _out(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        torch.mul(t, 0.5, out=t)
    elif t.dtype == torch.int8:
        torch.neg(t, out=t)
    else:
        torch.bitwise_xor(t, 1, out=t)


def _setitem(t: torch.Tensor) -> None:
    t[...] = _bumped(t)


WRITE_FORMS = {
    "method": _bump_in_place,
    "operator": _operator,
    "out": _out,
    "setitem": _setitem,
    "copy": lambda t: t.copy_(_bumped(t)),
    "narrow": lambda t: _bump_in_place(t.narrow(0, 0, max(1, t.shape[0] // 2))),
    "select": lambda t: _bump_in_place(t.select(t.dim() - 1, 0)),
    "unbind": lambda t: _bump_in_place(t.unbind(0)[0]),
    "as_strided": lambda t: _bump_in_place(t.as_strided((t.numel() // 2,), (2,))),
    "custom_op": bump_,
}
WRITE_POINTS = ("start", "between_gathers", "after_gathers", "after_mask", "end")
GATHER_SPELLINGS = {"getitem": "getitem", "getitem_slices": "getitem",
                    "index_select": "index_select", "torch_gather": "gather",
                    "take_along_dim": "take_along_dim", "take": "take"}
COMPARE_SPELLINGS = {"lt": ("lt",), "gt": ("gt",), "not_ge": ("ge", "logical_not"),
                     "le_minus_one": ("le",)}
MASKS = ("none", "bool", "where", "where_inverted", "masked_fill", "where_min", "offbyone",
         "alibi", "host_bias", "causal", "window", "sliding", "sliding_le", "sliding_topleft",
         "sliding_offbyone")
MASK_FORMS = {"where": ("where",), "where_inverted": ("where",),
              "masked_fill": ("masked_fill", "logical_not"), "where_min": ("where",),
              "offbyone": ("where",), "alibi": ("where", "add"),
              "window": ("logical_and", "ge"), "sliding": ("logical_and", "le", "lt"),
              "sliding_le": ("logical_and", "le")}
# Position arithmetic the mask forms above use (arange, + a constant, - , * -1).
POSITION_FORMS = {"sliding": ("arange", "add", "sub"), "window": ("sub",),
                  "sliding_offbyone": ("neg", "mul")}


@dataclass(frozen=True)
class Write:
    target: str  # kc | vc | bt | sl | ks | vs
    form: str  # a WRITE_FORMS key, or "base": through the stacked kv tensor
    point: str  # a WRITE_POINTS entry


@dataclass(frozen=True)
class Program:
    index: int
    spec: Spec
    kv: str  # float | int8 | int8_k (int8 K, float V)
    batch: int
    q_len: int
    hq: int
    hkv: int
    head_dim: int
    block_size: int
    blocks: int
    num_blocks: int
    table_dtype: torch.dtype
    compare: str  # a COMPARE_SPELLINGS key
    per_gather_index: bool  # K and V gathered through their own bt.to(int64)
    stacked: bool  # kc, vc = kv[0], kv[1]
    dtype_view: str  # none | roundtrip | reinterpret
    grad: str  # none | query | bias | enable_grad | no_grad
    padding: str  # none | kv_batch1 | sliced_table | empty_seq | long_prefill | minus_one
    writes: tuple[Write, ...] = field(default=())
    window: int = 3  # of the window/sliding masks
    stand_in: bool = False  # run with OPTIONS_STAND_IN (kernels for window_left/softcap)

    @property
    def gathered_blocks(self) -> int:
        return self.blocks - 1 if self.padding == "sliced_table" else self.blocks

    def hazards(self) -> list[str]:
        found = [f"write:{w.form}:{w.target}:{w.point}" for w in self.writes]
        found += [f"{kind}:{value}" for kind, value in (
            ("dtype_view", self.dtype_view), ("grad", self.grad), ("padding", self.padding))
            if value != "none"]
        return found + (["per_gather_index"] if self.per_gather_index else [])


def _pick(rng: random.Random, options: tuple, weights: tuple | None = None):
    return rng.choices(options, weights)[0]


def generate(index: int, seed: int = SEED) -> Program:
    """Program ``index`` of the run seeded by ``seed``; half of them carry no hazard."""
    rng = random.Random(f"{seed}:{index}")
    kv = _pick(rng, ("float", "int8", "int8_k"), (5, 3, 1))
    dtype = _pick(rng, (torch.float32, torch.bfloat16), (3, 1))
    gather = _pick(rng, tuple(GATHER_SPELLINGS))
    layout = "HND" if gather.startswith("getitem") and rng.random() < 0.3 else "NHD"
    gqa = _pick(rng, ("enable_gqa", "repeat_interleave", "repeat_kv", "mha"))
    dequant_form = "none" if kv == "float" else _pick(
        rng, ("to_mul", "promote", "scale_first", "float_then_to"))
    if kv == "int8_k":
        dequant_form = "to_mul_fp_value"
    spelling = _pick(rng, ("sdpa", "explicit"), (2, 1))
    spec = Spec(gather=gather, layout=layout, view=_pick(rng, ("flatten", "permute")),
                gqa=gqa, dequant=dequant_form, mask=_pick(rng, MASKS),
                scale=_pick(rng, ("default", "float")), dtype=dtype, spelling=spelling,
                softcap=_pick(rng, (None, 0.7, 30.0)) if spelling == "explicit" else None)
    hkv = _pick(rng, (1, 2))
    group = 1 if gqa == "mha" else _pick(rng, (1, 2, 4))
    q_len = _pick(rng, (1, 1, 2, 3))
    block_size, blocks = _pick(rng, (1, 2, 4)), rng.randint(1, 4)
    while blocks * block_size < q_len + 2:
        blocks += 1
    batch = rng.randint(1, 3)
    hazardous = rng.random() < 0.5
    padding = _pick(rng, ("none", "kv_batch1", "sliced_table", "empty_seq", "long_prefill",
                          "minus_one")) if hazardous and rng.random() < 0.4 else "none"
    if padding in ("empty_seq", "long_prefill") and not SHORT_SEQUENCES or \
            padding == "minus_one" and not NEGATIVE_IDS:
        padding = "none"  # the op cannot express these before the contract change
    if padding == "kv_batch1":
        batch = max(batch, 2)
    if padding == "sliced_table":
        blocks = max(blocks, 2)
    if padding == "long_prefill":
        q_len = 3
    if spec.mask in ("causal", "sliding", "sliding_le") and rng.random() < 0.5:
        q_len = blocks * block_size  # square: the op's own causal flag
    if q_len > (blocks - (padding == "sliced_table")) * block_size and not SHORT_SEQUENCES:
        q_len = 1
    num_blocks = batch * blocks + rng.randint(0, 4)
    num_blocks += num_blocks % 2  # even: a flipped low bit keeps a block id in range
    grad = _pick(rng, ("query", "bias", "enable_grad", "no_grad")) \
        if hazardous and rng.random() < 0.25 else "none"
    if grad == "bias":
        spec = replace(spec, mask="alibi")
    stacked = kv != "int8_k" and rng.random() < 0.25
    writes = []
    if hazardous and rng.random() < 0.7:
        targets = ("kc", "vc", "bt", "sl") + (("ks", "vs") if kv != "float" else ())
        for _ in range(rng.randint(1, 2)):
            form = _pick(rng, tuple(WRITE_FORMS) + (("base",) if stacked else ()))
            target = _pick(rng, ("kc", "vc")) if form == "base" else _pick(rng, targets)
            if target == "vs" and kv == "int8_k":
                target = "ks"
            writes.append(Write(target, form, _pick(rng, WRITE_POINTS)))
    dtype_view = _pick(rng, ("roundtrip", "reinterpret")) if hazardous and \
        rng.random() < 0.15 else "none"
    if dtype_view == "reinterpret" and kv == "float":
        dtype_view = "roundtrip"
    return Program(
        index=index, spec=spec, kv=kv, batch=batch, q_len=q_len, hq=hkv * group, hkv=hkv,
        head_dim=64 if kv != "float" else _pick(rng, (32, 64)), block_size=block_size,
        blocks=blocks, num_blocks=num_blocks,
        table_dtype=torch.int64 if gather == "take" else _pick(rng, (torch.int64, torch.int32)),
        compare=_pick(rng, tuple(COMPARE_SPELLINGS)),
        per_gather_index=hazardous and rng.random() < 0.2, stacked=stacked,
        dtype_view=dtype_view, grad=grad, padding=padding, writes=tuple(writes),
        window=rng.randint(1, blocks * block_size + 1), stand_in=rng.random() < 0.5)


def make_inputs(p: Program) -> tuple:
    """(q, kc, vc, bt, sl, ks, vs, bias, kv): random data everywhere, never zeros."""
    g = torch.Generator().manual_seed(1000 + p.index)
    dtype = p.spec.dtype
    shape = (p.num_blocks, p.block_size, p.hkv, p.head_dim)
    if p.spec.layout == "HND":
        shape = (p.num_blocks, p.hkv, p.block_size, p.head_dim)

    def cache(int8: bool) -> torch.Tensor:
        if int8:
            return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        return torch.randn(shape, generator=g).to(dtype)

    kc, vc = cache(p.kv != "float"), cache(p.kv == "int8")
    ks, vs = (torch.rand(shape[:3], generator=g) * 0.02 + 0.005 for _ in range(2))
    bt = torch.randperm(p.num_blocks, generator=g)[:p.batch * p.blocks].view(p.batch, p.blocks)
    keys = p.gathered_blocks * p.block_size
    low = min(p.q_len + 1, keys)
    sl = torch.randint(low, p.blocks * p.block_size + 1, (p.batch,), generator=g)
    if p.padding == "empty_seq":
        sl[torch.randint(0, p.batch, (1,), generator=g)] = 0
    elif p.padding == "long_prefill":
        sl[torch.randint(0, p.batch, (1,), generator=g)] = torch.randint(
            0, p.q_len, (1,), generator=g)
    elif p.padding == "minus_one":
        used = (sl + p.block_size - 1) // p.block_size
        bt[torch.arange(p.blocks)[None, :] >= used[:, None]] = -1
    q = torch.randn(p.batch, p.hq, p.q_len, p.head_dim, generator=g).to(dtype)
    if p.spec.mask == "host_bias":
        keep = torch.arange(keys) < sl[:, None]
        bias = torch.zeros(p.batch, 1, 1, keys).masked_fill(~keep[:, None, None], -math.inf)
    else:
        slopes = torch.rand(p.hq, generator=g)
        bias = (slopes[:, None, None] * (torch.arange(keys) - keys + 1.0)).expand(
            p.hq, p.q_len, keys)[None].contiguous()
    bias = bias.to(dtype).requires_grad_(p.grad == "bias")
    q.requires_grad_(p.grad in ("query", "enable_grad", "no_grad"))
    kv = torch.stack((kc, vc)) if p.stacked else torch.zeros(0)
    return q, kc, vc, bt.to(p.table_dtype), sl.to(_pick(random.Random(p.index), (
        torch.int64, torch.int32))), ks, vs, bias, kv


def _valid(p: Program, keys: int, sl: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(keys)
    if p.compare == "lt":
        return pos < sl[:, None]
    if p.compare == "gt":
        return sl[:, None] > pos
    if p.compare == "le_minus_one":
        return pos <= sl[:, None] - 1
    return ~(pos >= sl[:, None])


def _sliding(p: Program, q_len: int, keys: int) -> torch.Tensor:
    """[q_len, keys]: causal and a window over positions; the queries are the last q_len
    positions (the op's), or the first ones (top-left, another window and no causal)."""
    pos = torch.arange(keys)
    kind = p.spec.mask
    q_pos = torch.arange(q_len)[:, None] + (0 if kind == "sliding_topleft" else keys - q_len)
    causal = pos[None, :] <= q_pos
    if kind == "sliding_le":
        return causal & (q_pos - pos[None, :] <= p.window - 1)
    if kind == "sliding_offbyone":  # -(j - p) * 1 <= W: one key more than a W window
        return causal & (-(pos[None, :] - q_pos) * 1 <= p.window)
    return causal & (q_pos - pos[None, :] < p.window)


def _mask(p: Program, keys: int, sl: torch.Tensor, bias: torch.Tensor,
          dtype: torch.dtype) -> torch.Tensor | None:
    valid = _valid(p, keys, sl)
    kind = p.spec.mask
    if kind == "bool":
        mask = valid
    elif kind == "where":
        mask = torch.where(valid, 0.0, -math.inf).to(dtype)
    elif kind == "where_inverted":
        mask = torch.where(torch.arange(keys) >= sl[:, None], -math.inf, 0.0).to(dtype)
    elif kind == "masked_fill":
        mask = torch.zeros(valid.shape, dtype=dtype).masked_fill(~valid, -math.inf)
    elif kind == "where_min":
        mask = torch.where(valid, 0.0, torch.finfo(dtype).min).to(dtype)
    elif kind == "offbyone":
        mask = torch.where(torch.arange(keys) <= sl[:, None], 0.0, -math.inf).to(dtype)
    elif kind == "alibi":
        return bias + torch.where(valid, 0.0, -math.inf)[:, None, None, :].to(dtype)
    elif kind == "window":  # the last `window` keys of each sequence
        mask = valid & (torch.arange(keys) >= sl[:, None] - p.window)
    elif kind.startswith("sliding"):
        return _sliding(p, bias.shape[-2], keys)
    else:
        return bias if kind == "host_bias" else None
    return mask[:, None, None, :]


def _dtype_view(p: Program, pages: torch.Tensor) -> torch.Tensor:
    if p.dtype_view == "reinterpret":
        return pages.view(torch.uint8)
    if p.dtype_view == "roundtrip":
        as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16,
                  torch.int8: torch.uint8}[pages.dtype]
        return pages.view(as_int).view(pages.dtype)
    return pages


def build(p: Program):
    """The program as a function of ``make_inputs(p)``."""
    spec = p.spec

    def write(point: str, tensors: dict[str, torch.Tensor]) -> None:
        for w in p.writes:
            if w.point != point:
                continue
            if w.form == "base":  # block 0 of kv[0] / kv[1], written through the stack
                i = 0 if w.target == "kc" else 1
                tensors["kv"][i, 0] = _bumped(tensors["kv"][i, 0])
            else:
                WRITE_FORMS[w.form](tensors[w.target])

    def pages(cache: torch.Tensor, scales: torch.Tensor, table: torch.Tensor,
              view: bool) -> torch.Tensor:
        x = gather_pages(spec, cache, table)
        x = _dtype_view(p, x) if view else x
        if x.dtype in (torch.int8, torch.uint8):
            x = dequant(spec, x, gather_pages(spec, scales, table))
        return x

    def body(q, kc, vc, bt, sl, ks, vs, bias, kv):
        if p.stacked:
            kc, vc = kv[0], kv[1]
        tensors = {"kc": kc, "vc": vc, "bt": bt, "sl": sl, "ks": ks, "vs": vs, "kv": kv}
        write("start", tensors)
        table = bt[:, :p.gathered_blocks] if p.padding == "sliced_table" else bt
        table = table[:1] if p.padding == "kv_batch1" else table
        k_pages = pages(kc, ks, table.to(torch.int64) if p.per_gather_index else table, True)
        write("between_gathers", tensors)
        v_pages = pages(vc, vs, table.to(torch.int64) if p.per_gather_index else table, False)
        write("after_gathers", tensors)
        k, v = to_bhld(spec, k_pages), to_bhld(spec, v_pages)
        group = q.shape[1] // k.shape[1]
        k, v = expand_heads(spec, k, group), expand_heads(spec, v, group)
        mask = _mask(p, k.shape[2], sl, bias, q.dtype)
        write("after_mask", tensors)
        scale = 0.3 if spec.scale == "float" else None
        if spec.spelling == "explicit":
            if spec.mask == "causal":
                mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(
                    k.shape[2] - q.shape[2])
            out = explicit_attention(q, k, v, mask, scale, spec.softcap, 0.0)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=spec.mask == "causal", scale=scale,
                enable_gqa=spec.gqa == "enable_gqa")
        write("end", tensors)
        return out

    if p.grad != "enable_grad":
        return body

    def under_enable_grad(*args):
        with torch.enable_grad():
            return body(*args)

    return under_enable_grad


def run(p: Program):
    fn, args = build(p), make_inputs(p)
    tolerance = INT8_TOLERANCE if p.kv != "float" else None
    backward = p.grad in ("query", "bias", "enable_grad")
    with contextlib.ExitStack() as stack:
        if p.stand_in:
            stack.enter_context(registered(OPTIONS_STAND_IN))
        if p.grad in ("enable_grad", "no_grad"):
            stack.enter_context(torch.no_grad())
        return differential(fn, args, tolerance=tolerance, backward=backward)


def test_programs_are_drawn_from_every_form_the_pattern_accepts():
    """A new gather or mask form in the pattern's tables needs a spelling here too."""
    assert set(GATHER_SPELLINGS.values()) == set(GATHERS)
    mask_ops = {op for ops in (*COMPARE_SPELLINGS.values(), *MASK_FORMS.values()) for op in ops}
    assert mask_ops == set(COMPARES) | set(ADDITIVE)
    assert {op for ops in POSITION_FORMS.values() for op in ops} == set(POSITIONS)
    drawn = [generate(i) for i in range(PROGRAMS)]
    assert {p.spec.gather for p in drawn} == set(GATHER_SPELLINGS)
    assert {p.spec.mask for p in drawn} == set(MASKS)
    assert {(p.spec.spelling, p.spec.softcap is not None) for p in drawn} == {
        ("sdpa", False), ("explicit", False), ("explicit", True)}
    assert {w.form for p in drawn for w in p.writes} == set(WRITE_FORMS) | {"base"}
    assert {w.point for p in drawn for w in p.writes} == set(WRITE_POINTS)


@pytest.mark.skipif(PROGRAMS < 1, reason="PAGEDFUSE_FUZZ_PROGRAMS=0")
def test_differential_fuzz():
    """Every program: kept with a reason, or the same outputs, inputs and gradients as eager;
    never an error where eager runs. Both outcomes must occur often."""
    indices = [int(ONLY)] if ONLY is not None else range(PROGRAMS)
    failures, outcomes = [], Counter()
    for i in indices:
        p = generate(i)
        outcome = run(p)
        try:
            outcome.check()
        except AssertionError as exc:
            failures.append(f"program {i} (PAGEDFUSE_FUZZ_ONLY={i}): {p}\n  "
                            f"hazards {p.hazards()}\n  {exc}")
        outcomes["eager raised" if outcome.eager_error else
                 "rewritten" if outcome.rewritten else "kept"] += 1
    assert not failures, "\n\n".join(failures[:5]) + f"\n\n{len(failures)} failing programs"
    if ONLY is None and PROGRAMS >= 100:
        assert outcomes["rewritten"] >= PROGRAMS // 4, outcomes
        assert outcomes["kept"] >= PROGRAMS // 10, outcomes
        assert outcomes["eager raised"] <= PROGRAMS // 20, outcomes
