"""bench_decode's recorded tables are data: --replot must read back what markdown() wrote,
whatever columns a table of an older run had, and redraw its plot without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench_decode = pytest.importorskip("bench_decode")
pytest.importorskip("matplotlib")


def _table(columns: list[str], rows: list[dict]) -> str:
    """A table in markdown()'s layout: geometry, B, L, KV GB, then one cell per method."""
    short = dict(zip(bench_decode.METHOD_ORDER, bench_decode.SHORT, strict=True))
    head = ["geometry", "B", "L", "KV GB", *(short[m] for m in columns), "pf err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [bench_decode.geometry_name(r["geo"]), str(r["B"]), str(r["L"]), "1.00",
                 *(bench_decode._fmt(r, m) for m in columns), "1.0e-03"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nnot a table row\n"


def _row(geo: str, batch: int, length: int, us: dict[str, float | None]) -> dict:
    return {"geo": bench_decode.GEOMETRIES[geo], "B": batch, "L": length,
            "contig_backend": "cudnn", "us": us,
            "floor": {m: 0.5 + 0.01 * i for i, m in enumerate(us) if us[m] is not None},
            "err": {}}


def test_rows_read_back_what_the_table_printed():
    methods = [m for m in bench_decode.METHOD_ORDER if m != "FlexAttention paged"]
    rows = [_row("llama3_8b", 64, 8192, {m: 100.0 + i for i, m in enumerate(methods)}),
            _row("qwen35", 1, 1536, {**{m: 12.5 for m in methods}, "pagedfuse INT8 K": None})]
    text = _table(methods, rows) + _table(bench_decode.METHOD_ORDER, rows[:1])
    got = bench_decode.rows_from_markdown(text)  # the first table only; an old column set
    assert [(r["geo"], r["B"], r["L"]) for r in got] == [(r["geo"], r["B"], r["L"])
                                                         for r in rows]
    for want, have in zip(rows, got, strict=True):
        printed = {m: u for m, u in want["us"].items() if u is not None}
        assert have["us"] == pytest.approx(printed, abs=0.05)
        assert have["floor"] == pytest.approx({m: want["floor"][m] for m in printed},
                                              abs=0.005)
    assert "pagedfuse INT8 K" not in got[1]["us"]  # "n/a" is no point


def test_replot_draws_the_section_asked_for(tmp_path):
    rows = [_row("tinyllama", b, n, {m: 50.0 * b for m in bench_decode.METHOD_ORDER})
            for b in (1, 8) for n in (1536, 8192)]
    doc = tmp_path / "results.md"
    doc.write_text("## GPU decode (2026-11-30, NVIDIA H200, torch 2.11)\n\nCopy bandwidth "
                   "(read + write) measured in the same run: 4.29 TB/s.\n\n"
                   + _table(bench_decode.METHOD_ORDER, rows[:1])
                   + "\n### Later run\n\n... measured in the same run: 4.10 TB/s.\n\n"
                   + _table(bench_decode.METHOD_ORDER, rows))
    out = tmp_path / "plot.png"
    drawn = bench_decode.replot(str(doc), "### Later run", str(out))
    assert [(r["B"], r["L"]) for r in drawn] == [(1, 1536), (1, 8192), (8, 1536), (8, 8192)]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="Missing"):
        bench_decode.replot(str(doc), "### Missing", str(out))


def test_markdown_reads_back_and_lists_failures_and_b1_latency(monkeypatch):
    """markdown() itself (its GPU facts stubbed): the rows read back, a failed method is a
    note with its message, and the B=1 latency block comes with B=1 rows only."""
    from types import SimpleNamespace

    monkeypatch.setattr(bench_decode.torch.cuda, "get_device_name", lambda: "Test GPU")
    monkeypatch.setattr(bench_decode, "triton", SimpleNamespace(__version__="0"))
    monkeypatch.setattr(bench_decode, "_native_path", lambda kind: "CUDA C++")
    us = {m: 40.0 + i for i, m in enumerate(bench_decode.METHOD_ORDER)}
    big = {**_row("llama3_8b", 64, 8192, {**us, "FlexAttention paged": None}), "kv_gb": 2.15}
    big["err"] = {"FlexAttention paged": "InductorError: boom"}
    small = {**_row("tinyllama", 1, 1536, us), "kv_gb": 0.0, "cudnn_us": 80.0,
             "pf_eager_us": 150.0}

    text = bench_decode.markdown([big], 4.2e12, "bench", 1.0)
    assert [(r["B"], r["L"]) for r in bench_decode.rows_from_markdown(text)] == [(64, 8192)]
    assert "- FlexAttention paged (llama3_8b B=64 L=8192): InductorError: boom" in text
    assert "B=1 latency" not in text

    text = bench_decode.markdown([big, small], 4.2e12, "bench", 1.0)
    read = bench_decode.rows_from_markdown(text)
    assert read[1]["us"] == pytest.approx(us)
    line = f"- tinyllama B=1 L=1536: pagedfuse {us['pagedfuse bf16']:.1f} vs cuDNN 80.0 "
    assert line + f"({us['pagedfuse bf16'] / 80:.2f}x); eager op call 150.0" in text


def test_fixed_part_and_rate_come_back_from_two_timings():
    """The overhead sweep's split of a kernel's time: fixed + bytes / rate."""
    fixed, rate = 20.0, 4.3e12
    timing = [(fixed + b / rate * 1e6, b) for b in (1.1e9, 4.4e9)]
    got_fixed, got_rate = bench_decode.fixed_and_rate(*timing[0], *timing[1])
    assert got_fixed == pytest.approx(fixed) and got_rate == pytest.approx(rate)
