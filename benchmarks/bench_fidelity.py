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
otherwise); ``dequant`` is the same compiled model with the op forced to a plain
dequantize-then-attend (float32 attention over the dequantized caches with the query left
unquantized) over exactly the query, K and V the kernel receives. So pagedfuse vs dequant is
the kernel's own loss (quantizing the query, and P for an INT8 V) apart from the cache's
quantization loss (dequant vs fp32). Eager is not that baseline for INT8 K + bf16 V: there
the model attends in bf16, and the bf16 SDPA's own rounding would be counted against the
kernel. For INT8 K+V eager attends in float32 and is that baseline already (the dequant run
is then a cross-check).

Each kernel-vs-dequant line also gives the paired standard error of the difference, over
windows (the per-window mean log-likelihood differences' standard deviation over the square
root of their count): an INT8 query rounds differently after any earlier layer's last-bit
change, and the change persists through the rest of its window, so two runs that differ
only in summation order already differ by about that much.

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
from typing import NamedTuple

import torch

import pagedfuse
from pagedfuse import envs
from pagedfuse.models import fidelity, from_transformers, generate, smollm2
from pagedfuse.ops.backends import Backend, all_backends, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall
from pagedfuse.ops.reference import paged_attention_reference

CACHES: dict[str, dict[str, str]] = {
    "fp32": dict(kv_cache="fp32"),
    "bf16": dict(kv_cache="bf16"),
    "int8k-bf16v": dict(kv_cache="int8", value_cache="bf16"),
    "int8": dict(kv_cache="int8"),
}
CACHE_LABELS = {"fp32": "fp32", "bf16": "bf16", "int8k-bf16v": "INT8 K + bf16 V",
                "int8": "INT8 K+V"}
PATHS = ("eager", "pagedfuse", "dequant")


