"""``pagedfuse demo | explain | bench``.

``demo`` runs the paged decoder (pagedfuse.models) eagerly and compiled with pagedfuse, prints
each compiled graph's report, the compiled-vs-eager logits error, greedy-token agreement and
decode tokens/s, and exits non-zero when a case fails: an attention site left unrewritten, the
logits' max relative error over ``LOGITS_RTOL`` or the token agreement under
``MIN_AGREEMENT``. Both are looser than the op tolerances of DESIGN.md because the error
compounds over layers, and INT8 adds the query quantization the fused op does (the eager model
attends with a float query).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import pagedfuse
from pagedfuse.models import (
    KV_CACHE_KINDS,
    LAYOUTS,
    PRESETS,
    DecoderConfig,
    Generation,
    PagedDecoder,
    generate,
    preset,
)

# max |compiled - eager| / max |eager| over all logits, per KV cache kind.
LOGITS_RTOL = {"fp32": 1e-3, "bf16": 3e-2, "int8": 1e-1}
# Fraction of greedy tokens the compiled model must pick as eager did (fed the same history):
# fp32 must agree everywhere; bf16 and INT8 may flip near ties (random weights give flat
# logits: llama3 int8 flips 1 of 14 at the defaults), a broken kernel agrees almost nowhere.
MIN_AGREEMENT = {"fp32": 1.0, "bf16": 0.8, "int8": 0.8}
BENCH_SCRIPTS = {"cpu": "bench_cpu.py", "cuda": "bench_decode.py"}


@dataclass(frozen=True)
class Case:
    """One model variant the demo runs."""

    preset: str
    kv_cache: str
    alibi: bool = False
    layout: str = "nhd"

    def config(self, block_size: int) -> DecoderConfig:
        return preset(self.preset, kv_cache=self.kv_cache, alibi=self.alibi, layout=self.layout,
                      block_size=block_size)

    def __str__(self) -> str:
        return (f"{self.preset} kv={self.kv_cache} {'alibi' if self.alibi else 'rope'} "
                f"{self.layout}")


# `pagedfuse demo` without flags: every preset with a float and an INT8 cache, plus ALiBi.
DEFAULT_SWEEP = tuple(Case(p, kv) for p in PRESETS for kv in ("fp32", "int8")) + (
    Case("tinyllama", "fp32", alibi=True),)


def full_sweep() -> tuple[Case, ...]:
    """``--all``: every preset x cache kind x position encoding x layout."""
    return tuple(Case(p, kv, alibi, layout) for p in PRESETS for kv in KV_CACHE_KINDS
                 for alibi in (False, True) for layout in LAYOUTS)


@dataclass
class CaseResult:
    case: Case
    reports: list  # pagedfuse Report objects, one per compiled graph
    max_rel_err: float
    agreement: float
    eager_tok_s: float
    compiled_tok_s: float

    @property
    def num_sites(self) -> int:
        return sum(r.num_sites for r in self.reports)

    @property
    def num_rewritten(self) -> int:
        return sum(r.num_rewritten for r in self.reports)

    def failures(self) -> list[str]:
        kind = self.case.kv_cache
        found = []
        if self.num_sites == 0 or self.num_rewritten < self.num_sites:
            found.append(f"{self.num_rewritten}/{self.num_sites} attention sites rewritten")
        if not self.max_rel_err <= LOGITS_RTOL[kind]:
            found.append(f"logits error {self.max_rel_err:.2e} > {LOGITS_RTOL[kind]:.0e}")
        if self.agreement < MIN_AGREEMENT[kind]:
            found.append(f"token agreement {self.agreement:.2f} < {MIN_AGREEMENT[kind]}")
        return found

    def summary(self) -> str:
        verdict = "; ".join(self.failures()) or "PASS"
        return (f"{self.case}: sites {self.num_rewritten}/{self.num_sites} rewritten, logits max "
                f"rel err {self.max_rel_err:.2e} (tol {LOGITS_RTOL[self.case.kv_cache]:.0e}), "
                f"token agreement {self.agreement:.0%}, decode tok/s eager "
                f"{self.eager_tok_s:.1f} | pagedfuse {self.compiled_tok_s:.1f}  {verdict}")


class _NoProgress:
    """Stands in for tqdm when the [bench] extra is not installed."""

    def update(self, n: int = 1) -> None:
        pass

    def write(self, text: str) -> None:
        print(text)

    def close(self) -> None:
        pass


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit="fwd", file=sys.stderr)


def _timed_generate(model: PagedDecoder, prompts: torch.Tensor, steps: int,
                    forward: Callable[..., torch.Tensor], forced: torch.Tensor | None,
                    tick: Callable[[], None]) -> tuple[Generation, float]:
    """The generation and its decode throughput: batch / median decode-step time (the median
    keeps one step slowed by a busy machine from skewing a short run)."""
    device = prompts.device
    stamps: list[float] = []

    def on_step() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stamps.append(time.perf_counter())
        tick()

    gen = generate(model, prompts, steps, forward=forward, forced=forced, on_step=on_step)
    step_seconds = statistics.median(b - a for a, b in itertools.pairwise(stamps))
    return gen, prompts.shape[0] / step_seconds


def _model_and_prompts(case: Case, args: argparse.Namespace) -> tuple[PagedDecoder, torch.Tensor]:
    model = PagedDecoder(case.config(args.block_size), device=args.device, seed=args.seed)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(args.seed))
    return model, prompts.to(args.device)


def run_case(case: Case, args: argparse.Namespace, bar) -> CaseResult:
    """Eager, then compiled with pagedfuse (fed eager's tokens, so logits compare position by
    position); each way once to warm up (and compile), once timed."""
    model, prompts = _model_and_prompts(case, args)
    tick = lambda: bar.update(1)
    _timed_generate(model, prompts, args.steps, model, None, tick)
    eager, eager_tok_s = _timed_generate(model, prompts, args.steps, model, None, tick)

    torch._dynamo.reset()
    pagedfuse.clear_reports()
    backend = pagedfuse.backend(inner=args.inner, verify=args.verify)
    compiled = torch.compile(model, backend=backend)
    _timed_generate(model, prompts, args.steps, compiled, eager.tokens, tick)
    reports = pagedfuse.reports()
    traced, compiled_tok_s = _timed_generate(model, prompts, args.steps, compiled, eager.tokens,
                                             tick)

    expected = eager.logits.float()
    err = ((traced.logits.float() - expected).abs().max() / expected.abs().max()).item()
    generated = slice(args.prompt_len - 1, None)
    picks = traced.logits[:, generated].argmax(dim=-1) == eager.tokens[:, args.prompt_len:]
    return CaseResult(case, reports, err, picks.float().mean().item(), eager_tok_s,
                      compiled_tok_s)


def single_case(args: argparse.Namespace) -> Case:
    """The case the model flags name; tinyllama fp32 rope nhd where they are silent."""
    return Case(args.preset or "tinyllama", args.kv_cache or "fp32", args.alibi,
                args.layout or "nhd")


def select_cases(args: argparse.Namespace) -> list[Case]:
    """--all: the full grid; any model flag: that one case; no flags: DEFAULT_SWEEP."""
    if args.all:
        return list(full_sweep())
    if args.preset or args.kv_cache or args.alibi or args.layout:
        return [single_case(args)]
    return list(DEFAULT_SWEEP)


def run_demo(args: argparse.Namespace) -> list[CaseResult]:
    cases = select_cases(args)
    bar = _progress(len(cases) * 4 * (args.steps + 1), "pagedfuse demo")
    results = []
    try:
        for case in cases:
            bar.write(f"\n== {case}: batch {args.batch}, prompt {args.prompt_len}, "
                      f"{args.steps} decode steps, {args.device}, inner {args.inner} ==")
            result = run_case(case, args, bar)
            for report in result.reports:
                bar.write(report.table())
            bar.write(result.summary())
            results.append(result)
    finally:
        bar.close()
    return results


def cmd_demo(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run_demo(args)
    print("\nsummary")
    for result in results:
        print(f"  {result.summary()}")
    failed = [r for r in results if r.failures()]
    print(f"{len(results) - len(failed)}/{len(results)} cases passed")
    return 1 if failed else 0


def cmd_explain(args: argparse.Namespace) -> int:
    """The report for one decode step (after an eager prefill), without compiling."""
    torch._dynamo.reset()  # another model's shape history would make head_dim look dynamic
    case = single_case(args)
    model, prompts = _model_and_prompts(case, args)
    cache = model.new_cache(args.batch, args.prompt_len + 1)
    with torch.no_grad():
        logits = model(*cache.append(prompts), cache.layers)
        step = cache.append(logits[:, -1:].argmax(dim=-1))
        print(f"{case}: one decode step, batch {args.batch}, {args.prompt_len} cached tokens")
        print(pagedfuse.explain(model, *step, cache.layers))
    return 0


def cmd_bench(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Run the benchmark script for the device, passing the remaining arguments on."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / BENCH_SCRIPTS[args.device]
    if not script.is_file():
        print(f"pagedfuse bench: {script} not found (benchmarks ship with the source tree, "
              "not the wheel)", file=sys.stderr)
        return 1
    return subprocess.call([sys.executable, str(script), *extra])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    model_opts = argparse.ArgumentParser(add_help=False)
    model_opts.add_argument("--preset", choices=list(PRESETS))
    model_opts.add_argument("--kv-cache", choices=KV_CACHE_KINDS)
    model_opts.add_argument("--alibi", action="store_true", help="ALiBi bias instead of RoPE")
    model_opts.add_argument("--layout", choices=LAYOUTS, help="page layout of the KV cache")
    model_opts.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    model_opts.add_argument("--batch", type=_positive, default=4)
    model_opts.add_argument("--prompt-len", type=_positive, default=512,
                            help="long enough that reading the paged context matters")
    model_opts.add_argument("--block-size", type=_positive, default=16)
    model_opts.add_argument("--seed", type=int, default=0)

    parser = argparse.ArgumentParser(prog="pagedfuse", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[model_opts],
                          help="eager vs pagedfuse-compiled decoding, with the reports")
    demo.add_argument("--steps", type=_positive, default=6, help="decode steps after prefill")
    demo.add_argument("--all", action="store_true",
                      help="every preset x cache kind x rope/alibi x layout")
    demo.add_argument("--inner", choices=("inductor", "eager"), default="inductor",
                      help="compiler the rewritten graph is handed to")
    demo.add_argument("--verify", action="store_true",
                      help="replay each rewritten site against the original on first call")
    demo.add_argument("--threads", type=_positive,
                      help="torch CPU threads (default: torch's choice)")
    sub.add_parser("explain", parents=[model_opts],
                   help="print pagedfuse.explain for one decode step")
    bench = sub.add_parser("bench", help="run benchmarks/bench_cpu.py (cpu) or "
                                         "bench_decode.py (cuda); other arguments pass through")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command != "bench" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "explain":
        return cmd_explain(args)
    return cmd_bench(args, extra)


if __name__ == "__main__":
    sys.exit(main())
