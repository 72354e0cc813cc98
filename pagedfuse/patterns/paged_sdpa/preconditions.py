"""The built-in pattern's preconditions: each returns None (pass) or a reason in words.

All of them read fake-tensor metadata and compare sizes with ``statically_known_true``, so
none adds a guard, except where the op needs two sizes equal that the program never relates
(the caches' and scales' block counts): two dynamic sizes equal in the trace are guarded
equal (``unify_sizes``). Facts only known at run time (block ids, lengths) are the op's job.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from pagedfuse import envs
from pagedfuse.graph.layout import is_one, same_size, static_int, unify_sizes
from pagedfuse.graph.ops import describe, fake
from pagedfuse.graph.region import escapes, stale_reads
from pagedfuse.ops.backends import SupportReport, get_backend, head_dim_reason, support_report
from pagedfuse.ops.validate import FLOAT_DTYPES, check_strides, dtype_name
from pagedfuse.patterns.base import Match, Precondition
from pagedfuse.patterns.paged_sdpa.kv_trace import Resolved, SourceView, Trace
from pagedfuse.patterns.paged_sdpa.sdpa_semantics import fully_masked_rows
from pagedfuse.patterns.paged_sdpa.site import MASK_BIAS, NO_BIAS, TOP_LEFT_CAUSAL, PagedSite


def _site(match: Match) -> PagedSite:
    return match.facts


def _dropout(match: Match) -> str | None:
    attention = _site(match).attention
    p = attention.dropout
    if isinstance(p, (int, float)) and p == 0:
        return None
    what = "dropout p (in training)" if attention.explicit else "dropout_p"
    if isinstance(p, fx.Node):
        return (f"{what} is the run-time value {p.name}: the fused kernels apply no dropout, "
                "and proving it is 0 would add a guard")
    advice = " (run the model in eval mode, or with p=0)" if attention.explicit else ""
    return f"{what}={p}: the fused kernels do not apply dropout{advice}"


def _arguments(match: Match) -> str | None:
    extra = list(_site(match).attention.extra_args)
    return f"unsupported SDPA arguments {extra}" if extra else None


def _explicit(match: Match) -> str | None:
    explicit = _site(match).attention.explicit
    return explicit.problem if explicit is not None else None


def _explicit_passes(match: Match) -> str:
    explicit = _site(match).attention.explicit
    if explicit is None:
        return "an SDPA call"
    return " -> ".join(explicit.steps) + ": attention as SDPA computes it"


def _softcap(match: Match) -> str | None:
    explicit = _site(match).attention.explicit
    return explicit.softcap_problem if explicit is not None else None


def _softcap_passes(match: Match) -> str:
    cap = _site(match).attention.softcap
    if cap is None:
        return "no soft cap"
    return f"softcap {cap:g}: scores become {cap:g} * tanh(s / {cap:g}) after the scale"


def _window_passes(match: Match) -> str:
    site = _site(match)
    m, reading = site.masking, site.mask_reading
    if m.window_left is None:
        return "no window" if reading is None else \
            f"no window read off the mask ({reading.why_bias or 'it holds none'})"
    if m.bias == NO_BIAS:
        return f"window_left {m.window_left}, read off the mask (which it replaces)"
    return (f"window_left {m.window_left} as a hint (only skips keys the mask hides); the "
            f"mask stays attn_bias: {reading.why_bias}")


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


# Casts that hold every int8 value exactly (uint8 wraps negatives; int8 itself is a no-op).
_INT8_EXACT = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                         torch.bfloat16, torch.float32, torch.float64})


def _casts(trace: Trace, before_scale: bool = False) -> list[torch.dtype]:
    """dtypes the trace casts to, in order; with ``before_scale``, only those the data goes
    through before its dequant multiply."""
    found = []
    for step in trace.steps:
        if step.kind == "scale" and before_scale:
            break
        if step.kind == "cast":
            found.append(fake(step.node).dtype)
    return found


def _int8_path(what: str, r: Resolved) -> str | None:
    scale = r.trace.scale
    if scale is None:
        return f"{what} cache is int8 but no dequant scale multiplies it"
    sdtype = fake(scale.gather.source).dtype
    if sdtype != torch.float32:
        return f"{what} scale is {dtype_name(sdtype)}; the int8 kernels take float32 scales"
    inexact = [d for d in _casts(r.trace, before_scale=True) if d not in _INT8_EXACT]
    if inexact:
        return f"{what}: the int8 data is cast to {dtype_name(inexact[0])} before the dequant, " \
               "which changes its values"
    not_float = [d for d in _casts(scale) if not d.is_floating_point]
    if not_float:
        return f"{what} scale is cast to {dtype_name(not_float[0])}, which changes its values"
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
    enable_gqa = site.attention.enable_gqa
    if hq == seen or enable_gqa and hq % seen == 0:
        return None
    return f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv} x {rep} repeats"


def _gqa_passes(match: Match) -> str:
    site = _site(match)
    return f"{site.q_fake.shape[1]} query heads over {site.size('head')} KV heads"


def _op_view_shape(source: fx.Node, view: SourceView) -> tuple:
    return view.op_shape(tuple(fake(source).shape))


def _differs(a: tuple, b: tuple) -> bool:
    """Whether two cache geometries differ; equal dynamic sizes are guarded equal (the
    program never relates the caches' sizes, only the op does)."""
    return len(a) != len(b) or not all(unify_sizes(x, y) for x, y in zip(a, b, strict=True))


def _value_cache(match: Match) -> str | None:
    """The op reads K and V through one geometry and gives the query's head_dim back."""
    site = _site(match)
    k = _op_view_shape(site.key.trace.gather.source, site.key.view)
    v = _op_view_shape(site.value.trace.gather.source, site.value.view)
    if not same_size(k[3], v[3]):
        return (f"value head_dim {v[3]} differs from the key's {k[3]}; the op's output has the "
                "query's head_dim")
    if _differs(k[:3], v[:3]):
        return (f"value cache is {tuple(v[:3])} (num_blocks, block_size, kv_heads), the key "
                f"cache {tuple(k[:3])}; the op reads both through one geometry")
    return None


def _scales(match: Match) -> str | None:
    """A dequant scale holds one value per token and head of its cache."""
    site = _site(match)
    for what, r in (("key", site.key), ("value", site.value)):
        scale = r.trace.scale
        if scale is None:
            continue
        data = _op_view_shape(r.trace.gather.source, r.view)[:3]
        got = _op_view_shape(scale.gather.source, r.scale_view)
        if _differs(got, data):
            return (f"{what} scale is {tuple(got)}, not one value per token and head of the "
                    f"{what} cache {tuple(data)}")
    return None


def _batch(match: Match) -> str | None:
    """SDPA broadcasts a K/V batch of 1 over the queries (the table is expanded for the op);
    a query batch of 1 over many K/V batches has no per-sequence form."""
    site = _site(match)
    queries, kv = site.q_fake.shape[0], site.size("batch")
    if same_size(queries, kv) or is_one(kv):
        return None
    if is_one(queries):
        return (f"one query batch row is broadcast over a K/V batch of {kv}; the op takes one "
                "query row per sequence")
    return f"query batch {queries} and K/V batch {kv} are not known to be equal"


def _batch_passes(match: Match) -> str:
    site = _site(match)
    queries, kv = site.q_fake.shape[0], site.size("batch")
    if same_size(queries, kv):
        return f"batch {queries}"
    return f"K/V batch 1 broadcast over {queries} query rows (the block table is expanded)"


def _devices(match: Match) -> str | None:
    """Eager may index a cache with a table on another device; the op takes every tensor on
    the query's device."""
    site = _site(match)
    device = site.q_fake.device
    traces = [("key cache", site.key.trace), ("value cache", site.value.trace)]
    tensors = [(what, t.gather.source) for what, t in traces]
    tensors += [(f"{what} scale", t.scale.gather.source) for what, t in traces if t.scale]
    tensors += [("block table", site.index), ("attn_mask", site.mask)]
    if site.masking.seq_lens is not None:
        tensors.append(("seq_lens", site.masking.seq_lens))
    for what, node in tensors:
        value = fake(node)
        if isinstance(value, torch.Tensor) and value.device != device:
            return (f"{what} {node.name} is on {value.device}, the query on {device}; the op "
                    "takes every tensor on the query's device")
    return None


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
    m = fake(site.mask)
    if site.attention.explicit and m is not None and not m.dtype.is_floating_point:
        return (f"{site.mask.name} is a {dtype_name(m.dtype)} tensor added to the scores (as "
                "numbers), not a mask; the op would read it as one")
    if site.masking.bias != MASK_BIAS:
        return None
    if m.dtype != torch.bool and m.dtype not in FLOAT_DTYPES:
        return f"attn_mask is {dtype_name(m.dtype)}, neither bool nor a float bias"
    if not 2 <= m.dim() <= 4:
        return f"attn_mask has {m.dim()} dims; attn_bias takes 2 to 4"
    return None


def _mask_passes(match: Match) -> str:
    site = _site(match)
    m = site.masking
    if site.mask is None:
        return "no mask: every gathered key is attended"
    if m.bias == NO_BIAS:
        said = [f"seq_lens = {m.seq_lens.name}" if m.seq_lens is not None else "",
                "causal" if m.causal else "",
                f"window_left {m.window_left}" if m.window_left is not None else ""]
        what = "length mask" if m.seq_lens is not None and not m.causal and \
            m.window_left is None else "mask"
        return f"{what} in the op's terms: {', '.join(s for s in said if s)}"
    hint = f"; seq_lens = {m.seq_lens.name} as a hint" if m.seq_lens is not None else ""
    return f"attn_bias = {site.mask.name} (not a length mask: " \
        f"{site.mask_reading.why_bias}){hint}"


def _masked_rows(match: Match) -> str | None:
    """The op gives a row with no visible key zeros; where a mask may hide every key of a
    row, SDPA on this device must give zeros too (the explicit spelling's NaN rows are set
    after the op), or the user states that no row is ever fully masked."""
    site = _site(match)
    if site.mask is None or site.masking.nan_rows or _sdpa_masked_row(site) == "zeros":
        return None
    if envs.PAGEDFUSE_ASSUME_VISIBLE_KEY:
        return None
    return (f"SDPA on {site.q_fake.device.type} gives a fully masked row "
            f"{_sdpa_masked_row(site)}, the op zeros; the mask {site.mask.name} may hide every "
            "key of a row (if none ever does, as in a serving step where each query sees "
            "itself, set PAGEDFUSE_ASSUME_VISIBLE_KEY=1)")


def _sdpa_masked_row(site: PagedSite) -> str:
    return fully_masked_rows(site.q_fake.device, site.q_fake.dtype, fake(site.mask).dtype,
                             static_int(site.size("dim")) or 64)


def _masked_rows_passes(match: Match) -> str:
    site = _site(match)
    if site.mask is None:
        return "no mask: every row sees a key"
    if site.masking.nan_rows:
        return ("a row the mask hides entirely is set to NaN after the op, as the explicit "
                "softmax gives it")
    got = _sdpa_masked_row(site)
    if got == "zeros":
        return f"SDPA on {site.q_fake.device.type} gives a fully masked row zeros, as the op does"
    return (f"every row sees a key (PAGEDFUSE_ASSUME_VISIBLE_KEY=1; SDPA on "
            f"{site.q_fake.device.type} would give a fully masked row {got})")


def _causal_passes(match: Match) -> str:
    site = _site(match)
    if site.masking.bias == TOP_LEFT_CAUSAL:
        return ("is_causal with fewer queries than keys: SDPA aligns it top-left, so it goes "
                "to the op as a bool attn_bias, not as the op's bottom-right causal")
    if site.attention.is_causal:
        return "causal (queries == keys: top-left and bottom-right agree)"
    return "causal, read off the mask" if site.masking.causal else "not causal"


def _scale(match: Match) -> str | None:
    scale = _site(match).attention.scale
    if scale is None or isinstance(scale, (int, float)) and math.isfinite(scale):
        return None
    if isinstance(scale, fx.Node) and isinstance(fake(scale), (float, torch.SymFloat)):
        return None
    return f"scale {scale!r} is neither a finite float nor a graph scalar"


def _scale_passes(match: Match) -> str:
    scale = _site(match).attention.scale
    if scale is None:
        return f"default 1/sqrt({_site(match).size('dim')})"
    return f"scale {scale.name if isinstance(scale, fx.Node) else scale}"


def _self_contained(match: Match) -> str | None:
    return escapes(match.region, _site(match).anchor)


def _no_write_in_between(match: Match) -> str | None:
    site = _site(match)
    return stale_reads(site.reads(), site.anchor)


def _requires_grad(node: object) -> bool:
    return bool(getattr(fake(node), "requires_grad", False))


def _no_grad_needed(match: Match) -> str | None:
    """The ops have no backward: fuse only where autograd will not need one. Decided by the
    attention's own fake output (grad mode and inputs where it runs), not the global mode at
    compile time."""
    site = _site(match)
    if not _requires_grad(site.anchor):
        return None
    traces = [r.trace for r in (site.key, site.value)]
    traces += [t.scale for t in traces if t.scale is not None]
    leaves = [site.query] + [t.gather.source for t in traces]
    needs = [n.name for n in leaves if _requires_grad(n)]
    if _requires_grad(site.mask):
        needs.append(f"the attn_mask {site.mask.name}")
    needs = needs or [describe(n) for n in site.anchor.all_input_nodes if _requires_grad(n)]
    return (f"{', '.join(needs)} require grad where the attention runs with grad enabled, and "
            "the pagedfuse ops have no backward; run under torch.no_grad() or "
            "torch.inference_mode()")


def _fake_view(source: fx.Node, view: SourceView | None) -> torch.Tensor | None:
    """The fake value of the cache (or scale) view the replacement hands the op."""
    if view is None:
        return None
    t = fake(source)
    return t if view.op_view is None else getattr(t, view.op_view[0])(*view.op_view[1])


def _kernel_report(site: PagedSite) -> SupportReport | str:
    """The backend registry's verdict on the op call the replacement would make, asked with
    fake tensors shaped, strided and typed like its arguments (so no data is touched)."""
    q = site.q_fake
    mode = getattr(q, "fake_mode", None)
    if mode is None:
        return "the query has no fake value to ask the kernel backends with"
    batch, q_len = q.shape[0], q.shape[2]
    keys = site.size("block") * site.size("slot")
    table = fake(site.index)
    table = table.unsqueeze(0) if table.dim() == 1 else table
    masking = site.masking
    key_scale = value_scale = None
    if site.int8:
        key_scale = _fake_view(site.key.trace.scale.gather.source, site.key.scale_view)
        if site.value.trace.scale is not None:
            value_scale = _fake_view(site.value.trace.scale.gather.source,
                                     site.value.scale_view)
    with mode:
        lengths = torch.empty(batch, dtype=torch.int32, device=q.device)
        starts = torch.empty(batch + 1, dtype=torch.int32, device=q.device)
        bias = (None if masking.bias == NO_BIAS else
                torch.empty(q_len, keys, dtype=torch.bool, device=q.device)
                if masking.bias == TOP_LEFT_CAUSAL else fake(site.mask))
        try:
            return support_report(
                site.op, q.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3]).contiguous(),
                _fake_view(site.key.trace.gather.source, site.key.view),
                _fake_view(site.value.trace.gather.source, site.value.view),
                table.expand(batch, table.shape[1]) if is_one(table.shape[0]) else table,
                lengths, starts, key_scale=key_scale,
                value_scale=value_scale, attn_bias=bias, causal=masking.causal,
                max_seq_len=keys, max_query_len=q_len, window_left=masking.window_left,
                softcap=site.attention.softcap)
        except (TypeError, ValueError) as exc:
            return f"the op would refuse the call: {exc}"


