"""Compile the prefill kernel for sm_90 with no GPU and report what the compiler made of it.

For each geometry x cache kind x plan: the matrix instructions in the PTX (Hopper's
warpgroup MMA is ``wgmma.mma_async``; its INT8 form ends in ``s32.s8.s8``), the SASS
counts of HGMMA (16-bit) / IGMMA (int8) / HMMA / IMMA (the older warp-level MMAs), and
ptxas's registers, spills and shared memory, and the order of the asynchronous work in the
key loop without masks (``loop``): whether a Q·K^T wgmma is still in flight while the softmax
runs (``qk_wait_before_softmax``: a ``wgmma.wait_group 0`` between the loop's first wgmma
and its first ``ex2``, i.e. no overlap), whether the kernel is warp-specialized
(``setmaxnreg``), and the SASS key loop's instructions per thread and key tile on its
shortest and longest paths (``sass_loop``: the tile every row reads whole, the masked one).
Triton's own compiler runs against a stand-in driver that names the target, so this runs on
any machine with Triton installed; on the H200 bench_prefill.py
--asm reads the same from the kernels it actually ran.

    python benchmarks/prefill_asm.py                 # every geometry and kind, default plans
    python benchmarks/prefill_asm.py --plans sweep   # the sweep's candidate plans too
    python benchmarks/prefill_asm.py --kernel gluon  # the Gluon kernels, every kind and geometry

``--json PATH`` writes the rows of the kernel compiled into the record at PATH, replacing that
kernel's rows and keeping the others' (benchmarks/results/prefill_asm_sm90.json holds the
Triton prefill's default plans and the Gluon kernels' plans).
    python benchmarks/prefill_asm.py --kernel decode # the split-KV decode (backend triton)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.prefill import paged_call  # noqa: E402

from pagedfuse.ops import prefill_plan as pp  # noqa: E402
from pagedfuse.ops import triton_prefill as tp  # noqa: E402
from pagedfuse.ops.reference import quantize_int8_reference  # noqa: E402

GEOMETRIES = {"qwen35": (24, 4, 256), "llama3_8b": (32, 8, 128), "tinyllama": (32, 4, 64)}
KINDS = ("bf16", "int8_k", "int8_kv")
MMA = re.compile(r"\b(HGMMA|IGMMA|QGMMA|HMMA|IMMA)\b")
# PTX events of a loop's schedule, in program order
EVENTS = (("mma", re.compile(r"wgmma\.mma_async")), ("commit", re.compile(r"wgmma\.commit_group")),
          ("wait", re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")),
          ("ex2", re.compile(r"\bex2\.approx")), ("cp", re.compile(r"cp\.async\.c[ag]\.")),
          ("cpwait", re.compile(r"cp\.async\.wait_group\s+(\d+)")),
          ("bar", re.compile(r"\b(bar|barrier)\.sync")), ("mbar", re.compile(r"mbarrier\.")),
          ("tma", re.compile(r"cp\.async\.bulk\.tensor")))


class _TargetOnly:
    """What Triton's JIT asks a driver for when it compiles without launching."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def _toolkit(name: str) -> str:
    """ptxas / cuobjdump as shipped inside Triton's package."""
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _caches(blocks: int, hkv: int, d: int, kind: str):
    """CPU K/V caches of 16-token pages in ``kind``'s format, with their scales (or None)."""
    k = torch.randn(blocks, 16, hkv, d).to(torch.bfloat16)
    v = torch.randn(blocks, 16, hkv, d).to(torch.bfloat16)
    ks = vs = None
    if kind != "bf16":
        k, ks = quantize_int8_reference(k)
    if kind == "int8_kv":
        v, vs = quantize_int8_reference(v)
    return k, v, ks, vs


