"""Paged attention written in plain PyTorch in every spelling the built-in pattern accepts
(the programs the rewrite tests compile), random paged caches for them, and the tolerances
the tests compare with."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import pagedfuse
from helpers.capture import Capture
from pagedfuse.numerics import INT8_SITE_RTOL as INT8_TOLERANCE
from pagedfuse.numerics import SITE_RTOL as TOLERANCES
from pagedfuse.numerics import max_rel_err

SDPA = torch._C._nn.scaled_dot_product_attention
PAGED = (torch.ops.pagedfuse.paged_attention.default,
         torch.ops.pagedfuse.paged_attention_int8.default)


@dataclass(frozen=True)
class Spec:
    gather: str = "getitem"  # getitem | getitem_slices | index_select | torch_gather |
    #                          take_along_dim | take
    layout: str = "NHD"  # NHD | HND cache
    view: str = "flatten"  # flatten: flatten+transpose | permute: permute+reshape
    gqa: str = "enable_gqa"  # enable_gqa | repeat_interleave | repeat_kv | mha
    dequant: str = "none"  # none|to_mul|promote|scale_first|float_then_to|to_mul_fp_value
    mask: str = "bool"  # none | bool | where | masked_fill | alibi | causal | offbyone |
    #                     window (lengths & a window from them) | sliding (causal & window
    #                     from positions over all keys, q_len = keys)
    scale: str = "default"  # default | float | item
    dtype: torch.dtype = torch.float32
    dropout: float = 0.0
    spelling: str = "sdpa"  # sdpa | explicit: matmul, scale, (cap), + mask, softmax, matmul
    softcap: float | None = None  # explicit only: c * tanh(s / c) after the scale
    window: int = 5  # the window of the window/sliding masks


@dataclass
class Case:
    q: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor
    bt: torch.Tensor
    sl: torch.Tensor
    ks: torch.Tensor
    vs: torch.Tensor
    bias: torch.Tensor
    scale: torch.Tensor

    def args(self) -> tuple:
        return (self.q, self.kc, self.vc, self.bt, self.sl, self.ks, self.vs, self.bias,
                self.scale)


def make_case(spec: Spec, batch: int = 3, q_len: int = 1, q_heads: int = 8, kv_heads: int = 2,
              head_dim: int = 64, block_size: int = 4, blocks: int = 3, num_blocks: int = 16,
              seed: int = 0) -> Case:
    """Random data everywhere (never zeros); a block table that is a random permutation."""
    g = torch.Generator().manual_seed(seed)
    if spec.gqa == "mha":
        kv_heads = q_heads
    keys = blocks * block_size
    if spec.mask in ("causal", "sliding"):
        q_len = keys
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if spec.layout == "HND":
        shape = (num_blocks, kv_heads, block_size, head_dim)
    scale_shape = shape[:3]
    int8 = spec.dequant != "none"
    if int8:
        kc = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        vc = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        if spec.dequant == "to_mul_fp_value":
            vc = torch.randn(shape, generator=g).to(spec.dtype)
    else:
        kc = torch.randn(shape, generator=g).to(spec.dtype)
        vc = torch.randn(shape, generator=g).to(spec.dtype)
    ks = torch.rand(scale_shape, generator=g) * 0.02 + 0.005
    vs = torch.rand(scale_shape, generator=g) * 0.02 + 0.005
    bt = torch.randperm(num_blocks, generator=g)[:batch * blocks].view(batch, blocks)
    sl = torch.randint(q_len, keys + 1, (batch,), generator=g)
    sl[0] = keys
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=g).to(spec.dtype)
    slopes = 2.0 ** (-8.0 * torch.arange(1, q_heads + 1) / q_heads)
    pos = torch.arange(keys).float()
    bias = (slopes[:, None, None] * (pos - keys + 1)).expand(q_heads, q_len, keys)
    bias = bias[None].to(spec.dtype).contiguous()
    return Case(q, kc, vc, bt, sl, ks, vs, bias, torch.tensor(0.3))


def gather_pages(spec: Spec, cache: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """[B, M, bs, H, ...] (NHD) or [B, M, H, bs, ...] (HND) pages; flat gathers (NHD only)
    read per token: [B, L, H, ...]."""
    if spec.gather == "getitem":
        return cache[bt]
    if spec.gather == "getitem_slices":
        return cache[bt, :, :] if cache.dim() == 3 else cache[bt, :, :, :]
    bs = cache.shape[1]
    flat = cache.flatten(0, 1)
    slots = (bt[:, :, None] * bs + torch.arange(bs)).view(bt.shape[0], -1)  # [B, L]
    if spec.gather == "index_select":
        rows = torch.index_select(flat, 0, slots.view(-1))
    elif spec.gather == "take_along_dim":
        rows = torch.take_along_dim(flat, slots.view(-1).view(-1, *(1,) * (flat.dim() - 1)), 0)
    elif spec.gather == "take":  # element offsets of whole rows; rows arrive flattened
        row = flat[0].numel()
        rows = torch.take(flat, slots[..., None] * row + torch.arange(row))
    else:
        index = slots.view(-1).view(-1, *(1,) * (flat.dim() - 1)).expand(-1, *flat.shape[1:])
        rows = torch.gather(flat, 0, index)
    return rows.view(bt.shape[0], -1, *cache.shape[2:])  # [B, L, H, ...]


def to_bhld(spec: Spec, pages: torch.Tensor) -> torch.Tensor:
    b = pages.shape[0]
    if pages.dim() == 4:  # per-token rows [B, L, H, D]
        return pages.transpose(1, 2)
    if spec.layout == "HND":  # [B, M, H, bs, D]
        return pages.permute(0, 2, 1, 3, 4).reshape(b, pages.shape[2], -1, pages.shape[-1])
    if spec.view == "permute":  # [B, M, bs, H, D]
        return pages.permute(0, 3, 1, 2, 4).reshape(b, pages.shape[3], -1, pages.shape[-1])
    return pages.flatten(1, 2).transpose(1, 2)


def dequant(spec: Spec, pages: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    s = scales.unsqueeze(-1)
    if spec.dequant in ("to_mul", "to_mul_fp_value"):
        return pages.to(spec.dtype) * s.to(spec.dtype)
    if spec.dequant == "promote":
        return (pages * s).to(spec.dtype)
    if spec.dequant == "scale_first":
        return s.to(spec.dtype) * pages.to(spec.dtype)
    return (pages.float() * s).to(spec.dtype)


def expand_heads(spec: Spec, x: torch.Tensor, group: int) -> torch.Tensor:
    b, h, n, d = x.shape
    if spec.gqa == "repeat_interleave":
        return x.repeat_interleave(group, dim=1)
    if spec.gqa == "repeat_kv" or spec.gqa == "enable_gqa" and spec.spelling == "explicit":
        return x[:, :, None, :, :].expand(b, h, group, n, d).reshape(b, h * group, n, d)
    return x


def build_mask(spec: Spec, valid: torch.Tensor, sl: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor | None:
    """SDPA's attn_mask for ``spec`` from the [B, L] validity ``arange(L) < sl[:, None]``."""
    additive = torch.where(valid, 0.0, float("-inf"))[:, None, None, :].to(dtype)
    if spec.mask == "bool":
        return valid[:, None, None, :]
    if spec.mask == "where":
        return additive
    if spec.mask == "masked_fill":
        return torch.zeros(valid.shape, dtype=dtype).masked_fill(~valid, float("-inf"))[
            :, None, None, :]
    if spec.mask == "offbyone":
        keys = torch.arange(valid.shape[1], device=valid.device)
        return torch.where(keys <= sl[:, None], 0.0, float("-inf"))[:, None, None, :].to(dtype)
    if spec.mask == "alibi":
        return bias + additive
    keys = torch.arange(valid.shape[1], device=valid.device)
    if spec.mask == "window":  # decode: the last `window` keys of each sequence
        return (valid & (keys >= sl[:, None] - spec.window))[:, None, None, :]
    if spec.mask == "sliding":  # queries are the keys: causal and (p - j < W)
        pos_q = keys[:, None]
        return (keys[None, :] <= pos_q) & (pos_q - keys[None, :] < spec.window)
    return None  # "none", "causal"


