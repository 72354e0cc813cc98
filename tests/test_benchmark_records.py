"""benchmarks/README.md's tables are generated from the records under benchmarks/results/:
the README must match what summarize.py makes of them, each benchmark's newest record is
the one shown, and a record carried over from an older log says so."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import summarize  # noqa: E402


def test_readme_tables_are_the_records():
    assert summarize.main(["--check"]) == 0


def test_every_benchmark_has_a_current_record():
    for summary in summarize.SUMMARIES:
        assert summary.newest(), f"{summary.script}: no record under benchmarks/results/"


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(summarize, "RESULTS", tmp_path)
    monkeypatch.setattr(summarize, "HERE", tmp_path.parent)
    return tmp_path


def _decode_record(results: Path, name: str, date: str, us: float, source: str | None):
    record = json.loads((BENCHMARKS / "results" / "decode_h200_2026-11-30.json").read_text())
    record["env"]["date"] = date
    record["env"].pop("source", None)
    if source:
        record["env"]["source"] = source
    record["rows"] = record["rows"][:1]
    record["rows"][0]["us"]["pagedfuse bf16"] = us
    (results / name).write_text(json.dumps(record))


def test_the_newest_record_is_shown_and_a_carried_over_one_says_so(results):
    _decode_record(results, "decode_a.json", "2026-12-05", 12.5, None)
    _decode_record(results, "decode_b.json", "2026-11-30", 99.0, "from an old log")
    text = summarize.section(summarize.SUMMARIES[0])
    assert "**2026-12-05**" in text and "12.5 (" in text
    assert "99.0" not in text and "Carried over" not in text
    _decode_record(results, "decode_c.json", "2026-12-07", 7.5, "from an old log")
    text = summarize.section(summarize.SUMMARIES[0])
    assert "**2026-12-07**" in text and "*Carried over: from an old log.*" in text


def test_a_benchmark_without_a_record_says_it_awaits_its_run(results):
    assert "awaits its first run" in summarize.section(summarize.SUMMARIES[0])


def test_a_plot_beside_the_record_is_shown(results):
    _decode_record(results, "decode_a.json", "2026-12-05", 12.5, None)
    shutil.copy(BENCHMARKS / "results" / "decode_h200_2026-11-30.png", results / "decode_a.png")
    assert f"({results.name}/decode_a.png)" in summarize.section(summarize.SUMMARIES[0])


def _prefill_record(timing: str | None, captured: bool | None) -> dict:
    record = json.loads((BENCHMARKS / "results" / "prefill-subset_h200_2026-12-02_graph_timing"
                         ".json").read_text())
    record["env"].pop("timing")
    if timing:
        record["env"]["timing"] = timing
    for row in record["rows"]:
        row.pop("captured", None)
        if captured is not None and row["method"] == "gluon bf16 ws":
            row["captured"] = captured
    return record


def test_the_prefill_table_says_how_its_record_was_timed():
    """A record of graph replays says so, and marks an entry timed by plain calls; an older
    record (no "timing") says its times include the host's cost of a call."""
    _, graphed = summarize.prefill(_prefill_record("graph replay", False))
    assert graphed.startswith("GPU time per call (do_bench medians of CUDA graph replays")
    marked = [line for line in graphed.splitlines() if "(plain calls)" in line]
    assert len(marked) == 6 and all(line.startswith("| ") for line in marked)
    _, plain = summarize.prefill(_prefill_record(None, None))
    assert plain.startswith("ms per call (do_bench medians of plain calls, the host's cost")
    assert "(plain calls)" not in plain.split("\n\n", 1)[1]
