"""The torch.library definitions of torch.ops.pagedfuse.*: schema, fake impl, kernel dispatch.

Each attention op validates its arguments into a PagedCall (validate.py), allocates its
output and hands both to the kernel backend the registry chooses for the call
(backends/registry.py); quantize_int8 runs the device's quantize kernel.

The ops are registered with the low-level ``torch.library.Library`` API rather than
``custom_op``, whose Python wrappers (an autograd.Function, an aliasing check and a dynamo
guard on every call) cost more than the rest of an eager call together. What custom_op
added is here explicitly: the pt2_compliant tag, a fake impl, and an Autograd kernel that
lets a call that needs gradients fail at backward. The schemas are inferred from the typed
signatures below, so this module does not use ``from __future__ import annotations``.

``window_left`` and ``softcap`` are keyword-only: the dispatcher hands them to a kernel as
keyword arguments (and leaves out those at their default), so every kernel here takes
``**options``. Where no kernel of the device implements one yet, the pure-torch reference
runs the call: the op's contract holds on every device, only the speed differs (the
rewrite's ``kernel`` check never fuses such a site).
"""

from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch
from torch._C import DispatchKey, DispatchKeySet

from pagedfuse import envs
from pagedfuse.ops.backends import Backend, choose, get_backend, quantize_kernel, registry
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall, empty_contiguous
from pagedfuse.ops.signature_cache import SignatureCache
from pagedfuse.ops.validate import (
    build_call,
    check_metadata,
    check_quantize_input,
    check_values,
    pointer_masks,
    value_checks_enabled,
)

Tensor = torch.Tensor

_LIB = torch.library.Library("pagedfuse", "FRAGMENT")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# Below Autograd, a plain CPU or CUDA tensor under no mode dispatches straight to the kernel.
_PLAIN = frozenset(DispatchKeySet(key).raw_repr() for key in (DispatchKey.CPU,
                                                              DispatchKey.CUDA))


def _backend(call: PagedCall) -> Backend:
    """The registry's choice; for a call using an option no kernel of its device implements
    yet (and no backend forced), the reference."""
    try:
        return choose(call)
    except ValueError:
        if not call.options or envs.PAGEDFUSE_BACKEND is not None:
            raise
        return get_backend("reference")


def _attend(op: str, query: Tensor, key_cache: Tensor, value_cache: Tensor,
            key_scale: Tensor | None, value_scale: Tensor | None, block_table: Tensor,
            seq_lens: Tensor, query_start_loc: Tensor, scale: float, causal: bool,
            attn_bias: Tensor | None, max_seq_len: int | None,
            max_query_len: int | None, window_left: int | None = None,
            softcap: float | None = None) -> tuple[Tensor, PagedCall, Backend | None]:
    """The op on real tensors: its output, the validated call and the backend that ran it
    (None: an empty output, nothing to run). The dispatcher hands the scalars over as the
    schema types them (scale and softcap as float, causal as bool), so they go into the
    call as given."""
    call = build_call(op, query, key_cache, value_cache, key_scale, value_scale, block_table,
                      seq_lens, query_start_loc, scale, causal, attn_bias, max_seq_len,
                      max_query_len, window_left=window_left, softcap=softcap)
    if value_checks_enabled(query.device):
        check_values(call.geometry, block_table, seq_lens, query_start_loc, attn_bias,
                     max_seq_len, max_query_len)
    g = call.geometry
    out = empty_contiguous(query, (g.num_tokens, g.num_q_heads, g.head_dim), query.dtype,
                           (g.num_q_heads * g.head_dim, g.head_dim, 1))
    backend = None
    if out.numel():
        backend = _backend(call)
        backend.run(call, out, None)
    return out, call, backend


