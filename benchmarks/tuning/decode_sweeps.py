"""Tuning sweeps of the GPU decode: what the kernels' defaults were chosen from.

Each sweep prints one line per point (GPU time from ../timing.py, the fraction of the byte
floor, ratios to contiguous SDPA); none writes a file::

    python benchmarks/tuning/decode_sweeps.py native      # CUDA C++ decode: heads per CTA x splits
    python benchmarks/tuning/decode_sweeps.py native:bf16,int8_k   # some cache formats only
    python benchmarks/tuning/decode_sweeps.py targets --layout hnd --flush read

Sweeps: native, tiles (Triton tile configs), splits (bf16 split counts), splitcheck (the
heuristic's split count against 1/2/4 at B=64), locality (the block table's order), targets
(the default paths at the KV >= 1 GB points), balanced (the balanced grid), skew (one long
sequence among short ones), host (host cost of one eager call, layer by layer) and overhead
(the fixed costs around the decode kernel).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import decode_cases  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402
from decode_cases import (  # noqa: E402
    GEOMETRIES,
    NATIVE_KIND,
    OPS,
    Case,
    best_contiguous,
    contiguous_out,
    decode_call,
    default_native,
    each_case,
    pf_call,
    rel_err,
)
from timing import bench, fixed_and_rate  # noqa: E402

from pagedfuse.ops import cuda as pf_cuda  # noqa: E402
from pagedfuse.ops import cuda_native  # noqa: E402
from pagedfuse.ops.backends import (
    choose,  # noqa: E402
    cuda_decode,  # noqa: E402
)
from pagedfuse.ops.backends import triton as pf_triton  # noqa: E402

INT8_CONFIGS = [(64, 4, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3), (256, 8, 2)]
BF16_CONFIGS = [(64, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 3), (64, 8, 2), (128, 8, 2)]
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)


def sweep_native(bw: float, kinds: tuple[str, ...] = tuple(NATIVE_KIND)) -> None:
    """Each cache format: the CUDA C++ decode with each count of KV heads per CTA its
    variant takes and several split counts, against the Triton kernel (at its heuristic's
    splits) and contiguous bf16 SDPA, at B=8 and B=64."""
    reps = dict(warmup=5, rep=20)
    device = torch.device("cuda")

    def visit(gname: str, case: Case) -> None:
        (_, hkv, d), batch, length = case.geo, case.batch, case.length
        contig_us = min(best_contiguous(case, reps).values())
        for kind in kinds:
            native = NATIVE_KIND[kind]
            floor_us = case.bytes(kind) / bw * 1e6
            triton_us = bench(lambda k=kind: pf_call(case, k, "triton"), reps)
            default = cuda_decode.native_config(native, d, hkv, batch, device)
            auto = pf_cuda.num_kv_splits(batch, hkv, d, length, pf_cuda.sm_count(device),
                                         default)
            line = []
            for heads in (h for h in cuda_native.HEADS_PER_CTA if hkv % h == 0):
                config = cuda_decode.native_config(native, d, hkv, batch, device, heads)
                for n in ((2, 4, 6, 8, 12, 16) if batch == 8 else (1, 2, 3, 4)):
                    us = bench(lambda n=n, c=config, k=kind: pf_call(
                        case, k, "cuda_decode", config=c, splits=n), reps)
                    line.append(f"{heads}/{n}: {us:.1f} ({100 * floor_us / us:.0f}%)")
            print(f"{kind} {gname} B={batch} L={length}: Triton {triton_us:.1f} "
                  f"({100 * floor_us / triton_us:.0f}%); CUDA C++ by heads per CTA/splits "
                  + ", ".join(line) + f"; default {default.heads}/{auto}; "
                  f"contiguous bf16 SDPA {contig_us:.1f}", flush=True)

    each_case(((8, 8192), (8, 32768), (64, 8192), (64, 32768)), visit)


TARGET_POINTS = ((64, 8192), (64, 32768), (8, 32768))  # the KV >= 1 GB points
TARGET_RATIOS = {"bf16": 1.0, "int8_kv": 0.55, "int8_k": 0.80}
FLOOR_TARGET = (8, 8192, 0.85)  # bf16 at B, L: at least this fraction of its floor


def print_default_paths(label: str, case: Case, bw: float, contig_us: float,
                        reps: dict) -> None:
    """One line: each cache format's default path on ``case`` (µs, the fraction of its
    floor, the ratio to contiguous SDPA and, where the issue sets one, whether it meets the
    format's target), and the largest error against contiguous SDPA."""
    ref = contiguous_out(case)
    cells, worst = [], 0.0
    for kind, target in TARGET_RATIOS.items():
        worst = max(worst, rel_err(pf_call(case, kind), ref))
        us = bench(lambda k=kind: pf_call(case, k), reps)
        fraction = case.bytes(kind) / bw * 1e6 / us
        verdict = ""
        if case.bytes("bf16") >= 1e9:
            verdict = "met" if us / contig_us <= target else "missed"
        elif kind == "bf16" and (case.batch, case.length) == FLOOR_TARGET[:2]:
            met = fraction >= FLOOR_TARGET[2]
            verdict = f"{FLOOR_TARGET[2]:.0%} of floor {'met' if met else 'missed'}"
        cells.append(f"{kind} {us:.1f} ({100 * fraction:.0f}%, {us / contig_us:.3f}x"
                     + (f", {verdict})" if verdict else ")"))
    print(f"{label}: {', '.join(cells)}; contiguous SDPA {contig_us:.1f} "
          f"({100 * case.bytes('bf16') / bw * 1e6 / contig_us:.0f}%); worst error {worst:.1e}",
          flush=True)