def small_call(geo: tuple[int, int, int], kind: str, q_len: int, causal: bool = True):
    """A CPU PagedCall with the dtypes, strides and alignments of a real one (values unused)."""
    hq, hkv, d = geo
    seq = max(q_len, 256)
    blocks = seq // 16
    k, v, ks, vs = _caches(blocks, hkv, d, kind)
    return paged_call(torch.randn(q_len, hq, d).to(torch.bfloat16), k, v,
                      torch.arange(blocks, dtype=torch.int32)[None], torch.tensor([seq]),
                      torch.tensor([0, q_len]), 1 / math.sqrt(d), causal, key_scale=ks,
                      value_scale=vs, max_seq_len=seq, max_query_len=q_len)


def compile_plan(call, plan: pp.PrefillPlan, capability: int = 90):
    """The compiled kernel (Triton's CompiledKernel) of ``call`` under ``plan``."""
    out = torch.empty_like(call.query)
    q, q_scale = quantize_int8_reference(call.query) if call.int8_k else (call.query, None)
    launch = tp.launch_args(call, out, plan, q, q_scale)
    saved = driver._active  # None until a real driver was asked for (none without a GPU)
    driver.set_active(_TargetOnly(capability))
    try:
        return tp.prefill_kernel.warmup(*launch.args, grid=launch.grid, **launch.options)
    finally:
        driver._active = saved


def _iteration(lines: list[str], labels: dict[str, int], header: int) -> list[str]:
    """The lines of one iteration of the loop at ``header``, in execution order: from the
    header, following unconditional branches and falling through conditional ones (LLVM
    may place a loop's blocks out of text order, e.g. a Gluon loop with an if/else), up
    to the branch back to the header."""
    body, i, seen = [], header, set()
    while i < len(lines) and i not in seen:
        seen.add(i)
        line = lines[i]
        body.append(line)
        m = re.search(r"(@!?%p\w+\s+)?\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(2)) == header:
            break  # the back edge
        if m and not m.group(1):
            i = labels[m.group(2)]
        elif re.search(r"\bret;", line):
            break
        else:
            i += 1
    return body


def compile_gluon(call, plan, capability: int = 90):
    """The compiled Gluon prefill kernel (pagedfuse/ops/gluon_prefill.py) of ``call`` under
    ``plan`` (a GluonPlan)."""
    from pagedfuse.ops import gluon_prefill as gp

    out = torch.empty_like(call.query)
    q, q_scale = quantize_int8_reference(call.query) if call.int8_k else (call.query, None)
    launch = gp.launch_args(call, out, plan, q, q_scale)
    saved = driver._active
    driver.set_active(_TargetOnly(capability))
    try:
        return launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.options)
    finally:
        driver._active = saved


def gluon_rows(q_len: int) -> list[dict]:
    """The Gluon kernels' plans: the default for ``q_len`` (the warp-specialized "ws"
    pipeline) at every geometry and cache kind; at llama3_8b INT8 K also its one-consumer and
    64-key variants and the cp.async "cp" pipeline's default and 64-key plans, and at
    llama3_8b bf16 and INT8 K+V the one-consumer plan short queries take."""
    from pagedfuse.ops.backends import gluon_prefill as gb

    variants = {("llama3_8b", "int8_k"): (dict(block_m=64), dict(block_n=64, stages=4),
                                          dict(pipeline="cp", stages=3),
                                          dict(pipeline="cp", block_n=64, stages=4)),
                ("llama3_8b", "bf16"): (dict(block_m=64),),
                ("llama3_8b", "int8_kv"): (dict(block_m=64),)}
    rows = []
    for name, geo in GEOMETRIES.items():
        for kind in KINDS:
            call = small_call(geo, kind, q_len)
            first = gb.default_plan(call)
            plans = [first] + [p for p in (gb.make_plan(call, **v)
                                           for v in variants.get((name, kind), ()))
                               if p != first]
            for plan in plans:
                try:
                    info = inspect(compile_gluon(call, plan))
                except Exception as exc:  # a plan over the shared-memory limit, say
                    info = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                row = {"kernel": "gluon", "geometry": name, "kind": kind,
                       "plan": plan.__dict__, **info}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