def _dequantize_then_attend(call: PagedCall, out: torch.Tensor, plan: None = None) -> None:
    """The plain dequantize-then-attend: float32 attention over the dequantized caches with
    the query as it is. The model's calls (every sequence as long, as many query rows, no
    bias or option) go batched through SDPA, which is what makes it affordable on a GPU with
    hundreds of windows; any other call goes through the reference, one sequence at a time."""
    q_lens, lengths = call.query_start_loc.diff(), call.seq_lens
    n, length = (int(q_lens[0]), int(lengths[0])) if lengths.numel() else (0, 0)
    if (call.attn_bias is not None or call.options or length < n or n == 0
            or not bool((q_lens == n).all() & (lengths == length).all())):
        out.copy_(paged_attention_reference(
            call.query, call.key_cache, call.value_cache, call.block_table, call.seq_lens,
            call.query_start_loc, call.scale, call.causal, call.attn_bias, call.key_scale,
            call.value_scale, window_left=call.window_left, softcap=call.softcap,
            quantize_query=False))
        return
    g = call.geometry
    blocks = call.block_table[:, :-(-length // g.block_size)].long()

    def gathered(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        rows = cache[blocks].flatten(1, 2)[:, :length].float()  # [B, L, Hkv, D]
        if scale is not None:
            rows = rows * scale[blocks].flatten(1, 2)[:, :length].float().unsqueeze(-1)
        return rows.transpose(1, 2)

    query = call.query.float().view(g.batch, n, g.num_q_heads, g.head_dim).transpose(1, 2)
    mask = None
    if call.causal:  # bottom-right: query row t sits at position length - n + t
        rows = torch.arange(n, device=out.device)[:, None] + (length - n)
        mask = torch.arange(length, device=out.device)[None, :] <= rows
    attended = torch.nn.functional.scaled_dot_product_attention(
        query, gathered(call.key_cache, call.key_scale),
        gathered(call.value_cache, call.value_scale), attn_mask=mask, scale=call.scale,
        enable_gqa=True)
    out.copy_(attended.transpose(1, 2).reshape(out.shape))


# Asked only when forced: any device's own backends, and the reference, outrank it. main()
# registers it, so importing this module (the tests do) leaves the registry as it was.
DEQUANTIZE = Backend(name="dequantize-then-attend", device=None, priority=-1,
                     head_dims={FLOAT_OP: None, INT8_OP: None}, run=_dequantize_then_attend)
# The op's backend per path (None: the registry's choice).
FORCED_BACKEND = {"dequant": DEQUANTIZE.name}
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
    # Each window's mean NLL per path: kernel-vs-dequant standard errors come from these.
    window_nll_prefill: list[float]
    window_nll_decode: list[float]


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
                     seconds, scores.prefill.mean(dim=1).tolist(),
                     scores.decode.mean(dim=1).tolist())


def _rel(value: float, base: float) -> float:
    return value / base - 1.0


class Check(NamedTuple):
    what: str
    rel_diff: float
    limit: float
    passed: bool
    std_error: float | None = None  # paired, for kernel-vs-dequant checks


def _paired_std_error(kernel: list[float], base: list[float]) -> float:
    """Standard error of the mean NLL difference (about that of the relative perplexity
    difference, exp(mean difference) - 1), with windows as the independent samples: a
    perturbation persists through the rest of its window, so its tokens are not."""
    diff = torch.tensor(kernel, dtype=torch.float64) - torch.tensor(base, dtype=torch.float64)
    return (diff.std() / diff.numel() ** 0.5).item()


def checks(results: list[RunResult]) -> list[Check]:
    """Every bar the runs can be held to."""
    by = {(r.cache, r.path): r for r in results}
    found = []
    for cache, limit in VS_FP32_LIMITS.items():
        for path in PATHS:
            run, base = by.get((cache, path)), by.get(("fp32", path))
            if run and base:
                diff = _rel(run.ppl_text, base.ppl_text)
                found.append(Check(f"{path} {CACHE_LABELS[cache]} vs fp32 cache", diff, limit,
                                   abs(diff) <= limit))
    for cache in ("int8k-bf16v", "int8"):
        baseline = (cache, "dequant") if (cache, "dequant") in by else (cache, "eager")
        kernel, dequant = by.get((cache, "pagedfuse")), by.get(baseline)
        if kernel is None or dequant is None or (
                baseline[1] == "eager" and cache not in EAGER_IS_DEQUANT):
            continue
        for which in ("prefill", "decode"):
            diff = _rel(getattr(kernel, f"ppl_{which}"), getattr(dequant, f"ppl_{which}"))
            se = _paired_std_error(getattr(kernel, f"window_nll_{which}"),
                                   getattr(dequant, f"window_nll_{which}"))
            found.append(Check(f"pagedfuse {CACHE_LABELS[cache]} vs dequantize-then-attend, "
                               f"{which}", diff, KERNEL_VS_DEQUANT_LIMIT,
                               abs(diff) <= KERNEL_VS_DEQUANT_LIMIT, se))
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


# Settings a resumed record must share with the run that continues it (the rest, such as
# --runs, --threads or the model's path, do not change what a run measures).
SAME_SETTINGS = ("device", "tokens", "window", "prefill", "greedy_prompts", "greedy_prompt_len",
                 "greedy_tokens", "dtype", "inner", "block_size")


def resumed_runs(args: argparse.Namespace, device_name: str,
                 text_sha: str) -> tuple[list[str], list[RunResult]]:
    """The commands and runs of the --json record that this run continues."""
    if not args.json.exists():
        return [], []
    record = json.loads(args.json.read_text())
    mine = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    differ = [k for k in SAME_SETTINGS if record["settings"].get(k) != mine[k]]
    if record["text_sha256"] != text_sha:
        differ.append("text")
    if record["device_name"] != device_name:
        differ.append("device_name")
    if differ:
        raise SystemExit(f"--resume: {args.json} was measured with other {', '.join(differ)}")
    commands = record.get("commands", [record.get("command")])
    return commands, [RunResult(**run) for run in record["runs"]]


def write_record(args: argparse.Namespace, commands: list[str], device_name: str,
                 text_sha: str, windows: int, results: list[RunResult],
                 bars: list[Check]) -> None:
    """The JSON record of the runs so far, with the bars they can be held to."""
    record = {
        "commands": commands,
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
        "checks": [bar._asdict() for bar in bars],
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
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs of the --json record (same text, settings and "
                        "device) and do only the others: a run cut short is continued")
    args = parser.parse_args(argv)
    if args.resume and args.json is None:
        parser.error("--resume needs --json, the record to continue")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Every query of the model sees at least its own key; on CUDA, whose SDPA gives a fully
    # masked row other values than the op, the rewrite must be told so.
    os.environ.setdefault("PAGEDFUSE_ASSUME_VISIBLE_KEY", "1")
    if DEQUANTIZE.name not in {b.name for b in all_backends()}:
        register_backend(DEQUANTIZE)
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

    command = " ".join(shlex.quote(a) for a in ["benchmarks/bench_fidelity.py", *sys.argv[1:]])
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else \
        platform.processor() or platform.machine()
    text_sha = hashlib.sha256(ids[:args.tokens].numpy().tobytes()).hexdigest()
    commands, results = resumed_runs(args, device_name, text_sha) if args.resume else ([], [])
    commands.append(command)
    done = {(r.cache, r.path) for r in results}
    runs = [run for run in (tuple(r.split("/")) for r in args.runs) if run not in done]
    decode_steps = args.window - 1 - args.prefill
    progress = _progress(len(runs) * decode_steps)
    tick = (lambda: progress.update(1)) if progress is not None else (lambda: None)
    for cache, path in runs:
        if progress is not None:
            progress.set_postfix_str(f"{cache} {path}")
        results.append(run_one(loaded.hf_model, cache, path, args, windows, reference, tick))
        if args.json:  # after every run, so a run cut short keeps what it measured
            write_record(args, commands, device_name, text_sha, windows.shape[0], results,
                         checks(results))
        gc.collect()
    if progress is not None:
        progress.close()

    print(f"\n### Fidelity: SmolLM2-135M-Instruct ({smollm2.GGUF_FILE}), {args.device} "
          f"({device_name}), {datetime.date.today()}\n")
    print(f"{'; '.join(f'`{c}`' for c in commands)}: {windows.shape[0]} windows of "
          f"{args.window} tokens ({args.prefill} prefilled, {decode_steps} decoded) over "
          f"{args.tokens} tokens of pydoc_data.topics; "
          f"weights {args.dtype}; pagedfuse inner {args.inner}; greedy agreement over "
          f"{args.greedy_prompts} x {args.greedy_tokens} tokens vs eager fp32.\n")
    print(table(results))
    bars = checks(results)
    print()
    for bar in bars:
        se = "" if bar.std_error is None else f" +- {bar.std_error:.3%} (paired s.e.)"
        print(f"{'PASS' if bar.passed else 'FAIL'}  {bar.what}: {bar.rel_diff:+.3%}{se} "
              f"(limit {bar.limit:.1%})")

    if args.json:
        print(f"\nwrote {args.json}")
    return 0 if all(b.passed for b in bars) else 1


if __name__ == "__main__":
    sys.exit(main())
