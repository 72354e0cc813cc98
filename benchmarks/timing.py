"""The GPU timing harness every decode benchmark and tuning sweep shares.

A method is timed as one call captured in a CUDA graph and replayed with the L2 flushed
before each replay, so the Python host cost of the call is left out and every method pays
the same harness. ``FLUSH`` picks the flush: "zero" (triton's do_bench: zeroing 256 MB, which
leaves the L2 full of dirty lines the timed call's reads must write back) or "read" (reading
256 MB, leaving clean lines, as a decode step's weight GEMMs do before attention). The floor
of a method is the bytes it must read over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch

try:  # timing needs Triton; --replot and the tests import the table script without it
    import triton
    import triton.testing
except ImportError:
    triton = None

FLUSH = "zero"  # how bench() clears the L2 before each timed replay (the scripts' --flush)


def copy_bandwidth(gb: float = 4.0) -> float:
    """Device-to-device copy: bytes read + written per second (the ceiling)."""
    src = torch.randn(int(gb * 1e9 / 4), device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200,
                                 return_mode="median")
    return 2 * gb * 1e9 / (ms * 1e-3)


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


def replays_equal(graph: torch.cuda.CUDAGraph, out: torch.Tensor, eager: torch.Tensor,
                  replays: int = 100) -> bool:
    """Whether every replay of ``graph`` writes ``eager`` into ``out`` (poisoned before each
    replay, so a graph that recorded nothing fails)."""
    same = True
    for _ in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        same &= bool(torch.equal(out, eager))
    return same


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


def fixed_and_rate(short_us: float, short_bytes: int, long_us: float,
                   long_bytes: int) -> tuple[float, float]:
    """(fixed µs, bytes per second) of time = fixed + bytes / rate through two timings."""
    rate = (long_bytes - short_bytes) / ((long_us - short_us) * 1e-6)
    return short_us - short_bytes / rate * 1e6, rate
