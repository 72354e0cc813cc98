"""``pagedfuse demo | explain | doctor | bench``.

``demo`` runs the paged decoder (pagedfuse.models) three ways: eagerly, compiled with inductor
alone (what a user would otherwise run) and compiled with pagedfuse (+ inductor). It prints a
summary table first (attention sites rewritten, the logits' error against eager, greedy-token
agreement, prefill time and decode tokens/s of each way), the full reports with ``--verbose``,
and exits non-zero when a case fails: an attention site left unrewritten, the logits' max
relative error over ``LOGITS_RTOL`` or the token agreement under ``MIN_AGREEMENT``. Both are
looser than the op tolerances (docs/design.md) because the error compounds over layers, and
INT8 adds the query quantization the fused op does (the eager model attends with a float
query). The progress bar goes to stderr.

``demo --model smollm2`` runs a trained model instead (SmolLM2-135M-Instruct, fetched on first
use): real text for a few questions, eager, inductor alone and pagedfuse, per KV cache kind.

``demo --tp N``, on each rank ``torchrun --nproc-per-node N`` starts, shards one preset over
the ranks (pagedfuse.models.tensor_parallel) and compares every rank with the unsharded model
(docs/tensor-parallel.md).

``explain`` prints pagedfuse.explain for a preset's decode step, or for a user's function
(``module:function`` or ``file.py:function``) on the inputs a factory returns.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import pagedfuse
from pagedfuse.models import (
    KV_CACHE_KINDS,
    LAYOUTS,
    PRESETS,
    DecoderConfig,
    Generation,
    PagedDecoder,
    from_transformers,
    generate,
    preset,
    smollm2,
)

# max |compiled - eager| / max |eager| over all logits, per KV cache kind.
LOGITS_RTOL = {"fp32": 1e-3, "bf16": 3e-2, "int8": 1e-1}
# Fraction of greedy tokens the compiled model must pick as eager did (fed the same history):
# fp32 must agree everywhere; bf16 and INT8 may flip near ties (random weights give flat
# logits: llama3 int8 flips 1 of 14 at the defaults), a broken kernel agrees almost nowhere.
MIN_AGREEMENT = {"fp32": 1.0, "bf16": 0.8, "int8": 0.8}
BENCH_SCRIPTS = {"cpu": "bench_cpu.py", "cuda": "bench_decode.py"}
PATHS = ("eager", "inductor", "pagedfuse")  # the ways the demo runs a model, in table order


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


@dataclass(frozen=True)
class Timing:
    """One way of running a generation: the prefill's wall time and decode tokens/s (batch /
    the fastest decode step's time)."""

    prefill_ms: float
    tok_s: float


@dataclass
class CaseResult:
    case: Case
    reports: list  # pagedfuse Report objects, one per compiled graph
    max_rel_err: float
    agreement: float
    timings: dict[str, Timing] = field(default_factory=dict)  # by PATHS entry

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

    def verdict(self) -> str:
        return "; ".join(self.failures()) or "PASS"

    def row(self, paths: Sequence[str]) -> list[str]:
        """The case's line of the summary table."""
        times = [self.timings.get(p) for p in paths]
        prefill = " / ".join("-" if t is None else f"{t.prefill_ms:.1f}" for t in times)
        decode = " / ".join("-" if t is None else f"{t.tok_s:.1f}" for t in times)
        base = self.timings.get("inductor") or self.timings.get("eager")
        mine = self.timings.get("pagedfuse")
        speedup = f"{mine.tok_s / base.tok_s:.2f}x" if mine and base and base.tok_s else "-"
        return [str(self.case), f"{self.num_rewritten}/{self.num_sites}",
                f"{self.max_rel_err:.1e} (tol {LOGITS_RTOL[self.case.kv_cache]:.0e})",
                f"{self.agreement:.0%}", prefill, decode, speedup, self.verdict()]


def format_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [head, *rows])