def _paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    causal: bool,
    attn_bias: Tensor | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    *,
    window_left: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of packed queries [T, Hq, D] over a paged float KV cache (docs/design.md).
    ``window_left``: a query at position p reads keys j > p - window_left only;
    ``softcap``: scaled scores s become softcap * tanh(s / softcap) before attn_bias."""
    return _attend(FLOAT_OP, query, key_cache, value_cache, None, None, block_table, seq_lens,
                   query_start_loc, scale, causal, attn_bias, max_seq_len, max_query_len,
                   window_left, softcap)[0]


def _paged_attention_int8(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    key_scale: Tensor,
    value_scale: Tensor | None,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    causal: bool,
    attn_bias: Tensor | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    *,
    window_left: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Paged attention over an INT8 K cache (per-token, per-KV-head scales); V int8 or float.
    ``window_left`` and ``softcap`` as for paged_attention."""
    return _attend(INT8_OP, query, key_cache, value_cache, key_scale, value_scale,
                   block_table, seq_lens, query_start_loc, scale, causal, attn_bias,
                   max_seq_len, max_query_len, window_left, softcap)[0]


def _quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 over the last dim: (x_int8, scale = max|x| / 127 as float32)."""
    check_quantize_input(x)
    return quantize_kernel(x.device.type)(x)


def _host_quantize(x: Tensor) -> tuple[tuple[Tensor, Tensor], dict | None]:
    """quantize_int8 for the C++ host path's miss: the result, and the launch its table keeps
    for x's signature where the device's quantize kernel has a C++ launcher."""
    check_quantize_input(x)
    backend = registry.quantize_backend(x.device.type)
    launch = None if backend is None else backend.host_quantize
    return quantize_kernel(x.device.type)(x), None if launch is None else launch(x)


def _paged_attention_fake(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                          scale, causal, attn_bias=None, max_seq_len=None, max_query_len=None,
                          *, window_left=None, softcap=None):
    check_metadata(FLOAT_OP, query, key_cache, value_cache, block_table, seq_lens,
                   query_start_loc, scale, attn_bias, fake=True, window_left=window_left,
                   softcap=softcap)
    return query.new_empty(query.shape)


def _paged_attention_int8_fake(query, key_cache, value_cache, key_scale, value_scale,
                               block_table, seq_lens, query_start_loc, scale, causal,
                               attn_bias=None, max_seq_len=None, max_query_len=None, *,
                               window_left=None, softcap=None):
    check_metadata(INT8_OP, query, key_cache, value_cache, block_table, seq_lens,
                   query_start_loc, scale, attn_bias, key_scale, value_scale, fake=True,
                   window_left=window_left, softcap=softcap)
    return query.new_empty(query.shape)


def _quantize_int8_fake(x):
    check_quantize_input(x)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


class _NoBackward(torch.autograd.Function):
    """Runs the op below Autograd for inputs that require grad; backward raises, as the ops
    have no gradient formula (the rewrite keeps such sites as written)."""

    @staticmethod
    def forward(ctx, op, options, *args):
        ctx.op_name = op.name()
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **options)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.op_name} has no backward: call it where no gradient is "
                           "needed (torch.no_grad() or torch.inference_mode())")


def _is_tensor(kind: torch.Type) -> bool:
    """A schema type that holds a tensor: Tensor or Tensor?."""
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


def _autograd_kernel(op: torch._ops.OpOverload, impl: Callable) -> Callable:
    """The op's Autograd kernel. Outside a trace (plain CPU/CUDA tensors, no mode, nothing
    requiring grad) it calls the implementation itself, which is what the redispatch below
    Autograd would reach, without a second round of argument conversion. Whether a keyset
    is plain below Autograd is remembered per keyset (a handful occur), and only the leading
    arguments up to the last tensor one are asked whether they require grad: both run on
    every call in grad mode."""
    plain: SignatureCache[int, bool] = SignatureCache(limit=64)  # a handful of keysets occur
    tensors = 1 + max(i for i, a in enumerate(op._schema.arguments) if _is_tensor(a.type))

    def kernel(keyset, *args, **options):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args[:tensors]):
            return _NoBackward.apply(op, options, *args)
        raw = keyset.raw_repr()
        below_is_plain = plain.get(raw)
        if below_is_plain is None:
            below_is_plain = plain.put(raw, (keyset & _AFTER_AUTOGRAD).raw_repr() in _PLAIN)
        if below_is_plain:
            return impl(*args, **options)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _AFTER_AUTOGRAD, *args, **options)

    return kernel


def _requiring_grad(op: torch._ops.OpOverload) -> Callable:
    """The C++ Autograd kernel's call for inputs that require grad, which hands over every
    argument positionally: _NoBackward with the keyword-only ones as keywords."""
    arguments = op._schema.arguments
    keywords = [a.name for a in arguments if a.kwarg_only]
    leading = len(arguments) - len(keywords)

    def call(*args):
        return _NoBackward.apply(op, dict(zip(keywords, args[leading:], strict=True)),
                                 *args[:leading])

    return call


# --- the C++ host path (csrc/host/host.cpp) --------------------------------------------------
# Where pagedfuse._host is built, it holds the ops' Autograd, CPU and CUDA kernels: a call whose
# signature it has seen before runs without Python; a miss runs the Python implementation
# below (_host_attention, _host_quantize), whose spec (None: always Python) it keeps per
# signature. The switches the Python path reads per call join every signature.
_HOST_SWITCHES = ("PAGEDFUSE_BACKEND", "PAGEDFUSE_CHECKS", "PAGEDFUSE_PDL", "PAGEDFUSE_BALANCED")
_HOST_OPS = (FLOAT_OP, INT8_OP, "quantize_int8")  # host.cpp's OpKind codes


def _extension() -> ModuleType | None:
    try:
        from pagedfuse import _host
    except ImportError:  # not built: every call runs the Python implementation
        return None
    _host.configure(list(_HOST_SWITCHES))
    registry.on_change(_host.clear)  # its signatures hold the registry's choices
    return _host


HOST = _extension()


def _host_attention(op: str) -> Callable:
    """The attention op ``op`` for the C++ host path's miss (its schema's arguments, all
    positional): the output, and what the table keeps for the call's signature."""
    def fill(query: Tensor, key_cache: Tensor, value_cache: Tensor,
             *rest: object) -> tuple[Tensor, dict | None]:
        args = (query, key_cache, value_cache, *((None, None) if op == FLOAT_OP else ()), *rest)
        out, call, backend = _attend(op, *args)  # args in _attend's order
        launch = None if backend is None else backend.host_launch  # None: nothing ran
        # strided index tensors (build_call copies them per call) stay in Python
        if launch is None or call.seq_lens is not args[6] or call.query_start_loc is not args[7]:
            return out, None
        spec = launch(call)
        if spec is None:
            return out, None
        checks = partial(check_values, call.geometry) if value_checks_enabled(query.device) \
            else None
        return out, {**spec, "masks": pointer_masks(call), "checks": checks}

    return fill


def _define(name: str, impl: Callable, fake: Callable, fill: Callable) -> torch._ops.OpOverload:
    """Define pagedfuse::``name`` with the schema of ``impl``'s signature; returns the op.
    ``fill``: the op for the C++ host path's miss."""
    schema = torch.library.infer_schema(impl, mutates_args=())
    _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    op = getattr(torch.ops.pagedfuse, name).default
    _LIB.impl(name, impl, "CompositeExplicitAutograd")  # every device the C++ one is not for
    if HOST is None:
        _LIB.impl(name, _autograd_kernel(op, impl), "Autograd", with_keyset=True)
    else:
        HOST.register_op(name, _HOST_OPS.index(name), fill, _requiring_grad(op))
    torch.library.register_fake(f"pagedfuse::{name}", fake, lib=_LIB)
    return op


paged_attention = _define(FLOAT_OP, _paged_attention, _paged_attention_fake,
                          _host_attention(FLOAT_OP))
paged_attention_int8 = _define(INT8_OP, _paged_attention_int8, _paged_attention_int8_fake,
                               _host_attention(INT8_OP))
quantize_int8 = _define("quantize_int8", _quantize_int8, _quantize_int8_fake, _host_quantize)
