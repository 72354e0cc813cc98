"""Paged prefill and chunked prefill on the GPU: the prefill kernels against the peers.

Cases (batch, seq_len, q_len) on the three preset geometries, page 16, NHD caches with the
blocks in random order, bf16, bottom-right causal (each sequence's q_len queries are its
last tokens). Side by side in one run: SDPA on contiguous K/V with GQA pre-expanded
(cuDNN, flash, efficient; ``is_causal`` for full prefill, lower-right for chunks),
FlexAttention compiled with a lower-right causal block mask (contiguous K/V, GQA), where
installed cuDNN's paged SDPA on the same pages (backend ``cudnn_prefill``) and SageAttention
(int8 Q·K^T on contiguous K/V, where it runs), the eager gather + SDPA code users write,
today's pagedfuse op (bf16 and INT8 K+V), and the prefill kernels (triton_prefill.py):
bf16, INT8 K (bf16 V), INT8 K+V (V dequantized in registers, P·V in bf16) and INT8 K+V
with int8 P, and the Gluon kernels (gluon_prefill.py: "ws", warp-specialized with TMA, on
bf16, INT8 K and INT8 K+V caches, "cp", cp.async, on INT8 K;
a case the backend declines records its reason as the entry's error). Times are GPU time:
medians of triton.testing.do_bench over replays of the call captured in a CUDA graph
(timing.py, as the decode benchmarks time; do_bench's L2 clear between replays), or over
plain calls for an entry that cannot be captured (its row's "captured" is false).
TFLOP/s counts causal pairs only (4 * D * Hq per pair); for INT8 entries it is TOP/s of the
same count. Errors are ||out - ref|| / ||ref|| against fp32 attention on the unquantized
K/V; for INT8 entries "deq err" is the error of fp32 dequantize-then-attend on the same INT8
cache (the quantization's own share). Beside the cases (unless --no-mixed): the mixed
batch (MIXED: decode rows and prompt chunks in one call, against its parts alone) and the
packed batch under a mask (PACKED_BIAS: transformers' continuous batching at a prefill
step, the mask as attn_bias against the same keys called causal and against the gather +
SDPA it replaces).

    python benchmarks/bench_prefill.py --json out.json --plot prefill.png
    python benchmarks/bench_prefill.py --sweep --json sweep.json   # time candidate plans
    python benchmarks/bench_prefill.py --gluon-sweep --json tiles.json  # the Gluon "ws" tiles
    python benchmarks/bench_prefill.py --gluon-ab sum_mma stages=3 --json ab.json  # switches
    python benchmarks/bench_prefill.py --replot out.json --plot prefill.png   # no GPU
    python benchmarks/bench_prefill.py --no-flex --no-mixed --methods "prefill INT8 K" \
        "gluon INT8 K ws" "gluon INT8 K cp"   # only these entries
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import timing  # noqa: E402
from helpers.prefill import paged_call  # noqa: E402

import pagedfuse.ops  # noqa: E402,F401  (registers torch.ops.pagedfuse.*)

GEOMETRIES = {"qwen35": (24, 4, 256), "llama3_8b": (32, 8, 128), "tinyllama": (32, 4, 64)}
CASES = ((1, 8192, 8192), (1, 16384, 2048), (4, 8192, 512), (8, 2048, 2048), (16, 4096, 64),
         (64, 8192, 4))
SWEEP_CASES = ((1, 8192, 8192), (1, 16384, 2048))
GLUON_SWEEP_CASES = ((1, 8192, 8192), (8, 2048, 2048))  # long tiles, and short ones
PROMPT_CASES = ((1, 8192, 8192), (1, 16384, 2048), (8, 2048, 2048))  # prompts and 2K chunks
AB_ROUNDS = 3  # --gluon-ab: each variant timed this many times, in turns
REPS = {"warmup": 25, "rep": 100}  # do_bench's ms of warm-up and of timed replays per entry
SHORT_Q = 8  # speculative decoding's q_len 2-8: the short-query sweep and the unhinted op
SHORT_CASE = (64, 8192, 4)
# the mixed batch: decode rows and prompt chunks in one call, over histories of HISTORY keys
MIXED = {"decode_rows": 60, "chunks": 2, "chunk": 512, "history": 8192}
# transformers' continuous batching at a prefill step: (query tokens, keys read, keys that
# exist), every request packed into one sequence read through a per-token index (page 1)
# under an additive mask (0 / finfo.min, causal; keys past the last existing one padding)
PACKED_BIAS = ((4096, 4096, 4096), (4096, 4608, 4096), (2048, 8192, 6144))
PAGE = 16  # tokens per page (--page: the cost of the page gather, against larger pages)
KINDS = ("bf16", "int8_k", "int8_kv")
DEVICE = "cuda"  # the Triton interpreter's dry run of this script sets "cpu"
OPS = torch.ops.pagedfuse
KERNELS = {  # name -> (cache kind, P·V mode)
    "prefill bf16": ("bf16", "half"),
    "prefill INT8 K": ("int8_k", "half"),
    "prefill INT8 K+V": ("int8_kv", "half"),
}
GLUON = {  # name -> (cache kind, GluonPlan.pipeline)
    "gluon bf16 ws": ("bf16", "ws"),
    "gluon INT8 K ws": ("int8_k", "ws"),
    "gluon INT8 K+V ws": ("int8_kv", "ws"),
    "gluon INT8 K cp": ("int8_k", "cp"),
}
# --pv-int8 adds this: on the H200 1.4-3.3x slower than "half" with 1.3-1.7x its error
# (benchmarks/results/prefill_h200_2026-12-01_pv_int8.json), since int8 wgmma needs V
# K-major and the cache's V rows are not
PV_INT8_ENTRY = ("prefill INT8 K+V int8 P", ("int8_kv", "int8"))


class Case:
    """One (geometry, batch, seq_len, q_len) problem on the GPU in every layout the methods
    need. ``light``: the paged tensors only (for compiling the kernels elsewhere)."""

    def __init__(self, geo: tuple[int, int, int], batch: int, seq_len: int, q_len: int,
                 light: bool = False):
        hq, hkv, d = geo
        self.geo, self.batch, self.seq_len, self.q_len = geo, batch, seq_len, q_len
        self.scale = 1.0 / math.sqrt(d)
        blocks = batch * seq_len // PAGE
        dev = DEVICE
        self.table = torch.randperm(blocks, device=dev).view(batch, -1).to(torch.int32)
        self.kc, self.vc = (torch.randn(blocks, PAGE, hkv, d, device=dev,
                                        dtype=torch.bfloat16) for _ in "kv")
        self.q = torch.randn(batch * q_len, hq, d, device=dev, dtype=torch.bfloat16)
        self.seq_lens = torch.full((batch,), seq_len, device=dev, dtype=torch.int32)
        self.starts = torch.arange(batch + 1, device=dev, dtype=torch.int32) * q_len
        self.k8, self.ks = OPS.quantize_int8(self.kc)
        self.v8, self.vs = OPS.quantize_int8(self.vc)
        if light:
            return
        group = hq // hkv
        self.q4 = self.q.view(batch, q_len, hq, d).transpose(1, 2).contiguous()
        self.k_c, self.v_c = (gather(c, self.table).contiguous() for c in (self.kc, self.vc))
        self.k_x, self.v_x = (x.repeat_interleave(group, dim=1) for x in (self.k_c, self.v_c))

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.seq_len} q{self.q_len}"

    def flops(self) -> float:
        """4 * D * Hq per (query, visible key) pair, bottom-right causal."""
        hq, _, d = self.geo
        n, length = self.q_len, self.seq_len
        pairs = self.batch * (n * (length - n) + n * (n + 1) / 2)
        return 4.0 * d * hq * pairs

    def kv_bytes(self, kind: str) -> int:
        """K/V (and scale) bytes one pass reads: the floor of a memory-bound case (q_len 4)."""
        _, hkv, d = self.geo
        per_token = {"bf16": 4 * d, "int8_kv": 2 * d + 8, "int8_k": 3 * d + 4}[kind]
        return self.batch * self.seq_len * hkv * per_token

    def call(self, kind: str):
        """The PagedCall of this case with ``kind``'s caches."""
        k, v, ks, vs = {"bf16": (self.kc, self.vc, None, None),
                        "int8_k": (self.k8, self.vc, self.ks, None),
                        "int8_kv": (self.k8, self.v8, self.ks, self.vs)}[kind]
        return paged_call(self.q, k, v, self.table, self.seq_lens, self.starts, self.scale,
                          True, key_scale=ks, value_scale=vs, max_seq_len=self.seq_len,
                          max_query_len=self.q_len)

    def tokens(self, out4: torch.Tensor) -> torch.Tensor:
        """[B, Hq, q, D] -> [B * q, Hq, D]."""
        return out4.transpose(1, 2).reshape(self.q.shape)


def gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[nb, bs, H, D] through [B, n] -> [B, H, n * bs, D] (a view of the gathered copy)."""
    return cache[table].flatten(1, 2).transpose(1, 2)


def lower_right_mask(q_len: int, seq_len: int, device) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query i (the (seq_len - q_len + i)-th key) sees."""
    rows = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
    return torch.arange(seq_len, device=device)[None, :] <= rows


def fp32_attention(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   chunk: int = 2048) -> torch.Tensor:
    """Lower-right causal attention in fp32 (no TF32), [B, Hq, q, D] with K/V [B, Hkv, L, D];
    query rows in chunks so the score matrix stays a few GB."""
    b, hq, n, d = q4.shape
    hkv, length = k.shape[1], k.shape[2]
    group = hq // hkv
    out = torch.empty(b, hq, n, d, device=q4.device, dtype=torch.float32)
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for i in range(b):
            for h in range(hkv):
                kf, vf = k[i, h].float(), v[i, h].float()
                for r in range(0, n, chunk):
                    qf = q4[i, h * group:(h + 1) * group, r:r + chunk].float()
                    s = qf @ kf.T * scale
                    rows = torch.arange(r, min(r + chunk, n), device=q4.device)[:, None]
                    s.masked_fill_(torch.arange(length, device=q4.device)[None, :] >
                                   rows + (length - n), float("-inf"))
                    out[i, h * group:(h + 1) * group, r:r + chunk] = torch.softmax(s, -1) @ vf
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    return out


def sdpa_contiguous(case: Case, backend: str) -> torch.Tensor:
    """SDPA on contiguous, GQA-expanded K/V; bottom-right causal for chunks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, s = case.q4, case.k_x, case.v_x, case.scale
    full = case.q_len == case.seq_len
    if backend == "flash" and not full:  # aten's flash op: is_causal means lower-right
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True,
                                                                  scale=s)[0]
    if backend == "efficient" and not full:  # custom_mask_type 2: lower-right causal
        return torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, None,
            None, 0.0, 2, False, scale=s)[0].transpose(1, 2)
    which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    with sdpa_kernel([which]):
        if full:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=lower_right_mask(case.q_len, case.seq_len, q.device), scale=s)


def gather_sdpa(case: Case) -> torch.Tensor:
    """What a user writes: gather the pages, repeat K/V for GQA, SDPA with a causal mask."""
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv, d = case.geo
    b, n, length = case.batch, case.q_len, case.seq_len
    q = case.q.view(b, n, hq, d).transpose(1, 2)
    k = gather(case.kc, case.table).repeat_interleave(hq // hkv, dim=1)
    v = gather(case.vc, case.table).repeat_interleave(hq // hkv, dim=1)
    if n == length:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case.scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, length),
                                          scale=case.scale)


def flex_method(case: Case, flex: Callable) -> Callable[[], torch.Tensor]:
    """FlexAttention (compiled) with a lower-right causal block mask, GQA, contiguous K/V."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = case.seq_len - case.q_len

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    mask = create_block_mask(causal, None, None, case.q_len, case.seq_len, device=DEVICE)
    return lambda: flex(case.q4, case.k_c, case.v_c, block_mask=mask, scale=case.scale,
                        enable_gqa=True)


