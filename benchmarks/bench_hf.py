"""Time to first token and decode throughput of transformers' continuous batching, compiled
with and without pagedfuse.

A random Llama (no download) runs `generate_batch` with `attn_implementation="sdpa"`; the
varlen path is compiled once with plain inductor and once with
`pagedfuse.backend(inner="inductor")`. Each backend first runs the workload once (compiles,
including the automatic-dynamic recompile), then `--repeats` timed runs. Decode throughput =
tokens produced after the last request got its first token / the time from then to the last
token (per-token timestamps from transformers), so prefill and compile time are excluded;
a decode step is one token of the request that decodes longest in that window.
Time to first token: per request, its first token's timestamp minus its creation (every
request is submitted at once, so the last one's is the whole prefill phase); median and last.
The issue's end-to-end H200 case: --requests 16 --min-prompt 4096 --max-prompt 4096
--new-tokens 64 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --layers 4
--max-batch-tokens 4096.
The table is printed, dated, with machine and command; --json keeps the record
(summarize.py reads benchmarks/results/).

    python benchmarks/bench_hf.py --device cuda              # the H200 run
    python benchmarks/bench_hf.py --device cpu --layers 2 --hidden 256 --requests 8 \\
        --new-tokens 16                                      # a quick smoke run
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import CompileConfig, ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache

import pagedfuse

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Run:
    """One timed generate_batch call."""

    decode_tokens: int
    decode_steps: int
    decode_seconds: float
    ttft_seconds: list[float]  # per request
    tokens: list[list[int]]

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds

    @property
    def step_ms(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps

    @property
    def ttft_ms(self) -> tuple[float, float]:
        """Median and last request's time to first token."""
        return (1e3 * statistics.median(self.ttft_seconds), 1e3 * max(self.ttft_seconds))


def zeroing(init: Callable) -> Callable:
    """PagedAttentionCache.__init__ made to zero the caches it allocates. transformers
    allocates them with torch.empty and, in a batch that needs no query padding, reads its
    never-written trash slot (weight 0, but 0 * NaN = NaN; see docs/transformers.md):
    zeroed, every run decodes from the same memory."""

    @functools.wraps(init)
    def zeroed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for cache in (*self.key_cache, *self.value_cache):
            cache.zero_()

    return zeroed


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab,
        max_position_embeddings=4 * (args.max_prompt + args.new_tokens),
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                          dtype=DTYPES[args.dtype])
    return model.to(args.device).eval()


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g)
    return [torch.randint(3, args.vocab, (int(n),), generator=g).tolist() for n in lengths]


def cb_config(args: argparse.Namespace, backend: str | Callable) -> ContinuousBatchingConfig:
    tokens_per_request = args.max_prompt + args.new_tokens
    num_blocks = -(-args.requests * tokens_per_request // args.block_size) + args.requests
    return ContinuousBatchingConfig(
        block_size=args.block_size, num_blocks=num_blocks,
        max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.requests,
        q_padding_interval_size=args.q_interval, kv_padding_interval_size=args.kv_interval,
        varlen_compile_config=CompileConfig(backend=backend, mode=args.mode),
    )


def generate(model, prompts, args: argparse.Namespace, backend) -> Run:
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=cb_config(args, backend),
                               record_timestamps=True, progress_bar=False)
    if len(out) != len(prompts):
        sys.exit(f"generate_batch returned {len(out)} of {len(prompts)} requests (see the log)")
    stamps = [r.timestamps for r in out.values()]
    decode_start = max(s[0] for s in stamps)  # every request has had its prefill
    decode_end = max(s[-1] for s in stamps)
    decoded = [sum(1 for t in s if t > decode_start) for s in stamps]
    ttft = [r.timestamps[0] - r.created_time for r in out.values()]
    return Run(sum(decoded), max(decoded), decode_end - decode_start, ttft,
               [list(r.generated_tokens) for r in out.values()])


def measure(model, prompts, args: argparse.Namespace, backend) -> tuple[list[Run], float]:
    """Timed runs after one untimed run; also the seconds the untimed (compiling) run took."""
    torch._dynamo.reset()
    start = time.perf_counter()
    generate(model, prompts, args, backend)
    first = time.perf_counter() - start
    return [generate(model, prompts, args, backend) for _ in range(args.repeats)], first


