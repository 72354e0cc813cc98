"""What each KV cache kind costs a real model, and what pagedfuse's kernels add to it.

SmolLM2-135M-Instruct (pagedfuse.models.smollm2; fetched on first use, or --model-path) scores
the first --tokens tokens of Python's own language reference (``pydoc_data.topics``, sorted
by topic: fixed English text, no download) in sliding windows of --window tokens: each
window's first --prefill tokens go through one prefill, the rest through token-by-token
decode, teacher-forced (the text's tokens are fed, not the model's picks), so both paths of
the paged attention run. Windows overlap by --prefill tokens; the text perplexity counts every
token once, the prefill and decode perplexities count each path's predictions.

Caches: fp32, bf16, INT8 K + bf16 V, INT8 K+V, with the weights and the rest of the model in
--dtype (fp32 by default, so only the cache and the attention's precision vary). Each cache
runs on up to three paths: ``eager`` is the model's own plain PyTorch (gather the pages,
dequantize an INT8 cache, SDPA in the cache's float dtype); ``pagedfuse`` is the model compiled
with the pagedfuse backend, every attention site rewritten to the fused op (the run fails
otherwise); ``dequant`` is the same compiled model with the op forced to its pure-torch
reference (PAGEDFUSE_BACKEND=reference), which dequantizes the same cache and attends in
float32 over exactly the query, K and V the kernel receives. So pagedfuse vs dequant isolates
the kernel's own loss (it also quantizes the query) from the cache's quantization loss
(dequant vs fp32). Eager is not that baseline for INT8 K + bf16 V: there the model attends in
bf16, and the bf16 SDPA's own rounding would be counted against the kernel. For INT8 K+V eager
attends in float32 and is that baseline already (the dequant run is then a cross-check; on a
GPU it costs minutes, the reference running one sequence at a time).

Greedy agreement: eager fp32 generates --greedy-tokens tokens after each of --greedy-prompts
text prompts; every run is fed that history and must pick the same tokens.

Prints a markdown table; --json keeps the record (summarize.py reads benchmarks/results/).

    .venv/bin/python benchmarks/bench_fidelity.py [--device cuda] [--model-path FILE.gguf]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import pagedfuse
from pagedfuse import envs
from pagedfuse.models import fidelity, from_transformers, generate, smollm2

CACHES: dict[str, dict[str, str]] = {
    "fp32": dict(kv_cache="fp32"),
    "bf16": dict(kv_cache="bf16"),
    "int8k-bf16v": dict(kv_cache="int8", value_cache="bf16"),
    "int8": dict(kv_cache="int8"),
}
CACHE_LABELS = {"fp32": "fp32", "bf16": "bf16", "int8k-bf16v": "INT8 K + bf16 V",
                "int8": "INT8 K+V"}
PATHS = ("eager", "pagedfuse", "dequant")
# The op's backend per path (None: the registry's choice).
FORCED_BACKEND = {"dequant": "reference"}
# Caches whose eager path already is the float32 dequantize-then-attend (no float V cache,
# so the model attends in its fp32 activations): a dequant run is then only a cross-check.
EAGER_IS_DEQUANT = frozenset({"int8"})
ATTENTION_LABELS = {"pagedfuse": "pagedfuse", "dequant": "dequantize + fp32 attention"}
# The bars: perplexity vs the fp32 cache, and the kernels vs dequantize-then-attend.
VS_FP32_LIMITS = {"int8": 0.01, "int8k-bf16v": 0.005, "bf16": 0.002}
KERNEL_VS_DEQUANT_LIMIT = 0.001
ALL_RUNS = tuple(f"{cache}/{path}" for cache in CACHES for path in PATHS
                 if path != "dequant" or cache.startswith("int8"))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class RunResult:
    cache: str
    path: str
    ppl_text: float
    ppl_prefill: float
    ppl_decode: float
    greedy_agreement: float
    sites: str  # "rewritten/found" over the compiled graphs; "-" for eager
    graphs: int
    seconds: float


def text_tokens(tokenizer, count: int) -> torch.Tensor:
    """The first ``count`` tokens of fidelity.reference_text()."""
    ids = tokenizer(fidelity.reference_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < count:
        raise SystemExit(f"--tokens: the text has only {len(ids)} tokens")
    return torch.tensor(ids[:count], dtype=torch.int64)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench_fidelity", unit="step", file=sys.stderr)


def run_one(hf_model, cache: str, path: str, args: argparse.Namespace, windows: torch.Tensor,
            reference: torch.Tensor, tick: Callable[[], None]) -> RunResult:
    model = from_transformers(hf_model, device=args.device, dtype=DTYPES[args.dtype],
                              block_size=args.block_size, **CACHES[cache])
    forward = model
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    if path != "eager":
        forward = torch.compile(model, backend=pagedfuse.backend(inner=args.inner))
    start = time.perf_counter()
    with envs.overridden("PAGEDFUSE_BACKEND", FORCED_BACKEND.get(path)):
        scores = fidelity.score_windows(model, windows, args.prefill, forward=forward,
                                        on_step=tick)
        agreement = fidelity.greedy_agreement(model, reference, args.greedy_prompt_len,
                                              forward=forward)
    seconds = time.perf_counter() - start
    reports = pagedfuse.reports()
    found = sum(r.num_sites for r in reports)
    rewritten = sum(r.num_rewritten for r in reports)
    if path != "eager" and (found == 0 or rewritten < found):
        raise SystemExit(f"{cache}: {rewritten}/{found} attention sites rewritten:\n"
                         + "\n".join(r.table() for r in reports))
    return RunResult(cache, path, fidelity.perplexity(scores.text()),
                     fidelity.perplexity(scores.prefill), fidelity.perplexity(scores.decode),
                     agreement, f"{rewritten}/{found}" if reports else "-", len(reports),
                     seconds)


def _rel(value: float, base: float) -> float:
    return value / base - 1.0


def checks(results: list[RunResult]) -> list[tuple[str, float, float, bool]]:
    """(what, relative difference, limit, within it) for every bar the runs can be held to."""
    by = {(r.cache, r.path): r for r in results}
    found = []
    for cache, limit in VS_FP32_LIMITS.items():
        for path in PATHS:
            run, base = by.get((cache, path)), by.get(("fp32", path))
            if run and base:
                diff = _rel(run.ppl_text, base.ppl_text)
                found.append((f"{path} {CACHE_LABELS[cache]} vs fp32 cache", diff, limit,
                              abs(diff) <= limit))
    for cache in ("int8k-bf16v", "int8"):
        kernel = by.get((cache, "pagedfuse"))
        dequant = by.get((cache, "dequant")) or (by.get((cache, "eager"))
                                                 if cache in EAGER_IS_DEQUANT else None)
        if kernel and dequant:
            for which in ("prefill", "decode"):
                diff = _rel(getattr(kernel, f"ppl_{which}"), getattr(dequant, f"ppl_{which}"))
                found.append((f"pagedfuse {CACHE_LABELS[cache]} vs dequantize-then-attend, "
                              f"{which}", diff, KERNEL_VS_DEQUANT_LIMIT,
                              abs(diff) <= KERNEL_VS_DEQUANT_LIMIT))
    return found


def table(results: list[RunResult]) -> str:
    base = {r.path: r for r in results if r.cache == "fp32"}
    dequant = {r.cache: r for r in results if r.path == "eager" and r.cache in EAGER_IS_DEQUANT}
    dequant.update({r.cache: r for r in results if r.path == "dequant"})
    lines = ["| cache | attention | perplexity | vs fp32 cache | prefill ppl | decode ppl | "
             "vs dequantize-then-attend (prefill / decode) | greedy agreement | sites |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        fp32 = base.get(r.path) or base.get("eager") or base.get("pagedfuse")
        vs_fp32 = "" if fp32 is None or r is fp32 else f"{_rel(r.ppl_text, fp32.ppl_text):+.3%}"
        eager = dequant.get(r.cache)
        vs_eager = "" if r.path != "pagedfuse" or eager is None else (
            f"{_rel(r.ppl_prefill, eager.ppl_prefill):+.3%} / "
            f"{_rel(r.ppl_decode, eager.ppl_decode):+.3%}")
        attention = ATTENTION_LABELS[r.path] if r.path != "eager" else (
            "dequantize + SDPA" if r.cache.startswith("int8") else "SDPA")
        lines.append(f"| {CACHE_LABELS[r.cache]} | {attention} | {r.ppl_text:.4f} | {vs_fp32} "
                     f"| {r.ppl_prefill:.4f} | {r.ppl_decode:.4f} | {vs_eager} | "
                     f"{r.greedy_agreement:.1%} | {r.sites} |")
    return "\n".join(lines)


def write_record(args: argparse.Namespace, command: str, device_name: str, text_sha: str,
                 windows: int, results: list[RunResult]) -> None:
    """The JSON record of the runs so far, with the bars they can be held to."""
    record = {
        "command": command,
        "date": str(datetime.date.today()),
        "device": args.device,
        "device_name": device_name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": smollm2.GGUF_FILE,
        "text_sha256": text_sha,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "windows": windows,
        "runs": [asdict(r) for r in results],
        "checks": [dict(what=w, rel_diff=d, limit=lim, passed=ok)
                   for w, d, lim, ok in checks(results)],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-path", help="the GGUF file (or its folder); default: the "
                        "cache, fetched on first use")
    parser.add_argument("--tokens", type=int, default=4096, help="text tokens scored")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=512,
                        help="tokens of each window prefilled; the rest are decoded")
    parser.add_argument("--greedy-prompts", type=int, default=4)
    parser.add_argument("--greedy-prompt-len", type=int, default=128)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--runs", nargs="+", choices=ALL_RUNS, default=list(ALL_RUNS),
                        metavar="CACHE/PATH", help=f"default: all of {', '.join(ALL_RUNS)}")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="weights and activations outside attention")
    parser.add_argument("--inner", choices=("eager", "inductor"), default="eager",
                        help="compiler for the rewritten graph: the fused op is the same "
                        "either way, and inductor costs minutes per graph on a small CPU")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a small shared CPU more threads spin)")
    parser.add_argument("--json", type=Path, help="write the record here (e.g. "
                        "benchmarks/results/fidelity-<device>.json); default: print only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Every query of the model sees at least its own key; on CUDA, whose SDPA gives a fully
    # masked row other values than the op, the rewrite must be told so.
    os.environ.setdefault("PAGEDFUSE_ASSUME_VISIBLE_KEY", "1")
    torch.set_num_threads(args.threads)
    try:
        loaded = smollm2.load(args.model_path)
    except smollm2.ModelUnavailable as err:
        print(f"bench_fidelity: {err}", file=sys.stderr)
        return 2
    greedy_len = args.greedy_prompts * args.greedy_prompt_len
    ids = text_tokens(loaded.tokenizer, args.tokens + greedy_len)
    windows = fidelity.sliding_windows(ids[:args.tokens], args.window, args.prefill)
    prompts = ids[args.tokens:].view(args.greedy_prompts, args.greedy_prompt_len)

    reference_model = from_transformers(loaded.hf_model, device=args.device,
                                        dtype=DTYPES[args.dtype], block_size=args.block_size)
    reference = generate(reference_model, prompts.to(args.device),
                         args.greedy_tokens - 1).tokens.cpu()
    del reference_model

    runs = [tuple(run.split("/")) for run in args.runs]
    decode_steps = args.window - 1 - args.prefill
    bar = _progress(len(runs) * decode_steps)
    tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    command = " ".join(shlex.quote(a) for a in ["benchmarks/bench_fidelity.py", *sys.argv[1:]])
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else \
        platform.processor() or platform.machine()
    text_sha = hashlib.sha256(ids[:args.tokens].numpy().tobytes()).hexdigest()
    results = []
    for cache, path in runs:
        if bar is not None:
            bar.set_postfix_str(f"{cache} {path}")
        results.append(run_one(loaded.hf_model, cache, path, args, windows, reference, tick))
        if args.json:  # after every run, so a run cut short keeps what it measured
            write_record(args, command, device_name, text_sha, windows.shape[0], results)
        gc.collect()
    if bar is not None:
        bar.close()

    print(f"\n### Fidelity: SmolLM2-135M-Instruct ({smollm2.GGUF_FILE}), {args.device} "
          f"({device_name}), {datetime.date.today()}\n")
    print(f"`{command}`: {windows.shape[0]} windows of {args.window} tokens ({args.prefill} "
          f"prefilled, {decode_steps} decoded) over {args.tokens} tokens of pydoc_data.topics; "
          f"weights {args.dtype}; pagedfuse inner {args.inner}; greedy agreement over "
          f"{args.greedy_prompts} x {args.greedy_tokens} tokens vs eager fp32.\n")
    print(table(results))
    bars = checks(results)
    print()
    for what, diff, limit, ok in bars:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {diff:+.3%} (limit {limit:.1%})")

    if args.json:
        print(f"\nwrote {args.json}")
    return 0 if all(ok for *_, ok in bars) else 1


if __name__ == "__main__":
    sys.exit(main())