def declined(why: str) -> Callable[[], torch.Tensor]:
    """A method for a case its kernel does not run: calling it raises ``why``, which the
    case's row then records as its error."""
    def run() -> torch.Tensor:
        raise ValueError(why)
    return run


def cudnn_paged_method(case: Case) -> Callable[[], torch.Tensor]:
    """cuDNN's paged SDPA on the case's own pages (backend ``cudnn_prefill``, registered
    where ``nvidia-cudnn-frontend`` is installed), or ``declined`` with its reason."""
    from pagedfuse.ops.backends import get_backend, registry

    backend, call = get_backend("cudnn_prefill"), case.call("bf16")
    if why := registry.reason(backend, call):
        return declined(f"cudnn_prefill declines: {why}")

    def run() -> torch.Tensor:
        out = torch.empty_like(case.q)
        backend.run(call, out, None)
        return out
    return run


def sage_method(case: Case) -> Callable[[], torch.Tensor]:
    """SageAttention (``sageattn``: Q and K quantized to int8 per block on every call, int8
    Q·K^T, fp16 P·V) on contiguous K/V, GQA unexpanded, or ``declined`` where it does not
    run the case: version 1.0.6 serves head_dim 64, 96 and 128, and causal only where the
    queries are all the keys. It subtracts K's mean from K in place, so it gets a copy."""
    if case.geo[2] not in (64, 96, 128):
        return declined(f"SageAttention 1.0.6: head_dim {case.geo[2]} not in 64, 96, 128")
    if case.q_len != case.seq_len:
        return declined("SageAttention 1.0.6: causal only where q_len == kv_len")
    from sageattention import sageattn

    k = case.k_c.clone()
    return lambda: sageattn(case.q4, k, case.v_c, tensor_layout="HND", is_causal=True,
                            sm_scale=case.scale)


def prefill(case: Case, kind: str, plan=None) -> torch.Tensor:
    from pagedfuse.ops.triton_prefill import prefill_into

    out = torch.empty_like(case.q)
    prefill_into(case.call(kind), out, plan)
    return out


def gluon_prefill(case: Case, kind: str, pipeline: str) -> torch.Tensor:
    """The Gluon kernel (backend ``gluon_prefill``) on the ``kind`` caches: the backend's own
    launches where ``pipeline`` is its default plan's (for INT8 K+V queries of
    DEQUANT_V_FROM tokens and more, the dequantized copy of the pages and the INT8 K
    kernel), else ``pipeline``'s default plan; a call the backend declines raises with its
    reason."""
    from pagedfuse.ops.backends import gluon_prefill as gb

    call = case.call(kind)
    if why := gb.supports(call):
        raise ValueError(f"gluon_prefill declines: {why}")
    out = torch.empty_like(case.q)
    plan = None if pipeline == gb.default_plan(call).pipeline else gb.make_plan(
        call, pipeline=pipeline)
    gb.run(call, out, plan)
    return out


def split_kv(case: Case, kind: str) -> torch.Tensor:
    """The split-KV Triton kernel (backend ``triton``) on this case."""
    from pagedfuse.ops.backends import triton as split_kv_backend

    out = torch.empty_like(case.q)
    split_kv_backend.run(case.call(kind), out)
    return out


def methods(case: Case, flex: Callable | None, plans: dict) -> dict:
    """name -> (kind for errors, output layout "bhqd" or "thd", zero-argument callable);
    ``plans``: (geo, kind) -> the tile shape a sweep chose (see plan_for)."""
    tail = (case.table, case.seq_lens, case.starts, case.scale, True, None, case.seq_len,
            case.q_len)
    out = {f"SDPA {b}": ("bf16", "bhqd", lambda b=b: sdpa_contiguous(case, b))
           for b in ("cudnn", "flash", "efficient")}
    if flex is not None:
        out["FlexAttention"] = ("bf16", "bhqd", flex_method(case, flex))
    out["eager gather+SDPA"] = ("bf16", "bhqd", lambda: gather_sdpa(case))
    from pagedfuse.ops.backends import registry

    if any(b.name == "cudnn_prefill" for b in registry.all_backends()):
        out["cuDNN paged"] = ("bf16", "thd", cudnn_paged_method(case))
    if importlib.util.find_spec("sageattention"):
        out["SageAttention"] = ("bf16", "bhqd", sage_method(case))
    out["pagedfuse op bf16"] = ("bf16", "thd", lambda: OPS.paged_attention(
        case.q, case.kc, case.vc, *tail))
    out["pagedfuse op INT8 K+V"] = ("int8_kv", "thd", lambda: OPS.paged_attention_int8(
        case.q, case.k8, case.v8, case.ks, case.vs, *tail))
    if case.q_len <= SHORT_Q:  # what a direct call without the length hints gets
        out["pagedfuse op bf16 no hints"] = ("bf16", "thd", lambda: OPS.paged_attention(
            case.q, case.kc, case.vc, *tail[:5], None, None, None))
        for kind in ("bf16", "int8_kv"):  # the other candidate for short queries
            out[f"split-KV Triton {kind}"] = (kind, "thd", lambda kind=kind: split_kv(case,
                                                                                    kind))
    for name, (kind, pv) in KERNELS.items():
        shape = plans.get((case.geo, kind))
        plan = plan_for(case.call(kind), pv, shape) if shape or pv != "half" else None
        out[name] = (kind, "thd", lambda kind=kind, plan=plan: prefill(case, kind, plan))
    for name, (kind, pipeline) in GLUON.items():
        out[name] = (kind, "thd", lambda k=kind, p=pipeline: gluon_prefill(case, k, p))
    return out


def plan_for(call, pv: str = "half", shape: tuple[int, int, int, int] | None = None):
    """The default plan for ``call``'s sizes with P·V mode ``pv``; ``shape`` = (block_m,
    block_n, num_warps, num_stages) replaces its tile shape and pipelining (a sweep's
    choice; block_m only where the default fills 128 rows with one head, i.e. q_len >= 128:
    shorter queries keep their packed rows)."""
    from pagedfuse.ops.prefill_plan import default_plan

    plan = dataclasses.replace(default_plan(call), pv=pv)
    if shape:
        block_m = shape[0] if plan.pack == 1 and plan.block_m == 128 else plan.block_m
        plan = dataclasses.replace(plan, block_m=block_m, block_n=shape[1],
                                   num_warps=shape[2], num_stages=shape[3])
    return plan