LAYOUTS = {"random page 16": {}, "in order page 16": dict(shuffle=False),
           "random page 128": dict(page=128),
           "random page 16, scales by head": dict(scales_by_head=True),
           "random page 16 within 64-block runs": dict(window=64),
           "random page 16, HND": dict(hnd=True)}


def sweep_locality(bw: float) -> None:
    """What the page table's randomness costs: each cache format's default kernel at B=64
    with the blocks in random order (the table's case, NHD) and in the other LAYOUTS, next
    to contiguous SDPA."""
    reps = dict(warmup=5, rep=20)
    for gname, geo in GEOMETRIES.items():
        for length in (8192, 32768):
            contig_us = None
            for layout, kwargs in LAYOUTS.items():
                case = Case(geo, 64, length, **{"hnd": False, **kwargs})
                if contig_us is None:
                    contig_us = min(best_contiguous(case, reps).values())
                print_default_paths(f"locality {gname} B=64 L={length} {layout}", case, bw,
                                    contig_us, reps)
                del case
                torch.cuda.empty_cache()


def sweep_targets(bw: float) -> None:
    """Each cache format's default path at the issue's KV >= 1 GB points and bf16's floor
    point, as its ratio to contiguous SDPA next to the target: one line per point, for
    comparing kernel builds (and cache layouts: --layout)."""
    reps = dict(warmup=5, rep=20)
    each_case(TARGET_POINTS + (FLOOR_TARGET[:2],), lambda gname, case: print_default_paths(
        f"targets {gname} B={case.batch} L={case.length}", case, bw,
        min(best_contiguous(case, reps).values()), reps))


def _balanced_us(case: Case, kind: str, config: pf_cuda.LaunchConfig, reps: dict) -> float:
    """bench() of the CUDA C++ decode's balanced grid with ``config``'s heads per CTA."""
    return bench(lambda: pf_call(case, kind, "cuda_decode", config=config,
                                  splits=cuda_decode.BALANCED), reps)


def sweep_balanced(bw: float) -> None:
    """The balanced grid against each cache format's default path, by KV heads per CTA, at
    the target points, B=8 L=8192 and B=64 L=1536, as ratios to contiguous SDPA."""
    reps = dict(warmup=5, rep=20)
    device = torch.device("cuda")

    def visit(gname: str, case: Case) -> None:
        (_, hkv, d), batch = case.geo, case.batch
        contig_us = min(best_contiguous(case, reps).values())
        for kind in TARGET_RATIOS:
            us = bench(lambda k=kind: pf_call(case, k), reps)
            cells = [f"default {us:.1f} ({us / contig_us:.3f}x)"]
            for heads in (h for h in cuda_native.HEADS_PER_CTA if hkv % h == 0):
                config = cuda_decode.native_config(NATIVE_KIND[kind], d, hkv, batch, device,
                                                   heads)
                us = _balanced_us(case, kind, config, reps)
                cells.append(f"balanced/{heads} {us:.1f} ({us / contig_us:.3f}x)")
            print(f"balanced {gname} B={batch} L={case.length} {kind}: {', '.join(cells)}; "
                  f"contiguous SDPA {contig_us:.1f}", flush=True)

    each_case(TARGET_POINTS + ((8, 8192), (64, 1536)), visit)