def summary_table(results: Sequence[CaseResult], paths: Sequence[str]) -> str:
    ways = "/".join(paths)
    baseline = "inductor" if "inductor" in paths else "eager"
    head = ["case", "rewritten", "logits max rel err", "tokens as eager",
            f"prefill ms ({ways})", f"decode tok/s ({ways})", f"pagedfuse vs {baseline}",
            "result"]
    return format_table(head, [r.row(paths) for r in results])


class _NoProgress:
    """Stands in for tqdm when the [bench] extra is not installed."""

    def update(self, n: int = 1) -> None:
        pass

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
                    tick: Callable[[], None],
                    prompt_lens: list[int] | None = None) -> tuple[Generation, Timing]:
    """The generation and its timing. Decode throughput comes from the fastest decode step:
    on a shared machine a few steps of a short run are slowed many times over by other jobs
    (on the 2-core test machine steps of one compiled decode graph ranged from 3 to 57 ms),
    which even the median of six does not hide; the fastest is the machine's own speed."""
    device = prompts.device
    stamps: list[float] = []

    def on_step() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stamps.append(time.perf_counter())
        tick()

    start = time.perf_counter()
    gen = generate(model, prompts, steps, forward=forward, forced=forced, on_step=on_step,
                   prompt_lens=prompt_lens)
    step_seconds = min(b - a for a, b in itertools.pairwise(stamps))
    return gen, Timing(1e3 * (stamps[0] - start), prompts.shape[0] / step_seconds)


def _model_and_prompts(case: Case, args: argparse.Namespace) -> tuple[PagedDecoder, torch.Tensor]:
    model = PagedDecoder(case.config(args.block_size), device=args.device, seed=args.seed)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(args.seed))
    return model, prompts.to(args.device)


def _model_paths(inner: str) -> tuple[str, ...]:
    """--inner eager compiles nothing with inductor, so it drops the inductor column too."""
    return PATHS if inner == "inductor" else ("eager", "pagedfuse")


def _model_forward(model: PagedDecoder, path: str, args: argparse.Namespace):
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    if path == "eager":
        return model
    if path == "inductor":
        return torch.compile(model)
    return torch.compile(model, backend=pagedfuse.backend(inner=args.inner, verify=args.verify))


def run_case(case: Case, args: argparse.Namespace, bar) -> CaseResult:
    """Eager once, each compiled way twice: once to compile, once timed. The compiled ways are
    fed eager's tokens, so their logits compare with eager's position by position."""
    model, prompts = _model_and_prompts(case, args)
    tick = lambda: bar.update(1)
    timings, reports, eager, traced = {}, [], None, None
    for path in _model_paths(args.inner):
        forward = _model_forward(model, path, args)
        forced = None if eager is None else eager.tokens
        if path != "eager":
            _timed_generate(model, prompts, args.steps, forward, forced, tick)
        if path == "pagedfuse":
            reports = pagedfuse.reports()
        gen, timings[path] = _timed_generate(model, prompts, args.steps, forward, forced, tick)
        eager = gen if path == "eager" else eager
        traced = gen if path == "pagedfuse" else traced

    expected = eager.logits.float()
    err = ((traced.logits.float() - expected).abs().max() / expected.abs().max()).item()
    generated = slice(args.prompt_len - 1, None)
    picks = traced.logits[:, generated].argmax(dim=-1) == eager.tokens[:, args.prompt_len:]
    return CaseResult(case, reports, err, picks.float().mean().item(), timings)


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
    paths = _model_paths(args.inner)
    forwards = (2 * len(paths) - 1) * (args.steps + 1)  # eager once, compiled ways twice
    bar = _progress(len(cases) * forwards, "pagedfuse demo")
    try:
        return [run_case(case, args, bar) for case in cases]
    finally:
        bar.close()