def timed(fn: Callable) -> tuple[float, bool]:
    """(ms, captured): the median GPU time of one call of ``fn`` by timing.bench, a CUDA graph
    replayed after do_bench's L2 clear, so that the host's cost of an eager call is not
    timed (a Gluon launch from Python costs about 260 µs of the H200 host's time, as much as
    some of these kernels take on the GPU); by plain calls where ``fn`` cannot be captured."""
    try:
        return timing.bench(fn, REPS) / 1e3, True
    except RuntimeError as exc:  # a peer that syncs or allocates in a way capture refuses
        torch.cuda.synchronize()
        print(f"  not captured, timed by plain calls: {str(exc).splitlines()[0][:120]}",
              flush=True)
        return timing.bench_eager(fn, REPS) / 1e3, False


def bench_ms(fn: Callable) -> float:
    return timed(fn)[0]


def write_probe(path: str, probe: str, how: str, rows: list[dict]) -> None:
    """A tuning probe's record: what it measured, when and where, how (its docstring), and
    its rows."""
    Path(path).write_text(json.dumps({
        "probe": probe, "date": datetime.date.today().isoformat(),
        "gpu": f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
        "how": how, "rows": rows}, indent=1))


def in_turns(fns: dict[str, Callable], rounds: int = AB_ROUNDS) -> dict[str, float]:
    """The median ms (bench_ms) of each of ``fns`` (zero-argument calls, each run once
    first), timed in turns over ``rounds`` rounds, so that the clock's and the
    temperature's drift reaches them all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench_ms(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def references(case: Case) -> dict[str, torch.Tensor]:
    """fp32 attention [T, Hq, D] on the unquantized K/V, and on the dequantized INT8 caches."""
    deq = {"k": case.k8.float() * case.ks[..., None], "v": case.v8.float() * case.vs[..., None]}
    k_d, v_d = (gather(deq[x], case.table) for x in "kv")
    return {
        "fp32": case.tokens(fp32_attention(case.q4, case.k_c, case.v_c, case.scale)),
        "int8_kv": case.tokens(fp32_attention(case.q4, k_d, v_d, case.scale)),
        "int8_k": case.tokens(fp32_attention(case.q4, k_d, case.v_c, case.scale)),
    }


def _compile_job(job: tuple) -> str:
    """Compile one prefill specialization into Triton's on-disk cache (a worker process);
    ``job``: (geo, batch, seq_len, q_len, kind, pv, shape, extra): plan_for's plan with the
    PrefillPlan fields ``extra`` replaced, or with none of them the default launches."""
    geo, batch, seq_len, q_len, kind, pv, shape, extra = job
    from pagedfuse.ops import triton_prefill as tp
    from pagedfuse.ops.prefill_plan import default_plans

    case = Case(geo, batch, seq_len, q_len, light=True)
    call = case.call(kind)
    plans = [dataclasses.replace(plan_for(call, pv, shape), **extra)]
    if shape is None and pv == "half" and not extra:
        plans = list(default_plans(call))
    q, q_scale = OPS.quantize_int8(call.query) if call.int8_k else (call.query, None)
    t = time.time()
    for plan in plans:
        parts = None  # only their dtype and alignment reach the compiler
        if plan.splits > 1:
            parts = (torch.empty(16, device=DEVICE), torch.empty(16, device=DEVICE))
        launch = tp.launch_args(call, torch.empty_like(call.query), plan, q, q_scale,
                                partials=parts)
        tp.prefill_kernel.warmup(*launch.args, grid=launch.grid, **launch.options)
    return f"{kind} {plans} {time.time() - t:.1f}s"


def _set_page(page: int) -> None:
    global PAGE
    PAGE = page


def precompile(jobs: list[tuple], workers: int, compile_job: Callable = _compile_job) -> None:
    """Compile the kernels in parallel processes first: Triton compiles one at a time per
    process, and the timed run then finds each in the disk cache."""
    t = time.time()
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                             initializer=_set_page, initargs=(PAGE,)) as pool:
        done = list(pool.map(compile_job, jobs))
    print(f"precompiled {len(done)} specializations in {time.time() - t:.0f} s "
          f"({workers} processes)", flush=True)


def compiled_mma() -> list[dict]:
    """The MMA instructions in the PTX of every prefill kernel this process compiled."""
    import re

    from pagedfuse.ops.triton_prefill import prefill_kernel

    rows = []
    for cache in prefill_kernel.device_caches.values():
        for kernel in cache[0].values():
            ptx = kernel.asm["ptx"]
            consts = {k: v for k, v in kernel.src.constants.items()} if hasattr(
                kernel, "src") else {}
            rows.append({"constants": str(consts)[:300],
                         "mma": sorted(set(re.findall(r"wgmma\.mma_async[\w.]*|mma\.sync[\w.]*",
                                                      ptx))),
                         "cp_async": ptx.count("cp.async")})
    return rows


def run_cases(args, plans: dict) -> list[dict]:
    import triton  # noqa: F401

    rows = []
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        torch._dynamo.config.recompile_limit = 64  # one compile per case, never eager
    deadline = time.time() + args.budget
    for gname in args.geometries:
        geo = GEOMETRIES[gname]
        for batch, seq_len, q_len in args.cases:
            case = Case(geo, batch, seq_len, q_len)
            refs = references(case)
            t_flex = time.time()
            use_flex = flex is not None and time.time() < deadline - args.flex_reserve
            for name, (kind, layout, fn) in methods(case, flex if use_flex else None,
                                                    plans).items():
                if args.methods and name not in args.methods:
                    continue
                row = {"geometry": gname, "geo": list(geo), "batch": batch,
                       "seq_len": seq_len, "q_len": q_len, "method": name, "kind": kind}
                if time.time() > deadline:
                    row["error"] = "skipped: out of time"
                    rows.append(row)
                    continue
                try:
                    got = fn()
                    got = case.tokens(got) if layout == "bhqd" else got
                    row["err"] = rel_err(got, refs["fp32"])
                    if kind != "bf16":
                        row["deq_err"] = rel_err(refs[kind], refs["fp32"])
                    del got
                    ms, row["captured"] = timed(fn)
                    row["ms"] = ms
                    row["tflops"] = case.flops() / (ms * 1e-3) / 1e12
                    row["kv_gbs"] = case.kv_bytes(kind) / (ms * 1e-3) / 1e9
                except Exception as exc:  # a peer that does not run this case
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    if args.verbose:
                        traceback.print_exc()
                if name == "FlexAttention":
                    row["with_compile_s"] = round(time.time() - t_flex, 1)
                rows.append(row)
                print(_line(row), flush=True)
            del case, refs
            torch.cuda.empty_cache()
    return rows


def run_sweep(args) -> list[dict]:
    """Time each candidate plan (prefill_asm.sweep_plans) per geometry and cache kind."""
    rows = []
    deadline = time.time() + args.budget
    for gname in args.geometries:
        geo = GEOMETRIES[gname]
        for batch, seq_len, q_len in SWEEP_CASES:
            case = Case(geo, batch, seq_len, q_len, light=True)
            for kind in args.kinds:
                for shape in sweep_shapes(geo[2]):
                    if time.time() > deadline:
                        break
                    plan = plan_for(case.call(kind), "half", shape)
                    row = {"geometry": gname, "batch": batch, "seq_len": seq_len,
                           "q_len": q_len, "kind": kind, "plan": plan.__dict__}
                    try:
                        row["ms"] = bench_ms(
                            lambda c=case, k=kind, p=plan: prefill(c, k, p))
                        row["tflops"] = case.flops() / (row["ms"] * 1e-3) / 1e12
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def gluon_sweep_plans(call) -> list[dict]:
    """The GluonPlan overrides --gluon-sweep times for ``call``: keys per tile x buffers x K/V
    rings (without, with, with a V loader: WS_TILES' choices); for a one-warpgroup tile (a
    short query's) keys x buffers at one and two CTAs per SM (SHORT_INT8_TILES' choices)."""
    from pagedfuse.ops.backends import gluon_prefill as gb

    if gb.default_plan(call).block_m == 64:
        return [dict(block_n=n, stages=st, ctas_per_sm=c) for n, st, c in itertools.product(
            gb.BLOCK_NS, range(2, 5), gb.CTAS_PER_SM)]
    return [dict(block_n=n, stages=st, kv_rings=rings, v_loader=loader)
            for n, st, (rings, loader) in itertools.product(
                gb.BLOCK_NS, range(2, 6), ((False, False), (True, False), (True, True)))]


def run_gluon_sweep(args) -> list[dict]:
    """Time gluon_sweep_plans per geometry and cache kind on GLUON_SWEEP_CASES and
    SHORT_CASE; a plan whose buffers exceed the shared memory records the compiler's error."""
    from pagedfuse.ops.backends import gluon_prefill as gb
    from pagedfuse.ops.gluon_prefill import prefill_into

    rows = []
    deadline = time.time() + args.budget
    for gname in args.geometries:
        for batch, seq_len, q_len in (*GLUON_SWEEP_CASES, SHORT_CASE):
            case = Case(GEOMETRIES[gname], batch, seq_len, q_len, light=True)
            out = torch.empty_like(case.q)
            for kind in args.kinds:
                call = case.call(kind)
                for overrides in gluon_sweep_plans(call):
                    if time.time() > deadline:
                        break
                    row = {"geometry": gname, "geo": list(case.geo), "batch": batch,
                           "seq_len": seq_len, "q_len": q_len, "kind": kind, **overrides}
                    try:
                        plan = gb.make_plan(call, **overrides)
                        row["ms"] = bench_ms(lambda p=plan, c=call, o=out: prefill_into(c, o, p))
                        row["tflops"] = case.flops() / (row["ms"] * 1e-3) / 1e12
                    except Exception as exc:  # no such plan, or out of shared memory
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del case
            torch.cuda.empty_cache()
    return rows


