"""The README's code runs as printed, its switch table is envs.py's, and no file of the
project points outside the repository.

Every ```python block of README.md is marked ``<!-- test: name -->`` and run here from the
README text itself. The one-liners' ``model`` is bound to a small paged decoder (a user's
model); the transformers example loads a small random Qwen2 where the README names a hub
checkpoint, so it runs offline."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedfuse
from pagedfuse import envs
from pagedfuse.models import PagedDecoder, preset

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def blocks() -> dict[str, str]:
    text = README.read_text()
    marked = dict(re.findall(r"<!-- test: ([\w-]+) -->\n```python\n(.*?)```", text, re.S))
    assert len(marked) == text.count("```python"), "a python block of README.md has no marker"
    return marked


def run_block(name: str, namespace: dict | None = None) -> str:
    """Run one block in ``namespace`` (default: a fresh one); what it printed."""
    namespace = {} if namespace is None else namespace
    namespace.setdefault("__name__", f"readme_{name.replace('-', '_')}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(blocks()[name], f"README.md ({name})", "exec"), namespace)
    return printed.getvalue()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_every_python_block_is_run_by_a_test():
    assert set(blocks()) == {"one-liners", "use-it", "transformers", "ops"}


def test_one_liners_compile_a_users_model():
    pytest.importorskip("transformers")
    config = preset("tinyllama", kv_cache="fp32")
    namespace = {"model": PagedDecoder(config, seed=0)}
    run_block("one-liners", namespace)
    eager = PagedDecoder(config, seed=0)
    tokens = torch.randint(0, config.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    outputs = []
    for model in (eager, namespace["model"]):
        cache = eager.new_cache(2, 20)
        with torch.no_grad():
            outputs.append(model(*cache.append(tokens), cache.layers))
    report = pagedfuse.last_report()
    assert report.num_sites == report.num_rewritten == config.num_layers
    assert pagedfuse.numerics.max_rel_err(outputs[1], outputs[0]) < 1e-3
    assert type(namespace["compile_config"]).__name__ == "CompileConfig"


def test_use_it_prints_the_report_of_the_run_and_the_explain():
    printed = run_block("use-it")
    reports = printed.count("1 attention site(s), 1 rewritten")
    assert reports == 2 and "None" not in printed.splitlines()[0], printed  # report + explain
    error = float(re.search(r"tensor\(([\d.e+-]+)\)", printed)[1])
    assert error < 1e-4
    assert "-> pagedfuse.paged_attention" in printed


def test_the_settings_line_refuses_a_misspelt_name():
    source = blocks()["use-it"]
    assert 'options={"verify": True}' in source
    with pytest.raises(ValueError, match="did you mean 'verify'"):
        pagedfuse.backend(options={"verfy": True})


def test_transformers_example_prints_every_graphs_report(monkeypatch):
    transformers = pytest.importorskip("transformers", minversion="5.12")
    pytest.importorskip("psutil")  # continuous batching needs it on the CPU
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_hf import zeroing  # transformers reads never-written slots of torch.empty

    def small_qwen2(name, **kwargs):
        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=256,
            max_position_embeddings=256)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                             **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", small_qwen2)
    monkeypatch.setattr(PagedAttentionCache, "__init__",
                        zeroing(PagedAttentionCache.__init__))
    printed = run_block("transformers")
    reports = pagedfuse.reports()
    assert len(reports) >= 2  # the static graph and the automatic-dynamic one
    assert printed.count("pagedfuse report (graph") == len(reports)
    for report in reports:
        assert report.num_sites == report.num_rewritten == 2, str(report)


def test_ops_example_matches_the_reference():
    ns: dict = {}
    run_block("ops", ns)
    args = (ns["block_table"], ns["seq_lens"], ns["query_start_loc"])
    want = pagedfuse.ops.paged_attention_reference(
        ns["query"].double(), ns["k_cache"].double(), ns["v_cache"].double(), *args,
        ns["D"] ** -0.5, True)
    assert pagedfuse.numerics.rel_err(ns["out"], want) <= 1e-4
    assert pagedfuse.numerics.rel_err(ns["out8"], want) <= pagedfuse.numerics.QUANTIZATION_RTOL


def test_switch_table_is_envs_py():
    rows = re.findall(r"^\| `(PAGEDFUSE_\w+)` \| `([^`]*)` \| ([\w.+]+) \| (.*) \|$",
                      README.read_text(), re.M)
    assert rows == [(v.name, v.default, v.reader, v.meaning) for v in envs.VARIABLES.values()]


OUTSIDE = re.compile(r"\.\./shared|/work/|DESIGN\.md|NOTES-gpu\.md")


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    here = Path(__file__).relative_to(ROOT).as_posix()
    pointing = set()
    for name in files:
        path = ROOT / name
        if name == here or not path.is_file() or path.suffix in (".png", ".so", ".whl"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if OUTSIDE.search(text):
            pointing.add(name)
    assert pointing == set(), "files pointing outside the repository"