def print_demo(results: Sequence[CaseResult], args: argparse.Namespace) -> None:
    """The summary table, the reasons behind each failed case, and with --verbose every
    graph's full report."""
    paths = _model_paths(args.inner)
    print(f"pagedfuse demo: batch {args.batch}, prompt {args.prompt_len}, {args.steps} decode "
          f"steps, {args.device}, pagedfuse + {args.inner}; prefill: wall time of the first "
          "forward; decode tok/s: batch / the fastest decode step")
    print(summary_table(results, paths))
    failed = [r for r in results if r.failures()]
    print(f"{len(results) - len(failed)}/{len(results)} cases passed")
    for result in failed:
        print(f"\n{result.case}: {result.verdict()}")
        for report in result.reports:
            print("\n".join(_report_lines(report)))
    if args.verbose:
        for result in results:
            print(f"\n== {result.case} ==")
            for report in result.reports:
                print(report.table())
    elif results:
        print("\n(the full reports: --verbose)")


MODEL_QUESTIONS = ("What is the capital of France?", "Who were the first men on the moon?",
                   "Write one sentence about the sea.")
MODEL_CACHES = ("fp32", "bf16", "int8")


@dataclass
class TextRun:
    """One way of running the real model over all questions."""

    path: str  # eager, inductor or pagedfuse
    tokens: list[list[int]]  # the generated tokens, one list per question
    tok_s: float
    reports: list  # pagedfuse reports (pagedfuse only)
    prefill_ms: float = 0.0

    def agreement(self, other: TextRun) -> tuple[int, int]:
        """(tokens equal to ``other``'s at the same position, tokens)."""
        pairs = [(a, b) for mine, theirs in zip(self.tokens, other.tokens, strict=True)
                 for a, b in zip(mine, theirs, strict=True)]
        return sum(a == b for a, b in pairs), len(pairs)


def run_model_cache(loaded: smollm2.LoadedModel, kv_cache: str, args: argparse.Namespace,
                    bar) -> list[TextRun]:
    """Every path over all questions in one right-padded batch (one prefill graph, one decode
    graph); the compile happens in the run, outside the fastest decode step it reports (the
    prefill time includes it)."""
    questions = [smollm2.chat_tokens(loaded.tokenizer, q) for q in MODEL_QUESTIONS]
    lengths = [len(q) for q in questions]
    pad = loaded.tokenizer.pad_token_id or 0
    prompts = torch.tensor([q + [pad] * (max(lengths) - len(q)) for q in questions],
                           device=args.device)
    model = from_transformers(loaded.hf_model, device=args.device, kv_cache=kv_cache,
                              layout=args.layout or "nhd", block_size=args.block_size)
    runs = []
    for path in _model_paths(args.inner):
        forward = _model_forward(model, path, args)
        gen, timing = _timed_generate(model, prompts, args.steps, forward, None,
                                      lambda: bar.update(1), prompt_lens=lengths)
        reports = pagedfuse.reports() if path == "pagedfuse" else []
        runs.append(TextRun(path, gen.tokens[:, prompts.shape[1]:].tolist(), timing.tok_s,
                            reports, timing.prefill_ms))
    return runs


def _text(loaded: smollm2.LoadedModel, tokens: list[int]) -> str:
    """The answer up to the end-of-turn token, on one line."""
    eos = loaded.tokenizer.eos_token_id
    end = tokens.index(eos) if eos in tokens else len(tokens)
    return " ".join(loaded.tokenizer.decode(tokens[:end], skip_special_tokens=True).split())


def model_cache_failures(kv_cache: str, runs: list[TextRun]) -> list[str]:
    """A pagedfuse graph with an attention site left, or fp32 text that differs from eager."""
    found = []
    for run in runs:
        sites = sum(r.num_sites for r in run.reports)
        rewritten = sum(r.num_rewritten for r in run.reports)
        if run.path == "pagedfuse" and (sites == 0 or rewritten < sites):
            found.append(f"{kv_cache}: {rewritten}/{sites} attention sites rewritten")
        same, total = run.agreement(runs[0])
        if kv_cache == "fp32" and same < total:
            found.append(f"fp32: {run.path} picked {total - same} tokens eager did not")
    return found


