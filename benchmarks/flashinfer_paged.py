"""FlashInfer's paged prefill (``BatchPrefillWithPagedKVCacheWrapper``) as a measured peer of
bench_library_prefill.py: it reads the case's own NHD pages in place, through the page lists
FlashInfer takes (CSR: each sequence's used block ids in order, and the last page's fill),
built here from the call's block table. Never a dependency of pagedfuse: imported only where
``flashinfer`` is installed, for the measurement.

Its kernels compile with nvcc at first use. ``--build-ahead`` compiles the ones run here
on any machine with nvcc and installs them as FlashInfer's ahead-of-time artifacts, which it
then loads without a compiler (the H200 runs took them from the project's CPU machine):

    FLASHINFER_CUDA_ARCH_LIST=9.0a python benchmarks/flashinfer_paged.py --build-ahead 64 128 256

FlashInfer plans a batch from page lists on the host (its work split follows the lengths),
so a caller whose lengths live on the GPU, as the op's do, copies them to the host per batch,
a host sync; ``checks`` measures what plan and run themselves synchronise, capture in a CUDA
graph (plan outside, run inside) and tracing under torch.compile.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import time
import traceback
from pathlib import Path

import timing
import torch

WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace for split-KV partial results
BACKENDS = ("fa3", "fa2")  # its Hopper (FlashAttention-3 style) and its portable kernels


def version() -> str | None:
    """The installed flashinfer-python, or None."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return None
    return importlib.metadata.version("flashinfer-python")


def page_lists(call) -> dict[str, torch.Tensor]:
    """The call's lengths and block table as FlashInfer's host-side page lists."""
    page = call.key_cache.shape[1]
    lens = call.seq_lens.cpu().long()
    pages = (lens + page - 1) // page
    table = call.block_table.cpu()
    return {
        "qo_indptr": call.query_start_loc.cpu().int(),
        "paged_kv_indptr": torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)]).int(),
        "paged_kv_indices": torch.cat([table[b, :n] for b, n in enumerate(pages.tolist())]),
        "paged_kv_last_page_len": (lens - (pages - 1).clamp(min=0) * page).int(),
    }


class Paged:
    """One planned FlashInfer call of ``call``'s shape on kernel ``backend``; ``graph``: the
    wrapper's CUDA-graph mode (fixed device buffers, sized for this call)."""

    def __init__(self, call, backend: str, graph: bool = False):
        import flashinfer

        self.call = call
        lists = page_lists(call)
        buffers = {}
        if graph:
            buffers = {f"{name}_buf": torch.empty_like(t, device=call.device)
                       for name, t in lists.items()}
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=call.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=graph, backend=backend, **buffers)
        self.plan(lists)

    def plan(self, lists: dict[str, torch.Tensor]) -> None:
        geo = self.call.geometry
        self.wrapper.plan(
            **lists, num_qo_heads=geo.num_q_heads, num_kv_heads=geo.num_kv_heads,
            head_dim_qk=geo.head_dim, page_size=self.call.key_cache.shape[1],
            causal=self.call.causal, sm_scale=self.call.scale, q_data_type=self.call.query.dtype,
            kv_data_type=self.call.key_cache.dtype)

    def run(self, out: torch.Tensor | None = None) -> torch.Tensor:
        c = self.call
        return self.wrapper.run(c.query, (c.key_cache, c.value_cache), out=out)


def check_capture(call, backend: str) -> dict:
    """Plan outside, capture ``run``: 100 replays equal the eager call."""
    paged = Paged(call, backend, graph=True)
    eager = paged.run().clone()
    out = torch.empty_like(eager)
    paged.run(out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged.run(out)
    return {"replays_equal_eager": timing.replays_equal(graph, out, eager)}


def check_sync(call, backend: str) -> dict:
    """torch's sync debug mode over a plan from host lists, then a run. The lists themselves
    come from the op's device-side lengths and table, a copy to the host per batch."""
    paged = Paged(call, backend)
    paged.run()
    lists = page_lists(call)
    torch.cuda.synchronize()
    verdict = {}
    for part, fn in (("plan", lambda: paged.plan(lists)), ("run", paged.run)):
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            verdict[part] = "no host sync"
        except RuntimeError as exc:
            verdict[part] = f"synchronizes: {str(exc).splitlines()[0][:120]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return verdict


def check_compile(make_call, backend: str) -> dict:
    """``run`` inside one torch.compile(dynamic=True, fullgraph=True) function over three
    token counts, the wrapper planned again outside before each: recompiles, first-call
    seconds, or the error that stops it."""
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    paged, firsts = None, []

    def attend(q, k, v):
        return paged.wrapper.run(q, (k, v))

    compiled = torch.compile(attend, dynamic=True, fullgraph=True)
    try:
        for q_len in (256, 384, 512):
            call = make_call(q_len)
            if paged is None:
                paged = Paged(call, backend)
            paged.call = call
            paged.plan(page_lists(call))
            torch.cuda.synchronize()
            t = time.time()
            got = compiled(call.query, call.key_cache, call.value_cache)
            torch.cuda.synchronize()
            firsts.append(round(time.time() - t, 3))
            if not torch.equal(got, paged.run()):
                return {"error": f"compiled output differs from eager at q_len {q_len}"}
        return {"recompiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]
                - frames, "first_call_s": firsts}
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def checks(call, make_call) -> dict:
    """Every term for each kernel: capture, sync, compile."""
    out: dict = {"flashinfer_python": version()}
    for backend in BACKENDS:
        entry: dict = {}
        for name, check, arg in (("capture", check_capture, call), ("sync", check_sync, call),
                                 ("compile_dynamic", check_compile, make_call)):
            try:
                entry[name] = check(arg, backend)
            except Exception as exc:
                traceback.print_exc()
                entry[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        out[backend] = entry
    return out


def build_ahead(head_dims: list[int], dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Compile the modules Paged runs (both kernels; one per head dim, every mask mode) for
    FLASHINFER_CUDA_ARCH_LIST's targets and copy each into FlashInfer's ahead-of-time
    folder, where it is found before any compile. The spec's arguments are the ones its
    wrapper's plan passes for a bf16 cache without position encoding, window or cap."""
    from flashinfer.jit import env
    from flashinfer.jit.attention.modules import (
        _gen_batch_prefill_primary_module,
        gen_batch_prefill_module,
    )

    installed = []
    for d in head_dims:
        args = (dtype, dtype, dtype, torch.int32, d, d, 0, False, False, False, False)
        for spec in (gen_batch_prefill_module("fa3", *args),
                     _gen_batch_prefill_primary_module("fa2", *args)):
            t = time.time()
            spec.build()
            dest = env.FLASHINFER_AOT_DIR / spec.name / f"{spec.name}.so"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(spec.jit_library_path, dest)
            print(f"{spec.name}: {time.time() - t:.0f} s", flush=True)
            installed.append(dest)
    return installed


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="compile FlashInfer's paged prefill ahead of use")
    ap.add_argument("--build-ahead", type=int, nargs="+", metavar="HEAD_DIM", required=True)
    build_ahead(ap.parse_args().build_ahead)
