"""CPU kernels: hand raw pointers, sizes and strides (in elements) to pagedfuse._C (csrc/).

Arguments arrive validated (validate.py), so every block id and length the C++ side reads
lies inside the cache. Only the cheap conversions happen here: the small index tensors become
contiguous int64, a bool attn_bias is viewed as uint8 and a half-precision one widened to
float32; the query, caches and scales go by strides, never copied.

The extension is imported inside the functions, so the package still imports on a machine
where it is not built (e.g. a GPU machine that only uses the Triton kernels).
"""

from __future__ import annotations

import torch

from pagedfuse.ops.call import PagedCall

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}


def _extension():
    try:
        from pagedfuse import _C
    except ImportError as err:
        raise ImportError("pagedfuse._C (the CPU kernels) is not built: run `make setup` "
                          "(or `pip install --no-build-isolation -e .`) in the repository"
                          ) from err
    return _C


def kernel_address(name: str) -> int:
    """The address of _C's entry point ``name`` (paged_attention, quantize_rows), which the C++
    host path calls directly."""
    return _extension().kernel_addresses()[name]


def available_isas() -> list[str]:
    """Values of PAGEDFUSE_CPU_ISA this CPU can run (read by the kernels on every call)."""
    return ["portable", "avx512"] if _extension().cpu_has_avx512_vnni() else ["portable"]


def selected_isa() -> str:
    """The instruction set the next kernel call will use, given PAGEDFUSE_CPU_ISA."""
    return _extension().selected_isa()


def _index(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def _bias_args(attn_bias: torch.Tensor | None, batch: int, num_q_heads: int):
    """(tensor kept alive, kind, strides of its [B, Hq, rows, cols] view with 0 on broadcast
    dims); kind 0 = none, 1 = bool (as uint8), 2 = float32."""
    if attn_bias is None:
        return None, 0, [0, 0, 0, 0]
    if attn_bias.dtype == torch.bool:
        bias, kind = attn_bias.view(torch.uint8), 1
    else:
        bias, kind = attn_bias.to(torch.float32), 2
    full = bias.expand(batch, num_q_heads, *bias.shape[-2:])
    strides = [0 if n == 1 else s for n, s in zip(full.shape, full.stride(), strict=True)]
    return bias, kind, strides


def _scale_strides(scale: torch.Tensor | None) -> list[int]:
    return [0, 0, 0] if scale is None else list(scale.stride())


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def signature_args(call: PagedCall) -> dict[str, object] | None:
    """The C++ kernel's arguments for ``call`` but data pointers and the thread count: what
    depends on the call signature alone, which the C++ host path keeps per signature. None
    for an attn_bias of a 16-bit dtype, which each call widens to a float32 copy."""
    bias = call.attn_bias
    if bias is not None and bias.dtype not in (torch.bool, torch.float32):
        return None
    _, bias_kind, bias_strides = _bias_args(bias, call.geometry.batch, call.geometry.num_q_heads)
    return _static_args(call, bias_kind, bias_strides)


def _static_args(call: PagedCall, bias_kind: int, bias_strides: list[int]) -> dict[str, object]:
    geo = call.geometry
    # 0: no window (a window is >= 1); one as long as the table holds keys hides none:
    # clamped there, the kernel's position arithmetic cannot overflow
    window = 0 if call.window_left is None else min(call.window_left,
                                                    geo.max_blocks * geo.block_size)
    return {
        "query_dtype": _DTYPE_CODES[call.query.dtype],
        "query_strides": list(call.query.stride()[:2]),
        "key_dtype": _DTYPE_CODES[call.key_cache.dtype],
        "key_strides": list(call.key_cache.stride()[:3]),
        "value_dtype": _DTYPE_CODES[call.value_cache.dtype],
        "value_strides": list(call.value_cache.stride()[:3]),
        "key_scale_strides": _scale_strides(call.key_scale),
        "value_scale_strides": _scale_strides(call.value_scale),
        "max_blocks": geo.max_blocks,
        "num_blocks": geo.num_blocks,
        "bias_kind": bias_kind,
        "bias_strides": bias_strides,
        "num_tokens": geo.num_tokens,
        "num_q_heads": geo.num_q_heads,
        "num_kv_heads": geo.num_kv_heads,
        "head_dim": geo.head_dim,
        "batch": geo.batch,
        "block_size": geo.block_size,
        "scale": float(call.scale),
        "causal": bool(call.causal),
        "window_left": window,
        "softcap": float(call.softcap or 0.0),  # 0: no cap (a cap is > 0)
    }


def paged_attention_into(call: PagedCall, out: torch.Tensor, plan: None = None) -> None:
    """Fill the contiguous ``out`` [T, Hq, D]. The C++ side reads each sequence's own lengths,
    so it needs neither the ``max_*`` hints nor a plan (it splits work by the thread count).
    """
    ext = _extension()
    table, lens, starts = (_index(call.block_table), _index(call.seq_lens),
                           _index(call.query_start_loc))
    bias, bias_kind, bias_strides = _bias_args(call.attn_bias, call.geometry.batch,
                                               call.geometry.num_q_heads)
    ext.paged_attention({
        **_static_args(call, bias_kind, bias_strides),
        "out": out.data_ptr(),
        "query": call.query.data_ptr(),
        "key_cache": call.key_cache.data_ptr(),
        "value_cache": call.value_cache.data_ptr(),
        "key_scale": _pointer(call.key_scale),
        "value_scale": _pointer(call.value_scale),
        "block_table": table.data_ptr(),
        "seq_lens": lens.data_ptr(),
        "query_start_loc": starts.data_ptr(),
        "attn_bias": _pointer(bias),
        "threads": torch.get_num_threads(),
    })


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 over the last dim, bit-identical to quantize_int8_reference."""
    ext = _extension()
    src = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32)
    if scale.numel():  # rows of length 0 get scale 0
        ext.quantize_int8(src.data_ptr(), dtype_code(src), scale.numel(), x.shape[-1],
                          q.data_ptr(), scale.data_ptr(), torch.get_num_threads())
    return q, scale


def dtype_code(t: torch.Tensor) -> int:
    """The kernels' code of t's dtype (csrc/common.h's Dtype)."""
    return _DTYPE_CODES[t.dtype]