def _report_lines(report) -> list[str]:
    """A graph's report in one line (30 identical layers make the full table long), plus the
    reason for every site left as written."""
    ops = sorted({s.replacement for s in report.sites if s.rewritten})
    lines = [f"pagedfuse ({report.graph}): {report.num_rewritten}/{report.num_sites} attention "
             f"sites rewritten -> {', '.join(ops) or 'nothing'}"]
    for site in report.sites:
        failed = site.first_failure
        if not site.rewritten:
            lines.append(f"  kept {site.site}: " + (f"{failed.name}: {failed.reason}" if failed
                                                     else "no pattern matched"))
    return lines


def print_model_cache(loaded: smollm2.LoadedModel, kv_cache: str, runs: list[TextRun],
                      fp32_eager: TextRun | None, write: Callable[[str], None]) -> None:
    for run in runs:
        for report in run.reports:
            for line in _report_lines(report):
                write(line)
    width = max(len(r.path) for r in runs)
    for i, question in enumerate(MODEL_QUESTIONS):
        write(f"[{i + 1}] {question}")
        for run in runs:
            write(f"    {run.path:<{width}}  {_text(loaded, run.tokens[i])}")
    eager = runs[0]
    lines = []
    for run in runs:
        reference, name = (fp32_eager, "eager fp32") if run is eager else (eager, "eager")
        note = ""
        if reference is not None and reference is not run:
            same, total = run.agreement(reference)
            note = f" ({same}/{total} tokens as {name})"
        lines.append(f"{run.path} {run.tok_s:.1f} tok/s, prefill {run.prefill_ms:.0f} ms{note}")
    write(f"{kv_cache} decode: " + " | ".join(lines))


def cmd_demo_model(args: argparse.Namespace) -> int:
    try:
        loaded = smollm2.load(args.model_path)
    except smollm2.ModelUnavailable as err:
        print(f"pagedfuse demo: {err}", file=sys.stderr)
        return 2
    caches = [args.kv_cache] if args.kv_cache else list(MODEL_CACHES)
    paths = _model_paths(args.inner)
    bar = _progress(len(caches) * len(paths) * (args.steps + 1), "pagedfuse demo")
    failures, fp32_eager, sections = [], None, []
    try:
        for kv_cache in caches:
            runs = run_model_cache(loaded, kv_cache, args, bar)
            fp32_eager = runs[0] if kv_cache == "fp32" else fp32_eager
            sections.append((kv_cache, runs, fp32_eager))
            failures += model_cache_failures(kv_cache, runs)
    finally:
        bar.close()
    for kv_cache, runs, fp32_reference in sections:
        print(f"\n== SmolLM2-135M-Instruct, {kv_cache} KV cache: {len(MODEL_QUESTIONS)} "
              f"questions, {args.steps + 1} new tokens, {args.device}; {', '.join(paths)} "
              "(prefill includes the first compile) ==")
        print_model_cache(loaded, kv_cache, runs, fp32_reference, print)
    print("\n" + ("\n".join(failures) if failures else
                  f"PASS: every attention site rewritten for {', '.join(caches)}"))
    return 1 if failures else 0


@dataclass
class RankRun:
    """One row of ``demo --tp``'s summary: a rank's heads and result (its sites, its logits
    against tp=1, its timing under "pagedfuse"), or the unsharded tp=1 reference's."""

    label: str  # the rank, or "tp=1"
    q_heads: range
    kv_heads: range
    result: CaseResult

    def row(self) -> list[str]:
        r, timing = self.result, self.result.timings["pagedfuse"]
        span = lambda heads: f"{heads.start}-{heads.stop - 1}"
        compared = self.label != "tp=1"
        return [self.label, span(self.q_heads), span(self.kv_heads),
                f"{r.num_rewritten}/{r.num_sites}",
                f"{r.max_rel_err:.1e}" if compared else "-",
                f"{r.agreement:.0%}" if compared else "-",
                f"{timing.prefill_ms:.1f}", f"{timing.tok_s:.1f}", r.verdict()]


