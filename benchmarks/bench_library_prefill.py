"""bf16 paged prefill on the GPU: the libraries that read a paged cache in place, cuDNN's
paged SDPA (backend ``cudnn_prefill``) and, where it is installed, FlashInfer's paged
prefill (flashinfer_paged.py: its fa3 and fa2 kernels), against our prefill kernels
(``triton_prefill``, ``gluon_prefill``) and SDPA on contiguous K/V (cuDNN, flash), in one
run, on bench_prefill.py's cases (its Case, peers, reference and timer) plus a mixed batch
of decode rows and prompt chunks. Per entry: ms of GPU time (bench_prefill's timer: CUDA
graph replays, plain calls where a call cannot be captured, as "captured" says), TFLOP/s of
causal pairs, error against fp32 attention; for our backends and cuDNN's also the host time
of an eager call. Then the other terms of the comparison, per
backend: capture in a CUDA graph (100 replays equal to eager), host synchronisation (none
may occur: torch's sync debug mode raises), a compiled caller with a varying token count
(recompiles, cuDNN graphs built, first-call seconds), install weight, FlashInfer's the same
way (flashinfer_paged.checks); and what cuDNN itself writes in rows that read no key (the
backend zeroes them afterwards).

    python benchmarks/bench_library_prefill.py --json out.json
    python benchmarks/bench_library_prefill.py --precompile-only   # Triton kernels to disk
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_prefill as bp  # noqa: E402  (also puts tests/ on the path)
import flashinfer_paged  # noqa: E402
import timing  # noqa: E402
from helpers.prefill import paged_call  # noqa: E402

from pagedfuse import envs  # noqa: E402
from pagedfuse.ops import cudnn_paged  # noqa: E402
from pagedfuse.ops.backends import get_backend  # noqa: E402

OURS = ("triton_prefill", "gluon_prefill")
BACKENDS = (*OURS, "cudnn_prefill")
PEERS = ("cudnn", "flash")  # SDPA on contiguous, GQA-expanded K/V
MIXED = dict(decode_rows=60, chunks=2, chunk=512, history=8192)  # issue 22's mixed batch


class MixedCase:
    """Decode rows and prompt chunks in one call: ``decode_rows`` sequences of one query
    token and ``chunks`` of ``chunk`` tokens, each after ``history`` keys."""

    def __init__(self, geo: tuple[int, int, int], decode_rows: int, chunks: int, chunk: int,
                 history: int):
        hq, hkv, d = geo
        q_lens = [1] * decode_rows + [chunk] * chunks
        self.geo, self.batch, self.q_lens = geo, len(q_lens), q_lens
        self.seq_lens_list = [history + q for q in q_lens]
        self.seq_len, self.q_len = max(self.seq_lens_list), max(q_lens)
        self.scale = d ** -0.5
        width = -(-self.seq_len // bp.PAGE)
        blocks = self.batch * width
        dev = bp.DEVICE
        self.table = torch.randperm(blocks, device=dev).view(self.batch, -1).to(torch.int32)
        self.kc, self.vc = (torch.randn(blocks, bp.PAGE, hkv, d, device=dev,
                                        dtype=torch.bfloat16) for _ in "kv")
        self.q = torch.randn(sum(q_lens), hq, d, device=dev, dtype=torch.bfloat16)
        self.seq_lens = torch.tensor(self.seq_lens_list, device=dev, dtype=torch.int32)
        self.starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=dev,
                                   dtype=torch.int32)

    @property
    def name(self) -> str:
        return f"mixed {self.q_lens.count(1)}x1 + {self.batch - self.q_lens.count(1)}x" \
               f"{self.q_len}"

    def flops(self) -> float:
        hq, _, d = self.geo
        pairs = sum(n * (length - n) + n * (n + 1) / 2
                    for n, length in zip(self.q_lens, self.seq_lens_list, strict=True))
        return 4.0 * d * hq * pairs

    def call(self, kind: str = "bf16"):
        return paged_call(self.q, self.kc, self.vc, self.table, self.seq_lens, self.starts,
                          self.scale, True, max_seq_len=self.seq_len, max_query_len=self.q_len)

    def reference(self) -> torch.Tensor:
        """fp32 attention [T, Hq, D], one sequence at a time."""
        hq, _, d = self.geo
        out = torch.empty(self.q.shape, device=self.q.device, dtype=torch.float32)
        starts = self.starts.tolist()
        for b, length in enumerate(self.seq_lens_list):
            q4 = self.q[starts[b]:starts[b + 1]].transpose(0, 1)[None]
            k, v = (bp.gather(c, self.table[b:b + 1])[:, :, :length] for c in (self.kc, self.vc))
            out[starts[b]:starts[b + 1]] = bp.fp32_attention(q4, k, v, self.scale)[0] \
                .transpose(0, 1)
        return out


def run_backend(name: str, call) -> torch.Tensor:
    out = torch.empty_like(call.query)
    get_backend(name).run(call, out, None)
    return out


def host_us(fn: Callable[[], object], calls: int = 20) -> float:
    """CPU time to enqueue one call (the GPU still busy with the earlier ones)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def methods(case) -> dict[str, tuple[str, Callable[[], torch.Tensor]]]:
    """name -> (output layout "bhqd" or "thd", zero-argument callable)."""
    out: dict = {}
    if not isinstance(case, MixedCase):
        out.update({f"SDPA {p}": ("bhqd", lambda p=p: bp.sdpa_contiguous(case, p))
                    for p in PEERS})
    call = case.call("bf16")
    for name in BACKENDS:
        out[name] = ("thd", lambda name=name: run_backend(name, call))
    if flashinfer_paged.version():
        out.update({f"flashinfer {b}": ("thd", flashinfer_peer(call, b))
                    for b in flashinfer_paged.BACKENDS})
    return out


