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

import torch
from torch._C import DispatchKey, DispatchKeySet

from pagedfuse import envs
from pagedfuse.ops.backends import Backend, choose, get_backend, quantize_kernel
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall, empty_contiguous
from pagedfuse.ops.validate import (
    build_call,
    check_metadata,
    check_quantize_input,
    check_values,
    value_checks_enabled,
)

Tensor = torch.Tensor

_LIB = torch.library.Library("pagedfuse", "FRAGMENT")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# Below Autograd, a plain CPU or CUDA tensor under no mode dispatches straight to the kernel.
_PLAIN = frozenset(DispatchKeySet(key).raw_repr() for key in (DispatchKey.CPU,
                                                              DispatchKey.CUDA))
_KEYSET_LIMIT = 64  # keysets an Autograd kernel remembers (a handful occur)


def _backend(call: PagedCall) -> Backend:
    """The registry's choice; for a call using an option no kernel of its device implements
    yet (and no backend forced), the reference."""
    try:
        return choose(call)
    except ValueError:
        if not call.options or envs.PAGEDFUSE_BACKEND is not None:
            raise
        return get_backend("reference")


def _run(op: str, query: Tensor, key_cache: Tensor, value_cache: Tensor,
         key_scale: Tensor | None, value_scale: Tensor | None, block_table: Tensor,
         seq_lens: Tensor, query_start_loc: Tensor, scale: float, causal: bool,
         attn_bias: Tensor | None, max_seq_len: int | None,
         max_query_len: int | None, window_left: int | None = None,
         softcap: float | None = None) -> Tensor:
    """The op on real tensors. The dispatcher hands the scalars over as the schema types
    them (scale and softcap as float, causal as bool), so they go into the call as given."""
    call = build_call(op, query, key_cache, value_cache, key_scale, value_scale, block_table,
                      seq_lens, query_start_loc, scale, causal, attn_bias, max_seq_len,
                      max_query_len, window_left=window_left, softcap=softcap)
    if value_checks_enabled(query.device):
        check_values(call.geometry, block_table, seq_lens, query_start_loc, attn_bias,
                     max_seq_len, max_query_len)
    g = call.geometry
    out = empty_contiguous(query, (g.num_tokens, g.num_q_heads, g.head_dim), query.dtype,
                           (g.num_q_heads * g.head_dim, g.head_dim, 1))
    if out.numel():
        _backend(call).run(call, out, None)
    return out


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
    return _run(FLOAT_OP, query, key_cache, value_cache, None, None, block_table, seq_lens,
                query_start_loc, scale, causal, attn_bias, max_seq_len, max_query_len,
                window_left, softcap)


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
    return _run(INT8_OP, query, key_cache, value_cache, key_scale, value_scale, block_table,
                seq_lens, query_start_loc, scale, causal, attn_bias, max_seq_len,
                max_query_len, window_left, softcap)


def _quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 over the last dim: (x_int8, scale = max|x| / 127 as float32)."""
    check_quantize_input(x)
    return quantize_kernel(x.device.type)(x)


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
    def forward(ctx, op, keyset, options, *args):
        ctx.op_name = op.name()
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset, *args, **options)

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
    plain: dict[int, bool] = {}
    tensors = 1 + max(i for i, a in enumerate(op._schema.arguments) if _is_tensor(a.type))

    def kernel(keyset, *args, **options):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args[:tensors]):
            return _NoBackward.apply(op, keyset & _AFTER_AUTOGRAD, options, *args)
        raw = keyset.raw_repr()
        below_is_plain = plain.get(raw)
        if below_is_plain is None:
            if len(plain) >= _KEYSET_LIMIT:
                plain.clear()
            below_is_plain = plain[raw] = (keyset & _AFTER_AUTOGRAD).raw_repr() in _PLAIN
        if below_is_plain:
            return impl(*args, **options)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _AFTER_AUTOGRAD, *args, **options)

    return kernel


def _define(name: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define pagedfuse::``name`` with the schema of ``impl``'s signature; returns the op."""
    schema = torch.library.infer_schema(impl, mutates_args=())
    _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    op = getattr(torch.ops.pagedfuse, name).default
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    _LIB.impl(name, _autograd_kernel(op, impl), "Autograd", with_keyset=True)
    torch.library.register_fake(f"pagedfuse::{name}", fake, lib=_LIB)
    return op


paged_attention = _define(FLOAT_OP, _paged_attention, _paged_attention_fake)
paged_attention_int8 = _define(INT8_OP, _paged_attention_int8, _paged_attention_int8_fake)
quantize_int8 = _define("quantize_int8", _quantize_int8, _quantize_int8_fake)