def _tp_generate(model: PagedDecoder, prompts: torch.Tensor, args: argparse.Namespace,
                 forced: torch.Tensor | None, bar) -> tuple[Generation, list, Timing]:
    """Compile ``model`` with pagedfuse, generate once to compile and once timed."""
    forward = _model_forward(model, "pagedfuse", args)
    tick = lambda: bar.update(1)
    _timed_generate(model, prompts, args.steps, forward, forced, tick)
    reports = pagedfuse.reports()
    gen, timing = _timed_generate(model, prompts, args.steps, forward, forced, tick)
    return gen, reports, timing


def _demo_tp(args: argparse.Namespace, mesh, bar) -> int:
    """Rank 0 runs the unsharded model and hands its tokens and logits to every rank; each
    rank then generates with its shard, fed those tokens (so logits compare position by
    position), checks its own sites and logits, and rank 0 gathers the results."""
    import torch.distributed as dist

    from pagedfuse.models import tensor_parallel

    world, rank = mesh.size(), mesh.get_local_rank()
    case = single_case(args)
    config = case.config(args.block_size)
    reference = [None, None]
    if rank == 0:
        model, prompts = _model_and_prompts(case, args)
        gen, reports, timing = _tp_generate(model, prompts, args, None, bar)
        result = CaseResult(case, reports, 0.0, 1.0, {"pagedfuse": timing})
        reference = [Generation(gen.tokens.cpu(), gen.logits.cpu()),
                     RankRun("tp=1", range(config.num_q_heads), range(config.num_kv_heads),
                             result)]
    dist.broadcast_object_list(reference, src=0)
    expected = reference[0]

    model, prompts = _model_and_prompts(case, args)
    tensor_parallel.parallelize(model, mesh)
    forced = expected.tokens.to(prompts.device)
    gen, reports, timing = _tp_generate(model, prompts, args, forced, bar)
    want = expected.logits.float()
    err = ((gen.logits.float().cpu() - want).abs().max() / want.abs().max()).item()
    generated = slice(args.prompt_len - 1, None)
    picks = gen.logits[:, generated].argmax(dim=-1).cpu() == expected.tokens[:, args.prompt_len:]
    shard = tensor_parallel.head_shard(config.num_q_heads, config.num_kv_heads, world, rank)
    mine = RankRun(str(rank), shard.q_heads, shard.kv_heads, CaseResult(
        case, reports, err, picks.float().mean().item(), {"pagedfuse": timing}))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    code = [0]
    if rank == 0:
        bar.close()
        code[0] = print_demo_tp(case, [reference[1], *gathered], args)
    dist.broadcast_object_list(code, src=0)
    return code[0]