def ab_switches(items: list[str]) -> dict[str, dict[str, object]]:
    """--gluon-ab's switches by name, each the GluonPlan fields it sets: "FIELD" sets a
    boolean field on, "FIELD=N" an integer one to N (a boolean one: 0 off, 1 on), and
    several joined by commas are one switch (another tile:
    "ctas_per_sm=1,block_n=128,stages=4,sum_mma"; the default's off: "own_tiles=0")."""
    from pagedfuse.ops.backends.gluon_prefill import GluonPlan

    types = {f.name: f.type for f in dataclasses.fields(GluonPlan)}
    switches = {}
    for item in items:
        fields = {}
        for part in item.split(","):
            field, _, value = part.partition("=")
            kind = types.get(field)
            boolean = kind in (bool, "bool")
            if not (boolean and value in ("", "0", "1")
                    or kind in (int, "int") and value.isdigit()):
                raise SystemExit(f"--gluon-ab: {part!r} of {item!r} is not FIELD or FIELD=0/1 "
                                 f"(a boolean GluonPlan field) or FIELD=N (an integer one): "
                                 f"{sorted(types)}")
            fields[field] = value != "0" if boolean else int(value)
        switches[item] = fields
    return switches


def gluon_variants(call, items: list[str]) -> dict[str, object]:
    """The Gluon default plan of ``call`` with each combination of ``items`` (ab_switches)
    set, no field set twice (named by those set, "none" for none), where check_plan allows
    it."""
    from pagedfuse.ops.backends import gluon_prefill as gb

    switches = ab_switches(items)
    variants = {}
    for on in itertools.product((False, True), repeat=len(switches)):
        chosen = [name for name, set_ in zip(switches, on, strict=True) if set_]
        overrides = {f: v for name in chosen for f, v in switches[name].items()}
        if len(overrides) < sum(len(switches[name]) for name in chosen):  # a field set twice
            continue
        try:
            plan = gb.make_plan(call, **overrides)
        except ValueError:  # a switch this kind does not have
            continue
        variants["+".join(chosen) or "none"] = plan
    return variants


