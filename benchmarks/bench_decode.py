"""Paged bf16/INT8 decode on the GPU: pagedfuse's kernels against the peers, one table.

Geometries (Hq, Hkv, D) x batch x context, page 16, random block permutation, bf16, NHD
caches ([blocks, page, Hkv, D]; --layout hnd: [blocks, Hkv, page, D], where FlexAttention's
paged view does not apply). Each row times, side by side in one run: eager gather + SDPA,
the same under torch.compile (inductor), SDPA on already-contiguous K/V (best of cuDNN and
flash: the proxy for the physical limit), FlexAttention paged over the same cache
(flex_paged.py), naive INT8 dequant + SDPA under inductor, and pagedfuse grouped bf16, INT8
K+V and INT8 K + bf16 V, each by the op's default path (the CUDA C++ decode where built)
and by the Triton kernel. Times come from timing.py (CUDA graph replays after an L2 flush);
B=1 is also timed as one plain (eager) call. "floor" = bytes that must be read / the copy
bandwidth measured in the same run. The table is printed; --json keeps the raw rows (e.g.
under benchmarks/results/, which summarize.py turns into benchmarks/README.md's table).

    python benchmarks/bench_decode.py --json results/decode_h200_DATE.json --plot decode.png
    python benchmarks/bench_decode.py --replot results/decode_h200_DATE.json --plot d.png
                                                           # redraw a recorded run, no GPU

Tuning sweeps (tile shapes, splits, heads per CTA, locality, flushes, host cost) are in
benchmarks/tuning/decode_sweeps.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import decode_cases
import timing
import torch
from decode_cases import (
    BATCHES,
    GEOMETRIES,
    LENGTHS,
    OPS,
    Case,
    best_contiguous,
    contiguous_out,
    fits,
    gather_sdpa,
    geometry_name,
    int8_sdpa,
    native_path,
    pf_call,
    rel_err,
)
from timing import bench, bench_eager
from torch.nn.attention.flex_attention import flex_attention

BENCHMARK = "decode"  # the JSON's "benchmark": what summarize.py reads it as


def methods(case: Case, compiled: dict[str, Callable]) -> dict[str, tuple[str, Callable]]:
    """name -> (floor kind, zero-argument callable)."""
    tail = (*case.block_args, case.scale, False, None, case.length, 1)
    flex = {} if compiled.get("flex") is None else {
        "FlexAttention paged": ("bf16", _set_up_on_first_call(
            lambda: _flex_paged(case, compiled["flex"])))}
    return {
        **flex,
        "eager gather+SDPA": ("bf16", lambda: gather_sdpa(case.q, case.k, case.v,
                                                          case.table, case.scale)),
        "inductor gather+SDPA": ("bf16", lambda: compiled["gather"](
            case.q, case.k, case.v, case.table, case.scale)),
        "naive INT8 inductor": ("int8_kv", lambda: compiled["int8"](
            case.q, case.k8, case.ks, case.v8, case.vs, case.table, case.scale)),
        "pagedfuse bf16": ("bf16", lambda: OPS.paged_attention(
            case.q, case.k, case.v, *tail)),
        "pagedfuse bf16 Triton": ("bf16", lambda: pf_call(case, "bf16", "triton")),
        "pagedfuse INT8 K+V": ("int8_kv", lambda: OPS.paged_attention_int8(
            case.q, case.k8, case.v8, case.ks, case.vs, *tail)),
        "pagedfuse INT8 K+V Triton": ("int8_kv", lambda: pf_call(case, "int8_kv",
                                                                  "triton")),
        "pagedfuse INT8 K": ("int8_k", lambda: OPS.paged_attention_int8(
            case.q, case.k8, case.v, case.ks, None, *tail)),
        "pagedfuse INT8 K Triton": ("int8_k", lambda: pf_call(case, "int8_k",
                                                               "triton")),
    }


def _reps(case: Case) -> dict:
    big = case.bytes("bf16") > 2e9
    return dict(warmup=5, rep=25) if big else dict(warmup=10, rep=60)


def run_case(case: Case, compiled: dict, bw: float) -> dict:
    """Times (µs), floor fractions and errors of every method on one case."""
    reps = _reps(case)
    row = {"geo": case.geo, "B": case.batch, "L": case.length,
           "kv_gb": case.bytes("bf16") / 1e9, "us": {}, "floor": {}, "err": {}}
    ref = contiguous_out(case)
    timed = methods(case, compiled)
    for name, (kind, fn) in timed.items():
        try:
            out = fn()
            us = bench(fn, reps)
        except Exception as exc:  # a peer that cannot run this case is reported, not fatal
            row["us"][name] = None
            row["err"][name] = _reason(exc)
            print(f"{name} failed on {case.geo} B={case.batch} L={case.length}:\n"
                  + "".join(traceback.format_exception(exc)[-3:]), file=sys.stderr)
            continue
        row["us"][name] = us
        row["floor"][name] = case.bytes(kind) / bw / (us * 1e-6)
        row["err"][name] = rel_err(out.reshape(case.q.shape), ref)
    contig = best_contiguous(case, reps)
    row["contig_backend"], us = min(contig.items(), key=lambda item: item[1])
    row["us"]["contiguous SDPA"] = us
    row["floor"]["contiguous SDPA"] = case.bytes("bf16") / bw / (us * 1e-6)
    row["cudnn_us"] = contig.get("cudnn")
    row["pf_eager_us"] = bench_eager(timed["pagedfuse bf16"][1], reps)
    return row


def _reason(exc: Exception) -> str:
    """The exception's type and first line (an InductorError's first line is its cause), and
    its last line where the first only leads in to a subprocess's traceback."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.startswith("Set TORCHDYNAMO_VERBOSE")]
    why = " ... ".join(lines[:1] + lines[-1:]) if lines[:1] and lines[0].endswith(":") \
        else "".join(lines[:1])
    return f"{type(exc).__name__}: {why[:300]}".replace("|", "/")


