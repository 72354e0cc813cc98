"""What a KV cache kind (or a kernel) costs a real model: perplexity on real text, scored in
sliding windows through both paths a server runs (a prefill of the window's first part, then
token-by-token decode of the rest, teacher-forced), and greedy-token agreement with a
reference. Shared by benchmarks/bench_fidelity.py and the tests."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedfuse.models.decoder import PagedDecoder, generate


class WindowScores(NamedTuple):
    """Negative log-likelihoods (nats, float64) of each window's tokens 1..W-1."""

    prefill: torch.Tensor  # [B, P]: predicted by the prefill's logits (tokens 1..P)
    decode: torch.Tensor  # [B, W - 1 - P]: predicted by the decode steps (tokens P+1..W-1)

    def text(self) -> torch.Tensor:
        """Every token of the text once: all of window 0, then each later window's tokens past
        the previous window (its positions P..W-1; ``sliding_windows`` overlaps them by P)."""
        later = torch.cat((self.prefill[1:, -1:], self.decode[1:]), dim=1)
        return torch.cat((self.prefill[0], self.decode[0], later.flatten()))


def reference_text() -> str:
    """Python's own language reference (``pydoc_data.topics``, topics in sorted order): fixed
    English prose with code, shipped with every Python, so no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(nll.double().mean().item())


def sliding_windows(tokens: torch.Tensor, window: int, prefill: int) -> torch.Tensor:
    """[B, window] windows of ``tokens`` [N] with stride window - prefill, as many as fit:
    each window's prefill part is context the previous window already scored."""
    stride = window - prefill
    if not 0 < prefill < window - 1:
        raise ValueError(f"prefill: {prefill} must lie in (0, window - 1 = {window - 1})")
    if tokens.numel() < window:
        raise ValueError(f"tokens: {tokens.numel()} are fewer than one window of {window}")
    count = (tokens.numel() - window) // stride + 1
    return tokens.unfold(0, window, stride)[:count]


def _nll(logits: torch.Tensor, targets: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """Per-token NLL, ``rows`` at a time: a long prefill's log-softmax over a 49k vocabulary
    would otherwise double its multi-GB logits."""
    flat, wanted = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    parts = [F.cross_entropy(chunk.float(), goal, reduction="none")
             for chunk, goal in zip(flat.split(rows), wanted.split(rows), strict=True)]
    return torch.cat(parts).view(targets.shape).double()


@torch.no_grad()
def score_windows(model: PagedDecoder, windows: torch.Tensor, prefill: int, *,
                  forward: Callable[..., torch.Tensor] | None = None,
                  on_step: Callable[[], None] | None = None) -> WindowScores:
    """Prefill each window's first ``prefill`` tokens, then feed the rest one at a time (the
    text's own tokens, not the model's picks) and keep each prediction's NLL. ``forward``
    replaces ``model`` for the calls (e.g. a compiled model)."""
    forward = model if forward is None else forward
    batch, width = windows.shape
    windows = windows.to(model.embed.weight.device)
    cache = model.new_cache(batch, width)
    # fresh tensors, not views into the windows: a view's storage offset can take a value
    # Dynamo guards on (duck sizing), which would compile the decode step twice
    feed = lambda start, stop: cache.append(windows[:, start:stop].clone())
    logits = forward(*feed(0, prefill), cache.layers)
    prefill_nll = _nll(logits, windows[:, 1:prefill + 1])
    decode_nll = []
    for pos in range(prefill, width - 1):
        logits = forward(*feed(pos, pos + 1), cache.layers)
        decode_nll.append(_nll(logits, windows[:, pos + 1:pos + 2]))
        if on_step is not None:
            on_step()
    return WindowScores(prefill_nll.cpu(), torch.cat(decode_nll, dim=1).cpu())


@torch.no_grad()
def greedy_agreement(model: PagedDecoder, reference: torch.Tensor, prompt_len: int, *,
                     forward: Callable[..., torch.Tensor] | None = None) -> float:
    """Share of the greedy tokens of ``reference`` [B, prompt_len + n] (a greedy generation
    from its first ``prompt_len`` tokens) that ``model`` picks too, fed the reference's own
    history at every step, so one early flip does not count against every later token."""
    steps = reference.shape[1] - prompt_len - 1
    gen = generate(model, reference[:, :prompt_len], steps, forward=forward, forced=reference)
    picks = gen.logits[:, prompt_len - 1:].argmax(dim=-1).cpu()
    return (picks == reference[:, prompt_len:].cpu()).double().mean().item()