def flashinfer_peer(call, backend: str) -> Callable[[], torch.Tensor]:
    """FlashInfer's run on ``call``, planned at its first call (which the first-call time
    then holds, with its module's load); the timed calls are runs alone."""
    planned: list = []

    def run() -> torch.Tensor:
        if not planned:
            planned.append(flashinfer_paged.Paged(call, backend))
        return planned[0].run()

    return run


def run_cases(cases: list, budget: float) -> list[dict]:
    rows = []
    deadline = time.time() + budget
    for gname, make in cases:
        if time.time() > deadline:
            rows.append({"geometry": gname, "error": "skipped: out of time"})
            continue
        case = make()
        ref = case.reference() if isinstance(case, MixedCase) else \
            case.tokens(bp.fp32_attention(case.q4, case.k_c, case.v_c, case.scale))
        base = {"geometry": gname, "geo": list(case.geo), "case": case.name,
                "batch": case.batch, "seq_len": case.seq_len, "q_len": case.q_len}
        for name, (layout, fn) in methods(case).items():
            row = {**base, "method": name}
            try:
                t = time.time()
                got = fn()
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t, 3)
                row["err"] = bp.rel_err(case.tokens(got) if layout == "bhqd" else got, ref)
                del got
                row["ms"], row["captured"] = bp.timed(fn)
                row["tflops"] = case.flops() / (row["ms"] * 1e-3) / 1e12
                if name in BACKENDS:
                    row["host_us"] = host_us(fn)
            except Exception as exc:  # a peer that does not run this case
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                traceback.print_exc()
            rows.append(row)
            print(line(row), flush=True)
        del case, ref
        torch.cuda.empty_cache()
    return rows


def line(row: dict) -> str:
    head = f"{row['geometry']:10s} {row.get('case', ''):22s} {row.get('method', ''):16s}"
    if "error" in row:
        return f"{head} {row['error']}"
    extra = f" host_us {row['host_us']:.1f}" if "host_us" in row else ""
    return f"{head} {row['ms']:8.3f} ms {row['tflops']:6.0f} TF/s err {row['err']:.2e}{extra}"