def _gluon_ab_job(job: tuple) -> str:
    """Compile (by running once) one case's Gluon variants; ``job``: (geo, case, kind,
    fields)."""
    from pagedfuse.ops.gluon_prefill import prefill_into

    geo, shape, kind, fields = job
    case = Case(geo, *shape, light=True)
    call = case.call(kind)
    out = torch.empty_like(case.q)
    for plan in gluon_variants(call, fields).values():
        prefill_into(call, out, plan)
    torch.cuda.synchronize()
    return f"{kind} {shape}"


def run_gluon_ab(args) -> list[dict]:
    """Interleaved A/B of GluonPlan switches (``--gluon-ab FIELD[=N] ...``) on the default
    plans: every combination, timed in turns (medians of AB_ROUNDS), with each one's error
    against fp32 attention; the rows name the plans."""
    from pagedfuse.ops.gluon_prefill import prefill_into

    ab_switches(args.gluon_ab)  # named before any compile
    jobs = [(GEOMETRIES[g], c, kind, args.gluon_ab) for g in args.geometries
            for c in args.cases for kind in args.kinds]
    precompile(jobs, args.workers, _gluon_ab_job)
    rows = []
    for gname in args.geometries:
        for shape in args.cases:
            case = Case(GEOMETRIES[gname], *shape)
            ref = case.tokens(fp32_attention(case.q4, case.k_c, case.v_c, case.scale))
            for kind in args.kinds:
                call = case.call(kind)
                plans = gluon_variants(call, args.gluon_ab)
                outs = {n: torch.full_like(case.q, float("nan")) for n in plans}
                ms = in_turns({n: lambda c=call, o=outs[n], p=plan: prefill_into(c, o, p)
                               for n, plan in plans.items()})
                row = {"geometry": gname, "batch": shape[0], "seq_len": shape[1],
                       "q_len": shape[2], "kind": kind,
                       "plans": {n: p.__dict__ for n, p in plans.items()}, "ms": ms,
                       "vs_none": {n: t / ms["none"] for n, t in ms.items()},
                       "err": {n: rel_err(o, ref) for n, o in outs.items()}}
                rows.append(row)
                print(gname, shape, kind, {n: (round(t, 4), round(row["vs_none"][n], 3),
                                               f"{row['err'][n]:.2e}") for n, t in ms.items()},
                      flush=True)
            del case, ref
            torch.cuda.empty_cache()
    return rows


def run_short_sweep(args) -> list[dict]:
    """Time the short-query launch choices (keys per step, stages, key splits) at
    SHORT_CASE, with the default packing (the whole GQA group in 64 rows)."""
    rows = []
    deadline = time.time() + args.budget
    for gname in args.geometries:
        case = Case(GEOMETRIES[gname], *SHORT_CASE, light=True)
        for kind in KINDS:
            for extra in short_variants():
                if time.time() > deadline:
                    break
                plan = dataclasses.replace(plan_for(case.call(kind)), **extra)
                row = {"geometry": gname, "batch": case.batch, "seq_len": case.seq_len,
                       "q_len": case.q_len, "kind": kind, "plan": plan.__dict__}
                try:
                    row["ms"] = bench_ms(lambda c=case, k=kind, p=plan: prefill(c, k, p))
                    row["kv_gbs"] = case.kv_bytes(kind) / (row["ms"] * 1e-3) / 1e9
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def short_variants() -> list[dict]:
    return [dict(block_n=n, num_stages=st, splits=sp) for n, st in ((64, 3), (128, 2))
            for sp in (1, 2)]


