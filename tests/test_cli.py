"""`pagedfuse demo | explain | bench`: argument handling, pass/fail rules, and the demo end to
end on the smallest case."""

from types import SimpleNamespace

import pytest
import torch

from pagedfuse import cli
from pagedfuse.models import PRESETS


def _parse(*argv: str):
    return cli.build_parser().parse_args(argv)


def test_default_demo_sweeps_every_preset_with_float_int8_and_alibi():
    cases = cli.select_cases(_parse("demo"))
    assert {c.preset for c in cases} == set(PRESETS)
    assert {(c.preset, c.kv_cache) for c in cases if not c.alibi} == \
        {(p, kv) for p in PRESETS for kv in ("fp32", "int8")}
    assert [c for c in cases if c.alibi] == [cli.Case("tinyllama", "fp32", alibi=True)]


def test_demo_flags_pick_one_case_and_all_picks_the_grid():
    args = _parse("demo", "--preset", "llama3", "--kv-cache", "int8", "--layout", "hnd",
                  "--steps", "3", "--batch", "4")
    assert cli.select_cases(args) == [cli.Case("llama3", "int8", False, "hnd")]
    assert (args.steps, args.batch, args.device, args.inner) == (3, 4, "cpu", "inductor")
    assert cli.select_cases(_parse("demo", "--alibi")) == [cli.Case("tinyllama", "fp32", True)]
    grid = cli.select_cases(_parse("demo", "--all"))
    assert len(grid) == len(set(grid)) == len(PRESETS) * 3 * 2 * 2


@pytest.mark.parametrize("argv, message", [
    (["demo", "--steps", "0"], "--steps: must be >= 1"),
    (["demo", "--kv-cache", "fp8"], "--kv-cache: invalid choice"),
    (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["explain", "--preset", "gpt5"], "--preset: invalid choice"),
    ([], "the following arguments are required: command"),
])
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_device_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--device", "cuda"])
    assert "no CUDA device available" in capsys.readouterr().err


def _result(kv_cache: str, sites: int, rewritten: int, err: float, agreement: float):
    report = SimpleNamespace(num_sites=sites, num_rewritten=rewritten)
    return cli.CaseResult(cli.Case("tinyllama", kv_cache), [report], err, agreement, 1.0, 1.0)


@pytest.mark.parametrize("result, failure", [
    (_result("fp32", 4, 4, 2e-3, 1.0), "logits error 2.00e-03 > 1e-03"),
    (_result("fp32", 4, 4, 1e-6, 0.95), "token agreement 0.95 < 1.0"),
    (_result("int8", 4, 4, 5e-2, 0.5), "token agreement 0.50 < 0.8"),
    (_result("bf16", 4, 3, 1e-2, 1.0), "3/4 attention sites rewritten"),
    (_result("fp32", 0, 0, 0.0, 1.0), "0/0 attention sites rewritten"),
    (_result("fp32", 4, 4, float("nan"), 1.0), "logits error nan"),
])
def test_case_fails_on_unrewritten_sites_error_or_agreement(result, failure):
    assert [f for f in result.failures() if f.startswith(failure)]
    assert failure in result.summary()


def test_case_within_tolerances_passes():
    result = _result("int8", 4, 4, 9e-2, 0.8)
    assert result.failures() == []
    assert result.summary().endswith("PASS")


def test_bench_dispatches_to_the_device_script(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert cli.main(["bench", "--reps", "3"]) == 0
    (cmd,) = calls
    assert cmd[1].endswith("benchmarks/bench_cpu.py") and cmd[2:] == ["--reps", "3"]


def test_bench_without_the_script_says_so(monkeypatch, capsys):
    monkeypatch.setitem(cli.BENCH_SCRIPTS, "cpu", "no_such_bench.py")
    assert cli.main(["bench"]) == 1
    assert "no_such_bench.py not found" in capsys.readouterr().err


def test_demo_smallest_case_end_to_end(monkeypatch, capsys):
    """Every attention site of the prefill and decode graphs is rewritten and the compiled
    logits match eager within the fp32 tolerance."""
    results = []

    def recording_run_demo(args):
        results.extend(run_demo(args))
        return results

    run_demo = cli.run_demo
    monkeypatch.setattr(cli, "run_demo", recording_run_demo)
    assert cli.main(["demo", "--preset", "tinyllama", "--steps", "2", "--batch", "2",
                     "--prompt-len", "12"]) == 0
    (result,) = results
    layers = PRESETS["tinyllama"].num_layers
    assert [(r.num_sites, r.num_rewritten) for r in result.reports] == [(layers, layers)] * 2
    assert result.max_rel_err <= cli.LOGITS_RTOL["fp32"]
    assert result.agreement == 1.0
    assert result.eager_tok_s > 0 and result.compiled_tok_s > 0
    out = capsys.readouterr().out
    assert out.count(f"{layers} attention site(s), {layers} rewritten") == 2
    assert "-> pagedfuse.paged_attention" in out
    assert "1/1 cases passed" in out


def test_explain_reports_the_decode_step(capsys):
    assert cli.main(["explain", "--preset", "llama3", "--kv-cache", "int8"]) == 0
    out = capsys.readouterr().out
    layers = PRESETS["llama3"].num_layers
    assert f"{layers} attention site(s), {layers} rewritten" in out
    assert "-> pagedfuse.paged_attention_int8" in out
