"""A timeline of the CUDA C++ decode's CTAs at the missed target points: where a call's time
goes between the graph launch, the CTAs' tiles, the merge of their warps and the last CTA.

Needs the profiling build of the library (per-CTA %globaltimer stamps):

    PAGEDFUSE_CUDA_ARCH=90 PAGEDFUSE_NVCC_FLAGS=-DPF_CTA_CLOCK \\
        pip install --no-build-isolation --no-deps -e .
    python benchmarks/tuning/cta_clock.py

Each default call is captured in a CUDA graph and replayed after a 256 MB zeroing L2 flush
(as the table's do_bench does); the line reports the median replay's event time, and from
that replay's stamps the kernel's span (first CTA start to last CTA end), the spread of CTA
starts and ends, the median time from warp 0's last tile to the CTA's end (the other warps'
last tiles, then the merge), and the share of SM time (all SMs) with no CTA running once
an SM's last CTA ended.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import torch  # noqa: E402
from decode_cases import GEOMETRIES, Case, pf_call  # noqa: E402
from decode_sweeps import default_launch  # noqa: E402
from timing import captured, flush_buffer, replay_us  # noqa: E402

from pagedfuse.ops import cuda as pf_cuda  # noqa: E402
from pagedfuse.ops import cuda_native  # noqa: E402

POINTS = (("llama3_8b", 64, 8192, ("int8_kv", "bf16")), ("llama3_8b", 8, 32768, ("int8_kv",)),
          ("llama3_8b", 8, 8192, ("bf16", "int8_kv")), ("qwen35", 8, 8192, ("bf16",)))
REPLAYS = 7


def stamps(lib: ctypes.CDLL, ctas: int) -> torch.Tensor:
    """[ctas, 4] float64: start, warp 0's tiles done, end (µs from the first start), SM."""
    buf = (ctypes.c_ulonglong * (4 * ctas))()
    err = lib.pagedfuse_cta_clock(buf, ctas)
    if err:
        raise RuntimeError(lib.pagedfuse_cuda_error_string(err).decode())
    t = torch.tensor(list(buf), dtype=torch.float64).view(ctas, 4)
    t[:, :3] = (t[:, :3] - t[:, 0].min()) / 1e3
    return t


def timeline(case: Case, kind: str, lib: ctypes.CDLL, flush: torch.Tensor) -> str:
    """One line: the default call of ``kind`` on ``case``, timed and stamped."""
    config, splits = default_launch(case, kind)
    ctas = case.geo[1] // config.heads * case.batch * splits
    sms = pf_cuda.sm_count(case.q.device)
    graph = captured(lambda: pf_call(case, kind))
    runs = [(replay_us(graph, flush.zero_), stamps(lib, ctas)) for _ in range(REPLAYS)]
    event_us, t = sorted(runs, key=lambda run: run[0])[REPLAYS // 2]
    start, tiles, end, sm = t.unbind(1)
    span = end.max().item()
    last_end = torch.zeros(int(sm.max()) + 1, dtype=torch.float64).scatter_reduce(
        0, sm.long(), end, "amax")
    last_end = last_end[last_end > 0]  # per SM that ran a CTA (SM ids may skip some)
    idle = ((span - last_end).sum().item() + (sms - len(last_end)) * span) / (sms * span)
    return (f"heads per CTA {config.heads}, splits {splits}, {ctas} CTAs on "
            f"{len(last_end)} SMs: event {event_us:.1f} µs, kernel span {span:.1f}; "
            f"starts {start.min():.1f}-{start.max():.1f}; ends {end.min():.1f}-{span:.1f} "
            f"(median {end.median():.1f}); warp 0's last tile to CTA end, median "
            f"{(end - tiles).median():.2f}; SM time idle after its last CTA {100 * idle:.1f}%")


def main() -> None:
    lib = cuda_native.library()
    if lib is None or not hasattr(lib, "pagedfuse_cta_clock"):
        raise SystemExit("needs the library built with PAGEDFUSE_NVCC_FLAGS=-DPF_CTA_CLOCK")
    lib.pagedfuse_cta_clock.argtypes = [ctypes.c_void_p, ctypes.c_int]
    flush = flush_buffer()
    torch.manual_seed(0)
    for gname, batch, length, kinds in POINTS:
        case = Case(GEOMETRIES[gname], batch, length)
        for kind in kinds:
            print(f"{gname} B={batch} L={length} {kind}: {timeline(case, kind, lib, flush)}",
                  flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
