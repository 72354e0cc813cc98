"""transformers' continuous batching through pagedfuse beyond Llama under `paged|sdpa`:
sliding-window layers (Mistral, Gemma2, Gemma3) and the explicit spelling of
`paged|eager` (Llama, Gemma2).

What the graphs hold (transformers 5.12, `generate_batch` on the CPU):
- a sliding-window layer reads its ring of cache slots with `index_select`, then
  `masked_scatter_`s the new K/V into that copy, then writes them into the cache with
  `index_copy_`; the window lives in the host-built mask (a graph input). The ring's slot
  for a new token holds a key the same step still reads, so the write cannot move before
  the attention; the op reads the patched copy instead (kv_trace.read_patched).
- `paged|eager` spells attention as matmul, scale, + mask, softmax in float32, cast, matmul.
  transformers' paged attention functions drop Gemma2's `attn_logit_softcapping` (only its
  non-paged eager code applies it), so no soft cap reaches these graphs.

Every site must be rewritten, with the same tokens as the same call without pagedfuse.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pagedfuse

transformers = pytest.importorskip("transformers", minversion="5.12")
pytest.importorskip("psutil")  # continuous batching needs it on the CPU

from helpers.capture import Capture, count_calls  # noqa: E402
from transformers.generation.configuration_utils import (  # noqa: E402
    CompileConfig,
    ContinuousBatchingConfig,
)
from transformers.generation.continuous_batching.cache import (  # noqa: E402
    PagedAttentionCache,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_hf import zeroing  # noqa: E402

NUM_LAYERS = 2
WINDOW = 8  # smaller than three of the prompts
PROMPT_LENGTHS = (5, 11, 17, 8, 3)
SMALL = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=256,
    max_position_embeddings=256,
)
BOTH_KINDS = ["sliding_attention", "full_attention"]
# name: (config, attention implementation, sliding layers)
MODELS = {
    "mistral-sdpa": (lambda: transformers.MistralConfig(**SMALL, sliding_window=WINDOW),
                     "sdpa", NUM_LAYERS),
    "gemma2-sdpa": (lambda: transformers.Gemma2Config(
        **SMALL, sliding_window=WINDOW, attn_logit_softcapping=50.0, layer_types=BOTH_KINDS),
        "sdpa", 1),
    "gemma2-eager": (lambda: transformers.Gemma2Config(
        **SMALL, sliding_window=WINDOW, attn_logit_softcapping=50.0, layer_types=BOTH_KINDS),
        "eager", 1),
    "gemma3-sdpa": (lambda: transformers.Gemma3TextConfig(
        **SMALL, sliding_window=WINDOW, layer_types=BOTH_KINDS), "sdpa", 1),
    "llama-eager": (lambda: transformers.LlamaConfig(**SMALL), "eager", 0),
}


@pytest.fixture(autouse=True)
def zeroed_caches(monkeypatch):
    """Zeroed paged caches, as in test_hf_continuous_batching: transformers allocates them
    with torch.empty and a batch can read slots nothing wrote."""
    monkeypatch.setattr(PagedAttentionCache, "__init__", zeroing(PagedAttentionCache.__init__))


def generate_batch(model, backend) -> list[list[int]]:
    """Greedy tokens per prompt from continuous batching, compiled with ``backend`` (a static
    warm-up graph, then an automatic-dynamic one)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    config = ContinuousBatchingConfig(
        block_size=16, num_blocks=16, max_batch_tokens=64, q_padding_interval_size=8,
        kv_padding_interval_size=32, varlen_compile_config=CompileConfig(backend=backend))
    greedy = transformers.GenerationConfig(max_new_tokens=6, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=greedy,
                               continuous_batching_config=config, progress_bar=False)
    assert len(out) == len(PROMPT_LENGTHS), "generate_batch lost requests (see the log)"
    return [list(result.generated_tokens) for result in out.values()]


@pytest.mark.parametrize("name", MODELS)
def test_every_site_is_rewritten_with_identical_tokens(name):
    config, implementation, sliding = MODELS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config(), attn_implementation=implementation, dtype=torch.float32).eval()

    plain = Capture()
    without_pagedfuse = generate_batch(model, plain)
    pagedfuse.clear_reports()
    inner = Capture()
    with_pagedfuse = generate_batch(model, pagedfuse.backend(inner=inner, verify=True))

    assert with_pagedfuse == without_pagedfuse
    reports = pagedfuse.reports()
    assert len(plain.graphs) == len(inner.graphs) == len(reports) == 2
    for gm, report in zip(inner.graphs, reports, strict=True):
        assert report.num_sites == report.num_rewritten == NUM_LAYERS, str(report)
        assert all(site.verify_error <= 1e-4 for site in report.sites), str(report)
        patched = [s for s in report.sites if "patched" in s.checks[0].reason]
        assert len(patched) == sliding, str(report)
        assert count_calls(gm, torch.ops.pagedfuse.paged_attention) == NUM_LAYERS, gm.code
        assert count_calls(gm, F.scaled_dot_product_attention, F.softmax) == 0, gm.code
        # the cache writes and the patches of the gathered copies stay
        assert count_calls(gm, "index_copy_") == 2 * NUM_LAYERS, gm.code
        assert count_calls(gm, "masked_scatter_") == 2 * sliding, gm.code
        # transformers' paged attention drops Gemma2's attn_logit_softcapping
        assert all(next(c for c in s.checks if c.name == "softcap").reason == "no soft cap"
                   for s in report.sites)