def sweep_skew(bw: float) -> None:
    """A batch of one long sequence among short ones, as continuous batching serves (one
    request deep into a long context, the rest early in theirs): sequence 0 keeps all
    L=32768 keys, the others L / 32. Each cache format's default path against the balanced
    grid (default KV heads per CTA), with the fraction of the floor of the keys present."""
    reps = dict(warmup=5, rep=20)

    def visit(gname: str, case: Case) -> None:
        case.seq_lens.fill_(case.length // 32)
        case.seq_lens[0] = case.length
        present = float(case.seq_lens.sum()) / (case.batch * case.length)
        cells = []
        for kind in TARGET_RATIOS:
            floor_us = present * case.bytes(kind) / bw * 1e6
            split = bench(lambda k=kind: pf_call(case, k), reps)
            balanced = _balanced_us(case, kind, default_launch(case, kind)[0], reps)
            cells.append(f"{kind} default {split:.1f} ({100 * floor_us / split:.0f}%) / "
                         f"balanced {balanced:.1f} ({100 * floor_us / balanced:.0f}%)")
        print(f"skew {gname} B={case.batch} L={case.length}: {'; '.join(cells)}", flush=True)

    each_case(((8, 32768), (64, 32768)), visit)


OVERHEAD_POINTS = ((1, 8192), (8, 8192), (8, 32768), (64, 8192), (64, 32768))


def sweep_overhead(bw: float) -> None:
    """Where the time goes beyond reading the bytes, per cache format's default path: the op
    with programmatic dependent launch (PDL) and without it, the decode kernel alone (its
    query quantized beforehand, no split combine), and the harness's own floor (a graph of
    one 4-byte fill, timed the same way). Comparing L=8192 with L=32768 at one B separates
    a fixed cost from the streaming rate."""
    reps = dict(warmup=5, rep=20)
    empty = torch.zeros(1, device="cuda")
    print(f"harness floor (one tiny kernel, same timing): {bench(empty.zero_, reps):.1f} us",
          flush=True)
    alone_at = {}  # (geometry, kind, B, L) -> (µs, bytes) of the kernel alone

    def visit(gname: str, case: Case) -> None:
        cells = []
        for kind in TARGET_RATIOS:
            off = bench(lambda k=kind: pf_call(case, k, pdl=False), reps)
            on = bench(lambda k=kind: pf_call(case, k, pdl=True), reps)
            alone = bench(_decode_alone(case, kind), reps)
            alone_at[gname, kind, case.batch, case.length] = alone, case.bytes(kind)
            floor_us = case.bytes(kind) / bw * 1e6
            cells.append(f"{kind} PDL off {off:.1f} / on {on:.1f} / decode alone "
                         f"{alone:.1f} (floor {floor_us:.1f})")
        quantize = bench(lambda: OPS.quantize_int8(case.q), reps)
        print(f"overhead {gname} B={case.batch} L={case.length}: {'; '.join(cells)}; "
              f"quantize alone {quantize:.1f}", flush=True)

    each_case(OVERHEAD_POINTS, visit)
    for gname in GEOMETRIES:
        for kind in TARGET_RATIOS:
            short = alone_at.get((gname, kind, 64, 8192))
            long = alone_at.get((gname, kind, 64, 32768))
            if short and long:
                fixed_us, rate = fixed_and_rate(*short, *long)
                print(f"kernel alone {gname} {kind} B=64: fixed {fixed_us:.1f} us + bytes at "
                      f"{100 * rate / bw:.1f}% of copy bandwidth", flush=True)


def default_launch(case: Case, kind: str) -> tuple[pf_cuda.LaunchConfig, int]:
    """The CUDA C++ decode's (config, splits) for a default call of ``kind`` on ``case``."""
    _, hkv, d = case.geo
    config = cuda_decode.native_config(NATIVE_KIND[kind], d, hkv, case.batch, case.q.device)
    return config, pf_cuda.num_kv_splits(case.batch, hkv, d, case.length,
                                         pf_cuda.sm_count(case.q.device), config)


def _decode_alone(case: Case, kind: str) -> Callable[[], None]:
    """The CUDA C++ decode kernel of a default call, launched plainly, without the query's
    quantization (done here, once) or the split combine."""
    d = case.geo[2]
    config, splits = default_launch(case, kind)
    call = decode_call(case, kind)
    q, q_scale = OPS.quantize_int8(case.q) if call.int8_k else (case.q, None)
    out = torch.empty_like(case.q)
    parts = torch.empty(splits * case.q.numel() // d * (d + 1), device="cuda")
    part_o, part_lse = parts[: splits * case.q.numel()], parts[splits * case.q.numel():]
    return lambda: cuda_native.kernel_into(
        call, out, q, q_scale, splits, config.heads, part_o, part_lse)


def sweep(bw: float, what: str) -> None:
    """GPU-time sweeps: the CUDA C++ decode ("native"), the Triton bf16 and INT8 K tile
    configs ("tiles"), the bf16 split counts of the default path ("splits"), the block table's order
    ("locality"), the default paths at the target points ("targets"), the balanced grid
    ("balanced"; "skew": on one long sequence among short ones), the host cost of
    an eager call ("host") or the fixed costs around the decode kernel ("overhead")."""
    if what.startswith("native"):  # native, or native:KIND[,KIND...] (bench_decode's kinds)
        kinds = what.partition(":")[2]
        sweep_native(bw, tuple(kinds.split(",")) if kinds else tuple(NATIVE_KIND))
        return
    named = {"locality": sweep_locality, "targets": sweep_targets, "balanced": sweep_balanced,
             "skew": sweep_skew, "host": lambda _: host_overhead(), "overhead": sweep_overhead,
             "splitcheck": split_check}
    if what in named:
        named[what](bw)
        return
    reps = dict(warmup=5, rep=20)
    batch, length = 64, 8192  # the point of the KV >= 1 GB targets
    for gname, geo in (GEOMETRIES.items() if what == "tiles" else ()):
        case = Case(geo, batch, length)
        contig_us = min(best_contiguous(case, reps).values())
        print(f"{gname} B={batch} L={length}: contiguous SDPA {contig_us:.1f} us", flush=True)
        for kind, configs, splits in (("bf16", BF16_CONFIGS, (1, 4)),
                                      ("int8_k", INT8_CONFIGS, (1, 2))):
            floor_us = case.bytes(kind) / bw * 1e6
            results = []
            for cfg, n in ((pf_cuda.LaunchConfig(*c), n) for c in configs for n in splits):
                try:
                    us = bench(lambda c=cfg, k=kind, n=n, cs=case: pf_call(
                        cs, k, "triton", config=c, splits=n), reps)
                except Exception as exc:
                    print(f"  {gname} {kind} {cfg}: {type(exc).__name__}")
                    continue
                results.append((us, cfg, n))
            results.sort(key=lambda x: x[0])
            print(f"{gname} B={batch} L={length} {kind} (block_n/warps/stages x splits): "
                  + ", ".join(f"{c.block_n}/{c.num_warps}/{c.num_stages}x{n}: {u:.0f} us "
                              f"({100 * floor_us / u:.0f}%, {u / contig_us:.2f}x contig)"
                              for u, c, n in results[:5]), flush=True)
        del case
    for gname, geo in (GEOMETRIES.items() if what == "splits" else ()):
        for batch, length in ((1, 1536), (1, 8192), (1, 32768), (8, 1536), (8, 8192),
                              (8, 32768), (64, 1536), (64, 8192)):
            case = Case(geo, batch, length)
            floor_us = case.bytes("bf16") / bw * 1e6
            line = []
            for splits in SPLITS:
                us = bench(lambda s=splits, cs=case: pf_call(cs, "bf16", splits=s), reps)
                line.append(f"{splits}:{us:.1f}({100 * floor_us / us:.0f}%)")
            auto = pf_cuda.num_kv_splits(batch, geo[1], geo[2], length, pf_cuda.sm_count(
                torch.device("cuda")), pf_triton.launch_config(False))
            print(f"splits {gname} B={batch} L={length} (auto {auto}): " + " ".join(line),
                  flush=True)
            del case


SPLIT_CHECK = (1, 2, 4)


def split_check(bw: float) -> str:
    """B=64, L=8192, every geometry and cache format: the chosen split count against 1, 2
    and 4 splits, in the same run as the table (the heuristic's fit)."""
    reps = dict(warmup=5, rep=20)
    lines = ["", "Split check (B=64, L=8192; µs of GPU time at 1 / 2 / 4 splits, and the "
             "heuristic's choice):", ""]
    for gname, geo in GEOMETRIES.items():
        case = Case(geo, 64, 8192)
        for kind in ("bf16", "int8_kv", "int8_k"):
            native = default_native(kind, geo[2])
            config = (cuda_decode.native_config(NATIVE_KIND[kind], geo[2], geo[1], 64,
                                                torch.device("cuda"))
                      if native else pf_triton.launch_config(kind != "bf16"))
            auto = pf_cuda.num_kv_splits(64, geo[1], geo[2], 8192,
                                         pf_cuda.sm_count(torch.device("cuda")), config)
            times = {s: bench(lambda s=s, k=kind, cs=case: pf_call(cs, k, splits=s), reps)
                     for s in sorted({*SPLIT_CHECK, auto})}
            floor_us = case.bytes(kind) / bw * 1e6
            lines.append(f"- {gname} {kind}: " + ", ".join(
                f"{s}: {us:.1f} ({100 * floor_us / us:.0f}%)" for s, us in times.items())
                + f"; chosen {auto}")
            print(lines[-1], flush=True)
        del case
        torch.cuda.empty_cache()
    return "\n".join(lines) + "\n"


def host_overhead() -> str:
    """Wall µs per plain call at B=1 (llama3_8b, L=1536; the GPU time is ~14 µs, so the
    host is what is timed), peeled layer by layer: which part of an eager call costs what."""
    from pagedfuse.ops.triton_paged import combine_splits_kernel
    from pagedfuse.ops.validate import check_metadata

    case = Case(GEOMETRIES["llama3_8b"], 1, 1536)
    tail = (*case.block_args, case.scale, False, None, case.length, 1)
    call = decode_call(case, "bf16")
    backend = choose(call)
    out = torch.empty_like(case.q)
    rows, splits, hd = case.q.shape[1], 8, case.q.shape[2]
    parts = torch.zeros(splits * rows * (hd + 1), device="cuda")
    steps = {
        "op call (OpOverloadPacket, grad mode on)":
            lambda: OPS.paged_attention(case.q, case.k, case.v, *tail),
        "op call (.default, under inference_mode)":
            lambda: OPS.paged_attention.default(case.q, case.k, case.v, *tail),
        f"backend run alone ({backend.name})": lambda: backend.run(call, out, None),
        "check_metadata alone": lambda: check_metadata(
            "paged_attention", case.q, case.k, case.v, *case.block_args, case.scale, None),
        "Triton split combine launch alone (in the kernel wrapper's cost: B=1 has splits)":
            lambda: combine_splits_kernel[(rows,)](parts, parts, out, rows, splits,
                                                   SPLITS_PAD=splits, HEAD_DIM=hd, num_warps=2),
    }
    lines = ["", "Host cost of one eager call (llama3_8b B=1 L=1536, wall µs per call, "
             "median of 5 loops of 200 calls):", ""]
    for name, fn in steps.items():
        with torch.inference_mode(name.endswith("inference_mode)")):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            loops = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(200):
                    fn()
                torch.cuda.synchronize()
                loops.append((time.perf_counter() - start) / 200 * 1e6)
        lines.append(f"- {name}: {sorted(loops)[2]:.1f}")
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


SWEEPS = ("native", "tiles", "splits", "splitcheck", "locality", "targets", "balanced", "skew",
          "host", "overhead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", help=f"one of {', '.join(SWEEPS)} (native:KIND,...: some "
                        "cache formats of the native sweep)")
    parser.add_argument("--geos", nargs="+", choices=list(GEOMETRIES),
                        help="only these geometries")
    parser.add_argument("--flush", choices=("zero", "read"), default=timing.FLUSH,
                        help="the L2 flush before each timed replay (see timing.py)")
    parser.add_argument("--layout", choices=("nhd", "hnd"), default=decode_cases.LAYOUT,
                        help="the caches' storage order")
    args = parser.parse_args()
    if args.sweep.partition(":")[0] not in SWEEPS:
        parser.error(f"unknown sweep {args.sweep!r} (one of {', '.join(SWEEPS)})")
    bw = decode_cases.configure(args.layout, args.flush, args.geos)
    start = time.time()
    sweep(bw, args.sweep)
    print(f"sweep {args.sweep}: {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
