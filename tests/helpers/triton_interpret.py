"""The Triton split-KV kernel (backend ``triton``) on CPU tensors, run by
tests/test_window_kernels.py as ``TRITON_INTERPRET=1 python -m helpers.triton_interpret``:
window_left and softcap against the float64 reference, fp32 and fp16 (the interpreter's bf16
tl.dot is wrong), with the kernel's own split count and with 3 splits, and the
non-finite cases (decode with non-finite INT8 V scales too). Prints "unsupported: ..." and
exits 0 where the interpreter itself cannot run a loop with run-time bounds (numpy 2 does
not; numpy 1.26 does); raises on any mismatch."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from helpers.cases import Case, make_case, poison_kv
from helpers.window_cases import (
    DECODE,
    INF,
    NAN,
    POISONS,
    WINDOWS,
    poison_case,
    window_case,
)
from pagedfuse import numerics


@triton.jit
def _probe(x_ptr, n):
    for i in range(0, n):
        tl.store(x_ptr + i, i)


def interpreter_problem() -> str | None:
    """Why the interpreter cannot run the kernels here, or None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET=1 is not set"
    x = torch.zeros(3, dtype=torch.int32)
    try:
        _probe[(1,)](x, 3)
    except Exception as err:  # noqa: BLE001 (any failure of the probe means: cannot run)
        return f"{type(err).__name__}: {err}"
    return None if x.tolist() == [0, 1, 2] else f"the probe wrote {x.tolist()}"


def run(backend, c: Case, splits: int | None, max_query_len: int | None = None) -> torch.Tensor:
    """``max_query_len=1``: the decode hint, with which the plan has one token per tile."""
    call = c.call(max_query_len=max_query_len, capability=False)
    why = backend.supports(call)
    assert why is None, why
    return c.run_backend(backend, backend.make_plan(call, splits=splits) if splits else None,
                         max_query_len=max_query_len)


def in_dtype(c: Case, dtype: torch.dtype) -> Case:
    """``c`` with its query and float caches in ``dtype`` (int8 caches stay int8)."""
    floats = {name: getattr(c, name).to(dtype) for name in ("query", "key_cache", "value_cache")
              if getattr(c, name).is_floating_point()}
    return c.with_(**floats)


def main() -> None:
    problem = interpreter_problem()
    if problem is not None:
        print(f"unsupported: {problem}")
        return
    from pagedfuse.ops.backends import get_backend

    triton_backend = get_backend("triton")
    cases = [(f"w{w}-{'causal' if causal else 'noncausal'}", window_case(w, causal))
             for w in WINDOWS for causal in (False, True)]
    # decode calls (one query token per tile, whose loop starts at its window)
    cases += [(f"decode-w{w}-{kind}", window_case(w, True, kind=kind, q_lens=DECODE))
              for w in (1, 16, 4096) for kind in ("float", "int8_k", "int8_kv")]
    cases += [(f"w16-softcap-{kind}", window_case(16, True, kind=kind, softcap=5.0))
              for kind in ("float", "int8_k", "int8_kv")]
    cases += [("w7-noncausal-bias-softcap", window_case(7, False, bias="float",
                                                        bias_shape="per_batch", softcap=2.0))]
    checked = 0
    # fp32 with the kernel's own split count (1 here), fp16 with 3 splits and the combine
    for name, case in cases:
        for dtype, splits in ((torch.float32, None), (torch.float16, 3)):
            c = in_dtype(case, dtype)
            tol = numerics.kernel_tolerance(dtype, c.call(capability=False).kind)
            hint = 1 if name.startswith("decode") else None
            err = numerics.rel_err(run(triton_backend, c, splits, hint), c.reference())
            assert err <= tol, f"{name} {dtype} splits={splits}: rel err {err:.3g} > {tol}"
            checked += 1
    # Element-wise: fp32 to its rounding; int8 V through the fp16 P.V, which rounds P
    for kind, tol, split_counts in (("float", 1e-4, (None, 3)), ("int8_kv", 4e-2, (3,))):
        for where in POISONS:
            c = poison_case(where, kind)
            ref = c.reference()
            for splits in split_counts:
                got = run(triton_backend, c, splits)
                torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol,
                                           equal_nan=True, msg=lambda m, w=where, k=kind,
                                           s=splits: f"{k} {w} splits={s}: {m}")
                checked += 1
    # Decode (one query token per tile) with non-finite INT8 V scales: NaN, +-Inf of both
    # signs in one tile, an Inf on a key whose value is 0 in some dims, and an Inf on a key a
    # bool mask gives weight 0 (where the reference's 0 * Inf is NaN)
    for where in ("nan", "inf", "mixed", "inf_zero_value", "inf_masked"):
        c = make_case(seq_lens=(60, 37, 20), num_q_heads=4, num_kv_heads=2, block_size=4,
                      kind="int8_kv", causal=True, seed=5,
                      bias="bool" if where == "inf_masked" else None)
        c = c.with_(value_scale=c.value_scale.clone(), value_cache=c.value_cache.clone())
        block = int(c.block_table[0, 3])  # sequence 0's keys 12..15
        poison_kv(c, "v", block, 1, NAN if where == "nan" else INF)
        if where == "mixed":
            poison_kv(c, "v", block, 2, -INF)
        if where == "inf_zero_value":
            c.value_cache[block, 1, 1, :5] = 0
        if where == "inf_masked":
            c.attn_bias[0, :, :, 13] = False
        ref = c.reference()
        for splits in (None, 3):
            got = run(triton_backend, c, splits, max_query_len=1)
            torch.testing.assert_close(got.double(), ref.double(), rtol=4e-2, atol=4e-2,
                                       equal_nan=True, msg=lambda m, w=where, s=splits:
                                       f"decode int8_kv V scale {w} splits={s}: {m}")
            checked += 1
    # The prefill kernel (fp16 only) on the window and soft-cap cases with q_len > 1: its own
    # plan, and 16-row tiles of 16 keys packing two heads over 3 key splits (window starts
    # then fall inside tiles and splits)
    prefill = get_backend("triton_prefill")
    for name, case in cases:
        if name.startswith("decode"):
            continue
        c = in_dtype(case, torch.float16)
        call = c.call(capability=False)
        tol = numerics.kernel_tolerance(torch.float16, call.kind)
        for plan in (None, prefill.make_plan(call, block_m=16, pack=2, block_n=16, splits=3)):
            err = numerics.rel_err(c.run_backend(prefill, plan), c.reference())
            assert err <= tol, f"prefill {name} plan={plan}: rel err {err:.3g} > {tol}"
            checked += 1
    print(f"checked {checked} runs")


if __name__ == "__main__":
    main()