def explicit_attention(q, k, v, mask, scale, softcap, dropout):
    """Attention as transformers' eager code writes it: matmul, scale, soft cap, + mask,
    softmax in float32, cast back, dropout, matmul (a bool mask made 0/-inf first)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None
                                                    else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
        scores = scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=False)
    return torch.matmul(probs, v)


def attention(spec: Spec):
    """The model function for ``spec``: plain PyTorch paged attention."""

    def fn(q, kc, vc, bt, sl, ks, vs, bias, scale_t):
        scale = {"default": None, "float": 0.3, "item": None}[spec.scale]
        dropout = {"dropout_p": spec.dropout} if spec.dropout else {}
        if spec.scale == "item":
            scale = scale_t.item()
        k_pages, v_pages = gather_pages(spec, kc, bt), gather_pages(spec, vc, bt)
        if spec.dequant != "none":
            k_pages = dequant(spec, k_pages, gather_pages(spec, ks, bt))
            if v_pages.dtype == torch.int8:
                v_pages = dequant(spec, v_pages, gather_pages(spec, vs, bt))
        k, v = to_bhld(spec, k_pages), to_bhld(spec, v_pages)
        group = q.shape[1] // k.shape[1]
        k, v = expand_heads(spec, k, group), expand_heads(spec, v, group)
        keys = k.shape[2]
        valid = torch.arange(keys, device=q.device) < sl[:, None]
        mask = build_mask(spec, valid, sl, bias, q.dtype)
        if spec.spelling == "explicit":
            if spec.mask == "causal":
                mask = torch.ones(q.shape[2], keys, dtype=torch.bool).tril(keys - q.shape[2])
            return explicit_attention(q, k, v, mask, scale, spec.softcap, spec.dropout)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=spec.mask == "causal", scale=scale,
            enable_gqa=spec.gqa == "enable_gqa", **dropout)

    return fn


TOL, INT8_TOL = TOLERANCES, INT8_TOLERANCE  # verify mode's: one source for both


def compile_and_compare(spec: Spec, case: Case | None = None, **backend_kwargs):
    """Compile ``attention(spec)`` with a capturing inner; return (capture, report, error)."""
    torch._dynamo.reset()
    case = case or make_case(spec)
    fn = attention(spec)
    capture = Capture()
    pagedfuse.clear_reports()
    backend = pagedfuse.backend(inner=capture, **backend_kwargs)
    got = torch.compile(fn, backend=backend)(*case.args())
    want = fn(*case.args())
    report = pagedfuse.Report.merged(pagedfuse.reports())
    return capture, report, max_rel_err(got, want)


def compile_fn(fn, args: tuple, **backend_kwargs):
    """Compile ``fn`` with a capturing inner and run it on ``args``; (capture, the merged
    report, the output)."""
    torch._dynamo.reset()
    capture = Capture()
    pagedfuse.clear_reports()
    out = torch.compile(fn, backend=pagedfuse.backend(inner=capture, **backend_kwargs))(*args)
    return capture, pagedfuse.Report.merged(pagedfuse.reports()), out


def op_node(capture: Capture) -> torch.fx.Node:
    """The (first) pagedfuse op call in the captured graphs."""
    return next(n for gm in capture.graphs for n in gm.graph.nodes if n.target in PAGED)
