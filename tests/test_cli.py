"""`pagedfuse demo | explain | doctor | bench`: argument handling, pass/fail rules, the demo end
to end on the smallest case, explain on a user's function, doctor, --version and --help."""

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import pagedfuse
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
    timings = {p: cli.Timing(10.0, 1.0) for p in cli.PATHS}
    return cli.CaseResult(cli.Case("tinyllama", kv_cache), [report], err, agreement, timings)


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
    assert failure in result.row(cli.PATHS)[-1]


def test_case_within_tolerances_passes():
    result = _result("int8", 4, 4, 9e-2, 0.8)
    assert result.failures() == []
    assert result.row(cli.PATHS)[-1] == "PASS"


def test_summary_row_compares_pagedfuse_with_inductor_alone():
    result = _result("fp32", 4, 4, 1e-6, 1.0)
    result.timings = {"eager": cli.Timing(30.0, 10.0), "inductor": cli.Timing(20.0, 40.0),
                      "pagedfuse": cli.Timing(12.5, 100.0)}
    row = result.row(cli.PATHS)
    assert row[1:] == ["4/4", "1.0e-06 (tol 1e-03)", "100%", "30.0 / 20.0 / 12.5",
                       "10.0 / 40.0 / 100.0", "2.50x", "PASS"]
    lines = cli.summary_table([result, result], cli.PATHS).splitlines()
    assert lines[0].split("  ")[0] == "case" and "pagedfuse vs inductor" in lines[0]
    assert len(lines) == 3 and len({line.index("PASS") for line in lines[1:]}) == 1


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


def _demo(monkeypatch, *argv: str) -> tuple[list, str, str]:
    results = []

    def recording_run_demo(args):
        results.extend(run_demo(args))
        return results

    run_demo = cli.run_demo
    monkeypatch.setattr(cli, "run_demo", recording_run_demo)
    code = cli.main(["demo", "--preset", "tinyllama", "--steps", "2", "--batch", "2",
                     "--prompt-len", "12", *argv])
    assert code == 0
    return results


def test_demo_smallest_case_end_to_end(monkeypatch, capsys):
    """Every attention site of the prefill and decode graphs is rewritten, the compiled
    logits match eager within the fp32 tolerance, all three ways are timed, and the output
    is the summary table (the full reports only with --verbose), the progress on stderr."""
    (result,) = _demo(monkeypatch, "--inner", "inductor")
    layers = PRESETS["tinyllama"].num_layers
    assert [(r.num_sites, r.num_rewritten) for r in result.reports] == [(layers, layers)] * 2
    assert result.max_rel_err <= cli.LOGITS_RTOL["fp32"]
    assert result.agreement == 1.0
    assert set(result.timings) == set(cli.PATHS)
    assert all(t.prefill_ms > 0 and t.tok_s > 0 for t in result.timings.values())
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[1].startswith("case ") and "prefill ms (eager/inductor/pagedfuse)" in out[1]
    assert out[2].startswith("tinyllama kv=fp32 rope nhd") and out[2].endswith("PASS")
    assert out[3] == "1/1 cases passed"
    assert "attention site(s)" not in captured.out  # no full report without --verbose
    assert "fwd" in captured.err and "fwd" not in captured.out  # the progress bar's unit


def test_demo_verbose_adds_each_graphs_report_after_the_summary(monkeypatch, capsys):
    _demo(monkeypatch, "--inner", "eager", "--verbose")
    out = capsys.readouterr().out
    layers = PRESETS["tinyllama"].num_layers
    assert out.index("1/1 cases passed") < out.index("== tinyllama kv=fp32 rope nhd ==")
    assert out.count(f"{layers} attention site(s), {layers} rewritten") == 2
    assert "-> pagedfuse.paged_attention" in out
    assert "prefill ms (eager/pagedfuse)" in out  # --inner eager: no inductor column


def test_demo_failure_names_the_check_that_kept_a_site(monkeypatch, capsys):
    kept = pagedfuse.SiteReport("out", "paged_sdpa", checks=[
        pagedfuse.Check("match", True, "cache[index]"),
        pagedfuse.Check("head_dim", False, "head_dim 96 not in {64, 128, 256}")])
    result = _result("fp32", 1, 0, 1e-6, 1.0)
    result.reports = [pagedfuse.Report([kept], graph="graph 0/0")]
    args = cli.build_parser().parse_args(["demo"])
    args.steps = 2
    cli.print_demo([result], args)
    out = capsys.readouterr().out
    assert "0/1 cases passed" in out
    assert "kept out: head_dim: head_dim 96 not in {64, 128, 256}" in out


