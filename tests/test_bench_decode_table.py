"""bench_decode's records are data: a run's JSON must read back into the rows it timed, print
the table without a GPU (failed methods noted with their message, B=1 latencies with B=1 rows
only) and redraw its plot; the overhead sweep's split of a time into fixed part and rate must
invert two timings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench_decode = pytest.importorskip("bench_decode")
import timing  # noqa: E402

ENV = {"date": "2026-11-30", "gpu": "Test GPU", "torch": "2.11", "triton": "3.6",
       "python": "3.12", "command": "python benchmarks/bench_decode.py", "seconds": 100,
       "copy_bandwidth_tbs": 4.29, "flush": "zero",
       "default_paths": {k: "CUDA C++" for k in ("bf16", "int8_kv", "int8_k")}}


def _row(geo: str, batch: int, length: int, us: dict[str, float | None]) -> dict:
    return {"geo": list(bench_decode.GEOMETRIES[geo]), "B": batch, "L": length,
            "kv_gb": 2.15, "contig_backend": "cudnn", "us": us,
            "floor": {m: 0.5 + 0.01 * i for i, m in enumerate(us) if us[m] is not None},
            "err": {m: 1e-3 for m in us if us[m] is not None}}


def _record(tmp_path, rows) -> Path:
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"benchmark": "decode", "env": ENV, "rows": rows}))
    return path


def test_a_record_reads_back_and_prints_its_table(tmp_path):
    us = {m: 40.0 + i for i, m in enumerate(bench_decode.METHOD_ORDER)}
    big = _row("llama3_8b", 64, 8192, {**us, "FlexAttention paged": None})
    big["err"]["FlexAttention paged"] = "InductorError: boom"
    small = {**_row("tinyllama", 1, 1536, us), "cudnn_us": 80.0, "pf_eager_us": 150.0}
    rows, env = bench_decode.load(_record(tmp_path, [big, small]))
    assert env == ENV
    assert [(r["geo"], r["B"], r["L"]) for r in rows] == [
        ((32, 8, 128), 64, 8192), ((32, 4, 64), 1, 1536)]
    text = bench_decode.markdown(rows, env)
    assert "GPU decode (2026-11-30, Test GPU, torch 2.11" in text
    assert "| llama3_8b | 64 | 8192 | 2.15 | 40.0 (50%) |" in text
    assert "- FlexAttention paged (llama3_8b B=64 L=8192): InductorError: boom" in text
    line = f"- tinyllama B=1 L=1536: pagedfuse {us['pagedfuse bf16']:.1f} vs cuDNN 80.0 "
    assert line + f"({us['pagedfuse bf16'] / 80:.2f}x); eager op call 150.0" in text
    assert "B=1 latency" not in bench_decode.markdown(rows[:1], env)


def test_replot_draws_a_recorded_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    rows = [_row("tinyllama", b, n, {m: 50.0 * b for m in bench_decode.METHOD_ORDER})
            for b in (1, 8) for n in (1536, 8192)]
    out = tmp_path / "plot.png"
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--replot",
                                      str(_record(tmp_path, rows)), "--plot", str(out)])
    bench_decode.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_record_of_another_benchmark_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"benchmark": "prefill", "env": {}, "rows": []}))
    with pytest.raises(ValueError, match="not a decode benchmark record"):
        bench_decode.load(path)


def test_fixed_part_and_rate_come_back_from_two_timings():
    """The overhead sweep's split of a kernel's time: fixed + bytes / rate."""
    fixed, rate = 20.0, 4.3e12
    times = [(fixed + b / rate * 1e6, b) for b in (1.1e9, 4.4e9)]
    got_fixed, got_rate = timing.fixed_and_rate(*times[0], *times[1])
    assert got_fixed == pytest.approx(fixed) and got_rate == pytest.approx(rate)