H200_SMS = 132  # what the split heuristic sizes the decode's grid for, with no GPU to ask
DECODE_BATCH, DECODE_KEYS = 64, 8192
DECODE_OPTIONS = {"-": {}, "window 4096": dict(window_left=4096), "softcap 50": dict(softcap=50.0)}


def decode_rows() -> list[dict]:
    """The split-KV Triton decode (backends/triton.py) at B=64 and 8K keys, default plan, for
    every geometry, cache kind and option: what it costs in registers, spills and shared
    memory on sm_90 (above the H200's 227 KB a launch steps down to smaller tiles)."""
    from pagedfuse.ops import triton_paged
    from pagedfuse.ops.backends import triton as tb

    rows = []
    for name, (hq, hkv, d) in GEOMETRIES.items():
        for kind in KINDS:
            for option, values in DECODE_OPTIONS.items():
                blocks = DECODE_KEYS // 16
                k, v, ks, vs = _caches(blocks, hkv, d, kind)
                call = paged_call(
                    torch.randn(DECODE_BATCH, hq, d).to(torch.bfloat16), k, v,
                    torch.zeros(DECODE_BATCH, blocks, dtype=torch.int32),
                    torch.full((DECODE_BATCH,), DECODE_KEYS),
                    torch.arange(DECODE_BATCH + 1), 1 / math.sqrt(d), True, key_scale=ks,
                    value_scale=vs, max_seq_len=DECODE_KEYS, max_query_len=1)._replace(**values)
                g = call.geometry
                config = tb.launch_config(call.int8_k)
                plan = tb.launch_plan(g.num_tokens, g.num_q_heads, g.num_kv_heads, d, g.batch,
                                      call.keys_bound, 1, H200_SMS, config, False)
                q, q_scale = (quantize_int8_reference(call.query) if call.int8_k
                              else (call.query, call.query))
                out = torch.empty_like(call.query)
                parts = torch.empty(plan.splits * out.numel() // d * (d + 1))
                args, constexprs = tb.kernel_args(call, out, plan, q, q_scale,
                                                  parts[:plan.splits * out.numel()],
                                                  parts[plan.splits * out.numel():])
                saved = driver._active
                driver.set_active(_TargetOnly(90))
                try:
                    kernel = triton_paged.paged_attention_kernel.warmup(
                        *args, **constexprs, BLOCK_N=config.block_n,
                        num_warps=config.num_warps, num_stages=config.num_stages,
                        grid=(g.batch, g.num_kv_heads, plan.splits))
                finally:
                    driver._active = saved
                info = inspect(kernel)
                rows.append({"kernel": "decode", "geometry": name, "kind": kind,
                             "option": option, "splits": plan.splits,
                             "config": config._asdict(),
                             **{key: info[key] for key in ("registers", "spill_bytes",
                                                          "shared_bytes", "sass_mma")}})
    return rows


def loop_schedule(ptx: str) -> dict:
    """The innermost loop that issues wgmma, the first of those (the key loop without masks:
    the masked loop comes after it; in a warp-specialized kernel, a consumer's key loop,
    which may sit inside the loop a worker warp waits in): its events in one iteration's
    execution order, run-length coded ("mma x4" is four wgmma), and whether the softmax
    waits for its Q·K^T."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*(\$L__\w+):", line))}
    starts = sorted(labels.values())
    # LLVM marks a loop's first block "=>This (Inner) Loop Header: Depth=N"
    # on or after its label line
    headers = [(max(j for j in starts if j <= i), int(m.group(1)))
               for i, line in enumerate(lines) if (m := re.search(r"Loop Header: Depth=(\d+)",
                                                                  line))]
    found = []
    for header, depth in headers:
        seq = []
        for body in _iteration(lines, labels, header):
            for name, rx in EVENTS:
                if hit := rx.search(body):
                    seq.append(name + (hit.group(1) if name in ("wait", "cpwait") else ""))
        if "mma" in seq:
            found.append((-depth, header, seq))
    if not found:
        return {"loop": None, "qk_wait_before_softmax": None}
    _, _, seq = min(found)
    runs: list[list] = []
    for e in seq:
        if runs and runs[-1][0] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, 1])
    first_mma = seq.index("mma")
    first_ex2 = seq.index("ex2", first_mma) if "ex2" in seq[first_mma:] else len(seq)
    return {"loop": " ".join(e if n == 1 else f"{e} x{n}" for e, n in runs),
            "qk_wait_before_softmax": "wait0" in seq[first_mma:first_ex2]}


def inspect(kernel, ptxas: bool = True) -> dict:
    """MMA instructions in PTX and SASS; ptxas -v resources (registers, spills)."""
    ptx = kernel.asm["ptx"]
    info = {
        "ptx_mma": sorted(set(re.findall(r"wgmma\.mma_async[\w.]*|mma\.sync[\w.]*", ptx))),
        "shared_bytes": kernel.metadata.shared,
        "setmaxnreg": len(re.findall(r"\bsetmaxnreg\.", ptx)),
        **loop_schedule(ptx),
    }
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([_toolkit("cuobjdump"), "--dump-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
        info["sass_mma"] = dict(Counter(MMA.findall(sass)))
        info.update(sass_loop(sass))
        if info["setmaxnreg"]:
            info["local_ops"] = partition_local_ops(sass)
        if ptxas:
            src = Path(tmp) / "k.ptx"
            src.write_text(ptx)
            arch = re.search(r"\.target\s+(\w+)", ptx).group(1)
            log = subprocess.run([_toolkit("ptxas"), f"-arch={arch}", "-v", str(src), "-o",
                                  os.devnull], capture_output=True, text=True).stderr
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            info["registers"] = int(regs.group(1)) if regs else None
            info["spill_bytes"] = int(spill.group(1)) + int(spill.group(2)) if spill else None
    return info


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
GMMA = ("HGMMA", "IGMMA", "QGMMA")


def sass_loop(sass: str, max_paths: int = 64) -> dict:
    """The key loop in SASS: the first loop (a branch back to an earlier address) that issues
    GMMA and holds no other such loop, i.e. the first consumer's key loop. One iteration's
    paths from its head to its back edge: a conditional branch forward inside the loop forks
    a path, one backward (a barrier's wait loop, the head's own too) or out of the loop (a
    wait's slow path) is taken as not taken. ``min``/``max``: the instructions of the
    shortest path (the tile every row reads whole) and the longest (the masked tile),
    ``ops``: the shortest path's opcodes, most frequent first. Counts are per thread and key
    tile."""
    code = {}  # address -> (predicated, opcode, operands)
    for m in SASS_LINE.finditer(sass):
        code[int(m.group(1), 16)] = (bool(m.group(2)), m.group(3), m.group(4))
    addrs = sorted(code)
    nxt = dict(zip(addrs, addrs[1:], strict=False))  # each address to the next
    loops = []  # (head, back edge)
    for a in addrs:
        pred, op, rest = code[a]
        if op == "BRA" and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < a:
            head = int(t.group(1), 16)
            if any(code[b][1].split(".")[0] in GMMA for b in addrs if head <= b <= a):
                loops.append((head, a))
    inner = [(h, e) for h, e in loops
             if not any(h <= h2 and e2 <= e and (h2, e2) != (h, e) for h2, e2 in loops)]
    if not inner:
        return {"sass_loop": None}
    head, end = min(inner)
    paths, stack = [], [(head, [])]
    while stack and len(paths) < max_paths:
        a, path = stack.pop()
        while a is not None and head <= a <= end:
            pred, op, rest = code[a]
            path.append(op)
            target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
            t = int(target.group(1), 16) if target else None
            if a == end or op == "EXIT" or (op == "BRA" and t == head and not pred):
                paths.append(path)
                break
            if t is not None and a < t <= end:
                if pred:
                    stack.append((t, list(path)))
                else:
                    a = t
                    continue
            a = nxt.get(a)
    if not paths:
        return {"sass_loop": None}
    shortest = min(paths, key=len)
    return {"sass_loop": {"paths": len(paths), "min": len(shortest),
                          "max": max(len(p) for p in paths),
                          "ops": dict(Counter(op.split(".")[0] for op in shortest)
                                      .most_common(12))}}


def partition_local_ops(sass: str) -> dict[str, int]:
    """Local-memory loads and stores (spills) of a warp-specialized kernel by partition:
    each is counted in the register budget the last ``USETMAXREG`` before it in the text set
    (the Gluon backend's CONSUMER_REGS: "consumer", PRODUCER_REGS: "producer"). A map by
    text order, which is how ptxas lays out the partitions' code."""
    from pagedfuse.ops.backends.gluon_prefill import CONSUMER_REGS, PRODUCER_REGS

    names = {CONSUMER_REGS: "consumer", PRODUCER_REGS: "producer"}
    where, counts = "entry", Counter()
    for line in sass.splitlines():
        if m := re.search(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:UP\d,\s*)?(0x[0-9a-f]+)", line):
            where = names.get(int(m.group(1), 16), "other")
        elif re.search(r"\b(STL|LDL)\b", line):
            counts[where] += 1
    return dict(counts)


def sweep_plans(head_dim: int) -> list[pp.PrefillPlan]:
    """The candidates bench_prefill.py --sweep times. Pruned offline with this tool: with
    128-row tiles, 4 warps spill 1-10 KB for head_dim >= 128, and so does block_n 128 at
    head_dim 256 (and 64-row tiles at 256); 4 stages compile to the same shared memory as
    3. 64-row tiles with 4 warps fit two or more CTAs per SM for head_dim <= 128 (128-255
    registers), so one CTA's softmax can overlap another's MMAs."""
    shapes = {64: ((128, 64, 8, 3), (128, 128, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3),
                   (64, 128, 4, 2)),
              128: ((128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 2),
                    (64, 64, 4, 3)),
              256: ((128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3))}[head_dim]
    return [pp.PrefillPlan(m, 1, n, w, s) for m, n, w, s in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", choices=("default", "sweep"), default="default")
    ap.add_argument("--q-len", type=int, default=2048)
    ap.add_argument("--kernel", choices=("triton", "gluon", "decode"), default="triton")
    ap.add_argument("--json", help="the record to write this kernel's rows into")
    args = ap.parse_args()
    if args.kernel == "gluon":
        rows = gluon_rows(args.q_len)
    elif args.kernel == "decode":
        rows = decode_rows()
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        rows = []
        for name, geo in GEOMETRIES.items():
            for kind in KINDS:
                call = small_call(geo, kind, args.q_len)
                plans = [pp.default_plan(call)]
                if args.plans == "sweep":
                    plans += [p for p in sweep_plans(geo[2]) if p != plans[0]]
                for plan in plans:
                    try:
                        info = inspect(compile_plan(call, plan))
                    except Exception as exc:  # a plan over the shared-memory limit, say
                        info = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    row = {"geometry": name, "kind": kind, "plan": plan.__dict__, **info}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        write_record(Path(args.json), rows, args.kernel)


def write_record(path: Path, rows: list[dict], kernel: str) -> None:
    """``rows`` replace the rows of ``kernel`` in the record at ``path``; the other kernels'
    rows stay (a Triton row has no "kernel" field)."""
    old = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in old if r.get("kernel", "triton") != kernel]
    path.write_text(json.dumps(kept + rows, indent=1))

if __name__ == "__main__":
    main()