def print_demo_tp(case: Case, runs: list[RankRun], args: argparse.Namespace) -> int:
    """The summary of ``demo --tp`` (the tp=1 reference, then every rank); the exit code: 1
    when any of them left an attention site or a rank's logits or tokens differ from tp=1."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"pagedfuse demo --tp {args.tp}: {case}, batch {args.batch}, prompt "
          f"{args.prompt_len}, {args.steps} decode steps, {args.device} ({backend}), pagedfuse "
          f"+ {args.inner}; logits error and tokens against tp=1; prefill: wall time of the "
          "first forward; decode tok/s: batch / the fastest decode step")
    head = ["rank", "query heads", "KV heads", "rewritten", "logits max rel err",
            "tokens as tp=1", "prefill ms", "decode tok/s", "result"]
    print(format_table(head, [run.row() for run in runs]))
    failed = [run for run in runs if run.result.failures()]
    print(f"{len(runs) - len(failed)}/{len(runs)} passed (logits tol "
          f"{LOGITS_RTOL[case.kv_cache]:.0e})")
    for run in runs:
        for report in run.result.reports:
            if args.verbose:
                print(f"\n== rank {run.label} ==\n{report.table()}")
            elif report.num_rewritten < report.num_sites:
                print("\n".join(f"rank {run.label}: {line}" for line in _report_lines(report)))
    return 1 if failed else 0


def cmd_demo_tp(args: argparse.Namespace) -> int:
    """``demo --tp N`` on each of the N ranks torchrun starts (gloo on the CPU, NCCL on CUDA
    with cuda:LOCAL_RANK per rank); only rank 0 prints."""
    import torch.distributed as dist

    from pagedfuse.models import tensor_parallel

    try:
        mesh = tensor_parallel.init_from_env(args.device)
    except RuntimeError as err:
        print(f"pagedfuse demo: {err}", file=sys.stderr)
        return 2
    try:
        rank = mesh.get_local_rank()
        problem = None if mesh.size() == args.tp else \
            f"--tp {args.tp}: torchrun started {mesh.size()} processes"
        if problem is None:
            try:
                tensor_parallel.rank_config(single_case(args).config(args.block_size), args.tp,
                                            rank)
            except ValueError as err:
                problem = f"--tp {args.tp}: {err}"
        if problem is not None:
            if rank == 0:
                print(f"pagedfuse demo: {problem}", file=sys.stderr)
            return 2
        forwards = 4 * (args.steps + 1)  # the reference (rank 0) and the shard, each twice
        bar = _progress(forwards, "pagedfuse demo --tp") if rank == 0 else _NoProgress()
        return _demo_tp(args, mesh, bar)
    finally:
        dist.destroy_process_group()


def cmd_demo(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        # Every query of the demo's models sees at least its own key; on CUDA, whose SDPA
        # gives a fully masked row other values than the op, the rewrite must be told so.
        os.environ.setdefault("PAGEDFUSE_ASSUME_VISIBLE_KEY", "1")
    if args.model:
        return cmd_demo_model(args)
    if args.tp:
        return cmd_demo_tp(args)
    results = run_demo(args)
    print_demo(results, args)
    return 1 if any(r.failures() for r in results) else 0


def _load_object(spec: str, what: str) -> Any:
    """``module:name`` or ``path/to/file.py:name`` (dots in ``name`` reach attributes)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{what}: expected module:name or file.py:name, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"{what}: no file {target}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(path.stem, module)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: {target} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def explain_target(target: str, inputs: str | None) -> pagedfuse.Report:
    """pagedfuse.explain of the function ``target`` names on the inputs ``inputs`` makes:
    a tuple of positional arguments, a dict of keyword arguments, or one argument (default
    factory: ``example_inputs`` beside the function)."""
    fn = _load_object(target, "function")
    if not callable(fn):
        raise ValueError(f"function: {target} is not callable")
    if inputs is None:
        where = target.rpartition(":")[0]
        try:
            factory = _load_object(f"{where}:example_inputs", "--inputs")
        except ValueError:
            raise ValueError(f"--inputs: not given, and {where} has no example_inputs; pass "
                             "--inputs module:factory, a callable returning the example "
                             "inputs") from None
    else:
        factory = _load_object(inputs, "--inputs")
    made = factory() if callable(factory) else factory
    torch._dynamo.reset()
    with torch.no_grad():
        if isinstance(made, dict):
            return pagedfuse.explain(fn, **made)
        return pagedfuse.explain(fn, *(made if isinstance(made, (tuple, list)) else (made,)))


def cmd_explain(args: argparse.Namespace) -> int:
    """A user's function on its example inputs, or one preset decode step (after an eager
    prefill), reported without compiling."""
    if args.target:
        try:
            print(explain_target(args.target, args.inputs))
        except (ValueError, ImportError) as err:
            print(f"pagedfuse explain: {err}", file=sys.stderr)
            return 2
        return 0
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