def test_explain_reports_the_decode_step(capsys):
    assert cli.main(["explain", "--preset", "llama3", "--kv-cache", "int8"]) == 0
    out = capsys.readouterr().out
    layers = PRESETS["llama3"].num_layers
    assert f"{layers} attention site(s), {layers} rewritten" in out
    assert "-> pagedfuse.paged_attention_int8" in out


_USER_MODULE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F

    def attend(q, kc, vc, bt):
        k = kc[bt].flatten(1, 2).transpose(1, 2)
        v = vc[bt].flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def example_inputs():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(2, 8, 1, HEAD_DIM, generator=g),
                torch.randn(8, 4, 2, HEAD_DIM, generator=g),
                torch.randn(8, 4, 2, HEAD_DIM, generator=g),
                torch.tensor([[0, 3], [5, 1]]))

    def as_keywords():
        q, kc, vc, bt = example_inputs()
        return {"q": q, "kc": kc, "vc": vc, "bt": bt}
""")


@pytest.mark.parametrize("head_dim, inputs, verdict", [
    (64, None, "1 rewritten"),
    (64, "as_keywords", "1 rewritten"),
    (48, None, "FAIL head_dim"),
])
def test_explain_takes_a_users_function_and_input_factory(tmp_path, capsys, head_dim, inputs,
                                                          verdict):
    path = tmp_path / "user_model.py"
    path.write_text(_USER_MODULE.replace("HEAD_DIM", str(head_dim)))
    argv = ["explain", f"{path}:attend"] + (["--inputs", f"{path}:{inputs}"] if inputs else [])
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "1 attention site(s)" in out and verdict in out


def test_explain_of_a_module_function_by_import_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "user_pkg_mod.py").write_text(_USER_MODULE.replace("HEAD_DIM", "64"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["explain", "user_pkg_mod:attend"]) == 0
    assert "1 attention site(s), 1 rewritten" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["explain", "no_colon"], "expected module:name"),
    (["explain", "os:no_such_function"], "os has no 'no_such_function'"),
    (["explain", "os.path:join"], "--inputs: not given, and"),
])
def test_explain_bad_targets_say_what_is_wrong(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_version_and_help_with_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == \
        f"pagedfuse {pagedfuse.__version__} (torch {torch.__version__})"
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: 512)" in help_text and "(default: inductor)" in help_text


def test_doctor_names_versions_libraries_and_the_backend_per_call(capsys):
    code = cli.main(["doctor"])
    out = capsys.readouterr().out
    from pagedfuse import doctor

    assert code == (1 if doctor.missing_fast_paths() else 0)
    assert f"torch       {torch.__version__}" in out
    assert "pagedfuse._C" in out and "pagedfuse._cuda_kernels" in out
    section = out[out.index("backend per typical call on cpu"):].splitlines()
    assert len(section) == 1 + len(doctor.TYPICAL_CALLS)
    for call, line in zip(doctor.TYPICAL_CALLS, section[1:], strict=False):
        assert line.strip().startswith(call.label)
        assert ("would run cpu" in line) == (call.head_dim in (64, 128) or
                                             call.kv == "float" and call.head_dim == 96)


def test_doctor_says_what_is_missing_on_a_gpu_machine(monkeypatch):
    """A CUDA device without Triton or the CUDA C++ library: each gap named, with the fix;
    warn_if_degraded warns once per gap."""
    from pagedfuse import doctor
    from pagedfuse.ops import cuda_native

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(doctor, "_has_module", lambda name: name != "triton")
    monkeypatch.setattr(cuda_native, "library", lambda: None)
    problems = doctor.missing_fast_paths(check_arch=False)
    assert [p.split(" ")[0:2] for p in problems] == [["Triton", "is"], ["the", "CUDA"]]
    assert "python -m pip install --no-build-isolation -e ." in problems[1]
    monkeypatch.setattr(doctor, "_warned", set())
    with pytest.warns(doctor.PagedfuseWarning) as record:
        doctor.warn_if_degraded(check_arch=False)
        doctor.warn_if_degraded(check_arch=False)
    assert len(record) == 2


def test_doctor_flags_a_cpu_torch_on_a_machine_with_a_gpu(monkeypatch):
    from pagedfuse import doctor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(doctor, "_gpu_present", lambda: True)
    (problem,) = doctor.missing_fast_paths()
    assert "NVIDIA GPU but torch" in problem and "CPU build" in problem


def test_console_script_version():
    run = subprocess.run([sys.executable, "-m", "pagedfuse.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("pagedfuse ")
    assert "Failed to initialize NumPy" not in run.stderr
