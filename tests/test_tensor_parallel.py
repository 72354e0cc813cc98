"""Tensor parallelism (pagedfuse.models.tensor_parallel): which heads each rank gets, and tp=2
over gloo on the CPU, two processes this test spawns: every rank compiles its shard with
pagedfuse, every attention site of every rank is rewritten (or kept with the reason on that
rank), and the tokens and logits equal the unsharded model's. Also transformers' own tensor
parallelism (``tp_plan="auto"``) under continuous batching through pagedfuse."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pagedfuse
from pagedfuse import cli
from pagedfuse.models import PRESETS, PagedDecoder, generate, preset
from pagedfuse.models.tensor_parallel import head_shard, init_from_env, parallelize, rank_config

WORLD = 2
STEPS = 3
BATCH, PROMPT = 2, 12
# Each case's config at tp=2. gqa: 16 query and 2 KV heads per rank; kv_replicated: one KV
# head for two ranks (ALiBi too, whose per-head slopes are sharded with the query heads);
# head_dim16: a shape the CPU kernel lacks, which each rank must report and keep.
CASES = {
    "gqa": preset("tinyllama"),
    "kv_replicated": preset("tinyllama", num_kv_heads=1, alibi=True),
    "head_dim16": preset("tinyllama", head_dim=16),
}


# -- which heads each rank gets ---------------------------------------------------------------

@pytest.mark.parametrize("num_q_heads, num_kv_heads, world_size", [
    (32, 4, 2), (32, 8, 4), (32, 4, 4), (24, 4, 8), (16, 1, 2), (8, 2, 8), (32, 32, 8),
    (12, 4, 1),
])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(num_q_heads, num_kv_heads,
                                                           world_size):
    """Query heads in equal consecutive runs; a rank's KV heads are exactly those its query
    heads read under the model's GQA grouping (head h reads h // group), counted plainly."""
    group = num_q_heads // num_kv_heads
    shards = [head_shard(num_q_heads, num_kv_heads, world_size, r) for r in range(world_size)]
    per_rank = num_q_heads // world_size
    holders = {}
    for rank, shard in enumerate(shards):
        assert list(shard.q_heads) == [h for h in range(num_q_heads) if h // per_rank == rank]
        read = sorted({h // group for h in shard.q_heads})
        assert list(shard.kv_heads) == read
        for kv in read:
            holders.setdefault(kv, []).append(rank)
    assert sorted(holders) == list(range(num_kv_heads))  # every KV head lives somewhere
    assert all(shard.kv_replicas == len(holders[shard.kv_heads[0]]) for shard in shards)
    local = rank_config(preset("tinyllama", num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=32), world_size, 0)
    assert (local.num_q_heads, local.num_kv_heads) == (per_rank, len(shards[0].kv_heads))


def test_qwen35_at_tp8_gives_one_replicated_kv_head_and_three_query_heads_per_rank():
    cfg = preset("qwen35")
    shards = [head_shard(cfg.num_q_heads, cfg.num_kv_heads, 8, r) for r in range(8)]
    assert [(list(s.q_heads), list(s.kv_heads)) for s in shards[:3]] == \
        [([0, 1, 2], [0]), ([3, 4, 5], [0]), ([6, 7, 8], [1])]
    assert {s.kv_replicas for s in shards} == {2}


@pytest.mark.parametrize("args, message", [
    ((30, 5, 4, 0), "num_q_heads: 30 query heads do not split evenly over 4 ranks"),
    ((24, 4, 3, 0), "num_kv_heads: 4 KV heads neither split evenly over 3 ranks"),
    ((12, 2, 3, 0), "num_kv_heads: 2 KV heads do not divide 3 ranks"),
    ((32, 3, 2, 0), "num_q_heads: 32 is not a multiple of num_kv_heads 3"),
    ((32, 4, 2, 2), "rank: 2 not in [0, 2)"),
    ((32, 4, 0, 0), "world_size: must be >= 1"),
])
def test_heads_that_do_not_shard_raise_naming_the_argument(args, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        head_shard(*args)


def test_an_mlp_that_does_not_split_raises():
    with pytest.raises(ValueError, match="intermediate_size: 510 does not split evenly over 4"):
        rank_config(preset("tinyllama", intermediate_size=510), 4, 0)


# -- tp=2 over gloo ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, out: Path, *args) -> None:
    """``worker(rank, out, *args)`` in WORLD processes, with torchrun's variables set."""
    mp.spawn(_rank_main, args=(worker, _free_port(), out, args), nprocs=WORLD, join=True)


def _rank_main(rank: int, worker, port: int, out: Path, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a small shared machine
    try:
        worker(rank, out, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _written_kv(cache) -> torch.Tensor:
    """Layer 0's written K rows [tokens, Hkv, D] (nhd pages), in the sequences' order."""
    bs = cache.config.block_size
    slots = [cache.blocks[b][p // bs] * bs + p % bs
             for b, length in enumerate(cache.lengths) for p in range(length)]
    slots = torch.tensor(slots)
    return cache.layers[0].key[slots // bs, slots % bs]


def _generate(model: PagedDecoder, prompts: torch.Tensor, forward=None):
    """The generation and the cache it filled."""
    caches, new_cache = [], model.new_cache
    model.new_cache = lambda *a, **k: caches.append(new_cache(*a, **k)) or caches[-1]
    gen = generate(model, prompts, STEPS, forward=forward)
    return gen, caches[0]


def _decoder_worker(rank: int, out: Path) -> None:
    """Per case: the unsharded model eagerly, then this rank's shard eagerly and compiled
    with pagedfuse; saves logits, tokens, written K rows and the compiled graphs' reports."""
    mesh = init_from_env("cpu")
    results = {}
    for name, config in CASES.items():
        prompts = torch.randint(0, config.vocab_size, (BATCH, PROMPT),
                                generator=torch.Generator().manual_seed(1))
        full, full_cache = _generate(PagedDecoder(config, seed=3), prompts)
        model = parallelize(PagedDecoder(config, seed=3), mesh)
        eager, _ = _generate(model, prompts)
        torch._dynamo.reset()
        pagedfuse.clear_reports()
        compiled, cache = _generate(model, prompts, torch.compile(
            model, backend=pagedfuse.backend(inner="eager")))
        results[name] = dict(
            full=full, eager=eager, compiled=compiled, full_kv=_written_kv(full_cache),
            kv=_written_kv(cache), cache_shape=tuple(cache.layers[0].key.shape),
            reports=pagedfuse.reports())
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[dict]:
    """Both ranks' results, one spawn for every case."""
    out = tmp_path_factory.mktemp("tp2")
    _spawn(_decoder_worker, out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("name", CASES)
def test_tp2_tokens_and_logits_equal_tp1(tp2, name):
    for rank in range(WORLD):
        run = tp2[rank][name]
        full = run["full"]
        for way in ("eager", "compiled"):
            assert torch.equal(run[way].tokens, full.tokens), (rank, way)
            assert _rel_err(run[way].logits, full.logits) < 1e-5, (rank, way)


@pytest.mark.parametrize("name", ["gqa", "kv_replicated"])
def test_every_site_is_rewritten_on_every_rank(tp2, name):
    layers = CASES[name].num_layers
    for rank in range(WORLD):
        reports = tp2[rank][name]["reports"]
        assert [(r.num_sites, r.num_rewritten) for r in reports] == [(layers, layers)] * 2
        assert {s.replacement for r in reports for s in r.sites} == {"pagedfuse.paged_attention"}


def test_an_unsupported_rank_local_shape_is_reported_on_each_rank(tp2):
    for rank in range(WORLD):
        reports = tp2[rank]["head_dim16"]["reports"]
        sites = [s for r in reports for s in r.sites]
        assert len(sites) == 2 * CASES["head_dim16"].num_layers
        assert all(not s.rewritten and s.first_failure.name == "head_dim" for s in sites)
        assert "head_dim 16 not in" in sites[0].first_failure.reason


@pytest.mark.parametrize("name", CASES)
def test_each_rank_caches_exactly_its_kv_heads(tp2, name):
    """Each rank's pages hold its KV heads only, and their rows equal the unsharded cache's
    rows of those heads (both ranks the same row where the head is replicated)."""
    config = CASES[name]
    for rank in range(WORLD):
        run = tp2[rank][name]
        shard = head_shard(config.num_q_heads, config.num_kv_heads, WORLD, rank)
        assert run["cache_shape"][2] == len(shard.kv_heads)
        want = run["full_kv"][:, shard.kv_heads.start:shard.kv_heads.stop]
        torch.testing.assert_close(run["kv"], want, rtol=1e-5, atol=1e-5)


# -- pagedfuse demo --tp ----------------------------------------------------------------------

def _demo_worker(rank: int, out: Path) -> None:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli.main(["demo", "--tp", str(WORLD), "--preset", "tinyllama", "--steps", "2",
                         "--batch", "2", "--prompt-len", "12", "--inner", "eager"])
    torch.save(dict(code=code, out=stdout.getvalue()), out / f"rank{rank}.pt")


def test_demo_tp_prints_one_summary_of_every_rank(tmp_path):
    """What torchrun --nproc-per-node 2 --no-python pagedfuse demo --tp 2 runs on each rank."""
    _spawn(_demo_worker, tmp_path)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert [run["code"] for run in runs] == [0] * WORLD
    assert runs[1]["out"] == ""  # one summary, on rank 0
    lines = runs[0]["out"].splitlines()
    assert lines[0].startswith("pagedfuse demo --tp 2: tinyllama kv=fp32 rope nhd")
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    sites = 2 * PRESETS["tinyllama"].num_layers  # prefill and decode graphs
    assert rows["tp=1"][1:4] == ["0-31", "0-3", f"{sites}/{sites}"]
    assert rows["0"][1:4] == ["0-15", "0-1", f"{sites}/{sites}"]
    assert rows["1"][1:4] == ["16-31", "2-3", f"{sites}/{sites}"]
    assert all(row[5] == "100%" and row[-1] == "PASS" for row in (rows["0"], rows["1"]))
    assert lines[5].startswith("3/3 passed")


@pytest.mark.parametrize("argv, message", [
    (["--all"], "--tp: shards one random preset"),
    (["--model", "smollm2"], "--tp: shards one random preset"),
    (["--tp", "0"], "--tp: must be >= 1"),
])
def test_demo_tp_refuses_what_it_cannot_shard(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--tp", "2", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_tp_outside_torchrun_says_how_to_launch(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["demo", "--tp", "2"]) == 2
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set; launch with torchrun" in \
        capsys.readouterr().err


# -- transformers' own tensor parallelism -----------------------------------------------------

def _hf_worker(rank: int, out: Path, model_dir: Path) -> None:
    """transformers sets up the process group itself from torchrun's variables."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_hf_continuous_batching as hf_cb
    from transformers import AutoModelForCausalLM
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    caches, init = [], hf_cb.zeroing(PagedAttentionCache.__init__)

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(self)

    PagedAttentionCache.__init__ = recording_init
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto",
                                                 attn_implementation="sdpa",
                                                 dtype=torch.float32).eval()
    pagedfuse.clear_reports()
    tokens = hf_cb.generate_batch(model, pagedfuse.backend(inner="eager"))
    torch.save(dict(tokens=tokens, reports=pagedfuse.reports(),
                    cache_shape=tuple(caches[-1].key_cache[0].shape)), out / f"rank{rank}.pt")


def test_transformers_tp_plan_auto_with_continuous_batching(tmp_path):
    """A random Llama (8 query, 2 KV heads) saved, loaded on two ranks with tp_plan="auto":
    every compiled site of both ranks rewritten over a one-KV-head cache, and the tokens of
    the unsharded model's per-prompt generate. (transformers 5.12 refuses fewer KV heads
    than ranks in continuous batching: docs/tensor-parallel.md.)"""
    hf_cb = pytest.importorskip("test_hf_continuous_batching")
    model = hf_cb.build_model("llama", "cpu")
    model.save_pretrained(tmp_path / "model")
    expected = hf_cb.generate_one_by_one(model)
    _spawn(_hf_worker, tmp_path, tmp_path / "model")
    for rank in range(WORLD):
        run = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert run["tokens"] == expected
        assert run["cache_shape"][1:] == (1, hf_cb.SMALL["head_dim"])  # [slots, Hkv, D]
        reports = run["reports"]
        assert reports and all(r.num_sites == hf_cb.NUM_LAYERS == r.num_rewritten
                               for r in reports)