def table(rows: list[dict]) -> str:
    """Markdown: ms (TFLOP/s) per method and case, then our faster kernel's time over the
    fastest library's."""
    names = list(dict.fromkeys(r["method"] for r in rows if "method" in r))
    keys = list(dict.fromkeys((r["geometry"], r["case"]) for r in rows if "case" in r))
    by = {(r["geometry"], r["case"], r["method"]): r for r in rows if "method" in r}
    libraries = [n for n in names if n not in OURS and not n.startswith("SDPA")]
    lines = ["| geometry | case | " + " | ".join(names) + " | ours / library time |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for g, c in keys:
        cells = []
        for n in names:
            r = by.get((g, c, n), {})
            cells.append(f"{r['ms']:.3g} ({r['tflops']:.0f})" if "ms" in r else "-")
        ours, lib = (min((by[g, c, n]["ms"] for n in group if "ms" in by.get((g, c, n), {})),
                         default=None) for group in (OURS, libraries))
        ratio = f"{ours / lib:.2f}x" if ours and lib else "-"
        lines.append(f"| {g} | {c} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


# --- the other terms of the comparison ------------------------------------------------------

def check_capture(name: str, call) -> dict:
    """100 replays of the call captured as every timed entry is (timing.captured: warmed
    up, so built and compiled, outside the graph) equal the eager call."""
    eager = run_backend(name, call)
    out = torch.empty_like(call.query)
    backend = get_backend(name)
    graph = timing.captured(lambda: backend.run(call, out, None))
    return {"replays_equal_eager": timing.replays_equal(graph, out, eager)}


def check_sync(name: str, call) -> dict:
    """torch's sync debug mode raises on any host synchronisation inside the call."""
    run_backend(name, call)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_backend(name, call)
        verdict = "no host sync"
    except RuntimeError as exc:
        verdict = f"synchronizes: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"sync": verdict}


def check_compile(name: str, geo: tuple[int, int, int]) -> dict:
    """A compiled caller (dynamic=True) of the op forced to ``name``, on one cache with a
    varying token count: recompiles, cuDNN graphs built, first-call seconds, error."""
    hq, hkv, d = geo
    torch._dynamo.reset()
    ops = torch.ops.pagedfuse

    def attend(q, k, v, table, lens, starts):  # no hints: buckets follow the token count
        return ops.paged_attention(q, k, v, table, lens, starts, d ** -0.5, True)

    compiled = torch.compile(attend, dynamic=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    builds = cudnn_paged.builds
    blocks = 4 * 4096 // bp.PAGE
    kc, vc = (torch.randn(blocks, bp.PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
              for _ in "kv")
    table = torch.randperm(blocks, device="cuda").view(4, -1).to(torch.int32)
    firsts, errs = [], []
    try:
        with envs.overridden("PAGEDFUSE_BACKEND", name):
            for chunk in (64, 200, 512, 777, 1024):
                q_lens = [chunk, chunk // 2, 1, 7]
                lens = torch.tensor([2048 + n for n in q_lens], device="cuda",
                                    dtype=torch.int32)
                starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                      device="cuda", dtype=torch.int32)
                q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
                args = (q, kc, vc, table, lens, starts)
                torch.cuda.synchronize()
                t = time.time()
                got = compiled(*args)
                torch.cuda.synchronize()
                firsts.append(round(time.time() - t, 3))
                errs.append(bp.rel_err(got, attend(*args).float()))
        verdict = {"recompiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]
                   - frames, "first_call_s": firsts, "err_vs_eager_max": max(errs)}
    except Exception as exc:
        verdict = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        traceback.print_exc()
    verdict["cudnn_graphs_built"] = cudnn_paged.builds - builds
    return verdict


def cudnn_rows_without_keys() -> dict:
    """What cuDNN itself leaves in rows that read no key (its call without the backend's
    zeroing): a sequence with no keys, and under causal 5 queries over 3 keys."""
    starts = [0, 2, 7, 12]
    q = torch.randn(12, 8, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(8, 16, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    table = torch.arange(8, device="cuda", dtype=torch.int32).view(4, 2)[:3]
    call = paged_call(q, kc, vc, table, torch.tensor([0, 3, 20], device="cuda",
                                                     dtype=torch.int32),
                      torch.tensor(starts, device="cuda", dtype=torch.int32), 0.1, True)
    zero = cudnn_paged.zero_rows_without_keys
    cudnn_paged.zero_rows_without_keys = lambda call, out: None
    try:
        out = torch.full_like(q, 7.0)
        get_backend("cudnn_prefill").run(call, out, None)
    finally:
        cudnn_paged.zero_rows_without_keys = zero
    rows = {"no keys (L=0)": out[0:2], "causal, before the first key": out[2:4]}

    def what(t: torch.Tensor) -> str:
        if torch.isnan(t).all():
            return "NaN"
        if (t == 0).all():
            return "zeros"
        return "unwritten" if (t == 7.0).all() else "other values"

    return {k: what(v) for k, v in rows.items()}


def install_weight(wheel: str | None) -> dict:
    out: dict = {}
    if wheel and Path(wheel).exists():
        out["frontend_wheel_mb"] = round(Path(wheel).stat().st_size / 2**20, 1)
    for dist in ("nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "triton", "flashinfer-python"):
        try:
            files = importlib.metadata.files(dist) or []
            size = sum((f.size or 0) for f in files)
            out[f"{dist}_installed_mb"] = round(size / 2**20, 1)
            out[f"{dist}_version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[f"{dist}_installed_mb"] = None
    t = subprocess.run([sys.executable, "-c", "import time; t = time.time(); import torch; "
                        "u = time.time(); import cudnn; print(time.time() - u)"],
                       capture_output=True, text=True, timeout=120)
    out["import_cudnn_s_after_torch"] = t.stdout.strip() or t.stderr[-200:]
    return out


def engine_of_a_graph() -> dict:
    """Which engine served the graphs built so far (None: the cuDNN library itself)."""
    out = {}
    for key, built in list(cudnn_paged._GRAPHS.items())[:3]:
        g = built.graph
        try:
            name = g.get_plan_name_at_index(g._plan_index)
        except Exception as exc:  # a private index: best effort for the record
            name = f"? ({type(exc).__name__})"
        out[f"d{key.head_dim} hq{key.num_q_heads} b{key.batch} s{key.query_rows}"] = {
            "python_engine": getattr(g.selected_engine, "name", None), "plan": name,
            "workspace": built.workspace}
    return out


def host_split(geo: tuple[int, int, int]) -> dict:
    """CPU µs per eager call of each part of a cudnn_prefill call, and of alternative ways of
    handing cuDNN the buffers (the ordered ``tensor_uids`` form, torch tensors instead of
    addresses); 16 sequences of 64 queries over 4K (the cases' rows hold triton_prefill's
    whole call)."""
    call = bp.Case(geo, 16, 4096, 64, light=True).call("bf16")
    out = torch.empty_like(call.query)
    key = cudnn_paged.graph_key(call)
    run_backend("cudnn_prefill", call)
    built = cudnn_paged.graph_for(key)
    handle = cudnn_paged._handle(key.device)
    buffers = cudnn_paged.metadata(call, key)
    buffers.update({cudnn_paged.Uid.Q: call.query, cudnn_paged.Uid.K: call.key_cache,
                    cudnn_paged.Uid.V: call.value_cache, cudnn_paged.Uid.OUT: out})
    ws = torch.empty(max(built.workspace, 1), dtype=torch.uint8, device="cuda")
    ptrs = {uid: t.data_ptr() for uid, t in buffers.items()}
    uids = tuple(buffers)
    parts = {
        "cudnn_prefill call": lambda: get_backend("cudnn_prefill").run(call, out, None),
        "graph_key": lambda: cudnn_paged.graph_key(call),
        "metadata (torch ops)": lambda: cudnn_paged.metadata(call, key),
        "execute (addresses)": lambda: built.graph.execute(ptrs, ws.data_ptr(), handle=handle),
        "execute (tensors)": lambda: built.graph.execute(buffers, ws, handle=handle),
        "execute (ordered)": lambda: built.graph.execute(tuple(buffers.values()), ws,
                                                         handle=handle, tensor_uids=uids),
        "zero_rows_without_keys": lambda: cudnn_paged.zero_rows_without_keys(call, out),
    }
    result = {}
    for name, fn in parts.items():
        try:
            result[name] = round(host_us(fn, 50), 1)
        except Exception as exc:
            result[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return result


def checks(geo: tuple[int, int, int], wheel: str | None) -> dict:
    case = bp.Case(geo, 4, 4096, 512, light=True)
    call = case.call("bf16")
    out: dict = {"geometry": list(geo), "case": case.name}
    for name in BACKENDS:
        entry: dict = {}
        for check in (check_capture, check_sync):
            try:
                entry.update(check(name, call))
            except Exception as exc:
                entry[check.__name__] = f"{type(exc).__name__}: {str(exc)[:200]}"
                traceback.print_exc()
        entry["compile_dynamic"] = check_compile(name, geo)
        out[name] = entry
        print(name, json.dumps(entry), flush=True)
    if flashinfer_paged.version():
        out["flashinfer"] = flashinfer_paged.checks(
            call, lambda q_len: bp.Case(geo, 4, 4096, q_len, light=True).call("bf16"))
        print("flashinfer", json.dumps(out["flashinfer"]), flush=True)
    for name, fn in (("host_us", lambda: host_split(geo)),
                     ("cudnn_rows_without_keys", cudnn_rows_without_keys),
                     ("install", lambda: install_weight(wheel)),
                     ("cudnn_engine", engine_of_a_graph)):
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            traceback.print_exc()
        print(name, json.dumps(out[name]), flush=True)
    return out


def case_list(geometries: list[str], mixed: bool) -> list:
    cases = [(g, lambda g=g, c=c: bp.Case(bp.GEOMETRIES[g], *c)) for g in geometries
             for c in bp.CASES]
    if mixed:
        cases += [(g, lambda g=g: MixedCase(bp.GEOMETRIES[g], **MIXED)) for g in geometries]
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows, the checks and the environment here")
    ap.add_argument("--geometries", nargs="+", default=list(bp.GEOMETRIES))
    ap.add_argument("--budget", type=float, default=150, help="seconds for the cases")
    ap.add_argument("--no-mixed", action="store_true")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--wheel", help="the frontend wheel, for its size")
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--host-only", action="store_true", help="only the host-time split")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args()
    if args.host_only:
        print(json.dumps(host_split(bp.GEOMETRIES["llama3_8b"]), indent=1))
        return
    jobs = [(bp.GEOMETRIES[g], *c, "bf16", "half", None, {}) for g in args.geometries
            for c in bp.CASES]
    bp.precompile(jobs, args.workers)
    if args.precompile_only:
        return
    import cudnn
    import triton

    env = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__,
           "cudnn_frontend": cudnn.__version__, "cudnn_backend": cudnn.backend_version(),
           "torch_cudnn": torch.backends.cudnn.version(), "flashinfer": flashinfer_paged.version(),
           "python": platform.python_version(),
           "argv": sys.argv[1:], "timing": "graph replay"}
    print(env, flush=True)
    rows = run_cases(case_list(args.geometries, not args.no_mixed), args.budget)
    print(table(rows))
    record = {"env": env, "rows": rows}
    for part in ("rows", "checks"):  # written after each part: a time limit keeps the first
        if part == "checks":
            if args.no_checks:
                break
            record["checks"] = checks(bp.GEOMETRIES["llama3_8b"], args.wheel)
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
