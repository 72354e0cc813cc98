"""Paged bf16/INT8 decode on the GPU: pagedfuse's kernels against the peers.

Geometries (Hq, Hkv, D) x batch x context, page 16, random block permutation, bf16, NHD
caches ([blocks, page, Hkv, D]; --layout hnd: [blocks, Hkv, page, D], where FlexAttention's
paged view does not apply). Each row times, side by side in one run: eager gather + SDPA,
the same under torch.compile (inductor), SDPA on already-contiguous K/V (best of cuDNN and
flash: the proxy for the physical limit), FlexAttention paged over the same cache
(flex_paged.py), naive INT8 dequant + SDPA under inductor, and pagedfuse grouped bf16, INT8
K+V and INT8 K + bf16 V, each by the op's default path (the CUDA C++ decode where built)
and by the Triton kernel. Times are medians (triton.testing.do_bench, L2 flushed between
calls by zeroing 256 MB; --flush read: by reading it); B=1 is also timed under CUDA graph
replay. "floor" = bytes that must be read / the copy bandwidth measured in the same run.

    python benchmarks/bench_decode.py --out results.md --plot decode_bandwidth.png
    python benchmarks/bench_decode.py --sweep native   # tuning: native, tiles, splits, locality,
                                                       # targets, balanced, skew, host,
                                                       # overhead
    python benchmarks/bench_decode.py --sweep targets --layout hnd  # the targets, HND caches
    python benchmarks/bench_decode.py --replot benchmarks/RESULTS.md --section "Call 26" \
        --plot decode_bandwidth.png                    # redraw a recorded table, no GPU
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

import pagedfuse.ops  # noqa: F401  (registers torch.ops.pagedfuse.*)
from pagedfuse.ops import cuda_native
from pagedfuse.ops.backends import choose, get_backend, reason
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall
from pagedfuse.ops.validate import build_call

try:  # timing needs Triton and pagedfuse's CUDA kernels; --replot runs without them
    import triton
    import triton.testing

    from pagedfuse.ops import cuda as pf_cuda
    from pagedfuse.ops.backends import cuda_decode
    from pagedfuse.ops.backends import triton as pf_triton
    from pagedfuse.ops.triton_paged import LOG2E
except ImportError:
    triton = pf_cuda = cuda_decode = pf_triton = None

GEOMETRIES = {"qwen35": (24, 4, 256), "tinyllama": (32, 4, 64), "llama3_8b": (32, 8, 128)}
BATCHES = (1, 8, 64)
LENGTHS = (1536, 8192, 32768)
PAGE = 16
LAYOUT = "nhd"  # the caches' storage order for every Case (--layout)
FLUSH = "zero"  # how bench() clears the L2 before each timed replay (--flush)
MEMORY_LIMIT = 60e9
OPS = torch.ops.pagedfuse


def copy_bandwidth(gb: float = 4.0) -> float:
    """Device-to-device copy: bytes read + written per second (the ceiling)."""
    src = torch.randn(int(gb * 1e9 / 4), device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200,
                                 return_mode="median")
    return 2 * gb * 1e9 / (ms * 1e-3)


class Case:
    """One (geometry, B, L) problem on the GPU, all layouts the methods need; the cache's
    blocks are in random order unless ``shuffle`` is False, or with ``window``, random only
    within runs of that many blocks (the runs in random order): as far apart in the address
    space as in order, as scattered within a run as random. The INT8 scales are token-major
    ([blocks, page, Hkv] storage, each token's heads adjacent) unless ``scales_by_head``:
    then a page's scales of one head are adjacent ([blocks, Hkv, page] storage, passed
    transposed). ``hnd`` (default: ``LAYOUT == "hnd"``) stores K/V as [blocks, Hkv, page, D]
    (FlashInfer's order: a page of one head is contiguous), passed as the transposed view,
    with its scales by head."""

    def __init__(self, geo: tuple[int, int, int], batch: int, length: int, page: int = PAGE,
                 shuffle: bool = True, scales_by_head: bool = False, window: int = 0,
                 hnd: bool | None = None):
        hq, hkv, d = geo
        hnd = LAYOUT == "hnd" if hnd is None else hnd
        self.geo, self.batch, self.length = geo, batch, length
        self.scale = 1.0 / math.sqrt(d)
        blocks = batch * length // page
        if window:
            runs = torch.randperm(blocks // window)[:, None] * window
            order = (runs + torch.rand(blocks // window, window).argsort(dim=1)).flatten()
        else:
            order = torch.randperm(blocks) if shuffle else torch.arange(blocks)
        self.table = order.view(batch, -1).to(device="cuda", dtype=torch.int32)
        shape = (blocks, hkv, page, d) if hnd else (blocks, page, hkv, d)
        self.k, self.v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                          for _ in "kv")
        self.q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        self.seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
        self.starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        self.k8, self.ks = OPS.quantize_int8(self.k)
        self.v8, self.vs = OPS.quantize_int8(self.v)
        if hnd:  # quantized in storage order, every tensor passed as its [blocks, page] view
            self.k, self.v, self.k8, self.v8, self.ks, self.vs = (
                x.transpose(1, 2) for x in (self.k, self.v, self.k8, self.v8, self.ks, self.vs))
        elif scales_by_head:
            self.ks, self.vs = (s.transpose(1, 2).contiguous().transpose(1, 2)
                                for s in (self.ks, self.vs))
        # [B, Hkv, L, D] contiguous: what a non-paged cache would hold
        self.k_contig = _gather(self.k, self.table).contiguous()
        self.v_contig = _gather(self.v, self.table).contiguous()

    def bytes(self, kind: str) -> int:
        """K/V (and scale) bytes that must be read: the floor's numerator."""
        hq, hkv, d = self.geo
        tokens = self.batch * self.length * hkv
        per_token = {"bf16": 4 * d, "int8_kv": 2 * d + 8, "int8_k": d + 4 + 2 * d}[kind]
        return tokens * per_token

    def methods(self, compiled: dict[str, Callable]) -> dict[str, tuple[str, Callable]]:
        """name -> (floor kind, zero-argument callable)."""
        tail = (*self.block_args, self.scale, False, None, self.length, 1)
        flex = {} if compiled.get("flex") is None else {
            "FlexAttention paged": ("bf16", _set_up_on_first_call(
                lambda: _flex_paged(self, compiled["flex"])))}
        return {
            **flex,
            "eager gather+SDPA": ("bf16", lambda: gather_sdpa(self.q, self.k, self.v,
                                                              self.table, self.scale)),
            "inductor gather+SDPA": ("bf16", lambda: compiled["gather"](
                self.q, self.k, self.v, self.table, self.scale)),
            "naive INT8 inductor": ("int8_kv", lambda: compiled["int8"](
                self.q, self.k8, self.ks, self.v8, self.vs, self.table, self.scale)),
            "pagedfuse bf16": ("bf16", lambda: OPS.paged_attention(
                self.q, self.k, self.v, *tail)),
            "pagedfuse bf16 Triton": ("bf16", lambda: _pf_call(self, "bf16", "triton")),
            "pagedfuse INT8 K+V": ("int8_kv", lambda: OPS.paged_attention_int8(
                self.q, self.k8, self.v8, self.ks, self.vs, *tail)),
            "pagedfuse INT8 K+V Triton": ("int8_kv", lambda: _pf_call(self, "int8_kv",
                                                                      "triton")),
            "pagedfuse INT8 K": ("int8_k", lambda: OPS.paged_attention_int8(
                self.q, self.k8, self.v, self.ks, None, *tail)),
            "pagedfuse INT8 K Triton": ("int8_k", lambda: _pf_call(self, "int8_k",
                                                                   "triton")),
        }

    @property
    def block_args(self):
        return self.table, self.seq_lens, self.starts

    def caches(self, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                          torch.Tensor | None]:
        """(key, value, key scales, value scales) of one cache format (None: no scales)."""
        k, ks = (self.k, None) if kind == "bf16" else (self.k8, self.ks)
        v, vs = (self.v8, self.vs) if kind == "int8_kv" else (self.v, None)
        return k, v, ks, vs


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[nb, bs, H, D] cache through [B, n] table -> [B, H, n*bs, D] (a view after the copy)."""
    return cache[table].flatten(1, 2).transpose(1, 2)


def gather_sdpa(q, k_cache, v_cache, table, scale):
    """What a user writes: gather the pages, then SDPA with GQA."""
    k, v = _gather(k_cache, table), _gather(v_cache, table)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)


def int8_sdpa(q, k8, ks, v8, vs, table, scale):
    """Naive INT8: dequantize the gathered pages to bf16, then SDPA."""
    k = (k8[table].to(q.dtype) * ks[table][..., None].to(q.dtype)).flatten(1, 2).transpose(1, 2)
    v = (v8[table].to(q.dtype) * vs[table][..., None].to(q.dtype)).flatten(1, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)


def contiguous_sdpa(q4, k, v, scale, backends=(SDPBackend.CUDNN_ATTENTION,
                                               SDPBackend.FLASH_ATTENTION)):
    with sdpa_kernel(list(backends)):
        return F.scaled_dot_product_attention(q4, k, v, scale=scale)


def best_contiguous(case: Case, reps: dict) -> dict[str, float]:
    """Median µs of cuDNN and of flash on contiguous K/V (those that run)."""
    hq, hkv, d = case.geo
    q4 = case.q.view(case.batch, hkv, hq // hkv, d)
    times = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        fn = lambda b=backend: contiguous_sdpa(q4, case.k_contig, case.v_contig, case.scale,
                                               (b,))
        try:
            times[backend.name.lower().replace("_attention", "")] = bench(fn, reps)
        except RuntimeError:
            continue
    return times


def contiguous_out(case: Case) -> torch.Tensor:
    """The case's attention by SDPA on the contiguous K/V: the reference for the errors."""
    hq, hkv, d = case.geo
    return contiguous_sdpa(case.q.view(case.batch, hkv, hq // hkv, d), case.k_contig,
                           case.v_contig, case.scale).reshape(case.q.shape)


@functools.cache
def _capture_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()


def captured(fn: Callable) -> torch.cuda.CUDAGraph:
    """One call of ``fn`` in a CUDA graph, after two warm-up calls (compiles, autotuning) on
    the stream it is captured on, as a server warms up before capturing: state a kernel
    keeps per stream (the balanced grid's counts) then exists before the capture."""
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, flush: Callable[[], object]) -> float:
    """µs from an event before to an event after one replay of ``graph``, ``flush`` run
    first (median_replay_us: bench's read flush, and the scripts that time replays by
    hand)."""
    flush()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


@functools.cache
def flush_buffer() -> torch.Tensor:
    """256 MB to zero or read between timed calls, as do_bench's L2 flush does."""
    return torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")


def median_replay_us(graph: torch.cuda.CUDAGraph, flush: Callable[[], object],
                     count: int) -> float:
    """Median µs of ``count`` replays of ``graph`` (replay_us), ``flush`` run before each."""
    return statistics.median(replay_us(graph, flush) for _ in range(count))


def bench(fn: Callable, reps: dict) -> float:
    """Median µs of GPU time: one call captured in a CUDA graph and replayed with the L2
    flushed before each replay, so the Python host overhead of the call is left out.

    FLUSH "zero" is do_bench's flush: zeroing 256 MB, which leaves the L2 full of dirty lines
    that the timed call's reads must write back. FLUSH "read" reads 256 MB instead, leaving
    clean lines, as a decode step's weight GEMMs do before attention."""
    graph = captured(fn)
    if FLUSH == "zero":
        us = 1e3 * triton.testing.do_bench(graph.replay, return_mode="median", **reps)
    else:
        flush = functools.partial(torch.amax, flush_buffer())
        for _ in range(3):
            once = replay_us(graph, flush)
        us = median_replay_us(graph, flush, max(10, int(reps["rep"] * 1e3 / once)))
    del graph
    return us


def bench_eager(fn: Callable, reps: dict) -> float:
    """Median µs of plain calls: includes the host overhead where it exceeds the GPU time."""
    return 1e3 * triton.testing.do_bench(fn, return_mode="median", **reps)


def _reps(case: Case) -> dict:
    big = case.bytes("bf16") > 2e9
    return dict(warmup=5, rep=25) if big else dict(warmup=10, rep=60)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().flatten(), ref.float().flatten()
    return float((out - ref).norm() / ref.norm())


def run_case(case: Case, compiled: dict, bw: float) -> dict:
    """Times (µs), floor fractions and errors of every method on one case."""
    reps = _reps(case)
    row = {"geo": case.geo, "B": case.batch, "L": case.length,
           "kv_gb": case.bytes("bf16") / 1e9, "us": {}, "floor": {}, "err": {}}
    ref = contiguous_out(case)
    methods = case.methods(compiled)
    for name, (kind, fn) in methods.items():
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
    row["pf_eager_us"] = bench_eager(methods["pagedfuse bf16"][1], reps)
    return row


def _reason(exc: Exception) -> str:
    """The exception's type and first line (an InductorError's first line is its cause), and
    its last line where the first only leads in to a subprocess's traceback."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.startswith("Set TORCHDYNAMO_VERBOSE")]
    why = " ... ".join(lines[:1] + lines[-1:]) if lines[:1] and lines[0].endswith(":") \
        else "".join(lines[:1])
    return f"{type(exc).__name__}: {why[:300]}".replace("|", "/")


def _fits(geo, batch, length) -> bool:
    hq, hkv, d = geo
    kv = 4 * batch * length * hkv * d
    return 4.5 * kv < MEMORY_LIMIT  # cache, int8 copy, contiguous copy, eager temporaries


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
NATIVE_KIND = {"bf16": "half", "int8_kv": "int8_kv", "int8_k": "int8_k"}  # cuda_native's


def _fmt(row: dict, name: str) -> str:
    us = row["us"].get(name)
    if us is None:
        return "n/a"
    backend = f" {row['contig_backend']}" if name == "contiguous SDPA" else ""
    return f"{us:.1f} ({100 * row['floor'][name]:.0f}%){backend}"


def geometry_name(geo: tuple[int, int, int]) -> str:
    return next(k for k, v in GEOMETRIES.items() if v == geo)


def _case_name(row: dict) -> str:
    return f"{geometry_name(row['geo'])} B={row['B']} L={row['L']}"


def _ratio(row: dict, name: str) -> str:
    us = row["us"].get(name)
    return f"{us / row['us']['contiguous SDPA']:.2f}" if us else "n/a"


def _err(row: dict, name: str) -> str:
    err = row["err"].get(name)
    return f"{err:.1e}" if isinstance(err, float) else "n/a"


def markdown(rows: list[dict], bw: float, command: str, seconds: float) -> str:
    """The dated table for RESULTS.md, with each target's measured verdict."""
    gpu = torch.cuda.get_device_name()
    lines = [
        f"\n## GPU decode ({datetime.date.today().isoformat()}, {gpu}, torch "
        f"{torch.__version__}, Triton {triton.__version__}, Python {platform.python_version()})",
        "",
        f"Command: `{command}` ({seconds:.0f} s). Copy bandwidth (read + write) measured in "
        f"the same run: {bw / 1e12:.2f} TB/s. Cells: median µs of GPU time (one call "
        "captured in a CUDA graph, replayed with the L2 flushed before each replay) and the "
        "fraction of the K/V byte floor of that method's cache format (bf16; INT8 K+V with "
        "scales; INT8 K + bf16 V); for contiguous SDPA the faster backend is named. "
        "pf bf16, pf i8 K+V and pf i8 K are the ops' default paths (bf16: "
        f"{_native_path('bf16')}; INT8 K+V: {_native_path('int8_kv')}; INT8 K: "
        f"{_native_path('int8_k')}); the Triton columns force the Triton kernel. Page 16, "
        "random block permutation, bf16 queries, q_len 1. flex: FlexAttention through "
        "torch's experimental PagedAttention over the same cache, under torch.compile "
        "(flex_paged.py).",
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
        lines.append(f"- {geometry_name(r['geo'])} B=1 L={r['L']}: pagedfuse "
                     f"{r['us']['pagedfuse bf16']:.1f}{vs}; eager op call {r['pf_eager_us']:.1f}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], bw: float, path: str, device: str | None = None) -> None:
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
    fig.suptitle(f"Paged decode on {device or torch.cuda.get_device_name()} "
                 f"(dashed: copy bandwidth {bw / 1e12:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rows_from_markdown(text: str) -> list[dict]:
    """The rows of the first decode table in ``text`` (as markdown() wrote it, any version of
    its columns), with what plot() reads: each method's µs and printed floor fraction."""
    names = dict(zip(SHORT, METHOD_ORDER, strict=True))
    columns, rows = None, []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:3] == ["geometry", "B", "L"]:
            columns = cells
        elif columns and cells[0] in GEOMETRIES:
            row = {"geo": GEOMETRIES[cells[0]], "B": int(cells[1]), "L": int(cells[2]),
                   "us": {}, "floor": {}}
            for short, cell in zip(columns, cells, strict=True):
                found = re.match(r"([\d.]+) \((\d+)%\)", cell)
                if short in names and found:
                    row["us"][names[short]] = float(found[1])
                    row["floor"][names[short]] = int(found[2]) / 100
            rows.append(row)
        elif rows:
            break
    return rows


def replot(path: str, section: str, out: str) -> list[dict]:
    """Redraws the plot of the first decode table after the first line of ``path`` that
    contains ``section``, with the bandwidth and the GPU that section recorded; returns the
    rows drawn."""
    lines = open(path).read().splitlines()
    start = next((i for i, line in enumerate(lines) if section in line), None)
    if start is None:
        raise ValueError(f"no line of {path} contains {section!r}")
    text = "\n".join(lines[start:])
    bw = float(re.search(r"measured in the same run: ([\d.]+) TB/s", text)[1]) * 1e12
    heading = next((line for line in reversed(lines[:start + 1]) if line.startswith("## ")),
                   "")
    device = re.search(r"\(\d{4}-\d\d-\d\d[^,]*, ([^,]+),", heading)
    rows = rows_from_markdown(text)
    plot(rows, bw, out, device[1] if device else "GPU")
    return rows


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
            triton_us = bench(lambda k=kind: _pf_call(case, k, "triton"), reps)
            default = cuda_decode.native_config(native, d, hkv, batch, device)
            auto = pf_cuda.num_kv_splits(batch, hkv, d, length, pf_cuda.sm_count(device),
                                         default)
            line = []
            for heads in (h for h in cuda_native.HEADS_PER_CTA if hkv % h == 0):
                config = cuda_decode.native_config(native, d, hkv, batch, device, heads)
                for n in ((2, 4, 6, 8, 12, 16) if batch == 8 else (1, 2, 3, 4)):
                    us = bench(lambda n=n, c=config, k=kind: _pf_call(
                        case, k, "cuda_decode", config=c, splits=n), reps)
                    line.append(f"{heads}/{n}: {us:.1f} ({100 * floor_us / us:.0f}%)")
            print(f"{kind} {gname} B={batch} L={length}: Triton {triton_us:.1f} "
                  f"({100 * floor_us / triton_us:.0f}%); CUDA C++ by heads per CTA/splits "
                  + ", ".join(line) + f"; default {default.heads}/{auto}; "
                  f"contiguous bf16 SDPA {contig_us:.1f}", flush=True)

    _each_case(((8, 8192), (8, 32768), (64, 8192), (64, 32768)), visit)


def _each_case(points: tuple[tuple[int, int], ...],
               visit: Callable[[str, Case], None]) -> None:
    """visit(geometry name, case) for each geometry at each (B, L) of ``points`` that fits
    in memory; a case is freed before the next one is built."""
    for gname, geo in GEOMETRIES.items():
        for batch, length in points:
            if _fits(geo, batch, length):
                visit(gname, Case(geo, batch, length))
                torch.cuda.empty_cache()


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
        worst = max(worst, rel_err(_pf_call(case, kind), ref))
        us = bench(lambda k=kind: _pf_call(case, k), reps)
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
    _each_case(TARGET_POINTS + (FLOOR_TARGET[:2],), lambda gname, case: print_default_paths(
        f"targets {gname} B={case.batch} L={case.length}", case, bw,
        min(best_contiguous(case, reps).values()), reps))


def _balanced_us(case: Case, kind: str, config: pf_cuda.LaunchConfig, reps: dict) -> float:
    """bench() of the CUDA C++ decode's balanced grid with ``config``'s heads per CTA."""
    return bench(lambda: _pf_call(case, kind, "cuda_decode", config=config,
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
            us = bench(lambda k=kind: _pf_call(case, k), reps)
            cells = [f"default {us:.1f} ({us / contig_us:.3f}x)"]
            for heads in (h for h in cuda_native.HEADS_PER_CTA if hkv % h == 0):
                config = cuda_decode.native_config(NATIVE_KIND[kind], d, hkv, batch, device,
                                                   heads)
                us = _balanced_us(case, kind, config, reps)
                cells.append(f"balanced/{heads} {us:.1f} ({us / contig_us:.3f}x)")
            print(f"balanced {gname} B={batch} L={case.length} {kind}: {', '.join(cells)}; "
                  f"contiguous SDPA {contig_us:.1f}", flush=True)

    _each_case(TARGET_POINTS + ((8, 8192), (64, 1536)), visit)


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
            split = bench(lambda k=kind: _pf_call(case, k), reps)
            balanced = _balanced_us(case, kind, default_launch(case, kind)[0], reps)
            cells.append(f"{kind} default {split:.1f} ({100 * floor_us / split:.0f}%) / "
                         f"balanced {balanced:.1f} ({100 * floor_us / balanced:.0f}%)")
        print(f"skew {gname} B={case.batch} L={case.length}: {'; '.join(cells)}", flush=True)

    _each_case(((8, 32768), (64, 32768)), visit)


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
            off = bench(lambda k=kind: _pf_call(case, k, pdl=False), reps)
            on = bench(lambda k=kind: _pf_call(case, k, pdl=True), reps)
            alone = bench(_decode_alone(case, kind), reps)
            alone_at[gname, kind, case.batch, case.length] = alone, case.bytes(kind)
            floor_us = case.bytes(kind) / bw * 1e6
            cells.append(f"{kind} PDL off {off:.1f} / on {on:.1f} / decode alone "
                         f"{alone:.1f} (floor {floor_us:.1f})")
        quantize = bench(lambda: OPS.quantize_int8(case.q), reps)
        print(f"overhead {gname} B={case.batch} L={case.length}: {'; '.join(cells)}; "
              f"quantize alone {quantize:.1f}", flush=True)

    _each_case(OVERHEAD_POINTS, visit)
    for gname in GEOMETRIES:
        for kind in TARGET_RATIOS:
            short = alone_at.get((gname, kind, 64, 8192))
            long = alone_at.get((gname, kind, 64, 32768))
            if short and long:
                fixed_us, rate = fixed_and_rate(*short, *long)
                print(f"kernel alone {gname} {kind} B=64: fixed {fixed_us:.1f} us + bytes at "
                      f"{100 * rate / bw:.1f}% of copy bandwidth", flush=True)


def fixed_and_rate(short_us: float, short_bytes: int, long_us: float,
                   long_bytes: int) -> tuple[float, float]:
    """(fixed µs, bytes per second) of time = fixed + bytes / rate through two timings."""
    rate = (long_bytes - short_bytes) / ((long_us - short_us) * 1e-6)
    return short_us - short_bytes / rate * 1e6, rate


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
    call = _call(case, kind)
    q, q_scale = OPS.quantize_int8(case.q) if call.int8_k else (case.q, None)
    out = torch.empty_like(case.q)
    parts = torch.empty(splits * case.q.numel() // d * (d + 1), device="cuda")
    part_o, part_lse = parts[: splits * case.q.numel()], parts[splits * case.q.numel():]
    return lambda: cuda_native.decode_into(
        call, out, q, q_scale, case.scale * LOG2E, splits, config.heads, part_o, part_lse)


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
             "skew": sweep_skew, "host": lambda _: host_overhead(), "overhead": sweep_overhead}
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
                    us = bench(lambda c=cfg, k=kind, n=n, cs=case: _pf_call(
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
                us = bench(lambda s=splits, cs=case: _pf_call(cs, "bf16", splits=s), reps)
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
            native = _default_native(kind, geo[2])
            config = (cuda_decode.native_config(NATIVE_KIND[kind], geo[2], geo[1], 64,
                                                torch.device("cuda"))
                      if native else pf_triton.launch_config(kind != "bf16"))
            auto = pf_cuda.num_kv_splits(64, geo[1], geo[2], 8192,
                                         pf_cuda.sm_count(torch.device("cuda")), config)
            times = {s: bench(lambda s=s, k=kind, cs=case: _pf_call(cs, k, splits=s), reps)
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
    call = _call(case, "bf16")
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


def _call(case: Case, kind: str) -> PagedCall:
    """The validated decode call of ``case`` over its ``kind`` caches (hints: the length and
    one query token, as the rewrite passes them)."""
    k, v, ks, vs = case.caches(kind)
    return build_call(FLOAT_OP if ks is None else INT8_OP, case.q, k, v, ks, vs,
                      *case.block_args, case.scale, False, None, case.length, 1)


def _pf_call(case: Case, kind: str, backend: str | None = None, config=None, splits=None,
             pdl: bool | None = None) -> torch.Tensor:
    """One decode of ``kind`` on ``case`` by ``backend`` (default: the op's choice), with its
    plan's ``config`` / ``splits`` / programmatic dependent launch pinned where given."""
    call = _call(case, kind)
    chosen = choose(call) if backend is None else get_backend(backend)
    why = reason(chosen, call)
    if why is not None:
        raise ValueError(f"{chosen.name} cannot run this call: {why}")
    plan = None
    if (config, splits, pdl) != (None, None, None):
        plan = chosen.make_plan(call, config, splits)
        if pdl is not None:
            plan = plan._replace(pdl=pdl and pf_cuda.pdl_capable(case.q.device))
    out = torch.empty_like(case.q)
    chosen.run(call, out, plan)
    return out


def _native_reason(kind: str) -> str | None:
    """Why a q_len 1 call of this cache format cannot take the CUDA C++ decode here (None:
    it can; llama3_8b shapes)."""
    q = torch.empty(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(1, 16, 8, 128, device="cuda",
                    dtype=torch.bfloat16 if kind == "bf16" else torch.int8)
    v = k if kind != "int8_k" else q.new_empty(k.shape)
    scale = None if kind == "bf16" else torch.empty(1, 16, 8, device="cuda")
    lens = torch.ones(1, device="cuda", dtype=torch.int32)
    starts = torch.arange(2, device="cuda", dtype=torch.int32)
    call = build_call(FLOAT_OP if scale is None else INT8_OP, q, k, v, scale,
                      scale if kind == "int8_kv" else None, lens[:, None], lens, starts,
                      0.1, False, None, 1, 1)
    return reason(get_backend("cuda_decode"), call)


def _default_native(kind: str, head_dim: int) -> bool:
    """Whether the op's default path for this format and head_dim is the CUDA C++ decode."""
    return _native_reason(kind) is None and head_dim in cuda_decode.HEAD_DIMS


def _native_path(kind: str) -> str:
    """Which kernel the op runs here by default for a q_len 1 call, per head_dim."""
    reason = _native_reason(kind)
    if reason is not None:
        return f"Triton ({reason})"
    native = sorted(cuda_decode.HEAD_DIMS)
    others = sorted({g[2] for g in GEOMETRIES.values()} - set(native))
    return f"CUDA C++ at head_dim {', '.join(map(str, native))}" + (
        f", Triton at {', '.join(map(str, others))}" if others else "")


def main() -> None:
    global LAYOUT, FLUSH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown section here")
    parser.add_argument("--plot", help="write the bandwidth plot here")
    parser.add_argument("--sweep", help="a tuning sweep instead of the table: native (or "
                        "native:bf16,int8_k,... for some cache formats), tiles, splits, "
                        "locality, targets, balanced, skew, host or overhead")
    parser.add_argument("--quick", action="store_true", help="B in (1, 8), L=1536 only")
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                        help="the table's batch sizes (the split check and host cost run "
                        "only for the full grid)")
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS,
                        help="the table's context lengths")
    parser.add_argument("--geos", nargs="+", choices=list(GEOMETRIES),
                        help="only these geometries, in the table or a sweep")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--flush", choices=("zero", "read"), default=FLUSH,
                        help="clear the L2 before each timed replay by zeroing 256 MB "
                        "(do_bench's; dirty lines) or by reading 256 MB (clean lines, as "
                        "after a decode step's weight GEMMs)")
    parser.add_argument("--layout", choices=("nhd", "hnd"), default=LAYOUT,
                        help="the caches' storage order: [blocks, page, Hkv, D] (NHD, vLLM's "
                        "flash layout) or [blocks, Hkv, page, D] (HND, FlashInfer's)")
    parser.add_argument("--replot", metavar="MARKDOWN", help="redraw --plot from a table "
                        "this script wrote, in MARKDOWN after --section; needs no GPU")
    parser.add_argument("--section", default="## GPU decode",
                        help="text of a line before the table --replot draws")
    args = parser.parse_args()
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot")
        replot(args.replot, args.section, args.plot)
        return
    LAYOUT, FLUSH = args.layout, args.flush
    for name in set(GEOMETRIES) - set(args.geos or GEOMETRIES):
        del GEOMETRIES[name]
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if args.sweep:
        sweep(bw, args.sweep)
        return
    from tqdm import tqdm

    start = time.time()
    full = (not args.quick and not args.geos and (*args.batches,) == BATCHES
            and (*args.lengths,) == LENGTHS)
    try:  # short, so before the table; a failure here must not cost the table
        extra = split_check(bw) + host_overhead() if full else ""
    except Exception as exc:
        extra = f"\nSplit check / host cost failed: {exc!r}\n"
        print(extra, flush=True)
    compiled = compile_peers(flex=not args.no_flex)
    batches, lengths = ((1, 8), (1536,)) if args.quick else (args.batches, args.lengths)
    combos = [(g, b, n) for g in GEOMETRIES.values() for b in batches for n in lengths
              if _fits(g, b, n)]
    rows = []
    for geo, batch, length in tqdm(combos, desc="decode bench", mininterval=5):
        case = Case(geo, batch, length)
        rows.append(run_case(case, compiled, bw))
        del case
        torch.cuda.empty_cache()
        r = rows[-1]
        print(f"{geo} B={batch} L={length}: " + ", ".join(
            f"{s} {_fmt(r, m)}" for s, m in zip(SHORT, METHOD_ORDER, strict=True)), flush=True)
        section = markdown(rows, bw, " ".join(["python benchmarks/bench_decode.py",
                                               *sys.argv[1:]]), time.time() - start) + extra
        if args.out:  # rewritten after every case: a cut-short run keeps what it measured
            with open(args.out, "w") as f:
                f.write(section)
    print(section)
    if args.plot:
        plot(rows, bw, args.plot)


if __name__ == "__main__":
    main()
