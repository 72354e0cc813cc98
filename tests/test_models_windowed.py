"""The Gemma2-like preset (a sliding window and a soft cap): the decoder and the package's
dense reference against a dense oracle written here, and its compiled sites (decode: a length
mask with the window's start, read as seq_lens and window_left hints; prefill: a bias)
rewritten to the op with softcap, with a stand-in kernel and with the CPU kernels."""

from __future__ import annotations

import pytest
import torch
from helpers.backends import OPTIONS_STAND_IN, registered
from helpers.capture import Capture

import pagedfuse
from pagedfuse.models import PRESETS, PagedDecoder, dense_reference_logits, generate, preset
from pagedfuse.numerics import max_rel_err

BATCH, PROMPT_LEN, STEPS = 2, 6, 4


def small_gemma2(**overrides) -> PagedDecoder:
    """The preset with a window and a cap that matter over 10 tokens."""
    config = preset("gemma2", **{"sliding_window": 3, "softcap": 2.0, "block_size": 4,
                                 **overrides})
    return PagedDecoder(config, seed=3)


def dense_logits(model: PagedDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """float64 logits over the whole history, no cache: position i sees keys
    (i - window, i], scores capped after the scale."""
    cfg = model.config
    model = model.double()
    batch, seq = tokens.shape
    positions = torch.arange(seq).expand(batch, seq)
    pos = torch.arange(seq)
    visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < cfg.sliding_window)
    h = model.embed(tokens)
    for layer in model.layers:
        attn, x = layer.attn, layer.attn_norm(h)
        q, k, v = attn.project(x, positions)
        group = cfg.num_q_heads // cfg.num_kv_heads
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / cfg.head_dim ** 0.5
        scores = cfg.softcap * torch.tanh(scores / cfg.softcap)
        out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
        h = h + attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        h = h + layer.mlp(layer.mlp_norm(h))
    return torch.nn.functional.linear(model.norm(h), model.output_weight())


def _prompts(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(7))


def test_the_preset_is_gemma2s_attention():
    config = PRESETS["gemma2"]  # the demo and tests/test_models.py sweep PRESETS
    assert (config.num_q_heads, config.num_kv_heads, config.head_dim) == (16, 8, 256)
    assert (config.sliding_window, config.softcap) == (4096, 50.0)
    with pytest.raises(ValueError, match="^sliding_window: "):
        preset("gemma2", sliding_window=0)
    with pytest.raises(ValueError, match="^softcap: "):
        preset("gemma2", softcap=float("inf"))


def test_decoder_matches_the_dense_oracle():
    model = small_gemma2()
    gen = generate(model, _prompts(model.config.vocab_size), STEPS)
    want = dense_logits(small_gemma2(), gen.tokens[:, :-1])
    assert max_rel_err(gen.logits, want) <= 1e-4


def test_the_dense_reference_applies_the_window_and_the_cap():
    tokens = generate(small_gemma2(), _prompts(512), STEPS).tokens[:, :-1]
    want = dense_logits(small_gemma2(), tokens)
    assert max_rel_err(dense_reference_logits(small_gemma2(), tokens), want) <= 1e-5


def test_window_and_cap_change_the_logits():
    tokens = generate(small_gemma2(), _prompts(512), STEPS).tokens
    base = generate(small_gemma2(), _prompts(512), STEPS, forced=tokens).logits
    for changes in (dict(sliding_window=None), dict(softcap=None)):
        other = generate(small_gemma2(**changes), _prompts(512), STEPS, forced=tokens).logits
        assert max_rel_err(other, base) > 1e-2, changes


def _compiled_run(model: PagedDecoder):
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    capture = Capture()
    prompts = _prompts(model.config.vocab_size)
    eager = generate(model, prompts, STEPS)
    compiled = torch.compile(model, backend=pagedfuse.backend(inner=capture))
    got = generate(model, prompts, STEPS, forward=compiled, forced=eager.tokens)
    return eager, got, pagedfuse.Report.merged(pagedfuse.reports()), capture


def test_compiled_sites_are_rewritten_with_the_options_and_held_to_eager():
    """With a stand-in for the window/softcap kernels: every site becomes the op with
    softcap, decode with the window as a hint over the length mask, logits as eager's."""
    with registered(OPTIONS_STAND_IN):
        eager, got, report, capture = _compiled_run(small_gemma2())
    assert report.num_sites == report.num_rewritten > 0, str(report)
    calls = [n for gm in capture.graphs for n in gm.graph.nodes
             if n.target is torch.ops.pagedfuse.paged_attention.default]
    assert calls and all(n.kwargs.get("softcap") == 2.0 for n in calls)
    assert any(n.kwargs.get("window_left") == 3 for n in calls)  # the decode graph
    assert max_rel_err(got.logits, eager.logits) <= 1e-4


def test_compiled_sites_are_rewritten():
    """With the CPU kernels themselves: every site rewritten, logits as eager's."""
    eager, got, report, _ = _compiled_run(small_gemma2())
    assert report.num_sites == report.num_rewritten > 0, str(report)
    assert max_rel_err(got.logits, eager.logits) <= 1e-4
