"""The decode problems the GPU benchmarks time: geometries, one case's caches in every
format and layout, the peers a user would otherwise run, and pagedfuse's call of each cache
format by the op's choice of kernel or by a named backend with a pinned launch plan.

Shared by the table (bench_decode.py) and the tuning sweeps (tuning/).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import timing
import torch
import torch.nn.functional as F
from timing import bench
from torch.nn.attention import SDPBackend, sdpa_kernel

import pagedfuse.ops  # noqa: F401  (registers torch.ops.pagedfuse.*)
from pagedfuse.ops.backends import choose, get_backend, reason
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall
from pagedfuse.ops.validate import build_call

try:  # pagedfuse's CUDA kernels need Triton; the table's --replot runs without them
    from pagedfuse.ops import cuda as pf_cuda
    from pagedfuse.ops.backends import cuda_decode
except ImportError:
    pf_cuda = cuda_decode = None

GEOMETRIES = {"qwen35": (24, 4, 256), "tinyllama": (32, 4, 64), "llama3_8b": (32, 8, 128)}
BATCHES = (1, 8, 64)
LENGTHS = (1536, 8192, 32768)
PAGE = 16
LAYOUT = "nhd"  # the caches' storage order for every Case (--layout)
MEMORY_LIMIT = 60e9
OPS = torch.ops.pagedfuse
KINDS = ("bf16", "int8_kv", "int8_k")  # cache formats: bf16 K+V, INT8 K+V, INT8 K + bf16 V
NATIVE_KIND = {"bf16": "half", "int8_kv": "int8_kv", "int8_k": "int8_k"}  # cuda_native's


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
        self.k_contig = gather_pages(self.k, self.table).contiguous()
        self.v_contig = gather_pages(self.v, self.table).contiguous()

    def bytes(self, kind: str) -> int:
        """K/V (and scale) bytes that must be read: the floor's numerator."""
        hq, hkv, d = self.geo
        tokens = self.batch * self.length * hkv
        per_token = {"bf16": 4 * d, "int8_kv": 2 * d + 8, "int8_k": d + 4 + 2 * d}[kind]
        return tokens * per_token

    @property
    def block_args(self):
        return self.table, self.seq_lens, self.starts

    def caches(self, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                          torch.Tensor | None]:
        """(key, value, key scales, value scales) of one cache format (None: no scales)."""
        k, ks = (self.k, None) if kind == "bf16" else (self.k8, self.ks)
        v, vs = (self.v8, self.vs) if kind == "int8_kv" else (self.v, None)
        return k, v, ks, vs


def configure(layout: str, flush: str, geos: list[str] | None) -> float:
    """Apply the scripts' common options (cache layout, L2 flush, the geometries to keep),
    seed the generator, and measure the copy bandwidth the run's fractions are of (bytes/s,
    printed)."""
    global LAYOUT
    LAYOUT, timing.FLUSH = layout, flush
    for name in set(GEOMETRIES) - set(geos or GEOMETRIES):
        del GEOMETRIES[name]
    torch.manual_seed(0)
    bw = timing.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    return bw


def gather_pages(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[nb, bs, H, D] cache through [B, n] table -> [B, H, n*bs, D] (a view after the copy)."""
    return cache[table].flatten(1, 2).transpose(1, 2)


def gather_sdpa(q, k_cache, v_cache, table, scale):
    """What a user writes: gather the pages, then SDPA with GQA."""
    k, v = gather_pages(k_cache, table), gather_pages(v_cache, table)
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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().flatten(), ref.float().flatten()
    return float((out - ref).norm() / ref.norm())


def fits(geo, batch, length) -> bool:
    hq, hkv, d = geo
    kv = 4 * batch * length * hkv * d
    return 4.5 * kv < MEMORY_LIMIT  # cache, int8 copy, contiguous copy, eager temporaries


def each_case(points: tuple[tuple[int, int], ...],
               visit: Callable[[str, Case], None]) -> None:
    """visit(geometry name, case) for each geometry at each (B, L) of ``points`` that fits
    in memory; a case is freed before the next one is built."""
    for gname, geo in GEOMETRIES.items():
        for batch, length in points:
            if fits(geo, batch, length):
                visit(gname, Case(geo, batch, length))
                torch.cuda.empty_cache()


def geometry_name(geo: tuple[int, int, int]) -> str:
    return next(k for k, v in GEOMETRIES.items() if v == geo)


def decode_call(case: Case, kind: str) -> PagedCall:
    """The validated decode call of ``case`` over its ``kind`` caches (hints: the length and
    one query token, as the rewrite passes them)."""
    k, v, ks, vs = case.caches(kind)
    return build_call(FLOAT_OP if ks is None else INT8_OP, case.q, k, v, ks, vs,
                      *case.block_args, case.scale, False, None, case.length, 1)


def pf_call(case: Case, kind: str, backend: str | None = None, config=None, splits=None,
             pdl: bool | None = None) -> torch.Tensor:
    """One decode of ``kind`` on ``case`` by ``backend`` (default: the op's choice), with its
    plan's ``config`` / ``splits`` / programmatic dependent launch pinned where given."""
    call = decode_call(case, kind)
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


def native_reason(kind: str) -> str | None:
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


def default_native(kind: str, head_dim: int) -> bool:
    """Whether the op's default path for this format and head_dim is the CUDA C++ decode."""
    return native_reason(kind) is None and head_dim in cuda_decode.HEAD_DIMS


def native_path(kind: str) -> str:
    """Which kernel the op runs here by default for a q_len 1 call, per head_dim."""
    reason = native_reason(kind)
    if reason is not None:
        return f"Triton ({reason})"
    native = sorted(cuda_decode.HEAD_DIMS)
    others = sorted({g[2] for g in GEOMETRIES.values()} - set(native))
    return f"CUDA C++ at head_dim {', '.join(map(str, native))}" + (
        f", Triton at {', '.join(map(str, others))}" if others else "")
