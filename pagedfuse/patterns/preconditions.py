"""The built-in pattern's preconditions: each returns None (pass) or a reason in words.

All of them read fake-tensor metadata and compare sizes with ``statically_known_true``, so
none adds a guard; facts only known at run time (block ids, lengths) are the op's job.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from pagedfuse.ops import head_dim_reason, kernel_devices
from pagedfuse.ops.validate import FLOAT_DTYPES, check_strides, dtype_name
from pagedfuse.patterns.axes import static_int
from pagedfuse.patterns.base import Match, Precondition
from pagedfuse.patterns.kv_trace import Resolved, SourceView
from pagedfuse.patterns.paged_site import PagedSite
from pagedfuse.patterns.region import escapes, written_between
from pagedfuse.patterns.spelling import arg, extra_kwargs, fake


def _site(match: Match) -> PagedSite:
    return match.facts


def _dropout(match: Match) -> str | None:
    p = arg(_site(match).sdpa, "dropout_p", 0.0)
    if isinstance(p, (int, float)) and p == 0:
        return None
    if isinstance(p, fx.Node):
        return (f"dropout_p is the run-time value {p.name}: the fused kernels apply no dropout, "
                "and proving it is 0 would add a guard")
    return f"dropout_p={p}: the fused kernels do not apply dropout"


def _arguments(match: Match) -> str | None:
    extra = extra_kwargs(_site(match).sdpa)
    return f"unsupported SDPA arguments {extra}" if extra else None


def _chain_dtypes(r: Resolved) -> list[torch.dtype]:
    return [fake(s.node).dtype for s in r.trace.steps if s.kind in ("cast", "scale")]


def _float_path(what: str, r: Resolved, qdtype: torch.dtype) -> str | None:
    """A float cache may pass through casts only if they are lossless round trips."""
    cache = fake(r.trace.gather.source).dtype
    if cache != qdtype:
        return f"{what} cache is {dtype_name(cache)} but the query is {dtype_name(qdtype)}"
    if r.trace.scale is not None:
        return f"{what}: a scale multiply on a {dtype_name(cache)} cache is not a dequant"
    lossy = [d for d in _chain_dtypes(r) if d not in (cache, torch.float32, torch.float64)]
    return f"{what} is cast through {dtype_name(lossy[0])} (lossy)" if lossy else None


def _int8_path(what: str, r: Resolved) -> str | None:
    scale = r.trace.scale
    if scale is None:
        return f"{what} cache is int8 but no dequant scale multiplies it"
    sdtype = fake(scale.gather.source).dtype
    if sdtype != torch.float32:
        return f"{what} scale is {dtype_name(sdtype)}; the int8 kernels take float32 scales"
    return None


def _dtype(match: Match) -> str | None:
    site = _site(match)
    qdtype = site.q_fake.dtype
    if qdtype not in FLOAT_DTYPES:
        return f"query is {dtype_name(qdtype)}, not float32/bfloat16/float16"
    if not site.int8:
        return _float_path("key", site.key, qdtype) or _float_path("value", site.value, qdtype)
    value_int8 = fake(site.value.trace.gather.source).dtype == torch.int8
    return _int8_path("key", site.key) or (
        _int8_path("value", site.value) if value_int8 else
        _float_path("value", site.value, qdtype))


def _dtype_passes(match: Match) -> str:
    site = _site(match)
    k, v = (dtype_name(fake(r.trace.gather.source).dtype) for r in (site.key, site.value))
    return f"query {dtype_name(site.q_fake.dtype)}, key cache {k}, value cache {v}"


def _head_dim(match: Match) -> str | None:
    site = _site(match)
    d = static_int(site.size("dim"))
    if d is None:
        return ("head_dim is dynamic (e.g. dynamic=True on a cache passed as an input); the "
                "kernels need it fixed: mark only batch and length dynamic")
    return head_dim_reason(site.op, site.q_fake.device.type, d)


def _gqa(match: Match) -> str | None:
    """Fails only where the head counts are known not to fit; a dynamic count is left to SDPA's
    own rule (it rejects the same inputs) and the op's run-time check."""
    site = _site(match)
    hq, hkv = static_int(site.q_fake.shape[1]), static_int(site.size("head"))
    rep = static_int(site.rep)
    if None in (hq, hkv, rep):
        return None
    seen = hkv * rep
    enable_gqa = bool(arg(site.sdpa, "enable_gqa", False))
    if hq == seen or enable_gqa and hq % seen == 0:
        return None
    return f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv} x {rep} repeats"


def _gqa_passes(match: Match) -> str:
    site = _site(match)
    return f"{site.q_fake.shape[1]} query heads over {site.size('head')} KV heads"


def _block_size(match: Match) -> str | None:
    bs = _site(match).size("slot")
    return None if static_int(bs) else f"block_size {bs} is dynamic; it must be fixed"


def _op_view_meta(source: fx.Node, view: SourceView) -> torch.Tensor | None:
    """A meta tensor shaped and strided like the cache view the op will be handed (None when
    sizes or strides are dynamic: the op checks those at run time)."""
    t = fake(source)
    if not all(isinstance(v, int) for v in (*t.shape, *t.stride())):
        return None
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if view.op_view is None:
        return meta
    method, args = view.op_view
    return getattr(meta, method)(*args)