def _kernel(match: Match) -> str | None:
    """A kernel backend of the query's device takes the call; the pure-torch reference, which
    serves devices without kernels, does not count (it is slower than eager SDPA)."""
    site = _site(match)
    report = _kernel_report(site)
    if isinstance(report, str):
        return report
    if report.chosen is None:
        return str(report)
    if get_backend(report.chosen).device is None:
        return (f"no pagedfuse {site.op} kernel for {report.device}: only the slow "
                f"{report.chosen} would run")
    return None


PRECONDITIONS = (
    Precondition("explicit attention", _explicit, _explicit_passes),
    Precondition("dropout", _dropout, lambda m: "dropout_p 0"),
    Precondition("arguments", _arguments, lambda m: "no unsupported SDPA arguments"),
    Precondition("softcap", _softcap, _softcap_passes),
    Precondition("dtype", _dtype, _dtype_passes),
    Precondition("head_dim", _head_dim, lambda m: f"head_dim {_site(m).size('dim')}"),
    Precondition("gqa", _gqa, _gqa_passes),
    Precondition("value cache", _value_cache, lambda m: "value cache shaped like the key cache"),
    Precondition("scales", _scales, lambda m: "one scale per token and head, or none"),
    Precondition("batch", _batch, _batch_passes),
    Precondition("devices", _devices, lambda m: f"all on {_site(m).q_fake.device}"),
    Precondition("block_size", _block_size, lambda m: f"block_size {_site(m).size('slot')}"),
    Precondition("cache strides", _strides, lambda m: "innermost dim contiguous, rows aligned"),
    Precondition("mask", _mask, _mask_passes),
    Precondition("window", lambda m: None, _window_passes),
    Precondition("masked rows", _masked_rows, _masked_rows_passes),
    Precondition("causal", lambda m: None, _causal_passes),
    Precondition("scale", _scale, _scale_passes),
    Precondition("self-contained", _self_contained,
                 lambda m: "gathered K/V are used only by this attention"),
    Precondition("cache writes", _no_write_in_between,
                 lambda m: "no write to the caches, table, scales or lengths between their "
                           "read and the attention"),
    Precondition("autograd", _no_grad_needed, lambda m: "no gradient needed"),
    Precondition("kernel", _kernel, lambda m: str(_kernel_report(_site(m)))),
)
