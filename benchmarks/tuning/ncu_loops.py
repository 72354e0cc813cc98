"""Where the Gluon prefill kernel's warps spend their time, by loop and by instruction kind.

Two steps: a target for Nsight Compute on the H200, then a report of its per-instruction
warp-state samples (the source page of ``--set full`` with ``--import-source yes``)::

    ncu --clock-control none -k regex:ws_prefill -s 3 -c 1 --set full --import-source yes \\
        -o REP python3 benchmarks/tuning/ncu_loops.py probe llama3_8b int8_k 1 8192 8192
    ncu -i REP.ncu-rep --page source --csv --print-source sass > REP.csv
    python benchmarks/tuning/ncu_loops.py report REP.csv [REP2.csv ...]   # no GPU

``probe GEOMETRY KIND B L Q`` runs the gluon_prefill backend's default launches of one
bench_prefill case five times (ncu profiles the fourth) and prints the graph-timed ms.
``report`` finds the hot loops (runs of instructions that executed equally often and hold
at least --share of the samples; a consumer's key loop is one per consumer), and for each
prints its instructions, cycles between its warp's issues (samples / "selected" samples),
and its samples by what the instruction is: ``mufu`` (ex2), ``max`` (row maxima and their
shuffles), ``mma`` (wgmma issue, where a warp waits for the tensor cores' queue),
``mbar`` (an mbarrier arrive: the samples there are the warpgroup barrier before it),
``ffma``/``fmul``/``iadd``... (the softmax's arithmetic), ``bra`` (mbarrier try-wait
loops), and its top stall reasons.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
KINDS = (("GMMA", "mma"), ("WARPGROUP", "mma"), ("SYNCS", "mbar"), ("BAR", "bar"),
         ("MUFU", "mufu"), ("FMNMX", "max"), ("SHFL", "max"), ("VOTE", "max"),
         ("FFMA", "ffma"), ("FMUL", "fmul"), ("FADD", "fadd"), ("VIADD", "iadd"),
         ("F2FP", "pack"), ("PRMT", "prmt"), ("LDS", "lds"), ("BRA", "bra"), ("NOP", "nop"))


def probe(geometry: str, kind: str, batch: int, seq_len: int, q_len: int) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
    import bench_prefill as bp

    from pagedfuse.ops.backends import get_backend

    call = bp.Case(bp.GEOMETRIES[geometry], batch, seq_len, q_len, light=True).call(kind)
    backend = get_backend("gluon_prefill")
    out = torch.empty_like(call.query)
    for _ in range(5):
        backend.run(call, out, None)
    torch.cuda.synchronize()
    print("ms", bp.bench_ms(lambda: backend.run(call, out, None)))


def _kind(source: str) -> str:
    words = source.split()
    op = words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]
    return next((k for key, k in KINDS if key in op), op.split(".")[0])


def report(path: str, share: float) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def num(row: list[str], name: str) -> float:
        try:
            return float(row[col[name]])
        except ValueError:
            return 0.0

    total = sum(num(r, SAMPLES) for r in body)
    runs: list[list[list[str]]] = []
    for row in body:  # runs of (within 5%) equal execution counts
        ex, last = num(row, EXECUTED), runs[-1][-1] if runs else None
        if last and ex and num(last, EXECUTED) and abs(ex / num(last, EXECUTED) - 1) < 0.05:
            runs[-1].append(row)
        else:
            runs.append([row])
    print(f"{path}: {len(body)} instructions, {total:.0f} samples")
    for run in runs:
        samples = sum(num(r, SAMPLES) for r in run)
        if samples < share * total or len(run) < 32:  # not a loop body
            continue
        selected = sum(num(r, "stall_selected") for r in run)
        by_kind, count = Counter(), Counter()
        for r in run:
            k = _kind(r[col["Source"]].strip())
            by_kind[k] += num(r, SAMPLES)
            count[k] += 1
        reasons = Counter({s[6:]: sum(num(r, s) for r in run) for s in stalls})
        print(f"  loop of {len(run)} instructions, executed {num(run[0], EXECUTED):.0f} times: "
              f"{samples / total:.1%} of the samples, {samples / max(selected, 1):.2f} cycles "
              "per issue")
        print("    by kind: " + ", ".join(f"{k} {v / samples:.0%} ({count[k]})"
                                         for k, v in by_kind.most_common(9)))
        print("    stalls: " + ", ".join(f"{k} {v / samples:.0%}"
                                        for k, v in reasons.most_common(6)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("geometry")
    p.add_argument("kind")
    p.add_argument("shape", nargs=3, type=int, metavar="B L Q")
    r = sub.add_parser("report")
    r.add_argument("csv", nargs="+")
    r.add_argument("--share", type=float, default=0.05)
    args = ap.parse_args()
    if args.cmd == "probe":
        probe(args.geometry, args.kind, *args.shape)
    else:
        for path in args.csv:
            report(path, args.share)


if __name__ == "__main__":
    main()