def cmd_doctor(args: argparse.Namespace) -> int:
    """Versions, kernel libraries, missing fast paths, the backend per typical call; exit 1
    when a fast path is missing."""
    from pagedfuse import doctor

    print(doctor.report())
    return 1 if doctor.missing_fast_paths() else 0


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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default (where it has one)."""


def build_parser() -> argparse.ArgumentParser:
    model_opts = argparse.ArgumentParser(add_help=False)
    model_opts.add_argument("--preset", choices=list(PRESETS),
                            help="model geometry (default: tinyllama where one case is asked "
                            "for, every preset in the demo's sweep)")
    model_opts.add_argument("--kv-cache", choices=KV_CACHE_KINDS, help="KV cache kind")
    model_opts.add_argument("--alibi", action="store_true", help="ALiBi bias instead of RoPE")
    model_opts.add_argument("--layout", choices=LAYOUTS, help="page layout of the KV cache")
    model_opts.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device")
    model_opts.add_argument("--batch", type=_positive, default=4, help="sequences")
    model_opts.add_argument("--prompt-len", type=_positive, default=512,
                            help="long enough that reading the paged context matters")
    model_opts.add_argument("--block-size", type=_positive, default=16,
                            help="tokens per KV cache page")
    model_opts.add_argument("--seed", type=int, default=0, help="weights and prompts")

    parser = argparse.ArgumentParser(prog="pagedfuse", description=__doc__.split("\n")[0],
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"pagedfuse {pagedfuse.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[model_opts], formatter_class=_HelpFormatter,
                          help="eager vs inductor vs pagedfuse: summary table, reports")
    demo.add_argument("--steps", type=_positive,
                      help="decode steps after prefill (default 6; 31 with --model)")
    demo.add_argument("--model", choices=("smollm2",),
                      help="a trained model (fetched on first use) generating text for fixed "
                      "questions, instead of the random presets; --preset, --alibi, --all, "
                      "--batch, --prompt-len and --seed do not apply")
    demo.add_argument("--model-path", help="the model's GGUF file (or its folder), e.g. "
                      "copied to a machine with no network")
    demo.add_argument("--all", action="store_true",
                      help="every preset x cache kind x rope/alibi x layout")
    demo.add_argument("--inner", choices=("inductor", "eager"), default="inductor",
                      help="compiler the rewritten graph is handed to (eager: no inductor "
                      "column either)")
    demo.add_argument("--verify", action="store_true",
                      help="replay each rewritten site against the original on first call")
    demo.add_argument("--verbose", action="store_true",
                      help="print every graph's full report after the summary")
    demo.add_argument("--threads", type=_positive,
                      help="torch CPU threads (default: torch's choice)")
    demo.add_argument("--tp", type=_positive,
                      help="tensor parallel over N ranks, each launched by torchrun "
                      "--nproc-per-node N (gloo on cpu, NCCL on cuda): one case, every rank's "
                      "sites and its tokens against tp=1")
    explain = sub.add_parser("explain", parents=[model_opts], formatter_class=_HelpFormatter,
                             help="print pagedfuse.explain for a function or a preset's "
                             "decode step")
    explain.add_argument("target", nargs="?",
                         help="module:function or file.py:function to explain (default: the "
                         "preset's decode step)")
    explain.add_argument("--inputs", help="module:factory (or file.py:factory) returning the "
                         "function's example inputs: a tuple of arguments, a dict of keyword "
                         "arguments or one argument (default: example_inputs beside the "
                         "function)")
    sub.add_parser("doctor", formatter_class=_HelpFormatter,
                   help="versions, kernel libraries, missing fast paths, the backend each op "
                   "takes for typical calls")
    bench = sub.add_parser("bench", formatter_class=_HelpFormatter,
                           help="run benchmarks/bench_cpu.py (cpu) or bench_decode.py (cuda); "
                           "other arguments pass through")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command != "bench" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    if args.command == "demo":
        if args.model and (args.preset or args.alibi or args.all):
            parser.error("--model: runs the trained model; --preset, --alibi and --all pick "
                         "random presets")
        if args.tp and (args.model or args.all):
            parser.error("--tp: shards one random preset; --model and --all do not apply")
        if args.steps is None:
            args.steps = 31 if args.model else 6
        return cmd_demo(args)
    if args.command == "explain":
        return cmd_explain(args)
    if args.command == "doctor":
        return cmd_doctor(args)
    return cmd_bench(args, extra)


if __name__ == "__main__":
    sys.exit(main())