def _strides(match: Match) -> str | None:
    """Innermost dim contiguous and 16-byte aligned rows, as the kernels need (scales, rows of
    4 bytes, are checked by the op)."""
    site = _site(match)
    for name, r in (("key_cache", site.key), ("value_cache", site.value)):
        meta = _op_view_meta(r.trace.gather.source, r.view)
        try:
            if meta is not None:
                check_strides(name, meta, fake=True)
        except ValueError as exc:
            return str(exc)
    return None


def _mask(match: Match) -> str | None:
    site = _site(match)
    if site.mask is None or site.mask_reading.seq_lens is not None:
        return None
    m = fake(site.mask)
    if m.dtype != torch.bool and m.dtype not in FLOAT_DTYPES:
        return f"attn_mask is {dtype_name(m.dtype)}, neither bool nor a float bias"
    if not 2 <= m.dim() <= 4:
        return f"attn_mask has {m.dim()} dims; attn_bias takes 2 to 4"
    return None


def _mask_passes(match: Match) -> str:
    site = _site(match)
    if site.mask is None:
        return "no mask: every gathered key is attended"
    if site.mask_reading.seq_lens is not None:
        return f"length mask: seq_lens = {site.mask_reading.seq_lens.name}"
    return f"attn_bias = {site.mask.name} (not a length mask: {site.mask_reading.why_bias})"


def _causal_passes(match: Match) -> str:
    site = _site(match)
    if not arg(site.sdpa, "is_causal", False):
        return "not causal"
    if site.causal_as_bias:
        return ("is_causal with fewer queries than keys: SDPA aligns it top-left, so it goes "
                "to the op as a bool attn_bias, not as the op's bottom-right causal")
    return "causal (queries == keys: top-left and bottom-right agree)"


def _scale(match: Match) -> str | None:
    scale = arg(_site(match).sdpa, "scale")
    if scale is None or isinstance(scale, (int, float)) and math.isfinite(scale) and scale:
        return None
    if isinstance(scale, fx.Node) and isinstance(fake(scale), (float, torch.SymFloat)):
        return None
    return f"scale {scale!r} is neither a finite float nor a graph scalar"


def _scale_passes(match: Match) -> str:
    scale = arg(_site(match).sdpa, "scale")
    if scale is None:
        return f"default 1/sqrt({_site(match).size('dim')})"
    return f"scale {scale.name if isinstance(scale, fx.Node) else scale}"


def _self_contained(match: Match) -> str | None:
    site = _site(match)
    gathers = {r.trace.gather.node for r in (site.key, site.value)}
    return escapes(site.sdpa.graph, set(match.region), gathers, site.sdpa)


def _no_write_in_between(match: Match) -> str | None:
    site = _site(match)
    traces = [site.key.trace, site.value.trace]
    traces += [t.scale for t in traces if t.scale is not None]
    tensors = {t.gather.source for t in traces} | {site.index}
    return written_between(site.sdpa.graph, tensors, [t.gather.node for t in traces], site.sdpa)


def _no_grad_needed(match: Match) -> str | None:
    """The ops have no backward: fuse only where autograd will not need one (no_grad,
    inference_mode, or inputs that do not require grad)."""
    site = _site(match)
    if not torch.is_grad_enabled():
        return None
    tensors = [site.query] + [r.trace.gather.source for r in (site.key, site.value)]
    tensors += [r.trace.scale.gather.source for r in (site.key, site.value) if r.trace.scale]
    needs = [t.name for t in tensors if getattr(fake(t), "requires_grad", False)]
    if needs:
        return (f"{', '.join(needs)} require grad and the pagedfuse ops have no backward; "
                "run under torch.no_grad() or torch.inference_mode()")
    return None


def _kernel(match: Match) -> str | None:
    site = _site(match)
    device = site.q_fake.device.type
    if device in kernel_devices():
        return None
    return f"no pagedfuse {site.op} kernel for {device} (only the slow reference)"


PRECONDITIONS = (
    Precondition("dropout", _dropout, lambda m: "dropout_p 0"),
    Precondition("arguments", _arguments, lambda m: "no unsupported SDPA arguments"),
    Precondition("dtype", _dtype, _dtype_passes),
    Precondition("head_dim", _head_dim, lambda m: f"head_dim {_site(m).size('dim')}"),
    Precondition("gqa", _gqa, _gqa_passes),
    Precondition("block_size", _block_size, lambda m: f"block_size {_site(m).size('slot')}"),
    Precondition("cache strides", _strides, lambda m: "innermost dim contiguous, rows aligned"),
    Precondition("mask", _mask, _mask_passes),
    Precondition("causal", lambda m: None, _causal_passes),
    Precondition("scale", _scale, _scale_passes),
    Precondition("self-contained", _self_contained,
                 lambda m: "gathered K/V are used only by this attention"),
    Precondition("cache writes", _no_write_in_between,
                 lambda m: "no cache write between the gather and the attention"),
    Precondition("autograd", _no_grad_needed, lambda m: "no gradient needed"),
    Precondition("kernel", _kernel, lambda m: f"{_site(m).op} kernel for "
                                              f"{_site(m).q_fake.device.type}"),
)