def _median_ttft(runs: list[Run]) -> tuple[float, float]:
    """The runs' medians of the median and of the last time to first token, ms."""
    return (statistics.median(r.ttft_ms[0] for r in runs),
            statistics.median(r.ttft_ms[1] for r in runs))


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU threads"


def markdown(args: argparse.Namespace, rows: dict[str, tuple[list[Run], float]], sites: str,
             same_tokens: bool, command: str) -> str:
    import transformers

    lines = [
        f"\n## transformers continuous batching decode ({datetime.date.today().isoformat()}, "
        f"{machine(args.device)}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, Python {platform.python_version()})",
        "",
        f"Command: `{command}`. Random Llama: {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, {args.dtype}; "
        f"{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
        f"{args.new_tokens} new tokens each, greedy; block_size {args.block_size}, "
        f"max_batch_tokens {args.max_batch_tokens}, padding intervals q {args.q_interval} / "
        f"kv {args.kv_interval}, compile mode {args.mode!r}. Median of {args.repeats} runs "
        f"after one compiling run; KV caches zero-initialized. pagedfuse sites rewritten: "
        f"{sites}. Same tokens with and without pagedfuse: {'yes' if same_tokens else 'NO'}.",
        "",
        "| backend | time to first token, ms (median / last) | decode tok/s | "
        "ms per decode step | first (compiling) run s |",
        "|---|---|---|---|---|",
    ]
    for name, (runs, first) in rows.items():
        decode = statistics.median(r.decode_tps for r in runs)
        step = statistics.median(r.step_ms for r in runs)
        median_ttft, last_ttft = _median_ttft(runs)
        lines.append(f"| {name} | {median_ttft:.1f} / {last_ttft:.1f} | {decode:,.0f} | "
                     f"{step:.2f} | {first:.1f} |")
    base, fused = (statistics.median(r.decode_tps for r in runs) for runs, _ in rows.values())
    lines += ["", f"pagedfuse / inductor decode throughput: {fused / base:.2f}x"]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--q-interval", type=int, default=64, help="q_padding_interval_size")
    p.add_argument("--kv-interval", type=int, default=512, help="kv_padding_interval_size")
    p.add_argument("--mode", default="default", help="torch.compile mode for inductor")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the record (environment, settings, rows) here")
    args = p.parse_args()
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def main() -> None:
    args = parse_args()
    # Each query continuous batching schedules sees at least its own key (a row that only pads
    # the batch may not, and nothing reads its output); on CUDA, whose SDPA gives a fully
    # masked row other values than the op, the rewrite must be told so.
    os.environ.setdefault("PAGEDFUSE_ASSUME_VISIBLE_KEY", "1")
    command = "python " + shlex.join(sys.argv)
    PagedAttentionCache.__init__ = zeroing(PagedAttentionCache.__init__)
    model = build_model(args)
    prompts = make_prompts(args)
    rows = {"inductor": measure(model, prompts, args, "inductor")}
    pagedfuse.clear_reports()
    rows["pagedfuse + inductor"] = measure(
        model, prompts, args, pagedfuse.backend(inner="inductor", mode=args.mode))
    reports = pagedfuse.reports()
    sites = ", ".join(f"{r.num_rewritten}/{r.num_sites}" for r in reports) or "no graphs"
    same = rows["inductor"][0][0].tokens == rows["pagedfuse + inductor"][0][0].tokens
    print(markdown(args, rows, sites, same, command))
    if args.json:
        import transformers

        record = {
            "benchmark": "hf",
            "env": {"date": datetime.date.today().isoformat(), "machine": machine(args.device),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "python": platform.python_version(), "command": command},
            "settings": vars(args), "sites": sites, "same_tokens": same,
            "rows": [{"backend": name,
                      "decode_tok_s": statistics.median(r.decode_tps for r in runs),
                      "step_ms": statistics.median(r.step_ms for r in runs),
                      "ttft_ms": _median_ttft(runs)[0], "last_ttft_ms": _median_ttft(runs)[1],
                      "first_run_s": first} for name, (runs, first) in rows.items()],
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
