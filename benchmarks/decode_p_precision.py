"""Where the INT8 K+V decode kernels lose accuracy: a faithful PyTorch emulation of their
numerics, and of alternatives for P·V, measured on random data, on real activations and as
perplexity.

The GPU decode kernels for an INT8 V cache fold the per-token V scales into P. The Triton
kernel (and the CUDA C++ one before it moved to fp16 P') quantizes P' = p * v_scale to int8
per query head and tile of keys (step = tile max / 127), runs P·V as an int8 MMA and scales
the int32 result back, while the softmax denominator l sums the unquantized p. The kernels
(``KERNELS``) and what each does by default (``Kernel.pv``):

- ``cuda``: csrc/cuda/paged_decode.cu (16-bit queries only): tiles of 32 keys, dealt in
  turn to the warps of a head (4 warps at head_dim 64), each with its own exp2 online
  softmax whose max lags by up to kLazyMax = 8, the warps merged per CTA, then the split
  combine; P' in fp16 (``cuda/int8``: the int8 P it had, rounded to nearest even).
- ``triton``: the split-KV kernel of pagedfuse/ops/triton_paged.py (every other decode,
  e.g. a float32 query, as bench_fidelity's INT8 K+V model sends): tiles of BLOCK_N = 128
  keys, the max moved every tile, P' in fp16 (the kernel scales it by its row's largest
  first; unscaled here, the same within fp16's range); ``triton/int8``: the int8 P it had,
  rounded half away from zero (the record's ``triton`` rows were measured with it).

Both quantize the query per (token, head) exactly as quantize_int8 and take Q·K^T exactly in
integers. ``emulate`` reproduces that arithmetic in float32 (tile boundaries, split chunks,
merges and combines included) with P·V done one of several ways (``PV_MODES``), so each
error source can be measured alone.

Modes (run what you need; each updates the one JSON record, --json):

- ``--random``: each emulation against fp32 attention on the unquantized K/V, beside the
  plain dequantize-then-attend, on random data (bench_decode's construction, so the errors
  compare with the GPU kernels' measured ones).
- ``--capture``: SmolLM2-135M over --tokens text tokens (sliding windows of --window,
  --prefill prefilled), every decode call of every layer answered by a
  dequantize-then-attend while each variant is computed on the same query and caches:
  relative error and bias of the output (its signed projection on the reference output) and
  the signed error of the attention mass that reaches the numerator, against
  dequantize-then-attend and against the quantized query with exact P·V.
- ``--fidelity VARIANT ...``: bench_fidelity's perplexity, with the prefill calls through the
  dequantize-then-attend and the decode calls through the emulated variant (``dequant``: the
  baseline, every call plain; run first unless the record has it), so the decode line is the
  decode kernel's loss alone. Paired standard errors over windows, as bench_fidelity gives.

    .venv/bin/python benchmarks/decode_p_precision.py --random --capture --tokens 2048 \\
        --json benchmarks/results/pv_precision.json
    .venv/bin/python benchmarks/decode_p_precision.py --tokens 16384 --prefill 512 \\
        --fidelity dequant triton/int8 cuda/int8 cuda --json benchmarks/results/pv_precision.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import pagedfuse
from pagedfuse import envs
from pagedfuse.models import fidelity, from_transformers, smollm2
from pagedfuse.ops.backends import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall
from pagedfuse.ops.reference import quantize_int8_reference

BENCHMARKS = Path(__file__).resolve().parent

LOG2E = 1.4426950408889634
ROUND_BIAS = 12582912.0  # 1.5 * 2^23: x + it rounds x to an integer, ties to even


@dataclass(frozen=True)
class Kernel:
    """A decode kernel's tiling and softmax: ``tile`` keys per P quantization, ``streams``
    tiles dealt in turn per split (the CUDA kernel's warps per head; its split chunks are
    multiples of streams * tile), ``lazy`` log2 units the running max may lag (0: it moves
    every tile), ``ties_even``: int8 P rounds ties to even (else away from zero), ``pv``:
    its P·V (a PV_MODES entry), ``splits``: the split count (None: what the kernel's
    heuristics pick for the H200's 132 SMs)."""

    name: str
    tile: int
    streams: int
    lazy: float
    ties_even: bool
    pv: str
    splits: int | None = None


def cuda_kernel(head_dim: int) -> Kernel:
    """paged_decode.cu's INT8 K+V variant (Traits<kInt8KV, D>): 32-key tiles; 4 warps on
    one head at head_dim 64, else 8 warps over 4 (128) or 2 (256) heads."""
    streams = {64: 4, 128: 2, 256: 4}[head_dim]
    return Kernel("cuda", tile=32, streams=streams, lazy=8.0, ties_even=True, pv="fp16")


TRITON = Kernel("triton", tile=128, streams=1, lazy=0.0, ties_even=False, pv="fp16")
KERNELS = ("cuda", "triton")


def kernel_named(name: str, head_dim: int) -> Kernel:
    return cuda_kernel(head_dim) if name == "cuda" else TRITON


def h200_splits(kernel: Kernel, batch: int, num_kv_heads: int, head_dim: int,
                context: int) -> int:
    """The split count the kernel's host code picks on the H200's 132 SMs, as
    cuda.num_kv_splits computes it for that backend's LaunchConfig (that module needs
    Triton): the CUDA decode takes the largest power of two of splits whose CTAs (one per
    sequence and KV head) fit one wave at 4 per SM (INT8 K+V, head_dim 64; larger grids are
    not modelled), the Triton one a power of two near 4 programs per SM times
    sqrt(128 / head_dim); never more than tiles of the context."""
    programs, sms = batch * num_kv_heads, 132
    tiles = -(-context // (kernel.tile * kernel.streams))
    if kernel.name == "cuda":
        fit = max(4 * sms // max(programs, 1), 1)
        splits = 1 << (fit.bit_length() - 1)
    else:
        wanted = max(1.0, 4 * sms * math.sqrt(128 / head_dim) / max(programs, 1))
        splits = 1 << int(math.log2(wanted))
    return max(1, min(splits, tiles))


# How P·V is done over the int8 V cache (v8 [.., T, D] with per-token scales vs):
#   float            P' = p * vs in fp32 (the CPU kernel; only the query's quantization left)
#   int8             P' quantized per head and tile to int8, l from the unquantized p (today)
#   int8_consistent  as int8, with l summed from the dequantized quantized weights q step / vs
#   fp16             P' rounded to fp16, V int8 -> fp16 (exact), fp32 accumulation
#   int8x2           P' as int8 plus its rounding residual as a second int8 (two int8 MMAs)
PV_MODES = ("float", "int8", "int8_consistent", "fp16", "int8x2")


@dataclass(frozen=True)
class Variant:
    """One emulated decode: a kernel's structure, a P·V mode, whether the query is quantized
    (False: only for the dequantize-then-attend reference), and whether the model's prefill
    calls (causal, several query tokens) are emulated too (the Triton kernel's, which serves
    a float32 query's prefill on the GPU; else they are the dequantize-then-attend)."""

    kernel: Kernel
    pv: str
    quantize_query: bool = True
    prefill: bool = False

    @property
    def name(self) -> str:
        return f"{self.kernel.name}/{self.pv}" + ("+prefill" if self.prefill else "")


@dataclass
class Emulated:
    """[B, Hq, D] outputs and [B, Hq] attention mass reaching the numerator (sum over keys
    of each key's effective weight over the softmax's denominator; 1 where exact)."""

    out: torch.Tensor
    mass: torch.Tensor


def _round_p(x: torch.Tensor, ties_even: bool) -> torch.Tensor:
    if ties_even:  # x + 1.5 * 2^23 in one rounding, as the kernel's FMA does
        return (x + ROUND_BIAS) - ROUND_BIAS
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def _pv_tile(p: torch.Tensor, v8: torch.Tensor, vs: torch.Tensor, pv: str,
             ties_even: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's P·V: p [..., T] (0 on masked keys), v8 [..., T, D] as float, vs [..., T].
    Returns (the part added to O [..., D], the weights it gave each key [..., T] in units of
    p, the tile's contribution to l [...])."""
    l_part = p.sum(-1)
    pv_ = torch.where(p > 0, p * vs, torch.zeros_like(p))  # never 0 * a masked key's scale
    if pv == "float":
        weights = pv_
    elif pv == "fp16":  # held at fp16's largest value, as the CUDA kernel's kPMax
        weights = pv_.clamp(max=65504.0).half().float()
    else:
        pmax = pv_.abs().amax(-1, keepdim=True)
        if ties_even:  # __fdividef(127, pmax), then the step as pmax * (1 / 127)
            inv = torch.where(pmax > 0, 127.0 / pmax, torch.ones_like(pmax))
            step = torch.where(pmax > 0, pmax * (1.0 / 127.0), torch.ones_like(pmax))
        else:  # Triton: step = pmax / 127, then pv * (1 / step)
            step = torch.where(pmax > 0, pmax / 127.0, torch.ones_like(pmax))
            inv = 1.0 / step
        scaled = pv_ * inv
        q = _round_p(scaled, ties_even)
        if pv == "int8x2":  # the residual in [-0.5, 0.5] as a second int8 of step / 254
            q = q + _round_p((scaled - q) * 254.0, ties_even) / 254.0
        weights = q * step
        if pv == "int8_consistent":
            l_part = torch.where(p > 0, weights / vs, torch.zeros_like(p)).sum(-1)
    part = torch.einsum("...t,...td->...d", weights, v8)
    mass = torch.where(p > 0, weights / vs, torch.zeros_like(p))
    return part, mass, l_part


def emulate(query: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor, v8: torch.Tensor,
            vs: torch.Tensor, length: int, scale: float, variant: Variant,
            splits: int | None = None, reads: torch.Tensor | None = None) -> Emulated:
    """The attention of each sequence's query over its ``length`` keys: query [B, Hq, D] (a
    decode) or [B, n, Hq, D] (n tokens, causal, the last at position length - 1: the Triton
    kernel's prefill), k8/v8 [B, >= length, Hkv, D] int8 and ks/vs [B, >= length, Hkv], as
    the kernel's tiles, softmax, merges and split combine compute it (non-finite inputs are
    not modelled). ``splits``: None takes the kernel's own count, else its H200 count.
    ``reads``: a bool mask [B, 1 or Hq, n, >= length] of the keys each row reads (a bool
    attn_bias, which the kernel adds as 0 / -inf), in place of the causal mask. Rows of a
    tile are independent in every kernel, so each row is emulated alone."""
    kernel = variant.kernel
    decode = query.dim() == 3
    if decode:
        query = query.unsqueeze(1)
    batch, rows, num_q_heads, head_dim = query.shape
    num_kv_heads = k8.shape[2]
    group = num_q_heads // num_kv_heads
    if splits is None:
        splits = kernel.splits or h200_splits(kernel, batch, num_kv_heads, head_dim, length)
    scale_log2 = scale * LOG2E
    if variant.quantize_query:
        q8, q_scale = quantize_int8_reference(query)
        q_float = q8.float()
    else:
        q_float, q_scale = query.float(), torch.ones(query.shape[:3])
    q_float = q_float.view(batch, rows, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q_scale = q_scale.view(batch, rows, num_kv_heads, group, 1).permute(0, 2, 3, 1, 4)
    k, v = k8[:, :length].float(), v8[:, :length].float()
    k_scale = ks[:, :length].float().permute(0, 2, 1)[:, :, None, None]  # [B, Hkv, 1, 1, L]
    v_scale = vs[:, :length].float().permute(0, 2, 1)  # [B, Hkv, L]
    dots = torch.einsum("bhgnd,blhd->bhgnl", q_float, k)  # exact: integers below 2^24
    if kernel.name == "cuda":  # sc *= (q_scale * scale_log2) * k_scale
        scores = dots * ((q_scale * scale_log2) * k_scale)
    else:  # qk * (q_scale * k_scale) * sm_scale_log2
        scores = dots * (q_scale * k_scale) * scale_log2
    if reads is None:  # bottom-right causal
        positions = torch.arange(rows)[:, None] + (length - rows)
        reads = torch.arange(length)[None, :] <= positions
    else:  # [B, 1 or Hq, n, L] -> [B, Hkv, G, n, L]
        reads = reads[..., :length].expand(batch, num_q_heads, rows, length).reshape(
            batch, num_kv_heads, group, rows, length)
    scores = scores.masked_fill(~reads, float("-inf"))

    # Key index of every tile slot: split s, stream w, round i, token t.
    cta = kernel.tile * kernel.streams
    per_split = -(-length // splits)
    chunk = -(-per_split // cta) * cta
    rounds = chunk // cta
    s_i = torch.arange(splits).view(-1, 1, 1, 1)
    w_i = torch.arange(kernel.streams).view(1, -1, 1, 1)
    r_i = torch.arange(rounds).view(1, 1, -1, 1)
    t_i = torch.arange(kernel.tile).view(1, 1, 1, -1)
    idx = s_i * chunk + w_i * kernel.tile + r_i * cta + t_i  # [S, W, R, T]
    live = idx < torch.clamp(s_i * chunk + chunk, max=length)
    idx = torch.where(live, idx, 0).flatten()

    def tiles(x: torch.Tensor, dim: int = -1) -> torch.Tensor:  # L -> S, W, R, T at dim
        dim %= x.dim()
        return x.index_select(dim, idx).unflatten(dim, (splits, kernel.streams, rounds,
                                                        kernel.tile))

    s_t = tiles(scores).masked_fill(~live, float("-inf"))  # [B, Hkv, G, n, S, W, R, T]
    v_t = tiles(v.permute(0, 2, 1, 3), dim=2)[:, :, None, None]  # [B, Hkv, 1, 1, S, .., D]
    vs_t = tiles(v_scale)[:, :, None, None]  # [B, Hkv, 1, 1, S, W, R, T]

    shape = s_t.shape[:6]
    m = torch.full(shape, float("-inf"))
    l_sum = torch.zeros(shape)
    mass = torch.zeros(shape)
    o = torch.zeros(*shape, head_dim)
    for r in range(rounds):
        st = s_t[..., r, :]
        tile_max = st.amax(-1)
        if kernel.lazy:
            grow = tile_max > m + kernel.lazy
            alpha = torch.where(grow, torch.exp2(m - tile_max), torch.ones_like(m))
            m = torch.where(grow, tile_max, m)
        else:
            m_new = torch.maximum(m, tile_max)
            alpha = torch.exp2(m - torch.where(m_new == float("-inf"), 0.0, m_new))
            m = m_new
        m_use = torch.where(m == float("-inf"), 0.0, m)
        p = torch.exp2(st - m_use.unsqueeze(-1))
        part, weights, l_part = _pv_tile(p, v_t[..., r, :, :], vs_t[..., r, :], variant.pv,
                                         kernel.ties_even)
        l_sum = l_sum * alpha + l_part
        mass = mass * alpha + weights.sum(-1)
        o = o * alpha.unsqueeze(-1) + part

    # Merge the streams (the CUDA CTA's warps), then combine the splits; dim: m's axis.
    def merge(m: torch.Tensor, l_sum: torch.Tensor, *acc: torch.Tensor, dim: int):
        top = m.amax(dim, keepdim=True)
        top = torch.where(top == float("-inf"), 0.0, top)
        e = torch.exp2(m - top)
        total = (e * l_sum).sum(dim)
        safe = torch.where(total > 0, total, torch.ones_like(total))
        vals = [((e.unsqueeze(-1) if a.dim() > e.dim() else e) * a).sum(dim)
                / (safe.unsqueeze(-1) if a.dim() > e.dim() else safe) for a in acc]
        return top.squeeze(dim), total, vals

    m, l_sum, (o, mass) = merge(m, l_sum, o, mass, dim=5)  # over W: [B, Hkv, G, n, S]
    lse = torch.where(l_sum > 0, m + torch.log2(torch.where(l_sum > 0, l_sum, 1.0)),
                      float("-inf"))
    _, _, (o, mass) = merge(lse, torch.ones_like(lse), o, mass, dim=4)
    out = o.permute(0, 3, 1, 2, 4).reshape(batch, rows, num_q_heads, head_dim)
    mass = mass.permute(0, 3, 1, 2).reshape(batch, rows, num_q_heads)
    return Emulated(out[:, 0], mass[:, 0]) if decode else Emulated(out, mass)


def dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x8.double() * scale.double().unsqueeze(-1)


def attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain attention of one query token per sequence in float64: query [B, Hq, D], k/v
    [B, L, Hkv, D] (every key read)."""
    batch, num_q_heads, head_dim = query.shape
    group = num_q_heads // k.shape[2]
    q = query.double().view(batch, k.shape[2], group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k.double()) * scale
    out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), v.double())
    return out.reshape(batch, num_q_heads, head_dim)


def quantized_query(query: torch.Tensor) -> torch.Tensor:
    """The query as the kernels see it: quantize_int8 per (token, head), dequantized."""
    q8, q_scale = quantize_int8_reference(query)
    return dequantize(q8, q_scale)


def all_variants(head_dim: int) -> list[Variant]:
    return [Variant(kernel_named(k, head_dim), pv) for k in KERNELS for pv in PV_MODES]


def variant_named(name: str, head_dim: int) -> Variant:
    """``kernel[/pv][+prefill]`` (``cuda``, ``triton`` alone: P·V as that kernel does it
    now; ``+prefill``: the prefill calls too, the Triton kernel only)."""
    base, prefill = name.removesuffix("+prefill"), name.endswith("+prefill")
    kernel, _, pv = base.partition("/")
    if kernel not in KERNELS or (pv and pv not in PV_MODES) or (prefill and kernel != "triton"):
        raise ValueError(f"variant {name!r}: want KERNEL[/PV][+prefill], KERNEL in {KERNELS}, "
                         f"PV in {PV_MODES}, +prefill with triton only")
    found = kernel_named(kernel, head_dim)
    return Variant(found, pv or found.pv, prefill=prefill)


@dataclass
class ErrorStats:
    """Sums over output rows of one variant's error e = out - ref (ref: a reference
    output): relative error, the signed share of e along ref (bias: < 0 shrinks the output),
    the mean signed element error over the reference's rms, and the attention mass's signed
    error (mass - 1) and its rms."""

    err2: float = 0.0
    ref2: float = 0.0
    along: float = 0.0
    err_sum: float = 0.0
    elements: int = 0
    mass_err: float = 0.0
    mass_err2: float = 0.0
    rows: int = 0

    def add(self, out: torch.Tensor, ref: torch.Tensor, mass: torch.Tensor | None = None):
        e = out.double() - ref.double()
        self.err2 += float((e * e).sum())
        self.ref2 += float((ref.double() ** 2).sum())
        self.along += float((e * ref.double()).sum())
        self.err_sum += float(e.sum())
        self.elements += e.numel()
        if mass is not None:
            dm = mass.double() - 1.0
            self.mass_err += float(dm.sum())
            self.mass_err2 += float((dm * dm).sum())
            self.rows += dm.numel()

    def summary(self) -> dict[str, float]:
        rms = math.sqrt(self.ref2 / max(self.elements, 1))
        found = {"rel_err": math.sqrt(self.err2 / self.ref2),
                 "bias_along_ref": self.along / self.ref2,
                 "mean_err_over_rms": self.err_sum / max(self.elements, 1) / rms}
        if self.rows:
            found["mass_bias"] = self.mass_err / self.rows
            found["mass_rms_err"] = math.sqrt(self.mass_err2 / self.rows)
        return found


@dataclass
class Capture:
    """Error sums per variant over every decode call seen, against the dequantize-then-attend
    (``vs_dequant``) and against attention with the quantized query and exact P·V
    (``vs_q8``: the P·V path's own error)."""

    variants: list[Variant]
    vs_dequant: dict[str, ErrorStats] = field(default_factory=dict)
    vs_q8: dict[str, ErrorStats] = field(default_factory=dict)
    calls: int = 0

    def observe(self, query, k8, ks, v8, vs, length, scale, splits_of) -> torch.Tensor:
        k, v = dequantize(k8[:, :length], ks[:, :length]), dequantize(v8[:, :length],
                                                                      vs[:, :length])
        ref = attend(query, k, v, scale)
        ref_q8 = attend(quantized_query(query), k, v, scale)
        self.vs_dequant.setdefault("query quantized, exact P·V", ErrorStats()).add(ref_q8, ref)
        for variant in self.variants:
            got = emulate(query, k8, ks, v8, vs, length, scale, variant,
                          splits=splits_of(variant.kernel))
            self.vs_dequant.setdefault(variant.name, ErrorStats()).add(got.out, ref, got.mass)
            self.vs_q8.setdefault(variant.name, ErrorStats()).add(got.out, ref_q8, got.mass)
        self.calls += 1
        return ref

    def summary(self) -> dict:
        return {"calls": self.calls,
                "vs_dequant": {k: s.summary() for k, s in self.vs_dequant.items()},
                "vs_q8": {k: s.summary() for k, s in self.vs_q8.items()}}


def call_inputs(call: PagedCall, prefill: bool = False):
    """(query [B, Hq, D] or [B, n, Hq, D], k8, ks, v8, vs [B, L(, Hkv, D)], L) of a call the
    emulation takes, and the keys each row reads (None: all, or causal): INT8 K+V, every
    sequence as long and with as many query tokens (one with no bias, or with ``prefill``
    several, causal or under a bool mask), no option; None for any other call."""
    bias = call.attn_bias
    if call.value_scale is None or call.key_scale is None or call.options or (
            bias is not None and bias.dtype != torch.bool):
        return None
    lengths, q_lens = call.seq_lens, call.query_start_loc.diff()
    if not lengths.numel() or not bool((lengths == lengths[0]).all()) \
            or not bool((q_lens == q_lens[0]).all()):
        return None
    n = int(q_lens[0])
    if n == 0 or (n == 1 and bias is not None) or (
            n > 1 and not (prefill and (call.causal or bias is not None))):
        return None
    g = call.geometry
    length = int(lengths[0])
    blocks = call.block_table[:, :-(-length // g.block_size)].long()

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x[blocks].flatten(1, 2)[:, :length]

    query = call.query if n == 1 else call.query.view(g.batch, n, *call.query.shape[1:])
    reads = None
    if bias is not None:
        reads = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))[..., :n, :length]
        reads = reads.expand(g.batch, *reads.shape[1:])
        if call.causal:
            positions = torch.arange(n)[:, None] + (length - n)
            reads = reads & (torch.arange(length)[None, :] <= positions)
    return (query, rows(call.key_cache), rows(call.key_scale), rows(call.value_cache),
            rows(call.value_scale), length, reads)


class Emulation:
    """The op's backend while measuring: decode calls (and prefill calls, if it says so) as
    ``variant`` computes them (None: the dequantize-then-attend), or decode calls observed by
    ``capture`` (which answers with the dequantize-then-attend); every other call is the
    dequantize-then-attend."""

    variant: Variant | None = None
    capture: Capture | None = None
    PREFILL_BATCH = 4  # sequences a prefill is emulated at a time (its tiles take memory)

    @classmethod
    def run(cls, call: PagedCall, out: torch.Tensor, plan: None = None) -> None:
        prefill = cls.variant is not None and cls.variant.prefill
        inputs = call_inputs(call, prefill) if cls.variant or cls.capture else None
        if inputs is None:
            fidelity_module()._dequantize_then_attend(call, out)
            return
        g = call.geometry
        splits_of = lambda kernel: h200_splits(kernel, g.batch, g.num_kv_heads, g.head_dim,  # noqa: E731
                                               call.keys_bound)
        *tensors, length, reads = inputs
        if cls.capture is not None:
            got = cls.capture.observe(*tensors, length, call.scale, splits_of)
        else:
            splits, step = splits_of(cls.variant.kernel), cls.PREFILL_BATCH
            got = torch.cat([
                emulate(*(x[b:b + step] for x in tensors), length, call.scale, cls.variant,
                        splits=splits, reads=None if reads is None else reads[b:b + step]).out
                for b in range(0, g.batch, step)])
        out.copy_(got.reshape(out.shape))


EMULATION_BACKEND = "decode-p-emulation"


def fidelity_module():
    """benchmarks/bench_fidelity.py, imported on first use: importing it registers its
    dequantize-then-attend backend, which only a measuring run wants (not a test importing
    this module)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import bench_fidelity

    return bench_fidelity


def register() -> None:
    """The emulation's backend, asked only when forced (PAGEDFUSE_BACKEND)."""
    fidelity_module()
    from pagedfuse.ops.backends import all_backends

    if EMULATION_BACKEND not in {b.name for b in all_backends()}:
        register_backend(Backend(name=EMULATION_BACKEND, device=None, priority=-2,
                                 head_dims={FLOAT_OP: None, INT8_OP: None},
                                 run=Emulation.run))


# ---- random data


def random_errors(seed: int = 0) -> list[dict]:
    """bench_decode's construction (bf16 randn q, K, V; INT8 caches from quantize_int8; scale
    1/sqrt(D)) at each geometry: every variant's and the dequantize-then-attend's relative
    error against fp32 attention on the unquantized K/V, outputs rounded to bf16 as the
    kernels return them for a bf16 query."""
    rows = []
    for geo, batch, length in (((32, 4, 64), 4, 1536), ((32, 8, 128), 2, 1536),
                               ((24, 4, 256), 2, 1536)):
        torch.manual_seed(seed)
        hq, hkv, d = geo
        k, v = (torch.randn(batch, length, hkv, d).bfloat16().float() for _ in "kv")
        query = torch.randn(batch, hq, d).bfloat16().float()
        scale = 1.0 / math.sqrt(d)
        (k8, ks), (v8, vs) = quantize_int8_reference(k), quantize_int8_reference(v)
        ref = attend(query, k, v, scale)

        def err(out: torch.Tensor, ref: torch.Tensor = ref) -> float:
            e = out.bfloat16().double() - ref
            return float(e.norm() / ref.norm())

        dequant = err(attend(query, dequantize(k8, ks), dequantize(v8, vs), scale))
        row = {"geometry": list(geo), "B": batch, "L": length, "dequant": dequant}
        for variant in all_variants(d):
            got = emulate(query, k8, ks, v8, vs, length, scale, variant)
            row[variant.name] = err(got.out)
        rows.append(row)
    return rows


# ---- real activations and perplexity


def load_model(args: argparse.Namespace):
    loaded = smollm2.load(args.model_path)
    ids = fidelity_module().text_tokens(loaded.tokenizer, args.tokens)
    return loaded, fidelity.sliding_windows(ids, args.window, args.prefill)


def scored(loaded, windows: torch.Tensor, args: argparse.Namespace, backend: str):
    """Window scores with the op forced to ``backend``, the model compiled by pagedfuse
    (every attention site rewritten, else it fails)."""
    model = from_transformers(loaded.hf_model, device="cpu", dtype=torch.float32,
                              block_size=16, kv_cache="int8")
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    forward = torch.compile(model, backend=pagedfuse.backend(inner="eager"))
    with envs.overridden("PAGEDFUSE_BACKEND", backend):
        scores = fidelity.score_windows(model, windows, args.prefill, forward=forward)
    reports = pagedfuse.reports()
    found, done = sum(r.num_sites for r in reports), sum(r.num_rewritten for r in reports)
    if found == 0 or done < found:
        raise SystemExit(f"{done}/{found} attention sites rewritten")
    return scores


def capture_run(args: argparse.Namespace) -> dict:
    loaded, windows = load_model(args)
    Emulation.capture = Capture(all_variants(loaded.hf_model.config.head_dim))
    try:
        scored(loaded, windows, args, EMULATION_BACKEND)
        return {"tokens": args.tokens, "windows": windows.shape[0],
                **Emulation.capture.summary()}
    finally:
        Emulation.capture = None


def fidelity_runs(args: argparse.Namespace, record: dict) -> dict:
    """Perplexity per variant (``dequant`` first if the record lacks it for these
    settings), each decode line against the dequantize-then-attend's with its paired
    standard error."""
    loaded, windows = load_model(args)
    head_dim = loaded.hf_model.config.head_dim
    key = f"tokens={args.tokens} window={args.window} prefill={args.prefill}"
    runs = record.setdefault("fidelity", {}).setdefault(key, {})
    wanted = [name for name in args.fidelity if name != "dequant"]
    if "dequant" not in runs or "dequant" in args.fidelity:  # the baseline first
        wanted.insert(0, "dequant")
    for name in wanted:
        start = time.perf_counter()
        if name == "dequant":
            scores = scored(loaded, windows, args, fidelity_module().DEQUANTIZE.name)
        else:
            Emulation.variant = variant_named(name, head_dim)
            try:
                scores = scored(loaded, windows, args, EMULATION_BACKEND)
            finally:
                Emulation.variant = None
        runs[name] = {"ppl_prefill": fidelity.perplexity(scores.prefill),
                      "ppl_decode": fidelity.perplexity(scores.decode),
                      "window_nll_prefill": scores.prefill.mean(dim=1).tolist(),
                      "window_nll_decode": scores.decode.mean(dim=1).tolist(),
                      "seconds": round(time.perf_counter() - start, 1)}
        base = runs.get("dequant")
        if base is not None and name != "dequant":
            for which in ("prefill", "decode"):
                runs[name][f"vs_dequant_{which}"] = (
                    runs[name][f"ppl_{which}"] / base[f"ppl_{which}"] - 1.0)
                runs[name][f"std_error_{which}"] = fidelity_module()._paired_std_error(
                    runs[name][f"window_nll_{which}"], base[f"window_nll_{which}"])
        print(f"{name}: " + ", ".join(f"{k} {v:+.4%}" if k.startswith("vs") else
                                      f"{k} {v:.4%}" if k.startswith("std") else f"{k} {v}"
                                      for k, v in runs[name].items()
                                      if not k.startswith("window")), flush=True)
        write(args, record)
    return record


def write(args: argparse.Namespace, record: dict) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random", action="store_true", help="errors on random data")
    parser.add_argument("--capture", action="store_true",
                        help="error sources on the real model's decode calls")
    parser.add_argument("--fidelity", nargs="+", metavar="VARIANT", default=[],
                        help="perplexity with the decode as VARIANT (KERNEL[/PV]) or dequant")
    parser.add_argument("--model-path")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="the record, updated in place")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    register()
    record = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
    record.update(date=str(datetime.date.today()), torch=torch.__version__,
                  python=platform.python_version(), machine=platform.machine())
    record.setdefault("commands", []).append(" ".join(
        shlex.quote(a) for a in ["benchmarks/decode_p_precision.py", *sys.argv[1:]]))
    if args.random:
        record["random"] = random_errors()
        for row in record["random"]:
            print(json.dumps(row))
        write(args, record)
    if args.capture:
        record["capture"] = capture_run(args)
        print(json.dumps(record["capture"], indent=1))
        write(args, record)
    if args.fidelity:
        fidelity_runs(args, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
