"""bench_fidelity.py --resume: a record cut short is continued only by a run that measures the
same thing (text, settings, device); its runs are kept and its commands listed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_fidelity as bf  # noqa: E402


def _run(cache: str, path: str, ppl: float) -> bf.RunResult:
    return bf.RunResult(cache, path, ppl, ppl + 1.0, ppl - 1.0, 0.75, "-", 0, 1.5,
                        [ppl, ppl + 0.25], [ppl - 0.5, ppl])


def _args(tmp_path: Path, *extra: str):
    return bf.parse_args(["--tokens", "2048", "--json", str(tmp_path / "r.json"), "--resume",
                          *extra])


def test_resume_keeps_the_runs_and_commands_of_the_same_measurement(tmp_path):
    args = _args(tmp_path)
    runs = [_run("fp32", "eager", 12.5), _run("int8", "eager", 12.75)]
    bf.write_record(args, ["first command"], "cpu-x", "sha-a", 3, runs, bf.checks(runs))
    commands, kept = bf.resumed_runs(args, "cpu-x", "sha-a")
    assert commands == ["first command"]
    assert kept == runs
    assert bf.resumed_runs(_args(tmp_path / "none"), "cpu-x", "sha-a") == ([], [])


@pytest.mark.parametrize(("extra", "device_name", "sha", "named"), [
    (("--prefill", "256"), "cpu-x", "sha-a", "prefill"),
    (("--dtype", "bf16"), "cpu-x", "sha-a", "dtype"),
    ((), "cpu-y", "sha-a", "device_name"),
    ((), "cpu-x", "sha-b", "text"),
])
def test_resume_refuses_a_record_of_another_measurement(tmp_path, extra, device_name, sha,
                                                        named):
    runs = [_run("fp32", "eager", 12.5)]
    bf.write_record(_args(tmp_path), ["first"], "cpu-x", "sha-a", 3, runs, bf.checks(runs))
    with pytest.raises(SystemExit, match=named):
        bf.resumed_runs(_args(tmp_path, *extra), device_name, sha)


def test_resume_needs_a_record_to_continue():
    with pytest.raises(SystemExit):
        bf.parse_args(["--resume"])