def compile_peers(flex: bool = True) -> dict[str, Callable | None]:
    """The compiled peers. FlexAttention compiles for each shape: on the H200, the shapes
    after the first, which Dynamo made dynamic, failed inductor's flex lowering (it wants
    concrete batch and head counts). The recompile limit is raised so no case falls back to
    eager flex, which would materialize every score."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 64))  # (the latter: its older name)
    return {"gather": torch.compile(gather_sdpa, dynamic=True),
            "int8": torch.compile(int8_sdpa, dynamic=True),
            "flex": torch.compile(flex_attention, dynamic=False) if flex else None}


def _flex_paged(case: Case, flex: Callable) -> Callable:
    """FlexAttention over the case's pages; imported here, since torch's PagedAttention is
    experimental: a torch without it costs the flex column, not the run."""
    from flex_paged import paged_flex_call

    return paged_flex_call(case.q, case.k, case.v, case.table, case.seq_lens, case.scale,
                           flex)


def _set_up_on_first_call(set_up: Callable[[], Callable]) -> Callable:
    """A call whose setup runs inside its first call, so a peer that cannot set up a case
    fails in run_case's try, like one that cannot run it."""
    fn = None

    def call():
        nonlocal fn
        if fn is None:
            fn = set_up()
        return fn()

    return call


METHOD_ORDER = ["eager gather+SDPA", "inductor gather+SDPA", "contiguous SDPA",
                "FlexAttention paged", "naive INT8 inductor", "pagedfuse bf16",
                "pagedfuse bf16 Triton", "pagedfuse INT8 K+V", "pagedfuse INT8 K+V Triton",
                "pagedfuse INT8 K", "pagedfuse INT8 K Triton"]


SHORT = ["eager", "inductor", "contig", "flex", "naive i8", "pf bf16", "pf bf16 Triton",
         "pf i8 K+V", "pf i8 K+V Triton", "pf i8 K", "pf i8 K Triton"]


RATIOS = {"flex/contig": "FlexAttention paged",
          "pf/contig": "pagedfuse bf16", "pf Triton/contig": "pagedfuse bf16 Triton",
          "i8KV/contig": "pagedfuse INT8 K+V", "i8KV Triton/contig": "pagedfuse INT8 K+V Triton",
          "i8K/contig": "pagedfuse INT8 K", "i8K Triton/contig": "pagedfuse INT8 K Triton"}


def _fmt(row: dict, name: str) -> str:
    us = row["us"].get(name)
    if us is None:
        return "n/a"
    backend = f" {row['contig_backend']}" if name == "contiguous SDPA" else ""
    return f"{us:.1f} ({100 * row['floor'][name]:.0f}%){backend}"


def _case_name(row: dict) -> str:
    return f"{geometry_name(row['geo'])} B={row['B']} L={row['L']}"


def _ratio(row: dict, name: str) -> str:
    us = row["us"].get(name)
    return f"{us / row['us']['contiguous SDPA']:.2f}" if us else "n/a"


