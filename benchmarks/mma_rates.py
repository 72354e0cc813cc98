"""The tensor cores' sustained rates per operand type on this GPU: the ceiling the INT8 bars
of the prefill kernels are judged against.

INT8 K runs Q·K^T as an int8 wgmma and keeps P·V in 16 bits (the error bound needs it), so
its matrix work takes ``0.5 + 0.5 / r`` of bf16's time, r being int8's rate over bf16's
(Q·K^T and P·V are the same FLOPs): where both kernels are bound by it, INT8 K is at most
``1 / (0.5 + 0.5 / r)`` times bf16's speed. The data sheet's r is 2 (a 4/3 ceiling); what a
chip sustains under its power limit on random data is what this measures, two ways, in one
run:

- ``wgmma loop``: a Gluon kernel whose warpgroups issue wgmma back to back from operands
  held in shared memory (m64 x N per instruction, K = 128, one group in flight while the
  next issues, no memory traffic), two CTAs on every SM: the tensor pipe alone, for bf16,
  fp8 e4m3 and int8;
- cuBLAS GEMMs at 8192^3 (``torch.matmul``, ``torch._scaled_mm``, ``torch._int_mm``).

Each entry runs ``--seconds`` of back-to-back launches after as long a warm-up, so clocks
and power reach their steady state; nvidia-smi's SM clock and power are read at the end of
each. Prints a table and, with ``--json``, writes the rows, the ratios and the ceilings.

    python benchmarks/mma_rates.py --json benchmarks/results/mma_rates_h200_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

K_DIM = 128  # a head dim: Q·K^T's reduction, and the operand tile each wgmma reads
M_ROWS = 128  # rows per CTA: two warpgroups of 64, as the prefill kernel's consumers
GEMM = 8192
# the loop's result against float64: int8 is exact, bf16 measured 4.8e-7 and fp8 5.0e-4 (the
# H200's fp8 wgmma accumulates with fewer bits than fp32; mma_rates_h200_2026-12-02.json)
CHECK_TOL = 1e-3
# bar: INT8 K at >= 1.3x bf16's speed needs 0.5 + 0.5 / r <= 1 / 1.3 where MMA-bound
BAR = 1.3


@gluon.jit
def mma_loop_kernel(a_ptr, b_ptr, out_ptr, iters, N: gl.constexpr, K: gl.constexpr,
                    M: gl.constexpr, INSTR_K: gl.constexpr):
    """Each CTA: ``iters`` wgmma of [M, K] x [K, N] from shared memory into one
    accumulator, which goes to ``out`` so nothing is dead. num_warps = M // 16."""
    NUM_WARPS: gl.constexpr = M // 16
    in_t: gl.constexpr = a_ptr.dtype.element_ty
    acc_t: gl.constexpr = gl.int32 if in_t == gl.int8 else gl.float32
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, N, INSTR_K])
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    cols = gl.arange(0, K, gl.SliceLayout(0, LOAD))
    rows_a = gl.arange(0, M, gl.SliceLayout(1, LOAD))
    rows_b = gl.arange(0, N, gl.SliceLayout(1, LOAD))
    a_smem = gl.allocate_shared_memory(
        in_t, [M, K], gl.NVMMASharedLayout.get_default_for([M, K], in_t),
        gl.load(a_ptr + rows_a[:, None] * K + cols[None, :]))
    b_smem = gl.allocate_shared_memory(
        in_t, [N, K], gl.NVMMASharedLayout.get_default_for([N, K], in_t),
        gl.load(b_ptr + rows_b[:, None] * K + cols[None, :]))
    fence_async_shared()
    b_t = b_smem.permute((1, 0))  # K-major B, as Q·K^T reads a key tile
    acc = gl.zeros([M, N], acc_t, ACC)
    for _ in range(iters):
        # one group stays in flight while the next issues on the same accumulator, as a
        # GEMM's main loop chains its k steps
        acc = warpgroup_mma(a_smem, b_t, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
    acc = warpgroup_mma_wait(0, deps=(acc,))
    r = gl.arange(0, M, gl.SliceLayout(1, ACC))
    c = gl.arange(0, N, gl.SliceLayout(0, ACC))
    base = out_ptr + gl.program_id(0).to(gl.int64) * M * N
    gl.store(base + r[:, None] * N + c[None, :], acc)


def _operands(kind: str, rows: int, cols: int) -> torch.Tensor:
    """Random operands of ``kind`` (int8 over its whole range, floats N(0, 1))."""
    if kind == "int8":
        return torch.randint(-127, 128, (rows, cols), device="cuda", dtype=torch.int8)
    x = torch.randn(rows, cols, device="cuda")
    return x.to(torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn)


def _loop_call(kind: str, n: int, ctas: int, iters: int):
    """One launch of mma_loop_kernel over ``ctas`` CTAs, and its operations."""
    a, b = _operands(kind, M_ROWS, K_DIM), _operands(kind, n, K_DIM)
    out = torch.empty(ctas, M_ROWS, n, device="cuda",
                      dtype=torch.int32 if kind == "int8" else torch.float32)
    instr_k = 16 if kind == "bf16" else 32

    def launch():
        mma_loop_kernel[(ctas,)](a, b, out, iters, n, K_DIM, M_ROWS, instr_k,
                                 num_warps=M_ROWS // 16)

    return launch, 2.0 * M_ROWS * n * K_DIM * iters * ctas, (a, b, out, iters)


def check_loop(kind: str, n: int) -> float:
    """The loop kernel's result against iters * A @ B^T (relative error; int8 exact)."""
    launch, _, (a, b, out, iters) = _loop_call(kind, n, 2, 3)
    launch()
    ref = iters * (a.double() @ b.double().T)
    got = out.double()
    return float(((got - ref).norm() / ref.norm()).item())


def _gemm_call(kind: str):
    """A cuBLAS GEMM of GEMM^3 on random operands, and its operations."""
    a = _operands(kind, GEMM, GEMM)
    b = _operands(kind, GEMM, GEMM)
    if kind == "bf16":
        fn = lambda: torch.matmul(a, b)  # noqa: E731
    elif kind == "fp8":
        one = torch.ones((), device="cuda")
        bt = b.t()  # _scaled_mm wants B column-major

        fn = lambda: torch._scaled_mm(a, bt, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        bt = b.t()
        fn = lambda: torch._int_mm(a, bt)  # noqa: E731
    return fn, 2.0 * GEMM**3


def _smi() -> dict:
    """The SM clock (MHz) and power (W) nvidia-smi reads now."""
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
        clock, power = (float(x) for x in line.split(","))
        return {"sm_mhz": clock, "power_w": power}
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


def sustained(fn, ops: float, seconds: float) -> dict:
    """Operations per second of ``fn`` over ``seconds`` of back-to-back calls, after as long
    a warm-up; the median of 20 windows, with the smallest and largest."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < seconds:  # warm-up: clocks and power settle
        fn()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    per_window = max(1, int(calls / 20))
    rates = []
    for _ in range(20):
        e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        e0.record()
        for _ in range(per_window):
            fn()
        e1.record()
        e1.synchronize()
        rates.append(ops * per_window / (e0.elapsed_time(e1) * 1e-3))
    rates.sort()
    return {"tops": rates[10] / 1e12, "min_tops": rates[0] / 1e12, "max_tops": rates[-1] / 1e12,
            **_smi()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows, ratios and ceilings here")
    ap.add_argument("--seconds", type=float, default=2.0, help="per entry, after as long a "
                    "warm-up")
    ap.add_argument("--n", type=int, nargs="+", default=[64, 128],
                    help="wgmma N (keys per Q·K^T tile)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n in args.n:
        for kind in ("bf16", "fp8", "int8"):
            err = check_loop(kind, n)
            if not err <= CHECK_TOL:  # a loop that computes something else times nothing
                raise SystemExit(f"wgmma loop {kind} N={n}: {err:.2e} from iters * A @ B^T")
            # two CTAs per SM (four warpgroups issuing), about 20 ms a launch at bf16's
            # data-sheet rate: launches are never the limit
            ctas = 2 * sms
            iters = int(20e-3 * 990e12 / (2.0 * M_ROWS * n * K_DIM * ctas))
            fn, ops, _ = _loop_call(kind, n, ctas, iters)
            row = {"method": "wgmma loop", "kind": kind, "n": n, "k": K_DIM, "check_err": err,
                   **sustained(fn, ops, args.seconds)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for kind in ("bf16", "fp8", "int8"):
        fn, ops = _gemm_call(kind)
        row = {"method": "cuBLAS GEMM", "kind": kind, "n": GEMM, "k": GEMM,
               **sustained(fn, ops, args.seconds)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = ceilings(rows)
    for line in summary["lines"]:
        print(line)
    if args.json:
        env = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "sms": sms,
               "command": "python benchmarks/mma_rates.py --seconds "
                          f"{args.seconds} --n {' '.join(map(str, args.n))}"}
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows, "ceilings": summary["ceilings"]}, f, indent=1)


def ceilings(rows: list[dict]) -> dict:
    """Per method and N: int8's and fp8's rate over bf16's (r), INT8 K's MMA-bound speedup
    over bf16 with P·V in 16 bits (1 / (0.5 + 0.5 / r)), and whether that reaches BAR."""
    out, lines = [], []
    keyed = {(r["method"], r["n"], r["kind"]): r["tops"] for r in rows}
    for method, n in sorted({(r["method"], r["n"]) for r in rows}):
        bf16 = keyed.get((method, n, "bf16"))
        for kind in ("int8", "fp8"):
            if not bf16 or (method, n, kind) not in keyed:
                continue
            r = keyed[(method, n, kind)] / bf16
            ceiling = 1 / (0.5 + 0.5 / r)
            out.append({"method": method, "n": n, "kind": kind, "ratio": r,
                        "int8_k_ceiling": ceiling, "reaches_bar": ceiling >= BAR})
            lines.append(f"{method} N={n}: {kind} {keyed[(method, n, kind)]:.0f} against bf16 "
                         f"{bf16:.0f} T/s (r = {r:.2f}); with P·V in 16 bits at most "
                         f"{ceiling:.3f}x bf16's speed (bar {BAR}x)")
    return {"ceilings": out, "lines": lines}


if __name__ == "__main__":
    main()