def mixed_batch(geo: tuple[int, int, int], kind: str) -> dict:
    """The op on MIXED's batch, and on its decode rows and its chunks alone (each with its
    own length hints): ms of each; the fused call should cost at most their sum."""
    hq, hkv, d = geo
    n_dec, n_chunk, chunk, hist = (MIXED[k] for k in ("decode_rows", "chunks", "chunk",
                                                         "history"))
    q_lens = [1] * n_dec + [chunk] * n_chunk
    seq_lens = [hist + q for q in q_lens]
    pages = [-(-n // PAGE) for n in seq_lens]
    width = max(pages)
    perm = torch.randperm(sum(pages), device=DEVICE).to(torch.int32)
    table = torch.zeros(len(q_lens), width, dtype=torch.int32, device=DEVICE)
    at = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[at:at + n]
        at += n
    kc, vc = (torch.randn(sum(pages), PAGE, hkv, d, device=DEVICE, dtype=torch.bfloat16)
              for _ in "kv")
    q = torch.randn(sum(q_lens), hq, d, device=DEVICE, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE,
                          dtype=torch.int32)
    k8, ks = OPS.quantize_int8(kc)
    v8, vs = OPS.quantize_int8(vc)

    def op(rows: slice, seqs: slice, q_max: int):
        st = starts[seqs.start:seqs.stop + 1] - starts[seqs.start]
        args = (table[seqs], lens[seqs], st, 1 / math.sqrt(d), True, None, max(seq_lens),
                q_max)
        qq = q[rows]
        if kind == "bf16":
            return lambda: OPS.paged_attention(qq, kc, vc, *args)
        v = v8 if kind == "int8_kv" else vc
        return lambda: OPS.paged_attention_int8(qq, k8, v, ks, vs if kind == "int8_kv"
                                                else None, *args)

    n_tok = sum(q_lens)
    return {"mixed": bench_ms(op(slice(0, n_tok), slice(0, len(q_lens)), chunk)),
            "decode part": bench_ms(op(slice(0, n_dec), slice(0, n_dec), 1)),
            "prefill part": bench_ms(op(slice(n_dec, n_tok), slice(n_dec, len(q_lens)),
                                        chunk))}


def run_mixed(args) -> list[dict]:
    rows = []
    for gname in args.mixed_geometries:
        for kind in ("bf16", "int8_kv"):
            row = {"geometry": gname, "case": "mixed", **MIXED, "kind": kind}
            try:
                row.update(mixed_batch(GEOMETRIES[gname], kind))
                row["vs_sum"] = row["mixed"] / (row["decode part"] + row["prefill part"])
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def packed_bias(geo: tuple[int, int, int], tokens: int, keys: int, real: int) -> dict:
    """ms of the op on PACKED_BIAS's call with its mask as attn_bias, of the op on the same
    keys told causal instead (what the mask means), and of the gather + SDPA with the mask
    that the rewrite replaces (SDPA's own backend choice)."""
    hq, hkv, d = geo
    kc, vc = (torch.randn(2 * keys, 1, hkv, d, device=DEVICE, dtype=torch.bfloat16)
              for _ in "kv")
    q = torch.randn(tokens, hq, d, device=DEVICE, dtype=torch.bfloat16)
    index = torch.randperm(2 * keys, device=DEVICE)[:keys]
    i = torch.arange(tokens, device=DEVICE)[:, None] + real - tokens
    j = torch.arange(keys, device=DEVICE)[None, :]
    mask = torch.zeros(tokens, keys, device=DEVICE, dtype=torch.bfloat16).masked_fill(
        (j > i) | (j >= real), torch.finfo(torch.bfloat16).min)[None, None]
    table = index.to(torch.int32)[None]
    starts = torch.tensor([0, tokens], device=DEVICE, dtype=torch.int32)
    scale = 1 / math.sqrt(d)

    def op(causal: bool) -> Callable[[], torch.Tensor]:
        lens = torch.tensor([real if causal else keys], device=DEVICE, dtype=torch.int32)
        bias = None if causal else mask
        return lambda: OPS.paged_attention(q, kc, vc, table, lens, starts, scale, causal, bias,
                                           keys, tokens)

    def eager() -> torch.Tensor:
        k, v = (c[index, 0].transpose(0, 1)[None].repeat_interleave(hq // hkv, dim=1)
                for c in (kc, vc))
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                              scale=scale)

    return {"op, mask as attn_bias": bench_ms(op(False)), "op, causal": bench_ms(op(True)),
            "gather + SDPA with the mask": bench_ms(eager)}


def run_packed_bias(args) -> list[dict]:
    rows = []
    for gname in args.mixed_geometries:
        for tokens, keys, real in PACKED_BIAS:
            row = {"geometry": gname, "case": "packed bias", "tokens": tokens, "keys": keys,
                   "real_keys": real}
            try:
                row.update(packed_bias(GEOMETRIES[gname], tokens, keys, real))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def sweep_shapes(head_dim: int) -> list[tuple[int, int, int, int]]:
    """(block_m, block_n, num_warps, num_stages) candidates: prefill_asm.sweep_plans's."""
    from prefill_asm import sweep_plans

    return [(p.block_m, p.block_n, p.num_warps, p.num_stages) for p in sweep_plans(head_dim)]


def best_plans(sweep_rows: list[dict]) -> dict:
    """(geo, kind) -> the tile shape (block_m, block_n, warps, stages) with the least mean time
    relative to each case's fastest, over the sweep's cases."""
    totals: dict = {}
    for r in sweep_rows:
        if "ms" not in r or r["q_len"] <= SHORT_Q:  # the short-query sweep's rows
            continue
        p = r["plan"]
        key = (tuple(GEOMETRIES[r["geometry"]]), r["kind"],
               (p["block_m"], p["block_n"], p["num_warps"], p["num_stages"]))
        totals.setdefault(key, []).append(r["ms"] / min(
            x["ms"] for x in sweep_rows if "ms" in x and x["geometry"] == r["geometry"]
            and x["kind"] == r["kind"] and x["batch"] == r["batch"]
            and x["q_len"] == r["q_len"]))
    best: dict = {}
    for (geo, kind, shape), rel in totals.items():
        score = sum(rel) / len(rel)
        if (geo, kind) not in best or score < best[(geo, kind)][0]:
            best[(geo, kind)] = (score, shape)
    return {k: shape for k, (_, shape) in best.items()}


def _line(row: dict) -> str:
    head = f"{row['geometry']:10s} {row['batch']}x{row['seq_len']} q{row['q_len']:<5d} " \
           f"{row['method']:26s}"
    if "error" in row:
        return f"{head} {row['error']}"
    deq = f" deq {row['deq_err']:.2e} ({row['err'] / row['deq_err']:.2f}x)" \
        if "deq_err" in row else ""
    return f"{head} {row['ms']:8.3f} ms {row['tflops']:6.0f} TF/s err {row['err']:.2e}{deq}"


def table(rows: list[dict]) -> str:
    """Markdown: one line per case, ms (TFLOP/s) per method; then the errors."""
    names = list(dict.fromkeys(r["method"] for r in rows))
    cases = list(dict.fromkeys((r["geometry"], r["batch"], r["seq_len"], r["q_len"])
                               for r in rows))
    by = {(r["geometry"], r["batch"], r["seq_len"], r["q_len"], r["method"]): r for r in rows}
    lines = ["| geometry | B, L, q | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for c in cases:
        cells = []
        for n in names:
            r = by.get((*c, n))
            cells.append("-" if r is None or "ms" not in r else
                         f"{r['ms']:.3g} ({r['tflops']:.0f})")
        lines.append(f"| {c[0]} | {c[1]}, {c[2]}, {c[3]} | " + " | ".join(cells) + " |")
    lines += ["", "errors (rel. to fp32 on unquantized K/V; INT8: / dequantize-then-attend)",
              "| geometry | B, L, q | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for c in cases:
        cells = []
        for n in names:
            r = by.get((*c, n))
            if r is None or "err" not in r:
                cells.append("-")
            elif "deq_err" in r:
                cells.append(f"{r['err']:.1e} ({r['err'] / r['deq_err']:.2f}x)")
            else:
                cells.append(f"{r['err']:.1e}")
        lines.append(f"| {c[0]} | {c[1]}, {c[2]}, {c[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["method"] for r in rows))
    cases = list(dict.fromkeys((r["geometry"], r["batch"], r["seq_len"], r["q_len"])
                               for r in rows))
    by = {(r["geometry"], r["batch"], r["seq_len"], r["q_len"], r["method"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(10, 1.1 * len(cases)), 5))
    width = 0.85 / len(names)
    colors = plt.get_cmap("tab20").colors  # distinct up to 20 entries (tab10 repeats at 11)
    for i, n in enumerate(names):
        ys = [by.get((*c, n), {}).get("tflops", 0.0) for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], ys, width, label=n,
               color=colors[i % len(colors)])
    ax.set_xticks([x + 0.425 for x in range(len(cases))])
    ax.set_xticklabels([f"{g}\n{b}x{s} q{q}" for g, b, s, q in cases], fontsize=7)
    ax.set_ylabel("TFLOP/s (TOP/s for INT8), causal pairs")
    ax.set_title(f"Paged prefill on the H200, bf16 page {PAGE} (bench_prefill.py)")
    ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows (and the run's environment) here")
    ap.add_argument("--plot", help="write a bar chart of TFLOP/s here")
    ap.add_argument("--replot", help="read rows from this JSON instead of running (no GPU)")
    ap.add_argument("--sweep", action="store_true", help="time the candidate plans")
    ap.add_argument("--gluon-sweep", action="store_true",
                    help="time the Gluon kernel's tiles (keys per step x buffers)")
    ap.add_argument("--gluon-ab", nargs="+", metavar="FIELD[=N][,FIELD[=N]...]",
                    help="time the Gluon default plans with every combination of these "
                         "GluonPlan switches (a boolean field, or an integer one's value; "
                         "fields joined by commas are one switch), interleaved")
    ap.add_argument("--plans", help="a sweep's JSON: run with its best plan per geometry/kind")
    ap.add_argument("--geometries", nargs="+", default=list(GEOMETRIES))
    ap.add_argument("--cases", type=lambda s: tuple(int(x) for x in s.split(",")), nargs="+",
                    help="batch,seq_len,q_len ... (default: CASES; --gluon-ab: "
                         "GLUON_SWEEP_CASES)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-mixed", action="store_true",
                    help="skip the mixed batch and the packed batch under a mask")
    ap.add_argument("--mixed-geometries", nargs="+", default=["llama3_8b"],
                    help="geometries of the mixed batch and the packed batch under a mask")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS),
                    help="cache kinds the tile-shape sweep times (the short-query one: all)")
    ap.add_argument("--pv-int8", action="store_true", help="also time P·V as an int8 dot")
    ap.add_argument("--budget", type=float, default=400, help="seconds; then skip the rest")
    ap.add_argument("--flex-reserve", type=float, default=120,
                    help="stop compiling FlexAttention this many seconds before the budget")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--methods", nargs="+",
                    help="time only the entries of these names (default: all)")
    ap.add_argument("--page", type=int, default=PAGE,
                    help="tokens per page of the cases' caches (still in random order)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    args.cases = args.cases or list(GLUON_SWEEP_CASES if args.gluon_ab else CASES)
    _set_page(args.page)
    if args.replot:
        record = json.loads(Path(args.replot).read_text())
        rows = record["rows"]
        _set_page(record["env"].get("page", PAGE))
        print(table(rows))
        if args.plot:
            plot(rows, args.plot)
        return
    import triton

    if args.pv_int8:
        KERNELS.setdefault(*PV_INT8_ENTRY)
    # time: which of one day's records is the newest (summarize.py)
    env = {"date": datetime.date.today().isoformat(),
           "time": datetime.datetime.now().isoformat(timespec="minutes"),
           "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__,
           "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
           "page": PAGE, "argv": sys.argv[1:], "timing": "graph replay"}
    print(env, flush=True)
    plans = {}
    if args.plans:
        plans = best_plans(json.loads(Path(args.plans).read_text())["rows"])
        print("tile shapes (block_m, block_n, warps, stages):",
              {f"{g} {k}": p for (g, k), p in plans.items()}, flush=True)
    if args.gluon_ab:
        rows = run_gluon_ab(args)
    elif args.gluon_sweep:
        rows = run_gluon_sweep(args)
    elif args.sweep:
        jobs = [(GEOMETRIES[g], *c, kind, "half", shape, {}) for g in args.geometries
                for c in SWEEP_CASES for kind in args.kinds
                for shape in sweep_shapes(GEOMETRIES[g][2])]
        jobs += [(GEOMETRIES[g], *SHORT_CASE, kind, "half", None, extra)
                 for g in args.geometries for kind in KINDS for extra in short_variants()]
        precompile(jobs, args.workers)
        rows = run_sweep(args) + run_short_sweep(args)
    else:
        jobs = [(GEOMETRIES[g], *c, kind, pv, plans.get((GEOMETRIES[g], kind)), {})
                for g in args.geometries for c in args.cases
                for name, (kind, pv) in KERNELS.items()
                if not args.methods or name in args.methods]
        precompile(jobs, args.workers)
        from pagedfuse.ops.backends.gluon_prefill import DEQUANT_V_FROM

        env["dequant_v_from"] = DEQUANT_V_FROM  # the Gluon INT8 K+V entries' copy, from here
        # the short queries' byte floor: their K/V bytes at this run's copy bandwidth
        env["copy_gbs"] = timing.copy_bandwidth() / 1e9
        rows = run_cases(args, plans)
        print(table(rows))
        if not args.no_mixed:
            env["mixed"] = run_mixed(args)
            env["packed_bias"] = run_packed_bias(args)
        try:
            env["compiled_mma"] = compiled_mma()
            print("compiled prefill kernels' MMA:", sorted({m for r in env["compiled_mma"]
                                                            for m in r["mma"]}))
        except Exception as exc:
            print("could not read the compiled kernels:", exc)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    if args.plot and not (args.sweep or args.gluon_sweep or args.gluon_ab):
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