def _err(row: dict, name: str) -> str:
    err = row["err"].get(name)
    return f"{err:.1e}" if isinstance(err, float) else "n/a"


def environment(bw: float, command: str, seconds: float) -> dict:
    """What a run's table states about itself: when, where, with what, and which kernel
    each format's default path took."""
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": timing.triton.__version__,
            "python": platform.python_version(), "command": command, "seconds": round(seconds),
            "copy_bandwidth_tbs": round(bw / 1e12, 3), "flush": timing.FLUSH,
            "default_paths": {kind: native_path(kind) for kind in ("bf16", "int8_kv", "int8_k")}}


def markdown(rows: list[dict], env: dict) -> str:
    """The run's dated table: every method's µs and fraction of its floor, ratios to
    contiguous SDPA, errors, then the methods that failed and the B=1 latencies."""
    paths = env["default_paths"]
    lines = [
        f"GPU decode ({env['date']}, {env['gpu']}, torch {env['torch']}, Triton "
        f"{env['triton']}, Python {env['python']})",
        "",
        f"Command: `{env['command']}` ({env['seconds']:.0f} s). Copy bandwidth (read + write) "
        f"measured in the same run: {env['copy_bandwidth_tbs']:.2f} TB/s. Cells: median µs of "
        "GPU time (one call captured in a CUDA graph, replayed with the L2 flushed "
        f"({env['flush']}) before each replay) and the fraction of the K/V byte floor of that "
        "method's cache format (bf16; INT8 K+V with scales; INT8 K + bf16 V); for contiguous "
        "SDPA the faster backend is named. pf bf16, pf i8 K+V and pf i8 K are the ops' default "
        f"paths (bf16: {paths['bf16']}; INT8 K+V: {paths['int8_kv']}; INT8 K: "
        f"{paths['int8_k']}); the Triton columns force the Triton kernel. Page 16, random "
        "block permutation, bf16 queries, q_len 1. flex: FlexAttention through torch's "
        "experimental PagedAttention over the same cache, under torch.compile (flex_paged.py).",
        "",
        "| geometry | B | L | KV GB | " + " | ".join(SHORT) + " | " + " | ".join(RATIOS)
        + " | pf err | i8KV err | i8K err |",
        "|" + "---|" * (4 + len(SHORT) + len(RATIOS) + 3),
    ]
    for r in rows:
        name = geometry_name(r["geo"])
        lines.append(
            f"| {name} | {r['B']} | {r['L']} | {r['kv_gb']:.2f} | "
            + " | ".join(_fmt(r, m) for m in METHOD_ORDER) + " | "
            + " | ".join(_ratio(r, m) for m in RATIOS.values())
            + f" | {_err(r, 'pagedfuse bf16')} | {_err(r, 'pagedfuse INT8 K+V')} | "
            f"{_err(r, 'pagedfuse INT8 K')} |")
    failures: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        for m in METHOD_ORDER:
            if r["us"].get(m) is None and m in r["err"]:
                failures.setdefault((m, r["err"][m]), []).append(_case_name(r))
    if failures:
        lines += ["", "n/a: the method failed on that case:", ""]
        lines += [f"- {m} ({', '.join(cases)}): {why}" for (m, why), cases in failures.items()]
    single = [r for r in rows if r["B"] == 1]
    if single:
        lines += ["", "B=1 latency (CUDA graph replay, L2 flushed): pagedfuse bf16 vs cuDNN on "
                  "contiguous K/V; and one plain (eager) call of the pagedfuse op, whose Python "
                  "host overhead shows where it exceeds the GPU time:", ""]
    for r in single:
        cudnn = r.get("cudnn_us")
        vs = (f" vs cuDNN {cudnn:.1f} ({r['us']['pagedfuse bf16'] / cudnn:.2f}x)"
              if cudnn and r["us"].get("pagedfuse bf16") else "")
        eager = r.get("pf_eager_us")
        lines.append(f"- {geometry_name(r['geo'])} B=1 L={r['L']}: pagedfuse "
                     f"{r['us']['pagedfuse bf16']:.1f}{vs}"
                     + (f"; eager op call {eager:.1f}" if eager else ""))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], bw: float, path: str, device: str) -> None:
    """Achieved bandwidth against context length, one panel per geometry and batch; each
    method keeps its colour, pagedfuse's are squares and its forced-Triton runs dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10").colors

    fig, axes = plt.subplots(len(GEOMETRIES), len(BATCHES), figsize=(15, 11), sharex=True,
                             squeeze=False)
    for i, (gname, geo) in enumerate(GEOMETRIES.items()):
        for j, batch in enumerate(BATCHES):
            ax = axes[i][j]
            sel = [r for r in rows if r["geo"] == geo and r["B"] == batch]
            for k, name in enumerate(METHOD_ORDER):
                pts = [(r["L"], r["floor"][name] * bw / 1e12) for r in sel
                       if r["us"].get(name)]
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=name,
                            color=colours[k] if k < len(colours) else "black",
                            marker="s" if "pagedfuse" in name else "o",
                            ls="--" if name.endswith("Triton") else "-")
            ax.axhline(bw / 1e12, color="k", ls="--", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{gname} {geo}, B={batch}", fontsize=9)
            ax.set_ylabel("achieved TB/s (floor bytes / time)", fontsize=8)
            ax.set_xlabel("context length")
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes.flat),
                          key=lambda hl: len(hl[1]))  # the panel with the most methods
    axes[0][0].legend(handles, labels, fontsize=7)
    fig.suptitle(f"Paged decode on {device} "
                 f"(dashed: copy bandwidth {bw / 1e12:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load(path: str | Path) -> tuple[list[dict], dict]:
    """(rows, env) of a run this script recorded with --json."""
    record = json.loads(Path(path).read_text())
    if record.get("benchmark") != BENCHMARK:
        raise ValueError(f"{path}: not a {BENCHMARK} benchmark record")
    rows = [{**r, "geo": tuple(r["geo"])} for r in record["rows"]]
    return rows, record["env"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the run's rows and environment here")
    parser.add_argument("--plot", help="write the bandwidth plot here")
    parser.add_argument("--quick", action="store_true", help="B in (1, 8), L=1536 only")
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                        help="the table's batch sizes")
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS,
                        help="the table's context lengths")
    parser.add_argument("--geos", nargs="+", choices=list(GEOMETRIES),
                        help="only these geometries")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--flush", choices=("zero", "read"), default=timing.FLUSH,
                        help="clear the L2 before each timed replay by zeroing 256 MB "
                        "(do_bench's; dirty lines) or by reading 256 MB (clean lines, as "
                        "after a decode step's weight GEMMs)")
    parser.add_argument("--layout", choices=("nhd", "hnd"), default=decode_cases.LAYOUT,
                        help="the caches' storage order: [blocks, page, Hkv, D] (NHD, vLLM's "
                        "flash layout) or [blocks, Hkv, page, D] (HND, FlashInfer's)")
    parser.add_argument("--replot", metavar="JSON", help="print the table of a run recorded "
                        "with --json and, with --plot, redraw its plot; needs no GPU")
    args = parser.parse_args()
    if args.replot:
        rows, env = load(args.replot)
        print(markdown(rows, env))
        if args.plot:
            plot(rows, env["copy_bandwidth_tbs"] * 1e12, args.plot, env["gpu"])
        return
    bw = decode_cases.configure(args.layout, args.flush, args.geos)
    from tqdm import tqdm

    start = time.time()
    command = " ".join(["python benchmarks/bench_decode.py", *sys.argv[1:]])
    compiled = compile_peers(flex=not args.no_flex)
    batches, lengths = ((1, 8), (1536,)) if args.quick else (args.batches, args.lengths)
    combos = [(g, b, n) for g in GEOMETRIES.values() for b in batches for n in lengths
              if fits(g, b, n)]
    rows = []
    for geo, batch, length in tqdm(combos, desc="decode bench", mininterval=5):
        case = Case(geo, batch, length)
        rows.append(run_case(case, compiled, bw))
        del case
        torch.cuda.empty_cache()
        r = rows[-1]
        print(f"{geo} B={batch} L={length}: " + ", ".join(
            f"{s} {_fmt(r, m)}" for s, m in zip(SHORT, METHOD_ORDER, strict=True)), flush=True)
        env = environment(bw, command, time.time() - start)
        if args.json:  # rewritten after every case: a cut-short run keeps what it measured
            Path(args.json).write_text(json.dumps(
                {"benchmark": BENCHMARK, "env": {**env, "layout": args.layout},
                 "rows": rows}, indent=1) + "\n")
    print(markdown(rows, env))
    if args.plot:
        plot(rows, bw, args.plot, env["gpu"])


if __name__ == "__main__":
    main()
