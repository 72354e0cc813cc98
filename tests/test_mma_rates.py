"""benchmarks/mma_rates.py's arithmetic: int8's rate over bf16's, and the MMA-bound speed-up
of INT8 K (int8 Q·K^T, 16-bit P·V) that it allows; the committed record agrees with it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import mma_rates  # noqa: E402


def _row(method: str, n: int, kind: str, tops: float) -> dict:
    return {"method": method, "n": n, "kind": kind, "tops": tops}


def test_the_ceiling_is_bf16s_time_over_int8_ks_matrix_time():
    rows = [_row("loop", 64, "bf16", 800.0), _row("loop", 64, "int8", 1760.0),
            _row("loop", 64, "fp8", 1200.0), _row("gemm", 1, "int8", 900.0)]
    got = {(c["method"], c["kind"]): c for c in mma_rates.ceilings(rows)["ceilings"]}
    assert set(got) == {("loop", "int8"), ("loop", "fp8")}  # no bf16 row: no ratio
    int8 = got[("loop", "int8")]
    assert int8["ratio"] == pytest.approx(2.2)
    # Q·K^T at 2.2x bf16's rate, P·V at bf16's: (0.5 / 2.2 + 0.5) of bf16's time
    assert int8["int8_k_ceiling"] == pytest.approx(1 / (0.5 / 2.2 + 0.5))
    assert int8["reaches_bar"] and not got[("loop", "fp8")]["reaches_bar"]  # 1.375x, 1.2x


def test_the_record_holds_its_rows_ceilings():
    path = max(BENCHMARKS.glob("results/mma_rates_*.json"))
    record = json.loads(path.read_text())
    again = mma_rates.ceilings(record["rows"])["ceilings"]
    assert len(again) == len(record["ceilings"]) > 0
    for want, got in zip(record["ceilings"], again, strict=True):
        assert want["method"] == got["method"] and want["kind"] == got["kind"]
        assert math.isclose(want["int8_k_ceiling"], got["int8_k_ceiling"])
